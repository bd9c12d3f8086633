"""Do the stored learning tables regenerate from the stored runs? Each `bench/results/<bench>/` that bench/learning.py
wrote is tabulated again from its stored summaries, by its own recorded command plus `--stored_only` (nothing is
trained), into a temporary folder, and the new table.md is compared with the stored one, byte for byte.

    python bench/regenerate_tables.py --out bench/results/regenerate_tables

A table that differs is listed with its first differing line. A bench whose stored runs were trained by an older
command line the bench no longer accepts is listed as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import RESULTS, ROOT, write_result  # noqa: E402


def stored_command(record: dict, out: Path) -> list[str]:
    """The recorded bench/learning.py command with its `--out` replaced by `out` and `--stored_only` added."""
    argv = list(record["command"])
    if "--out" in argv:
        at = argv.index("--out")
        argv[at + 1] = str(out)
    else:
        argv += ["--out", str(out)]
    return [sys.executable, *argv, "--stored_only"] if "--stored_only" not in argv else [sys.executable, *argv]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=RESULTS / "regenerate_tables")
    args = parser.parse_args(argv)
    measured: dict[str, dict] = {}
    benches = sorted(
        p.parent for p in RESULTS.glob("*/result.json") if json.loads(p.read_text()).get("bench") == "learning"
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    for folder in benches:
        record = json.loads((folder / "result.json").read_text())
        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / folder.name
            shutil.copytree(folder, copy)  # the stored runs, where the command reads them
            (copy / "table.md").unlink(missing_ok=True)
            done = subprocess.run(stored_command(record, copy), cwd=ROOT, env=env, capture_output=True, text=True)
            new = (copy / "table.md").read_text() if (copy / "table.md").exists() else None
        old = (folder / "table.md").read_text() if (folder / "table.md").exists() else None
        if done.returncode != 0 or new is None:
            outcome = {"outcome": "failed", "error": (done.stderr or done.stdout).strip().splitlines()[-1:]}
        elif new == old:
            outcome = {"outcome": "identical"}
        else:
            first = next(
                (i for i, (a, b) in enumerate(zip(old.splitlines(), new.splitlines(), strict=False)) if a != b),
                min(len(old.splitlines()), len(new.splitlines())),
            )
            outcome = {"outcome": "differs", "line": first + 1}
        measured[folder.name] = outcome
        print(folder.name, outcome, file=sys.stderr)
    counts = {k: sum(v["outcome"] == k for v in measured.values()) for k in ("identical", "differs", "failed")}
    lines = [
        f"{counts['identical']} of {len(measured)} learning tables regenerate identically from their stored runs."
    ]
    lines += [
        f"- {name}: {v['outcome']} {v.get('line', v.get('error', ''))}"
        for name, v in measured.items()
        if v["outcome"] != "identical"
    ]
    text = "\n".join(lines)
    print(text)
    write_result(args.out, "regenerate_tables", {"out": str(args.out)}, measured, text)
    return measured


if __name__ == "__main__":
    main()
