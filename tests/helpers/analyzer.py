"""TASPO's scripted offline analyzer and its prompt readers: used by test_analyzer, test_taspo and
test_every_trainer_trains."""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import dataclass

from rewards.analyzer import (
    ExtractedItems,
)
from rewards.judge import BaseJudge

KEY_ENV = "AGENT_TRL_TEST_ANALYZER_KEY"


SENTINEL = "SENTINEL-5c1e"


def shown_rollouts(text: str) -> list[int]:
    """The rollout ids an extraction prompt shows."""
    return [int(x) for x in re.findall(r'<rollout id="(\d+)">', text)]


def listed_items(text: str) -> list[dict]:
    """The candidate items a match prompt lists."""
    return json.loads(re.search(r"<items>\n(.*?)\n</items>", text, flags=re.DOTALL).group(1))


def items_per_rollout(text: str) -> dict:
    """An extraction answer: `own<i>` citing turn 1 of each shown rollout i (in the order shown), then `shared`
    citing turn 1 of all of them."""
    ids = shown_rollouts(text)
    items = [
        dict(id=f"own{i}", rule=f"act as rollout {i} did", condition=f"rollout {i} applies",
             evidence=[dict(rollout=i, turn=1)])
        for i in ids
    ]  # fmt: skip
    items.append(dict(id="shared", rule="say the asked word", condition="a word is asked for",
                      evidence=[dict(rollout=i, turn=1) for i in ids]))  # fmt: skip
    return {"items": items}


def all_listed(text: str) -> dict:
    """A match answer: every candidate applies."""
    return {"applicable": [e["id"] for e in listed_items(text)]}


@dataclass
class Call:
    schema: str
    text: str
    process: int  # the simulated process that made the call (tests/test_taspo.py)


class Scripted(BaseJudge):
    """An analyzer answering from functions of the prompt text (`extract`, `match`: text -> answer dict, None for
    unscorable; may be async); records every call."""

    def __init__(self, extract=items_per_rollout, match=all_listed):
        super().__init__()
        self.extract, self.match = extract, match
        self.calls: list[Call] = []
        self.process = 0

    async def score(self, messages, schema, *, vote_index=0, **sampling):
        text = "\n".join(str(m.get("content", "")) for m in messages)
        self.calls.append(Call(schema.__name__, text, self.process))
        self.stats.add("calls")
        answer = (self.extract if schema is ExtractedItems else self.match)(text)
        if inspect.isawaitable(answer):
            answer = await answer
        return None if answer is None else schema.model_validate(answer)

    def schemas(self) -> list[str]:
        return [c.schema for c in self.calls]

    def match_prompt(self, marker: str) -> str:
        """The one match prompt whose path contains `marker`."""
        (text,) = [c.text for c in self.calls if c.schema == "Applicable" and marker in c.text]
        return text
