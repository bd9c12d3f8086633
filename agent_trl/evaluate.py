"""Evaluate a trained agent: `python -m agent_trl.evaluate --config RUN.yaml --model FOLDER [--samples K] [--out DIR]`.

    python -m agent_trl.evaluate --config configs/quickstart.yaml --model runs/quickstart --samples 8
    python -m agent_trl.evaluate --config configs/my_run.yaml --model runs/my_run/checkpoint-100 --no_greedy
    python -m agent_trl.evaluate --config configs/dataset_quickstart.yaml --model runs/dataset_quickstart --samples 4

`--model` is a model folder, a checkpoint folder, a LoRA adapter folder (adapter_config.json: its base is loaded and
the adapter applied with peft, unmerged, as the trainer evaluates it) or any name the trainer accepts (`tiny:<env>`,
`tiny`, a Hub id); default: the config's `model_name_or_path`. Every field of `python train.py` is read as training
reads it (`train.parse`, `load_sources`): the environment or dataset, the held-out tasks (`num_eval_tasks`, the
eval split), the episode budgets and the sampling settings, so the numbers are those of train.py's held-out
evaluation (`agent_trl.evaluation`), with K sampled episodes (or completions, single-turn) per task and one greedy.

Reported, sampled and greedy: success, reward, turns, and per k = 1, 2, 4, ... up to K (and K):
1. pass@k, the chance that at least one of k episodes of a task succeeds: per task 1 - C(n-c, k) / C(n, k) for c
   successes in n = K episodes (the unbiased estimator of https://huggingface.co/papers/2107.03374), averaged over
   tasks; pass@1 is the success rate;
2. pass^k, the chance that all k succeed: per task C(c, k) / C(n, k) (https://huggingface.co/papers/2406.12045),
   averaged; pass^K is train.py's `pass^K`.
A single-turn completion succeeds when every reward function is positive (`agent_trl.evaluation.prompt_outcomes`,
as train.py).

Written into `--out` (default `<model folder>/evaluation/`; `runs/evaluation/<name>` for a name that is no folder):
`evaluation.json` (every number, the settings, the model, the versions), `transcripts.jsonl` (one line per episode)
and `evaluation.png` (pass@k and pass^k against k). Left out: quantized loading (the model loads in `dtype`, default
float32) and vLLM; episodes sample with the temperature only, as train.py's held-out evaluation does.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from functools import partial

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed  # noqa: E402
from trl import TrlParser  # noqa: E402

import train  # noqa: E402
from agent_trl.config_file import join_negative_numbers  # noqa: E402
from agent_trl.evaluation import (  # noqa: E402  # noqa: E402
    evaluation_metrics,
    loop_settings,
    play_tasks,
    prompt_metrics,
    prompt_outcomes,
    prompt_sampling,
    score_prompts,
)
from agent_trl.preflight import model_problem  # noqa: E402
from agent_trl.real_model import is_real  # noqa: E402
from agent_trl.resume import checkpoints  # noqa: E402
from agent_trl.run_info import resolve_model, versions  # noqa: E402
from agent_trl.sources import Sources, load_sources  # noqa: E402
from envs.tiny import is_tiny  # noqa: E402

FILES = ("evaluation.json", "transcripts.jsonl", "evaluation.png")


@dataclass
class EvaluateArguments:
    model: str | None = field(
        default=None,
        metadata={
            "help": "What to evaluate: a model or checkpoint folder (runs/x, runs/x/checkpoint-100), a LoRA adapter "
            "folder (its base is loaded, offline), or a name the trainer accepts (tiny:<env>, tiny, a Hub id). "
            "Default: the config's model_name_or_path."
        },
    )
    samples: int | None = field(
        default=None,
        metadata={
            "help": "Sampled episodes (single-turn: completions) per task; pass@k and pass^k for k = 1, 2, 4, "
            "... up to it. Default: the config's eval_samples."
        },  # fmt: skip
    )
    out: str | None = field(
        default=None,
        metadata={"help": "Output folder. Default: <model folder>/evaluation (runs/evaluation/<name> otherwise)."},
    )
    greedy: bool = field(default=True, metadata={"help": "One greedy episode per task as well (--no_greedy: none)."})


# --------------------------------------------------------------------------------------------------------------------
# 1. The estimators


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task with `c` successes in `n` episodes: the chance that k of them drawn without
    replacement hold at least one success, Eq. 1 of https://huggingface.co/papers/2107.03374."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)  # Eq. 1: 1 - C(n-c, k) / C(n, k)


def pass_hat_k(n: int, c: int, k: int) -> float:
    """pass^k of one task with `c` successes in `n` episodes: the chance that k of them drawn without replacement all
    succeed, C(c, k) / C(n, k) (the pass^k of tau-bench, https://huggingface.co/papers/2406.12045)."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass^k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return math.comb(c, k) / math.comb(n, k)


def k_values(n: int) -> list[int]:
    """1, 2, 4, ... up to `n`, and `n` itself."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


def pass_curves(counts: list[int], n: int) -> dict[str, dict[str, float]]:
    """pass@k and pass^k, each averaged over tasks, of tasks with `counts` successes in `n` episodes each; keyed by k
    as text (JSON keys)."""
    ks = k_values(n)
    mean = lambda f, k: sum(f(n, c, k) for c in counts) / len(counts)  # noqa: E731
    return {
        "pass@k": {str(k): mean(pass_at_k, k) for k in ks},
        "pass^k": {str(k): mean(pass_hat_k, k) for k in ks},
    }


# --------------------------------------------------------------------------------------------------------------------
# 2. Start-up: arguments, the model folder, the output folder


def parse(argv: list[str] | None = None):
    """(EvaluateArguments, RunArguments, trainer config, ModelConfig): this command's options, then everything else
    exactly as `python train.py` parses it (`--config`, the source, budget and sampling fields)."""
    argv = join_negative_numbers(sys.argv[1:] if argv is None else argv)
    own = TrlParser((EvaluateArguments,), allow_abbrev=False, prog="python -m agent_trl.evaluate")
    if any(a in ("-h", "--help") for a in argv):
        own.print_help()
        print("\nEvery field of python train.py is read as training reads it:\n")
        train.parse(argv)  # prints the run's, the trainer's and the model's fields, and exits
    args, rest = own.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    run, config, model_args, _ = train.parse(rest)
    return args, run, config, model_args


def check_model(name: str) -> str | None:
    """Stops with a message when `name` cannot be evaluated, before anything is loaded; returns the base model of a
    LoRA adapter folder (None for anything else)."""
    if is_tiny(name) or is_real(name):
        if problem := model_problem(name):
            raise SystemExit(f"error: {problem}")
        return None
    path = os.path.expanduser(name)
    if not os.path.exists(path):
        problem = model_problem(name)  # a Hub id: in the local cache, or allowed to download
        if problem or name.startswith(("/", "./", "../", "~")):
            raise SystemExit(f"error: model {name!r} does not exist (no such folder, nor a Hub model found offline)")
        return None
    if not os.path.isdir(path):
        raise SystemExit(f"error: model {name!r} is a file; give the folder the model was saved in")
    if not os.access(path, os.R_OK | os.X_OK):
        raise SystemExit(f"error: model folder {name!r} cannot be read (permissions)")
    adapter = os.path.join(path, "adapter_config.json")
    if os.path.isfile(adapter):
        base = read_json(adapter, name).get("base_model_name_or_path")
        if not base:
            raise SystemExit(f"error: LoRA adapter {name!r}: adapter_config.json names no base_model_name_or_path")
        if problem := model_problem(base):  # a folder that is gone, a Hub id missing from the offline cache
            raise SystemExit(
                f"error: LoRA adapter {name!r}: its base model {base!r} cannot be found offline ({problem}); evaluate "
                "where the base is, or point base_model_name_or_path in adapter_config.json at a copy"
            )
        return base
    if os.path.isfile(os.path.join(path, "config.json")):
        read_json(os.path.join(path, "config.json"), name)
        return None
    found = checkpoints(path)
    hint = f"; it holds checkpoints: give one, e.g. {os.path.join(name, os.path.basename(found[-1]))}" if found else ""
    raise SystemExit(f"error: model folder {name!r} has no config.json or adapter_config.json (no saved model){hint}")


def read_json(path: str, name: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"error: model {name!r}: {os.path.basename(path)} cannot be read ({e})") from e
    if not isinstance(data, dict):
        raise SystemExit(f"error: model {name!r}: {os.path.basename(path)} is not a JSON object")
    return data


def output_folder(out: str | None, name: str) -> str:
    """`out`, else `<model folder>/evaluation`, else `runs/evaluation/<name>`; created and checked writable."""
    if out is None:
        folder = os.path.expanduser(name)
        out = os.path.join(folder, "evaluation") if os.path.isdir(folder) else os.path.join(
            "runs", "evaluation", re.sub(r"[^A-Za-z0-9_.-]", "-", name)
        )  # fmt: skip
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out):
            pass
    except OSError as e:
        raise SystemExit(f"error: output folder {out!r} cannot be written ({e}); choose another with --out") from e
    return out


# --------------------------------------------------------------------------------------------------------------------
# 3. Loading and playing


def load_model(name: str, folder: str, base: str | None, dtype: str, device: str):
    """(model, tokenizer): `folder` itself, or the adapter `folder` applied to `base` (unmerged)."""
    try:
        if base is None:
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
            tokenizer_folder = folder
        else:
            from peft import PeftModel

            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=dtype), folder)
            saved = ("tokenizer.json", "tokenizer_config.json")  # the trainer saves the tokenizer with the adapter
            tokenizer_folder = folder if any(os.path.isfile(os.path.join(folder, f)) for f in saved) else base
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, padding_side="left")
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise SystemExit(f"error: model {name!r} cannot be loaded: {type(e).__name__}: {e}") from e
    return model.to(device), tokenizer


def episode_records(rollouts, tasks: list[dict], samples: int, mode: str) -> list[dict]:
    """One transcripts.jsonl line per episode of `play_tasks` (task-major)."""
    return [
        {
            "mode": mode,
            "task_index": j // samples,
            "task_id": tasks[j // samples].get("task_id", j // samples),
            "sample": j % samples,
            "success": r.success,
            "reward": r.env_reward,
            "turns": len(r.turn_rewards),
            "truncated": r.truncated,
            "first_observation": r.prompt_messages[-1]["content"] if r.prompt_messages else None,
            "transcript": r.transcript,  # per turn: action, observation, reward, invalid
        }
        for j, r in enumerate(rollouts)
    ]


def evaluate_mode(model, tokenizer, sources: Sources, run, config, samples: int, greedy: bool):
    """(numbers, transcripts, successes per task) of `samples` episodes per held-out task, sampled with the config's
    settings or greedy: the numbers train.py reports (`evaluation_metrics` / `prompt_metrics`) plus turns, pass@k and
    pass^k."""
    tasks, mode = sources.eval_rows, "greedy" if greedy else "sampled"
    if sources.environment is not None:
        factory = partial(sources.environment.factory, {})
        kw = dict(settings=loop_settings(config), batch_size=run.eval_batch_size, samples=samples)
        kw["system_prompt"] = run.system_prompt
        rollouts = play_tasks(model, tokenizer, factory, tasks, temperature=config.temperature, greedy=greedy, **kw)
        numbers = evaluation_metrics(rollouts, tasks, samples)  # the keys of train.py's held-out numbers
        records = episode_records(rollouts, tasks, samples, mode)
    else:
        funcs = sources.reward_funcs
        weights = torch.tensor(config.reward_weights or [1.0] * len(funcs), dtype=torch.float64)
        sampling = {"greedy": True} if greedy else prompt_sampling(config)
        texts, scores = score_prompts(model, tokenizer, tasks, funcs, config.max_completion_length, **sampling,
                                      batch_size=run.eval_batch_size, samples=samples)  # fmt: skip
        success, reward = prompt_outcomes(scores, weights, run.success_threshold)  # (N * samples,), (N * samples,)
        numbers = {**prompt_metrics(scores, weights, funcs, samples, run.success_threshold), "turns": 1.0}
        names = [getattr(f, "__name__", f"reward_{i}") for i, f in enumerate(funcs)]
        records = [
            {
                "mode": mode,
                "task_index": j // samples,
                "task_id": tasks[j // samples].get("task_id", j // samples),
                "sample": j % samples,
                "success": bool(success[j]),
                "reward": float(reward[j]),
                "rewards": {n: None if math.isnan(v) else v for n, v in zip(names, scores[j].tolist(), strict=True)},
                "turns": 1,
                "prompt": tasks[j // samples]["prompt"],
                "transcript": [{"action": text, "observation": None, "reward": float(reward[j])}],
            }
            for j, text in enumerate(texts)
        ]
    counts = [sum(r["success"] for r in records[i * samples : (i + 1) * samples]) for i in range(len(tasks))]
    numbers = {**numbers, **pass_curves(counts, samples), "tasks": len(tasks), "episodes": len(records)}
    return numbers, records, counts


# --------------------------------------------------------------------------------------------------------------------
# 4. Report


def plot_pass_curves(result: dict, path: str, title: str) -> None:
    """pass@k (rising) and pass^k (falling) against k, sampled success marked at k = 1, greedy success as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sampled = result["sampled"]
    ks = [int(k) for k in sampled["pass@k"]]
    fig, ax = plt.subplots(figsize=(5.0, 3.6))
    ax.plot(ks, list(sampled["pass@k"].values()), "o-", label="pass@k (any of k succeeds)")
    ax.plot(ks, list(sampled["pass^k"].values()), "s-", label="pass^k (all k succeed)")
    ax.plot([1], [sampled["success"]], "k*", ms=11, label=f"sampled success {sampled['success']:.3f}")
    if "greedy" in result:
        greedy = result["greedy"]["success"]
        ax.axhline(greedy, color="gray", ls="--", label=f"greedy success {greedy:.3f}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_ylim(-0.02, 1.02)
    ax.set_xlabel("k (episodes per task)")
    ax.set_ylabel("fraction of tasks")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table(result: dict) -> str:
    """The printed summary: success, reward and turns per mode, then pass@k and pass^k per k."""
    modes = [m for m in ("sampled", "greedy") if m in result]
    lines = [f"{'':10}{'success':>9}{'reward':>9}{'turns':>8}"]
    lines += [f"{m:10}{result[m]['success']:9.3f}{result[m]['reward']:9.3f}{result[m]['turns']:8.2f}" for m in modes]
    curves = result["sampled"]
    lines.append(f"{'k':10}" + "".join(f"{k:>8}" for k in curves["pass@k"]))
    for key in ("pass@k", "pass^k"):
        lines.append(f"{key:10}" + "".join(f"{v:8.3f}" for v in curves[key].values()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args, run, config, model_args = parse(argv)
    samples = run.eval_samples if args.samples is None else args.samples
    problems = [
        f"{what} must be >= 1, got {value}"
        for what, value in [("--samples" if args.samples is not None else "eval_samples", samples),
                            ("eval_batch_size", run.eval_batch_size), ("num_eval_tasks", run.num_eval_tasks)]
        if value < 1
    ]  # fmt: skip
    if problems:
        raise SystemExit("error: " + "; ".join(problems))
    if (run.environment is None or run.environment.lower() == "none") and run.dataset_name is None:
        raise SystemExit(
            "error: nothing to evaluate on: give an environment (--environment shop, ...) or a dataset "
            "(--dataset_name FILE with --reward_funcs), or the training config (--config configs/quickstart.yaml)"
        )
    name = args.model or model_args.model_name_or_path
    if not name:
        raise SystemExit("error: give the model to evaluate: --model FOLDER (a run's output_dir, a checkpoint, a LoRA "
                         "adapter) or a name such as tiny:shop")  # fmt: skip
    base = check_model(name)
    out = output_folder(args.out, name)
    start = time.time()
    try:
        sources = load_sources(run, config)
    except ValueError as e:  # e.g. an environment refusing a difficulty
        raise SystemExit(f"error: {e}") from e
    folder = resolve_model(name, run, sources)
    base = resolve_model(base, run, sources) if base is not None else None
    device = "cuda" if torch.cuda.is_available() and not config.use_cpu else "cpu"
    dtype = model_args.dtype or "float32"  # as train.py loads the model it trains
    model, tokenizer = load_model(name, folder, base, dtype, device)
    each = f"{samples} sampled {'episodes' if sources.environment else 'completions'} each"
    print(f"evaluating {name} on {sources.described}: {len(sources.eval_rows)} held-out tasks, {each}"
          f"{', and one greedy' if args.greedy else ''}")  # fmt: skip

    set_seed(config.seed)
    result = {"model": name, "model_folder": folder, "adapter_base": base, "data": sources.described}
    result["environment"] = sources.environment.name if sources.environment else None
    result["settings"] = {
        "samples": samples,
        "ks": k_values(samples),
        "greedy": args.greedy,
        "seed": config.seed,
        # episodes sample with the temperature only, as train.py's held-out evaluation; a dataset with all three
        **(prompt_sampling(config) if sources.environment is None else {"temperature": config.temperature}),
        **asdict(loop_settings(config)),
        "batch_size": run.eval_batch_size,
        "reward_weights": config.reward_weights,
        "dtype": dtype,
        "device": device,
    }
    result["sampled"], transcripts, counts = evaluate_mode(model, tokenizer, sources, run, config, samples, False)
    per_task = [{"task_id": t.get("task_id", i), "successes": c, "episodes": samples}
                for i, (t, c) in enumerate(zip(sources.eval_rows, counts, strict=True))]  # fmt: skip
    if args.greedy:
        result["greedy"], greedy_transcripts, solved = evaluate_mode(model, tokenizer, sources, run, config, 1, True)
        transcripts += greedy_transcripts
        for row, c in zip(per_task, solved, strict=True):
            row["greedy_success"] = bool(c)
    result["per_task"] = per_task
    result["run"], result["versions"] = asdict(run), versions()
    result["wall_seconds"] = round(time.time() - start, 1)

    with open(os.path.join(out, "evaluation.json"), "w") as f:
        json.dump(result, f, indent=2, default=str)
    with open(os.path.join(out, "transcripts.jsonl"), "w") as f:
        f.writelines(json.dumps(r, default=str) + "\n" for r in transcripts)
    where = f"{sources.environment.name} tasks" if sources.environment else run.dataset_name
    plot_pass_curves(result, os.path.join(out, "evaluation.png"), f"{name} on {where} ({samples} samples per task)")
    print(f"\n{table(result)}")
    print(f"wrote {', '.join(os.path.join(out, f) for f in FILES)}")
    return result


if __name__ == "__main__":
    main()
