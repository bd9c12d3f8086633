"""Where MPO's level-2 policies go wrong: from evaluation transcripts (one per run), the first command of each held-out
episode and whether it was the one the task names first (`read <file>`, i.e. `cat <file>`), the turns spent before
that first step was done, and, for failed episodes, the step the `next:` line named when the episode ended.

    .venv/bin/python bench/results/terminal_level2/mpo_first_turn/first_turn.py LABEL=transcripts.jsonl[.gz] ...
"""

import collections
import gzip
import json
import sys

for arg in sys.argv[1:]:
    label, path = arg.split("=", 1)
    rows = [json.loads(line) for line in (gzip.open(path, "rt") if path.endswith(".gz") else open(path))]
    for mode in ("sampled", "greedy"):
        runs = [r for r in rows if r["mode"] == mode]
        first = collections.Counter(r["transcript"][0]["action"].split(" ")[0] for r in runs)
        to_first_step, stuck = [], collections.Counter()
        for r in runs:
            hint = r["first_observation"].rsplit("next: ", 1)[1].split("\n")[0]
            moved = [i + 1 for i, t in enumerate(r["transcript"]) if "next: " + hint not in t["observation"]]
            to_first_step.append(moved[0] if moved else len(r["transcript"]))
            if not r["success"]:
                last = r["transcript"][-1]["observation"]
                named = last.rsplit("next: ", 1)[1].split("\n")[0] if "next: " in last else "(none)"
                stuck[named.split(" ")[0]] += 1
        n = len(runs)
        print(
            f"{label} {mode}: {n} episodes, success {sum(r['success'] for r in runs) / n:.3f}; first command "
            f"{dict(first.most_common())}; 'cat' first {first['cat'] / n:.2f}; turns until the first step is done "
            f"{sum(to_first_step) / n:.2f}; failed episodes ended at step {dict(stuck.most_common())}"
        )
