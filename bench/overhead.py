"""Step time of the methods relative to GRPO on the same setup, measured side by side in one run.

    python bench/overhead.py --steps 20                      # random tiny model on shop, CPU
    python bench/overhead.py --steps 20 --model tiny:shop    # the embedded default (built and cached on first use)

Every method trains `--steps` optimizer steps from the same model folder, on the same tasks, with the same seed and the
same batch layout (`per_device_train_batch_size` rows per minibatch, `steps_per_generation` minibatches per generation
batch, G = `--num_generations`), after one untimed warm-up step (first-call costs). The time is the trainer's own
`train_runtime` (generation, rewards, advantages, losses, optimizer steps), so model loading and trainer construction
are not counted. Methods run with their own defaults: PPO with a value head on the policy's backbone (one extra no-grad
policy forward per generation batch for V_old), MPO with a separate critic model (the critic's no-grad forward for
V_old, and its forward and backward in every loss), GiGPO (anchor groups: a pass over the batch's state keys), TASPO
with the offline oracle analyzer (its calls, and the teacher pass: two no-grad policy forwards over the rows with
matched rules). For TASPO the table adds the teacher pass's share of the step and the analyzer calls and estimated
tokens per optimizer step (the oracle's tokens are the prompt characters / 4, what an API analyzer would be sent).
AlignOPSD runs with its shop recipe's settings (matching by action, K = 2, teacher generations of one turn's tokens);
the table adds its teacher generation, teacher forwards and encoder time per step. The Funnel runs one consolidation
step at its most expensive (a one-entry state, every task selected: the JSD attribution's two teacher forwards and the
distillation's student and teacher forwards on every row); its loop's other costs (evidence, gates, selection, editor
calls) are episodes and requests, counted per run in summary.json's `funnel.rollouts`. X-Tree runs its skill bonus
(`xtree_use: bonus`): the tree is mined when the trainer is built (not timed, about a second); each step adds the
bonus reward function (canonicalising and encoding every rollout's actions) and the per-group rescaling.

A method may carry settings of its config after `@` (`--methods grpo mpo "mpo@critic_num_layers=1"`): it is then a
row of its own, named as written.

Each method runs twice: learning (learning rate 1e-3), where every method plays its own episodes and their lengths
drift apart as the policies move (a policy that learns shorter episodes generates and trains faster), and with the
policy frozen (learning rate 0: every forward, backward and optimizer step still runs), where every method plays the
same episodes, so the ratio is the method's own cost per step. The mean completion length of each run is recorded
beside its time. Prints a markdown table of seconds per step and ratios; when the output folder already holds a result
measured with the same settings, its learning figures appear beside the new ones as the earlier run (a before/after
across a code change), with its timestamp. The README's figures come from

    python bench/overhead.py --steps 10 --model tiny:shop --batch_size 32 --max_completion_length 256 \
        --max_turn_tokens 24 --num_generations 8

and are written to bench/results/overhead/result.json (each method's `train_runtime`, s/step and mean completion
length in both modes, the warm-up's, the settings, library versions and machine) and result.md (the table), or into
`--out`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import yaml  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from agent_trl.sources import env_rows  # noqa: E402
from bench.record import RESULTS, write_result  # noqa: E402
from envs import ENVIRONMENTS  # noqa: E402
from envs.sources import load_environment  # noqa: E402
from envs.tiny import CHAT_TEMPLATE, TinySpec, build_model, build_tokenizer, demonstrations, is_tiny, tiny_model  # noqa: E402
from trainers import TRAINERS  # noqa: E402

METHODS = ("grpo", "ppo", "mpo", "gigpo", "taspo", "alignopsd", "beta_opsd", "funnel", "xtree")
EXTRA = (
    "taspo/teacher_forward_s",
    "taspo/analyzer_calls",
    "taspo/analyzer_tokens_in",
    "taspo/analyzer_tokens_out",
    "alignopsd/teacher_gen_s",
    "alignopsd/teacher_forward_s",
    "alignopsd/encoder_s",
    "beta_opsd/teacher_forward_seconds",
    "funnel/teacher_forward_seconds",
)
#: the Funnel's consolidation step at its most expensive: a one-entry state and every task selected (c = 1), so every
#: row gets the JSD attribution (two teacher forwards) and the reverse KL (a student and a teacher forward)
FUNNEL_STATE = "Notes from experience:\n- Steps that worked: search -> click -> choose -> buy"
#: per-method settings of the shipped tiny recipes (configs/<method>_shop.yaml) that differ from the method's defaults
RECIPE = {"alignopsd": {"alignopsd_match_on": "action", "alignopsd_top_k": 2}}
LENGTH = "completions/mean_length"  # TRL's metric, averaged over the run (logging_strategy "no": one log at the end)


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


def method_spec(spec: str) -> tuple[str, dict]:
    """'mpo@critic_num_layers=1,critic_lr_multiplier=1' -> ('mpo', {'critic_num_layers': 1, ...}): a method with
    settings of its config changed (values read as YAML scalars)."""
    method, _, extra = spec.partition("@")
    if method not in METHODS:
        raise SystemExit(f"--methods {spec!r}: unknown method {method!r}; choose from {', '.join(METHODS)}")
    overrides = [item for item in extra.split(",") if item]
    bad = [item for item in overrides if "=" not in item]
    if bad:
        raise SystemExit(f"--methods {spec!r}: settings after '@' must be FIELD=VALUE, got {bad}")
    settings = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in overrides)}
    unknown = sorted(set(settings) - {f.name for f in dataclasses.fields(TRAINERS[method][1])})
    if unknown:
        raise SystemExit(f"--methods {spec!r}: {method}'s config has no field {', '.join(unknown)}")
    return method, settings


def step_seconds(
    spec: str, folder: str, env: str, opts: argparse.Namespace, workdir: str, learning_rate: float = 1e-3
) -> tuple[float, float | None, dict[str, float]]:
    """Seconds per optimizer step of the method `spec` (a name, or a name with settings, see `method_spec`), the run's
    mean completion length (tokens, model and environment), and the `EXTRA` metrics the method logs, per optimizer
    step (their run means are per generation batch)."""
    method, overrides = method_spec(spec)
    trainer_cls, config_cls = TRAINERS[method]
    source = load_environment(env, {}, 0)
    config = config_cls(
        output_dir=os.path.join(workdir, spec.replace("@", "_").replace(",", "_").replace("=", "-")),
        per_device_train_batch_size=opts.batch_size,
        steps_per_generation=2,
        num_generations=opts.num_generations,
        max_completion_length=opts.max_completion_length,
        max_turn_tokens=opts.max_turn_tokens,
        max_steps=opts.steps,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        report_to="none",
        seed=0,
        bf16=False,
        use_cpu=not torch.cuda.is_available(),
        activation_checkpointing=False,
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        **RECIPE.get(method, {})
        | ({"alignopsd_teacher_max_tokens": opts.max_turn_tokens} if method == "alignopsd" else {})
        | overrides,
    )
    trainer = trainer_cls(
        model=folder,
        args=config,
        train_dataset=env_rows(source, source.make_tasks("train", 256, seed=0, difficulty=0)),
        processing_class=AutoTokenizer.from_pretrained(folder, padding_side="left"),
        env_factory=source.factory,
    )
    if method == "funnel":
        trainer.selection = {row["task_id"]: 1.0 for row in trainer.train_dataset}
        trainer.state_block = lambda row: FUNNEL_STATE
    torch.manual_seed(0)
    start = time.perf_counter()
    trainer.train()
    runtime = next((h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h), None)
    seconds = (runtime if runtime is not None else time.perf_counter() - start) / opts.steps
    final = next((h for h in trainer.state.log_history if LENGTH in h), {})  # one log: means over the run's batches
    extra = {k: final[k] / 2 for k in EXTRA if k in final}  # per generation batch -> per optimizer step (2 per batch)
    return seconds, final.get(LENGTH), extra


def earlier_run(out: Path, opts: argparse.Namespace) -> dict | None:
    """The figures of the result in `out` that this run replaces, if it was measured with the same settings."""
    path = out / "result.json"
    if not path.exists():
        return None
    old = json.loads(path.read_text())
    settings = {k: v for k, v in vars(opts).items() if k != "out"}
    if {k: v for k, v in old.get("settings", {}).items() if k != "out"} != settings:
        return None
    env = old.get("environment", {})
    keep = ("timestamp", "torch_threads", "omp_num_threads", "load_average")
    return {"seconds_per_step": old["measured"]["seconds_per_step"]} | {k: env.get(k) for k in keep}


def report(runs: dict[str, dict], opts: argparse.Namespace, earlier: dict | None = None) -> str:
    """The console text and result.md: the settings line and, per mode (learning, frozen policy), the table of s/step,
    ratios vs GRPO and mean completion lengths, with the earlier run's learning figures beside them when there is one.
    `runs[mode][method]` is `step_seconds`' (s/step, mean completion length)."""
    lines = [
        f"{opts.steps} steps on {opts.env}, model {opts.model}, {opts.batch_size} x 2 rows per generation batch, "
        f"{torch.get_num_threads()} torch thread(s)\n"
    ]
    head = "| method | learning: s/step | ratio vs GRPO | mean length "
    head += "| frozen policy: s/step | ratio vs GRPO | mean length |"
    rule = "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
    if earlier is not None:
        head, rule = head + " earlier run, learning: s/step | ratio vs GRPO |", rule + " ---: | ---: |"
    lines += [head, rule]
    for method in runs["learning"]:
        row = f"| {method} |"
        for mode in ("learning", "frozen"):
            s, length, _ = runs[mode][method]
            row += f" {s:.3f} | {s / runs[mode]['grpo'][0]:.2f} | {'' if length is None else f'{length:.1f}'} |"
        if earlier is not None:
            old = earlier["seconds_per_step"]
            row += f" {old[method]:.3f} | {old[method] / old['grpo']:.2f} |" if method in old else " | |"
        lines.append(row)
    for mode in ("learning", "frozen"):
        for method, (s, _, extra) in runs[mode].items():
            if "alignopsd/teacher_gen_s" in extra:
                gen, fwd = extra["alignopsd/teacher_gen_s"], extra.get("alignopsd/teacher_forward_s", 0.0)
                enc = extra.get("alignopsd/encoder_s", 0.0)
                lines.append(
                    f"\n{method}, {mode}: teacher generation {gen:.3f} s ({gen / s:.0%} of the step), teacher "
                    f"forwards {fwd:.3f} s ({fwd / s:.0%}), encoder {enc:.3f} s per step"
                )
            if "beta_opsd/teacher_forward_seconds" in extra:
                fwd = extra["beta_opsd/teacher_forward_seconds"]
                lines.append(f"\n{method}, {mode}: student and teacher forwards {fwd:.3f} s per step ({fwd / s:.0%})")
            if "funnel/teacher_forward_seconds" in extra:
                fwd = extra["funnel/teacher_forward_seconds"]
                lines.append(
                    f"\n{method}, {mode}: JSD attribution (teacher forwards) {fwd:.3f} s per step ({fwd / s:.0%})"
                )
            if "taspo/teacher_forward_s" in extra:
                lines.append(
                    f"\n{method}, {mode}: teacher pass {extra['taspo/teacher_forward_s']:.3f} s per step "
                    f"({extra['taspo/teacher_forward_s'] / s:.0%} of the step); analyzer "
                    f"{extra.get('taspo/analyzer_calls', 0):.1f} calls, "
                    f"{extra.get('taspo/analyzer_tokens_in', 0):.0f} "
                    f"prompt and {extra.get('taspo/analyzer_tokens_out', 0):.0f} output tokens per step"
                )
    lines.append(
        "\nLearning: each method plays its own episodes (learning rate 1e-3), whose lengths drift apart as the "
        "policies move. Frozen policy: learning rate 0, every method plays the same episodes, so the ratio is the "
        "method's own cost per step. Mean length: tokens per completion (model and environment), averaged over the "
        "run."
    )
    if earlier is not None:
        lines.append(
            f"Earlier run: the result this one replaced, measured {earlier['timestamp']} with "
            f"{earlier['torch_threads']} torch thread(s) (learning only). Absolute times depend on the machine's "
            "load; compare ratios."
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per method")
    parser.add_argument("--env", default="shop", choices=sorted(ENVIRONMENTS))
    parser.add_argument("--model", default="random", help="'random' (tiny, untrained), tiny:<env>, or a folder")
    parser.add_argument("--batch_size", type=int, default=16, help="rows per minibatch (2 minibatches per generation)")
    parser.add_argument("--max_completion_length", type=int, default=128)
    parser.add_argument("--max_turn_tokens", type=int, default=16)
    parser.add_argument(
        "--num_generations", type=int, default=2, help="G (GiGPO and TASPO need groups; 2 is TRL's least)"
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        default=list(METHODS),
        help=f"from {', '.join(METHODS)}, each optionally with settings after '@' (FIELD=VALUE, comma-separated: "
        "'mpo@critic_num_layers=1'); grpo always runs first",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "overhead", help="folder for result.json and result.md")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as workdir:
        if opts.model == "random":
            folder = random_model(opts.env, os.path.join(workdir, "model"))
        else:
            folder = tiny_model(opts.model) if is_tiny(opts.model) else opts.model
        for spec in opts.methods:
            method_spec(spec)  # a misspelt method or setting fails before any run
        one = argparse.Namespace(**{**vars(opts), "steps": 1})
        methods = ["grpo", *(m for m in opts.methods if m != "grpo")]
        warmup = step_seconds("grpo", folder, opts.env, one, workdir)[0]
        rates = {"learning": 1e-3, "frozen": 0.0}
        runs = {
            mode: {m: step_seconds(m, folder, opts.env, opts, workdir, lr) for m in methods}
            for mode, lr in rates.items()
        }
    earlier = earlier_run(opts.out, opts)
    text = report(runs, opts, earlier)
    print("\n" + text)
    seconds = {m: s for m, (s, _, _) in runs["learning"].items()}
    frozen = {m: s for m, (s, _, _) in runs["frozen"].items()}
    measured = {
        "seconds_per_step": seconds,  # learning
        "train_runtime_s": {m: s * opts.steps for m, s in seconds.items()},
        "ratio_vs_grpo": {m: s / seconds["grpo"] for m, s in seconds.items()},
        "mean_completion_length": {m: n for m, (_, n, _) in runs["learning"].items()},
        "per_step": {mode: {m: x for m, (_, _, x) in runs[mode].items() if x} for mode in runs},  # EXTRA metrics
        "frozen_seconds_per_step": frozen,  # learning rate 0: every method plays the same episodes
        "frozen_train_runtime_s": {m: s * opts.steps for m, s in frozen.items()},
        "frozen_ratio_vs_grpo": {m: s / frozen["grpo"] for m, s in frozen.items()},
        "frozen_mean_completion_length": {m: n for m, (_, n, _) in runs["frozen"].items()},
        "warmup_grpo_s": warmup,  # one untimed-for-the-table GRPO step before the measured runs
        "model": folder if opts.model != "random" else "random (temporary folder)",
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "earlier_run": earlier,  # the replaced result's s/step, timestamp and threads (same settings), or None
    }
    written = write_result(opts.out, "overhead", vars(opts) | {"out": str(opts.out)}, measured, text)
    print(f"\nwrote {' and '.join(map(str, written))}", file=sys.stderr)
    return seconds


if __name__ == "__main__":
    main()
