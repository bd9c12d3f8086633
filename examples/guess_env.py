"""An environment of your own: `python train.py --environment examples.guess_env:GuessEnv ...`.

Guess a secret number in [1, hi]: each turn the agent answers with one number and hears "higher", "lower" or
"correct". An environment is any class with `reset(task) -> observation` and `step(action) -> (observation,
reward, done, info)`; subclassing `envs.base.Env` adds the optional parts the trainer can use: `make_tasks` (the
tasks of each split, so no dataset is needed), `state_key` (GiGPO's anchor states), and an expert
(`expert_action`, `noisy_action`) for demonstrations. `environment_kwargs` (`{"hi": 50}`) reach `__init__`.
"""

from __future__ import annotations

import random

from envs.base import Env


class GuessEnv(Env):
    name = "guess"
    max_turns = 8

    def __init__(self, hi: int = 20, difficulty: int = 0):
        super().__init__(difficulty)
        if hi < 2:
            raise ValueError(f"hi must be >= 2, got {hi}")
        self.hi = hi

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        """`n` tasks of `split`: a task is the seed its secret is drawn from (in [1, hi] at reset), even seeds for
        training and odd ones for evaluation, so the two splits never share a game."""
        start = 2 * seed * n + (split != "train")
        return [{"task_id": f"{split}-{i}", "seed": start + 2 * i} for i in range(n)]

    def reset(self, task: dict) -> str:
        self.secret = random.Random(int(task["seed"])).randint(1, self.hi)
        self.lo, self.top, self.turns = 1, self.hi, 0
        return f"I am thinking of a number from 1 to {self.hi}. Answer with one number."

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        self.turns += 1
        words = action.strip().split()
        if not words or not words[0].lstrip("-").isdigit():
            return "Answer with one number.", 0.0, False, {"success": False}
        guess = int(words[0])
        if guess == self.secret:
            return "correct", 1.0, True, {"success": True}
        if guess < self.secret:
            self.lo = max(self.lo, guess + 1)
            return "higher", 0.0, False, {"success": False}
        self.top = min(self.top, guess - 1)
        return "lower", 0.0, False, {"success": False}

    def state_key(self) -> str:
        return f"{self.lo}-{self.top}"

    def expert_action(self) -> str:
        return str((self.lo + self.top) // 2)  # bisection

    def noisy_action(self, rng: random.Random) -> str:
        return str(rng.randint(self.lo, self.top))
