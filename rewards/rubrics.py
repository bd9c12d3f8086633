"""DRACO's judge stages: dynamic rubrics, outcome-blind reward and step-credit attribution (draco.md, arXiv
2609.04094), over any `BaseJudge` (the API `Judge`, the `LocalModelJudge` self-judge, or `rewards.oracle.OracleJudge`).

The stages of one task group (draco.md §4.3), all async with bounded concurrency and one step deadline:

1. **S1, task rubric** from the task alone (at most 15 criteria), cached for the run (D9);
2. **S2, trajectory rubric** per rollout, anchored on what that rollout got wrong (at most 10);
3. **union**, one merged rubric per group (at most 24), with a deterministic fallback merge;
4. **scoring** of every rollout: +1 satisfied / −1 violated / 0 not applicable per criterion (k votes combined by
   Eq. 10 / conventions.md C10 when the judge votes);
5. **discriminative dropout** (Eq. 1) and the **outcome-blind reward** R = (p − f)/(p + f) (Eq. 2); with the
   essential gate (draco.md D19, `essential_gate`), R = −1 for a rollout that fails a criterion the judge marked
   `essential` (an outcome the instruction names);
6. **credit**, per rollout with A ≠ 0: a final PASS/FAIL/NOT_APPLICABLE per surviving criterion with the steps
   (numbered from 1) causally responsible for it. The trainer turns these into step weights (`trainers/draco.py`).

Every stage answers one JSON object with one array field (D6); the judge parses and repairs the JSON, and this module
checks what a schema cannot (titles, counts, citations), re-asking with the error appended up to `stage_retries`
times (§4.3 validation). Over-limit arrays are truncated, not retried (D7). A stage that fails takes the fallback of
§4.6 and never raises: S1 -> empty rubric (not cached), S2 -> no candidates, union -> deterministic merge, scoring ->
unscorable (reward None), credit -> None (the trainer's `judge_failure` fallback).

Judges see only what the agent saw (§4.2): role-tagged task blocks, the visible action of every step (reasoning
removed, D5) and the observations. Rewards, success flags and the environment's hidden task fields are never
rendered. Prompt sections are wrapped in tags (`<task>`, `<rollout>`, `<criteria>`, `<steps>`) so that the oracle
judge can read the same prompts back (`extract_*` below).

`DracoReward` is the TRL reward function (`(prompts, completions, **kwargs) -> list[float | None]`): it groups the
rows, runs stages 1-5, keeps per-row records for the credit stage (`last`) and logs `draco/*` metrics through TRL's
`log_metric`. Deliberately left out: the input-budget shortening of §4.6 (observations are capped at
`observation_chars` in the credit summary only) and per-phase endpoints (one judge serves all phases).

Decision ids (`Dn`) without a page are docs/methods/draco.md's.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import string
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import pydantic

from rewards.judge import REPAIR_PROMPT, BaseJudge, combine_votes, strip_reasoning

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=pydantic.BaseModel)
TEMPLATE_VERSION = "draco-v2"  # part of every S1 cache key (§4.2); v2 asks for `essential` (D19)
LIMITS = {"task": 15, "rollout": 10, "merge": 24}  # §4.3: S1 / S2 per rollout / union
PHASES = ("task", "rollout", "merge", "scoring", "credit")
VERDICTS = {"PASS": 1, "FAIL": -1, "NOT_APPLICABLE": 0}


# ---------------------------------------------------------------------------------------------------------------------
# Schemas of the five stages (§4.3)


class Criterion(pydantic.BaseModel):
    """A merged criterion (union stage output). `essential` (draco.md D19): an outcome the instruction itself names,
    so that an attempt failing it has not done the task; a judge that omits the field marks nothing essential."""

    title: str
    description: str
    evaluator_instruction: str
    essential: bool = False


class TaskCriterion(Criterion):
    grounding_references: list[str] = pydantic.Field(default_factory=list)


class RolloutCriterion(TaskCriterion):
    trajectory_evidence: str = ""


class TaskCriteria(pydantic.BaseModel):
    criteria: list[TaskCriterion]


class RolloutCriteria(pydantic.BaseModel):
    criteria: list[RolloutCriterion]


class MergedCriteria(pydantic.BaseModel):
    criteria: list[Criterion]


class CriterionScore(pydantic.BaseModel):
    rubric_title: str
    score: Literal[-1, 0, 1]
    evidence: str = ""
    justification: str = ""


class Scores(pydantic.BaseModel):
    scores: list[CriterionScore]


class Attribution(pydantic.BaseModel):
    rubric_title: str
    rubric_index: int
    verdict: Literal["PASS", "FAIL", "NOT_APPLICABLE"]
    relevant_steps: list[int] = pydantic.Field(default_factory=list)
    explanation: str = ""

    @pydantic.field_validator("verdict", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.strip().upper().replace(" ", "_") if isinstance(value, str) else value


class Attributions(pydantic.BaseModel):
    attributions: list[Attribution]


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers: titles, dropout, reward


def normalize_title(title: str) -> str:
    """Lowercase, punctuation stripped, whitespace collapsed (§4.3 validation).

    >>> normalize_title("  Bought the RIGHT item!  ")
    'bought the right item'
    """
    return " ".join(title.lower().translate(str.maketrans("", "", string.punctuation)).split())


def dedupe_and_truncate(criteria: Sequence[M], limit: int) -> tuple[list[M], bool]:
    """Keep the first criterion of each normalised title (and drop empty titles), then the first `limit` (D7).
    Returns the list and whether anything was truncated."""
    seen: set[str] = set()
    out: list[M] = []
    for c in criteria:
        key = normalize_title(c.title)
        if key and key not in seen:
            seen.add(key)
            out.append(c)
    return out[:limit], len(out) > limit


def discriminative_dropout(verdicts: Sequence[Sequence[int] | None], num_criteria: int) -> list[int]:
    """Indices of the criteria some scored rollout failed (draco.md Eq. 1). Not applicable (0) is not a failure;
    unscored rollouts (None) are ignored; a criterion every rollout fails is kept.

    >>> discriminative_dropout([[1, 1, -1, 0], [1, -1, -1, 0], None], 4)
    [1, 2]
    """
    return [c for c in range(num_criteria) if any(v is not None and v[c] == -1 for v in verdicts)]  # Eq. 1


def rubric_reward(verdicts: Sequence[int] | None, surviving: Sequence[int]) -> float | None:
    """Outcome-blind reward R = (p − f) / (p + f) over the surviving criteria, 0 when none applies (draco.md Eq. 2).
    None (unscorable) stays None.

    >>> rubric_reward([1, -1, 1, 0], [0, 1, 2, 3])  # p = 2, f = 1
    0.3333333333333333
    >>> rubric_reward([0, 1], [0]), rubric_reward(None, [0])
    (0.0, None)
    """
    if verdicts is None:
        return None
    p = sum(verdicts[c] == 1 for c in surviving)  # Eq. 2
    f = sum(verdicts[c] == -1 for c in surviving)
    return (p - f) / (p + f) if p + f else 0.0


def gated_rubric_reward(
    verdicts: Sequence[int] | None, surviving: Sequence[int], essential: Sequence[bool]
) -> float | None:
    """Eq. 2 with the essential gate (draco.md D19): −1, the bottom of Eq. 2's range, when the rollout fails (−1) a
    surviving criterion marked essential (`essential[c]`, per criterion); else `rubric_reward`. A rollout that misses
    an outcome the instruction names can then never out-score one that reaches every named outcome, nor get a
    positive advantage in a group where some rollout reaches them. Not applicable (0) is not a failure.

    >>> gated_rubric_reward([1, 1, 1, -1], [0, 1, 2, 3], [True, True, False, False])  # a non-essential fail: Eq. 2
    0.5
    >>> gated_rubric_reward([1, 1, 1, -1], [0, 1, 2, 3], [False, False, False, True])  # Eq. 2 would give 0.5
    -1.0
    """
    if verdicts is not None and any(essential[c] and verdicts[c] == -1 for c in surviving):
        return -1.0  # D19
    return rubric_reward(verdicts, surviving)


def fallback_merge(task: Sequence[Criterion], rollouts: Sequence[Sequence[Criterion]]) -> list[Criterion]:
    """The union stage's fallback (§4.6): S1 then S2 candidates, deduplicated by title, truncated to 24."""
    keep = {"title", "description", "evaluator_instruction", "essential"}
    flat = [Criterion(**c.model_dump(include=keep)) for c in task]
    for group in rollouts:
        flat += [Criterion(**c.model_dump(include=keep)) for c in group]
    return dedupe_and_truncate(flat, LIMITS["merge"])[0]


def check_scores(result: Scores, criteria: Sequence[Criterion]) -> tuple[list[int | None], list[str], str | None]:
    """Match scoring entries to criteria: by position, checked by normalised title; an entry whose title names another
    criterion is matched by title instead. Returns the verdict per criterion (None where missing), the evidence and an
    error for the re-ask (wrong count, unknown titles, missing criteria) or None."""
    titles = [normalize_title(c.title) for c in criteria]
    verdicts: list[int | None] = [None] * len(criteria)
    evidence = [""] * len(criteria)
    unknown = []
    for i, entry in enumerate(result.scores):
        key = normalize_title(entry.rubric_title)
        c = i if i < len(titles) and titles[i] == key else (titles.index(key) if key in titles else None)
        if c is None or verdicts[c] is not None:
            unknown.append(entry.rubric_title)
            continue
        verdicts[c], evidence[c] = entry.score, entry.evidence
    problems = []
    if len(result.scores) != len(criteria):
        problems.append(f"expected {len(criteria)} scores, one per criterion in order, got {len(result.scores)}")
    if unknown:
        problems.append(f"titles that match no criterion: {unknown[:5]}")
    missing = [criteria[c].title for c, v in enumerate(verdicts) if v is None]
    if missing:
        problems.append(f"criteria left unscored: {missing[:5]}")
    return verdicts, evidence, "; ".join(problems) or None


def check_attributions(
    result: Attributions, criteria: Sequence[Criterion], num_steps: int
) -> tuple[list[int | None], list[list[int]], str | None]:
    """Match credit entries by `rubric_index` (1-based), checked by title (or by title alone when the index is
    wrong). Steps outside 1..num_steps are dropped and repeats kept once (conventions.md C9). Returns the verdict
    per criterion (+1/−1/0, None where missing), the cited steps and an error for the re-ask (a PASS or FAIL citing
    no valid step, a missing or unknown entry) or None."""
    titles = [normalize_title(c.title) for c in criteria]
    verdicts: list[int | None] = [None] * len(criteria)
    steps: list[list[int]] = [[] for _ in criteria]
    problems = []
    for entry in result.attributions:
        key, i = normalize_title(entry.rubric_title), entry.rubric_index - 1
        c = i if 0 <= i < len(titles) and titles[i] == key else (titles.index(key) if key in titles else None)
        if c is None or verdicts[c] is not None:
            problems.append(f"entry {entry.rubric_index} {entry.rubric_title!r} matches no criterion")
            continue
        verdicts[c] = VERDICTS[entry.verdict]
        steps[c] = sorted({j for j in entry.relevant_steps if 1 <= j <= num_steps})  # C9
        if entry.verdict != "NOT_APPLICABLE" and not steps[c]:
            problems.append(f"criterion {c + 1} is {entry.verdict} but cites no step in 1..{num_steps}")
    missing = [c + 1 for c, v in enumerate(verdicts) if v is None]
    if missing:
        problems.append(f"criteria without an attribution: {missing[:8]}")
    return verdicts, steps, "; ".join(problems) or None


# ---------------------------------------------------------------------------------------------------------------------
# Rendering (what the judge sees) and reading it back (for the oracle)


def clip_middle(text: str, limit: int | None) -> str:
    """Keep the first 3/4 and the last 1/4 of `limit` characters (draco.md D4: 750 + 250 of 1,000).

    >>> clip_middle("abcdefghij", 8)
    'abcdef … ij'
    """
    if limit is None or len(text) <= limit:
        return text
    head = limit * 3 // 4
    return f"{text[:head]} … {text[len(text) - (limit - head) :]}"


def render_task(prompt: str | Sequence[Mapping[str, Any]]) -> str:
    """The agent's prompt as role-tagged blocks (`[SYSTEM]`, `[USER]`, ...); a string is one user message."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    blocks = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):  # multimodal parts: keep the text ones
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        blocks.append(f"[{str(m.get('role', 'user')).upper()}]\n{content or ''}")
    return "\n\n".join(blocks)


def render_steps(transcript: Sequence[Mapping[str, Any]], observation_chars: int | None = None) -> str:
    """Steps numbered from 1: the visible action (reasoning removed, D5) and the observation after it (clipped to
    `observation_chars`, D4). Only `action` and `observation` are read: rewards never reach a judge (§4.2)."""
    blocks = []
    for j, turn in enumerate(transcript, 1):
        action = strip_reasoning(str(turn.get("action", "")))
        observation = clip_middle(str(turn.get("observation", "")), observation_chars)
        blocks.append(f"[ASSISTANT] step {j}\n{action}\n\n[ENVIRONMENT] step {j}\n{observation}")
    return "\n\n".join(blocks)


def _criteria_json(criteria: Sequence[pydantic.BaseModel], extra: Sequence[dict] | None = None) -> str:
    rows = []
    for i, c in enumerate(criteria):
        row = {"index": i + 1, **c.model_dump()}
        if extra is not None:
            row.update(extra[i])
        rows.append(row)
    return f"<criteria>\n{json.dumps(rows, indent=1, ensure_ascii=False)}\n</criteria>"


def extract_task(text: str) -> str:
    """The `<task>` section of a prompt ('' when absent)."""
    m = re.search(r"<task>\n(.*?)\n</task>", text, flags=re.DOTALL)
    return m.group(1) if m else ""


def extract_criteria(text: str) -> list[dict]:
    """The criteria listed in the `<criteria>` section of a prompt, as dicts with their 1-based `index`."""
    m = re.search(r"<criteria>\n(.*?)\n</criteria>", text, flags=re.DOTALL)
    try:
        rows = json.loads(m.group(1)) if m else []
    except json.JSONDecodeError:
        return []
    return [r for r in rows if isinstance(r, dict) and isinstance(r.get("title"), str)]


def extract_rollouts(text: str) -> list[list[str]]:
    """The actions of every `<rollout>` (or `<steps>`) section of a prompt, in step order."""
    sections = re.findall(r"<(?:rollout|steps)[^>]*>\n(.*?)\n</(?:rollout|steps)>", text, flags=re.DOTALL)
    return [parse_actions(s) for s in sections]


def parse_actions(section: str) -> list[str]:
    """The actions of a rendered transcript (`render_steps`), step 1 first."""
    parts = re.split(r"^\[(ASSISTANT|ENVIRONMENT)\] step (\d+)$", section, flags=re.MULTILINE)
    actions: dict[int, str] = {}
    for role, j, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        if role == "ASSISTANT":
            actions[int(j)] = body.strip("\n")
    return [actions[j] for j in sorted(actions)]


# ---------------------------------------------------------------------------------------------------------------------
# Prompts (project wording; steps are numbered from 1)

_COMMON = (
    "You review transcripts of an AI agent working in an environment. The transcript shows only what the agent saw: "
    "its prompt, its visible actions and the environment's observations."
)
_TASK_RULES = """Write the criteria a careful reviewer would use to tell better attempts at this task from worse ones.
Rules:
- each criterion separates better from worse attempts and is decidable from the transcript alone;
- each tests one thing, answerable yes or no, objectively, and is understandable without the others;
- each is grounded in the task text; criteria do not overlap, so one mistake costs one criterion, never two;
- criteria about the task's outcome come first; behavioural criteria only where the behaviour predicts the outcome;
- aim at the failure modes this task realistically has, at a granularity that suits the task;
- no generic compliance criteria that almost every attempt meets, unless breaking them is a realistic way to fail;
- plain language.
Return {{"criteria": [...]}} with at most {limit} entries, most important first. Fields: title (3-8 words),
description (1-3 sentences), evaluator_instruction (how a scorer decides pass, fail or not applicable),
grounding_references (the parts of the task text that ground the criterion), essential (true only for an outcome the
task text itself names as required, e.g. each requested property of the final result, so that an attempt failing it
has not done the task whatever else it did; false for process, behaviour and partial-progress criteria)."""
_ROLLOUT_RULES = """Propose extra criteria that this rollout reveals.
Rules:
- only criteria that could not have been written from the instructions alone and that duplicate no existing one;
- each new criterion is anchored on something this rollout got wrong or did only partly; criteria this rollout
  plainly passes are not allowed;
- word each criterion so that it applies to any rollout of the task while keeping the failure it is anchored on.
Return {{"criteria": [...]}} with at most {limit} entries (possibly none). Fields: title, description,
evaluator_instruction, grounding_references, trajectory_evidence (what in this rollout failed or was incomplete),
essential (true only for an outcome the task text itself names as required; usually false here)."""
_MERGE_RULES = """Merge the candidate criteria into one rubric for this group of rollouts.
Rules:
- merge true paraphrases, and merge criteria that the same observable mistake would fail;
- keep genuinely different failure modes apart; prefer outcome criteria;
- drop criteria that are too specific to one rollout, vague, or generic compliance;
- drop any criterion that every shown rollout would pass, or that would be not applicable to every rollout; keep a
  criterion that every rollout fails;
- the limit is a ceiling, not a target.
Return {{"criteria": [...]}} with at most {limit} entries. Fields: title, description, evaluator_instruction,
essential (true when a criterion merged into it is essential and it still tests an outcome the task names)."""
_SCORING_RULES = """Score the rollout against every criterion, in the given order. For each: find the evidence,
assess it, give a score and justify it in 1-3 actionable sentences.
Scores: 1 = satisfied; -1 = violated; 0 = the situation the criterion is about never arose (a conditional criterion
whose trigger never happened is 0, not 1). When torn between -1 and 0, choose -1.
Score every criterion exactly once, in order, and add none.
Return {"scores": [...]} with fields rubric_title, score (-1, 0 or 1), evidence (where in the rollout) and
justification."""
_CREDIT_RULES = """For each criterion, give a final verdict (PASS, FAIL or NOT_APPLICABLE; you may confirm or override
the scoring verdict), list the steps causally responsible for it (steps such that changing them would change the
verdict), and explain the attribution.
Rules:
- every PASS and every FAIL cites at least one step, by its number;
- a criterion about something that never happened cites the step where the omission mattered most, or the last step
  by which the action should have happened;
- only NOT_APPLICABLE may cite no step.
Return {"attributions": [...]} with fields rubric_title, rubric_index (the criterion's 1-based index), verdict,
relevant_steps (step numbers), explanation."""


def _notes(notes: str) -> str:
    return f"\n\nEnvironment notes (normal behaviour here; do not penalise it):\n{notes}" if notes else ""


def task_rubric_messages(task: str, notes: str = "") -> list[dict[str, str]]:
    """S1: the agent's prompt only."""
    user = f"<task>\n{task}\n</task>{_notes(notes)}\n\n{_TASK_RULES.format(limit=LIMITS['task'])}"
    return [{"role": "system", "content": _COMMON}, {"role": "user", "content": user}]


def rollout_rubric_messages(
    task: str, steps: str, existing: Sequence[Criterion], notes: str = ""
) -> list[dict[str, str]]:
    """S2: the prompt, one complete rollout and the S1 criteria."""
    user = (
        f"<task>\n{task}\n</task>{_notes(notes)}\n\n<rollout>\n{steps}\n</rollout>\n\nExisting criteria:\n"
        f"{_criteria_json(existing)}\n\n{_ROLLOUT_RULES.format(limit=LIMITS['rollout'])}"
    )
    return [{"role": "system", "content": _COMMON}, {"role": "user", "content": user}]


def merge_messages(
    task: str, candidates: Sequence[Criterion], rollouts: Sequence[str], notes: str = ""
) -> list[dict[str, str]]:
    """Union: all S1 and S2 candidates and all G rollouts in full."""
    shown = "\n\n".join(f'<rollout index="{i}">\n{r}\n</rollout>' for i, r in enumerate(rollouts, 1))
    user = (
        f"<task>\n{task}\n</task>{_notes(notes)}\n\n{shown}\n\nCandidate criteria:\n{_criteria_json(candidates)}"
        f"\n\n{_MERGE_RULES.format(limit=LIMITS['merge'])}"
    )
    return [{"role": "system", "content": _COMMON}, {"role": "user", "content": user}]


def scoring_messages(task: str, steps: str, criteria: Sequence[Criterion], notes: str = "") -> list[dict[str, str]]:
    """Scoring: the task, one rollout and the merged criteria, numbered."""
    user = (
        f"<task>\n{task}\n</task>{_notes(notes)}\n\n<rollout>\n{steps}\n</rollout>\n\nCriteria:\n"
        f"{_criteria_json(criteria)}\n\n{_SCORING_RULES}"
    )
    return [{"role": "system", "content": _COMMON}, {"role": "user", "content": user}]


def credit_messages(
    task: str,
    summary: str,
    num_steps: int,
    criteria: Sequence[Criterion],
    verdicts: Sequence[int],
    evidence: Sequence[str],
    notes: str = "",
) -> list[dict[str, str]]:
    """Credit: M, the step summary 1..M, and each surviving criterion with its scoring verdict and evidence."""
    names = {1: "PASS", -1: "FAIL", 0: "NOT_APPLICABLE"}
    extra = [{"scoring_verdict": names[v], "scoring_evidence": e} for v, e in zip(verdicts, evidence, strict=True)]
    user = (
        f"<task>\n{task}\n</task>{_notes(notes)}\n\nThe rollout has {num_steps} steps.\n"
        f'<steps count="{num_steps}">\n{summary}\n</steps>\n\nCriteria:\n{_criteria_json(criteria, extra)}\n\n'
        f"{_CREDIT_RULES}"
    )
    return [{"role": "system", "content": _COMMON}, {"role": "user", "content": user}]


# ---------------------------------------------------------------------------------------------------------------------
# The pipeline


@dataclass
class GroupInput:
    """One task group: its key (task id), the rendered task and the transcripts of its G rollouts."""

    task_key: str
    task: str
    transcripts: list[list[dict]]


@dataclass
class GroupResult:
    task_criteria: list[TaskCriterion]
    rollout_criteria: list[list[RolloutCriterion]]
    merged: list[Criterion]
    verdicts: list[list[int] | None]  # (G, |C|) scoring verdicts; None = unscorable rollout
    evidence: list[list[str]]
    surviving: list[int]  # Eq. 1
    rewards: list[float | None]  # Eq. 2


@dataclass
class CreditResult:
    verdicts: list[int]  # credit-stage verdict per surviving criterion (+1 PASS, -1 FAIL, 0 NOT_APPLICABLE)
    steps: list[list[int]]  # cited steps, 1-based, per surviving criterion
    overrides: int  # verdicts that differ from the scoring verdict (D1)


class RubricPipeline:
    """DRACO's judge stages over one `BaseJudge`; see the module docstring.

    Args:
        judge: any `BaseJudge`; with `judge.votes = k > 1` the scoring call is sampled k times and combined with the
            judge's `vote_rule` (Eq. 10 / C10 for `all`).
        concurrency: most judge calls in flight (the API judge also bounds its own requests).
        step_deadline_s: all judge work of one step (`start_step()` to the credit stage) must end by then; pending
            calls are cancelled and take their stage's fallback (§4.6).
        stage_retries: re-asks after a stage-level validation error (wrong count, titles, citations).
        observation_chars: cap on each observation in the credit summary (D4).
        protocol_notes: the environment adapter's notes slot of every template (§4.2).
        judge_id: judge identity in the S1 cache key (D9).
        essential_gate: reward a rollout that fails an essential criterion −1 (`gated_rubric_reward`, D19); False
            is the paper's Eq. 2, where the `essential` flags are asked for but not used.
    """

    def __init__(
        self,
        judge: BaseJudge,
        *,
        concurrency: int = 32,
        step_deadline_s: float = 1200.0,
        stage_retries: int = 2,
        observation_chars: int = 1000,
        protocol_notes: str = "",
        judge_id: str = "judge",
        essential_gate: bool = False,
    ) -> None:
        self.judge = judge
        self.concurrency = concurrency
        self.step_deadline_s = step_deadline_s
        self.stage_retries = stage_retries
        self.observation_chars = observation_chars
        self.notes = protocol_notes
        self.judge_id = judge_id
        self.essential_gate = essential_gate
        self.counts: Counter[str] = Counter()  # per-phase calls, retries, failures; read with `metrics()`
        self._task_cache: dict[tuple[str, ...], list[TaskCriterion]] = {}
        self._task_pending: dict[tuple[str, ...], asyncio.Task] = {}
        self._deadline = math.inf
        self._semaphore: asyncio.Semaphore | None = None

    # -- plumbing -----------------------------------------------------------------------------------------------------

    def start_step(self) -> None:
        """Start the clock of one step's judge work (the step deadline of §4.6)."""
        self._deadline = time.monotonic() + self.step_deadline_s

    def metrics(self, prefix: str = "draco/", reset: bool = True) -> dict[str, float]:
        """Per-phase counters: `judge_calls/<phase>`, `judge_retries/<phase>`, `judge_failures/<phase>`,
        `judge_deadline/<phase>`, and `judge_truncations`."""
        out = {f"{prefix}{k}": float(v) for k, v in sorted(self.counts.items())}
        if reset:
            self.counts.clear()
        return out

    async def _call(self, phase: str, messages: list[dict], schema: type[M], vote_index: int = 0) -> M | None:
        """One judge call under the concurrency bound and the step deadline; None on failure (never raises)."""
        if self._semaphore is None:
            self._semaphore = asyncio.Semaphore(self.concurrency)
        self.counts[f"judge_calls/{phase}"] += 1
        try:
            async with self._semaphore:
                remaining = self._deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                result = await asyncio.wait_for(self.judge.score(messages, schema, vote_index=vote_index), remaining)
        except TimeoutError:
            self.counts[f"judge_deadline/{phase}"] += 1
            result = None
        except Exception as err:  # a judge broke the never-raise contract; the stage falls back anyway
            logger.warning("judge raised %s in phase %s", type(err).__name__, phase)
            result = None
        if result is None:
            self.counts[f"judge_failures/{phase}"] += 1
        return result

    async def _ask(
        self,
        phase: str,
        messages: list[dict],
        schema: type[M],
        check: Callable[[M], tuple[Any, str | None]],
        vote_index: int = 0,
    ) -> Any | None:
        """Ask, check, and re-ask with the error appended (`stage_retries` times); the last checked value is returned
        even when it still has errors (the caller applies the documented partial fallback). None: the judge failed."""
        for attempt in range(self.stage_retries + 1):
            result = await self._call(phase, messages, schema, vote_index)
            if result is None:
                return None
            value, error = check(result)
            if error is None or attempt == self.stage_retries:
                return value
            self.counts[f"judge_retries/{phase}"] += 1
            messages = [
                *messages,
                {"role": "assistant", "content": result.model_dump_json()},
                {"role": "user", "content": REPAIR_PROMPT.format(error=error)},
            ]
        return None

    def _limit(self, phase: str, criteria: list[M]) -> list[M]:
        out, truncated = dedupe_and_truncate(criteria, LIMITS[phase])
        if truncated:
            logger.info("DRACO %s stage: %d criteria truncated to %d (D7)", phase, len(criteria), LIMITS[phase])
            self.counts["judge_truncations"] += 1
        return out

    # -- stages -------------------------------------------------------------------------------------------------------

    async def task_rubric(self, task_key: str, task: str) -> list[TaskCriterion] | None:
        """S1, cached per (task, prompt hash, judge identity, template version) for the run (D9); failures not cached.
        Concurrent requests for one key share one call. None: the judge failed."""
        key = (task_key, hashlib.sha256(task.encode()).hexdigest()[:16], self.judge_id, TEMPLATE_VERSION)
        if key in self._task_cache:
            return self._task_cache[key]

        async def ask() -> list[TaskCriterion] | None:
            messages = task_rubric_messages(task, self.notes)
            result = await self._ask("task", messages, TaskCriteria, lambda r: (r.criteria, None))
            if result is None:  # failures are not cached (D9)
                return None
            criteria = self._task_cache[key] = self._limit("task", result)
            return criteria

        pending = self._task_pending.get(key)
        if pending is None:
            pending = self._task_pending[key] = asyncio.ensure_future(ask())
            pending.add_done_callback(lambda _: self._task_pending.pop(key, None))
        return await asyncio.shield(pending)

    async def rollout_rubric(
        self, task: str, steps: str, existing: list[TaskCriterion]
    ) -> list[RolloutCriterion] | None:
        """S2 for one rollout; a failure (None) contributes no candidates."""
        messages = rollout_rubric_messages(task, steps, existing, self.notes)
        result = await self._ask("rollout", messages, RolloutCriteria, lambda r: (r.criteria, None))
        return None if result is None else self._limit("rollout", result)

    async def merge(
        self, task: str, s1: list[TaskCriterion], s2: list[list[RolloutCriterion]], rollouts: list[str]
    ) -> list[Criterion]:
        """Union stage; on failure the deterministic merge of §4.6. A merged criterion whose title is that of an
        essential candidate stays essential (D19), whatever the union's answer says."""
        candidates = [c for group in [s1, *s2] for c in group]
        if not candidates:
            return []
        messages = merge_messages(task, candidates, rollouts, self.notes)
        result = await self._ask("merge", messages, MergedCriteria, lambda r: (r.criteria, None))
        if result is None:
            return fallback_merge(s1, s2)
        essential = {normalize_title(c.title) for c in candidates if c.essential}
        return [
            c.model_copy(update={"essential": True}) if normalize_title(c.title) in essential else c
            for c in self._limit("merge", result)
        ]

    async def score(self, task: str, steps: str, criteria: list[Criterion]) -> tuple[list[int], list[str]] | None:
        """Scoring of one rollout; with k votes, Eq. 10 over the samples that parsed. After the last re-ask, missing
        criteria count as 0; a rollout with no usable entry (or no parsed sample) is unscorable (None)."""
        messages = scoring_messages(task, steps, criteria, self.notes)

        def check(r: Scores) -> tuple[tuple[list[int | None], list[str]], str | None]:
            verdicts, evidence, error = check_scores(r, criteria)
            return (verdicts, evidence), error

        samples = await asyncio.gather(
            *(self._ask("scoring", messages, Scores, check, vote_index=r) for r in range(self.judge.votes))
        )
        per_sample = [
            None if s is None or all(v is None for v in s[0]) else {c: v for c, v in enumerate(s[0]) if v is not None}
            for s in samples
        ]
        combined = combine_votes(per_sample, self.judge.vote_rule, criteria=range(len(criteria)))  # Eq. 10 / C10
        if combined is None:
            return None
        if self.judge.votes > 1:
            parsed = [s for s in per_sample if s is not None]
            disagree = sum(len({s.get(c, 0) for s in parsed}) > 1 for c in combined)
            self.judge.stats.add_votes(len(combined), disagree)
        evidence = next(s[1] for s, p in zip(samples, per_sample, strict=True) if p is not None)
        return [combined[c] for c in range(len(criteria))], evidence

    async def credit(
        self, task: str, transcript: list[dict], criteria: list[Criterion], verdicts: list[int], evidence: list[str]
    ) -> CreditResult | None:
        """Credit stage of one rollout over the surviving criteria; None when the call failed (Eq. 9 fallback).
        After the last re-ask, a PASS or FAIL without a valid step cites nothing and a missing entry is N/A."""
        num_steps = len(transcript)
        summary = render_steps(transcript, self.observation_chars)
        messages = credit_messages(task, summary, num_steps, criteria, verdicts, evidence, self.notes)

        def check(r: Attributions) -> tuple[tuple[list[int | None], list[list[int]]], str | None]:
            verdicts_, steps, error = check_attributions(r, criteria, num_steps)
            return (verdicts_, steps), error

        result = await self._ask("credit", messages, Attributions, check)
        if result is None:
            return None
        final = [0 if v is None else v for v in result[0]]
        overrides = sum(f != s for f, s in zip(final, verdicts, strict=True))
        return CreditResult(final, result[1], overrides)

    async def score_group(self, group: GroupInput) -> GroupResult:
        """Stages S1, S2, union and scoring of one group, then dropout (Eq. 1) and rewards (Eq. 2)."""
        steps = [render_steps(t) for t in group.transcripts]
        asked = await self.task_rubric(group.task_key, group.task)
        s1 = asked or []
        answered = list(await asyncio.gather(*(self.rollout_rubric(group.task, s, s1) for s in steps)))
        s2 = [c or [] for c in answered]
        merged = await self.merge(group.task, s1, s2, steps)
        if merged:
            scored = await asyncio.gather(*(self.score(group.task, s, merged) for s in steps))
        elif asked is None and all(c is None for c in answered):  # no criteria because every call failed: the group
            scored = [None for _ in steps]  # is unscorable, not a group the judge found nothing to test in
        else:  # the judge proposed nothing to score: R = 0 for every rollout (§7 item 16), no calls
            scored = [([], []) for _ in steps]
        verdicts = [None if s is None else s[0] for s in scored]
        evidence = [[] if s is None else s[1] for s in scored]
        surviving = discriminative_dropout(verdicts, len(merged))  # Eq. 1
        if self.essential_gate:  # D19: failing an outcome the instruction names scores -1
            essential = [c.essential for c in merged]
            rewards = [gated_rubric_reward(v, surviving, essential) for v in verdicts]
        else:
            rewards = [rubric_reward(v, surviving) for v in verdicts]  # Eq. 2
        return GroupResult(s1, s2, merged, verdicts, evidence, surviving, rewards)

    # -- sync entry points (run on the judge's background loop) -------------------------------------------------------

    def score_groups(self, groups: Sequence[GroupInput]) -> list[GroupResult]:
        """Stages 1-5 for every group of a step, concurrently. Starts the step clock."""
        self.start_step()

        async def run() -> list[GroupResult]:
            self._semaphore = asyncio.Semaphore(self.concurrency)
            return list(await asyncio.gather(*(self.score_group(g) for g in groups)))

        return self.judge.run_sync(run())

    def credit_many(
        self, items: Sequence[tuple[str, list[dict], list[Criterion], list[int], list[str]]]
    ) -> list[CreditResult | None]:
        """Credit stage for (task, transcript, surviving criteria, scoring verdicts, evidence) items, concurrently,
        under the deadline started by the step's `score_groups`."""

        async def run() -> list[CreditResult | None]:
            self._semaphore = asyncio.Semaphore(self.concurrency)
            return list(await asyncio.gather(*(self.credit(*item) for item in items)))

        return self.judge.run_sync(run()) if items else []


# ---------------------------------------------------------------------------------------------------------------------
# The TRL reward function


@dataclass
class RowRecord:
    """What the credit stage needs about one row, kept by `DracoReward` in row order."""

    task_key: str
    task: str
    transcript: list[dict]
    criteria: list[Criterion]  # surviving criteria of the row's group (C*)
    verdicts: list[int] | None  # scoring verdicts over C*; None = unscorable
    evidence: list[str]
    group_scored: int  # scored members of the row's group
    reward: float | None = None


def _completion_text(completion: Any) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list):  # conversational: the assistant messages
        return "\n".join(str(m.get("content") or "") for m in completion if isinstance(m, dict))
    return str(completion)


def group_metrics(results: Sequence[GroupResult]) -> dict[str, float]:
    """draco.md §8 metrics of the rubric stages for one step's groups."""
    n = max(1, len(results))
    scored = [v for r in results for v in r.verdicts if v is not None]
    rewards = [x for r in results for x in r.rewards if x is not None]
    total = sum(len(r.rewards) for r in results)
    applicable = fails = na = cells = 0
    for r in results:
        for v in r.verdicts:
            if v is None:
                continue
            for c in r.surviving:
                cells += 1
                na += v[c] == 0
                applicable += v[c] != 0
                fails += v[c] == -1
    merged = sum(len(r.merged) for r in results)
    mean = sum(rewards) / len(rewards) if rewards else math.nan
    failed_essential = [  # scored rollouts failing a surviving essential criterion (D19; gated when the gate is on)
        any(r.merged[c].essential and v[c] == -1 for c in r.surviving) for r in results for v in r.verdicts if v
    ]
    return {
        "draco/criteria_s1": sum(len(r.task_criteria) for r in results) / n,
        "draco/criteria_s2": sum(len(c) for r in results for c in r.rollout_criteria) / n,
        "draco/criteria_merged": merged / n,
        "draco/criteria_surviving": sum(len(r.surviving) for r in results) / n,
        "draco/dropout_rate": 1 - sum(len(r.surviving) for r in results) / merged if merged else math.nan,
        "draco/criteria_essential": sum(r.merged[c].essential for r in results for c in r.surviving) / n,
        "draco/essential_fail_rate": sum(failed_essential) / len(failed_essential) if failed_essential else math.nan,
        "draco/reward_mean": mean,
        "draco/reward_std": math.sqrt(sum((x - mean) ** 2 for x in rewards) / len(rewards)) if rewards else math.nan,
        "draco/na_rate": na / cells if cells else math.nan,
        "draco/fail_rate": fails / applicable if applicable else math.nan,
        "draco/zero_std_groups": sum(len({x for x in r.rewards if x is not None}) <= 1 for r in results) / n,
        "draco/groups_no_signal": sum(not r.surviving for r in results) / n,
        "draco/unscorable_rate": (total - len(scored)) / total if total else math.nan,
        "draco/groups_skipped": sum(sum(v is not None for v in r.verdicts) < 2 for r in results) / n,
    }


class DracoReward:
    """DRACO's outcome-blind reward (Eq. 1-2) as a TRL reward function; see the module docstring.

    Rows are grouped `group_size` at a time in batch order (TRL repeats each prompt G times in a row). Reads the
    `transcript` column (per turn: action, observation) when the rows come from the agent loop, else the completion is
    a one-step transcript; `task_id` keys the S1 cache. With `per_step_identity` the judge identity of the S1 cache
    key carries TRL's global step (`trainer_state`), so a self-judge regenerates S1 every step (D9). Under
    `torch.distributed` with several processes, the main process gathers every row, makes every judge call and
    broadcasts the results (D14).

    >>> import asyncio
    >>> from rewards.judge import BaseJudge
    >>> class NoJudge(BaseJudge):
    ...     async def score(self, messages, schema, **kw):
    ...         return None
    >>> DracoReward(RubricPipeline(NoJudge()), group_size=2)(["say hi"] * 2, ["hi", "ho"])
    [0.0, 0.0]
    """

    __name__ = "draco_reward"

    def __init__(self, pipeline: RubricPipeline, group_size: int, per_step_identity: bool = False) -> None:
        self.pipeline = pipeline
        self.group_size = group_size
        self.per_step_identity = per_step_identity  # D9: a self-judge changes every step, so S1 is regenerated
        self.judge_id = pipeline.judge_id
        self.last: list[RowRecord] = []  # this process's rows of the latest call, in row order
        self.last_metrics: dict[str, float] = {}

    def __call__(
        self,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        transcript: Sequence[list[dict]] | None = None,
        task_id: Sequence[str | None] | None = None,
        log_metric: Callable[[str, float], None] | None = None,
        trainer_state: Any = None,
        **kwargs: Any,
    ) -> list[float | None]:
        if self.per_step_identity and trainer_state is not None:
            self.pipeline.judge_id = f"{self.judge_id}@step{trainer_state.global_step}"
        self.pipeline.start_step()  # on every process: the credit calls of this step share the deadline
        rows = []
        for i, prompt in enumerate(prompts):
            task = render_task(prompt)
            steps = list(transcript[i]) if transcript is not None else []
            if not steps:  # single-turn: the completion is the only step
                steps = [{"action": _completion_text(completions[i]), "observation": ""}]
            key = task_id[i] if task_id is not None and task_id[i] is not None else None
            rows.append((str(key) if key is not None else hashlib.sha256(task.encode()).hexdigest()[:16], task, steps))
        records, metrics = self._score_everywhere(rows)
        self.last, self.last_metrics = records, metrics
        if log_metric is not None:
            for name, value in metrics.items():
                log_metric(name, value)
        return [r.reward for r in records]

    def _score_everywhere(self, rows: list[tuple[str, str, list[dict]]]) -> tuple[list[RowRecord], dict]:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
            return self._score(rows)
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, rows)
        box = [self._score([r for part in gathered for r in part]) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        records, metrics = box[0]
        start = sum(len(part) for part in gathered[: dist.get_rank()])
        return records[start : start + len(rows)], metrics

    def _score(self, rows: list[tuple[str, str, list[dict]]]) -> tuple[list[RowRecord], dict]:
        G = self.group_size
        if len(rows) % G:
            raise ValueError(f"DracoReward got {len(rows)} rows, not a multiple of the group size {G}")
        groups = []
        for s in range(0, len(rows), G):
            if len({key for key, _, _ in rows[s : s + G]}) != 1:
                raise ValueError(f"DracoReward: rows {s}..{s + G - 1} are not one task's group of {G} rollouts")
            groups.append(GroupInput(rows[s][0], rows[s][1], [steps for _, _, steps in rows[s : s + G]]))
        results = self.pipeline.score_groups(groups)
        records = []
        for g, res in zip(groups, results, strict=True):
            surviving = [res.merged[c] for c in res.surviving]
            n_scored = sum(v is not None for v in res.verdicts)
            for i, steps in enumerate(g.transcripts):
                v = res.verdicts[i]
                records.append(
                    RowRecord(
                        task_key=g.task_key,
                        task=g.task,
                        transcript=steps,
                        criteria=surviving,
                        verdicts=None if v is None else [v[c] for c in res.surviving],
                        evidence=[res.evidence[i][c] for c in res.surviving] if v is not None else [],
                        group_scored=n_scored,
                        reward=res.rewards[i],
                    )
                )
        return records, group_metrics(results)


__all__ = [
    "Attribution",
    "Attributions",
    "CreditResult",
    "Criterion",
    "CriterionScore",
    "DracoReward",
    "GroupInput",
    "GroupResult",
    "MergedCriteria",
    "RolloutCriteria",
    "RolloutCriterion",
    "RowRecord",
    "RubricPipeline",
    "Scores",
    "TaskCriteria",
    "TaskCriterion",
    "check_attributions",
    "check_scores",
    "discriminative_dropout",
    "extract_criteria",
    "extract_rollouts",
    "extract_task",
    "fallback_merge",
    "gated_rubric_reward",
    "normalize_title",
    "render_steps",
    "render_task",
    "rubric_reward",
]
