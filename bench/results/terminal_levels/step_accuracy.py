"""Per step kind, how often the agent's command was the one the `next:` line named (its expert command), from an
evaluation's transcripts.jsonl: turns whose next line moved on / turns at that step (a step done wrong and named again
counts once per try; `submit` is not counted).

    .venv/bin/python bench/results/terminal_levels/step_accuracy.py /tmp/terminal_levels_eval/level1/transcripts.jsonl
"""

import collections
import json
import sys

KINDS = ("read", "create the directory", "write the code", "write", "append", "copy", "rename", "move", "delete")
right, seen = collections.Counter(), collections.Counter()
for line in open(sys.argv[1]):
    row = json.loads(line)
    hint = row["first_observation"].rsplit("next: ", 1)[1].split("\n")[0]
    for turn in row["transcript"]:
        kind = next((k for k in KINDS if hint.startswith(k)), "other")
        key = (row["mode"], kind)
        seen[key] += 1
        ok = "next: " + hint not in turn["observation"]  # the step was done: the next line moved on
        right[key] += ok
        if "next: " not in turn["observation"]:
            break
        hint = turn["observation"].rsplit("next: ", 1)[1].split("\n")[0]
for mode in ("sampled", "greedy"):
    print(mode + ": " + ", ".join(f"{k} {right[mode, k]}/{seen[mode, k]}" for k in (*KINDS, "other") if seen[mode, k]))
