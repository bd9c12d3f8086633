"""Stopping and resuming a run: the checkpoint `resume_from_checkpoint` names (checked before any model is loaded),
whether a checkpoint was written to the end, the Ctrl-C / SIGTERM callback that stops at a generation-batch boundary
with a checkpoint, and the teardown of torch.distributed after a multi-process run."""

from __future__ import annotations

import json
import logging
import os
import signal
import struct
import zipfile

import torch
from transformers import TrainerCallback

logger = logging.getLogger(__name__)


def checkpoints(folder: str) -> list[str]:
    """The `checkpoint-N` folders in `folder` (a run's output_dir), by N; none when `folder` is not a folder."""
    if not os.path.isdir(folder):
        return []
    found = [
        (int(entry[11:]), os.path.join(folder, entry))
        for entry in os.listdir(folder)
        if entry.startswith("checkpoint-") and entry[11:].isdigit() and os.path.isdir(os.path.join(folder, entry))
    ]
    return [path for _, path in sorted(found)]


def resume_checkpoint(config) -> str | None:
    """The checkpoint folder `resume_from_checkpoint` names, checked before any model is loaded (None: a fresh run).

    `true` picks the latest complete checkpoint in output_dir (a `checkpoint-N` folder holding trainer_state.json, the
    last file the trainer writes there); incomplete ones, e.g. from a run killed while saving, are skipped with a
    warning. A path must be a complete checkpoint folder. A run whose checkpoints would fall inside a generation batch
    is refused: resuming from one would play new rollouts where the original run reused its batch, so the two runs
    would part."""
    value = config.resume_from_checkpoint
    steps, accumulation = config.steps_per_generation * config.num_iterations, config.gradient_accumulation_steps
    per_batch = max(1, steps // accumulation)  # optimizer steps on one generation batch
    if config.save_strategy == "steps" and per_batch > 1 and config.save_steps % per_batch:
        raise SystemExit(
            f"error: save_steps {config.save_steps} is not a multiple of the {per_batch} optimizer steps of one "
            "generation batch (steps_per_generation x num_iterations): a checkpoint inside a batch cannot resume "
            f"exactly; use save_steps {per_batch * max(1, round(config.save_steps / per_batch))}"
        )
    if value in (None, False, ""):
        return None
    if str(value).lower() == "true":
        found = checkpoints(config.output_dir)
        problems = {path: checkpoint_problem(path) for path in found}
        complete = [p for p in found if problems[p] is None]
        for path in found:
            if problems[path] is not None:
                logger.warning(
                    "resume_from_checkpoint: skipping %s, an incomplete checkpoint (%s)", path, problems[path]
                )
        if not complete:
            raise SystemExit(
                f"error: resume_from_checkpoint true, but output_dir {config.output_dir!r} holds no complete "
                "checkpoint-N folder"
            )
        return complete[-1]
    path = os.path.expanduser(str(value))
    if not os.path.isdir(path):
        raise SystemExit(f"error: resume_from_checkpoint {value!r} is not a folder")
    if (problem := checkpoint_problem(path)) is not None:
        raise SystemExit(f"error: resume_from_checkpoint {value!r} is not a complete checkpoint ({problem})")
    return path


def checkpoint_problem(path: str) -> str | None:
    """Why a checkpoint folder cannot be resumed from, or None: trainer_state.json (which the trainer writes last)
    missing or cut short, or a weights or state file that is not whole: a safetensors file whose header does not
    parse or whose size is not the header's length plus its tensors' bytes, a torch file (`.pt`, `.bin`) that is not a
    readable zip archive (torch saves zips; a cut or overwritten one loses its central directory)."""
    if not checkpoint_complete(path):
        return "no readable trainer_state.json"
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if name.endswith(".safetensors") and (problem := safetensors_problem(file)):
            return f"{name} {problem}"
        if name.endswith((".pt", ".bin")) and not zipfile.is_zipfile(file):
            return f"{name} is not a readable torch file (cut short or overwritten)"
    return None


def safetensors_problem(file: str) -> str | None:
    """Whether a safetensors file is whole: 8 bytes of header length, the JSON header, then the tensors' bytes up to
    the largest end offset the header gives, and nothing missing."""
    size = os.path.getsize(file)
    try:
        with open(file, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size:
                return f"has a header length ({length:,}) beyond the file's {size:,} bytes"
            header = json.loads(f.read(length))
    except (struct.error, ValueError, UnicodeDecodeError):
        return "has no readable header"
    ends = [t["data_offsets"][1] for key, t in header.items() if key != "__metadata__"]
    expected = 8 + length + max(ends, default=0)
    if size != expected:
        return f"holds {size:,} bytes where its header describes {expected:,} (cut short or overwritten)"
    return None


def checkpoint_complete(path: str) -> bool:
    """Whether a checkpoint folder was written to the end: the trainer writes trainer_state.json last, so a run killed
    while saving leaves it missing, or cut short (not JSON)."""
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            return isinstance(json.load(f), dict)
    except (OSError, ValueError):
        return False


class StopOnSignal(TrainerCallback):
    """Ctrl-C or SIGTERM stops training at the next generation-batch boundary with a checkpoint there, so the run can
    resume exactly (`resume_from_checkpoint`); a second signal stops at once. Installed by train.py's `main` around
    `train()`."""

    def __init__(self, per_batch: int):
        self.per_batch, self.requested = per_batch, None
        self._previous: dict[int, object] = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. a notebook worker): signals stay as they are
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.requested is not None:  # a second signal: stop now, as the default handler would
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name
        print(
            f"\n{self.requested}: stopping at the next generation-batch boundary with a checkpoint (again: stop now)"
        )

    def on_step_end(self, args, state, control, **kwargs):
        if self.requested is not None and state.global_step % self.per_batch == 0:
            control.should_save = True
            control.should_training_stop = True
        return control


def close_process_group() -> None:
    """Tear down torch.distributed after a multi-process run; a no-op in one process.

    Every rank waits at a barrier first, so no rank closes its gloo connections while a peer is still using them, and
    the group is destroyed before interpreter shutdown: either race can abort a rank (SIGABRT, "terminate called
    without an active exception") after its work is done.
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
