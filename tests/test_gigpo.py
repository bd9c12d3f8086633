"""GiGPO (gigpo.md): anchor keys and groups, discounted step returns, the step advantage and its token broadcast
(Eq. 1-9) on hand-computed cases and on seeded random batches checked against a plain-Python re-implementation of the
equations; the keys the agent loop records (D1, §7 item 15); GiGPOTrainer's advantage hook on hand-built batches
(D4, D11, D12); GiGPOConfig validation. One test per property of gigpo.md §7, at least."""

from __future__ import annotations

import difflib
import logging
import math
import random
import statistics
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_ARGS, WORDS, EchoEnv
from datasets import Dataset

import trainers.gigpo as gigpo_module
from envs.base import Env, ProtocolEnv, state_key_of
from trainers import agent_loop
from trainers.agent_loop import play
from trainers.base import RolloutBatch
from trainers.credit import credit_metrics
from trainers.gigpo import (
    GiGPOConfig,
    GiGPOTrainer,
    anchor_groups,
    anchor_key,
    discounted_returns,
    gigpo_advantages,
    gigpo_metrics,
    gigpo_step_level,
    similarity,
    step_rewards,
)

EPS = 1e-4  # gigpo.md D6, TRL's epsilon

# ---------------------------------------------------------------------------------------------------------------------
# Building cases, and the equations re-implemented in plain Python (the reference the code is checked against)


def norm(key):
    return None if key is None else " ".join(str(key).split())


def tensors(rows: list[dict]) -> dict:
    """Tensors of a case. Each row: `keys` (one per turn, its length is K_i), `R` (the trained reward), optional
    `r` (per-turn environment rewards, default 0), `n` (loss tokens per turn, default 2), `g` (task group, default 0).
    Tokens: each turn's n_j tokens, then 2 environment tokens (-1), then -1 padding to the longest row."""
    K = max(1, max(len(row["keys"]) for row in rows))
    index = []
    for row in rows:
        ids = []
        for j, n in enumerate(row.get("n", [2] * len(row["keys"]))):
            ids += [j] * n + [-1, -1]
        index.append(ids)
    T = max(1, max(len(ids) for ids in index))
    k_i = [len(row["keys"]) for row in rows]
    pairs, float64 = zip(rows, k_i, strict=True), torch.float64
    r = [list(row.get("r", [0.0] * k)) + [0.0] * (K - k) for row, k in pairs]  # (B, K), 0 on turns a row lacks
    return dict(
        turn_index=torch.tensor([ids + [-1] * (T - len(ids)) for ids in index]),
        turn_valid=torch.tensor([[j < k for j in range(K)] for k in k_i]),
        turn_rewards=torch.tensor(r, dtype=float64),
        rewards=torch.tensor([float(row["R"]) for row in rows], dtype=float64),
        keys=[list(row["keys"]) for row in rows],
        group_ids=[row.get("g", 0) for row in rows],
    )


def step_level(case: dict, gamma: float = 0.95, scale: bool = True, eta: float | None = None):
    return gigpo_step_level(
        case["turn_valid"], case["turn_rewards"], case["rewards"], case["keys"], case["group_ids"], gamma, scale, eta
    )


def advantages(case: dict, adv: torch.Tensor, omega=1.0, gamma=0.95, scale=True, eta=None):
    c = case
    tensors_in = (c["turn_index"], c["turn_valid"], c["turn_rewards"], c["rewards"], c["keys"], c["group_ids"])
    return gigpo_advantages(adv, *tensors_in, omega, gamma, scale, eta)


def ref_returns(row: dict, gamma: float) -> list[float]:
    """Eq. 1 + D8 (the part of R the per-turn rewards leave unexplained goes on the last turn), then Eq. 4 as a sum."""
    K = len(row["keys"])
    r = list(row.get("r", [0.0] * K))
    r[-1] += row["R"] - sum(r)
    return [sum(gamma ** (k - j) * r[k] for k in range(j, K)) for j in range(K)]


def ref_anchor_members(rows: list[dict]) -> dict:
    """Eq. 3: (task group, normalised key) -> [(i, j)], None keys left out (they are singletons, D12)."""
    members = defaultdict(list)
    for i, row in enumerate(rows):
        for j, key in enumerate(row["keys"]):
            if norm(key) is not None:
                members[(row.get("g", 0), norm(key))].append((i, j))
    return members


def ref_step_adv(rows: list[dict], gamma: float, scale: bool) -> list[list[float]]:
    """Eq. 5 with statistics.mean / statistics.stdev (Bessel) per anchor group; singletons give 0."""
    R = [ref_returns(row, gamma) for row in rows]
    out = [[0.0] * len(row["keys"]) for row in rows]
    for steps in ref_anchor_members(rows).values():
        values = [R[i][j] for i, j in steps]
        if len(values) < 2:
            continue
        mu = statistics.mean(values)
        f = statistics.stdev(values) + EPS if scale else 1.0
        for (i, j), v in zip(steps, values, strict=True):
            out[i][j] = (v - mu) / f
    return out


def ref_episode_adv(rows: list[dict], scale: bool) -> list[float]:
    """Eq. 2 (TRL's group advantage) over each task group's episode rewards."""
    by_group = defaultdict(list)
    for row in rows:
        by_group[row.get("g", 0)].append(row["R"])
    out = []
    for row in rows:
        values = by_group[row.get("g", 0)]
        f = statistics.stdev(values) + EPS if scale else 1.0
        out.append((row["R"] - statistics.mean(values)) / f)
    return out


def check_tokens(out: torch.Tensor, case: dict, expected: list[list[float]], atol: float = 1e-12) -> None:
    """Every loss token of turn j of row i holds expected[i][j]; every other token holds 0 (Eq. 7)."""
    for i, row_ids in enumerate(case["turn_index"].tolist()):
        for t, j in enumerate(row_ids):
            want = 0.0 if j < 0 else expected[i][j]
            assert abs(float(out[i, t]) - want) <= atol, (i, t, j, float(out[i, t]), want)


def grpo_broadcast(adv: torch.Tensor, turn_index: torch.Tensor) -> torch.Tensor:
    return adv.unsqueeze(1) * (turn_index >= 0)


POOL = ["hall", " hall ", "hall\n", "kitchen", "door  open", "door open", "\tdoor open", "attic"]


def random_rows(rng: random.Random, groups: int = 3, G: int = 5, missing: float = 0.1) -> list[dict]:
    """Task groups of G rows; K_i in 1..4; keys from a small pool with whitespace variants (so anchors recur, also
    within one rollout), some None; dense per-turn rewards and a trained reward that they only partly explain."""
    rows = []
    for g in range(groups):
        first = rng.choice(POOL)
        for _ in range(G):
            K = rng.randint(1, 4)
            keys = [first] + [None if rng.random() < missing else rng.choice(POOL) for _ in range(K - 1)]
            r = [rng.choice([0.0, 0.0, 0.25, 1.0]) for _ in range(K)]
            rows.append(dict(keys=keys, r=r, R=sum(r) + rng.choice([0.0, 0.5, 2.0]), n=[rng.randint(1, 4)] * K, g=g))
    return rows


# ---------------------------------------------------------------------------------------------------------------------
# §7 items 1-4: GRPO limits, zero sum, unit std, singletons


@pytest.mark.parametrize("scale", [True, False])
def test_no_shared_states_is_grpo_exactly(scale):
    """gigpo.md §7 item 1: with every key distinct (no anchor group of size >= 2), the output is the GRPO broadcast
    A^E on the loss tokens, bit for bit, and A^S is 0 everywhere."""
    rng = random.Random(1)
    rows = random_rows(rng, missing=0.0)
    for i, row in enumerate(rows):
        row["keys"] = [f"state {i}.{j}" for j in range(len(row["keys"]))]
    case = tensors(rows)
    adv = torch.tensor(ref_episode_adv(rows, scale), dtype=torch.float32)
    out, stats = advantages(case, adv, scale=scale)
    assert torch.equal(out.advantages, grpo_broadcast(adv, case["turn_index"]))
    assert (stats.step_adv == 0).all()


def test_omega_zero_is_grpo_exactly():
    """gigpo.md §7 item 2: ω = 0 gives the GRPO broadcast exactly, although A^S is non-zero here."""
    rows = random_rows(random.Random(2))
    case = tensors(rows)
    adv = torch.tensor(ref_episode_adv(rows, True), dtype=torch.float32)
    out, stats = advantages(case, adv, omega=0.0)
    assert (stats.step_adv != 0).any()  # the step level has something to say, and ω = 0 silences it
    assert torch.equal(out.advantages, grpo_broadcast(adv, case["turn_index"]))


@pytest.mark.parametrize("scale", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_step_advantage_matches_the_equations_zero_sum_and_unit_std(scale, seed):
    """gigpo.md §7 item 3 (and Eq. 1-7 on random batches): A^S equals the plain-Python Eq. 5; inside every anchor
    group Σ A^S = 0 (relative 1e-9) in both modes; in std mode the Bessel std of A^S in a non-constant group of size
    >= 2 is σ/(σ + 1e-4) ≈ 1; the tokens hold A^E + ω·A^S (ω = 0.7 here)."""
    rows = random_rows(random.Random(10 + seed))
    case = tensors(rows)
    gamma, omega = 0.9, 0.7
    a_e = ref_episode_adv(rows, scale)
    out, stats = advantages(case, torch.tensor(a_e, dtype=torch.float64), omega=omega, gamma=gamma, scale=scale)
    want = ref_step_adv(rows, gamma, scale)
    for i, row in enumerate(want):
        for j, value in enumerate(row):
            assert abs(float(stats.step_adv[i, j]) - value) <= 1e-12
    check_tokens(out.advantages, case, [[a_e[i] + omega * s for s in row] for i, row in enumerate(want)], 1e-12)
    R = [ref_returns(row, gamma) for row in rows]
    checked = 0
    for steps in ref_anchor_members(rows).values():
        a_s = [float(stats.step_adv[i, j]) for i, j in steps]
        assert abs(sum(a_s)) <= 1e-9 * max(1e-300, sum(abs(a) for a in a_s)) or all(a == 0 for a in a_s)
        sigma = statistics.stdev([R[i][j] for i, j in steps]) if len(steps) >= 2 else 0.0
        if scale and sigma > 0:
            assert statistics.stdev(a_s) == pytest.approx(sigma / (sigma + EPS), rel=1e-9)
            assert statistics.stdev(a_s) == pytest.approx(1.0, abs=1e-4 / sigma)
            checked += 1
    assert checked or not scale  # the random batch has non-constant anchor groups to check


@pytest.mark.parametrize("scale", [True, False])
def test_singleton_and_constant_groups_give_zero(scale):
    """gigpo.md §7 item 4: a singleton group and a group whose returns are all equal give A^S = 0, beside a
    non-constant group that does not."""
    # γ = 0.5, terminal rewards R = 1, 1, 0 on the last of two turns:
    #   returns row 0: [0.5, 1], row 1: [0.5, 1], row 2: [0, 0]
    #   "s": (0.5, 0.5, 0), mean 1/3, centred (1/6, 1/6, -1/3); Bessel std = sqrt((1/36 + 1/36 + 1/9) / 2) = sqrt(1/12)
    #   "c": (1, 1) constant -> 0; "x": singleton -> 0
    rows = [dict(keys=["s", "c"], R=1), dict(keys=["s", "c"], R=1), dict(keys=["s", "x"], R=0)]
    stats = step_level(tensors(rows), gamma=0.5, scale=scale)
    f = math.sqrt(1 / 12) + EPS if scale else 1.0
    assert stats.step_adv[:, 0].tolist() == pytest.approx([1 / 6 / f, 1 / 6 / f, -1 / 3 / f], abs=1e-12)
    assert stats.step_adv[:, 1].tolist() == [0.0, 0.0, 0.0]


# ---------------------------------------------------------------------------------------------------------------------
# §7 items 5-9: no conservation, sign flips, length independence, zero-variance groups, discounting


def test_token_sum_is_not_conserved_and_residual_is_not_applicable():
    """gigpo.md §7 item 5: the per-row token sum need not equal A·N, and the additive form reports
    `credit/conservation_residual_max` as 0 (not applicable)."""
    # γ = 0.5, scale off. Row 0: keys (s, t), R = 1, n = (1, 3) -> returns (0.5, 1); row 1: key s, R = 1, n = (2,)
    # -> return 1. "s": (0.5, 1), mean 0.75 -> A^S = -0.25 (row 0), +0.25 (row 1); "t" singleton -> 0.
    # A^E is an input (TRL's value); take (0.5, -0.5). Tokens: row 0 turn 0: 0.5 - 0.25 = 0.25 (1 token), turn 1: 0.5
    # (3 tokens): sum 1.75 while A·N = 0.5·4 = 2. Row 1: -0.5 + 0.25 = -0.25 (2 tokens): sum -0.5 while A·N = -1.
    case = tensors([dict(keys=["s", "t"], R=1, n=[1, 3]), dict(keys=["s"], R=1, n=[2])])
    adv = torch.tensor([0.5, -0.5], dtype=torch.float64)
    out, _ = advantages(case, adv, gamma=0.5, scale=False)
    check_tokens(out.advantages, case, [[0.25, 0.5], [-0.25]])
    assert out.advantages.sum(dim=1).tolist() == pytest.approx([1.75, -0.5], abs=1e-12)
    N = (case["turn_index"] >= 0).sum(dim=1)
    assert (out.advantages.sum(dim=1) - adv * N).abs().min() >= 0.25  # A·N = (2, -1): not conserved
    metrics = credit_metrics(out, adv, case["turn_index"], case["turn_valid"], form="additive")
    assert metrics["credit/conservation_residual_max"] == 0.0


def test_sign_flip_on_a_worse_step_of_a_good_rollout():
    """gigpo.md §7 item 6: a successful rollout that lingers in state "a" (two wasted actions there) gets a negative
    advantage on its first step from "a", and `gigpo/sign_flip_turn_frac` counts exactly that one step of eight."""
    # γ = 0.5, ω = 1, scale off. Rewards R = (1, 1, 0) -> A^E = R - 2/3 = (1/3, 1/3, -2/3).
    #   row 0 keys (s, a, a, a), success after 4 turns: returns (1/8, 1/4, 1/2, 1)
    #   row 1 keys (s, a), success after 2 turns: returns (1/2, 1)
    #   row 2 keys (s, b), failure: returns (0, 0)
    # "s": (1/8, 1/2, 0), mean 5/24 -> A^S = (-1/12, 7/24, -5/24)
    # "a": (1/4, 1/2, 1 | 1), mean 11/16 -> A^S = (-7/16, -3/16, 5/16 | 5/16); "b" singleton -> 0
    # A = A^E + A^S: row 0 (1/4, -5/48, 7/48, 31/48), row 1 (5/8, 31/48), row 2 (-7/8, -2/3)
    # A^E != 0 on all 8 steps; only row 0 step 2 changes sign -> 1/8.
    rows = [dict(keys=["s", "a", "a", "a"], R=1), dict(keys=["s", "a"], R=1), dict(keys=["s", "b"], R=0)]
    case = tensors(rows)
    adv = torch.tensor([1 / 3, 1 / 3, -2 / 3], dtype=torch.float64)
    out, stats = advantages(case, adv, omega=1.0, gamma=0.5, scale=False)
    want = [[1 / 4, -5 / 48, 7 / 48, 31 / 48], [5 / 8, 31 / 48], [-7 / 8, -2 / 3]]
    check_tokens(out.advantages, case, want)
    assert float(out.advantages[0][case["turn_index"][0] == 1][0]) < 0 < float(adv[0])
    metrics = gigpo_metrics(stats, adv, case["turn_valid"], case["group_ids"], omega=1.0)
    assert metrics["gigpo/sign_flip_turn_frac"] == pytest.approx(1 / 8, abs=1e-12)


def test_per_token_value_does_not_depend_on_step_length():
    """gigpo.md §7 item 7: rescaling the token counts n_j changes nothing per token; each token of step j holds
    A^E + ω·A^S of that step."""
    rows = random_rows(random.Random(7))
    rng = random.Random(8)
    long_rows = [dict(row, n=[rng.randint(1, 30) for _ in row["keys"]]) for row in rows]
    short_rows = [dict(row, n=[1] * len(row["keys"])) for row in rows]
    a_e = ref_episode_adv(rows, True)
    adv = torch.tensor(a_e, dtype=torch.float64)
    want = [[a_e[i] + s for s in row] for i, row in enumerate(ref_step_adv(rows, 0.95, True))]
    per_step = []
    for variant in (long_rows, short_rows):
        case = tensors(variant)
        out, _ = advantages(case, adv)
        check_tokens(out.advantages, case, want, 1e-12)
        per_step.append([[float(out.advantages[i][case["turn_index"][i] == j][0]) for j in range(len(row["keys"]))]
                         for i, row in enumerate(variant)])  # fmt: skip
    assert per_step[0] == per_step[1]


def test_zero_variance_groups():
    """gigpo.md §7 item 8: a task group where every rollout succeeds with different lengths has A^E = 0 but A^S != 0
    at the shared first state (the shortest success ranks highest); a group where every rollout fails with zero
    rewards gives all zeros; `gigpo/zero_var_groups_with_step_signal` counts the first group only (not the all-fail
    group, nor a group with σ(R) > 0 and step signal)."""
    # group 0, γ = 0.5, all R = 1: returns (1), (1/2, 1), (1/4, 1/2, 1). At "s0": (1, 1/2, 1/4), mean 7/12, centred
    # (5/12, -1/12, -4/12), Bessel std = sqrt((25 + 1 + 16) / 144 / 2) = sqrt(7/48). "p", "q", "r" are singletons.
    # group 1: all R = 0 -> every return 0, and "s1" repeats (also within row 3) but is constant.
    # group 2: R = (1, 0), one turn each at "s2": A^E = A^S = ±0.5 / (sqrt(1/2) + 1e-4), so A = ±1 / (sqrt(1/2) + ε).
    rows = [
        dict(keys=["s0"], R=1, g=0),
        dict(keys=["s0", "p"], R=1, g=0),
        dict(keys=["s0", "q", "r"], R=1, g=0),
        dict(keys=["s1", "s1"], R=0, g=1),
        dict(keys=["s1", "u"], R=0, g=1),
        dict(keys=["s1"], R=0, g=1),
        dict(keys=["s2"], R=1, g=2),
        dict(keys=["s2"], R=0, g=2),
    ]
    case = tensors(rows)
    h = 0.5 / (math.sqrt(0.5) + EPS)
    adv = torch.tensor([0.0] * 6 + [h, -h], dtype=torch.float64)  # σ(R) = 0 in groups 0 and 1: TRL's A^E is 0
    out, stats = advantages(case, adv, gamma=0.5, scale=True)
    f = math.sqrt(7 / 48) + EPS
    want = [[5 / 12 / f], [-1 / 12 / f, 0], [-4 / 12 / f, 0, 0], [0, 0], [0, 0], [0], [2 * h], [-2 * h]]
    check_tokens(out.advantages, case, want)
    assert (out.advantages[3:6] == 0).all() and torch.isfinite(out.advantages).all()
    metrics = gigpo_metrics(stats, adv, case["turn_valid"], case["group_ids"], omega=1.0)
    assert metrics["gigpo/zero_var_groups_with_step_signal"] == 1.0


def test_discounted_returns():
    """gigpo.md §7 item 9: a sparse terminal reward gives R_ij = γ^(K_i − j)·r_final (0 on turns a row lacks); γ = 1
    gives every step of a successful rollout the same return; dense rewards follow Eq. 4 as a sum."""
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    sparse = torch.tensor([[0.0, 0.0, 0.0, 2.0], [0.0, 1.0, 0.0, 0.0]])
    want = torch.tensor([[2 * 0.9**3, 2 * 0.9**2, 2 * 0.9, 2.0], [0.9, 1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(discounted_returns(sparse, valid, 0.9), want, rtol=0, atol=1e-12)
    assert discounted_returns(sparse, valid, 1.0).tolist() == [[2.0] * 4, [1.0, 1.0, 0.0, 0.0]]
    # dense, γ = 0.5: r = (1, 0, 2): R_3 = 2, R_2 = 0 + 0.5·2 = 1, R_1 = 1 + 0.5·1 = 1.5
    assert discounted_returns(torch.tensor([[1.0, 0.0, 2.0]]), torch.ones(1, 3, dtype=torch.bool), 0.5).tolist() == [
        [1.5, 1.0, 2.0]
    ]
    # through the step level: a final-only reward lands on the last turn (D8) and is discounted back
    stats = step_level(tensors([dict(keys=["a", "b", "c"], R=3.0), dict(keys=["a"], R=0.0)]), gamma=0.9)
    assert stats.returns[0].tolist() == pytest.approx([3 * 0.81, 3 * 0.9, 3.0], abs=1e-12)
    stats = step_level(tensors([dict(keys=["a", "b", "c"], R=3.0), dict(keys=["a"], R=0.0)]), gamma=1.0)
    assert stats.returns[0].tolist() == [3.0, 3.0, 3.0]


def test_step_rewards_put_the_unexplained_reward_on_the_last_turn():
    """gigpo.md Eq. 1 and D8: Σ_j r_ij = R(τ_i); the per-turn rewards stay, the part of R they leave unexplained goes
    on the row's last valid turn; a row with a non-finite reward is all NaN."""
    turn_rewards = torch.tensor([[0.2, 0.3, 0.0], [0, 0, 0], [1.0, 1.0, 0], [0.5, 0, 0]], dtype=torch.float64)
    valid = torch.tensor([[True, True, False], [True, True, True], [True, True, False], [True, False, False]])
    R = torch.tensor([1.0, 4.0, 1.0, math.nan])
    r = step_rewards(turn_rewards, valid, R)
    # row 0: 1.0 - (0.2 + 0.3) = 0.5 more on turn 2 -> 0.8; row 1: final-only reward on turn 3; row 2: a binary
    # reward below the per-turn sum: 1 - 2 = -1 on the last turn -> 0; row 3: NaN
    want = torch.tensor([[0.2, 0.8, 0.0], [0.0, 0.0, 4.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(r[:3], want, rtol=0, atol=1e-12)
    assert torch.isnan(r[3]).all()
    assert r.dtype == torch.float64


# ---------------------------------------------------------------------------------------------------------------------
# §7 items 10-14: repeated visits, keys, similarity, tool-only rows, missing keys


def test_repeated_visits_share_an_anchor_group_with_their_own_returns():
    """gigpo.md §7 item 10 (Eq. 3): two visits of "a" in one rollout join the other rollout's "a" in one anchor
    group, each with its own discounted return; the group-size metrics count them (§8)."""
    # γ = 0.5, scale off. Row 0 keys (a, b, a), R = 1: returns (1/4, 1/2, 1); row 1 key (a), R = 0: return 0.
    # "a": (1/4, 1, 0), mean 5/12 -> A^S = (-1/6, 7/12, -5/12); "b" singleton -> 0.
    case = tensors([dict(keys=["a", "b", "a"], R=1), dict(keys=["a"], R=0)])
    stats = step_level(case, gamma=0.5, scale=False)
    labels = stats.labels
    assert labels[0, 0] == labels[0, 2] == labels[1, 0] != labels[0, 1]
    assert stats.returns[0].tolist() == [0.25, 0.5, 1.0] and stats.returns[1, 0] == 0.0
    assert stats.step_adv[0].tolist() == pytest.approx([-1 / 6, 0.0, 7 / 12], abs=1e-12)
    assert float(stats.step_adv[1, 0]) == pytest.approx(-5 / 12, abs=1e-12)
    m = gigpo_metrics(stats, torch.tensor([0.5, -0.5]), case["turn_valid"], case["group_ids"], omega=1.0)
    # four steps in groups of sizes 3, 1, 3, 3
    assert m["gigpo/step_group_size_mean"] == pytest.approx(10 / 4)
    assert m["gigpo/singleton_frac"] == m["gigpo/group_size_frac/1"] == pytest.approx(1 / 4)
    assert m["gigpo/anchor_coverage"] == m["gigpo/group_size_frac/2-5"] == pytest.approx(3 / 4)
    assert m["gigpo/group_size_frac/6-9"] == 0.0
    assert m["gigpo/return_mean"] == pytest.approx((0.25 + 0.5 + 1.0 + 0.0) / 4)


class HallEnv(Env):
    """A hall (the same text, with varying whitespace) and a kitchen: "river" goes to the hall, "stone" to the
    kitchen, "apple" ends the episode."""

    name = "hall"
    max_turns = 5

    def reset(self, task):
        return "  You are in the\n hall  "

    def step(self, action):
        if action.strip() == "apple":
            return "", 1.0, True, {"success": True}
        if action.strip() == "stone":
            return "You are in the kitchen", 0.0, False, {}
        return "You are in the   hall", 0.0, False, {}


def plan_generate(tokenizer, plan: list[str]):
    """A GenerateFn answering every context on call k with plan[k] (+ eos)."""
    calls = []

    def generate(contexts, max_new_tokens):
        word = plan[len(calls)]
        calls.append(len(contexts))
        ids = tokenizer(word, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        return [(ids, [-0.5] * len(ids)) for _ in contexts]

    return generate


def test_keys_ignore_whitespace_and_step_numbers(tiny_tokenizer):
    """gigpo.md §7 item 11 (D1): whitespace-only differences give the same key and anchor; an environment without a
    state key gets the normalised observation before the step (the initial one for step 1); the same state at steps
    1, 2 and 4 gives the same key (no step number in it)."""
    assert anchor_key("  room 1\n\t key ") == "room 1 key" and anchor_key(None) is None
    labels, _ = anchor_groups([["a  b", "c"], [" a b\n", "c "], ["a\tb"]], [0, 0, 0], 2)
    assert labels[0, 0] == labels[1, 0] == labels[2, 0] and labels[0, 1] == labels[1, 1] != labels[0, 0]
    assert state_key_of(Env(), "  You are in\n room 2 ") == "You are in room 2"

    class Inventory(Env):
        def state_key(self):
            return "  room 2 |\n holding: key "

    assert state_key_of(Inventory(), "You are in room 2") == "room 2 | holding: key"  # the richer key wins

    class Plain:  # duck-typed, no state_key at all
        def reset(self, task):
            return "x"

        def step(self, action):
            return "y", 0.0, True, {}

    assert state_key_of(ProtocolEnv(Plain()), " seen  last ") == "seen last"
    plan = ["river", "stone", "river", "apple"]  # hall -> hall -> kitchen -> hall -> done
    (rollout,) = play(plan_generate(tiny_tokenizer, plan), tiny_tokenizer, [HallEnv()], [{}])
    assert rollout.done and rollout.success and len(rollout.turn_rewards) == 4
    hall = "You are in the hall"
    assert rollout.state_keys == [hall, hall, "You are in the kitchen", hall]


def ratio_partition(keys: list[list], groups: list[int], eta: float) -> dict:
    """Eq. 9 in plain Python: visiting rows in order and turns in order, a normalised key joins the first cluster
    (of its task group) whose first member it matches with difflib ratio >= eta, else starts one. Returns
    (row, turn) -> cluster id; None keys are left out."""
    firsts = defaultdict(list)  # group -> first members, in order
    cluster = {}
    for i, (row, g) in enumerate(zip(keys, groups, strict=True)):
        for j, key in enumerate(row):
            key = norm(key)
            if key is None:
                continue
            for c, first in enumerate(firsts[g]):
                if difflib.SequenceMatcher(None, key, first, autojunk=False).ratio() >= eta:
                    cluster[(i, j)] = (g, c)
                    break
            else:
                firsts[g].append(key)
                cluster[(i, j)] = (g, len(firsts[g]) - 1)
    return cluster


def same_partition(labels: torch.Tensor, keys: list[list], clusters: dict) -> None:
    steps = [(i, j) for i, row in enumerate(keys) for j in range(len(row))]
    for i, j in steps:
        assert (int(labels[i, j]) < 0) == ((i, j) not in clusters)
    for a in clusters:
        for b in clusters:
            assert (labels[a] == labels[b]) == (clusters[a] == clusters[b]), (a, b)


def test_similarity_mode():
    """gigpo.md §7 item 12 (Eq. 9): the ratio is 2·M/(|a| + |b|), also for long texts; a state joins the FIRST
    cluster (order of appearance) whose first member it matches, not the best one; pairs below η are never merged
    into one cluster; η = 1.0 reproduces exact matching; clusters never cross task groups; `merges` counts the
    merged states."""
    P = "0123456789abcdef"  # 16 distinct characters
    A, B, x = P + "XXXX", P + "YYYY", P + "XYYY"
    # M: A~B share P (16) -> 32/40 = 0.8; x~A: P and one "X" (17) -> 34/40 = 0.85; x~B: P and "YYY" (19) -> 0.95
    assert similarity(A, B) == pytest.approx(0.8) and similarity(x, A) == pytest.approx(0.85)
    assert similarity(x, B) == pytest.approx(0.95) and similarity(A, A) == 1.0
    long = "the quick brown fox jumps over the lazy dog. " * 6  # 270 characters, one differs: M = 269
    assert similarity(long, "X" + long[1:]) == pytest.approx(2 * 269 / 540)  # no junk heuristic on long texts

    # η = 0.85, order A, B, x: B starts its own cluster (0.8 < η); x joins A's cluster (0.85), although B is closer
    labels, merges = anchor_groups([[A], [B], [x]], [0, 0, 0], 1, eta=0.85)
    assert labels[2, 0] == labels[0, 0] != labels[1, 0] and merges == 1
    # order B, A, x: x now joins B's cluster, the first one it matches
    labels, merges = anchor_groups([[B], [A], [x]], [0, 0, 0], 1, eta=0.85)
    assert labels[2, 0] == labels[0, 0] != labels[1, 0] and merges == 1
    # η = 0.9: x is below η with A (0.85) and never merged with it; it joins B (0.95)
    labels, merges = anchor_groups([[A, x], [B]], [0, 0], 2, eta=0.9)
    assert labels[0, 0] != labels[0, 1] == labels[1, 0] and merges == 1
    # the same text in another task group is another anchor, also with similarity on
    labels, _ = anchor_groups([[A], [A]], [0, 1], 1, eta=0.5)
    assert labels[0, 0] != labels[1, 0]

    rng = random.Random(12)
    for _ in range(20):
        keys = [
            [None if rng.random() < 0.1 else "".join(rng.choice("ab") if rng.random() < 0.15 else c for c in P)
             + rng.choice(["", " ", "\n"]) for _ in range(rng.randint(1, 3))]
            for _ in range(6)
        ]  # fmt: skip
        groups = [0, 0, 0, 1, 1, 1]
        K = max(len(row) for row in keys)
        exact, none_merged = anchor_groups(keys, groups, K)
        labels, merges = anchor_groups(keys, groups, K, eta=1.0)
        assert torch.equal(labels, exact) and merges == none_merged == 0
        for eta in (0.8, 0.9):
            labels, merges = anchor_groups(keys, groups, K, eta=eta)
            clusters = ratio_partition(keys, groups, eta)
            same_partition(labels, keys, clusters)
            for step, (g, c) in clusters.items():  # every member matches its cluster's first member with >= η
                first = next(norm(keys[i][j]) for (i, j), cl in sorted(clusters.items()) if cl == (g, c))
                assert similarity(norm(keys[step[0]][step[1]]), first) >= eta
            distinct = {(g, norm(k)) for row, g in zip(keys, groups, strict=True) for k in row if k is not None}
            firsts = {(g, norm(keys[i][j])) for (i, j), (g, c) in clusters.items()
                      if (i, j) == min(s for s, cl in clusters.items() if cl == (g, c))}  # fmt: skip
            assert merges == len(distinct - firsts)  # distinct states merged into a cluster they do not start


def test_all_tool_token_rows_give_zeros_and_no_nan():
    """gigpo.md §7 item 13: a row whose tokens are all environment tokens (turn_index all -1: its one turn was cut to
    no token, or it has no turn) gets zeros, and nothing is NaN; the other rows are unaffected."""
    # γ = 0.5 (irrelevant: one turn), scale off: "s" holds row 0 (return 1) and row 1 (return 0): A^S = +0.5, -0.5.
    case = tensors([dict(keys=["s"], R=1, n=[2]), dict(keys=["s"], R=0, n=[0]), dict(keys=[], R=0, n=[])])
    adv = torch.tensor([0.7, -0.7, 0.0], dtype=torch.float64)
    out, stats = advantages(case, adv, gamma=0.5, scale=False)
    assert (case["turn_index"][1:] == -1).all()
    check_tokens(out.advantages, case, [[1.2], [], []])
    assert (out.advantages[1:] == 0).all() and torch.isfinite(out.advantages).all()
    assert out.reasons[1:] == ["empty_row", "empty_row"]
    # a batch where no row has a loss token at all
    case = tensors([dict(keys=["s"], R=1, n=[0]), dict(keys=["s"], R=0, n=[0])])
    out, stats = advantages(case, torch.tensor([1.0, -1.0]))
    assert (out.advantages == 0).all() and torch.isfinite(stats.step_adv).all()


def test_missing_keys_are_singletons():
    """gigpo.md §7 item 14 (D12): steps whose key is None are singletons (A^S = 0), they are not pooled with each
    other; the keyed steps still anchor; `gigpo/missing_key_frac` counts them."""
    # γ = 0.5, scale off. Returns row 0 (R = 1): (0.5, 1); row 1 (R = 0): (0, 0). "t": (1, 0) -> A^S = +0.5, -0.5.
    # Were the two None steps one group, they would get (0.5, 0) - 0.25 = ±0.25.
    case = tensors([dict(keys=[None, "t"], R=1), dict(keys=[None, "t"], R=0)])
    stats = step_level(case, gamma=0.5, scale=False)
    assert stats.labels[:, 0].tolist() == [-1, -1] and stats.labels[0, 1] == stats.labels[1, 1] >= 0
    assert stats.step_adv.tolist() == [[0.0, 0.5], [0.0, -0.5]]
    assert stats.missing == 2
    m = gigpo_metrics(stats, torch.tensor([0.5, -0.5]), case["turn_valid"], case["group_ids"], omega=1.0)
    assert m["gigpo/missing_key_frac"] == 0.5 and m["gigpo/singleton_frac"] == 0.5
    # a key recorded for a turn the row lacks (turn_valid False) takes no part: "t" is then a singleton
    case["turn_valid"] = torch.tensor([[True, True], [True, False]])
    stats = step_level(case, gamma=0.5, scale=False)
    assert stats.labels[1, 1] == -1 and stats.step_adv.tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_anchors_never_cross_task_groups():
    """gigpo.md Eq. 3: an anchor group lives inside one task group: the same key in two task groups gives two
    groups, each normalised on its own."""
    # γ = 0.5, scale off. Group 0: "s" returns (1, 0) -> ±0.5. Group 1: "s" returns (1/2, 1/2, 0) (two 2-turn
    # successes and a 1-turn failure) -> mean 1/3 -> (1/6, 1/6, -1/3). Pooled, the five would give other values.
    rows = [
        dict(keys=["s"], R=1, g=0),
        dict(keys=["s"], R=0, g=0),
        dict(keys=["s", "t"], R=1, g=1),
        dict(keys=["s", "u"], R=1, g=1),
        dict(keys=["s"], R=0, g=1),
    ]
    stats = step_level(tensors(rows), gamma=0.5, scale=False)
    assert stats.labels[0, 0] == stats.labels[1, 0] != stats.labels[2, 0] == stats.labels[3, 0] == stats.labels[4, 0]
    assert stats.step_adv[:, 0].tolist() == pytest.approx([0.5, -0.5, 1 / 6, 1 / 6, -1 / 3], abs=1e-12)


def test_nan_reward_row_gives_zeros_and_no_nan_elsewhere():
    """gigpo.md D12 and the `gigpo_step_level` docstring: a row with a non-finite reward gets A^S = 0, the anchor
    groups holding one of its steps give 0 to all their members, other groups (also with the same key in another
    task group) are untouched, and no output is NaN (its A^E = NaN row falls back to zeros)."""
    # γ = 0.5, scale off. Group 1 "s": returns (1, 0) -> ±0.5.
    rows = [
        dict(keys=["s", "t"], R=math.nan, g=0),
        dict(keys=["s", "t"], R=1, g=0),
        dict(keys=["s", "u"], R=0, g=0),
        dict(keys=["s"], R=1, g=1),
        dict(keys=["s"], R=0, g=1),
    ]
    case = tensors(rows)
    adv = torch.tensor([math.nan, 0.5, -0.5, 0.5, -0.5], dtype=torch.float64)
    out, stats = advantages(case, adv, gamma=0.5, scale=False)
    assert stats.step_adv[:3].abs().sum() == 0 and torch.isfinite(stats.step_adv).all()
    assert stats.step_adv[3:, 0].tolist() == [0.5, -0.5]
    assert torch.isfinite(out.advantages).all()
    check_tokens(out.advantages, case, [[0.0, 0.0], [0.5, 0.5], [-0.5, -0.5], [1.0], [-1.0]])
    metrics = gigpo_metrics(stats, adv, case["turn_valid"], case["group_ids"], omega=1.0)
    assert math.isfinite(metrics["gigpo/return_mean"])


# ---------------------------------------------------------------------------------------------------------------------
# §7 item 15: an environment whose state key raises


class FlakyKeyEnv(EchoEnv):
    """EchoEnv whose state_key raises before the second turn."""

    def state_key(self):
        if self.k == 1:
            raise RuntimeError("no key today")
        return super().state_key()


def expert_generate(tokenizer):
    """Answers the last 'say X' of each context with X (+ eos): EchoEnv's expert."""

    def generate(contexts, max_new_tokens):
        out = []
        for ctx in contexts:
            word = tokenizer.decode(ctx).rsplit("say ", 1)[-1].split("<|im_end|>")[0]
            ids = tokenizer(word, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            out.append((ids, [-0.5] * len(ids)))
        return out

    return generate


def test_state_key_that_raises_gives_none_and_the_episode_completes(tiny_tokenizer):
    """gigpo.md §7 item 15: when the environment raises computing its key, that step's key is None and the episode
    still runs to its end (every turn played, success reported)."""
    env = FlakyKeyEnv()
    env.reset({"words": WORDS[:3]})
    env.k = 1
    assert state_key_of(env, "say river") is None
    tasks = EchoEnv.make_tasks("train", 2)
    rollouts = play(expert_generate(tiny_tokenizer), tiny_tokenizer, [FlakyKeyEnv() for _ in tasks], tasks)
    for r in rollouts:
        assert r.done and r.success and not r.truncated and r.env_errors == 0
        assert r.turn_rewards == [1.0, 1.0, 1.0] and r.state_keys == ["k=0", None, "k=2"]


# ---------------------------------------------------------------------------------------------------------------------
# The trainer: D4 (one switch for both levels), D12 (no keys), §7 item 16 (process equivalence), config validation


def gigpo_config(tmp_path, **kw) -> GiGPOConfig:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=40,
        max_turn_tokens=4, **CPU_ARGS,
    )  # fmt: skip
    return GiGPOConfig(**(settings | kw))


@pytest.fixture
def trainer(tiny_model_folder, tmp_path):
    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple", "river", "stone"]}}] * 4)
    t = GiGPOTrainer(
        model=tiny_model_folder, train_dataset=data, args=gigpo_config(tmp_path), env_factory=lambda r: EchoEnv()
    )
    t.model.train()  # metrics go to "train", as inside train()
    return t


def rollout_batch(case: dict, adv: torch.Tensor, keys=None) -> RolloutBatch:
    B, T = case["turn_index"].shape
    loss = (case["turn_index"] >= 0).long()
    return RolloutBatch(
        completion_ids=torch.zeros(B, T, dtype=torch.long), completion_mask=torch.ones(B, T, dtype=torch.long),
        env_mask=loss, turn_index=case["turn_index"], turn_rewards=case["turn_rewards"].double(),
        turn_valid=case["turn_valid"], rewards=case["rewards"].float(), advantages=adv, sampling_logps=None,
        group_ids=torch.tensor(case["group_ids"]), truncated=torch.zeros(B, dtype=torch.bool),
        continues=torch.zeros(B, dtype=torch.bool), task_ids=[None] * B,
        state_keys=case["keys"] if keys is None else keys, transcripts=[[] for _ in range(B)], rows=[{}] * B,
    )  # fmt: skip


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_trainer_hook_follows_the_equations_and_scale_switch(trainer, monkeypatch, scale_rewards):
    """gigpo.md D4 (`scale_rewards` normalises both levels), Eq. 6-7 and §8: the trainer's advantages are A^E + ω·A^S
    of the plain-Python equations with the configured γ and ω, and it logs the credit/* and gigpo/* metrics,
    `credit/conservation_residual_max` = 0 (§7 item 5)."""
    monkeypatch.setattr(trainer.args, "scale_rewards", scale_rewards)
    monkeypatch.setattr(trainer.args, "gigpo_gamma", 0.8)
    monkeypatch.setattr(trainer.args, "gigpo_step_weight", 0.5)
    scale = scale_rewards != "none"
    rows = random_rows(random.Random(3), groups=2, G=4)
    case = tensors(rows)
    a_e = ref_episode_adv(rows, scale)
    out = trainer.compute_advantages(rollout_batch(case, torch.tensor(a_e, dtype=torch.float32)))
    want = [[a_e[i] + 0.5 * s for s in row] for i, row in enumerate(ref_step_adv(rows, 0.8, scale))]
    check_tokens(out.double(), case, want, atol=1e-6)
    assert out.dtype == torch.float32
    metrics = trainer.logged_metrics("train")
    assert metrics["credit/conservation_residual_max"] == [0.0]
    assert "credit/fallback_rate/no_state_keys" not in metrics
    steps = sum(len(row["keys"]) for row in rows)
    missing = sum(k is None for row in rows for k in row["keys"])
    assert metrics["gigpo/missing_key_frac"] == [pytest.approx(missing / steps)]
    assert all(f"gigpo/{name}" in metrics for name in ("anchor_coverage", "adv_step_std", "similarity_merges"))


def test_trainer_without_keys_warns_once_and_is_plain_grpo(trainer, caplog):
    """gigpo.md §7 item 14 and D12: when the environment gives no key at all (every key None, or none recorded),
    the trainer warns once over two batches, returns the plain GRPO broadcast and logs the `no_state_keys` reason."""
    rows = [
        dict(keys=[None, None], R=1),
        dict(keys=[None], R=0),
        dict(keys=[None, None, None], R=1),
        dict(keys=[], R=0),
    ]
    case = tensors(rows)
    adv = torch.tensor([0.5, -1.5, 0.5, 0.5])
    with caplog.at_level(logging.WARNING, logger="trainers.gigpo"):
        first = trainer.compute_advantages(rollout_batch(case, adv))
        second = trainer.compute_advantages(rollout_batch(case, adv, keys=[[] for _ in rows]))
    for out in (first, second):
        assert torch.equal(out, grpo_broadcast(adv, case["turn_index"]))
    assert len([r for r in caplog.records if "no state keys" in r.getMessage()]) == 1
    assert trainer.logged_metrics("train")["credit/fallback_rate/no_state_keys"] == [1.0, 1.0]


def test_process_equivalence(trainer, monkeypatch):
    """gigpo.md §7 item 16 and D11: two processes, each holding half of the batch (a task group spans both halves),
    gather keys and rewards, and each keeps its rows: the halves' A^S and advantages concatenate to the one-process
    result exactly. Without the gather the halves would disagree (the check has teeth)."""
    rng = random.Random(16)
    rows = random_rows(rng, groups=2, G=4, missing=0.0)
    for row in rows[:6]:
        row["g"] = 0  # rows 0-5 one task group (spans rows 0-3 and 4-7), rows 6-7 another
    for row in rows[6:]:
        row["g"] = 1
    for i in (4, 5):  # the first state of rows 0-3 also in the other half's rows of the group
        rows[i]["keys"][0] = rows[0]["keys"][0]
    rows[5]["R"] += 1.0  # a return at that state that differs from the other half's
    case = tensors(rows)
    adv = torch.tensor(ref_episode_adv(rows, True), dtype=torch.float32)
    full = trainer.compute_advantages(rollout_batch(case, adv))
    full_shift = trainer.credit.values
    stats = step_level(case, gamma=trainer.args.gigpo_gamma, scale=True)

    halves = []
    for lo, hi in ((0, 4), (4, 8)):
        halves.append(rollout_batch({k: v[lo:hi] for k, v in case.items()}, adv[lo:hi]))
    now = {"p": 0}

    def fake_gather(t):
        for name in ("advantages", "turn_valid", "turn_rewards", "rewards"):
            if t is getattr(halves[now["p"]], name):
                return torch.cat([getattr(h, name) for h in halves])
        raise AssertionError("gathered something unexpected")

    def fake_gather_object(obj):
        if obj is halves[now["p"]].state_keys:
            return [k for h in halves for k in h.state_keys]
        assert obj == halves[now["p"]].group_ids.tolist()
        return [g for h in halves for g in h.group_ids.tolist()]

    monkeypatch.setattr(gigpo_module, "gather", fake_gather)
    monkeypatch.setattr(gigpo_module, "gather_object", fake_gather_object)
    outs, shifts = [], []
    for p in (0, 1):
        now["p"] = p
        monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(num_processes=2, process_index=p))
        outs.append(trainer.compute_advantages(halves[p]))
        shifts.append(trainer.credit.values)
    assert torch.equal(torch.cat(outs), full)
    assert torch.equal(torch.cat(shifts), full_shift)  # ω·A^S of each process's rows
    assert torch.equal(full_shift, trainer.args.gigpo_step_weight * stats.step_adv)
    alone = [step_level({k: v[lo:hi] for k, v in case.items()}).step_adv for lo, hi in ((0, 4), (4, 8))]
    assert not torch.equal(torch.cat(alone), stats.step_adv)  # per-process statistics would differ


# A hand-checked batch (one task group, γ = 0.5, no std scaling, ω = 0.5). Returns (Eq. 1, 4; R on the last turn):
# row 0 "s"→"t", R = 1: (0.5, 1); row 1 "s", R = 1: (1); row 2 "s"→"t", R = 0: (0, 0); row 3 "u", R = 0: (0).
# Anchor "s" {0.5, 1, 0}, mean 0.5: A^S = 0, 0.5, -0.5; anchor "t" {1, 0}: 0.5, -0.5; "u" is a singleton: 0.
# A^E = R - 0.5 = (0.5, 0.5, -0.5, -0.5). Tokens of turn j hold A^E + 0.5·A^S, environment tokens and padding 0.
HAND_ROWS = [dict(keys=["s", "t"], R=1), dict(keys=["s"], R=1), dict(keys=["s", "t"], R=0), dict(keys=["u"], R=0)]
HAND_A_E = [0.5, 0.5, -0.5, -0.5]
HAND_OUT = [
    [0.5, 0.5, 0, 0, 0.75, 0.75, 0, 0],  # 0.5 + 0.5·0, then 0.5 + 0.5·0.5
    [0.75, 0.75, 0, 0, 0, 0, 0, 0],  # 0.5 + 0.5·0.5
    [-0.75, -0.75, 0, 0, -0.75, -0.75, 0, 0],  # -0.5 + 0.5·(-0.5) at both steps
    [-0.5, -0.5, 0, 0, 0, 0, 0, 0],  # the singleton adds nothing
]


def test_hand_checked_batch_and_rows_of_a_larger_batch():
    """`gigpo_advantages` on the hand-checked batch, whole and as the rows [2, 4) of it (another process's share,
    D11): the statistics come from the whole batch either way; rows outside the batch are refused."""
    case = tensors(HAND_ROWS)
    adv = torch.tensor(HAND_A_E)
    full, stats = advantages(case, adv, omega=0.5, gamma=0.5, scale=False)
    assert torch.equal(full.advantages, torch.tensor(HAND_OUT))
    assert stats.step_adv.tolist() == [[0.0, 0.5], [0.5, 0.0], [-0.5, -0.5], [0.0, 0.0]]
    c = case
    whole = (c["turn_valid"], c["turn_rewards"], c["rewards"], c["keys"], c["group_ids"], 0.5, 0.5, False)
    part, part_stats = gigpo_advantages(adv[2:], c["turn_index"][2:], *whole, start=2)
    assert torch.equal(part.advantages, torch.tensor(HAND_OUT[2:]))
    assert torch.equal(part.values, full.values[2:]) and torch.equal(part_stats.step_adv, stats.step_adv)
    alone, _ = advantages(tensors(HAND_ROWS[2:]), adv[2:], omega=0.5, gamma=0.5, scale=False)
    assert not torch.equal(alone.advantages, part.advantages)  # rows 2-3 alone have no anchor partner for "s"
    with pytest.raises(ValueError, match="not inside"):
        gigpo_advantages(adv[2:], c["turn_index"][2:], *whole, start=3)


@pytest.mark.parametrize("processes", [1, 2])
def test_trainer_hook_is_gigpo_advantages_on_the_hand_checked_batch(trainer, monkeypatch, processes):
    """The trainer's advantages are those of the hand-checked batch, computed by one call of `gigpo_advantages`
    (there is no second implementation in the hook), on one process and as two processes of two rows each."""
    monkeypatch.setattr(trainer.args, "scale_rewards", "none")
    monkeypatch.setattr(trainer.args, "gigpo_gamma", 0.5)
    monkeypatch.setattr(trainer.args, "gigpo_step_weight", 0.5)
    calls = []

    def spy(*args, **kwargs):
        calls.append(kwargs.get("start"))
        return gigpo_advantages(*args, **kwargs)

    monkeypatch.setattr(gigpo_module, "gigpo_advantages", spy)
    case = tensors(HAND_ROWS)
    adv = torch.tensor(HAND_A_E)
    if processes == 1:
        out = trainer.compute_advantages(rollout_batch(case, adv))
        assert calls == [0]
    else:
        halves = [rollout_batch({k: v[lo : lo + 2] for k, v in case.items()}, adv[lo : lo + 2]) for lo in (0, 2)]
        whole = rollout_batch(case, adv)
        monkeypatch.setattr(gigpo_module, "gather", lambda t: next(
            getattr(whole, n) for n in ("advantages", "turn_valid", "turn_rewards", "rewards")
            if any(t is getattr(h, n) for h in halves)
        ))  # fmt: skip
        monkeypatch.setattr(
            gigpo_module, "gather_object", lambda o: whole.state_keys if isinstance(o[0], list) else case["group_ids"]
        )
        outs = []
        for p in (0, 1):
            monkeypatch.setattr(trainer, "accelerator", SimpleNamespace(num_processes=2, process_index=p))
            outs.append(trainer.compute_advantages(halves[p]))
        out = torch.cat(outs)
        assert calls == [0, 2]
    assert torch.equal(out, torch.tensor(HAND_OUT))


class Probe(GiGPOTrainer):
    """Keeps the last batch its advantage hook saw, with the output."""

    def compute_advantages(self, batch):
        out = super().compute_advantages(batch)
        self.seen = (batch, out)
        return out


def test_trainer_on_agent_loop_rollouts(tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch):
    """gigpo.md D1, D8 and Eq. 1-7 through the real rollout path: the keys the agent loop records (EchoEnv's
    `k=<turn>`) reach the hook, every step of a group of G = 4 anchors with the same step of the other rollouts, and
    the advantages are TRL's A^E plus the plain-Python A^S of the batch's own rewards."""
    rng = random.Random(0)

    def policy(model, tokenizer, **kwargs):  # the expert's word 60% of the time, else a random one
        def generate(contexts, max_new_tokens):
            out = []
            for ctx in contexts:
                word = tokenizer.decode(ctx).rsplit("say ", 1)[-1].split("<|im_end|>")[0]
                word = word if rng.random() < 0.6 else rng.choice(WORDS)
                ids = tokenizer(word, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                out.append((ids, [-1.0] * len(ids)))
            return out

        return generate

    monkeypatch.setattr(agent_loop, "hf_generate", policy)
    tasks = EchoEnv.make_tasks("train", 2)
    data = Dataset.from_list([{"prompt": "x", "task": t} for t in tasks])
    args = gigpo_config(tmp_path, max_completion_length=200, gigpo_gamma=0.5)
    trainer = Probe(model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda r: EchoEnv())
    trainer.model.train()
    torch.manual_seed(0)
    trainer.generate_and_score([dict(data[i // 4]) for i in range(8)])  # fresh dicts: rows get merged
    batch, out = trainer.seen
    assert batch.state_keys == [["k=0", "k=1", "k=2"]] * 8 and batch.group_ids.tolist() == [0] * 4 + [1] * 4
    rows = [
        dict(keys=keys, r=batch.turn_rewards[i, :3].tolist(), R=float(batch.rewards[i]), g=int(batch.group_ids[i]))
        for i, keys in enumerate(batch.state_keys)
    ]
    want = ref_step_adv(rows, 0.5, True)
    assert any(v != 0 for row in want for v in row)  # the scripted policy's hits differ between rollouts
    a_e = batch.advantages.double().tolist()
    assert a_e == pytest.approx(ref_episode_adv(rows, True), abs=1e-5)  # TRL's A^E is Eq. 2 in std mode
    check_tokens(out.double(), {"turn_index": batch.turn_index}, [[a_e[i] + s for s in r] for i, r in enumerate(want)],
                 atol=1e-5)  # fmt: skip
    metrics = trainer.logged_metrics("train")
    assert metrics["gigpo/anchor_coverage"] == [1.0] and metrics["gigpo/group_size_frac/2-5"] == [1.0]


def test_config_validation(tmp_path):
    """gigpo.md §5 defaults and the range checks of GiGPOConfig: ω >= 0, γ in [0, 1], η in (0, 1] or None."""
    args = gigpo_config(tmp_path)
    assert (args.gigpo_step_weight, args.gigpo_gamma, args.gigpo_similarity) == (1.0, 0.95, None)
    assert args.scale_rewards == "group"  # D4: "std" for both levels by default
    for ok in (dict(gigpo_step_weight=0.0), dict(gigpo_gamma=0.0), dict(gigpo_gamma=1.0), dict(gigpo_similarity=1.0)):
        gigpo_config(tmp_path, **ok)
    bad = [
        ("gigpo_step_weight", -0.1),
        ("gigpo_step_weight", math.nan),
        ("gigpo_gamma", -0.01),
        ("gigpo_gamma", 1.5),
        ("gigpo_similarity", 0.0),
        ("gigpo_similarity", 1.2),
    ]
    for name, value in bad:
        with pytest.raises(ValueError, match=name):
            gigpo_config(tmp_path, **{name: value})
