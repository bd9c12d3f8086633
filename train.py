"""Train an agent: python train.py --config configs/NAME.yaml [--field value ...]

CPU smoke run (tiny default agent, built offline, a few minutes on 2 cores):
    python train.py --config configs/quickstart.yaml
One GPU, a real model with LoRA:
    python train.py --config configs/quickstart.yaml --model_name_or_path Qwen/Qwen3-0.6B --use_peft \
        --use_cpu false --bf16 true --max_turn_tokens 64 --max_completion_length 512

Order: parse -> model (+ LoRA/QLoRA) -> tasks -> environment and rewards -> evaluate -> train -> evaluate -> report.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config  # noqa: E402

from envs import ENVIRONMENTS  # noqa: E402
from envs.tiny import is_tiny, tiny_model  # noqa: E402
from trainers import TRAINERS  # noqa: E402
from trainers.agent_loop import LoopSettings, evaluate  # noqa: E402
from trainers.reporting import plot_curves, write_summary  # noqa: E402


@dataclass
class RunArguments:
    trainer: str = field(default="grpo", metadata={"help": f"Training method: one of {sorted(TRAINERS)}."})
    environment: str = field(
        default="shop", metadata={"help": f"Built-in environment: one of {sorted(ENVIRONMENTS)}."}
    )
    difficulty: int = field(default=0, metadata={"help": "Environment difficulty level (0 = learnable by tiny)."})
    num_train_tasks: int = field(default=2000, metadata={"help": "Training tasks generated from the train split."})
    num_eval_tasks: int = field(default=200, metadata={"help": "Held-out tasks (eval split) for before/after eval."})
    task_seed: int = field(default=0, metadata={"help": "Seed of the task generator."})
    eval_samples: int = field(default=1, metadata={"help": "Sampled episodes per eval task (pass^k uses all)."})
    eval_batch_size: int = field(default=100, metadata={"help": "Episodes played together during evaluation."})
    skip_eval: bool = field(default=False, metadata={"help": "Skip the before/after held-out evaluation."})
    tiny_seed: int = field(
        default=0, metadata={"help": "Seed of the tiny default's build (demonstrations, init, SFT); RL uses `seed`."}
    )
    tiny_sft_steps: int | None = field(
        default=None, metadata={"help": "SFT steps of the tiny default's warm start (default: the environment's own)."}
    )
    tiny_num_demos: int | None = field(
        default=None, metadata={"help": "Demonstrations the tiny default is warm-started on (default: 2000)."}
    )


def make_dataset(env_cls, split: str, n: int, seed: int, difficulty: int) -> Dataset:
    rows = []
    for task in env_cls.make_tasks(split, n, seed=seed, difficulty=difficulty):
        rows.append(
            {
                "prompt": env_cls(difficulty=difficulty).reset(task),
                "task": json.dumps(task),
                "task_id": task["task_id"],
            }
        )
    return Dataset.from_list(rows)


def held_out(model, tokenizer, env_cls, run: RunArguments, config, tasks) -> dict:
    settings = LoopSettings(config.max_turn_tokens, config.max_completion_length, config.max_turns)
    factory = partial(env_cls, difficulty=run.difficulty)
    kw = dict(settings=settings, batch_size=run.eval_batch_size)
    return {
        "sampled": evaluate(
            model, tokenizer, factory, tasks, temperature=config.temperature, samples=run.eval_samples, **kw
        ),
        "greedy": evaluate(model, tokenizer, factory, tasks, greedy=True, **kw),
    }


def parse(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    probe, _ = TrlParser((RunArguments,)).parse_args_and_config(argv, return_remaining_strings=True)
    if probe.trainer not in TRAINERS:
        raise SystemExit(f"error: trainer {probe.trainer!r} is unknown; choose one of {sorted(TRAINERS)}")
    trainer_cls, config_cls = TRAINERS[probe.trainer]
    run, config, model_args = TrlParser((RunArguments, config_cls, ModelConfig)).parse_args_and_config(argv)
    if run.environment not in ENVIRONMENTS:
        raise SystemExit(f"error: environment {run.environment!r} is unknown; choose one of {sorted(ENVIRONMENTS)}")
    return run, config, model_args, trainer_cls


def main(argv: list[str] | None = None) -> dict:
    run, config, model_args, trainer_cls = parse(argv)
    start = time.time()
    env_cls = ENVIRONMENTS[run.environment]
    train_ds = make_dataset(env_cls, "train", run.num_train_tasks, run.task_seed, run.difficulty)  # validates first
    eval_tasks = env_cls.make_tasks("eval", run.num_eval_tasks, seed=run.task_seed, difficulty=run.difficulty)
    name = model_args.model_name_or_path
    if is_tiny(name):  # the embedded default: built offline once, then read from the cache
        sizes = {"sft_steps": run.tiny_sft_steps, "num_demos": run.tiny_num_demos}
        sizes = {k: v for k, v in sizes.items() if v is not None}  # unset: the build's defaults
        model_args.model_name_or_path = tiny_model(name, difficulty=run.difficulty, seed=run.tiny_seed, **sizes)
    quantization = get_quantization_config(model_args)
    config.model_init_kwargs = {
        "dtype": model_args.dtype or "float32",
        **({"device_map": "cpu"} if quantization and config.use_cpu else {}),
    }
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    summary = {"run": asdict(run), "model": name, "trainer": run.trainer}
    if not run.skip_eval:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
        set_seed(config.seed)  # reproducible sampled held-out episodes; the trainer seeds again before RL
        summary["before"] = held_out(model, tokenizer, env_cls, run, config, eval_tasks)
        print(f"held-out success before RL: {json.dumps(summary['before'])}")
        del model
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        args=config,
        train_dataset=train_ds,
        processing_class=tokenizer,
        env_factory=lambda row: env_cls(difficulty=run.difficulty),
        peft_config=get_peft_config(model_args),
        quantization_config=quantization,
    )
    trainer.train()
    trainer.save_model(config.output_dir)
    if not run.skip_eval:
        model = trainer.accelerator.unwrap_model(trainer.model)
        summary["after"] = held_out(model, tokenizer, env_cls, run, config, eval_tasks)
        print(f"held-out success after RL: {json.dumps(summary['after'])}")
    summary["wall_seconds"] = round(time.time() - start, 1)
    # new rollouts per optimizer step: one generation batch feeds num_iterations x (steps_per_generation / GA) steps
    updates_per_generation = config.num_iterations * config.steps_per_generation // config.gradient_accumulation_steps
    summary["rollouts_per_step"] = config.generation_batch_size / max(1, updates_per_generation)  # global batch
    summary["log_history"] = trainer.state.log_history
    if trainer.accelerator.is_main_process:
        write_summary(os.path.join(config.output_dir, "summary.json"), summary)
        plot_curves(
            trainer.state.log_history,
            os.path.join(config.output_dir, "curves.png"),
            title=f"{run.trainer} on {name} (difficulty {run.difficulty})",
        )
    return summary


def close_process_group() -> None:
    """Tear down torch.distributed after a multi-process run; a no-op in one process.

    Every rank waits at a barrier first, so no rank closes its gloo connections while a peer is still using them, and
    the group is destroyed before interpreter shutdown: either race can abort a rank (SIGABRT, "terminate called
    without an active exception") after its work is done.
    """
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    close_process_group()
