"""The generation engine the agent loop samples with: a `GenerateFn` maps the contexts of the live episodes to one
turn of sampled ids each, with their sampling log-probs.

`hf_generate` is the transformers backend: it keeps each episode's KV cache from one call to the next (`_PrefixCache`),
so only the new ids of a turn are prefilled, and samples with its own decode loop over the model's forward
(`sample_tokens`, warpers from `logits_processors`) where the model's cache allows, else with `model.generate`.
`sample_after_prefixes` samples many branches of shared prefixes (X-Tree's, the Funnel's teacher). `vllm_generate`
wraps TRL's vLLM client. `left_padded` pads contexts for a batched forward.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable

import torch

from trainers.trl_api import growing_cache, per_position_cache, weights_sharded

# A generation backend: (contexts, max_new_tokens) -> one (sampled ids, sampling log-probs) pair per context, or one
# (sampled ids, sampling log-probs, routes) triple when it records MoE routes: routes (len(context) + len(ids) - 1,
# L, k) int16, the top-k expert ids of every position the call fed to the model (routing-replay.md Eq. 2).
GenerateFn = Callable[[list[list[int]], int], list[tuple]]


def hf_generate(
    model,
    tokenizer,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    do_sample: bool = True,
    eos_token_ids: list[int] | None = None,
    record_routes: bool = False,
    reuse_cache: bool = True,
) -> GenerateFn:
    """A `GenerateFn` over a transformers model; log-probs are those of the processed (sampling) distribution.

    Decoder-only models whose cache is a plain per-position cache (full attention, the common case) are sampled by
    `sample_tokens`, a decode loop over the model's forward with transformers' own logits processors; any other model
    (sliding-window or linear-attention layers), a model sharded over processes (ZeRO-3, FSDP: `generate` keeps their
    decode steps in step) and route recording go through `model.generate`. Greedy episodes are the same either way
    (tests/test_agent_loop.py).

    With `record_routes` (an MoE model), each call records every router's top-k expert ids with forward hooks
    (`RouteRecorder`, routing-replay.md D1) and returns triples (ids, log-probs, routes), routes (len(context) +
    len(ids) - 1, L, k) int16 on the CPU: left padding and decode steps after the row's end are dropped.

    With `reuse_cache` (default; off when recording routes, whose record covers every fed position) the KV cache of
    one call is kept for the next call on the same episodes, so each turn prefills only its new ids (`_PrefixCache`).
    """
    from transformers import GenerationConfig

    if record_routes:
        from trainers.routing_replay import RouteRecorder, split_generate_routes

    eos = eos_token_ids or [tokenizer.eos_token_id]
    own_loop = not record_routes and not sharded_across_processes(model) and growing_cache(model) is not None
    processors = logits_processors(temperature, top_k, top_p, min_p, repetition_penalty, do_sample)
    prefix = _PrefixCache() if reuse_cache and not record_routes else None

    def generate(contexts: list[list[int]], max_new_tokens: int) -> list[tuple]:
        pad = tokenizer.pad_token_id
        if prefix is not None:
            ids, mask, cache = prefix.inputs(contexts, pad, model.device)
            prefix.cache = None  # a failed call must not leave a half-updated record behind
        else:
            (ids, mask), cache = left_padded(contexts, pad, model.device), None
        width = ids.shape[1]
        if own_loop:
            cache = cache if cache is not None else growing_cache(model)
            sequences, logps = sample_tokens(model, ids, mask, cache, max_new_tokens, processors, do_sample, eos, pad)
        else:
            config = GenerationConfig(
                do_sample=do_sample,
                temperature=temperature if do_sample else None,
                top_p=top_p if do_sample else None,
                top_k=top_k if do_sample else None,
                min_p=min_p,
                repetition_penalty=repetition_penalty,
                max_new_tokens=max_new_tokens,
                eos_token_id=eos,
                pad_token_id=pad,
                output_scores=True,
                return_dict_in_generate=True,
            )
            recorder = RouteRecorder(model) if record_routes else contextlib.nullcontext()
            with torch.no_grad(), recorder:
                extra = {"cache": cache} if cache is not None else {}
                out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config, **extra)
            sequences, cache = out.sequences, getattr(out, "cache", None)
            scores = torch.stack(out.scores, dim=1).float()  # (N, t, V)
            logps = torch.log_softmax(scores, dim=-1).gather(-1, sequences[:, width:, None]).squeeze(-1)  # (N, t)
        new = sequences[:, width:]  # (N, t)
        results, kept = [], []
        for row_ids, row_logps in zip(new.tolist(), logps.tolist(), strict=True):
            n = len(row_ids)
            for j, t in enumerate(row_ids):
                if t in eos:
                    n = j + 1
                    break
            results.append((row_ids[:n], row_logps[:n]))
            kept.append(n)
        if prefix is not None:
            prefix.store(contexts, [r[0] for r in results], mask, sequences, cache)
        if not record_routes:
            return results
        kept_mask = torch.arange(new.shape[1])[None, :] < torch.tensor(kept)[:, None]  # (N, t) tokens each row keeps
        routes = recorder.indices(len(contexts)).cpu()  # (N, width + t - 1, L, k), Eq. 2
        records = split_generate_routes(routes, mask.cpu(), kept_mask.long())  # N x (len(c) + n - 1, L, k)
        return [(ids_, logps_, record) for (ids_, logps_), record in zip(results, records, strict=True)]

    return generate


def logits_processors(
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
    do_sample: bool = True,
):
    """transformers' logits processors for these settings, in the order `generate` applies them (the repetition
    penalty, then, when sampling, temperature, top-k, top-p and min-p)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors = LogitsProcessorList()
    if repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(repetition_penalty))
    if do_sample:
        if temperature != 1.0:
            processors.append(TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            processors.append(TopPLogitsWarper(top_p))
        if min_p is not None:
            processors.append(MinPLogitsWarper(min_p))
    return processors


def sample_tokens(
    model,
    ids,
    mask,
    cache,
    max_new_tokens: int,
    processors,
    do_sample: bool,
    eos: list[int],
    pad: int,
    deadline: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `max_new_tokens` tokens per row of `ids` (N, S), left-padded with attention `mask` (N, S), of which the
    first `cache.get_seq_length()` positions are already in `cache` (a `growing_cache`, updated in place).

    Returns (sequences (N, S + t), log-probs (N, t)): the log-probs of the sampled ids under the processed
    distribution. A row that has produced an id in `eos` is continued with `pad` until every row has, or `t` reaches
    `max_new_tokens`; the cache then holds S + t - 1 positions per row (the last sampled id is never fed), as after
    `generate`. Position ids are the mask's running count, as `generate` derives them, so a cached row keeps the
    positions it was cached at. With a `deadline` (a `time.monotonic()` value) the loop also stops after the first step
    that ends past it, as `generate`'s `max_time` does: rows without an end id then stopped short of the limit.

    This is `generate`'s sampling loop reduced to what the agent loop uses (docs/methods/grpo.md D11), with two
    savings:
    - the samples come from the processed probabilities by inverting their running sum at one uniform draw per row
      (`torch.multinomial` draws an exponential variate per vocabulary entry: 1.7 ms of a 10 ms decode step of the
      tiny default, batch 64);
    - once half the rows being decoded have ended (and their end id has been fed), the others go on as a smaller
      batch (`GrowingLayer.narrow`): a turn's short actions stop costing compute while its long ones finish. The
      rows left out keep zeros in their later cache positions, which the next turn masks (`_PrefixCache`).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    n = ids.shape[0]
    positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
    fed = cache.get_seq_length()
    step_ids, step_positions = ids[:, fed:], positions[:, fed:]
    eos_ids = torch.tensor(eos, device=ids.device)
    finished = torch.zeros(n, dtype=torch.bool, device=ids.device)
    rows = torch.arange(n, device=ids.device)  # the rows being decoded, in the order of the cache's batch
    capacity = ids.shape[1] + max_new_tokens
    logps, sequences = [], ids
    with torch.no_grad():
        for t in range(max_new_tokens):
            logits = model(
                input_ids=step_ids,
                attention_mask=mask,
                position_ids=step_positions,
                cache=cache,
                use_cache=True,
                logits_to_keep=1,
            ).logits[:, -1]
            history = sequences if len(rows) == n else sequences[rows]  # what a repetition penalty reads
            logp = torch.log_softmax(processors(history, logits.float()), dim=-1)  # (rows, V)
            if do_sample:
                running = logp.exp().cumsum(-1)
                draw = torch.rand(len(rows), 1, device=ids.device) * running[:, -1:]
                token = torch.searchsorted(running, draw, right=True).clamp(max=logp.shape[1] - 1)[:, 0]
            else:
                token = logp.argmax(-1)
            ended = finished[rows]  # rows whose end id was fed in this step's forward
            token = token.masked_fill(ended, pad)
            row_tokens = torch.full((n,), pad, dtype=token.dtype, device=ids.device).index_copy(0, rows, token)
            row_logps = torch.zeros(n, device=ids.device).index_copy(0, rows, logp.gather(-1, token[:, None])[:, 0])
            logps.append(row_logps)
            finished |= torch.isin(row_tokens, eos_ids)
            sequences = torch.cat([sequences, row_tokens[:, None]], 1)
            if bool(finished.all()) or t + 1 == max_new_tokens:
                break
            if deadline is not None and time.monotonic() >= deadline:
                break
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
            step_ids, step_positions = token[:, None], step_positions[:, -1:] + 1
            if int(ended.sum()) * 2 >= len(rows):
                keep = (~ended).nonzero()[:, 0]
                for layer in cache.layers:
                    layer.narrow(rows, keep, n, capacity)
                rows, mask, step_ids, step_positions = rows[keep], mask[keep], step_ids[keep], step_positions[keep]
    for layer in cache.layers:
        layer.widen(rows)
    return sequences, torch.stack(logps, 1)


def shared_prefixes(contexts: list[list[int]]) -> tuple[list[list[int]], list[tuple[int, int]]]:
    """`contexts` as branches (r, p) of fewer sequences, each context being `sequences[r][:p]`: a context that extends
    the sequence before it, or is a prefix of it, joins that sequence (the turns of one episode, in order, are one
    sequence); any other starts a new one.

    >>> shared_prefixes([[1, 2], [1, 2, 3, 4], [1, 2, 3], [5]])
    ([[1, 2, 3, 4], [5]], [(0, 2), (0, 4), (0, 3), (1, 1)])
    """
    sequences: list[list[int]] = []
    branches = []
    for c in contexts:
        if sequences:
            last = sequences[-1]
            if c[: len(last)] == last:
                sequences[-1] = list(c)
                branches.append((len(sequences) - 1, len(c)))
                continue
            if last[: len(c)] == list(c):
                branches.append((len(sequences) - 1, len(c)))
                continue
        sequences.append(list(c))
        branches.append((len(sequences) - 1, len(c)))
    return sequences, branches


def sample_after_prefixes(
    model,
    sequences: list[list[int]],
    branches: list[tuple[int, int]],
    max_new_tokens: int,
    processors,
    do_sample: bool,
    eos: list[int],
    pad: int,
    rows_per_call: int = 64,
    deadline: float | None = None,
) -> list[tuple[list[int], list[float]]]:
    """For every branch (r, p), up to `max_new_tokens` ids sampled after the context `sequences[r][:p]` (cut after the
    first id in `eos`) and their log-probs under the processed distribution, as `sample_tokens` draws them after that
    context alone. `model` must take a `growing_cache`.

    The branches go `rows_per_call` at a time. Each call prefills its sequences once, up to the longest context its
    branches need, then repeats each sequence's cache rows for its branches: a branch masks the cached positions from
    its last context id on and feeds that id again, at its own position, so the cost of the contexts' common part is
    paid once per call instead of once per branch (the teacher's turns of one episode, trainers/alignopsd.py). Past
    `deadline` (a `time.monotonic()` value) a call stops after its current step and later calls do not start; their
    branches get empty lists.
    """
    for r, p in branches:
        if p < 1 or p > len(sequences[r]):
            raise ValueError(f"branch ({r}, {p}) is outside sequence {r} (length {len(sequences[r])})")
    device = model.device
    results: list[tuple[list[int], list[float]]] = [([], []) for _ in branches]
    for s in range(0, len(branches), rows_per_call):
        if deadline is not None and time.monotonic() >= deadline:
            break
        chunk = branches[s : s + rows_per_call]
        seqs = sorted({r for r, _ in chunk})
        local = {r: i for i, r in enumerate(seqs)}
        # each sequence up to its longest context in the chunk, but that context's last id
        prefixes = [sequences[r][: max(p for q, p in chunk if q == r) - 1] for r in seqs]
        cache = growing_cache(model)
        width = max(len(x) for x in prefixes)
        rows = torch.tensor([local[r] for r, _ in chunk], device=device)  # each branch's sequence row
        if width:
            ids, mask = left_padded(prefixes, pad, device)
            positions = (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
            with torch.no_grad():
                model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
                      logits_to_keep=1)  # fmt: skip
            cache.batch_select_indices(rows)
        else:
            ids = mask = torch.zeros((len(seqs), 0), dtype=torch.long, device=device)
        branch_mask = mask[rows].clone()
        for j, (r, p) in enumerate(chunk):
            branch_mask[j, width - len(prefixes[local[r]]) + p - 1 :] = 0  # from the context's last id on
        last = torch.tensor([[sequences[r][p - 1]] for r, p in chunk], device=device)
        # the ids past a branch's context become pad, as left padding is: a repetition penalty reads only the context
        branch_ids = torch.cat([ids[rows].masked_fill(branch_mask == 0, pad), last], 1)
        branch_mask = torch.cat([branch_mask, torch.ones_like(last)], 1)
        out, logps = sample_tokens(
            model, branch_ids, branch_mask, cache, max_new_tokens, processors, do_sample, eos, pad, deadline
        )
        for j, (row_ids, row_logps) in enumerate(zip(out[:, width + 1 :].tolist(), logps.tolist(), strict=True)):
            n = next((k + 1 for k, t in enumerate(row_ids) if t in eos), len(row_ids))
            results[s + j] = (row_ids[:n], row_logps[:n])
    return results


def sharded_across_processes(model) -> bool:
    """Whether `model`'s weights are sharded over several processes (DeepSpeed ZeRO-3 or FSDP), so that every forward
    is a collective: `generate` then keeps the processes' decode steps in step (`synced_gpus`), and the agent loop
    leaves sampling to it. The test is the one `generate` makes."""
    several = torch.distributed.is_available() and torch.distributed.is_initialized()
    several = several and torch.distributed.get_world_size() > 1
    return several and weights_sharded(model)


class _PrefixCache:
    """The KV cache of one generate call, kept for the next call on the same episodes (one per `hf_generate`).

    Turn k+1's context of an episode is turn k's context, the ids kept from its sampled turn and the observation ids,
    so the next call only prefills the new part. Rows keep their padded layout: [cached positions | left-padded new
    ids], with the attention mask 0 on every pad and on sampled ids the episode did not keep. Transformers derives
    position ids from the mask's cumulative sum, so each kept token keeps the position it had when its keys were
    cached, and the result equals a fresh prefill up to float rounding (tests/test_agent_loop.py checks the sampling
    log-probs against a plain forward pass, and greedy episodes against generation without reuse).

    Reuse needs every new context to extend a context of the last call, in the same order (`play` drops finished
    episodes and keeps the order); anything else (a new batch, the one-token dummy of a process with no live episode)
    is a plain full prefill that starts a new record.
    """

    def __init__(self):
        self.contexts: list[list[int]] = []  # the last call's contexts, unpadded
        self.generated: list[list[int]] = []  # the ids it returned per row (cut after the end-of-turn id)
        self.sequences = self.mask = self.cache = None  # (N, S) ids and mask; the cache holds the first S - 1
        self.sequences_new = 0  # S minus the call's input width: the sampled positions
        self.cache_device = None

    def inputs(self, contexts: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor, object]:
        """(input_ids, attention_mask, cache or None) of a generate call on `contexts`."""
        matched = self._match(contexts)
        if matched is None:
            return *left_padded([list(c) for c in contexts], pad, device), None
        rows, kept = zip(*matched, strict=True)
        width = self.sequences.shape[1]
        start = width - self.sequences_new  # first sampled position of the last call
        if rows != tuple(range(len(self.contexts))):  # some episodes ended: keep the cache rows of the others
            self.cache.batch_select_indices(torch.tensor(rows, device=self.cache_device))
        base_mask = self.mask[list(rows), : width - 1].clone()
        for j, n in enumerate(kept):
            base_mask[j, start + n :] = 0  # sampled ids the episode did not keep, or that are fed again below
        tails = [c[len(self.contexts[row]) + n :] for c, row, n in zip(contexts, rows, kept, strict=True)]
        tail_ids, tail_mask = left_padded(tails, pad, device)
        ids = torch.cat([self.sequences[list(rows), : width - 1], tail_ids], 1)
        return ids, torch.cat([base_mask, tail_mask], 1), self.cache

    def _match(self, contexts: list[list[int]]) -> list[tuple[int, int]] | None:
        """Per context, (row of the last call it extends, how many of that row's cached sampled ids it keeps)."""
        if self.cache is None:
            return None
        cached_new = self.sequences_new - 1  # sampled ids whose keys are in the cache
        matched, row = [], 0
        for c in contexts:
            while row < len(self.contexts):
                prev = self.contexts[row]
                if len(c) > len(prev) and c[: len(prev)] == prev:
                    break
                row += 1
            else:
                return None
            prev, gen = self.contexts[row], self.generated[row]
            n = 0
            while n < min(len(gen), cached_new, len(c) - len(prev) - 1) and c[len(prev) + n] == gen[n]:
                n += 1  # at least one new id is left to feed: its logits sample the next token
            matched.append((row, n))
            row += 1
        return matched

    def store(self, contexts, generated, input_mask, sequences, cache) -> None:
        """Keep the call's record, or drop it when the cache is not a plain per-position cache of S - 1 tokens."""
        plain = cache is not None and per_position_cache(cache)
        if not plain or cache.get_seq_length() != sequences.shape[1] - 1:
            self.cache = None  # sliding-window, linear-attention or static caches: always prefill in full
            return
        new = sequences.shape[1] - input_mask.shape[1]
        gen_mask = torch.tensor([[1] * len(g) + [0] * (new - len(g)) for g in generated], device=input_mask.device)
        self.contexts, self.generated = [list(c) for c in contexts], generated
        self.sequences, self.sequences_new = sequences, new
        self.mask = torch.cat([input_mask, gen_mask.to(input_mask.dtype)], 1)
        self.cache, self.cache_device = cache, sequences.device


def left_padded(rows: list[list[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows left-padded with `pad` to the longest, and their attention mask: (ids, mask), each (len(rows), width)."""
    width = max(len(r) for r in rows)
    flat = itertools.chain.from_iterable([pad] * (width - len(r)) + r for r in rows)  # one flat list (cheaper)
    ids = torch.tensor(list(flat), dtype=torch.long).view(len(rows), width).to(device)
    starts = torch.tensor([width - len(r) for r in rows]).unsqueeze(1)
    mask = (torch.arange(width).unsqueeze(0) >= starts).long().to(device)
    return ids, mask


def vllm_generate(trainer) -> GenerateFn:
    """A `GenerateFn` over TRL's vLLM helper (`use_vllm: true`; GPU only). Per-turn caps are applied by cutting."""

    def generate(contexts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        _, completion_ids, logprobs, _ = trainer.vllm_generation.generate(
            prompts=contexts, images=None, num_generations=1
        )
        return [
            (ids[:max_new_tokens], [lp[0] for lp in lps][:max_new_tokens])
            for ids, lps in zip(completion_ids, logprobs, strict=True)
        ]

    return generate


def sample_continuations(
    model,
    contexts: list[list[int]],
    max_new_tokens: int,
    eos: list[int],
    pad: int,
    batch_size: int,
    deadline: float,
    temperature: float = 1.0,
    top_k: int | None = 0,
    top_p: float = 1.0,
    min_p: float | None = None,
    repetition_penalty: float = 1.0,
) -> list[list[int] | None]:
    """One sampled continuation of each context (up to `max_new_tokens`, its end id kept), `batch_size` at a time,
    until `deadline` (a `time.monotonic()` value): the ids of each, or None for a context whose chunk never started.

    Contexts that extend one another (the turns of one episode) are sampled as branches of one sequence on a plain
    decoder (`shared_prefixes`, `sample_after_prefixes`): each chunk prefills an episode once and every turn branches
    from its cache. Other models (sliding-window or linear-attention layers, weights sharded over processes) go
    through `model.generate`, a context a row, each chunk capped by the time left."""
    from transformers import GenerationConfig

    generated: list[list[int] | None] = [None] * len(contexts)
    if contexts and growing_cache(model) is not None and not sharded_across_processes(model):
        sequences, branches = shared_prefixes(contexts)
        processors = logits_processors(temperature, top_k, top_p, min_p, repetition_penalty)
        out = sample_after_prefixes(
            model, sequences, branches, max_new_tokens, processors, True, eos, pad, batch_size, deadline=deadline
        )
        return [ids for ids, _ in out]
    for s in range(0, len(contexts), batch_size):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ids, mask = left_padded(contexts[s : s + batch_size], pad, model.device)
        config = GenerationConfig(
            do_sample=True,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            eos_token_id=eos,
            max_time=left,
        )
        new = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        generated[s : s + len(new)] = new[:, ids.shape[1] :].tolist()
    return generated
