"""TASPO: privileged-information reweighting of outcome advantages, https://huggingface.co/papers/2608.31077,
docs/methods/taspo.md.

Changes relative to GRPO:
1. Each step, an analyzer (an API model through `rewards/judge.py`, or the offline `OracleAnalyzer` of the built-in
   environments) extracts rules from the verified-successful rollouts of each task group (taspo.md Eq. 3, §4.3), and
   matches them to every rollout with A ≠ 0 by their conditions, outcome-blind and leave-one-out (Eq. 4-5, §4.4).
2. The teacher pass (`trainers/teacher.py`) scores each matched rollout's own tokens with the matched rules in its
   system message; the per-token log-prob shift Δ (Eq. 7), margin-filtered and averaged over each turn's action
   tokens (Eq. 8), de-meaned per rollout (Eq. 9) and squashed with the advantage's sign (Eq. 10), becomes a turn
   weight w ∈ (1 − ε, 1 + ε) with mean 1 over the rollout's action turns (Eq. 11).
3. w multiplies A on every loss token of its turn (Eq. 12, credit-interface.md Eq. I-2). Rows with A = 0, without
   matched rules, or whose analyzer call or teacher pass failed keep the GRPO broadcast.

Unchanged: TRL's group advantage (Eq. 1), the clipped surrogate, the KL term, the loss aggregation (`loss_type`,
conventions.md C22). Only `compute_advantages` is overridden. With several processes, the records of the whole batch
are gathered, the main process makes every analyzer call once and broadcasts the composed blocks, and each process
runs the teacher pass on its own rows (taspo.md D14).

This file reads top to bottom: `TASPOConfig`, the pure math (`margin_filter`, `turn_shift_means`, `taspo_weights`,
`taspo_advantages`, `# Eq. N` on the implementing lines), the action spans, the analyzer stage, then `TASPOTrainer`.

Logged metrics (besides the `credit/*` set of credit-interface.md §10): `taspo/pi_coverage`,
`taspo/groups_with_success`, `taspo/items_extracted_mean`, `taspo/items_loo_mean`, `taspo/items_matched_mean`,
`taspo/pi_tokens_mean`, `taspo/delta_abs_mean`, `taspo/kappa_filtered_frac`, `taspo/d_std`, `taspo/q_saturation_frac`,
`taspo/tau`, `taspo/w_min`, `taspo/w_max`, `taspo/w_std`, `taspo/action_turn_frac`, `taspo/action_span_fallback_frac`,
`taspo/teacher_forward_s`, and the analyzer's `taspo/analyzer_*` (calls, requests,
retries, timeouts, parse_failures, tokens, cost_usd, cost_usd_cum; `rewards/judge.py`) (taspo.md §8).

Decision ids (`Dn`) without a page are docs/methods/taspo.md's.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field

import torch
from accelerate.utils import broadcast_object_list, gather, gather_object
from torch import Tensor

from rewards.analyzer import (
    Applicable,
    ExtractedItems,
    Item,
    OracleAnalyzer,
    clean_items,
    compose,
    extraction_messages,
    leave_one_out,
    match_messages,
)
from rewards.judge import APIModelFields, BaseJudge, Judge
from rewards.rubrics import render_task
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, RolloutBatch
from trainers.credit import CreditOutput, credit_metrics, redistribute_multiplicative, turn_token_counts
from trainers.teacher import SOURCES, reference_context, teacher_logps

logger = logging.getLogger(__name__)

BACKENDS = ("oracle", "openai")
TAU_MODES = ("fixed", "auto")
# the API analyzer's endpoint fields `analyzer_model`, ..., as TASPOConfig declares them
ANALYZER = APIModelFields(
    "analyzer",
    ("model", "base_url", "api_key_env", "cache_path", "concurrency", "timeout", "max_retries", "max_repairs")
    + ("temperature", "max_tokens", "price_input_per_mtok", "price_output_per_mtok"),
    selector="analyzer_backend",
    defaults={"max_repairs": 2, "temperature": 0.0, "max_tokens": 4096},
    help={
        "concurrency": "Most analyzer calls in flight (taspo.md §5).",
        "timeout": "Seconds per analyzer call attempt (§5).",
        "max_retries": "Transport re-sends: 2 gives 3 attempts (D11).",
        "max_repairs": "Re-asks with the validation error after an invalid answer: 3 attempts (D11).",
        "temperature": "Analyzer temperature (taspo.md §5).",
        "max_tokens": "Analyzer max output tokens.",
    },
)


@dataclass
class TASPOConfig(AgentGRPOConfig):
    """AgentGRPOConfig plus TASPO's weights, analyzer and teacher settings (`docs/methods/taspo.md` §5); the endpoint
    fields (`analyzer_model`, ..., `analyzer_price_output_per_mtok`) follow `analyzer_backend`; `ANALYZER` builds the
    analyzer from them."""

    taspo_epsilon: float = field(default=0.2, metadata={"help": "ε: weights lie in (1 − ε, 1 + ε) (taspo.md D1)."})
    taspo_kappa: float = field(default=0.05, metadata={"help": "κ: |Δ| below it (nats) counts as 0 (taspo.md Eq. 8)."})
    taspo_tau: float = field(default=0.25, metadata={"help": "τ of the tanh squashing (taspo.md Eq. 10, D1)."})
    taspo_tau_mode: str = field(
        default="fixed",
        metadata={"help": "`fixed` (taspo_tau), or `auto`: τ = std of d̂ over the batch's action turns (D3, C12)."},
    )
    taspo_teacher: str = field(
        default="policy", metadata={"help": "Teacher of the shift pass: `policy` (pre-update) or `reference` (D9)."}
    )
    taspo_max_pi_tokens: int = field(default=1024, metadata={"help": "Longest privileged block P_i (taspo.md §4.5)."})
    analyzer_backend: str = field(
        default="oracle",
        metadata={
            "help": "`oracle` (built-in environments' ground truth, offline) or `openai` (any compatible endpoint)."
        },
    )
    # the API analyzer's endpoint (`analyzer_backend: openai`), read by ANALYZER.judge_config; held to
    # ANALYZER by tests/test_judge.py
    analyzer_model: str | None = field(default=None, metadata={"help": "Model id at the endpoint (`openai` only)."})
    analyzer_base_url: str | None = field(default=None, metadata={"help": "OpenAI-compatible base URL; None: OpenAI."})
    analyzer_api_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "Env variable holding the API key."})
    analyzer_cache_path: str | None = field(default=None, metadata={"help": "sqlite3 cache of analyzer answers."})
    analyzer_concurrency: int = field(default=32, metadata={"help": "Most analyzer calls in flight (taspo.md §5)."})
    analyzer_timeout: float = field(default=180.0, metadata={"help": "Seconds per analyzer call attempt (§5)."})
    analyzer_max_retries: int = field(default=2, metadata={"help": "Transport re-sends: 2 gives 3 attempts (D11)."})
    analyzer_max_repairs: int = field(
        default=2, metadata={"help": "Re-asks with the validation error after an invalid answer: 3 attempts (D11)."}
    )
    analyzer_temperature: float = field(default=0.0, metadata={"help": "Analyzer temperature (taspo.md §5)."})
    analyzer_max_tokens: int = field(default=4096, metadata={"help": "Analyzer max output tokens."})
    analyzer_price_input_per_mtok: float = field(default=0.0, metadata={"help": "USD per million prompt tokens."})
    analyzer_price_output_per_mtok: float = field(default=0.0, metadata={"help": "USD per million completion tokens."})
    analyzer_step_deadline: float = field(
        default=1200.0, metadata={"help": "Seconds for all analyzer work of a step."}
    )
    analyzer_observation_chars: int = field(default=1000, metadata={"help": "Observation cap in analyzer inputs."})

    def __post_init__(self):
        super().__post_init__()
        if not 0 < self.taspo_epsilon < 1:
            raise ValueError(
                f"taspo_epsilon must be in (0, 1) so that weights stay positive, got {self.taspo_epsilon}"
            )
        if not self.taspo_kappa >= 0:
            raise ValueError(f"taspo_kappa must be >= 0, got {self.taspo_kappa}")
        if not self.taspo_tau > 0:
            raise ValueError(f"taspo_tau must be > 0, got {self.taspo_tau}")
        if self.taspo_tau_mode not in TAU_MODES:
            raise ValueError(f"taspo_tau_mode must be one of {TAU_MODES}, got {self.taspo_tau_mode!r}")
        if self.taspo_teacher not in SOURCES:
            raise ValueError(f"taspo_teacher must be one of {SOURCES}, got {self.taspo_teacher!r}")
        if self.analyzer_backend not in BACKENDS:
            raise ValueError(f"analyzer_backend must be one of {BACKENDS}, got {self.analyzer_backend!r}")
        ANALYZER.check(self)


# ---------------------------------------------------------------------------------------------------------------------
# The weights (Eq. 8-12)


def margin_filter(delta: Tensor, kappa: float) -> Tensor:
    """φ(Δ) = Δ · 1[|Δ| ≥ κ] (taspo.md Eq. 8).

    >>> margin_filter(torch.tensor([0.01, -0.2, 0.05]), 0.05).tolist()
    [0.0, -0.20000000298023224, 0.05000000074505806]
    """
    return torch.where(delta.abs() >= kappa, delta, torch.zeros_like(delta))


def turn_shift_means(delta: Tensor, action_mask: Tensor, turn_index: Tensor, num_turns: int, kappa: float) -> Tensor:
    """d_ij = (1/|M_ij|) Σ_{t ∈ M_ij} φ(Δ_t) (taspo.md Eq. 8): a mean over the turn's action tokens, filtered tokens
    included in the count; (B, T) -> (B, K) float64, 0 on turns without action tokens.

    >>> d = turn_shift_means(torch.tensor([[0.3, 0.01, 9.0, -0.4]]), torch.tensor([[1, 1, 0, 1]]).bool(),
    ...                      torch.tensor([[0, 0, -1, 1]]), 2, kappa=0.05)
    >>> [round(x, 6) for x in d[0].tolist()]  # turn 0: (0.3 + 0) / 2; turn 1: -0.4; the 9.0 is no action token
    [0.15, -0.4]
    """
    phi = margin_filter(delta.to(torch.float64), kappa)  # (B, T)
    inside = action_mask.bool() & (turn_index >= 0)
    B = delta.shape[0]
    sums = torch.zeros(B, num_turns + 1, dtype=torch.float64, device=delta.device)
    counts = torch.zeros(B, num_turns + 1, dtype=torch.float64, device=delta.device)
    slot = torch.where(inside, turn_index, num_turns).long()  # outside tokens go to a spare column
    sums.scatter_add_(1, slot, torch.where(inside, phi, 0.0))
    counts.scatter_add_(1, slot, inside.to(torch.float64))
    return (sums / counts.clamp(min=1.0))[:, :num_turns]


@torch.no_grad()
def taspo_weights(d: Tensor, adv: Tensor, action_turns: Tensor, epsilon: float, tau: float) -> tuple[Tensor, Tensor]:
    """Turn weights, taspo.md Eq. 9-11: d̂ = d − mean over the action turns 𝒯_i (Eq. 9), q = tanh(sign(A) d̂ / τ)
    (Eq. 10), w = 1 + (ε/2)(q − q̄) on 𝒯_i and 1 elsewhere (Eq. 11). Mean of w over 𝒯_i is 1 and 1 − ε < w < 1 + ε.

    Returns w (B, K) float64 and q (B, K) (0 off 𝒯_i).

    >>> w, q = taspo_weights(torch.tensor([[0.5, 0.0, 7.0]]), torch.tensor([2.0]),
    ...                      torch.tensor([[True, True, False]]), epsilon=0.2, tau=0.25)
    >>> [round(x, 4) for x in w[0].tolist()]  # d̂ = ±0.25, q = ±tanh(1) = ±0.7616, w = 1 ± 0.1·0.7616
    [1.0762, 0.9238, 1.0]
    """
    on = action_turns.bool()
    n = on.sum(dim=1, keepdim=True).clamp(min=1)  # (B, 1)
    d = torch.where(on, d.to(torch.float64), 0.0)
    d_hat = torch.where(on, d - d.sum(dim=1, keepdim=True) / n, 0.0)  # Eq. 9
    sign = torch.sign(adv.to(torch.float64)).unsqueeze(1)  # (B, 1)
    q = torch.where(on, torch.tanh(sign * d_hat / tau), 0.0)  # Eq. 10
    q_bar = q.sum(dim=1, keepdim=True) / n
    w = torch.where(on, 1.0 + (epsilon / 2.0) * (q - q_bar), 1.0)  # Eq. 11
    return w, q


def auto_tau(d_hat: Tensor, action_turns: Tensor, floor: float = 1e-3, default: float = 0.25) -> float:
    """τ for `taspo_tau_mode: auto` (taspo.md D3, conventions.md C12): the population std of d̂ over the action turns
    given (rows in fallback excluded by the caller), floored at 1e-3; `default` when there is none.

    >>> auto_tau(torch.tensor([[0.5, -0.5, 9.0]]), torch.tensor([[True, True, False]]))
    0.5
    """
    pool = d_hat[action_turns.bool()].to(torch.float64)
    if pool.numel() == 0:
        return default
    return max(float(pool.std(unbiased=False)), floor)


def demeaned(d: Tensor, action_turns: Tensor) -> Tensor:
    """d̂ of Eq. 9 alone, (B, K) float64, 0 off 𝒯_i."""
    on = action_turns.bool()
    n = on.sum(dim=1, keepdim=True).clamp(min=1)
    d = torch.where(on, d.to(torch.float64), 0.0)
    return torch.where(on, d - d.sum(dim=1, keepdim=True) / n, 0.0)


@torch.no_grad()
def taspo_advantages(
    adv: Tensor,
    turn_index: Tensor,
    turn_valid: Tensor,
    delta: Tensor,
    action_mask: Tensor,
    action_turns: Tensor,
    epsilon: float = 0.2,
    kappa: float = 0.05,
    tau: float = 0.25,
    row_fallback: Tensor | None = None,
    reasons: list[str | None] | None = None,
) -> tuple[CreditOutput, Tensor, Tensor]:
    """TASPO's per-token advantages, taspo.md Eq. 8-12: Ã = A · w_ij on every loss token of turn j, 0 on tokens of no
    turn (credit-interface.md Eq. I-2, `turn_mean` residual). Rows in `row_fallback` (no matched rules, a failed
    analyzer call or teacher pass) keep the GRPO broadcast; rows with A = 0 are zeros.

    Args:
        adv (`Tensor`): (B,) A. turn_index (`Tensor`): (B, T). turn_valid (`Tensor`): (B, K) bool.
        delta (`Tensor`): (B, T) Δ, the teacher-pass log-prob shift (Eq. 7).
        action_mask (`Tensor`): (B, T) bool, the action tokens M_ij (D4).
        action_turns (`Tensor`): (B, K) bool, 𝒯_i: turns the environment executed (D6).
        epsilon, kappa, tau: ε, κ, τ.

    Returns:
        the `CreditOutput`, d (B, K) and q (B, K).
    """
    B, K = turn_valid.shape
    n = turn_token_counts(turn_index, K)  # (B, K)
    on = action_turns.bool() & turn_valid.bool() & (n > 0)  # a turn cut to no token carries nothing (C7)
    d = turn_shift_means(delta.detach(), action_mask, turn_index, K, kappa)  # (B, K) Eq. 8
    w, q = taspo_weights(d, adv, on, epsilon, tau)  # Eq. 9-11
    out = redistribute_multiplicative(  # Eq. 12
        adv, turn_index, w, turn_valid, row_fallback, reasons, n, conserve="turn_mean"
    )
    return out, d, q


# ---------------------------------------------------------------------------------------------------------------------
# Action spans (D4)

ACTION_PATTERNS = (r"<tool_call>.*?</tool_call>", r"<action>(.*?)</action>", r"```.*?```")


def action_token_mask(
    tokenizer, completion_ids: Tensor, turn_index: Tensor, num_turns: int
) -> tuple[Tensor, int, int]:
    """M_ij (taspo.md D4): the tokens of each turn that overlap its executable span (a tool-call block, `<action>`
    content or a code block, first match); all loss tokens of the turn when nothing parses. Returns the (B, T) mask,
    the number of turns and how many of them fell back to all tokens."""
    mask = turn_index >= 0
    turns = fallbacks = 0
    for b in range(completion_ids.shape[0]):
        for k in range(num_turns):
            where = (turn_index[b] == k).nonzero().flatten()
            if where.numel() == 0:
                continue
            turns += 1
            ids = completion_ids[b, where].tolist()
            text = tokenizer.decode(ids, skip_special_tokens=False)
            span = None
            for pattern in ACTION_PATTERNS:
                m = re.search(pattern, text, flags=re.DOTALL)
                if m:
                    span = m.span(1) if m.groups() else m.span()
                    break
            if span is None:
                fallbacks += 1
                continue
            ends = [len(tokenizer.decode(ids[: i + 1], skip_special_tokens=False)) for i in range(len(ids))]
            starts = [0, *ends[:-1]]
            keep = torch.tensor([s < span[1] and e > span[0] for s, e in zip(starts, ends, strict=True)])
            mask[b, where] = keep.to(mask.device)
    return mask, turns, fallbacks


# ---------------------------------------------------------------------------------------------------------------------
# The analyzer stage (taspo.md §4.1 steps 2-3, §4.3-4.4)


def build_analyzer(args: TASPOConfig, datasets: list) -> BaseJudge:
    """The analyzer `args.analyzer_backend` names; the oracle learns the tasks of the `task` column of `datasets`."""
    if args.analyzer_backend == "oracle":
        tasks = [t for ds in datasets if ds is not None and "task" in (ds.column_names or []) for t in ds["task"]]
        if not tasks:
            raise ValueError(
                "analyzer_backend 'oracle' needs a train_dataset with a `task` column (built-in env tasks)"
            )
        return OracleAnalyzer(tasks, obs_chars=args.analyzer_observation_chars)
    return Judge(ANALYZER.judge_config(args))


@dataclass
class RowRecord:
    """What the analyzer stage needs of one row (gathered over processes)."""

    group: int
    task: str  # the agent's prompt, rendered
    transcript: list[dict]
    success: bool
    adv: float


@dataclass
class StageResult:
    """The analyzer stage's outcome for every row of the (gathered) batch."""

    items: list[list[Item]]  # E_i per row
    reasons: list[str | None]  # fallback reason per row, None where E_i was matched
    extracted: list[int]  # |E_x| per group with a success that was analysed
    loo: list[int]  # |E_{x,−i}| per row sent to matching
    groups_with_success: float


def analyze(
    analyzer: BaseJudge, records: list[RowRecord], obs_chars: int = 1000, deadline_s: float = 1200.0
) -> StageResult:
    """Extraction per group with a success and a row with A ≠ 0, then one match per row with A ≠ 0 and a non-empty
    leave-one-out set (taspo.md §4.1, D10). A failed extraction sends its group's rows to fallback
    (`analyzer_failure`), a failed match its row (D11). Never raises."""
    start = time.monotonic()
    groups: dict[int, list[int]] = {}
    for i, r in enumerate(records):
        groups.setdefault(r.group, []).append(i)
    items: list[list[Item]] = [[] for _ in records]
    reasons: list[str | None] = [None] * len(records)
    for i, r in enumerate(records):
        if r.adv == 0:
            reasons[i] = "zero_adv"
    extract_for = []
    for g, rows in groups.items():
        successes = [i for i in rows if records[i].success]
        live = [i for i in rows if records[i].adv != 0]
        if not successes:
            for i in live:
                reasons[i] = "no_pi"  # D10: the group has no success
        elif live:
            extract_for.append((g, successes))
    messages = [
        extraction_messages(records[s[0]].task, [(i, records[i].transcript) for i in s], obs_chars)
        for _, s in extract_for
    ]
    extracted = analyzer.run_sync(analyzer.score_many(messages, ExtractedItems, deadline_s=deadline_s))
    group_items: dict[int, list[Item]] = {}
    sizes = []
    for (g, successes), result in zip(extract_for, extracted, strict=True):
        if result is None:
            for i in groups[g]:
                if records[i].adv != 0:
                    reasons[i] = "analyzer_failure"  # D11
            continue
        kept = clean_items(result.items, {i: len(records[i].transcript) for i in successes})
        group_items[g] = kept
        sizes.append(len(kept))
    targets, candidates = [], []
    for i, r in enumerate(records):
        if r.adv == 0 or r.group not in group_items:
            continue
        loo = leave_one_out(group_items[r.group], i)  # Eq. 4
        if not loo:
            reasons[i] = "no_pi"
            continue
        targets.append(i)
        candidates.append(loo)
    remaining = max(0.0, deadline_s - (time.monotonic() - start))
    messages = [
        match_messages(records[i].task, c, records[i].transcript, obs_chars)
        for i, c in zip(targets, candidates, strict=True)
    ]
    matched = analyzer.run_sync(analyzer.score_many(messages, Applicable, deadline_s=remaining))
    for i, loo, result in zip(targets, candidates, matched, strict=True):
        if result is None:
            reasons[i] = "analyzer_failure"  # D11
            continue
        chosen = set(result.applicable)  # unknown ids are ignored
        items[i] = [e for e in loo if e.id in chosen]  # Eq. 5
        if not items[i]:
            reasons[i] = "no_pi"
    n_groups = len(groups)
    with_success = sum(any(records[i].success for i in rows) for rows in groups.values())
    return StageResult(
        items=items,
        reasons=reasons,
        extracted=sizes,
        loo=[len(c) for c in candidates],
        groups_with_success=with_success / n_groups if n_groups else math.nan,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The trainer


class TASPOTrainer(AgentGRPOTrainer):
    """TASPO on the agent GRPO base; see the module docstring. `analyzer` (keyword-only) overrides the one built from
    the config; the other parameters are the base's, in TRL's order."""

    config_class = TASPOConfig

    def __init__(
        self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, *rest, analyzer=None, **kw
    ):
        args = self.as_config(args, model)
        self.analyzer = analyzer if analyzer is not None else build_analyzer(args, [train_dataset, eval_dataset])
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, *rest, **kw)
        if self.env_factory is None:
            raise ValueError("TASPO needs an environment: it reads the rollouts' transcripts (set `environment`)")
        if args.taspo_teacher == "reference":
            reference_context(self, self.model)  # no reference model: fail now, with the two ways to get one
        self.credit = None  # the latest batch's `CreditOutput`, for inspection
        self.blocks: list[str] = []  # the latest batch's privileged blocks P_i ('' where none)
        self._warned: set[str] = set()

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        args, acc = self.args, self.accelerator
        B, K = batch.turn_valid.shape
        device = batch.advantages.device
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        records = [
            RowRecord(
                group=int(g),
                task=render_task(row.get("prompt_messages") or row.get("prompt", "")),
                transcript=[{"action": t["action"], "observation": t["observation"]} for t in row["transcript"]],
                success=bool(row["success"]) if "success" in row else bool(r >= 1.0),  # D12
                adv=float(a) if has_tokens else 0.0,  # §7 item 16: a row without loss tokens is zeros, never analysed
            )
            for g, row, r, a, has_tokens in zip(
                batch.group_ids.tolist(),
                batch.rows,
                batch.rewards.tolist(),
                batch.advantages.tolist(),
                (batch.turn_index >= 0).any(dim=1).tolist(),
                strict=True,
            )
        ]
        start = acc.process_index * B if acc.num_processes > 1 else 0
        if acc.num_processes > 1:  # D14: one call per group and per row, made by the main process
            records = gather_object(records)
            payload = [None]
            if acc.is_main_process:
                payload = [self._stage(records, tok)]
            payload = broadcast_object_list(payload)
            stage, blocks = payload[0]
        else:
            stage, blocks = self._stage(records, tok)
        own_blocks = blocks[start : start + B]
        own_reasons = list(stage.reasons[start : start + B])
        teacher_s = time.monotonic()
        try:
            scored = teacher_logps(self, batch, [b or None for b in own_blocks], source=args.taspo_teacher)
            delta = scored.with_block - scored.without_block  # (B, T) Eq. 7, detached (no_grad)
            ok = True
        except (RuntimeError, ValueError) as err:  # a failed pass degrades to GRPO for these rows (interface §7)
            self._warn_once("teacher", f"TASPO teacher pass failed ({type(err).__name__}: {err}); rows keep GRPO")
            delta, ok = torch.zeros(batch.completion_ids.shape, device=device), False
        teacher_s = time.monotonic() - teacher_s
        if not ok:
            own_reasons = [r or "teacher_failure" for r in own_reasons]
        fallback = torch.tensor([r is not None for r in own_reasons], dtype=torch.bool, device=device)
        action_mask, n_turns, span_fallbacks = action_token_mask(tok, batch.completion_ids, batch.turn_index, K)
        executed = torch.zeros(B, K, dtype=torch.bool, device=device)  # 𝒯_i (D6): turns the environment executed
        for b, row in enumerate(batch.rows):
            for k, turn in enumerate(row["transcript"][:K]):
                executed[b, k] = not turn.get("invalid", False)
        tau = args.taspo_tau
        if args.taspo_tau_mode == "auto":  # D3, C12: over the whole batch's action turns of credited rows
            d = turn_shift_means(delta, action_mask, batch.turn_index, K, args.taspo_kappa)
            has_tokens = turn_token_counts(batch.turn_index, K) > 0  # a turn cut to no token is not in 𝒯 (C7)
            live = executed & batch.turn_valid.bool() & has_tokens & ~fallback.unsqueeze(1)
            d_hat = demeaned(d, live)
            if acc.num_processes > 1:
                d_hat, live = gather(d_hat), gather(live)
            tau = auto_tau(d_hat, live)
        out, d, q = taspo_advantages(
            batch.advantages,
            batch.turn_index,
            batch.turn_valid,
            delta,
            action_mask,
            executed,
            args.taspo_epsilon,
            args.taspo_kappa,
            tau,
            fallback,
            own_reasons,
        )
        self.credit, self.blocks = out, own_blocks
        metrics = credit_metrics(out, batch.advantages, batch.turn_index, batch.turn_valid)
        metrics |= self._taspo_metrics(batch, stage, own_blocks, out, delta, action_mask, executed, d, q, tok)
        metrics["taspo/tau"] = tau
        metrics["taspo/action_span_fallback_frac"] = span_fallbacks / n_turns if n_turns else math.nan
        metrics["taspo/teacher_forward_s"] = teacher_s
        metrics |= self.analyzer.metrics(prefix="taspo/analyzer_", reset=True)
        for name, value in metrics.items():
            self.log_metric(name, value)
        return out.advantages  # (B, T)

    def _stage(self, records: list[RowRecord], tok) -> tuple[StageResult, list[str]]:
        args = self.args
        stage = analyze(self.analyzer, records, args.analyzer_observation_chars, args.analyzer_step_deadline)

        def count(text: str) -> int:
            return len(tok(text, add_special_tokens=False)["input_ids"])

        blocks = [compose(items, count, args.taspo_max_pi_tokens) if items else "" for items in stage.items]
        for i, block in enumerate(blocks):
            if stage.reasons[i] is None and not block:
                stage.reasons[i] = "no_pi"  # every matched item was longer than the token budget
        return stage, blocks

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s", message)

    def _taspo_metrics(self, batch, stage, blocks, out, delta, action_mask, executed, d, q, tok) -> dict:
        nan = math.nan
        adv = batch.advantages
        live_rows = (adv != 0).cpu()
        credited = ~out.fallback.cpu() & live_rows
        metrics = {
            "taspo/pi_coverage": float(credited.sum() / live_rows.sum()) if bool(live_rows.any()) else nan,
            "taspo/groups_with_success": stage.groups_with_success,
            "taspo/items_extracted_mean": sum(stage.extracted) / len(stage.extracted) if stage.extracted else nan,
            "taspo/items_loo_mean": sum(stage.loo) / len(stage.loo) if stage.loo else nan,
        }
        matched = [len(x) for x in stage.items if x]
        metrics["taspo/items_matched_mean"] = sum(matched) / len(matched) if matched else nan
        lengths = [len(tok(b, add_special_tokens=False)["input_ids"]) for b in blocks if b]
        metrics["taspo/pi_tokens_mean"] = sum(lengths) / len(lengths) if lengths else nan
        rows = credited.to(delta.device).unsqueeze(1) & action_mask.bool()  # action tokens of credited rows
        values = delta[rows].double()
        metrics["taspo/delta_abs_mean"] = float(values.abs().mean()) if values.numel() else nan
        kappa = self.args.taspo_kappa
        metrics["taspo/kappa_filtered_frac"] = float((values.abs() < kappa).double().mean()) if values.numel() else nan
        has_tokens = turn_token_counts(batch.turn_index, executed.shape[1]) > 0
        on = executed & batch.turn_valid.bool() & has_tokens & credited.to(executed.device).unsqueeze(1)
        d_hat = demeaned(d, on)[on]
        metrics["taspo/d_std"] = float(d_hat.std(unbiased=False)) if d_hat.numel() else nan
        metrics["taspo/q_saturation_frac"] = float((q[on].abs() > 0.95).double().mean()) if bool(on.any()) else nan
        w = out.values[on]
        for name, value in (("min", w.min), ("max", w.max), ("std", lambda: w.std(unbiased=False))):
            metrics[f"taspo/w_{name}"] = float(value()) if w.numel() else nan
        valid = batch.turn_valid.bool()
        metrics["taspo/action_turn_frac"] = float((executed & valid).sum() / valid.sum()) if bool(valid.any()) else nan
        return metrics
