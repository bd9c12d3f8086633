"""The episodes file of a run (`save_episodes: true`): `<output_dir>/episodes.jsonl`, one line per episode trained on,
gathered from every process and written by the main one after each generation batch, so a run that stops keeps every
batch it trained on. Each line: `step` (the first optimizer step that trains on the batch, as in the logged metrics),
`group`, `task`, `reward`, `advantage` (TRL's group advantage of the row), `success`, `truncated` and `turns` (the
transcript, each turn with the number of model tokens it took)."""

from __future__ import annotations

import json
import os

import torch
from accelerate.utils import gather_object


class EpisodesWriter:
    """Appends a trainer's generation batches to `<output_dir>/episodes.jsonl`. The first write of a run drops the
    lines of steps after the one it starts from: a resumed run replaces what its checkpoint did not keep, a new run
    the whole file."""

    def __init__(self, output_dir: str):
        self.path = os.path.join(output_dir, "episodes.jsonl")
        self.first_step: int | None = None  # global step at the first write of this run (None: nothing written yet)

    def write(self, trainer, batch) -> None:
        """Append `batch` (a `RolloutBatch`) of `trainer`, gathered from every process (all processes call this)."""
        tokens = [
            torch.bincount(t[t >= 0], minlength=len(r)).tolist()  # model tokens of each turn
            for t, r in zip(batch.turn_index, batch.transcripts, strict=True)
        ]
        step = trainer.state.global_step + 1
        lines = gather_object(
            [
                json.dumps(
                    {
                        "step": step,
                        "group": int(batch.group_ids[i]),
                        "task": batch.task_ids[i],
                        "reward": float(batch.rewards[i]),
                        "advantage": float(batch.advantages[i]),
                        "success": bool(batch.rows[i]["success"]),
                        "truncated": bool(batch.truncated[i]),
                        "turns": [{**turn, "tokens": tokens[i][k]} for k, turn in enumerate(batch.transcripts[i])],
                    },
                    default=str,
                )
                for i in range(len(batch.rows))
            ]
        )
        if not trainer.accelerator.is_main_process:
            return
        if self.first_step is None:
            self.first_step = step - 1
            kept = []
            if os.path.exists(self.path):
                with open(self.path) as f:
                    kept = [line for line in f if line.strip() and json.loads(line)["step"] <= self.first_step]
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path, "w") as f:
                f.write("".join(kept))
        with open(self.path, "a") as f:
            f.write("".join(line + "\n" for line in lines))
