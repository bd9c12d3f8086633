"""How many of an evaluation's shopping-list episodes (shop levels 1 and 2) fail on the coupon alone: every item of the
list bought right (each entry's fraction 1) and a wrong coupon at checkout, read off the reward: with the coupon wrong
it is items / (items + 1) only when every entry scores 1. The coupon word is shown once, in the instruction, and
needed at the last turn.
With a model folder as second argument, also how its tokenizer splits the first episode's coupon in the instruction
and in the checkout action.
python bench/results/shop_levels/coupon.py <evaluate --out folder>/transcripts.jsonl [model folder]"""

import json
import re
import sys

rows = [json.loads(line) for line in open(sys.argv[1])]
for mode in ("sampled", "greedy"):
    rs = [r for r in rows if r["mode"] == mode]
    items_right = coupon_right = 0
    for r in rs:
        instruction = r["first_observation"].split("\n")[0]
        n = len(instruction.split("; then "))
        coupon = re.search(r"coupon \[(\w+)\]", instruction).group(1)
        checkouts = [t["action"] for t in r["transcript"] if t["action"].startswith("checkout[")]
        right = bool(checkouts) and checkouts[-1].strip() == f"checkout[{coupon}]"
        coupon_right += right
        # with a wrong coupon, the reward n / (n + 1) needs every entry's fraction at 1
        items_right += r["success"] or (not right and abs(r["reward"] - n / (n + 1)) < 1e-6)
    print(
        f"{mode}: {len(rs)} episodes; every item right {items_right}, of them with the right coupon (success)"
        f" {sum(r['success'] for r in rs)}; right coupon at checkout in all {coupon_right}"
    )
if len(sys.argv) > 2:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
    coupon = re.search(r"coupon \[(\w+)\]", rows[0]["first_observation"]).group(1)
    for text in (f"pay with coupon [{coupon}]", f"checkout[{coupon}]"):
        print(f"{text!r} -> {tokenizer.tokenize(text)}")
