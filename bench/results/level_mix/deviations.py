"""Where a shop level-2 evaluate run's episodes first leave the expert: each episode is replayed in the environment and
its first action that differs from `expert_action()` is counted by page and kind (the action's and the expert's).

python bench/results/level_mix/deviations.py <evaluate --out folder>/transcripts.jsonl
"""

import collections
import json
import sys

from envs.shop import ShopEnv

TASKS = {t["task_id"]: t for t in ShopEnv.make_tasks("eval", 200, seed=0, difficulty=2)}
rows = [json.loads(line) for line in open(sys.argv[1])]
for mode in ("sampled", "greedy"):
    first: collections.Counter[str] = collections.Counter()
    episodes = [r for r in rows if r["mode"] == mode]
    for row in episodes:
        env = ShopEnv(2)
        env.reset(TASKS[row["task_id"]])
        kind = "never (every action the expert's)"
        for turn in row["transcript"]:
            action, expert = turn["action"].strip(), env.expert_action()
            if action != expert:
                kind = f"on the {env.page} page: {action.split('[')[0]} where the expert does {expert.split('[')[0]}"
                break
            if env.step(action)[2]:
                break
        first[kind] += 1
    print(f"{mode}, {len(episodes)} episodes, the first action off the expert's:")
    for kind, count in first.most_common():
        print(f"  {count:4d}  {kind}")
