"""bench/learning.py: config variants, curves, the methods table (grouping, step time vs GRPO, collapse, reuse).

Every run folder here is written by the test with hand-chosen numbers; nothing is trained.
"""

import json
import math
from pathlib import Path

import pytest
import yaml

from bench import learning, record


def summary(successes, ev=None, before=0.1, after=0.4, *, trainer="grpo", environment="shop", per_step=64,
            runtime=1.0, wall=10.0, greedy=0.5):  # fmt: skip
    """A summary.json as train.py writes it: a log every 5 steps, then the trainer's closing row."""
    rows = [{"step": 5 * (i + 1), "loss": 0.0, "env/success": s} for i, s in enumerate(successes)]
    for row, v in zip(rows, ev or [], strict=False):
        row["critic/explained_variance"] = v
    return {
        "run": {"trainer": trainer, "environment": environment, "difficulty": 0},
        "model": f"tiny:{environment}",
        "trainer": trainer,
        "rollouts_per_step": per_step,
        "log_history": rows + [{"train_runtime": runtime, "step": 5 * len(rows)}],
        "before": {"sampled": {"success": before}},
        "after": {"sampled": {"success": after}, "greedy": {"success": greedy}},
        "wall_seconds": wall,
    }


def write_run(folder: Path, data: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "summary.json").write_text(json.dumps(data))


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
    s = summary([0.1] * 8, ev=[-1.0] * 6 + [None, 0.4])  # how summary.json stores a NaN
    assert learning.late_mean(s, "critic/explained_variance") == pytest.approx(0.4)


def test_early_mean_uses_the_logs_up_to_a_rollout_budget():
    s = summary([0.1] * 6, ev=[0.2, 0.4, math.nan, 0.9, 5.0, 5.0])  # logs at 320, 640, ..., 1920 rollouts
    assert learning.early_mean(s, "critic/explained_variance", 1280) == pytest.approx(0.5)  # (0.2 + 0.4 + 0.9) / 3
    assert learning.early_mean(s, "critic/explained_variance", 300) is None  # no log that early
    spent = summary([0.1] * 3, ev=[1.0, 2.0, 4.0])  # the Funnel logs every rollout it played, training or not
    for row, total in zip(spent["log_history"], [500, 900, 1300], strict=False):
        row["rollouts_spent"] = total
    assert learning.early_mean(spent, "critic/explained_variance", 900) == pytest.approx(1.5)


def test_seconds_per_rollout_uses_train_runtime_not_wall_time():
    # 4 logs -> last step 20; 20 steps x 32 rollouts = 640 rollouts; 320 s / 640 = 0.5 s (wall time 999 s ignored)
    assert learning.seconds_per_rollout(summary([0.1] * 4, per_step=32, runtime=320.0, wall=999.0)) == 0.5
    no_runtime = summary([0.1])
    no_runtime["log_history"].pop()
    assert learning.seconds_per_rollout(no_runtime) is None


def test_method_aggregation_and_settings(tmp_path):
    assert learning.method("ppo", {"critic_model_name_or_path": "policy"}) == "t1"  # separate critic (t1.md D2)
    assert learning.method("ppo", {}) == "ppo" and learning.method("mpo", {"critic_model_name_or_path": "p"}) == "mpo"
    assert learning.aggregation("grpo", {"loss_type": "grpo"}) == "grpo (episode mean)"
    assert learning.aggregation("draco", {}) == "dapo (token mean)"  # TRL's default when the config names none
    assert learning.aggregation("ppo", {"loss_type": "grpo"}) == "grpo (episode mean)"  # every trainer reads it (C22)
    assert learning.aggregation("mpo", {}) == "dapo (token mean)"
    assert learning.aggregation("grpo", {"loss_type": "luspo"}) == "luspo"  # unknown to the table: named as is
    config = tmp_path / "x.yaml"
    config.write_text("trainer: ppo\nloss_type: grpo\nbeta: 0.0\n")
    # overrides apply in order: --set first, then the variant's own (train.py's argparse keeps the last)
    fields = learning.settings(str(config), ["loss_type=dapo", "critic_model_name_or_path=policy", "loss_type=bnpo"])
    assert fields == {"trainer": "ppo", "loss_type": "bnpo", "beta": 0.0, "critic_model_name_or_path": "policy"}


def test_table_has_one_row_per_config_and_metric_columns():
    runs = [
        learning.Run(0, summary([0.2, 0.6], ev=[0.1, 0.3])),
        learning.Run(1, summary([0.1, 0.2], [0.0, 0.5], 0.3, 0.2)),
    ]
    row = learning.Row("a", "grpo", "shop", 0, "grpo (episode mean)", runs)
    text = learning.table([row], threshold=0.5, at_rollouts=640, metrics=["critic/explained_variance"])
    header, rule, line = text.splitlines()[:3]
    assert header.count("|") == rule.count("|") == line.count("|") == 16  # 14 columns + 1 metric
    assert "| 0.100 [-0.100, 0.300] |" in line  # gain: 0.4 - 0.1 = 0.3 and 0.2 - 0.3 = -0.1
    assert "| 640 [640, 640] (1/2 reached) |" in line
    assert "| s1: 0.300 → 0.200 |" in line  # seed 1 ends below its start; seed 0 does not
    assert "| 0.400 [0.300, 0.500] |" in line  # explained variance over the last quarter (the last log)
    assert "| 1.00x (1.6 ms) |" in line  # its own reference: 1 s / (10 steps x 64 rollouts) = 1.5625 ms per rollout
    text = learning.table([row], 0.5, 640, ["critic/explained_variance"], upto=320)
    header, rule, line = text.splitlines()[:3]
    assert header.count("|") == line.count("|") == 17 and "critic/explained_variance (up to 320 rollouts) |" in header
    assert line.endswith("| 0.400 [0.300, 0.500] | 0.050 [0.000, 0.100] |")  # last quarter, then the first log only
    seeds = learning.measured([row], 0.5, 640, ["critic/explained_variance"], upto=320)["rows"][0]["seeds"]
    assert [s["metrics_last_quarter"]["critic/explained_variance"] for s in seeds] == [0.3, 0.5]
    assert [s["metrics_upto"]["critic/explained_variance"] for s in seeds] == [0.1, 0.0]


CONFIGS = {  # in the order given on the command line: environments interleaved, GRPO not first
    "t1_shop": {"trainer": "ppo", "environment": "shop", "difficulty": 0, "critic_model_name_or_path": "policy"},
    "mpo_term": {"trainer": "mpo", "environment": "terminal", "difficulty": 0},
    "grpo_shop": {"trainer": "grpo", "environment": "shop", "difficulty": 0, "loss_type": "grpo"},
    "ppo_term": {"trainer": "ppo", "environment": "terminal", "difficulty": 0},
}


@pytest.fixture
def bench(tmp_path, monkeypatch):
    """Config files, OUT with some runs, and two --reuse folders A and B holding the rest (and decoys)."""
    monkeypatch.setattr(record, "environment", lambda: {"stub": True})  # no torch/trl import for result.json

    def no_training(*args, **kwargs):
        raise AssertionError(f"a run was missing and would have been trained: {args}")

    monkeypatch.setattr(learning.subprocess, "run", no_training)
    for name, fields in CONFIGS.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(fields))
    out, a, b = tmp_path / "out", tmp_path / "A", tmp_path / "B"
    wall = {"wall": 1000.0}  # equal wall times: a ratio of wall times would be 1.00x
    # GRPO shop: 2 logs x 5 steps x 4 rollouts = 40 rollouts; 100 s and 140 s -> 2.5 and 3.5 s/rollout, mean 3.0
    write_run(a / "grpo_shop-s0", summary([0.2, 0.6], per_step=4, runtime=100.0, **wall))
    write_run(a / "grpo_shop-s1", summary([0.3, 0.4], per_step=4, runtime=140.0, **wall))
    write_run(b / "grpo_shop-s0", summary([0.2, 0.6], per_step=4, runtime=1.0, **wall))  # decoy: A comes first
    # T1 shop: 4 logs -> step 20 x 2 = 40 rollouts; 300 s and 420 s -> 7.5 and 10.5, mean 9.0 -> 9.0 / 3.0 = 3.00x
    shop_t1 = dict(trainer="ppo", per_step=2, **wall)
    write_run(out / "t1_shop-s0", summary([0.1, 0.3, 0.5, 0.7], runtime=300.0, **shop_t1))
    write_run(b / "t1_shop-s0", summary([0.1, 0.3, 0.5, 0.7], runtime=1.0, **shop_t1))  # decoy: OUT comes first
    write_run(b / "t1_shop-s1", summary([0.1, 0.2, 0.4, 0.6], runtime=420.0, **shop_t1))
    # terminal: no GRPO row; MPO seed 1 ends below its start (0.3 -> 0.2), seed 0 level (0.3 -> 0.3) is no collapse
    term = dict(environment="terminal", per_step=2, runtime=80.0, **wall)
    write_run(out / "mpo_term-s0", summary([0.3, 0.3], before=0.3, after=0.3, trainer="mpo", **term))
    write_run(out / "mpo_term-s1", summary([0.3, 0.2], before=0.3, after=0.2, trainer="mpo", **term))
    write_run(out / "ppo_term-s0", summary([0.3, 0.5], before=0.1, after=0.4, trainer="ppo", **term))
    write_run(out / "ppo_term-s1", summary([0.3, 0.5], before=0.1, after=0.5, trainer="ppo", **term))
    specs = [str(tmp_path / f"{name}.yaml") for name in CONFIGS]
    return specs, out, a, b


def test_two_environments_grouped_with_step_time_collapse_and_reuse(bench):
    specs, out, a, b = bench
    learning.main(["--configs", *specs, "--seeds", "0", "1", "--out", str(out), "--reuse", str(a), str(b)])
    lines = (out / "table.md").read_text().splitlines()
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[2:] if line.startswith("|")]
    # grouped by environment in order of first appearance (shop, then terminal); GRPO first, then PPO, T1, MPO
    assert [r[:3] for r in rows] == [
        ["shop (0)", "grpo", "grpo_shop (reused)"],
        ["shop (0)", "t1", "t1_shop (reused: s1)"],
        ["terminal (0)", "ppo", "ppo_term"],
        ["terminal (0)", "mpo", "mpo_term"],
    ]
    assert [r[3] for r in rows] == ["grpo (episode mean)"] + ["dapo (token mean)"] * 3  # the fixtures name none
    step = [r[12] for r in rows]  # ms per rollout: 3.0 s, 9.0 s, 80 s / 20 rollouts = 4.0 s
    assert step == ["1.00x (3000.0 ms)", "3.00x (9000.0 ms)", "n/a (4000.0 ms)", "n/a (4000.0 ms)"]
    assert [r[8] for r in rows] == ["none", "none", "none", "s1: 0.300 → 0.200"]
    assert f"- reused, read from {a} (not run again): grpo_shop s0, s1." in lines
    assert f"- reused, read from {b} (not run again): t1_shop s1." in lines
    assert "- terminal (difficulty 0), tiny:terminal: no GRPO row with train_runtime: step time n/a." in lines

    result = json.loads((out / "result.json").read_text())
    assert result["bench"] == "learning" and result["environment"]["stub"] is True
    by_config = {r["config"]: r for r in result["measured"]["rows"]}
    assert by_config["t1_shop"]["step_time_vs_grpo"] == pytest.approx(3.0)
    assert by_config["mpo_term"]["step_time_vs_grpo"] is None and by_config["mpo_term"]["collapsed_seeds"] == [1]
    assert [s["reused_from"] for s in by_config["t1_shop"]["seeds"]] == [None, str(b)]
    assert [s["seconds_per_rollout"] for s in by_config["grpo_shop"]["seeds"]] == [2.5, 3.5]
    for png in ("curves.png", "curves_shop_d0.png", "curves_terminal_d0.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


def test_a_reused_run_of_another_environment_is_refused(bench):
    specs, out, a, b = bench
    (a / "grpo_shop-s1" / "summary.json").write_text(json.dumps(summary([0.2], environment="search")))
    with pytest.raises(SystemExit, match=r"grpo_shop-s1: the run has \{'environment': 'search'\}"):
        learning.main(["--configs", specs[2], "--seeds", "0", "1", "--out", str(out), "--reuse", str(a)])


def test_stored_only_tabulates_the_stored_seeds_and_trains_nothing(bench):
    specs, out, a, b = bench
    # seed 2 of every config is missing; grpo_shop has s0 and s1 in A, ppo_term s0 and s1 in OUT: 2 seeds each
    learning.main(["--configs", specs[2], specs[3], "--seeds", "0", "1", "2", "--out", str(out), "--reuse", str(a),
                   "--stored_only"])  # fmt: skip
    result = json.loads((out / "result.json").read_text())
    by_config = {r["config"]: r for r in result["measured"]["rows"]}
    assert [s["seed"] for s in by_config["grpo_shop"]["seeds"]] == [0, 1]
    assert [s["seed"] for s in by_config["ppo_term"]["seeds"]] == [0, 1]
    rows = [line for line in (out / "table.md").read_text().splitlines() if "| ppo_term |" in line]
    assert [c.strip() for c in rows[0].split("|")[1:-1]][4] == "2"  # the seeds column counts the stored runs
    with pytest.raises(SystemExit, match="no stored run of ppo_term"):
        learning.main(["--configs", specs[3], "--seeds", "2", "--out", str(out), "--stored_only"])


def test_a_missing_run_is_trained_with_the_overrides(tmp_path, monkeypatch):
    calls = []

    def train(cmd, **kwargs):  # stands in for train.py: records the command, writes the run's summary.json
        calls.append(cmd)
        write_run(Path(cmd[cmd.index("--output_dir") + 1]), summary([0.5]))

    monkeypatch.setattr(learning.subprocess, "run", train)
    run = learning.load("configs/quickstart.yaml@loss_type=dapo", 2, tmp_path, ["max_steps=5"], reuse=[tmp_path])
    assert run.seed == 2 and run.reused_from is None and run.summary["after"]["sampled"]["success"] == 0.4
    folder = tmp_path / "quickstart@loss_type=dapo-s2"
    assert calls[0][1:] == [str(learning.ROOT / "train.py"), "--config", "configs/quickstart.yaml", "--seed", "2",
                            "--output_dir", str(folder), "--max_steps", "5", "--loss_type", "dapo"]  # fmt: skip


def test_line_styles_keep_a_colour_per_method_and_give_an_ablation_a_colour_per_config():
    colors = {m: f"C{i}" for i, m in enumerate(learning.METHODS)}  # as plot() starts: grpo C0, ppo C2, t1 C3
    # a method's configs share its colour and differ by line style; a method not in METHODS takes the next colour
    got = learning.line_styles(["grpo", "ppo", "ppo", "t1", "xtree", "ppo", "ppo"], colors)
    assert got == [("C0", "-"), ("C2", "-"), ("C2", "--"), ("C3", "-"), ("C6", "-"), ("C2", ":"), ("C2", "-.")]
    assert colors["xtree"] == "C6"  # kept for the next panel
    # five configs of one method: more than the four line styles, so each config gets a colour of its own
    assert learning.line_styles(["t1"] * 5 + ["grpo"], colors) == [(f"C{i}", "-") for i in range(6)]
    # past ten colours the cycle repeats with the next line style
    twelve = learning.line_styles(["t1"] * 12, colors)
    assert twelve[9] == ("C9", "-") and twelve[10] == ("C0", "--") and twelve[11] == ("C1", "--")
    assert learning.line_styles([], colors) == []
