"""Layer 1: the shared credit interface (credit-interface.md Eq. I-2..I-5, invariants G1-G9, §7 fallbacks, §9
property suite) and DRACO's step weights (draco.md Eq. 4-9, conventions.md C8, C9, C11), on hand-computed
examples and on seeded random batches."""

from __future__ import annotations

import math
import random

import pytest
import torch

from trainers.credit import (
    credit_metrics,
    redistribute_additive,
    redistribute_multiplicative,
    token_budget_multipliers,
    turn_token_counts,
)
from trainers.draco import draco_advantages, draco_citations, draco_step_weights

# ---------------------------------------------------------------------------------------------------------------------
# Random batches as §9 describes them


def random_batch(rng: random.Random, dtype: torch.dtype = torch.float32) -> dict:
    """B in [1, 8], K_b in [1, 12], n in [1, 50], -1 runs between turns and trailing padding; A with exact zeros,
    negatives and large magnitudes; one row in five has no loss token; DRACO verdict tables and citations."""
    B = rng.randint(1, 8)
    rows, counts = [], []
    for _ in range(B):
        k_b = 0 if rng.random() < 0.2 else rng.randint(1, 12)
        ids: list[int] = [-1] * rng.randint(0, 5)
        for k in range(k_b):
            ids += [k] * rng.randint(1, 50) + [-1] * rng.randint(0, 8)
        rows.append(ids + [-1] * rng.randint(0, 6))
        counts.append(k_b)
    T, K = max(len(r) for r in rows), max(1, max(counts))
    turn_index = torch.tensor([r + [-1] * (T - len(r)) for r in rows])  # (B, T)
    turn_valid = torch.tensor([[k < k_b for k in range(K)] for k_b in counts])  # (B, K)
    adv = torch.tensor(
        [rng.choice([0.0, rng.gauss(0, 1), -abs(rng.gauss(0, 3)), rng.uniform(-1e4, 1e4)]) for _ in range(B)],
        dtype=dtype,
    )  # (B,)
    C = rng.randint(1, 6)
    verdicts = torch.tensor([[rng.choice([-1, 0, 1]) for _ in range(C)] for _ in range(B)])  # (B, C)
    cited = [[[j for j in range(1, K + 3) if rng.random() < 0.25] for _ in range(C)] for _ in range(B)]
    citations = draco_citations(cited, K, C) & turn_valid.unsqueeze(1)  # (B, C, K)
    return dict(adv=adv, turn_index=turn_index, turn_valid=turn_valid, verdicts=verdicts, citations=citations)


def batches(n: int = 150, dtype: torch.dtype = torch.float32):
    rng = random.Random(1234)
    return [random_batch(rng, dtype) for _ in range(n)]


def run_draco(b: dict, **kw):
    return draco_advantages(b["adv"], b["turn_index"], b["turn_valid"], b["verdicts"], b["citations"], **kw)


def run_mult(b: dict, seed: int = 0, **kw):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(b["turn_valid"].shape, generator=g, dtype=torch.float64) * 3  # (B, K)
    return redistribute_multiplicative(b["adv"], b["turn_index"], m, b["turn_valid"], **kw), m


def run_add(b: dict, seed: int = 0, omega: float = 0.7):
    g = torch.Generator().manual_seed(seed)
    o = torch.randn(b["turn_valid"].shape, generator=g, dtype=torch.float64)  # (B, K)
    return redistribute_additive(b["adv"], b["turn_index"], o, b["turn_valid"], omega), o


def per_turn_values(out: torch.Tensor, turn_index: torch.Tensor, K: int) -> list[list[set[float]]]:
    return [[set(out[b][turn_index[b] == k].tolist()) for k in range(K)] for b in range(out.shape[0])]


METHODS = {"draco": lambda b: run_draco(b), "mult": lambda b: run_mult(b)[0], "add": lambda b: run_add(b)[0]}


def reference_credit(method: str, b: dict) -> torch.Tensor:
    """Per-token advantages in plain Python: credit-interface.md Eq. I-2 (`mult`, the multipliers of `run_mult`), Eq.
    I-3 (`add`, the offsets of `run_add`, omega 0.7), and for `draco` draco.md Eq. 4-9 through Eq. I-4; 0 off the
    turns, a row without loss tokens all zeros, the plain broadcast A_b where DRACO falls back."""
    per_turn = {"mult": lambda: run_mult(b)[1], "add": lambda: run_add(b)[1], "draco": lambda: None}[method]()
    rows = []
    for i, (a, ti) in enumerate(zip(b["adv"].tolist(), b["turn_index"].tolist(), strict=True)):
        n = [ti.count(k) for k in range(int(b["turn_valid"][i].sum()))]  # Eq. I-5
        if method == "mult":
            value = [a * m for m in per_turn[i].tolist()]  # Eq. I-2
        elif method == "add":
            value = [a + 0.7 * o for o in per_turn[i].tolist()]  # Eq. I-3
        else:
            verdicts, cites = b["verdicts"][i].tolist(), b["citations"][i].tolist()  # (C,), (C, K)
            P = [sum(v == 1 and z[k] for v, z in zip(verdicts, cites, strict=True)) for k in range(len(n))]  # Eq. 4
            F = [sum(v == -1 and z[k] for v, z in zip(verdicts, cites, strict=True)) for k in range(len(n))]
            q = [p / (p + f) if p + f else None for p, f in zip(P, F, strict=True)]
            cited = [x for x in q if x is not None]
            q = [x if x is not None else sum(cited) / max(len(cited), 1) for x in q]  # Eq. 5: uncited take the mean
            w = [x if a >= 0 else 1.0 - x for x in q]  # Eq. 6
            if a == 0 or not cited or sum(w) <= 1e-12:  # zeros (G5), or the plain broadcast (Eq. 9, C8)
                value = [a] * len(n)
            else:
                value = [a * sum(n) * w_k / (n_k * sum(w)) for w_k, n_k in zip(w, n, strict=True)]  # Eq. 7-8
        rows.append([value[k] if k >= 0 else 0.0 for k in ti])  # G1; a row with no turn has no k >= 0 (G6)
    return torch.tensor(rows, dtype=torch.float64).to(b["adv"].dtype)


# ---------------------------------------------------------------------------------------------------------------------
# G1-G9 for every composition


@pytest.mark.parametrize("method", sorted(METHODS))
def test_general_invariants_g1_to_g9(method):
    fn = METHODS[method]
    for b in batches():
        res = fn(b)
        out, ti, K = res.advantages, b["turn_index"], b["turn_valid"].shape[1]
        assert torch.equal(out[ti == -1], torch.zeros_like(out[ti == -1]))  # G1
        assert all(len(v) <= 1 for row in per_turn_values(out, ti, K) for v in row)  # G2
        assert torch.isfinite(out).all()  # G6
        empty = (ti < 0).all(dim=1)
        assert (out[empty] == 0).all() and all(res.reasons[i] == "empty_row" for i in empty.nonzero().flatten())
        for i in res.fallback.nonzero().flatten():  # G4: the plain GRPO broadcast
            expected = torch.where(ti[i] >= 0, b["adv"][i], torch.zeros((), dtype=out.dtype))
            assert torch.equal(out[i], expected)
        if method != "add":  # G5: multiplicative forms only
            assert (out[b["adv"] == 0] == 0).all()
        assert not out.requires_grad and out.grad_fn is None  # G7
        torch.testing.assert_close(out, reference_credit(method, b))  # G8 + Eq. I-2..I-4: a per-token reference
        assert out.dtype == b["adv"].dtype and out.device == b["adv"].device  # G9


@pytest.mark.parametrize("method", sorted(METHODS))
def test_row_locality_g3(method):
    fn = METHODS[method]
    rng = random.Random(7)
    for b in batches(60):
        B = b["adv"].shape[0]
        perm = torch.tensor(rng.sample(range(B), B))
        permuted = {k: v[perm] for k, v in b.items()}
        if method == "draco":
            assert torch.equal(fn(permuted).advantages, fn(b).advantages[perm])
        else:  # the random per-turn inputs are drawn for the batch, so permute them with it
            inputs = run_mult(b)[1] if method == "mult" else run_add(b)[1]
            if method == "mult":
                res = redistribute_multiplicative(
                    b["adv"][perm], b["turn_index"][perm], inputs[perm], b["turn_valid"][perm]
                )
            else:
                res = redistribute_additive(
                    b["adv"][perm], b["turn_index"][perm], inputs[perm], b["turn_valid"][perm], 0.7
                )
            assert torch.equal(res.advantages, fn(b).advantages[perm])


def test_detached_even_when_inputs_need_grad():
    adv = torch.tensor([1.0, -2.0], requires_grad=True)
    ti = torch.tensor([[0, 0, -1, 1], [0, -1, -1, -1]])
    valid = torch.tensor([[True, True], [True, False]])
    m = torch.tensor([[0.5, 2.0], [1.0, 0.0]], requires_grad=True)
    for out in (
        redistribute_multiplicative(adv, ti, m, valid).advantages,
        redistribute_additive(adv, ti, m, valid, 0.5).advantages,
        draco_advantages(adv, ti, valid, torch.tensor([[1], [1]]), torch.ones(2, 1, 2, dtype=torch.bool)).advantages,
    ):
        assert not out.requires_grad and out.grad_fn is None  # G7


# ---------------------------------------------------------------------------------------------------------------------
# DRACO's properties (draco.md §7 items 3-14) on random batches


def test_draco_conservation_sign_and_bounds():
    for dtype, tol in ((torch.float64, 1e-9), (torch.float32, 1e-5)):
        for b in batches(dtype=dtype):
            res = run_draco(b)
            out, ti, adv = res.advantages.double(), b["turn_index"], b["adv"].double()
            n = turn_token_counts(ti, b["turn_valid"].shape[1])  # (B, K)
            N = n.sum(dim=1).double()
            # Sum conservation (P1): Σ_t a = A·N for every row, credited or not (§8.4 tolerances)
            torch.testing.assert_close(out.sum(dim=1), adv * N, rtol=tol, atol=tol * adv.abs().max().item() + 1e-12)
            # Sign preservation (P3): every token is 0 or has the sign of A
            assert ((torch.sign(out) == 0) | (torch.sign(out) == torch.sign(adv).unsqueeze(1))).all()
            # Bound: 0 <= m_j <= N / n_j on the turns holding tokens
            live = b["turn_valid"] & (n > 0)
            m = res.values
            assert (m[live] >= 0).all()
            assert (m[live] <= (N.unsqueeze(1) / n.clamp(min=1))[live] * (1 + 1e-12)).all()
            assert res.residual.max() < 1e-9  # the interface's own residual (float64, before the cast)


def test_draco_length_independence_p5():
    # the shares n_j a_j / (A N) equal w_j / Σw and do not move when a step's token count is rescaled
    verdicts = torch.tensor([[1, -1, 1]])
    citations = draco_citations([[[1], [2], [2, 3]]], 3)
    adv = torch.tensor([2.0], dtype=torch.float64)
    valid = torch.ones(1, 3, dtype=torch.bool)
    w, _ = draco_step_weights(verdicts, citations, adv, valid)  # Q = [1, 1/2, 1] -> w = [1, .5, 1]
    for lengths in ([1, 1, 1], [5, 1, 2], [50, 3, 7], [1, 40, 1]):
        ti = torch.tensor([sum(([k] * n + [-1] for k, n in enumerate(lengths)), [])])
        out = draco_advantages(adv, ti, valid, verdicts, citations).advantages
        n = torch.tensor(lengths, dtype=torch.float64)
        shares = torch.stack([out[0][ti[0] == k].sum() for k in range(3)]) / (adv * n.sum())
        torch.testing.assert_close(shares, w[0] / w[0].sum(), rtol=1e-12, atol=1e-12)
        assert all(
            torch.equal(
                out[0][ti[0] == k], torch.full((lengths[k],), out[0][ti[0] == k][0].item(), dtype=torch.float64)
            )
            for k in range(3)
        )


def test_draco_scale_c11_and_symmetry_p7():
    for b in batches(80, dtype=torch.float64):
        base = run_draco(b).advantages
        for c in (0.5, 3.0, 1e3):  # C11: a(cA) = c a(A) for c > 0
            scaled = draco_advantages(c * b["adv"], b["turn_index"], b["turn_valid"], b["verdicts"], b["citations"])
            torch.testing.assert_close(scaled.advantages, c * base, rtol=1e-12, atol=1e-9)
        # P7: a loser with verdicts v equals minus the winner with flipped verdicts (Q -> 1 - Q)
        loser = draco_advantages(-b["adv"].abs(), b["turn_index"], b["turn_valid"], b["verdicts"], b["citations"])
        winner = draco_advantages(b["adv"].abs(), b["turn_index"], b["turn_valid"], -b["verdicts"], b["citations"])
        torch.testing.assert_close(loser.advantages, -winner.advantages, rtol=1e-12, atol=1e-12)
    # a negative c switches the winner/loser branch, so a(-A) is not -a(A) in general (C11)
    ti = torch.tensor([[0, 1, 1]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    v, z = torch.tensor([[1, -1]]), draco_citations([[[1], [2]]], 2)
    pos = draco_advantages(torch.tensor([1.0]), ti, valid, v, z).advantages  # winner: all on step 1
    neg = draco_advantages(torch.tensor([-1.0]), ti, valid, v, z).advantages  # loser: all on step 2
    assert not torch.equal(neg, -pos)


def test_draco_monotone_p4():
    # winners: a_j rises with Q_j; losers: |a_j| rises as Q_j falls (weights through Eq. I-4)
    n = torch.tensor([[4, 2, 3]])
    valid = torch.ones(1, 3, dtype=torch.bool)
    for q in (0.0, 0.2, 0.5, 0.9):
        w_lo = torch.tensor([[q, 0.5, 0.7]], dtype=torch.float64)
        w_hi = torch.tensor([[q + 0.1, 0.5, 0.7]], dtype=torch.float64)
        assert token_budget_multipliers(w_hi, n, valid)[0][0, 0] > token_budget_multipliers(w_lo, n, valid)[0][0, 0]
        # loser: w = 1 - Q, so a lower Q means a larger weight and a larger |a|
        m_low_q = token_budget_multipliers(1 - w_lo, n, valid)[0][0, 0]
        m_high_q = token_budget_multipliers(1 - w_hi, n, valid)[0][0, 0]
        assert m_low_q > m_high_q


# ---------------------------------------------------------------------------------------------------------------------
# Hand-computed examples


def test_token_budget_multipliers_eq_i4():
    # N = 2 + 1 + 3 = 6, w = [1, 0, .5], Σw = 1.5: m = [6·1/(2·1.5), 0, 6·.5/(3·1.5)] = [2, 0, 2/3]
    m, zero = token_budget_multipliers(
        torch.tensor([[1.0, 0.0, 0.5]]), torch.tensor([[2, 1, 3]]), torch.ones(1, 3, dtype=torch.bool)
    )
    torch.testing.assert_close(m, torch.tensor([[2.0, 0.0, 2 / 3]], dtype=torch.float64))
    assert not zero.any() and (m * torch.tensor([[2, 1, 3]])).sum() == pytest.approx(6.0)
    # Σw = 0 -> zero flag; turns without tokens take no share; negative weights are refused
    _, zero = token_budget_multipliers(torch.zeros(1, 2), torch.tensor([[1, 1]]), torch.ones(1, 2, dtype=torch.bool))
    assert zero.tolist() == [True]
    m, _ = token_budget_multipliers(torch.tensor([[1.0, 5.0]]), torch.tensor([[4, 0]]), torch.ones(1, 2).bool())
    assert m.tolist() == [[1.0, 0.0]]  # the cut turn (n = 0, C7) gets nothing; the other carries N = 4
    with pytest.raises(ValueError, match="non-negative"):
        token_budget_multipliers(torch.tensor([[-1.0, 2.0]]), torch.tensor([[1, 1]]), torch.ones(1, 2).bool())


def test_draco_hand_example_winner_and_loser():
    # steps n = [2, 1, 3] with a gap; c1 PASS cites step 1, c2 FAIL cites step 2, c3 N/A cites step 3 (ignored)
    ti = torch.tensor([[0, 0, -1, 1, -1, 2, 2, 2, -1]] * 2)
    valid = torch.ones(2, 3, dtype=torch.bool)
    verdicts = torch.tensor([[1, -1, 0]] * 2)
    z = draco_citations([[[1], [2], [3]]] * 2, 3)
    adv = torch.tensor([1.5, -1.0], dtype=torch.float64)
    # winner: Q = [1, 0, Q̄ = 1/2] -> w = Q; m = [2, 0, 2/3] (see above) -> a = 1.5 m = [3, 0, 1]
    # loser: w = 1 - Q = [0, 1, 1/2]; m = [0, 6/(1·1.5) = 4, 6·.5/(3·1.5) = 2/3] -> a = [0, -4, -2/3]
    out = draco_advantages(adv, ti, valid, verdicts, z)
    expected = torch.tensor(
        [[3.0, 3.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, -4.0, 0.0, -2 / 3, -2 / 3, -2 / 3, 0.0]],
        dtype=torch.float64,
    )
    torch.testing.assert_close(out.advantages, expected)
    assert out.fallback.tolist() == [False, False] and out.reasons == [None, None]
    assert out.advantages.sum(dim=1).tolist() == pytest.approx([1.5 * 6, -1.0 * 6])  # P1


def test_draco_step_weights_quality_and_mean_fill():
    # step 1 cited by PASS and FAIL (Q = 1/2), step 2 by PASS (Q = 1), step 3 uncited -> Q̄ = 3/4; step 4 absent
    verdicts = torch.tensor([[1, -1, 1, 0]])
    z = draco_citations([[[1, 2], [1], [2, 2, 9], [3]]], 4)  # c4 N/A on step 3 is ignored; step 9 dropped (C9)
    valid = torch.tensor([[True, True, True, False]])
    w, cited = draco_step_weights(verdicts, z, torch.tensor([0.3]), valid)
    assert w.tolist() == [[0.5, 1.0, 0.75, 0.0]] and cited.tolist() == [True]
    w, _ = draco_step_weights(verdicts, z, torch.tensor([-0.3]), valid)  # loser: 1 - Q
    assert w.tolist() == [[0.5, 0.0, 0.25, 0.0]]


def test_draco_strict_step_quality_d18():
    # the shop's premature buy: step 1 search (PASS: search), step 2 click (PASS: type), step 3 buy (PASS: type, price;
    # FAIL: size), step 4 absent. Eq. 4: Q = [1, 1, 2/3]; strict (D18): Q = [1, 1, 0]
    verdicts = torch.tensor([[1, 1, 1, -1]])  # search, type, price, size
    z = draco_citations([[[1], [2, 3], [3], [3]]], 4)
    valid = torch.tensor([[True, True, True, False]])
    w, _ = draco_step_weights(verdicts, z, torch.tensor([0.5]), valid)
    assert w[0].tolist() == pytest.approx([1.0, 1.0, 2 / 3, 0.0])
    w, cited = draco_step_weights(verdicts, z, torch.tensor([0.5]), valid, strict=True)
    assert w.tolist() == [[1.0, 1.0, 0.0, 0.0]] and cited.tolist() == [True]
    w, _ = draco_step_weights(verdicts, z, torch.tensor([-0.5]), valid, strict=True)  # loser: 1 - Q, all on the buy
    assert w.tolist() == [[0.0, 0.0, 1.0, 0.0]]
    # winner A = 0.5 over steps of 1, 2 and 3 tokens (N = 6): the buy gets nothing, steps 1-2 share A·N = 3 by w / n
    ti = torch.tensor([[0, 1, 1, 2, 2, 2]])
    out = draco_advantages(torch.tensor([0.5]), ti, valid, verdicts, z, strict=True).advantages
    # Eq. 7: a_j = A·N·w_j / (n_j·Σw) = 0.5·6·1 / (n_j·2): step 1 (n = 1) 1.5, step 2 (n = 2) 0.75, step 3 0
    assert out[0].tolist() == pytest.approx([1.5, 0.75, 0.75, 0.0, 0.0, 0.0])


def test_draco_citations_c9():
    z = draco_citations([[[2, 2, 0, 4, -1], []], [[1]]], num_turns=3)  # duplicates once, 0 / 4 / -1 dropped
    assert z.shape == (2, 2, 3)
    assert z.int().tolist() == [[[0, 1, 0], [0, 0, 0]], [[1, 0, 0], [0, 0, 0]]]


def test_draco_equal_weights_give_equal_step_totals_p2():
    # unanimous PASS on a winner (or unanimous FAIL on a loser) citing every step: equal totals, NOT the uniform A
    ti = torch.tensor([[0, -1, 1, 1, 1, -1, 2, 2]] * 2)
    valid = torch.ones(2, 3, dtype=torch.bool)
    z = draco_citations([[[1, 2, 3]]] * 2, 3)
    out = draco_advantages(torch.tensor([2.0, -2.0]), ti, valid, torch.tensor([[1], [-1]]), z)
    assert out.fallback.tolist() == [False, False]  # C8: matching polarity is not a fallback
    # N = 6, K = 3: every step totals A·N/3 = ±4 -> per token ±4/1, ±4/3, ±4/2
    expected = torch.tensor([[4.0, 0, 4 / 3, 4 / 3, 4 / 3, 0, 2.0, 2.0]])
    torch.testing.assert_close(out.advantages, torch.cat([expected, -expected]))


def test_draco_fallbacks_eq9_c8():
    ti = torch.tensor([[0, 0, -1, 1]] * 5)
    valid = torch.ones(5, 2, dtype=torch.bool)
    adv = torch.tensor([1.0, 1.0, -1.0, 0.7, -0.4])
    verdicts = torch.tensor([[1, 1], [-1, -1], [1, 1], [1, -1], [1, -1]])
    z = draco_citations([[[], []], [[1], [2]], [[1, 2], [2]], [[1], [2]], [[1], [2]]], 2)
    failed = torch.tensor([False, False, False, True, False])
    out = draco_advantages(adv, ti, valid, verdicts, z, failed, [None, None, None, "judge_failure", None])
    # no citation; winner cited only by FAILs; loser cited only by PASSes; failed credit call; a credited row
    assert out.reasons == ["no_citation", "zero_weight_sum", "zero_weight_sum", "judge_failure", None]
    broadcast = adv.unsqueeze(1) * (ti >= 0)
    torch.testing.assert_close(out.advantages[:4], broadcast[:4])  # exactly the GRPO broadcast (G4)
    assert torch.equal(out.advantages[:4], broadcast[:4])
    assert out.advantages[4].tolist() == pytest.approx([0.0, 0.0, 0.0, -0.4 * 3])  # loser: all on the failed step


def test_draco_zero_advantage_rows_are_zeros_not_fallbacks():
    # a zero-variance group (all A = 0): zeros, no fallback, neutral multipliers, no residual
    ti = torch.tensor([[0, 0, 1], [0, -1, -1]])
    valid = torch.tensor([[True, True], [True, False]])
    out = draco_advantages(
        torch.zeros(2), ti, valid, torch.zeros(2, 1, dtype=torch.long), torch.zeros(2, 1, 2, dtype=torch.bool)
    )
    assert (out.advantages == 0).all() and not out.fallback.any() and out.residual.max() == 0
    assert out.values[valid].tolist() == [1.0, 1.0, 1.0]


def test_single_turn_row_gets_m_one():
    # §9.7: one step receives A·N over its N tokens (m = 1)
    ti = torch.tensor([[-1, 0, 0, 0, -1]])
    valid = torch.ones(1, 1, dtype=torch.bool)
    for verdicts in ([[1]], [[-1]], [[1, -1]]):
        v = torch.tensor(verdicts)
        out = draco_advantages(torch.tensor([0.8]), ti, valid, v, torch.ones(1, v.shape[1], 1, dtype=torch.bool))
        assert out.values.tolist() == [[1.0]] or out.fallback.item()  # a winner cited only by FAIL falls back
        assert out.advantages[0].tolist() == pytest.approx([0.0, 0.8, 0.8, 0.8, 0.0])


def test_all_environment_token_row():
    ti = torch.full((2, 6), -1)
    ti[1, :2] = 0
    valid = torch.tensor([[False], [True]])
    for res in (
        draco_advantages(
            torch.tensor([3.0, 1.0]), ti, valid, torch.tensor([[1], [1]]), torch.ones(2, 1, 1, dtype=torch.bool)
        ),
        redistribute_multiplicative(torch.tensor([3.0, 1.0]), ti, torch.tensor([[math.nan], [2.0]]), valid),
        redistribute_additive(torch.tensor([3.0, 1.0]), ti, torch.tensor([[math.inf], [1.0]]), valid, 1.0),
    ):
        assert res.advantages[0].tolist() == [0.0] * 6 and res.reasons[0] == "empty_row"
        assert torch.isfinite(res.advantages).all()


# ---------------------------------------------------------------------------------------------------------------------
# The interface itself


def test_multiplicative_hand_example_and_fallback_and_nonfinite():
    ti = torch.tensor([[0, 0, -1, 1, -1], [0, -1, 1, 1, 1], [0, 1, -1, -1, -1]])
    valid = torch.ones(3, 2, dtype=torch.bool)
    m = torch.tensor([[0.5, 2.0], [4.0, 0.0], [math.nan, 1.0]])
    fb = torch.tensor([False, True, False])
    out = redistribute_multiplicative(torch.tensor([2.0, -1.0, 3.0]), ti, m, valid, fb, [None, "no_pi", None])
    # row 0: 2·.5 on turn 0, 2·2 on turn 1; row 1 in fallback: -1 everywhere; row 2: NaN multiplier -> fallback 3
    assert out.advantages.tolist() == [[1.0, 1.0, 0.0, 4.0, 0.0], [-1.0, 0.0, -1.0, -1.0, -1.0], [3.0, 3.0, 0, 0, 0]]
    assert out.reasons == [None, "no_pi", "nonfinite"]
    # token-sum residual of row 0: |2·.5 + 1·2 - 3| / 3 = 0; turn-mean residual: |(.5 + 2)/2 - 1| = .25
    assert out.residual.tolist() == [0.0, 0.0, 0.0]
    tm = redistribute_multiplicative(torch.tensor([2.0]), ti[:1], m[:1], valid[:1], conserve="turn_mean")
    assert tm.residual.tolist() == [0.25]
    metrics = credit_metrics(out, torch.tensor([2.0, -1.0, 3.0]), ti, valid)
    assert metrics["credit/fallback_rate"] == pytest.approx(2 / 3)
    assert metrics["credit/fallback_rate/nonfinite"] == pytest.approx(1 / 3)
    assert metrics["credit/nonfinite_fallbacks"] == 1.0
    # multipliers over the 6 live turns: .5, 2 and 1 (neutral) for the four fallback turns
    assert metrics["credit/mult_min"] == 0.5 and metrics["credit/mult_max"] == 2.0
    assert metrics["credit/mult_mean"] == pytest.approx((0.5 + 2 + 4 * 1.0) / 6)
    assert metrics["credit/sign_flip_token_frac"] == 0.0 and metrics["credit/adv_token_abs_max"] == 4.0
    # tokens per turn: (2 + 1) + (1 + 3) + (1 + 1) = 9 over 6 turns
    assert metrics["credit/turns_per_traj_mean"] == 2.0 and metrics["credit/tokens_per_turn_mean"] == 1.5


def test_additive_hand_example_and_sign_flips():
    # GiGPO-style: A + ω·o, sign may flip (no sign preservation); fallback = o ≡ 0
    ti = torch.tensor([[0, 0, -1, 1], [0, -1, 1, 1]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    o = torch.tensor([[1.0, -3.0], [2.0, 2.0]])
    out = redistribute_additive(torch.tensor([0.5, 1.0]), ti, o, valid, 0.5, torch.tensor([False, True]))
    # row 0: 0.5 + .5·1 = 1 on turn 0, 0.5 - 1.5 = -1 on turn 1 (a flip); row 1: fallback -> 1 everywhere
    assert out.advantages.tolist() == [[1.0, 1.0, 0.0, -1.0], [1.0, 0.0, 1.0, 1.0]]
    m = credit_metrics(out, torch.tensor([0.5, 1.0]), ti, valid, form="additive")
    assert m["credit/sign_flip_token_frac"] == pytest.approx(1 / 6)  # 1 of 6 loss tokens
    assert m["credit/offset_abs_mean"] == pytest.approx((0.5 + 1.5 + 0 + 0) / 4)
    with pytest.raises(ValueError, match="omega"):
        redistribute_additive(torch.tensor([0.5]), ti[:1], o[:1], valid[:1], -1.0)


def test_token_counts_are_checked_eq_i5():
    ti = torch.tensor([[0, 0, -1, 1]])
    valid = torch.ones(1, 2, dtype=torch.bool)
    assert turn_token_counts(ti, 2, torch.tensor([[2, 1]])).tolist() == [[2, 1]]
    with pytest.raises(ValueError, match="Eq. I-5"):
        redistribute_multiplicative(
            torch.tensor([1.0]), ti, torch.ones(1, 2), valid, turn_tokens=torch.tensor([[1, 2]])
        )
    with pytest.raises(ValueError, match="turn_valid"):  # tokens on a turn marked absent
        redistribute_multiplicative(torch.tensor([1.0]), ti, torch.ones(1, 2), torch.tensor([[True, False]]))
    with pytest.raises(ValueError, match="turns were given"):
        turn_token_counts(ti, 1)
