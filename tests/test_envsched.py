"""Tests of EnvSched, the environment-aware task scheduler (docs/methods/envsched.md): reward scaling and decay
(Eq. 1-3, lazy against eager), the posterior moments, informativeness, uncertainty and score (Eq. 4-8) against the Beta
closed forms of Eq. 9 and Monte Carlo, the environment/task similarity and kNN graph (Eq. 10-11), the cold-start
priors (Eq. 12-15), batch selection with quotas, similarity penalty, exploration and the seeded tie-break (Eq. 16-18,
§4.4), invalid rollouts, `SchedulerSampler`'s layout, and checkpoint/resume of `EnvScheduler`. Covers
docs/methods/envsched.md §7 properties 1-19 and 21 (property 20, the two-rank run, is not covered here); every expected
value is derived by hand, in closed form, by a numpy re-implementation written here, by Monte Carlo or by brute-force
enumeration. No model is built and nothing is trained.
"""

from __future__ import annotations

import json
import math
import tracemalloc

import numpy as np
import pytest

from trainers.envsched import (
    EnvScheduler,
    SchedSettings,
    SchedulerSampler,
    decay_factor,
    environment_similarity,
    informativeness,
    jaccard,
    knn_graph,
    pair_similarity,
    posterior,
    priors,
    scale_reward,
    score,
    select_batch,
    uncertainty,
)

DESC = {
    "shop": {"tools": ["search", "click", "buy"], "state_keys": ["cart", "page"], "verifier": "exact"},
    "search": {"tools": ["search", "open"], "state_keys": ["page"], "verifier": "f1"},
    "terminal": {"tools": ["bash"], "state_keys": ["cwd", "files"], "verifier": "exit_code"},
    "echo": {"tools": [], "state_keys": [], "verifier": "exact"},
}
ALPHAS = (0.3, 0.2, 0.2, 0.3)


def make_sched(sizes: dict, B: int, seed: int = 0, texts=None, task_ids=None, **kw) -> EnvScheduler:
    env_names = [e for e, n in sizes.items() for _ in range(n)]
    ids = task_ids if task_ids is not None else [f"task-{i}" for i in range(len(env_names))]
    return EnvScheduler(env_names, DESC, texts, B, SchedSettings(**kw), seed=seed, task_ids=ids)


# ---------------------------------------------------------------------------------------------------------------------
# Independent numpy re-implementations of the spec's equations


def ref_moments(W, S1, S2, mu0, n0):
    """Eq. 5 written out: (n, μ, v)."""
    n = W + n0
    mu = (S1 + n0 * mu0) / n
    return n, mu, (S2 + n0 * mu0) / n - mu**2


def ref_score(W, S1, S2, mu0, n0, c_u):
    """Eq. 5-8 with ζ = 0: (Î, U, s)."""
    n, _, v = ref_moments(W, S1, S2, mu0, n0)
    info, unc = v * n / (n + 1), v / (n + 1)
    return info, unc, info + c_u * np.sqrt(np.maximum(unc, 0.0))


def ref_priors(W, S1, env_ids, nbr_idx, nbr_w, n_envs, kappa, mu_init, n_base, n_max):
    """Eq. 12-15 with explicit loops."""
    N = len(W)
    tot_w = float(sum(W))
    mu_g = float(sum(S1)) / tot_w if tot_w > 0 else mu_init
    mu_e = []
    for e in range(n_envs):
        s1 = sum(S1[t] for t in range(N) if env_ids[t] == e)
        w = sum(W[t] for t in range(N) if env_ids[t] == e)
        mu_e.append((s1 + kappa * mu_g) / (w + kappa))
    mu0, n0 = np.zeros(N), np.zeros(N)
    for t in range(N):
        num = sum(nbr_w[t][k] * S1[nbr_idx[t][k]] for k in range(len(nbr_idx[t])))
        den = sum(nbr_w[t][k] * W[nbr_idx[t][k]] for k in range(len(nbr_idx[t])))
        mu0[t] = (num + kappa * mu_e[env_ids[t]]) / (den + kappa)
        n0[t] = min(n_base + den, n_max)
    return mu0, n0


def ref_similarity_matrix(descs, env_ids, emb, alphas):
    """Eq. 10 for every task pair, from Python sets and explicit dot products."""
    a_tool, a_state, a_ver, a_emb = alphas
    if emb is None:
        tot = a_tool + a_state + a_ver
        a_tool, a_state, a_ver, a_emb = a_tool / tot, a_state / tot, a_ver / tot, 0.0

    def jac(a, b):
        a, b = set(a), set(b)
        return 1.0 if not a and not b else len(a & b) / len(a | b)

    N = len(env_ids)
    out = np.zeros((N, N))
    for i in range(N):
        for j in range(N):
            di, dj = descs[env_ids[i]], descs[env_ids[j]]
            w = a_tool * jac(di["tools"], dj["tools"]) + a_state * jac(di["state_keys"], dj["state_keys"])
            w += a_ver * (di["verifier"] == dj["verifier"])
            if emb is not None:
                w += a_emb * max(0.0, float(sum(emb[i][d] * emb[j][d] for d in range(emb.shape[1]))))
            out[i, j] = w
    return out


def ref_greedy(s, env_ids, B, quota, lam, sim, M):
    """§4.4 steps 3-4 without exploration, for distinct objective values: (picks, quota violations)."""
    N = len(s)
    cand = list(np.argsort(-s, kind="stable")[:M])
    sel, counts, stage, viol = [], {}, 0, 0
    while len(sel) < B:
        pool = cand if stage == 0 else range(N)
        elig = [i for i in pool if i not in sel and (stage == 2 or quota is None or counts.get(env_ids[i], 0) < quota)]
        if not elig:
            stage += 1
            continue
        vals = [s[i] - lam * (max(sim[i, j] for j in sel) if sel else 0.0) for i in elig]
        best = elig[int(np.argmax(vals))]
        if stage == 2 and quota is not None and counts.get(env_ids[best], 0) >= quota:
            viol += 1
        sel.append(int(best))
        counts[env_ids[best]] = counts.get(env_ids[best], 0) + 1
    return sel, viol


def matrix_similarity(S):
    return lambda i, js: S[i, np.asarray(js)]


# ---------------------------------------------------------------------------------------------------------------------
# Eq. 1-2


def test_scale_reward_hand_values():
    np.testing.assert_allclose(scale_reward([-1.0, 0.0, 0.25, 1.0, 2.0]), [0.0, 0.0, 0.25, 1.0, 1.0])
    np.testing.assert_allclose(scale_reward([-3.0, -1.0, 1.0, 3.0, 5.0], lo=-1.0, hi=3.0), [0.0, 0.0, 0.5, 1.0, 1.0])
    with pytest.raises(ValueError):
        scale_reward([0.5], lo=1.0, hi=1.0)
    with pytest.raises(ValueError):
        scale_reward([0.5], lo=2.0, hi=1.0)


@pytest.mark.parametrize("h", [1.0, 2.0, 3.0, 7.5, 50.0])
def test_decay_factor_halves_after_one_half_life(h):
    eta = decay_factor(h)
    assert 0 < eta < 1
    assert eta**h == pytest.approx(0.5, rel=1e-12)
    assert decay_factor(1.0) == 0.5
    assert decay_factor(math.inf) == 1.0


@pytest.mark.parametrize(("N", "B", "h"), [(100, 4, 50), (20, 4, 10), (9, 2, 10), (43, 2, 44)])
def test_default_half_life(N, B, h):
    """D4: h = max(10, 2·⌈N/B⌉), η = 2^(−1/h) (hand values)."""
    sched = make_sched({"shop": N}, B)
    assert sched.half_life == h
    assert sched.eta == pytest.approx(2.0 ** (-1.0 / h), rel=1e-15)


# ---------------------------------------------------------------------------------------------------------------------
# Property 1: Beta equivalence (Eq. 9)

BETA_CASES = [  # (W, S1, μ0, n0): integer and decayed (fractional) binary histories
    (0.0, 0.0, 0.5, 2.0),
    (5.0, 2.0, 0.5, 2.0),
    (10.0, 10.0, 0.3, 4.0),
    (7.3, 1.9, 0.8, 3.1),
    (40.0, 13.0, 0.05, 2.0),
    (3.7, 0.0, 0.95, 4.0),
]


@pytest.mark.parametrize(("W", "S1", "mu0", "n0"), BETA_CASES)
def test_beta_equivalence_closed_form(W, S1, mu0, n0):
    """Binary rewards: S2 = S1; a = S1 + n0·μ0, b = W − S1 + n0·(1 − μ0); Î = ab/((a+b)(a+b+1)),
    U = ab/((a+b)²(a+b+1))."""
    n, mu, v = posterior(np.array(W), np.array(S1), np.array(S1), np.array(mu0), np.array(n0))
    a, b = S1 + n0 * mu0, (W - S1) + n0 * (1 - mu0)
    assert float(n) == pytest.approx(a + b, rel=1e-14)
    assert float(mu) == pytest.approx(a / (a + b), rel=1e-12)
    assert float(informativeness(v, n)) == pytest.approx(a * b / ((a + b) * (a + b + 1)), rel=1e-12, abs=1e-15)
    assert float(uncertainty(v, n)) == pytest.approx(a * b / ((a + b) ** 2 * (a + b + 1)), rel=1e-12, abs=1e-15)


@pytest.mark.parametrize(("W", "S1", "mu0", "n0"), [c for c in BETA_CASES if 0 < c[2] < 1 and c[1] + c[3] > 0])
def test_beta_equivalence_monte_carlo(W, S1, mu0, n0):
    """Î = E[p(1−p)] and U = Var(p) under p ~ Beta(a, b), within 5 standard errors of 200k numpy Beta draws."""
    a, b = S1 + n0 * mu0, (W - S1) + n0 * (1 - mu0)
    p = np.random.default_rng(1234).beta(a, b, size=200_000)
    n, _, v = posterior(np.array(W), np.array(S1), np.array(S1), np.array(mu0), np.array(n0))
    q = p * (1 - p)
    assert abs(float(informativeness(v, n)) - q.mean()) < 5 * q.std() / math.sqrt(len(p))
    d2 = (p - p.mean()) ** 2
    assert abs(float(uncertainty(v, n)) - p.var()) < 5 * d2.std() / math.sqrt(len(p))


# ---------------------------------------------------------------------------------------------------------------------
# Property 2: ranges, no NaN without history


def test_ranges_random_histories():
    rng = np.random.default_rng(0)
    for trial in range(300):
        T = int(rng.integers(0, 30))
        eta = decay_factor(float(rng.uniform(1, 30))) if trial % 3 else 1.0
        r = rng.uniform(0, 1, size=(T, 4)) if trial % 2 else rng.integers(0, 2, size=(T, 4)).astype(float)
        wts = eta ** np.arange(T)[::-1, None]  # weight of step i at step T
        W, S1, S2 = (wts * np.ones_like(r)).sum(), (wts * r).sum(), (wts * r**2).sum()
        mu0, n0 = rng.uniform(0, 1), rng.uniform(2, 4)
        n, mu, v = posterior(W, S1, S2, mu0, n0)
        info, unc = informativeness(v, n), uncertainty(v, n)
        assert np.isfinite([n, mu, v, info, unc]).all()
        assert v >= 0 and unc >= 0 and 0 <= info <= 0.25 + 1e-15
        _, mu_ref, v_ref = ref_moments(W, S1, S2, mu0, n0)
        assert mu == pytest.approx(mu_ref, rel=1e-12) and v == pytest.approx(v_ref, abs=1e-12)


@pytest.mark.parametrize(("mu0", "n0"), [(0.5, 2.0), (0.2, 2.0), (0.0, 3.0), (1.0, 4.0)])
def test_no_history_prior_only_values(mu0, n0):
    """W = S1 = S2 = 0: v = μ0(1−μ0), n = n0, Î = v·n0/(n0+1), U = v/(n0+1)."""
    n, mu, v = posterior(np.zeros(1), np.zeros(1), np.zeros(1), np.full(1, mu0), np.full(1, n0))
    vv = mu0 * (1 - mu0)
    assert float(v[0]) == pytest.approx(vv, abs=1e-15) and float(mu[0]) == pytest.approx(mu0)
    info, unc = informativeness(v, n), uncertainty(v, n)
    assert float(info[0]) == pytest.approx(vv * n0 / (n0 + 1), abs=1e-15)
    assert float(unc[0]) == pytest.approx(vv / (n0 + 1), abs=1e-15)
    assert float(score(info, unc, 0.5)[0]) == pytest.approx(vv * n0 / (n0 + 1) + 0.5 * math.sqrt(vv / (n0 + 1)))


def test_score_cost_term_hand_values():
    """Eq. 8: s = (Î + c_u·√U) / c̄^ζ; ζ = 0 ignores the cost."""
    info, unc, cost = np.array([0.2, 0.1]), np.array([0.04, 0.09]), np.array([2.0, 0.5])
    np.testing.assert_allclose(score(info, unc, 0.5), [0.3, 0.25])
    np.testing.assert_allclose(score(info, unc, 0.5, cost=cost, zeta=0.0), [0.3, 0.25])
    np.testing.assert_allclose(score(info, unc, 0.5, cost=cost, zeta=1.0), [0.15, 0.5])
    np.testing.assert_allclose(score(info, unc, 1.0, cost=cost, zeta=2.0), [0.4 / 4, 0.4 / 0.25])


# ---------------------------------------------------------------------------------------------------------------------
# Property 3: ordering


def _binary_scores(k, mu0, n0, weight=1.0):
    """Scores of a balanced (k passes, k fails), all-pass and all-fail history of 2k observations of equal weight."""
    W = 2 * k * weight
    out = {}
    for name, s1 in (("balanced", k * weight), ("pass", W), ("fail", 0.0)):
        n, _, v = posterior(W, s1, s1, mu0, n0)
        out[name] = float(score(informativeness(v, n), uncertainty(v, n), 0.5))
    return out


@pytest.mark.parametrize("mu0", [0.0, 0.2, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("n0", [2.0, 4.0])
def test_balanced_history_beats_extremes(mu0, n0):
    """With x = n0·μ0, y = n0·(1−μ0), Beta algebra gives ab(balanced) − ab(all fail) = k(k + y − x) at equal a+b, so
    balanced wins against all-fail when k > n0(2μ0−1) and against all-pass when k > n0(1−2μ0); with μ0 = 1/2 always."""
    for k in range(1, 8):
        for weight in (1.0, 0.37):  # equal observation times, decayed or not
            sc = _binary_scores(k, mu0, n0, weight)
            kk = k * weight
            if kk > n0 * (2 * mu0 - 1):
                assert sc["balanced"] > sc["fail"]
            if kk > n0 * (1 - 2 * mu0):
                assert sc["balanced"] > sc["pass"]


def test_ordering_needs_enough_history_against_an_extreme_prior():
    """The closed form's precondition is tight: μ0 = 1, n0 = 4, k = 1 gives ab = 5 (balanced) < 8 (all fail)."""
    sc = _binary_scores(1, 1.0, 4.0)
    assert sc["fail"] > sc["balanced"]
    n, _, v = posterior(2.0, 1.0, 1.0, 1.0, 4.0)  # a = 5, b = 1
    assert float(informativeness(v, n)) == pytest.approx(5 / (6 * 7))


# ---------------------------------------------------------------------------------------------------------------------
# Property 4: constant continuous rewards


def test_constant_reward_information_vanishes_closed_form():
    """r′ ≡ c with n observations: a mixture of a point mass at c (weight n/N) and Bernoulli(μ0) (weight n0/N),
    N = n + n0, so v = (n0/N)·μ0(1−μ0) + (n·n0/N²)·(c−μ0)² → 0, while a mean-only model keeps c(1−c)."""
    c, mu0, n0 = 0.3, 0.5, 2.0
    prev = math.inf
    for n_obs in (1, 3, 10, 100, 1000, 10_000):
        n, _, v = posterior(float(n_obs), n_obs * c, n_obs * c * c, mu0, n0)
        N = n_obs + n0
        v_mix = n0 / N * mu0 * (1 - mu0) + n_obs * n0 / N**2 * (c - mu0) ** 2
        assert float(v) == pytest.approx(v_mix, rel=1e-9)
        info = float(informativeness(v, n))
        assert info == pytest.approx(v_mix * N / (N + 1), rel=1e-9)
        assert info < prev
        prev = info
    assert prev < 1e-4 < c * (1 - c)


def test_constant_reward_scheduler_infinite_half_life():
    """Only task 0 is ever observed, always r = 0.3, h = ∞: μ_g = μ_e = 0.3, task 0's neighbours have no data so
    μ0 = 0.3 and n0 = n_base = 2; hence v = 2·0.21/(W+2), Î = 0.42/(W+3), which → 0."""
    sched = make_sched({"shop": 3, "search": 3}, 2, half_life=math.inf)
    G, prev = 8, math.inf
    for step in range(1, 41):
        sched.draw()
        sched.update([0] * G, [0.3] * G)
        sc = sched.scores()
        W = G * step
        assert sched.W[0] == pytest.approx(W, rel=1e-15)
        assert sc["mu0"][0] == pytest.approx(0.3, rel=1e-12)
        assert sc["info"][0] == pytest.approx(0.42 / (W + 3), rel=1e-9)
        assert sc["info"][0] < prev
        prev = sc["info"][0]
    assert prev < 2e-3


# ---------------------------------------------------------------------------------------------------------------------
# Property 5: lazy decay equals eager per-step decay


def test_lazy_decay_matches_eager_through_draw_and_update():
    """Random runs of draws (clock ticks) and updates (also several updates per tick, and ticks without updates)
    against an eager simulation that multiplies every sum by η at each tick, and against Eq. 3's Σ η^(t−t_i)."""
    sched = make_sched({"shop": 4, "search": 3, "echo": 2}, 2, half_life=3.0)
    eta = 2.0 ** (-1.0 / 3.0)
    N = 9
    We, S1e, S2e = np.zeros(N), np.zeros(N), np.zeros(N)
    log = []  # (t_i, task, r′)
    rng = np.random.default_rng(5)
    for _ in range(60):
        if rng.random() < 0.5:
            for _ in range(int(rng.integers(1, 5))):  # a gap of several ticks
                sched.draw()
                We, S1e, S2e = We * eta, S1e * eta, S2e * eta
        else:
            idx = rng.integers(0, N, size=int(rng.integers(1, 7)))
            r = rng.uniform(-0.5, 1.5, size=len(idx))
            sched.update(idx.tolist(), r.tolist())
            rp = np.minimum(np.maximum(r, 0.0), 1.0)
            for i, x in zip(idx, rp, strict=True):
                We[i] += 1.0
                S1e[i] += x
                S2e[i] += x * x
                log.append((sched.t, int(i), float(x)))
        # read the lazily decayed sums as of the current step without touching the scheduler
        f = eta ** (sched.t - sched.t_last).astype(float)
        np.testing.assert_allclose(sched.W * f, We, rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(sched.S1 * f, S1e, rtol=1e-12, atol=1e-300)
        np.testing.assert_allclose(sched.S2 * f, S2e, rtol=1e-12, atol=1e-300)
    sched.scores()  # a read decays to t
    assert (sched.t_last == sched.t).all()
    W_def = np.zeros(N)
    S1_def = np.zeros(N)
    for ti, i, x in log:
        W_def[i] += eta ** (sched.t - ti)
        S1_def[i] += eta ** (sched.t - ti) * x
    np.testing.assert_allclose(sched.W, W_def, rtol=1e-12)
    np.testing.assert_allclose(sched.S1, S1_def, rtol=1e-12)


def test_lazy_decay_arbitrary_gaps():
    """`_decay_to` across gaps of 0-40 steps (the clock moved directly) against eager repeated multiplication."""
    sched = make_sched({"shop": 3, "terminal": 3}, 2, half_life=4.5)
    eta = 2.0 ** (-1.0 / 4.5)
    We, S2e = np.zeros(6), np.zeros(6)
    rng = np.random.default_rng(11)
    for _ in range(40):
        gap = int(rng.choice([0, 1, 2, 7, 40]))
        sched.t += gap
        for _ in range(gap):
            We, S2e = We * eta, S2e * eta
        idx = rng.integers(0, 6, size=3)
        r = rng.uniform(0, 1, size=3)
        sched.update(idx.tolist(), r.tolist())
        np.add.at(We, idx, 1.0)
        np.add.at(S2e, idx, r**2)
        np.testing.assert_allclose(sched.W, We, rtol=1e-12)
        np.testing.assert_allclose(sched.S2, S2e, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Property 6: recency


def _switching_history(eta, n_zero, n_mixed, G=4):
    """W, S1, S2 (Eq. 3) after n_zero steps of all-0 groups then n_mixed steps of half-passing groups."""
    r = [[0.0] * G] * n_zero + [[1.0] * (G // 2) + [0.0] * (G // 2)] * n_mixed
    T = len(r)
    W = S1 = S2 = 0.0
    for i, row in enumerate(r):
        w = eta ** (T - 1 - i)
        W += w * len(row)
        S1 += w * sum(row)
        S2 += w * sum(x * x for x in row)
    return W, S1, S2


def test_recency_finite_half_life_reacts_faster():
    for n_mixed in (1, 2, 3, 5):
        out = {}
        for name, eta in (("decay", decay_factor(5.0)), ("none", 1.0)):
            before = ref_score(*_switching_history(eta, 30, 0), 0.5, 2.0, 0.5)[2]
            W, S1, S2 = _switching_history(eta, 30, n_mixed)
            n, _, v = posterior(W, S1, S2, 0.5, 2.0)
            after = float(score(informativeness(v, n), uncertainty(v, n), 0.5))
            assert after == pytest.approx(ref_score(W, S1, S2, 0.5, 2.0, 0.5)[2], rel=1e-12)
            out[name] = (before, after)
        assert out["decay"][1] > out["none"][1]
        assert out["decay"][1] - out["decay"][0] > out["none"][1] - out["none"][0]


def test_recency_scheduler():
    """The same switching history fed to two schedulers (h = 5 and h = ∞): task 0's score rises more with decay."""
    scheds = {h: make_sched({"shop": 4, "search": 4}, 2, half_life=h) for h in (5.0, math.inf)}
    rise = {}
    for h, sched in scheds.items():
        for _ in range(30):
            sched.draw()
            sched.update([0] * 4, [0.0] * 4)
        before = sched.scores()["score"][0]
        for _ in range(3):
            sched.draw()
            sched.update([0] * 4, [1.0, 0.0, 1.0, 0.0])
        rise[h] = sched.scores()["score"][0] - before
    assert rise[5.0] > rise[math.inf] > 0


# ---------------------------------------------------------------------------------------------------------------------
# Property 7: prior wash-out


@pytest.mark.parametrize("eta", [1.0, decay_factor(10.0)])
def test_prior_washes_out(eta):
    """μ − m = n0(μ0 − m)/n exactly, so |μ − m| ≤ n0/n; |v − v_data| ≤ 3n0/n and Î within a further 1/(4(n+1)):
    whatever the prior, μ and Î reach the decayed data moments as evidence grows."""
    rng = np.random.default_rng(3)
    for G in (1, 10, 100, 1000):
        r = rng.beta(2, 3, size=(60, G))  # continuous rewards in [0, 1]
        wts = eta ** np.arange(60)[::-1, None]
        W, S1, S2 = float((wts * np.ones_like(r)).sum()), float((wts * r).sum()), float((wts * r**2).sum())
        m, v_data = S1 / W, S2 / W - (S1 / W) ** 2
        for mu0 in (0.0, 0.3, 1.0):
            for n0 in (2.0, 4.0):
                n, mu, v = posterior(W, S1, S2, mu0, n0)
                assert float(mu) - m == pytest.approx(n0 * (mu0 - m) / (W + n0), abs=1e-12)
                assert abs(float(v) - v_data) <= 3 * n0 / (W + n0) + 1e-12
                info = float(informativeness(v, n))
                assert abs(info - v_data) <= 3 * n0 / (W + n0) + 0.25 / (W + n0 + 1) + 1e-12
                if eta == 1.0 and G == 1000:
                    assert abs(float(mu) - m) < 1e-4 and abs(info - v_data) < 2e-4


# ---------------------------------------------------------------------------------------------------------------------
# Property 8: similarity


def test_jaccard_hand_values():
    assert jaccard({"a", "b"}, {"b", "c"}) == pytest.approx(1 / 3)
    assert jaccard(set(), set()) == 1.0
    assert jaccard({"a"}, set()) == 0.0
    assert jaccard({"a", "b"}, {"a", "b"}) == 1.0


def test_environment_similarity_hand_values():
    """shop vs search: J(tools) = |{search}|/|{search,click,buy,open}| = 1/4, J(state) = 1/2, verifiers differ.
    With embeddings: 0.3/4 + 0.2/2 = 0.175; without: α's rescaled by 1/0.7. echo: empty sets, J(∅, ∅) = 1."""
    descs = [DESC["shop"], DESC["search"], DESC["echo"], {"tools": [], "state_keys": [], "verifier": "exact"}]
    with_emb = environment_similarity(descs, ALPHAS, True)
    no_emb = environment_similarity(descs, ALPHAS, False)
    assert with_emb[0, 1] == pytest.approx(0.175)
    assert no_emb[0, 1] == pytest.approx(0.175 / 0.7)
    assert with_emb[0, 0] == pytest.approx(0.7) and no_emb[0, 0] == pytest.approx(1.0)
    assert with_emb[2, 3] == pytest.approx(0.7) and no_emb[2, 3] == pytest.approx(1.0)
    assert with_emb[0, 2] == pytest.approx(0.2)  # shop vs echo: only the verifier ("exact") matches
    assert no_emb[0, 2] == pytest.approx(0.2 / 0.7)


def _random_pool(rng, N, n_envs, d=6):
    vocab_t, vocab_s = ["a", "b", "c", "d"], ["x", "y", "z"]
    descs = [
        {
            "tools": [t for t in vocab_t if rng.random() < 0.5],
            "state_keys": [s for s in vocab_s if rng.random() < 0.4],
            "verifier": str(rng.choice(["exact", "f1"])),
        }
        for _ in range(n_envs)
    ]
    env_ids = rng.integers(0, n_envs, size=N)
    emb = rng.normal(size=(N, d))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    emb[1] = emb[0]  # identical embeddings
    emb[3] = -emb[2]  # opposite embeddings: clipped at 0
    return descs, env_ids, emb


@pytest.mark.parametrize("with_emb", [True, False])
def test_pair_similarity_symmetric_bounded_and_matches_reference(with_emb):
    rng = np.random.default_rng(2)
    descs, env_ids, emb = _random_pool(rng, 25, 4)
    env_ids[1] = env_ids[0]
    emb = emb if with_emb else None
    env_sim = environment_similarity(descs, ALPHAS, with_emb)
    a_emb = ALPHAS[3] if with_emb else 0.0
    N = len(env_ids)
    i, j = np.meshgrid(np.arange(N), np.arange(N), indexing="ij")
    w = pair_similarity(env_sim, env_ids, emb, a_emb, i, j)
    np.testing.assert_allclose(w, ref_similarity_matrix(descs, env_ids, emb, ALPHAS), atol=1e-12)
    np.testing.assert_allclose(w, w.T, atol=1e-15)
    assert (w >= 0).all() and (w <= 1 + 1e-12).all()
    assert w[0, 1] == pytest.approx(1.0)  # same environment, identical embeddings (or none)
    np.testing.assert_allclose(np.diag(w), 1.0)


def test_scheduler_identical_texts_same_environment_have_similarity_one():
    texts = ["buy red socks", "buy red socks", "list the files", "search for a cheap laptop", "open the cart"]
    sched = make_sched({"shop": 2, "terminal": 1, "search": 2}, 2, texts=texts)
    w = sched.similarity(0, np.arange(5))
    assert w[1] == pytest.approx(1.0, abs=1e-6)
    assert (w >= 0).all() and (w <= 1 + 1e-6).all()
    for a in range(5):
        for b in range(5):
            assert sched.similarity(a, np.array([b]))[0] == pytest.approx(sched.similarity(b, np.array([a]))[0])


# ---------------------------------------------------------------------------------------------------------------------
# Property 9: cold-start ordering (Eq. 12-15 on hand-built graphs)

PRIOR_KW = dict(kappa=2.0, mu_init=0.5, n_base=2.0, n_max=4.0)


def test_coldstart_half_passing_neighbours_beat_failing_or_passing():
    """Tasks 0, 1, 2 unseen; their two neighbours (w = 1, W = 10 each) pass 5/10, 0/10 and 10/10.
    μ_g = 30/60 = 1/2, one environment: μ_e = (30 + 1)/(60 + 2) = 1/2; μ0 = (ΣwS1 + 1)/(20 + 2) = 11/22, 1/22, 21/22;
    n0 = min(2 + 20, 4) = 4."""
    W = np.array([0, 0, 0, 10, 10, 10, 10, 10, 10], dtype=float)
    S1 = np.array([0, 0, 0, 5, 5, 0, 0, 10, 10], dtype=float)
    env_ids = np.zeros(9, dtype=np.int64)
    nbr_idx = np.array([[3, 4], [5, 6], [7, 8], [4, 5], [3, 5], [6, 3], [5, 3], [8, 3], [7, 3]])
    nbr_w = np.ones((9, 2))
    mu0, n0 = priors(W, S1, env_ids, nbr_idx, nbr_w, 1, **PRIOR_KW)
    np.testing.assert_allclose(mu0[:3], [11 / 22, 1 / 22, 21 / 22], rtol=1e-12)
    np.testing.assert_allclose(n0[:3], 4.0)
    n, _, v = posterior(W, S1, S1, mu0, n0)
    s = score(informativeness(v, n), uncertainty(v, n), 0.5)
    assert s[0] > s[1] and s[0] > s[2]
    assert s[1] == pytest.approx(s[2])  # symmetric: 1/22 and 21/22


def test_coldstart_environment_and_global_fallbacks():
    """env 0: task 0 observed (W = 4, S1 = 3); env 1: task 3 observed (W = 6, S1 = 1); env 2 unobserved.
    μ_g = 4/10; μ_e0 = (3 + 0.8)/6 = 19/30; μ_e1 = (1 + 0.8)/8 = 0.225; μ_e2 = κμ_g/κ = 0.4.
    Unseen tasks whose neighbours are unobserved get their environment's mean, n0 = n_base."""
    W = np.array([4, 0, 0, 6, 0, 0, 0], dtype=float)
    S1 = np.array([3, 0, 0, 1, 0, 0, 0], dtype=float)
    env_ids = np.array([0, 0, 0, 1, 1, 2, 2])
    nbr_idx = np.array([[1, 2], [2, 5], [1, 6], [4, 1], [5, 2], [6, 1], [5, 2]])
    nbr_w = np.full((7, 2), 0.6)
    mu0, n0 = priors(W, S1, env_ids, nbr_idx, nbr_w, 3, **PRIOR_KW)
    assert mu0[1] == pytest.approx(19 / 30) and mu0[2] == pytest.approx(19 / 30)
    assert mu0[4] == pytest.approx(0.225)
    assert mu0[5] == pytest.approx(0.4) and mu0[6] == pytest.approx(0.4)
    np.testing.assert_allclose(n0[[1, 2, 4, 5, 6]], 2.0)
    # task 3 has neighbour 1 (unobserved) and 4 (unobserved): env 1's mean as well; task 0 likewise in env 0
    assert mu0[3] == pytest.approx(0.225) and mu0[0] == pytest.approx(19 / 30)


@pytest.mark.parametrize("mu_init", [0.5, 0.2])
def test_coldstart_no_data_anywhere_all_scores_equal(mu_init):
    """No data: μ0 = μ_init and n0 = n_base everywhere; v = μ_init(1 − μ_init), Î = v·2/3, U = v/3."""
    sched = make_sched({"shop": 5, "search": 4, "echo": 3}, 3, mu_init=mu_init)
    sc = sched.scores()
    v = mu_init * (1 - mu_init)
    np.testing.assert_allclose(sc["mu0"], mu_init, rtol=1e-15)
    np.testing.assert_allclose(sc["score"], v * 2 / 3 + 0.5 * math.sqrt(v / 3), rtol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Properties 10-11 and the prior against a loop re-implementation


def _random_graph(rng, N, k):
    nbr_idx = np.array([rng.choice([j for j in range(N) if j != i], size=k, replace=False) for i in range(N)])
    return nbr_idx, rng.uniform(0, 1, size=(N, k))


@pytest.mark.parametrize("c", [0.0, 0.37, 1.0])
def test_prior_fixed_point(c):
    rng = np.random.default_rng(7)
    N = 40
    env_ids = rng.integers(0, 3, size=N)
    env_ids[env_ids == 2] = 1  # environment 3 of 4 (id 3) and 2 hold no task; env 1 gets all of 2's tasks
    env_ids[:5] = 3
    W = rng.exponential(3.0, size=N) * (rng.random(N) < 0.6)
    W[:5] = 0.0  # environment 3: tasks but no data
    S1 = c * W
    nbr_idx, nbr_w = _random_graph(rng, N, 6)
    mu0, _ = priors(W, S1, env_ids, nbr_idx, nbr_w, 4, kappa=2.0, mu_init=0.5, n_base=2.0, n_max=4.0)
    np.testing.assert_allclose(mu0, c, atol=1e-12)


@pytest.mark.parametrize(("n_base", "n_max"), [(2.0, 4.0), (1.0, 7.0), (3.0, 3.0)])
def test_prior_strength_bounds_and_reference(n_base, n_max):
    rng = np.random.default_rng(int(n_max * 10))
    for _ in range(20):
        N = int(rng.integers(2, 30))
        k = int(rng.integers(1, min(N, 6)))
        env_ids = rng.integers(0, 3, size=N)
        W = rng.choice([0.0, 0.01, 1.0, 5.0, 1e6], size=N)
        S1 = W * rng.uniform(0, 1, size=N)
        nbr_idx, nbr_w = _random_graph(rng, N, k)
        kw = dict(kappa=2.0, mu_init=0.5, n_base=n_base, n_max=n_max)
        mu0, n0 = priors(W, S1, env_ids, nbr_idx, nbr_w, 3, **kw)
        assert (n0 >= n_base).all() and (n0 <= n_max).all()
        assert ((mu0 >= 0) & (mu0 <= 1)).all()
        mu0_ref, n0_ref = ref_priors(W, S1, env_ids, nbr_idx, nbr_w, 3, **kw)
        np.testing.assert_allclose(mu0, mu0_ref, rtol=1e-10, atol=1e-14)
        np.testing.assert_allclose(n0, n0_ref, rtol=1e-12)


def test_scheduler_scores_match_reference_pipeline():
    """`EnvScheduler.scores()` after random updates against Eq. 5-8 and 12-15 re-implemented here (on its graph)."""
    sched = make_sched({"shop": 5, "search": 4, "terminal": 3}, 3, half_life=6.0)
    rng = np.random.default_rng(9)
    for _ in range(12):
        tasks = sched.draw()
        idx = np.repeat(tasks, 3)
        sched.update(idx.tolist(), rng.uniform(0, 1, size=len(idx)).tolist())
    sc = sched.scores()
    s = sched.settings
    mu0, n0 = ref_priors(sched.W, sched.S1, sched.env_ids, sched.nbr_idx, sched.nbr_w, len(sched.envs), s.kappa,
                         s.mu_init, s.n_base, s.n_max)  # fmt: skip
    info, _, sref = ref_score(sched.W, sched.S1, sched.S2, mu0, n0, s.c_u)
    np.testing.assert_allclose(sc["mu0"], mu0, rtol=1e-12)
    np.testing.assert_allclose(sc["info"], info, rtol=1e-10, atol=1e-15)
    np.testing.assert_allclose(sc["score"], sref, rtol=1e-10)


# ---------------------------------------------------------------------------------------------------------------------
# Property 12: the kNN graph


@pytest.mark.parametrize("with_emb", [True, False])
def test_knn_graph_brute_force_and_determinism(with_emb):
    rng = np.random.default_rng(4)
    descs, env_ids, emb = _random_pool(rng, 30, 3)
    emb = emb if with_emb else None
    a_emb = ALPHAS[3] if with_emb else 0.0
    env_sim = environment_similarity(descs, ALPHAS, with_emb)
    full = ref_similarity_matrix(descs, env_ids, emb, ALPHAS)
    k = 5
    idx, w = knn_graph(env_sim, env_ids, emb, a_emb, k, seed=0)
    idx2, w2 = knn_graph(env_sim, env_ids, emb, a_emb, k, seed=0)
    idx3, w3 = knn_graph(env_sim, env_ids, emb, a_emb, k, seed=0, block=7)  # other blocking, same graph
    assert np.array_equal(idx, idx2) and np.array_equal(w, w2)
    assert np.array_equal(idx, idx3) and np.array_equal(w, w3)
    idx_s, w_s = knn_graph(env_sim, env_ids, emb, a_emb, k, seed=99)
    for t in range(30):
        others = np.array([j for j in range(30) if j != t])
        top = np.sort(full[t, others])[::-1][:k]
        assert t not in idx[t] and len(set(idx[t].tolist())) == k
        np.testing.assert_allclose(w[t], top, atol=1e-12)  # the k largest weights, in order
        np.testing.assert_allclose(w[t], full[t, idx[t]], atol=1e-12)
        rest = np.setdiff1d(others, idx[t])
        assert full[t, rest].max() <= w[t].min() + 1e-12
        # another seed may only reorder ties: same weights; the same neighbours strictly above the k-th weight
        np.testing.assert_allclose(w_s[t], w[t], atol=1e-12)
        kth = top[-1]
        assert {j for j in idx[t] if full[t, j] > kth + 1e-12} == {j for j in idx_s[t] if full[t, j] > kth + 1e-12}


def test_knn_graph_ties_broken_by_seed_not_index():
    """One environment, no embeddings: every pair has w = 1. Neighbours then depend on the seed and are not simply the
    lowest indices."""
    env_sim = np.ones((1, 1))
    env_ids = np.zeros(40, dtype=np.int64)
    idx0, w0 = knn_graph(env_sim, env_ids, None, 0.0, 4, seed=0)
    idx1, _ = knn_graph(env_sim, env_ids, None, 0.0, 4, seed=1)
    np.testing.assert_allclose(w0, 1.0)
    assert not np.array_equal(np.sort(idx0, axis=1), np.sort(idx1, axis=1))
    lowest = [sorted(j for j in range(40) if j != t)[:4] for t in range(40)]
    assert sum(sorted(idx0[t].tolist()) == lowest[t] for t in range(40)) < 5
    assert np.array_equal(idx0, knn_graph(env_sim, env_ids, None, 0.0, 4, seed=0)[0])


def test_scheduler_graph_rebuilt_identically():
    texts = [f"task number {i} about {w}" for i, w in enumerate(["socks", "files", "cats", "dogs", "maps"] * 3)]
    a = make_sched({"shop": 6, "search": 5, "echo": 4}, 3, texts=texts)
    b = make_sched({"shop": 6, "search": 5, "echo": 4}, 3, texts=texts)
    assert np.array_equal(a.nbr_idx, b.nbr_idx) and np.array_equal(a.nbr_w, b.nbr_w)
    assert a.identity == b.identity


def test_knn_graph_memory_is_a_blocked_matrix_product():
    """Eq. 11: blocks of an embedding matrix product. For N = 300, d = 128 the (300, 300) similarity block is 0.7 MB;
    a (300, 300, 128) fp64 temporary is 92 MB (EnvScheduler: d = 512, block = 512, so 2 MB × N per block)."""
    rng = np.random.default_rng(0)
    N, d = 300, 128
    emb = rng.normal(size=(N, d))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    env_ids = rng.integers(0, 3, size=N)
    env_sim = np.full((3, 3), 0.3) + 0.4 * np.eye(3)
    tracemalloc.start()
    try:
        idx, _ = knn_graph(env_sim, env_ids, emb, 0.3, 10, seed=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert idx.shape == (N, 10)
    assert peak < 20e6  # generous: 25x the (block, N) similarity matrix


# ---------------------------------------------------------------------------------------------------------------------
# Property 13: shape and layout


def test_select_batch_shape_random_configs():
    rng = np.random.default_rng(12)
    for _ in range(150):
        N = int(rng.integers(1, 40))
        B = int(rng.integers(1, N + 1))
        env_ids = rng.integers(0, int(rng.integers(1, 5)), size=N)
        S = rng.uniform(0, 1, size=(N, N))
        S = (S + S.T) / 2
        sel = select_batch(rng.uniform(0, 1, size=N), env_ids, B, rng, quota=int(rng.integers(0, B + 1)),
                           n_explore=int(rng.integers(0, B + 1)), lambda_sim=float(rng.uniform(0, 2)),
                           similarity=matrix_similarity(S), candidates=int(rng.integers(B, N + 1)))  # fmt: skip
        assert len(sel.tasks) == B == len(set(sel.tasks))
        assert all(0 <= t < N for t in sel.tasks)


def test_pool_smaller_than_batch_raises():
    with pytest.raises(ValueError):
        make_sched({"shop": 2, "echo": 1}, 4)
    with pytest.raises(ValueError):
        select_batch(np.zeros(3), np.zeros(3, dtype=np.int64), 4, np.random.default_rng(0), quota=None, n_explore=0,
                     lambda_sim=0.0, similarity=matrix_similarity(np.zeros((3, 3))))  # fmt: skip
    sched = make_sched({"shop": 2, "echo": 2}, 4, rho_max=None)  # N = B: the whole pool every time
    assert sorted(sched.draw()) == [0, 1, 2, 3]


def test_scheduler_draws_are_distinct():
    sched = make_sched({"shop": 10, "search": 8, "terminal": 6, "echo": 4}, 6)
    rng = np.random.default_rng(0)
    for _ in range(25):
        tasks = sched.draw()
        assert len(tasks) == 6 == len(set(tasks)) and all(0 <= t < 28 for t in tasks)
        idx = np.repeat(tasks, 2)
        sched.update(idx.tolist(), rng.integers(0, 2, size=len(idx)).astype(float).tolist())


@pytest.mark.parametrize(("B", "G", "repeat", "blocks"), [(3, 2, 2, 3), (4, 1, 3, 2), (2, 5, 1, 4)])
def test_sampler_layout(B, G, repeat, blocks):
    sched = make_sched({"shop": 5, "search": 4, "echo": 3}, B)
    sampler = SchedulerSampler(sched, num_generations=G, repeat=repeat, blocks=blocks)
    assert len(sampler) == blocks * B * G * repeat
    ids = list(sampler)
    assert len(ids) == len(sampler)
    size = B * G * repeat
    assert len(sched.pending) == blocks  # one draw per block, none updated yet
    for b in range(blocks):
        block = ids[b * size : (b + 1) * size]
        one = block[: B * G]
        assert block == one * repeat
        tasks = one[::G]
        assert one == [t for t in tasks for _ in range(G)]
        assert len(set(tasks)) == B
        assert tasks == sched.pending[b]


# ---------------------------------------------------------------------------------------------------------------------
# Property 14: quotas


def test_quota_feasible_never_exceeded():
    rng = np.random.default_rng(21)
    env_ids = np.repeat(np.arange(4), 10)
    S = rng.uniform(0, 0.9, size=(40, 40))
    S = (S + S.T) / 2
    for trial in range(200):
        s = rng.uniform(0, 1, size=40)
        if trial % 2:
            s[env_ids == 0] += 5.0  # environment 0 dominates the scores: its quota binds
        sel = select_batch(s, env_ids, 8, rng, quota=2, n_explore=trial % 4, lambda_sim=[0.0, 0.5][trial % 3 == 0],
                           similarity=matrix_similarity(S))  # fmt: skip
        counts = np.bincount(env_ids[sel.tasks], minlength=4)
        assert counts.max() <= 2 and sel.quota_violations == 0
        if trial % 2:
            assert counts[0] == 2


@pytest.mark.parametrize(
    ("sizes", "B", "quota"),
    [((20, 2), 8, 2), ((1, 1, 30), 10, 3), ((3, 3, 3), 9, 2), ((5,), 4, 1), ((4, 4), 6, 0)],
)
def test_quota_infeasible_fills_batch_and_counts_excess(sizes, B, quota):
    """Feasible capacity Σ_e min(q, |e|); the excess B − capacity must be picked above quota, each pick counted."""
    env_ids = np.concatenate([np.full(n, e) for e, n in enumerate(sizes)])
    N = len(env_ids)
    expected = B - sum(min(quota, n) for n in sizes)
    assert expected > 0
    rng = np.random.default_rng(sum(sizes))
    for n_explore in (0, 1):
        sel = select_batch(rng.uniform(0, 1, size=N), env_ids, B, rng, quota=quota, n_explore=n_explore,
                           lambda_sim=0.1, similarity=matrix_similarity(np.zeros((N, N))))  # fmt: skip
        assert len(set(sel.tasks)) == B
        counts = np.bincount(env_ids[sel.tasks], minlength=len(sizes))
        assert sel.quota_violations == expected == sum(max(0, c - quota) for c in counts)


def test_scheduler_quota_hand_values():
    """B = 10, ρ = 0.25: q = ⌈2.5⌉ = 3. shop's tasks have balanced histories (high scores), the rest always fail, so
    shop fills exactly its quota; a pool with only 2 non-shop tasks and B = 8 (q = 2) needs 8 − 2 − 2 = 4
    violations."""
    sched = make_sched({"shop": 8, "search": 8, "terminal": 8, "echo": 8}, 10, explore=0.0)
    for _ in range(5):
        sched.update(list(range(8)) * 2, [1.0] * 8 + [0.0] * 8)
        sched.update(list(range(8, 32)) * 2, [0.0] * 48)
    for _ in range(5):
        tasks = sched.draw()
        counts = np.bincount(sched.env_ids[tasks], minlength=4)
        assert counts.max() == 3 and sched.last["quota_violations"] == 0
        assert counts[sched.envs.index("shop")] == 3
    small = make_sched({"shop": 12, "echo": 2}, 8)
    for _ in range(3):
        tasks = small.draw()
        assert len(set(tasks)) == 8 and small.last["quota_violations"] == 4
        assert np.bincount(small.env_ids[tasks], minlength=2)[small.envs.index("echo")] == 2


# ---------------------------------------------------------------------------------------------------------------------
# Property 15: reductions


def test_reduction_to_top_b_distinct_scores():
    rng = np.random.default_rng(31)
    for _ in range(100):
        N = int(rng.integers(2, 60))
        B = int(rng.integers(1, N + 1))
        s = rng.permutation(N) / N + 0.01 * rng.random()  # distinct
        S = rng.uniform(0, 1, size=(N, N))
        sel = select_batch(s, rng.integers(0, 3, size=N), B, rng, quota=None, n_explore=0, lambda_sim=0.0,
                           similarity=matrix_similarity(S), candidates=int(rng.integers(B, N + 1)))  # fmt: skip
        assert sel.tasks == sorted(range(N), key=lambda i: -s[i])[:B]
        assert sel.explored == 0 and sel.quota_violations == 0


def test_reduction_with_ties_takes_the_top_levels():
    """Scores on a coarse grid (many ties): every task strictly above the B-th largest score is selected, the rest
    come from the tied boundary level."""
    rng = np.random.default_rng(32)
    for _ in range(100):
        N = int(rng.integers(5, 40))
        B = int(rng.integers(1, N))
        s = rng.integers(0, 4, size=N) / 4.0
        sel = select_batch(s, np.zeros(N, dtype=np.int64), B, rng, quota=None, n_explore=0, lambda_sim=0.0,
                           similarity=matrix_similarity(np.ones((N, N))))  # fmt: skip
        boundary = np.sort(s)[::-1][B - 1]
        assert {i for i in range(N) if s[i] > boundary} <= set(sel.tasks)
        assert all(s[i] >= boundary for i in sel.tasks)
        assert list(s[sel.tasks]) == sorted(s[sel.tasks], reverse=True)


def test_scheduler_reduction_to_top_b():
    """λ_sim = 0, no quota, ε = 0: each draw is the top B of the reference scores (distinct after continuous
    updates)."""
    sched = make_sched({"shop": 6, "search": 6, "terminal": 6}, 4, lambda_sim=0.0, rho_max=None, explore=0.0,
                       half_life=8.0)  # fmt: skip
    rng = np.random.default_rng(41)
    sched.update(list(range(18)) * 2, rng.uniform(0, 1, size=36).tolist())
    st = sched.settings
    eta = sched.eta
    for _ in range(15):
        f = eta ** (sched.t - sched.t_last).astype(float)
        W, S1, S2 = sched.W * f, sched.S1 * f, sched.S2 * f
        mu0, n0 = ref_priors(W, S1, sched.env_ids, sched.nbr_idx, sched.nbr_w, 3, st.kappa, st.mu_init, st.n_base,
                             st.n_max)  # fmt: skip
        s = ref_score(W, S1, S2, mu0, n0, st.c_u)[2]
        assert len(set(np.round(s, 9))) == 18
        tasks = sched.draw()
        assert tasks == sorted(range(18), key=lambda i: -s[i])[:4]
        idx = np.repeat(tasks, 3)
        sched.update(idx.tolist(), rng.uniform(0, 1, size=len(idx)).tolist())


def test_greedy_matches_reference_with_quota_penalty_and_candidates():
    """Eq. 18 with quotas, a small candidate set (forcing the widening step) and relaxation, against `ref_greedy`."""
    rng = np.random.default_rng(51)
    for trial in range(120):
        N = int(rng.integers(4, 30))
        B = int(rng.integers(1, N + 1))
        env_ids = rng.integers(0, int(rng.integers(1, 5)), size=N)
        S = rng.uniform(0, 1, size=(N, N))
        S = (S + S.T) / 2
        s = rng.uniform(0, 1, size=N)
        quota = None if trial % 4 == 0 else int(rng.integers(1, B + 1))
        M = int(rng.integers(B, N + 1))
        lam = float(rng.uniform(0, 1))
        sel = select_batch(s, env_ids, B, rng, quota=quota, n_explore=0, lambda_sim=lam,
                           similarity=matrix_similarity(S), candidates=M)  # fmt: skip
        exp_tasks, exp_viol = ref_greedy(s, env_ids, B, quota, lam, S, M)
        assert sel.tasks == exp_tasks
        assert sel.quota_violations == exp_viol
        exp_pen = [lam * (max(S[t, j] for j in exp_tasks[:p]) if p else 0.0) for p, t in enumerate(exp_tasks)]
        np.testing.assert_allclose(sel.penalties, exp_pen, atol=1e-12)


# ---------------------------------------------------------------------------------------------------------------------
# Property 16: similarity penalty


def test_large_lambda_never_selects_duplicates_while_alternatives_remain():
    rng = np.random.default_rng(61)
    for _ in range(60):
        N = int(rng.integers(6, 30))
        clusters = rng.integers(0, int(rng.integers(2, N)), size=N)
        S = rng.uniform(0, 0.9, size=(N, N))
        S = (S + S.T) / 2
        S[clusters[:, None] == clusters[None, :]] = 1.0  # w = 1 within a cluster
        B = int(rng.integers(1, N + 1))
        s = rng.uniform(0, 1, size=N)
        sel = select_batch(s, rng.integers(0, 3, size=N), B, rng, quota=None, n_explore=0, lambda_sim=100.0,
                           similarity=matrix_similarity(S))  # fmt: skip
        for p, t in enumerate(sel.tasks):
            chosen = sel.tasks[:p]
            if not chosen:
                continue
            alternatives = [j for j in range(N) if j not in chosen and max(S[j, c] for c in chosen) < 1]
            if alternatives:
                assert max(S[t, c] for c in chosen) < 1
        n_clusters = len(set(clusters.tolist()))
        assert len(set(clusters[sel.tasks].tolist())) == min(B, n_clusters)


def test_large_lambda_with_identical_embeddings():
    """Tasks 2k and 2k+1 share an environment and an embedding (w = 1): with λ = 100 a batch of 4 takes one of each
    pair, although the pairs' scores are 1.0, 0.99, 0.98, ... (top-4 by score would be two pairs)."""
    rng = np.random.default_rng(62)
    N = 8
    env_ids = np.array([0, 0, 1, 1, 0, 0, 1, 1])
    base = rng.normal(size=(4, 5))
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    emb = np.repeat(base, 2, axis=0)
    env_sim = environment_similarity([DESC["shop"], DESC["search"]], ALPHAS, True)

    def sim(i, js):
        return pair_similarity(env_sim, env_ids, emb, ALPHAS[3], np.full(len(js), i), np.asarray(js))

    assert sim(0, [1])[0] == pytest.approx(1.0)
    s = 1.0 - 0.01 * np.arange(N)
    sel = select_batch(s, env_ids, 4, rng, quota=None, n_explore=0, lambda_sim=100.0, similarity=sim)
    assert sorted(t // 2 for t in sel.tasks) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------------------------------
# Property 17: exploration


def test_exploration_count_and_uniformity():
    """n_x = 2 explored per batch; over T batches each task's explored count is Binomial-like with mean 2T/N. The
    Pearson statistic is ~χ²(N−1) (slightly less spread without replacement); bound: df + 8·√(2·df). Scores are
    heavily skewed, so a score-driven exploration would fail."""
    N, B, T, nx = 20, 5, 3000, 2
    s = np.linspace(1.0, 0.0, N) ** 4
    rng = np.random.default_rng(71)
    counts = np.zeros(N)
    for _ in range(T):
        sel = select_batch(s, np.arange(N) % 4, B, rng, quota=None, n_explore=nx, lambda_sim=0.1,
                           similarity=matrix_similarity(np.zeros((N, N))))  # fmt: skip
        assert sel.explored == nx and len(set(sel.tasks)) == B
        np.add.at(counts, sel.tasks[:nx], 1)
    expected = T * nx / N
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    df = N - 1
    assert chi2 < df + 8 * math.sqrt(2 * df)
    # the greedy part is not uniform: the top-scored task is in (almost) every batch
    assert counts.sum() == T * nx


def test_exploration_respects_quotas():
    """Three environments of 4 tasks, quota 1, n_x = 3: the explored tasks come from three different environments."""
    rng = np.random.default_rng(72)
    env_ids = np.repeat(np.arange(3), 4)
    for _ in range(200):
        sel = select_batch(rng.uniform(size=12), env_ids, 3, rng, quota=1, n_explore=3, lambda_sim=0.0,
                           similarity=matrix_similarity(np.zeros((12, 12))))  # fmt: skip
        assert sel.explored == 3 and sorted(env_ids[sel.tasks].tolist()) == [0, 1, 2]
        assert sel.quota_violations == 0


@pytest.mark.parametrize(("B", "n_x"), [(4, 0), (5, 1), (10, 1), (15, 2), (25, 3), (35, 4)])
def test_scheduler_exploration_count_rounds_halves_up(B, n_x):
    """Eq. 17 with ε = 0.1: 0.4 → 0, 0.5 → 1, 1.0 → 1, 1.5 → 2, 2.5 → 3, 3.5 → 4."""
    sched = make_sched({"shop": 12, "search": 12, "terminal": 12, "echo": 12}, B)
    sched.draw()
    assert sched.last["explore_count"] == n_x


# ---------------------------------------------------------------------------------------------------------------------
# Property 18: tie-break


def test_tie_break_uncorrelated_with_index():
    """All scores equal, no exploration: the greedy order comes from the seeded permutation. A uniformly random
    B-subset of 0..N−1 has mean index (N−1)/2 with per-draw variance (N²−1)/12/B·(N−B)/(N−1); bound 6 σ/√T."""
    N, B, T = 40, 5, 2000
    rng = np.random.default_rng(81)
    means, firsts = [], []
    for _ in range(T):
        sel = select_batch(np.full(N, 0.3), np.zeros(N, dtype=np.int64), B, rng, quota=None, n_explore=0,
                           lambda_sim=0.0, similarity=matrix_similarity(np.zeros((N, N))))  # fmt: skip
        means.append(np.mean(sel.tasks))
        firsts.append(sel.tasks[0])
    sd = math.sqrt((N * N - 1) / 12 / B * (N - B) / (N - 1) / T)
    assert abs(np.mean(means) - (N - 1) / 2) < 6 * sd
    sd_first = math.sqrt((N * N - 1) / 12 / T)
    assert abs(np.mean(firsts) - (N - 1) / 2) < 6 * sd_first
    p0 = np.mean(np.array(firsts) == 0)  # Binomial(T, 1/N)/T
    assert abs(p0 - 1 / N) < 6 * math.sqrt(1 / N * (1 - 1 / N) / T)
    assert len(set(firsts)) == N


def test_tie_break_applies_to_the_candidate_set():
    """All scores equal and a candidate set of 2B < N: the top-M cut is tie-broken by the permutation as well, so over
    many draws every task is selected and the mean index is (N−1)/2 (6 σ)."""
    N, B, T = 60, 3, 1500
    rng = np.random.default_rng(82)
    seen, means = set(), []
    for _ in range(T):
        sel = select_batch(np.full(N, 0.1), np.zeros(N, dtype=np.int64), B, rng, quota=None, n_explore=0,
                           lambda_sim=0.1, similarity=matrix_similarity(np.ones((N, N))),
                           candidates=2 * B)  # fmt: skip
        seen.update(sel.tasks)
        means.append(np.mean(sel.tasks))
    assert seen == set(range(N))
    sd = math.sqrt((N * N - 1) / 12 / B * (N - B) / (N - 1) / T)
    assert abs(np.mean(means) - (N - 1) / 2) < 6 * sd


def test_scheduler_cold_start_selection_uncorrelated_with_index():
    """No data: every score is equal (property 9). One environment, no quota, no exploration: 400 draws of 4 from 32
    must have mean index near 15.5 (6 σ)."""
    N, B, T = 32, 4, 400
    sched = make_sched({"shop": N}, B, rho_max=None, explore=0.0)
    means = [np.mean(sched.draw()) for _ in range(T)]
    sd = math.sqrt((N * N - 1) / 12 / B * (N - B) / (N - 1) / T)
    assert abs(np.mean(means) - (N - 1) / 2) < 6 * sd


# ---------------------------------------------------------------------------------------------------------------------
# Property 19: invalid rollouts


def _history(sched, steps=6, seed=0):
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        tasks = sched.draw()
        idx = np.repeat(tasks, 2)
        sched.update(idx.tolist(), rng.integers(0, 2, size=len(idx)).astype(float).tolist())


def test_invalid_rollouts_change_nothing():
    sizes = {"shop": 6, "search": 5, "echo": 4}
    a, b = make_sched(sizes, 3, half_life=4.0), make_sched(sizes, 3, half_life=4.0)
    _history(a)
    _history(b)
    for step in range(6):
        ta, tb = a.draw(), b.draw()
        assert ta == tb
        idx = np.repeat(ta, 4)
        r = np.tile([1.0, 0.0, 0.7, 0.2], len(ta))
        valid = np.tile([True, False, True, False], len(ta))
        r_bad = r.copy()
        r_bad[~valid] = np.resize([np.nan, 5.0, -3.0, 0.5], int((~valid).sum()))
        if step % 2:  # mixed batch: invalid rows (with garbage rewards) next to valid ones
            a.update(idx.tolist(), r_bad.tolist(), valid.tolist())
            b.update(idx[valid].tolist(), r[valid].tolist())
        else:  # an all-invalid batch equals an empty one
            a.update(idx.tolist(), [math.nan] * len(idx), [False] * len(idx))
            b.update([], [])
        for name in ("W", "S1", "S2", "t_last"):
            assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert a.invalid == 3 * 6 + 3 * 12 and b.invalid == 0
    assert a.draw() == b.draw()


def test_all_invalid_update_leaves_statistics_at_their_decayed_values():
    sched = make_sched({"shop": 4, "terminal": 4}, 2, half_life=3.0)
    _history(sched, steps=4)
    sched.draw()
    sched.scores()  # decay to the current step
    before = [sched.W.copy(), sched.S1.copy(), sched.S2.copy()]
    sched.update([0, 1, 2, 3], [1.0, 0.0, 1.0, 0.5], [False] * 4)
    for x, y in zip(before, [sched.W, sched.S1, sched.S2], strict=True):
        assert np.array_equal(x, y)


# ---------------------------------------------------------------------------------------------------------------------
# Property 21: resume


def _rollouts(tasks, step, G):
    """Deterministic per-task pass probabilities, an invalid row now and then."""
    rng = np.random.default_rng([17, step])
    idx = np.repeat(tasks, G)
    p = ((idx * 37) % 11) / 10.0
    r = (rng.random(len(idx)) < p).astype(float)
    valid = rng.random(len(idx)) > 0.05
    return idx.tolist(), r.tolist(), valid.tolist()


@pytest.mark.parametrize(("k", "texts"), [(3, False), (5, True)])
def test_resume_matches_uninterrupted_run(k, texts):
    sizes = {"shop": 7, "search": 6, "terminal": 5, "echo": 4}
    words = ["socks", "laptop", "files", "grep", "echo", "cat", "maps", "news"]
    tx = [f"{words[i % 8]} task {i // 3}" for i in range(22)] if texts else None
    B, G, repeat = 4, 2, 2

    def fresh():
        return make_sched(sizes, B, seed=5, texts=tx, half_life=6.0)

    # uninterrupted: 2k + 1 draw/update cycles
    ref = fresh()
    ref_draws = []
    for step in range(2 * k + 1):
        tasks = ref.draw()
        ref_draws.append(list(tasks))
        ref.update(*_rollouts(tasks, step, G))
    # interrupted: k cycles, one more draw left pending, save through JSON, restore into a fresh scheduler
    first = fresh()
    for step in range(k):
        tasks = first.draw()
        assert tasks == ref_draws[step]
        first.update(*_rollouts(tasks, step, G))
    pending = list(first.draw())
    state = json.loads(json.dumps(first.state_dict()))
    assert state["pending"] == [pending]
    resumed = fresh()
    resumed.load_state_dict(state)
    sampler = SchedulerSampler(resumed, num_generations=G, repeat=repeat, blocks=k + 1)
    it = iter(sampler)
    got = []
    for step in range(k, 2 * k + 1):
        block = [next(it) for _ in range(B * G * repeat)]
        one = block[: B * G]
        assert block == one * repeat and one == [t for t in one[::G] for _ in range(G)]
        tasks = one[::G]
        got.append(tasks)
        resumed.update(*_rollouts(tasks, step, G))
    assert got[0] == pending  # the pending block is served first
    assert got == ref_draws[k:]
    for name in ("W", "S1", "S2", "t_last", "n_sel", "t_sel"):
        assert np.array_equal(getattr(resumed, name), getattr(ref, name)), name
    assert resumed.t == ref.t and resumed.pending == ref.pending == []
    assert resumed.rng.bit_generator.state == ref.rng.bit_generator.state


def test_load_state_dict_rejects_another_pool_or_settings():
    sizes = {"shop": 4, "search": 4}
    src = make_sched(sizes, 2)
    _history(src, steps=2)
    state = json.loads(json.dumps(src.state_dict()))
    with pytest.raises(ValueError):
        make_sched({"shop": 4, "search": 5}, 2).load_state_dict(state)
    with pytest.raises(ValueError):
        make_sched(sizes, 2, task_ids=[f"other-{i}" for i in range(8)]).load_state_dict(state)
    with pytest.raises(ValueError):
        make_sched({"shop": 4, "terminal": 4}, 2).load_state_dict(state)
    with pytest.raises(ValueError):
        make_sched(sizes, 2, lambda_sim=0.5).load_state_dict(state)
    make_sched(sizes, 2).load_state_dict(state)  # the same pool and settings load


def test_restored_pending_draws_are_served_once():
    """After a load, the first sampler pass serves the pending draw, and only that pass: a second pass (a new epoch of
    the loader) draws anew instead of replaying it again."""
    a = make_sched({"shop": 6, "search": 6}, B=4, seed=5)
    pending = a.draw()
    b = make_sched({"shop": 6, "search": 6}, B=4, seed=5)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    sampler = SchedulerSampler(b, num_generations=1, repeat=1, blocks=1)
    assert list(sampler) == pending
    again = list(sampler)
    assert again == b.pending[-1] and b.t == a.t + 1  # a fresh draw, not the replayed one
