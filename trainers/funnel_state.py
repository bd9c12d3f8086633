"""The Experience Funnel's textual state and its editors (docs/methods/funnel.md §4.3).

* `State`: ordered entries `{id, scope, kind, text, origin, created_round, updated_round}`; ids `E<n>` are handed out
  in increasing order and never reused.
* `apply_edit_ops(state, ops, ...)`: the only way a state changes. It validates every op (unknown id, empty or
  over-long text, `add` in residual mode: dropped and logged), applies at most `max_ops_per_round`, then drops trailing
  ops until the entry count and the rendered token budget hold. Pure: the input state is not changed.
* `render_state(state, family)`: the block the policy reads, entries of scope "*" or of the task's family in id order;
  None when no entry applies, so the state-free prompt is the plain prompt byte for byte.
* Editors turn (state, evidence, gate history) into ops: `CardEditor` (deterministic, no model: the action skeleton
  shared by the successful evidence rollouts of each task family, funnel.md D19) and `LLMEditor` (an API model through
  the judge layer, `rewards/judge.py`: retries, JSON repair and the on-disk cache are the judge's).
"""

from __future__ import annotations

import copy
import json
import logging
import re
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

import pydantic

logger = logging.getLogger(__name__)

KINDS = ("skill", "guidance")
STATE_HEADER = "Notes from experience:"


@dataclass
class Entry:
    id: str
    text: str
    kind: str = "skill"
    scope: str = "*"
    origin: str = "manual"
    created_round: int = 0
    updated_round: int = 0


@dataclass
class State:
    entries: list[Entry] = field(default_factory=list)
    next_id: int = 1  # the number of the next `E<n>`; never decreases, so deleted ids are not reused

    def __post_init__(self):  # a state built by hand never hands out an id its entries already hold
        taken = [int(e.id[1:]) for e in self.entries if e.id[:1] == "E" and e.id[1:].isdigit()]
        self.next_id = max([self.next_id, *(n + 1 for n in taken)])

    def to_dict(self) -> dict:
        return {"entries": [asdict(e) for e in self.entries], "next_id": self.next_id}

    @classmethod
    def from_dict(cls, data: dict) -> State:
        return cls([Entry(**e) for e in data.get("entries", [])], int(data.get("next_id", 1)))

    def ids(self) -> list[str]:
        return [e.id for e in self.entries]

    def without(self, entry_id: str) -> State:
        out = copy.deepcopy(self)
        out.entries = [e for e in out.entries if e.id != entry_id]
        return out


def task_family(task: dict) -> str:
    """The scope key of a task: its `family` field when it has one, else "*" (every entry applies)."""
    family = task.get("family") if isinstance(task, dict) else None
    return str(family) if family not in (None, "") else "*"


def render_state(state: State, family: str = "*") -> str | None:
    """The state block for a task of `family` (funnel.md D13): the header, then one line per entry whose scope is "*"
    or `family`, in id order. None when no entry applies. Deterministic: the same state gives the same bytes.

    >>> render_state(State([Entry("E2", "buy last"), Entry("E1", "search first", scope="shoes")]), "shoes")
    'Notes from experience:\\n- search first\\n- buy last'
    """
    lines = [e.text for e in sorted(state.entries, key=lambda e: int(e.id[1:])) if e.scope in ("*", family)]
    if not lines:
        return None
    return "\n".join([STATE_HEADER, *(f"- {t}" for t in lines)])


def state_tokens(state: State, count_tokens: Callable[[str], int]) -> int:
    """The most tokens the rendered state takes for any family it mentions (what the budget bounds)."""
    families = {e.scope for e in state.entries if e.scope != "*"} or {"*"}
    return max(count_tokens(render_state(state, f) or "") for f in families)


class EditOp(pydantic.BaseModel):
    """One edit operation (funnel.md §4.3)."""

    op: Literal["add", "modify", "delete"]
    id: str | None = None
    text: str | None = None
    kind: str | None = None
    scope: str | None = None
    rationale: str | None = None
    origin: str | None = None


class EditProposal(pydantic.BaseModel):
    """What an editor returns: the ops, in the order to apply them."""

    ops: list[EditOp] = pydantic.Field(default_factory=list)


def apply_edit_ops(
    state: State,
    ops: Sequence[EditOp],
    round_index: int,
    *,
    max_entries: int,
    max_entry_chars: int,
    max_ops: int,
    token_budget: int,
    count_tokens: Callable[[str], int],
    residual: bool = False,
    origin: str = "llm",
) -> tuple[State, list[dict], list[dict]]:
    """Apply `ops` to a copy of `state` (funnel.md §4.3). Returns (new state, applied ops, dropped ops with their
    `reason`). Budgets hold afterwards; the same ops on the same state give the same result."""
    dropped: list[dict] = []
    valid: list[EditOp] = []
    for op in ops:
        reason = _invalid(op, state, valid, max_entry_chars, residual)
        if reason:
            dropped.append({**op.model_dump(exclude_none=True), "reason": reason})
        else:
            valid.append(op)
    for op in valid[max_ops:]:
        dropped.append({**op.model_dump(exclude_none=True), "reason": "over max_ops_per_round"})
    valid = valid[:max_ops]
    while True:  # drop trailing ops until the result fits
        out = _apply(state, valid, round_index, origin)
        if len(out.entries) <= max_entries and state_tokens(out, count_tokens) <= token_budget:
            break
        if not valid:  # the incumbent itself is over budget: keep it (only ops are dropped), the loop consolidates
            break
        last = valid.pop()
        dropped.append({**last.model_dump(exclude_none=True), "reason": "over max_entries or state_token_budget"})
    for d in dropped:
        logger.info("state edit dropped: %s", json.dumps(d))
    return out, [op.model_dump(exclude_none=True) for op in valid], dropped


def _invalid(op: EditOp, state: State, earlier: list[EditOp], max_chars: int, residual: bool) -> str | None:
    if op.op == "add" and residual:
        return "add in residual mode"
    if op.op in ("modify", "delete"):
        live = set(state.ids()) - {o.id for o in earlier if o.op == "delete"}
        if op.id not in live:
            return f"unknown id {op.id!r}"
    if op.op in ("add", "modify"):
        if op.op == "add" or op.text is not None:
            text = (op.text or "").strip()
            if not text:
                return "empty text"
            if len(text) > max_chars:
                return f"text longer than {max_chars} characters"
        if op.kind is not None and op.kind not in KINDS:
            return f"kind must be one of {KINDS}"
    return None


def _apply(state: State, ops: Sequence[EditOp], round_index: int, origin: str) -> State:
    out = copy.deepcopy(state)
    for op in ops:
        if op.op == "add":
            out.entries.append(
                Entry(f"E{out.next_id}", op.text.strip(), op.kind or "skill", op.scope or "*",
                      op.origin or origin, round_index, round_index)
            )  # fmt: skip
            out.next_id += 1
        elif op.op == "delete":
            out.entries = [e for e in out.entries if e.id != op.id]
        else:
            entry = next(e for e in out.entries if e.id == op.id)
            entry.text = op.text.strip() if op.text is not None else entry.text
            entry.scope, entry.kind = op.scope or entry.scope, op.kind or entry.kind
            entry.updated_round = round_index
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Evidence and editors


@dataclass
class Evidence:
    """One rollout the editor may read: the task text, its family, reward, success, actions and last observation."""

    task: str
    family: str
    reward: float
    success: bool
    actions: list[str]
    final_observation: str


def action_verb(action: str) -> str:
    """The canonical token of an action: its first word, or the name before a bracket ("click[3]" → "click").

    >>> action_verb("search[red shoes]"), action_verb("  cat notes.txt"), action_verb("")
    ('search', 'cat', '')
    """
    match = re.match(r"\s*([A-Za-z_][\w-]*)", action)
    return match.group(1).lower() if match else ""


class CardEditor:
    """Deterministic editor (funnel.md D19): for each task family among the evidence, the most common sequence of
    action verbs over its successful rollouts (ties: the lexicographically first) becomes one entry
    "Steps that worked: a -> b -> c"; an existing card entry of that scope is modified when the skeleton changed. In
    residual mode it proposes nothing (pruning is left to the gate's leave-one-out)."""

    prefix = "Steps that worked: "

    def propose(self, state: State, evidence: Sequence[Evidence], history: Sequence[dict], residual: bool = False):
        if residual:
            return EditProposal()
        by_family: dict[str, Counter] = {}
        for ev in evidence:
            if ev.success and ev.actions:
                by_family.setdefault(ev.family, Counter())[tuple(action_verb(a) for a in ev.actions)] += 1
        ops = []
        for family in sorted(by_family):
            best = min(by_family[family].items(), key=lambda kv: (-kv[1], kv[0]))[0]
            text = self.prefix + " -> ".join(best)
            mine = [e for e in state.entries if e.origin == "card" and e.scope == family]
            if mine and mine[0].text == text:
                continue
            if mine:
                ops.append(EditOp(op="modify", id=mine[0].id, text=text))
            else:
                ops.append(EditOp(op="add", text=text, kind="skill", scope=family, origin="card"))
        return EditProposal(ops=ops)


EDITOR_SYSTEM = (
    "You improve the experience notes an agent reads before acting. The notes are a short list of entries, each a "
    "skill or a piece of guidance. Read the agent's recent episodes and propose edit operations that would make it "
    "succeed more often: add an entry, modify one (by id) or delete one (by id). Reply with JSON only: "
    '{"ops": [{"op": "add", "text": "...", "kind": "skill|guidance", "scope": "*", "rationale": "..."}, '
    '{"op": "modify", "id": "E1", "text": "..."}, {"op": "delete", "id": "E2"}]}. Propose no ops if nothing helps.'
)
RESIDUAL_NOTE = (
    "The agent has just been trained on these notes. Episodes with and without the notes are shown. Which entries "
    "does it no longer need? You may only modify or delete entries in this round; additions are ignored."
)


def editor_messages(
    environment: str,
    state: State,
    evidence: Sequence[Evidence],
    history: Sequence[dict],
    budgets: dict,
    max_rollouts: int = 16,
    residual: bool = False,
    obs_chars: int = 400,
    action_chars: int = 120,
) -> list[dict]:
    """The editor's chat request (funnel.md §4.3): environment, entries as `[id] (scope) text`, budgets, evidence
    balanced between successes and failures (truncated), and the last 5 rejected edits with their gate statistics."""
    wins = [e for e in evidence if e.success]
    losses = [e for e in evidence if not e.success]
    half = max_rollouts // 2
    shown = wins[: max(half, max_rollouts - len(losses))] + losses[: max(half, max_rollouts - len(wins))]
    shown = shown[:max_rollouts]
    entries = "\n".join(f"[{e.id}] ({e.scope}) {e.text}" for e in state.entries) or "(no entries)"
    episodes = []
    for i, ev in enumerate(shown):
        actions = "; ".join(a[:action_chars] for a in ev.actions)
        episodes.append(
            f"Episode {i + 1} ({'success' if ev.success else 'failure'}, reward {ev.reward:.2f}, family {ev.family})\n"
            f"Task: {ev.task[:obs_chars]}\nActions: {actions}\nLast observation: {ev.final_observation[:obs_chars]}"
        )
    rejected = [h for h in history if not h.get("accept")][-5:]
    rejected_text = (
        "\n".join(
            f"- ops {json.dumps(h.get('ops', []))}: mean difference {h.get('mean_diff', 0):.3f}, "
            f"SE {h.get('se', 0):.3f}"
            for h in rejected
        )
        or "(none)"
    )
    user = "\n\n".join([
        f"Environment: {environment}",
        f"Current notes:\n{entries}",
        "Budgets: " + ", ".join(f"{k} {v}" for k, v in budgets.items()),
        "Recent episodes:\n" + ("\n\n".join(episodes) or "(none)"),
        f"Rejected edits (do not repeat them):\n{rejected_text}",
        *([RESIDUAL_NOTE] if residual else []),
    ])  # fmt: skip
    return [{"role": "system", "content": EDITOR_SYSTEM}, {"role": "user", "content": user}]


class LLMEditor:
    """An API model proposes the ops through a judge (`rewards/judge.py`): temperature 0, seed 0, JSON output, its
    retries and repairs, answers cached on disk by a hash of the request. A request that still fails proposes
    nothing (funnel.md §4.3, §7 property 15)."""

    def __init__(self, judge, environment: str, budgets: dict, max_rollouts: int = 16):
        self.judge, self.environment, self.budgets, self.max_rollouts = judge, environment, budgets, max_rollouts

    def propose(self, state: State, evidence: Sequence[Evidence], history: Sequence[dict], residual: bool = False):
        messages = editor_messages(self.environment, state, evidence, history, self.budgets, self.max_rollouts,
                                   residual)  # fmt: skip
        answer = self.judge.score_sync(messages, EditProposal)
        if answer is None:
            logger.warning("the editor gave no usable answer; this round proposes no edit")
            return EditProposal()
        return EditProposal(ops=[op.model_copy(update={"origin": "llm"}) for op in answer.ops])  # not the model's say
