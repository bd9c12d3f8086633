"""Run reports: the learning-curve PNG and summary.json written into every run folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

#: (log key, panel title) of the curves `plot_curves` draws when they were logged: success and the curves that show a
#: collapse (completion length, turns, truncation; trainers/alarm.py watches the same signals)
CURVES = [
    ("env/success", "training success (sampled)"),
    ("reward", "mean reward"),
    ("completions/mean_length", "completion length (tokens)"),
    ("env/turns", "turns per episode"),
    ("env/truncated", "truncated fraction"),
    ("entropy", "token entropy"),
]


def series(log_history: list[dict], key: str, x_scale: float = 1) -> list[tuple[float, float]]:
    """(x_scale x step, value) of every logged `key`; None (a value with nothing behind it, e.g. the mean reward of a
    batch without one) and NaN are left out."""
    rows = [row for row in log_history if row.get(key) is not None and "step" in row and not math.isnan(row[key])]
    return [(row["step"] * x_scale, row[key]) for row in rows]


def curve_panels(log_history: list[dict]) -> list[tuple[str, str]]:
    """The (log key, title) panels `plot_curves` draws, in `CURVES` order: each curve logged at least once, less the
    reward panel when it repeats the success curve (a binary reward)."""
    panels = [(key, name) for key, name in CURVES if series(log_history, key)]
    if ("reward", "mean reward") in panels and series(log_history, "reward") == series(log_history, "env/success"):
        panels.remove(("reward", "mean reward"))
    return panels


def run_title(summary: dict) -> str:
    """The title of a run's curves: its trainer, model and environment (with its difficulty) or dataset."""
    run = summary.get("run") or {}
    environment = run.get("environment")
    data = f"{environment}, difficulty {run.get('difficulty', 0)}" if environment else "dataset"
    return f"{summary.get('trainer', run.get('trainer', '?'))} on {summary.get('model', '?')} ({data})"


def run_curves(summary: dict, folder: str | Path) -> Path | None:
    """Draw `folder`/curves.png from the run's summary.json content (`plot_curves` of its log history, against
    rollouts trained on, with the held-out success, or reward for a dataset, before and after). What train.py draws
    at the end of a run, and `python -m agent_trl.curves` draws again from a stored summary."""
    measure = "success" if (summary.get("run") or {}).get("environment") else "reward"
    sampled = {k: (summary.get(k) or {}).get("sampled") or {} for k in ("before", "after")}
    held_out = {k: v[measure] for k, v in sampled.items() if v.get(measure) is not None}
    return plot_curves(
        summary.get("log_history") or [],
        Path(folder) / "curves.png",
        title=run_title(summary),
        rollouts_per_step=summary.get("rollouts_per_step"),
        held_out=held_out,
    )


def plot_curves(
    log_history: list[dict],
    path: str | Path,
    title: str = "",
    rollouts_per_step: float | None = None,
    held_out: dict[str, float] | None = None,
) -> Path | None:
    """One panel per logged curve of `CURVES` (`curve_panels`), against rollouts trained on (`rollouts_per_step` x
    step; the optimizer step when it is None); returns the PNG path (None if nothing was logged).

    The reward panel is left out when it repeats the success curve (a binary reward). `held_out` ({"before": x,
    "after": y}, held-out sampled success, or reward for a dataset) is drawn on the success panel (the reward panel
    without one) at the first and last x."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = curve_panels(log_history)
    if not panels:
        return None
    scale = rollouts_per_step or 1
    marked = "env/success" if any(key == "env/success" for key, _ in panels) else "reward"
    last_x = max(x for key, _ in panels for x, _ in series(log_history, key, scale))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.2), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels, strict=True):
        points = series(log_history, key, scale)
        marker = "o" if len(points) < 3 else None  # a short run's one or two points would draw no visible line
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2, marker=marker, ms=4, label="training")
        if key == marked and held_out:
            xs = {"before": 0, "after": last_x}
            for when, value in held_out.items():
                ax.plot([xs[when]], [value], "o", ms=6, label=f"held-out {when}: {value:.2f}")
            ax.legend(fontsize=7)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("rollouts" if rollouts_per_step else "optimizer step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(path: str | Path, summary: dict) -> Path:
    """Write `summary` as JSON atomically (a crash never leaves a half-written file)."""
    path = Path(path)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(summary, indent=2, default=str))
    tmp.replace(path)
    return path


def speed(log_history: list[dict]) -> dict:
    """Time per optimizer step (TRL's logged `step_time`: generation, scoring and the update, mean over the logged
    steps, and the whole training time over the steps trained) and the process's peak resident memory so far
    (`ru_maxrss`: the model, the optimizer, evaluation and the largest step's activations)."""
    import resource
    import sys

    step_times = [row["step_time"] for row in log_history if "step_time" in row]
    end = next((row for row in reversed(log_history) if "train_runtime" in row), {})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)  # bytes
    return {
        "seconds_per_step": round(sum(step_times) / len(step_times), 2) if step_times else None,
        "train_seconds_per_step": round(end["train_runtime"] / end["step"], 2) if end.get("step") else None,
        "peak_memory_gib": round(peak / 2**30, 2),
    }
