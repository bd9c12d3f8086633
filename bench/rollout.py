"""Rollout throughput: the project's agent loop against TRL's own `environment_factory` tool loop.

Both loops play the same tool environment (`envs.shop_tools.ShopTools`) with the same model and tokenizer (the tiny
tool-calling model of `envs.shop_tools.tiny_tool_model`, so both play real multi-turn episodes), the same prompts,
the same sampling settings (GRPOConfig defaults: temperature 1, top_p 1, top_k 0) and the same budgets:

* per-turn token cap: `max_turn_tokens=n` (ours) and `generation_kwargs={"max_new_tokens": n}` (TRL);
* turns: `max_turns=K` (ours) and `max_tool_calling_iterations=K-1` (TRL: one first turn plus K-1 post-tool turns);
* all turns together: `max_completion_length` (both).

What is timed is one call of each trainer's `_generate_and_score_completions` on the same `--episodes` rows: the
whole rollout phase of a GRPO step (environment reset, prompt rendering, multi-turn generation, tool calls, reward,
padding), without the optimizer step. Ours is `AgentGRPOTrainer(env_factory=lambda row: ToolEnv(ShopTools))`, whose
`rollout_func` runs `trainers/agent_loop.play` (which also computes sampling log-probs); TRL's is
`GRPOTrainer(environment_factory=ShopTools)`. A third arm is ours with `reuse_kv_cache: false` (each turn prefills
the whole context again), to show what keeping the KV cache across turns buys. The loops alternate `--repeats` times
after one untimed warm-up call each, and the table reports ratios of the median times. Success =
`ShopTools.get_reward() == 1.0` (all five attributes), read from the environment instances of each loop; turns = runs
of model tokens in `completion_mask * tool_mask`, counted the same way for every loop.

The loops sample identically (same seed, same first turns) but do not play identical episodes: a malformed tool call
(invalid JSON, a `name` that is not a string) is an error observation in `ToolEnv`, and the episode goes on, while
TRL's `parse_response` falls back to plain text, which ends the episode. With a weak model ours therefore plays more
turns per episode; the turns/s and model tokens/s columns normalise for that.

    HF_HUB_OFFLINE=1 python bench/rollout.py --episodes 64 --repeats 3
"""

from __future__ import annotations

import argparse
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
    args = p.parse_args(argv)
    if args.episodes % args.group_size:
        p.error("--episodes must be a multiple of --group-size")
    return args


def turns_and_tokens(out: dict) -> tuple[list[int], list[int]]:
    """Assistant turns (maximal runs of model tokens, `completion_mask * tool_mask`) and model tokens per rollout."""
    mask = out["completion_mask"] * out["tool_mask"]  # (B, T)
    starts = (mask[:, 1:] > mask[:, :-1]).sum(1) + mask[:, 0]  # (B,)
    return starts.tolist(), mask.sum(1).tolist()


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
    for trainer in (ours, plain, trl):
        trainer.model.train()  # rollouts as during training

    def trl_rewards(n: int) -> list[float]:
        return [env.get_reward() for env in trl.environments]

    return {
        "agent_loop (ours)": (ours, ours_rewards),
        "agent_loop, reuse_kv_cache: false": (plain, plain_rewards),
        "TRL environment_factory": (trl, trl_rewards),
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from envs.shop_tools import make_rows, tiny_tool_model

    t0 = time.perf_counter()
    overrides = {} if args.sft_steps is None else {"sft_steps": args.sft_steps}
    folder = tiny_tool_model(difficulty=args.difficulty, seed=args.seed, **overrides)
    print(f"tool model: {folder} ({time.perf_counter() - t0:.0f} s to build or load)", file=sys.stderr)

    rows = make_rows("eval", args.episodes // args.group_size, seed=args.seed, difficulty=args.difficulty)
    inputs = [row for row in rows for _ in range(args.group_size)]  # RepeatSampler layout: each prompt G times
    loops = build_trainers(args, folder, rows)

    for trainer, _ in loops.values():  # untimed warm-up: one group each
        trainer._generate_and_score_completions([dict(x) for x in inputs[: args.group_size]])

    times: dict[str, list[float]] = {name: [] for name in loops}
    turns: dict[str, list[int]] = {name: [] for name in loops}
    tokens: dict[str, list[int]] = {name: [] for name in loops}
    rewards: dict[str, list[float]] = {name: [] for name in loops}
    prompts: dict[str, list[list[int]]] = {}
    names = list(loops)
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:  # alternate which loop goes first
            trainer, read_rewards = loops[name]
            torch.manual_seed(args.seed + r)
            start = time.perf_counter()
            out = trainer._generate_and_score_completions([dict(x) for x in inputs])
            times[name].append(time.perf_counter() - start)
            episode_turns, episode_tokens = turns_and_tokens(out)
            turns[name] += episode_turns
            tokens[name] += episode_tokens
            prompts[name] = [
                ids[m.bool()].tolist() for ids, m in zip(out["prompt_ids"], out["prompt_mask"], strict=True)
            ]
            rewards[name] += read_rewards(len(inputs))
            print(f"repeat {r}: {name}: {times[name][-1]:.2f} s", file=sys.stderr)

    if any(prompts[name] != prompts[names[0]] for name in names):
        raise RuntimeError("the loops rendered different prompt ids")
    eps = {name: args.episodes / statistics.median(times[name]) for name in names}
    ours_name, plain_name, trl_name = names
    print(
        f"\n{args.episodes} episodes x {args.repeats} repeats, G={args.group_size},"
        f" {args.max_turn_tokens} tokens/turn, {args.max_turns} turns, {args.max_completion_length} tokens/episode,"
        f" {args.threads} threads,"
        f" model {Path(folder).name}\n"
    )
    print("| loop | episodes/s (median) | times (s) | turns/episode | turns/s | model tokens/s | success | reward |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        mean_turns, mean_tokens = statistics.mean(turns[name]), statistics.mean(tokens[name])
        print(
            f"| {name} | {eps[name]:.2f} | {', '.join(f'{t:.1f}' for t in times[name])} | {mean_turns:.2f} | "
            f"{eps[name] * mean_turns:.1f} | {eps[name] * mean_tokens:.0f} | "
            f"{statistics.mean(r == 1.0 for r in rewards[name]):.3f} | {statistics.mean(rewards[name]):.3f} |"
        )
    print(f"\nratio of medians (ours / TRL, episodes/s): {eps[ours_name] / eps[trl_name]:.2f}")
    print(f"ratio of medians (KV reuse / no reuse, episodes/s): {eps[ours_name] / eps[plain_name]:.2f}")


if __name__ == "__main__":
    main()
