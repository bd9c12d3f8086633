"""What the agent did, batch by batch: a summary of the episodes a run saved with `save_episodes: true`.

    python train.py --config configs/quickstart.yaml --save_episodes true --output_dir runs/quickstart
    python bench/episodes.py runs/quickstart/episodes.jsonl --every 5 --long 12 --out runs/quickstart/episodes

For each window of `--every` steps: episodes, success rate, turns per episode, model tokens per turn, the share of
turns the environment rejected (`invalid`), and the long turns (at least `--long` model tokens) split four ways: the
environment accepted or rejected the action, and the episode succeeded or failed, and again by the sign of the
episode's group advantage (how the loss pushes the turn's tokens). A policy drifting towards long turns shows here
first, and the counts say whether the drift is paid for by success (long accepted turns in successful episodes) or
grows in failed episodes. Prints a markdown table; with `--out` also writes result.md, result.json and a
plot (episodes.png) of the four counts per window.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
from collections import defaultdict

LONG_KINDS = ("accepted, success", "accepted, failure", "rejected, success", "rejected, failure")
SIGNS = ("< 0", "= 0", "> 0")  # the sign of the episode's group advantage: how the loss pushes the long turn


def read_episodes(path: str) -> list[dict]:
    """The episodes of a run's episodes.jsonl (or a gzipped copy, .gz), one dict per line."""
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summarise(episodes: list[dict], every: int = 1, long_tokens: int = 12) -> list[dict]:
    """One row per window of `every` steps (windows start at step 1: steps 1..every, every+1..2*every, ...)."""
    if every < 1 or long_tokens < 1:
        raise ValueError(f"every and long_tokens must be >= 1, got {every} and {long_tokens}")
    windows: dict[int, list[dict]] = defaultdict(list)
    for episode in episodes:
        windows[(episode["step"] - 1) // every].append(episode)
    rows = []
    for w in sorted(windows):
        group = windows[w]
        turns = [turn for episode in group for turn in episode["turns"]]
        long, signs = dict.fromkeys(LONG_KINDS, 0), dict.fromkeys(SIGNS, 0)
        for episode in group:
            outcome = "success" if episode["success"] else "failure"
            advantage = episode.get("advantage", math.nan)
            sign = "< 0" if advantage < 0 else "> 0" if advantage > 0 else "= 0" if advantage == 0 else None
            for turn in episode["turns"]:
                if turn["tokens"] >= long_tokens:
                    long[f"{'rejected' if turn.get('invalid') else 'accepted'}, {outcome}"] += 1
                    if sign is not None:
                        signs[sign] += 1
        rows.append(
            {
                "steps": f"{w * every + 1}-{(w + 1) * every}" if every > 1 else str(w + 1),
                "episodes": len(group),
                "success": sum(e["success"] for e in group) / len(group),
                "turns": len(turns) / len(group),
                "tokens_per_turn": sum(t["tokens"] for t in turns) / max(1, len(turns)),
                "rejected_turns": sum(bool(t.get("invalid")) for t in turns) / max(1, len(turns)),
                "long_turns": long,
                "long_turns_by_advantage": signs,
            }
        )
    return rows


def table(rows: list[dict], long_tokens: int) -> str:
    head = (
        "| steps | episodes | success | turns / episode | model tokens / turn | rejected turns | "
        + " | ".join(f"turns >= {long_tokens} tokens: {k}" for k in LONG_KINDS)
        + " | their episode's advantage < 0 / = 0 / > 0 |"
    )
    lines = [head, "|" + "---|" * (7 + len(LONG_KINDS))]
    for r in rows:
        cells = [
            r["steps"],
            str(r["episodes"]),
            f"{r['success']:.3f}",
            f"{r['turns']:.2f}",
            f"{r['tokens_per_turn']:.2f}",
            f"{r['rejected_turns']:.3f}",
        ]
        signs = " / ".join(str(r["long_turns_by_advantage"][k]) for k in SIGNS)
        lines.append("| " + " | ".join(cells + [str(r["long_turns"][k]) for k in LONG_KINDS] + [signs]) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], long_tokens: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    x = list(range(len(rows)))
    for kind in LONG_KINDS:
        top.plot(x, [r["long_turns"][kind] for r in rows], marker=".", label=kind)
    top.set_ylabel(f"turns >= {long_tokens} model tokens")
    top.legend(fontsize=8)
    bottom.plot(x, [r["success"] for r in rows], marker=".", label="success")
    bottom.plot(x, [r["rejected_turns"] for r in rows], marker=".", label="rejected turns (share)")
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("share")
    bottom.legend(fontsize=8)
    bottom.set_xticks(x, [r["steps"] for r in rows], rotation=45, fontsize=7)
    bottom.set_xlabel("training steps")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a run's episodes.jsonl (written with save_episodes: true), or a .gz of it")
    parser.add_argument("--every", type=int, default=5, help="steps per row (default 5, like logging_steps)")
    parser.add_argument("--long", type=int, default=12, help="a turn with at least this many model tokens is long")
    parser.add_argument("--out", help="folder for result.md, result.json and episodes.png")
    args = parser.parse_args(argv)
    if not os.path.exists(args.path):
        parser.error(f"{args.path} does not exist; train with --save_episodes true to write it")
    episodes = read_episodes(args.path)
    if not episodes:
        parser.error(f"{args.path} has no episodes")
    rows = summarise(episodes, args.every, args.long)
    text = table(rows, args.long)
    print(text)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        command = f"python bench/episodes.py {args.path} --every {args.every} --long {args.long} --out {args.out}"
        with open(os.path.join(args.out, "result.md"), "w") as f:
            f.write(f"`{command}`\n\n{text}\n")
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"source": args.path, "every": args.every, "long": args.long, "rows": rows}, f, indent=1)
        plot(rows, args.long, os.path.join(args.out, "episodes.png"))
    return rows


if __name__ == "__main__":
    main()
