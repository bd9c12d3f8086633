"""Layer 3 for the whole registry: every trainer of `trainers.TRAINERS` takes 2 optimizer steps of `.train()` on the
tiny random model, alone and under `scheduler: envsched`, with rewards that vary inside the groups.

The tests are parametrized over `TRAINERS` itself, so a new trainer is covered as soon as it is registered; it plays
EchoEnv with its config's defaults unless `SETUPS` says otherwise (as each trainer's own tests build it).

Where the reward variance comes from: agent_loop's generate is wrapped so that at each turn an episode says the
expert's action with probability `P_EXPERT` and otherwise keeps the tiny model's own sample (the real sampler, its
KV-cache reuse included). Some episodes succeed, others do not, so the environment's reward, success-based analyses
(TASPO) and judges (DRACO's oracle) all see varied groups; the model being trained is the tiny random one either way.

Properties checked (none of them a number read off a run):
1. exactly 2 optimizer steps are logged, each with a finite loss and a finite gradient norm, from two generation
   batches (on-policy) or from one split in two minibatches (`steps_per_generation: 2`, as PPO and MPO recipes do);
2. the groups were not all reward-constant (TRL's `frac_reward_zero_std` < 1 in each generation batch), and so the
   gradient of at least one step is non-zero;
3. every trainable parameter of the policy (critic and value head included) moved;
4. under EnvSched: each generation batch plays exactly the tasks of one of the scheduler's draws, G rollouts each, the
   scheduler's statistics hold the played tasks' rollouts (and nothing else), and its `sched/*` metrics are logged.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv
from datasets import Dataset

from envs.shop import ShopEnv
from tests.helpers.analyzer import Scripted
from tests.helpers.draco import DATA as SHOP_DATA
from tests.helpers.draco import scripted_policy as shop_policy
from trainers import TRAINERS, agent_loop
from trainers.funnel_state import Entry, State, render_state

G = 4
P_EXPERT = 0.75
REAL_GENERATE = agent_loop.hf_generate  # the tiny model's own sampler, wrapped below
ECHO_TASKS = EchoEnv.make_tasks("train", 40)  # 40: X-Tree mines its tree from one noisy expert episode per task
ECHO_DATA = Dataset.from_list(
    [
        {"prompt": EchoEnv().reset(t), "task": json.dumps(t), "task_id": t["task_id"],
         "hint": f"Say {', then '.join(t['words'])}, one word per turn."}
        for t in ECHO_TASKS
    ]
)  # fmt: skip
FUNNEL_STATE = State(
    [Entry("E1", "Repeat the word you are asked for, exactly."), Entry("E2", "One word per turn.")], 3
)


def echo_expert(model, tokenizer, **kwargs):
    """EchoEnv's expert as a generate function: the word the context's last observation asks for."""

    def generate(contexts, max_new_tokens):
        words = [tokenizer.decode(c).rsplit("say ", 1)[-1].split("<|im_end|>")[0].strip() for c in contexts]
        ids = [tokenizer(w, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for w in words]
        return [(i, [-1.0] * len(i)) for i in ids]

    return generate


def funnel_state(trainer) -> None:
    """The Funnel's consolidation trainer as its loop hands it over: every task selected, one state block."""
    trainer.selection = {row["task_id"]: 1.0 for row in trainer.train_dataset}
    trainer.state_block = lambda row: render_state(FUNNEL_STATE)


@dataclass
class Setup:
    """How one trainer is built beyond the shared settings, following that trainer's own tests."""

    data: Dataset = ECHO_DATA
    env: type = EchoEnv
    expert: Callable = echo_expert  # a factory of generate functions, with hf_generate's signature
    fields: dict = field(default_factory=dict)  # config fields
    kwargs: dict = field(default_factory=dict)  # trainer keyword arguments: name -> a factory of the value
    after: Callable | None = None  # called with the built trainer


SETUPS: dict[str, Setup] = {
    # the oracle judge knows the built-in environments' tasks only; shop actions take longer turns (test_draco.py)
    "draco": Setup(
        SHOP_DATA, ShopEnv, shop_policy(p_expert=1.0), dict(max_completion_length=400, max_turn_tokens=64, max_turns=6)
    ),
    "taspo": Setup(kwargs=dict(analyzer=Scripted)),  # tests/test_taspo.py: the scripted offline analyzer
    "alignopsd": Setup(
        fields=dict(alignopsd_pi="column:hint", alignopsd_match_on="action", alignopsd_teacher_max_tokens=4)
    ),
    "funnel": Setup(after=funnel_state),
    "xtree": Setup(fields=dict(xtree_corpus_episodes=40, xtree_min_frequency=3)),
}


def mixed_policy(expert, seed: int = 0):
    """An `hf_generate` stand-in: per context, the expert's action with probability P_EXPERT, else the model's own
    sample (its ids and log-probs), from the real sampler called on every context."""
    rng = random.Random(seed)

    def factory(model, tokenizer, **kwargs):
        own, knows = REAL_GENERATE(model, tokenizer, **kwargs), expert(model, tokenizer, **kwargs)

        def generate(contexts, max_new_tokens):
            out = own(contexts, max_new_tokens)
            picked = [i for i in range(len(contexts)) if rng.random() < P_EXPERT]
            told = knows([contexts[i] for i in picked], max_new_tokens) if picked else []
            for i, (ids, logps) in zip(picked, told, strict=True):
                out[i] = (ids[:max_new_tokens], logps[:max_new_tokens])
            return out

        return generate

    return factory


def build(name: str, tiny_model_folder, tiny_tokenizer, out_dir, monkeypatch, **extra):
    trainer_cls, config_cls = TRAINERS[name]
    setup = SETUPS.get(name, Setup())
    settings = dict(per_device_train_batch_size=2 * G, num_generations=G, max_completion_length=60, max_turn_tokens=4,
                    max_steps=2, learning_rate=1e-2, lr_scheduler_type="constant")  # fmt: skip
    args = config_cls(output_dir=str(out_dir), **{**settings, **CPU_ARGS, **setup.fields, **extra})
    kwargs = {k: v() for k, v in setup.kwargs.items()}
    monkeypatch.setattr(agent_loop, "hf_generate", mixed_policy(setup.expert))
    trainer = trainer_cls(model=tiny_model_folder, args=args, train_dataset=setup.data,
                          processing_class=tiny_tokenizer, env_factory=lambda row: setup.env(), **kwargs)  # fmt: skip
    if setup.after is not None:
        setup.after(trainer)
    return trainer


def trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def check_trained(trainer, before: dict[str, torch.Tensor]) -> list[dict]:
    """Properties 1-3 of the module docstring; returns the 2 step logs."""
    steps = [row for row in trainer.state.log_history if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2] and trainer.state.global_step == 2
    assert all(math.isfinite(row["loss"]) and math.isfinite(row["grad_norm"]) for row in steps), steps
    generated = [row["frac_reward_zero_std"] for row in steps if "frac_reward_zero_std" in row]  # per batch
    assert generated and all(f < 1.0 for f in generated), "every group of a generation batch had one reward"
    assert any(row["grad_norm"] > 0 for row in steps), [row["grad_norm"] for row in steps]
    after = dict(trainer.model.named_parameters())
    assert before and after.keys() >= before.keys()
    unchanged = [n for n, p in before.items() if torch.equal(p, after[n])]
    assert not unchanged, f"parameters that did not move: {unchanged}"
    return steps


@pytest.mark.parametrize("per_generation", [1, 2], ids=["on_policy", "two_minibatches"])
@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_trains_two_steps(name, per_generation, tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch):
    """`per_generation` 2: both steps train on one generation batch, split in two (the second one off-policy)."""
    trainer = build(name, tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch,
                    steps_per_generation=per_generation)  # fmt: skip
    before = trainable(trainer)
    torch.manual_seed(0)
    trainer.train()
    check_trained(trainer, before)


@pytest.mark.parametrize("name", sorted(TRAINERS))
def test_trains_two_steps_under_envsched(name, tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch):
    trainer = build(name, tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch, scheduler="envsched",
                    sched_explore=0.25)  # fmt: skip
    scheduler = trainer.task_scheduler
    assert scheduler is not None
    draws, played = [], []  # the scheduler's draws, and the task of each rollout it was updated with
    draw, update = scheduler.draw, scheduler.update
    monkeypatch.setattr(scheduler, "draw", lambda: draws.append(list(draw())) or draws[-1])
    monkeypatch.setattr(scheduler, "update", lambda idx, *a: played.append([int(i) for i in idx]) or update(idx, *a))
    before = trainable(trainer)
    torch.manual_seed(0)
    trainer.train()
    steps = check_trained(trainer, before)
    assert len(played) == 2  # one generation batch per optimizer step, each fed back to the scheduler
    for tasks, drawn in zip(played, draws, strict=False):  # batch k plays draw k: its B = 8 / G tasks, G times each
        assert sorted(set(tasks)) == sorted(drawn) and all(tasks.count(i) == G for i in drawn)
    seen = {i for tasks in played for i in tasks}
    assert {int(i) for i in scheduler.W.nonzero()[0]} == seen  # the statistics hold the played tasks only
    assert int(scheduler.n_sel.sum()) == len(draws) * len(draws[0]) and scheduler.t == len(draws)
    for row in steps:
        assert 0.0 <= row["sched/zero_variance_group_frac"] <= 1.0 and row["sched/unique_tasks_seen"] >= 2
