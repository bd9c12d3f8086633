"""DRACO: dynamic-rubric rewards with step-level credit, https://huggingface.co/papers/2609.04094,
docs/methods/draco.md.

Changes relative to GRPO:
1. Outcome-blind reward: the environment's success is never used; `rewards.rubrics.DracoReward` builds one dynamic
   rubric per task group with a judge (S1 task rubric, S2 trajectory rubrics, union), scores every rollout
   (+1 / −1 / 0), drops criteria nobody failed (Eq. 1) and rewards R = (p − f)/(p + f) (Eq. 2); with
   `draco_essential_gate` (draco.md D19, a project option) a rollout failing a criterion the judge marked essential
   (an outcome the instruction names) gets R = −1.
2. Credit: a judge call per rollout with A ≠ 0 names the steps responsible for each surviving criterion; step quality
   Q and weight w (Eq. 4-6) redistribute A over the steps with the token sum A·N conserved (Eq. 7-8, credit-interface
   Eq. I-4, I-2). Rows without usable citations, with Σw = 0 or whose credit call failed keep the GRPO broadcast
   (Eq. 9).
3. The judge is built from config fields: `oracle` (ground truth of the built-in environments, no LLM), `openai` (any
   OpenAI-compatible endpoint through `rewards.judge.Judge`), or `self` (the policy, §4.5: k = 3 unanimity votes).

Unchanged: TRL's group normalisation (Eq. 3), clipped surrogate, KL term and loss aggregation (`loss_type` `grpo`,
`dapo` or `bnpo`: the redistribution keeps each row's token sum, so each aggregation keeps its meaning, conventions.md
C22). Only `compute_advantages` is overridden. Left out: per-phase judge
endpoints and the input-budget shortening of §4.6; with several processes the reward stage runs on the main process
(D14) but each process makes the credit calls of its own rows (each call is still made once).

This file reads top to bottom: `DRACOConfig` (DRACO's fields only), the pure math (citations, step weights and the
redistribution, `# Eq. N` on the implementing lines, built on the shared credit interface of `trainers/credit.py`),
the judge factory, then `DRACOTrainer`.

Logged metrics (besides the `credit/*` set of credit-interface §10):
- `draco/criteria_s1|s2|merged|surviving|essential`, `draco/dropout_rate`, `draco/essential_fail_rate` (rollouts
  failing an essential criterion: the ones D19's gate sets to −1), `draco/reward_mean|std`, `draco/na_rate`,
  `draco/fail_rate`, `draco/zero_std_groups`, `draco/groups_no_signal`, `draco/unscorable_rate`,
  `draco/groups_skipped`: the rubric stages (logged by the reward function);
- `draco/override_rate`: credit verdicts that differ from the scoring verdict; `draco/credit_inert_rate`: credited
  rows whose steps all get the same total (or that fell back); `draco/citations_per_step_mean`,
  `draco/uncited_step_frac`: citation density; `draco/zero_adv_rate`: rows with A = 0 (no credit call, D10);
- `draco/judge_*`: the judge's `metrics()` (calls, requests, retries, timeouts, parse failures, tokens, Eq. 11 cost)
  and per-phase `draco/judge_calls|retries|failures|deadline/<phase>`, `draco/judge_truncations`.

Decision ids (`Dn`) without a page are docs/methods/draco.md's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rewards.judge import APIModelFields, BaseJudge, Judge, LocalModelJudge
from rewards.oracle import OracleJudge
from rewards.rubrics import DracoReward, RubricPipeline
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, RolloutBatch
from trainers.credit import (
    CreditOutput,
    credit_metrics,
    redistribute_multiplicative,
    token_budget_multipliers,
    turn_token_counts,
)

BACKENDS = ("oracle", "openai", "self")
STEP_QUALITIES = ("ratio", "strict")  # draco.md Eq. 4, D18
LOSS_TYPES = ("grpo", "dapo", "bnpo")  # per-row mean, or one token mean (credit-interface.md §2.4)
# the API judge's endpoint fields `judge_model`, `judge_base_url`, ..., as DRACOConfig declares them
JUDGE = APIModelFields(
    "judge",
    ("model", "base_url", "api_key_env", "cache_path", "concurrency", "timeout", "max_retries", "temperature")
    + ("max_tokens", "price_input_per_mtok", "price_output_per_mtok"),
    selector="judge_backend",
    defaults={"temperature": None},  # resolved per backend in __post_init__
    help={
        "concurrency": "Most judge calls in flight (§4.6: 32).",
        "timeout": "Seconds per judge call attempt (§4.6: 180).",
        "max_retries": "Transport re-sends per call: 3 attempts (§4.6).",
        "temperature": "Judge temperature; None: 0.1 for an API judge (§4.2), 0.6 for self (D12).",
        "max_tokens": "Judge max output tokens (§5: 16,384).",
    },
)


@dataclass
class DRACOConfig(AgentGRPOConfig):
    """AgentGRPOConfig plus DRACO's judge settings (`docs/methods/draco.md` §4.6, §5); the endpoint fields
    (`judge_model`, ..., `judge_price_output_per_mtok`) follow `judge_backend`; `JUDGE` builds the judge from them."""

    judge_backend: str = field(
        default="oracle", metadata={"help": "Judge: `oracle` (ground truth, no LLM), `openai` (endpoint) or `self`."}
    )
    # the API judge's endpoint (`judge_backend: openai`), read by JUDGE.judge_config; held to
    # JUDGE by tests/test_judge.py
    judge_model: str | None = field(default=None, metadata={"help": "Model id at the endpoint (`openai` only)."})
    judge_base_url: str | None = field(default=None, metadata={"help": "OpenAI-compatible base URL; None: OpenAI."})
    judge_api_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "Env variable holding the API key."})
    judge_cache_path: str | None = field(default=None, metadata={"help": "sqlite3 cache of judge answers."})
    judge_concurrency: int = field(default=32, metadata={"help": "Most judge calls in flight (§4.6: 32)."})
    judge_timeout: float = field(default=180.0, metadata={"help": "Seconds per judge call attempt (§4.6: 180)."})
    judge_max_retries: int = field(default=2, metadata={"help": "Transport re-sends per call: 3 attempts (§4.6)."})
    judge_temperature: float | None = field(
        default=None, metadata={"help": "Judge temperature; None: 0.1 for an API judge (§4.2), 0.6 for self (D12)."}
    )
    judge_max_tokens: int = field(default=16384, metadata={"help": "Judge max output tokens (§5: 16,384)."})
    judge_price_input_per_mtok: float = field(default=0.0, metadata={"help": "USD per million prompt tokens."})
    judge_price_output_per_mtok: float = field(default=0.0, metadata={"help": "USD per million completion tokens."})
    judge_stage_retries: int = field(
        default=2, metadata={"help": "Re-asks after a validation error (counts, titles, citations) per stage call."}
    )
    judge_step_deadline: float = field(default=1200.0, metadata={"help": "Seconds for all judge work of a step."})
    judge_votes: int | None = field(
        default=None, metadata={"help": "Scoring samples k, unanimity (Eq. 10); None: 3 for self, else 1."}
    )
    credit_observation_chars: int = field(default=1000, metadata={"help": "Observation cap in credit summaries (D4)."})
    protocol_notes: str = field(default="", metadata={"help": "Environment protocol notes shown to judges (§4.2)."})
    draco_credit: bool = field(
        default=True, metadata={"help": "False: the 'dynamic rubric, no credit' ablation (uniform A per token)."}
    )
    draco_step_quality: str = field(
        default="ratio",
        metadata={
            "help": "Q_j of a cited step: `ratio` P/(P+F) (draco.md Eq. 4), or `strict`: 0 if any FAIL cites it, else "
            "1 (draco.md D18, project option)."
        },
    )

    draco_essential_gate: bool = field(
        default=False,
        metadata={
            "help": "R = -1 for a rollout that fails a criterion the judge marked essential (an outcome the "
            "instruction names, draco.md D19, project option); False: the paper's Eq. 2."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.loss_type not in LOSS_TYPES:  # conventions.md C22: a row's token sum N_b·A_b is kept under each
            raise ValueError(f"loss_type must be one of {LOSS_TYPES} (conventions.md C22), got {self.loss_type!r}")
        if self.draco_step_quality not in STEP_QUALITIES:
            raise ValueError(f"draco_step_quality must be one of {STEP_QUALITIES}, got {self.draco_step_quality!r}")
        if self.judge_backend not in BACKENDS:
            raise ValueError(f"judge_backend must be one of {BACKENDS}, got {self.judge_backend!r}")
        JUDGE.check(self)
        # derived at runtime: backend-dependent defaults (§4.2, §4.5, D12)
        if self.judge_votes is None:
            self.judge_votes = 3 if self.judge_backend == "self" else 1
        if self.judge_temperature is None:
            self.judge_temperature = 0.6 if self.judge_backend == "self" else 0.1
        if self.judge_votes < 1:
            raise ValueError(f"judge_votes must be >= 1, got {self.judge_votes}")


# ---------------------------------------------------------------------------------------------------------------------
# Step quality, step weights and the redistribution (Eq. 4-9), through the credit interface


def draco_citations(cited_steps: list[list[list[int]]], num_turns: int, num_criteria: int | None = None) -> Tensor:
    """Z (B, C, K) bool from 1-based step citations per row and criterion: step j is turn j - 1 (draco.md §3).

    conventions.md C9: a step cited twice by one criterion counts once; steps outside 1..num_turns are dropped.

    >>> draco_citations([[[1, 1, 3], [9]]], num_turns=3).int().tolist()
    [[[1, 0, 1], [0, 0, 0]]]
    """
    C = num_criteria if num_criteria is not None else max((len(row) for row in cited_steps), default=0)
    z = torch.zeros(len(cited_steps), C, num_turns, dtype=torch.bool)
    for b, row in enumerate(cited_steps):
        for c, steps in enumerate(row):
            for j in steps:
                if 1 <= j <= num_turns:  # C9: out-of-range dropped; repeats set the same cell once
                    z[b, c, j - 1] = True
    return z


@torch.no_grad()
def draco_step_weights(
    verdicts: Tensor, citations: Tensor, adv: Tensor, turn_valid: Tensor, strict: bool = False
) -> tuple[Tensor, Tensor]:
    """DRACO's step weights from credit-stage verdicts and citations, draco.md Eq. 4-6.

    P_j / F_j = number of PASS / FAIL verdicts citing step j (Eq. 4); Q_j = P_j / (P_j + F_j) on cited steps (with
    `strict`, draco.md D18: Q_j = 1 if F_j = 0 else 0, so a step any failed criterion cites is never reinforced); an
    uncited step takes the mean Q of the row's cited steps (Eq. 5); w_j = Q_j for a winner (A ≥ 0) and 1 − Q_j for a
    loser (A < 0) (Eq. 6). NOT_APPLICABLE verdicts (0) are ignored. Verdicts of dropped criteria must not be passed
    (pad them with 0).

    Args:
        verdicts (`Tensor`): (B, C) int, +1 PASS, -1 FAIL, 0 NOT_APPLICABLE (credit stage, surviving criteria only).
        citations (`Tensor`): (B, C, K) bool Z (see `draco_citations`).
        adv (`Tensor`): (B,) A.
        turn_valid (`Tensor`): (B, K) bool.
        strict (`bool`): D18's all-or-nothing step quality instead of Eq. 4's pass ratio.

    Returns:
        `tuple[Tensor, Tensor]`: w (B, K) float64 in [0, 1], 0 off the row's turns; `cited` (B,) bool, false where no
        valid step is cited (then Q̄ is undefined and the row falls back, Eq. 9).

    >>> w, cited = draco_step_weights(torch.tensor([[1, -1]]), torch.tensor([[[1, 1, 0], [0, 1, 0]]]).bool(),
    ...                               torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool))
    >>> w.tolist(), cited.tolist()  # Q = [1, 1/2, mean(1, 1/2) = 3/4]
    ([[1.0, 0.5, 0.75]], [True])
    """
    valid = turn_valid.bool()  # (B, K)
    z = citations.bool() & valid.unsqueeze(1)  # (B, C, K)
    P = ((verdicts == 1).unsqueeze(2) & z).sum(dim=1).to(torch.float64)  # (B, K) Eq. 4
    F = ((verdicts == -1).unsqueeze(2) & z).sum(dim=1).to(torch.float64)  # (B, K) Eq. 4
    hit = (P + F) > 0  # (B, K) cited steps
    q = (F == 0).to(torch.float64) if strict else P / (P + F).clamp(min=1.0)  # (B, K) D18 or Eq. 4
    q = torch.where(hit, q, 0.0)
    n_hit = hit.sum(dim=1)  # (B,)
    q_bar = q.sum(dim=1) / n_hit.clamp(min=1)  # (B,) Eq. 5
    q = torch.where(hit, q, q_bar.unsqueeze(1))  # Eq. 5: uncited steps get the mean
    w = torch.where(adv.to(torch.float64).unsqueeze(1) >= 0, q, 1.0 - q)  # Eq. 6: winner Q, loser 1 - Q
    return torch.where(valid, w, 0.0), n_hit > 0


@torch.no_grad()
def draco_advantages(
    adv: Tensor,
    turn_index: Tensor,
    turn_valid: Tensor,
    verdicts: Tensor,
    citations: Tensor,
    row_fallback: Tensor | None = None,
    reasons: list[str | None] | None = None,
    strict: bool = False,
) -> CreditOutput:
    """DRACO's per-token advantages, draco.md Eq. 4-9, through the shared interface (Eq. I-4 then Eq. I-2):
    a_j = A · N · w_j / (n_j · Σ_k w_k) on every loss token of step j (Eq. 7), 0 on tokens in no step.

    Fallback to the plain GRPO broadcast (Eq. 9, conventions.md C8), with the reason logged: the producer's rows
    (`row_fallback`, e.g. `judge_failure`, `group_skipped`); no valid step cited (`no_citation`); Σw = 0
    (`zero_weight_sum`: a winner cited only by FAILs, a loser cited only by PASSes). Rows with A = 0 are exact zeros
    (G5; draco.md D10 skips their credit call), and are not counted as fallbacks. Equal weights give equal step
    totals A·N/K_b, not the uniform A (P2, D13). a(c·A) = c·a(A) holds for c > 0 (C11).

    Args:
        adv (`Tensor`): (B,) A from TRL.
        turn_index (`Tensor`): (B, T).
        turn_valid (`Tensor`): (B, K) bool.
        verdicts (`Tensor`): (B, C) credit-stage verdicts in {-1, 0, 1} over the surviving criteria.
        citations (`Tensor`): (B, C, K) bool.
        row_fallback (`Tensor`, *optional*): (B,) bool rows the producer already sends to fallback.
        reasons (`list[str | None]`, *optional*): their reason codes.
        strict (`bool`): D18's step quality (see `draco_step_weights`).

    Returns:
        `CreditOutput` with the token-sum residual of P1.
    """
    B, K = turn_valid.shape
    n = turn_token_counts(turn_index, K)  # (B, K) Eq. I-5
    w, cited = draco_step_weights(verdicts, citations, adv, turn_valid, strict)  # (B, K) Eq. 4-6
    m, zero = token_budget_multipliers(w, n, turn_valid)  # (B, K) Eq. 8 = Eq. I-4
    fb = torch.zeros(B, dtype=torch.bool, device=adv.device) if row_fallback is None else row_fallback.bool().clone()
    why = [None] * B if reasons is None else list(reasons)
    active = adv != 0  # A = 0 rows are zeros whatever the weights (G5)
    m = torch.where(active.unsqueeze(1), m, 1.0)  # ... so they keep neutral multipliers (no zero-sum artefact)
    for b in range(B):
        if bool(fb[b]) or not bool(active[b]) or int(n[b].sum()) == 0:
            continue
        if not bool(cited[b]):
            fb[b], why[b] = True, "no_citation"  # Eq. 9: Q̄ undefined
        elif bool(zero[b]):
            fb[b], why[b] = True, "zero_weight_sum"  # Eq. 9 / C8
    return redistribute_multiplicative(adv, turn_index, m, turn_valid, fb, why, n)  # Eq. 7 = A · m (Eq. I-2)


# ---------------------------------------------------------------------------------------------------------------------
# The judge and the trainer


def build_judge(args: DRACOConfig, datasets: list) -> BaseJudge:
    """The judge named by `args.judge_backend`; the oracle learns the tasks of the `task` column of `datasets`."""
    if args.judge_backend == "oracle":
        tasks = [t for ds in datasets if ds is not None and "task" in (ds.column_names or []) for t in ds["task"]]
        if not tasks:
            raise ValueError("judge_backend 'oracle' needs a train_dataset with a `task` column (built-in env tasks)")
        return OracleJudge(tasks)
    if args.judge_backend == "openai":
        return Judge(JUDGE.judge_config(args, votes=args.judge_votes))
    return LocalModelJudge(  # model and tokenizer are attached once the trainer has loaded them
        None,
        None,
        temperature=args.judge_temperature,
        top_p=0.95,
        max_new_tokens=args.judge_max_tokens,
        timeout=args.judge_timeout,
        votes=args.judge_votes,
        chat_template_kwargs={"enable_thinking": True},  # §4.5: thinking on in every phase
    )


class DRACOTrainer(AgentGRPOTrainer):
    """DRACO on the agent GRPO base; see the module docstring. `judge` (keyword-only) overrides the one built from the
    config; the other parameters are the base's, in TRL's order."""

    config_class = DRACOConfig

    def __init__(
        self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None, *rest, judge=None, **kw
    ):
        args = self.as_config(args, model)  # the judge and the reward are built from it before the base's __init__
        judge = judge if judge is not None else build_judge(args, [train_dataset, eval_dataset])
        self.pipeline = RubricPipeline(
            judge,
            concurrency=args.judge_concurrency,
            step_deadline_s=args.judge_step_deadline,
            stage_retries=args.judge_stage_retries,
            observation_chars=args.credit_observation_chars,
            protocol_notes=args.protocol_notes,
            judge_id=f"{args.judge_backend}:{args.judge_model or ''}",  # the S1 cache's judge identity (D9)
            essential_gate=args.draco_essential_gate,  # D19
        )
        per_step = args.judge_backend == "self"  # D9: the self-judge changes every step, so S1 is regenerated
        self.draco_reward = DracoReward(self.pipeline, args.num_generations, per_step_identity=per_step)
        reward_funcs = [self.draco_reward, *(reward_funcs or [])]
        super().__init__(model, reward_funcs, args, train_dataset, eval_dataset, *rest, **kw)
        self.credit = None  # the latest batch's `CreditOutput` (fallback flags, reasons, multipliers), for inspection
        if isinstance(judge, LocalModelJudge) and judge.model is None:  # self-judge: the policy judges itself
            judge.model, judge.tokenizer = self.model, self.processing_class

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        records = self.draco_reward.last
        if len(records) != len(batch.rows):
            raise RuntimeError(f"DRACO has {len(records)} reward records for {len(batch.rows)} rows")
        adv, device = batch.advantages, batch.advantages.device  # (B,)
        if not self.args.draco_credit:  # the "dynamic rubric, no credit" ablation: A on every token
            self._log_judge()
            return super().compute_advantages(batch)
        B, K = batch.turn_valid.shape
        fallback = torch.zeros(B, dtype=torch.bool, device=device)
        reasons: list[str | None] = [None] * B
        todo = []
        for b, r in enumerate(records):
            if r.group_scored < 2:  # D8: A = 0 for the whole group
                fallback[b], reasons[b] = True, "group_skipped"
            elif adv[b] != 0 and r.verdicts is not None:  # D10: no credit call when A = 0
                todo.append(b)
        rows = [records[b] for b in todo]
        results = self.pipeline.credit_many([(r.task, r.transcript, r.criteria, r.verdicts, r.evidence) for r in rows])
        C = max((len(r.criteria) for r in records), default=0)
        verdicts = torch.zeros(B, C, dtype=torch.long, device=device)  # (B, C) credit-stage verdicts
        steps: list[list[list[int]]] = [[] for _ in range(B)]
        for b, res in zip(todo, results, strict=True):
            if res is None:
                fallback[b], reasons[b] = True, "judge_failure"  # Eq. 9
                continue
            verdicts[b, : len(res.verdicts)] = torch.tensor(res.verdicts, dtype=torch.long)
            steps[b] = res.steps
        citations = draco_citations(steps, K, C).to(device)  # (B, C, K), C9
        strict = self.args.draco_step_quality == "strict"  # D18
        out = draco_advantages(adv, batch.turn_index, batch.turn_valid, verdicts, citations, fallback, reasons, strict)
        self.credit = out
        self._log_draco(out, batch, verdicts, citations, todo, results)
        return out.advantages  # (B, T)

    def _log_draco(self, out, batch: RolloutBatch, verdicts, citations, todo, results) -> None:
        nan = float("nan")
        for name, value in credit_metrics(out, batch.advantages, batch.turn_index, batch.turn_valid).items():
            self.log_metric(name, value)
        done = [r for r in results if r is not None]
        judged = sum(len(r.verdicts) for r in done)
        self.log_metric("draco/override_rate", sum(r.overrides for r in done) / judged if judged else nan)
        credited = torch.zeros(len(batch.rows), dtype=torch.bool, device=verdicts.device)  # (B,) rows sent to credit
        credited[todo] = True
        n = turn_token_counts(batch.turn_index, batch.turn_valid.shape[1])  # (B, K)
        live = batch.turn_valid.bool() & (n > 0)
        totals = out.values * n  # (B, K) step totals / A; all equal = inert (P2)
        spread = torch.where(live, totals, -math.inf).amax(1) - torch.where(live, totals, math.inf).amin(1)
        inert = out.fallback | (spread <= 1e-9 * n.sum(1))
        self.log_metric("draco/credit_inert_rate", float(inert[credited].double().mean()) if todo else nan)
        cites = ((verdicts != 0).unsqueeze(2) & citations).sum(1)  # (B, K) PASS/FAIL verdicts citing step j
        steps = cites[live & credited.unsqueeze(1)].double()  # over the steps of credited rows
        self.log_metric("draco/citations_per_step_mean", float(steps.mean()) if steps.numel() else nan)
        self.log_metric("draco/uncited_step_frac", float((steps == 0).double().mean()) if steps.numel() else nan)
        self.log_metric("draco/zero_adv_rate", float((batch.advantages == 0).double().mean()))
        self._log_judge()

    def _log_judge(self) -> None:
        metrics = {**self.pipeline.judge.metrics(prefix="draco/judge_", reset=True), **self.pipeline.metrics()}
        for name, value in metrics.items():
            self.log_metric(name, value)
