"""An oracle judge for the built-in environments: DRACO's five stages answered from ground truth, with no LLM.

`OracleJudge(tasks)` is a `BaseJudge`: it receives exactly the prompts `rewards/rubrics.py` sends to an API judge and
answers with the same pydantic schemas, so DRACO's rubric and credit machinery can be tested and benchmarked offline
and deterministically. What it does per stage (the stage is told by the schema):

- it finds the task by the instruction on the first line of the prompt's `[USER]` block (the tasks are handed to it
  at construction, e.g. the training dataset's `task` column; the prompts never contain ground truth);
- it reads each rollout's actions back from the prompt and replays them in a fresh environment, so it knows every
  state the agent passed through;
- S1 returns the environment's task-level checks as criteria (the outcome attributes of the task, marked `essential`
  where success requires them, draco.md D19); S2 returns the
  process checks this rollout fails; the union deduplicates and drops the criteria every shown rollout passes or
  finds not applicable (§4.3); scoring evaluates each listed criterion by title (an unknown title scores 0); credit
  gives the same verdicts with the steps responsible (a PASS or FAIL always cites at least one step, an omission
  cites the last step).

It counts like the real judge (`metrics()`): calls, requests, tokens estimated as characters / 4 (flagged in
`usage_estimated`), cost 0. It never raises: an unknown task or an unreadable prompt gives None (unscorable).

Checks per environment (titles are the criteria titles):
- shop: bought item type / material / colour, chosen size, price within budget (task level, essential), a search
  naming the wanted item (task level); every action valid on its page (process). The shopping lists (levels 1 and
  2, `shop_list_checks`): per list item, the cart's entry at its position is the wanted item (type, material, colour
  and price within budget) and has the wanted size (task level, essential), the checkout uses the instruction's
  coupon (task level, essential), a search naming each wanted item (task level); every action valid on its page
  (process).
- terminal: each assertion of the verifier on the final file system, ending with `submit` (task level, essential);
  commands run without shell errors (process).
- search: each hop's supporting document surfaced by a search (task level), the final answer correct (task level,
  essential); every turn a valid action (process).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import pydantic

from envs.search import SearchEnv
from envs.shop import ShopEnv, item_attributes, listing_title
from envs.terminal import TerminalEnv, check_assertion, command_line
from rewards.judge import BaseJudge, M
from rewards.rubrics import (
    Attributions,
    MergedCriteria,
    RolloutCriteria,
    Scores,
    TaskCriteria,
    extract_criteria,
    extract_rollouts,
    extract_task,
    normalize_title,
)

logger = logging.getLogger(__name__)


@dataclass
class Check:
    """One criterion the oracle can decide, with its verdict on a replayed rollout."""

    title: str
    description: str
    verdict: int  # +1 satisfied, -1 violated, 0 not applicable
    steps: list[int]  # 1-based steps responsible for the verdict
    evidence: str = ""
    process: bool = False  # a process check (S2) rather than a task-level one (S1)
    essential: bool = False  # an outcome the instruction names: what success requires (draco.md D19)

    def criterion(self, evidence: bool = False) -> dict[str, Any]:
        out = {
            "title": self.title,
            "description": self.description,
            "evaluator_instruction": f"Pass if {self.description[0].lower()}{self.description[1:]}",
            "grounding_references": [],
            "essential": self.essential,
        }
        if evidence:
            out["trajectory_evidence"] = self.evidence
        return out


def _last(actions: Sequence[str]) -> list[int]:
    return [len(actions)] if actions else []


def _process_check(title: str, description: str, bad: list[int], num_steps: int, what: str) -> Check:
    """A process criterion (S2): violated at the `bad` steps, else satisfied by all `num_steps` steps. `what` names
    one violation ("shell error"); the evidence lists the steps of the violations."""
    evidence = f"{what}s at steps {bad}" if bad else f"no {what}"
    return Check(title, description, -1 if bad else 1, bad or list(range(1, num_steps + 1)), evidence, process=True)


# ---------------------------------------------------------------------------------------------------------------------
# Per-environment checks: (task, actions) -> checks


def shop_checks(task: dict, actions: Sequence[str]) -> list[Check]:
    if "targets" in task:  # a shopping list (levels 1 and 2)
        return shop_list_checks(task, actions)
    env = ShopEnv(task["difficulty"])
    env.reset(task)
    t, level = task["target"], task["difficulty"]
    opened: dict[str, int] = {}  # item id -> step that opened it last
    chose: dict[str, int] = {}  # option kind -> step of the last choice
    searches: list[tuple[int, set[str]]] = []
    invalid: list[int] = []
    info: dict = {}
    buy_step = None
    for j, action in enumerate(actions, 1):
        before = dict(env.chosen)
        page = env.page
        _, _, done, info = env.step(action)
        if info.get("invalid"):
            invalid.append(j)
        elif env.page == "results":
            searches.append((j, _query_words(action)))
        elif env.page == "item" and page == "results":
            opened[env.item["id"]] = j
        elif env.page == "item":
            chose.update({k: j for k, v in env.chosen.items() if before.get(k) != v})
        if done:
            buy_step = j if env.page == "done" and "matched" in info else None
            break
    matched, item = info.get("matched"), env.item if buy_step else None

    def outcome(attr: str, title: str, description: str, option: bool = False) -> Check:
        if item is None:
            return Check(title, description, -1, _last(actions), "nothing was bought", essential=True)
        first = chose.get(attr) if option else opened.get(item["id"])
        steps = sorted({s for s in (first, buy_step) if s})
        bought = f"bought {item['id']} ({listing_title(item, level)} ${item['price']}), options {env.chosen or 'none'}"
        return Check(title, description, 1 if matched[attr] else -1, steps, bought, essential=True)

    colour_option = any(len(it["colours"]) > 1 for it in env.catalogue)  # the level whose items offer colours
    checks = [
        outcome("type", f"The bought item is a {t['type']}", f"The item bought is a {t['type']}."),
        outcome("material", f"The bought item is {t['material']}", f"The item bought is made of {t['material']}."),
        outcome(
            "colour",
            f"The bought item is {t['colour']}",
            f"The item bought is {t['colour']}" + (" (colour option chosen)." if colour_option else "."),
            option=colour_option,
        ),
        outcome("size", f"Size {t['size']} was chosen", f"Size {t['size']} is chosen before buying.", option=True),
        outcome(
            "price", f"The price is at most {t['max_price']} dollars", f"The item costs {t['max_price']} or less."
        ),
    ]
    wanted = {t["type"], t["material"]} | (set() if colour_option else {t["colour"]})  # titles name the colour
    checks.append(_search_check("A search names the wanted item", wanted, searches, len(actions)))
    checks.append(_valid_actions_check(invalid, len(actions)))
    return checks


def _query_words(action: str) -> set[str]:
    return set(action.lower().replace("[", " ").replace("]", " ").split())


def _search_check(title: str, wanted: set[str], searches: list[tuple[int, set[str]]], num_steps: int) -> Check:
    """Some search (step, query words) holds every `wanted` word: it cites the first such search, else every search,
    else the first step."""
    good = [j for j, words in searches if wanted <= words]
    return Check(
        title,
        f"Some search query contains the words {', '.join(sorted(wanted))}.",
        1 if good else -1,
        good[:1] or [j for j, _ in searches] or [1][:num_steps],  # no search: the first step
        f"search steps {[j for j, _ in searches]}",
    )


def _valid_actions_check(invalid: list[int], num_steps: int) -> Check:
    return _process_check(
        "Every action is valid on its page",
        "Every action is one the current page accepts (no error observation).",
        invalid,
        num_steps,
        "error observation",
    )


def shop_list_checks(task: dict, actions: Sequence[str]) -> list[Check]:
    """The shop's shopping lists (levels 1 and 2). `ShopEnv._checkout` scores the cart by position (its entry k
    against the list's item k) and the coupon, so per list item there are two outcome checks, each citing the steps
    of one decision and the `add`: the entry is the wanted item (type, material, colour, price within budget: the
    click) and has the wanted size (the choice). A level-0 check per attribute would make 5 per item, 25 task-level
    criteria with a list of 4, above S1's limit of 15 (draco.md §4.3); a wrong item here is one click (a twin or a
    filler), so one criterion per decision is also one criterion per mistake. A missing entry (an early checkout, or
    none) fails both and cites the last step; leaving without a checkout fails only the coupon's check."""
    env = ShopEnv(task["difficulty"])
    env.reset(task)
    level, targets, coupon = task["difficulty"], task["targets"], task["coupon"]
    entries: list[tuple[int | None, int | None, int]] = []  # per cart entry: steps of its click, size choice, add
    opened = sized = None  # steps of the open item's click and of its latest size choice
    searches: list[tuple[int, set[str]]] = []
    invalid: list[int] = []
    checkout: tuple[int, bool] | None = None  # (step, coupon right)
    for j, action in enumerate(actions, 1):
        page, size, in_cart = env.page, env.chosen.get("size"), len(env.cart)
        _, _, done, info = env.step(action)
        if info.get("invalid"):
            invalid.append(j)
        elif env.page == "results":
            searches.append((j, _query_words(action)))
        elif env.page == "item" and page == "results":
            opened, sized = j, None
        elif env.page == "item" and env.chosen.get("size") != size:
            sized = j
        elif len(env.cart) > in_cart:
            entries.append((opened, sized, j))
        if done:  # only a checkout ends a list's episode
            checkout = (j, info["coupon"])
            break

    checks = []
    for k, t in enumerate(targets, 1):
        name = f"{t['colour']} {t['material']} {t['type']}"
        item_title = f"Cart entry {k} is a {name} at most {t['max_price']} dollars"
        item_description = (
            f"The item added to the cart in position {k} is a {name} costing {t['max_price']} dollars or less."
        )
        size_title = f"Size {t['size']} was chosen for cart entry {k}"
        size_description = f"The item added to the cart in position {k} has size {t['size']} chosen."
        if k > len(env.cart):
            missing = f"the cart holds {len(env.cart)} of the list's {len(targets)} items"
            checks.append(Check(item_title, item_description, -1, _last(actions), missing, essential=True))
            checks.append(Check(size_title, size_description, -1, _last(actions), missing, essential=True))
            continue
        (item, size), (click, choose, add) = env.cart[k - 1], entries[k - 1]
        matched = item_attributes(item, size, item["colours"][0], t)  # the checkout's own rule
        right_item = all(matched[a] for a in ("type", "material", "colour", "price"))
        added = f"entry {k}: {item['id']} ({listing_title(item, level)} ${item['price']}), size {size or 'none'}"
        steps = sorted({s for s in (click, add) if s})
        checks.append(Check(item_title, item_description, 1 if right_item else -1, steps, added, essential=True))
        steps = sorted({s for s in (choose, add) if s})
        checks.append(Check(size_title, size_description, 1 if matched["size"] else -1, steps, added, essential=True))
    paid = "no checkout" if checkout is None else f"checkout at step {checkout[0]}, coupon right: {checkout[1]}"
    checks.append(
        Check(
            f"The checkout uses coupon {coupon}",
            f"The agent checks out with the coupon word the instruction names: checkout[{coupon}].",
            1 if checkout and checkout[1] else -1,
            [checkout[0]] if checkout else _last(actions),
            paid,
            essential=True,
        )
    )
    for t in targets:
        wanted = {t["type"], t["material"], t["colour"]}  # at these levels the titles name the colour
        checks.append(_search_check(f"A search names the wanted {t['type']}", wanted, searches, len(actions)))
    checks.append(_valid_actions_check(invalid, len(actions)))
    return checks


_SHELL_ERRORS = ("bash: ", ": No such file or directory", ": Is a directory", ": Not a directory", "missing operand")


def describe_step(assertion: dict) -> str:
    kind, path = assertion["kind"], assertion["path"]
    return {
        "file_exists": f"A file exists at {path}",
        "file_absent": f"Nothing exists at {path}",
        "dir_exists": f"A directory exists at {path}",
        "file_equals": f"{path} holds exactly {str(assertion.get('content', '')).strip()!r}",
        "file_contains": f"{path} contains {str(assertion.get('text', '')).strip()!r}",
        "line_count": f"{path} has {assertion.get('lines')} lines",
    }.get(kind, f"{kind} {path}")


def terminal_checks(task: dict, actions: Sequence[str]) -> list[Check]:
    env = TerminalEnv(task["difficulty"])
    env.reset(task)
    commands: list[str] = []
    errors: list[int] = []
    submit_step = None
    for j, action in enumerate(actions, 1):
        observation, _, done, _ = env.step(action)
        commands.append(command_line(action))
        if any(e in observation for e in _SHELL_ERRORS):
            errors.append(j)
        if done:
            submit_step = j
            break
    checks = []
    for assertion in task.get("assertions", []):
        holds = check_assertion(env.shell.files, env.shell.dirs, assertion)
        name = assertion["path"].strip("/").split("/")[-1]
        touched = [j for j, c in enumerate(commands, 1) if name and name in c]
        title = describe_step(assertion)
        description = f"At the end, {title[0].lower()}{title[1:]}."
        checks.append(Check(title, description, 1 if holds else -1, touched or _last(actions), essential=True))
    checks.append(
        Check(
            "The episode ends with submit",
            "The agent ends the episode with `submit` once the work is done.",
            1 if submit_step else -1,
            [submit_step] if submit_step else _last(actions),
            essential=True,
        )
    )
    checks.append(
        _process_check(
            "Commands run without shell errors",
            "No command fails with a shell error (unknown command, missing file, bad operand).",
            errors,
            len(commands),
            "shell error",
        )
    )
    return checks


def search_checks(task: dict, actions: Sequence[str]) -> list[Check]:
    env = SearchEnv(task["difficulty"])
    env.reset(task)
    surfaced: dict[int, int] = {}  # document index -> first step that showed it
    invalid: list[int] = []
    answer: tuple[int, bool] | None = None
    for j, action in enumerate(actions, 1):
        shown = set(env.shown)
        observation, _, done, info = env.step(action)
        if observation.startswith("error"):
            invalid.append(j)
        for doc in env.shown - shown:
            surfaced.setdefault(doc, j)
        if done:
            answer = (j, bool(info.get("success")))
            break
    checks = []
    for h, (hop, doc) in enumerate(zip(task["hops"], task["support"], strict=True), 1):
        found = surfaced.get(doc)
        checks.append(
            Check(
                f"A search finds the fact about {hop}",
                f"A search shows the document stating hop {h} of the answer chain (about {hop}).",
                1 if found else -1,
                [found] if found else _last(actions),
            )
        )
    checks.append(
        Check(
            "The final answer is correct",
            "The agent answers with the entity the question asks for.",
            1 if answer and answer[1] else -1,
            [answer[0]] if answer else _last(actions),
            "no answer" if answer is None else f"answer at step {answer[0]}",
            essential=True,
        )
    )
    checks.append(
        _process_check(
            "Every turn has a valid action",
            "Every turn contains a well-formed search[...] or answer[...] action.",
            invalid,
            len(actions),
            "error observation",
        )
    )
    return checks


CHECKS: dict[str, Callable[[dict, Sequence[str]], list[Check]]] = {
    "shop": shop_checks,
    "terminal": terminal_checks,
    "search": search_checks,
}


# ---------------------------------------------------------------------------------------------------------------------
# The judge


def instruction_key(text: str) -> str:
    """Lowercase, whitespace collapsed: how instructions are matched."""
    return " ".join(text.lower().split())


class OracleJudge(BaseJudge):
    """DRACO judge that answers from the environments' ground truth; see the module docstring.

    Args:
        tasks: task dicts with `instruction` and `env` (the built-in generators' format).
        checks: per-environment check functions; defaults to `CHECKS` (shop, terminal, search).
    """

    def __init__(
        self,
        tasks: Iterable[Mapping[str, Any]] = (),
        checks: Mapping[str, Callable[[dict, Sequence[str]], list[Check]]] | None = None,
    ) -> None:
        super().__init__()
        self.checks = dict(CHECKS if checks is None else checks)
        self.tasks: dict[str, dict] = {}
        self.add_tasks(tasks)

    def __repr__(self) -> str:
        return f"OracleJudge(tasks={len(self.tasks)})"

    def add_tasks(self, tasks: Iterable[Mapping[str, Any]]) -> None:
        for task in tasks:
            task = json.loads(task) if isinstance(task, str) else dict(task)
            self.tasks[instruction_key(task["instruction"])] = task

    def find_task(self, prompt: str) -> dict | None:
        """The task whose instruction is the first line of the `[USER]` block of the prompt's `<task>` section."""
        task_text = extract_task(prompt)
        _, _, user = task_text.partition("[USER]\n")
        first = user.strip().splitlines()[0] if user.strip() else ""
        label, _, rest = first.partition(":")  # the environments' "Instruction: ...", "Task: ...", "Question: ..."
        return self.tasks.get(instruction_key(first)) or self.tasks.get(instruction_key(rest) if label else "")

    async def score(
        self, messages: Sequence[Mapping[str, Any]], schema: type[M], *, vote_index: int = 0, **sampling: Any
    ) -> M | None:
        self.stats.add("calls")
        self.stats.add("requests")
        prompt = "\n".join(str(m.get("content", "")) for m in messages)
        try:
            answer = self.answer(prompt, schema)
            result = None if answer is None else schema.model_validate(answer)
        except Exception as err:  # never raise into the training loop
            logger.warning("oracle judge could not answer %s: %s: %s", schema.__name__, type(err).__name__, err)
            self.stats.add("failures/internal")
            result = None
        self.stats.add("tokens_in", math.ceil(len(prompt) / 4))
        self.stats.add("tokens_out", math.ceil(len(json.dumps(answer)) / 4) if result is not None else 0)
        self.stats.add("usage_estimated")
        if result is None:
            self.stats.add("unscorable")
        return result

    def answer(self, prompt: str, schema: type[pydantic.BaseModel]) -> dict | None:
        """The JSON answer (a dict in `schema`'s envelope) to one DRACO prompt, or None for an unknown task."""
        task = self.find_task(prompt)
        if task is None or task.get("env") not in self.checks:
            return None
        judge = self.checks[task["env"]]
        rollouts = extract_rollouts(prompt)
        if schema is TaskCriteria:
            return {"criteria": [c.criterion() for c in judge(task, []) if not c.process]}
        if schema is RolloutCriteria:
            return {"criteria": [c.criterion(True) for c in judge(task, rollouts[0]) if c.process and c.verdict < 0]}
        listed = extract_criteria(prompt)
        if schema is MergedCriteria:
            verdicts = [{normalize_title(c.title): c.verdict for c in judge(task, r)} for r in rollouts]
            kept, seen = [], set()
            for c in listed:
                key = normalize_title(c["title"])
                votes = [v.get(key) for v in verdicts]
                if key in seen or (None not in votes and (all(x == 1 for x in votes) or all(x == 0 for x in votes))):
                    continue  # duplicate, or passed / not applicable everywhere (§4.3 union rules)
                seen.add(key)
                kept.append(
                    {k: c[k] for k in ("title", "description", "evaluator_instruction", "essential") if k in c}
                )
            return {"criteria": kept[:24]}
        checks = {normalize_title(c.title): c for c in judge(task, rollouts[0])}
        if schema is Scores:
            scores = []
            for c in listed:
                check = checks.get(normalize_title(c["title"]))
                score = check.verdict if check else 0
                evidence = check.evidence if check else "the oracle does not know this criterion"
                scores.append({"rubric_title": c["title"], "score": score, "evidence": evidence, "justification": ""})
            return {"scores": scores}
        if schema is Attributions:
            names = {1: "PASS", -1: "FAIL", 0: "NOT_APPLICABLE"}
            out = []
            for i, c in enumerate(listed, 1):
                check = checks.get(normalize_title(c["title"]))
                verdict = check.verdict if check and check.steps else 0
                steps = check.steps if verdict else []
                out.append(
                    {
                        "rubric_title": c["title"],
                        "rubric_index": i,
                        "verdict": names[verdict],
                        "relevant_steps": steps,
                        "explanation": check.evidence if check else "",
                    }
                )
            return {"attributions": out}
        return None


__all__ = ["CHECKS", "Check", "OracleJudge", "search_checks", "shop_checks", "shop_list_checks", "terminal_checks"]
