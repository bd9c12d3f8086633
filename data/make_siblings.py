"""Write data/siblings.jsonl: the local dataset of the verifiers example (examples/verifiers_siblings.py).

    python data/make_siblings.py            # 2000 questions, seed 0 (the shipped file)

Each row: `question` and `answer` (a number, as text), drawn from reasoning-gym's "Alice in Wonderland" generator at
its curriculum's first level (sibling questions: "X has 3 brothers and she also has 2 sisters. How many sisters does
X's brother have?"), distinct questions only (the level has about 2,100).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import reasoning_gym
from reasoning_gym.factory import CURRICULA


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(Path(__file__).with_name("siblings.jsonl")))
    args = parser.parse_args()
    curriculum = CURRICULA["aiw"]()
    curriculum.set_global_level(0)
    config = {k: v for k, v in dataclasses.asdict(curriculum.generate_configuration({})).items() if k != "seed"}
    config["size"] = 100 * args.n
    dataset = reasoning_gym.create_dataset("aiw", seed=args.seed, **config)
    rows, seen = [], set()
    for item in dataset:
        if item["question"] not in seen:
            seen.add(item["question"])
            rows.append({"question": item["question"], "answer": str(item["answer"])})
        if len(rows) == args.n:
            break
    with open(args.out, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    print(f"wrote {len(rows)} questions to {args.out}")


if __name__ == "__main__":
    main()
