"""The teacher pass (docs/methods/teacher-pass.md): the frozen pre-update policy, or the reference model, re-scores a
rollout's own completion tokens with a privileged block added to its context. Used by the methods that measure how
privileged information (hints, a sibling's context) shifts the policy's log-probs: TASPO, AlignOPSD, β-OPSD and
Experience Funnel.

* `with_privileged_block(messages, block)`: the block appended to the end of the system message, or a system
  message made for it (teacher-pass.md Eq. 1).
* `teacher_logps(trainer, batch, blocks)`: one teacher-forced forward per chunk of rows, batched, with and without
  the block, returning (B, T) log-probs aligned to the rollout's completion tokens. The completion ids are the
  rollout's ids, never re-tokenised; only the prompt changes (teacher-pass.md Eq. 2-3).

The "pre-update policy" is the model as it is when `compute_advantages` runs: the optimizer has not stepped on this
generation batch yet, so no copy of the weights is needed, with LoRA or without (teacher-pass.md D1). The reference
model is TRL's own: `trainer.ref_model` when TRL made one (β > 0), or the PEFT model with its adapter disabled
(teacher-pass.md D2).

Decision ids (`Dn`) without a page are docs/methods/teacher-pass.md's.
"""

from __future__ import annotations

import copy
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor

from trainers.agent_loop import render_prompt_ids
from trainers.generation import left_padded
from trainers.trl_api import use_adapter

SOURCES = ("policy", "reference", "initial")
POSITIONS = ("system_end", "first_user_after_task", "first_user_before_task")


def with_privileged_block(messages: list[dict] | str, block: str, position: str = "system_end") -> list[dict]:
    """The prompt messages with `block` placed at `position` (teacher-pass.md Eq. 1, D7); `messages` is not changed.

    `system_end`: appended to the end of the system message after a blank line; with no system message, one holding
    just the block is put first. `first_user_after_task` / `first_user_before_task`: after (or before) the text of the
    first user message, separated by a blank line; the conversation need not end with a user message.

    >>> with_privileged_block([{"role": "user", "content": "buy socks"}], "Hint: choose a size.")
    [{'role': 'system', 'content': 'Hint: choose a size.'}, {'role': 'user', 'content': 'buy socks'}]
    >>> with_privileged_block([{"role": "system", "content": "Be brief."}], "Hint.")[0]["content"]
    'Be brief.\\n\\nHint.'
    >>> with_privileged_block("buy socks", "Plan: buy", position="first_user_after_task")[0]["content"]
    'buy socks\\n\\nPlan: buy'
    """
    if position not in POSITIONS:
        raise ValueError(f"privileged block position must be one of {POSITIONS}, got {position!r}")
    out = [{"role": "user", "content": messages}] if isinstance(messages, str) else copy.deepcopy(list(messages))
    if position != "system_end":
        user = next((m for m in out if m.get("role") == "user"), None)
        if user is None or not isinstance(user.get("content"), str):
            raise ValueError(f"privileged block position {position!r} needs a text user message")
        parts = [user["content"], block] if position == "first_user_after_task" else [block, user["content"]]
        user["content"] = "\n\n".join(p for p in parts if p)
        return out
    if out and out[0].get("role") == "system":
        content = out[0].get("content") or ""
        if not isinstance(content, str):
            raise ValueError("the teacher pass needs a text system message (got structured content)")
        out[0]["content"] = f"{content}\n\n{block}" if content else block
    else:
        out.insert(0, {"role": "system", "content": block})
    return out


@dataclass
class TeacherOutput:
    """Result of `teacher_logps`."""

    with_block: Tensor  # (B, T) float32 log-probs of the completion tokens with the block in context; 0 off `rows`
    without_block: Tensor  # (B, T) the same forward without the block (same routine, same chunking)
    rows: Tensor  # (B,) bool, the rows that had a block and were scored
    prompt_tokens_added: Tensor  # (B,) int, prompt length with the block minus without


def initial_context(trainer, model):
    """The model and context in which the initial policy scores (teacher-pass.md D7): the PEFT model with its adapter
    disabled, else the frozen copy a trainer loaded as `initial_model`."""
    unwrapped = trainer.accelerator.unwrap_model(model)
    if hasattr(unwrapped, "peft_config"):
        return model, use_adapter(unwrapped, adapter_name=None)
    initial = getattr(trainer, "initial_model", None)
    if initial is None:
        raise ValueError(
            "teacher source 'initial' needs a PEFT adapter (the base is the initial policy) or a frozen "
            "copy of the initial weights in trainer.initial_model"
        )
    return initial, nullcontext()


def reference_context(trainer, model):
    """The model and context in which the reference scores (teacher-pass.md D2)."""
    if getattr(trainer, "ref_model", None) is not None:
        return trainer.ref_model, nullcontext()
    unwrapped = trainer.accelerator.unwrap_model(model)
    if hasattr(unwrapped, "peft_config"):
        return model, use_adapter(unwrapped, adapter_name="ref" if "ref" in unwrapped.peft_config else None)
    raise ValueError(
        "teacher source 'reference' needs a reference model: set beta > 0 (TRL then keeps one) or train a PEFT "
        "adapter (the base model is the reference); or use the teacher source 'policy'"
    )


@torch.no_grad()
def teacher_logps(
    trainer,
    batch,
    blocks: list[str | None],
    source: str = "policy",
    batch_size: int | None = None,
    position: str = "system_end",
    plain: bool = True,
) -> TeacherOutput:
    """Log-probs of each row's own completion tokens under the teacher, with and without its privileged block
    (teacher-pass.md Eq. 2-3). Rows whose block is None (or empty) are not scored. `plain=False` skips the pass
    without the block (`without_block` stays 0).

    The prompt with the block is rendered from the rollout's prompt messages and tools (`prompt_messages`,
    `prompt_tools` in `batch.rows`, recorded by the agent loop) with the tokenizer's chat template; the prompt without
    it is the rollout's own `prompt_ids`. Both passes run through the trainer's log-prob forward (TRL's, with the
    sampling temperature), in chunks of `batch_size` rows (default: `per_device_train_batch_size`), in eval mode.

    Args:
        trainer: an `AgentGRPOTrainer` (its model, tokenizer, accelerator, and `_get_per_token_logps_and_entropies`).
        batch (`RolloutBatch`): the generation batch (prompt_ids, prompt_mask, completion ids and mask, rows).
        blocks (`list[str | None]`): (B,) the privileged text per row.
        source (`str`): `policy` (the pre-update policy), `reference` (teacher-pass.md D2) or `initial` (D7).
        batch_size (`int`, *optional*): rows per forward.
        position (`str`): where the block goes (`POSITIONS`, teacher-pass.md D7).
        plain (`bool`): also run the pass without the block.
    """
    if source not in SOURCES:
        raise ValueError(f"teacher source must be one of {SOURCES}, got {source!r}")
    B, T = batch.completion_ids.shape
    if len(blocks) != B:
        raise ValueError(f"teacher_logps got {len(blocks)} blocks for {B} rows")
    device = batch.completion_ids.device
    rows = torch.tensor([bool(b) for b in blocks], dtype=torch.bool, device=device)
    out = TeacherOutput(
        with_block=torch.zeros(B, T, device=device),
        without_block=torch.zeros(B, T, device=device),
        rows=rows,
        prompt_tokens_added=torch.zeros(B, dtype=torch.long, device=device),
    )
    picked = rows.nonzero().flatten().tolist()
    if not picked:
        return out
    tok = trainer.processing_class
    tok = getattr(tok, "tokenizer", tok)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    privileged, unblocked = [], []
    for b in picked:
        row = batch.rows[b]
        if "prompt_messages" not in row:
            raise RuntimeError("the teacher pass needs the agent loop's prompt_messages (train with an environment)")
        messages = with_privileged_block(row["prompt_messages"], blocks[b], position)  # Eq. 1
        privileged.append(render_prompt_ids(tok, messages, row.get("prompt_tools")))
        keep = batch.prompt_mask[b].bool()
        unblocked.append(batch.prompt_ids[b][keep].tolist())
    model = trainer.model
    context = nullcontext()
    if source == "reference":
        model, context = reference_context(trainer, model)
    elif source == "initial":
        model, context = initial_context(trainer, model)
    was_training = model.training
    model.eval()
    size = batch_size or trainer.args.per_device_train_batch_size
    completion_ids, completion_mask = batch.completion_ids[picked], batch.completion_mask[picked]
    try:
        with context, trainer.free_routing():  # MoE: the sampler's routes belong to another context; route freely
            passes = [(privileged, out.with_block)] + [(unblocked, out.without_block)] * plain
            for prompts, target in passes:
                prompt_ids, prompt_mask = left_padded(prompts, pad_id, device)
                input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # Eq. 2: the rollout's own ids
                attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
                logps, _, _ = trainer.token_logps(model, input_ids, attention_mask, T, size)
                target[picked] = logps.float() * completion_mask.float()  # Eq. 3
    finally:
        model.train(was_training)
    out.prompt_tokens_added[picked] = torch.tensor(
        [len(p) - len(q) for p, q in zip(privileged, unblocked, strict=True)], device=device
    )
    return out


@torch.no_grad()
def plain_logps(trainer, batch, source: str = "policy", batch_size: int | None = None) -> Tensor:
    """(B, T) log-probs of every row's completion tokens after its own prompt (`batch.prompt_ids`), under `source`
    (`SOURCES`), in eval mode at the sampling temperature, through the same routine as `teacher_logps`: the student's
    side of a teacher pass when the trainer keeps no old log-probs (β-OPSD's current-student reference)."""
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    model, context = trainer.model, nullcontext()
    if source == "reference":
        model, context = reference_context(trainer, model)
    elif source == "initial":
        model, context = initial_context(trainer, model)
    T = batch.completion_ids.shape[1]
    input_ids = torch.cat([batch.prompt_ids, batch.completion_ids], dim=1)
    attention_mask = torch.cat([batch.prompt_mask, batch.completion_mask], dim=1)
    was_training = model.training
    model.eval()
    try:
        with context, trainer.free_routing():
            size = batch_size or trainer.args.per_device_train_batch_size
            logps, _, _ = trainer.token_logps(model, input_ids, attention_mask, T, size)
    finally:
        model.train(was_training)
    return logps.float() * batch.completion_mask.float()


@torch.no_grad()
def score_after_prefixes(
    trainer, sequences: list[list[int]], jobs: list[tuple[int, int, list[int]]], rows_per_forward: int = 16
) -> list[Tensor]:
    """Log-probs of continuation y after the prefix `sequences[r][:p]`, for every job (r, p, y), under the trainer's
    policy in eval mode at the sampling temperature; one (len(y),) float32 tensor per job, in order.

    The jobs of one sequence share one forward (teacher-pass.md D6): the sequence up to its longest prefix, then each
    continuation, with a 4-D attention mask that lets continuation k see the first p_k tokens of the sequence and its
    own earlier tokens, and position ids that continue from p_k. Each continuation is scored exactly as if it followed
    its prefix alone, while the shared prefix is computed once."""
    per_seq: dict[int, list[int]] = {}
    for k, (r, p, _) in enumerate(jobs):
        if p < 1 or p > len(sequences[r]):
            raise ValueError(f"job {k}: prefix length {p} is outside sequence {r} (length {len(sequences[r])})")
        per_seq.setdefault(r, []).append(k)
    out: list[Tensor | None] = [None] * len(jobs)
    model, device = trainer.model, trainer.accelerator.device
    tok = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    was_training = model.training
    model.eval()
    packs = []  # (tokens, positions, allow (S, S) bool, [(job, prediction positions)])
    for r, ks in per_seq.items():
        base = sequences[r][: max(jobs[k][1] for k in ks)]
        tokens, positions, reads = list(base), list(range(len(base))), []
        spans = []
        for k in ks:
            p, y = jobs[k][1], jobs[k][2]
            start = len(tokens)
            tokens += y
            positions += list(range(p, p + len(y)))
            spans.append((start, p, len(y)))
            reads.append((k, [p - 1, *range(start, start + len(y) - 1)]))
        S = len(tokens)
        allow = torch.tril(torch.ones(S, S, dtype=torch.bool))
        allow[len(base) :, :] = False
        for start, p, m in spans:
            allow[start : start + m, :p] = True
            allow[start : start + m, start : start + m] = torch.tril(torch.ones(m, m, dtype=torch.bool))
        packs.append((tokens, positions, allow, reads))
    try:
        with trainer.free_routing():
            for s in range(0, len(packs), rows_per_forward):
                chunk = packs[s : s + rows_per_forward]
                width = max(len(t) for t, _, _, _ in chunk)
                ids = torch.full((len(chunk), width), pad_id, dtype=torch.long, device=device)
                pos = torch.zeros((len(chunk), width), dtype=torch.long, device=device)
                allow = torch.eye(width, dtype=torch.bool, device=device).repeat(len(chunk), 1, 1)  # padding: itself
                for i, (t, q, a, _) in enumerate(chunk):
                    ids[i, : len(t)] = torch.tensor(t, device=device)
                    pos[i, : len(q)] = torch.tensor(q, device=device)
                    allow[i, : len(t), : len(t)] = a.to(device)
                dtype = next(model.parameters()).dtype
                mask = torch.zeros(allow.shape, dtype=dtype, device=device).masked_fill(~allow, torch.finfo(dtype).min)
                logits = model(input_ids=ids, attention_mask=mask.unsqueeze(1), position_ids=pos).logits
                logps = torch.log_softmax(logits.float() / trainer.temperature, dim=-1)  # (b, S, V)
                for i, (_, _, _, reads) in enumerate(chunk):
                    for k, where in reads:
                        y = torch.tensor(jobs[k][2], device=device)
                        out[k] = logps[i, where].gather(1, y.unsqueeze(1)).squeeze(1)
    finally:
        model.train(was_training)
    return out
