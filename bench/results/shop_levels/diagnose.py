"""Where the tiny default's level-1 episodes go wrong, from an evaluation's transcripts.jsonl (argument)."""

import json
import re
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
for mode in ("sampled", "greedy"):
    R = [r for r in rows if r["mode"] == mode]
    query = click = checkouts = coupons = 0
    for r in R:
        instruction = r["first_observation"].split("\n")[0].removeprefix("Instruction: i need a ")
        first = instruction.split(";")[0].replace(",", "")
        coupon = re.search(r"coupon \[(\w+)\]", instruction).group(1)
        tr = r["transcript"]
        query += tr[0]["action"] == f"search[{first}]"
        ids = re.findall(r"\[(\w+)\]", tr[0]["observation"])
        click += bool(len(tr) > 1 and ids and tr[1]["action"] == f"click[{ids[0]}]")
        done = [t["action"] for t in tr if t["action"].startswith("checkout")]
        checkouts += bool(done)
        coupons += bool(done and done[-1] == f"checkout[{coupon}]")
    print(
        f"{mode}: {len(R)} episodes; first query exact {query}; first click on the first result {click}; "
        f"checked out {checkouts}; with the right coupon {coupons}"
    )
