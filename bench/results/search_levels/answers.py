"""What the answers of an evaluate run's transcripts.jsonl get wrong (search levels 1 and 2, "answer with the first and
the last town, as <first> to <last>"): of the episodes that answer, how many name the first town right (the birthplace
the person's search showed, turns earlier) and how many name a town the episode saw as the end of a road.
python bench/results/search_levels/answers.py <evaluate --out folder>/transcripts.jsonl"""

import json
import re
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
for mode in ("sampled", "greedy"):
    answered = first_right = last_an_end = both = 0
    for r in (r for r in rows if r["mode"] == mode):
        person = re.search(r"where (.+) was born", r["first_observation"]).group(1)
        seen = " ".join(str(t.get("observation", "")) for t in r["transcript"])
        born = re.search(re.escape(person) + r" was born in (\w+)", seen)
        answers = [t["action"] for t in r["transcript"] if t["action"].startswith("answer[")]
        if not answers:
            continue
        answered += 1
        parts = re.fullmatch(r"answer\[(\w+) to (\w+)\]", answers[-1].strip())
        first = bool(parts and born and parts.group(1) == born.group(1))
        last = bool(parts and re.search(rf"\b{parts.group(2)}: the road from \w+ ends here", seen))
        first_right, last_an_end, both = first_right + first, last_an_end + last, both + (first and last)
    print(
        f"{mode}: {answered} episodes answer; the first town right {first_right}; the last town one seen as a road's"
        f" end {last_an_end}; both {both}"
    )
