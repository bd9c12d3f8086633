"""Experience Funnel: a textual state edited on a fast clock and gated, distilled into the weights on a slow one;
https://arxiv.org/abs/2609.08919, docs/methods/funnel.md.

The method is a loop of phases (`trainers/funnel_loop.py` runs it); this file holds its math and the one phase that
takes gradient steps, consolidation. Changes relative to GRPO during consolidation:
1. The prompts stay state-free; GRPO runs on them unchanged (Eq. 8).
2. Rows of tasks on which the state helps (three-state selection, Eq. 1-3: weight 1 if the state became useful, α if
   it stays useful, 0 otherwise) also get a full-vocabulary reverse KL towards a frozen teacher, a snapshot of the
   policy taken when consolidation starts, reading the state (Eq. 6-7).
3. Inside those rows, tokens whose next-token distribution the state moves most (JSD between the teacher with and
   without the state, Eq. 4) weigh more (Eq. 5).
4. The objective is (1 − λ_d)·GRPO + λ_d·distillation (Eq. 9).

This file reads top to bottom: `FunnelConfig`, the pure math (`benefit`, `transition_weights`, `selection_weights`,
`jsd_per_token`, `token_weights`, `reverse_kl_per_token`, `weighted_distill_loss`, `consolidation_loss`,
`paired_gate`, `# Eq. N` on the implementing lines), then `FunnelTrainer`.

Logged metrics (`funnel/`, funnel.md §8) per generation batch: `selected_frac` (rows with c > 0), `jsd_mean`,
`jsd_median`, `jsd_p95`, `omega_mean`, `omega_at_max_frac`, `teacher_forward_seconds`; per micro-batch
`distill_loss`, `kl_mean` (selected rows), `rl_loss`.

Decision ids (`Dn`) without a page are docs/methods/funnel.md's.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rewards.judge import APIModelFields
from trainers.agent_loop import render_prompt_ids
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, RolloutBatch
from trainers.generation import left_padded
from trainers.teacher import POSITIONS, with_privileged_block
from trainers.trl_api import chunked_divergence, use_adapter

logger = logging.getLogger(__name__)

TOKEN_WEIGHT_MODES = ("linear_norm", "none", "topk_frac")
RESIDUAL_MODES = ("editor", "leave_one_out", "off")
EDITORS = ("card", "openai")
# the 'openai' editor's endpoint fields `editor_model`, ..., as FunnelConfig declares them
EDITOR = APIModelFields(
    "editor",
    ("model", "base_url", "api_key_env", "cache_path", "timeout", "max_retries"),
    selector="editor",
    defaults={"timeout": 120.0},
    help={
        "model": "Model id at the endpoint ('openai' editor).",
        "cache_path": "sqlite3 cache of editor answers; None: <output_dir>/editor_cache.sqlite.",
        "timeout": "Seconds per editor request attempt.",
        "max_retries": "Transport re-sends after a failed request (§4.3).",
    },
)


@dataclass
class FunnelConfig(AgentGRPOConfig):
    """AgentGRPOConfig plus the Funnel's loop, gates, editor and consolidation (`docs/methods/funnel.md` §5).
    `max_steps` is the length of one consolidation (`consolidation_steps` of the paper's loop); a fresh optimizer and
    schedule start at every consolidation (D15). Changed default: `loss_type="grpo"` (conventions.md C22). The
    editor's endpoint fields (`editor_model`, ..., `editor_max_retries`) follow `editor`; `EDITOR` builds the editor
    from them."""

    loss_type: str = field(default="grpo", metadata={"help": "TRL's loss aggregation for the GRPO part (Eq. 8)."})
    # the loop
    rounds: int = field(default=5, metadata={"help": "R: state rounds of the loop (§4.2)."})
    consolidate_every: int = field(
        default=2, metadata={"help": "K_c: consolidate after every K_c rounds, at the last round, and when the state "
                             "outgrows state_token_budget (D6)."}
    )  # fmt: skip
    collect_tasks: int = field(default=32, metadata={"help": "n_collect: training tasks of the editor's evidence."})
    collect_rollouts: int = field(default=2, metadata={"help": "Rollouts per evidence task (§4.2 step 1)."})
    selection_tasks: int = field(default=64, metadata={"help": "Training tasks of the three-state selection."})
    selection_rollouts: int = field(default=4, metadata={"help": "n: paired rollouts per task and condition (Eq. 1)."})
    gate_tasks: int = field(default=64, metadata={"help": "|D_sel|: selection-validation tasks of every gate."})
    gate_rollouts: int = field(default=2, metadata={"help": "Paired rollouts per gate task and condition (Eq. 10)."})
    gate_z: float = field(default=1.0, metadata={"help": "z of the gates (Eq. 10-11, D5)."})
    benefit_margin: float = field(default=0.0, metadata={"help": "δ_b of Eq. 2 (strict >)."})
    alpha: float = field(default=0.5, metadata={"help": "Weight of persistently useful tasks (Eq. 3, D1)."})
    consolidation_pool: str = field(
        default="train",
        metadata={
            "help": "Tasks a consolidation trains on: 'train' (every training task; those outside the selection pool "
            "get GRPO only, D14) or 'selection' (the selection pool alone)."
        },
    )
    residual_mode: str = field(
        default="leave_one_out",
        metadata={"help": f"Residual pruning after an accepted consolidation: one of {RESIDUAL_MODES} (D7)."},
    )
    # the state and its editor
    editor: str = field(
        default="card",
        metadata={
            "help": "Who proposes state edits: 'card' (deterministic: the common action skeleton of successful "
            "evidence rollouts per task family, docs/methods/funnel.md D19) or 'openai' (an API model through the "
            "judge layer, rewards/judge.py)."
        },
    )
    # the editor's endpoint (`editor: openai`), read by EDITOR.judge_config; held to
    # EDITOR by tests/test_judge.py
    editor_model: str | None = field(default=None, metadata={"help": "Model id at the endpoint ('openai' editor)."})
    editor_base_url: str | None = field(default=None, metadata={"help": "OpenAI-compatible base URL; None: OpenAI."})
    editor_api_key_env: str = field(default="OPENAI_API_KEY", metadata={"help": "Env variable holding the API key."})
    editor_cache_path: str | None = field(
        default=None, metadata={"help": "sqlite3 cache of editor answers; None: <output_dir>/editor_cache.sqlite."}
    )
    editor_timeout: float = field(default=120.0, metadata={"help": "Seconds per editor request attempt."})
    editor_max_retries: int = field(default=2, metadata={"help": "Transport re-sends after a failed request (§4.3)."})
    editor_evidence_rollouts: int = field(default=16, metadata={"help": "Rollouts shown to the editor (balanced)."})
    max_entries: int = field(default=8, metadata={"help": "Most entries of the state."})
    max_entry_chars: int = field(default=300, metadata={"help": "Longest entry text."})
    max_ops_per_round: int = field(default=4, metadata={"help": "Most edit operations applied per round."})
    state_token_budget: int = field(default=256, metadata={"help": "Most tokens of the rendered state."})
    state_position: str = field(
        default="system_end", metadata={"help": f"Where the state block goes: one of {POSITIONS} (D13)."}
    )
    # consolidation
    distillation_weight: float = field(default=0.5, metadata={"help": "λ_d of Eq. 9 (D12)."})
    token_weight_mode: str = field(
        default="linear_norm", metadata={"help": f"JSD → token weight (Eq. 5): one of {TOKEN_WEIGHT_MODES} (D2)."}
    )
    token_weight_kappa: float = field(default=1.0, metadata={"help": "κ of Eq. 5."})
    token_weight_max: float = field(default=5.0, metadata={"help": "ω_max of Eq. 5."})
    token_weight_topk: float = field(default=0.2, metadata={"help": "q of the `topk_frac` mode."})
    distill_temperature: float = field(default=1.0, metadata={"help": "τ of Eq. 4 and Eq. 6."})
    teacher_rows_per_forward: int = field(default=8, metadata={"help": "Rows per teacher forward (memory)."})

    def __post_init__(self):
        super().__post_init__()
        for name, value, allowed in [
            ("token_weight_mode", self.token_weight_mode, TOKEN_WEIGHT_MODES),
            ("residual_mode", self.residual_mode, RESIDUAL_MODES),
            ("editor", self.editor, EDITORS),
            ("state_position", self.state_position, POSITIONS),
            ("consolidation_pool", self.consolidation_pool, ("train", "selection")),
        ]:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("rounds", "consolidate_every", "collect_tasks", "collect_rollouts", "selection_rollouts",
                     "gate_rollouts", "editor_evidence_rollouts", "max_entries", "max_entry_chars",
                     "max_ops_per_round", "state_token_budget", "teacher_rows_per_forward"):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("selection_tasks", "gate_tasks"):  # Eq. 10's standard error needs two tasks
            if getattr(self, name) < 2:
                raise ValueError(f"{name} must be >= 2 (the gates' standard error needs two tasks), got "
                                 f"{getattr(self, name)}")  # fmt: skip
        for name in ("alpha", "distillation_weight", "token_weight_topk"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.gate_z < 0 or self.benefit_margin < 0:
            raise ValueError(f"gate_z and benefit_margin must be >= 0, got {self.gate_z}, {self.benefit_margin}")
        if self.token_weight_max < 1.0 or self.token_weight_kappa < 0:
            raise ValueError("token_weight_max must be >= 1 and token_weight_kappa >= 0")
        if self.distill_temperature <= 0:
            raise ValueError(f"distill_temperature must be > 0, got {self.distill_temperature}")
        EDITOR.check(self)
        if self.max_steps is None or self.max_steps < 1:
            raise ValueError(f"max_steps (optimizer steps per consolidation) must be >= 1, got {self.max_steps}")


# ---------------------------------------------------------------------------------------------------------------------
# Pure math (funnel.md §4.1)


def benefit(state_rewards, free_rewards, margin: float = 0.0) -> bool:
    """b(x; S, θ) of Eq. 2: the mean reward with the state beats the state-free mean by more than `margin` (strict).
    Means of the n paired rollouts of Eq. 1.

    >>> benefit([1, 0], [0, 0]), benefit([1, 0], [0, 1])
    (True, False)
    """
    if len(state_rewards) == 0 or len(free_rewards) == 0:
        raise ValueError("benefit needs at least one rollout per condition")
    gap = sum(state_rewards) / len(state_rewards) - sum(free_rewards) / len(free_rewards)  # Eq. 1
    return gap > margin  # Eq. 2


def transition_weights(b_prev: dict, b_new: dict, alpha: float) -> dict:
    """c(x) of Eq. 3 for every task of `b_new`: (0, 1) → 1, (1, 1) → α, (1, 0) and (0, 0) → 0. A task missing from
    `b_prev` has b_prev = 0 (the empty previous state, D9)."""
    table = {(False, True): 1.0, (True, True): alpha, (True, False): 0.0, (False, False): 0.0}  # Eq. 3
    return {x: table[(bool(b_prev.get(x, False)), bool(b))] for x, b in b_new.items()}


def selection_weights(rewards: dict, alpha: float, margin: float = 0.0, prev_is_empty: bool = False) -> dict:
    """The three-state selection (Eq. 1-3): `rewards[x]` maps the conditions "free" (∅), "prev" (S_prev) and "new"
    (S_k) to the n paired rewards of task x. With an empty S_prev, b_prev = 0 by definition (Eq. 2). Independent of
    the order of `rewards` (the result is keyed by task)."""
    b_new = {x: benefit(r["new"], r["free"], margin) for x, r in rewards.items()}
    b_prev = {} if prev_is_empty else {x: benefit(r["prev"], r["free"], margin) for x, r in rewards.items()}
    return transition_weights(b_prev, b_new, alpha)


def _kl_terms(logp: Tensor, logq: Tensor) -> Tensor:
    """Σ_v p·(log p − log q), with 0·log 0 = 0 (no NaN where p = 0, even against q = 0)."""
    p = logp.exp()
    return torch.where(p > 0, p * (logp - logq), torch.zeros_like(p)).sum(-1)


def jsd_per_token(logp: Tensor, logq: Tensor) -> Tensor:
    """D_t of Eq. 4 from two (..., V) log-softmax outputs: ½·KL(P‖M) + ½·KL(Q‖M), M = ½(P + Q), built in log space;
    in nats, in [0, ln 2]."""
    logm = torch.logaddexp(logp, logq) - math.log(2.0)  # log M
    return 0.5 * _kl_terms(logp, logm) + 0.5 * _kl_terms(logq, logm)  # Eq. 4


def token_weights(
    jsd: Tensor, mask: Tensor, mode: str = "linear_norm", kappa: float = 1.0, omega_max: float = 5.0,
    eps: float = 1e-8, topk: float = 0.2,
) -> Tensor:  # fmt: skip
    """ω of Eq. 5 (B, T), detached, 0 off `mask`. `linear_norm`: clip(1 + κ·D_t / (D̄ + ε), 0, ω_max) with D̄ the
    row's mean over its model tokens, and ω = 1 on a row whose D̄ is 0; `none`: 1; `topk_frac`: min(1 + κ, ω_max) on
    the model tokens whose D is larger than D_(k+1), the (k+1)-th largest D of the row (k = ceil(q·M), M its model
    tokens; every model token when k = M), else 1: the tokens among the k largest however ties are broken. Tokens
    tied at the k-th value across the cut get no bonus (at most k tokens get it), and a row of several tokens whose D
    are all equal gets ω = 1; a row of one model token has k = M = 1, so that token gets the bonus, as Eq. 5 says."""
    m = mask.bool()
    d = torch.where(m, jsd.detach().double(), torch.zeros_like(jsd, dtype=torch.float64))
    ones = torch.ones_like(d)
    if mode == "none":
        omega = ones
    elif mode == "linear_norm":
        count = m.sum(-1, keepdim=True).clamp(min=1)
        mean = d.sum(-1, keepdim=True) / count
        omega = (1.0 + kappa * d / (mean + eps)).clamp(0.0, omega_max)  # Eq. 5
        omega = torch.where(mean > 0, omega, ones)
    elif mode == "topk_frac":
        omega = ones.clone()
        for b in range(d.shape[0]):
            values = d[b][m[b]]  # (M,) the row's model tokens
            if len(values) == 0 or (len(values) > 1 and bool((values == values[0]).all())):
                continue  # no token stands out among several: ω = 1, as linear_norm's D̄ = 0 (D2)
            k = math.ceil(topk * len(values))
            cut = torch.sort(values, descending=True).values[k].item() if k < len(values) else -math.inf  # D_(k+1)
            omega[b, d[b] > cut] = min(1.0 + kappa, omega_max)  # Eq. 5, topk_frac (0 off the mask below)
    else:
        raise ValueError(f"token weight mode must be one of {TOKEN_WEIGHT_MODES}, got {mode!r}")
    return torch.where(m, omega, torch.zeros_like(omega)).to(jsd.dtype)


def reverse_kl_per_token(student_logps: Tensor, teacher_logps: Tensor) -> Tensor:
    """KL_t of Eq. 6 from (..., V) log-softmax outputs: Σ_v π_θ(v)·[log π_θ(v) − log π_T(v)], the gradient through
    the student only (the teacher is detached)."""
    return _kl_terms(student_logps, teacher_logps.detach())  # Eq. 6


def weighted_distill_loss(kl: Tensor, omega: Tensor, c: Tensor, mask: Tensor) -> Tensor:
    """L_distill of Eq. 7: per row ℓ_b = Σ_t ω_t·KL_t / Σ_t ω_t over its model tokens (0 for a row without any), then
    Σ_b c_b·ℓ_b / max(1, #{c_b > 0}). `omega` and `c` are detached; a batch with no selected row gives an exact 0 that
    still backpropagates (a zero gradient)."""
    m = mask.bool()
    w = torch.where(m, omega.detach().to(kl.dtype), torch.zeros_like(kl))
    per_row = (w * torch.where(m, kl, torch.zeros_like(kl))).sum(-1) / w.sum(-1).clamp(min=1e-12)
    c = c.detach().to(kl.dtype)
    return (c * per_row).sum() / max(1, int((c > 0).sum().item()))  # Eq. 7


def consolidation_loss(rl: Tensor, distill: Tensor, weight: float) -> Tensor:
    """Eq. 9: (1 − λ_d)·L_RL + λ_d·L_distill; each end is exactly one of the two losses."""
    if weight <= 0.0:
        return rl
    if weight >= 1.0:
        return distill
    return (1.0 - weight) * rl + weight * distill  # Eq. 9


@dataclass
class GateResult:
    """A gate's decision and the statistics behind it (logged for every gate, D5)."""

    accept: bool
    mean_diff: float  # d̄
    se: float  # std(d_x) / sqrt(|D_sel|)
    candidate: float  # mean reward of the candidate
    incumbent: float  # mean reward of the incumbent
    tasks: int

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("accept", "mean_diff", "se", "candidate", "incumbent", "tasks")}


def paired_gate(candidate, incumbent, z: float = 1.0, mode: str = "improve") -> GateResult:
    """Eq. 10 (`improve`: accept iff d̄ > z·SE and d̄ > 0) or Eq. 11 (`non_inferior`: accept iff d̄ ≥ −z·SE), from
    per-task rewards (|D_sel|, n) of the two conditions on the same tasks with paired seeds. SE uses the sample
    standard deviation of the per-task differences d_x (ddof 1)."""
    cand = torch.as_tensor(candidate, dtype=torch.float64)
    inc = torch.as_tensor(incumbent, dtype=torch.float64)
    if cand.shape != inc.shape or cand.dim() != 2 or cand.shape[0] < 2:
        raise ValueError(f"paired_gate needs two (tasks >= 2, n) reward arrays, got {tuple(cand.shape)} and "
                         f"{tuple(inc.shape)}")  # fmt: skip
    d = cand.mean(1) - inc.mean(1)  # d_x
    mean, se = d.mean().item(), (d.std(unbiased=True) / math.sqrt(len(d))).item()
    if mode == "improve":
        accept = mean > z * se and mean > 0  # Eq. 10
    elif mode == "non_inferior":
        accept = mean >= -z * se  # Eq. 11
    else:
        raise ValueError(f"gate mode must be 'improve' or 'non_inferior', got {mode!r}")
    return GateResult(bool(accept), mean, se, cand.mean().item(), inc.mean().item(), len(d))


# ---------------------------------------------------------------------------------------------------------------------
# The consolidation trainer


class FunnelTrainer(AgentGRPOTrainer):
    """One consolidation (funnel.md §4.2 step 4.3) on the agent GRPO base. The loop sets `selection` ({task_id: c})
    and `state_block(row) -> str | None` (the rendered state for the row's task) before `train()`. The teacher is a
    frozen snapshot of the policy taken here, at construction (`self_frozen`, D3): a second PEFT adapter copied from
    the trained one, or a frozen copy of the whole model without PEFT."""

    config_class = FunnelConfig
    TEACHER_ADAPTER = "funnel_teacher"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.env_factory is None:
            raise ValueError("the Funnel needs an environment: the teacher reads the rollouts' own prompt messages")
        self.selection: dict = {}
        self.state_block = lambda row: None
        self.teacher_model = None
        if self.args.distillation_weight > 0:
            self._snapshot_teacher()

    def _snapshot_teacher(self) -> None:
        unwrapped = self.accelerator.unwrap_model(self.model)
        if hasattr(unwrapped, "peft_config"):
            from peft import get_peft_model_state_dict, set_peft_model_state_dict

            if self.TEACHER_ADAPTER in unwrapped.peft_config:
                unwrapped.delete_adapter(self.TEACHER_ADAPTER)
            active = unwrapped.active_adapter
            unwrapped.add_adapter(self.TEACHER_ADAPTER, copy.deepcopy(unwrapped.peft_config[active]))
            state = get_peft_model_state_dict(unwrapped, adapter_name=active)
            set_peft_model_state_dict(unwrapped, state, adapter_name=self.TEACHER_ADAPTER)
            unwrapped.set_adapter(active)  # add_adapter may not switch, but keep the trained one active for certain
            for name, p in unwrapped.named_parameters():
                if f".{self.TEACHER_ADAPTER}." in name:
                    p.requires_grad_(False)
            return
        teacher = copy.deepcopy(unwrapped)
        teacher.requires_grad_(False)
        self.teacher_model = teacher.eval()

    def drop_teacher(self) -> None:
        """Remove the teacher (its adapter from the policy, or the frozen copy) after the consolidation."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        if hasattr(unwrapped, "peft_config") and self.TEACHER_ADAPTER in unwrapped.peft_config:
            unwrapped.delete_adapter(self.TEACHER_ADAPTER)
        self.teacher_model = None

    def _teacher_context(self):
        """(module to call, context) for a teacher forward."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        if hasattr(unwrapped, "peft_config"):
            return unwrapped, use_adapter(unwrapped, adapter_name=self.TEACHER_ADAPTER)
        return self.teacher_model, nullcontext()

    # -- hidden states and divergences -------------------------------------------------------------------------------
    @staticmethod
    def _backbone_and_head(model):
        """The decoder stack without its LM head, and the head (TRL's DistillationTrainer does the same)."""
        if hasattr(model, "peft_config"):
            model = model.base_model.model
        return model.base_model, model.get_output_embeddings()

    def _hidden(self, model, prompt_ids: Tensor, prompt_mask: Tensor, ids: Tensor, cmask: Tensor) -> Tensor:
        """(rows, T, H) last hidden states at the positions that predict each completion token."""
        backbone, _ = self._backbone_and_head(model)
        input_ids = torch.cat([prompt_ids, ids], dim=1)
        attention = torch.cat([prompt_mask, cmask], dim=1)
        with self.free_routing():
            hidden = backbone(input_ids=input_ids, attention_mask=attention, use_cache=False).last_hidden_state
        P, T = prompt_ids.shape[1], ids.shape[1]
        return hidden[:, P - 1 : P - 1 + T]

    def _divergence(self, hidden_s: Tensor, head_s, hidden_t: Tensor, head_t, beta: float) -> Tensor:
        """Per-token divergence (N,) between the two models' next-token distributions at temperature τ, through TRL's
        chunked kernel (no (N, V) logits); β = 1 is the reverse KL(student ‖ teacher), 0.5 the JSD."""
        return chunked_divergence(hidden_s, head_s, hidden_t, head_t, beta, self.args.distill_temperature)

    def _teacher_prompts(self, rows: list[dict], blocks: list[str]) -> list[list[int]]:
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        return [
            render_prompt_ids(
                tok, with_privileged_block(row["prompt_messages"], block, self.args.state_position),
                row.get("prompt_tools"),
            )
            for row, block in zip(rows, blocks, strict=True)
        ]  # fmt: skip

    # -- hook 1: weights and teacher inputs --------------------------------------------------------------------------
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        """GRPO's advantages unchanged (Eq. 8); adds c (B,), ω (B, T) and the teacher prompts to the batch."""
        B, T = batch.completion_ids.shape
        device = batch.completion_ids.device
        c = torch.tensor([float(self.selection.get(t, 0.0)) for t in batch.task_ids], device=device)
        blocks = [self.state_block(row) if c[b] > 0 else None for b, row in enumerate(batch.rows)]
        c = torch.where(torch.tensor([bool(x) for x in blocks], device=device), c, torch.zeros_like(c))
        omega = torch.zeros(B, T, device=device)
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        picked = (c > 0).nonzero().flatten().tolist()
        teacher_prompts = [[pad_id] for _ in range(B)]
        seconds, jsd_all = 0.0, []
        if self.args.distillation_weight > 0 and picked:
            start = time.perf_counter()
            prompts = self._teacher_prompts([batch.rows[b] for b in picked], [blocks[b] for b in picked])
            for b, p in zip(picked, prompts, strict=True):
                teacher_prompts[b] = p
            jsd = self._attribution(batch, picked, prompts, pad_id)  # Eq. 4, (len(picked), T)
            mask = batch.mask[picked]
            omega[picked] = token_weights(
                jsd, mask, self.args.token_weight_mode, self.args.token_weight_kappa, self.args.token_weight_max,
                topk=self.args.token_weight_topk,
            ).float()  # fmt: skip  # Eq. 5
            jsd_all = jsd[mask.bool()]
            seconds = time.perf_counter() - start
        teacher_ids, teacher_mask = left_padded(teacher_prompts, pad_id, device)
        batch.extras.update(funnel_c=c, funnel_omega=omega, teacher_prompt_ids=teacher_ids,
                            teacher_prompt_mask=teacher_mask)  # fmt: skip
        self._log_batch(c, omega, batch.mask, jsd_all, seconds)
        return super().compute_advantages(batch)

    @torch.no_grad()
    def _attribution(self, batch: RolloutBatch, picked: list[int], prompts: list[list[int]], pad_id: int) -> Tensor:
        """D (rows, T) of Eq. 4: the teacher's JSD with and without the state at every completion position (D10)."""
        model, context = self._teacher_context()
        _, head = self._backbone_and_head(model)
        out = []
        size = self.args.teacher_rows_per_forward
        was_training = model.training
        model.eval()
        try:
            with context:
                for lo in range(0, len(picked), size):
                    rows = picked[lo : lo + size]
                    ids, cmask = batch.completion_ids[rows], batch.completion_mask[rows]
                    keep = [batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist() for b in rows]
                    plain_ids, plain_mask = left_padded(keep, pad_id, ids.device)
                    state_ids, state_mask = left_padded(prompts[lo : lo + size], pad_id, ids.device)
                    h_state = self._hidden(model, state_ids, state_mask, ids, cmask)
                    h_plain = self._hidden(model, plain_ids, plain_mask, ids, cmask)
                    n, T, H = h_state.shape
                    d = self._divergence(h_state.reshape(-1, H), head, h_plain.reshape(-1, H), head, 0.5)
                    out.append(d.view(n, T) * cmask)
        finally:
            model.train(was_training)
        return torch.cat(out)

    # -- hook 2: the loss --------------------------------------------------------------------------------------------
    def policy_loss(self, model, inputs: dict) -> Tensor:
        lam = self.args.distillation_weight
        rl = super().policy_loss(model, inputs) if lam < 1.0 else None
        if lam <= 0.0:
            return rl  # Eq. 9 at λ_d = 0: GRPO's loss, nothing else runs
        distill = self.distill_loss(model, inputs)
        if rl is not None:
            self.log_metric("funnel/rl_loss", rl.item())
        return consolidation_loss(rl if rl is not None else distill, distill, lam)  # Eq. 9

    def distill_loss(self, model, inputs: dict) -> Tensor:
        """Eq. 6-7 on the micro-batch, divided by the gradient-accumulation steps as TRL divides its loss."""
        c = inputs["funnel_c"]
        rows = (c > 0).nonzero().flatten()
        if len(rows) == 0:  # D14: no selected row, an exact 0 with a (zero) gradient
            p = next(q for q in model.parameters() if q.requires_grad)
            return p.sum() * 0.0
        ids, cmask = inputs["completion_ids"][rows], inputs["completion_mask"][rows]
        mask = self.loss_mask(inputs)[rows]
        unwrapped = self.accelerator.unwrap_model(model)
        h_student = self._hidden(unwrapped, inputs["prompt_ids"][rows], inputs["prompt_mask"][rows], ids, cmask)
        teacher, context = self._teacher_context()
        with torch.no_grad(), context:
            was_training = teacher.training
            teacher.eval()
            h_teacher = self._hidden(teacher, inputs["teacher_prompt_ids"][rows], inputs["teacher_prompt_mask"][rows],
                                     ids, cmask)  # fmt: skip
            teacher.train(was_training)
        _, head_s = self._backbone_and_head(unwrapped)
        _, head_t = self._backbone_and_head(teacher)
        n, T, H = h_student.shape
        kl = self._divergence(h_student.reshape(-1, H), head_s, h_teacher.reshape(-1, H), head_t, 1.0).view(n, T)
        loss = weighted_distill_loss(kl, inputs["funnel_omega"][rows], c[rows], mask)  # Eq. 7
        m = mask.bool()
        self.log_metric("funnel/kl_mean", kl[m].mean().item() if m.any() else math.nan)
        self.log_metric("funnel/distill_loss", loss.item())
        ga = getattr(self, "current_gradient_accumulation_steps", self.args.gradient_accumulation_steps)
        scale = ga if self.model.training else 1.0
        return loss / scale

    def _log_batch(self, c: Tensor, omega: Tensor, mask: Tensor, jsd: Tensor, seconds: float) -> None:
        nan = math.nan
        selected = mask.bool() & (c > 0).unsqueeze(1)
        metrics = {
            "selected_frac": (c > 0).double().mean().item(),
            "teacher_forward_seconds": seconds,
            "omega_mean": omega[selected].mean().item() if selected.any() else nan,
            "omega_at_max_frac": (omega[selected] >= self.args.token_weight_max - 1e-6).double().mean().item()
            if selected.any()
            else nan,
        }
        if len(jsd):
            j = jsd.double()
            metrics.update(jsd_mean=j.mean().item(), jsd_median=j.median().item(),
                           jsd_p95=torch.quantile(j, 0.95).item())  # fmt: skip
        for name, value in metrics.items():
            self.log_metric(f"funnel/{name}", value)
