"""One GRPO step with routing replay on a tiny Qwen3-MoE, for tests/test_distributed_grpo.py (not a test itself).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tests/distributed_grpo_run.py MODEL_FOLDER OUT_DIR

Every process writes OUT_DIR/rank<r>.json: its rows' first-step advantages keyed by "<task_id>/<global row>", its
generate calls (all, and those on the dummy context), its turns, and the logged routing metrics. The global batch is
3 EchoEnv tasks x G = 4 in dataset order (no shuffling); the tasks ask for 1, 1 and 3 words, so with 2 processes rank 0
(rows 0-5) plays one turn and rank 1 (rows 6-11) three, and rank 0 must keep generating on a dummy context.

Sampling differs with the batch split (each process draws its own noise), so the reward here is a deterministic
function of a row's task and global index: the comparison checks the cross-process group statistics, not the sampler.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from conftest import EchoEnv  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from trainers.base import AgentGRPOConfig, AgentGRPOTrainer  # noqa: E402

TASKS = [  # words per task: 1, 1, 3 -> turns per task
    {"task_id": "t0", "words": ["apple"]},
    {"task_id": "t1", "words": ["river"]},
    {"task_id": "t2", "words": ["stone", "cloud", "amber"]},
]
GLOBAL_BATCH = 12  # 3 tasks x G


def row_reward(completions, task_id, **kwargs) -> list[float]:
    """Deterministic per-row reward: depends only on the task and the row's index in the global batch."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    start = rank * len(completions)
    return [float((7 * (start + i) + int(task_id[i][1:])) % 5) for i in range(len(completions))]


def main(folder: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    data = Dataset.from_list([{"prompt": "x", "task": json.dumps(t), "task_id": t["task_id"]} for t in TASKS])
    args = AgentGRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=GLOBAL_BATCH // world, num_generations=4,
        max_completion_length=64, max_turn_tokens=4, learning_rate=1e-2, report_to="none", seed=0, bf16=False,
        use_cpu=True, activation_checkpointing=False, save_strategy="no", logging_steps=1, max_steps=1,
        disable_dropout=True, shuffle_dataset=False, top_k=0, routing_replay=True, disable_tqdm=True,
    )  # fmt: skip
    trainer = AgentGRPOTrainer(
        model=folder, reward_funcs=[row_reward], args=args, train_dataset=data, processing_class=tokenizer,
        env_factory=lambda row: EchoEnv(),
    )  # fmt: skip
    calls = {"generate": 0, "dummy": 0}
    num_live_global = trainer.num_live_global

    def counted(n: int) -> int:  # one generate call per loop iteration while any process has a live episode
        total = num_live_global(n)
        calls["generate"] += total > 0
        calls["dummy"] += total > 0 and n == 0
        return total

    trainer.num_live_global = counted
    first = {}
    generate_and_score = trainer.generate_and_score

    def capture(inputs):
        out = generate_and_score(inputs)
        if not first:
            mask = (out["completion_mask"] * out["tool_mask"]).bool()  # (B, T) model tokens
            B = len(inputs)
            for b, row in enumerate(inputs):
                advantage = out["advantages"][b][mask[b]]  # the group advantage on every model token
                assert torch.allclose(advantage, advantage[0].expand_as(advantage))
                first[f"{row['task_id']}/{trainer.accelerator.process_index * B + b}"] = advantage[0].item()
            first["_turns"] = max(len(row["turn_rewards"]) for row in inputs)
            first["_routing"] = list(out["routing"].shape)
        return out

    trainer.generate_and_score = capture
    trainer.train()
    rank = trainer.accelerator.process_index
    logs = {k: v for k, v in trainer.state.log_history[0].items() if k.startswith("routing/")}
    result = {
        "world": trainer.accelerator.num_processes,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "advantages": {k: v for k, v in first.items() if not k.startswith("_")},
        "turns": first["_turns"],
        "routing_shape": first["_routing"],
        "calls": calls,
        "logs": logs,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    from agent_trl.resume import close_process_group

    main(sys.argv[1], sys.argv[2])
    close_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # the results are written: skip interpreter shutdown, where C++ thread teardown can still abort
