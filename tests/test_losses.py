"""Layer 1: ratios, surrogates, value loss and aggregation in `trainers/losses.py`, and MPO's turn-level ratio and
actor loss (`trainers/mpo.py`). Hand-computed values with the arithmetic in comments and gradient-flow assertions
(what must and must not receive gradient): `docs/methods/mpo.md` §7 items 12-19, `docs/methods/t1.md` §7 items 13-15
and 21."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd.functional import jacobian

from trainers.losses import (
    LOSS_TYPES,
    aggregate_loss,
    clip_fractions,
    clipped_surrogate,
    clipped_surrogate_loss,
    clipped_value_loss,
    masked_token_mean,
)
from trainers.mpo import mpo_loss, turn_importance_ratio, turn_log_ratio

F64 = torch.float64
LOG = math.log


def t(x, dtype=F64, grad=False):
    return torch.tensor(x, dtype=dtype, requires_grad=grad)


def close(actual, expected, atol=1e-12, rtol=1e-12):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=rtol)


def grad_of(loss: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    (g,) = torch.autograd.grad(loss, x)
    return g


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation


def test_masked_token_mean_hand_computed_and_all_masked():
    # (1 + 2 + 3) / 3 model tokens; the 9 sits on an environment token
    x = t([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0]], grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_token_mean(x, mask), 2.0)
    close(masked_token_mean(x, mask, num_tokens=6), 1.0)  # global N_tok = 6 -> 6 / 6
    # all-masked batch: 0, not NaN (C6), and zero gradient
    loss = masked_token_mean(x, torch.zeros_like(mask))
    assert loss.item() == 0.0
    assert (grad_of(loss, x) == 0).all()


def test_gradient_accumulation_equals_one_batch():
    # mpo.md §7 item 18 / t1.md item 21: micro-batches normalised by the global N_tok add up to the one-batch loss
    g = torch.Generator().manual_seed(0)
    logps = torch.randn(6, 5, generator=g, dtype=F64).requires_grad_()
    old = logps.detach() + 0.1 * torch.randn(6, 5, generator=g, dtype=F64)
    adv = torch.randn(6, 5, generator=g, dtype=F64)
    mask = (torch.rand(6, 5, generator=g) < 0.7).long()
    ti = torch.where(mask.bool(), torch.arange(5).div(2, rounding_mode="floor").expand(6, 5), -1)
    n_tok = mask.sum()
    full = masked_token_mean(mpo_loss(logps, old, adv, ti, mask), mask, n_tok)
    parts = sum(
        masked_token_mean(
            mpo_loss(logps[i : i + 3], old[i : i + 3], adv[i : i + 3], ti[i : i + 3], mask[i : i + 3]),
            mask[i : i + 3],
            n_tok,
        )
        for i in (0, 3)
    )
    close(parts, full)
    close(grad_of(parts, logps), grad_of(full, logps))


# Two rows of different lengths: row 0 has 3 loss tokens (values 1, 2, 3; the 9 sits on an environment token), row 1
# has 1 loss token (value 6). Σ m x = 1 + 2 + 3 + 6 = 12 over 4 loss tokens.
AGG_X = [[1.0, 2.0, 9.0, 3.0], [6.0, 5.0, 0.0, 0.0]]
AGG_MASK = [[1, 1, 0, 1], [1, 0, 0, 0]]
AGG_EXPECTED = {
    "grpo": (6 / 3 + 6 / 1) / 2,  # row means 2 and 6, then their mean: 4 (each row weighs the same; grpo.md Eq. 6)
    "bnpo": 12 / 4,  # one token mean over the micro-batch: 3 (grpo.md Eq. 8)
    "dapo": 12 / 8,  # over the given N_tok = 8 (e.g. two such micro-batches per optimizer step): 1.5 (grpo.md Eq. 7)
    "dr_grpo": 12 / (2 * 5),  # over B x max_completion_length = 2 x 5: 1.2 (Dr. GRPO)
}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_aggregate_loss_hand_computed(loss_type):
    x = t(AGG_X, grad=True)
    mask = torch.tensor(AGG_MASK)
    loss = aggregate_loss(x, mask, loss_type, num_tokens=8, max_completion_length=5)
    close(loss, AGG_EXPECTED[loss_type])
    # gradient: the weight of each loss token; exactly 0 on the environment token and the padding
    weight = {"grpo": [1 / 6, 1 / 2], "bnpo": [1 / 4, 1 / 4], "dapo": [1 / 8, 1 / 8], "dr_grpo": [1 / 10, 1 / 10]}
    w0, w1 = weight[loss_type]  # grpo: 1 / (B * N_b) = 1 / (2 * 3) on row 0, 1 / (2 * 1) on row 1
    close(grad_of(loss, x), [[w0, w0, 0.0, w0], [w1, 0.0, 0.0, 0.0]])


def test_aggregate_loss_all_masked_row_counts_in_grpo_and_dtype():
    # row 1 has no loss token: it adds 0 but still counts in B, as in TRL: (6 / 3 + 0) / 2 = 1
    x = t([[1.0, 2.0, 3.0], [float("nan"), 4.0, 5.0]], dtype=torch.float32)
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]])
    loss = aggregate_loss(x, mask, "grpo")
    assert loss.dtype == torch.float32
    close(loss, 1.0)


def test_aggregate_loss_refuses_unknown_types_and_missing_normalisers():
    x, mask = t(AGG_X), torch.tensor(AGG_MASK)
    for bad in ("sapo", "cispo", "luspo", "vespo", "token_mean"):
        with pytest.raises(ValueError, match="loss_type"):
            aggregate_loss(x, mask, bad)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(x, mask, "dapo")
    with pytest.raises(ValueError, match="max_completion_length"):
        aggregate_loss(x, mask, "dr_grpo")


# ---------------------------------------------------------------------------------------------------------------------
# Token-level clipped surrogate (t1.md Eq. 10-11)


def test_clipped_surrogate_loss_hand_computed():
    # ratios [1.5, 0.5, 1.1, 1.5], A = [1, -1, 2, -1], eps 0.2:
    # tok0: min(1.5*1, 1.2*1) = 1.2 -> L = -1.2 (clipped, no grad)
    # tok1: min(0.5*-1, 0.8*-1) = -0.8 -> L = 0.8 (clipped, no grad)
    # tok2: min(2.2, 2.2) -> L = -2.2, dL/dlogp = -A rho = -2.2
    # tok3: min(-1.5, -1.2) = -1.5 -> L = 1.5, dL/dlogp = -A rho = 1.5
    old = t([[0.0, 0.0, 0.0, 0.0]])
    logps = t([[LOG(1.5), LOG(0.5), LOG(1.1), LOG(1.5)]], grad=True)
    adv = t([[1.0, -1.0, 2.0, -1.0]])
    mask = torch.ones(1, 4)
    loss = clipped_surrogate_loss(logps, old, adv, mask, 0.2, 0.2)
    close(loss, [[-1.2, 0.8, -2.2, 1.5]])
    close(grad_of(loss.sum(), logps), [[0.0, 0.0, -2.2, 1.5]])
    # dual clip at 1.4 caps tok3 at 1.4 * |A| = 1.4 and kills its gradient
    dual = clipped_surrogate_loss(logps, old, adv, mask, 0.2, 0.2, c_dual=1.4)
    close(dual, [[-1.2, 0.8, -2.2, 1.4]])
    close(grad_of(dual.sum(), logps), [[0.0, 0.0, -2.2, 0.0]])


def test_clipped_surrogate_loss_masks_and_no_nan_leak():
    # environment/padding tokens: loss exactly 0 and gradient exactly 0, even with NaN/inf inputs there
    logps = t([[-1.0, float("nan"), -2.0, float("-inf")]], grad=True)
    old = t([[-1.1, 0.0, float("nan"), -1.0]])  # token 0: rho = exp(0.1), inside the clip
    adv = t([[1.0, float("nan"), float("inf"), 2.0]])
    mask = torch.tensor([[1, 0, 0, 0]])
    loss = clipped_surrogate_loss(logps, old, adv, mask, 0.2, 0.2, c_dual=3.0)
    assert torch.isfinite(loss).all() and (loss[0, 1:] == 0).all()
    g = grad_of(masked_token_mean(loss, mask), logps)
    assert torch.isfinite(g).all() and (g[0, 1:] == 0).all() and g[0, 0] != 0


def test_on_policy_gradient_is_plain_policy_gradient():
    # t1.md item 13 / mpo.md item 14: pi = pi_old -> rho = 1, no clip, grad = -(1/N) A on each model token
    logps = t([[-0.5, -1.0, -2.0, -0.1]], grad=True)
    adv = t([[0.3, -2.0, 5.0, 1.0]])
    mask = torch.tensor([[1, 1, 0, 1]])
    ti = torch.tensor([[0, 0, -1, 1]])
    expected = torch.where(mask.bool(), -adv / 3, 0.0)
    token = masked_token_mean(clipped_surrogate_loss(logps, logps.detach(), adv, mask, 0.2, 0.2), mask)
    close(grad_of(token, logps), expected)
    turn = masked_token_mean(mpo_loss(logps, logps.detach(), adv, ti, mask), mask)
    close(grad_of(turn, logps), expected)


def test_standard_clip_zero_gradient_cases():
    # t1.md item 14: A > 0 and rho > 1 + eps -> 0 grad; A < 0 and rho < 1 - eps -> 0 grad
    logps = t([[LOG(1.3), LOG(0.7)]], grad=True)
    loss = clipped_surrogate_loss(logps, torch.zeros(1, 2, dtype=F64), t([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.2)
    assert (grad_of(loss.sum(), logps) == 0).all()


def test_clipped_surrogate_asymmetric_bounds_and_fractions():
    # eps_low 0.1, eps_high 0.3: rho 1.25 with A > 0 is inside (no clip), rho 0.85 with A < 0 is clipped at 0.9
    ratio = t([[1.25, 0.85, 3.5, 1.0]], grad=True)
    adv = t([[2.0, -1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss = clipped_surrogate(ratio, adv, mask, eps_low=0.1, eps_high=0.3, c_dual=3.0)
    # tok0: -2.5 ; tok1: max(0.85, 0.9) = 0.9 ; tok2: max(3.5, 1.3) = 3.5 -> dual clip min(3.5, 3) = 3 ; tok3 masked
    close(loss, [[-2.5, 0.9, 3.0, 0.0]])
    close(grad_of(loss.sum(), ratio), [[-2.0, 0.0, 0.0, 0.0]])
    fr = clip_fractions(ratio, adv, mask, eps_low=0.1, eps_high=0.3, c_dual=3.0)
    # clipped: tok1 (A < 0, rho < 0.9) -> 1/3 ; dual: tok2 (A < 0, rho > 3) -> 1/3
    close(fr["clip_frac"], 1 / 3)
    close(fr["dual_clip_frac"], 1 / 3)
    assert clip_fractions(ratio, adv, torch.zeros_like(mask), 0.1, 0.3)["clip_frac"].item() == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Clipped value loss (mpo.md Eq. 18, t1.md Eq. 12)


def test_clipped_value_loss_hand_computed():
    # V_old = 1, clip 0.2:
    # tok0: V 1.5 -> V_clip 1.2; (1.5-2)^2 = 0.25 < (1.2-2)^2 = 0.64 -> clipped branch, zero grad
    # tok1: V 0.5 -> V_clip 0.8; (0.5-2)^2 = 2.25 > 1.44 -> unclipped branch, grad 2 (0.5 - 2) = -3
    # tok2: V 1.05 (inside the clip): 1.05^2 = 1.1025, grad 2 * 1.05 = 2.1 ; tok3 masked
    values = t([[1.5, 0.5, 1.05, 7.0]], grad=True)
    old, ret = t([[1.0, 1.0, 1.0, 1.0]]), t([[2.0, 2.0, 0.0, float("nan")]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss = clipped_value_loss(values, old, ret, mask, clip=0.2)
    close(loss, [[0.64, 2.25, 1.1025, 0.0]])
    close(grad_of(loss.sum(), values), [[0.0, -3.0, 2.1, 0.0]])


def test_clipped_value_loss_no_gradient_to_targets_and_all_masked():
    values = t([[0.1, 0.15]], grad=True)  # inside the clip: the unclipped branch carries the gradient
    old = t([[0.0, 0.0]], grad=True)
    ret = t([[1.0, 1.0]], grad=True)
    loss = masked_token_mean(clipped_value_loss(values, old, ret, torch.ones(1, 2), 0.2), torch.ones(1, 2))
    g_v, g_old, g_ret = torch.autograd.grad(loss, (values, old, ret), allow_unused=True)
    assert g_old is None and g_ret is None and (g_v != 0).any()  # stop-gradient targets receive nothing
    empty = masked_token_mean(clipped_value_loss(values, old, ret, torch.zeros(1, 2), 0.2), torch.zeros(1, 2))
    assert empty.item() == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# Turn-level ratio (mpo.md Eq. 13-15)


def ratio_batch():
    # row 0: turn 0 -> positions 0,1 ; env 2 ; turn 1 -> positions 3,4,5 ; row 1: turn 0 -> positions 0..2, pad
    ti = torch.tensor([[0, 0, -1, 1, 1, 1], [0, 0, 0, -1, -1, -1]])
    mask = (ti >= 0).long()
    old = t([[-1.0, -2.0, -5.0, -0.5, -1.5, -1.0], [-0.3, -0.2, -0.1, 0.0, 0.0, 0.0]])
    ell = t([[0.1, -0.3, 9.0, 0.2, 0.05, -0.1], [0.02, 0.03, -0.01, 4.0, 4.0, 4.0]])  # 9 and 4s sit off the mask
    return ti, mask, old, old + ell


def test_turn_log_ratio_hand_computed():
    ti, mask, old, logps = ratio_batch()
    # product: row 0 turns -> 0.1 - 0.3 = -0.2 ; 0.2 + 0.05 - 0.1 = 0.15 ; row 1 -> 0.04 ; (row 1 has no turn 1)
    close(turn_log_ratio(logps, old, ti, mask), [[-0.2, 0.15], [0.04, 0.0]])
    # geomean: divide by n_k -> -0.1, 0.05 ; 0.04 / 3
    close(turn_log_ratio(logps, old, ti, mask, mode="geomean"), [[-0.1, 0.05], [0.04 / 3, 0.0]])
    with pytest.raises(ValueError, match="mode"):
        turn_log_ratio(logps, old, ti, mask, mode="mean")


@pytest.mark.parametrize("mode", ["product", "geomean"])
def test_turn_ratio_value_and_jacobian(mode):
    # items 12-13: rho_{k,i} = exp(Lambda_k) on every token of turn k; d rho_i / d logp_j = rho_i on the diagonal,
    # 0 off it (within a turn, across turns, across rows); env/pad tokens: rho = 1 and no gradient
    ti, mask, old, logps = ratio_batch()
    lam = turn_log_ratio(logps, old, ti, mask, mode=mode)
    rho = turn_importance_ratio(logps, old, ti, mask, mode=mode)
    expected = torch.where(mask.bool(), lam.gather(1, ti.clamp(min=0)).exp(), 1.0)
    close(rho, expected)
    jac = jacobian(lambda x: turn_importance_ratio(x, old, ti, mask, mode=mode), logps.detach())  # (B, T, B, T)
    flat = jac.reshape(12, 12)
    close(flat, torch.diag(torch.where(mask.bool(), rho, 0.0).reshape(-1)))


def test_single_turn_ratio_is_the_sequence_ratio():
    # item 6: one turn -> rho = pi_theta(y) / pi_old(y) for the whole sequence, on every token
    ti = torch.tensor([[0, 0, 0, -1]])
    old, logps = t([[-1.0, -2.0, -0.5, 0.0]]), t([[-0.9, -2.2, -0.4, 3.0]])
    rho = turn_importance_ratio(logps, old, ti, ti >= 0)
    close(rho[0, :3], [math.exp(0.1 - 0.2 + 0.1)] * 3)


def test_turn_ratio_clamp():
    # item 17: |Lambda| > c -> forward exp(+-c), finite; gradient still rho * d logp
    ti = torch.tensor([[0, 0, 1]])
    logps = t([[15.0, 15.0, -30.0]], grad=True)
    rho = turn_importance_ratio(logps, torch.zeros(1, 3, dtype=F64), ti, ti >= 0, clamp=20.0)
    close(rho.detach(), [[math.exp(20.0), math.exp(20.0), math.exp(-20.0)]])
    close(grad_of(rho.sum(), logps), rho.detach())


def test_mpo_loss_gradient_equals_stop_gradient_surrogate_without_clipping():
    # item 13: no clip active -> grad of the loss == grad of -(1/N) sum sg[rho] A log pi
    ti, mask, old, logps = ratio_batch()
    logps = (old + 0.3 * (logps - old)).requires_grad_()  # small drift: turn ratios within [0.8, 1.2]
    adv = t([[0.5, -1.0, 0.0, 2.0, -0.5, 1.0], [1.0, 1.0, -3.0, 0.0, 0.0, 0.0]])
    loss = masked_token_mean(mpo_loss(logps, old, adv, ti, mask), mask)
    rho = turn_importance_ratio(logps, old, ti, mask).detach()
    assert ((rho - 1).abs() < 0.2).all()
    surrogate = -(torch.where(mask.bool(), rho * adv * logps, 0.0)).sum() / mask.sum()
    close(grad_of(loss, logps), grad_of(surrogate, logps))


def test_turn_shared_clipping():
    # item 15: turn 0 ratio exp(0.3) > 1.2 with all A > 0 -> every token of turn 0 has zero gradient; turn 1's
    # gradient is what it is without turn 0; mixed signs: the decision depends only on (rho_k, sign A)
    ti = torch.tensor([[0, 0, 0, 1, 1]])
    mask = ti >= 0
    old = torch.zeros(1, 5, dtype=F64)
    logps = t([[0.1, 0.1, 0.1, 0.01, -0.02]], grad=True)
    adv = t([[1.0, 2.0, 0.5, 1.0, -1.0]])
    g = grad_of(masked_token_mean(mpo_loss(logps, old, adv, ti, mask), mask, 5), logps)
    assert (g[0, :3] == 0).all()
    only_1 = torch.tensor([[0, 0, 0, 1, 1]]).bool()
    g1 = grad_of(masked_token_mean(mpo_loss(logps, old, adv, ti, only_1), only_1, 5), logps)
    close(g[0, 3:], g1[0, 3:])
    # mixed signs in the clipped turn: A < 0 tokens keep their gradient (clip binds only for A > 0 at rho > 1.2)
    mixed = t([[1.0, -2.0, 0.5, 1.0, -1.0]])
    gm = grad_of(mpo_loss(logps, old, mixed, ti, mask).sum(), logps)
    rho0 = math.exp(0.3)
    close(gm[0, :3], [0.0, 2.0 * rho0, 0.0])


def test_dual_clip_zeroes_gradient_beyond_c_dual():
    # item 16: A < 0 and rho > c_dual (exp(1.2) = 3.32 > 3) -> zero gradient and loss 3 |A| ;
    # rho <= c_dual (exp(1.0) = 2.72) -> the dual clip has no effect (same as without it)
    ti = torch.tensor([[0, 1]])
    logps = t([[1.2, 1.0]], grad=True)
    old = torch.zeros(1, 2, dtype=F64)
    adv = t([[-1.0, -1.0]])
    loss = mpo_loss(logps, old, adv, ti, ti >= 0, c_dual=3.0)
    close(loss[0, 0], 3.0)
    g = grad_of(loss.sum(), logps)
    no_dual = clipped_surrogate(turn_importance_ratio(logps, old, ti, ti >= 0), adv, ti >= 0, 0.2, 0.2, None)
    assert g[0, 0] == 0
    close(g[0, 1], grad_of(no_dual[0, 1], logps)[0, 1])
    close(g[0, 1], math.exp(1.0))  # dL/dlogp = -A rho


def test_mpo_loss_env_tokens_receive_no_gradient_and_dtype():
    ti, mask, old, logps = ratio_batch()
    logps32 = logps.float().requires_grad_()
    adv = torch.ones(2, 6)
    loss = mpo_loss(logps32, old.float(), adv, ti, mask)
    assert loss.dtype == torch.float32
    g = grad_of(masked_token_mean(loss, mask), logps32)
    assert (g[~mask.bool()] == 0).all() and (g[mask.bool()] != 0).all()
    # a row without any model token: zero loss, zero gradient, no NaN (C6)
    loss_empty = mpo_loss(logps32, old.float(), adv, torch.full_like(ti, -1), torch.zeros_like(mask))
    assert (loss_empty == 0).all()
