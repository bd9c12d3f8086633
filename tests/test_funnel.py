"""Pure-function tests of the Experience Funnel (arXiv 2609.08919, docs/methods/funnel.md): the three-state selection
(Eq. 1-3), the JSD attribution and its token weights (Eq. 4-5), the reverse-KL distillation loss and its blend with RL
(Eq. 6-9), the paired gates (Eq. 10-11), the textual state (rendering, edit ops and their budgets), the card editor,
the LLM editor against a real loopback OpenAI-compatible server, the seeded task split and `FunnelConfig` validation.
Covers docs/methods/funnel.md §7 properties 1-6, 11 and 13-15, and the pure parts of properties 7-10, 16 and 17 (no
model is trained); every expected value is derived by hand, in closed form, by a numpy re-implementation, by TRL's SDFT
loss utilities or by enumeration.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rewards.judge import Judge, JudgeConfig
from tests.judge_server import JudgeServer, error, ok
from trainers.funnel import (
    FunnelConfig,
    FunnelTrainer,
    GateResult,
    benefit,
    consolidation_loss,
    jsd_per_token,
    paired_gate,
    reverse_kl_per_token,
    selection_weights,
    token_weights,
    transition_weights,
    weighted_distill_loss,
)
from trainers.funnel_loop import split_tasks
from trainers.funnel_state import (
    CardEditor,
    EditOp,
    EditProposal,
    Entry,
    Evidence,
    LLMEditor,
    State,
    apply_edit_ops,
    render_state,
    task_family,
)

LN2 = math.log(2.0)
HEADER = "Notes from experience:"


def words(text: str) -> int:
    return len(text.split())


def np_log_softmax(x: np.ndarray) -> np.ndarray:
    z = x - x.max(-1, keepdims=True)
    return z - np.log(np.exp(z).sum(-1, keepdims=True))


def np_kl(logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
    """Σ_v p (log p − log q) with 0·log 0 = 0, in numpy."""
    p = np.exp(logp)
    with np.errstate(invalid="ignore", divide="ignore"):
        terms = np.where(p > 0, p * (logp - logq), 0.0)
    return terms.sum(-1)


def np_jsd(logp: np.ndarray, logq: np.ndarray) -> np.ndarray:
    p, q = np.exp(logp), np.exp(logq)
    m = 0.5 * (p + q)
    with np.errstate(invalid="ignore", divide="ignore"):
        logm = np.log(m)
    return 0.5 * np_kl(logp, logm) + 0.5 * np_kl(logq, logm)


def random_logps(shape, seed: int, dtype=torch.float64, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(scale * torch.randn(*shape, generator=g, dtype=dtype), dim=-1)


# ---------------------------------------------------------------------------------------------------------------------
# §7.1-3: transition table, strict benefit, selection determinism


def test_transition_table_keyed_by_task_and_missing_prev_is_zero():
    alpha = 0.37
    b_prev = {"a": 0, "b": 1, "c": 1, "d": 0}  # "e" is missing from b_prev: b_prev = 0
    b_new = {"a": 1, "b": 1, "c": 0, "d": 0, "e": 1, "f": 0}
    c = transition_weights(b_prev, b_new, alpha)
    assert c == {"a": 1.0, "b": alpha, "c": 0.0, "d": 0.0, "e": 1.0, "f": 0.0}
    assert set(c.values()) <= {0.0, alpha, 1.0}
    # every combination of the table, enumerated; bools and ints are both accepted
    for bp in (False, True):
        for bn in (False, True):
            expected = {(0, 1): 1.0, (1, 1): alpha, (1, 0): 0.0, (0, 0): 0.0}[(int(bp), int(bn))]
            assert transition_weights({"x": bp}, {"x": bn}, alpha) == {"x": expected}
            assert transition_weights({"x": int(bp)}, {"x": int(bn)}, alpha) == {"x": expected}
    assert transition_weights({"only_prev": 1}, {}, alpha) == {}  # keyed by the tasks of b_new


def test_benefit_is_strict_and_margin_is_strict():
    assert benefit([1, 0], [0, 1]) is False  # tie: 0.5 vs 0.5
    assert benefit([1, 1, 0, 0], [1, 0, 1, 0]) is False
    assert benefit([1, 0], [0, 0]) is True
    assert benefit([0, 0], [1, 0]) is False
    # gap exactly 0.5: not > 0.5, but > 0.49
    assert benefit([1, 1], [1, 0], margin=0.5) is False
    assert benefit([1, 1], [1, 0], margin=0.49) is True
    # means over different counts: 2/3 - 1/2 = 1/6
    assert benefit([1, 1, 0], [1, 0], margin=0.16) is True
    assert benefit([1, 1, 0], [1, 0], margin=0.17) is False
    with pytest.raises(ValueError):
        benefit([], [1])
    with pytest.raises(ValueError):
        benefit([1], [])


def expected_selection(rewards: dict, alpha: float, margin: float, prev_is_empty: bool) -> dict:
    """Eq. 1-3 written out independently."""
    out = {}
    for x, r in rewards.items():
        b_new = np.mean(r["new"]) - np.mean(r["free"]) > margin
        b_prev = (not prev_is_empty) and (np.mean(r["prev"]) - np.mean(r["free"]) > margin)
        out[x] = 1.0 if (b_new and not b_prev) else (alpha if (b_new and b_prev) else 0.0)
    return out


def random_rewards(n_tasks: int, n: int, seed: int) -> dict:
    rng = random.Random(seed)
    return {
        f"task-{i}": {cond: [float(rng.random() < 0.5) for _ in range(n)] for cond in ("free", "prev", "new")}
        for i in range(n_tasks)
    }


def test_selection_with_empty_prev_labels_every_useful_task_newly_useful():
    rewards = {
        "up": {"free": [0, 0], "prev": [1, 1], "new": [1, 0]},  # prev would also help: still 1 with an empty S_prev
        "tie": {"free": [1, 0], "prev": [1, 1], "new": [0, 1]},
        "down": {"free": [1, 1], "prev": [1, 1], "new": [0, 0]},
        "both": {"free": [0, 0], "prev": [1, 1], "new": [1, 1]},
    }
    assert selection_weights(rewards, 0.5, prev_is_empty=True) == {"up": 1.0, "tie": 0.0, "down": 0.0, "both": 1.0}
    # the same rewards with a real S_prev: "up" and "both" become persistently useful
    assert selection_weights(rewards, 0.5) == {"up": 0.5, "tie": 0.0, "down": 0.0, "both": 0.5}
    many = random_rewards(40, 4, seed=1)
    got = selection_weights(many, 0.25, prev_is_empty=True)
    assert got == expected_selection(many, 0.25, 0.0, prev_is_empty=True)
    assert set(got.values()) <= {0.0, 1.0}
    assert any(v == 1.0 for v in got.values()) and any(v == 0.0 for v in got.values())


@pytest.mark.parametrize("margin", [0.0, 0.25])
def test_selection_matches_eq_1_to_3_and_ignores_task_order(margin):
    rewards = random_rewards(60, 4, seed=7)
    expected = expected_selection(rewards, 0.5, margin, prev_is_empty=False)
    assert set(expected.values()) == {0.0, 0.5, 1.0}  # the fixture exercises all three labels
    first = selection_weights(rewards, 0.5, margin)
    assert first == expected
    assert set(first) == set(rewards)
    keys = list(rewards)
    for seed in range(5):
        random.Random(seed).shuffle(keys)
        shuffled = {k: rewards[k] for k in keys}
        assert selection_weights(shuffled, 0.5, margin) == expected
    assert selection_weights(rewards, 0.5, margin) == first  # repeated call


# ---------------------------------------------------------------------------------------------------------------------
# §7.4: JSD


def test_jsd_symmetric_zero_bounded_and_matches_numpy():
    logp, logq = random_logps((3, 5, 11), 0), random_logps((3, 5, 11), 1)
    d = jsd_per_token(logp, logq)
    assert d.shape == (3, 5)
    torch.testing.assert_close(d, jsd_per_token(logq, logp), rtol=0, atol=1e-12)
    assert torch.all(d >= 0) and torch.all(d <= LN2 + 1e-12)
    np.testing.assert_allclose(d.numpy(), np_jsd(logp.numpy(), logq.numpy()), rtol=0, atol=1e-10)
    assert torch.all(jsd_per_token(logp, logp).abs() <= 1e-12)


def test_jsd_disjoint_supports_reach_ln2_without_nan():
    ninf = -math.inf
    logp = torch.tensor([[0.0, ninf, ninf], [math.log(0.5), math.log(0.5), ninf]], dtype=torch.float64)
    logq = torch.tensor([[ninf, 0.0, ninf], [ninf, ninf, 0.0]], dtype=torch.float64)
    d = jsd_per_token(logp, logq)
    assert not torch.isnan(d).any()
    torch.testing.assert_close(d, torch.full((2,), LN2, dtype=torch.float64), rtol=0, atol=1e-12)
    # partial overlap with zero probabilities: P = (1/2, 1/2, 0), Q = (1/2, 0, 1/2), M = (1/2, 1/4, 1/4)
    # KL(P||M) = 1/2 ln 1 + 1/2 ln 2, the same for Q: JSD = ln(2) / 2
    p = torch.tensor([math.log(0.5), math.log(0.5), ninf], dtype=torch.float64)
    q = torch.tensor([math.log(0.5), ninf, math.log(0.5)], dtype=torch.float64)
    assert jsd_per_token(p, q).item() == pytest.approx(LN2 / 2, abs=1e-12)
    # identical distributions with zeros: exactly 0, no NaN
    assert jsd_per_token(p, p).item() == 0.0


def test_jsd_matches_trl_compute_divergence_alpha_half(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.sdft.loss_utils import compute_divergence

    for seed, dtype, atol in [(3, torch.float64, 1e-6), (4, torch.float32, 1e-6)]:
        g = torch.Generator().manual_seed(seed)
        student = torch.log_softmax(2.0 * torch.randn(4, 7, 33, generator=g, dtype=dtype), -1)
        teacher = torch.log_softmax(2.0 * torch.randn(4, 7, 33, generator=g, dtype=dtype), -1)
        ours = jsd_per_token(student, teacher)
        theirs = compute_divergence(student, teacher, alpha=0.5)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol)


# ---------------------------------------------------------------------------------------------------------------------
# §7.5-6: uniform reduction and token weight bounds


def test_zero_jsd_gives_unit_weights_at_model_tokens():
    mask = torch.tensor([[1, 1, 0, 1, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])
    omega = token_weights(torch.zeros(3, 5), mask, "linear_norm")
    assert torch.equal(omega, mask.float())
    # a nonzero D at an environment token does not count: the row's mean over model tokens is 0
    d = torch.zeros(3, 5)
    d[0, 2] = 0.6
    assert torch.equal(token_weights(d, mask, "linear_norm"), mask.float())
    # the rule holds without the stabiliser too: D̄ = 0 gives 1, not 0/0
    assert torch.equal(token_weights(torch.zeros(3, 5), mask, "linear_norm", eps=0.0), mask.float())


def test_uniform_reduction_equals_plain_reverse_kl_opsd(monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from trl.experimental.sdft.loss_utils import compute_divergence

    B, T, V = 3, 6, 13
    g = torch.Generator().manual_seed(11)
    s_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    t_logits = torch.randn(B, T, V, generator=g, dtype=torch.float64)
    student, teacher = torch.log_softmax(s_logits, -1), torch.log_softmax(t_logits, -1)
    # model tokens, an environment gap in the middle, right padding
    mask = torch.tensor([[1, 1, 0, 0, 1, 1], [1, 1, 1, 1, 1, 1], [1, 0, 1, 0, 0, 0]])
    kl = reverse_kl_per_token(student, teacher)
    omega = token_weights(torch.zeros(B, T, dtype=torch.float64), mask, "linear_norm")
    loss = weighted_distill_loss(kl, omega, torch.ones(B, dtype=torch.float64), mask)

    # numpy: KL(student || teacher) per token, masked mean per row, then mean over rows
    s_np = np_log_softmax(s_logits.numpy())
    t_np = np_log_softmax(t_logits.numpy())
    kl_np = (np.exp(s_np) * (s_np - t_np)).sum(-1)
    m = mask.numpy().astype(float)
    expected = np.mean((kl_np * m).sum(1) / m.sum(1))
    assert loss.item() == pytest.approx(expected, abs=1e-6, rel=0)
    np.testing.assert_allclose(kl.numpy(), kl_np, rtol=0, atol=1e-10)

    # TRL's SDFT divergence with alpha=1 (reverse KL) per token, the same reduction
    trl_kl = compute_divergence(student, teacher, alpha=1.0)
    mf = mask.double()
    trl_loss = ((trl_kl * mf).sum(1) / mf.sum(1)).mean()
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-6, rel=0)


def test_linear_norm_hand_example_with_clip_and_padding():
    # row 0: model tokens D = (0, 0.1, 0.2, 0.5), mean 0.2; the environment token's D = 0.69 is ignored
    # omega = 1 + D / 0.2 = (1, 1.5, 2, 3.5), 0 at the environment token
    # row 1: D = (0, 0, 0, 0, 1), mean 0.2, kappa = 2: 1 + 2 * 5 = 11 clipped to omega_max = 5; 1 elsewhere
    d = torch.tensor([[0.0, 0.1, 0.69, 0.2, 0.5], [0.0, 0.0, 0.0, 0.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 1]])
    eps = 1e-8
    row0 = token_weights(d[:1], mask[:1], "linear_norm", kappa=1.0, omega_max=5.0, eps=eps)
    expected0 = torch.tensor(
        [[1.0, 1 + 0.1 / (0.2 + eps), 0.0, 1 + 0.2 / (0.2 + eps), 1 + 0.5 / (0.2 + eps)]], dtype=torch.float64
    )
    torch.testing.assert_close(row0, expected0, rtol=0, atol=1e-12)
    torch.testing.assert_close(row0, torch.tensor([[1.0, 1.5, 0.0, 2.0, 3.5]]).double(), rtol=0, atol=1e-6)
    row1 = token_weights(d[1:], mask[1:], "linear_norm", kappa=2.0, omega_max=5.0, eps=eps)
    assert row1.tolist() == [[1.0, 1.0, 1.0, 1.0, 5.0]]
    # both rows in one batch: rows are normalised independently
    both = token_weights(d, mask, "linear_norm", kappa=1.0, omega_max=5.0, eps=eps)
    torch.testing.assert_close(both[0], expected0[0], rtol=0, atol=1e-12)
    assert both[1].tolist() == [1.0, 1.0, 1.0, 1.0, 5.0]  # 1 + 1 * 5 = 6 -> 5


def test_linear_norm_is_scale_invariant_per_row():
    g = torch.Generator().manual_seed(5)
    d = torch.rand(4, 9, generator=g, dtype=torch.float64) * LN2
    mask = (torch.rand(4, 9, generator=g) < 0.7).long()
    mask[:, 0] = 1
    base = token_weights(d, mask, "linear_norm", kappa=1.5, omega_max=3.0)
    row_mean = (d[2] * mask[2]).sum() / mask[2].sum()
    assert 0.05 * row_mean > 1e-2  # so eps = 1e-8 moves omega by less than 1e-5 at every factor below
    for factor in (0.05, 0.37, 1.0, 6.5):
        scaled = d.clone()
        scaled[2] *= factor  # one row only: that row's omega is unchanged, the others untouched
        torch.testing.assert_close(token_weights(scaled, mask, "linear_norm", kappa=1.5, omega_max=3.0), base,
                                   rtol=0, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("mode", ["linear_norm", "none", "topk_frac"])
def test_weight_bounds_and_exact_zero_off_mask(mode):
    g = torch.Generator().manual_seed(9)
    d = torch.rand(6, 17, generator=g, dtype=torch.float64) * LN2
    d[1] = 0.0  # an all-zero row
    d[2, ::3] = 0.0
    mask = (torch.rand(6, 17, generator=g) < 0.6).long()
    mask[3] = 0  # a row without model tokens
    for kappa, omega_max in [(1.0, 5.0), (10.0, 2.5), (0.0, 1.0)]:
        omega = token_weights(d, mask, mode, kappa=kappa, omega_max=omega_max, topk=0.3)
        assert omega.shape == d.shape and omega.dtype == d.dtype
        assert torch.all(omega >= 0) and torch.all(omega <= omega_max)
        assert torch.all(omega[mask == 0] == 0.0)
        assert torch.all(omega[mask == 1] >= 1.0)  # D >= 0, so the baseline 1 is a floor at model tokens
    if mode == "none":
        assert torch.equal(token_weights(d, mask, mode), mask.double())


def test_topk_frac_hand_example():
    # model tokens are positions 0-4 (M = 5); position 5 is an environment token with the largest D
    # sorted model D: 0.5, 0.5, 0.5, 0.3, 0.1; the bonus goes to D_t > D_(k+1), k = ceil(q·M)
    d = torch.tensor([[0.3, 0.5, 0.5, 0.1, 0.5, 0.9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1, 0]])
    # q = 0.4: k = ceil(2.0) = 2, but D_(2) = D_(3) = 0.5: three tokens tie across the cut, none gets the bonus
    assert token_weights(d, mask, "topk_frac", kappa=1.0, topk=0.4).tolist() == [[1, 1, 1, 1, 1, 0]]
    # q = 0.3: k = ceil(1.5) = 2 as well; q = 0.1: k = ceil(0.5) = 1, D_(2) = 0.5, the same tie
    assert token_weights(d, mask, "topk_frac", kappa=1.0, topk=0.3).tolist() == [[1, 1, 1, 1, 1, 0]]
    assert token_weights(d, mask, "topk_frac", kappa=1.0, topk=0.1).tolist() == [[1, 1, 1, 1, 1, 0]]
    # q = 0.5: k = ceil(2.5) = 3, D_(4) = 0.3 < 0.5: all three tied tokens, no tie across the cut
    assert token_weights(d, mask, "topk_frac", kappa=1.0, topk=0.5).tolist() == [[1, 2, 2, 1, 2, 0]]
    # q = 0.8: k = 4, D_(5) = 0.1: every token above 0.1; kappa = 10 is clipped at omega_max = 4
    assert token_weights(d, mask, "topk_frac", kappa=10.0, omega_max=4.0, topk=0.8).tolist() == [[4, 4, 4, 1, 4, 0]]
    # q = 1: k = M, every model token
    assert token_weights(d, mask, "topk_frac", kappa=0.5, topk=1.0).tolist() == [[1.5] * 5 + [0.0]]


@pytest.mark.parametrize("q", [0.05, 0.2, 1.0])
def test_topk_frac_a_single_model_token_gets_the_bonus(q):
    """M = 1: k = ceil(q·1) = 1 = M for every q > 0, so Eq. 5 gives the one token 1 + κ (clipped at ω_max); the rule
    that a row of equal D gets ω = 1 is for rows of several tokens (the old code gave 1 here)."""
    d = torch.tensor([[0.0, 0.7, 0.2], [0.0, 0.0, 0.5]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 0], [1, 0, 0]])  # one model token in each row (D = 0 in the second)
    assert token_weights(d, mask, "topk_frac", kappa=1.0, topk=q).tolist() == [[0, 2, 0], [2, 0, 0]]
    assert token_weights(d, mask, "topk_frac", kappa=9.0, omega_max=3.0, topk=q).tolist() == [[0, 3, 0], [3, 0, 0]]


def test_topk_frac_ties_at_the_threshold_hand_example():
    # M = 6, sorted D: 0.7, 0.4, 0.4, 0.4, 0.2, 0.1
    d = torch.tensor([[0.2, 0.7, 0.4, 0.4, 0.1, 0.4]], dtype=torch.float64)
    mask = torch.ones(1, 6, dtype=torch.long)
    # q = 0.5: k = 3; D_(3) = D_(4) = 0.4 tie across the cut: only 0.7 (> D_(4)) gets 1 + κ = 3, one token, not 3
    assert token_weights(d, mask, "topk_frac", kappa=2.0, topk=0.5).tolist() == [[1, 3, 1, 1, 1, 1]]
    # q = 0.6: k = ceil(3.6) = 4; D_(5) = 0.2: 0.7 and the three 0.4s, no tie across the cut
    assert token_weights(d, mask, "topk_frac", kappa=2.0, topk=0.6).tolist() == [[1, 3, 3, 3, 1, 3]]
    # q = 0.2: k = ceil(1.2) = 2; D_(3) = 0.4 tie with D_(2): again only 0.7
    assert token_weights(d, mask, "topk_frac", kappa=2.0, topk=0.2).tolist() == [[1, 3, 1, 1, 1, 1]]
    # q = 0.1: k = 1; D_(2) = 0.4 < 0.7, no tie: the single largest token
    assert token_weights(d, mask, "topk_frac", kappa=2.0, topk=0.1).tolist() == [[1, 3, 1, 1, 1, 1]]


def test_topk_frac_all_equal_gives_unit_weights():
    """funnel.md §7 item 5 and Eq. 5: a row of several model tokens whose D are all equal gets ω = 1 at every model
    token, whatever q (k < M and k = M alike), 0 off them; D at environment tokens does not count. (A row of one
    model token is not a tie: test_topk_frac_a_single_model_token_gets_the_bonus.)"""
    d = torch.tensor([
        [0.3, 0.3, 0.3, 0.3, 0.3],
        [0.0, 0.0, 0.0, 0.0, 0.0],
        [0.2, 0.9, 0.2, 0.2, 0.0],  # model tokens 0, 2, 3 all 0.2; the environment token's 0.9 is ignored
    ], dtype=torch.float64)  # fmt: skip
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]])
    for q in (0.0, 0.2, 0.5, 1.0):
        omega = token_weights(d, mask, "topk_frac", kappa=1.0, topk=q)
        assert torch.equal(omega, mask.double()), q
    # with D ≡ 0 the loss is plain reverse-KL OPSD, as with linear_norm (D2)
    zeros = torch.zeros(3, 5, dtype=torch.float64)
    assert torch.equal(token_weights(zeros, mask, "topk_frac"), token_weights(zeros, mask, "linear_norm"))


def test_topk_frac_count_matches_ceil_on_random_rows():
    g = torch.Generator().manual_seed(2)
    for q in (0.05, 0.2, 0.35):
        d = torch.rand(5, 23, generator=g, dtype=torch.float64)  # continuous: no ties
        mask = (torch.rand(5, 23, generator=g) < 0.8).long()
        omega = token_weights(d, mask, "topk_frac", kappa=1.0, topk=q)
        for b in range(5):
            m = int(mask[b].sum())
            k = math.ceil(q * m - 1e-9)
            idx = [t for t in range(23) if mask[b, t]]
            top = sorted(idx, key=lambda t: -d[b, t].item())[:k]
            expected = [2.0 if t in top else (1.0 if mask[b, t] else 0.0) for t in range(23)]
            assert omega[b].tolist() == expected


def test_topk_frac_with_ties_matches_every_tie_break_rule():
    """Random rows of D drawn from three values (many ties): a model token gets 1 + κ iff it is among the k largest
    under every ordering of the ties, i.e. at most k model tokens have D >= its D (plain Python); never more than k
    tokens get the bonus, and the count is k whenever there is no tie across the cut."""
    rng = random.Random(4)
    for _ in range(200):
        T = rng.randint(1, 9)
        d = torch.tensor([[rng.choice([0.0, 0.25, 0.5]) for _ in range(T)]], dtype=torch.float64)
        mask = torch.tensor([[int(rng.random() < 0.8) for _ in range(T)]])
        q = rng.choice([0.1, 0.2, 0.5, 0.75, 1.0])
        omega = token_weights(d, mask, "topk_frac", kappa=1.0, topk=q)[0].tolist()
        model = [t for t in range(T) if mask[0, t]]
        values = [d[0, t].item() for t in model]
        k = math.ceil(q * len(model) - 1e-9)
        same = len(values) > 1 and len(set(values)) == 1  # a tie needs two tokens: one token alone is the top 1
        for t in range(T):
            at_least = sum(v >= d[0, t].item() for v in values)
            want = 0.0 if not mask[0, t] else (2.0 if at_least <= k and not same else 1.0)
            assert omega[t] == want, (d, mask, q, t)
        cut_tie = 0 < k < len(values) and sorted(values, reverse=True)[k - 1] == sorted(values, reverse=True)[k]
        assert omega.count(2.0) <= k
        if not cut_tie and not same:
            assert omega.count(2.0) == k


def test_token_weights_rejects_unknown_mode_and_never_carry_gradient():
    d = torch.rand(2, 4, dtype=torch.float64, requires_grad=True)
    with pytest.raises(ValueError):
        token_weights(d, torch.ones(2, 4), "x")
    for mode in ("linear_norm", "none", "topk_frac"):
        assert not token_weights(d, torch.ones(2, 4), mode).requires_grad


# ---------------------------------------------------------------------------------------------------------------------
# §7.7-9 (pure parts): losses, gradients, KL direction


def test_weighted_distill_loss_hand_example_with_alpha_rows():
    inf_free = 123.0
    kl = torch.tensor(
        [[1.0, 2.0, 9.0], [4.0, 2.0, 6.0], [inf_free, inf_free, inf_free], [7.0, 7.0, 7.0]], dtype=torch.float64
    )
    omega = torch.tensor([[1.0, 3.0, 5.0], [1.0, 1.0, 2.0], [2.0, 2.0, 2.0], [1.0, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 1], [0, 0, 0]])
    # row 0: (1*1 + 3*2) / 4 = 1.75 (its masked omega 5 and KL 9 do not count); row 1: (4 + 2 + 12) / 4 = 4.5
    c = torch.tensor([1.0, 0.5, 0.0, 0.0], dtype=torch.float64)
    assert weighted_distill_loss(kl, omega, c, mask).item() == pytest.approx((1.75 + 0.5 * 4.5) / 2, abs=1e-12)
    # a selected row without model tokens has l_b = 0 but counts in #{c > 0}
    c2 = torch.tensor([1.0, 0.5, 0.0, 1.0], dtype=torch.float64)
    assert weighted_distill_loss(kl, omega, c2, mask).item() == pytest.approx((1.75 + 2.25 + 0.0) / 3, abs=1e-12)
    # the c = 0 row contributes nothing: any KL values there give the same loss
    for value in (0.0, 1e6, -5.0):
        kl2 = kl.clone()
        kl2[2] = value
        assert weighted_distill_loss(kl2, omega, c, mask).item() == pytest.approx(2.0, abs=1e-12)


def test_weighted_distill_loss_all_unselected_is_exact_zero_with_zero_gradient():
    logits = torch.randn(3, 4, 7, dtype=torch.float64, requires_grad=True)
    teacher = random_logps((3, 4, 7), 8)
    kl = reverse_kl_per_token(torch.log_softmax(logits, -1), teacher)
    omega = token_weights(torch.rand(3, 4, dtype=torch.float64), torch.ones(3, 4))
    loss = weighted_distill_loss(kl, omega, torch.zeros(3, dtype=torch.float64), torch.ones(3, 4))
    assert loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    assert logits.grad is not None and torch.all(logits.grad == 0)


def test_no_gradient_reaches_omega_c_or_teacher():
    student_logits = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    teacher_logps = random_logps((2, 5, 6), 12).requires_grad_(True)
    omega = torch.rand(2, 5, dtype=torch.float64).add(1.0).requires_grad_(True)
    c = torch.tensor([1.0, 0.5], dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 1, 1, 1]])
    kl = reverse_kl_per_token(torch.log_softmax(student_logits, -1), teacher_logps)
    loss = weighted_distill_loss(kl, omega, c, mask)
    loss.backward()
    assert student_logits.grad is not None and student_logits.grad.abs().sum() > 0
    assert omega.grad is None and c.grad is None and teacher_logps.grad is None


def test_reverse_kl_direction_hand_example():
    s = torch.tensor([0.5, 0.5], dtype=torch.float64).log()
    t = torch.tensor([0.9, 0.1], dtype=torch.float64).log()
    # KL(s||t) = 0.5 ln(0.5/0.9) + 0.5 ln(0.5/0.1) = ln(5/3); KL(t||s) = 0.9 ln 1.8 + 0.1 ln 0.2
    reverse, forward = math.log(5 / 3), 0.9 * math.log(1.8) + 0.1 * math.log(0.2)
    assert abs(reverse - forward) > 0.1
    assert reverse_kl_per_token(s, t).item() == pytest.approx(reverse, abs=1e-12)
    assert reverse_kl_per_token(t, s).item() == pytest.approx(forward, abs=1e-12)
    logps = random_logps((3, 4, 9), 21)
    assert torch.all(reverse_kl_per_token(logps, logps) == 0)
    # a student that puts no mass where the teacher has none: no NaN, and 0·log 0 = 0
    s0 = torch.tensor([0.0, -math.inf], dtype=torch.float64)
    t0 = torch.tensor([math.log(0.5), math.log(0.5)], dtype=torch.float64)
    assert reverse_kl_per_token(s0, t0).item() == pytest.approx(LN2, abs=1e-12)


def test_reverse_kl_gradient_matches_finite_differences_and_closed_form():
    g = torch.Generator().manual_seed(31)
    z = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    teacher = random_logps((2, 3, 5), 32)
    weights = torch.rand(2, 3, generator=g, dtype=torch.float64)

    def f(logits):
        return (weights * reverse_kl_per_token(torch.log_softmax(logits, -1), teacher)).sum()

    zz = z.clone().requires_grad_(True)
    f(zz).backward()
    grad = zz.grad
    h = 1e-6
    fd = torch.zeros_like(z)
    flat = z.view(-1)
    for i in range(flat.numel()):
        plus, minus = flat.clone(), flat.clone()
        plus[i] += h
        minus[i] -= h
        fd.view(-1)[i] = (f(plus.view_as(z)) - f(minus.view_as(z))) / (2 * h)
    torch.testing.assert_close(grad, fd, rtol=0, atol=1e-7)
    # closed form: d KL(softmax(z) || t) / dz = p * (log p - log t - KL)
    p_log = torch.log_softmax(z, -1)
    p = p_log.exp()
    kl = (p * (p_log - teacher)).sum(-1, keepdim=True)
    torch.testing.assert_close(grad, weights.unsqueeze(-1) * p * (p_log - teacher - kl), rtol=0, atol=1e-12)
    assert teacher.grad is None


def lm_head(H: int, V: int, bias: bool, g: torch.Generator) -> torch.nn.Linear:
    head = torch.nn.Linear(H, V, bias=bias)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g))
    return head


def logps_of(hidden: torch.Tensor, head: torch.nn.Linear, tau: float) -> torch.Tensor:
    """log softmax((hidden @ W^T + b) / τ) in float64, (N, V) logits built in full: what the pure functions read."""
    logits = hidden.double() @ head.weight.double().T
    if head.bias is not None:
        logits = logits + head.bias.double()
    return torch.log_softmax(logits / tau, dim=-1)


@pytest.mark.parametrize("heads", ["two", "two_with_bias", "shared_with_bias"])
@pytest.mark.parametrize("tau", [0.7, 1.6])
@pytest.mark.parametrize("N, V", [(37, 50), (5, 33_000), (4_100, 11)])  # 33 000 > TRL's vocabulary chunk (32 768),
def test_training_divergence_is_the_pure_functions(heads, tau, N, V):  # 4 100 > its token chunk (4 096)
    """The divergence the trainer runs, `FunnelTrainer._divergence` (TRL's chunked kernel, no (N, V) logits), equals
    the pure functions on full logits: β = 0.5 (`_attribution`'s D_t, Eq. 4) is `jsd_per_token`, β = 1 (the trained
    KL_t, Eq. 6) is `reverse_kl_per_token`, at a temperature τ ≠ 1, on random hidden states and LM heads (with and
    without bias; one head shared by student and teacher as with the LoRA teacher adapter, D3). β = 1 is
    backpropagated in training: its gradient reaches the student's hidden states and head exactly as the pure
    function's (a weighted sum, like Eq. 7), and neither path sends any to the teacher's side. β = 0.5 runs under
    no_grad (`_attribution`), so only its value matters. The config exposes no β: these two are the trainer's."""
    H = 6
    g = torch.Generator().manual_seed(N + V + int(10 * tau))
    head_s = lm_head(H, V, heads != "two", g)
    head_t = head_s if heads == "shared_with_bias" else lm_head(H, V, heads != "two", g)
    h_s = torch.randn(N, H, generator=g).requires_grad_(True)  # (N, H) float32, as the trainer's hidden states
    h_t = torch.randn(N, H, generator=g).requires_grad_(True)  # a leaf, to see that no gradient reaches it
    weights = torch.rand(N, generator=g, dtype=torch.float64) + 0.5  # ω-like positive weights
    host = SimpleNamespace(args=SimpleNamespace(distill_temperature=tau))  # all `_divergence` reads of the trainer

    jsd = FunnelTrainer._divergence(host, h_s, head_s, h_t, head_t, 0.5).detach()  # (N,)
    with torch.no_grad():
        want = jsd_per_token(logps_of(h_s, head_s, tau), logps_of(h_t, head_t, tau))
    assert jsd.shape == (N,) and float(want.max()) > 1e-2  # the heads differ: the check is not near 0 = 0
    torch.testing.assert_close(jsd.double(), want, rtol=1e-4, atol=1e-6)

    kl = FunnelTrainer._divergence(host, h_s, head_s, h_t, head_t, 1.0)  # (N,)
    (weights.float() * kl).sum().backward()
    kernel = [h_s.grad.clone(), head_s.weight.grad.clone()] + ([head_s.bias.grad.clone()] if heads != "two" else [])
    assert h_t.grad is None and (heads == "shared_with_bias" or head_t.weight.grad is None)
    for p in (h_s, *head_s.parameters(), *head_t.parameters()):
        p.grad = None
    student = logps_of(h_s, head_s, tau)
    teacher = logps_of(h_t, head_t, tau)  # a live graph on a shared head: the pure function detaches it itself
    ref = reverse_kl_per_token(student, teacher)
    torch.testing.assert_close(kl.double(), ref, rtol=1e-4, atol=1e-6)
    (weights * ref).sum().backward()
    pure = [h_s.grad, head_s.weight.grad] + ([head_s.bias.grad] if heads != "two" else [])
    assert all(float(p.abs().max()) > 1e-3 for p in pure)  # gradients to compare, not zeros
    for a, b in zip(kernel, pure, strict=True):
        # the kernel accumulates in float32: seen up to 4e-6 of the largest entry off the float64 reference
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-4, atol=1e-5 * float(b.abs().max()))
    assert h_t.grad is None and (heads == "shared_with_bias" or head_t.weight.grad is None)


def test_consolidation_loss_endpoints_and_blend():
    rl = torch.tensor(2.0, requires_grad=True)
    distill = torch.tensor(-6.0, requires_grad=True)
    assert consolidation_loss(rl, distill, 0.0) is rl
    assert consolidation_loss(rl, distill, 1.0) is distill
    blend = consolidation_loss(rl, distill, 0.25)
    assert blend.item() == pytest.approx(0.75 * 2.0 + 0.25 * -6.0)  # = 0
    blend = consolidation_loss(rl, distill, 0.5)
    assert blend.item() == pytest.approx(-2.0)
    blend.backward()
    assert rl.grad.item() == pytest.approx(0.5) and distill.grad.item() == pytest.approx(0.5)


# ---------------------------------------------------------------------------------------------------------------------
# §7.10-11: gates


def np_gate_stats(cand, inc):
    d = np.asarray(cand, float).mean(1) - np.asarray(inc, float).mean(1)
    return d.mean(), d.std(ddof=1) / math.sqrt(len(d))


CAND = [[1, 1], [1, 0], [0, 1], [1, 1]]
INC = [[0, 1], [0, 0], [0, 1], [1, 0]]  # d = (0.5, 0.5, 0, 0.5): mean 0.375, std 0.25, SE 0.125


def test_improvement_gate_statistics_and_decisions():
    r = paired_gate(CAND, INC, z=1.0)
    assert isinstance(r, GateResult)
    assert (r.mean_diff, r.se, r.tasks) == (0.375, 0.125, 4)
    assert r.candidate == pytest.approx(6 / 8) and r.incumbent == pytest.approx(3 / 8)
    assert r.accept is True
    assert paired_gate(CAND, INC, z=2.9).accept is True
    assert paired_gate(CAND, INC, z=3.0).accept is False  # d̄ = 3·SE exactly: not strictly greater
    assert paired_gate(INC, CAND, z=0.0).accept is False  # d̄ < 0
    assert paired_gate([[1], [0]], [[0], [1]], z=0.0).accept is False  # d̄ = 0 with SE > 0
    assert r.as_dict() == {"accept": True, "mean_diff": 0.375, "se": 0.125, "candidate": 0.75, "incumbent": 0.375,
                           "tasks": 4}  # fmt: skip
    rng = np.random.default_rng(0)
    for _ in range(20):
        cand, inc = rng.integers(0, 2, (9, 3)), rng.integers(0, 2, (9, 3))
        mean, se = np_gate_stats(cand, inc)
        got = paired_gate(cand.tolist(), inc.tolist(), z=1.0)
        assert got.mean_diff == pytest.approx(mean, abs=1e-12) and got.se == pytest.approx(se, abs=1e-12)
        assert got.accept == bool(mean > se and mean > 0)


@pytest.mark.parametrize("mode", ["improve", "non_inferior"])
def test_identical_candidate_rejected_by_improve_accepted_by_non_inferior(mode):
    rng = np.random.default_rng(3)
    for _ in range(5):
        same = rng.random((6, 2)).tolist()
        r = paired_gate(same, same, z=1.0, mode=mode)
        assert r.mean_diff == 0.0 and r.se == 0.0
        assert r.accept is (mode == "non_inferior")
    # a clearly better candidate passes both
    assert paired_gate([[1, 1]] * 5, [[0, 0]] * 5, z=1.0, mode=mode).accept is True


def test_non_inferiority_gate():
    # worse by more than z·SE: d̄ = -0.375, SE = 0.125
    assert paired_gate(INC, CAND, z=1.0, mode="non_inferior").accept is False
    assert paired_gate(INC, CAND, z=3.0, mode="non_inferior").accept is True  # d̄ = -3·SE exactly: ≥ holds
    # slightly worse, within z·SE: d = (-0.5, 0.5, 0, -0.5)
    cand = [[0, 0], [1, 1], [1, 0], [0, 1]]
    inc = [[1, 0], [1, 0], [1, 0], [1, 1]]
    mean, se = np_gate_stats(cand, inc)
    assert mean == pytest.approx(-0.125) and -se < mean < 0
    r = paired_gate(cand, inc, z=1.0, mode="non_inferior")
    assert r.accept is True and r.mean_diff == pytest.approx(mean) and r.se == pytest.approx(se)
    assert paired_gate(cand, inc, z=0.5, mode="non_inferior").accept is bool(mean >= -0.5 * se)


def test_gate_rejects_bad_shapes_and_modes():
    with pytest.raises(ValueError):
        paired_gate([[1, 0], [1, 1]], [[1, 0, 1], [1, 1, 0]])  # shapes differ
    with pytest.raises(ValueError):
        paired_gate([[1, 0]], [[0, 0]])  # one task
    with pytest.raises(ValueError):
        paired_gate([1, 0, 1], [0, 0, 1])  # not (tasks, n)
    with pytest.raises(ValueError):
        paired_gate(CAND, INC, mode="better")


# ---------------------------------------------------------------------------------------------------------------------
# §7.13: rendering


def test_render_state_scope_filter_and_numeric_id_order():
    assert render_state(State()) is None
    assert render_state(State(), "shoes") is None
    entries = [
        Entry("E10", "tenth global"),
        Entry("E2", "second shoes", scope="shoes"),
        Entry("E3", "third bags", scope="bags"),
        Entry("E1", "first global"),
    ]
    state = State(entries, next_id=11)
    expected = f"{HEADER}\n- first global\n- second shoes\n- tenth global"
    assert render_state(state, "shoes") == expected
    assert render_state(state, "bags") == f"{HEADER}\n- first global\n- third bags\n- tenth global"
    assert render_state(state, "*") == f"{HEADER}\n- first global\n- tenth global"
    assert render_state(state, "hats") == f"{HEADER}\n- first global\n- tenth global"
    only_bags = State([Entry("E3", "third bags", scope="bags")], next_id=4)
    assert render_state(only_bags, "shoes") is None
    # deterministic: same state, reordered entries, a deep copy -> the same bytes
    a = render_state(state, "shoes").encode()
    assert render_state(copy.deepcopy(state), "shoes").encode() == a
    assert render_state(State(list(reversed(entries)), next_id=11), "shoes").encode() == a
    assert task_family({"family": "shoes"}) == "shoes" and task_family({"x": 1}) == "*"


# ---------------------------------------------------------------------------------------------------------------------
# §7.14: edit ops


def tokens_of(state: State) -> int:
    """The largest rendered size over the families the state mentions, counted in words, written out by hand:
    the header (3 words) plus "- " and the words of each visible entry."""
    families = {e.scope for e in state.entries if e.scope != "*"} or {"*"}
    best = 0
    for f in families:
        visible = [e for e in state.entries if e.scope in ("*", f)]
        best = max(best, 3 + sum(1 + words(e.text) for e in visible) if visible else 0)
    return best


LIMITS = dict(max_entries=4, max_entry_chars=20, max_ops=3, token_budget=25, count_tokens=words)


def base_state() -> State:
    return State(
        [
            Entry("E1", "search first", created_round=1, updated_round=1),
            Entry("E2", "buy last", scope="shoes", created_round=1, updated_round=2),
        ],
        next_id=3,
    )


def test_invalid_ops_are_dropped_with_reasons():
    state = base_state()
    ops = [
        EditOp(op="modify", id="E99", text="x"),
        EditOp(op="delete", id="E7"),
        EditOp(op="add", text="y" * 21),
        EditOp(op="add", text="   "),
        EditOp(op="modify", id="E1", text=""),
        EditOp(op="add", text="z" * 20),  # exactly max_entry_chars: kept
    ]
    out, applied, dropped = apply_edit_ops(state, ops, 3, **LIMITS)
    assert [d["reason"] for d in dropped] == [
        "unknown id 'E99'",
        "unknown id 'E7'",
        "text longer than 20 characters",
        "empty text",
        "empty text",
    ]
    assert applied == [{"op": "add", "text": "z" * 20}]
    assert [e.id for e in out.entries] == ["E1", "E2", "E3"] and out.entries[2].text == "z" * 20
    assert out.entries[0].text == "search first"
    # residual mode: every add is dropped, modify and delete still apply
    ops = [EditOp(op="add", text="new"), EditOp(op="delete", id="E2"), EditOp(op="modify", id="E1", text="look")]
    out, applied, dropped = apply_edit_ops(state, ops, 3, residual=True, **LIMITS)
    assert [d["reason"] for d in dropped] == ["add in residual mode"]
    assert [(e.id, e.text) for e in out.entries] == [("E1", "look")] and out.next_id == 3
    # an id deleted earlier in the same batch is unknown afterwards
    out, applied, dropped = apply_edit_ops(
        state, [EditOp(op="delete", id="E1"), EditOp(op="modify", id="E1", text="again")], 3, **LIMITS
    )
    assert [d["reason"] for d in dropped] == ["unknown id 'E1'"] and out.ids() == ["E2"]


def test_ids_are_never_reused_after_deletion():
    state = base_state()
    out, _, _ = apply_edit_ops(state, [EditOp(op="delete", id="E2"), EditOp(op="add", text="fresh")], 4, **LIMITS)
    assert out.ids() == ["E1", "E3"] and out.next_id == 4
    out, _, _ = apply_edit_ops(out, [EditOp(op="delete", id="E3"), EditOp(op="add", text="again")], 5, **LIMITS)
    assert out.ids() == ["E1", "E4"]
    again = State.from_dict(json.loads(json.dumps(out.to_dict())))  # a state restored from funnel.json
    out, _, _ = apply_edit_ops(again, [EditOp(op="add", text="more")], 6, **LIMITS)
    assert out.ids() == ["E1", "E4", "E5"]
    # many rounds of random deletes and adds: an added id has never been seen before
    rng = random.Random(0)
    state, seen = base_state(), {"E1", "E2"}
    for k in range(40):
        ops = [EditOp(op="delete", id=rng.choice(state.ids()))] if state.entries and rng.random() < 0.6 else []
        ops.append(EditOp(op="add", text=f"note {k}"))
        new, _, _ = apply_edit_ops(state, ops, k, max_entries=3, max_entry_chars=50, max_ops=4, token_budget=1000,
                                   count_tokens=words)  # fmt: skip
        added = set(new.ids()) - set(state.ids())
        assert not (added & seen)
        seen |= added
        state = new


def entry_fields(e: Entry) -> tuple:
    return (e.id, e.text, e.scope, e.kind, e.origin, e.created_round, e.updated_round)


def test_modify_bumps_updated_round_keeps_created_round():
    state = base_state()
    out, _, _ = apply_edit_ops(state, [EditOp(op="modify", id="E2", text="  buy at the end ")], 7, **LIMITS)
    assert entry_fields(out.entries[1]) == ("E2", "buy at the end", "shoes", "skill", "manual", 1, 7)
    out, _, _ = apply_edit_ops(state, [EditOp(op="modify", id="E1", scope="bags", kind="guidance")], 8, **LIMITS)
    assert entry_fields(out.entries[0]) == ("E1", "search first", "bags", "guidance", "manual", 1, 8)
    out, _, _ = apply_edit_ops(state, [EditOp(op="add", text="new note", scope="hats")], 9, origin="card", **LIMITS)
    assert entry_fields(out.entries[-1]) == ("E3", "new note", "hats", "skill", "card", 9, 9)
    assert [entry_fields(e) for e in state.entries] == [entry_fields(e) for e in base_state().entries]


def test_budgets_hand_examples():
    state = State([Entry("E1", "a")], next_id=2)
    adds = [EditOp(op="add", text=t) for t in ("b", "c", "d", "e")]
    # max_ops: the first 3 valid ops, in order
    out, applied, dropped = apply_edit_ops(state, adds, 1, max_entries=9, max_entry_chars=9, max_ops=3,
                                           token_budget=99, count_tokens=words)  # fmt: skip
    assert [a["text"] for a in applied] == ["b", "c", "d"] and dropped[0]["reason"] == "over max_ops_per_round"
    # max_entries = 2: only one add fits; trailing ops are dropped
    out, applied, dropped = apply_edit_ops(state, adds, 1, max_entries=2, max_entry_chars=9, max_ops=9,
                                           token_budget=99, count_tokens=words)  # fmt: skip
    assert out.ids() == ["E1", "E2"] and [a["text"] for a in applied] == ["b"] and len(dropped) == 3
    assert all(d["reason"] == "over max_entries or state_token_budget" for d in dropped)
    # token budget: header 3 + 2 per one-word entry: 3 entries = 9 words fit in 9, a fourth would need 11
    out, applied, dropped = apply_edit_ops(state, adds, 1, max_entries=9, max_entry_chars=9, max_ops=9,
                                           token_budget=9, count_tokens=words)  # fmt: skip
    assert out.ids() == ["E1", "E2", "E3"] and tokens_of(out) == 9 and len(dropped) == 2
    # a delete first makes room for one more add
    ops = [EditOp(op="delete", id="E1"), *adds]
    out, applied, dropped = apply_edit_ops(state, ops, 1, max_entries=9, max_entry_chars=9, max_ops=9,
                                           token_budget=9, count_tokens=words)  # fmt: skip
    assert out.ids() == ["E2", "E3", "E4"]


def random_op(rng: random.Random, ids: list[str]) -> EditOp:
    kind = rng.choice(["add", "add", "modify", "delete"])
    text = " ".join(rng.choice(["go", "look", "buy", "search", "x"]) for _ in range(rng.randint(0, 6)))
    if rng.random() < 0.1:
        text = "w" * rng.randint(21, 30)
    ident = rng.choice([*ids, "E0", "E42"]) if ids and rng.random() < 0.9 else f"E{rng.randint(0, 9)}"
    scope = rng.choice([None, "*", "shoes", "bags"])
    if kind == "add":
        return EditOp(op="add", text=text, scope=scope)
    if kind == "modify":
        return EditOp(op="modify", id=ident, text=text if rng.random() < 0.8 else None, scope=scope)
    return EditOp(op="delete", id=ident)


def test_budgets_hold_and_application_is_pure_and_deterministic():
    rng = random.Random(1234)
    checked = 0
    for trial in range(150):
        entries = [Entry(f"E{i + 1}", rng.choice(["go", "buy now", "look around"]), scope=rng.choice(["*", "shoes"]))
                   for i in range(rng.randint(0, 3))]  # fmt: skip
        state = State(entries, next_id=len(entries) + 1 + rng.randint(0, 2))
        if tokens_of(state) > LIMITS["token_budget"]:
            continue
        ops = [random_op(rng, state.ids()) for _ in range(rng.randint(0, 7))]
        before = copy.deepcopy(state.to_dict())
        out, applied, dropped = apply_edit_ops(state, ops, trial, **LIMITS)
        assert state.to_dict() == before  # the input is not changed
        out2, applied2, dropped2 = apply_edit_ops(state, ops, trial, **LIMITS)
        assert (out2.to_dict(), applied2, dropped2) == (out.to_dict(), applied, dropped)
        assert len(out.entries) <= LIMITS["max_entries"]
        assert all(0 < len(e.text) <= LIMITS["max_entry_chars"] for e in out.entries)
        assert tokens_of(out) <= LIMITS["token_budget"]
        assert len(applied) <= LIMITS["max_ops"] and len(applied) + len(dropped) == len(ops)
        assert len(set(out.ids())) == len(out.ids()) and out.next_id >= state.next_id
        new_ids = set(out.ids()) - set(state.ids())
        assert all(int(i[1:]) >= state.next_id for i in new_ids)
        checked += 1
    assert checked > 100


# ---------------------------------------------------------------------------------------------------------------------
# §7.15: the LLM editor over a real loopback server

KEY_ENV = "AGENT_TRL_TEST_FUNNEL_EDITOR_KEY"
EVIDENCE = [
    Evidence("find red shoes", "shoes", 1.0, True, ["search[red shoes]", "click[2]", "buy"], "bought"),
    Evidence("find a blue bag", "bags", 0.0, False, ["search[bag]", "click[9]"], "out of stock"),
]
BUDGETS = {"max_entries": 4, "max_entry_chars": 100, "max_ops_per_round": 2, "state_token_budget": 64}


def make_editor(server: JudgeServer, **overrides) -> LLMEditor:
    settings = dict(model="editor", base_url=server.base_url, api_key_env=KEY_ENV, timeout=2.0, max_retries=1,
                    max_repairs=1, backoff_base=0.01, backoff_max=0.05, temperature=0.0, seed=0)  # fmt: skip
    return LLMEditor(Judge(JudgeConfig(**(settings | overrides))), "a web shop", BUDGETS, max_rollouts=4)


@pytest.fixture
def editor_key(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test-funnel")


def test_llm_editor_non_json_replies_give_empty_proposal(editor_key):
    state = base_state()
    with JudgeServer(default=lambda body: ok("I would add a note about searching first.")) as server:
        editor = make_editor(server)
        try:
            proposal = editor.propose(state, EVIDENCE, [])
        finally:
            editor.judge.close()
        assert len(server.requests) == 2  # the request and max_repairs = 1 re-ask, then nothing more
    assert isinstance(proposal, EditProposal) and proposal.ops == []
    out, applied, dropped = apply_edit_ops(state, proposal.ops, 2, **LIMITS)
    assert out.to_dict() == state.to_dict() and applied == [] and dropped == []


def test_llm_editor_transport_failures_give_empty_proposal(editor_key):
    with JudgeServer(default=lambda body: error(500)) as server:
        editor = make_editor(server)
        try:
            proposal = editor.propose(base_state(), EVIDENCE, [])
        finally:
            editor.judge.close()
        assert len(server.requests) == 2  # max_retries = 1: two attempts
    assert proposal.ops == []


def test_llm_editor_parses_a_valid_reply_after_a_repair(editor_key):
    reply = json.dumps({"ops": [
        {"op": "add", "text": "search then click", "kind": "skill", "scope": "shoes", "rationale": "won"},
        {"op": "delete", "id": "E1"},
    ]})  # fmt: skip
    with JudgeServer(default=lambda body: ok(reply)) as server:
        server.script(ok("not json at all"))
        editor = make_editor(server)
        try:
            proposal = editor.propose(base_state(), EVIDENCE, [{"accept": False, "ops": [], "mean_diff": -0.1}])
        finally:
            editor.judge.close()
        assert len(server.requests) == 2
        user = server.requests[0].body["messages"][-1]["content"]
    assert [op.model_dump(exclude_none=True) for op in proposal.ops] == [  # the origin is the library's to set
        {"op": "add", "text": "search then click", "kind": "skill", "scope": "shoes", "rationale": "won",
         "origin": "llm"},
        {"op": "delete", "id": "E1", "origin": "llm"},
    ]  # fmt: skip
    assert "[E1] (*) search first" in user and "[E2] (shoes) buy last" in user
    out, applied, _ = apply_edit_ops(base_state(), proposal.ops, 2, **LIMITS)
    assert out.ids() == ["E2", "E3"] and out.entries[1].origin == "llm" and len(applied) == 2


def test_llm_editor_cache_answers_a_repeated_request_without_network(editor_key, tmp_path):
    reply = json.dumps({"ops": [{"op": "modify", "id": "E2", "text": "buy at the end"}]})
    path = str(tmp_path / "editor.sqlite")
    with JudgeServer(default=lambda body: ok(reply)) as server:
        editor = make_editor(server, cache_path=path)
        try:
            first = editor.propose(base_state(), EVIDENCE, [])
            assert len(server.requests) == 1
            second = editor.propose(base_state(), EVIDENCE, [])
            assert len(server.requests) == 1
        finally:
            editor.judge.close()
        resumed = make_editor(server, cache_path=path)  # a new editor on the same file (a resumed run)
        try:
            third = resumed.propose(base_state(), EVIDENCE, [])
        finally:
            resumed.judge.close()
        assert len(server.requests) == 1
    assert first == second == third and first.ops[0].text == "buy at the end"


# ---------------------------------------------------------------------------------------------------------------------
# §7.16: the card editor


def ev(family: str, actions: list[str], success: bool = True) -> Evidence:
    return Evidence(f"task of {family}", family, float(success), success, actions, "done")


CARD_EVIDENCE = [
    ev("shoes", ["search[red shoes]", "click[2]", "buy"]),
    ev("shoes", ["search[shoes]", "click[5]", "buy now"]),
    ev("shoes", ["search[x]", "buy"]),
    *[ev("shoes", ["search[x]", "click[1]", "click[2]", "buy"], success=False) for _ in range(5)],
    ev("bags", ["search[bag]", "buy"]),  # a tie between two sequences with one success each:
    ev("bags", ["look", "wait"]),  # ("look", "wait") < ("search", "buy") lexicographically: "look" wins
    ev("hats", []),  # a success without actions
    ev("socks", ["search[socks]", "buy"], success=False),  # only failures
]


def test_card_editor_adds_one_card_per_family_deterministically():
    proposal = CardEditor().propose(State(), CARD_EVIDENCE, [])
    by_scope = {op.scope: op for op in proposal.ops}
    assert len(proposal.ops) == 2 and set(by_scope) == {"shoes", "bags"}
    assert by_scope["shoes"].text == "Steps that worked: search -> click -> buy"
    assert by_scope["bags"].text == "Steps that worked: look -> wait"
    for op in proposal.ops:
        assert (op.op, op.origin, op.kind, op.id) == ("add", "card", "skill", None)
    dumped = [op.model_dump() for op in proposal.ops]
    for seed in range(6):
        shuffled = CARD_EVIDENCE[:]
        random.Random(seed).shuffle(shuffled)
        assert [op.model_dump() for op in CardEditor().propose(State(), shuffled, []).ops] == dumped
    out, _, _ = apply_edit_ops(State(), proposal.ops, 1, max_entries=8, max_entry_chars=300, max_ops=4,
                               token_budget=256, count_tokens=words)  # fmt: skip
    assert all(e.origin == "card" for e in out.entries)  # the op's origin wins over apply's default "llm"
    assert {e.scope for e in out.entries} == {"shoes", "bags"}


def test_card_editor_modifies_its_own_entry_and_ignores_failures():
    only_failures = [e for e in CARD_EVIDENCE if not e.success]
    assert CardEditor().propose(State(), only_failures, []).ops == []
    assert CardEditor().propose(State(), [], []).ops == []
    current = "Steps that worked: search -> click -> buy"
    state = State([
        Entry("E1", current, scope="shoes", origin="card"),
        Entry("E2", "check the size chart", scope="bags", origin="manual"),
        Entry("E3", "Steps that worked: search -> buy", scope="bags", origin="card"),
    ], next_id=4)  # fmt: skip
    ops = CardEditor().propose(state, CARD_EVIDENCE, []).ops
    # shoes: unchanged skeleton, nothing; bags: its own card entry E3 changed, modified (the manual E2 is not its own)
    assert [op.model_dump(exclude_none=True) for op in ops] == [
        {"op": "modify", "id": "E3", "text": "Steps that worked: look -> wait"}
    ]
    # one more success on ("search", "buy") for bags breaks the tie: E3 is already right, nothing to do
    assert CardEditor().propose(state, [*CARD_EVIDENCE, ev("bags", ["search", "buy"])], []).ops == []
    assert CardEditor().propose(State(), CARD_EVIDENCE, [], residual=True).ops == []
    assert CardEditor().propose(state, CARD_EVIDENCE, [], residual=True).ops == []


# ---------------------------------------------------------------------------------------------------------------------
# §7.17 (pure part): the seeded split


def rows_with_ids(n: int) -> list[dict]:
    return [{"task_id": f"task-{i:03d}", "task": json.dumps({"goal": i})} for i in range(n)]


def test_split_is_disjoint_complete_sized_and_order_free():
    rows = rows_with_ids(40)
    train, sel = split_tasks(rows, 7, seed=3)
    ids = lambda rs: [r["task_id"] for r in rs]  # noqa: E731
    assert len(sel) == 7 and len(train) == 33
    assert not set(ids(train)) & set(ids(sel))
    assert sorted(ids(train) + ids(sel)) == sorted(ids(rows))
    # D16: the 7 task ids whose sha256 of "seed:id" is smallest
    expected = sorted(ids(rows), key=lambda t: hashlib.sha256(f"3:{t}".encode()).hexdigest())[:7]
    assert set(ids(sel)) == set(expected)
    for seed in range(4):
        shuffled = rows[:]
        random.Random(seed).shuffle(shuffled)
        train2, sel2 = split_tasks(shuffled, 7, seed=3)
        assert ids(sel2) == ids(sel) and ids(train2) == ids(train)
    assert set(ids(split_tasks(rows, 7, seed=4)[1])) != set(ids(sel))  # the seed matters
    # rows without a task_id are keyed by their task JSON: still disjoint, complete and order-free
    bare = [{"task": json.dumps({"goal": i})} for i in range(12)]
    t1, s1 = split_tasks(bare, 3, seed=0)
    t2, s2 = split_tasks(bare[::-1], 3, seed=0)
    assert s1 == s2 and t1 == t2 and len(s1) == 3
    assert sorted(r["task"] for r in t1 + s1) == sorted(r["task"] for r in bare)


def test_split_needs_fewer_gate_tasks_than_rows():
    with pytest.raises(ValueError):
        split_tasks(rows_with_ids(5), 5, seed=0)
    with pytest.raises(ValueError):
        split_tasks(rows_with_ids(5), 9, seed=0)
    train, sel = split_tasks(rows_with_ids(5), 4, seed=0)
    assert len(train) == 1 and len(sel) == 4


def test_split_keeps_rows_of_one_task_id_on_one_side():
    """Two rows of one task id never straddle the cut; D_sel holds n_sel distinct ids; row order does not matter."""
    rows = [{"task_id": f"t{i}", "copy": c} for c in range(2) for i in range(10)]  # every task twice
    for n_sel in range(1, 10):
        train, sel = split_tasks(rows, n_sel, seed=0)
        assert not {r["task_id"] for r in train} & {r["task_id"] for r in sel}, n_sel
        assert len({r["task_id"] for r in sel}) == n_sel and len(sel) == 2 * n_sel
        again = split_tasks(list(reversed(rows)), n_sel, seed=0)
        assert again == (train, sel)
    with pytest.raises(ValueError):
        split_tasks(rows, 10, seed=0)  # only 10 distinct ids


def test_a_hand_built_state_never_reuses_an_id():
    state = State([Entry("E1", "a"), Entry("E4", "b")])
    assert state.next_id == 5
    out, _, _ = apply_edit_ops(state, [EditOp(op="add", text="c")], 1, **LIMITS)
    assert [e.id for e in out.entries] == ["E1", "E4", "E5"]


# ---------------------------------------------------------------------------------------------------------------------
# FunnelConfig validation


def make_config(tmp_path, **overrides) -> FunnelConfig:
    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=2,
                use_cpu=True, report_to="none")  # fmt: skip
    return FunnelConfig(**(base | overrides))


def test_funnel_config_defaults_are_valid(tmp_path):
    config = make_config(tmp_path)
    assert (config.alpha, config.loss_type, config.token_weight_mode, config.editor) == (
        0.5, "grpo", "linear_norm", "card",
    )  # fmt: skip
    make_config(tmp_path, editor="openai", editor_model="gpt-test", alpha=1.0, gate_tasks=2)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(alpha=1.5), "alpha"),
        (dict(alpha=-0.1), "alpha"),
        (dict(gate_tasks=1), "gate_tasks"),
        (dict(selection_tasks=1), "selection_tasks"),
        (dict(token_weight_mode="x"), "token_weight_mode"),
        (dict(residual_mode="sometimes"), "residual_mode"),
        (dict(editor="openai"), "editor_model"),
        (dict(max_steps=-1), "max_steps"),
        (dict(distillation_weight=1.2), "distillation_weight"),
        (dict(token_weight_max=0.5), "token_weight_max"),
        (dict(distill_temperature=0.0), "distill_temperature"),
        (dict(max_entries=0), "max_entries"),
    ],
)
def test_funnel_config_rejects_bad_values(tmp_path, overrides, field):
    with pytest.raises(ValueError, match=field):
        make_config(tmp_path, **overrides)


def test_funnel_config_max_steps_unset_is_rejected(tmp_path):
    base = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, use_cpu=True,
                report_to="none")  # fmt: skip
    with pytest.raises(ValueError, match="max_steps"):
        FunnelConfig(**base)


def test_the_editor_model_cannot_claim_another_origin(editor_key):
    reply = json.dumps({"ops": [{"op": "add", "text": "buy last", "origin": "card"}]})
    with JudgeServer(default=lambda body: ok(reply)) as server:
        editor = make_editor(server)
        try:
            proposal = editor.propose(base_state(), EVIDENCE, [])
        finally:
            editor.judge.close()
    assert [op.origin for op in proposal.ops] == ["llm"]
