"""Train-sampler log-prob gap with and without MoE routing replay (R3), and the memory of the stored routes.

    OMP_NUM_THREADS=1 python bench/routing_gap.py                        # random tiny Qwen3-MoE, no SFT (fast)
    OMP_NUM_THREADS=1 python bench/routing_gap.py --model tiny-moe:shop  # the SFT-warm-started default (built once)

Two short GRPO runs on the shop environment, same seed and data, `routing_replay` true and false. Each generation
batch is trained on for `--lag` optimizer steps (`steps_per_generation = lag`, GA = 1), so the policy lags the sampler
by 0 .. lag-1 updates. Rewards: the environment's plus a dense shaping term (distinct characters), so the policy
moves in a few steps; the MoE load-balancing loss is off in both runs (replay forces it off, D10). Measured
(docs/methods/routing-replay.md):

1. `routing/logp_gap` (Eq. 10): mean |old-policy log-prob - sampler log-prob| over model tokens, the old pass at the
   behaviour weights, as the trainer logs it.
2. The lagged gap: before each micro-step's loss, mean |log pi_theta - q| over model tokens, with the recorded routes
   replayed and with free routing, at the same weights on the same batch (replay run), plus free routing in the run
   without replay. At lag 0 this is Eq. 10 again; later lags add the policy's own updates (the ratio's numerator).
3. The flip rate (Eq. 9) of free routing against the record at those weights, the mean |replayed - free| log-prob
   (routing's own share of the drift), and the record size (Eq. 8).

Limits: CPU and fp32 only (no bf16 here): sampler and trainer are the same fp32 model, so at lag 0 the gap is float
noise with or without replay. The bf16-sampler vs fp32-trainer gap that R3 targets is measured by bench/gpu_check.sh
on a GPU. A tiny model's numbers say nothing about a 30B MoE; compare replay on vs off within one setting.

Writes bench/results/routing_gap/result.json (both runs: every micro-step's gap, flip rate and routing share per lag,
every logged `routing/logp_gap`, the settings, library versions and machine) and result.md (the tables), or into
`--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from bench.record import RESULTS, write_result  # noqa: E402
from envs import ENVIRONMENTS  # noqa: E402
from envs.tiny import CHAT_TEMPLATE, TinySpec, build_model, build_tokenizer, demonstrations, tiny_model  # noqa: E402
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, env_reward  # noqa: E402
from trainers.routing_replay import RouteRecorder, find_routers, replay_routes, routing_flips  # noqa: E402
from trainers.trl_api import TRLSeams  # noqa: E402

REFERENCE_MODELS = {  # (MoE layers L, experts per token k), from the public configs; Eq. 8 only, not measured
    "Qwen3-30B-A3B": (48, 8),
    "Mixtral-8x7B": (32, 2),
    "OLMoE-1B-7B": (16, 8),
}


def random_tiny_moe(env: str, folder: str) -> str:
    """A random tiny Qwen3-MoE (no SFT) with routers drawn from N(0, 0.5), as in the tests."""
    env_cls = ENVIRONMENTS[env]
    texts = [CHAT_TEMPLATE] + [m["content"] for d in demonstrations(env_cls, 200, 0, 0, 0.3) for m in d]
    tokenizer = build_tokenizer(texts)
    model = build_model(TinySpec(env=env, moe=True), tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in find_routers(model).modules:
            router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def distinct_chars(completions, **kwargs) -> list[float]:
    """Dense shaping reward (weight 1 next to the environment's), so that groups have spread and the policy moves even
    when a random tiny model never succeeds."""
    return [len(set(str(c))) / (1 + len(str(c))) for c in completions]


def run(folder: str, env: str, replay: bool, args: argparse.Namespace, out_dir: str) -> dict:
    env_cls = ENVIRONMENTS[env]
    tasks = env_cls.make_tasks("train", 64, seed=0)
    data = Dataset.from_list(
        [{"prompt": env_cls().reset(t), "task": json.dumps(t), "task_id": t["task_id"]} for t in tasks]
    )
    config = AgentGRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=args.batch, num_generations=args.group,
        steps_per_generation=args.lag, max_steps=args.steps, max_completion_length=128, max_turn_tokens=16,
        learning_rate=args.lr, lr_scheduler_type="constant", report_to="none", seed=0, bf16=False, use_cpu=True,
        activation_checkpointing=False, save_strategy="no", logging_steps=1, disable_dropout=True, top_k=0,
        routing_replay=replay, disable_tqdm=True,
        router_aux_loss_coef=0.0,  # both runs: replay forces it to 0 (D10), so the run without replay matches
    )  # fmt: skip
    trainer = AgentGRPOTrainer(
        model=folder, reward_funcs=[env_reward, distinct_chars], args=config, train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(folder, padding_side="left"), env_factory=lambda row: env_cls(),
    )  # fmt: skip
    policy = trainer.accelerator.unwrap_model(trainer.model)
    routers = find_routers(policy)
    lagged = defaultdict(lambda: defaultdict(list))  # {"replay" | "free" | "flip": {lag: [values]}}
    micro_step = {"lag": 0}
    generate_and_score = trainer.generate_and_score

    def generation(inputs):
        micro_step["lag"] = 0
        return generate_and_score(inputs)

    compute_loss = trainer.micro_batch_loss

    def measured(model, inputs):  # before the loss: the same weights, replayed and free
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # (B, S)
        attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (B, S)
        T = inputs["completion_ids"].size(1)
        mask = trainer.loss_mask(inputs).bool()  # (B, T) model tokens
        q = inputs["sampling_per_token_logps"]  # (B, T)
        lag = micro_step["lag"]
        with torch.no_grad():
            with trainer.free_routing(), RouteRecorder(policy) as recorder:
                free = TRLSeams.token_logps(trainer, policy, input_ids, attention, T)[0]
            lagged["free"][lag].append((free - q)[mask].abs().mean().item())  # Eq. 10 form, one micro-batch
            if "routing" in inputs:
                with replay_routes(policy, inputs["routing"], attention):  # Eq. 3
                    replayed = TRLSeams.token_logps(trainer, policy, input_ids, attention, T)[0]
                lagged["replay"][lag].append((replayed - q)[mask].abs().mean().item())
                lagged["routing"][lag].append((replayed - free)[mask].abs().mean().item())  # routing's own share
                rows = mask.any(1, keepdim=True)  # (B, 1) rows bearing model tokens
                flip, _ = routing_flips(inputs["routing"], recorder.indices(len(input_ids)), attention.bool() & rows)
                lagged["flip"][lag].append(flip.item())  # Eq. 9
        micro_step["lag"] += 1
        return compute_loss(model, inputs)

    trainer.generate_and_score = generation
    trainer.micro_batch_loss = measured
    start = time.time()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "routing/logp_gap" in h]
    sizes = [h for h in trainer.state.log_history if "routing/record_mb" in h]
    return {
        "seconds": time.time() - start,
        "eq10_gap": sum(h["routing/logp_gap"] for h in logs) / max(1, len(logs)),
        "eq10_gap_logged": [h["routing/logp_gap"] for h in logs],  # every logged step's value
        "lagged": {kind: {lag: sum(v) / len(v) for lag, v in sorted(d.items())} for kind, d in lagged.items()},
        "lagged_values": {kind: dict(sorted(d.items())) for kind, d in lagged.items()},  # every micro-step's value
        "bytes_per_token": sizes[0]["routing/record_bytes_per_token"] if sizes else None,
        "record_mb": sum(h["routing/record_mb"] for h in sizes) / max(1, len(sizes)),
        "routers": (len(routers.modules), routers.top_k),
        "success": [h.get("env/success") for h in trainer.state.log_history if "env/success" in h],
    }


def report(on: dict, off: dict, args: argparse.Namespace) -> str:
    """The console text and result.md: the gap table, the stored-routes table and the wall times."""
    lags = sorted(on["lagged"]["replay"])
    lines = [
        f"### Train-sampler log-prob gap, {args.model} on {args.env}, CPU fp32, {args.steps} steps, lag {args.lag}\n",
        "| routing in the trainer | Eq. 10 gap (behaviour weights) | " + " | ".join(f"lag {k}" for k in lags) + " |",
        "|---|---|" + "---|" * len(lags),
    ]
    rows = [
        ("replay (R3), replay run", on["eq10_gap"], on["lagged"]["replay"]),
        ("free, same weights and batch (replay run)", None, on["lagged"]["free"]),
        ("free, run without replay", off["eq10_gap"], off["lagged"]["free"]),
    ]
    for name, eq10, lagged in rows:
        eq10_text = "-" if eq10 is None else f"{eq10:.2e}"
        lines.append(f"| {name} | {eq10_text} | " + " | ".join(f"{lagged[k]:.2e}" for k in lags) + " |")
    share = on["lagged"]["routing"]
    lines.append(
        "| mean \\|replay - free\\| (same weights) | - | " + " | ".join(f"{share[k]:.2e}" for k in lags) + " |"
    )
    flips = on["lagged"]["flip"]
    lines.append(
        "| flip frac of free routing vs record (Eq. 9) | - | " + " | ".join(f"{flips[k]:.2%}" for k in lags) + " |"
    )
    lines += ["\n### Stored routes (Eq. 8, int16)\n", "| model | L x k | bytes per token | source |"]
    lines.append("|---|---|---|---|")
    layers, k = on["routers"]
    lines.append(
        f"| {args.model} | {layers} x {k} | {on['bytes_per_token']:.0f} | measured (routing/record_bytes_per_token), "
        f"{on['record_mb'] * 1024:.1f} KiB per batch (routing/record_mb) |"
    )
    for name, (layers, k) in REFERENCE_MODELS.items():
        lines.append(f"| {name} | {layers} x {k} | {layers * k * 2} | Eq. 8 from the public config |")
    lines.append(f"\nwall time: replay {on['seconds']:.0f} s, no replay {off['seconds']:.0f} s (CPU, shared cores)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", default="random", help="'random' (tiny Qwen3-MoE, no SFT), tiny-moe:<env>, a folder"
    )
    parser.add_argument("--env", default="shop")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    parser.add_argument("--lag", type=int, default=4, help="optimizer steps per generation batch")
    parser.add_argument("--batch", type=int, default=8, help="rollouts per optimizer step")
    parser.add_argument("--group", type=int, default=8, help="num_generations (G)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", type=Path, default=RESULTS / "routing_gap", help="folder for result.json and .md")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    with tempfile.TemporaryDirectory() as tmp:
        if args.model == "random":
            folder = random_tiny_moe(args.env, os.path.join(tmp, "model"))
        else:
            folder = tiny_model(args.model) if args.model.startswith("tiny") else args.model
        results = {
            replay: run(folder, args.env, replay, args, os.path.join(tmp, str(replay))) for replay in (True, False)
        }

    on, off = results[True], results[False]
    text = report(on, off, args)
    print("\n" + text)
    reference = {
        name: {"layers": n, "top_k": k, "bytes_per_token": n * k * 2} for name, (n, k) in REFERENCE_MODELS.items()
    }
    measured = {"replay": on, "no_replay": off, "reference_models_eq8": reference}
    written = write_result(args.out, "routing_gap", vars(args) | {"out": str(args.out)}, measured, text)
    print(f"\nwrote {' and '.join(map(str, written))}", file=sys.stderr)
    return measured


if __name__ == "__main__":
    main()
