"""The noisy expert the tiny default's demonstrations play, by per-turn noise (`tiny_noise`): its success and turns on
400 training tasks per level of shop and search. Level 2 at noise 0.1 makes about as many mistakes per episode as
level 0 at the default 0.3 (about 1.9 and 1.5).

usage: PYTHONPATH=. python bench/results/level_mix/noise.py
"""

import random

from envs.base import noisy_expert_episode
from envs.search import SearchEnv
from envs.shop import ShopEnv

print("env     level  noise  success  turns  noisy turns")
for cls in (ShopEnv, SearchEnv):
    for level in (0, 1, 2):
        tasks = cls.make_tasks("train", 400, seed=0, difficulty=level)
        for noise in (0.3, 0.2, 0.15, 0.1):
            env, rng = cls(level), random.Random(1)
            success = turns = 0
            for task in tasks:
                _, transcript, done = noisy_expert_episode(env, task, noise, rng)
                success += done and transcript[-1]["reward"] >= 1
                turns += len(transcript)
            n = len(tasks)
            row = f"{cls.name:<7} {level:>5}  {noise:>5}  {success / n:>7.3f}  {turns / n:>5.1f}"
            print(f"{row}  {noise * turns / n:>11.1f}")
