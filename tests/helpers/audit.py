"""The task audit's scripted auditor and planted tasks: used by test_audit, test_audit_filter."""

from __future__ import annotations

import json
import re

from envs.terminal import TerminalEnv
from rewards.audit import DIMENSIONS, HARD_FLAGS
from tests.judge_server import ok

KEY_ENV = "AUDIT_TEST_KEY"


def report(scores: dict | None = None, flags: tuple[str, ...] = (), **extra) -> dict:
    values = {d: 9 for d in DIMENSIONS} | (scores or {})
    return {
        "schema_version": "1",
        "task_id": "t",
        "scores": {d: {"score": s, "rationale": "ok"} for d, s in values.items()},
        "hard_rejects": {f: {"flag": f in flags, "evidence": "seen" if f in flags else ""} for f in HARD_FLAGS},
        "repair": {"instruction_only_fixable": False, "proposed_instruction": None},
        "category": "file_operations",
        **extra,
    }


def planted_tasks() -> list[dict]:
    good = TerminalEnv.make_tasks("train", 2, seed=4)
    base = {"env": "terminal", "difficulty": 0, "files": {}, "dirs": []}
    apple = [{"kind": "file_equals", "path": "zeta.txt", "content": "apple"}]
    return [
        *good,
        {**base, "task_id": "leak-1", "instruction": "create zeta.txt containing apple (expected output: PASS "
         "file_equals zeta.txt apple)", "assertions": apple, "solution": ["echo apple > zeta.txt"]},
        {**base, "task_id": "impossible-1", "instruction": "create a file named zeta.txt containing apple",
         "assertions": [{"kind": "file_equals", "path": "zeta.txt", "content": "banana"}],
         "solution": ["echo apple > zeta.txt"]},
        {**base, "task_id": "vague-1", "instruction": "put apple in the usual file", "assertions": apple,
         "solution": ["echo apple > zeta.txt"]},
        {**base, "task_id": "broken-1", "instruction": "create the directory kappa",
         "assertions": [{"kind": "dir_exists", "path": "kappa"}], "solution": ["mkdir kappa"]},
    ]  # fmt: skip


def scripted_auditor(body) -> object:
    """Reads the request like an auditor would: instruction, verifier and solution sections of the prompt."""
    text = body["messages"][1]["content"]
    task_id = re.search(r"^task_id: (\S+)$", text, flags=re.MULTILINE).group(1)
    if task_id == "broken-1":
        return ok("The task looks fine to me!")  # never valid JSON: fail closed
    instruction = text.split("## Instruction\n", 1)[1].split("\n\n## ", 1)[0]
    verifier = json.loads(text.split("## Verifier\n", 1)[1].split("\n\n## ", 1)[0])
    answer = report(verdict="accept", total=10)  # verdict-like extras, ignored
    answer["task_id"] = task_id
    if "expected output" in instruction:
        answer["hard_rejects"]["test_leakage"] = {"flag": True, "evidence": "the instruction shows the checker output"}
    for a in verifier.get("assertions", []):
        if a["kind"] == "file_equals" and a["content"] not in instruction and "usual file" not in instruction:
            answer["hard_rejects"]["hidden_requirements"] = {"flag": True, "evidence": f"checks {a['content']!r}"}
            answer["scores"]["instruction_verifier_alignment"]["score"] = 1
            answer["scores"]["solution_correctness"]["score"] = 1  # the reference solution cannot pass
    if "usual file" in instruction:
        answer["scores"]["instruction_completeness"]["score"] = 2
        answer["repair"] = {
            "instruction_only_fixable": True,
            "proposed_instruction": "create a file named zeta.txt containing apple",
        }
    return ok(json.dumps(answer))
