"""Analyzers: API models (or an offline oracle) that read rollouts and return structured guidance, called through the
judge layer (`rewards/judge.py`: cache, retries, concurrency, cost accounting, failures as None).

TASPO's two calls (docs/methods/taspo.md §4.3-4.4):

* **extraction**, once per task group with a success: the task and every successful rollout, asked for reusable items
  (rule, condition, evidence in the successful rollouts), at most 12; `clean_items` then drops evidence that points
  at a rollout not shown or a turn out of range, drops items left without evidence, renumbers duplicate ids and keeps
  the first 12 (taspo.md §4.3);
* **match**, once per target rollout: the candidate items without their evidence and the target's path (actions and
  observations, no reward, no success flag, no environment message after the last action), asked which conditions
  arise along the path (taspo.md §4.4, D8).

`OracleAnalyzer` answers both from the built-in environments' ground truth, offline and deterministically, so the
tiny default trains without a model endpoint (as DRACO's `OracleJudge` does): it replays each successful rollout in a
fresh environment and keeps the turns where the rollout took the environment expert's action; an item says "when the
environment has just shown «observation»: take the action «action»"; a condition arises in a path when the path shows
that observation (taspo.md D15).

Decision ids (`Dn`) without a page are docs/methods/taspo.md's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pydantic

from rewards.oracle import OracleJudge
from rewards.rubrics import clip_middle, render_steps

MAX_ITEMS = 12  # taspo.md §4.3


class Evidence(pydantic.BaseModel):
    rollout: int
    turn: int
    action: str = ""
    observation: str = ""


class Item(pydantic.BaseModel):
    id: str
    rule: str
    condition: str
    evidence: list[Evidence] = pydantic.Field(default_factory=list)


class ExtractedItems(pydantic.BaseModel):
    items: list[Item]


class Applicable(pydantic.BaseModel):
    applicable: list[str]


# ---------------------------------------------------------------------------------------------------------------------
# Prompts (project wording; turns are numbered from 1)

_SYSTEM = (
    "You analyse transcripts of an AI agent working in an environment. A transcript shows only what the agent saw: "
    "its task, its visible actions and the environment's observations."
)

_EXTRACTION_RULES = f"""The rollouts above all completed the task. Extract reusable guidance that explains what made
them succeed. Each item has:
- "rule": a requirement of the task, an ordering constraint, or a progress rule;
- "condition": when the rule applies, stated so that it can be checked from an interaction history (earlier actions
  and observations);
- "evidence": the places in the rollouts above that support the rule, each as {{"rollout": <id>, "turn": <turn>,
  "action": "...", "observation": "..."}}.
Items must transfer to other attempts at the same task; do not just restate a final answer. Every item cites at least
one place. Give at most {MAX_ITEMS} items, most useful first, each with a unique "id".
Answer with JSON: {{"items": [{{"id": "...", "rule": "...", "condition": "...", "evidence": [...]}}]}}"""

_MATCH_RULES = """Above are candidate guidance items (id, rule, condition) and the path of one attempt at the task.
For each item, decide whether its condition actually arises somewhere along this path. Do not judge whether the
attempt succeeded or whether the agent followed the rule; only whether the situation the condition describes occurs.
Answer with JSON: {"applicable": ["<id>", ...]} (an empty list is a valid answer)."""


def extraction_messages(task: str, successes: Sequence[tuple[int, Sequence[Mapping]]], obs_chars: int = 1000) -> list:
    """The extraction call (taspo.md §4.3): `task` (the agent's prompt, rendered) and each successful rollout as
    (id, transcript); observations clipped to `obs_chars`, reasoning removed."""
    shown = "\n\n".join(
        f'<rollout id="{rid}">\n{render_steps(transcript, obs_chars)}\n</rollout>' for rid, transcript in successes
    )
    user = f"<task>\n{task}\n</task>\n\n{shown}\n\n{_EXTRACTION_RULES}"
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


def path_steps(transcript: Sequence[Mapping]) -> list[dict]:
    """The target's path for the match call: actions and observations only, and no environment message after the
    final action, which can reveal the outcome (taspo.md D8)."""
    steps = [{"action": t.get("action", ""), "observation": t.get("observation", "")} for t in transcript]
    if steps:
        steps[-1]["observation"] = ""
    return steps


def match_messages(task: str, items: Sequence[Item], transcript: Sequence[Mapping], obs_chars: int = 1000) -> list:
    """The match call (taspo.md §4.4): the items without evidence, and the outcome-blind path of the target."""
    listed = json.dumps([{"id": e.id, "rule": e.rule, "condition": e.condition} for e in items], ensure_ascii=False)
    path = render_steps(path_steps(transcript), obs_chars)
    user = f"<task>\n{task}\n</task>\n\n<items>\n{listed}\n</items>\n\n<path>\n{path}\n</path>\n\n{_MATCH_RULES}"
    return [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": user}]


def clean_items(items: Iterable[Item], turns: Mapping[int, int]) -> list[Item]:
    """Validate an extraction (taspo.md §4.3): evidence whose rollout was not shown (`turns`: shown rollout id ->
    its number of turns) or whose turn is out of range is discarded; an item left without evidence is dropped;
    duplicate ids are renumbered (`<id>-2`, ...); at most 12 items are kept, in order.

    >>> kept = clean_items([Item(id="a", rule="r", condition="c", evidence=[Evidence(rollout=9, turn=1)]),
    ...                     Item(id="a", rule="r2", condition="c", evidence=[Evidence(rollout=0, turn=2)])], {0: 2})
    >>> [(e.id, e.rule) for e in kept]
    [('a', 'r2')]
    """
    out, seen = [], set()
    for item in items:
        evidence = [z for z in item.evidence if z.rollout in turns and 1 <= z.turn <= turns[z.rollout]]
        if not evidence:
            continue
        uid, n = item.id, 1
        while uid in seen:
            n += 1
            uid = f"{item.id}-{n}"
        seen.add(uid)
        out.append(item.model_copy(update={"id": uid, "evidence": evidence}))
        if len(out) == MAX_ITEMS:
            break
    return out


def leave_one_out(items: Sequence[Item], rollout: int) -> list[Item]:
    """E_{x,−i} (taspo.md Eq. 4): the items with evidence from a successful rollout other than `rollout`.

    >>> a = Item(id="a", rule="r", condition="c", evidence=[Evidence(rollout=1, turn=1)])
    >>> [e.id for e in leave_one_out([a], 1)], [e.id for e in leave_one_out([a], 2)]
    ([], ['a'])
    """
    return [e for e in items if any(z.rollout != rollout for z in e.evidence)]


def compose(items: Sequence[Item], count_tokens, max_tokens: int = 1024) -> str:
    """P_i (taspo.md Eq. 6, §4.5): a header line and one numbered line "When <condition>: <rule>" per item, in the
    analyzer's order; trailing items are dropped while the text exceeds `max_tokens` (`count_tokens(text) -> int`).
    Evidence is never shown to the policy."""
    header = "Privileged guidance for this task (used in training only):"
    lines = [f"{k}. When {e.condition}: {e.rule}" for k, e in enumerate(items, 1)]
    while lines and count_tokens("\n".join([header, *lines])) > max_tokens:
        lines.pop()
    return "\n".join([header, *lines]) if lines else ""


# ---------------------------------------------------------------------------------------------------------------------
# The offline oracle


def _section(text: str, tag: str) -> str:
    m = re.search(rf"<{tag}>\n(.*?)\n</{tag}>", text, flags=re.DOTALL)
    return m.group(1) if m else ""


def _turns(section: str) -> list[tuple[str, str]]:
    """(action, observation) per step of a `render_steps` section."""
    parts = re.split(r"^\[(ASSISTANT|ENVIRONMENT)\] step (\d+)$", section, flags=re.MULTILINE)
    steps: dict[int, dict[str, str]] = {}
    for role, j, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
        steps.setdefault(int(j), {})[role] = body.strip("\n")
    return [(s.get("ASSISTANT", ""), s.get("ENVIRONMENT", "")) for _, s in sorted(steps.items())]


def _key(text: str) -> str:
    return " ".join(text.split())


def _oracle_item(uid: str, seen: str, action: str) -> dict:
    """An oracle item (taspo.md D15): after the (normalised) observation `seen`, take `action`."""
    shown = clip_middle(_key(seen), 200)
    return {
        "id": uid,
        "rule": f"take the action «{action}»",
        "condition": f"the environment has just shown «{shown}»",
        "evidence": [],
    }


def expert_items(first: str, turns: Sequence[tuple[str, str]]) -> list[Item]:
    """The items the oracle would extract from one successful rollout that took only expert actions: per turn j,
    "when the environment has just shown «the observation before it»: take the action «its action»" (the first
    observation before turn 1). `turns`: (action, observation) per turn. The tiny default's guidance demonstrations
    show these (`envs.tiny`), so that it learns to read TASPO's teacher block as the oracle writes it.

    >>> [(e.rule, e.condition) for e in expert_items("buy  socks", [("search[socks]", "results: [fox] socks")])]
    [('take the action «search[socks]»', 'the environment has just shown «buy socks»')]
    """
    seen, items = [first, *(obs for _, obs in turns[:-1])], []
    for j, ((action, _), before) in enumerate(zip(turns, seen, strict=True), 1):
        entry = _oracle_item(f"e{j}", before, action)
        items.append(Item(**(entry | {"evidence": [Evidence(rollout=0, turn=j)]})))
    return items[:MAX_ITEMS]


class OracleAnalyzer(OracleJudge):
    """TASPO's analyzer answered from the built-in environments' ground truth (see the module docstring). It is
    DRACO's `OracleJudge` (task lookup by instruction, call and token accounting, never raising) answering TASPO's two
    schemas instead of the rubric stages.

    Args:
        tasks: task dicts with `instruction` and `env` (the built-in generators' format).
        obs_chars: the observation cap the prompts use (an observation longer than it cannot be matched in full).
    """

    def __init__(self, tasks: Iterable[Mapping[str, Any]] = (), obs_chars: int = 1000) -> None:
        super().__init__(tasks, checks={})
        self.obs_chars = obs_chars

    def __repr__(self) -> str:
        return f"OracleAnalyzer(tasks={len(self.tasks)})"

    def answer(self, prompt: str, schema: type[pydantic.BaseModel]) -> dict | None:
        task = self.find_task(prompt)
        if task is None:
            return None
        if schema is ExtractedItems:
            return {"items": self._extract(task, prompt)}
        if schema is Applicable:
            return {"applicable": self._match(task, prompt)}
        return None

    def _extract(self, task: dict, prompt: str) -> list[dict]:
        from envs import ENVIRONMENTS

        first = _key(_section(prompt, "task").partition("[USER]\n")[2])
        items: dict[tuple[str, str], dict] = {}
        for rid, body in re.findall(r'<rollout id="(\d+)">\n(.*?)\n</rollout>', prompt, flags=re.DOTALL):
            env = ENVIRONMENTS[task["env"]]()
            seen = first
            env.reset(task)
            for j, (action, observation) in enumerate(_turns(body), 1):
                expert = env.expert_action()
                if _key(action) == _key(expert):  # a step the ground truth requires here
                    key = (clip_middle(seen, 200), expert)
                    entry = items.setdefault(key, _oracle_item(f"e{len(items) + 1}", seen, expert))
                    entry["evidence"].append({"rollout": int(rid), "turn": j, "action": action, "observation": ""})
                env.step(action)
                seen = _key(observation)
        ranked = sorted(items.values(), key=lambda e: -len(e["evidence"]))  # most supported first
        return ranked[:MAX_ITEMS]

    def _match(self, task: dict, prompt: str) -> list[str]:
        try:
            items = json.loads(_section(prompt, "items"))
        except json.JSONDecodeError:
            return []
        shown = {clip_middle(_key(_section(prompt, "task").partition("[USER]\n")[2]), 200)}
        shown |= {clip_middle(_key(obs), 200) for _, obs in _turns(_section(prompt, "path"))}
        out = []
        for item in items:
            m = re.fullmatch(r"the environment has just shown «(.*)»", str(item.get("condition", "")), flags=re.DOTALL)
            if m and m.group(1) in shown:
                out.append(str(item["id"]))
        return out
