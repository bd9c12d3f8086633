"""Where the episodes of an evaluate run's transcripts.jsonl go wrong (search levels 1 and 2): the share of turns with
a valid action, of first searches that copy the person from the question, of episodes that answer, and of episodes
cut at max_turns. python bench/results/search_levels/diagnose.py <evaluate --out folder>/transcripts.jsonl"""

import json
import re
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
for mode in ("sampled", "greedy"):
    rs = [r for r in rows if r["mode"] == mode]
    people = [re.search(r"where (.+) was born", r["first_observation"]).group(1) for r in rs]
    copied = sum(bool(r["transcript"]) and r["transcript"][0]["action"].strip() == f"search[{p}]"
                 for r, p in zip(rs, people, strict=True))  # fmt: skip
    valid = sum(not t["invalid"] for r in rs for t in r["transcript"]) / max(1, sum(len(r["transcript"]) for r in rs))
    answered = sum(any(t["action"].startswith("answer[") for t in r["transcript"]) for r in rs)
    cut, n = sum(r["truncated"] for r in rs), len(rs)
    print(
        f"{mode}: {n} episodes; valid actions {valid:.2f}; first search copies the person {copied / n:.3f};"
        f" episodes that answer {answered / n:.3f}; cut at max_turns {cut / n:.3f}"
    )
