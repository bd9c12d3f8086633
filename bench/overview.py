"""Every method at level 0 and level 2 in one table, read from the learning runs stored under bench/results (nothing
is trained here).

    python bench/overview.py --out bench/results/overview

Each column is one environment and level, as measured in one section of docs/benchmarks.md (the section is named in
`COLUMNS`); each cell names the stored runs of one recipe, `<folder>/<config>-s<seed>/summary.json`, the layout
bench/learning.py writes. Within a column every recipe starts from the same build, so a cell compares with the GRPO
cell above it. Per cell, over its seeds:

- held-out sampled success after RL, the mean; **bold** when the recipe's lowest seed is above GRPO's highest (beyond
  the seed spread), marked `(below)` when its highest seed is below GRPO's lowest;
- at level 2, where every recipe ends near the ceiling, also training success at `--at_rollouts` rollouts: the mean of
  the logged values in the window of `--window` rollouts ending there (a run that logs every 160 rollouts and one that
  logs every 320 are read over the same 320), marked the same way;
- every seed whose held-out sampled success after RL is below its own before RL (a collapse);
- the seeds, where a recipe ran on fewer than its column's (`Column.fewer`).

Writes OUT/table.md, OUT/result.json and OUT/result.md (bench/record.py; every per-seed number) and OUT/overview.png
(held-out sampled success before and after RL, one panel per column).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere: the repository's packages
from bench.learning import curve, held_out  # noqa: E402
from bench.record import RESULTS, write_result  # noqa: E402

METHODS = (
    "GRPO",
    "GiGPO",
    "TASPO",
    "AlignOPSD",
    "AlignOPSD, beta 0.02",
    "PPO",
    "PPO, lam 0.95",
    "T1",
    "MPO",
    "DRACO",
    "X-Tree",
)  # row order


@dataclass
class Column:
    title: str  # 'shop 0': environment and level
    section: str  # the docs/benchmarks.md section that describes the recipes and the build
    level: int
    cells: dict[str, str]  # method -> '<folder under bench/results>/<config as written>'
    seeds: tuple[int, ...] = (0, 1, 2)
    fewer: dict[str, tuple[int, ...]] = field(default_factory=dict)  # method -> its seeds, where it ran fewer

    def seeds_of(self, method: str) -> tuple[int, ...]:
        return self.fewer.get(method, self.seeds)


L2_SHOP = "@difficulty=2,max_completion_length=896"
L2_SEARCH = "@difficulty=2,max_completion_length=960"
L2_TERMINAL = "@difficulty=2,max_completion_length=768,tiny_guidance_frac=0.5"

COLUMNS = [
    Column("shop 0", "tiny:shop on the shipped build", 0, {
        "GRPO": "quickstart_kl/quickstart",
        "GiGPO": "shop_kl/gigpo_shop@beta=0.02",
        "TASPO": "shop_kl/taspo_shop@beta=0.02",
        "AlignOPSD": "alignopsd_shop_beta0/alignopsd_shop",
        "PPO": "shop_kl/ppo_shop",
        "T1": "shop_kl_t1/t1_shop",
        "MPO": "shop_kl/mpo_shop",
        "DRACO": "shop_draco_fixed/draco_shop",
        "X-Tree": "shop_kl/xtree_shop@beta=0.02",
    }),
    Column("shop 0, guidance build", "A tiny default that reads guidance", 0, {
        "GRPO": "shop_guided/quickstart@tiny_guidance_frac=0.5",
        "TASPO": "shop_guided/taspo_shop",
        "AlignOPSD": "shop_guided/alignopsd_shop",
    }),
    Column("search 0", "Every method on every environment", 0, {
        "GRPO": "methods/grpo_search",
        "GiGPO": "methods/gigpo_search",
        "TASPO": "methods/taspo_search",
        "AlignOPSD": "methods/alignopsd_search",
        "PPO": "methods/ppo_search",
        "T1": "methods/t1_search",
        "MPO": "methods/mpo_search",
        "DRACO": "methods/draco_search",
    }),
    Column("terminal 0", "Every method on every environment", 0, {
        "GRPO": "terminal_c4/grpo_terminal",
        "GiGPO": "methods/gigpo_terminal",
        "PPO, lam 0.95": "terminal_c4/ppo_terminal",  # run when 0.95 was the recipe's setting
        "MPO": "methods/mpo_terminal",
        "DRACO": "methods/draco_terminal",
    }),
    Column("terminal 0, submit counted", "T1 with the submission counted", 0, {
        "GRPO": "t1_submitted/grpo_terminal",
        "T1": "t1_submitted/t1_terminal",
        "PPO": "ppo_lam_level0/ppo_terminal@lam=1.0",
        "PPO, lam 0.95": "ppo_lam_level0/ppo_terminal@lam=0.95",
    }),
    Column("shop 2", "Shop level 2, GRPO, GiGPO and MPO", 2, {
        "GRPO": f"shop_level2/quickstart{L2_SHOP}",
        "GiGPO": f"shop_level2/gigpo_shop{L2_SHOP}",
        "MPO": f"shop_level2/mpo_shop{L2_SHOP}",
    }),
    Column("shop 2, guidance build", "Shop level 2, the teacher methods", 2, {
        "GRPO": f"shop_level2_guided/quickstart{L2_SHOP},tiny_guidance_frac=0.5",
        "TASPO": f"shop_level2_guided/taspo_shop{L2_SHOP}",
        "AlignOPSD": f"shop_level2_guided/alignopsd_shop{L2_SHOP},alignopsd_top_k=3",
        "AlignOPSD, beta 0.02": f"shop_level2_guided/alignopsd_shop{L2_SHOP},alignopsd_top_k=3,beta=0.02",
    }, fewer={"AlignOPSD": (0, 1)}),
    Column("search 2", "Search level 2 from the shipped build", 2, {
        "GRPO": f"search_level2/grpo_search{L2_SEARCH}",
        "GiGPO": f"search_level2/gigpo_search{L2_SEARCH}",
        "TASPO": f"search_level2/taspo_search{L2_SEARCH}",
        "AlignOPSD": f"search_level2/alignopsd_search{L2_SEARCH}",
        "MPO": f"search_level2/mpo_search{L2_SEARCH}",
    }),
    Column("terminal 2", "Terminal level 2 with the shortcut closed", 2, {
        "GRPO": f"terminal_level2_closed/grpo_terminal{L2_TERMINAL}",
        "GiGPO": f"terminal_level2_closed/gigpo_terminal{L2_TERMINAL}",
        "TASPO": "terminal_level2_closed/taspo_terminal",
        "AlignOPSD": "terminal_level2_closed/alignopsd_terminal",
        "MPO": f"terminal_level2_closed/mpo_terminal{L2_TERMINAL}",
        "PPO": f"terminal_level2_closed/ppo_terminal{L2_TERMINAL},lam=1.0",
        "PPO, lam 0.95": f"terminal_level2_closed/ppo_terminal{L2_TERMINAL},lam=0.95",
        "T1": f"terminal_level2_closed/t1_terminal{L2_TERMINAL},assertion_scale=35",
        "DRACO": f"terminal_level2_closed/draco_terminal{L2_TERMINAL}",
        "X-Tree": f"terminal_level2_closed/xtree_terminal{L2_TERMINAL}",
    }),
]  # fmt: skip


@dataclass
class Cell:
    method: str
    runs: str  # '<folder>/<config>'
    before: list[float]  # held-out sampled success after SFT, per seed
    after: list[float]  # the same after RL
    at: list[float | None] = field(default_factory=list)  # training success in the window ending at --at_rollouts


def window_mean(points: list[tuple[float, float]], end: float, width: float) -> float | None:
    """The mean of the logged training success at rollouts in (end - width, end]; None if nothing was logged there."""
    inside = [s for r, s in points if end - width < r <= end]
    return statistics.mean(inside) if inside else None


def load_cell(results: Path, method: str, runs: str, seeds: tuple[int, ...], end: float, width: float) -> Cell:
    cell = Cell(method, runs, [], [])
    for seed in seeds:
        path = results / f"{runs}-s{seed}" / "summary.json"
        if not path.exists():
            raise SystemExit(f"{method}: no stored run {path.relative_to(results)} (run bench/learning.py first)")
        summary = json.loads(path.read_text())
        before, after = held_out(summary, "before"), held_out(summary, "after")
        if before is None or after is None:
            raise SystemExit(f"{path}: the run skipped its held-out evaluation before or after RL")
        cell.before.append(before)
        cell.after.append(after)
        cell.at.append(window_mean(curve(summary), end, width))
    return cell


def versus(values: list[float | None], grpo: list[float | None]) -> str:
    """'above' when the lowest value is above GRPO's highest, 'below' when the highest is below GRPO's lowest."""
    mine, theirs = [v for v in values if v is not None], [v for v in grpo if v is not None]
    if not mine or not theirs:
        return ""
    if min(mine) > max(theirs):
        return "above"
    return "below" if max(mine) < min(theirs) else ""


def mark(values: list[float | None], grpo: list[float | None] | None) -> str:
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    text = f"{statistics.mean(known):.3f}"
    side = versus(values, grpo) if grpo is not None else ""
    return f"**{text}**" if side == "above" else f"{text} (below)" if side == "below" else text


def collapses(cell: Cell, seeds: tuple[int, ...]) -> list[int]:
    return [seed for seed, b, a in zip(seeds, cell.before, cell.after, strict=True) if a < b]


def table(columns: list[Column], cells: dict[str, dict[str, Cell]], at_rollouts: float, window: float) -> str:
    head = "| method | " + " | ".join(c.title for c in columns) + " |"
    lines = [head, "|---" * (len(columns) + 1) + "|"]
    starts = [statistics.mean(cells[c.title]["GRPO"].before) for c in columns]
    lines.append("| held-out sampled after SFT (the start) | " + " | ".join(f"{s:.3f}" for s in starts) + " |")
    for method in METHODS:
        if not any(method in c.cells for c in columns):
            continue
        row = []
        for column in columns:
            cell = cells[column.title].get(method)
            if cell is None:
                row.append("")
                continue
            grpo = None if method == "GRPO" else cells[column.title]["GRPO"]
            text = mark(cell.after, grpo.after if grpo else None)
            if column.level >= 2:
                text += " / " + mark(cell.at, grpo.at if grpo else None)
            seeds = column.seeds_of(method)
            if seeds != column.seeds:
                text += f" (seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})"
            fell = collapses(cell, seeds)
            row.append(text + (f" (collapse: seed {', '.join(map(str, fell))})" if fell else ""))
        lines.append(f"| {method} | " + " | ".join(row) + " |")
    notes = [
        "",
        "Held-out sampled success after RL, mean over the column's seeds (a cell that ran fewer names them); at "
        f"level 2 also training success over the {window:.0f} rollouts up to {at_rollouts:.0f} (after / at "
        f"{at_rollouts:.0f}). Bold: the lowest seed "
        "above GRPO's highest in the same column; (below): the highest seed below GRPO's lowest.",
    ]
    total = sum(len(cell.after) for column in columns for cell in cells[column.title].values())
    fell = sum(len(collapses(cell, c.seeds_of(m))) for c in columns for m, cell in cells[c.title].items())
    notes.append(f"{total} runs; {fell or 'none'} ended below {'its' if fell == 1 else 'their'} own start.")
    for column in columns:
        folders = sorted({runs.split("/")[0] for runs in column.cells.values()})
        notes.append(
            f'- {column.title} (seeds {", ".join(map(str, column.seeds))}): docs/benchmarks.md, "{column.section}"; '
            + "runs in "
            + ", ".join(f"bench/results/{f}/" for f in folders)
        )
    return "\n".join(lines + notes)


def plot(columns: list[Column], cells: dict[str, dict[str, Cell]], path: Path) -> None:
    """One panel per column: each method's held-out sampled success before (light) and after RL, seeds as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(columns), figsize=(2.4 * len(columns), 3.6), sharey=True, squeeze=False)
    for ax, column in zip(axes[0], columns, strict=True):
        methods = [m for m in METHODS if m in column.cells]
        for i, method in enumerate(methods):
            cell = cells[column.title][method]
            ax.bar(i, statistics.mean(cell.after), color=f"C{METHODS.index(method)}", alpha=0.8)
            ax.bar(i, statistics.mean(cell.before), color="white", alpha=0.5)
            ax.scatter([i] * len(cell.after), cell.after, color="black", s=6, zorder=3)
        ax.set_xticks(range(len(methods)), methods, rotation=60, fontsize=7)
        ax.set_title(column.title, fontsize=9)
        ax.set_ylim(0, 1)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("held-out sampled success\n(light: the start; dots: seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None, columns: list[Column] | None = None, results: Path = RESULTS) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--at_rollouts", type=float, default=1920, help="level 2: training success read here")
    parser.add_argument("--window", type=float, default=320, help="rollouts averaged up to --at_rollouts")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    columns = COLUMNS if columns is None else columns
    missing = [c.title for c in columns if "GRPO" not in c.cells]
    if missing:
        raise SystemExit(f"every column needs a GRPO cell to compare with; none in {missing}")
    cells = {
        c.title: {
            m: load_cell(results, m, runs, c.seeds_of(m), args.at_rollouts, args.window) for m, runs in c.cells.items()
        }
        for c in columns
    }
    text = table(columns, cells, args.at_rollouts, args.window)
    args.out.mkdir(parents=True, exist_ok=True)
    plot(columns, cells, args.out / "overview.png")
    measured = {
        c.title: {m: {"runs": cell.runs, "seeds": list(c.seeds_of(m)), "before": cell.before, "after": cell.after,
                      "success_at_rollouts": cell.at, "collapsed_seeds": collapses(cell, c.seeds_of(m))}
                  for m, cell in cells[c.title].items()}
        for c in columns
    }  # fmt: skip
    options = json.loads(json.dumps(vars(args), default=str))
    (args.out / "table.md").write_text(text + "\n")
    write_result(args.out, "overview", options, measured, text)
    print(text)
    print(f"\nwrote table.md, result.json, result.md and overview.png in {args.out}")
    return measured


if __name__ == "__main__":
    main()
