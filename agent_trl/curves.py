"""Draw the learning curves of stored runs again: `curves.png` beside every `summary.json` under the given folders.

    python -m agent_trl.curves bench/results              # every run the benchmarks stored
    python -m agent_trl.curves runs/quickstart            # one run

A run folder's curves are the ones train.py draws when the run ends (`trainers.reporting.run_curves`), made from the
log history its summary.json keeps; the repository stores the summaries and leaves these per-run pictures out
(tables and per-bench plots stay). A summary without a log history (an evaluation's) is skipped.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm.auto import tqdm

from trainers.reporting import run_curves


def redraw(folders: list[Path], progress: bool = True) -> list[Path]:
    """Draw curves.png for every run summary under `folders`; returns the pictures written."""
    found = {p for folder in folders for p in ([folder] if folder.is_file() else folder.rglob("summary.json"))}
    summaries = sorted(found)
    written = []
    for path in tqdm(summaries, desc="runs", disable=not progress):
        try:
            summary = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            print(f"skipped {path}: {err}")
            continue
        if isinstance(summary, dict) and summary.get("log_history"):
            picture = run_curves(summary, path.parent)
            if picture is not None:
                written.append(picture)
    return written


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, default=[Path("bench/results")])
    args = parser.parse_args(argv)
    missing = [str(f) for f in args.folders if not f.exists()]
    if missing:
        parser.error(f"no such folder: {', '.join(missing)}")
    written = redraw(args.folders)
    print(f"drew {len(written)} curves.png")
    return written


if __name__ == "__main__":
    main()
