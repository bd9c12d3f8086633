"""Write data/arith.jsonl: number word problems for the dataset quickstart (configs/dataset_quickstart.yaml).

    python data/make_arith.py            # 2400 problems, seed 0 (the shipped file)

Each row: `prompt` (one user message), `answer` (the number, as text), `op`: "recall" (read back one of two counts,
a copy the tiny default learns), "add", "sub", "max" or "min" (a sum, a difference, the larger or the smaller of two
counts: lookups and comparisons it learns slowly). Problems are unique;
a run holds out its test rows from this one file (`num_eval_tasks`, seeded), so train and test never share a problem.
Operands are 1..max_operand (default 9: sums 2..18, differences 0..8), small enough for the tiny default to learn
some of them.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

NAMES = ["Ann", "Ben", "Cara", "Dev", "Eli", "Fay", "Gus", "Hana", "Ivo", "Jo", "Kim", "Lea"]
THINGS = ["apples", "books", "coins", "shells", "stamps", "marbles", "pens", "cards"]
ADD = [
    "{n} has {a} {t} and gets {b} more. How many {t} does {n} have now?",
    "{n} found {a} {t} on Monday and {b} {t} on Tuesday. How many {t} did {n} find?",
]
RECALL = "{n} has {a} {t} and {m} has {b} {t}. How many {t} does {n} have?"
COMPARE = {
    "max": "{n} has {a} {t} and {m} has {b} {t}. What is the larger number of {t}?",
    "min": "{n} has {a} {t} and {m} has {b} {t}. What is the smaller number of {t}?",
}
SUB = [
    "{n} has {a} {t} and gives away {b}. How many {t} does {n} have left?",
    "{n} had {a} {t} and lost {b} of them. How many {t} are left?",
]


def problems(n: int, seed: int, max_operand: int = 9) -> list[dict]:
    rng = random.Random(seed)
    rows, seen = [], set()
    while len(rows) < n:
        op = rng.choice(["recall", "add", "sub", "max", "min"])
        a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
        if op == "sub":
            a, b = max(a, b), min(a, b)
        if op in COMPARE and a == b:
            continue
        name, other = rng.sample(NAMES, 2)
        if op == "recall":
            template = RECALL
        else:
            template = COMPARE[op] if op in COMPARE else rng.choice(ADD if op == "add" else SUB)
        text = template.format(n=name, m=other, t=rng.choice(THINGS), a=a, b=b)
        if text in seen:
            continue
        seen.add(text)
        answer = {"recall": a, "add": a + b, "sub": a - b, "max": max(a, b), "min": min(a, b)}[op]
        rows.append({"prompt": [{"role": "user", "content": text}], "answer": str(answer), "op": op})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=2400)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max_operand", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).with_name("arith.jsonl")))
    args = parser.parse_args()
    rows = problems(args.n, args.seed, args.max_operand)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} problems to {args.out}")


if __name__ == "__main__":
    main()
