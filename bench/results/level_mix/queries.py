"""Of a shop level-2 evaluate run's episodes, how many first searches for each list item type the query the expert
types there (the first item's from the instruction, each later one's from the observation after the last add).

python bench/results/level_mix/queries.py <evaluate --out folder>/transcripts.jsonl
"""

import json
import sys

from envs.shop import ShopEnv

TASKS = {t["task_id"]: t for t in ShopEnv.make_tasks("eval", 200, seed=0, difficulty=2)}
rows = [json.loads(line) for line in open(sys.argv[1])]
for mode in ("sampled", "greedy"):
    right: dict[int, int] = {}
    total: dict[int, int] = {}
    for row in (r for r in rows if r["mode"] == mode):
        env = ShopEnv(2)
        env.reset(TASKS[row["task_id"]])
        searched: set[int] = set()
        for turn in row["transcript"]:
            action = turn["action"].strip()
            item = len(env.cart)
            if action.startswith("search[") and item not in searched:
                searched.add(item)
                total[item] = total.get(item, 0) + 1
                right[item] = right.get(item, 0) + (action == env.expert_action())
            if env.step(action)[2]:
                break
    counts = ", ".join(f"item {k + 1}: {right[k]} of {total[k]}" for k in sorted(total))
    print(f"{mode}: first search per item typing the expert's query: {counts}")
