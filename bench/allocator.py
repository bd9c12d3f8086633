"""Page faults of repeated CPU steps with and without `keep_freed_memory` (docs/methods/grpo.md D14), on glibc.

    python bench/allocator.py [--repeats 5] [--steps 5]

Each measurement runs in a fresh Python process (the allocator setting lasts for the process): one step's worth of
activations (tensors of 24, 8, 16, 4, 20 and 12 MB alive together, freed at the step's end) is allocated once, then
`--steps` more times, and the process's minor page faults over those steps are counted (`getrusage`). Under glibc's
defaults freed blocks are handed back to the system and faulted in again, zeroed; with `keep_freed_memory` they are
reused. Default and kept processes alternate, `--repeats` of each. Page counts depend on the heap's layout and the
machine, so this is a measurement, not a test.

Writes bench/results/allocator/result.json and result.md, or into `--out`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository's packages

from bench.record import RESULTS, write_result  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
STEP_MB = (24, 8, 16, 4, 20, 12)
PROCESS = """
import resource, sys
sys.path.insert(0, sys.argv[2])
import torch
if sys.argv[1] == "kept":
    from trainers.cpu_paths import keep_freed_memory
    assert keep_freed_memory(), "not glibc"

def step():  # a step's activations, alive together, freed at its end
    live = [torch.ones(mb * 2**18) for mb in STEP_MB]
    return len(live)

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(int(sys.argv[3])):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
""".replace("STEP_MB", repr(STEP_MB))


def faults(mode: str, steps: int) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", PROCESS, mode, str(ROOT), str(steps)], capture_output=True, text=True, env=env,
        check=True,
    )  # fmt: skip
    return int(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="Processes of each kind.")
    parser.add_argument("--steps", type=int, default=5, help="Steps counted per process, after the first.")
    parser.add_argument("--out", type=Path, default=RESULTS / "allocator")
    opts = parser.parse_args(argv)
    if not sys.platform.startswith("linux"):
        raise SystemExit("error: bench/allocator.py measures glibc's allocator (Linux)")
    runs = {"default": [], "kept": []}
    for _ in range(opts.repeats):
        for mode in runs:
            runs[mode].append(faults(mode, opts.steps))
    pages = opts.steps * sum(STEP_MB) * 2**20 // 4096  # every page the counted steps touch
    measured = {"pages_touched": pages, "faults": runs}
    rows = [
        f"| {mode} | {statistics.median(v)} | {min(v)}-{max(v)} | {statistics.median(v) / pages:.1%} |"
        for mode, v in runs.items()
    ]
    table = "\n".join(
        [
            f"Minor page faults over {opts.steps} steps of {sum(STEP_MB)} MB ({pages} pages), {opts.repeats} "
            "processes each:",
            "",
            "| allocator | median faults | range | share of pages |",
            "|---|---|---|---|",
            *rows,
        ]
    )
    write_result(opts.out, "allocator", vars(opts) | {"out": str(opts.out)}, measured, table)
    print(table)
    return measured


if __name__ == "__main__":
    main()
