"""The benches' result folders: bench/record.py writes result.json and result.md, atomically; bench/rollout.py's
summary and table on a synthetic run; bench/overhead.py's method settings."""

import json
import sys
from argparse import Namespace

import pytest

from bench import record, rollout

LOOPS = (rollout.OURS, rollout.GENERATE_ARM, rollout.NO_REUSE, rollout.TRL)
SECONDS = {LOOPS[0]: [2.0, 1.0, 4.0], LOOPS[1]: [3.0, 3.0, 1.0], LOOPS[2]: [4.0, 5.0, 3.0], LOOPS[3]: [8.0, 8.0, 2.0]}


def synthetic_runs() -> list[dict]:
    """3 repeats x 4 loops x 4 episodes; every episode of a loop has the same turns, tokens and reward."""
    per_episode = {LOOPS[0]: (3, 30, 1.0), LOOPS[1]: (3, 30, 1.0), LOOPS[2]: (3, 30, 0.5), LOOPS[3]: (2, 10, 0.0)}
    runs = []
    for r in range(3):
        for position, name in enumerate(LOOPS if r % 2 == 0 else LOOPS[::-1]):
            turns, tokens, reward = per_episode[name]
            runs.append(
                {"repeat": r, "position": position, "loop": name, "seconds": SECONDS[name][r],
                 "turns": [turns] * 4, "model_tokens": [tokens] * 4, "rewards": [reward] * 4}
            )  # fmt: skip
    return runs


def args() -> Namespace:
    return Namespace(episodes=4, repeats=3, group_size=2, max_turn_tokens=8, max_turns=4, max_completion_length=64,
                     threads=1)  # fmt: skip


def test_rollout_summary_medians_and_ratios():
    summary = rollout.summarise(synthetic_runs(), episodes=4)
    ours, generate, plain, trl = (summary["loops"][name] for name in LOOPS)
    # medians: ours 2 s -> 4/2 = 2 episodes/s; through generate 3 s -> 4/3; no reuse 4 s -> 1; TRL 8 s -> 0.5
    assert (ours["episodes_per_s"], plain["episodes_per_s"], trl["episodes_per_s"]) == (2.0, 1.0, 0.5)
    assert generate["episodes_per_s"] == 4 / 3 and summary["ratio_decode_loop_over_generate"] == 1.5
    assert ours["times_s"] == [2.0, 1.0, 4.0]  # every timed call, in repeat order, not only the median
    assert ours["turns_per_s"] == 6.0 and ours["model_tokens_per_s"] == 60.0  # 2 eps/s x 3 turns, x 30 tokens
    assert (ours["success"], plain["success"], plain["reward"]) == (1.0, 0.0, 0.5)  # success = reward 1.0 only
    assert summary["ratio_ours_over_trl"] == 4.0 and summary["ratio_kv_reuse_over_no_reuse"] == 2.0


def test_write_result_files(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench/rollout.py", "--episodes", "4", "--out", str(tmp_path)])
    runs = synthetic_runs()
    summary = rollout.summarise(runs, episodes=4)
    text = rollout.report(summary, args(), "/cache/tiny-shop-tools-x")
    json_path, md_path = record.write_result(tmp_path, "rollout", {"episodes": 4}, {"runs": runs, **summary}, text)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "result.md"]

    result = json.loads(json_path.read_text())
    assert set(result) == {"bench", "command", "settings", "measured", "environment"}
    assert result["bench"] == "rollout" and result["command"] == sys.argv and result["settings"] == {"episodes": 4}
    assert len(result["measured"]["runs"]) == 12  # 3 repeats x 4 loops, each timing kept
    assert [run["seconds"] for run in result["measured"]["runs"] if run["loop"] == LOOPS[3]] == SECONDS[LOOPS[3]]
    env = result["environment"]
    assert {"timestamp", "versions", "torch_threads", "platform", "cpu_count"} <= set(env)
    assert {"torch", "transformers", "trl"} <= set(env["versions"]) and env["platform"]["system"]

    lines = md_path.read_text().splitlines()
    assert lines[0] == f"`python bench/rollout.py --episodes 4 --out {tmp_path}`"
    table = [line for line in lines if line.startswith("|")]
    assert table[0].startswith("| loop | episodes/s (median) | times (s) |") and set(table[1]) == {"|", "-"}
    rows = table[2:]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == list(LOOPS)  # one row per loop
    assert all(row.count("|") == table[0].count("|") == 9 for row in rows)  # 8 columns
    assert "| 2.0, 1.0, 4.0 |" in rows[0]
    assert "ratio of medians (ours / TRL, episodes/s): 4.00" in lines
    assert "ratio of medians (own decode loop / transformers generate, episodes/s): 1.50" in lines


def test_rollout_report_states_the_ceiling():
    summary = rollout.summarise(synthetic_runs(), episodes=4)
    summary |= {"ceiling_tokens_per_s": 400.0, "tokens_per_episode": 50}
    line = rollout.report(summary, args(), "/cache/m").splitlines()[-1]
    # ours: 2 episodes/s x 50 tokens = 100 tokens/s, a quarter of the ceiling
    assert line.endswith("at 100 tokens/s, 25.0% of it") and "400 tokens/s" in line


def test_failed_write_leaves_the_old_result_and_no_partial_file(tmp_path, monkeypatch):
    record.write_result(tmp_path, "overhead", {}, {"seconds_per_step": {"grpo": 1.0}}, "| method |\n|---|\n| grpo |")
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}

    with pytest.raises(TypeError):  # not JSON-serialisable: raised before any file is touched
        record.write_result(tmp_path, "overhead", {}, {"seconds_per_step": object()}, "| method |")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before

    synced = []

    def fsync_fails_on_the_second_file(fd):
        synced.append(fd)
        if len(synced) == 2:
            raise OSError("disk full")

    monkeypatch.setattr(record.os, "fsync", fsync_fails_on_the_second_file)
    with pytest.raises(OSError, match="disk full"):
        record.write_result(tmp_path, "overhead", {}, {"seconds_per_step": {"grpo": 2.0}}, "| method |\n| grpo |")
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == before  # neither file replaced, no temporary left

    def interrupted(src, dst):
        raise KeyboardInterrupt

    fresh = tmp_path / "fresh"
    monkeypatch.setattr(record.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):  # interrupted at the first move: nothing in the new folder
        record.write_result(fresh, "overhead", {}, {"seconds_per_step": {"grpo": 2.0}}, "| method |")
    assert list(fresh.iterdir()) == []


def test_overhead_method_settings_after_at():
    from bench import overhead

    assert overhead.method_spec("grpo") == ("grpo", {})
    name, settings = overhead.method_spec("ppo@critic_model_name_or_path=policy,critic_num_layers=1")
    assert name == "ppo" and settings == {"critic_model_name_or_path": "policy", "critic_num_layers": 1}
    for bad, message in [
        ("mop", "unknown method"),
        ("mpo@critic_num_layers", "FIELD=VALUE"),
        ("mpo@layers=1", "no field"),
    ]:
        with pytest.raises(SystemExit, match=message):
            overhead.method_spec(bad)
