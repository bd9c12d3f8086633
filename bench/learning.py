"""Learning curves: run configs over seeds, then write a markdown table and a PNG of the curves.

    python bench/learning.py --configs configs/quickstart.yaml --seeds 0 1 2 --out bench/results/quickstart
    python bench/learning.py --configs configs/t1_terminal.yaml configs/t1_terminal.yaml@reward=binary \
        configs/t1_terminal.yaml@critic_warmup_steps=0 --seeds 0 1 2 --metrics critic/explained_variance \
        --out bench/results/t1_terminal

A config may carry its own overrides after `@` (FIELD=VALUE, comma-separated): it is then a variant, named and
tabulated as written (`t1_terminal@reward=binary`).

Each (config, seed) runs `train.py` in its own process (so runs never share state) with `--seed S --output_dir
OUT/<config>-s<S>` plus the `--set` overrides, and reads the run's summary.json. A finished run is not run again,
so an interrupted benchmark resumes. The table reports, per config, the mean and spread (min to max) over seeds of:
held-out success sampled at the config's temperature before and after RL, its gain, greedy success after RL, training
success at a fixed number of rollouts, the rollouts needed to first reach `--threshold` training success, and wall
time, plus any logged `--metrics` (e.g. critic/explained_variance), averaged over the last quarter of each run's logs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def variant(spec: str) -> tuple[str, str, list[str]]:
    """'configs/x.yaml@a=1,b=2' -> (name 'x@a=1,b=2', path 'configs/x.yaml', overrides ['a=1', 'b=2'])."""
    path, _, extra = spec.partition("@")
    overrides = [item for item in extra.split(",") if item]
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise SystemExit(f"--configs {spec!r}: overrides after '@' must be FIELD=VALUE, got {bad}")
    return Path(path).stem + (f"@{extra}" if extra else ""), path, overrides


def run(spec: str, seed: int, out: Path, overrides: list[str]) -> dict:
    name, config, own = variant(spec)
    overrides = overrides + own
    folder = out / f"{name}-s{seed}"
    summary = folder / "summary.json"
    if not summary.exists():
        cmd = [
            sys.executable,
            str(ROOT / "train.py"),
            "--config",
            config,
            "--seed",
            str(seed),
            "--output_dir",
            str(folder),
        ]
        for item in overrides:
            key, _, value = item.partition("=")
            cmd += [f"--{key}", value]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return json.loads(summary.read_text())


def curve(summary: dict) -> list[tuple[float, float]]:
    """(rollouts so far, training success) at every logged step."""
    per_step = summary["rollouts_per_step"]
    return [(row["step"] * per_step, row["env/success"]) for row in summary["log_history"] if "env/success" in row]


def spread(values: list[float]) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    return f"{statistics.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def rollouts_to(points: list[tuple[float, float]], threshold: float) -> float | None:
    return next((r for r, s in points if s >= threshold), None)


def success_at(points: list[tuple[float, float]], rollouts: float) -> float | None:
    before = [s for r, s in points if r <= rollouts]
    return before[-1] if before else None


def late_mean(summary: dict, metric: str) -> float | None:
    """Mean of a logged metric over the last quarter of the run's logged steps (NaN entries skipped)."""
    values = [row[metric] for row in summary["log_history"] if metric in row and "loss" in row]
    values = values[len(values) - max(1, len(values) // 4) :]
    values = [v for v in values if not math.isnan(v)]
    return statistics.mean(values) if values else None


def table(results: dict[str, list[dict]], threshold: float, at_rollouts: float, metrics: list[str] = ()) -> str:
    lines = [
        "| config | seeds | sampled before | sampled after | gain | greedy after | "
        f"train success @ {at_rollouts:g} rollouts | rollouts to {threshold:g} | wall s |"
        + "".join(f" {m} (last quarter) |" for m in metrics),
        "|---|---|---|---|---|---|---|---|---|" + "---|" * len(metrics),
    ]
    for name, runs in results.items():
        before = [r["before"]["sampled"]["success"] for r in runs if "before" in r]
        after = [r["after"]["sampled"]["success"] for r in runs if "after" in r]
        greedy = [r["after"]["greedy"]["success"] for r in runs if "after" in r]
        gains = [a - b for a, b in zip(after, before, strict=False)]
        reach = [rollouts_to(curve(r), threshold) for r in runs]
        reached = [x for x in reach if x is not None]
        reach_text = f"{spread(reached)} ({len(reached)}/{len(runs)} reached)" if reached else f"0/{len(runs)} reached"
        lines.append(
            f"| {name} | {len(runs)} | {spread(before)} | {spread(after)} | {spread(gains)} | {spread(greedy)} | "
            f"{spread([success_at(curve(r), at_rollouts) for r in runs])} | {reach_text} | "
            f"{spread([r['wall_seconds'] for r in runs])} |"
            + "".join(f" {spread([late_mean(r, m) for r in runs])} |" for m in metrics)
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, runs in results.items():
        curves = [curve(r) for r in runs]
        n = min(len(c) for c in curves)
        if n == 0:
            continue
        xs = [p[0] for p in curves[0][:n]]
        ys = [[c[i][1] for c in curves] for i in range(n)]
        mean = [statistics.mean(y) for y in ys]
        (line,) = ax.plot(xs, mean, label=f"{name} (mean of {len(runs)})")
        ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=line.get_color(), alpha=0.15)
    ax.set_xlabel("rollouts")
    ax.set_ylabel("training success (sampled)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", required=True)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE", help="overrides for every run")
    parser.add_argument("--threshold", type=float, default=0.5, help="training success for rollouts-to-threshold")
    parser.add_argument("--at_rollouts", type=float, default=None, help="budget for 'success at N rollouts'")
    parser.add_argument("--metrics", nargs="*", default=[], help="logged metrics to tabulate (last-quarter mean)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = {variant(c)[0]: [run(c, s, args.out, args.set) for s in args.seeds] for c in args.configs}
    at = args.at_rollouts or min(curve(r)[-1][0] for runs in results.values() for r in runs if curve(r))
    text = table(results, args.threshold, at, args.metrics)
    (args.out / "table.md").write_text(text + "\n")
    plot(results, args.out / "curves.png")
    print(text)
    print(f"\nwrote {args.out / 'table.md'} and {args.out / 'curves.png'}")


if __name__ == "__main__":
    main()
