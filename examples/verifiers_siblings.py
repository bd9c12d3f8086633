"""A verifiers 0.4 environment, as a user writes one: a taskset from a local JSONL file, a reward function, and an
environment that lets the agent answer again after a wrong answer. Train on it with no glue
(configs/verifiers_siblings.yaml):

    environment: verifiers:examples.verifiers_siblings
    environment_kwargs: {env: {attempts: 2}, expert: "{answer}"}

The questions (data/siblings.jsonl, made by data/make_siblings.py) are reasoning-gym's sibling puzzles: "Susan has 4
sisters and she also has 3 brothers. How many sisters does James's brother have?" (5).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import verifiers.v1 as vf


def final_number(reply: str) -> str:
    """The last number in a reply ("" when there is none)."""
    numbers = re.findall(r"-?\d+", reply or "")
    return numbers[-1] if numbers else ""


class SiblingsData(vf.TaskData):
    answer: str


class SiblingsTask(vf.Task[SiblingsData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return float(final_number(trace.last_reply) == self.data.answer)


class SiblingsConfig(vf.TasksetConfig):
    path: str = str(Path(__file__).resolve().parents[1] / "data" / "siblings.jsonl")
    num_tasks: int | None = None


class SiblingsTaskset(vf.Taskset[SiblingsTask, SiblingsConfig]):
    def load(self):
        with open(self.config.path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        for i, row in enumerate(rows[: self.config.num_tasks]):
            data = SiblingsData(id=f"siblings-{i}", prompt=row["question"], answer=row["answer"])
            yield SiblingsTask(data, self.config.task)


class SiblingsEnvConfig(vf.EnvConfig):
    agent: vf.AgentConfig = vf.AgentConfig()
    attempts: int = 1


class SiblingsEnv(vf.Env[SiblingsEnvConfig]):
    """A wrong answer is told so and may be answered again, up to `attempts` answers."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            turn = await chat.turn()
            for _ in range(1, self.config.attempts):
                if turn.terminated or final_number(turn.last_reply) == task.data.answer:
                    break
                turn = await chat.turn("Wrong. Try again.")


__all__ = ["SiblingsEnv", "SiblingsTaskset"]
