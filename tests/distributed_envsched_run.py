"""Three GRPO steps with `scheduler: envsched` for tests/test_envsched_trainer.py (not a test itself).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tests/distributed_envsched_run.py MODEL_FOLDER OUT_DIR

Every process writes OUT_DIR/rank<r>.json: the scheduler's final state, every draw it made, and the pool indices of
the rows it played itself.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

import torch.distributed as dist  # noqa: E402
from conftest import CPU_ARGS, EchoEnv  # noqa: E402
from datasets import Dataset  # noqa: E402

from trainers.base import AgentGRPOConfig, AgentGRPOTrainer  # noqa: E402


def token_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 3 == 0) for ids in completion_ids]


def main(folder: str, out: str) -> None:
    args = AgentGRPOConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_completion_length=24,
                           max_turn_tokens=4, max_steps=3, learning_rate=1e-3, scheduler="envsched",
                           **CPU_ARGS)  # fmt: skip
    tasks = EchoEnv.make_tasks("train", 12)
    data = Dataset.from_list([{"prompt": "say", "task": t, "task_id": t["task_id"]} for t in tasks])
    trainer = AgentGRPOTrainer(model=folder, reward_funcs=[token_reward], args=args, train_dataset=data,
                               env_factory=lambda row: EchoEnv())  # fmt: skip
    scheduler = trainer.task_scheduler
    draws, rows = [], []
    draw, update = scheduler.draw, trainer.task_scheduling.update

    def spy_draw():
        draws.append(draw())
        return draws[-1]

    def spy_update(trainer, inputs, batch):
        rows.extend(int(r["sched_index"]) for r in inputs)
        return update(trainer, inputs, batch)

    scheduler.draw, trainer.task_scheduling.update = spy_draw, spy_update
    trainer.train()
    rank = dist.get_rank()
    state = scheduler.state_dict()
    state["rng"] = json.loads(json.dumps(state["rng"]))
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"state": state, "draws": draws, "rows": rows}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
