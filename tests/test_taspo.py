"""TASPO (taspo.md): the turn weights (Eq. 8-12) on hand-computed cases and on seeded random batches checked against a
plain-Python re-implementation of the equations (§7 items 1-11), τ auto (D3) and the action spans (D4); the teacher
pass as TASPO uses it (Eq. 7, §7 item 12); TASPOTrainer's advantage hook on a generation batch of the tiny model with a
scripted analyzer: the equations end to end, zero-variance and token-less rows, executed turns, failed analyzer calls
and timeouts against the loopback server, and two-process equivalence (§7 items 14-19, D6, D10, D11, D14); config
validation. The analyzer's prompts, validation and stage are in tests/test_analyzer.py."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import math
import random
import statistics
import time
from collections import defaultdict

import pytest
import torch
from conftest import CPU_ARGS, WORDS, EchoEnv
from datasets import Dataset

import trainers.taspo as taspo_module
import trainers.teacher as teacher_module
from tests.helpers.analyzer import KEY_ENV, SENTINEL, Scripted
from tests.judge_server import JudgeServer, hang, ok
from trainers import agent_loop
from trainers.taspo import (
    TASPOConfig,
    TASPOTrainer,
    action_token_mask,
    auto_tau,
    build_analyzer,
    demeaned,
    margin_filter,
    taspo_advantages,
    taspo_weights,
    turn_shift_means,
)
from trainers.teacher import teacher_logps

# ---------------------------------------------------------------------------------------------------------------------
# The equations re-implemented in plain Python (the reference the code is checked against), and token-level cases


def sign(x: float) -> int:
    return (x > 0) - (x < 0)


def ref_d(shifts: list[float], kappa: float) -> float:
    """Eq. 8: φ(Δ) = Δ·1[|Δ| ≥ κ], averaged over the turn's action tokens, the filtered ones counted; 0 without any."""
    phi = [x if abs(x) >= kappa else 0.0 for x in shifts]
    return sum(phi) / len(phi) if phi else 0.0


def ref_weights(d: list[float], A: float, on: list[bool], eps: float, tau: float) -> list[float]:
    """Eq. 9-11 for one row: d̂ = d − mean over 𝒯, q = tanh(sign(A)·d̂/τ), w = 1 + (ε/2)(q − q̄) on 𝒯, 1 elsewhere."""
    idx = [j for j, x in enumerate(on) if x]
    if not idx:
        return [1.0] * len(d)
    d_bar = sum(d[j] for j in idx) / len(idx)  # Eq. 9
    q = {j: math.tanh(sign(A) * (d[j] - d_bar) / tau) for j in idx}  # Eq. 10
    q_bar = sum(q.values()) / len(idx)
    return [1.0 + eps / 2 * (q[j] - q_bar) if j in q else 1.0 for j in range(len(d))]  # Eq. 11


def case(rows: list[dict]) -> dict:
    """Tensors of a token-level case. Each row: `A` and `turns`, each turn a dict with `act` (Δ of its action tokens),
    optional `other` (Δ of its loss tokens outside the action span, e.g. reasoning) and `executed` (default True).
    Tokens per turn: `other`, then `act`, then 2 environment tokens (turn_index −1) whose Δ is 7.0 and whose action
    mask is set, so that they would show if they ever counted; padding likewise, to the longest row."""
    K = max(len(r["turns"]) for r in rows)
    index, delta, act = [], [], []
    for r in rows:
        ti, de, am = [], [], []
        for j, turn in enumerate(r["turns"]):
            for x in turn.get("other", []):
                ti, de, am = ti + [j], de + [x], am + [False]
            for x in turn["act"]:
                ti, de, am = ti + [j], de + [x], am + [True]
            ti, de, am = ti + [-1, -1], de + [7.0, 7.0], am + [True, True]
        index.append(ti), delta.append(de), act.append(am)
    T = max(len(ti) for ti in index)
    pad = [T - len(ti) for ti in index]
    return dict(
        rows=rows,
        adv=torch.tensor([float(r["A"]) for r in rows], dtype=torch.float64),
        turn_index=torch.tensor([ti + [-1] * p for ti, p in zip(index, pad, strict=True)]),
        delta=torch.tensor([de + [7.0] * p for de, p in zip(delta, pad, strict=True)], dtype=torch.float64),
        action_mask=torch.tensor([am + [True] * p for am, p in zip(act, pad, strict=True)]),
        turn_valid=torch.tensor([[j < len(r["turns"]) for j in range(K)] for r in rows]),
        action_turns=torch.tensor(
            [[j < len(r["turns"]) and r["turns"][j].get("executed", True) for j in range(K)] for r in rows]
        ),
    )


def run(c: dict, eps=0.2, kappa=0.05, tau=0.25, fallback=None, reasons=None):
    inputs = (c["adv"], c["turn_index"], c["turn_valid"], c["delta"], c["action_mask"], c["action_turns"])
    return taspo_advantages(*inputs, eps, kappa, tau, fallback, reasons)


def ref_case(c: dict, eps: float, kappa: float, tau: float) -> tuple[list[list[float]], list[list[float]]]:
    """d (Eq. 8) and w (Eq. 9-11) of every row of a case, from its `rows` spec."""
    ds, ws = [], []
    for r in c["rows"]:
        d = [ref_d(t["act"], kappa) for t in r["turns"]]
        ds.append(d)
        ws.append(ref_weights(d, r["A"], [t.get("executed", True) for t in r["turns"]], eps, tau))
    return ds, ws


def token_values(out: torch.Tensor, turn_index: torch.Tensor) -> list[dict[int, list[float]]]:
    """Per row: turn j -> the values of its tokens; also checks that tokens of no turn hold exactly 0 (Eq. 12)."""
    per_row = []
    for b in range(out.shape[0]):
        turns = defaultdict(list)
        for t, j in enumerate(turn_index[b].tolist()):
            if j < 0:
                assert out[b, t] == 0
            else:
                turns[j].append(float(out[b, t]))
        per_row.append(turns)
    return per_row


def random_rows(rng: random.Random, n: int = 40, scales=(0.01, 0.3, 3.0, 50.0)) -> list[dict]:
    """Rows of 1-5 turns of 1-4 action tokens (Δ uniform in ±scale; the largest scales saturate tanh), some reasoning
    tokens with wild Δ, about a quarter of the turns not executed, A of both signs, 0 and tiny. The first rows are
    the edge cases: no executed turn, a single one, A = 0."""
    rows = []
    for _ in range(n):
        scale = rng.choice(scales)
        turns = [
            dict(act=[rng.uniform(-1, 1) * scale for _ in range(rng.randint(1, 4))],
                 other=[rng.uniform(-9, 9) for _ in range(rng.randint(0, 2))], executed=rng.random() < 0.75)
            for _ in range(rng.randint(1, 5))
        ]  # fmt: skip
        rows.append(dict(turns=turns, A=rng.choice([0.0, -1.5, 0.7, 1e-3, rng.uniform(-3, 3)])))
    for t in rows[0]["turns"] + rows[1]["turns"]:
        t["executed"] = False
    rows[1]["turns"].append(dict(act=[0.4, -0.2], executed=True))  # exactly one executed turn
    rows[0]["A"], rows[1]["A"], rows[2]["A"] = 1.0, -2.0, 0.0
    return rows


SETTINGS = [(0.2, 0.05, 0.25), (0.9, 0.0, 0.1), (0.5, 0.3, 1.0)]  # (ε, κ, τ)

# ---------------------------------------------------------------------------------------------------------------------
# Eq. 8-12 against the reference; §7 items 1-9


@pytest.mark.parametrize("eps,kappa,tau", SETTINGS)
@pytest.mark.parametrize("seed", range(3))
def test_weights_and_tokens_match_the_equations(seed, eps, kappa, tau):
    """taspo.md Eq. 8-12 on random batches: d (per-turn mean of the margin-filtered Δ over the action tokens only), w
    and the per-token Ã = A·w on every loss token of its turn (0 elsewhere) equal the plain-Python equations."""
    c = case(random_rows(random.Random(seed)))
    out, d, q = run(c, eps, kappa, tau)
    ref_ds, ref_ws = ref_case(c, eps, kappa, tau)
    for b, r in enumerate(c["rows"]):
        K = len(r["turns"])
        assert d[b, :K].tolist() == pytest.approx(ref_ds[b], abs=1e-12)
        assert out.values[b, :K].tolist() == pytest.approx(ref_ws[b], abs=1e-12)
        for j, values in token_values(out.advantages, c["turn_index"])[b].items():
            assert values == pytest.approx([r["A"] * ref_ws[b][j]] * len(values), abs=1e-12)
    assert out.advantages.dtype == torch.float64 and not out.fallback.any()
    w_direct, q_direct = taspo_weights(d, c["adv"], c["action_turns"], eps, tau)
    assert torch.equal(w_direct, out.values) and torch.equal(q_direct, q)


def random_weights(seed: int, B: int = 200, K: int = 6, scale: float = 3.0):
    """Random d (B, K), A (B,) (a tenth 0) and 𝒯 (B, K) ⊆ the row's K_i turns, with K_i (B,)."""
    g = torch.Generator().manual_seed(seed)
    k_i = torch.randint(1, K + 1, (B,), generator=g)
    valid = torch.arange(K).unsqueeze(0) < k_i.unsqueeze(1)
    on = valid & (torch.rand(B, K, generator=g) < 0.7)
    d = (torch.rand(B, K, generator=g, dtype=torch.float64) * 2 - 1) * scale
    A = torch.randn(B, generator=g, dtype=torch.float64) * 2
    A[::10] = 0.0
    return d, A, on, valid, k_i


@pytest.mark.parametrize("eps", [0.05, 0.2, 0.99])
@pytest.mark.parametrize("seed", range(3))
def test_weights_against_reference_and_turn_mean(seed, eps):
    """taspo.md Eq. 9-11 and §7 item 1: w equals the reference; its mean over 𝒯_i is 1 (relative 1e-9) and, as the
    turns outside 𝒯_i hold 1, so is its mean over all K_i turns; through the interface, the mean over the turns of
    the per-turn token value is A_i, and the declared `turn_mean` residual is ~0."""
    d, A, on, valid, k_i = random_weights(seed)
    w, _ = taspo_weights(d, A, on, eps, 0.25)
    for b in range(d.shape[0]):
        K = int(k_i[b])
        want = ref_weights(d[b, :K].tolist(), float(A[b]), on[b, :K].tolist(), eps, 0.25)
        assert w[b, :K].tolist() == pytest.approx(want, abs=1e-12)
        if on[b].any():
            assert abs(float(w[b][on[b]].mean()) - 1.0) <= 1e-9
        assert abs(float(w[b, :K].mean()) - 1.0) <= 1e-9
    c = case(random_rows(random.Random(10 + seed)))
    out, _, _ = run(c, eps, 0.0, 0.25)
    for b, turns in enumerate(token_values(out.advantages, c["turn_index"])):
        per_turn = [values[0] for _, values in sorted(turns.items())]  # all tokens of a turn hold one value (G2)
        A_b = c["rows"][b]["A"]
        assert statistics.fmean(per_turn) == pytest.approx(A_b, rel=1e-9, abs=1e-15)  # mean_j Ã_ij = A_i
    assert float(out.residual.max()) <= 1e-12


@pytest.mark.parametrize("eps", [0.05, 0.2, 0.99])
def test_bounds_strict_and_single_turn_rows_are_one(eps):
    """taspo.md §7 item 2 and the proof sketch: 1 − ε < w < 1 + ε, and indeed |w − 1| ≤ ε(n − 1)/n with n = |𝒯_i|,
    also where tanh saturates (d up to ±50 with τ = 0.05 makes q exactly ±1); w = 1 exactly when |𝒯_i| ≤ 1."""
    for seed, scale in ((0, 0.3), (1, 3.0), (2, 50.0)):
        d, A, on, _, _ = random_weights(seed, scale=scale)
        w, q = taspo_weights(d, A, on, eps, 0.05)
        n = on.sum(dim=1, keepdim=True).double().clamp(min=1)  # rows without 𝒯: bound 0, w = 1
        assert ((w > 1 - eps) & (w < 1 + eps)).all()
        assert ((w - 1).abs() <= eps * (n - 1) / n + 1e-15).all()
        small = on.sum(dim=1) <= 1
        assert small.any() and (w[small] == 1.0).all()
        if scale == 50.0:
            assert (q.abs() == 1.0).any()  # saturated, and the bound still holds


@pytest.mark.parametrize("eps", [0.2, 0.99])
def test_weights_positive_and_sign_preserved(eps):
    """taspo.md §7 item 3: for ε < 1, w > 0, hence sign(Ã) = sign(A) on every loss token (A = 0: Ã = 0)."""
    c = case(random_rows(random.Random(5), n=60))
    out, _, _ = run(c, eps, 0.0, 0.1)
    assert (out.values > 0).all()
    loss = c["turn_index"] >= 0
    signs = torch.sign(c["adv"]).unsqueeze(1).expand_as(loss)
    assert torch.equal(torch.sign(out.advantages)[loss], signs[loss])


def test_zero_advantage_gives_unit_weights_and_zero_tokens():
    """taspo.md §7 item 4 (proof step 6): A = 0 gives q ≡ 0, w ≡ 1 exactly and Ã ≡ 0, whatever Δ is."""
    rows = random_rows(random.Random(6))
    for r in rows:
        r["A"] = 0.0
    c = case(rows)
    out, _, q = run(c, 0.2, 0.0, 0.25)
    assert (out.values == 1.0).all() and (q == 0).all() and (out.advantages == 0).all()


def test_fallback_rows_are_the_grpo_broadcast():
    """taspo.md §7 item 5, Eq. 6, D10-D11 (credit-interface.md G4): a row without matched PI (or whose analyzer call
    failed) gets A on every loss token and 0 elsewhere, bit for bit, whatever its Δ; its reason is kept."""
    c = case(random_rows(random.Random(7)))
    B = c["adv"].shape[0]
    fallback = torch.tensor([b % 3 == 0 for b in range(B)])
    reasons = ["no_pi" if b % 6 == 0 else "analyzer_failure" if b % 3 == 0 else None for b in range(B)]
    out, _, _ = run(c, 0.2, 0.0, 0.1, fallback, reasons)
    grpo = c["adv"].unsqueeze(1) * (c["turn_index"] >= 0)
    for b in range(B):
        if fallback[b]:
            assert torch.equal(out.advantages[b], grpo[b]) and (out.values[b] == 1).all()
        assert out.reasons[b] == reasons[b]
    credited = ~fallback & (c["adv"] != 0)
    assert not torch.equal(out.advantages[credited], grpo[credited])  # the others are reweighted (the test has teeth)


@pytest.mark.parametrize("shift", [-3.7, 0.5, 100.0])
def test_shift_invariance(shift):
    """taspo.md §7 item 6: adding a constant to every d_ij of a row (here through every action token's Δ, κ = 0)
    leaves w unchanged."""
    d, A, on, _, _ = random_weights(8, scale=0.5)
    w0, _ = taspo_weights(d, A, on, 0.2, 0.25)
    w1, _ = taspo_weights(d + shift, A, on, 0.2, 0.25)
    torch.testing.assert_close(w1, w0, rtol=0, atol=1e-10)
    rows = random_rows(random.Random(8), scales=(0.3,))
    c0 = case(rows)
    for r in rows:
        for t in r["turns"]:
            t["act"] = [x + shift for x in t["act"]]
    out0, _, _ = run(c0, 0.2, 0.0, 0.25)
    out1, _, _ = run(case(rows), 0.2, 0.0, 0.25)
    torch.testing.assert_close(out1.values, out0.values, rtol=0, atol=1e-10)


def test_ordering_follows_the_sign_of_A():
    """taspo.md §7 item 7: on 𝒯_i, for A > 0, d_ij > d_ik implies w_ij > w_ik; for A < 0 the reverse (d in ±0.5
    with τ = 0.25 keeps tanh strictly increasing in float64)."""
    d, A, on, _, _ = random_weights(9, scale=0.5)
    w, _ = taspo_weights(d, A, on, 0.2, 0.25)
    pairs = 0
    for b in range(d.shape[0]):
        idx = on[b].nonzero().flatten().tolist()
        for j in idx:
            for k in idx:
                if d[b, j] > d[b, k] + 1e-9 and A[b] != 0:
                    assert (w[b, j] > w[b, k]) if A[b] > 0 else (w[b, j] < w[b, k])
                    pairs += 1
    assert pairs > 100


def test_weights_depend_on_the_sign_of_A_only():
    """taspo.md §7 item 8: scaling A by any positive factor leaves w bit-identical; flipping its sign mirrors w
    around 1 (q and q̄ change sign, so w(−A) = 2 − w(A))."""
    d, A, on, _, _ = random_weights(10)
    w, _ = taspo_weights(d, A, on, 0.2, 0.25)
    for factor in (1e-6, 0.3, 7.0, 1e6):
        assert torch.equal(taspo_weights(d, A * factor, on, 0.2, 0.25)[0], w)
    flipped, _ = taspo_weights(d, -A, on, 0.2, 0.25)
    torch.testing.assert_close(flipped, 2.0 - w, rtol=0, atol=1e-12)


def test_turns_outside_the_action_set_keep_weight_one():
    """taspo.md §7 item 9, Eq. 11, D6: a turn that is not executed (or past the row's last turn) has w = 1 exactly,
    and its tokens carry A exactly, even with large Δ on them."""
    rows = random_rows(random.Random(11), scales=(3.0,))
    c = case(rows)
    out, _, _ = run(c, 0.2, 0.0, 0.25)
    outside = ~c["action_turns"]
    assert outside.any() and (out.values[outside] == 1.0).all()
    for b, turns in enumerate(token_values(out.advantages, c["turn_index"])):
        for j, values in turns.items():
            if not rows[b]["turns"][j]["executed"]:
                assert values == [rows[b]["A"]] * len(values)


# ---------------------------------------------------------------------------------------------------------------------
# §7 items 10-11, D3


def test_length_independence():
    """taspo.md §7 item 10: duplicating every action token's Δ (each turn twice as long, same shifts; reasoning
    tokens as they were) leaves d, w and the per-token Ã unchanged: Ã does not scale with the turn's length."""
    rows = random_rows(random.Random(12), scales=(0.3,))
    longer = copy.deepcopy(rows)
    for r in longer:
        for t in r["turns"]:
            t["act"] = [x for x in t["act"] for _ in range(2)]
    for kappa in (0.0, 0.1):
        (out1, d1, _), (out2, d2, _) = run(case(rows), 0.2, kappa, 0.25), run(case(longer), 0.2, kappa, 0.25)
        torch.testing.assert_close(d2, d1, rtol=0, atol=1e-12)
        torch.testing.assert_close(out2.values, out1.values, rtol=0, atol=1e-12)
        short = token_values(out1.advantages, case(rows)["turn_index"])
        long = token_values(out2.advantages, case(longer)["turn_index"])
        for a, b in zip(short, long, strict=True):
            assert {j: v[0] for j, v in a.items()} == pytest.approx({j: v[0] for j, v in b.items()}, abs=1e-12)


def test_margin_filter_and_mean_with_filtered_tokens():
    """taspo.md §7 item 11, Eq. 8: |Δ| < κ becomes 0, |Δ| ≥ κ passes unchanged (κ itself included); d is a mean over
    the action tokens with the filtered ones in the denominator, not a sum and not a mean of the survivors."""
    x = torch.tensor([0.3, -0.3, 0.0499, -0.0499, 0.05, -0.05, 0.0, 2.5], dtype=torch.float64)
    assert margin_filter(x, 0.05).tolist() == [0.3, -0.3, 0.0, 0.0, 0.05, -0.05, 0.0, 2.5]
    assert torch.equal(margin_filter(x, 0.0), x)
    # turn 0: action Δ (0.3, 0.01, −0.02, 0.5) -> (0.3 + 0.5) / 4 = 0.2 (the survivors' mean would be 0.4, the sum
    # 0.8); turn 1: a reasoning token (Δ 2.0, not an action token) and one action token −0.04 (filtered) -> 0;
    # turn 2: action Δ −0.6 -> −0.6. Environment tokens (Δ 9.0) never count.
    delta = torch.tensor([[0.3, 0.01, -0.02, 0.5, 9.0, 2.0, -0.04, 9.0, -0.6]], dtype=torch.float64)
    act = torch.tensor([[1, 1, 1, 1, 0, 0, 1, 0, 1]]).bool()
    turn = torch.tensor([[0, 0, 0, 0, -1, 1, 1, -1, 2]])
    d = turn_shift_means(delta, act, turn, 3, kappa=0.05)
    assert d.dtype == torch.float64 and d[0].tolist() == pytest.approx([0.2, 0.0, -0.6], abs=1e-15)
    assert turn_shift_means(delta, act, turn, 3, kappa=0.0)[0].tolist() == pytest.approx([0.1975, -0.04, -0.6])


def test_auto_tau_and_demeaned():
    """taspo.md D3, Eq. 9 (conventions.md C12): d̂ is d minus the row's mean over 𝒯 (0 off 𝒯); τ auto is the population
    std of d̂ over the action turns given, floored at 1e-3, and the default 0.25 for an empty pool."""
    d = torch.tensor([[0.5, 0.1, 9.0], [0.2, -0.4, 0.0]], dtype=torch.float64)
    on = torch.tensor([[True, True, False], [True, True, True]])
    d_hat = demeaned(d, on)
    # row 0: mean of (0.5, 0.1) = 0.3 -> (0.2, −0.2, 0); row 1: mean of (0.2, −0.4, 0) = −0.0667 -> (4/15, −1/3, 1/15)
    assert d_hat.flatten().tolist() == pytest.approx([0.2, -0.2, 0.0, 4 / 15, -1 / 3, 1 / 15], abs=1e-12)
    pool = [0.2, -0.2, 4 / 15, -1 / 3, 1 / 15]
    assert auto_tau(d_hat, on) == pytest.approx(statistics.pstdev(pool), rel=1e-12)  # ddof 0
    pool = torch.tensor([[0.3, -0.1, -0.2, 5.0]], dtype=torch.float64)
    assert auto_tau(pool, torch.tensor([[1, 1, 1, 0]]).bool()) == pytest.approx(
        math.sqrt((0.09 + 0.01 + 0.04) / 3), rel=1e-12
    )
    assert auto_tau(torch.zeros(2, 3), torch.ones(2, 3).bool()) == 1e-3  # floored
    assert auto_tau(d_hat, torch.zeros(2, 3).bool()) == 0.25  # empty pool: the default


def test_action_token_mask(tiny_tokenizer):
    """taspo.md D4: in a turn with a tool-call block only the tokens overlapping the block are selected (the prose
    before it is not); `<action>` selects its content; a code block selects the block; a turn with no markup selects
    all its loss tokens and counts as a fallback; environment tokens are never selected."""
    tok = tiny_tokenizer

    def ids(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    parts = [  # (text, turn, expected selected); pieces tokenised apart, so token boundaries fall between them
        ("I will call ", 0, False), ('<tool_call>{"name": "say", "arguments": {}}</tool_call>', 0, True),
        ("\nsay river\n", -1, False),
        ("apple", 1, True),
        ("\nok\n", -1, False),
        ("think first ", 2, False), ("<action>", 2, False), ("stone", 2, True), ("</action>", 2, False),
        ("\nok\n", -1, False),
        ("run ", 3, False), ("```\nls -la\n```", 3, True), (" done", 3, False),
    ]  # fmt: skip
    completion, turns, want = [], [], []
    for text, j, selected in parts:
        piece = ids(text)
        completion += piece
        turns += [j] * len(piece)
        want += [selected] * len(piece)
    assert tok.decode(completion, skip_special_tokens=False) == "".join(p[0] for p in parts)
    mask, n_turns, fallbacks = action_token_mask(tok, torch.tensor([completion]), torch.tensor([turns]), 4)
    assert mask[0].tolist() == want
    assert (n_turns, fallbacks) == (4, 1)  # only turn 1 ("apple") has no markup


# ---------------------------------------------------------------------------------------------------------------------
# The trainer on a generation batch of the tiny model (§7 items 12, 14-19)


def taspo_config(tmp_path, **kw) -> TASPOConfig:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=60,
        max_turn_tokens=4, reward="binary", **CPU_ARGS,
    )  # fmt: skip
    return TASPOConfig(**(settings | kw))


# placed before the module's trainer is built: each TrainingArguments made resets accelerate's shared state
def test_config_validation_and_reference_teacher(tiny_model_folder, tmp_path):
    """taspo.md §5 defaults (ε 0.2, κ 0.05, τ 0.25 fixed, policy teacher, oracle analyzer, temperature 0, 3 attempts,
    concurrency 32, 180 s timeout, 1,200 s step deadline, 1,024-token block, 1,000-character observations) and the
    config checks; `taspo_teacher: reference` with β = 0 and no PEFT adapter fails at construction (D9, teacher-pass.md
    D2); TASPO without an environment fails at construction."""
    args = taspo_config(tmp_path)
    assert (args.taspo_epsilon, args.taspo_kappa, args.taspo_tau, args.taspo_tau_mode) == (0.2, 0.05, 0.25, "fixed")
    assert (args.taspo_teacher, args.analyzer_backend, args.analyzer_temperature) == ("policy", "oracle", 0.0)
    assert (args.analyzer_max_retries, args.analyzer_max_repairs, args.analyzer_concurrency) == (2, 2, 32)
    assert (args.analyzer_timeout, args.analyzer_step_deadline) == (180.0, 1200.0)
    assert (args.taspo_max_pi_tokens, args.analyzer_observation_chars) == (1024, 1000)
    for ok_kw in (dict(taspo_epsilon=0.999), dict(taspo_kappa=0.0), dict(taspo_tau_mode="auto")):
        taspo_config(tmp_path, **ok_kw)
    bad = [
        ("taspo_epsilon", 0.0), ("taspo_epsilon", 1.0), ("taspo_epsilon", -0.2), ("taspo_epsilon", math.nan),
        ("taspo_kappa", -0.01), ("taspo_kappa", math.nan), ("taspo_tau", 0.0), ("taspo_tau", -1.0),
        ("taspo_tau_mode", "adaptive"), ("taspo_teacher", "oracle"), ("analyzer_backend", "claude"),
    ]  # fmt: skip
    for name, value in bad:
        with pytest.raises(ValueError, match=name):
            taspo_config(tmp_path, **{name: value})
    with pytest.raises(ValueError, match="analyzer_model"):
        taspo_config(tmp_path, analyzer_backend="openai")
    tasks = EchoEnv.make_tasks("train", 1)
    data = Dataset.from_list([{"prompt": "say apple", "task": json.dumps(tasks[0])}] * 4)
    with pytest.raises(ValueError, match="beta > 0"):
        TASPOTrainer(
            model=tiny_model_folder, train_dataset=data, args=taspo_config(tmp_path, taspo_teacher="reference"),
            env_factory=lambda row: EchoEnv(), analyzer=Scripted(),
        )  # fmt: skip
    with pytest.raises(ValueError, match="environment"):
        TASPOTrainer(model=tiny_model_folder, train_dataset=data, args=taspo_config(tmp_path), analyzer=Scripted())


def scripted_policy(seed: int, p_expert: float = 0.75):
    """An `hf_generate` stand-in: EchoEnv's word (the last "say X" of the context) with probability p_expert, else a
    random word; the tiny random model is still the policy the teacher pass scores."""
    rng = random.Random(seed)

    def factory(model, tokenizer, **kwargs):
        def generate(contexts, max_new_tokens):
            out = []
            for ctx in contexts:
                word = tokenizer.decode(ctx).rsplit("say ", 1)[-1].split("<|im_end|>")[0]
                word = word if rng.random() < p_expert else rng.choice(WORDS)
                ids = tokenizer(word, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                out.append((ids, [-1.0] * len(ids)))
            return out

        return generate

    return factory


class Probe(TASPOTrainer):
    def compute_advantages(self, batch):
        out = super().compute_advantages(batch)
        self.seen = batch
        return out


@pytest.fixture(scope="module")
def echo(tiny_model_folder, tmp_path_factory):
    """A TASPOTrainer on EchoEnv (binary reward) and one generation batch of 8 rows, 2 tasks × G = 4, from a scripted
    policy: task 0 succeeded in rows 1 and 3 and failed in rows 0 and 2 (A = ±0.866); task 1 failed four times
    (A = 0, a zero-variance group). The two tasks' system messages differ in length, so the rows are left-padded
    differently. Every turn is one word and an end-of-turn id, 3 turns per row."""
    tasks = EchoEnv.make_tasks("train", 2)
    data = Dataset.from_list(
        [
            {"prompt": [{"role": "system", "content": "Be brief. " * (1 + 3 * i)}, {"role": "user", "content": "x"}],
             "task": t}
            for i, t in enumerate(tasks)
        ]
    )  # fmt: skip
    trainer = Probe(
        model=tiny_model_folder, train_dataset=data, args=taspo_config(tmp_path_factory.mktemp("taspo")),
        env_factory=lambda row: EchoEnv(), analyzer=Scripted(),
    )  # fmt: skip
    trainer.model.train()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(agent_loop, "hf_generate", scripted_policy(5))
        torch.manual_seed(0)
        trainer.generate_and_score([dict(data[i // 4]) for i in range(8)])
    batch = trainer.seen
    assert [r["success"] for r in batch.rows] == [False, True, False, True] + [False] * 4
    assert batch.group_ids.tolist() == [0] * 4 + [1] * 4 and batch.turn_valid.all() and batch.turn_valid.shape[1] == 3
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # TRL: (R − 0.5) / (Bessel std √(1/3) + 1e-4)
    assert batch.advantages.tolist() == pytest.approx([-a, a, -a, a, 0, 0, 0, 0], abs=1e-5)
    assert len(set(batch.prompt_mask.sum(dim=1).tolist())) == 2
    return trainer, batch


@pytest.fixture
def trainer(echo, monkeypatch):
    """The module's trainer with a fresh scripted analyzer and fresh metrics for each test."""
    t, _ = echo
    monkeypatch.setattr(t, "analyzer", Scripted())
    monkeypatch.setattr(t, "_metrics", {"train": defaultdict(list), "eval": defaultdict(list)})
    return t


def grpo_broadcast(batch) -> torch.Tensor:
    return batch.advantages.unsqueeze(1) * (batch.turn_index >= 0)


def last_metrics(trainer) -> dict[str, float]:
    return {k: v[-1] for k, v in trainer.logged_metrics("train").items()}


def count_forwards(trainer, monkeypatch) -> list:
    """Records (input_ids, attention_mask, logits_to_keep) of each teacher-pass forward."""
    calls, original = [], trainer.token_logps

    def spy(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        calls.append((input_ids.clone(), attention_mask.clone(), logits_to_keep))
        return original(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)

    monkeypatch.setattr(trainer, "token_logps", spy)
    return calls


def test_trainer_follows_the_equations_with_auto_tau(trainer, echo, monkeypatch):
    """taspo.md §4.1, Eq. 4-12, D3 (conventions.md C12), D4, D6 end to end: the matched blocks; the trainer's output is
    A·w with w from the plain-Python Eq. 8-11 over Δ of a teacher pass with those blocks, M_ij = all loss tokens of
    the turn (echo actions have no markup, D4) and 𝒯 = all turns (EchoEnv rejects none); τ auto is the population
    std of d̂ over the action turns of the rows not in fallback."""
    _, batch = echo
    kappa = 0.002
    monkeypatch.setattr(trainer.args, "taspo_tau_mode", "auto")
    monkeypatch.setattr(trainer.args, "taspo_kappa", kappa)
    out = trainer.compute_advantages(batch)
    # task 0's successes 1 and 3 give own1, own3, shared; rows 0, 2 (failures) receive all three, row 1 own3 and
    # shared, row 3 own1 and shared (§7 item 13); task 1 (A = 0) is skipped (D10)
    assert trainer.credit.reasons == [None] * 4 + ["zero_adv"] * 4
    lines = {i: trainer.blocks[i].split("\n")[1:] for i in range(4)}
    assert lines[0] == lines[2] == ["1. When rollout 1 applies: act as rollout 1 did",
                                    "2. When rollout 3 applies: act as rollout 3 did",
                                    "3. When a word is asked for: say the asked word"]  # fmt: skip
    assert lines[1] == [
        "1. When rollout 3 applies: act as rollout 3 did",
        "2. When a word is asked for: say the asked word",
    ]
    assert lines[3][0] == "1. When rollout 1 applies: act as rollout 1 did" and trainer.blocks[4:] == [""] * 4
    scored = teacher_logps(trainer, batch, [b or None for b in trainer.blocks])
    delta = (scored.with_block - scored.without_block).double()
    d = []
    for b in range(4):
        ti = batch.turn_index[b].tolist()
        d.append([ref_d([float(delta[b, t]) for t in range(len(ti)) if ti[t] == j], kappa) for j in range(3)])
    d_hat = [x - statistics.fmean(row) for row in d for x in row]
    tau = max(statistics.pstdev(d_hat), 1e-3)
    assert last_metrics(trainer)["taspo/tau"] == pytest.approx(tau, rel=1e-9)
    assert tau != 0.25 and any(abs(x) >= kappa for x in delta[:4][batch.turn_index[:4] >= 0].tolist())
    A = batch.advantages.tolist()
    want = [ref_weights(d[b], A[b], [True] * 3, 0.2, tau) for b in range(4)] + [[1.0] * 3] * 4
    assert trainer.credit.values.flatten().tolist() == pytest.approx([w for row in want for w in row], abs=1e-9)
    assert any(abs(w - 1) > 1e-3 for row in want[:4] for w in row)  # the weights are not all 1 (teeth)
    for b, turns in enumerate(token_values(out, batch.turn_index)):
        for j, values in turns.items():
            assert values == pytest.approx([A[b] * want[b][j]] * len(values), abs=1e-6)
    assert out.dtype == batch.advantages.dtype and not out.requires_grad
    m = last_metrics(trainer)
    assert m["credit/conservation_residual_max"] <= 1e-12 and m["credit/sign_flip_token_frac"] == 0
    assert m["taspo/pi_coverage"] == 1.0 and m["taspo/groups_with_success"] == 0.5
    assert m["taspo/items_extracted_mean"] == 3 and m["taspo/items_matched_mean"] == 2.5
    assert m["taspo/action_span_fallback_frac"] == 1.0 and m["taspo/action_turn_frac"] == 1.0


def test_shift_pass_same_ids_same_layout_detached(trainer, echo, monkeypatch):
    """taspo.md §7 item 12, Eq. 7, §4.5: both passes score the rollout's own completion ids (identical in both); when
    the block adds nothing (with_privileged_block patched to return the prompt unchanged) both passes see the same
    prompt, and Δ ≈ 0 (abs 1e-4) across rows whose left padding differs, so both run in the same routine and layout;
    Δ is detached; in the trainer Δ ≈ 0 < κ makes every w 1: the output is the GRPO broadcast."""
    _, batch = echo
    B, T = batch.completion_ids.shape
    blocks = [f"Hint {i}: repeat the word you are asked for." for i in range(B)]
    real = teacher_logps(trainer, batch, blocks)
    assert (real.with_block - real.without_block).abs().max() > 1e-3  # a real block does shift the log-probs
    forwards = count_forwards(trainer, monkeypatch)
    monkeypatch.setattr(
        teacher_module, "with_privileged_block", lambda messages, block, position="system_end": copy.deepcopy(messages)
    )
    with torch.enable_grad():
        scored = teacher_logps(trainer, batch, blocks)
    (ids_with, mask_with, keep_with), (ids_plain, mask_plain, keep_plain) = forwards
    assert keep_with == keep_plain == T
    assert torch.equal(ids_with[:, -T:], batch.completion_ids) and torch.equal(ids_plain[:, -T:], batch.completion_ids)
    assert torch.equal(ids_with, ids_plain) and torch.equal(mask_with, mask_plain)
    assert (mask_with[:, :-T] == 0).any() and (mask_with[:, :-T] == 0).sum(dim=1).unique().numel() == 2
    delta = scored.with_block - scored.without_block
    assert delta.abs().max() <= 1e-4
    assert not delta.requires_grad and not scored.with_block.requires_grad and scored.with_block.grad_fn is None
    forwards.clear()
    out = trainer.compute_advantages(batch)
    assert trainer.credit.reasons[:4] == [None] * 4 and len(forwards) == 2
    assert torch.equal(out, grpo_broadcast(batch)) and not out.requires_grad


def test_zero_variance_groups_no_call_no_forward(trainer, echo, monkeypatch):
    """taspo.md §7 item 15, D10: the batch's task 1 (four failures, A = 0) gets no analyzer call and Ã ≡ 0; with A = 0
    everywhere there is no analyzer call and no teacher forward at all, and Ã ≡ 0."""
    _, batch = echo
    forwards = count_forwards(trainer, monkeypatch)
    out = trainer.compute_advantages(batch)
    # one extraction (task 0) and one match per row 0-3; task 1's actions appear in no prompt
    assert sorted(trainer.analyzer.schemas()) == ["Applicable"] * 4 + ["ExtractedItems"]
    assert (out[4:] == 0).all() and len(forwards) == 2
    trainer.analyzer.calls.clear()
    forwards.clear()
    zero = dataclasses.replace(batch, advantages=torch.zeros_like(batch.advantages))
    out = trainer.compute_advantages(zero)
    assert trainer.analyzer.calls == [] and forwards == []
    assert (out == 0).all() and trainer.credit.reasons == ["zero_adv"] * 8
    assert math.isnan(last_metrics(trainer)["taspo/pi_coverage"])


def test_row_without_loss_tokens(trainer, echo):
    """taspo.md §7 item 16: a row whose tokens are all environment tokens (turn_index −1 throughout), here a failure
    with A ≠ 0 in a group with successes, gets zeros, produces no NaN anywhere and no analyzer call of its own."""
    _, batch = echo
    turn_index = batch.turn_index.clone()
    turn_index[2] = -1
    out = trainer.compute_advantages(dataclasses.replace(batch, turn_index=turn_index))
    assert torch.isfinite(out).all() and (out[2] == 0).all()
    assert trainer.credit.reasons[2] == "empty_row"
    assert sorted(trainer.analyzer.schemas()) == ["Applicable"] * 3 + ["ExtractedItems"]  # rows 0, 1, 3 only
    assert all(math.isfinite(v) or k.endswith(("latency_s_p50", "latency_s_p95", "vote_disagreement"))
               for k, v in last_metrics(trainer).items())  # fmt: skip


def test_rejected_turns_keep_weight_one(trainer, echo, monkeypatch):
    """taspo.md D6, §7 item 9 in the trainer: a turn the environment rejected (`invalid` in the transcript) is not in
    𝒯: w = 1 there and the row's other turns average 1."""
    _, batch = echo
    monkeypatch.setattr(trainer.args, "taspo_kappa", 0.0)
    monkeypatch.setattr(trainer.args, "taspo_tau", 0.002)
    rows = copy.deepcopy(batch.rows)
    rows[0]["transcript"][1]["invalid"] = True
    trainer.compute_advantages(dataclasses.replace(batch, rows=rows))
    w = trainer.credit.values
    assert w[0, 1] == 1.0 and float(w[0, 0] + w[0, 2]) == pytest.approx(2.0, abs=1e-12) and w[0, 0] != 1.0
    assert float(w[1].mean()) == pytest.approx(1.0, abs=1e-12) and (w[1] != 1.0).all()


def test_outcome_blind_through_the_trainer(trainer, echo):
    """taspo.md §7 item 14, D8: with a sentinel in every turn's reward and success fields, in the rows' outcome
    fields and in every rollout's final environment message, no match prompt contains it (the successes' extraction
    prompt does: the sentinel was within reach)."""
    _, batch = echo
    rows = copy.deepcopy(batch.rows)
    for row in rows:
        for turn in row["transcript"]:
            turn["reward"], turn["success"] = SENTINEL, SENTINEL
        row["transcript"][-1]["observation"] = f"{SENTINEL}: episode over"
        row["final_info"], row["env_reward"] = {"success": SENTINEL}, SENTINEL
    trainer.compute_advantages(dataclasses.replace(batch, rows=rows))
    matches = [c.text for c in trainer.analyzer.calls if c.schema == "Applicable"]
    (extraction,) = [c.text for c in trainer.analyzer.calls if c.schema == "ExtractedItems"]
    assert len(matches) == 4 and not any(SENTINEL in text for text in matches)
    assert f"{SENTINEL}: episode over" in extraction


def test_teacher_failure_falls_back(trainer, echo, monkeypatch, caplog):
    """credit-interface.md §7 (fallback policy), taspo.md D11: when the teacher pass fails the rows keep the GRPO
    broadcast (reason `teacher_failure`), with one warning."""
    _, batch = echo

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(taspo_module, "teacher_logps", broken)
    monkeypatch.setattr(trainer, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="trainers.taspo"):
        first = trainer.compute_advantages(batch)
        second = trainer.compute_advantages(batch)
    assert torch.equal(first, grpo_broadcast(batch)) and torch.equal(second, first)
    assert trainer.credit.reasons == ["teacher_failure"] * 4 + ["zero_adv"] * 4
    assert len([r for r in caplog.records if "teacher pass failed" in r.getMessage()]) == 1


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    with JudgeServer(default=lambda body: ok("{}")) as srv:
        yield srv


def api_analyzer(trainer, server):
    """`build_analyzer` for the loopback server, from a copy of the trainer's config (a new TrainingArguments would
    reset accelerate's shared state under the module's trainer)."""
    args = copy.copy(trainer.args)
    args.analyzer_backend, args.analyzer_model, args.analyzer_base_url = "openai", "analyzer-test", server.base_url
    args.analyzer_api_key_env, args.analyzer_timeout = KEY_ENV, 0.3
    judge = build_analyzer(args, [])
    judge.config.backoff_base = 0.01
    return judge


def test_unparsable_analyzer_output_gives_grpo_rows(trainer, echo, server, monkeypatch):
    """taspo.md §7 item 17, D11: an endpoint that never answers JSON is re-asked (3 attempts), then the group's rows
    keep w ≡ 1 (`analyzer_failure`): the output is the GRPO broadcast; nothing raises; the failures are logged."""
    _, batch = echo
    server.default = lambda body: ok("Sorry, I can only answer in prose.")
    with api_analyzer(trainer, server) as judge:
        monkeypatch.setattr(trainer, "analyzer", judge)
        out = trainer.compute_advantages(batch)
    assert torch.equal(out, grpo_broadcast(batch))
    assert trainer.credit.reasons == ["analyzer_failure"] * 4 + ["zero_adv"] * 4
    m = last_metrics(trainer)
    assert len(server.requests) == 3 and m["taspo/analyzer_parse_failures"] == 3 and m["taspo/analyzer_requests"] == 3
    assert m["credit/fallback_rate/analyzer_failure"] == 0.5


def test_analyzer_timeouts_give_grpo_rows_and_are_counted(trainer, echo, server, monkeypatch):
    """taspo.md §7 item 18: an endpoint that hangs past the 0.3 s timeout is retried (3 attempts), then the rows
    fall back to w ≡ 1; `taspo/analyzer_timeouts` counts the 3 timed-out attempts."""
    _, batch = echo
    server.default = lambda body: hang(3.0)
    with api_analyzer(trainer, server) as judge:
        monkeypatch.setattr(trainer, "analyzer", judge)
        out = trainer.compute_advantages(batch)
    assert torch.equal(out, grpo_broadcast(batch))
    assert trainer.credit.reasons == ["analyzer_failure"] * 4 + ["zero_adv"] * 4
    m = last_metrics(trainer)
    assert m["taspo/analyzer_timeouts"] == 3 and m["taspo/analyzer_retries"] == 2


def test_step_deadline_from_the_config(trainer, echo, monkeypatch):
    """taspo.md §5 (step deadline), §7 item 18: `analyzer_step_deadline` bounds the whole analyzer stage of a step;
    matches still pending then are cancelled and their rows keep the GRPO broadcast."""
    _, batch = echo

    async def slow(text):
        await asyncio.sleep(5)
        return {"applicable": []}

    monkeypatch.setattr(trainer, "analyzer", Scripted(match=slow))
    monkeypatch.setattr(trainer.args, "analyzer_step_deadline", 0.4)
    start = time.monotonic()
    out = trainer.compute_advantages(batch)
    assert time.monotonic() - start < 3.0
    assert torch.equal(out, grpo_broadcast(batch))
    assert trainer.credit.reasons == ["analyzer_failure"] * 4 + ["zero_adv"] * 4
    assert last_metrics(trainer)["taspo/analyzer_failures/deadline"] == 4


class SimulatedAccelerator:
    """The trainer's accelerator as process `p` of 2 sees it; everything else is the real one."""

    def __init__(self, real, p: int):
        self._real, self.num_processes, self.process_index = real, 2, p
        self.is_main_process = p == 0

    def __getattr__(self, name):
        return getattr(self._real, name)


class Captured(Exception):
    pass


def split(batch, lo: int, hi: int):
    """Rows lo..hi of a RolloutBatch (one process's share)."""
    values = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        values[f.name] = v[lo:hi] if isinstance(v, torch.Tensor | list) else v
    return dataclasses.replace(batch, **values)


@pytest.mark.parametrize("tau_mode", ["fixed", "auto"])
def test_process_equivalence(trainer, echo, monkeypatch, tau_mode):
    """taspo.md §7 item 19, D14 (and conventions.md C12 for τ auto): two processes with 4 rows each, one task group
    spanning both (its successes on process 0, failures on both): the records are gathered, the main process makes
    every analyzer call once and broadcasts, each process scores its own rows; the halves' weights and advantages
    concatenate to the one-process result (up to float32 noise: the processes pad their rows to other widths).
    Alone, process 1 would see no success (the check has teeth)."""
    _, batch = echo
    monkeypatch.setattr(trainer.args, "taspo_kappa", 0.0)
    monkeypatch.setattr(trainer.args, "taspo_tau", 0.005)
    monkeypatch.setattr(trainer.args, "taspo_tau_mode", tau_mode)
    # rows 0-5 one group (rewards 0, 1, 0, 1, 0, 0), rows 6-7 another (0, 0): TRL's A, Bessel std + 1e-4
    groups = [0, 0, 0, 0, 0, 0, 1, 1]
    R = batch.rewards.tolist()
    mu, sd = statistics.fmean(R[:6]), statistics.stdev(R[:6])
    adv = torch.tensor([(r - mu) / (sd + 1e-4) for r in R[:6]] + [0.0, 0.0], dtype=batch.advantages.dtype)
    full = dataclasses.replace(batch, group_ids=torch.tensor(groups), advantages=adv)
    analyzer = trainer.analyzer
    one = trainer.compute_advantages(full)
    one_values, one_reasons, one_blocks = trainer.credit.values, trainer.credit.reasons, trainer.blocks
    one_tau = last_metrics(trainer)["taspo/tau"]
    # 1 extraction (rollouts 1, 3) + a match for each of rows 0-5 (each has a success other than itself)
    assert len(analyzer.calls) == 7 and one_reasons == [None] * 6 + ["zero_adv"] * 2

    halves = [split(full, 0, 4), split(full, 4, 8)]
    records, payload, gathered = {}, {}, {}
    state = {"p": 0, "phase": "capture"}

    def fake_gather_object(obj):
        if state["phase"] == "capture":
            records[state["p"]] = obj
            raise Captured
        return records[0] + records[1]

    def fake_broadcast(objects):
        if state["p"] == 0:
            payload["value"] = copy.deepcopy(objects)
        else:
            assert objects == [None]  # the non-main process computes nothing itself
        return copy.deepcopy(payload["value"])

    def fake_gather(t):
        assert tau_mode == "auto", "fixed τ gathers nothing"
        key = (state["p"], t.dtype)
        if state["phase"] == "dry":  # first pass: learn each process's d̂ and 𝒯
            gathered[key] = t.clone()
            return t
        return torch.cat([gathered[(0, t.dtype)], gathered[(1, t.dtype)]])

    monkeypatch.setattr(taspo_module, "gather_object", fake_gather_object)
    monkeypatch.setattr(taspo_module, "broadcast_object_list", fake_broadcast)
    monkeypatch.setattr(taspo_module, "gather", fake_gather)
    real = trainer.accelerator
    phases = ["capture", "dry", "run"] if tau_mode == "auto" else ["capture", "run"]
    for phase in phases:
        state["phase"] = phase
        analyzer.calls.clear()
        outs, values, reasons, blocks, taus = [], [], [], [], []
        for p in (0, 1):
            state["p"] = p
            analyzer.process = p
            monkeypatch.setattr(trainer, "accelerator", SimulatedAccelerator(real, p))
            try:
                outs.append(trainer.compute_advantages(halves[p]))
            except Captured:
                continue
            values.append(trainer.credit.values)
            reasons += trainer.credit.reasons
            blocks += trainer.blocks
            taus.append(last_metrics(trainer)["taspo/tau"])
    assert reasons == one_reasons and blocks == one_blocks
    # equal up to the float32 noise of the teacher pass: each process pads its own rows to its own width
    torch.testing.assert_close(torch.cat(values), one_values, rtol=0, atol=1e-4)
    torch.testing.assert_close(torch.cat(outs), one, rtol=0, atol=1e-4)
    assert any(abs(float(w) - 1) > 1e-3 for w in one_values[:6].flatten())  # non-trivial weights
    assert taus == pytest.approx([one_tau, one_tau], rel=1e-4) and (one_tau != 0.005) == (tau_mode == "auto")
    assert len(analyzer.calls) == 7 and {c.process for c in analyzer.calls} == {0}  # each call once, on the main one
    monkeypatch.setattr(trainer, "accelerator", real)
    trainer.compute_advantages(halves[1])
    assert trainer.credit.reasons == ["no_pi", "no_pi", "zero_adv", "zero_adv"]  # alone: no success in sight
