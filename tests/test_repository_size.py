"""What a user clones: the stored benchmark results stay under a size. bench/results keeps each run's summary.json
(with its log history), the per-bench tables and plots, and logs; a run's own curves.png is left out and drawn again
by `python -m agent_trl.curves bench/results`."""

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIMIT_MB = 64  # about 59 MB when the run pictures left the repository


def tracked(folder: str) -> list[Path]:
    """The files git tracks under `folder` (the working tree's other files: weights, checkpoints, are ignored)."""
    out = subprocess.run(["git", "ls-files", "-z", folder], cwd=ROOT, capture_output=True, check=True).stdout
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_bench_results_stay_under_the_limit():
    files = [p for p in tracked("bench/results") if p.is_file()]
    assert files, "git lists no stored results: the test would check nothing"
    size = sum(p.stat().st_size for p in files) / 2**20
    largest = sorted(files, key=lambda p: p.stat().st_size)[-3:]
    assert size < LIMIT_MB, f"bench/results holds {size:.1f} MiB (limit {LIMIT_MB}); largest: {largest}"


def test_no_run_folder_keeps_its_own_curves():
    """A run folder's curves.png is drawn from its summary.json on demand, never stored beside it."""
    stored = [p for p in tracked("bench/results") if p.name == "curves.png" and (p.parent / "summary.json").exists()]
    assert stored == []
