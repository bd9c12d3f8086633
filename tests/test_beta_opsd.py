"""β-OPSD (docs/methods/beta-opsd.md, arXiv 2607.28582): the pure math of trainers/beta_opsd.py. The schedule (Eq. 4),
both targets (Eq. 5-6) with their exact endpoints (C15), the token mismatch (Eq. 7), the return-to-go (Eq. 8, both
scopes), the loss (Eq. 9), the blend with GRPO (Eq. 10, C14) and the config guards, checked against §7 properties
1-13, 15, 17 and 18 of the spec on hand-computed cases, numpy re-implementations and brute-force enumeration of a
tabular toy policy. Properties 14 and 16 (trainer level) live in test_beta_opsd_trainer.py."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from trainers.beta_opsd import (
    BetaOPSDConfig,
    beta_opsd_loss,
    blend_advantages,
    geometric_target_logps,
    mixture_target_logps,
    reward_to_go,
    teacher_weight,
    token_mismatch,
)

F64 = torch.float64
NEG_INF = float("-inf")
INTERIOR_W = [0.1, 0.3, 0.5, 0.8, 0.95]


def rand_logps(gen: torch.Generator, *shape: int, scale: float = 2.0) -> torch.Tensor:
    """Random log-softmax outputs over the last axis, float64."""
    return torch.log_softmax(scale * torch.randn(*shape, generator=gen, dtype=F64), dim=-1)


def gather(logps: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return logps.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # (B, T)


def full_geometric(ref: torch.Tensor, teacher: torch.Tensor, w: float) -> torch.Tensor:
    """(B, T, V) log p̃ of Eq. 5 for every vocabulary entry, by calling the function once with ids ≡ v per v."""
    B, T, V = ref.shape
    cols = [geometric_target_logps(ref, teacher, torch.full((B, T), v), w)[0] for v in range(V)]
    return torch.stack(cols, dim=-1)


# ---------------------------------------------------------------------------------------------------------------------
# 1. Schedule (Eq. 4)


@pytest.mark.parametrize("start,end,K", [(0.5, 0.8, 4), (0.5, 0.8, 200), (0.8, 0.5, 7), (0.2, 1.0, 11), (0.0, 0.6, 3)])
def test_schedule_endpoints_linear_and_clipped(start, end, K):
    assert teacher_weight(0, start, end, K) == start  # w_0 = w_start, exactly
    assert teacher_weight(K - 1, start, end, K) == end  # w_{K-1} = w_end, exactly
    for k in (K, K + 1, 10 * K, 10**6):  # held at w_end past K - 1
        assert teacher_weight(k, start, end, K) == end
    ws = np.array([teacher_weight(k, start, end, K) for k in range(K)])
    expected = start + (end - start) * np.arange(K) / (K - 1)  # s_k = k / (K - 1)
    np.testing.assert_allclose(ws, expected, rtol=0, atol=1e-15)
    np.testing.assert_allclose(np.diff(ws, 2), 0.0, atol=1e-15)  # linear: second differences vanish
    # (β = 1/w ≥ 1 follows from 0 < w ≤ 1, which the endpoints and linearity above pin; no separate check)


def test_schedule_hand_values_and_short_schedules():
    # K = 4, 0.5 → 0.8: s = 0, 1/3, 2/3, 1 -> w = 0.5, 0.6, 0.7, 0.8; β = 2, 5/3, 10/7, 5/4
    ws = [teacher_weight(k, 0.5, 0.8, 4) for k in range(4)]
    assert ws == pytest.approx([0.5, 0.6, 0.7, 0.8], abs=1e-15)
    assert [1 / w for w in ws] == pytest.approx([2.0, 5 / 3, 10 / 7, 1.25], abs=1e-14)
    # K = 200 (paper), step 100 (the reported checkpoint): 0.5 + 0.3 * 100/199
    assert teacher_weight(100, 0.5, 0.8, 200) == pytest.approx(0.5 + 0.3 * 100 / 199, abs=1e-15)
    for K in (1, 0, -3):  # K <= 1 gives w_end at every step
        for k in (0, 1, 5):
            assert teacher_weight(k, 0.5, 0.8, K) == 0.8


# ---------------------------------------------------------------------------------------------------------------------
# 2. Exact endpoints in both target spaces (C15), also with masked (−inf) vocabulary entries


def test_mixture_endpoints_exact_with_masked_entries():
    # sampled-token log-probs; −inf where one model's masked vocabulary holds the sampled token
    ref = torch.tensor([[math.log(0.5), NEG_INF, math.log(0.2)]], dtype=F64)
    teacher = torch.tensor([[NEG_INF, math.log(0.25), math.log(0.4)]], dtype=F64)
    at0, at1 = mixture_target_logps(ref, teacher, 0.0), mixture_target_logps(ref, teacher, 1.0)
    assert torch.equal(at0, ref) and torch.equal(at1, teacher)
    assert not at0.isnan().any() and not at1.isnan().any()
    assert torch.isfinite(at0[0, [0, 2]]).all() and torch.isfinite(at1[0, 1:]).all()
    # interior w = 0.25: log(0.75·0.5), log(0.25·0.25), log(0.75·0.2 + 0.25·0.4) = log(0.375), log(0.0625), log(0.25)
    mid = mixture_target_logps(ref, teacher, 0.25)
    torch.testing.assert_close(mid, torch.tensor([[0.375, 0.0625, 0.25]], dtype=F64).log(), rtol=0, atol=1e-14)


def test_geometric_endpoints_exact_with_masked_entries():
    gen = torch.Generator().manual_seed(1)
    ref, teacher = rand_logps(gen, 2, 3, 5), rand_logps(gen, 2, 3, 5)
    ref[..., 3] = NEG_INF  # the reference's masked vocabulary entry
    teacher[..., 1] = NEG_INF  # the teacher's
    ref, teacher = ref.log_softmax(-1), teacher.log_softmax(-1)
    ids = torch.tensor([[1, 3, 0], [3, 1, 4]])  # sampled ids sit on the other distribution's masked entry
    chosen0, z0 = geometric_target_logps(ref, teacher, ids, 0.0)
    chosen1, z1 = geometric_target_logps(ref, teacher, ids, 1.0)
    assert torch.equal(chosen0, gather(ref, ids)) and torch.equal(chosen1, gather(teacher, ids))
    assert torch.equal(z0, torch.zeros(2, 3, dtype=F64)) and torch.equal(z1, torch.zeros(2, 3, dtype=F64))
    for t in (chosen0, z0, chosen1, z1):
        assert not t.isnan().any()  # 0·(−inf) never evaluated
    # where only the zero-weight side is masked the target is finite; where the full-weight side is, −inf
    assert torch.isfinite(chosen0[ids != 3]).all() and (chosen0[ids == 3] == NEG_INF).all()
    assert torch.isfinite(chosen1[ids != 1]).all() and (chosen1[ids == 1] == NEG_INF).all()
    # interior w: a masked entry of either side has target probability 0 (−inf, not NaN); the rest stay finite
    chosen, z = geometric_target_logps(ref, teacher, ids, 0.5)
    assert torch.isfinite(z).all() and not chosen.isnan().any()
    on_masked = (ids == 1) | (ids == 3)
    assert (chosen[on_masked] == NEG_INF).all() and torch.isfinite(chosen[~on_masked]).all()


# ---------------------------------------------------------------------------------------------------------------------
# 3-4. The two targets against independent numpy computations


@pytest.mark.parametrize("w", [0.0, *INTERIOR_W, 1.0])
def test_geometric_target_is_normalised_geometric_mean(w):
    gen = torch.Generator().manual_seed(3)
    ref, teacher = rand_logps(gen, 2, 3, 7), rand_logps(gen, 2, 3, 7)
    full = full_geometric(ref, teacher, w)  # (B, T, V)
    p_ref, p_t = np.exp(ref.numpy()), np.exp(teacher.numpy())
    num = p_ref ** (1 - w) * p_t**w  # π_ref^(1−w)·p_T^w
    np.testing.assert_allclose(full.exp().numpy(), num / num.sum(-1, keepdims=True), rtol=0, atol=1e-12)
    np.testing.assert_allclose(full.exp().sum(-1).numpy(), 1.0, rtol=0, atol=1e-12)
    _, log_z = geometric_target_logps(ref, teacher, torch.zeros(2, 3, dtype=torch.long), w)
    np.testing.assert_allclose(log_z.numpy(), np.log(num.sum(-1)), rtol=0, atol=1e-12)


@pytest.mark.parametrize("w", [0.0, *INTERIOR_W, 1.0])
def test_mixture_target_is_probability_mixture(w):
    gen = torch.Generator().manual_seed(4)
    ref, teacher = rand_logps(gen, 2, 3, 6, scale=4.0), rand_logps(gen, 2, 3, 6, scale=4.0)
    ids = torch.randint(0, 6, (2, 3), generator=gen)
    got = mixture_target_logps(gather(ref, ids), gather(teacher, ids), w)
    expected = np.log((1 - w) * np.exp(gather(ref, ids).numpy()) + w * np.exp(gather(teacher, ids).numpy()))
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12)
    # a proper distribution: the mixture at every vocabulary entry sums to 1
    every = mixture_target_logps(ref, teacher, w)  # (B, T, V): each entry as if it had been sampled
    np.testing.assert_allclose(every.exp().sum(-1).numpy(), 1.0, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# 5-7. The token mismatch with the current-student reference (logp_ref = logp_old)


@pytest.mark.parametrize("space", ["prob_sampled", "logit_full"])
def test_no_signal_at_w0_with_current_student_reference(space):
    gen = torch.Generator().manual_seed(5)
    student, teacher = rand_logps(gen, 3, 4, 6), rand_logps(gen, 3, 4, 6)
    ids = torch.randint(0, 6, (3, 4), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]])
    logp_old = gather(student, ids)
    if space == "prob_sampled":
        target = mixture_target_logps(logp_old, gather(teacher, ids), 0.0)
    else:
        target, _ = geometric_target_logps(student, teacher, ids, 0.0)
    rho = token_mismatch(logp_old, target, mask)
    assert torch.equal(rho, torch.zeros(3, 4, dtype=F64))
    returns = reward_to_go(rho, mask, 0.99)
    assert torch.equal(returns, torch.zeros(3, 4, dtype=F64))
    logp = logp_old.clone().requires_grad_(True)
    beta_opsd_loss(logp, returns, mask).backward()
    assert torch.equal(logp.grad, torch.zeros(3, 4, dtype=F64))


@pytest.mark.parametrize("w", INTERIOR_W)
def test_eq11_identity_logit_full(w):
    gen = torch.Generator().manual_seed(6)
    student, teacher = rand_logps(gen, 3, 5, 8), rand_logps(gen, 3, 5, 8)
    ids = torch.randint(0, 8, (3, 5), generator=gen)
    mask = torch.ones(3, 5, dtype=torch.long)
    mask[1, 3:] = 0
    logp_old, logp_t = gather(student, ids), gather(teacher, ids)
    target, log_z = geometric_target_logps(student, teacher, ids, w)
    rho = token_mismatch(logp_old, target, mask)
    # Eq. 11 with log Z_t = log Σ_v π_θ̄(v)^(1−w)·p_T(v)^w computed in numpy
    log_z_np = np.log((np.exp(student.numpy()) ** (1 - w) * np.exp(teacher.numpy()) ** w).sum(-1))
    expected = np.where(mask.numpy() == 1, w * (logp_old - logp_t).numpy() + log_z_np, 0.0)
    np.testing.assert_allclose(rho.numpy(), expected, rtol=0, atol=1e-6)
    np.testing.assert_allclose(log_z.numpy(), log_z_np, rtol=0, atol=1e-12)
    assert (log_z <= 0).all()  # Hölder


@pytest.mark.parametrize("w", INTERIOR_W)
def test_eq12_lower_bound_prob_sampled(w):
    gen = torch.Generator().manual_seed(7)
    logp_old = -torch.rand(64, 16, generator=gen, dtype=F64) * 8  # π_θ̄(y_t) in (e^-8, 1]
    logp_t = -torch.rand(64, 16, generator=gen, dtype=F64) * 60  # teacher down to e^-60: near the bound
    mask = torch.ones(64, 16)
    rho = token_mismatch(logp_old, mixture_target_logps(logp_old, logp_t, w), mask)
    assert (-rho >= math.log1p(-w) - 1e-12).all()
    # −ρ_t = log(1 − w + w·p_T/π_θ̄), in numpy
    ratio = np.exp(logp_t.numpy() - logp_old.numpy())
    np.testing.assert_allclose((-rho).numpy(), np.log(1 - w + w * ratio), rtol=0, atol=1e-12)
    # the bound is attained in the limit p_T → 0: a teacher at e^-60 sits on it
    sure, unlikely = torch.tensor([[0.0]], dtype=F64), torch.tensor([[-60.0]], dtype=F64)  # π_θ̄ = 1, p_T = e^-60
    tight = token_mismatch(sure, mixture_target_logps(sure, unlikely, w), torch.ones(1, 1))
    assert -tight.item() == pytest.approx(math.log1p(-w), abs=1e-12)


def test_token_mismatch_hand_and_detached():
    # ρ = m·(logp_old − log p̃): [−1 − (−3), (masked), −0.5 − (−0.25)] = [2, 0, −0.25]
    logp_old = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    target = torch.tensor([[-3.0, -1.0, -0.25]], dtype=F64, requires_grad=True)
    rho = token_mismatch(logp_old, target, torch.tensor([[1, 0, 1]]))
    assert torch.equal(rho, torch.tensor([[2.0, 0.0, -0.25]], dtype=F64))
    assert not rho.requires_grad  # Eq. 7 is built from detached values only


# ---------------------------------------------------------------------------------------------------------------------
# 8. Return-to-go (Eq. 8)


def test_reward_to_go_hand_computed():
    rho = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=F64)
    ones = torch.ones(1, 4)
    # γ = 0.5: G3 = 4; G2 = 3 + 0.5·4 = 5; G1 = 2 + 0.5·5 = 4.5; G0 = 1 + 0.5·4.5 = 3.25
    assert torch.equal(reward_to_go(rho, ones, 0.5), torch.tensor([[3.25, 4.5, 5.0, 4.0]], dtype=F64))
    # γ = 1: reversed cumulative sum [10, 9, 7, 4]; γ = 0: G = ρ
    assert torch.equal(reward_to_go(rho, ones, 1.0), torch.tensor([[10.0, 9.0, 7.0, 4.0]], dtype=F64))
    assert torch.equal(reward_to_go(rho, ones, 0.0), rho)
    # masked position 1 (ρ there = 100 is garbage) and trailing padding (ρ = 7): model tokens 0, 2 carry 1, 3
    # γ = 0.5: G2 = 3 (last model token = its ρ), G0 = 1 + 0.5·3 = 2.5 (one discount step, the gap not counted)
    rho = torch.tensor([[1.0, 100.0, 3.0, 7.0]], dtype=F64)
    got = reward_to_go(rho, torch.tensor([[1, 0, 1, 0]]), 0.5)
    assert torch.equal(got, torch.tensor([[2.5, 0.0, 3.0, 0.0]], dtype=F64))


def test_reward_to_go_random_gamma_limits_and_last_token():
    gen = torch.Generator().manual_seed(8)
    rho = torch.randn(5, 9, generator=gen, dtype=F64)
    mask = (torch.rand(5, 9, generator=gen) < 0.7).long()
    mask[4] = 0  # an all-masked row
    rho = rho * mask  # as token_mismatch gives it
    assert torch.equal(reward_to_go(rho, mask, 0.0), rho)  # γ = 0: G = ρ
    g1 = reward_to_go(rho, mask, 1.0).numpy()
    r, m = rho.numpy(), mask.numpy()
    for b in range(5):
        pos = np.flatnonzero(m[b])
        np.testing.assert_allclose(g1[b, pos], np.cumsum(r[b, pos][::-1])[::-1], rtol=0, atol=1e-12)
        assert (g1[b, m[b] == 0] == 0).all()
        if len(pos):
            gl = reward_to_go(rho, mask, 0.9)[b, pos[-1]]
            assert gl.item() == r[b, pos[-1]]  # G at the last model token is its ρ
    assert torch.equal(reward_to_go(rho, mask, 0.9)[4], torch.zeros(9, dtype=F64))


def test_reward_to_go_masked_values_do_not_leak():
    gen = torch.Generator().manual_seed(9)
    rho = torch.randn(4, 10, generator=gen, dtype=F64)
    mask = (torch.rand(4, 10, generator=gen) < 0.6).long()
    base = reward_to_go(rho, mask, 0.9)
    garbage = torch.where(mask.bool(), rho, 1e6 * torch.randn(4, 10, generator=gen, dtype=F64))
    got = reward_to_go(garbage, mask, 0.9)
    assert torch.equal(got, base)  # whatever ρ says off the model tokens, no G changes
    assert (got[mask == 0] == 0).all()


def test_reward_to_go_env_insertion_invariant():
    gen = torch.Generator().manual_seed(10)
    M, gamma = 7, 0.8
    rho = torch.randn(1, M, generator=gen, dtype=F64)
    compact = reward_to_go(rho, torch.ones(1, M), gamma)  # (1, M) model tokens only
    # the same model tokens with environment tokens (mask 0, arbitrary ρ) inserted before, between and after them
    gaps = [2, 0, 3, 1, 0, 0, 2, 4]  # env tokens before model token j (and, last, after all of them)
    values, mask = [], []
    for j in range(M):
        values += torch.randn(gaps[j], generator=gen, dtype=F64).tolist() + [rho[0, j].item()]
        mask += [0] * gaps[j] + [1]
    values += [5.0] * gaps[M]
    mask += [0] * gaps[M]
    spread = reward_to_go(torch.tensor([values], dtype=F64), torch.tensor([mask]), gamma)
    model = torch.tensor(mask).bool()
    torch.testing.assert_close(spread[0, model], compact[0], rtol=0, atol=1e-12)
    assert (spread[0, ~model] == 0).all()


# ---------------------------------------------------------------------------------------------------------------------
# 9. rtg_scope = turn (turn_index: k on turn k's model tokens, −1 elsewhere; credit-interface.md)


def test_reward_to_go_turn_scope_hand():
    rho = torch.tensor([[1.0, 2.0, 9.0, 3.0, 4.0, 9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0, 1, 1, 0]])
    turns = torch.tensor([[0, 0, -1, 1, 1, -1]])
    # trajectory, γ = 0.5: G4 = 4, G3 = 3 + 2 = 5, G1 = 2 + 2.5 = 4.5, G0 = 1 + 2.25 = 3.25
    traj = reward_to_go(rho, mask, 0.5)
    assert torch.equal(traj, torch.tensor([[3.25, 4.5, 0.0, 5.0, 4.0, 0.0]], dtype=F64))
    # turn: turn 1 as above (5, 4); turn 0 stops at its end: G1 = 2, G0 = 1 + 0.5·2 = 2
    turn = reward_to_go(rho, mask, 0.5, turns)
    assert torch.equal(turn, torch.tensor([[2.0, 2.0, 0.0, 5.0, 4.0, 0.0]], dtype=F64))


def test_reward_to_go_turn_scope_never_sees_later_turns():
    gen = torch.Generator().manual_seed(11)
    gamma = 0.9
    # one row: turns of 3, 2, 4 model tokens separated by environment tokens, then padding
    layout = [(0, 3), (-1, 2), (1, 2), (-1, 3), (2, 4), (-1, 2)]
    turns = torch.tensor([[k for k, n in layout for _ in range(n)]])
    mask = (turns >= 0).long()
    T = turns.shape[1]
    rho = torch.randn(1, T, generator=gen, dtype=F64) * mask
    base = reward_to_go(rho, mask, gamma, turns)
    for k in range(3):
        on_k = turns[0] == k
        # equals the trajectory return of the turn's own tokens alone
        alone = reward_to_go(rho * on_k, mask * on_k, gamma)
        torch.testing.assert_close(base[0, on_k], alone[0, on_k], rtol=0, atol=1e-12)
        # changing ρ in every later turn leaves turn k's returns unchanged
        later = turns[0] > k
        if later.any():
            noisy = rho + 10 * torch.randn(1, T, generator=gen, dtype=F64) * later * mask
            changed = reward_to_go(noisy, mask, gamma, turns)
            assert torch.equal(changed[0, turns[0] <= k], base[0, turns[0] <= k])
            assert not torch.equal(changed, base)
    # a single turn: turn scope equals trajectory scope
    one = torch.where(mask.bool(), torch.zeros_like(turns), turns)
    assert torch.equal(reward_to_go(rho, mask, gamma, one), reward_to_go(rho, mask, gamma))


# ---------------------------------------------------------------------------------------------------------------------
# 10. Gradient path of Eq. 9


def test_loss_hand_computed_value_and_gradient():
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -4.0, -4.0], [-1.0, -1.0, -1.0]], dtype=F64, requires_grad=True)
    returns = torch.tensor([[2.0, 4.0, 9.0], [3.0, 5.0, 5.0], [7.0, 7.0, 7.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # M = 2, 1, 0 (the empty row counts in 1/B)
    loss = beta_opsd_loss(logp, returns, mask)
    # (1/3)·[(2·−1 + 4·−2)/2 + (3·−0.5)/1 + 0] = (1/3)·(−5 − 1.5) = −13/6
    assert loss.item() == pytest.approx(-13 / 6, abs=1e-15)
    loss.backward()
    # ∂L/∂logp_t = m_t·G_t/(B·M_b): row 0: 2/6, 4/6, 0; row 1: 3/3, 0, 0; row 2: 0
    expected = torch.tensor([[1 / 3, 2 / 3, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64)
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-15)
    assert returns.grad is None  # sg(G)


@pytest.mark.parametrize("space", ["prob_sampled", "logit_full"])
def test_loss_gradient_only_through_logp(space):
    """The whole chain Eq. 5/6 → 7 → 8 → 9 with every input a leaf that asks for a gradient: only the explicit logp
    path receives one, and it is (1/B)(1/M_b)·G_t on model tokens, 0 elsewhere."""
    gen = torch.Generator().manual_seed(12)
    B, T, V, w = 4, 6, 5, 0.6
    student = rand_logps(gen, B, T, V).requires_grad_(True)
    teacher = rand_logps(gen, B, T, V).requires_grad_(True)
    ids = torch.randint(0, V, (B, T), generator=gen)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 0], [0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    logp = gather(student, ids)  # with gradient; also used as logp_old and the reference (current student)
    if space == "prob_sampled":
        target = mixture_target_logps(logp, gather(teacher, ids), w)
    else:
        target, _ = geometric_target_logps(student, teacher, ids, w)
    rho = token_mismatch(logp, target, mask)
    returns = reward_to_go(rho, mask, 0.9)
    assert not rho.requires_grad and not returns.requires_grad
    beta_opsd_loss(logp, returns, mask).backward()
    assert teacher.grad is None  # the teacher (and the target built from it) gets no gradient
    counts = mask.sum(-1, keepdim=True).clamp(min=1)
    expected = mask * returns / (B * counts)  # (B, T): (1/B)(1/M_b)·G_t on model tokens
    expected_full = torch.zeros(B, T, V, dtype=F64).scatter(-1, ids.unsqueeze(-1), expected.unsqueeze(-1))
    torch.testing.assert_close(student.grad, expected_full, rtol=0, atol=1e-14)  # nothing via ρ or the reference


def test_loss_gradient_random_matches_formula():
    gen = torch.Generator().manual_seed(13)
    B, T = 6, 8
    logp = (-torch.rand(B, T, generator=gen, dtype=F64) * 5).requires_grad_(True)
    returns = torch.randn(B, T, generator=gen, dtype=F64).requires_grad_(True)
    mask = (torch.rand(B, T, generator=gen) < 0.6).long()
    mask[0] = 0
    beta_opsd_loss(logp, returns, mask).backward()
    m = mask.double()
    expected = m * returns.detach() / (B * m.sum(-1, keepdim=True).clamp(min=1))
    torch.testing.assert_close(logp.grad, expected, rtol=0, atol=1e-14)
    assert (logp.grad[mask == 0] == 0).all()
    assert returns.grad is None


# ---------------------------------------------------------------------------------------------------------------------
# 11. Unbiasedness (Eq. 13) on a tabular toy, vocabulary 3, enumerated


@pytest.mark.parametrize("kinds", [("m", "m", "m"), ("m", "e", "m", "m")], ids=["model_only", "with_env_token"])
def test_rtg_estimator_is_unbiased_for_sequence_kl(kinds):
    """π_θ(y_t | prefix) = softmax(θ[prefix]) over V = 3 with a table row per prefix; a fixed random target p̃ of the
    same shape. 'e' is an environment token drawn from a fixed θ-free q(·|prefix), mask 0: it is in the prefix of
    later tokens but neither π nor p̃ scores it (both sequence distributions use q there, so it cancels in the KL)."""
    V, L = 3, len(kinds)
    gen = torch.Generator().manual_seed(14)
    seqs = list(itertools.product(range(V), repeat=L))  # 27 or 81 sequences
    prefixes = sorted({s[:t] for s in seqs for t in range(L)}, key=lambda p: (len(p), p))
    row = {p: i for i, p in enumerate(prefixes)}
    idx = torch.tensor([[row[s[:t]] for t in range(L)] for s in seqs])  # (N, L) table row of each position
    ys = torch.tensor(seqs)  # (N, L)
    model = torch.tensor([k == "m" for k in kinds]).expand(len(seqs), L)  # (N, L)
    mask = model.long()
    theta = torch.randn(len(prefixes), V, generator=gen, dtype=F64).requires_grad_(True)
    log_target_table = rand_logps(gen, len(prefixes), V)  # fixed p̃, no gradient
    log_env_table = rand_logps(gen, len(prefixes), V)  # fixed q

    logp = torch.log_softmax(theta, -1)[idx, ys]  # (N, L) log π_θ(y_t | h_t)
    log_target = log_target_table[idx, ys]  # (N, L)
    log_env = log_env_table[idx, ys]  # (N, L)
    log_p_seq = torch.where(model, logp, log_env).sum(-1)  # (N,) log P_θ(y)
    p_seq = log_p_seq.exp()
    assert p_seq.sum().item() == pytest.approx(1.0, abs=1e-12)
    kl = (p_seq * torch.where(model, logp - log_target, torch.zeros_like(logp)).sum(-1)).sum()  # KL(P_θ ‖ P̃)
    (grad_kl,) = torch.autograd.grad(kl, theta, retain_graph=True)

    rho = token_mismatch(logp.detach(), log_target, mask)  # (N, L)
    weight = p_seq.detach() * len(seqs) * 3  # B·M_b·P(y) turns Eq. 9's 1/(B·M_b) into the expectation E_y[...]

    def estimator(returns: torch.Tensor) -> torch.Tensor:  # Σ_y P(y) Σ_t returns_t ∇θ log π(y_t | h_t), via Eq. 9
        loss = beta_opsd_loss(logp, weight.unsqueeze(1) * returns, mask)
        return torch.autograd.grad(loss, theta, retain_graph=True)[0]

    rtg = estimator(reward_to_go(rho, mask, 1.0))
    torch.testing.assert_close(rtg, grad_kl, rtol=0, atol=1e-10)
    local = estimator(rho)  # the per-token estimator: biased for the sequence KL
    assert (local - grad_kl).abs().max().item() > 1e-2
    assert grad_kl.abs().max().item() > 1e-2  # the check is not vacuous


# ---------------------------------------------------------------------------------------------------------------------
# 12-13. Eq. 2 and Eq. 3 on enumerated distributions (math checks, numpy)


def kl(p: np.ndarray, q: np.ndarray) -> float:
    return float((p * (np.log(p) - np.log(q))).sum())


def j_beta(pi: np.ndarray, p_t: np.ndarray, p_ref: np.ndarray, beta: float) -> float:
    """Eq. 1: E_π[log p_T − log π_ref] − β·KL(π ‖ π_ref)."""
    return float((pi * (np.log(p_t) - np.log(p_ref))).sum()) - beta * kl(pi, p_ref)


def random_simplex(rng: np.random.Generator, n: int) -> np.ndarray:
    x = np.exp(2 * rng.standard_normal(n))
    return x / x.sum()


def test_eq2_decomposition():
    rng = np.random.default_rng(15)
    for _ in range(5):
        pi, p_t, p_ref = (random_simplex(rng, 27) for _ in range(3))  # 27 = all sequences of length 3 over V = 3
        for beta in (1.0, 1.25, 2.0, 5.0):
            expected = -kl(pi, p_t) - (beta - 1) * kl(pi, p_ref)  # Eq. 2
            assert j_beta(pi, p_t, p_ref, beta) == pytest.approx(expected, abs=1e-12)
        assert j_beta(pi, p_t, p_ref, 1.0) == pytest.approx(-kl(pi, p_t), abs=1e-12)  # β = 1: vanilla OPSD


@pytest.mark.parametrize("beta", [1.0, 1.25, 2.0, 4.0])
def test_eq3_optimum_and_single_token_interpolant(beta):
    rng = np.random.default_rng(16)
    w = 1.0 / beta
    # T = 1: Eq. 5 at every vocabulary entry equals π*_β ∝ π_ref^(1−1/β)·p_T^(1/β)
    V = 5
    gen = torch.Generator().manual_seed(16)
    ref, teacher = rand_logps(gen, 1, 1, V), rand_logps(gen, 1, 1, V)
    ids = torch.arange(V).view(V, 1)  # row v samples v
    local, _ = geometric_target_logps(ref.expand(V, 1, V), teacher.expand(V, 1, V), ids, w)  # (V, 1)
    p_ref, p_t = np.exp(ref.numpy().ravel()), np.exp(teacher.numpy().ravel())
    star = p_ref ** (1 - w) * p_t**w
    z = star.sum()
    star = star / z
    np.testing.assert_allclose(np.exp(local.numpy().ravel()), star, rtol=0, atol=1e-13)
    # π*_β maximises J_β: J_β(π*) = β·log Z_β, and no perturbation scores higher (vocabulary and 27 sequences)
    for q_ref, q_t in [(p_ref, p_t), (random_simplex(rng, 27), random_simplex(rng, 27))]:
        star = q_ref ** (1 - w) * q_t**w
        z = star.sum()
        star = star / z
        best = j_beta(star, q_t, q_ref, beta)
        assert best == pytest.approx(beta * math.log(z), abs=1e-12)
        for scale in (1e-3, 0.1, 1.0):
            for _ in range(50):
                other = star * np.exp(scale * rng.standard_normal(len(star)))
                assert j_beta(other / other.sum(), q_t, q_ref, beta) <= best + 1e-12


# ---------------------------------------------------------------------------------------------------------------------
# 15. Blending with GRPO (Eq. 10, C14)


def test_blend_advantages():
    returns = torch.tensor([[1.0, 2.0, 3.0], [-4.0, 0.5, 8.0]], dtype=F64)
    adv_grpo = torch.tensor([0.75, -1.5])
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])  # position (0, 1) an env token, (1, 2) padding
    # λ_d = 0: plain GRPO on every model token, exactly; 0 on env tokens and padding (C14)
    expected0 = torch.tensor([[0.75, 0.0, 0.75], [-1.5, -1.5, 0.0]], dtype=F64)
    assert torch.equal(blend_advantages(returns, adv_grpo, mask, 0.0), expected0)
    # λ_d = 1: A = −G; GRPO's advantage is ignored, even a NaN (unscorable) one
    expected1 = torch.tensor([[-1.0, 0.0, -3.0], [4.0, -0.5, 0.0]], dtype=F64)
    for other in (adv_grpo, torch.tensor([100.0, -7.0]), torch.tensor([float("nan"), 3.0])):
        assert torch.equal(blend_advantages(returns, other, mask, 1.0), expected1)
    # λ_d = 0.25: 0.75·Â − 0.25·G: row 0: 0.5625 − 0.25 = 0.3125, 0.5625 − 0.75 = −0.1875;
    # row 1: −1.125 + 1 = −0.125, −1.125 − 0.125 = −1.25
    expected = torch.tensor([[0.3125, 0.0, -0.1875], [-0.125, -1.25, 0.0]], dtype=F64)
    assert torch.equal(blend_advantages(returns, adv_grpo, mask, 0.25), expected)


def test_blend_advantages_random_limits():
    gen = torch.Generator().manual_seed(17)
    returns = torch.randn(6, 10, generator=gen, dtype=F64)
    adv_grpo = torch.randn(6, generator=gen)
    mask = (torch.rand(6, 10, generator=gen) < 0.7).long()
    got0 = blend_advantages(returns, adv_grpo, mask, 0.0)
    assert torch.equal(got0, mask * adv_grpo.double().unsqueeze(1))
    got1 = blend_advantages(returns, adv_grpo, mask, 1.0)
    assert torch.equal(got1, blend_advantages(returns, torch.randn(6, generator=gen), mask, 1.0))
    assert torch.equal(got1, -(mask * returns))


# ---------------------------------------------------------------------------------------------------------------------
# 17. Config guards


def make_config(tmp_path, **kwargs) -> BetaOPSDConfig:
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", max_steps=10)
    base.update(activation_checkpointing=False)  # as conftest.CPU_ARGS; silences a transformers deprecation warning
    return BetaOPSDConfig(**{**base, **kwargs})


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(num_iterations=2), "num_iterations"),  # D14
        (dict(beta=0.04), "beta"),  # D13
        (dict(teacher_weight_start=-0.1), "teacher_weight_start"),
        (dict(teacher_weight_start=1.5), "teacher_weight_start"),
        (dict(teacher_weight_end=-0.5), "teacher_weight_end"),
        (dict(teacher_weight_end=1.01), "teacher_weight_end"),
        (dict(max_steps=-1), "schedule_steps"),  # D10: schedule_steps None and no max_steps
        (dict(schedule_steps=0), "schedule_steps"),
        (dict(target_space="logit_sampled"), "target_space"),
    ],
)
def test_config_guards(tmp_path, kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        make_config(tmp_path, **kwargs)


def test_config_defaults_and_accepted_values(tmp_path):
    cfg = make_config(tmp_path)
    assert cfg.loss_type == "grpo"  # D4
    assert (cfg.teacher_weight_start, cfg.teacher_weight_end, cfg.schedule_steps) == (0.5, 0.8, None)
    assert (cfg.target_space, cfg.rtg, cfg.rtg_gamma, cfg.distillation_weight) == ("prob_sampled", True, 0.99, 1.0)
    assert cfg.beta == 0.0 and cfg.num_iterations == 1
    make_config(tmp_path, max_steps=-1, schedule_steps=200)  # D10: an explicit length suffices
    make_config(tmp_path, teacher_weight_start=0.0, teacher_weight_end=1.0, target_space="logit_full")  # inclusive


# ---------------------------------------------------------------------------------------------------------------------
# 18. Determinism


@pytest.mark.parametrize("space", ["prob_sampled", "logit_full"])
def test_bitwise_deterministic(space):
    def run():
        gen = torch.Generator().manual_seed(18)
        student, teacher = rand_logps(gen, 4, 12, 9), rand_logps(gen, 4, 12, 9)
        ids = torch.randint(0, 9, (4, 12), generator=gen)
        mask = (torch.rand(4, 12, generator=gen) < 0.8).long()
        turns = torch.where(mask.bool(), torch.arange(12).div(4, rounding_mode="floor").expand(4, 12), -1)
        logp_old = gather(student, ids)
        if space == "prob_sampled":
            target = mixture_target_logps(logp_old, gather(teacher, ids), 0.65)
        else:
            target, _ = geometric_target_logps(student, teacher, ids, 0.65)
        rho = token_mismatch(logp_old, target, mask)
        returns = reward_to_go(rho, mask, 0.99)
        returns_turn = reward_to_go(rho, mask, 0.99, turns)
        logp = logp_old.clone().requires_grad_(True)
        loss = beta_opsd_loss(logp, returns, mask)
        loss.backward()
        return rho, returns, returns_turn, loss.detach(), logp.grad

    first, second = run(), run()
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_padding_and_unused_parts_never_turn_into_nan():
    """A -inf log-prob on a padded position does not reach the loss, and at λ_d = 0 an infinite G (a target that gives
    the sampled token probability 0) is ignored, as Eq. 10 says."""
    loss = beta_opsd_loss(torch.tensor([[-1.0, -math.inf]]), torch.tensor([[1.0, 0.0]]), torch.tensor([[1, 0]]))
    assert loss.item() == -1.0
    adv = blend_advantages(torch.tensor([[math.inf]]), torch.tensor([0.5]), torch.tensor([[1]]), 0.0)
    assert adv.item() == 0.5
