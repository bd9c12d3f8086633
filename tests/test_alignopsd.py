"""AlignOPSD (alignopsd.md): the method's pure math in trainers/alignopsd.py. M1 (source selection, source weights, the
probability mixture, the confidence and the detached corrected gap, Eq. 5-11), the segmentation (profiles, JSD,
boundary validity, the batch threshold and the semantic / guided / forced cuts, Eq. 12-17) and the M2 credit
(allocation, projection, mixing, Eq. 18-25, D4, conventions.md C21), on hand-computed cases and on seeded random
inputs checked against plain-Python re-implementations of the equations written below. The trainer's own
properties (teacher passes, encoder, fallbacks) are not tested here."""

from __future__ import annotations

import inspect
import math
import random
from fractions import Fraction

import pytest
import torch

from trainers.alignopsd import (
    Segmentation,
    allocate,
    batch_threshold,
    boundary_distances,
    confidence,
    corrected_gap,
    cross_logps,
    jsd_bits,
    mix,
    profiles,
    project_density,
    row_weights,
    segment,
    select_sources,
    source_weights,
)

F64 = torch.float64
LEGACY = (0.0, 4.0)  # alignopsd.md Eq. 22 default bounds
BOUNDED = (0.8, 1.2)  # alignopsd.md Eq. 22 bounded mode
MODES = [pytest.param(LEGACY, (0.5, 2.5), id="legacy"), pytest.param(BOUNDED, (0.9, 1.1), id="bounded")]

# ---------------------------------------------------------------------------------------------------------------------
# Plain-Python re-implementations of the equations (the references the code is checked against)


def softmax(xs: list[float]) -> list[float]:
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    z = sum(e)
    return [v / z for v in e]


def ref_allocate(s: list[float], n: list[int], spans: list[tuple[int, int]], T: float):
    """Eq. 19-21 with math.exp: b_σ = softmax(log N_σ + S_σ / T), q_t = softmax_{t∈σ}(log n_t + s_t / T),
    r_t = N b_σ q_t / n_t. Returns (r, b)."""
    N = sum(n)
    b = softmax([math.log(sum(n[a:e])) + (sum(s[a:e]) / (e - a)) / T for a, e in spans])
    r = [0.0] * len(s)
    for (a, e), budget in zip(spans, b, strict=True):
        q = softmax([math.log(n[t]) + s[t] / T for t in range(a, e)])
        for t, qt in zip(range(a, e), q, strict=True):
            r[t] = N * budget * qt / n[t]
    return r, b


def exact_projection(r: list[float], n: list[int], lo: float, hi: float) -> list[Fraction]:
    """Eq. 22 solved exactly in rationals: f(λ) = Σ n clamp(r − λ, lo, hi) is continuous, piecewise linear and
    non-increasing, with breakpoints r_t − hi and r_t − lo; find the piece where it crosses N and interpolate. The
    minimiser h = clamp(r − λ, lo, hi) is unique (strictly convex objective) even where λ is not."""
    R = [Fraction(x) for x in r]
    lo_, hi_ = Fraction(lo), Fraction(hi)
    N = sum(n)

    def h_of(lam):
        return [min(max(x - lam, lo_), hi_) for x in R]

    def f(lam):
        return sum(k * v for k, v in zip(n, h_of(lam), strict=True))

    pts = sorted({x - hi_ for x in R} | {x - lo_ for x in R})
    assert f(pts[0]) == N * hi_ >= N >= N * lo_ == f(pts[-1])
    i, j = 0, len(pts) - 1  # invariant f(pts[i]) ≥ N ≥ f(pts[j]); halve the bracket of breakpoints
    while j - i > 1:
        k = (i + j) // 2
        i, j = (k, j) if f(pts[k]) >= N else (i, k)
    f1, f2 = f(pts[i]), f(pts[j])
    lam = pts[i] if f1 == f2 else pts[i] + (f1 - N) * (pts[j] - pts[i]) / (f1 - f2)  # f is linear in between
    return h_of(lam)


def ref_jsd_bits(p: list[float], q: list[float]) -> float:
    """Eq. 14: ½ KL(p ‖ m) + ½ KL(q ‖ m) with m = (p + q) / 2, in bits, 0 · log 0 = 0."""
    m = [(a + b) / 2 for a, b in zip(p, q, strict=True)]
    return sum(0.5 * a * math.log2(a / c) for a, c in zip(p, m, strict=True) if a > 0) + sum(
        0.5 * b * math.log2(b / c) for b, c in zip(q, m, strict=True) if b > 0
    )


def ref_segment(d: list[float], ok: list[bool], theta: float, l_min: int, l_max: int, gmin: float = 0.01):
    """Eq. 17, written recursively: semantic cuts strongest first (ties smaller t) when both pieces keep l_min turns;
    then each span longer than l_max is split at its guided cut (largest valid d ≥ gmin, leftmost) or forced cut
    (nearest the midpoint, left) and both halves are repaired in turn. Returns (starts, semantic, guided, forced)."""
    K = len(d)
    if K < l_min:
        return [0], 0, 0, 0
    cuts: set[int] = set()
    for t in sorted((t for t in range(1, K) if ok[t] and d[t] > theta), key=lambda t: (-d[t], t)):
        left = max([0, *(c for c in cuts if c < t)])
        right = min([K, *(c for c in cuts if c > t)])
        if t - left >= l_min and right - t >= l_min:
            cuts.add(t)
    semantic = len(cuts)
    kinds = {"guided": 0, "forced": 0}

    def repair(a: int, b: int) -> list[int]:
        if b - a <= l_max:
            return []
        feasible = list(range(a + l_min, b - l_min + 1))
        strong = [p for p in feasible if ok[p] and d[p] >= gmin]
        if strong:
            best = max(d[p] for p in strong)
            p = min(p for p in strong if d[p] == best)
            kinds["guided"] += 1
        else:
            gap = min(abs(p - (a + b) / 2) for p in feasible)
            p = min(p for p in feasible if abs(p - (a + b) / 2) == gap)
            kinds["forced"] += 1
        return [*repair(a, p), p, *repair(p, b)]

    edges = sorted({0, *cuts, K})
    for a, b in zip(edges, edges[1:], strict=False):
        cuts.update(repair(a, b))
    return sorted({0, *cuts}), semantic, kinds["guided"], kinds["forced"]


def random_spans(rng: random.Random, K: int) -> list[tuple[int, int]]:
    """A random partition of K turns (singletons and the whole row included)."""
    p = rng.choice([0.0, 0.2, 0.5, 1.0])
    starts = [0] + [t for t in range(1, K) if rng.random() < p]
    return list(zip(starts, [*starts[1:], K], strict=True))


def span_budgets(r: torch.Tensor, n: list[int], spans) -> list[float]:
    """b_σ read back from a density: Σ_{t∈σ} n_t r_t / N (Eq. 21)."""
    N = sum(n)
    return [sum(n[t] * float(r[t]) for t in range(a, b)) / N for a, b in spans]


def kl(b: list[float], u: list[float]) -> float:
    return sum(x * math.log(x / y) for x, y in zip(b, u, strict=True) if x > 0)


# ---------------------------------------------------------------------------------------------------------------------
# M1: source selection (Eq. 5)


def test_selection_threshold_then_one_per_sibling_then_top_k():
    """alignopsd.md Eq. 5: top K taken before the per-sibling cap would give [0] (0 and 1 are both rollout 1, the cap
    then drops 1); the cap first keeps rollout 1's best (0) and rollout 2's best (3), then the top 2 are [0, 3]. The
    0.7 of rollout 3 is below γ = 0.8 and never selected; H = γ exactly is kept (≥)."""
    sims = [0.99, 0.98, 0.97, 0.90, 0.70, 0.80]
    rollouts = [1, 1, 1, 2, 3, 4]
    turns = [0, 1, 2, 0, 0, 3]
    assert select_sources(sims, rollouts, turns, gamma=0.8, k=2) == [0, 3]
    assert select_sources(sims, rollouts, turns, gamma=0.8, k=3) == [0, 3, 5]  # 0.8 ≥ γ kept, 0.7 dropped
    assert select_sources(sims, rollouts, turns, gamma=0.8, k=10) == [0, 3, 5]
    assert select_sources(sims, rollouts, turns, gamma=0.95, k=3) == [0]
    assert select_sources(sims, rollouts, turns, gamma=0.999, k=3) == []
    assert select_sources([], [], [], gamma=0.8, k=3) == []


def test_selection_ties_are_deterministic():
    """alignopsd.md Eq. 5, D2: equal H is ordered by rollout, then turn; the result names the same (rollout, turn)
    sources under any order of the candidate list."""
    # three rollouts at H = 0.9: rollouts 1 and 2 win by index; rollout 3 is third
    assert select_sources([0.9, 0.9, 0.9], [3, 1, 2], [0, 0, 0], k=2) == [1, 2]
    # one rollout, two turns at equal H: its best is the smaller turn (turn 2, index 1)
    assert select_sources([0.9, 0.9], [1, 1], [5, 2], k=3) == [1]
    # higher H beats a smaller rollout index
    assert select_sources([0.85, 0.9], [1, 2], [0, 0], k=1) == [1]
    rng = random.Random(0)
    for _ in range(200):
        pairs = rng.sample([(ro, tu) for ro in range(5) for tu in range(4)], rng.randint(1, 12))
        sims = [rng.choice([0.79, 0.8, 0.85, 0.9, 0.95, 1.0]) for _ in pairs]
        cand = list(zip(sims, pairs, strict=True))
        picked = [cand[c][1] for c in select_sources(sims, [p[0] for p in pairs], [p[1] for p in pairs], k=3)]
        rng.shuffle(cand)
        again = select_sources([c[0] for c in cand], [c[1][0] for c in cand], [c[1][1] for c in cand], k=3)
        assert [cand[c][1] for c in again] == picked


def test_selection_against_a_plain_reimplementation():
    """alignopsd.md Eq. 5 on random candidates: each sibling's best (largest H, then smallest turn), those with H ≥ γ,
    sorted by (−H, rollout, turn), the first K. Also: every selected H ≥ γ, one per rollout, at most K, best first."""
    rng = random.Random(1)
    for _ in range(300):
        pairs = rng.sample([(ro, tu) for ro in range(6) for tu in range(5)], rng.randint(0, 20))
        sims = [round(rng.uniform(0.5, 1.0), 2) for _ in pairs]
        gamma, k = rng.choice([0.7, 0.8, 0.9]), rng.randint(1, 4)
        best = {}
        for c, (ro, tu) in enumerate(pairs):
            if ro not in best or (sims[c], -tu) > (sims[best[ro]], -pairs[best[ro]][1]):
                best[ro] = c
        keep = sorted((c for c in best.values() if sims[c] >= gamma), key=lambda c: (-sims[c], *pairs[c]))[:k]
        got = select_sources(sims, [p[0] for p in pairs], [p[1] for p in pairs], gamma=gamma, k=k)
        assert got == keep
        assert all(sims[c] >= gamma for c in got) and len(got) <= k
        assert len({pairs[c][0] for c in got}) == len(got)
        assert [sims[c] for c in got] == sorted((sims[c] for c in got), reverse=True)


# ---------------------------------------------------------------------------------------------------------------------
# M1: weights, mixture, confidence and the corrected gap (Eq. 6-11)


def test_source_weights_are_a_softmax_over_h_over_tau():
    """alignopsd.md Eq. 6: ω = softmax(H / 0.10)."""
    sims = [0.9, 1.0, 0.85]
    assert source_weights(torch.tensor(sims, dtype=F64)).tolist() == pytest.approx(
        softmax([h / 0.1 for h in sims]), abs=1e-12
    )


def test_the_mixture_is_log_sum_of_probabilities_not_mean_of_logs():
    """alignopsd.md Eq. 7: with ω = (½, ½) and p = (0.5, 0.1), log p_cross = log 0.3, while Σ ω log p = log √0.05
    = log 0.2236…; random mixtures match log Σ_s ω_s p_s(y_u)."""
    lp = torch.log(torch.tensor([[0.5, 0.9], [0.1, 0.9]], dtype=F64))
    got = cross_logps(lp, torch.tensor([0.5, 0.5], dtype=F64))
    assert got.tolist() == pytest.approx([math.log(0.3), math.log(0.9)], abs=1e-12)
    assert abs(float(got[0]) - 0.5 * (math.log(0.5) + math.log(0.1))) > 0.2  # log 0.3 − log 0.2236 ≈ 0.29
    g = torch.Generator().manual_seed(2)
    for _ in range(50):
        S, n = int(torch.randint(1, 4, (1,), generator=g)), 5
        p = torch.rand(S, n, generator=g, dtype=F64) * 0.98 + 0.01
        w = torch.softmax(torch.randn(S, generator=g, dtype=F64), 0)
        got = cross_logps(torch.log(p), w)
        for u in range(n):
            assert float(got[u]) == pytest.approx(math.log(sum(float(w[s] * p[s, u]) for s in range(S))), abs=1e-12)


def test_confidence_and_alpha_ranges():
    """alignopsd.md Eq. 8-9: ρ = Σ ω clamp((H − γ)/(1 − γ), 0, 1) ∈ [0, 1] (plain formula) and α = 0.8 ρ ≤ 0.8 on
    random inputs, sources below γ and at H = 1 included; ρ = 0 without a source."""
    assert confidence(torch.tensor([], dtype=F64), torch.tensor([], dtype=F64)) == 0.0
    # hand: H = (0.9, 1.0), ω = (½, ½): ½·0.5 + ½·1 = 0.75
    assert confidence(torch.tensor([0.9, 1.0], dtype=F64), torch.tensor([0.5, 0.5])) == pytest.approx(0.75, abs=1e-12)
    assert confidence(torch.tensor([1.0, 1.0], dtype=F64), torch.tensor([0.5, 0.5])) == pytest.approx(1.0, abs=1e-12)
    rng = random.Random(3)
    for _ in range(300):
        S = rng.randint(1, 4)
        sims = [rng.choice([rng.uniform(-1, 1), rng.uniform(0.8, 1.0), 1.0]) for _ in range(S)]
        gamma = rng.choice([0.7, 0.8, 0.9])
        w = softmax([h / 0.1 for h in sims])
        rho = confidence(torch.tensor(sims, dtype=F64), torch.tensor(w, dtype=F64), gamma)
        assert 0.0 <= rho <= 1.0 + 1e-12
        assert rho == pytest.approx(
            sum(o * min(max((h - gamma) / (1 - gamma), 0), 1) for o, h in zip(w, sims, strict=True))
        )
        _, alpha = corrected_gap(
            torch.zeros(2), torch.zeros(2), torch.zeros(S, 2), torch.tensor(sims, dtype=F64), gamma=gamma
        )
        assert 0.0 <= alpha <= 0.8 + 1e-12
        assert alpha == pytest.approx(0.8 * rho, abs=1e-12)


def test_without_sources_alpha_is_zero_and_the_gap_is_the_diagonal_one():
    """alignopsd.md Eq. 9-11, D3: no selected source gives α = 0 and log p_corr = log p_diag, so g = diag − student
    (also with α_max = 0)."""
    diag = torch.tensor([-0.5, -1.25, -3.0], dtype=F64)
    student = torch.tensor([-1.0, -1.0, -0.5], dtype=F64)
    expected = [0.5, -0.25, -2.5]
    for src, sims in [(None, None), (torch.zeros(0, 3), torch.zeros(0)), (torch.zeros(1, 3), None)]:
        g, alpha = corrected_gap(diag, student, src, sims)
        assert alpha == 0.0 and g.tolist() == pytest.approx(expected, abs=1e-15)
    g, alpha = corrected_gap(diag, student, torch.zeros(1, 3, dtype=F64), torch.tensor([0.95]), alpha_max=0.0)
    assert alpha == 0.0 and g.tolist() == pytest.approx(expected, abs=1e-15)


def test_corrected_gap_by_hand():
    """alignopsd.md Eq. 6-11: H = (0.9, 1.0) gives ω = (1, e)/(1 + e), ρ = ω_0·½ + ω_1·1, α = 0.8 ρ,
    g = (1 − α) log p_diag + α log(ω_0 p_0 + ω_1 p_1) − log π_old."""
    p_diag, p_old = [0.5, 0.2], [0.25, 0.4]
    p_src = [[0.6, 0.1], [0.3, 0.05]]
    w0, w1 = 1 / (1 + math.e), math.e / (1 + math.e)
    alpha = 0.8 * (w0 * 0.5 + w1 * 1.0)
    expected = [
        (1 - alpha) * math.log(p_diag[u]) + alpha * math.log(w0 * p_src[0][u] + w1 * p_src[1][u]) - math.log(p_old[u])
        for u in range(2)
    ]
    g, a = corrected_gap(
        torch.log(torch.tensor(p_diag, dtype=F64)),
        torch.log(torch.tensor(p_old, dtype=F64)),
        torch.log(torch.tensor(p_src, dtype=F64)),
        torch.tensor([0.9, 1.0], dtype=F64),
    )
    assert a == pytest.approx(alpha, abs=1e-12)
    assert g.tolist() == pytest.approx(expected, abs=1e-12)


def test_corrected_gap_is_detached():
    """alignopsd.md Eq. 11: g = sg[…]; inputs that require grad (log-probs and H) give a result without grad."""
    diag = torch.tensor([-0.5, -1.0], dtype=F64, requires_grad=True)
    student = torch.tensor([-0.7, -0.2], dtype=F64, requires_grad=True)
    src = torch.tensor([[-0.3, -2.0], [-1.0, -0.1]], dtype=F64, requires_grad=True)
    sims = torch.tensor([0.9, 0.95], dtype=F64, requires_grad=True)
    g, alpha = corrected_gap(diag, student, src, sims)
    assert not g.requires_grad and g.grad_fn is None and isinstance(alpha, float) and alpha > 0
    g, _ = corrected_gap(diag, student)
    assert not g.requires_grad


# ---------------------------------------------------------------------------------------------------------------------
# Segmentation: profiles, distances, threshold (Eq. 12-16)


def test_profiles_by_hand():
    """alignopsd.md Eq. 12-13, D3: turn 0 (H = 0.9, 0.5 eligible) has P = (e^9, e^5, 0)/(e^9 + e^5), the source
    below γ keeping mass, and is valid; turn 1's best eligible H is 0.7 < γ (the ineligible 0.95 does not count):
    invalid, yet its profile sums to 1; turn 2 has no eligible source: zero profile, invalid."""
    sims = torch.tensor([[0.9, 0.5, 0.7], [0.6, 0.7, 0.95], [0.99, 0.99, 0.99]], dtype=F64)
    elig = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]], dtype=torch.bool)
    p, valid = profiles(sims, elig)
    z0, z1 = math.exp(9) + math.exp(5), math.exp(6) + math.exp(7)
    assert p[0].tolist() == pytest.approx([math.exp(9) / z0, math.exp(5) / z0, 0.0], abs=1e-12)
    assert p[1].tolist() == pytest.approx([math.exp(6) / z1, math.exp(7) / z1, 0.0], abs=1e-12)
    assert float(p[0, 1]) > 0.01  # below γ, still mass
    assert p[2].tolist() == [0.0, 0.0, 0.0]
    assert valid.tolist() == [True, False, False]


def test_profiles_random():
    """alignopsd.md Eq. 12-13: rows with an eligible source sum to 1 and equal the plain softmax over the eligible
    sources; ineligible entries and source-less rows are 0; valid ⇔ best eligible H ≥ γ."""
    g = torch.Generator().manual_seed(4)
    for _ in range(100):
        K, M = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
        sims = torch.rand(K, M, generator=g, dtype=F64) * 1.2 - 0.2
        elig = torch.rand(K, M, generator=g) < 0.6
        p, valid = profiles(sims, elig, gamma=0.8)
        for t in range(K):
            cols = [s for s in range(M) if elig[t, s]]
            if not cols:
                assert p[t].tolist() == [0.0] * M and not valid[t]
                continue
            ref = softmax([float(sims[t, s]) / 0.1 for s in cols])
            assert [float(p[t, s]) for s in cols] == pytest.approx(ref, abs=1e-12)
            assert all(float(p[t, s]) == 0.0 for s in range(M) if s not in cols)
            assert float(p[t].sum()) == pytest.approx(1.0, abs=1e-12)
            assert bool(valid[t]) == (max(float(sims[t, s]) for s in cols) >= 0.8)


def test_jsd_bits():
    """alignopsd.md Eq. 14: 0 for equal profiles, 1 for disjoint supports, symmetric, within [0, 1] and equal to the
    plain formula ½ KL(p ‖ m) + ½ KL(q ‖ m) in bits on random profiles (zeros included)."""
    assert jsd_bits(torch.tensor([0.2, 0.8, 0.0]), torch.tensor([0.2, 0.8, 0.0])) == pytest.approx(0.0, abs=1e-15)
    assert jsd_bits(torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 0.5, 0.5])) == pytest.approx(1.0, abs=1e-12)
    assert jsd_bits(torch.tensor([0.5, 0.5, 0, 0]), torch.tensor([0, 0, 0.25, 0.75])) == pytest.approx(1.0, abs=1e-12)
    # hand: p = (1, 0), q = (½, ½), m = (¾, ¼): ½ log2(4/3) + ½ (½ log2(2/3) + ½ log2 2) = 0.3112781…
    assert jsd_bits(torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])) == pytest.approx(0.31127812445913283, 1e-12)
    g = torch.Generator().manual_seed(5)
    for _ in range(200):
        M = int(torch.randint(1, 7, (1,), generator=g))
        p, q = (torch.rand(M, generator=g, dtype=F64) * (torch.rand(M, generator=g) < 0.7) for _ in range(2))
        p[0], q[-1] = p[0] + 0.1, q[-1] + 0.1
        p, q = p / p.sum(), q / q.sum()
        d = jsd_bits(p, q)
        assert 0.0 <= d <= 1.0 and d == pytest.approx(jsd_bits(q, p), abs=1e-15)
        assert d == pytest.approx(ref_jsd_bits(p.tolist(), q.tolist()), abs=1e-12)
        assert jsd_bits(p, p) == pytest.approx(0.0, abs=1e-15)


def test_boundary_distances_and_validity_by_hand():
    """alignopsd.md Eq. 14-15: boundary 1 joins two valid turns with the same eligible set (valid, d = JSD of the
    swapped profiles); boundary 2 changes the eligible set; boundary 3 reaches an invalid turn; index 0 is unused."""
    sims = torch.tensor([[0.9, 0.5, 0.1], [0.5, 0.9, 0.1], [0.9, 0.5, 0.1], [0.3, 0.2, 0.1]], dtype=F64)
    elig = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 1, 1]], dtype=torch.bool)
    p, valid = profiles(sims, elig)
    assert valid.tolist() == [True, True, True, False]
    d, ok = boundary_distances(p, valid, elig)
    assert ok.tolist() == [False, True, False, False]
    a = math.exp(9) / (math.exp(9) + math.exp(5))
    assert float(d[1]) == pytest.approx(ref_jsd_bits([a, 1 - a, 0], [1 - a, a, 0]), abs=1e-12)
    for t in range(1, 4):
        assert float(d[t]) == pytest.approx(ref_jsd_bits(p[t - 1].tolist(), p[t].tolist()), abs=1e-12)


def test_batch_threshold():
    """alignopsd.md Eq. 16, D2: the 0.8 quantile with linear interpolation, clipped to [0.01, 0.10], +∞ without a
    valid boundary. By hand: sorted (0.02, 0.04, 0.06, 0.08, 0.09), position 0.8·4 = 3.2, 0.08 + 0.2·0.01 = 0.082;
    (0, 0.05): position 0.8, 0.04."""
    assert batch_threshold(torch.tensor([0.09, 0.02, 0.08, 0.04, 0.06], dtype=F64)) == pytest.approx(0.082, abs=1e-12)
    assert batch_threshold(torch.tensor([0.05, 0.0], dtype=F64)) == pytest.approx(0.04, abs=1e-12)
    assert batch_threshold(torch.tensor([0.0, 0.0, 0.001], dtype=F64)) == 0.01
    assert batch_threshold(torch.tensor([0.5, 0.9], dtype=F64)) == 0.10
    assert batch_threshold(torch.tensor([], dtype=F64)) == math.inf
    rng = random.Random(6)
    for _ in range(200):
        xs = [rng.random() ** rng.choice([1, 3, 6]) for _ in range(rng.randint(1, 30))]
        v = sorted(xs)
        pos = 0.8 * (len(v) - 1)
        i = math.floor(pos)
        q = v[i] + (pos - i) * (v[min(i + 1, len(v) - 1)] - v[i])
        theta = batch_threshold(torch.tensor(xs, dtype=F64))
        assert 0.01 <= theta <= 0.10
        assert theta == pytest.approx(min(max(q, 0.01), 0.10), abs=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Segmentation: cuts (Eq. 17)


def seg(d: list[float], ok: list[bool] | None = None, theta: float = 0.1, **kw) -> Segmentation:
    ok = [True] * len(d) if ok is None else ok
    return segment(torch.tensor(d, dtype=F64), torch.tensor(ok, dtype=torch.bool), theta, **kw)


def test_strongest_candidate_wins_a_conflict():
    """alignopsd.md Eq. 17, D2: cuts at 2 and 3 cannot both stand (a piece of 1 < L_min). Strongest first, 3 (0.6)
    is accepted and 2 (0.5) rejected: starts [0, 3]; weakest first would have given [0, 2]. Equal d: the smaller t."""
    s = seg([0, 0, 0.5, 0.6, 0, 0])
    assert (s.starts, s.semantic, s.guided, s.forced) == ([0, 3], 1, 0, 0)
    s = seg([0, 0, 0.5, 0.5, 0, 0])
    assert (s.starts, s.semantic) == ([0, 2], 1)
    # d must exceed θ strictly; an invalid boundary is never a candidate
    assert seg([0, 0, 0.1, 0, 0], theta=0.1).starts == [0]
    assert seg([0, 0, 0.9, 0, 0], ok=[True, True, False, True, True]).starts == [0]
    # compatible candidates are all accepted: 2 and 4 leave pieces of 2, 2 and 2
    s = seg([0, 0, 0.3, 0, 0.2, 0])
    assert (s.starts, s.semantic) == ([0, 2, 4], 2)


def test_guided_cut_takes_the_largest_valid_d_leftmost():
    """alignopsd.md Eq. 17, D2: K = 12 > L_max with no semantic boundary (θ = ∞). Feasible cuts are 2..10; 1 (d 0.9)
    is infeasible, 8 (d 0.2) is invalid; among 4 (0.05), 6 (0.03) and 9 (0.05) the largest d, leftmost, is 4:
    spans [0, 4) and [4, 12) (length 8), one guided cut."""
    d = [0, 0.9, 0, 0, 0.05, 0, 0.03, 0, 0.2, 0.05, 0, 0]
    ok = [t != 8 for t in range(12)]
    s = seg(d, ok, theta=math.inf)
    assert (s.starts, s.semantic, s.guided, s.forced) == ([0, 4], 0, 1, 0)
    assert s.spans(12) == [(0, 4), (4, 12)]
    # d = 0.01 is guided (≥), d = 0.0099 is not: then the forced cut at the midpoint 6 of [0, 12)
    d = [0.0] * 12
    d[4] = 0.01
    s = seg(d, theta=math.inf)
    assert (s.starts, s.guided, s.forced) == ([0, 4], 1, 0)
    d[4] = 0.0099
    s = seg(d, theta=math.inf)
    assert (s.starts, s.guided, s.forced) == ([0, 6], 0, 1)


def test_forced_cuts_nearest_the_midpoint_left_on_ties():
    """alignopsd.md Eq. 17, D2: no valid boundary. K = 9: feasible 2..7, midpoint 4.5, 4 and 5 tie, the left one:
    [0, 4]. K = 20: 10 (midpoint of [0, 20)), then [0, 10) at 5 and [10, 20) at 15: [0, 5, 10, 15], three forced."""
    s = seg([0.0] * 9, [False] * 9, theta=math.inf)
    assert (s.starts, s.semantic, s.guided, s.forced) == ([0, 4], 0, 0, 1)
    s = seg([0.5] * 20, [False] * 20)
    assert (s.starts, s.semantic, s.guided, s.forced) == ([0, 5, 10, 15], 0, 0, 3)
    # valid but weak boundaries (d < 0.01) do not guide
    s = seg([0.005] * 9, theta=0.1)
    assert (s.starts, s.forced) == ([0, 4], 1)


def test_semantic_then_repair():
    """alignopsd.md Eq. 17: K = 14, one semantic cut at 2 (d 0.5 > θ) leaves [2, 14) of 12 turns; its feasible cuts
    are 4..12, 3 (0.05) is not feasible, 10 (0.04) beats 7 (0.02): [0, 2, 10], one semantic and one guided."""
    d = [0.0] * 14
    d[2], d[3], d[7], d[10] = 0.5, 0.05, 0.02, 0.04
    s = seg(d, theta=0.1)
    assert (s.starts, s.semantic, s.guided, s.forced) == ([0, 2, 10], 1, 1, 0)


def test_short_rows_and_invalid_lengths():
    """alignopsd.md Eq. 17: a row shorter than L_min is one span; L_max < 2·L_min − 1 is rejected."""
    assert seg([0.0]).starts == [0] and seg([0.0]).spans(1) == [(0, 1)]
    assert seg([0.0, 0.9, 0.9], l_min=4, l_max=8).starts == [0]
    with pytest.raises(ValueError):
        seg([0.0] * 5, l_min=3, l_max=4)
    with pytest.raises(ValueError):
        seg([0.0] * 5, l_min=2, l_max=2)
    assert seg([0.0] * 6, l_min=3, l_max=5).starts == [0, 3]  # 2·3 − 1 = 5 is allowed; 6 > 5 is cut at 3


def test_segmentation_fuzz():
    """alignopsd.md Eq. 17 on random d, ok, θ (and L_min, L_max), K ≤ 40: a complete ordered partition with every
    length in [L_min, L_max] when K ≥ L_min, else one span; the cuts and their semantic / guided / forced counts
    equal the recursive re-implementation's."""
    rng = random.Random(7)
    forced_seen = guided_seen = semantic_seen = 0
    for trial in range(600):
        K = rng.randint(0, 40)
        l_min = 2 if trial % 2 else rng.randint(1, 3)
        l_max = 8 if trial % 2 else rng.randint(max(1, 2 * l_min - 1), 10)
        d = [rng.choice([0.0, rng.uniform(0, 0.01), rng.uniform(0.01, 0.1), rng.random()]) for _ in range(K)]
        ok = [rng.random() < rng.choice([0.0, 0.5, 0.9]) for _ in range(K)]
        theta = rng.choice([math.inf, rng.uniform(0.01, 0.1)])
        s = seg(d, ok, theta, l_min=l_min, l_max=l_max)
        assert (s.starts, s.semantic, s.guided, s.forced) == ref_segment(d, ok, theta, l_min, l_max)
        if K < l_min:
            assert s.starts == [0]
            continue
        spans = s.spans(K)
        assert spans[0][0] == 0 and spans[-1][1] == K
        assert all(a1 == b0 for (_, b0), (a1, _) in zip(spans, spans[1:], strict=False))
        assert all(l_min <= b - a <= l_max for a, b in spans)
        assert s.semantic + s.guided + s.forced == len(s.starts) - 1
        forced_seen += s.forced > 0
        guided_seen += s.guided > 0
        semantic_seen += s.semantic > 0
    assert min(forced_seen, guided_seen, semantic_seen) > 20  # every kind of cut was exercised


def test_segmentation_does_not_depend_on_a_or_g():
    """alignopsd.md Eq. 17: segments depend on H and eligibility only. `segment` takes d, ok, θ and lengths, nothing
    of A or g; `row_weights` takes a segmentation as given and, for random A and g, leaves it unchanged."""
    assert list(inspect.signature(segment).parameters) == ["d", "ok", "theta", "l_min", "l_max", "guided_min"]
    rng = random.Random(8)
    d = [rng.random() * 0.2 for _ in range(20)]
    ok = [rng.random() < 0.7 for _ in range(20)]
    s = seg(d, ok, theta=0.05)
    starts, spans = list(s.starts), s.spans(20)
    frozen = list(spans)
    n = torch.tensor([rng.randint(1, 30) for _ in range(20)])
    for _ in range(20):
        row_weights(torch.randn(20, dtype=F64) * 3, rng.choice([-2.0, -0.3, 0.0, 0.7, 1.5]), n, spans)
        assert spans == frozen and s.starts == starts
        assert seg(d, ok, theta=0.05).starts == starts


# ---------------------------------------------------------------------------------------------------------------------
# M2 credit: allocation (Eq. 18-21, 25)


def test_allocate_against_a_plain_reimplementation():
    """alignopsd.md Eq. 19-21 on random evidence, counts, segmentations and temperatures: r equals the math.exp
    re-implementation and Σ n r = N (relative 1e-12)."""
    rng = random.Random(9)
    for _ in range(300):
        K = rng.randint(1, 25)
        n = [rng.randint(1, 300) for _ in range(K)]
        s = [rng.gauss(0, rng.choice([0.1, 1.0, 3.0])) for _ in range(K)]
        spans, T = random_spans(rng, K), rng.choice([0.1, 0.5, 1.0, 3.0])
        r = allocate(torch.tensor(s, dtype=F64), torch.tensor(n), spans, T)
        ref, _ = ref_allocate(s, n, spans, T)
        assert r.dtype == F64
        assert r.tolist() == pytest.approx(ref, rel=1e-10, abs=1e-300)
        assert float((torch.tensor(n, dtype=F64) * r).sum()) == pytest.approx(sum(n), rel=1e-12)


def test_uniform_evidence_gives_exactly_one():
    """alignopsd.md Eq. 19-23 (what follows): equal s_t on every turn gives b_σ = N_σ/N, q_t = n_t/N_σ, r = h = w = 1
    (1e-12) for any lengths and any segmentation, forced cuts included, in both projection modes."""
    rng = random.Random(10)
    forced = 0
    for trial in range(200):
        K = rng.randint(1, 40)
        n = torch.tensor([rng.randint(1, 500) for _ in range(K)])
        if trial % 2:
            s = seg([0.0] * K, [False] * K, theta=math.inf)  # no valid boundary: forced cuts only
            forced += s.forced
            spans = s.spans(K)
        else:
            spans = random_spans(rng, K)
        c = rng.uniform(-5, 5)
        T = rng.choice([0.05, 0.5, 2.0])
        r = allocate(torch.full((K,), c, dtype=F64), n, spans, T)
        assert (r - 1).abs().max() <= 1e-12
        for bounds in (LEGACY, BOUNDED):
            w, ok = row_weights(torch.full((K,), c, dtype=F64), rng.choice([-1.0, 1.0]), n, spans, T, bounds)
            assert ok and (w - 1).abs().max() <= 1e-12
    assert forced > 50


def test_zero_advantage_gives_one():
    """alignopsd.md Eq. 18, 23: A = 0 gives s ≡ 0, hence w ≡ 1 whatever the gaps."""
    rng = random.Random(11)
    for _ in range(50):
        K = rng.randint(1, 20)
        n = torch.tensor([rng.randint(1, 100) for _ in range(K)])
        for bounds in (LEGACY, BOUNDED):
            w, ok = row_weights(torch.randn(K, dtype=F64) * 5, 0.0, n, random_spans(rng, K), 0.5, bounds)
            assert ok and (w - 1).abs().max() <= 1e-12


@pytest.mark.parametrize("bounds, w_range", MODES)
def test_credit_conservation_sign_and_bounds(bounds, w_range):
    """alignopsd.md Eq. 18-23, D4, conventions.md C21 on random gaps, counts, segmentations and advantages:
    Σ n w = N (relative 1e-9), w > 0, w within [0.5, 2.5] (legacy) or [0.9, 1.1] (bounded), w = 0.5 + 0.5 h with h
    the projection of the raw density, and the projection is active on many rows."""
    rng = random.Random(12 if bounds == LEGACY else 13)
    active = 0
    for _ in range(300):
        K = rng.randint(1, 30)
        n = [rng.randint(1, 200) for _ in range(K)]
        gaps = torch.tensor([rng.gauss(0, rng.choice([0.05, 0.5, 2.0, 6.0])) for _ in range(K)], dtype=F64)
        adv = rng.choice([-1.0, 1.0]) * rng.uniform(0.1, 3.0)
        spans, T = random_spans(rng, K), rng.choice([0.25, 0.5, 1.0])
        w, ok = row_weights(gaps, adv, torch.tensor(n), spans, T, bounds)
        N = sum(n)
        assert ok
        assert abs(sum(k * float(x) for k, x in zip(n, w, strict=True)) - N) <= 1e-9 * N
        assert float(w.min()) > 0
        assert w_range[0] - 1e-12 <= float(w.min()) and float(w.max()) <= w_range[1] + 1e-12
        r, _ = ref_allocate((math.copysign(1, adv) * gaps).tolist(), n, spans, T)
        h = exact_projection(r, n, *bounds)
        assert w.tolist() == pytest.approx([0.5 + 0.5 * float(x) for x in h], abs=1e-8)
        active += any(x in (Fraction(bounds[0]), Fraction(bounds[1])) for x in h)
    assert active > 50


def test_monotonicity_within_a_span_of_equal_counts():
    """alignopsd.md Eq. 18, 20-23: within a span whose turns have equal n_t, a higher ḡ_t gives w_t at least as high
    for A > 0 and at most as high for A < 0 (both projection modes, projection often active)."""
    rng = random.Random(14)
    pairs = 0
    for _ in range(200):
        K = rng.randint(2, 20)
        spans = random_spans(rng, K)
        n = [0] * K
        for a, b in spans:
            n[a:b] = [rng.randint(1, 50)] * (b - a)
        g = [rng.gauss(0, rng.choice([0.3, 2.0])) for _ in range(K)]
        for bounds in (LEGACY, BOUNDED):
            for adv in (1.3, -0.7):
                w = row_weights(torch.tensor(g, dtype=F64), adv, torch.tensor(n), spans, 0.5, bounds)[0].tolist()
                for a, b in spans:
                    for i in range(a, b):
                        for j in range(a, b):
                            if g[i] > g[j]:
                                pairs += 1
                                assert (w[i] >= w[j]) if adv > 0 else (w[i] <= w[j])
    assert pairs > 1000


def test_temperature_limits():
    """alignopsd.md Eq. 19, 25: KL(b ‖ u), u_σ = N_σ / N, of the span budgets does not increase as T grows (b from
    the re-implemented Eq. 19 and read back from allocate's density); b maximises Σ b S − T KL(b ‖ u) against random
    points of the simplex; a very large T gives w → 1."""
    rng = random.Random(15)
    temps = [0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 20.0, 100.0, 1e4]
    for _ in range(100):
        K = rng.randint(2, 20)
        n = [rng.randint(1, 100) for _ in range(K)]
        s = [rng.gauss(0, 2.0) for _ in range(K)]
        spans = random_spans(rng, K)
        N = sum(n)
        u = [sum(n[a:b]) / N for a, b in spans]
        S = [sum(s[a:b]) / (b - a) for a, b in spans]
        kls = []
        for T in temps:
            _, b = ref_allocate(s, n, spans, T)
            b_code = span_budgets(allocate(torch.tensor(s, dtype=F64), torch.tensor(n), spans, T), n, spans)
            assert b_code == pytest.approx(b, abs=1e-10)
            kls.append(kl(b, u))
            best = sum(x * y for x, y in zip(b, S, strict=True)) - T * kl(b, u)
            for _ in range(5):
                e = [rng.expovariate(1.0) for _ in b]
                other = [x / sum(e) for x in e]
                assert best >= sum(x * y for x, y in zip(other, S, strict=True)) - T * kl(other, u) - 1e-9
        assert all(k2 <= k1 + 1e-12 for k1, k2 in zip(kls, kls[1:], strict=False))
        assert kls[-1] < 1e-6
        w, _ = row_weights(torch.tensor(s, dtype=F64), 1.0, torch.tensor(n), spans, temperature=1e6)
        assert (w - 1).abs().max() < 1e-5


def test_weights_are_detached():
    """alignopsd.md Eq. 18-24: w enters Â as sg(w); gaps that require grad give weights without grad, whether the raw
    density is already feasible (small gaps) or projected (large gaps)."""
    for scale in (0.01, 5.0):
        gaps = (torch.tensor([0.3, -1.0, 2.0, 0.5], dtype=F64) * scale).requires_grad_()
        w, _ = row_weights(gaps, 1.0, torch.tensor([3, 1, 2, 5]), [(0, 2), (2, 4)])
        assert not w.requires_grad and w.grad_fn is None


# ---------------------------------------------------------------------------------------------------------------------
# M2 credit: the projection (Eq. 22, D4, C21) and mixing (Eq. 23)


def test_projection_by_hand():
    """alignopsd.md Eq. 22: r = (2.5, ¼, ¼), n = 1, hi = 2: a plain clamp gives (2, ¼, ¼) with sum 2.5 ≠ 3; the
    projection is clamp(r − λ) with λ = −¼: (2, ½, ½). Infeasible bounds (lo > 1 or hi < 1) are rejected."""
    h, ok = project_density(torch.tensor([2.5, 0.25, 0.25], dtype=F64), torch.tensor([1, 1, 1]), hi=2.0)
    assert ok and h.tolist() == pytest.approx([2.0, 0.5, 0.5], abs=1e-12)
    # n = (1, 2), N = 3, r = (5, 0): h_0 = 4 would need 2 h_1 = −1 < 0, so h_1 sits at lo = 0 and h_0 = 3 (λ = 2;
    # 0 − 2 < 0 is clamped); the plain clamp (4, 0) has sum 4
    h, ok = project_density(torch.tensor([5.0, 0.0], dtype=F64), torch.tensor([1, 2]))
    assert ok and h.tolist() == pytest.approx([3.0, 0.0], abs=1e-12)
    with pytest.raises(ValueError):
        project_density(torch.ones(3, dtype=F64), torch.ones(3), lo=1.1, hi=2.0)
    with pytest.raises(ValueError):
        project_density(torch.ones(3, dtype=F64), torch.ones(3), lo=0.0, hi=0.9)


def test_projection_returns_r_when_feasible():
    """alignopsd.md Eq. 22: r inside the bounds with Σ n r = N is returned unchanged (both modes, hand case and
    densities of small gaps)."""
    r = torch.tensor([1.1, 0.9, 1.0], dtype=F64)  # 1.1 + 0.9 + 2·1.0 = 4 = N
    for bounds in (LEGACY, BOUNDED):
        h, ok = project_density(r, torch.tensor([1, 1, 2]), *bounds)
        assert ok and torch.equal(h, r)
    rng = random.Random(16)
    for _ in range(100):
        K = rng.randint(1, 20)
        n = torch.tensor([rng.randint(1, 100) for _ in range(K)])
        r = allocate(torch.randn(K, dtype=F64) * 0.02, n, random_spans(rng, K), 0.5)
        assert float(r.min()) >= 0.8 and float(r.max()) <= 1.2
        for bounds in (LEGACY, BOUNDED):
            h, ok = project_density(r, n, *bounds)
            assert ok and torch.equal(h, r)


@pytest.mark.parametrize("bounds", [LEGACY, BOUNDED, (0.5, 1.0), (1.0, 3.0), (0.0, 1.5)])
def test_projection_fuzz_kkt_and_exact_solution(bounds):
    """alignopsd.md Eq. 22, D4, conventions.md C21 on random r (densities and arbitrary vectors) and counts: bounds
    hold, Σ n h = N (relative 1e-9), the KKT conditions hold (one λ with h_t = clamp(r_t − λ, lo, hi) for every t),
    h equals the exact rational solution, and h differs from a plain clamp whenever that clamp breaks the budget."""
    lo, hi = bounds
    rng = random.Random(f"{lo},{hi}")
    broken = 0
    for trial in range(120):
        K = rng.randint(1, 25)
        n = [rng.randint(1, 200) for _ in range(K)]
        if trial % 2:
            r = ref_allocate([rng.gauss(0, 3.0) for _ in range(K)], n, random_spans(rng, K), 0.5)[0]
        else:
            r = [rng.gauss(1, rng.choice([0.1, 1.0, 5.0])) for _ in range(K)]
        rt, nt = torch.tensor(r, dtype=F64), torch.tensor(n)
        h, ok = project_density(rt, nt, lo, hi)
        N = sum(n)
        assert ok
        assert lo <= float(h.min()) and float(h.max()) <= hi
        assert abs(sum(k * float(x) for k, x in zip(n, h, strict=True)) - N) <= 1e-9 * N
        # KKT: λ from the free coordinates is one number, and the clamped ones lie on the right side of it
        free = [t for t in range(K) if lo < float(h[t]) < hi]
        lam = sum(r[t] - float(h[t]) for t in free) / len(free) if free else None
        for t in range(K):
            if t in free:
                assert r[t] - float(h[t]) == pytest.approx(lam, abs=1e-8)
            elif lam is not None and float(h[t]) == hi:
                assert r[t] - lam >= hi - 1e-8
            elif lam is not None:
                assert r[t] - lam <= lo + 1e-8
        exact = exact_projection(r, n, lo, hi)
        assert h.tolist() == pytest.approx([float(x) for x in exact], abs=1e-8)
        clamp = rt.clamp(lo, hi)
        if abs(float((nt * clamp).sum()) - N) > 1e-9 * N:
            broken += 1
            assert float((h - clamp).abs().max()) > 0
    assert broken > 30


def test_projection_correction_loop():
    """conventions.md C21, alignopsd.md D4: the residual left by the bisection is spread over the free coordinates,
    clamped, and spread again until the budget is exact. By hand with no bisection step (iters = 0): r = (3, 1, 0.2),
    n = 1, bounds [0, 4], bracket [0.2 − 4, 3 − 0] = [−3.8, 3], λ = −0.4: h = (3.4, 1.4, 0.6), residual 3 − 5.4 = −2.4
    over 3 free coordinates: (2.6, 0.6, −0.2 → 0), residual −0.2 over 2 free ones: (2.5, 0.5, 0), the exact
    projection (λ = 0.5). On random rows with a short bisection: either the budget and bounds hold, or every
    coordinate sits at a bound and the row is reported (False)."""
    h, ok = project_density(torch.tensor([3.0, 1.0, 0.2], dtype=F64), torch.tensor([1, 1, 1]), iters=0)
    assert ok and h.tolist() == pytest.approx([2.5, 0.5, 0.0], abs=1e-12)
    rng = random.Random(17)
    for iters in (0, 5, 10):
        fixed = 0
        for _ in range(150):
            K = rng.randint(1, 25)
            n = [rng.randint(1, 200) for _ in range(K)]
            r = torch.tensor([rng.gauss(1, rng.choice([0.1, 1.0, 5.0])) for _ in range(K)], dtype=F64)
            lo, hi = rng.choice([LEGACY, BOUNDED])
            h, ok = project_density(r, torch.tensor(n), lo, hi, iters=iters)
            assert lo <= float(h.min()) and float(h.max()) <= hi
            if ok:
                fixed += 1
                assert abs(sum(k * float(x) for k, x in zip(n, h, strict=True)) - sum(n)) <= 1e-9 * sum(n)
            else:
                assert bool(((h == lo) | (h == hi)).all())
        assert fixed > {0: 30, 5: 130, 10: 145}[iters]


def test_mix():
    """alignopsd.md Eq. 23: w = (1 − β) + β h, so h ∈ [0, 4] maps to [0.5, 2.5] and [0.8, 1.2] to [0.9, 1.1]."""
    assert mix(torch.tensor([0.0, 4.0, 0.8, 1.2, 1.0], dtype=F64)).tolist() == pytest.approx(
        [0.5, 2.5, 0.9, 1.1, 1.0], abs=1e-15
    )
    assert mix(torch.tensor([2.0], dtype=F64), beta=0.25).tolist() == [1.25]
