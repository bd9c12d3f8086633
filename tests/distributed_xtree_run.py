"""Three X-Tree bonus steps for tests/test_xtree_trainer.py (not a test itself).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tests/distributed_xtree_run.py MODEL_FOLDER OUT_DIR

Every process writes OUT_DIR/rank<r>.json: per generation batch, the gathered (N, 2) reward columns before and after
the trainer's Eq. 10 shaping, and the group size.
"""

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

import torch.distributed as dist  # noqa: E402
from conftest import CPU_ARGS, WORDS, EchoEnv  # noqa: E402
from datasets import Dataset  # noqa: E402

from trainers import xtree  # noqa: E402
from trainers.base import AgentGRPOTrainer  # noqa: E402
from trainers.xtree_trainer import XTreeConfig, XTreeTrainer  # noqa: E402


def token_reward(completion_ids, **kwargs):
    return [float(sum(ids) % 3 == 0) for ids in completion_ids]


def every_pair_tree(path: str) -> None:
    """A tree with a node for every pair of the tokens a random tiny model's turns canonicalise to (the generic
    table: the first word, or `other<object>`), so every rollout of two turns or more earns a bonus."""
    vocab = [f"{w}<object>" for w in [*WORDS, "say"]] + ["other<object>"]
    trajs = [
        xtree.Trajectory(f"{u}|{v}|{k}", f"{u}|{v}", True, [u, v]) for u in vocab for v in vocab for k in range(2)
    ]
    tree, occurrences = xtree.mine(trajs, xtree.MinerConfig(max_skills=200, min_frequency=2, mdl_lambda=0.0))
    xtree.save(tree, path, occurrences)


def main(folder: str, out: str) -> None:
    tree = os.path.join(out, f"tree{os.environ.get('RANK', '0')}.json")
    every_pair_tree(tree)
    args = XTreeConfig(output_dir=out, per_device_train_batch_size=4, num_generations=2, max_completion_length=24,
                       max_turn_tokens=3, max_steps=3, learning_rate=1e-3, xtree_corpus_episodes=8, xtree_tree=tree,
                       **CPU_ARGS)  # fmt: skip
    tasks = EchoEnv.make_tasks("train", 12)
    data = Dataset.from_list([{"prompt": "say", "task": t, "task_id": t["task_id"]} for t in tasks])
    trainer = XTreeTrainer(model=folder, reward_funcs=[token_reward], args=args, train_dataset=data,
                           env_factory=lambda row: EchoEnv())  # fmt: skip
    batches = []
    parent = AgentGRPOTrainer.calculate_rewards

    def spy_parent(self, *a):
        raw = parent(self, *a)
        batches.append({"raw": raw.tolist()})
        return raw

    AgentGRPOTrainer.calculate_rewards = spy_parent
    shape = trainer.calculate_rewards

    def spy(*a):
        shaped = shape(*a)
        batches[-1]["shaped"] = shaped.tolist()
        return shaped

    trainer.calculate_rewards = spy
    trainer.train()
    with open(os.path.join(out, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump({"batches": batches, "group": args.num_generations}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
