"""Rollout throughput: the project's agent loop against TRL's own `environment_factory` tool loop.

Both loops play the same tool environment (`envs.shop_tools.ShopTools`) with the same model and tokenizer (the tiny
tool-calling model of `envs.shop_tools.tiny_tool_model`, so both play real multi-turn episodes), the same prompts,
the same sampling settings (GRPOConfig defaults: temperature 1, top_p 1, top_k 0) and the same budgets:

* per-turn token cap: `max_turn_tokens=n` (ours) and `generation_kwargs={"max_new_tokens": n}` (TRL);
* turns: `max_turns=K` (ours) and `max_tool_calling_iterations=K-1` (TRL: one first turn plus K-1 post-tool turns);
* all turns together: `max_completion_length` (both).

What is timed is one generation batch of each trainer (`trainers.trl_api.generation_batch`) on the same `--episodes`
rows: the whole rollout phase of a GRPO step (environment reset, prompt rendering, multi-turn generation, tool calls,
reward, padding), without the optimizer step. Ours is `AgentGRPOTrainer(env_factory=lambda row: ToolEnv(ShopTools))`,
whose `rollout_func` runs `trainers/agent_loop.play` (which also computes sampling log-probs); TRL's is
`GRPOTrainer(environment_factory=ShopTools)`. Two more arms show where ours gains: ours sampling through
transformers' `model.generate` instead of its own decode loop (`trainers.generation.sample_tokens`), and ours with
`reuse_kv_cache: false` (each turn prefills the whole context again). The loops alternate `--repeats` times
after one untimed warm-up call each, and the table reports ratios of the median times. Success =
`ShopTools.get_reward() == 1.0` (all five attributes), read from the environment instances of each loop; turns = runs
of model tokens in `completion_mask * tool_mask`, counted the same way for every loop.

The loops sample identically (same seed, same first turns) but do not play identical episodes: a malformed tool call
(invalid JSON, a `name` that is not a string) is an error observation in `ToolEnv`, and the episode goes on, while
TRL's `parse_response` falls back to plain text, which ends the episode. With a weak model ours therefore plays more
turns per episode; the turns/s and model tokens/s columns normalise for that.

The ceiling is model compute without sequential decoding: one no-grad forward of the same model over the last timed
call's whole batch (prompt and completion ids, padded as TRL pads them), in tokens per second of its non-pad tokens.

    HF_HUB_OFFLINE=1 python bench/rollout.py --episodes 64 --repeats 3
    HF_HUB_OFFLINE=1 python bench/rollout.py --model smollm2 --episodes 16 --repeats 3 \\
        --out bench/results/rollout_smollm2

`--model smollm2` plays the real pretrained model (SmolLM2-135M-Instruct, 134.5M parameters, agent_trl/real_model.py)
instead of the tiny tool model, where model compute, not per-operation overhead, dominates. Its own chat template
renders no tools, and TRL's tool loop needs one that does: the bench gives its tokenizer TRL's copy of the Qwen2.5
template (`trl.chat_template_utils.qwen2_5_chat_template`, the same `<|im_start|>`/`<|im_end|>` markers SmolLM2 was
trained with), in a folder of its own beside the converted model (`tool_template_folder`). The model was never taught
this tool-call format, so few of its turns are tool calls and most episodes end after one turn: the comparison is
mostly of the first turn's generation.

Writes bench/results/rollout/result.json (every timed call's seconds, turns, model tokens and rewards per episode,
the warm-up times, the settings, library versions and machine) and result.md (the table above), or into `--out`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402

from bench.record import RESULTS, write_result  # noqa: E402
from trainers.trl_api import generation_batch  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64, help="episodes per timed call (prompts x group size)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per loop, alternating the two loops")
    p.add_argument("--group-size", type=int, default=4, help="num_generations G")
    p.add_argument("--max-turn-tokens", type=int, default=48, help="per-turn new-token cap of both loops")
    p.add_argument("--max-turns", type=int, default=8, help="most assistant turns per episode")
    p.add_argument("--max-completion-length", type=int, default=512, help="token budget of all turns together")
    p.add_argument("--difficulty", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--sft-steps",
        type=int,
        default=None,
        help="SFT steps of the tool model (default: the recipe's 300, about 12-23 minutes to build on a shared 2-core "
        "CPU, then cached; 150 builds in about 5 and plays alike)",
    )
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument(
        "--model",
        default="tiny",
        choices=("tiny", "smollm2"),
        help="tiny: the tiny tool-calling shop model (built and cached); smollm2: the real pretrained model",
    )
    p.add_argument("--out", type=Path, default=RESULTS / "rollout", help="folder for result.json and result.md")
    args = p.parse_args(argv)
    if args.episodes % args.group_size:
        p.error("--episodes must be a multiple of --group-size")
    return args


def turns_and_tokens(out: dict) -> tuple[list[int], list[int]]:
    """Assistant turns (maximal runs of model tokens, `completion_mask * tool_mask`) and model tokens per rollout."""
    mask = out["completion_mask"] * out["tool_mask"]  # (B, T)
    starts = (mask[:, 1:] > mask[:, :-1]).sum(1) + mask[:, 0]  # (B,)
    return starts.tolist(), mask.sum(1).tolist()


OURS, GENERATE_ARM = "agent_loop (ours)", "agent_loop, transformers generate"
NO_REUSE, TRL = "agent_loop, reuse_kv_cache: false", "TRL environment_factory"


@contextlib.contextmanager
def through_generate(active: bool):
    """While active, `hf_generate` finds no cache for its own decode loop and samples with `model.generate`."""
    from trainers import agent_loop

    saved = agent_loop.growing_cache
    if active:
        agent_loop.growing_cache = lambda model: None
    try:
        yield
    finally:
        agent_loop.growing_cache = saved


def bare_forward_tokens_per_s(model, out: dict, repeats: int = 3) -> float:
    """Non-pad tokens per second of one no-grad forward over a rollout batch's prompt and completion ids (best of
    `repeats`): model compute without sequential decoding, the ceiling for a rollout's model tokens per second."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            start = time.perf_counter()
            model(input_ids=ids, attention_mask=mask)
            best = min(best, time.perf_counter() - start)
    return float(mask.sum()) / best


def tool_template_folder() -> str:
    """The real model's converted folder (agent_trl/real_model.py) with TRL's Qwen2.5 chat template on its tokenizer,
    which renders tools: the weights and config linked, the tokenizer saved anew, in the cache beside the model."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    from agent_trl.real_model import real_model

    source = Path(real_model("smollm2"))
    folder = source.parent / f"{source.name}-qwen2.5-template"
    if not (folder / "tokenizer_config.json").is_file():
        folder.mkdir(exist_ok=True)
        for name in ("config.json", "generation_config.json", "model.safetensors"):
            if not (folder / name).exists():
                (folder / name).symlink_to(source / name)
        tokenizer = AutoTokenizer.from_pretrained(source, padding_side="left")
        tokenizer.chat_template = qwen2_5_chat_template
        tokenizer.save_pretrained(folder)
    return str(folder)


def build_trainers(args: argparse.Namespace, folder: str, rows: list[dict]):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from envs.base import ToolEnv
    from envs.shop_tools import ShopTools
    from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

    common = dict(
        per_device_train_batch_size=args.episodes,
        num_generations=args.group_size,
        max_completion_length=args.max_completion_length,
        report_to="none",
        seed=args.seed,
        bf16=False,
        use_cpu=True,
        activation_checkpointing=False,
        save_strategy="no",
        max_steps=1,
    )
    data = Dataset.from_list(rows)

    def agent_trainer(reuse: bool):
        made: list[ToolEnv] = []  # its environments, in creation order (the last `episodes` are the last call's)

        def env_factory(row: dict) -> ToolEnv:
            made.append(ToolEnv(ShopTools, max_turns=args.max_turns))
            return made[-1]

        config = AgentGRPOConfig(
            output_dir="/tmp/bench-ours",
            max_turn_tokens=args.max_turn_tokens,
            max_turns=args.max_turns,
            reuse_kv_cache=reuse,
            **common,
        )
        trainer = AgentGRPOTrainer(model=folder, args=config, train_dataset=data, env_factory=env_factory)
        return trainer, lambda n: [env.instance.get_reward() for env in made[-n:]]

    ours, ours_rewards = agent_trainer(reuse=True)
    via_generate, via_generate_rewards = agent_trainer(reuse=True)
    plain, plain_rewards = agent_trainer(reuse=False)
    trl = GRPOTrainer(
        model=folder,
        args=GRPOConfig(
            output_dir="/tmp/bench-trl",
            generation_kwargs={"max_new_tokens": args.max_turn_tokens},
            max_tool_calling_iterations=args.max_turns - 1,
            **common,
        ),
        train_dataset=data,
        environment_factory=ShopTools,
    )
    torch.testing.assert_close(dict(ours.model.named_parameters()), dict(trl.model.named_parameters()))
    for trainer in (ours, via_generate, plain, trl):
        trainer.model.train()  # rollouts as during training

    def trl_rewards(n: int) -> list[float]:
        return [env.get_reward() for env in trl.environments]

    return {
        OURS: (ours, ours_rewards),
        GENERATE_ARM: (via_generate, via_generate_rewards),
        NO_REUSE: (plain, plain_rewards),
        TRL: (trl, trl_rewards),
    }


def summarise(runs: list[dict], episodes: int) -> dict:
    """Per loop: the timed calls' seconds, episodes/s of their median, and turns, tokens, success and reward over all
    repeats' episodes; plus the two ratios of medians. `runs` holds one record per timed call (see `main`)."""
    loops: dict[str, dict] = {}
    for name in dict.fromkeys(run["loop"] for run in runs):
        mine = [run for run in runs if run["loop"] == name]
        times = [run["seconds"] for run in mine]
        turns = [t for run in mine for t in run["turns"]]
        tokens = [t for run in mine for t in run["model_tokens"]]
        rewards = [r for run in mine for r in run["rewards"]]
        eps = episodes / statistics.median(times)
        loops[name] = {
            "times_s": times,
            "median_s": statistics.median(times),
            "episodes_per_s": eps,
            "turns_per_episode": statistics.mean(turns),
            "turns_per_s": eps * statistics.mean(turns),
            "model_tokens_per_s": eps * statistics.mean(tokens),
            "success": statistics.mean(r == 1.0 for r in rewards),
            "reward": statistics.mean(rewards),
        }
    ours, generate, plain, trl = (loops[name]["episodes_per_s"] for name in (OURS, GENERATE_ARM, NO_REUSE, TRL))
    return {
        "loops": loops,
        "ratio_ours_over_trl": ours / trl,
        "ratio_decode_loop_over_generate": ours / generate,
        "ratio_kv_reuse_over_no_reuse": ours / plain,
    }


def report(summary: dict, args: argparse.Namespace, model: str) -> str:
    """The console text and result.md: settings line, the table, the ratios and the ceiling."""
    lines = [
        f"{args.episodes} episodes x {args.repeats} repeats, G={args.group_size},"
        f" {args.max_turn_tokens} tokens/turn, {args.max_turns} turns, {args.max_completion_length} tokens/episode,"
        f" {args.threads} threads,"
        f" model {Path(model).name}\n",
        "| loop | episodes/s (median) | times (s) | turns/episode | turns/s | model tokens/s | success | reward |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["loops"].items():
        lines.append(
            f"| {name} | {row['episodes_per_s']:.2f} | {', '.join(f'{t:.1f}' for t in row['times_s'])} | "
            f"{row['turns_per_episode']:.2f} | {row['turns_per_s']:.1f} | {row['model_tokens_per_s']:.0f} | "
            f"{row['success']:.3f} | {row['reward']:.3f} |"
        )
    lines.append(f"\nratio of medians (ours / TRL, episodes/s): {summary['ratio_ours_over_trl']:.2f}")
    lines.append(
        f"ratio of medians (own decode loop / transformers generate, episodes/s): "
        f"{summary['ratio_decode_loop_over_generate']:.2f}"
    )
    lines.append(f"ratio of medians (KV reuse / no reuse, episodes/s): {summary['ratio_kv_reuse_over_no_reuse']:.2f}")
    if "ceiling_tokens_per_s" in summary:
        ceiling = summary["ceiling_tokens_per_s"]
        ours = summary["loops"][OURS]["episodes_per_s"] * summary["tokens_per_episode"]
        lines.append(
            f"ceiling (one no-grad forward over a whole rollout batch): {ceiling:.0f} tokens/s; ours goes through its"
            f" episodes' tokens (prompt, model and environment, {summary['tokens_per_episode']:.0f} per episode) at"
            f" {ours:.0f} tokens/s, {ours / ceiling:.1%} of it"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from envs.shop_tools import make_rows, tiny_tool_model

    t0 = time.perf_counter()
    overrides = {} if args.sft_steps is None else {"sft_steps": args.sft_steps}
    if args.model == "smollm2":
        folder = tool_template_folder()
    else:
        folder = tiny_tool_model(difficulty=args.difficulty, seed=args.seed, **overrides)
    build_seconds = time.perf_counter() - t0
    print(f"tool model: {folder} ({build_seconds:.0f} s to build or load)", file=sys.stderr)

    rows = make_rows("eval", args.episodes // args.group_size, seed=args.seed, difficulty=args.difficulty)
    inputs = [row for row in rows for _ in range(args.group_size)]  # RepeatSampler layout: each prompt G times
    loops = build_trainers(args, folder, rows)

    warmup: dict[str, float] = {}
    for name, (trainer, _) in loops.items():  # untimed warm-up: one group each (its time is kept, not compared)
        with through_generate(name == GENERATE_ARM):
            start = time.perf_counter()
            generation_batch(trainer, [dict(x) for x in inputs[: args.group_size]])
            warmup[name] = time.perf_counter() - start

    runs: list[dict] = []  # one record per timed call, in the order they ran
    prompts: dict[str, list[list[int]]] = {}
    names = list(loops)
    for r in range(args.repeats):
        for position, name in enumerate(names if r % 2 == 0 else names[::-1]):  # alternate which loop goes first
            trainer, read_rewards = loops[name]
            torch.manual_seed(args.seed + r)
            with through_generate(name == GENERATE_ARM):
                start = time.perf_counter()
                out = generation_batch(trainer, [dict(x) for x in inputs])
                seconds = time.perf_counter() - start
            if name == names[0]:
                last_ours = out
            episode_turns, episode_tokens = turns_and_tokens(out)
            prompts[name] = [
                ids[m.bool()].tolist() for ids, m in zip(out["prompt_ids"], out["prompt_mask"], strict=True)
            ]
            runs.append(
                {
                    "repeat": r,
                    "position": position,
                    "loop": name,
                    "seconds": seconds,
                    "turns": episode_turns,
                    "model_tokens": episode_tokens,
                    "rewards": read_rewards(len(inputs)),
                }
            )
            print(f"repeat {r}: {name}: {seconds:.2f} s", file=sys.stderr)

    if any(prompts[name] != prompts[names[0]] for name in names):
        raise RuntimeError("the loops rendered different prompt ids")
    summary = summarise(runs, args.episodes)
    summary["ceiling_tokens_per_s"] = bare_forward_tokens_per_s(loops[names[0]][0].model, last_ours)
    summary["tokens_per_episode"] = float(torch.cat([last_ours["prompt_mask"], last_ours["completion_mask"]], 1).sum())
    summary["tokens_per_episode"] /= args.episodes
    text = report(summary, args, folder)
    print("\n" + text)
    measured = {"model": folder, "model_build_seconds": build_seconds, "warmup_s": warmup, "runs": runs, **summary}
    written = write_result(args.out, "rollout", vars(args) | {"out": str(args.out)}, measured, text)
    print(f"\nwrote {' and '.join(map(str, written))}", file=sys.stderr)
    return measured


if __name__ == "__main__":
    main()
