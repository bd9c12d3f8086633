"""Where a training step's time goes: generation, environment steps, rewards, advantages, the loss's forward and
backward, the optimizer, and everything else (framework overhead), per method, on the same setup.

    python bench/profile_step.py --steps 10 --model tiny:shop --methods grpo ppo mpo [--beta 0.0 0.02]
    python bench/profile_step.py --steps 5 --model tiny:shop --methods grpo --beta 0.02 --torch_compile
    python bench/profile_step.py --steps 3 --model smollm2 --env textarena:GuessTheNumber-v0 --methods grpo ppo \\
        --batch_size 8 --num_generations 4 --max_turn_tokens 8 --max_completion_length 192 --lora_r 16 \\
        --temperature 0.7 --system_prompt "Reply with only your guess in square brackets, like [10]." \\
        --out bench/results/profile_step_smollm2

`--model smollm2` is the real pretrained model (agent_trl/real_model.py); `--lora_r` trains a LoRA adapter of that
rank on every linear layer (alpha twice the rank, as the real-model recipes) instead of every weight, and
`--system_prompt` puts a system message before every first observation (the run field of the same name).

Each method trains `--steps` optimizer steps (after one untimed warm-up step) with the shop recipe's batch layout
(64 rollouts per step: 8 tasks x G 8, 24 tokens per turn, 256 per episode), each `--beta` (the KL weight to the
starting policy: a reference forward per step when not 0; one row per method and value) and the policy frozen
(learning rate 0, so every method plays the same kind of episodes and the shares are the method's own). The
trainer's own functions are wrapped by timers that keep exclusive time (a region's time minus the regions timed
inside it):

- generation: the model's `generate` calls in the agent loop (prefill and decode);
- environment: `reset_all` and `step_all` (every environment's `reset` and its `step` of each turn);
- agent loop, other: the rest of an episode batch (tokenising observations, bookkeeping, padding);
- no-grad forwards: TRL's log-prob forwards outside the loss (old or reference log-probs, a value head's values,
  teacher passes) and a separate critic's forwards without gradient (`critic_values`);
- rewards: `calculate_rewards`; advantages: `compute_advantages` (the method's own math);
- loss forward: `policy_loss` (the actor's, and a critic's, forward and loss); backward: `accelerator.backward`;
- optimizer: `optimizer.step` (clipping excluded);
- other: `train_runtime` minus all of the above: TRL's batching and splitting, logging, gradient clipping, scheduler,
  the transformers training loop.

Model compute is generation + no-grad forwards + loss forward + backward + optimizer; the goal is "other" plus
"agent loop, other" plus rewards at most 5% of a step. Writes bench/results/profile_step/result.json and result.md
(or `--out`).

`--torch_compile` adds a row per method and beta with TrainingArguments' `torch_compile: true` (docs/methods/grpo.md
D16): accelerate compiles the policy (the loss's forward and backward, and the agent loop's decode loop, which
samples with the compiled module) and the reference model. Every row also records its warm-up step's time
(`first_step_seconds`, where compilation happens) and, compiled, dynamo's counts of graphs, frames and graph breaks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import AutoTokenizer, TrainerCallback  # noqa: E402

from agent_trl.real_model import is_real, real_model  # noqa: E402
from agent_trl.sources import env_rows  # noqa: E402
from bench.record import RESULTS, write_result  # noqa: E402
from envs.sources import load_environment  # noqa: E402
from envs.tiny import is_tiny, tiny_model  # noqa: E402
from trainers import TRAINERS, agent_loop  # noqa: E402
from trainers.agent_loop import with_system  # noqa: E402

PARTS = ["generation", "environment", "agent loop, other", "no-grad forwards", "rewards", "advantages",
         "loss forward", "backward", "optimizer"]  # fmt: skip
MODEL_COMPUTE = ("generation", "no-grad forwards", "loss forward", "backward", "optimizer")


class Profiler:
    """Exclusive wall time per named region; regions nest (a parent's time excludes its children's)."""

    def __init__(self):
        self.total: dict[str, float] = defaultdict(float)
        self.stack: list[list] = []  # [name, start, time spent in children]
        self.enabled = True

    @contextmanager
    def region(self, name: str):
        if not self.enabled:
            yield
            return
        self.stack.append([name, time.perf_counter(), 0.0])
        try:
            yield
        finally:
            name, start, children = self.stack.pop()
            spent = time.perf_counter() - start
            self.total[name] += spent - children
            if self.stack:
                self.stack[-1][2] += spent

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self.region(name):
                return fn(*args, **kwargs)

        return timed


def instrument(trainer, prof: Profiler) -> None:
    """Wrap the trainer's pieces (instance attributes, so nothing leaks to other trainers) and the agent loop's."""
    inside_loss = {"on": False}
    forward = trainer.token_logps

    def logps(*args, **kwargs):
        if inside_loss["on"]:
            return forward(*args, **kwargs)
        with prof.region("no-grad forwards"):
            return forward(*args, **kwargs)

    policy_loss = trainer.policy_loss

    def loss(*args, **kwargs):
        inside_loss["on"] = True
        try:
            with prof.region("loss forward"):
                return policy_loss(*args, **kwargs)
        finally:
            inside_loss["on"] = False

    trainer.token_logps = logps
    if hasattr(trainer, "critic_values"):  # a separate critic's forward (PPO/MPO with critic_model_name_or_path)
        values = trainer.critic_values

        def critic_values(*args, **kwargs):
            if torch.is_grad_enabled():  # the critic's loss: inside "loss forward"
                return values(*args, **kwargs)
            with prof.region("no-grad forwards"):
                return values(*args, **kwargs)

        trainer.critic_values = critic_values
    trainer.policy_loss = loss
    trainer.calculate_rewards = prof.wrap("rewards", trainer.calculate_rewards)
    trainer.compute_advantages = prof.wrap("advantages", trainer.compute_advantages)
    trainer.accelerator.backward = prof.wrap("backward", trainer.accelerator.backward)

    class OptimizerTimer(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            trainer.optimizer.step = prof.wrap("optimizer", trainer.optimizer.step)

    trainer.add_callback(OptimizerTimer())


@contextmanager
def agent_loop_timers(prof: Profiler):
    """The agent loop's module functions, timed while the block runs."""
    saved = agent_loop.play, agent_loop.reset_all, agent_loop.step_all, agent_loop.hf_generate

    def hf_generate(*args, **kwargs):
        return prof.wrap("generation", saved[3](*args, **kwargs))

    agent_loop.play = prof.wrap("agent loop, other", saved[0])
    agent_loop.reset_all = prof.wrap("environment", saved[1])
    agent_loop.step_all = prof.wrap("environment", saved[2])
    agent_loop.hf_generate = hf_generate
    try:
        yield
    finally:
        agent_loop.play, agent_loop.reset_all, agent_loop.step_all, agent_loop.hf_generate = saved


def profile(method: str, beta: float, folder: str, opts: argparse.Namespace, workdir: str, compile_: bool) -> dict:
    trainer_cls, config_cls = TRAINERS[method]
    source = load_environment(opts.env, {}, 0)
    config = config_cls(
        output_dir=os.path.join(workdir, f"{method}-{beta}"), per_device_train_batch_size=opts.batch_size, beta=beta,
        num_generations=opts.num_generations, max_completion_length=opts.max_completion_length,
        max_turn_tokens=opts.max_turn_tokens, max_steps=opts.steps + 1, learning_rate=0.0,
        temperature=opts.temperature, lr_scheduler_type="constant", loss_type="grpo", report_to="none", seed=0,
        bf16=False,
        use_cpu=not torch.cuda.is_available(), activation_checkpointing=False, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, torch_compile=compile_,
    )  # fmt: skip
    rows = env_rows(source, source.make_tasks("train", 256, seed=0, difficulty=0))
    if opts.system_prompt is not None:
        rows = rows.map(lambda row: {"prompt": with_system(row["prompt"], opts.system_prompt)})
    lora = None
    if opts.lora_r:
        from peft import LoraConfig

        lora = LoraConfig(
            r=opts.lora_r, lora_alpha=2 * opts.lora_r, target_modules="all-linear", task_type="CAUSAL_LM"
        )
    trainer = trainer_cls(
        model=folder, args=config, processing_class=AutoTokenizer.from_pretrained(folder, padding_side="left"),
        train_dataset=rows, env_factory=source.factory, peft_config=lora,
    )  # fmt: skip
    prof = Profiler()
    instrument(trainer, prof)

    class Window(TrainerCallback):  # the first step is a warm-up: time from the end of step 1 on
        def on_train_begin(self, args, state, control, **kwargs):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                prof.total.clear()
                self.start = time.perf_counter()

        def on_train_end(self, args, state, control, **kwargs):
            self.end = time.perf_counter()

    window = Window()
    trainer.add_callback(window)
    torch.manual_seed(0)
    torch._dynamo.reset()  # each compiled row compiles from scratch (in this process; inductor's disk cache aside)
    torch._dynamo.utils.counters.clear()
    with agent_loop_timers(prof):
        trainer.train()
    total = (window.end - window.start) / opts.steps
    parts = {name: prof.total.get(name, 0.0) / opts.steps for name in PARTS}
    parts["other"] = max(0.0, total - sum(parts.values()))
    out = {"seconds_per_step": total, "parts": parts, "first_step_seconds": window.start - window.begin}
    if compile_:
        counters = torch._dynamo.utils.counters
        out["dynamo"] = {
            "unique_graphs": counters["stats"]["unique_graphs"],  # one per compiled frame and guard set
            "frames": dict(counters["frames"]),  # frames dynamo was asked to compile ("total") and did ("ok")
            "graph_breaks": sum(counters["graph_break"].values()),
            "graph_break_reasons": sorted(counters["graph_break"])[:10],
        }
    return out


def report(results: dict, opts: argparse.Namespace) -> str:
    names = [*PARTS, "other"]
    lines = [
        f"{opts.steps} steps after a warm-up on {opts.env}, model {opts.model}, {opts.batch_size} rollouts per step "
        f"(G {opts.num_generations}), frozen policy, {torch.get_num_threads()} torch thread(s); share of a step\n",
        "| method | s/step | " + " | ".join(names) + " | model compute | outside model and env. | warm-up (s) |",
        "| --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: | ---: |",
    ]
    for method, r in results.items():
        s, p = r["seconds_per_step"], r["parts"]
        compute = sum(p[n] for n in MODEL_COMPUTE)
        outside = s - compute - p["environment"]
        row = f"| {method} | {s:.3f} | " + " | ".join(f"{100 * p[n] / s:.1f}%" for n in names)
        lines.append(row + f" | {100 * compute / s:.1f}% | {100 * outside / s:.1f}% | {r['first_step_seconds']:.1f} |")
    for method, r in results.items():
        if "dynamo" in r:
            d = r["dynamo"]
            lines.append(
                f"\n{method}: {d['unique_graphs']} graphs compiled ({d['frames']}), {d['graph_breaks']} graph breaks"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--env", default="shop")
    parser.add_argument("--model", default="tiny:shop", help="tiny:<env>, smollm2 or a model folder")
    parser.add_argument("--batch_size", type=int, default=64)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--max_completion_length", type=int, default=256)
    parser.add_argument("--max_turn_tokens", type=int, default=24)
    parser.add_argument("--methods", nargs="+", default=["grpo", "ppo", "mpo"], choices=sorted(TRAINERS))
    parser.add_argument("--beta", type=float, nargs="+", default=[0.0], help="KL weights, one row each")
    parser.add_argument(
        "--torch_compile", action="store_true", help="also a row per method and beta with torch_compile: true (D16)"
    )
    parser.add_argument("--lora_r", type=int, default=0, help="LoRA rank on every linear layer (0: full weights)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the rollouts")
    parser.add_argument("--system_prompt", default=None, help="a system message before every first observation")
    parser.add_argument("--out", type=Path, default=RESULTS / "profile_step")
    opts = parser.parse_args(argv)
    folder = opts.model
    if is_tiny(opts.model) or is_real(opts.model):
        folder = tiny_model(opts.model) if is_tiny(opts.model) else real_model(opts.model)
    with tempfile.TemporaryDirectory() as workdir:
        results = {
            (m if beta == 0 else f"{m}, beta {beta:g}") + (", compiled" if compile_ else ""): profile(
                m, beta, folder, opts, workdir, compile_
            )
            for m in opts.methods
            for beta in opts.beta
            for compile_ in ([False, True] if opts.torch_compile else [False])
        }
    text = report(results, opts)
    print("\n" + text)
    write_result(opts.out, "profile_step", vars(opts) | {"out": str(opts.out)}, results, text)
    return results


if __name__ == "__main__":
    main()
