"""Shared advantage math: pure tensor functions (tensors and plain numbers in, tensors out) that several methods use.

Reward placement, token GAE over model tokens (PPO, T1), the critic's explained variance, whitening, and the small
masked helpers the methods' own estimators are built from (MPO's turn GAE lives in `trainers/mpo.py`, DRACO's step
weights in `trainers/draco.py`, the credit interface in `trainers/credit.py`).

Conventions (the rollout-batch contract, docs/layout.md#the-rollout-batch). B rows, T completion tokens, K turns.
* `mask` (B, T): 1 on model tokens (sampled by the policy), 0 on environment tokens and padding.
* `turn_index` (B, T): k on the model tokens of assistant turn k, -1 elsewhere. Only tokens with `mask = 1` and
  `turn_index >= 0` are treated as turn tokens.
* `turn_rewards` (B, K): the reward credited to each turn (the outcome reward sits on the last turn). NaN or 0 where a
  row has no turn k; pass `turn_valid` (B, K) to say which turns exist when padding columns hold 0.
* `values` (B, T): critic value of the state before each completion token (aligned like log-probs).
* `truncated` (B,) bool: the episode was cut by a budget (bootstrap from the value after it) rather than ended by the
  environment (terminal value 0), conventions.md C4.

All arithmetic runs in float64 and results are cast to the dtype of `values` (or of the main input) at the end
(conventions.md C2). Nothing here keeps a graph: outputs are computed under `torch.no_grad()`.

Sources: T1, https://huggingface.co/papers/2609.11042 (`t1.md`).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------------------------------
# Small masked helpers


def turn_slots(turn_index: Tensor, mask: Tensor, num_turns: int) -> tuple[Tensor, Tensor]:
    """Turn tokens `tok` (B, T) bool and their slot `idx` (B, T) int64 in [0, K]; slot K is a dump column for every
    non-turn token, so scatters into (B, K + 1) buffers never need a branch."""
    tok = mask.bool() & (turn_index >= 0)  # (B, T)
    idx = torch.where(tok, turn_index.long(), torch.full_like(turn_index, num_turns, dtype=torch.long))  # (B, T)
    return tok, idx


def turn_lengths(turn_index: Tensor, mask: Tensor, num_turns: int) -> Tensor:
    """n_{b,k}: number of model tokens of turn k in row b (mpo.md Eq. 2; with `mask = turn_index >= 0` it is the
    credit interface's count, credit-interface.md Eq. I-5). (B, T) -> (B, K) int64."""
    tok, idx = turn_slots(turn_index, mask, num_turns)
    n = torch.zeros(turn_index.shape[0], num_turns + 1, dtype=torch.long, device=turn_index.device)
    return n.scatter_add(1, idx, tok.long())[:, :num_turns]  # mpo.md Eq. 2


def next_model_index(tok: Tensor) -> Tensor:
    """(B, T) position of the next model token strictly after t; T when there is none (environment tokens skipped)."""
    B, T = tok.shape
    pos = torch.arange(T, device=tok.device).expand(B, T)
    own = torch.where(tok, pos, torch.full_like(pos, T))  # (B, T) position of model tokens, T elsewhere
    after = torch.cat([own[:, 1:], torch.full_like(own[:, :1], T)], dim=1)  # (B, T) shifted left by one
    return after.flip(1).cummin(dim=1).values.flip(1)  # (B, T) min over positions > t


def reverse_scan(delta: Tensor, tok: Tensor, decay: float, reset: Tensor | None = None) -> Tensor:
    """out_t = delta_t + decay * out_{t'} on model tokens, t' the next model token (environment tokens are not steps);
    the carry is cut at tokens where `reset` is true and after the last model token. 0 off `tok`. (B, T) float64."""
    B, T = delta.shape
    carry = delta.new_zeros(B)
    cols = [delta.new_zeros(B)] * T
    for t in reversed(range(T)):
        c = carry if reset is None else torch.where(reset[:, t], 0.0, carry)
        val = delta[:, t] + decay * c
        cols[t] = torch.where(tok[:, t], val, 0.0)
        carry = torch.where(tok[:, t], val, carry)
    return torch.stack(cols, dim=1) if T else delta.clone()


def bootstrap_values(values: Tensor, valid_mask: Tensor) -> Tensor:
    """Value of the state after the last valid token of each row, used to bootstrap truncated rows (C4).

    Returns `values[b, t_last + 1]` when `t_last + 1 < T`: that slot holds the critic's value read at the position of
    the last valid token, i.e. the state right after it. When the last valid token is the last column, the state after
    it is not in the tensor and `values[b, t_last]` (the state before it) is returned instead. Rows without a valid
    token get 0. Pass the loss mask to bootstrap from the state after the last model token, or `completion_mask` to
    include the final environment observation. `values` must be the critic's output at every position (not zeroed off
    the mask); a trainer that computes the value after the last completion token should pass that as `boot_value`.

    Args:
        values (`Tensor`): (B, T) critic values of the state before each completion token.
        valid_mask (`Tensor`): (B, T) 1 on the tokens that count.

    Returns:
        `Tensor`: (B,) in the dtype of `values`.

    >>> values = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    >>> bootstrap_values(values, torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])).tolist()
    [3.0, 8.0]
    """
    B, T = values.shape
    pos = torch.arange(T, device=values.device).expand(B, T)
    last = torch.where(valid_mask.bool(), pos, -1).amax(dim=1) if T else values.new_full((B,), -1).long()  # (B,)
    slot = torch.where(last + 1 < T, last + 1, last).clamp(min=0)  # (B,)
    out = values.gather(1, slot.unsqueeze(1)).squeeze(1) if T else values.new_zeros(B)  # (B,)
    return torch.where(last >= 0, out, torch.zeros_like(out))


# ---------------------------------------------------------------------------------------------------------------------
# Reward placement


@torch.no_grad()
def place_turn_rewards(turn_rewards: Tensor, turn_index: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards: turn k's reward on the last model token of turn k (conventions.md C3).

    r_tok[b, t] = r[b, k] if t is the last model token of turn k, else 0. A turn with no model token (cut, C7) passes
    its reward to the last model token of the nearest earlier turn; with no earlier model token it is dropped. NaN
    rewards (turn absent) count as 0. Rewards never land on environment tokens.

    Args:
        turn_rewards (`Tensor`): (B, K) per-turn rewards.
        turn_index (`Tensor`): (B, T) turn of each model token, -1 elsewhere.
        mask (`Tensor`): (B, T) loss mask.

    Returns:
        `Tensor`: (B, T) in the dtype of `turn_rewards`.

    >>> turn_index = torch.tensor([[0, 0, -1, 1, 1, -1]])
    >>> place_turn_rewards(torch.tensor([[0.5, 2.0]]), turn_index, turn_index >= 0).tolist()
    [[0.0, 0.5, 0.0, 0.0, 2.0, 0.0]]
    """
    B, K = turn_rewards.shape
    T = turn_index.shape[1]
    r = turn_rewards.to(torch.float64)
    r = torch.where(torch.isnan(r), 0.0, r)  # (B, K) absent turns carry nothing
    tok, idx = turn_slots(turn_index, mask, K)
    pos = torch.arange(T, device=turn_index.device).expand(B, T)
    last = torch.full((B, K + 1), -1, dtype=torch.long, device=turn_index.device)
    last = last.scatter_reduce(1, idx, torch.where(tok, pos, -1), reduce="amax")[:, :K]  # (B, K) last token of turn
    last = last.cummax(dim=1).values if K else last  # (B, K) C7: an empty turn uses the latest earlier turn's token
    out = torch.zeros(B, T + 1, dtype=torch.float64, device=turn_rewards.device)
    target = torch.where(last >= 0, last, T)  # (B, K) dump column T when no model token precedes the turn
    out = out.scatter_add(1, target, r)[:, :T]  # (B, T) C3
    return out.to(turn_rewards.dtype)


@torch.no_grad()
def place_outcome_reward(rewards: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards for a trajectory-level reward: r on the last model token of the row, 0 elsewhere (t1.md Eq. 5,
    https://huggingface.co/papers/2609.11042). NaN (unscorable) becomes 0; a row with no model token gets nothing (C6).

    Args:
        rewards (`Tensor`): (B,) one reward per row.
        mask (`Tensor`): (B, T) loss mask.

    Returns:
        `Tensor`: (B, T) in the dtype of `rewards`.

    >>> place_outcome_reward(torch.tensor([0.25, 1.0]), torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 0]])).tolist()
    [[0.0, 0.0, 0.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]]
    """
    B, T = mask.shape
    r = rewards.to(torch.float64)
    r = torch.where(torch.isnan(r), 0.0, r)  # (B,)
    pos = torch.arange(T, device=mask.device).expand(B, T)
    last = torch.where(mask.bool(), pos, -1).amax(dim=1) if T else torch.full((B,), -1, device=mask.device)
    target = torch.where(last >= 0, last, T).unsqueeze(1)  # (B, 1) dump column T for rows without a model token
    out = torch.zeros(B, T + 1, dtype=torch.float64, device=mask.device).scatter_add(1, target, r.unsqueeze(1))
    return out[:, :T].to(rewards.dtype)  # t1.md Eq. 5


# ---------------------------------------------------------------------------------------------------------------------
# Token-level GAE over model tokens (PPO, T1)


@torch.no_grad()
def token_gae(
    rewards_tok: Tensor,
    values: Tensor,
    mask: Tensor,
    truncated: Tensor,
    gamma: float,
    lam: float,
    boot_value: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """GAE over the compressed sequence of model tokens (t1.md Eq. 6-8, https://huggingface.co/papers/2609.11042).

    With j = 1..M the model tokens of a row (environment tokens are skipped: they are not time steps, so the next
    model token after an environment gap is the next step):

        delta_j = r_j + gamma * V_{j+1} - V_j,    A_j = sum_{n >= 0} (gamma * lam)^n * delta_{j+n},    R_j = A_j + V_j

    with V_{M+1} = 0 for terminated rows and `boot_value` for truncated rows (conventions.md C4; the T1 recipe
    passes `truncated` all false, t1.md D8). With gamma = lam = 1 this gives A_j = sum(r) - V_j and R_j = sum(r)
    (t1.md Eq. 9). Rewards on environment tokens are ignored: place them with `place_turn_rewards` or
    `place_outcome_reward`. Rows without model tokens get zeros (C6).

    Args:
        rewards_tok (`Tensor`): (B, T) per-token rewards, on model tokens.
        values (`Tensor`): (B, T) V^old of the state before each token.
        mask (`Tensor`): (B, T) loss mask.
        truncated (`Tensor`): (B,) bool, cut by a budget (bootstrap) rather than ended.
        gamma (`float`): discount per model token.
        lam (`float`): GAE lambda.
        boot_value (`Tensor`, *optional*): (B,) value of the state after the last token, read for truncated rows only.
            Defaults to `bootstrap_values(values, mask)`.

    Returns:
        `tuple[Tensor, Tensor]`: advantages (B, T) and returns (B, T), both 0 off mask, in the dtype of `values`.
    """
    v = values.to(torch.float64)  # (B, T)
    r = rewards_tok.to(torch.float64)  # (B, T)
    tok = mask.bool()  # (B, T)
    T = v.shape[1]
    if boot_value is None:
        boot_value = bootstrap_values(values, mask)
    end = torch.where(truncated.bool(), boot_value.to(torch.float64), 0.0)  # (B,) V_{M+1}, C4
    nxt = next_model_index(tok)  # (B, T)
    v_next = torch.where(nxt < T, v.gather(1, nxt.clamp(max=max(T - 1, 0))), end.unsqueeze(1))  # (B, T) V_{j+1}
    delta = torch.where(tok, r + gamma * v_next - v, 0.0)  # t1.md Eq. 6
    adv = reverse_scan(delta, tok, gamma * lam)  # t1.md Eq. 7
    ret = torch.where(tok, adv + v, 0.0)  # t1.md Eq. 8
    return adv.to(values.dtype), ret.to(values.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# Critic diagnostics: all-reducible sums, then a float


@torch.no_grad()
def explained_variance_sums(returns: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """Sums for the explained variance (t1.md Eq. 15): all-reduce them (SUM) across ranks, then call
    `explained_variance_from_sums`. Averaging per-rank EVs is not allowed.

    Args:
        returns (`Tensor`): (B, T) R.
        values (`Tensor`): (B, T) V^old.
        mask (`Tensor`): (B, T) loss mask.

    Returns:
        `Tensor`: (5,) float64 [n, Σy, Σy^2, Σe, Σe^2] with y = R, e = R - V^old over model tokens.
    """
    m = mask.bool()
    y = torch.where(m, returns.to(torch.float64), 0.0)  # (B, T)
    e = torch.where(m, returns.to(torch.float64) - values.to(torch.float64), 0.0)  # (B, T)
    return torch.stack([m.sum().double(), y.sum(), (y**2).sum(), e.sum(), (e**2).sum()])


def explained_variance_from_sums(sums: Tensor) -> float:
    """EV = 1 - Var[R - V^old] / Var[R] from `explained_variance_sums` (t1.md Eq. 14-15, mpo.md Eq. 19), with
    Var(x) = Σx^2/n - (Σx/n)^2. NaN when undefined: no tokens, or Var[R] <= 1e-12 * max(1, mean(R^2)) (C5).

    Args:
        sums (`Tensor`): (5,) from `explained_variance_sums`, summed over ranks.

    Returns:
        `float`: the explained variance, or NaN.
    """
    n, sy, syy, se, see = (float(x) for x in sums.to(torch.float64).tolist())
    if n <= 0:
        return math.nan
    var_y = syy / n - (sy / n) ** 2  # Eq. 15
    if var_y <= 1e-12 * max(1.0, syy / n):  # C5
        return math.nan
    var_e = max(see / n - (se / n) ** 2, 0.0)  # Eq. 15
    return 1.0 - var_e / var_y  # t1.md Eq. 14


def explained_variance(returns: Tensor, values: Tensor, mask: Tensor) -> float:
    """Explained variance of the critic over model tokens, EV = 1 - Var[R - V^old] / Var[R] (t1.md Eq. 14,
    https://huggingface.co/papers/2609.11042; mpo.md Eq. 19). 1 for a perfect critic, 0 for a constant critic at
    the mean return, negative for an anti-correlated one; NaN when Var[R] ~ 0 (C5). Single-process convenience:
    across ranks all-reduce `explained_variance_sums` and call `explained_variance_from_sums`.

    Args:
        returns (`Tensor`): (B, T) R.
        values (`Tensor`): (B, T) V^old.
        mask (`Tensor`): (B, T) loss mask.

    Returns:
        `float`: EV or NaN.

    >>> explained_variance(torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[1.0, 0.0, 9.0]]), torch.tensor([[1, 1, 0]]))
    1.0
    """
    return explained_variance_from_sums(explained_variance_sums(returns, values, mask))


# ---------------------------------------------------------------------------------------------------------------------
# Whitening (PPO advantages)


@torch.no_grad()
def masked_sums(x: Tensor, mask: Tensor) -> Tensor:
    """(3,) float64 [n, Σx, Σx^2] over masked entries; all-reduce (SUM) for global statistics and pass to `whiten`."""
    m = mask.bool()
    xm = torch.where(m, x.to(torch.float64), 0.0)
    return torch.stack([m.sum().double(), xm.sum(), (xm**2).sum()])


@torch.no_grad()
def whiten(x: Tensor, mask: Tensor, sums: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """Masked whitening x -> (x - mu) / sqrt(sigma^2 + eps) over the masked entries, 0 elsewhere (PPO advantages).

    mu and sigma^2 (population variance) come from `sums` = [n, Σx, Σx^2] (`masked_sums`, all-reduced for global
    statistics, mpo.md D9) or from the local masked entries. One affine map for all entries, so turn means map to
    turn means. With no masked entry the result is all zeros.

    Args:
        x (`Tensor`): (B, T) values to whiten.
        mask (`Tensor`): (B, T) entries that count.
        sums (`Tensor`, *optional*): (3,) [n, Σx, Σx^2]; defaults to `masked_sums(x, mask)`.
        eps (`float`, *optional*, defaults to `1e-8`): added to the variance.

    Returns:
        `Tensor`: (B, T) in the dtype of `x`.

    >>> whiten(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]), eps=0.0).tolist()
    [[-1.0, 1.0, 0.0]]
    """
    n, sx, sxx = (float(v) for v in (masked_sums(x, mask) if sums is None else sums).to(torch.float64).tolist())
    if n <= 0:
        return torch.zeros_like(x)
    mean = sx / n
    var = max(sxx / n - mean * mean, 0.0)
    std = math.sqrt(var + eps) if var + eps > 0 else 1.0  # a constant input with eps = 0 maps to 0, not NaN
    out = (x.to(torch.float64) - mean) / std
    return torch.where(mask.bool(), out, 0.0).to(x.dtype)
