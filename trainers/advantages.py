"""Advantage estimators and critic diagnostics: pure tensor functions (tensors and plain numbers in, tensors out).

Conventions (DESIGN.md, the rollout-batch contract). B rows, T completion tokens, K turns.
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

Sources: T1, https://huggingface.co/papers/2609.11042 (`t1.md`); MPO, no arXiv id yet (`mpo.md`, a reconstruction).
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------------------------------
# Small masked helpers


def _turn_slots(turn_index: Tensor, mask: Tensor, num_turns: int) -> tuple[Tensor, Tensor]:
    """Turn tokens `tok` (B, T) bool and their slot `idx` (B, T) int64 in [0, K]; slot K is a dump column for every
    non-turn token, so scatters into (B, K + 1) buffers never need a branch."""
    tok = mask.bool() & (turn_index >= 0)  # (B, T)
    idx = torch.where(tok, turn_index.long(), torch.full_like(turn_index, num_turns, dtype=torch.long))  # (B, T)
    return tok, idx


def _num_turns(turn_index: Tensor) -> int:
    return int(turn_index.max().item()) + 1 if turn_index.numel() else 0


def _next_model_index(tok: Tensor) -> Tensor:
    """(B, T) position of the next model token strictly after t; T when there is none (environment tokens skipped)."""
    B, T = tok.shape
    pos = torch.arange(T, device=tok.device).expand(B, T)
    own = torch.where(tok, pos, torch.full_like(pos, T))  # (B, T) position of model tokens, T elsewhere
    after = torch.cat([own[:, 1:], torch.full_like(own[:, :1], T)], dim=1)  # (B, T) shifted left by one
    return after.flip(1).cummin(dim=1).values.flip(1)  # (B, T) min over positions > t


def _reverse_scan(delta: Tensor, tok: Tensor, decay: float, reset: Tensor | None = None) -> Tensor:
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
    tok, idx = _turn_slots(turn_index, mask, K)
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
    nxt = _next_model_index(tok)  # (B, T)
    v_next = torch.where(nxt < T, v.gather(1, nxt.clamp(max=max(T - 1, 0))), end.unsqueeze(1))  # (B, T) V_{j+1}
    delta = torch.where(tok, r + gamma * v_next - v, 0.0)  # t1.md Eq. 6
    adv = _reverse_scan(delta, tok, gamma * lam)  # t1.md Eq. 7
    ret = torch.where(tok, adv + v, 0.0)  # t1.md Eq. 8
    return adv.to(values.dtype), ret.to(values.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# MPO: turn-scale GAE + intra-turn token GAE, mean-preserving combination (mpo.md)


def turn_lengths(turn_index: Tensor, mask: Tensor, num_turns: int) -> Tensor:
    """n_{b,k}: number of model tokens of turn k in row b (mpo.md Eq. 2). (B, T) -> (B, K) int64."""
    tok, idx = _turn_slots(turn_index, mask, num_turns)
    n = torch.zeros(turn_index.shape[0], num_turns + 1, dtype=torch.long, device=turn_index.device)
    return n.scatter_add(1, idx, tok.long())[:, :num_turns]  # Eq. 2


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
    tok, idx = _turn_slots(turn_index, mask, num_turns)
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
    tok, idx = _turn_slots(turn_index, mask, K)
    nxt = _next_model_index(tok)  # (B, T)
    nxt_c = nxt.clamp(max=max(T - 1, 0))
    same = (nxt < T) & (idx.gather(1, nxt_c) == idx)  # (B, T) the next model token is in the same turn
    r = turn_rewards.to(torch.float64)
    pad = torch.zeros(B, 1, dtype=torch.float64, device=v.device)
    r = torch.cat([torch.where(torch.isfinite(r), r, 0.0), pad], dim=1)  # (B, K + 1)
    nv = torch.cat([next_turn_values.to(torch.float64), pad], dim=1)  # (B, K + 1)
    end = r.gather(1, idx) + gamma * nv.gather(1, idx)  # (B, T) r_k + gamma * V_{k+1}
    target = torch.where(same, v.gather(1, nxt_c), end)  # (B, T)
    delta = torch.where(tok, target - v, 0.0)  # Eq. 7
    return _reverse_scan(delta, tok, lam, reset=~same).to(values.dtype)  # Eq. 8


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
    tok, idx = _turn_slots(turn_index, mask, K)
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
    tok, idx = _turn_slots(turn_index, mask, K)
    if value_target == "mc":
        g = torch.cat([tg.returns, tg.returns.new_zeros(tg.returns.shape[0], 1)], dim=1)  # (B, K + 1)
        ret = torch.where(tok, g.gather(1, idx), 0.0)  # Eq. 17, R_{k,i} = G_k
    else:
        ret = torch.where(tok, a + v, 0.0)  # Eq. 17, lambda-return
    dt = values.dtype
    return MPOAdvantages(adv.to(dt), ret.to(dt), tg.advantages.to(dt), a.to(dt), turn_lengths(turn_index, mask, K))


# ---------------------------------------------------------------------------------------------------------------------
# Critic diagnostics: all-reducible sums, then a float


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
    tok, idx = _turn_slots(turn_index, mask, K)
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


# ---------------------------------------------------------------------------------------------------------------------
# Step-level credit: the shared redistribution interface (credit-interface.md) and DRACO's step weights (draco.md,
# https://huggingface.co/papers/2609.04094). Conventions: B rows, T tokens, K turns; `turn_index` (B, T) holds k on
# the loss tokens of turn k and -1 on every other token; `turn_valid` (B, K) marks the turns a row has.


class CreditOutput(NamedTuple):
    """Result of `redistribute_multiplicative` / `redistribute_additive` (credit-interface.md §5)."""

    advantages: Tensor  # (B, T) detached, in the dtype and on the device of `adv` (G7, G9)
    fallback: Tensor  # (B,) bool: the row got the plain GRPO broadcast (zeros when it has no loss token)
    reasons: list[str | None]  # (B,) fallback reason code (credit-interface.md §7), None for credited rows
    values: Tensor  # (B, K) float64 multiplier m (or shift ω·o) applied per turn; 1 (or 0) on fallback rows
    residual: Tensor  # (B,) float64 relative residual of the declared conserved quantity; 0 in fallback


def turn_token_counts(turn_index: Tensor, num_turns: int, turn_tokens: Tensor | None = None) -> Tensor:
    """n_{b,k} = Σ_t 1[turn_index[b, t] = k] (credit-interface.md Eq. I-5), (B, T) -> (B, K) int64.

    Counts a producer passes in (`turn_tokens`, (B, K)) must agree: a mismatch is a programming error and raises.

    >>> turn_token_counts(torch.tensor([[0, 0, -1, 1, -1]]), 2).tolist()
    [[2, 1]]
    """
    if turn_index.numel() and int(turn_index.max()) >= num_turns:
        raise ValueError(f"turn_index holds turn {int(turn_index.max())} but only {num_turns} turns were given")
    n = turn_lengths(turn_index, turn_index >= 0, num_turns)  # Eq. I-5
    if turn_tokens is not None and not torch.equal(turn_tokens.to(device=n.device, dtype=n.dtype), n):
        raise ValueError("turn_tokens disagree with the counts from turn_index (credit-interface.md Eq. I-5)")
    return n


def _credit_rows(
    adv: Tensor,
    turn_index: Tensor,
    per_turn: Tensor,
    turn_valid: Tensor,
    row_fallback: Tensor | None,
    reasons: list[str | None] | None,
    turn_tokens: Tensor | None,
    neutral: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, list[str | None]]:
    """Shared checks of both forms: counts (Eq. I-5), live turns, and the fallback flags of §7-8.

    Returns A (B,) float64 (non-finite -> 0), per-turn values (B, K) float64 with `neutral` on fallback rows and on
    turns without tokens, live turns (B, K) bool, n (B, K) int64, the fallback flags (B,) and the reason per row.
    """
    B, K = per_turn.shape
    n = turn_token_counts(turn_index, K, turn_tokens)  # (B, K)
    valid = turn_valid.bool()
    if bool(((n > 0) & ~valid).any()):
        raise ValueError("turn_index has tokens on a turn that turn_valid marks as absent")
    live = valid & (n > 0)  # (B, K) turns holding loss tokens (a fully cut turn has none, C7)
    fb = torch.zeros(B, dtype=torch.bool, device=per_turn.device) if row_fallback is None else row_fallback.bool()
    why = [None] * B if reasons is None else list(reasons)
    a = adv.detach().to(torch.float64)  # (B,) C2
    v = per_turn.detach().to(torch.float64)  # (B, K)
    bad = ~torch.isfinite(torch.where(live, v, 0.0)).all(dim=1) | ~torch.isfinite(a)  # (B,) §8.3
    empty = n.sum(dim=1) == 0  # (B,) G6
    fb = fb.clone()
    for b in range(B):
        if bool(empty[b]):
            fb[b], why[b] = True, "empty_row"
        elif bool(fb[b]):
            why[b] = why[b] or "fallback"
        elif bool(bad[b]):
            fb[b], why[b] = True, "nonfinite"
        else:
            why[b] = None
    a = torch.where(torch.isfinite(a), a, 0.0)
    v = torch.where(live & ~fb.unsqueeze(1), v, neutral)  # (B, K)
    return a, v, live, n, fb, why


def _per_token(values: Tensor, turn_index: Tensor) -> Tensor:
    """values[b, turn_index[b, t]] on turn tokens, 0 elsewhere: (B, K), (B, T) -> (B, T)."""
    if values.shape[1] == 0:
        return torch.zeros(turn_index.shape, dtype=values.dtype, device=values.device)
    picked = values.gather(1, turn_index.clamp(min=0).long())  # (B, T)
    return torch.where(turn_index >= 0, picked, 0.0)


@torch.no_grad()
def redistribute_multiplicative(
    adv: Tensor,
    turn_index: Tensor,
    multipliers: Tensor,
    turn_valid: Tensor,
    row_fallback: Tensor | None = None,
    reasons: list[str | None] | None = None,
    turn_tokens: Tensor | None = None,
    conserve: Literal["token_sum", "turn_mean", "none"] = "token_sum",
) -> CreditOutput:
    """Multiplicative composition, credit-interface.md Eq. I-2: out[b, t] = A_b · m_{b,k} on the tokens of turn k,
    A_b on every loss token of a fallback row (plain GRPO broadcast, G4), 0 on tokens with turn_index = -1 (G1).

    A row with no loss token is all zeros (reason `empty_row`, G6); a row with a non-finite multiplier on one of its
    turns goes to fallback (reason `nonfinite`, §8.3). Arithmetic in float64, output cast to `adv.dtype` (G9).

    Args:
        adv (`Tensor`): (B,) trajectory advantages A (Eq. I-1, TRL's value).
        turn_index (`Tensor`): (B, T) int, k on the loss tokens of turn k, -1 elsewhere.
        multipliers (`Tensor`): (B, K) m_{b,k}.
        turn_valid (`Tensor`): (B, K) bool, k < K_b.
        row_fallback (`Tensor`, *optional*): (B,) bool rows the producer sends to fallback.
        reasons (`list[str | None]`, *optional*): the producer's reason code per row (read where `row_fallback`).
        turn_tokens (`Tensor`, *optional*): (B, K) n_{b,k} from the producer; checked against Eq. I-5.
        conserve (`str`, *optional*, defaults to `"token_sum"`): the declared measure for the residual: `token_sum`
            |Σ_k n_k m_k − N| / N (DRACO, AlignOPSD), `turn_mean` |mean_k m_k − 1| (TASPO), or `none`.

    Returns:
        `CreditOutput`.

    >>> out = redistribute_multiplicative(torch.tensor([2.0]), torch.tensor([[0, 0, -1, 1]]),
    ...                                   torch.tensor([[0.75, 1.5]]), torch.tensor([[True, True]]))
    >>> out.advantages.tolist()  # 2·0.75 on turn 0, 0 on the gap, 2·1.5 on turn 1
    [[1.5, 1.5, 0.0, 3.0]]
    """
    a, m, live, n, fb, why = _credit_rows(
        adv, turn_index, multipliers, turn_valid, row_fallback, reasons, turn_tokens, 1
    )
    out = a.unsqueeze(1) * _per_token(m, turn_index)  # (B, T) Eq. I-2; m = 1 on fallback rows (G4)
    nf = n.to(torch.float64)
    if conserve == "token_sum":
        N = (nf * live).sum(dim=1)  # (B,)
        residual = ((nf * m * live).sum(dim=1) - N).abs() / N.clamp(min=1.0)
    elif conserve == "turn_mean":
        residual = ((m * live).sum(dim=1) / live.sum(dim=1).clamp(min=1) - 1.0).abs()
    elif conserve == "none":
        residual = torch.zeros_like(a)
    else:
        raise ValueError(f"conserve must be 'token_sum', 'turn_mean' or 'none', got {conserve!r}")
    residual = torch.where(fb, 0.0, residual)
    return CreditOutput(advantages=out.to(adv.dtype), fallback=fb, reasons=why, values=m, residual=residual)


@torch.no_grad()
def redistribute_additive(
    adv: Tensor,
    turn_index: Tensor,
    offsets: Tensor,
    turn_valid: Tensor,
    omega: float,
    row_fallback: Tensor | None = None,
    reasons: list[str | None] | None = None,
    turn_tokens: Tensor | None = None,
) -> CreditOutput:
    """Additive composition, credit-interface.md Eq. I-3: out[b, t] = A_b + ω · o_{b,k} on the tokens of turn k, 0 on
    tokens with turn_index = -1. The fallback is o ≡ 0 (plain GRPO broadcast). Nothing is conserved per row, so the
    residual is 0 and `values` holds ω · o. Output cast to `adv.dtype`.

    Args:
        adv (`Tensor`): (B,) trajectory advantages A.
        turn_index (`Tensor`): (B, T) int.
        offsets (`Tensor`): (B, K) o_{b,k}.
        turn_valid (`Tensor`): (B, K) bool.
        omega (`float`): ω ≥ 0.
        row_fallback, reasons, turn_tokens: as in `redistribute_multiplicative`.

    >>> redistribute_additive(torch.tensor([1.0]), torch.tensor([[0, -1, 1]]), torch.tensor([[0.5, -2.0]]),
    ...                       torch.tensor([[True, True]]), omega=0.5).advantages.tolist()
    [[1.25, 0.0, 0.0]]
    """
    if not omega >= 0:
        raise ValueError(f"omega must be >= 0, got {omega}")
    a, o, _, _, fb, why = _credit_rows(adv, turn_index, offsets, turn_valid, row_fallback, reasons, turn_tokens, 0.0)
    shift = omega * o  # (B, K), 0 on fallback rows
    out = torch.where(turn_index >= 0, a.unsqueeze(1) + _per_token(shift, turn_index), 0.0)  # (B, T) Eq. I-3
    return CreditOutput(out.to(adv.dtype), fallback=fb, reasons=why, values=shift, residual=torch.zeros_like(a))


@torch.no_grad()
def token_budget_multipliers(weights: Tensor, turn_tokens: Tensor, turn_valid: Tensor) -> tuple[Tensor, Tensor]:
    """Token-budget normalisation, credit-interface.md Eq. I-4 (= draco.md Eq. 8):
    m_{b,k} = N_b · w_{b,k} / (n_{b,k} · Σ_j w_{b,j}), so that Σ_k n_{b,k} · m_{b,k} = N_b.

    Only turns with n ≥ 1 take part (a turn cut to no token has nothing to carry its share, C7). A row whose weights
    sum to ≤ 1e-12 (§8.2) returns m = 0 and is flagged for fallback (`zero_weight_sum`, conventions.md C8).

    Args:
        weights (`Tensor`): (B, K) w ≥ 0.
        turn_tokens (`Tensor`): (B, K) n_{b,k} (Eq. I-5).
        turn_valid (`Tensor`): (B, K) bool.

    Returns:
        `tuple[Tensor, Tensor]`: m (B, K) float64, 0 on turns without tokens; zero-sum flag (B,) bool.

    >>> m, zero = token_budget_multipliers(torch.tensor([[1.0, 3.0]]), torch.tensor([[2, 6]]), torch.tensor([[1, 1]]))
    >>> m.tolist(), zero.tolist()  # N = 8: m_0 = 8·1/(2·4) = 1, m_1 = 8·3/(6·4) = 1
    ([[1.0, 1.0]], [False])
    """
    n = turn_tokens.to(torch.float64)  # (B, K)
    live = turn_valid.bool() & (n > 0)
    w = torch.where(live, weights.to(torch.float64), 0.0)  # (B, K)
    if bool((w < 0).any()):
        raise ValueError("token_budget_multipliers needs non-negative weights (credit-interface.md Eq. I-4)")
    N = (n * live).sum(dim=1, keepdim=True)  # (B, 1)
    total = w.sum(dim=1, keepdim=True)  # (B, 1)
    zero = total.squeeze(1) <= 1e-12  # §8.2: Σw ≤ 1e-12 is zero
    m = N * w / (n.clamp(min=1.0) * torch.where(zero.unsqueeze(1), 1.0, total))  # Eq. I-4
    return torch.where(live & ~zero.unsqueeze(1), m, 0.0), zero


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
def draco_step_weights(verdicts: Tensor, citations: Tensor, adv: Tensor, turn_valid: Tensor) -> tuple[Tensor, Tensor]:
    """DRACO's step weights from credit-stage verdicts and citations, draco.md Eq. 4-6.

    P_j / F_j = number of PASS / FAIL verdicts citing step j (Eq. 4); Q_j = P_j / (P_j + F_j) on cited steps; an
    uncited step takes the mean Q of the row's cited steps (Eq. 5); w_j = Q_j for a winner (A ≥ 0) and 1 − Q_j for a
    loser (A < 0) (Eq. 6). NOT_APPLICABLE verdicts (0) are ignored. Verdicts of dropped criteria must not be passed
    (pad them with 0).

    Args:
        verdicts (`Tensor`): (B, C) int, +1 PASS, -1 FAIL, 0 NOT_APPLICABLE (credit stage, surviving criteria only).
        citations (`Tensor`): (B, C, K) bool Z (see `draco_citations`).
        adv (`Tensor`): (B,) A.
        turn_valid (`Tensor`): (B, K) bool.

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
    q = torch.where(hit, P / (P + F).clamp(min=1.0), 0.0)  # Eq. 4
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

    Returns:
        `CreditOutput` with the token-sum residual of P1.
    """
    B, K = turn_valid.shape
    n = turn_token_counts(turn_index, K)  # (B, K) Eq. I-5
    w, cited = draco_step_weights(verdicts, citations, adv, turn_valid)  # (B, K) Eq. 4-6
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


def credit_metrics(
    out: CreditOutput, adv: Tensor, turn_index: Tensor, turn_valid: Tensor, form: str = "multiplicative"
) -> dict[str, float]:
    """The shared per-step metrics of credit-interface.md §10 for a batch of rows. `form` is `multiplicative`
    (`credit/mult_*` over the turns holding tokens) or `additive` (`credit/offset_abs_mean`). Empty means are NaN."""
    B, K = turn_valid.shape
    n = turn_token_counts(turn_index, K)  # (B, K)
    live = turn_valid.bool() & (n > 0)  # (B, K)
    tok = turn_index >= 0  # (B, T)
    x = out.advantages.detach().to(torch.float64)  # (B, T)
    metrics = {"credit/fallback_rate": float(out.fallback.double().mean()) if B else math.nan}
    for reason in sorted({r for r in out.reasons if r is not None}):
        metrics[f"credit/fallback_rate/{reason}"] = sum(r == reason for r in out.reasons) / B
    metrics["credit/nonfinite_fallbacks"] = float(sum(r == "nonfinite" for r in out.reasons))
    v = out.values[live]  # values over the turns holding tokens
    if form == "multiplicative":
        stats = (v.mean(), v.min(), v.max(), v.std(unbiased=False)) if v.numel() else (math.nan,) * 4
        for name, value in zip(("mean", "min", "max", "std"), stats, strict=True):
            metrics[f"credit/mult_{name}"] = float(value)
    elif form == "additive":
        metrics["credit/offset_abs_mean"] = float(v.abs().mean()) if v.numel() else math.nan
    else:
        raise ValueError(f"form must be 'multiplicative' or 'additive', got {form!r}")
    metrics["credit/conservation_residual_max"] = float(out.residual.max()) if B else math.nan
    sign_a = torch.sign(adv.detach().to(torch.float64)).unsqueeze(1)  # (B, 1)
    flips = tok & (torch.sign(x) != 0) & (torch.sign(x) != sign_a)  # (B, T)
    metrics["credit/sign_flip_token_frac"] = float(flips.sum() / tok.sum().clamp(min=1))
    metrics["credit/turns_per_traj_mean"] = float(live.sum(dim=1).double().mean()) if B else math.nan
    metrics["credit/tokens_per_turn_mean"] = float(n[live].double().mean()) if bool(live.any()) else math.nan
    metrics["credit/adv_token_abs_max"] = float(x.abs().max()) if x.numel() else 0.0
    return metrics
