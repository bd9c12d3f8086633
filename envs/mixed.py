"""The mixed pool: tasks of the three built-in environments (shop, search, terminal) in one training run, for one
policy and one tiny default (`tiny:mixed`) that covers all three. Each task keeps its own environment's `env` field;
an episode is played by that environment. Used to train across environments, e.g. with the task scheduler
(`scheduler: envsched`, docs/methods/envsched.md), whose quotas and graph work per environment."""

from __future__ import annotations

import random

from envs.base import Env
from envs.search import SearchEnv
from envs.shop import ShopEnv
from envs.terminal import TerminalEnv

PARTS: dict[str, type[Env]] = {"shop": ShopEnv, "search": SearchEnv, "terminal": TerminalEnv}


class MixedEnv(Env):
    """Dispatches every call to the environment of the task given to `reset` (its `env` field)."""

    name = "mixed"
    max_turns = max(cls.max_turns for cls in PARTS.values())  # until reset names the task's own
    #: the three warm starts in one: search alone needs 900 steps
    tiny_sft_steps = 1500
    #: changes when any part's demonstrations change (part of the tiny default's cache key)
    demo_version = ShopEnv.demo_version * 10_000 + SearchEnv.demo_version * 100 + TerminalEnv.demo_version
    #: the same per level, from each part's own version of it (`Env.level_demo_versions`)
    level_demo_versions = {
        level: sum(
            part.level_demo_versions.get(level, part.demo_version) * weight
            for part, weight in ((ShopEnv, 10_000), (SearchEnv, 100), (TerminalEnv, 1))
        )
        for level in sorted(set().union(*(part.level_demo_versions for part in (ShopEnv, SearchEnv, TerminalEnv))))
    }

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        self.inner: Env | None = None

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        """`n` tasks, a third from each environment (the first `n mod 3` environments one more), in a seeded random
        order; each keeps its environment's own split rule, so training and held-out tasks never overlap."""
        names = list(PARTS)
        counts = [n // 3 + (i < n % 3) for i in range(3)]
        tasks = [t for name, k in zip(names, counts, strict=True) if k
                 for t in PARTS[name].make_tasks(split, k, seed=seed, difficulty=difficulty)]  # fmt: skip
        random.Random(f"mixed/{split}/{seed}").shuffle(tasks)
        return tasks

    def _part(self, task: dict) -> Env:
        name = task.get("env")
        if name not in PARTS:
            raise ValueError(f"a mixed-pool task needs an `env` field among {sorted(PARTS)}, got {name!r}")
        return PARTS[name](difficulty=self.difficulty)

    def reset(self, task: dict) -> str:
        self.inner = self._part(task)
        self.max_turns = self.inner.max_turns
        return self.inner.reset(task)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        return self.inner.step(action)

    def state_key(self) -> str:
        return self.inner.state_key()

    def expert_action(self) -> str:
        return self.inner.expert_action()

    def noisy_action(self, rng: random.Random) -> str:
        return self.inner.noisy_action(rng)

    def privileged(self, task: dict) -> str | None:
        return self._part(task).privileged(task)

    def descriptor(self, task: dict | None = None) -> dict:
        if task is not None:
            return self._part(task).descriptor(task)
        if self.inner is None:
            raise ValueError("the mixed environment's descriptor depends on the task: pass one")
        return self.inner.descriptor()
