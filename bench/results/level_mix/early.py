"""How often search's noisy demonstrations end on an answer before the road has ended: the noisy expert (noise 0.3, as
the tiny default's demonstrations) on 1000 training tasks per level, with the early answer among the noisy options
always (share 1) and with the share `SearchEnv.noisy_early_answer_share` gives now.

usage: PYTHONPATH=. python bench/results/level_mix/early.py
"""

import random

from envs.base import noisy_expert_episode
from envs.search import SearchEnv

SHIPPED = dict(SearchEnv.noisy_early_answer_share)


def play(level: int, share: float, n: int = 1000) -> tuple[float, float]:
    """(success, share of episodes ending on an early answer) of the noisy expert on `n` training tasks."""
    SearchEnv.noisy_early_answer_share = {**SHIPPED, level: share}
    env, rng = SearchEnv(level), random.Random(1)
    success = early = 0
    for task in SearchEnv.make_tasks("train", n, seed=0, difficulty=level):
        _, transcript, done = noisy_expert_episode(env, task, 0.3, rng)
        won = done and transcript[-1]["reward"] > 0
        success += won
        early += done and transcript[-1]["action"].startswith("answer[") and env._progress < len(task["hops"])
    SearchEnv.noisy_early_answer_share = SHIPPED
    return success / n, early / n


if __name__ == "__main__":
    print("level  early-answer share  noisy-expert success  episodes ending on an early answer")
    for level in (1, 2):
        for share in sorted({1.0, SHIPPED[level]}, reverse=True):
            success, early = play(level, share)
            print(f"{level:>5}  {share:>18.2f}  {success:>20.3f}  {early:>34.3f}")
