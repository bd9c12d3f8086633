"""The T1 task audit (t1.md §4.6, Eq. 20-21, D17; §7 items 33-38): the verdict rules on literal reports, and the
`python -m rewards.audit` command end to end against a scripted auditor on the loopback server (planted bad tasks,
repair and re-audit, fail-closed answers, resume without re-asking, bad input)."""

from __future__ import annotations

import json
import random
import re
import socket

import pytest

from rewards.audit import DIMENSIONS, HARD_FLAGS, AuditReport, audit_verdict, main, read_tasks, weighted_score
from tests.helpers.audit import KEY_ENV, planted_tasks, report, scripted_auditor
from tests.judge_server import JudgeServer, ok


def verdict(**kw):
    return audit_verdict(AuditReport.model_validate(report(**kw)))


# ---------------------------------------------------------------------------------------------------------------------
# Layer 1: the verdict is computed by code (Eq. 20-21, D17)


def test_weights_sum_to_one_and_q_is_monotone():
    assert sum(w for w, _ in DIMENSIONS.values()) == pytest.approx(1.0)
    rng = random.Random(0)
    for _ in range(200):  # §7 item 35: Q is non-decreasing in each dimension score
        scores = {d: rng.randint(0, 10) for d in DIMENSIONS}
        d = rng.choice(list(DIMENSIONS))
        higher = scores | {d: min(10, scores[d] + rng.randint(0, 3))}
        assert weighted_score(higher) >= weighted_score(scores)
    # Eq. 20 by hand: all 9 except task_value 4: (0.9 · 0.9) + 0.1 · 0.4 = 0.85
    assert weighted_score({d: 9 for d in DIMENSIONS} | {"task_value": 4}) == pytest.approx(0.85)


def test_hard_flags_and_critical_minimums_block_acceptance():
    perfect = {d: 10 for d in DIMENSIONS}
    for flag in ("test_leakage", "solution_shortcut", "weak_verifier"):  # §7 item 33; final flags (D17)
        v = verdict(scores=perfect, flags=(flag,))
        assert v.verdict == "reject" and f"flag:{flag}" in v.reasons and v.q == 1.0
    assert verdict(scores=perfect, flags=("hidden_requirements",)).verdict == "repair"  # instruction side
    # §7 item 34: a critical dimension under 4 blocks acceptance whatever Q is
    v = verdict(scores=perfect | {"verifier_fairness": 3})
    assert v.verdict == "reject" and v.reasons == ["below_minimum:verifier_fairness"] and v.q == 0.895  # 1 - .15·.7
    assert verdict(scores=perfect | {"instruction_clarity": 3}).verdict == "repair"
    assert verdict(scores=perfect | {"task_value": 0}).verdict == "accept"  # task_value has no minimum
    # instruction-side problems plus a final one: reject, no repair
    v = verdict(scores=perfect | {"solution_correctness": 1}, flags=("hidden_requirements",))
    assert v.verdict == "reject" and set(v.reasons) == {
        "below_minimum:solution_correctness",
        "flag:hidden_requirements",
    }
    # Eq. 21 step 3: accept at 0.75, borderline in [0.60, 0.75), reject below
    base = {d: 7 for d in DIMENSIONS}
    assert weighted_score(base | {"verifier_fairness": 10}) == 0.745
    assert verdict(scores=base | {"verifier_fairness": 10, "task_value": 8}).verdict == "accept"  # exactly 0.755
    assert verdict(scores={d: 8 for d in DIMENSIONS} | {"task_value": 0, "verifier_coverage": 5}).q == 0.69
    assert (
        verdict(scores=base).verdict == "borderline" and verdict(scores={d: 5 for d in DIMENSIONS}).verdict == "reject"
    )


def test_extra_verdict_fields_are_ignored_and_the_schema_is_enforced():
    # §7 item 36: a total score or verdict in the auditor's answer changes nothing
    sneaky = report(flags=("test_leakage",), verdict="accept", total_score=1.0, q=1.0)
    assert audit_verdict(AuditReport.model_validate(sneaky)).verdict == "reject"
    with pytest.raises(ValueError, match="evidence"):  # a flag without evidence is malformed
        AuditReport.model_validate(report() | {"hard_rejects": {f: {"flag": True} for f in HARD_FLAGS}})
    with pytest.raises(ValueError):  # scores outside 0-10
        AuditReport.model_validate(report(scores={"task_value": 11}))
    bad = report()
    del bad["scores"]["verifier_coverage"]
    with pytest.raises(ValueError, match="verifier_coverage"):
        AuditReport.model_validate(bad)


# ---------------------------------------------------------------------------------------------------------------------
# Layer 2: the command against a scripted auditor


@pytest.fixture
def audit_env(tmp_path, monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-audit")
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(t) + "\n" for t in planted_tasks()))
    with JudgeServer(default=scripted_auditor) as server:

        def run(out: str = "out", *extra: str) -> dict:
            args = ["--tasks", str(tasks_file), "--out", str(tmp_path / out), "--base_url", server.base_url]
            return main([*args, "--model", "auditor-test", "--api_key_env", KEY_ENV, "--no_progress", *extra])

        yield run, server, tmp_path


def read(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_audit_rejects_planted_tasks_repairs_and_resumes(audit_env):
    run, server, tmp_path = audit_env
    summary = run()
    accepted, rejected = read(tmp_path / "out/accepted.jsonl"), read(tmp_path / "out/rejected.jsonl")
    good_ids = [t["task_id"] for t in planted_tasks()[:2]]
    assert sorted(r["task_id"] for r in accepted) == sorted([*good_ids, "vague-1"])
    by_id = {r["task_id"]: r for r in rejected}
    assert set(by_id) == {"leak-1", "impossible-1", "broken-1"}
    assert by_id["leak-1"]["reasons"] == ["flag:test_leakage"]  # a leaked answer
    assert "below_minimum:solution_correctness" in by_id["impossible-1"]["reasons"]  # an impossible verifier
    assert "flag:hidden_requirements" in by_id["impossible-1"]["reasons"]
    assert by_id["broken-1"]["reasons"] == ["audit_failed"]
    vague = next(r for r in accepted if r["task_id"] == "vague-1")  # repaired: only the instruction changed
    assert vague["repaired"] and vague["reaudit"]["verdict"] == "accept" and vague["original_instruction"]
    original = next(t for t in planted_tasks() if t["task_id"] == "vague-1")
    assert vague["task"] == original | {"instruction": "create a file named zeta.txt containing apple"}
    assert all(r["auditor_model"] == "auditor-test" and len(r["prompt_sha256"]) == 64 for r in accepted + rejected)
    # requests: 1 per good, leak and impossible task, 2 for the repaired one, 3 for the malformed one (2 re-asks)
    assert len(server.requests) == 2 + 1 + 1 + 2 + 3
    assert server.requests[0].headers["authorization"] == "Bearer sk-audit"
    assert summary["accepted"] == 3 and summary["repaired"] == summary["reaccepted"] == 1
    assert summary["audit_failed"] == 1 and summary["hard_flags"] == {"test_leakage": 1, "hidden_requirements": 1}
    assert json.loads((tmp_path / "out/report.json").read_text()) == summary
    # a rerun resumes: nothing is asked again and nothing is written twice
    before = (tmp_path / "out/accepted.jsonl").read_text(), (tmp_path / "out/rejected.jsonl").read_text()
    assert run() == summary and len(server.requests) == 9
    assert before == ((tmp_path / "out/accepted.jsonl").read_text(), (tmp_path / "out/rejected.jsonl").read_text())
    # --retry_failed asks again only for the fail-closed task, and keeps one record of it; as it fails again, every
    # call of this run failed, which ends the run with an error
    with pytest.raises(SystemExit, match="every one of the 1 audit calls failed"):
        run("out", "--retry_failed")
    assert len(server.requests) == 9 + 3
    assert [r["task_id"] for r in read(tmp_path / "out/rejected.jsonl")].count("broken-1") == 1


def test_audit_resumes_after_an_interruption(audit_env):
    run, server, tmp_path = audit_env
    run("part", "--limit", "3")
    assert len(read(tmp_path / "part/accepted.jsonl") + read(tmp_path / "part/rejected.jsonl")) == 3
    with (tmp_path / "part/accepted.jsonl").open("a") as handle:  # a crash in the middle of a write
        handle.write('{"task_id": "leak-1", "verd')
    run("part")
    records = read(tmp_path / "part/accepted.jsonl") + read(tmp_path / "part/rejected.jsonl")
    assert sorted(r["task_id"] for r in records) == sorted(t["task_id"] for t in planted_tasks())  # each once
    assert len(server.requests) == 9  # every task was asked exactly as often as in one uninterrupted run


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"task_id": "a", "instruction": "x"}\nnot json\n', "line 2 is not valid JSON"),
        ('{"task_id": "a"}\n', "line 1: field 'instruction'"),
        ('{"task_id": "a", "instruction": "x"}\n\n{"task_id": "a", "instruction": "y"}\n', "line 3: duplicate"),
        ("[1, 2]\n", "line 1 is not a JSON object"),
        ("\n", "holds no task"),
    ],
)
def test_bad_input_is_named(tmp_path, content, needle):
    path = tmp_path / "tasks.jsonl"
    path.write_text(content)
    with pytest.raises(SystemExit, match=re.escape(needle)):
        read_tasks(path)
    with pytest.raises(SystemExit, match="does not exist"):
        main(
            ["--tasks", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path), "--base_url", "http://x", "--model", "m"]
        )


def test_an_unreachable_or_refusing_auditor_stops_with_an_error(audit_env, tmp_path):
    """A wrong base_url or a rejected key stops before any task is audited; an auditor that answers every task with
    nothing usable ends the run with an error (the fail-closed records are kept for --retry_failed)."""
    run, server, _ = audit_env
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: connections are refused
    args = ["--tasks", str(tmp_path / "tasks.jsonl"), "--model", "m", "--api_key_env", KEY_ENV, "--no_progress"]
    with pytest.raises(SystemExit, match="cannot be reached"):
        main([*args, "--out", str(tmp_path / "refused"), "--base_url", f"http://127.0.0.1:{port}/v1"])
    assert not (tmp_path / "refused" / "rejected.jsonl").exists()
    server.models_status = 401
    with pytest.raises(SystemExit, match=f"answered HTTP 401 to the key in {KEY_ENV}"):
        run("rejected")
    assert server.requests == []
    server.models_status = 200  # the probe passes, but every audit answer is unusable
    server.default = lambda body: ok("no JSON here")
    with pytest.raises(SystemExit, match=f"every one of the {len(planted_tasks())} audit calls failed"):
        run("garbage")
    assert len(read(tmp_path / "garbage/rejected.jsonl")) == len(planted_tasks())
