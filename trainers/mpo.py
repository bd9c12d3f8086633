"""MPO, Multiscale Policy Optimization for long-horizon agents (IQuest Research; no arXiv id yet;
docs/methods/mpo.md, a reconstruction from the published description). Built on the PPO trainer, the one
deliberate second base.

What changes relative to GRPO (and to `AgentPPOTrainer`, whose critic, value loss and T1 options it keeps):

1. **Critic instead of group baseline** (mpo.md §2 item 1): a separate critic by default
   (`critic_model_name_or_path: policy`, D12: no shared-trunk head in MPO runs), at 15x the actor's learning rate.
2. **Turn-scale GAE is primary** (Eq. 5-6, lambda 0.8): one TD step per assistant turn; the turn's value is read at
   the position predicting its first token (Eq. 3). Discounting counts turns, not tokens (D10).
3. **Token scale only redistributes** (Eq. 7-11): an intra-turn token GAE (lambda_intra 0.95) that never crosses a turn
   boundary is centred within its turn and added with scale beta = 1.0, so each turn's mean advantage is exactly A_k.
4. **Turn-level importance ratio with stop-gradient** (Eq. 13-15): every token of a turn sees the whole turn's ratio,
   while its gradient flows only through its own log-probability; PPO clip plus a dual clip (Eq. 16).
5. **Critic targets** are Monte-Carlo returns counted in turns by default (Eq. 17, `value_target: mc`).
6. **Value-variance diagnostic** (Eq. 20-21): the inter-turn share of the critic's value variance, every batch.

What stays the same: the agent loop, reward placement (per-turn environment rewards on their turn, the outcome on the
last turn, Eq. 4), truncation handling (C4), the clipped value loss (Eq. 18), the global token-mean aggregation
(Eq. 16, TRL's "dapo"), no KL and no entropy bonus, no whitening (D9). Left out: G = 1 (TRL requires G >= 2; groups are
unused) and mask-derived vs explicit turn segmentation cross-checks (D11: the base uses the explicit `turn_index`).

Logged metrics (besides the PPO trainer's `critic/*`, `actor/*`, `ppo/*`, `t1/*`; `ppo/advantage_*` describe A~):
- `mpo/inter_turn_var_share`: Eq. 20, between-turn share of V_old's within-trajectory variance (omitted: undefined).
- `mpo/inter_turn_var_share_pooled`: Eq. 21, the same with groups (row, turn) pooled over the batch.
- `mpo/turn_adv_mean`, `mpo/turn_adv_std`: A_k over all turns with a model token (turn-weighted).
- `mpo/token_residual_abs_mean`: mean over model tokens of |A~ - A_k|.
- `mpo/residual_to_turn_ratio`: mean |A~ - A_k| / mean |A_k| over model tokens.
- `mpo/mean_constraint_max_err`: max over turns of |mean(A~) - A_k| (Eq. 11; round-off only).
- `mpo/sign_flip_frac`: fraction of model tokens with sign(A~) != sign(A_k).
- `mpo/turns_per_traj_mean`, `mpo/tokens_per_turn_mean`: rollout shape.
- `mpo/truncated_frac`, `mpo/boot_value_mean`: rows bootstrapping from V (C4) and their mean bootstrap value.
- `mpo/turn_log_ratio_abs_mean`, `mpo/turn_log_ratio_abs_max`: |Lambda_k| before the clamp (Eq. 14).
- `mpo/turn_clip_frac`: fraction of turns whose ratio lies outside [1 - eps_low, 1 + eps_high].
- `mpo/ratio_clamp_frac`: fraction of turns with |Lambda_k| > turn_log_ratio_clamp (should be ~0).
- `mpo/token_clip_frac`, `mpo/dual_clip_frac`: model tokens whose clipped branch binds / with A~ < 0 and rho > c_dual.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from trainers.advantages import masked_sums, mpo_advantages, value_variance_shares, value_variance_sums, whiten
from trainers.base import RolloutBatch
from trainers.losses import clip_fractions, mpo_loss, turn_importance_ratio, turn_log_ratio
from trainers.ppo import AgentPPOTrainer, PPOConfig


@dataclass
class MPOConfig(PPOConfig):
    """PPOConfig plus MPO's two scales and turn ratio (mpo.md §5). Changed defaults: a separate critic at 15x the
    actor's learning rate (D12), no whitening (D9). PPO's token `gamma` / `lam` are unused."""

    critic_model_name_or_path: str | None = field(
        default="policy", metadata={"help": "Separate critic (mpo.md D12); 'policy' copies the policy's checkpoint."}
    )
    critic_lr_multiplier: float = field(default=15.0, metadata={"help": "Critic LR / actor LR (mpo.md §5, D12)."})
    whiten_advantages: bool = field(default=False, metadata={"help": "One global affine map of A~ (mpo.md D9)."})
    turn_lambda: float = field(default=0.8, metadata={"help": "Turn-level GAE lambda (mpo.md Eq. 6; paper)."})
    intra_turn_lambda: float = field(default=0.95, metadata={"help": "Intra-turn GAE lambda (mpo.md Eq. 8; paper)."})
    token_residual_scale: float = field(
        default=1.0, metadata={"help": "beta of the mean-preserving projection (mpo.md Eq. 10). Not TRL's beta."}
    )
    turn_gamma: float = field(default=1.0, metadata={"help": "Discount per turn (mpo.md Eq. 5, D10)."})
    turn_ratio: str = field(default="product", metadata={"help": "'product' or 'geomean' turn ratio (mpo.md Eq. 14)."})
    turn_log_ratio_clamp: float = field(default=20.0, metadata={"help": "c_Lambda clamp (mpo.md Eq. 14, D1)."})
    dual_clip: float = field(default=3.0, metadata={"help": "c_dual of the dual clip (mpo.md Eq. 16, D1)."})
    value_target: str = field(default="mc", metadata={"help": "'mc' or 'lambda' critic targets (mpo.md Eq. 17)."})

    def __post_init__(self):
        super().__post_init__()
        if self.turn_ratio not in ("product", "geomean"):
            raise ValueError(f"turn_ratio must be 'product' or 'geomean', got {self.turn_ratio!r}")
        if self.value_target not in ("mc", "lambda"):
            raise ValueError(f"value_target must be 'mc' or 'lambda', got {self.value_target!r}")


class MPOTrainer(AgentPPOTrainer):
    """MPO on the PPO trainer: overrides the two hooks only; see the module docstring for changes and metrics."""

    def __init__(self, model, reward_funcs=None, args: MPOConfig | None = None, **kwargs):
        if not isinstance(args, MPOConfig):
            raise TypeError(f"args must be an MPOConfig, got {type(args).__name__}")
        super().__init__(model, reward_funcs=reward_funcs, args=args, **kwargs)

    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        a = self.args
        mask = self.batch_mask(batch)  # (B, T)
        values, after = self.old_values(batch)  # (B, T) V_old, aligned like log-probs
        truncated = batch.truncated & a.bootstrap_truncated  # (B,) C4
        boot = self.boot_values(batch, after)  # (B,)
        turn_index = torch.where(mask.bool(), batch.turn_index, -1)  # (B, T)
        out = mpo_advantages(
            values,
            mask,
            turn_index,
            self.turn_reward_matrix(batch),  # (B, K) Eq. 4
            truncated,
            boot,
            gamma=a.turn_gamma,
            turn_lambda=a.turn_lambda,  # Eq. 6
            intra_turn_lambda=a.intra_turn_lambda,  # Eq. 8
            beta=a.token_residual_scale,  # Eq. 10
            value_target=a.value_target,  # Eq. 17
            turn_valid=batch.turn_valid,
        )
        self.log_mpo_metrics(out, values, mask, turn_index, truncated, boot)
        adv = out.advantages  # (B, T)
        if a.whiten_advantages:
            adv = whiten(adv, mask, self.reduce_sum(masked_sums(adv, mask)))  # D9: one global affine map
        batch.extras.update(old_values=values, returns=out.returns)
        self.log_critic_metrics(out.returns, values, mask)  # Eq. 19
        self.log_advantage_metrics(adv, mask, truncated)
        self.audit_tito(batch)
        return adv

    def policy_loss(self, model, inputs: dict) -> Tensor:
        a = self.args
        logps, entropies, aux, values = self.forward_with_values(model, inputs, compute_entropy=True)
        mask = self.ppo_mask(inputs)  # (B, T)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old  # on-policy: rho = 1 (mpo.md §7 item 14)
        adv, turn_index = inputs["advantages"], inputs["turn_index"]  # (B, T), (B, T)
        eps = (self.epsilon_low, self.epsilon_high)
        actor_tok = mpo_loss(
            logps, old, adv, turn_index, mask, *eps, a.dual_clip, a.turn_log_ratio_clamp, a.turn_ratio
        )  # Eq. 13-16
        with torch.no_grad():
            rho = turn_importance_ratio(logps, old, turn_index, mask, a.turn_log_ratio_clamp, a.turn_ratio)  # Eq. 15
            frac = clip_fractions(rho, adv, mask, *eps, a.dual_clip)
            n = mask.sum()
            extra = {"mpo/token_clip_frac": frac["clip_frac"] * n, "mpo/dual_clip_frac": frac["dual_clip_frac"] * n}
            self.log_turn_ratio_metrics(turn_log_ratio(logps, old, turn_index, mask, mode=a.turn_ratio), turn_index)
        return self.ppo_loss(actor_tok, logps, old, values, entropies, aux, mask, inputs, extra)

    # ----------------------------------------------------------------------------------------------------------------
    def log_turn_ratio_metrics(self, lam: Tensor, turn_index: Tensor) -> None:
        """Turn-level ratio diagnostics over the turns of this micro-batch; lam (B, K) is Lambda_k before the clamp."""
        K = lam.shape[1]
        present = torch.zeros(lam.shape[0], K + 1, dtype=torch.bool, device=lam.device)
        present = present.scatter(1, torch.where(turn_index >= 0, turn_index, K), True)[:, :K]  # (B, K)
        lam = lam.double()
        ratio = lam.clamp(-self.args.turn_log_ratio_clamp, self.args.turn_log_ratio_clamp).exp()  # (B, K)
        outside = (ratio < 1 - self.epsilon_low) | (ratio > 1 + self.epsilon_high)
        sums = {
            "mpo/turn_log_ratio_abs_mean": lam.abs()[present].sum(),
            "mpo/turn_clip_frac": outside[present].sum().double(),
            "mpo/ratio_clamp_frac": (lam.abs() > self.args.turn_log_ratio_clamp)[present].sum().double(),
        }
        self.log_token_means(sums, present.sum().double())
        top = lam.abs()[present].max() if present.any() else lam.new_zeros(())
        self.log_metric("mpo/turn_log_ratio_abs_max", self.accelerator.reduce(top, reduction="max").item())

    def log_mpo_metrics(self, out, values: Tensor, mask: Tensor, turn_index: Tensor, truncated: Tensor, boot) -> None:
        """mpo.md §8 advantage and value-variance diagnostics, from sums all-reduced over processes."""
        share, pooled = value_variance_shares(self.reduce_sum(value_variance_sums(values, mask, turn_index)))
        if share is not None:  # Eq. 20, omitted when undefined
            self.log_metric("mpo/inter_turn_var_share", share)
        if pooled is not None:  # Eq. 21
            self.log_metric("mpo/inter_turn_var_share_pooled", pooled)
        B, K = out.turn_advantages.shape
        tok = mask.bool() & (turn_index >= 0)  # (B, T)
        slot = torch.where(tok, turn_index, K)  # (B, T), dump column K
        big_a = torch.cat([out.turn_advantages.double(), out.turn_advantages.new_zeros(B, 1).double()], 1)  # (B, K+1)
        a_tok = big_a.gather(1, slot)  # (B, T) A_k on each token of turn k
        adv = out.advantages.double()  # (B, T)
        present = out.turn_lengths > 0  # (B, K)
        n_k = out.turn_lengths.double().clamp(min=1.0)  # (B, K)
        turn_mean = torch.zeros(B, K + 1, dtype=torch.float64, device=adv.device).scatter_add(1, slot, adv)[:, :K]
        err = ((turn_mean / n_k - big_a[:, :K]).abs() * present).max() if present.any() else adv.new_zeros(())
        turns_a = big_a[:, :K][present]
        totals = self.reduce_sum(
            torch.stack(
                [
                    present.sum().double(),  # 0 turns with a model token
                    turns_a.sum(),  # 1
                    (turns_a**2).sum(),  # 2
                    tok.sum().double(),  # 3 model tokens
                    (adv - a_tok).abs()[tok].sum(),  # 4
                    a_tok.abs()[tok].sum(),  # 5
                    (torch.sign(adv) != torch.sign(a_tok))[tok].sum().double(),  # 6
                    torch.tensor(float(B), dtype=torch.float64, device=adv.device),  # 7 rows
                    truncated.sum().double(),  # 8
                    boot.double()[truncated].sum(),  # 9
                ]
            )
        ).tolist()
        turns, toks = max(totals[0], 1.0), max(totals[3], 1.0)
        mean_a = totals[1] / turns
        self.log_metric("mpo/turn_adv_mean", mean_a)
        self.log_metric("mpo/turn_adv_std", max(totals[2] / turns - mean_a**2, 0.0) ** 0.5)
        self.log_metric("mpo/token_residual_abs_mean", totals[4] / toks)
        self.log_metric("mpo/residual_to_turn_ratio", totals[4] / max(totals[5], 1e-12))
        self.log_metric("mpo/mean_constraint_max_err", self.accelerator.reduce(err, reduction="max").item())  # Eq. 11
        self.log_metric("mpo/sign_flip_frac", totals[6] / toks)
        self.log_metric("mpo/turns_per_traj_mean", totals[0] / max(totals[7], 1.0))
        self.log_metric("mpo/tokens_per_turn_mean", totals[3] / turns)
        self.log_metric("mpo/truncated_frac", totals[8] / max(totals[7], 1.0))
        self.log_metric("mpo/boot_value_mean", totals[9] / max(totals[8], 1.0))
