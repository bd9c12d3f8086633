"""Layer 2: the T1 rewards and token-in/token-out audit counters in `rewards/verifiers.py` (docs/methods/t1.md §7
items 1-5, 25, 30-31; conventions.md C20)."""

from __future__ import annotations

import functools
import random

import pytest
import torch

from rewards.verifiers import (
    FALLBACK_CAUSES,
    assertion_blend_reward,
    assertion_count_reward,
    assertion_reward_cause,
    binary_success_reward,
    retokenization_mismatch_count,
    tito_mismatch_count,
)

# ---------------------------------------------------------------------------------------------------------------------
# Dense count reward (t1.md Eq. 1-2, D9-D11)


def test_count_reward_is_p_over_s_and_row_independent():
    # item 1: r = P / S exactly (P absolute, not P / A); item 2: above 1 unclipped. S = 20: 7/20, 25/20, 0/20
    passed, total = [7, 25, 0], [10, 30, 4]
    rewards = assertion_count_reward(["a", "b", "c"], assertions_passed=passed, assertions_total=total)
    assert rewards == [0.35, 1.25, 0.0]
    # a row's reward does not depend on other rows, the batch size or the order
    assert assertion_count_reward(["b"], assertions_passed=[25], assertions_total=[30]) == [1.25]
    rev = assertion_count_reward(["c", "b", "a"], assertions_passed=passed[::-1], assertions_total=total[::-1])
    assert rev == rewards[::-1]


def test_count_reward_scale_comes_from_the_caller_only():
    # item 5: S is a fixed argument (run config), never derived from a batch
    reward_s10 = functools.update_wrapper(
        functools.partial(assertion_count_reward, assertion_scale=10.0), assertion_count_reward
    )
    assert reward_s10(["", ""], assertions_passed=[3, 30], assertions_total=[5, 30]) == [0.3, 3.0]
    assert reward_s10.__name__ == "assertion_count_reward"


@pytest.mark.parametrize(
    ("passed", "total", "success", "status", "reward", "cause"),
    [
        (3, 5, True, None, 3 / 20, "count"),
        (3, 5, True, "ok", 3 / 20, "count"),
        (3, 5, True, "infra_dropped", None, "infra_dropped"),  # row excluded
        (None, None, True, "verifier_error", 0.0, "verifier_error"),  # a missing verdict counts as failure
        (None, None, True, None, 1.0, "no_report"),  # r = b
        (None, None, False, "no_report", 0.0, "no_report"),
        (None, None, True, "parse_error", 1.0, "parse_error"),
        (0, 0, False, None, 0.0, "zero_assertions"),
        (6, 5, True, None, 1.0, "inconsistent"),  # P > A
        (-1, 5, False, None, 0.0, "inconsistent"),  # negative count
        (None, None, None, None, None, "no_report"),  # b unknown too -> unscorable
    ],
)
def test_fallback_causes(passed, total, success, status, reward, cause):
    # item 3: every D9 cause gives the specified reward and tag
    assert assertion_reward_cause(passed, total, status) == cause
    out = assertion_count_reward(
        [""], assertions_passed=[passed], assertions_total=[total], success=[success], verifier_status=[status]
    )
    assert out == [reward]


def test_fallback_cause_order_c20():
    # C20: the first match wins: infra > verifier error > no report > parse error > zero assertions > inconsistent
    assert assertion_reward_cause(0, 0, "infra_dropped") == "infra_dropped"
    assert assertion_reward_cause(6, 5, "verifier_error") == "verifier_error"
    assert assertion_reward_cause(0, 0, "no_report") == "no_report"
    assert assertion_reward_cause(6, 0, "parse_error") == "parse_error"
    assert assertion_reward_cause(6, 0) == "zero_assertions"
    with pytest.raises(ValueError, match="status"):
        assertion_reward_cause(1, 2, "timeout")


def test_count_reward_reads_final_info_and_logs_causes():
    # the agent loop's `final_info` (terminal env info) is the fallback source; TRL's hooks receive the fractions
    metrics, extra = {}, {}
    infos = [
        {"assertions_passed": 4, "assertions_total": 4, "success": True},
        {"assertions_passed": 0, "assertions_total": 0, "success": False},
        {"success": True},
        None,
    ]
    out = assertion_count_reward(
        ["", "", "", ""],
        final_info=infos,
        log_metric=lambda name, value: metrics.__setitem__(name, value),
        log_extra=lambda column, values: extra.__setitem__(column, values),
    )
    assert out == [0.2, 0.0, 1.0, None]
    assert extra["reward_cause"] == ["count", "zero_assertions", "no_report", "no_report"]
    assert metrics["t1/reward_fallback_frac"] == 0.75
    assert set(metrics) == {"t1/reward_fallback_frac", *(f"t1/reward_fallback/{c}" for c in FALLBACK_CAUSES)}
    assert metrics["t1/reward_fallback/no_report"] == 0.5 and metrics["t1/reward_fallback/verifier_error"] == 0.0


def test_blend_reward_bounds():
    # item 4: r = clip(max(b, 0.4 P/A), 0, max(1, b)) stays in [0, max(1, b)] and is 1 when b = 1
    rng = random.Random(0)
    for _ in range(200):
        total = rng.randint(1, 30)
        passed, b = rng.randint(0, total), rng.random() < 0.5
        (r,) = assertion_blend_reward([""], assertions_passed=[passed], assertions_total=[total], success=[b])
        assert 0.0 <= r <= 1.0
        assert r == (1.0 if b else 0.4 * passed / total)
    # 4/10 passing, b = 0 -> 0.4 * 0.4 = 0.16; unusable report -> b
    out = assertion_blend_reward(
        ["", ""], assertions_passed=[4, None], assertions_total=[10, None], success=[False, True]
    )
    assert out == pytest.approx([0.16, 1.0])


def test_binary_success_reward():
    assert binary_success_reward(["", "", ""], success=[True, False, None]) == [1.0, 0.0, None]
    assert binary_success_reward(["", ""], final_info=[{"success": 1}, {"success": False}]) == [1.0, 0.0]
    assert binary_success_reward(["", ""]) == [None, None]


# ---------------------------------------------------------------------------------------------------------------------
# TITO audit (t1.md Eq. 17, D14, §7 items 25, 30, 31)


def test_tito_mismatch_count_zero_on_faithful_stream():
    # stream: turn 0 sampled [5, 6], env [1, 2], turn 1 sampled [7], padding 0 -> 3 loss tokens, 0 mismatches
    ids = [[5, 6, 1, 2, 7, 0], [9, 3, 0, 0, 0, 0]]
    mask = [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert tito_mismatch_count(ids, mask, [[5, 6, 7], [9]]) == (0, 4)
    # tensors work too
    assert tito_mismatch_count(torch.tensor(ids), torch.tensor(mask), [torch.tensor([5, 6, 7]), [9]]) == (0, 4)


def test_tito_mismatch_count_flags_retokenized_and_missing_ids():
    # item 30: an injected re-tokenised loss token is counted (drift rate 1/3)
    assert tito_mismatch_count([[5, 6, 1, 8]], [[1, 1, 0, 1]], [[5, 6, 7]]) == (1, 3)
    # a context token marked as a loss token shifts every later position: 1 vs 6, 6 vs 7, 7 vs nothing -> 3
    assert tito_mismatch_count([[5, 1, 6, 7]], [[1, 1, 1, 1]], [[5, 6, 7]]) == (3, 4)
    # a sampled id that never reached the stream counts too
    assert tito_mismatch_count([[5, 6, 1]], [[1, 1, 0]], [[5, 6, 7]]) == (1, 2)


def test_round_trip_tokenizer_changes_nothing_without_reencoding():
    # item 31: decode-then-encode is not the identity on [1, 2] (it merges to [12]), yet a rollout that never
    # re-encodes has drift 0; the informational round-trip count shows what a re-tokenising harness would change
    def reencode(turn: list[int]) -> list[int]:
        return [12, *turn[2:]] if turn[:2] == [1, 2] else turn

    ids, mask = [[1, 2, 9, 3, 4, 0]], [[1, 1, 0, 1, 1, 0]]
    assert tito_mismatch_count(ids, mask, [[1, 2, 3, 4]]) == (0, 4)
    # turn [1, 2] -> [12]: position 0 differs (1 vs 12), position 1 has no counterpart; turn [3, 4] unchanged
    assert retokenization_mismatch_count(ids, mask, reencode) == (2, 4)
    assert retokenization_mismatch_count(ids, mask, lambda turn: turn) == (0, 4)
