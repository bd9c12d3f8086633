"""Multi-turn rollouts: the agent plays environments, batched across every live episode, token-in/token-out.

`play` is the loop; `trainer_rollouts` plays it for `AgentGRPOTrainer` (whose TRL `rollout_func` hook returns
`to_trl` of those rollouts), and `evaluate` runs it on held-out tasks outside training (`play_tasks` keeps the
episodes, for `python -m agent_trl.evaluate`). One turn of the loop:

1. the contexts of all live episodes (`prompt_ids + completion_ids`, plain token concatenation, never re-tokenised)
   are left-padded and generated in ONE batched call, capped at `max_turn_tokens` new tokens; the HF backend keeps
   the KV cache from the previous turn, so only the new ids are prefilled (`_PrefixCache`), and samples with its own
   decode loop over the model's forward (`sample_tokens`) where the model's cache allows;
2. each row is cut at its first end-of-turn id (kept, so stopping receives gradient); the sampled ids and their
   sampling log-probs are appended with `env_mask` 1 and `turn_index` k;
3. each environment steps on the decoded turn (on up to 8 worker threads, with a timeout; an exception becomes an
   error observation, a hang ends the episode);
4. the observation is rendered by the chat template as the next message plus the next generation prompt, and its ids
   are appended with `env_mask` 0, log-prob 0 and `turn_index` -1. A turn cut by its token cap is closed by an
   end-of-turn id in front of the observation (an environment token), so the stored sequence stays well formed.

An episode ends when the environment says `done` (terminated), or when it runs out of turns or of completion tokens
(`truncated`: a budget cut, a failed episode unless the environment declares that its episodes continue past a cut,
conventions.md C4). The outcome reward is the sum of the per-turn
rewards.

Returned per rollout (the data contract of DESIGN.md): `prompt_ids`, `completion_ids`, `logprobs`, `env_mask`,
`turn_index`, `turn_rewards` (K), `state_keys` (K, the state before each turn: `envs.base.state_key_of`),
`prompt_messages` and `prompt_tools` (what `prompt_ids` was rendered from), `transcript` (per turn: action, invalid,
observation, reward), `env_reward`, `success`, `truncated`, `continues` (truncated in an environment that declares
`continues_past_cut`), `final_info`.

MoE routing replay (R3, `docs/methods/routing-replay.md`): a generation backend may also return, per context, the route
record of that call (`hf_generate(..., record_routes=True)`); `play` then keeps one record per rollout, stitched over
turns by the first-computation rule (D5), of N_b - 1 rows for its N_b = prompt + completion tokens (`Rollout.routes`).
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from envs.base import Env, row_task, state_key_of
from trainers.trl_api import (
    cpu_fast_paths,
    growing_cache,
    per_position_cache,
    unwrap_model_for_generation,
    weights_sharded,
)

logger = logging.getLogger(__name__)

# A generation backend: (contexts, max_new_tokens) -> one (sampled ids, sampling log-probs) pair per context, or one
# (sampled ids, sampling log-probs, routes) triple when it records MoE routes: routes (len(context) + len(ids) - 1,
# L, k) int16, the top-k expert ids of every position the call fed to the model (routing-replay.md Eq. 2).
GenerateFn = Callable[[list[list[int]], int], list[tuple]]


@dataclass
class LoopSettings:
    """Budgets of one episode. `max_turns=None` uses each environment's own `max_turns`."""

    max_turn_tokens: int = 32
    max_completion_length: int = 256
    max_turns: int | None = None
    env_timeout: float = 30.0


@dataclass
class Rollout:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    sampled_ids: list[int] = field(default_factory=list)  # every id the sampler emitted, in order (TITO audit)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    turn_index: list[int] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    state_keys: list[str | None] = field(default_factory=list)  # None: the environment's state_key raised
    prompt_messages: list[dict] = field(default_factory=list)  # the messages `prompt_ids` was rendered from
    prompt_tools: list[dict] | None = None  # the tool schemas rendered with them (the teacher pass re-renders both)
    transcript: list[dict] = field(default_factory=list)
    done: bool = False
    truncated: bool = False
    continues: bool = False  # truncated, in an environment whose episodes go on past a cut (conventions.md C4)
    success: bool = False
    env_errors: int = 0  # environment exceptions and timeouts, turned into observations
    final_info: dict = field(default_factory=dict)
    routes: torch.Tensor | None = None  # (N_b - 1, L, k) int16 route record, N_b = prompt + completion tokens (R3)
    route_mismatch: int = 0  # (position, layer) pairs a later prefill routed differently (routing-replay.md Eq. 11)
    route_compared: int = 0  # (position, layer) pairs re-prefilled and compared

    @property
    def env_reward(self) -> float:
        return float(sum(self.turn_rewards))


def render_prompt_ids(tokenizer, messages: list[dict] | str, tools: list[dict] | None = None) -> list[int]:
    """Chat-templated prompt ids ending with the generation prompt; a plain string is one user message."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def with_system(prompt: list[dict] | str, system: str | None) -> list[dict] | str:
    """`prompt` (a text, or chat messages) with `system` as its system message: a text becomes a chat of system and
    user; a chat's own system message is replaced. Unchanged when `system` is None.

    >>> with_system("2 + 2?", "Reply with the number.")
    [{'role': 'system', 'content': 'Reply with the number.'}, {'role': 'user', 'content': '2 + 2?'}]
    >>> with_system([{"role": "system", "content": "old"}, {"role": "user", "content": "hi"}], "new")[0]["content"]
    'new'
    """
    if system is None:
        return prompt
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return [{"role": "system", "content": system}] + [m for m in messages if m.get("role") != "system"]


def observation_text(tokenizer, observation: str, role: str = "user") -> str:
    """What the chat template puts between the end-of-turn of an assistant turn and the next generation prompt's end.

    Rendered from the tokenizer's own template, so any Qwen/ChatML-style template works unchanged.
    """
    sentinel = "\x02ACTION\x02"
    eos = tokenizer.eos_token
    messages = [{"role": "user", "content": "\x01"}, {"role": "assistant", "content": sentinel}]
    messages.append({"role": role, "content": observation})
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    anchor = full.find(sentinel + eos)
    if anchor < 0:
        raise ValueError(f"chat template does not end assistant turns with the eos token {eos!r}")
    return full[anchor + len(sentinel) + len(eos) :]


class EnvironmentFailure(RuntimeError):
    """An environment's `reset` raised: the episode cannot start. The message names the class and the task."""


def reset_all(envs: Sequence[Env], tasks: Sequence[dict]) -> list:
    """Each environment's first observation (`env.reset(task)`), in order. One function, like `step_all`, so that the
    environment's own work is timed as such (bench/profile_step.py). A `reset` that raises stops the batch with an
    `EnvironmentFailure` naming the environment and the task (a step that raises only ends its episode)."""
    firsts = []
    for env, task in zip(envs, tasks, strict=True):
        try:
            firsts.append(env.reset(task))
        except Exception as e:
            shown = json.dumps(task, default=str)[:200]
            raise EnvironmentFailure(
                f"environment {type(env).__name__}.reset raised {type(e).__name__}: {e} (task {shown})"
            ) from e
    return firsts


def step_all(
    envs: Sequence[Env], actions: Sequence[str], timeout: float, workers: int = 8
) -> list[tuple[str, float, bool, dict]]:
    """Step every environment on its action, `workers` daemon threads pulling from one queue. An exception becomes an
    error observation; a step still running after `timeout` seconds ends its episode (its thread is abandoned, never
    joined; the other threads go on with the queue, so one hang does not stall the rest)."""
    results: list = [None] * len(envs)
    jobs: queue.SimpleQueue = queue.SimpleQueue()
    for j in range(len(envs)):
        jobs.put(j)

    def work() -> None:
        while True:
            try:
                j = jobs.get_nowait()
            except queue.Empty:
                return
            try:
                results[j] = envs[j].step(actions[j])
            except Exception as e:  # an environment bug must not crash training
                results[j] = (f"error: {type(e).__name__}: {e}", 0.0, False, {"env_error": True})

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(workers, len(envs)))]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    if stuck := [t for t in threads if t.is_alive()]:
        ABANDONED.update(stuck)
        running = [t for t in ABANDONED if t.is_alive()]
        ABANDONED.intersection_update(running)
        logger.warning(
            "%d environment step(s) ran past env_timeout (%gs) and were cut; %d abandoned step thread(s) of this "
            "process are still running, holding CPU and memory until they return (a step that never returns is a "
            "bug in the environment)",
            len(stuck),
            timeout,
            len(running),
        )
    expired = (f"error: environment step timed out after {timeout:g}s", 0.0, True, {"env_timeout": True})
    return [r if r is not None else expired for r in results]


#: step threads `step_all` gave up on that may still run: counted in its warning
ABANDONED: set[threading.Thread] = set()


def play(
    generate: GenerateFn,
    tokenizer,
    envs: Sequence[Env],
    tasks: Sequence[dict],
    prompts: Sequence[list[dict] | str] | None = None,
    settings: LoopSettings | None = None,
    num_live_global: Callable[[int], int] | None = None,
    progress: bool = False,
) -> list[Rollout]:
    """Play one episode per (env, task) with batched generation; returns one `Rollout` per episode, in order.

    `prompts` (optional) are the dataset prompts; the first observation from `env.reset` replaces the content of their
    last user message (so a TRL-style `reset` that appends text works as in TRL). A `reset` that returns a list of
    chat messages (a conversation ending with the environment's turn, e.g. X-Tree's replayed prefix) gives the whole
    prompt: those past turns are never part of the completion, so they are never trained on. `num_live_global` maps
    this process's live-episode count to the count over all processes, so every process makes the same number of
    generate calls (needed under ZeRO-3/FSDP, where each generate call is a collective); a process with nothing left
    generates on a one-token dummy context and discards it.
    """
    settings = settings or LoopSettings()
    eos_id = tokenizer.eos_token_id
    rollouts, turns, last_obs = [], [], []  # last_obs: the observation before each env's next turn (state keys)
    prompt_ids: dict[str, list[int]] = {}  # a group's G episodes share their prompt: rendered once per call
    for i, (env, first) in enumerate(zip(envs, reset_all(envs, tasks), strict=True)):
        if isinstance(first, list):  # a conversation so far (e.g. a replayed prefix): it is the whole prompt
            messages, first = copy.deepcopy(first), first[-1]["content"]
        else:
            messages = copy.deepcopy(prompts[i]) if prompts is not None else [{"role": "user", "content": first}]
            if isinstance(messages, str):
                messages = [{"role": "user", "content": messages}]
            user = [m for m in messages if m["role"] == "user"]
            if user:
                user[-1]["content"] = first
            else:
                messages.append({"role": "user", "content": first})
        try:
            key = json.dumps([messages, env.tools], sort_keys=True)
        except TypeError:  # content that is not plain text (e.g. images): rendered every time
            key = None
        ids = prompt_ids.get(key) if key is not None else None
        if ids is None:
            ids = render_prompt_ids(tokenizer, messages, env.tools)
            if key is not None:
                prompt_ids[key] = ids
        rollouts.append(
            Rollout(
                prompt_ids=list(ids),
                prompt_messages=messages,
                prompt_tools=env.tools,
            )
        )
        last_obs.append(first)
        turns.append(settings.max_turns if settings.max_turns is not None else env.max_turns)

    rendered: dict[tuple[str, str], list[int]] = {}  # (observation, role) -> its ids, rendered once per call
    bar = tqdm(total=len(rollouts), desc="episodes", leave=False, disable=not progress)
    k = 0
    while True:
        live = [i for i, r in enumerate(rollouts) if not r.done]
        if (num_live_global(len(live)) if num_live_global else len(live)) == 0:
            break
        if not live:  # keep generate calls in step with the other processes
            generate([[eos_id]], 1)
            continue
        budgets = [settings.max_completion_length - len(rollouts[i].completion_ids) for i in live]
        for i in live:
            rollouts[i].state_keys.append(state_key_of(envs[i], last_obs[i]))
        contexts = [rollouts[i].prompt_ids + rollouts[i].completion_ids for i in live]
        outputs = generate(contexts, min(settings.max_turn_tokens, max(budgets)))
        steps = []
        for i, context, budget, (ids, logps, *routes) in zip(live, contexts, budgets, outputs, strict=True):
            if eos_id in ids:
                cut = ids.index(eos_id) + 1
                ids, logps = ids[:cut], logps[:cut]
            ids, logps = ids[: min(budget, settings.max_turn_tokens)], logps[: min(budget, settings.max_turn_tokens)]
            r = rollouts[i]
            if routes:  # keep the positions fed to the model: context + kept tokens except the last (never fed)
                _add_turn_routes(r, routes[0][: len(context) + len(ids) - 1])
            r.completion_ids += ids
            r.sampled_ids += ids
            r.logprobs += [float(x) for x in logps]
            r.env_mask += [1] * len(ids)
            r.turn_index += [k] * len(ids)
            closed = bool(ids) and ids[-1] == eos_id
            action = tokenizer.decode(ids[:-1] if closed else ids, skip_special_tokens=False)
            steps.append((i, action, closed))
        results = step_all([envs[i] for i, _, _ in steps], [a for _, a, _ in steps], settings.env_timeout)
        going_on = []  # (episode, observation key, whether its turn closed) of the episodes that take another turn
        for (i, action, closed), (observation, reward, done, info) in zip(steps, results, strict=True):
            r = rollouts[i]
            r.turn_rewards.append(float(reward))
            r.env_errors += int(bool(info.get("env_error") or info.get("env_timeout")))
            r.final_info = dict(info)
            r.success = bool(info.get("success", False))
            invalid = bool(info.get("invalid", False))  # the environment rejected the action (TASPO's executed turns)
            r.transcript.append(
                {"action": action, "observation": observation, "reward": float(reward), "invalid": invalid}
            )
            last_obs[i] = observation
            out_of_tokens = len(r.completion_ids) >= settings.max_completion_length
            if done or k + 1 >= turns[i] or out_of_tokens:
                r.done, r.truncated = True, not done
                r.continues = r.truncated and envs[i].continues_past_cut
                bar.update(1)
                continue
            going_on.append((i, (observation, envs[i].observation_role), closed))
        new = [key for key in dict.fromkeys(key for _, key, _ in going_on) if key not in rendered]
        if new:  # a group's episodes often see the same observation: each is rendered once, all in one tokenizer call
            texts = [observation_text(tokenizer, observation, role) for observation, role in new]
            rendered.update(zip(new, tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True))
        for i, key, closed in going_on:
            r = rollouts[i]
            obs_ids = list(rendered[key])
            if not closed:
                obs_ids = [eos_id] + obs_ids
            if len(r.completion_ids) + len(obs_ids) >= settings.max_completion_length:
                r.done, r.truncated = True, True  # no room for the observation and another turn
                r.continues = envs[i].continues_past_cut
                bar.update(1)
                continue
            r.completion_ids += obs_ids
            r.logprobs += [0.0] * len(obs_ids)
            r.env_mask += [0] * len(obs_ids)
            r.turn_index += [-1] * len(obs_ids)
        k += 1
    bar.close()
    return rollouts


def _add_turn_routes(rollout: Rollout, routes: torch.Tensor) -> None:
    """Stitch one call's record (n_new, L, k) onto the rollout's record by the first-computation rule (D5)."""
    from trainers.routing_replay import prefix_recompute_mismatch, stitch_turn_routes

    if rollout.routes is None:
        rollout.routes = routes
        return
    mismatch = prefix_recompute_mismatch(rollout.routes, routes)  # (n_prev, L), routing-replay.md Eq. 11
    rollout.route_mismatch += int(mismatch.sum())
    rollout.route_compared += mismatch.numel()
    rollout.routes = stitch_turn_routes(rollout.routes, routes)  # (n_new, L, k), D5


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


def to_trl(rollouts: list[Rollout]) -> dict[str, list]:
    """A TRL `rollout_func` return value: TRL's required keys, `env_mask`, and the contract's extra fields."""
    return {
        "prompt_ids": [r.prompt_ids for r in rollouts],
        "completion_ids": [r.completion_ids for r in rollouts],
        "logprobs": [r.logprobs for r in rollouts],
        "env_mask": [r.env_mask for r in rollouts],
        "sampled_ids": [r.sampled_ids for r in rollouts],
        "turn_index": [r.turn_index for r in rollouts],
        "turn_rewards": [r.turn_rewards for r in rollouts],
        "state_keys": [r.state_keys for r in rollouts],
        "prompt_messages": [r.prompt_messages for r in rollouts],
        "prompt_tools": [r.prompt_tools for r in rollouts],
        "transcript": [r.transcript for r in rollouts],
        "env_reward": [r.env_reward for r in rollouts],
        "success": [r.success for r in rollouts],
        "truncated": [r.truncated for r in rollouts],
        "continues": [r.continues for r in rollouts],
        "env_errors": [r.env_errors for r in rollouts],
        "final_info": [r.final_info for r in rollouts],
    }


def trainer_rollouts(prompts: list, trainer, rows: list[dict]) -> list[Rollout]:
    """The rollouts of one generation batch of `trainer` (an `AgentGRPOTrainer`), as `Rollout` objects (their
    `routes` stay here, out of TRL's rows). The task of each prompt comes from `rows`, the batch's dataset rows in the
    order of `prompts` (already repeated G times): the trainer's generation step holds them.

    Every process makes the same number of generate calls (`trainer.num_live_global`); with
    `trainer.replay_routing` the HF backend records MoE routes (routing-replay.md D1).
    """
    if len(rows) != len(prompts):
        raise RuntimeError(f"trainer_rollouts got {len(prompts)} prompts but {len(rows)} rows")
    envs = [trainer.env_factory(row) for row in rows]
    # a `task` column (JSON or dict) holds the task; without one the row itself is the task, as TRL's reset(**row)
    tasks = [row_task(row) for row in rows]
    settings = trainer.loop_settings
    sync = trainer.num_live_global
    if trainer.use_vllm:  # routes cannot come from TRL's vLLM client; the trainer refuses replay with vLLM at init
        return play(vllm_generate(trainer), trainer.processing_class, envs, tasks, prompts, settings, sync)
    with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
        generate = hf_generate(
            model,
            trainer.processing_class,
            temperature=trainer.temperature,
            top_p=trainer.top_p,
            top_k=trainer.top_k,
            min_p=trainer.min_p,
            repetition_penalty=trainer.repetition_penalty,
            eos_token_ids=trainer.eos_token_ids,
            record_routes=trainer.replay_routing,
            reuse_cache=trainer.args.reuse_kv_cache,
        )
        return play(generate, trainer.processing_class, envs, tasks, prompts, settings, sync)


@cpu_fast_paths()  # the trainer's CPU switches (docs/methods/grpo.md D12, D14), as in training
def play_tasks(
    model,
    tokenizer,
    env_cls: type[Env] | Callable[[], Env],
    tasks: list[dict],
    settings: LoopSettings | None = None,
    temperature: float = 1.0,
    greedy: bool = False,
    batch_size: int = 64,
    samples: int = 1,
    progress: bool = True,
    system_prompt: str | None = None,
) -> list[Rollout]:
    """`samples` episodes of each task, `batch_size` at a time, in eval mode (the model's mode is restored after).
    Task-major: episode s of task i is rollout i * samples + s. `system_prompt`: a system message before each first
    observation (`with_system`), as training's rows have it."""
    was_training = model.training
    model.eval()
    generate = hf_generate(model, tokenizer, temperature=temperature, do_sample=not greedy)
    jobs = [t for t in tasks for _ in range(samples)]
    rollouts: list[Rollout] = []
    bar = tqdm(total=len(jobs), desc="greedy eval" if greedy else "sampled eval", disable=not progress, leave=False)
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        prompts = None if system_prompt is None else [with_system([], system_prompt) for _ in chunk]
        rollouts += play(generate, tokenizer, [env_cls() for _ in chunk], chunk, prompts, settings=settings)
        bar.update(len(chunk))
    bar.close()
    model.train(was_training)
    return rollouts


def evaluation_metrics(rollouts: list[Rollout], tasks: list[dict], samples: int) -> dict[str, float]:
    """What `evaluate` reports of `play_tasks`' rollouts: success, reward, pass^samples (tasks solved in every one of
    their episodes), turns, and success per environment for a mixed pool."""
    successes = torch.tensor([r.success for r in rollouts], dtype=torch.float64).view(len(tasks), samples)
    rewards = torch.tensor([r.env_reward for r in rollouts], dtype=torch.float64)
    out = {
        "success": successes.mean().item(),
        "reward": rewards.mean().item(),
        f"pass^{samples}": successes.min(dim=1).values.mean().item(),
        "turns": sum(len(r.turn_rewards) for r in rollouts) / len(rollouts),
    }
    if samples > 1:  # tasks solved in at least one of their episodes
        out[f"pass@{samples}"] = successes.max(dim=1).values.mean().item()
    envs = [str(t.get("env")) for t in tasks] if all(isinstance(t, dict) and t.get("env") for t in tasks) else []
    if len(set(envs)) > 1:  # a mixed pool: success per environment too
        out["by_env"] = {
            name: successes[[i for i, e in enumerate(envs) if e == name]].mean().item() for name in sorted(set(envs))
        }
    return out


def evaluate(
    model,
    tokenizer,
    env_cls: type[Env] | Callable[[], Env],
    tasks: list[dict],
    settings: LoopSettings | None = None,
    temperature: float = 1.0,
    greedy: bool = False,
    batch_size: int = 64,
    samples: int = 1,
    progress: bool = True,
    system_prompt: str | None = None,
) -> dict[str, float]:
    """Held-out success and reward: `samples` episodes per task (pass^k counts tasks solved in all of them); the
    episodes themselves: `play_tasks`, the numbers: `evaluation_metrics`."""
    kw = dict(temperature=temperature, greedy=greedy, batch_size=batch_size, samples=samples, progress=progress)
    kw["system_prompt"] = system_prompt
    return evaluation_metrics(play_tasks(model, tokenizer, env_cls, tasks, settings, **kw), tasks, samples)


def prompt_ids_like_trl(tokenizer, prompts: list) -> list[list[int]]:
    """Prompt ids as TRL's GRPOTrainer makes them: the chat template with the generation prompt for conversational
    prompts (message lists), the plain tokenizer for text prompts."""
    if isinstance(prompts[0], list):
        out = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True)
        return [list(ids) for ids in out["input_ids"]]
    return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]


@cpu_fast_paths()  # the trainer's CPU switches (docs/methods/grpo.md D12, D14), as in training
def score_prompts(
    model,
    tokenizer,
    rows: list[dict],
    reward_funcs: Sequence[Callable],
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    batch_size: int = 64,
    samples: int = 1,
    progress: bool = True,
) -> tuple[list[str], torch.Tensor]:
    """`samples` completions of each row (prompts rendered as TRL renders them; row-major: completion s of row i is
    i * samples + s), scored by `reward_funcs` with TRL's call (`prompts`, `completions`, `completion_ids`, the other
    columns as lists). Returns (completion texts, scores (N * samples, F), NaN where a function returned None)."""
    was_training = model.training
    model.eval()
    generate = hf_generate(
        model, tokenizer, temperature=temperature, top_p=top_p, top_k=top_k, do_sample=not greedy, reuse_cache=False
    )
    jobs = [r for r in rows for _ in range(samples)]
    scores, all_texts = [], []
    bar = tqdm(total=len(jobs), desc="greedy eval" if greedy else "sampled eval", disable=not progress, leave=False)
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        prompts = [r["prompt"] for r in chunk]
        completion_ids = []
        for ids, _ in generate(prompt_ids_like_trl(tokenizer, prompts), max_new_tokens):
            completion_ids.append(ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        all_texts += texts
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts, strict=True)
        ]
        columns = {k: [r[k] for r in chunk] for k in chunk[0] if k not in ("prompt", "completion", "completion_ids")}
        noop = lambda *args, **kwargs: None  # noqa: E731  (TRL's log_extra / log_metric, not recorded here)
        per_func = [
            func(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                trainer_state=None,
                log_extra=noop,
                log_metric=noop,
                **columns,
            )
            for func in reward_funcs
        ]
        scores.append(torch.tensor([[float("nan") if v is None else float(v) for v in f] for f in per_func]).T)
        bar.update(len(chunk))
    bar.close()
    model.train(was_training)
    return all_texts, torch.cat(scores).to(torch.float64)  # (N * samples, F)


def prompt_outcomes(
    scores: torch.Tensor, weights: torch.Tensor, threshold: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion, from its scores (N, F) and the reward weights (F,): success (N,) and the weighted reward (N,),
    a None counting 0. Success: the weighted reward is at least `threshold`, or with `threshold` None every function
    returned a positive value (a None fails)."""
    reward = (scores.nan_to_num(0.0) * weights).sum(dim=1)  # (N,)
    success = (scores > 0).all(dim=1) if threshold is None else reward >= threshold
    return success, reward


def evaluate_prompts(
    model,
    tokenizer,
    rows: list[dict],
    reward_funcs: Sequence[Callable],
    reward_weights: Sequence[float] | None = None,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    batch_size: int = 64,
    progress: bool = True,
    samples: int = 1,
    success_threshold: float | None = None,
) -> dict[str, float]:
    """Held-out score of a single-turn dataset: `samples` completions per row (`score_prompts`), averaged over all.

    Returns `reward` (the `reward_weights`-weighted sum, mean over completions; a function's None counts as 0),
    `rewards/<name>` (each function's mean over the completions it scored), and `success`: the fraction of
    completions that succeed (`prompt_outcomes`: by default every function returned a positive value, for a 0/1
    exact-match reward the accuracy; with `success_threshold` the weighted reward is at least it); with `samples` > 1
    also `pass@<samples>` and `pass^<samples>` (rows solved by at least one, and by all, of their completions)."""
    weights = torch.tensor(list(reward_weights) if reward_weights else [1.0] * len(reward_funcs), dtype=torch.float64)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"{len(reward_funcs)} reward functions but {len(weights)} reward_weights")
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, batch_size=batch_size)
    kw.update(samples=samples, progress=progress)
    _, scores = score_prompts(model, tokenizer, rows, reward_funcs, max_new_tokens, **kw)  # (N * samples, F)
    return prompt_metrics(scores, weights, reward_funcs, samples, success_threshold)


def prompt_metrics(
    scores: torch.Tensor,
    weights: torch.Tensor,
    reward_funcs: Sequence[Callable],
    samples: int = 1,
    success_threshold: float | None = None,
) -> dict[str, float]:
    """What `evaluate_prompts` reports of the scores (N, F) of N completions (row-major, `samples` per row): success
    and reward (`prompt_outcomes`, mean over completions), with `samples` > 1 pass@ and pass^ over each row's
    completions, and `rewards/<name>`, each function's mean over the completions it scored."""
    success, reward = prompt_outcomes(scores, weights, success_threshold)  # (N,), (N,)
    out = {"success": success.double().mean().item(), "reward": reward.mean().item()}
    if samples > 1:
        per_row = success.double().view(-1, samples)  # (rows, samples)
        out[f"pass@{samples}"] = per_row.max(dim=1).values.mean().item()
        out[f"pass^{samples}"] = per_row.min(dim=1).values.mean().item()
    for i, func in enumerate(reward_funcs):
        column = scores[:, i]
        name = getattr(func, "__name__", f"reward_{i}")
        out[f"rewards/{name}"] = column[~column.isnan()].mean().item() if (~column.isnan()).any() else float("nan")
    return out
