"""Run reports: the learning-curve PNG and summary.json written into every run folder."""

from __future__ import annotations

import json
import math
from pathlib import Path

#: (log key, panel title) of the curves `plot_curves` draws when they were logged
CURVES = [
    ("env/success", "training success (sampled)"),
    ("reward", "mean reward"),
    ("entropy", "token entropy"),
    ("loss", "loss"),
]


def plot_curves(log_history: list[dict], path: str | Path, title: str = "") -> Path | None:
    """One panel per logged curve of `CURVES`, against the optimizer step; returns the PNG path (None if nothing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, name) for key, name in CURVES if any(key in row for row in log_history)]
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2), squeeze=False)
    for ax, (key, name) in zip(axes[0], panels, strict=True):
        points = [(row["step"], row[key]) for row in log_history if key in row and not math.isnan(row[key])]
        ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("optimizer step")
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
