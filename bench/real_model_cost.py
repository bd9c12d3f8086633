"""What a GRPO step costs on the real model (`smollm2`, SmolLM2-135M-Instruct) on a CPU: full fine-tuning against LoRA
against QLoRA, fp32 against bf16, in seconds per optimizer step and peak resident memory.

    HF_HUB_OFFLINE=1 python bench/real_model_cost.py --steps 3 --repeats 2 --threads 2

Each arm is one `python train.py --config configs/smollm2_arith.yaml` run in a process of its own (peak memory is the
process's `ru_maxrss`, so arms cannot share one), with the held-out evaluation skipped, `--steps` optimizer steps of
the recipe's batch (32 completions of up to 32 tokens), learning rate 0 (the whole update runs, the policy does not
move, so every arm samples about the same completions) and the arm's flags:

- `full, fp32`: no LoRA, every weight trained, fp32 weights and compute (AdamW keeps two fp32 moments per weight);
- `LoRA, fp32`: the recipe (r 16 on every linear layer);
- `LoRA, fp32, activation checkpointing`: the recipe with `--activation_checkpointing true` (each block's activations
  recomputed in the backward pass instead of kept: less memory, one more forward of compute);
- `QLoRA, fp32 compute`: the recipe with `--load_in_4bit` (bitsandbytes NF4 base weights, `device_map: cpu`);
- `full, bf16` and `LoRA, bf16`: weights loaded in bfloat16 (`--dtype bfloat16`) and `--bf16 true` (autocast).

The arms run one after the other, never two at once, in an order that alternates between repeats (A B C, then C B A)
so that a drift of the machine's speed falls on every arm alike. Time per step is the median over the logged steps
after the first (TRL's `step_time`: generation, scoring and the update); memory is the largest peak over the
repeats. Writes bench/results/real_model_cost/result.json (every arm's every step time and summary) and result.md,
or into `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.record import RESULTS, ROOT, write_result  # noqa: E402

LORA_OFF = ["--use_peft", "false"]
ARMS: dict[str, list[str]] = {
    "full, fp32": LORA_OFF,
    "LoRA, fp32": [],
    "LoRA, fp32, activation checkpointing": ["--activation_checkpointing", "true"],
    "QLoRA, fp32 compute": ["--load_in_4bit", "true"],
    "full, bf16": LORA_OFF + ["--dtype", "bfloat16", "--bf16", "true"],
    "LoRA, bf16": ["--dtype", "bfloat16", "--bf16", "true"],
}
#: every arm trains with learning rate 0: the full update runs (forward, backward, AdamW), the policy stays the one
#: the run started from, so every arm samples completions of about the same length (with the recipe's 5e-4, LoRA
#: shortened its completions from 21 to 10 tokens within 4 steps and the arms timed different work)
FROZEN = ["--learning_rate", "0"]


def run_arm(name: str, flags: list[str], steps: int, threads: int, workdir: Path) -> dict:
    out = workdir / name.replace(", ", "-").replace(" ", "_")
    argv = [sys.executable, "train.py", "--config", "configs/smollm2_arith.yaml", "--output_dir", str(out)]
    argv += ["--skip_eval", "true", "--max_steps", str(steps), "--logging_steps", "1", "--seed", "0", *FROZEN, *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"{name}: train.py exited with {done.returncode}\n{done.stderr[-3000:]}")
    summary = json.loads((out / "summary.json").read_text())
    step_times = [row["step_time"] for row in summary["log_history"] if "step_time" in row]
    return {
        "step_times_s": step_times,
        "median_s_after_first": statistics.median(step_times[1:]) if len(step_times) > 1 else step_times[0],
        "peak_memory_gib": summary["speed"]["peak_memory_gib"],
        "parameters": summary["parameters"],
        "process_wall_s": round(wall, 1),
        "losses": [row.get("loss") for row in summary["log_history"] if "loss" in row],
        # the step time includes generation, and each arm's numerics sample completions of other lengths
        "completion_lengths": [
            row["completions/mean_length"] for row in summary["log_history"] if "completions/mean_length" in row
        ],  # fmt: skip
    }


def report(results: dict, args: argparse.Namespace) -> str:
    lines = [
        f"GRPO on the real model (configs/smollm2_arith.yaml: 32 completions of up to 32 tokens per step), "
        f"{args.steps} steps per run, {args.repeats} repeats, {args.threads} torch threads; one arm at a time\n",
        "| arm | s/step (median) | vs LoRA fp32 | completion tokens (mean) | peak memory (GiB) | trainable parameters "
        "| stored 4-bit |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = results["LoRA, fp32"]["median_s"]
    for name, r in results.items():
        p = r["parameters"]
        lengths = [x for run in r["runs"] for x in run.get("completion_lengths", [])]
        length = f"{statistics.mean(lengths):.1f}" if lengths else "n/a"
        lines.append(
            f"| {name} | {r['median_s']:.1f} | {r['median_s'] / base:.2f}x | {length} | {r['peak_memory_gib']:.2f} | "
            f"{p['trainable']:,} | {p['quantized']:,} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=2, help="runs per arm, in alternating order")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads of each run")
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--out", type=Path, default=RESULTS / "real_model_cost")
    args = parser.parse_args(argv)
    if "LoRA, fp32" not in args.arms:
        parser.error("--arms must include 'LoRA, fp32' (the reference of the ratios)")
    runs: dict[str, list[dict]] = {name: [] for name in args.arms}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            order = args.arms if r % 2 == 0 else args.arms[::-1]
            for name in order:
                result = run_arm(name, ARMS[name], args.steps, args.threads, Path(tmp) / f"r{r}")
                runs[name].append(result)
                print(f"repeat {r}: {name}: {result['median_s_after_first']:.1f} s/step, "
                      f"{result['peak_memory_gib']:.2f} GiB", file=sys.stderr)  # fmt: skip
    results = {
        name: {
            "median_s": statistics.median(x["median_s_after_first"] for x in arm),
            "peak_memory_gib": max(x["peak_memory_gib"] for x in arm),
            "parameters": arm[0]["parameters"],
            "runs": arm,
        }
        for name, arm in runs.items()
    }
    text = report(results, args)
    print("\n" + text)
    written = write_result(args.out, "real_model_cost", vars(args) | {"out": str(args.out)}, results, text)
    print(f"\nwrote {' and '.join(map(str, written))}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
