"""DRACO's judge cost and credit statistics per training step, offline: the oracle judge on scripted policies.

    python bench/draco_cost.py [--env shop] [--tasks 16] [--group 6] [--noise 0.5] [--steps 3] [--difficulty 0]
    python bench/draco_cost.py                      # the README's figures: shop, 16 tasks x G = 6, 3 steps

Each step plays `tasks` x `group` rollouts of a noisy expert (each turn is a plausible mistake with probability
`noise`), runs DRACO's judge stages through `rewards.rubrics` exactly as `DRACOTrainer` does (reward, then credit for
the rows with A != 0), and redistributes the group advantages with `trainers.draco.draco_advantages`, with each
step's token count taken as the characters of its action (no tokenizer, no model). It prints one JSON line per step:
judge calls per phase (draco.md §4.1: at most 1 + G + 1 + G + G per group, S1 cached across steps), estimated prompt
and answer tokens (characters / 4, as the oracle counts them), judge wall time, and the rubric and `credit/*` metrics.
What it measures is the machinery's cost and signal under a sound judge, not an LLM judge's latency or price.

Writes bench/results/draco_cost/result.json (every step's metrics, the settings, library versions and machine) and
result.md (a table with one row per step and the per-step ranges the README quotes), or into `--out`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository's packages

from bench.record import RESULTS, write_result  # noqa: E402
from envs import ENVIRONMENTS  # noqa: E402
from envs.base import noisy_expert_episode  # noqa: E402
from rewards.oracle import OracleJudge  # noqa: E402
from rewards.rubrics import DracoReward, RubricPipeline  # noqa: E402
from trainers.credit import credit_metrics  # noqa: E402
from trainers.draco import draco_advantages, draco_citations  # noqa: E402


def group_advantages(rewards: list[float | None], G: int) -> torch.Tensor:
    """TRL's Eq. I-1 with scale_rewards="group": (R - mean) / (Bessel std + 1e-4), unscorable rows excluded, A = 0."""
    r = torch.tensor([float("nan") if x is None else x for x in rewards], dtype=torch.float64).view(-1, G)
    mean = r.nanmean(dim=1, keepdim=True)
    n = (~r.isnan()).sum(dim=1, keepdim=True)
    var = ((r - mean).nan_to_num() ** 2).sum(dim=1, keepdim=True) / (n - 1).clamp(min=1)
    adv = (r - mean) / (var.sqrt() + 1e-4)
    return torch.where(n >= 2, adv, 0.0).nan_to_num().view(-1)


COLUMNS = {  # table column -> metric, after the per-phase judge calls
    "est. prompt tokens": "draco/judge_tokens_in",
    "est. answer tokens": "draco/judge_tokens_out",
    "judge s": "judge_seconds",
    "reward mean": "draco/reward_mean",
    "criteria surviving": "draco/criteria_surviving",
    "fallback rate": "credit/fallback_rate",
    "mult max": "credit/mult_max",
    "conservation residual max": "credit/conservation_residual_max",
}


def report(steps: list[dict], args: argparse.Namespace) -> str:
    """result.md: one row per step (judge calls, in all and per phase, tokens, time, reward and credit metrics), then
    the per-step ranges of judge calls and prompt tokens."""
    prefix = "draco/judge_calls/"
    phases = list(dict.fromkeys(k.removeprefix(prefix) for step in steps for k in step if k.startswith(prefix)))
    lines = [
        f"DRACO judge cost, oracle judge, {args.env}, {args.tasks} tasks x G = {args.group}, noise {args.noise}, "
        f"difficulty {args.difficulty}, seed {args.seed}, {args.steps} steps\n",
        "| step | rows | credited rows | judge calls | "
        + "".join(f"calls: {p} | " for p in phases)
        + " | ".join(COLUMNS)
        + " |",
        "|---|---|---|---|" + "---|" * (len(phases) + len(COLUMNS)),
    ]

    def cell(value: float | None) -> str:
        if value is None:
            return "-"
        return f"{value:.0f}" if float(value).is_integer() else f"{value:.4g}"

    for step in steps:
        cells = [step["step"], step["rows"], step["credited_rows"], step.get("draco/judge_calls")]
        cells += [step.get(prefix + p, 0) for p in phases] + [step.get(m) for m in COLUMNS.values()]
        lines.append("| " + " | ".join(cell(c) for c in cells) + " |")
    calls = [step["draco/judge_calls"] for step in steps]
    tokens = [step["draco/judge_tokens_in"] for step in steps]
    lines.append(
        f"\nPer step: {statistics.mean(calls):.0f} judge calls ({min(calls):.0f}-{max(calls):.0f}), "
        f"{statistics.mean(tokens) / 1000:.0f}k estimated prompt tokens ({min(tokens) / 1000:.0f}k-"
        f"{max(tokens) / 1000:.0f}k)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="shop", choices=sorted(ENVIRONMENTS))
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group", type=int, default=6)
    parser.add_argument("--noise", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--difficulty", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "draco_cost", help="folder for result.json and .md")
    args = parser.parse_args(argv)
    env_cls, rng = ENVIRONMENTS[args.env], random.Random(args.seed)
    tasks = env_cls.make_tasks("train", args.tasks * args.steps, seed=args.seed, difficulty=args.difficulty)
    judge = OracleJudge(tasks)
    pipeline = RubricPipeline(judge)
    reward = DracoReward(pipeline, group_size=args.group)
    recorded: list[dict] = []  # every step's metrics, unrounded (judge_seconds too)
    for step in range(args.steps):
        batch = [t for t in tasks[step * args.tasks : (step + 1) * args.tasks] for _ in range(args.group)]
        transcripts = [noisy_expert_episode(env_cls(t["difficulty"]), t, args.noise, rng)[1] for t in batch]
        start = time.perf_counter()
        metrics: dict[str, float] = {}
        rewards = reward(
            [env_cls(args.difficulty).reset(t) for t in batch],
            [""] * len(batch),
            transcript=transcripts,
            task_id=[t["task_id"] for t in batch],
            log_metric=metrics.__setitem__,
        )
        adv = group_advantages(rewards, args.group)  # (B,)
        todo = [b for b, r in enumerate(reward.last) if adv[b] != 0 and r.verdicts is not None]
        rows = [reward.last[b] for b in todo]
        results = pipeline.credit_many([(r.task, r.transcript, r.criteria, r.verdicts, r.evidence) for r in rows])
        elapsed = time.perf_counter() - start
        K = max(len(t) for t in transcripts)
        C = max(len(r.criteria) for r in reward.last)
        verdicts = torch.zeros(len(batch), C, dtype=torch.long)
        steps: list[list[list[int]]] = [[] for _ in batch]
        failed = torch.zeros(len(batch), dtype=torch.bool)
        for b, res in zip(todo, results, strict=True):
            if res is None:
                failed[b] = True
            else:
                verdicts[b, : len(res.verdicts)] = torch.tensor(res.verdicts)
                steps[b] = res.steps
        lengths = [[max(1, len(turn["action"])) for turn in t] for t in transcripts]
        T = max(sum(n) + len(n) for n in lengths)
        turn_index = torch.full((len(batch), T), -1)
        turn_valid = torch.zeros(len(batch), K, dtype=torch.bool)
        for b, ns in enumerate(lengths):
            pos = 0
            for k, n in enumerate(ns):
                turn_index[b, pos : pos + n] = k
                pos += n + 1  # one environment token between steps
            turn_valid[b, : len(ns)] = True
        reasons = ["judge_failure" if f else None for f in failed.tolist()]
        out = draco_advantages(adv, turn_index, turn_valid, verdicts, draco_citations(steps, K, C), failed, reasons)
        metrics |= credit_metrics(out, adv, turn_index, turn_valid)
        metrics |= pipeline.metrics() | judge.metrics(prefix="draco/judge_", reset=True)
        metrics |= {"step": step, "judge_seconds": round(elapsed, 3), "credited_rows": len(todo), "rows": len(batch)}
        keep = ("step", "rows", "credited_rows", "judge_seconds", "draco/judge_calls", "draco/judge_tokens_in")
        keep += ("draco/judge_tokens_out", "draco/reward_mean", "draco/criteria_surviving", "credit/fallback_rate")
        keep += ("credit/mult_max", "credit/conservation_residual_max")
        shown = {k: v for k, v in metrics.items() if k in keep or k.startswith("draco/judge_calls/")}
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in shown.items()}))
        recorded.append(metrics | {"judge_seconds": elapsed})
    text = report(recorded, args)
    written = write_result(args.out, "draco_cost", vars(args) | {"out": str(args.out)}, {"steps": recorded}, text)
    print(f"wrote {' and '.join(map(str, written))}", file=sys.stderr)
    return recorded


if __name__ == "__main__":
    main()
