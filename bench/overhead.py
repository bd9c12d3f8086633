"""Step time of the critic trainers (PPO, MPO) relative to GRPO on the same setup, measured side by side in one run.

    python bench/overhead.py --steps 20                      # random tiny model on shop, CPU
    python bench/overhead.py --steps 20 --model tiny:shop    # the embedded default (built and cached on first use)

Every method trains `--steps` optimizer steps from the same model folder, on the same tasks, with the same seed and
the same batch layout (`per_device_train_batch_size` rows per minibatch, `steps_per_generation` minibatches per
generation batch, G = 2), after one untimed warm-up step (first-call costs). The time is the trainer's own
`train_runtime` (generation, rewards, advantages, losses, optimizer steps), so model loading and trainer construction
are not counted. Methods run with their own defaults: PPO with a value head on the policy's backbone (one extra no-grad
forward per generation batch), MPO with a separate critic model (a second backbone forward and backward). Prints a
markdown table of seconds per step and ratios. The README's figures come from

    python bench/overhead.py --steps 30 --model tiny:shop --batch_size 32 --max_completion_length 256 \
        --max_turn_tokens 24

and are written to bench/results/overhead/result.json (each method's `train_runtime` and s/step, the warm-up's, the
settings, library versions and machine) and result.md (the table), or into `--out`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.record import RESULTS, write_result  # noqa: E402
from envs import ENVIRONMENTS  # noqa: E402
from envs.tiny import CHAT_TEMPLATE, TinySpec, build_model, build_tokenizer, demonstrations, is_tiny, tiny_model  # noqa: E402
from train import make_dataset  # noqa: E402
from trainers import TRAINERS  # noqa: E402

METHODS = ("grpo", "ppo", "mpo")


def random_model(env: str, folder: str) -> str:
    """A randomly initialised tiny Qwen2 with a tokenizer trained on the environment's expert text (no SFT)."""
    env_cls = ENVIRONMENTS[env]
    demos = demonstrations(env_cls, 200, seed=0, difficulty=0, noise=0.3)
    texts = [CHAT_TEMPLATE, "user assistant system tool"] + [m["content"] for d in demos for m in d]
    spec = TinySpec(env=env)
    tokenizer = build_tokenizer(texts, spec.vocab_size)
    build_model(spec, tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def step_seconds(method: str, folder: str, env: str, opts: argparse.Namespace, workdir: str) -> float:
    trainer_cls, config_cls = TRAINERS[method]
    env_cls = ENVIRONMENTS[env]
    config = config_cls(
        output_dir=os.path.join(workdir, method),
        per_device_train_batch_size=opts.batch_size,
        steps_per_generation=2,
        num_generations=2,
        max_completion_length=opts.max_completion_length,
        max_turn_tokens=opts.max_turn_tokens,
        max_steps=opts.steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        report_to="none",
        seed=0,
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        activation_checkpointing=False,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = trainer_cls(
        model=folder,
        args=config,
        train_dataset=make_dataset(env_cls, "train", 256, seed=0, difficulty=0),
        processing_class=AutoTokenizer.from_pretrained(folder, padding_side="left"),
        env_factory=lambda row: env_cls(difficulty=0),
    )
    torch.manual_seed(0)
    start = time.perf_counter()
    trainer.train()
    runtime = next((h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h), None)
    return (runtime if runtime is not None else time.perf_counter() - start) / opts.steps


def report(seconds: dict[str, float], opts: argparse.Namespace) -> str:
    """The console text and result.md: the settings line and the table of s/step and ratios vs GRPO."""
    lines = [
        f"{opts.steps} steps on {opts.env}, model {opts.model}, {opts.batch_size} x 2 rows per generation batch\n",
        "| method | s/step | ratio vs GRPO |\n| --- | ---: | ---: |",
    ]
    for method in seconds:
        lines.append(f"| {method} | {seconds[method]:.3f} | {seconds[method] / seconds['grpo']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per method")
    parser.add_argument("--env", default="shop", choices=sorted(ENVIRONMENTS))
    parser.add_argument("--model", default="random", help="'random' (tiny, untrained), tiny:<env>, or a folder")
    parser.add_argument("--batch_size", type=int, default=16, help="rows per minibatch (2 minibatches per generation)")
    parser.add_argument("--max_completion_length", type=int, default=128)
    parser.add_argument("--max_turn_tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=RESULTS / "overhead", help="folder for result.json and result.md")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        if opts.model == "random":
            folder = random_model(opts.env, os.path.join(workdir, "model"))
        else:
            folder = tiny_model(opts.model) if is_tiny(opts.model) else opts.model
        warmup = step_seconds("grpo", folder, opts.env, argparse.Namespace(**{**vars(opts), "steps": 1}), workdir)
        seconds = {m: step_seconds(m, folder, opts.env, opts, workdir) for m in METHODS}
    text = report(seconds, opts)
    print("\n" + text)
    measured = {
        "seconds_per_step": seconds,
        "train_runtime_s": {m: s * opts.steps for m, s in seconds.items()},
        "ratio_vs_grpo": {m: s / seconds["grpo"] for m, s in seconds.items()},
        "warmup_grpo_s": warmup,  # one untimed-for-the-table GRPO step before the measured runs
        "model": folder if opts.model != "random" else "random (temporary folder)",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
    }
    written = write_result(opts.out, "overhead", vars(opts) | {"out": str(opts.out)}, measured, text)
    print(f"\nwrote {' and '.join(map(str, written))}", file=sys.stderr)
    return seconds


if __name__ == "__main__":
    main()
