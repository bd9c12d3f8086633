"""GPU checks of MoE routing replay (R3) and of vLLM generation in the agent loop; run by bench/gpu_check.sh.

    python bench/gpu_replay_check.py            # checks 1 and 2 (needs CUDA)
    torchrun --standalone --nproc_per_node 1 bench/gpu_replay_check.py --vllm   # check 3 (needs vLLM)

1. bf16 sampler vs fp32 trainer (routing-replay.md §7, GPU checks): a tiny random Qwen3-MoE samples in bf16 on
   cuda with routes recorded; an fp32 copy scores the sampled tokens with free routing and with index replay (Eq. 3).
   Reports max and mean |delta log p| over completion tokens and the flip rate of free routing (Eq. 9).
   PASS: zero flips in the experts the fp32 replayed forward used, and a mean gap with replay no larger than without
   (plus 1e-4 slack).
2. AgentGRPOTrainer on cuda with `routing_replay: true`, the model in bf16 and activation checkpointing on: 2 GRPO
   steps with the old-log-prob pass, then the same without replay. PASS: both finish with finite losses, and with
   replay the router gets gradient; the Eq. 10 gaps, the flip rate and the Eq. 11 re-prefill mismatch are reported.
3. (`--vllm`) the agent loop with TRL's vLLM colocate generation on a tiny dense model: 1 GRPO step finishes; and
   `routing_replay: true` with `use_vllm: true` on a tiny MoE is refused at init (D1). Needs distributed env vars,
   hence torchrun.

Each check prints one `PASS name: ...` or `FAIL name: ...` line; the exit code is the number of failures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import traceback

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "bench")]

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from envs import ENVIRONMENTS  # noqa: E402
from envs.tiny import CHAT_TEMPLATE, TinySpec, build_model, build_tokenizer, demonstrations  # noqa: E402
from trainers.routing_replay import (  # noqa: E402
    RouteRecorder,
    find_routers,
    replay_routes,
    routes_to_training_layout,
    routing_flips,
    split_generate_routes,
)

FAILURES = []
DEVICE = "cuda"  # `--device cpu` dry-runs checks 1-2 (slowly, bf16 on CPU) to test this script without a GPU


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILURES.append(name)


def tiny_folder(folder: str, moe: bool, hidden: int = 256, heads: int = 4) -> str:
    """A random tiny model on the shop environment's tokenizer (head_dim 64, which every attention kernel supports)."""
    texts = [CHAT_TEMPLATE] + [m["content"] for d in demonstrations(ENVIRONMENTS["shop"], 200, 0, 0, 0.3) for m in d]
    tokenizer = build_tokenizer(texts)
    model = build_model(TinySpec(env="shop", moe=moe, hidden_size=hidden, num_heads=heads), tokenizer)
    if moe:
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for router in find_routers(model).modules:  # non-zero router init (§7)
                router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * 0.5)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def completion_logps(model, input_ids, attention_mask, prompt_width: int) -> torch.Tensor:
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, prompt_width - 1 : -1].float()
    return logits.log_softmax(-1).gather(-1, input_ids[:, prompt_width:, None]).squeeze(-1)  # (B, T)


def used_expert_flips(routing: torch.Tensor, used: list[torch.Tensor]) -> int:
    """Decisions with a record whose expert set differs from the ids the experts modules received ((B * S, k) each)."""
    B, S, L, k = routing.shape
    flips = 0
    for layer, ids in enumerate(used):
        recorded = routing[:, :, layer].reshape(B * S, k).long()  # (B*S, k)
        differs = (recorded.sort(-1).values != ids.sort(-1).values).any(-1)
        flips += int((differs & (recorded[:, 0] >= 0)).sum())
    return flips


def check_bf16_sampler(folder: str) -> None:
    """Check 1: record in a bf16 `generate`, score in fp32 with and without replay."""
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    sampler = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).to(DEVICE).eval()
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(DEVICE).eval()
    env = ENVIRONMENTS["shop"]
    prompts = [env().reset(t) for t in env.make_tasks("train", 16, seed=0)]
    messages = [[{"role": "user", "content": p}] for p in prompts]
    texts = [tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in messages]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(DEVICE)
    P = batch["input_ids"].shape[1]
    torch.manual_seed(0)
    with torch.no_grad(), RouteRecorder(sampler) as recorder:
        out = sampler.generate(
            **batch, max_new_tokens=48, do_sample=True, top_k=0, output_scores=True, return_dict_in_generate=True,
            pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
    completion = out.sequences[:, P:]  # (B, T)
    is_eos = completion == tokenizer.eos_token_id
    completion_mask = ((is_eos.cumsum(1) - is_eos.long()) == 0).long()  # (B, T) 1 through the first EOS, as TRL
    q = torch.stack(out.scores, 1).float().log_softmax(-1).gather(-1, completion[..., None]).squeeze(-1)  # (B, T)
    records = split_generate_routes(recorder.indices(len(texts)), batch["attention_mask"], completion_mask)
    routing = routes_to_training_layout(records, batch["attention_mask"], completion_mask)  # (B, S, L, k), D4
    attention = torch.cat([batch["attention_mask"], completion_mask], 1)  # (B, S)
    input_ids = out.sequences.masked_fill(attention == 0, tokenizer.pad_token_id)  # (B, S)
    used = []
    experts = [m for n, m in trainer.named_modules() if n.endswith("mlp.experts")]
    with torch.no_grad():
        with RouteRecorder(trainer) as free_recorder:
            free = completion_logps(trainer, input_ids, attention, P)
        handles = [m.register_forward_pre_hook(lambda mod, args: used.append(args[1].clone())) for m in experts]
        with replay_routes(trainer, routing, attention):  # Eq. 3
            replayed = completion_logps(trainer, input_ids, attention, P)
        for handle in handles:
            handle.remove()
    flip, flip_tok = routing_flips(routing, free_recorder.indices(len(texts)), attention.bool())  # Eq. 9
    mask = completion_mask.bool()
    gap_free, gap_replay = (free - q)[mask].abs(), (replayed - q)[mask].abs()
    replay_flips = used_expert_flips(routing, used)
    detail = (
        f"bf16 sampler vs fp32 trainer, {int(mask.sum())} tokens: free routing max|dlogp| {gap_free.max():.3e} mean "
        f"{gap_free.mean():.3e}, flips {flip:.3%} of decisions ({flip_tok:.2%} of positions); replay max|dlogp| "
        f"{gap_replay.max():.3e} mean {gap_replay.mean():.3e}, flips {replay_flips}"
    )
    report("bf16_replay", replay_flips == 0 and gap_replay.mean() <= gap_free.mean() + 1e-4, detail)


def check_trainer(folder: str) -> None:
    """Check 2: the trainer with routing replay on cuda in bf16, against the same run without replay."""
    from conftest import EchoEnv

    from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

    def distinct_chars(completions, **kwargs):
        return [len(set(str(c))) / (1 + len(str(c))) for c in completions]

    tasks = EchoEnv.make_tasks("train", 8)
    data = Dataset.from_list([{"prompt": "x", "task": json.dumps(t), "task_id": t["task_id"]} for t in tasks])
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    gaps = {}
    for replay in (True, False):
        with tempfile.TemporaryDirectory() as out:
            args = AgentGRPOConfig(
                output_dir=out, per_device_train_batch_size=8, num_generations=4, steps_per_generation=2,
                max_steps=2, max_completion_length=64, max_turn_tokens=8, learning_rate=1e-3, report_to="none",
                seed=0, bf16=True, use_cpu=DEVICE == "cpu", save_strategy="no", logging_steps=1, top_k=0,
                disable_dropout=True, activation_checkpointing=True, routing_replay=replay, router_aux_loss_coef=0.0,
                model_init_kwargs={"dtype": torch.bfloat16}, disable_tqdm=True,
            )  # fmt: skip
            trainer = AgentGRPOTrainer(
                model=folder, reward_funcs=[distinct_chars], args=args, train_dataset=data,
                processing_class=tokenizer, env_factory=lambda row: EchoEnv(),
            )  # fmt: skip
            trainer.train()
        logs = trainer.state.log_history[:-1]
        losses = [h["loss"] for h in logs if "loss" in h]
        gaps[replay] = logs[0].get("routing/logp_gap", float("nan"))
        ok = len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
        if replay:  # flip_frac compares free routing with the record: bf16 noise may flip some, replay pins them
            ok = ok and logs[0]["routing/replay_active"] == 1.0 and logs[0]["routing/router_grad_norm"] > 0
        report(
            f"trainer_{'replay' if replay else 'free'}", ok,
            f"losses {losses}, routing/logp_gap {gaps[replay]:.3e}"
            + (f", flip_frac {logs[0]['routing/flip_frac']:.3%}, prefix_recompute_mismatch_frac "
               f"{logs[0]['routing/prefix_recompute_mismatch_frac']:.3%}, router_grad_norm "
               f"{logs[0]['routing/router_grad_norm']:.3e}" if replay else ""),
        )  # fmt: skip
    print(f"INFO Eq. 10 gap in bf16 (trainer old pass vs sampler): replay {gaps[True]:.3e}, free {gaps[False]:.3e}")


def check_vllm(tmp: str) -> None:
    """Check 3: vLLM colocate generation in the agent loop; replay + vLLM refused at init."""
    from conftest import EchoEnv

    from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

    tasks = EchoEnv.make_tasks("train", 8)
    data = Dataset.from_list([{"prompt": "x", "task": json.dumps(t), "task_id": t["task_id"]} for t in tasks])

    def config(out: str, replay: bool) -> AgentGRPOConfig:
        return AgentGRPOConfig(
            output_dir=out, per_device_train_batch_size=8, num_generations=4, max_steps=1, max_completion_length=64,
            max_turn_tokens=8, learning_rate=1e-3, report_to="none", seed=0, bf16=True, save_strategy="no",
            logging_steps=1, use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.3,
            routing_replay=replay, disable_tqdm=True,
        )  # fmt: skip

    def distinct_chars(completions, **kwargs):
        return [len(set(str(c))) / (1 + len(str(c))) for c in completions]

    dense = tiny_folder(os.path.join(tmp, "dense"), moe=False)
    try:
        trainer = AgentGRPOTrainer(
            model=dense, reward_funcs=[distinct_chars], args=config(os.path.join(tmp, "v"), False),
            train_dataset=data, processing_class=AutoTokenizer.from_pretrained(dense, padding_side="left"),
            env_factory=lambda row: EchoEnv(),
        )  # fmt: skip
        trainer.train()
        logs = trainer.state.log_history[0]
        report(
            "vllm_agent_loop", "loss" in logs, f"1 step, env/turns {logs.get('env/turns')}, loss {logs.get('loss')}"
        )
        del trainer
    except Exception as e:  # report, then continue with the init check
        traceback.print_exc()
        report("vllm_agent_loop", False, f"{type(e).__name__}: {e}")
    moe = tiny_folder(os.path.join(tmp, "moe"), moe=True)
    try:
        AgentGRPOTrainer(
            model=moe, reward_funcs=[distinct_chars], args=config(os.path.join(tmp, "r"), True), train_dataset=data,
            processing_class=AutoTokenizer.from_pretrained(moe, padding_side="left"),
            env_factory=lambda row: EchoEnv(),
        )  # fmt: skip
        report("vllm_replay_refused", False, "routing_replay with use_vllm was accepted")
    except ValueError as e:
        report("vllm_replay_refused", "routing-replay.md D1" in str(e), str(e)[:120])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", action="store_true", help="run check 3 (vLLM) instead of checks 1-2")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run of checks 1-2")
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        report("cuda", False, "torch.cuda.is_available() is False")
        return 1
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"
    print(f"INFO device {name}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        checks = [check_vllm] if args.vllm else [check_bf16_sampler, check_trainer]
        folder = None if args.vllm else tiny_folder(os.path.join(tmp, "moe"), moe=True)
        for check in checks:
            try:
                check(tmp) if args.vllm else check(folder)
            except Exception as e:
                traceback.print_exc()
                report(check.__name__, False, f"{type(e).__name__}: {e}")
    return len(FAILURES)


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(ROOT, "tests"))  # EchoEnv lives in tests/conftest.py
    sys.exit(main())
