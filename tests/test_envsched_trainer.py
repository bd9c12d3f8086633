"""EnvSched inside the trainers (docs/methods/envsched.md): a resumed run draws exactly the schedule of an
uninterrupted one, including the draw that was pending at the save (§7 property 21, D17); the scheduler plugs into
every trainer (GRPO, PPO); the scheduler's state travels in the checkpoint; two processes (torchrun, gloo) hold the
same state and draw the same schedule (property 20, D16)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import CPU_ARGS, EchoEnv
from datasets import Dataset
from transformers import TrainerCallback

from trainers.base import AgentGRPOConfig, AgentGRPOTrainer
from trainers.ppo import AgentPPOTrainer, PPOConfig

TASKS = EchoEnv.make_tasks("train", 12)


def token_reward(completion_ids, **kwargs):
    """A reward that differs between rollouts of a random model, so the scheduler's statistics move."""
    return [float(sum(ids) % 3 == 0) for ids in completion_ids]


def make(folder, out, cls=AgentGRPOTrainer, config=AgentGRPOConfig, **fields):
    settings = dict(per_device_train_batch_size=8, num_generations=2, max_completion_length=24, max_turn_tokens=4,
                    max_steps=6, learning_rate=1e-3, lr_scheduler_type="constant", scheduler="envsched",
                    sched_explore=0.25)  # fmt: skip
    args = config(output_dir=str(out), **{**settings, **CPU_ARGS, **fields})
    data = Dataset.from_list([{"prompt": "say", "task": t, "task_id": t["task_id"]} for t in TASKS])
    trainer = cls(model=folder, reward_funcs=[token_reward], args=args, train_dataset=data,
                  env_factory=lambda row: EchoEnv())  # fmt: skip
    played = []
    update = trainer.task_scheduling.update

    def spy(trainer, inputs, batch):
        played.append([int(r["sched_index"]) for r in inputs])
        return update(trainer, inputs, batch)

    trainer.task_scheduling.update = spy
    return trainer, played


class StopAt(TrainerCallback):
    """Stops training after `step` (the run is 'killed' after its checkpoint there) and keeps the scheduler's state
    at that step."""

    def __init__(self, trainer, step: int):
        self.trainer, self.step, self.state = trainer, step, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.state = json.loads(json.dumps(self.trainer.task_scheduler.state_dict()))
            control.should_training_stop = self.trainer.args.output_dir.endswith("run")


def test_resume_draws_what_the_uninterrupted_run_draws(tiny_model_folder, tmp_path):
    """The scheduler's state comes back from the checkpoint bit for bit, and the resumed run serves first the draw
    that was pending at the save (drawn one batch ahead), then draws from the restored state exactly what the
    uninterrupted run drew. (Later draws depend on the policy's own samples after the resume.)"""
    whole, played_whole = make(tiny_model_folder, tmp_path / "whole")
    at_3 = StopAt(whole, 3)
    whole.add_callback(at_3)
    whole.train()
    first, _ = make(tiny_model_folder, tmp_path / "run", save_strategy="steps", save_steps=3)
    first.add_callback(StopAt(first, 3))
    first.train()
    saved = json.loads((tmp_path / "run" / "checkpoint-3" / "agent_state.json").read_text())["scheduler"]
    assert saved == at_3.state  # statistics, clock, generator and the pending draw, as the uninterrupted run had them
    assert saved["t"] == 4 and len(saved["pending"]) == 1  # one draw ahead of the rewards (the loader prefetches)
    resumed, played_resumed = make(tiny_model_folder, tmp_path / "run")
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    assert len(played_whole) == 6 and len(played_resumed) == 3
    assert played_resumed[0] == [i for i in saved["pending"][0] for _ in range(2)] == played_whole[3]
    assert played_resumed[1] == played_whole[4]  # drawn from the restored state before any new reward arrived
    assert [len(set(batch)) for batch in played_whole] == [4] * 6  # B = 8 rows / G 2 distinct tasks per batch


def test_a_checkpoint_of_another_pool_is_refused(tiny_model_folder, tmp_path):
    first, _ = make(tiny_model_folder, tmp_path / "run", save_strategy="steps", save_steps=2, max_steps=2)
    first.train()
    other, _ = make(tiny_model_folder, tmp_path / "other", sched_explore=0.5)  # other settings: another identity
    with pytest.raises(ValueError, match="another pool, graph or settings"):
        other.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))


def test_every_trainer_takes_the_scheduler(tiny_model_folder, tmp_path):
    trainer, played = make(tiny_model_folder, tmp_path / "ppo", cls=AgentPPOTrainer, config=PPOConfig, max_steps=2)
    trainer.train()
    assert len(played) == 2 and all(len(set(b)) == 4 for b in played)
    logged = [row for row in trainer.state.log_history if "sched/zero_variance_group_frac" in row]
    assert logged and all(0.0 <= row["sched/zero_variance_group_frac"] <= 1.0 for row in logged)


def test_the_scheduler_needs_max_steps_and_a_valid_range(tmp_path):
    with pytest.raises(ValueError, match="max_steps"):
        AgentGRPOConfig(output_dir=str(tmp_path), scheduler="envsched", per_device_train_batch_size=4,
                        num_generations=2, **CPU_ARGS)  # fmt: skip
    with pytest.raises(ValueError, match="sched_reward_range"):
        AgentGRPOConfig(output_dir=str(tmp_path), scheduler="envsched", max_steps=2, sched_reward_range=[1.0, 0.0],
                        per_device_train_batch_size=4, num_generations=2, **CPU_ARGS)  # fmt: skip
    with pytest.raises(ValueError, match="scheduler must be one of"):
        AgentGRPOConfig(output_dir=str(tmp_path), scheduler="fifo", per_device_train_batch_size=4, num_generations=2,
                        **CPU_ARGS)  # fmt: skip


SCRIPT = Path(__file__).with_name("distributed_envsched_run.py")


@pytest.mark.distributed
def test_two_processes_hold_the_same_schedule(tiny_model_folder, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
               tiny_model_folder, str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["state"] == ranks[1]["state"]  # statistics, clock, pending draws and generator, bit for bit
    assert ranks[0]["draws"] == ranks[1]["draws"] and len(ranks[0]["draws"]) >= 3
    rows = [set(r["rows"]) for r in ranks]  # the global stream is split: each rank plays its own half of a batch
    assert rows[0] and rows[1] and ranks[0]["rows"] != ranks[1]["rows"]
