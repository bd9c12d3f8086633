"""Learning curves and the methods table: run configs over seeds, then write one table of every config, its curves
and result.json.

    python bench/learning.py --configs configs/quickstart.yaml --seeds 0 1 2 --out bench/results/quickstart
    python bench/learning.py --configs configs/t1_terminal.yaml configs/t1_terminal.yaml@reward=binary \
        configs/t1_terminal.yaml@critic_warmup_steps=0 --seeds 0 1 2 --metrics critic/explained_variance \
        --out bench/results/t1_terminal
    python bench/learning.py --configs configs/quickstart.yaml configs/t1_shop.yaml configs/grpo_terminal.yaml \
        configs/t1_terminal.yaml --out bench/results/methods --reuse bench/results/quickstart

A config may carry its own overrides after `@` (FIELD=VALUE, comma-separated): it is then a variant, named and
tabulated as written (`t1_terminal@reward=binary`).

Each (config, seed) runs `train.py` in its own process (so runs never share state) with `--seed S --output_dir
OUT/<config>-s<S>` plus the `--set` overrides, and reads the run's summary.json. A finished run is not run again,
so an interrupted benchmark resumes. With `--reuse DIR ...`, a (config, seed) missing in OUT is read from the first DIR
that holds `<config>-s<S>/summary.json` instead (read in place, not copied; the table marks the row reused and names
the folder). A reused run must record the config's trainer, environment and difficulty; `--set` is not checked.
With `--stored_only` nothing is trained: a config's missing seeds are left out of its row (the table's seeds column
counts the rest), and a config with no stored run at all stops the command.

The table has one row per config, grouped by the environment and difficulty its runs' summary.json records; within an
environment GRPO comes first, then GiGPO, PPO, T1, MPO, DRACO, then any other trainer, each in the order given. A
row's method is its trainer, except that PPO with a separate critic (`critic_model_name_or_path` set, t1.md D2) is
T1. Columns:
- loss aggregation: the config's `loss_type`, TRL's default `dapo` (one token mean) when unset; every trainer reads
  it (conventions.md C22);
- the mean and spread (min to max) over seeds of: held-out success sampled at the config's temperature before and
  after RL, its gain, greedy success after RL, training success at a fixed number of rollouts, the rollouts needed to
  first reach `--threshold` training success, wall time, and any logged `--metrics` (e.g. critic/explained_variance)
  averaged over the last quarter of each run's logs, and with `--metrics_upto N` also over the logs up to N
  rollouts (how a method behaved early, while the policy still changes fast);
- collapse: every seed whose held-out sampled success after RL is below its own before RL;
- step time vs GRPO: training seconds per rollout, i.e. `train_runtime` (the time of `trainer.train()`: generation,
  rewards, advantages, losses, optimizer steps; not the model build or the held-out evaluations before and after RL,
  which `wall_seconds` includes) over the rollouts trained on (last step x `rollouts_per_step`), mean over seeds,
  divided by that of the first GRPO row of the same environment; n/a without one. Runs that shared the machine with
  other runs time that sharing too.

Writes OUT/table.md, OUT/result.json and OUT/result.md (bench/record.py; every per-seed number), OUT/curves.png (one
panel per environment) and OUT/curves_<environment>_d<difficulty>.png (training success against rollouts: mean over
seeds, min-max band, one line per config).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's packages
from bench.record import write_result  # noqa: E402

METHODS = ("grpo", "gigpo", "ppo", "t1", "mpo", "draco")  # row order within an environment; other trainers follow
TRL_LOSS_TYPE = "dapo"  # GRPOConfig.loss_type's default in TRL 1.16
LOSS_TYPES = {"grpo": "episode mean", "dapo": "token mean", "bnpo": "token mean", "dr_grpo": "sum / max length"}


@dataclass
class Run:
    seed: int
    summary: dict  # the run's summary.json
    reused_from: Path | None = None  # the --reuse folder it was read from; None: a run of OUT


@dataclass
class Row:
    name: str  # the config as written: 'x' or 'x@a=1'
    method: str
    environment: str
    difficulty: int
    aggregation: str
    runs: list[Run]


def variant(spec: str) -> tuple[str, str, list[str]]:
    """'configs/x.yaml@a=1,b=2' -> (name 'x@a=1,b=2', path 'configs/x.yaml', overrides ['a=1', 'b=2'])."""
    path, _, extra = spec.partition("@")
    overrides = [item for item in extra.split(",") if item]
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise SystemExit(f"--configs {spec!r}: overrides after '@' must be FIELD=VALUE, got {bad}")
    return Path(path).stem + (f"@{extra}" if extra else ""), path, overrides


def settings(config: str, overrides: list[str]) -> dict:
    """The config's YAML fields with the overrides applied in order, as train.py sees them (override values: str)."""
    fields = yaml.safe_load((ROOT / config).read_text()) or {}
    return fields | dict(item.partition("=")[::2] for item in overrides)


def method(trainer: str, fields: dict) -> str:
    """The row's method: its trainer, except that PPO with a separate critic is T1 (t1.md D2)."""
    return "t1" if trainer == "ppo" and fields.get("critic_model_name_or_path") is not None else trainer


def aggregation(trainer: str, fields: dict) -> str:
    """How the trainer aggregates the policy loss over tokens and episodes (conventions.md C22)."""
    loss_type = str(fields.get("loss_type", TRL_LOSS_TYPE))
    return f"{loss_type} ({LOSS_TYPES[loss_type]})" if loss_type in LOSS_TYPES else loss_type


def load(
    spec: str, seed: int, out: Path, overrides: list[str], reuse: list[Path] | None = None, train: bool = True
) -> Run | None:
    """The (config, seed) run's summary: from OUT, else from the first --reuse folder holding it, else run now (None
    with `train=False`)."""
    name, config, own = variant(spec)
    folder = out / f"{name}-s{seed}"
    summary = folder / "summary.json"
    if not summary.exists():
        stored = next((d / folder.name for d in reuse or [] if (d / folder.name / "summary.json").exists()), None)
        if stored is not None:
            return reused(stored, seed, settings(config, overrides + own))
        if not train:
            return None
        cmd = [sys.executable, str(ROOT / "train.py"), "--config", config, "--seed", str(seed)]
        cmd += ["--output_dir", str(folder)]
        for item in overrides + own:
            key, _, value = item.partition("=")
            cmd += [f"--{key}", value]
        print("$", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return Run(seed, json.loads(summary.read_text()))


def reused(folder: Path, seed: int, fields: dict) -> Run:
    """A run read from another results folder; it must record the config's trainer, environment and difficulty."""
    summary = json.loads((folder / "summary.json").read_text())
    recorded = {"trainer": summary["trainer"], **summary["run"]}
    keys = [k for k in ("trainer", "environment", "difficulty") if k in fields]
    wrong = {k: recorded[k] for k in keys if str(fields[k]) != str(recorded[k])}
    if wrong:
        raise SystemExit(f"--reuse {folder}: the run has {wrong}, its config says { {k: fields[k] for k in wrong} }")
    return Run(seed, summary, folder.parent)


def make_row(
    spec: str, seeds: list[int], out: Path, overrides: list[str], reuse: list[Path] | None = None, train: bool = True
) -> Row:
    """A config's row: its runs, and the environment, difficulty and trainer its first run's summary.json records;
    with `train=False` only the stored seeds."""
    name, config, own = variant(spec)
    runs = [run for seed in seeds if (run := load(spec, seed, out, overrides, reuse, train)) is not None]
    if not runs:
        raise SystemExit(f"--stored_only: no stored run of {name} (seeds {seeds}) in {out} or the --reuse folders")
    fields = settings(config, overrides + own)
    trainer, run = runs[0].summary["trainer"], runs[0].summary["run"]
    # a single-turn dataset run has no environment: its row is labelled by the dataset file
    where = run["environment"] or f"dataset {Path(run['dataset_name']).name}"
    kind = method(trainer, fields), where, run["difficulty"], aggregation(trainer, fields)
    return Row(name, *kind, runs)


def grouped(rows: list[Row]) -> dict[tuple[str, int], list[Row]]:
    """Rows by (environment, difficulty), in order of first appearance; within one, in METHODS' order, GRPO first."""
    groups: dict[tuple[str, int], list[Row]] = {}
    for row in rows:
        groups.setdefault((row.environment, row.difficulty), []).append(row)
    rank = {m: i for i, m in enumerate(METHODS)}
    return {key: sorted(group, key=lambda r: rank.get(r.method, len(METHODS))) for key, group in groups.items()}


def curve(summary: dict) -> list[tuple[float, float]]:
    """(rollouts so far, training success) at every logged step (`rollouts_spent` where a run logs it: every rollout
    it played, training or not); for a single-turn dataset run (no `env/success`),
    the mean training reward (for a 0/1 reward such as exact match, the accuracy)."""
    key = "env/success" if any("env/success" in row for row in summary["log_history"]) else "reward"
    return [(rollouts_of(row, summary), row[key]) for row in summary["log_history"] if key in row]


def rollouts_of(row: dict, summary: dict) -> float:
    """Rollouts played by a log row: a run that also spends rollouts outside training (the Funnel's gates and
    selection) logs the running total, any other run its step x rollouts per step."""
    return row.get("rollouts_spent", row["step"] * summary["rollouts_per_step"])


def finite_mean(values: list[float | None]) -> float | None:
    """The mean of the values that are numbers (a stored summary.json holds a logged NaN as null); None if none are."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.mean(values) if values else None


def held_out(summary: dict, when: str, mode: str = "sampled") -> float | None:
    """Held-out success `when` ('before' or 'after' RL), decoded `mode`; None if the run skipped that evaluation."""
    return summary[when][mode]["success"] if when in summary else None


def seconds_per_rollout(summary: dict) -> float | None:
    """`train_runtime` over the rollouts trained on (last step x rollouts_per_step); None if not recorded."""
    end = next((row for row in summary["log_history"] if "train_runtime" in row), None)
    return end["train_runtime"] / (end["step"] * summary["rollouts_per_step"]) if end and end["step"] else None


def mean_seconds(row: Row) -> float | None:
    values = [v for v in (seconds_per_rollout(r.summary) for r in row.runs) if v is not None]
    return statistics.mean(values) if values else None


def reference(group: list[Row]) -> tuple[Row | None, float | None]:
    """An environment's first GRPO row and its mean seconds per rollout, the step-time reference (None: no GRPO)."""
    grpo = next((row for row in group if row.method == "grpo"), None)
    return grpo, mean_seconds(grpo) if grpo else None


def collapses(row: Row) -> list[tuple[int, float, float]]:
    """(seed, before, after) for every seed whose held-out sampled success after RL is below its own before RL."""
    pairs = [(r.seed, held_out(r.summary, "before"), held_out(r.summary, "after")) for r in row.runs]
    return [(seed, b, a) for seed, b, a in pairs if b is not None and a is not None and a < b]


def spread(values: list[float | None], digits: int = 3) -> str:
    values = [v for v in values if v is not None and not math.isnan(v)]
    if not values:
        return "n/a"
    return f"{statistics.mean(values):.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def rollouts_to(points: list[tuple[float, float]], threshold: float) -> float | None:
    return next((r for r, s in points if s >= threshold), None)


def success_at(points: list[tuple[float, float]], rollouts: float) -> float | None:
    before = [s for r, s in points if r <= rollouts]
    return before[-1] if before else None


def late_mean(summary: dict, metric: str) -> float | None:
    """Mean of a logged metric over the last quarter of the run's logged steps (NaN entries skipped; a stored
    summary.json holds them as null)."""
    values = [row[metric] for row in summary["log_history"] if metric in row and "loss" in row]
    return finite_mean(values[len(values) - max(1, len(values) // 4) :])


def early_mean(summary: dict, metric: str, rollouts: float) -> float | None:
    """Mean of a logged metric over the run's logged steps up to `rollouts` rollouts (`rollouts_of`; NaN entries
    skipped)."""
    rows = summary["log_history"]
    return finite_mean(
        [r[metric] for r in rows if metric in r and "loss" in r and rollouts_of(r, summary) <= rollouts]
    )


def label(row: Row) -> str:
    """The config as written, marked when some or all of its seeds were read from a --reuse folder."""
    reused = [f"s{r.seed}" for r in row.runs if r.reused_from is not None]
    if not reused:
        return row.name
    return f"{row.name} (reused)" if len(reused) == len(row.runs) else f"{row.name} (reused: {', '.join(reused)})"


def cells(
    row: Row, base: float | None, threshold: float, at_rollouts: float, metrics: list[str], upto: float | None = None
) -> list[str]:
    """One table row; `base` is the environment's GRPO seconds per rollout (None: no GRPO row); `upto`: the
    `metrics` again, averaged over the logs up to that many rollouts."""
    summaries = [r.summary for r in row.runs]
    before, after = [held_out(s, "before") for s in summaries], [held_out(s, "after") for s in summaries]
    gains = [a - b for a, b in zip(after, before, strict=True) if a is not None and b is not None]
    reach = [x for x in (rollouts_to(curve(s), threshold) for s in summaries) if x is not None]
    n = len(row.runs)
    reach_text = f"{spread(reach, 0)} ({len(reach)}/{n} reached)" if reach else f"0/{n} reached"
    collapse = "; ".join(f"s{seed}: {b:.3f} → {a:.3f}" for seed, b, a in collapses(row))
    seconds = mean_seconds(row)
    ratio = "n/a" if seconds is None or base is None else f"{seconds / base:.2f}x"
    return [
        f"{row.environment} ({row.difficulty})", row.method, label(row), row.aggregation, str(n),
        spread(before), spread(after), spread(gains), collapse or ("none" if gains else "n/a"),
        spread([held_out(s, "after", "greedy") for s in summaries]),
        spread([success_at(curve(s), at_rollouts) for s in summaries]), reach_text,
        ratio if seconds is None else f"{ratio} ({1000 * seconds:.1f} ms)",
        spread([s["wall_seconds"] for s in summaries], 1),
        *(spread([late_mean(s, m) for s in summaries]) for m in metrics),
        *(spread([early_mean(s, m, upto) for s in summaries]) for m in metrics if upto is not None),
    ]  # fmt: skip


def table(
    rows: list[Row], threshold: float, at_rollouts: float, metrics: Sequence[str] = (), upto: float | None = None
) -> str:
    head = [
        "environment (difficulty)", "method", "config", "loss aggregation", "seeds", "sampled before", "sampled after",
        "gain", "collapse (after < before)", "greedy after", f"train success @ {at_rollouts:g} rollouts",
        f"rollouts to {threshold:g}", "step time vs GRPO (train ms/rollout)", "wall s",
        *(f"{m} (last quarter)" for m in metrics),
        *(f"{m} (up to {upto:g} rollouts)" for m in metrics if upto is not None),
    ]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    for (environment, difficulty), group in grouped(rows).items():
        grpo, base = reference(group)
        lines += ["| " + " | ".join(cells(row, base, threshold, at_rollouts, metrics, upto)) + " |" for row in group]
        models = ", ".join(sorted({r.summary["model"] for row in group for r in row.runs}))
        relative = f"step time relative to {grpo.name}" if base else "no GRPO row with train_runtime: step time n/a"
        notes.append(f"- {environment} (difficulty {difficulty}), {models}: {relative}.")
    reused: dict[Path, list[str]] = {}  # --reuse folder -> 'config s0, s1' read from it, in table order
    for row in (row for group in grouped(rows).values() for row in group):
        for folder in dict.fromkeys(r.reused_from for r in row.runs if r.reused_from is not None):
            seeds = ", ".join(f"s{r.seed}" for r in row.runs if r.reused_from == folder)
            reused.setdefault(folder, []).append(f"{row.name} {seeds}")
    notes += [f"- reused, read from {folder} (not run again): {'; '.join(runs)}." for folder, runs in reused.items()]
    notes.append(
        "- step time: train_runtime / rollouts trained on (held-out evaluation and model build excluded), mean over "
        "seeds. collapse: seeds whose held-out sampled success after RL is below their own before RL."
    )
    return "\n".join([*lines, "", *notes, *per_environment(rows)])


def per_environment(rows: list[Row]) -> list[str]:
    """For runs on a mixed pool (held-out `by_env` recorded): sampled success per environment before and after RL,
    mean [min, max] over seeds; nothing otherwise."""
    mixed = [row for row in rows if all("by_env" in r.summary.get("after", {}).get("sampled", {}) for r in row.runs)]
    if not mixed:
        return []
    envs = sorted({e for row in mixed for r in row.runs for e in r.summary["after"]["sampled"]["by_env"]})
    head = ["config", *(f"{e} {when}" for e in envs for when in ("before", "after"))]
    lines = [
        "",
        "Held-out sampled success per environment:",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in mixed:
        values = [spread([r.summary[when]["sampled"]["by_env"].get(e) for r in row.runs if when in r.summary])
                  for e in envs for when in ("before", "after")]  # fmt: skip
        lines.append("| " + " | ".join([label(row), *values]) + " |")
    return lines


def measured(
    rows: list[Row], threshold: float, at_rollouts: float, metrics: Sequence[str] = (), upto: float | None = None
) -> dict:
    """Every per-seed number behind the table, for result.json (the `--metrics` too, late and, with `upto`, early)."""
    out = []
    for group in grouped(rows).values():
        grpo, base = reference(group)
        for row in group:
            seconds = mean_seconds(row)
            seeds = [
                {"seed": r.seed, "reused_from": str(r.reused_from) if r.reused_from else None, "model": s["model"],
                 "sampled_before": held_out(s, "before"), "sampled_after": held_out(s, "after"),
                 "greedy_after": held_out(s, "after", "greedy"), "seconds_per_rollout": seconds_per_rollout(s),
                 "wall_seconds": s["wall_seconds"], "success_at_rollouts": success_at(curve(s), at_rollouts),
                 "rollouts_to_threshold": rollouts_to(curve(s), threshold),
                 "metrics_last_quarter": {m: late_mean(s, m) for m in metrics},
                 **({"metrics_upto": {m: early_mean(s, m, upto) for m in metrics}} if upto is not None else {})}
                for r in row.runs for s in [r.summary]
            ]  # fmt: skip
            out.append(
                {"environment": row.environment, "difficulty": row.difficulty, "method": row.method,
                 "config": row.name, "aggregation": row.aggregation, "grpo_reference": grpo.name if grpo else None,
                 "seconds_per_rollout": seconds, "step_time_vs_grpo": seconds / base if seconds and base else None,
                 "collapsed_seeds": [seed for seed, _, _ in collapses(row)], "seeds": seeds}
            )  # fmt: skip
    return {"threshold": threshold, "at_rollouts": at_rollouts, "rows": out}


LINE_STYLES = ("-", "--", ":", "-.")


def line_styles(methods: list[str], colors: dict[str, str]) -> list[tuple[str, str]]:
    """(colour, line style) for a panel's lines, one per config, given each config's method. A method keeps its colour
    (`colors`, extended with new methods in place) and its configs differ by line style; when one method has more
    configs than there are line styles (an ablation), every config gets a colour of its own instead."""
    if max(Counter(methods).values(), default=0) > len(LINE_STYLES):
        return [(f"C{i % 10}", LINE_STYLES[i // 10 % len(LINE_STYLES)]) for i in range(len(methods))]
    seen: Counter[str] = Counter()
    out = []
    for method in methods:
        out.append((colors.setdefault(method, f"C{len(colors)}"), LINE_STYLES[seen[method] % len(LINE_STYLES)]))
        seen[method] += 1
    return out


def plot(groups: dict[tuple[str, int], list[Row]], path: Path) -> None:
    """One panel per environment: mean training success over seeds with a min-max band, one line per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(groups), figsize=(6.5 * len(groups), 4), squeeze=False)
    colors = {m: f"C{i}" for i, m in enumerate(METHODS)}  # one colour per method in every panel
    for ax, ((environment, difficulty), rows) in zip(axes[0], groups.items(), strict=True):
        for row, (color, style) in zip(rows, line_styles([row.method for row in rows], colors), strict=True):
            curves = [curve(r.summary) for r in row.runs]
            n = min(len(c) for c in curves)
            if n == 0:
                continue
            xs = [p[0] for p in curves[0][:n]]
            ys = [[c[i][1] for c in curves] for i in range(n)]
            label = f"{row.method}: {row.name} (mean of {len(row.runs)})"
            ax.plot(xs, [statistics.mean(y) for y in ys], color=color, linestyle=style, label=label)
            ax.fill_between(xs, [min(y) for y in ys], [max(y) for y in ys], color=color, alpha=0.12)
        ax.set_title(f"{environment} (difficulty {difficulty})", fontsize=10)
        ax.set_xlabel("rollouts")
        ax.set_ylabel("training success (sampled)")
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
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
    parser.add_argument(
        "--metrics_upto",
        type=float,
        default=None,
        metavar="ROLLOUTS",
        help="also tabulate each --metrics averaged over the logs up to this many rollouts (early training)",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--reuse", nargs="*", type=Path, default=[], metavar="DIR", help="results folders to read missing runs from"
    )
    parser.add_argument(
        "--stored_only", action="store_true", help="train nothing: tabulate the stored seeds of each config"
    )
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [make_row(c, args.seeds, args.out, args.set, args.reuse, not args.stored_only) for c in args.configs]
    at = args.at_rollouts or min(curve(r.summary)[-1][0] for row in rows for r in row.runs if curve(r.summary))
    text = table(rows, args.threshold, at, args.metrics, args.metrics_upto)
    (args.out / "table.md").write_text(text + "\n")
    groups = grouped(rows)
    plot(groups, args.out / "curves.png")
    for (environment, difficulty), group in groups.items():
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", environment)  # `textarena:GuessTheNumber-v0`: no colon in a file name
        plot({(environment, difficulty): group}, args.out / f"curves_{name}_d{difficulty}.png")
    options = json.loads(json.dumps(vars(args), default=str))  # paths as text
    write_result(
        args.out, "learning", options, measured(rows, args.threshold, at, args.metrics, args.metrics_upto), text
    )
    print(text)
    print(f"\nwrote table.md, result.json, result.md and curves*.png in {args.out}")


if __name__ == "__main__":
    main()
