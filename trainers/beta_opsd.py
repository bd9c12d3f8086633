"""β-OPSD: on-policy self-distillation towards a scheduled interpolant between the current student and a fixed
teacher that reads privileged context, with return-to-go credit; https://arxiv.org/abs/2607.28582,
docs/methods/beta-opsd.md.

Changes relative to GRPO:
1. No verifier is needed: each model token gets a dense advantage A_t = −G_t, where G_t is the discounted sum of the
   token mismatches ρ (student log-prob minus target log-prob) from t to the end of the episode (Eq. 7-8).
2. The target is not the teacher but an interpolant between the current student (the reference) and the teacher,
   with a teacher weight w that rises on a linear schedule, 0.5 → 0.8 (Eq. 4-6). w = 1 is vanilla on-policy
   self-distillation (OPSD); w = 0 is the reference, i.e. no signal.
3. The teacher is the initial policy (the PEFT adapter disabled, or a frozen copy of the initial weights) reading the
   task's privileged text (`Env.privileged`: the expert's plan on the built-in environments, or a dataset column) in
   the first user message (teacher-pass.md D7). One extra no-grad forward per generation batch.
4. Optionally (λ_d < 1) the distillation advantage is blended with GRPO's sequence advantage (Eq. 10).

Unchanged: sampling, the agent loop, TRL's loss (with `num_iterations = 1` and `beta = 0` its gradient at the rollout
point is exactly Eq. 9's, under `loss_type: grpo`, the default here). Only `compute_advantages` is overridden.

This file reads top to bottom: `BetaOPSDConfig`, the pure math (`teacher_weight`, `mixture_target_logps`,
`geometric_target_logps`, `token_mismatch`, `reward_to_go`, `beta_opsd_loss`, `blend_advantages`, `# Eq. N` on the
implementing lines), then `BetaOPSDTrainer`.

Logged metrics (`beta_opsd/`, beta-opsd.md §8): `teacher_weight`, `beta`, `rho_mean`, `seq_kl_mean`,
`rho_pos_frac`, `rtg_mean`, `rtg_abs_max`, `rtg_std`, `teacher_student_logratio_mean`, `logZ_mean` (`logit_full`),
`adv_at_lower_bound_frac` (`prob_sampled`), `model_tokens_per_seq`, `env_tokens_per_seq`, `privileged_frac` (rows
with a privileged text), `teacher_forward_seconds`, and with λ_d < 1 `grpo_part_abs_mean`, `distill_part_abs_mean`.

Decision ids (`Dn`) without a page are docs/methods/beta-opsd.md's.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trainers.agent_loop import render_prompt_ids
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, RolloutBatch
from trainers.generation import left_padded
from trainers.teacher import POSITIONS, initial_context, plain_logps, teacher_logps, with_privileged_block
from trainers.trl_api import (
    add_fused_lm_head,
    attn_implementation,
    create_model_from_path,
    disable_dropout_in_model,
    get_config_model_id,
)

logger = logging.getLogger(__name__)

TARGET_SPACES = ("prob_sampled", "logit_full")
REFERENCES = ("current_student", "frozen_initial")
TEACHERS = ("fixed", "current")
RTG_SCOPES = ("trajectory", "turn")


@dataclass
class BetaOPSDConfig(AgentGRPOConfig):
    """AgentGRPOConfig plus β-OPSD (`docs/methods/beta-opsd.md` §5). Changed defaults: `loss_type="grpo"` (D4)."""

    loss_type: str = field(
        default="grpo", metadata={"help": "TRL's loss aggregation; 'grpo' is the per-sequence mean of Eq. 9 (D4)."}
    )
    teacher_weight_start: float = field(default=0.5, metadata={"help": "w at the first step (Eq. 4); β = 1/w."})
    teacher_weight_end: float = field(default=0.8, metadata={"help": "w at the end of the schedule (Eq. 4)."})
    schedule_steps: int | None = field(
        default=None, metadata={"help": "K of Eq. 4, the steps over which w moves; None: max_steps (D10)."}
    )
    target_space: str = field(
        default="prob_sampled",
        metadata={
            "help": "'prob_sampled': the probability mixture of the sampled token (Eq. 6, default, D1); 'logit_full': "
            "the normalised geometric interpolant over the whole vocabulary (Eq. 5), one more full-logit pass."
        },
    )
    opsd_reference: str = field(
        default="current_student",
        metadata={"help": "The interpolant's other end: 'current_student' (D2) or 'frozen_initial'."},
    )
    opsd_teacher: str = field(
        default="fixed",
        metadata={"help": "'fixed': the initial policy reads the privileged text (D3); 'current': the student does."},
    )
    opsd_privileged: str = field(
        default="env",
        metadata={
            "help": "The teacher's privileged text: 'env' (the environment's `privileged(task)`, the expert's plan "
            "on the built-in ones) or 'column:<name>' (a dataset column)."
        },
    )
    opsd_position: str = field(
        default="first_user_after_task", metadata={"help": f"Where the text goes: one of {POSITIONS} (D8)."}
    )
    rtg: bool = field(default=True, metadata={"help": "Return-to-go credit (Eq. 8); False: the local ρ_t itself."})
    rtg_gamma: float = field(default=0.99, metadata={"help": "γ of the return-to-go (Eq. 8)."})
    rtg_scope: str = field(
        default="trajectory", metadata={"help": "'trajectory' (Eq. 13 holds) or 'turn' (the sum stops at the turn)."}
    )
    distillation_weight: float = field(
        default=1.0, metadata={"help": "λ_d of Eq. 10: 1 is pure β-OPSD (rewards only logged), 0 is plain GRPO."}
    )
    advantage_clip: float | None = field(
        default=None, metadata={"help": "Clamp G to [-a, a] after the return-to-go (D17); None: no clip."}
    )
    logz_chunk_rows: int = field(
        default=4, metadata={"help": "Rows per full-vocabulary forward for 'logit_full' (memory: rows x T x V)."}
    )

    def __post_init__(self):
        super().__post_init__()
        for name, value, allowed in [
            ("target_space", self.target_space, TARGET_SPACES),
            ("opsd_reference", self.opsd_reference, REFERENCES),
            ("opsd_teacher", self.opsd_teacher, TEACHERS),
            ("opsd_position", self.opsd_position, POSITIONS),
            ("rtg_scope", self.rtg_scope, RTG_SCOPES),
        ]:
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        for name in ("teacher_weight_start", "teacher_weight_end", "rtg_gamma", "distillation_weight"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.num_iterations != 1:  # D14
            raise ValueError(f"β-OPSD is on-policy: num_iterations must be 1, got {self.num_iterations} (D14)")
        if self.beta != 0.0:  # D13
            raise ValueError(f"beta (GRPO's KL coefficient) must be 0 for β-OPSD (D13), got {self.beta}")
        if not (self.opsd_privileged == "env" or self.opsd_privileged.startswith("column:")):
            raise ValueError(f"opsd_privileged must be 'env' or 'column:<name>', got {self.opsd_privileged!r}")
        if self.advantage_clip is not None and self.advantage_clip <= 0:
            raise ValueError(f"advantage_clip must be > 0 or None, got {self.advantage_clip}")
        if self.logz_chunk_rows < 1:
            raise ValueError(f"logz_chunk_rows must be >= 1, got {self.logz_chunk_rows}")
        steps = self.schedule_steps if self.schedule_steps is not None else self.max_steps
        if steps is None or steps < 1:  # D10
            raise ValueError(
                "β-OPSD's schedule needs a length: set schedule_steps, or max_steps > 0 (D10); got "
                f"schedule_steps {self.schedule_steps}, max_steps {self.max_steps}"
            )


# ---------------------------------------------------------------------------------------------------------------------
# Pure math (beta-opsd.md §4)


def teacher_weight(step: int, start: float, end: float, steps: int) -> float:
    """w_k of Eq. 4: linear from `start` at step 0 to `end` at step K − 1, then held; K <= 1 gives `end`.

    >>> teacher_weight(0, 0.5, 0.8, 4), teacher_weight(3, 0.5, 0.8, 4), teacher_weight(99, 0.5, 0.8, 4)
    (0.5, 0.8, 0.8)
    """
    if steps <= 1:
        return end
    s = min(max(step / (steps - 1), 0.0), 1.0)
    return start + (end - start) * s  # Eq. 4


def mixture_target_logps(logp_ref: Tensor, logp_teacher: Tensor, w: float) -> Tensor:
    """log p̃(y_t) of Eq. 6: log((1 − w)·π_ref(y_t) + w·p_T(y_t)) from sampled-token log-probs; exactly the reference
    at w = 0 and the teacher at w = 1 (C15). Shapes (B, T)."""
    if w <= 0.0:
        return logp_ref.clone()
    if w >= 1.0:
        return logp_teacher.clone()
    return torch.logaddexp(math.log1p(-w) + logp_ref, math.log(w) + logp_teacher)  # Eq. 6


def geometric_target_logps(ref_logps: Tensor, teacher_logps: Tensor, ids: Tensor, w: float) -> tuple[Tensor, Tensor]:
    """Eq. 5 over the whole vocabulary: log p̃(y_t) = (1 − w)·ℓ_ref(y_t) + w·ℓ_T(y_t) − log Z_t with
    log Z_t = logsumexp_v[(1 − w)·ℓ_ref(v) + w·ℓ_T(v)]. `ref_logps`, `teacher_logps`: (B, T, V) log-softmax outputs;
    `ids`: (B, T) sampled tokens. Returns ((B, T) log p̃(y_t), (B, T) log Z_t). Endpoints are exact (C15): entries a
    distribution gives −inf never meet a 0 weight."""
    if w <= 0.0:
        chosen = ref_logps.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return chosen, torch.zeros_like(chosen)
    if w >= 1.0:
        chosen = teacher_logps.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        return chosen, torch.zeros_like(chosen)
    mixed = (1.0 - w) * ref_logps + w * teacher_logps  # (B, T, V) unnormalised log-interpolant
    log_z = torch.logsumexp(mixed, dim=-1)  # Eq. 5's normaliser
    return mixed.gather(-1, ids.unsqueeze(-1)).squeeze(-1) - log_z, log_z


def token_mismatch(logp_old: Tensor, log_target: Tensor, mask: Tensor) -> Tensor:
    """ρ_t = m_t·(log π_old(y_t) − log p̃(y_t)) of Eq. 7, detached; 0 off the model tokens."""
    return torch.where(mask.bool(), (logp_old - log_target).detach(), torch.zeros_like(logp_old))  # Eq. 7


def reward_to_go(rho: Tensor, mask: Tensor, gamma: float, turn_index: Tensor | None = None) -> Tensor:
    """G of Eq. 8: at each model token, Σ_{i ≥ j} γ^(i−j)·ρ over the model tokens from it to the end; environment
    tokens and padding are skipped (they neither count as a discount step nor carry G). With `turn_index` (B, T),
    the sum stops at the end of the token's own turn (`rtg_scope: turn`). Computed in float64 (C2).

    >>> reward_to_go(torch.tensor([[1.0, 5.0, 2.0]]), torch.tensor([[1, 0, 1]]), 0.5).tolist()
    [[2.0, 0.0, 2.0]]
    """
    m = mask.bool()
    out = torch.zeros_like(rho, dtype=torch.float64)
    running = torch.zeros(rho.shape[0], dtype=torch.float64, device=rho.device)
    current_turn = torch.full((rho.shape[0],), -2, dtype=torch.long, device=rho.device)
    for t in range(rho.shape[1] - 1, -1, -1):
        here = m[:, t]
        if turn_index is not None:  # a new (earlier) turn starts a new sum
            starts = here & (turn_index[:, t] != current_turn)
            running = torch.where(starts, torch.zeros_like(running), running)
            current_turn = torch.where(here, turn_index[:, t], current_turn)
        running = torch.where(here, rho[:, t].double() + gamma * running, running)  # Eq. 8
        out[:, t] = torch.where(here, running, torch.zeros_like(running))
    return out


def beta_opsd_loss(logp: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """Eq. 9 (minimised): (1/B) Σ_b (1/M_b) Σ_t m_t·sg(G_t)·log π(y_t); only `logp` carries a gradient. A row with no
    model token contributes 0 (its count is clamped to 1, C6). The trainer trains with TRL's loss fed A = −G, whose
    gradient at the rollout point is this one (not its value: the ratio there is 1);
    tests/test_beta_opsd_trainer.py checks the two gradients agree parameter by parameter."""
    m = mask.bool()
    terms = torch.where(m, returns.detach().to(logp.dtype) * logp, torch.zeros_like(logp))  # padding may hold -inf
    per_row = terms.sum(-1) / m.sum(-1).clamp(min=1).to(logp.dtype)
    return per_row.mean()  # Eq. 9


def blend_advantages(returns: Tensor, adv_grpo: Tensor, mask: Tensor, weight: float) -> Tensor:
    """A_t = (1 − λ_d)·Â_b − λ_d·G_t of Eq. 10 on model tokens, 0 on environment tokens and padding (C14); Â is
    ignored at λ_d = 1. `adv_grpo`: (B,) TRL's group advantage. Returns (B, T) float64."""
    distill = -weight * returns.double() if weight > 0.0 else torch.zeros_like(returns, dtype=torch.float64)
    if weight < 1.0:
        distill = distill + (1.0 - weight) * adv_grpo.double().unsqueeze(1)
    return torch.where(mask.bool(), distill, torch.zeros_like(distill))  # Eq. 10


# ---------------------------------------------------------------------------------------------------------------------
# The trainer


class BetaOPSDTrainer(AgentGRPOTrainer):
    """β-OPSD on the agent GRPO base; see the module docstring. The parameters are the base's, in TRL's order."""

    config_class = BetaOPSDConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.env_factory is None:
            raise ValueError("β-OPSD needs an environment: the teacher reads the rollouts' own prompt messages")
        unwrapped = self.accelerator.unwrap_model(self.model)
        needs_initial = self.args.opsd_teacher == "fixed" or self.args.opsd_reference == "frozen_initial"
        self.initial_model = None
        if needs_initial and not hasattr(unwrapped, "peft_config"):  # D3: a frozen copy loaded from the same weights
            self.initial_model = self._load_initial(unwrapped)
        steps = self.args.schedule_steps if self.args.schedule_steps is not None else self.args.max_steps
        self.schedule_steps = steps

    def _load_initial(self, unwrapped):
        """The initial weights, loaded again from the policy's path as TRL loads its reference model (a deep copy
        fails under ZeRO-3), with TRL's fused log-prob head, frozen and prepared for evaluation."""
        kwargs = dict(self.args.model_init_kwargs or {})
        kwargs.setdefault("dtype", unwrapped.dtype)
        kwargs.setdefault("attn_implementation", attn_implementation(unwrapped.config))
        model = create_model_from_path(get_config_model_id(unwrapped.config), **kwargs)
        if self.args.disable_dropout:
            disable_dropout_in_model(model)
        add_fused_lm_head(model, temperature=self.temperature, cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32)
        model.requires_grad_(False)
        return self.accelerator.prepare_model(model, evaluation_mode=True)

    def privileged_texts(self, rows: list[dict]) -> list[str | None]:
        """Each row's privileged text (`opsd_privileged`); None or "" gives the row no distillation signal. From the
        environment, the text is computed once per task (a generation batch holds each task G times)."""
        spec = self.args.opsd_privileged
        if spec != "env":
            return [str(row.get(spec.partition(":")[2]) or "") or None for row in rows]
        from envs.base import row_task

        keys = [json.dumps(row_task(row), sort_keys=True, default=str) for row in rows]
        texts: dict[str, str | None] = {}
        for key, row in zip(keys, rows, strict=True):
            if key not in texts:
                texts[key] = self.env_factory(row).privileged(row_task(row))
        return [texts[key] for key in keys]

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        args = self.args
        w = teacher_weight(self.state.global_step, args.teacher_weight_start, args.teacher_weight_end,
                           self.schedule_steps)  # fmt: skip  # C16: fixed for the generation batch
        mask = batch.mask
        blocks = self.privileged_texts(batch.rows)
        has_text = torch.tensor([bool(b) for b in blocks], dtype=torch.bool, device=mask.device)
        start = time.perf_counter()
        logp_old = plain_logps(self, batch)  # the current student on its own prompt (D2), no gradient
        log_z = None
        if args.target_space == "prob_sampled":
            source = "initial" if args.opsd_teacher == "fixed" else "policy"
            logp_teacher = teacher_logps(
                self, batch, blocks, source=source, position=args.opsd_position, plain=False
            ).with_block
            logp_ref = logp_old if args.opsd_reference == "current_student" else plain_logps(self, batch, "initial")
            log_target = mixture_target_logps(logp_ref.double(), logp_teacher.double(), w)  # Eq. 6
        else:  # the full-vocabulary passes also give the teacher's sampled-token log-probs
            log_target, log_z, logp_teacher = self._geometric_target(batch, blocks, w)  # Eq. 5
        seconds = time.perf_counter() - start
        valid = mask.bool() & has_text.unsqueeze(1)  # rows without a privileged text carry no signal
        rho = token_mismatch(logp_old.double(), log_target, valid)  # Eq. 7
        gamma = args.rtg_gamma if args.rtg else 0.0  # γ = 0 is the local estimator
        turns = batch.turn_index if args.rtg_scope == "turn" else None
        returns = reward_to_go(rho, valid, gamma, turns)  # Eq. 8
        if args.advantage_clip is not None:  # D17 (C17: after the return-to-go)
            returns = returns.clamp(-args.advantage_clip, args.advantage_clip)
        # Eq. 10 on every model token: a row without a privileged text has G = 0, so it keeps GRPO's part alone
        adv = blend_advantages(returns, batch.advantages, mask, args.distillation_weight)
        self._log_opsd(batch, w, rho, returns, valid, logp_old, logp_teacher, log_z, has_text, seconds)
        return adv.to(batch.advantages.dtype)

    @torch.no_grad()
    def _geometric_target(
        self, batch: RolloutBatch, blocks: list[str | None], w: float
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Eq. 5 from full-vocabulary log-softmax outputs of the reference (plain prompt) and the teacher (privileged
        prompt), `logz_chunk_rows` rows at a time so that only (rows, T, V) is held. Returns (B, T) log p̃(y_t),
        log Z_t and the teacher's log-probs of the sampled tokens, 0 off the completion and on rows without a text."""
        args = self.args
        B, T = batch.completion_ids.shape
        device = batch.completion_ids.device
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        teacher_model, teacher_ctx = (
            initial_context(self, self.model) if args.opsd_teacher == "fixed" else (self.model, nullcontext())
        )
        log_target = torch.zeros(B, T, dtype=torch.float64, device=device)
        log_z = torch.zeros(B, T, dtype=torch.float64, device=device)
        teacher_chosen = torch.zeros(B, T, device=device)
        for lo in range(0, B, args.logz_chunk_rows):
            rows = [b for b in range(lo, min(B, lo + args.logz_chunk_rows)) if blocks[b]]
            if not rows:
                continue
            ids, cmask = batch.completion_ids[rows], batch.completion_mask[rows]
            plain = [batch.prompt_ids[b][batch.prompt_mask[b].bool()].tolist() for b in rows]
            privileged = [
                render_prompt_ids(
                    tok,
                    with_privileged_block(batch.rows[b]["prompt_messages"], blocks[b], args.opsd_position),
                    batch.rows[b].get("prompt_tools"),
                )
                for b in rows
            ]
            if args.opsd_reference == "current_student":
                ref_model, ref_ctx = self.model, nullcontext()
            else:
                ref_model, ref_ctx = initial_context(self, self.model)
            with ref_ctx:
                ref = self._full_logps(ref_model, plain, ids, cmask, pad_id)
            with teacher_ctx:
                teacher = self._full_logps(teacher_model, privileged, ids, cmask, pad_id)
            chosen, z = geometric_target_logps(ref, teacher, ids, w)  # Eq. 5
            log_target[rows], log_z[rows] = chosen.double(), z.double()
            teacher_chosen[rows] = teacher.gather(-1, ids.unsqueeze(-1)).squeeze(-1) * cmask
        return log_target, log_z, teacher_chosen

    def _full_logps(self, model, prompts: list[list[int]], ids: Tensor, cmask: Tensor, pad_id: int) -> Tensor:
        """(rows, T, V) log-softmax at the sampling temperature over the completion positions, through the model's
        ordinary forward (TRL's fused head returns only sampled-token log-probs)."""
        prompt_ids, prompt_mask = left_padded(prompts, pad_id, ids.device)
        input_ids = torch.cat([prompt_ids, ids], dim=1)
        attention = torch.cat([prompt_mask, cmask], dim=1)
        was_training = model.training
        model.eval()
        try:
            with self.free_routing():
                logits = model(input_ids=input_ids, attention_mask=attention).logits
        finally:
            model.train(was_training)
        P, T = prompt_ids.shape[1], ids.shape[1]
        logits = logits[:, P - 1 : P - 1 + T].float() / self.temperature  # position t predicts completion token t
        return torch.log_softmax(logits, dim=-1)

    def _log_opsd(self, batch, w, rho, returns, valid, logp_old, logp_teacher, log_z, rows, seconds) -> None:
        args, nan = self.args, math.nan
        n = valid.sum().item()
        m = valid.bool()
        metrics = {
            "teacher_weight": w,
            "beta": 1.0 / w if w > 0 else math.inf,
            "rho_mean": rho[m].mean().item() if n else nan,
            "seq_kl_mean": rho.sum(-1)[rows].mean().item() if rows.any() else nan,
            "rho_pos_frac": (rho[m] > 0).double().mean().item() if n else nan,
            "rtg_mean": returns[m].mean().item() if n else nan,
            "rtg_abs_max": returns[m].abs().max().item() if n else nan,
            "rtg_std": returns[m].std(unbiased=False).item() if n else nan,
            "teacher_student_logratio_mean": (logp_teacher.double() - logp_old.double())[m].mean().item()
            if n
            else nan,
            "model_tokens_per_seq": batch.mask.sum(-1).double().mean().item(),
            "env_tokens_per_seq": (batch.completion_mask * (1 - batch.env_mask)).sum(-1).double().mean().item(),
            "privileged_frac": rows.double().mean().item(),
            "teacher_forward_seconds": seconds,
        }
        if log_z is not None:
            metrics["logZ_mean"] = log_z[m].mean().item() if n else nan
        elif 0.0 < w < 1.0 and args.opsd_reference == "current_student":  # Eq. 12's floor of −ρ
            metrics["adv_at_lower_bound_frac"] = ((-rho[m] - math.log1p(-w)).abs() < 1e-3).double().mean().item()
        if args.distillation_weight < 1.0:
            metrics["grpo_part_abs_mean"] = (1 - args.distillation_weight) * batch.advantages.abs().mean().item()
            metrics["distill_part_abs_mean"] = args.distillation_weight * returns[m].abs().mean().item() if n else nan
        for name, value in metrics.items():
            self.log_metric(f"beta_opsd/{name}", value)
