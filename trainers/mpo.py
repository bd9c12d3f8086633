"""MPO, Multiscale Policy Optimization for long-horizon agents (IQuest Research; no arXiv id yet;
docs/methods/mpo.md, a reconstruction from the published description). Built on the PPO trainer, the one
deliberate second base.

What changes relative to GRPO (and to `AgentPPOTrainer`, whose critic, value loss and T1 options it keeps):

1. **Critic instead of group baseline** (mpo.md §2 item 1): a separate critic by default
   (`critic_model_name_or_path: policy`, D12: no shared-trunk head in MPO runs), at 15x the actor's learning rate; or a
   head on the policy's detached hidden states (`value_head_detached`, ppo.md D14), which trains nothing of the actor.
2. **Turn-scale GAE is primary** (Eq. 5-6, lambda 0.8): one TD step per assistant turn; the turn's value is read at
   the position predicting its first token (Eq. 3). Discounting counts turns, not tokens (D10).
3. **Token scale only redistributes** (Eq. 7-11): an intra-turn token GAE (lambda_intra 0.95) that never crosses a turn
   boundary is centred within its turn and added with scale beta = 1.0, so each turn's mean advantage is exactly A_k.
4. **Turn-level importance ratio with stop-gradient** (Eq. 13-15): every token of a turn sees the whole turn's ratio,
   while its gradient flows only through its own log-probability; PPO clip plus a dual clip (Eq. 16).
5. **Critic targets** are Monte-Carlo returns counted in turns by default (Eq. 17, `value_target: mc`).
6. **Value-variance diagnostic** (Eq. 20-21): the inter-turn share of the critic's value variance, every batch.

This file reads top to bottom: `MPOConfig` (MPO's fields only), the pure math (turn and intra-turn GAE, the
mean-preserving projection, the value-variance shares, the turn-level ratio and the actor loss; `# Eq. N` on the
implementing lines), then `MPOTrainer`. The PPO trainer's two hooks do everything MPO shares with PPO (loss mask,
V_old, truncation and bootstrap values, whitening, the critic's value loss, T1 options, metrics, TITO audit);
`MPOTrainer` overrides only the estimator (`estimate_advantages`) and the actor's per-token loss (`actor_loss`).

What stays the same: the agent loop, reward placement (per-turn environment rewards on their turn, the outcome on the
last turn, Eq. 4), truncation handling (C4), the clipped value loss (Eq. 18), the aggregation of actor and critic
losses by TRL's `loss_type` (default "dapo", the global token mean of Eq. 16; "grpo", "bnpo", "dr_grpo" by C22), no KL
and no entropy bonus, no whitening (D9). Left out: G = 1 (TRL requires G >= 2; groups are unused) and mask-derived vs
explicit turn segmentation cross-checks (D11: the base uses the explicit `turn_index`).

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

Decision ids (`Dn`) without a page are docs/methods/mpo.md's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from trainers.advantages import bootstrap_values, next_model_index, reverse_scan, turn_lengths, turn_slots
from trainers.base import RolloutBatch
from trainers.losses import clip_fractions, clipped_surrogate
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


# ---------------------------------------------------------------------------------------------------------------------
# Advantages: turn-scale GAE + intra-turn token GAE, mean-preserving combination (Eq. 2-12, 17)


def _num_turns(turn_index: Tensor) -> int:
    return int(turn_index.max().item()) + 1 if turn_index.numel() else 0


@torch.no_grad()
def turn_start_values(values: Tensor, mask: Tensor, turn_index: Tensor, num_turns: int) -> Tensor:
    """V_k := V^old(s_{k,1}), the value read at the position predicting turn k's first model token (mpo.md Eq. 3).

    Args:
        values (`Tensor`): (B, T) V^old.
        mask (`Tensor`): (B, T) loss mask.
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.
        num_turns (`int`): K.

    Returns:
        `Tensor`: (B, K) in the dtype of `values`; NaN for turns without a model token.
    """
    B, T = values.shape
    tok, idx = turn_slots(turn_index, mask, num_turns)
    pos = torch.arange(T, device=values.device).expand(B, T)
    first = torch.full((B, num_turns + 1), T, dtype=torch.long, device=values.device)
    first = first.scatter_reduce(1, idx, torch.where(tok, pos, T), reduce="amin")[:, :num_turns]  # (B, K)
    v = values.gather(1, first.clamp(max=max(T - 1, 0))) if T else values.new_zeros(B, num_turns)  # Eq. 3
    return torch.where(first < T, v, torch.full_like(v, math.nan))


class TurnGAE(NamedTuple):
    """Output of `turn_gae`; every field is (B, K)."""

    advantages: Tensor  # A_k (mpo.md Eq. 6); 0 on columns that are not turns of the row
    next_values: Tensor  # V_{k+1}, the value turn k bootstraps into (the terminal value for the last turn)
    returns: Tensor  # G_k, Monte-Carlo return counted in turns (mpo.md Eq. 17)


@torch.no_grad()
def turn_gae(
    turn_rewards: Tensor,
    turn_values: Tensor,
    terminal_values: Tensor,
    gamma: float,
    lam: float,
    turn_valid: Tensor | None = None,
) -> TurnGAE:
    """Turn-level GAE: one TD step per assistant turn (mpo.md Eq. 5-6, 17; MPO has no arXiv id yet).

        delta_k = r_k + gamma * V_{k+1} - V_k,      A_k = sum_{l >= 0} (gamma * lam)^l * delta_{k+l},
        G_k = r_k + gamma * G_{k+1},                 V_{K+1} = G_{K+1} = terminal value.

    A turn with no model token (NaN in `turn_values`, cut by truncation) still counts as a step for discounting
    (conventions.md C7): its value is taken as its own one-step target V_k := r_k + gamma * V_{k+1}, so delta_k = 0
    and its reward flows into the earlier turns. The columns after a row's last turn are ignored; the last turn is the
    last column that has a model token or is marked in `turn_valid` (or, without `turn_valid`, has a finite reward).

    Args:
        turn_rewards (`Tensor`): (B, K) r_k; NaN where the row has no turn k.
        turn_values (`Tensor`): (B, K) V_k (Eq. 3); NaN where the turn has no model token.
        terminal_values (`Tensor`): (B,) V_{K+1}: 0 for terminated rows, the bootstrap value for truncated ones (C4).
        gamma (`float`): discount per turn.
        lam (`float`): turn GAE lambda (0.8 in MPO).
        turn_valid (`Tensor`, *optional*): (B, K) bool, k < number of turns of the row.

    Returns:
        `TurnGAE`: (advantages, next_values, returns), each (B, K) in the dtype of `turn_values`.
    """
    r = turn_rewards.to(torch.float64)  # (B, K)
    v = turn_values.to(torch.float64)  # (B, K)
    B, K = r.shape
    present = torch.isfinite(v)  # (B, K) turn has a model token
    has = present | (turn_valid.bool() if turn_valid is not None else torch.isfinite(r))  # (B, K)
    k_idx = torch.arange(K, device=r.device)
    last = torch.where(has, k_idx, -1).amax(dim=1) if K else torch.full((B,), -1, device=r.device)  # (B,)
    step = k_idx.unsqueeze(0) <= last.unsqueeze(1)  # (B, K) columns that are steps of the row
    r = torch.where(torch.isfinite(r), r, 0.0)
    next_v = terminal_values.to(torch.float64).clone()  # (B,) V_{K+1}
    next_a, next_g = torch.zeros_like(next_v), next_v.clone()
    adv, nv, ret = (torch.zeros(B, K, dtype=torch.float64, device=r.device) for _ in range(3))
    for k in reversed(range(K)):
        s = step[:, k]
        target = r[:, k] + gamma * next_v  # (B,)
        v_k = torch.where(present[:, k], v[:, k], target)  # C7: a turn without tokens has delta 0
        a_k = (target - v_k) + gamma * lam * next_a  # Eq. 5, Eq. 6 (recursion)
        g_k = r[:, k] + gamma * next_g  # Eq. 17
        adv[:, k] = torch.where(s, a_k, 0.0)
        nv[:, k] = next_v
        ret[:, k] = torch.where(s, g_k, 0.0)
        next_v = torch.where(s, v_k, next_v)
        next_a = torch.where(s, a_k, next_a)
        next_g = torch.where(s, g_k, next_g)
    dt = turn_values.dtype
    return TurnGAE(adv.to(dt), nv.to(dt), ret.to(dt))


@torch.no_grad()
def intra_turn_gae(
    values: Tensor,
    mask: Tensor,
    turn_index: Tensor,
    turn_rewards: Tensor,
    next_turn_values: Tensor,
    gamma: float,
    lam: float,
) -> Tensor:
    """Token-level GAE inside each turn, token discount 1 (mpo.md Eq. 7-8).

        delta_{k,i} = V_{k,i+1} - V_{k,i}   (i < n_k),        delta_{k,n_k} = r_k + gamma * V_{k+1} - V_{k,n_k},
        a_{k,i} = sum_{l=0}^{n_k - i} lam^l * delta_{k,i+l}.

    The recursion never crosses a turn boundary; the last token bootstraps into the next turn's start value, skipping
    the environment tokens in between.

    Args:
        values (`Tensor`): (B, T) V^old.
        mask (`Tensor`): (B, T) loss mask.
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.
        turn_rewards (`Tensor`): (B, K) r_k (NaN counts as 0).
        next_turn_values (`Tensor`): (B, K) V_{k+1}, e.g. `turn_gae(...).next_values`.
        gamma (`float`): turn discount.
        lam (`float`): lambda_intra (0.95 in MPO).

    Returns:
        `Tensor`: (B, T) a, 0 off the turn tokens, in the dtype of `values`.
    """
    v = values.to(torch.float64)  # (B, T)
    B, T = v.shape
    K = turn_rewards.shape[1]
    tok, idx = turn_slots(turn_index, mask, K)
    nxt = next_model_index(tok)  # (B, T)
    nxt_c = nxt.clamp(max=max(T - 1, 0))
    same = (nxt < T) & (idx.gather(1, nxt_c) == idx)  # (B, T) the next model token is in the same turn
    r = turn_rewards.to(torch.float64)
    pad = torch.zeros(B, 1, dtype=torch.float64, device=v.device)
    r = torch.cat([torch.where(torch.isfinite(r), r, 0.0), pad], dim=1)  # (B, K + 1)
    nv = torch.cat([next_turn_values.to(torch.float64), pad], dim=1)  # (B, K + 1)
    end = r.gather(1, idx) + gamma * nv.gather(1, idx)  # (B, T) r_k + gamma * V_{k+1}
    target = torch.where(same, v.gather(1, nxt_c), end)  # (B, T)
    delta = torch.where(tok, target - v, 0.0)  # Eq. 7
    return reverse_scan(delta, tok, lam, reset=~same).to(values.dtype)  # Eq. 8


@torch.no_grad()
def mean_preserving_projection(
    turn_advantages: Tensor, token_advantages: Tensor, turn_index: Tensor, mask: Tensor, beta: float
) -> Tensor:
    """Additive mean-preserving combination of the two scales (mpo.md Eq. 9-10).

        a_bar_k = (1 / n_k) sum_i a_{k,i},        A~_{k,i} = A_k + beta * (a_{k,i} - a_bar_k),

    so the mean of A~ over turn k is exactly A_k (Eq. 11) for any beta; beta = 0 gives turn-level PPO.

    Args:
        turn_advantages (`Tensor`): (B, K) A_k.
        token_advantages (`Tensor`): (B, T) a (intra-turn GAE).
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.
        mask (`Tensor`): (B, T) loss mask.
        beta (`float`): token residual scale (1.0 in MPO).

    Returns:
        `Tensor`: (B, T) A~, 0 off the turn tokens, in the dtype of `token_advantages`.
    """
    B, K = turn_advantages.shape
    tok, idx = turn_slots(turn_index, mask, K)
    a = torch.where(tok, token_advantages.to(torch.float64), 0.0)  # (B, T)
    n = torch.zeros(B, K + 1, dtype=torch.float64, device=a.device).scatter_add(1, idx, tok.double())  # (B, K + 1)
    s = torch.zeros(B, K + 1, dtype=torch.float64, device=a.device).scatter_add(1, idx, a)  # (B, K + 1)
    a_bar = s / n.clamp(min=1.0)  # Eq. 9
    big_a = torch.cat([turn_advantages.to(torch.float64), a_bar.new_zeros(B, 1)], dim=1)  # (B, K + 1)
    out = big_a.gather(1, idx) + beta * (a - a_bar.gather(1, idx))  # Eq. 10
    return torch.where(tok, out, 0.0).to(token_advantages.dtype)


class MPOAdvantages(NamedTuple):
    """Output of `mpo_advantages`."""

    advantages: Tensor  # (B, T) A~ (mpo.md Eq. 10), 0 off the turn tokens
    returns: Tensor  # (B, T) critic targets R (mpo.md Eq. 17), 0 off the turn tokens
    turn_advantages: Tensor  # (B, K) A_k (mpo.md Eq. 6), 0 on columns that are not turns
    token_advantages: Tensor  # (B, T) a, the intra-turn token GAE (mpo.md Eq. 8)
    turn_lengths: Tensor  # (B, K) int64 n_k; turns with n_k = 0 have no token for their advantage to land on (C7)


@torch.no_grad()
def mpo_advantages(
    values: Tensor,
    mask: Tensor,
    turn_index: Tensor,
    turn_rewards: Tensor,
    truncated: Tensor,
    boot_value: Tensor | None = None,
    gamma: float = 1.0,
    turn_lambda: float = 0.8,
    intra_turn_lambda: float = 0.95,
    beta: float = 1.0,
    value_target: Literal["mc", "lambda"] = "mc",
    turn_valid: Tensor | None = None,
) -> MPOAdvantages:
    """MPO advantages: turn-scale GAE plus a mean-preserving intra-turn token residual (mpo.md Eq. 2-12, 17).

        A_k from `turn_gae` (Eq. 5-6, lambda = 0.8),      a_{k,i} from `intra_turn_gae` (Eq. 7-8, lambda_intra = 0.95),
        A~_{k,i} = A_k + beta * (a_{k,i} - mean_i a_{k,i})                                                     (Eq. 10)
        R_{k,i} = G_k ("mc", Eq. 17)   or   a_{k,i} + V_{k,i} ("lambda").

    The terminal value V_{K+1} is 0 for terminated rows and `boot_value` for truncated rows (Eq. 3, C4); terminated
    rows never read `boot_value`. Rows are independent of each other (no whitening here, mpo.md D9).

    Args:
        values (`Tensor`): (B, T) V^old, the critic value of the state before each token.
        mask (`Tensor`): (B, T) loss mask.
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.
        turn_rewards (`Tensor`): (B, K) r_k; per-turn environment rewards with the outcome reward on the last turn
            (Eq. 4). NaN (or 0 with `turn_valid`) where the row has no turn k.
        truncated (`Tensor`): (B,) bool, cut by a budget rather than ended.
        boot_value (`Tensor`, *optional*): (B,) value of the state after the last token, read for truncated rows.
            Defaults to `bootstrap_values(values, mask)`.
        gamma (`float`, *optional*, defaults to `1.0`): turn discount (token discount is fixed at 1, D10).
        turn_lambda (`float`, *optional*, defaults to `0.8`): turn-level GAE lambda.
        intra_turn_lambda (`float`, *optional*, defaults to `0.95`): intra-turn GAE lambda.
        beta (`float`, *optional*, defaults to `1.0`): token residual scale.
        value_target (`str`, *optional*, defaults to `"mc"`): critic target, `"mc"` or `"lambda"` (Eq. 17).
        turn_valid (`Tensor`, *optional*): (B, K) bool, k < number of turns of the row.

    Returns:
        `MPOAdvantages`: advantages, returns, turn_advantages, token_advantages (dtype of `values`) and turn_lengths.
    """
    if value_target not in ("mc", "lambda"):
        raise ValueError(f"value_target must be 'mc' or 'lambda', got {value_target!r}")
    K = turn_rewards.shape[1]
    v = values.to(torch.float64)  # (B, T)
    if boot_value is None:
        boot_value = bootstrap_values(values, mask)
    terminal = torch.where(truncated.bool(), boot_value.to(torch.float64), 0.0)  # (B,) Eq. 3, C4
    v_turn = turn_start_values(v, mask, turn_index, K)  # (B, K) Eq. 3
    tg = turn_gae(turn_rewards.to(torch.float64), v_turn, terminal, gamma, turn_lambda, turn_valid)  # Eq. 5-6
    a = intra_turn_gae(v, mask, turn_index, turn_rewards, tg.next_values, gamma, intra_turn_lambda)  # Eq. 7-8
    adv = mean_preserving_projection(tg.advantages, a, turn_index, mask, beta)  # Eq. 9-10
    tok, idx = turn_slots(turn_index, mask, K)
    if value_target == "mc":
        g = torch.cat([tg.returns, tg.returns.new_zeros(tg.returns.shape[0], 1)], dim=1)  # (B, K + 1)
        ret = torch.where(tok, g.gather(1, idx), 0.0)  # Eq. 17, R_{k,i} = G_k
    else:
        ret = torch.where(tok, a + v, 0.0)  # Eq. 17, lambda-return
    dt = values.dtype
    return MPOAdvantages(adv.to(dt), ret.to(dt), tg.advantages.to(dt), a.to(dt), turn_lengths(turn_index, mask, K))


# ---------------------------------------------------------------------------------------------------------------------
# Value-variance diagnostic (Eq. 20-21): all-reducible sums, then a float


def _undefined_variance(total_sq_dev: float, n: float, sum_sq: float) -> bool:
    """C5: Var[x] <= 1e-12 * max(1, mean(x^2)), written on sums: Σ(x - mean)^2 <= 1e-12 * max(n, Σx^2)."""
    return n <= 0 or total_sq_dev <= 1e-12 * max(n, sum_sq)


@torch.no_grad()
def value_variance_sums(values: Tensor, mask: Tensor, turn_index: Tensor) -> Tensor:
    """Sums for the value-variance decomposition (mpo.md Eq. 20-21); all-reduce them (SUM) across ranks, then call
    `value_variance_shares`. Every entry is a sum over rows, so the sharded result equals the pooled one.

    Per row b (turn tokens only): Tot_b = Σ (V - V_bar_b)^2 and Btw_b = Σ_k n_k (V_bar_{b,k} - V_bar_b)^2, so that
    Wth_b = Tot_b - Btw_b = Σ (V - V_bar_{b,k})^2 (Eq. 20). Pooled over groups g = (b, k): N, S = Σ V, Q = Σ V^2 and
    Σ_g S_g^2 / n_g (Eq. 21).

    Args:
        values (`Tensor`): (B, T) V^old.
        mask (`Tensor`): (B, T) loss mask.
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.

    Returns:
        `Tensor`: (6,) float64 [N, S, Q, Σ_g S_g^2/n_g, Σ_b Btw_b, Σ_b Tot_b].
    """
    B, T = values.shape
    K = _num_turns(turn_index)
    tok, idx = turn_slots(turn_index, mask, K)
    v = torch.where(tok, values.to(torch.float64), 0.0)  # (B, T)
    n_b = tok.sum(dim=1).double()  # (B,)
    s_b = v.sum(dim=1)  # (B,)
    mean_b = s_b / n_b.clamp(min=1.0)  # (B,)
    tot_b = torch.where(tok, (v - mean_b.unsqueeze(1)) ** 2, 0.0).sum(dim=1)  # (B,) Eq. 20, Tot_b
    n_g = torch.zeros(B, K + 1, dtype=torch.float64, device=v.device).scatter_add(1, idx, tok.double())[:, :K]
    s_g = torch.zeros(B, K + 1, dtype=torch.float64, device=v.device).scatter_add(1, idx, v)[:, :K]  # (B, K)
    mean_g = s_g / n_g.clamp(min=1.0)  # (B, K)
    btw_b = (n_g * (mean_g - mean_b.unsqueeze(1)) ** 2).sum(dim=1)  # (B,) Eq. 20, Btw_b (empty turns add 0)
    between_pooled = (s_g**2 / n_g.clamp(min=1.0)).sum()  # Eq. 21, Σ_g S_g^2 / n_g
    return torch.stack([n_b.sum(), s_b.sum(), (v**2).sum(), between_pooled, btw_b.sum(), tot_b.sum()])


def value_variance_shares(sums: Tensor) -> tuple[float | None, float | None]:
    """Inter-turn share of the critic's value variance from `value_variance_sums` (summed over ranks).

        share = Σ_b Btw_b / Σ_b Tot_b                                     (mpo.md Eq. 20, within-trajectory)
        share_pooled = (Σ_g S_g^2/n_g - S^2/N) / (Q - S^2/N)                (mpo.md Eq. 21)

    A share is None (not logged, mpo.md §7 item 21) when its total variance is zero by the C5 rule
    Σ(V - mean)^2 <= 1e-12 * max(N, Q). Shares are clamped to [0, 1] against round-off.

    Args:
        sums (`Tensor`): (6,) from `value_variance_sums`.

    Returns:
        `tuple[float | None, float | None]`: (share, share_pooled).
    """
    n, s, q, between_pooled, btw, tot = (float(x) for x in sums.to(torch.float64).tolist())
    share = None if _undefined_variance(tot, n, q) else min(max(btw / tot, 0.0), 1.0)  # Eq. 20
    tot_pooled = q - s * s / n if n > 0 else 0.0
    pooled = None
    if not _undefined_variance(tot_pooled, n, q):
        pooled = min(max((between_pooled - s * s / n) / tot_pooled, 0.0), 1.0)  # Eq. 21
    return share, pooled


# ---------------------------------------------------------------------------------------------------------------------
# Turn-level importance ratio with stop-gradient and the actor loss (Eq. 13-16)


def _turn_log_ratio64(
    logps: Tensor, old_logps: Tensor, turn_index: Tensor, mask: Tensor, num_turns: int, mode: str
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(Lambda (B, K + 1) with a zero dump column, token log-ratio l (B, T), turn tokens (B, T), slot (B, T))."""
    if mode not in ("product", "geomean"):
        raise ValueError(f"mode must be 'product' or 'geomean', got {mode!r}")
    B = logps.shape[0]
    tok, idx = turn_slots(turn_index, mask, num_turns)  # (B, T), (B, T)
    new = torch.where(tok, logps.to(torch.float64), 0.0)  # (B, T)
    ell = new - torch.where(tok, old_logps.detach().to(torch.float64), 0.0)  # (B, T) Eq. 13, 0 off the turn tokens
    lam = torch.zeros(B, num_turns + 1, dtype=torch.float64, device=logps.device).scatter_add(1, idx, ell)  # Eq. 14
    if mode == "geomean":
        n = torch.zeros(B, num_turns + 1, dtype=torch.float64, device=logps.device).scatter_add(1, idx, tok.double())
        lam = lam / n.clamp(min=1.0)  # Eq. 14, geomean
    lam = torch.cat([lam[:, :num_turns], lam.new_zeros(B, 1)], dim=1)  # the dump column holds 0
    return lam, ell, tok, idx


def turn_log_ratio(
    logps: Tensor,
    old_logps: Tensor,
    turn_index: Tensor,
    mask: Tensor,
    num_turns: int | None = None,
    mode: Literal["product", "geomean"] = "product",
) -> Tensor:
    """Turn log-ratio Lambda_k (mpo.md Eq. 13-14), before the clamp; differentiable.

        l_{k,i} = log pi_theta(y_{k,i}) - log pi_old(y_{k,i}),
        Lambda_k = Σ_i l_{k,i} ("product")   or   Lambda_k = mean_i l_{k,i} ("geomean").

    Args:
        logps (`Tensor`): (B, T) log pi_theta of the sampled tokens.
        old_logps (`Tensor`): (B, T) log pi_old.
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.
        mask (`Tensor`): (B, T) loss mask.
        num_turns (`int`, *optional*): K; defaults to max(turn_index) + 1.
        mode (`str`, *optional*, defaults to `"product"`): `"product"` or `"geomean"`.

    Returns:
        `Tensor`: (B, K) Lambda, 0 for turns without a model token, in the dtype of `logps`.
    """
    K = num_turns if num_turns is not None else _num_turns(turn_index)
    lam, _, _, _ = _turn_log_ratio64(logps, old_logps, turn_index, mask, K, mode)
    return lam[:, :K].to(logps.dtype)


def turn_importance_ratio(
    logps: Tensor,
    old_logps: Tensor,
    turn_index: Tensor,
    mask: Tensor,
    clamp: float = 20.0,
    mode: Literal["product", "geomean"] = "product",
) -> Tensor:
    """Complete-turn importance ratio with stop-gradient (mpo.md Eq. 13-15; MPO has no arXiv id yet).

        rho_{k,i} = exp( sg[Lambda^_k - l_{k,i}] + l_{k,i} ),     Lambda^_k = clamp(Lambda_k, -clamp, +clamp)

    Value: exp(Lambda^_k) on every token of turn k (the turn's sequence ratio in "product" mode). Gradient:
    d rho_{k,i} / d l_{k,j} = rho_{k,i} if j = i and 0 otherwise (also across turns), so token i's advantage moves
    only token i's log-probability. Tokens outside any turn get rho = 1 and no gradient.

    Args:
        logps (`Tensor`): (B, T) log pi_theta of the sampled tokens (differentiable).
        old_logps (`Tensor`): (B, T) log pi_old (constant).
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.
        mask (`Tensor`): (B, T) loss mask.
        clamp (`float`, *optional*, defaults to `20.0`): c_Lambda, the clamp on the turn log-ratio.
        mode (`str`, *optional*, defaults to `"product"`): `"product"` or `"geomean"` (Eq. 14).

    Returns:
        `Tensor`: (B, T) rho, in the dtype of `logps`.
    """
    K = _num_turns(turn_index)
    lam, ell, tok, idx = _turn_log_ratio64(logps, old_logps, turn_index, mask, max(K, 0), mode)
    lam_hat = lam.clamp(-clamp, clamp).gather(1, idx)  # (B, T) Eq. 14, clamp; 0 off the turn tokens
    rho = torch.exp((lam_hat - ell).detach() + ell)  # Eq. 15
    return rho.to(logps.dtype)


def mpo_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    turn_index: Tensor,
    mask: Tensor,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    c_dual: float = 3.0,
    clamp: float = 20.0,
    mode: Literal["product", "geomean"] = "product",
) -> Tensor:
    """Per-token MPO actor loss: turn-level ratio (Eq. 15) in the PPO clip with a dual clip (mpo.md Eq. 16).

        L_{k,i} = -min(rho_{k,i} A~_{k,i}, clip(rho_{k,i}, 1 - eps_low, 1 + eps_high) A~_{k,i});
        for A~ < 0: L <- min(L, -c_dual * A~).

    Every token of a turn shares the turn's ratio, so clip decisions depend only on (rho_k, sign A~_{k,i}). Aggregate
    with `aggregate_loss` (Eq. 16: the global token mean, `loss_type="dapo"`; or `"grpo"` etc., conventions.md C22).

    Args:
        logps (`Tensor`): (B, T) log pi_theta (differentiable).
        old_logps (`Tensor`): (B, T) log pi_old.
        advantages (`Tensor`): (B, T) A~ (e.g. `mpo_advantages(...).advantages`).
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.
        mask (`Tensor`): (B, T) loss mask.
        eps_low (`float`, *optional*, defaults to `0.2`): lower clip range.
        eps_high (`float`, *optional*, defaults to `0.2`): upper clip range.
        c_dual (`float`, *optional*, defaults to `3.0`): dual-clip constant.
        clamp (`float`, *optional*, defaults to `20.0`): c_Lambda.
        mode (`str`, *optional*, defaults to `"product"`): turn ratio mode.

    Returns:
        `Tensor`: (B, T) per-token loss, 0 off the mask, in the dtype of `logps`.
    """
    ratio = turn_importance_ratio(logps, old_logps, turn_index, mask, clamp, mode)  # Eq. 15
    return clipped_surrogate(ratio, advantages, mask, eps_low, eps_high, c_dual)  # Eq. 16


# ---------------------------------------------------------------------------------------------------------------------
# The trainer


class MPOTrainer(AgentPPOTrainer):
    """MPO on the PPO trainer; see the module docstring for what changes and the logged metrics. Overrides only the
    estimator and the actor's per-token loss that the PPO trainer's two hooks call."""

    config_class = MPOConfig

    def estimate_advantages(
        self, batch: RolloutBatch, mask: Tensor, values: Tensor, truncated: Tensor, boot: Tensor
    ) -> tuple[Tensor, Tensor]:
        """A~ (Eq. 10) and the critic targets R (Eq. 17), both (B, T), by `mpo_advantages`; logs the §8 diagnostics."""
        a = self.args
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
        return out.advantages, out.returns

    def actor_loss(
        self, logps: Tensor, old_logps: Tensor, inputs: dict, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Eq. 13-16: the turn-level ratio with stop-gradient in the PPO clip, plus the dual clip. On-policy the turn
        ratio is 1 (mpo.md §7 item 14)."""
        a = self.args
        adv, turn_index = inputs["advantages"], inputs["turn_index"]  # (B, T), (B, T)
        eps_low, eps_high = self.clip_range()
        actor_tok = mpo_loss(
            logps,
            old_logps,
            adv,
            turn_index,
            mask,
            eps_low=eps_low,
            eps_high=eps_high,
            c_dual=a.dual_clip,
            clamp=a.turn_log_ratio_clamp,
            mode=a.turn_ratio,
        )  # (B, T) Eq. 13-16
        with torch.no_grad():
            rho = turn_importance_ratio(logps, old_logps, turn_index, mask, a.turn_log_ratio_clamp, a.turn_ratio)
            frac = clip_fractions(rho, adv, mask, eps_low, eps_high, a.dual_clip)  # Eq. 15-16
            n = mask.sum()
            sums = {"mpo/token_clip_frac": frac["clip_frac"] * n, "mpo/dual_clip_frac": frac["dual_clip_frac"] * n}
            lam = turn_log_ratio(logps, old_logps, turn_index, mask, mode=a.turn_ratio)  # (B, K) Eq. 14
            self.log_turn_ratio_metrics(lam, turn_index)
        return actor_tok, sums

    def log_turn_ratio_metrics(self, lam: Tensor, turn_index: Tensor) -> None:
        """Turn-level ratio diagnostics over the turns of this micro-batch; lam (B, K) is Lambda_k before the clamp."""
        K = lam.shape[1]
        eps_low, eps_high = self.clip_range()
        present = torch.zeros(lam.shape[0], K + 1, dtype=torch.bool, device=lam.device)
        present = present.scatter(1, torch.where(turn_index >= 0, turn_index, K), True)[:, :K]  # (B, K)
        lam = lam.double()
        ratio = lam.clamp(-self.args.turn_log_ratio_clamp, self.args.turn_log_ratio_clamp).exp()  # (B, K)
        outside = (ratio < 1 - eps_low) | (ratio > 1 + eps_high)
        sums = {
            "mpo/turn_log_ratio_abs_mean": lam.abs()[present].sum(),
            "mpo/turn_clip_frac": outside[present].sum().double(),
            "mpo/ratio_clamp_frac": (lam.abs() > self.args.turn_log_ratio_clamp)[present].sum().double(),
        }
        self.log_token_means(sums, present.sum().double())
        top = lam.abs()[present].max() if present.any() else lam.new_zeros(())
        self.log_metric("mpo/turn_log_ratio_abs_max", self.accelerator.reduce(top, reduction="max").item())

    def log_mpo_metrics(
        self, out: MPOAdvantages, values: Tensor, mask: Tensor, turn_index: Tensor, truncated: Tensor, boot: Tensor
    ) -> None:
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
        s = self.reduce_sums(
            {
                "turns": present.sum().double(),  # turns with a model token
                "turn_adv": turns_a.sum(),
                "turn_adv_sq": (turns_a**2).sum(),
                "tokens": tok.sum().double(),  # model tokens
                "residual_abs": (adv - a_tok).abs()[tok].sum(),
                "turn_adv_abs": a_tok.abs()[tok].sum(),
                "sign_flips": (torch.sign(adv) != torch.sign(a_tok))[tok].sum().double(),
                "rows": torch.tensor(float(B), dtype=torch.float64, device=adv.device),
                "truncated": truncated.sum().double(),
                "boot_value": boot.double()[truncated].sum(),
            }
        )
        turns, toks, rows = max(s["turns"], 1.0), max(s["tokens"], 1.0), max(s["rows"], 1.0)
        mean_a = s["turn_adv"] / turns
        self.log_metric("mpo/turn_adv_mean", mean_a)
        self.log_metric("mpo/turn_adv_std", max(s["turn_adv_sq"] / turns - mean_a**2, 0.0) ** 0.5)
        self.log_metric("mpo/token_residual_abs_mean", s["residual_abs"] / toks)
        self.log_metric("mpo/residual_to_turn_ratio", s["residual_abs"] / max(s["turn_adv_abs"], 1e-12))
        self.log_metric("mpo/mean_constraint_max_err", self.accelerator.reduce(err, reduction="max").item())  # Eq. 11
        self.log_metric("mpo/sign_flip_frac", s["sign_flips"] / toks)
        self.log_metric("mpo/turns_per_traj_mean", s["turns"] / rows)
        self.log_metric("mpo/tokens_per_turn_mean", s["tokens"] / turns)
        self.log_metric("mpo/truncated_frac", s["truncated"] / rows)
        self.log_metric("mpo/boot_value_mean", s["boot_value"] / max(s["truncated"], 1.0))
