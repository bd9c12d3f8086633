"""T1's semantic task audit as a command (t1.md §4.6, Eq. 20-21, D17; arXiv 2609.11042):

    python -m rewards.audit --tasks tasks.jsonl --out DIR --base_url http://host:8000/v1 --model NAME \
        [--api_key_env OPENAI_API_KEY] [--concurrency 16] [--limit N] [--retry_failed] [--cache FILE]
    python -m rewards.audit --tasks tasks.jsonl --out DIR --serve_model smollm2   # served on loopback meanwhile

Each task (one JSON object per line with `task_id` and `instruction`; the other fields are shown to the auditor as the
environment, the verifier and the reference solution) is sent to an LLM auditor over the `openai` client
(`rewards.judge.Judge`, temperature 0). The auditor scores eight dimensions 0-10 and sets four hard-reject flags; it is
never asked for a total or a verdict, and extra fields in its answer are ignored. The verdict is computed here:

1. Q = Σ_d w_d · s_d / 10 (Eq. 20; the weights sum to 1).
2. Eq. 21 with D17: `test_leakage`, `solution_shortcut`, `weak_verifier`, or a verifier/solution dimension below its
   critical minimum (4) -> reject. Otherwise `hidden_requirements` or an instruction dimension below its minimum ->
   repair. Otherwise Q >= 0.75 -> accept, 0.60 <= Q < 0.75 -> borderline (repair), Q < 0.60 -> reject.
3. Repair (at most one round): the auditor's `proposed_instruction` replaces the instruction only, and the task is
   audited again with the same rubric; it is accepted only if the re-audit accepts it.

Output in `--out`: `accepted.jsonl` and `rejected.jsonl` (one record per task: verdict, reasons, Q, scores, flags and
evidence, category, repair lineage, auditor model id and prompt hash, and the task itself, repaired where it was) and
`report.json` (counts of accept / borderline / reject / repaired / re-accepted, hard-flag counts, category shares).
Answers that still fail the schema after two re-asks, and tasks whose requests all failed, are rejected with cause
`audit_failed` (fail closed); `--retry_failed` audits those again. A rerun resumes: task ids already in either file are
skipped, and every record is appended as one line with a single write and an fsync (a torn last line from a crash is
cut off on the next start).

Decision ids (`Dn`) without a page are docs/methods/t1.md's.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pydantic
from tqdm.auto import tqdm

from rewards.judge import APIModelFields, Judge, check_endpoint

# key -> (weight w_d, critical minimum or None); t1.md §4.6 table and D17
DIMENSIONS: dict[str, tuple[float, int | None]] = {
    "instruction_verifier_alignment": (0.20, 4),
    "verifier_fairness": (0.15, 4),
    "verifier_coverage": (0.10, 4),
    "solution_correctness": (0.15, 4),
    "solution_reasonableness": (0.10, 4),
    "instruction_clarity": (0.10, 4),
    "instruction_completeness": (0.10, 4),
    "task_value": (0.10, None),
}
INSTRUCTION_DIMENSIONS = ("instruction_clarity", "instruction_completeness")
HARD_FLAGS = ("hidden_requirements", "test_leakage", "solution_shortcut", "weak_verifier")
FINAL_FLAGS = ("test_leakage", "solution_shortcut", "weak_verifier")  # D17: an instruction rewrite cannot fix these
ACCEPT_AT, BORDERLINE_AT = 0.75, 0.60
# the auditor's endpoint options `--model`, `--base_url`, ... (declared from `rewards.judge.API_MODEL_FIELDS`)
AUDITOR = APIModelFields(
    "",
    ("model", "base_url", "api_key_env", "cache_path", "concurrency", "timeout", "max_retries"),
    defaults={"concurrency": 16},
    help={
        "model": "auditor model id at the endpoint (required unless --serve_model)",
        "base_url": "OpenAI-compatible base URL, e.g. http://host:8000/v1 (required unless --serve_model)",
        "api_key_env": "environment variable holding the API key",
        "cache_path": "sqlite3 cache of auditor answers (optional)",
        "concurrency": "most requests in flight",
        "timeout": "seconds per request attempt",
        "max_retries": "re-sends after a transport error",
    },
)
CATEGORIES = (
    "scripting", "software_development", "system_administration", "environment_setup", "version_control",
    "data_processing", "file_operations", "networking", "security", "other",
)  # fmt: skip
TEMPLATE_VERSION = "t1-audit-v1"


# ---------------------------------------------------------------------------------------------------------------------
# The auditor's output contract (t1.md §4.6)


class DimensionScore(pydantic.BaseModel):
    score: int = pydantic.Field(ge=0, le=10)
    rationale: str = ""

    @pydantic.field_validator("rationale")
    @classmethod
    def _cap(cls, value: str) -> str:
        return value[:300]  # "string <= 300 chars": kept, not failed, when longer


class AuditScores(pydantic.BaseModel):
    instruction_verifier_alignment: DimensionScore
    verifier_fairness: DimensionScore
    verifier_coverage: DimensionScore
    solution_correctness: DimensionScore
    solution_reasonableness: DimensionScore
    instruction_clarity: DimensionScore
    instruction_completeness: DimensionScore
    task_value: DimensionScore


class Flag(pydantic.BaseModel):
    flag: bool
    evidence: str = ""

    @pydantic.model_validator(mode="after")
    def _evidence_when_flagged(self) -> Flag:
        if self.flag and not self.evidence.strip():
            raise ValueError("evidence is required when flag is true")
        return self


class HardRejects(pydantic.BaseModel):
    hidden_requirements: Flag
    test_leakage: Flag
    solution_shortcut: Flag
    weak_verifier: Flag


class Repair(pydantic.BaseModel):
    instruction_only_fixable: bool = False
    proposed_instruction: str | None = None


class AuditReport(pydantic.BaseModel):
    """One auditor answer. Extra fields (a total, a verdict) are ignored (t1.md §7 item 36)."""

    schema_version: str | int = "1"
    task_id: str | int = ""
    scores: AuditScores
    hard_rejects: HardRejects
    repair: Repair = pydantic.Field(default_factory=Repair)
    category: str = "other"


# ---------------------------------------------------------------------------------------------------------------------
# The verdict, computed by code (Eq. 20-21, D17)


@dataclass
class Verdict:
    verdict: str  # "accept", "borderline", "repair" or "reject"
    q: float
    reasons: list[str]


def weighted_score(scores: dict[str, int]) -> float:
    """Q = Σ_d w_d · s_d / 10 ∈ [0, 1] (t1.md Eq. 20).

    >>> weighted_score({d: 10 for d in DIMENSIONS}), weighted_score({d: 5 for d in DIMENSIONS})
    (1.0, 0.5)
    """
    points = sum(round(w * 100) * scores[d] for d, (w, _) in DIMENSIONS.items())  # integers: thresholds are exact
    return points / 1000  # Eq. 20


def audit_verdict(report: AuditReport) -> Verdict:
    """t1.md Eq. 21 with D17. `repair` marks instruction-side-only problems; `borderline` goes to repair too.

    >>> report = {"scores": {d: {"score": 9} for d in DIMENSIONS}, "hard_rejects": {f: {"flag": False} for f in
    ...           HARD_FLAGS}}
    >>> audit_verdict(AuditReport.model_validate(report)).verdict
    'accept'
    """
    scores = {d: getattr(report.scores, d).score for d in DIMENSIONS}
    flags = [f for f in HARD_FLAGS if getattr(report.hard_rejects, f).flag]
    low = [d for d, (_, minimum) in DIMENSIONS.items() if minimum is not None and scores[d] < minimum]
    q = weighted_score(scores)
    final = [f"flag:{f}" for f in flags if f in FINAL_FLAGS] + [
        f"below_minimum:{d}" for d in low if d not in INSTRUCTION_DIMENSIONS
    ]
    instruction_side = [f"flag:{f}" for f in flags if f not in FINAL_FLAGS] + [
        f"below_minimum:{d}" for d in low if d in INSTRUCTION_DIMENSIONS
    ]
    if final:  # Eq. 21 steps 1-2: no repair can fix these (D17)
        return Verdict("reject", q, final + instruction_side)
    if instruction_side:  # Eq. 21 steps 1-2, the instruction-side exception (D17)
        return Verdict("repair", q, instruction_side)
    if q >= ACCEPT_AT:  # Eq. 21 step 3
        return Verdict("accept", q, [])
    if q >= BORDERLINE_AT:
        return Verdict("borderline", q, [f"borderline_score:{q:.3f}"])
    return Verdict("reject", q, [f"low_score:{q:.3f}"])


# ---------------------------------------------------------------------------------------------------------------------
# Input, prompt and output

SYSTEM_PROMPT = f"""You audit tasks for training terminal and tool-using agents with reinforcement learning. \
Each task has an instruction the agent sees, an environment, a verifier that checks the agent's work, and a reference \
solution.

Score each dimension with an integer from 0 (worst) to 10 (best) and a rationale of at most 300 characters:
- instruction_verifier_alignment: every verifier check follows from the instruction, and every essential stated \
requirement is checked;
- verifier_fairness: any valid solution passes; no brittle checks on incidental details, no flakiness;
- verifier_coverage: the checks establish the task goal, not just side effects;
- solution_correctness: the reference solution passes and is actually correct;
- solution_reasonableness: the reference solution is a realistic, non-contrived approach within the limits;
- instruction_clarity: unambiguous, well specified;
- instruction_completeness: self-contained; the paths, formats and constraints needed to succeed are stated;
- task_value: realistic, useful, non-trivial skill.

Set each hard-reject flag (with evidence when true):
- hidden_requirements: the verifier checks something the instruction neither states nor clearly implies;
- test_leakage: tests, expected outputs or the solution are visible to the agent (in the environment or instruction);
- solution_shortcut: the verifier can be passed without doing the task (hard-coded outputs, editing tests, ...);
- weak_verifier: the verifier cannot establish whether the goal was achieved.

If the only problems are in the instruction, set repair.instruction_only_fixable and propose a rewritten instruction \
(repair.proposed_instruction) that changes nothing but the instruction text; otherwise leave it null. Pick a category \
from: {", ".join(CATEGORIES)}.

Answer with a single JSON object and nothing else: {{"schema_version": "1", "task_id": ..., "scores": {{<the eight \
keys>: {{"score": int, "rationale": str}}}}, "hard_rejects": {{<the four keys>: {{"flag": bool, "evidence": str}}}}, \
"repair": {{"instruction_only_fixable": bool, "proposed_instruction": str or null}}, "category": str}}. Do not give a \
total score or a verdict."""

SECTIONS = {  # prompt section -> task fields shown in it, in order
    "Environment": ("environment", "files", "dirs", "corpus", "catalogue_seed"),
    "Verifier": ("verifier", "tests", "assertions", "answer", "target"),
    "Reference solution": ("solution", "reference_solution", "hops"),
}
_NOT_SHOWN = {"task_id", "instruction", "split"}


class TaskFileError(SystemExit):
    """A bad input file: the message names the file, the line and the field."""

    def __init__(self, message: str) -> None:
        super().__init__(f"error: {message}")


def read_tasks(path: str | os.PathLike[str]) -> list[dict]:
    """Tasks from a JSONL file; raises `TaskFileError` naming the line and field of the first problem."""
    path = Path(path)
    if not path.is_file():
        raise TaskFileError(f"--tasks file {str(path)!r} does not exist")
    tasks, first_line = [], {}
    with path.open(encoding="utf-8") as handle:
        for n, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as err:
                raise TaskFileError(f"{path} line {n} is not valid JSON: {err.msg}") from None
            if not isinstance(task, dict):
                raise TaskFileError(f"{path} line {n} is not a JSON object")
            for name in ("task_id", "instruction"):
                value = task.get(name)
                if isinstance(value, bool) or not isinstance(value, str | int) or not str(value).strip():
                    raise TaskFileError(f"{path} line {n}: field {name!r} is missing or empty")
            task_id = str(task["task_id"])
            if task_id in first_line:
                raise TaskFileError(
                    f"{path} line {n}: duplicate task_id {task_id!r} (first on line {first_line[task_id]})"
                )
            first_line[task_id] = n
            tasks.append(task)
    if not tasks:
        raise TaskFileError(f"{path} holds no task")
    return tasks


def audit_messages(task: dict) -> list[dict[str, str]]:
    """The auditor request: instruction, environment, verifier and reference solution (t1.md §4.6)."""
    parts = [f"task_id: {task['task_id']}", f"## Instruction\n{task['instruction']}"]
    shown = set(_NOT_SHOWN)
    for title, fields in SECTIONS.items():
        values = {f: task[f] for f in fields if f in task}
        shown |= set(fields)
        if values:
            parts.append(f"## {title}\n{json.dumps(values, indent=1, ensure_ascii=False)}")
    rest = {k: v for k, v in task.items() if k not in shown}
    if rest:
        parts.append(f"## Other task fields\n{json.dumps(rest, indent=1, ensure_ascii=False)}")
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "\n\n".join(parts)}]


def prompt_hash(messages: Sequence[dict]) -> str:
    blob = json.dumps([TEMPLATE_VERSION, list(messages)], sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(blob.encode()).hexdigest()


class JsonlSink:
    """Append-only JSONL file: one `os.write` per record (O_APPEND) followed by an fsync."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict) -> None:
        os.write(self._fd, (json.dumps(record, ensure_ascii=False) + "\n").encode())
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def read_records(path: Path) -> list[dict]:
    """Records of an output file; a torn last line (no newline: a crash mid-write) is cut off first."""
    if not path.exists():
        return []
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        print(f"warning: {path} ends with a torn line; removing it", file=sys.stderr)
        with path.open("r+b") as handle:
            handle.truncate(keep)
        data = data[:keep]
    records = []
    for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise TaskFileError(f"{path} line {n} is not valid JSON ({err.msg}); fix or remove it to resume") from None
    return records


def _record(task: dict, verdict: str, initial: Verdict | None, report: AuditReport | None, **extra: Any) -> dict:
    out = {"task_id": str(task["task_id"]), "verdict": verdict, "initial_verdict": initial and initial.verdict}
    out["q"] = initial.q if initial else None
    out["reasons"] = initial.reasons if initial else ["audit_failed"]
    if report is not None:
        out["scores"] = {d: getattr(report.scores, d).score for d in DIMENSIONS}
        out["hard_rejects"] = {f: getattr(report.hard_rejects, f).flag for f in HARD_FLAGS}
        out["flag_evidence"] = {f: getattr(report.hard_rejects, f).evidence for f in HARD_FLAGS}
        out["category"] = report.category
    return out | extra | {"task": task}


class Auditor:
    """Audits tasks with one judge; `audit(task)` returns the output record (never raises for a judge failure)."""

    def __init__(self, judge: Judge) -> None:
        self.judge = judge

    async def _ask(self, task: dict) -> tuple[AuditReport | None, Verdict | None, str]:
        messages = audit_messages(task)
        report = await self.judge.score(messages, AuditReport, temperature=0.0)
        return report, (audit_verdict(report) if report is not None else None), prompt_hash(messages)

    async def audit(self, task: dict) -> dict:
        lineage = {"auditor_model": self.judge.config.model, "template": TEMPLATE_VERSION}
        report, first, digest = await self._ask(task)
        lineage["prompt_sha256"] = digest
        if first is None:
            return _record(task, "reject", None, None, repaired=False, **lineage)
        if first.verdict == "accept":
            return _record(task, "accept", first, report, repaired=False, **lineage)
        if first.verdict == "reject":
            return _record(task, "reject", first, report, repaired=False, **lineage)
        proposal = (report.repair.proposed_instruction or "").strip()  # repair or borderline: one repair round
        if not proposal or proposal == str(task["instruction"]).strip():
            record = _record(task, "reject", first, report, repaired=False, **lineage)
            record["reasons"] = [*first.reasons, "no_repair_proposed"]
            return record
        repaired = {**task, "instruction": proposal}  # only the instruction changes (t1.md §7 item 38)
        report2, second, digest2 = await self._ask(repaired)
        record = _record(
            repaired if second is not None and second.verdict == "accept" else task,
            "accept" if second is not None and second.verdict == "accept" else "reject",
            first,
            report,
            repaired=True,
            original_instruction=task["instruction"],
            proposed_instruction=proposal,
            reaudit={
                "verdict": second.verdict if second else None,
                "q": second.q if second else None,
                "reasons": second.reasons if second else ["audit_failed"],
                "prompt_sha256": digest2,
            },
            **lineage,
        )
        if record["verdict"] == "reject":
            record["reasons"] = [*first.reasons, "repair_not_accepted"]
        return record


def summarize(records: Sequence[dict]) -> dict:
    """The offline audit report (t1.md §8): counts, hard-flag counts, category shares."""
    verdicts = Counter(r["verdict"] for r in records)
    initial = Counter(r.get("initial_verdict") or "audit_failed" for r in records)
    flags = Counter(f for r in records for f, on in (r.get("hard_rejects") or {}).items() if on)
    categories = Counter(r.get("category", "unknown") for r in records if r["verdict"] == "accept")
    accepted = max(1, verdicts["accept"])
    return {
        "tasks": len(records),
        "accepted": verdicts["accept"],
        "rejected": verdicts["reject"],
        "initial": dict(initial),
        "borderline": initial["borderline"],
        "repaired": sum(bool(r.get("repaired")) for r in records),
        "reaccepted": sum(bool(r.get("repaired")) and r["verdict"] == "accept" for r in records),
        "audit_failed": initial["audit_failed"],
        "hard_flags": dict(flags),
        "category_shares": {c: n / accepted for c, n in categories.most_common()},
    }


async def _run(auditor: Auditor, tasks: list[dict], out: Path, progress: bool) -> None:
    accepted, rejected = JsonlSink(out / "accepted.jsonl"), JsonlSink(out / "rejected.jsonl")
    bar = tqdm(total=len(tasks), desc="auditing tasks", unit="task", disable=not progress)
    try:
        for next_done in asyncio.as_completed([auditor.audit(t) for t in tasks]):
            record = await next_done
            (accepted if record["verdict"] == "accept" else rejected).write(record)
            bar.update(1)
    finally:
        bar.close()
        accepted.close()
        rejected.close()


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rewards.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", required=True, help="JSONL file, one task per line (task_id, instruction, ...)")
    parser.add_argument("--out", required=True, help="output folder (accepted.jsonl, rejected.jsonl, report.json)")
    AUDITOR.add_arguments(parser, flags={"cache_path": "--cache"})
    parser.add_argument("--limit", type=int, default=None, help="audit at most this many new tasks")
    parser.add_argument("--retry_failed", action="store_true", help="audit again the tasks rejected as audit_failed")
    parser.add_argument("--no_progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--serve_model",
        default=None,
        help="audit with this model (a folder, or smollm2) served by `transformers serve` on loopback for the length "
        "of the audit, instead of --base_url and --model",
    )
    args = parser.parse_args(argv)
    if args.concurrency < 1 or (args.limit is not None and args.limit < 0):
        parser.error("--concurrency must be >= 1 and --limit >= 0")
    missing = [flag for flag, value in (("--model", args.model), ("--base_url", args.base_url)) if not value]
    if args.serve_model is None and missing:
        parser.error(f"required: {', '.join(missing)} (or --serve_model to serve a model for the audit)")
    if args.serve_model is not None and (args.model or args.base_url):
        parser.error("--serve_model serves the auditor itself; drop --model and --base_url")
    return args


def main(argv: Sequence[str] | None = None) -> dict:
    """Run the audit; returns the report. With --serve_model, against that model served on loopback meanwhile."""
    args = parse_args(argv)
    if args.serve_model is None:
        return audit(args)
    from agent_trl.served import serve

    log = Path(args.out) / "serve.log"
    print(f"serving {args.serve_model} for the audit with transformers serve (log: {log})", file=sys.stderr)
    with serve(args.serve_model, log_path=log) as endpoint:
        args.base_url, args.model = endpoint.base_url, endpoint.model
        return audit(args)


def audit(args: argparse.Namespace) -> dict:
    """The audit of `args.tasks` into `args.out` against the endpoint `args.base_url`."""
    tasks = read_tasks(args.tasks)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    done = read_records(out / "accepted.jsonl") + read_records(out / "rejected.jsonl")
    if args.retry_failed:
        failed = {r["task_id"] for r in done if r.get("initial_verdict") is None}
        kept = [r for r in read_records(out / "rejected.jsonl") if r["task_id"] not in failed]
        staging = out / "rejected.jsonl.tmp"
        staging.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept), encoding="utf-8")
        os.replace(staging, out / "rejected.jsonl")  # atomic: the old file or the new one, never half of it
        done = [r for r in done if r["task_id"] not in failed]
    seen = {str(r["task_id"]) for r in done}
    todo = [t for t in tasks if str(t["task_id"]) not in seen][: args.limit]
    print(f"{len(tasks)} tasks, {len(seen)} already audited, {len(todo)} to audit", file=sys.stderr)
    if todo and (problem := check_endpoint(args.base_url, args.api_key_env, timeout=min(args.timeout, 30.0))):
        raise SystemExit(f"error: --base_url / --api_key_env: {problem}")
    judge = Judge(
        AUDITOR.judge_config(
            args,
            temperature=0.0,  # t1.md §4.6: temperature 0
            max_repairs=2,  # "re-requested at most twice", then `audit_failed`
        )
    )
    try:
        judge.run_sync(_run(Auditor(judge), todo, out, progress=not args.no_progress))
    finally:
        judge.close()
    report = summarize(read_records(out / "accepted.jsonl") + read_records(out / "rejected.jsonl"))
    (out / "report.json").write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(json.dumps(report), file=sys.stderr)
    new_ids = {str(t["task_id"]) for t in todo}
    failed = [r for r in read_records(out / "rejected.jsonl") if str(r["task_id"]) in new_ids]
    if todo and sum(r.get("initial_verdict") is None for r in failed) == len(todo):
        raise SystemExit(
            f"error: every one of the {len(todo)} audit calls failed (audit_failed); the auditor at {args.base_url} "
            "answered nothing usable. The records are kept; rerun with --retry_failed once it works"
        )
    return report


if __name__ == "__main__":
    main()
