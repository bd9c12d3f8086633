"""trainers/reporting.py: curves.png draws one panel per logged curve of CURVES, episode length, turns and truncation
among them; summary.json is written whole."""

import json
import math
import struct

from trainers.reporting import CURVES, curve_panels, plot_curves, write_summary


def log_history(steps: int = 4, **extra) -> list[dict]:
    """A hand-made TRL log history: a binary success and its reward, episode length, turns, truncation, entropy; the
    last row is the end-of-training summary (no `step` curve keys), as Trainer.train() appends it."""
    rows = [
        {
            "step": s,
            "env/success": float(s % 2),
            "reward": float(s % 2),
            "completions/mean_length": 40.0 + s,
            "env/turns": 6.0 + 0.5 * s,
            "env/truncated": 0.25 / s,
            "entropy": 1.0 - 0.1 * s,
            **extra,
        }
        for s in range(1, steps + 1)
    ]
    return rows + [{"step": steps, "train_runtime": 12.0}]


def png_width(path) -> int:
    with open(path, "rb") as f:
        header = f.read(24)  # 8-byte signature, IHDR length and type, then width and height (big-endian)
    return struct.unpack(">I", header[16:20])[0]


def test_panels_include_episode_length_turns_and_truncation():
    # the reward repeats the binary success curve, so its panel is left out
    assert [key for key, _ in curve_panels(log_history())] == [
        "env/success",
        "completions/mean_length",
        "env/turns",
        "env/truncated",
        "entropy",
    ]


def test_panels_are_only_the_logged_curves():
    history = [{"step": 1, "reward": 0.5, "completions/mean_length": 30.0}, {"step": 2, "reward": math.nan}]
    assert [key for key, _ in curve_panels(history)] == ["reward", "completions/mean_length"]
    assert curve_panels([{"step": 1, "env/turns": None, "loss": 0.1}]) == []


def test_a_graded_reward_keeps_its_panel():
    history = [{**row, "reward": row["reward"] + 0.5} if "reward" in row else row for row in log_history()]
    assert len(curve_panels(history)) == len(CURVES)


def test_png_has_one_panel_per_curve(tmp_path):
    held_out = {"before": 0.1, "after": 0.4}
    path = plot_curves(log_history(), tmp_path / "curves.png", title="t", rollouts_per_step=64, held_out=held_out)
    assert png_width(path) == round(3.6 * 5 * 110)  # figsize (3.6 x panels) inches at 110 dpi
    assert plot_curves([{"step": 1, "loss": 0.1}], tmp_path / "none.png") is None


def test_write_summary(tmp_path):
    path = write_summary(tmp_path / "summary.json", {"held_out": {"after": 0.4}, "path": tmp_path})
    assert json.loads(path.read_text()) == {"held_out": {"after": 0.4}, "path": str(tmp_path)}
    assert not (tmp_path / "summary.json.tmp").exists()


def test_speed_reads_trl_step_times_and_the_process_peak():
    from trainers.reporting import speed

    history = [{"step_time": 2.0, "step": 1}, {"loss": 0.1, "step": 1}, {"step_time": 4.0, "step": 2}]
    history.append({"train_runtime": 9.0, "step": 2})
    pace = speed(history)
    assert pace["seconds_per_step"] == 3.0  # (2 + 4) / 2
    assert pace["train_seconds_per_step"] == 4.5  # 9 s over 2 steps
    assert pace["peak_memory_gib"] > 0.05  # this process holds torch at least
    assert speed([])["seconds_per_step"] is None and speed([])["train_seconds_per_step"] is None
