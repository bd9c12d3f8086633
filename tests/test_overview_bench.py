"""bench/overview.py: the one table of every method at level 0 and 2, read from stored runs. The runs here are written
by hand in bench/learning.py's layout, and every expected cell is worked out from them by hand."""

import json

import pytest

from bench import overview
from bench.overview import Column


def store(results, runs, seed, before, after, log=()):
    """A run's summary.json as train.py writes it: held-out success before and after RL, and its log rows."""
    folder = results / f"{runs}-s{seed}"
    folder.mkdir(parents=True)
    summary = {
        "rollouts_per_step": 32,
        "before": {"sampled": {"success": before}},
        "after": {"sampled": {"success": after}},
        "log_history": [{"step": step, "env/success": s} for step, s in log],
    }
    (folder / "summary.json").write_text(json.dumps(summary))


def test_window_mean_reads_equal_windows():
    points = [(160, 0.2), (320, 0.6), (480, 0.9)]
    assert overview.window_mean(points, 320, 320) == pytest.approx(0.4)  # (0.2 + 0.6) / 2
    assert overview.window_mean(points, 480, 320) == pytest.approx(0.75)  # (0.6 + 0.9) / 2: 160 is not in (160, 480]
    assert overview.window_mean(points, 480, 160) == pytest.approx(0.9)
    assert overview.window_mean(points, 100, 320) is None


def test_versus_needs_the_whole_spread_apart():
    assert overview.versus([0.55, 0.60], [0.40, 0.50]) == "above"
    assert overview.versus([0.50, 0.60], [0.40, 0.50]) == ""  # a tie at GRPO's highest is not beyond
    assert overview.versus([0.20, 0.39], [0.40, 0.50]) == "below"
    assert overview.versus([0.45, 0.70], [0.40, 0.50]) == ""


def test_table_marks_spread_collapse_and_level_two_window(tmp_path):
    # level 0: GiGPO's lowest seed (0.55) above GRPO's highest (0.50); MPO's highest (0.30) below GRPO's lowest (0.40);
    # TASPO's seed 1 ends below its own start (0.05 < 0.10)
    for seed, (grpo, gigpo, mpo, taspo) in enumerate([(0.40, 0.55, 0.20, 0.45), (0.50, 0.60, 0.30, 0.05)]):
        store(tmp_path, "a/grpo", seed, 0.10, grpo)
        store(tmp_path, "a/gigpo", seed, 0.10, gigpo)
        store(tmp_path, "a/mpo", seed, 0.10, mpo)
        store(tmp_path, "a/taspo", seed, 0.10, taspo)
    # level 2: GRPO logs every 320 rollouts (10 steps of 32), MPO every 160; the window (0, 320] holds GRPO's one log
    # (0.5, 0.3 by seed) and MPO's two (mean of 0.6 and 0.8 = 0.7; of 0.7 and 0.9 = 0.8)
    store(tmp_path, "b/grpo@difficulty=2", 0, 0.2, 0.90, [(10, 0.5), (20, 0.9)])
    store(tmp_path, "b/grpo@difficulty=2", 1, 0.3, 0.95, [(10, 0.3), (20, 0.9)])
    store(tmp_path, "b/mpo@difficulty=2", 0, 0.2, 0.92, [(5, 0.6), (10, 0.8), (15, 0.9)])
    store(tmp_path, "b/mpo@difficulty=2", 1, 0.3, 0.94, [(5, 0.7), (10, 0.9), (15, 0.9)])
    columns = [
        Column("a 0", "A", 0, {"GRPO": "a/grpo", "GiGPO": "a/gigpo", "TASPO": "a/taspo", "MPO": "a/mpo"}, (0, 1)),
        Column("b 2", "B", 2, {"GRPO": "b/grpo@difficulty=2", "MPO": "b/mpo@difficulty=2"}, (0, 1)),
    ]
    out = tmp_path / "out"
    measured = overview.main(["--at_rollouts", "320", "--out", str(out)], columns, tmp_path)
    rows = {line.split(" | ")[0]: line for line in (out / "table.md").read_text().splitlines()}
    assert rows["| held-out sampled after SFT (the start)"].endswith("| 0.100 | 0.250 |")
    assert rows["| GRPO"] == "| GRPO | 0.450 | 0.925 / 0.400 |"
    assert rows["| GiGPO"] == "| GiGPO | **0.575** |  |"
    assert rows["| TASPO"] == "| TASPO | 0.250 (collapse: seed 1) |  |"
    # MPO at level 2: after 0.93 [0.92, 0.94] within GRPO's [0.90, 0.95]; at 320 rollouts 0.75 [0.7, 0.8] above 0.5
    assert rows["| MPO"] == "| MPO | 0.250 (below) | 0.930 / **0.750** |"
    assert "12 runs; 1 ended below its own start." in rows  # 4 recipes x 2 seeds, 2 x 2; TASPO's seed 1
    assert measured["a 0"]["TASPO"]["collapsed_seeds"] == [1]
    assert measured["b 2"]["MPO"]["success_at_rollouts"] == pytest.approx([0.7, 0.8])
    assert (out / "overview.png").stat().st_size > 0
    assert json.loads((out / "result.json").read_text())["bench"] == "overview"


def test_a_missing_run_or_grpo_cell_stops_before_writing(tmp_path):
    store(tmp_path, "a/grpo", 0, 0.1, 0.4)
    missing_run = [Column("a", "A", 0, {"GRPO": "a/grpo", "GiGPO": "a/gigpo"}, (0,))]
    with pytest.raises(SystemExit, match="a/gigpo-s0"):
        overview.main(["--out", str(tmp_path / "out")], missing_run, tmp_path)
    with pytest.raises(SystemExit, match="GRPO cell"):
        overview.main(["--out", str(tmp_path / "out")], [Column("a", "A", 0, {"GiGPO": "a/grpo"}, (0,))], tmp_path)
    assert not (tmp_path / "out").exists()


def test_the_shipped_columns_name_stored_runs():
    """Every cell of the real table points at a folder of bench/results that holds its runs' seeds."""
    for column in overview.COLUMNS:
        assert "GRPO" in column.cells and set(column.cells) <= set(overview.METHODS)
        assert set(column.fewer) <= set(column.cells), column.title
        for method, runs in column.cells.items():
            for seed in column.seeds_of(method):
                assert (overview.RESULTS / f"{runs}-s{seed}" / "summary.json").exists(), (column.title, runs, seed)


def test_a_cell_with_fewer_seeds_names_them(tmp_path):
    # GRPO on seeds 0-2 ends at 0.90, 0.92, 0.94; PPO ran seeds 0 and 1 only and ended at 0.40 and 0.50: mean 0.450,
    # its highest (0.50) below GRPO's lowest (0.90); T1 ran seed 0 only and ended below its start (0.05 < 0.10)
    for seed, after in enumerate([0.90, 0.92, 0.94]):
        store(tmp_path, "c/grpo", seed, 0.10, after)
    store(tmp_path, "c/ppo", 0, 0.10, 0.40)
    store(tmp_path, "c/ppo", 1, 0.10, 0.50)
    store(tmp_path, "c/t1", 0, 0.10, 0.05)
    cells = {"GRPO": "c/grpo", "PPO": "c/ppo", "T1": "c/t1"}
    columns = [Column("c 0", "C", 0, cells, (0, 1, 2), fewer={"PPO": (0, 1), "T1": (0,)})]
    out = tmp_path / "out"
    measured = overview.main(["--out", str(out)], columns, tmp_path)
    rows = {line.split(" | ")[0]: line for line in (out / "table.md").read_text().splitlines()}
    assert rows["| GRPO"] == "| GRPO | 0.920 |"
    assert rows["| PPO"] == "| PPO | 0.450 (below) (seeds 0, 1) |"
    assert rows["| T1"] == "| T1 | 0.050 (below) (seed 0) (collapse: seed 0) |"
    assert "6 runs; 1 ended below its own start." in rows  # 3 + 2 + 1
    assert measured["c 0"]["PPO"]["seeds"] == [0, 1]
    assert measured["c 0"]["T1"]["collapsed_seeds"] == [0]
