"""A bench's result folder: `result.json` (every measured number and how it was measured) and `result.md` (the table).

Every bench in bench/ calls `write_result(out, bench, settings, measured, table)` once, at the end of a run:

* `result.json` holds `bench`, `command` (the exact `sys.argv`), `settings` (the parsed arguments), `measured` (every
  number the run took, individual timings included, not only their medians) and `environment` (library versions of
  torch, transformers and trl, torch's thread count, a UTC timestamp, load average and `platform` facts);
* `result.md` holds the markdown the README quotes, ready to paste, under a line with the command that produced it.

Both texts are built before anything touches the disk; both are written to temporary files in the same folder and
only then moved over the old ones with `os.replace`, so an interrupted or failing run leaves the previous result (or
nothing), never a half-written file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def environment() -> dict:
    """Library versions, thread count, timestamp and machine facts, for `result.json`."""
    import torch
    import transformers
    import trl

    return {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "trl": trl.__version__,
        },
        "torch_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,  # 1, 5, 15 min, at writing
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "platform": {
            "platform": platform.platform(),
            "system": platform.system(),
            "release": platform.release(),
            "machine": platform.machine(),
            "processor": platform.processor(),
            "python_implementation": platform.python_implementation(),
        },
    }


def write_atomic(files: dict[Path, str]) -> None:
    """Write each text to a temporary file beside its path, then move them all into place with `os.replace`.

    Nothing is replaced until every temporary file is written and synced, so a failure (or an interrupt) while
    writing leaves the old files (or none) and no temporary file behind.
    """
    temps = {path: path.with_name(f".{path.name}.{os.getpid()}.tmp") for path in files}  # same folder: same disk
    try:
        for path, text in files.items():
            with open(temps[path], "w") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
        for path, tmp in temps.items():
            os.replace(tmp, path)  # atomic on POSIX
    finally:
        for tmp in temps.values():
            tmp.unlink(missing_ok=True)


def write_result(out: Path, bench: str, settings: dict, measured: dict, table: str) -> tuple[Path, Path]:
    """Write `out/result.json` and `out/result.md`; returns their paths.

    Args:
        out (`Path`): the result folder, created if missing.
        bench (`str`): the bench's name (`rollout`, `routing_gap`, `overhead`, `draco_cost`, `learning`).
        settings (`dict`): the run's settings (its parsed arguments), JSON-serialisable.
        measured (`dict`): every measured number, JSON-serialisable (a `TypeError` is raised before any file is
            touched if it is not).
        table (`str`): the markdown the README shows.
    """
    record = {"bench": bench, "command": list(sys.argv), "settings": settings, "measured": measured}
    record["environment"] = environment() | {"python_executable": sys.executable}
    json_text = json.dumps(record, indent=1) + "\n"
    md_text = f"`{shlex.join(['python', *sys.argv])}`\n\n{table.strip()}\n"
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic({out / "result.json": json_text, out / "result.md": md_text})
    return out / "result.json", out / "result.md"
