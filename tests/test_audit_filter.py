"""`audit_filter`: a run trains only on the tasks the task audit accepted (t1.md §4.6). Planted bad tasks, audited by
`python -m rewards.audit` against a scripted auditor on the loopback server, never reach training; a repaired task
trains with its repaired instruction; the counts kept and dropped are in summary.json."""

from __future__ import annotations

import json

import pytest
from conftest import CPU_ARGS

import train
from envs.base import row_task
from rewards.audit import main as audit_main
from tests.helpers.audit import KEY_ENV, planted_tasks, scripted_auditor
from tests.judge_server import JudgeServer


@pytest.fixture
def audited(tmp_path, monkeypatch):
    """A dataset folder whose train split holds 2 generated terminal tasks, 4 planted ones (a leaked answer, an
    impossible verifier, a vague instruction the audit repairs, an audit answer that never parses) and 2 tasks the
    audit never saw, one JSON `task` per row; and the audit folder of the 6 audited tasks."""
    monkeypatch.setenv(KEY_ENV, "sk-audit")
    tasks = planted_tasks()
    audited_file = tmp_path / "audited.jsonl"
    audited_file.write_text("".join(json.dumps(t) + "\n" for t in tasks))
    data = tmp_path / "data"
    data.mkdir()
    extra = [dict(tasks[0], task_id=f"new-{i}") for i in range(2)]
    rows = [{"task_id": t["task_id"], "task": json.dumps(t)} for t in [*tasks, *extra]]
    (data / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (data / "test.jsonl").write_text(
        json.dumps({"task_id": "held", "task": json.dumps(dict(tasks[0], task_id="held"))})
    )
    with JudgeServer(default=scripted_auditor) as server:
        audit_main(["--tasks", str(audited_file), "--out", str(tmp_path / "audit"), "--base_url", server.base_url,
                    "--model", "auditor", "--api_key_env", KEY_ENV, "--no_progress"])  # fmt: skip
    return data, tmp_path / "audit", tasks


def argv(data, folder, out, tiny_model_folder, *extra):
    cpu = [f"--{k}={v}" for k, v in CPU_ARGS.items()]
    return ["--environment", "terminal", "--dataset_name", str(data), "--num_eval_tasks", "1", "--audit_filter",
            str(folder), "--model_name_or_path", tiny_model_folder, "--max_steps", "1",
            "--per_device_train_batch_size", "4", "--num_generations", "2", "--max_completion_length", "24",
            "--max_turn_tokens", "4", "--skip_eval", "true", "--output_dir", str(out), *cpu, *extra]  # fmt: skip


def trained_tasks(monkeypatch) -> dict:
    seen = {}
    original = train.load_sources

    def spy(run, config):
        sources = original(run, config)
        seen["tasks"] = [row_task(r) for r in sources.train]
        return sources

    monkeypatch.setattr(train, "load_sources", spy)
    return seen


def test_planted_bad_tasks_are_dropped_and_counted(audited, tiny_model_folder, tmp_path, monkeypatch):
    data, folder, tasks = audited
    seen = trained_tasks(monkeypatch)
    summary = train.main(argv(data, folder, tmp_path / "run", tiny_model_folder))
    good = [t["task_id"] for t in tasks[:2]]
    assert sorted(t["task_id"] for t in seen["tasks"]) == sorted([*good, "vague-1"])
    vague = next(t for t in seen["tasks"] if t["task_id"] == "vague-1")
    assert vague["instruction"] == "create a file named zeta.txt containing apple"  # trains repaired
    expected = {"folder": str(folder), "tasks": 8, "kept": 3, "repaired": 1, "dropped_rejected": 3,
                "dropped_unaudited": 2, "kept_unaudited": 0}  # fmt: skip
    assert summary["audit_filter"] == expected
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["audit_filter"] == expected


def test_unaudited_tasks_can_be_kept_and_a_filter_that_keeps_nothing_stops(audited, tiny_model_folder, tmp_path,
                                                                            monkeypatch):  # fmt: skip
    data, folder, _ = audited
    seen = trained_tasks(monkeypatch)
    summary = train.main(argv(data, folder, tmp_path / "a", tiny_model_folder, "--audit_keep_unaudited", "true"))
    assert summary["audit_filter"]["kept"] == 5 and summary["audit_filter"]["kept_unaudited"] == 2
    assert {"new-0", "new-1"} <= {t["task_id"] for t in seen["tasks"]}
    empty = tmp_path / "empty_audit"
    empty.mkdir()
    (empty / "rejected.jsonl").write_text("")
    with pytest.raises(SystemExit, match="leaves no training task"):
        train.main(argv(data, empty, tmp_path / "b", tiny_model_folder))
    with pytest.raises(SystemExit, match="holds no accepted.jsonl"):
        train.main(argv(data, tmp_path / "nowhere", tmp_path / "c", tiny_model_folder))
