"""Layer 5: the PPO trainer's first-step advantages are the same on 2 processes (torchrun, gloo) as on 1.

Run with `pytest -m distributed tests/test_distributed_ppo.py`. The test launches this file as a script twice, with
`torchrun --standalone --nproc_per_node 2` and with plain `python`, on the same tiny model and tasks. Sampling is
deterministic (`top_k=1`), so both runs play the same episodes; the script dumps each row's first-step advantages with
its task id, and the rows of a task are compared as a multiset. What must agree across the split: rewards sliced to
each rank, the global turn count K, the whitening statistics (all-reduced sums), the bootstrap of truncated rows, and
the explained variance (all-reduced sums). One optimizer step also runs under DDP with the hook-fed value head
(`ddp_find_unused_parameters=False`), and the ranks' weights stay equal after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve()


@pytest.mark.distributed
def test_two_processes_give_the_first_step_advantages_of_one(tiny_model_folder, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent), str(HERE.parent), env.get("PYTHONPATH", "")])
    torchrun = Path(sys.executable).with_name("torchrun")
    two, one = tmp_path / "two.json", tmp_path / "one.json"

    def script(out: Path) -> list[str]:
        return [str(HERE), tiny_model_folder, str(out), str(tmp_path)]

    launches = [
        [str(torchrun), "--standalone", "--nproc_per_node", "2", *script(two)],
        [sys.executable, *script(one)],
    ]
    for cmd in launches:
        done = subprocess.run(cmd, env=env, cwd=HERE.parent.parent, capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    rows2, rows1 = json.loads(two.read_text()), json.loads(one.read_text())
    assert rows2["world_size"] == 2 and rows1["world_size"] == 1
    assert len(rows1["rows"]) == len(rows2["rows"]) == 8  # 4 tasks x G = 2, every row kept

    def by_task(rows: list) -> dict[str, list]:  # a group's rows as a multiset: (ids, advantages) sorted
        groups: dict[str, list] = {}
        for task_id, ids, adv in rows:
            groups.setdefault(task_id, []).append((ids, adv))
        return {t: sorted(g, key=lambda row: (row[0], [round(a, 3) for a in row[1]])) for t, g in groups.items()}

    groups1, groups2 = by_task(rows1["rows"]), by_task(rows2["rows"])
    assert sorted(groups1) == sorted(groups2) and all(len(g) == 2 for g in groups1.values())
    for task_id, group1 in groups1.items():
        for (ids1, adv1), (ids2, adv2) in zip(group1, groups2[task_id], strict=True):
            assert ids2 == ids1, task_id  # the same episode was played
            assert len(adv1) == len(adv2) and max(abs(a - b) for a, b in zip(adv1, adv2, strict=True)) < 1e-4, task_id
    assert abs(rows2["explained_variance"] - rows1["explained_variance"]) < 1e-4
    assert rows2["checksums"][0] == rows2["checksums"][1]  # DDP kept the ranks' weights (value head included) equal
    assert any(abs(a) > 1e-3 for _, _, adv in rows1["rows"] for a in adv)  # not a comparison of zeros


def main(folder: str, out: str, workdir: str, critic: str | None = None) -> None:
    """One run (1 or 2 processes): a single PPO step; rank 0 writes all rows as [task id, model-token ids, advantages].
    `critic` is an optional `critic_model_name_or_path` (e.g. 'policy'; by hand: the separate critic under DDP)."""
    import torch
    from accelerate.utils import gather_object
    from conftest import CPU_ARGS, EchoEnv
    from datasets import Dataset
    from transformers import AutoTokenizer

    from trainers.ppo import AgentPPOTrainer, PPOConfig

    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tasks = EchoEnv.make_tasks("train", 4)
    data = Dataset.from_list(
        [{"prompt": EchoEnv().reset(t), "task": json.dumps(t), "task_id": t["task_id"]} for t in tasks]
    )
    args = PPOConfig(
        output_dir=os.path.join(workdir, f"run{world}"),
        per_device_train_batch_size=8 // world,  # one global generation batch of 8 rows either way
        num_generations=2,
        max_completion_length=40,
        max_turn_tokens=4,
        max_turns=2,  # every episode is cut by the turn budget ...
        bootstrap_truncated=True,  # ... and bootstraps from the value (not the default, conventions.md C4)
        top_k=1,  # deterministic sampling: both launches play the same episodes
        max_steps=1,
        learning_rate=1e-3,
        **CPU_ARGS,
        gamma=0.9,
        lam=0.8,
        critic_model_name_or_path=critic,
    )
    trainer = AgentPPOTrainer(
        model=folder,
        reward_funcs=[lambda completions, **kw: [len(set(c)) / (1 + len(c)) for c in completions]],
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(folder),
        env_factory=lambda row: EchoEnv(),
    )
    torch.manual_seed(0)
    head = trainer.critic.head if critic else trainer.critic
    torch.nn.init.normal_(head.weight, std=0.5)  # the same non-zero head on every rank and run
    seen = []
    original = trainer.compute_advantages

    def capture(batch):
        adv = original(batch)
        if not seen:
            for b, task_id in enumerate(batch.task_ids):
                m = batch.mask[b].bool()
                seen.append((task_id, batch.completion_ids[b][m].tolist(), adv[b][m].tolist()))
        return adv

    trainer.compute_advantages = capture
    trainer.train()
    rows = gather_object(seen)
    checksums = gather_object([sum(float(p.double().sum()) for p in trainer.model.parameters())])  # one per rank
    if trainer.accelerator.is_main_process:
        key = "critic/explained_variance"
        ev = next(h[key] for h in trainer.state.log_history if key in h)
        dump = {"world_size": world, "explained_variance": ev, "checksums": checksums}
        dump["rows"] = [[t, i, a] for t, i, a in rows]
        Path(out).write_text(json.dumps(dump))


if __name__ == "__main__":
    from agent_trl.resume import close_process_group

    main(*sys.argv[1:5])
    close_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # the results are written: skip interpreter shutdown, where C++ thread teardown can still abort
