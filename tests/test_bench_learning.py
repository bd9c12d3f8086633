"""bench/learning.py's pure parts: config variants, curves, the table's columns."""

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import learning  # noqa: E402


def summary(successes, ev=None, before=0.1, after=0.4):
    rows = [{"step": 5 * (i + 1), "loss": 0.0, "env/success": s} for i, s in enumerate(successes)]
    for row, v in zip(rows, ev or [], strict=False):
        row["critic/explained_variance"] = v
    return {
        "rollouts_per_step": 64,
        "log_history": rows + [{"train_runtime": 1.0, "step": 5 * len(rows)}],
        "before": {"sampled": {"success": before}},
        "after": {"sampled": {"success": after}, "greedy": {"success": 0.5}},
        "wall_seconds": 10.0,
    }


def test_variant_names_and_overrides():
    assert learning.variant("configs/t1_terminal.yaml") == ("t1_terminal", "configs/t1_terminal.yaml", [])
    name, path, overrides = learning.variant("configs/t1_terminal.yaml@reward=binary,critic_warmup_steps=0")
    assert name == "t1_terminal@reward=binary,critic_warmup_steps=0" and path == "configs/t1_terminal.yaml"
    assert overrides == ["reward=binary", "critic_warmup_steps=0"]
    with pytest.raises(SystemExit, match="FIELD=VALUE"):
        learning.variant("configs/x.yaml@reward")


def test_curve_threshold_and_budget():
    points = learning.curve(summary([0.1, 0.3, 0.6, 0.5]))
    assert points == [(320, 0.1), (640, 0.3), (960, 0.6), (1280, 0.5)]
    assert learning.rollouts_to(points, 0.5) == 960 and learning.rollouts_to(points, 0.9) is None
    assert learning.success_at(points, 1000) == 0.6 and learning.success_at(points, 100) is None


def test_late_mean_uses_the_last_quarter_and_skips_nan():
    s = summary([0.1] * 8, ev=[-1.0] * 6 + [0.2, math.nan])
    assert learning.late_mean(s, "critic/explained_variance") == pytest.approx(0.2)
    assert learning.late_mean(s, "missing") is None


def test_table_has_one_row_per_config_and_metric_columns():
    results = {"a": [summary([0.2, 0.6], ev=[0.1, 0.3]), summary([0.1, 0.2], ev=[0.0, 0.5], after=0.2)]}
    text = learning.table(results, threshold=0.5, at_rollouts=640, metrics=["critic/explained_variance"])
    header, rule, row = text.splitlines()
    assert header.count("|") == rule.count("|") == row.count("|") == 11
    assert "0.200 [0.100, 0.300]" in row  # gain: 0.3 and 0.1
    assert "640 [640, 640] (1/2 reached)" in row.replace(".000", "")
    assert "0.400 [0.300, 0.500]" in row  # explained variance over the last quarter (the last log)
