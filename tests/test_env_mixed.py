"""The mixed pool (envs/mixed.py): a third of the tasks from each built-in environment, every episode played by its
task's own environment, splits that never overlap, and the per-environment success of a held-out evaluation."""

from __future__ import annotations

import random

import pytest

from envs import ENVIRONMENTS
from envs.base import noisy_expert_episode
from envs.mixed import MixedEnv


def test_a_third_from_each_environment_in_a_seeded_order():
    tasks = MixedEnv.make_tasks("train", 10, seed=3)
    counts = {name: sum(t["env"] == name for t in tasks) for name in ("shop", "search", "terminal")}
    assert counts == {"shop": 4, "search": 3, "terminal": 3}  # 10 = 3 + 3 + 3, the first environment one more
    assert MixedEnv.make_tasks("train", 10, seed=3) == tasks  # seeded
    assert [t["env"] for t in tasks] != sorted(t["env"] for t in tasks)  # shuffled, not in blocks
    train = {t["task_id"] for t in MixedEnv.make_tasks("train", 300, seed=0)}
    held_out = {t["task_id"] for t in MixedEnv.make_tasks("eval", 60, seed=0)}
    assert len(train) == 300 and not train & held_out


@pytest.mark.parametrize("name", ["shop", "search", "terminal"])
def test_each_task_plays_as_in_its_own_environment(name):
    task = next(t for t in MixedEnv.make_tasks("train", 9, seed=1) if t["env"] == name)
    mixed, own = MixedEnv(), ENVIRONMENTS[name]()
    a = noisy_expert_episode(mixed, task, 0.5, random.Random(7))
    b = noisy_expert_episode(own, task, 0.5, random.Random(7))
    assert a == b and mixed.max_turns == own.max_turns
    assert mixed.descriptor(task) == own.descriptor(task) and mixed.state_key() == own.state_key()
    assert MixedEnv().privileged(task) == ENVIRONMENTS[name]().privileged(task)


def test_a_task_without_an_environment_is_refused():
    with pytest.raises(ValueError, match="`env` field"):
        MixedEnv().reset({"instruction": "x"})


def test_held_out_success_is_reported_per_environment(tiny_model_folder, monkeypatch):
    """`evaluate` on mixed tasks adds each environment's success; the episodes' outcomes are scripted here (shop tasks
    all succeed, search tasks half, terminal tasks none), so the expected means are known by hand."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_trl import evaluation
    from agent_trl.evaluation import evaluate
    from trainers.agent_loop import LoopSettings, Rollout

    tasks = MixedEnv.make_tasks("eval", 12, seed=0)  # 4 per environment
    wins = {"shop": [True] * 4, "search": [True, False, True, False], "terminal": [False] * 4}
    outcome = {t["task_id"]: wins[t["env"]][[u["task_id"] for u in tasks if u["env"] == t["env"]].index(t["task_id"])]
               for t in tasks}  # fmt: skip

    def scripted(generate, tokenizer, envs, chunk, prompts=None, settings=None, **kw):
        return [Rollout(prompt_ids=[0], success=outcome[t["task_id"]], turn_rewards=[1.0]) for t in chunk]

    monkeypatch.setattr(evaluation, "play", scripted)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    tok = AutoTokenizer.from_pretrained(tiny_model_folder, padding_side="left")
    out = evaluate(model, tok, MixedEnv, tasks, LoopSettings(4, 40, 2), progress=False)
    assert out["by_env"] == {"search": 0.5, "shop": 1.0, "terminal": 0.0}
    assert out["success"] == pytest.approx(6 / 12)
