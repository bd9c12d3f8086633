"""The step-level credit interface (credit-interface.md): pure tensor functions that turn per-turn weights into
token advantages, shared by every method that redistributes TRL's trajectory advantage A over the turns of a row
(DRACO today, `trainers/draco.py`). Tensors and plain numbers in, detached tensors out.

Conventions: B rows, T tokens, K turns; `turn_index` (B, T) holds k on the loss tokens of turn k and -1 on every other
token; `turn_valid` (B, K) marks the turns a row has. Arithmetic in float64, outputs cast to the dtype of `adv` (G9).

* `redistribute_multiplicative` (Eq. I-2): A · m_{b,k} on the tokens of turn k; `token_budget_multipliers` (Eq. I-4)
  builds m from non-negative weights so that the row's token sum A · N is conserved.
* `redistribute_additive` (Eq. I-3): A + ω · o_{b,k}.
* Rows the producer cannot credit fall back to the plain GRPO broadcast (§7, G4), with a reason code; `credit_metrics`
  gives the shared `credit/*` metrics (§10).

Kept out of `trainers/advantages.py` because it is one interface with its own page and invariants (G1-G9), and a
method that uses it (DRACO) never needs the critic estimators there.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from trainers.advantages import turn_lengths


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
