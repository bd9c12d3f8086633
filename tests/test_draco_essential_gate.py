"""draco.md D19, the essential gate: a rollout that fails a criterion the judge marked essential scores R = −1.

Hand-built rubrics and judge answers (the pure reward, a scripted HTTP judge through the real `Judge` client and
`RubricPipeline`, the oracle on the shop), plus a property test over random verdicts."""

import json
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import yaml

from envs import ShopEnv
from rewards.judge import Judge, JudgeConfig
from rewards.oracle import OracleJudge, shop_checks
from rewards.rubrics import (
    TEMPLATE_VERSION,
    Criterion,
    DracoReward,
    RubricPipeline,
    TaskCriterion,
    fallback_merge,
    gated_rubric_reward,
    rubric_reward,
    task_rubric_messages,
)
from tests.judge_server import JudgeServer, ok
from trainers.draco import DRACOConfig

# The shop's rubric, by hand: five outcome criteria the instruction names (essential), then two that are not.
SHOP_ESSENTIAL = [True, True, True, True, True, False, False]  # type, material, colour, size, price; search, valid


def test_gated_reward_by_hand():
    every = list(range(7))
    # a success: 7 passes -> 1 with or without the gate
    assert gated_rubric_reward([1] * 7, every, SHOP_ESSENTIAL) == 1.0
    # bought without the size: Eq. 2 gives (6 - 1) / 7 = 5/7; the gate: -1
    no_size = [1, 1, 1, -1, 1, 1, 1]
    assert rubric_reward(no_size, every) == pytest.approx(5 / 7)
    assert gated_rubric_reward(no_size, every, SHOP_ESSENTIAL) == -1.0
    # a success that failed both non-essential criteria: (5 - 2) / 7 = 3/7, not gated, above the no-size purchase
    assert gated_rubric_reward([1, 1, 1, 1, 1, -1, -1], every, SHOP_ESSENTIAL) == pytest.approx(3 / 7)
    # not applicable (0) on an essential criterion is not a failure: (5 - 0) / 5 over the applicable ones
    assert gated_rubric_reward([1, 1, 1, 0, 1, 1, 0], every, SHOP_ESSENTIAL) == 1.0
    # a failed essential criterion dropped by Eq. 1 (not surviving) does not gate: (5 - 1) / 6 = 2/3 over the rest
    assert gated_rubric_reward([1, 1, 1, -1, 1, 1, -1], [0, 1, 2, 4, 5, 6], SHOP_ESSENTIAL) == pytest.approx(2 / 3)
    assert gated_rubric_reward(None, every, SHOP_ESSENTIAL) is None  # unscorable stays unscorable
    # nothing essential: exactly Eq. 2
    assert gated_rubric_reward(no_size, every, [False] * 7) == pytest.approx(5 / 7)


def group_advantages(rewards: Sequence[float]) -> torch.Tensor:
    r = torch.tensor(rewards, dtype=torch.float64)  # (G,)
    return (r - r.mean()) / (r.std() + 1e-4)  # Eq. 3 (TRL's unbiased std)


def test_property_a_rollout_failing_an_essential_criterion_never_wins():
    rng = random.Random(0)
    mixed = 0
    for _ in range(500):
        C, G = rng.randint(1, 8), rng.randint(2, 8)
        essential = [rng.random() < 0.4 for _ in range(C)]
        verdicts = [[rng.choice([-1, 0, 1]) for _ in range(C)] for _ in range(G)]
        surviving = sorted(rng.sample(range(C), rng.randint(0, C)))
        gated = [any(essential[c] and v[c] == -1 for c in surviving) for v in verdicts]
        rewards = [gated_rubric_reward(v, surviving, essential) for v in verdicts]
        for v, g, r in zip(verdicts, gated, rewards, strict=True):
            assert r == (-1.0 if g else rubric_reward(v, surviving))
        passing = [r for g, r in zip(gated, rewards, strict=True) if not g]
        assert all(r <= min(passing, default=1.0) for g, r in zip(gated, rewards, strict=True) if g)
        if any(gated) and passing:  # a group where some rollout reaches every essential outcome
            mixed += 1
            adv = group_advantages(rewards)
            assert all(float(a) <= 1e-12 for g, a in zip(gated, adv, strict=True) if g)
    assert mixed > 100  # the property was exercised


def test_config_default_is_the_papers_eq2_and_the_shop_recipe_turns_the_gate_on():
    assert DRACOConfig(output_dir="/tmp/x", use_cpu=True, bf16=False).draco_essential_gate is False
    with open(Path(__file__).resolve().parent.parent / "configs" / "draco_shop.yaml") as f:
        assert yaml.safe_load(f)["draco_essential_gate"] is True


def test_prompts_ask_for_essential_and_the_fallback_merge_keeps_it():
    text = task_rubric_messages("[USER]\nbuy a red shirt")[1]["content"]
    assert "essential (true only for an outcome the\ntask text itself names" in text
    assert TEMPLATE_VERSION == "draco-v2"  # a new S1 cache key: v1 rubrics had no flag
    size = TaskCriterion(title="Size M", description="d", evaluator_instruction="e", essential=True)
    search = TaskCriterion(title="Search", description="d", evaluator_instruction="e")
    merged = fallback_merge([size], [[search]])
    assert [(c.title, c.essential) for c in merged] == [("Size M", True), ("Search", False)]
    assert (
        Criterion.model_validate({"title": "t", "description": "d", "evaluator_instruction": "e"}).essential is False
    )


# A scripted OpenAI-compatible judge. Three one-step rollouts of "buy a red cotton shirt in size M":
#   A chose the size and bought, but never searched and made an invalid action: passes size, type; fails search, valid
#   B searched and bought without a size: passes type, search, valid; fails size
#   C did nothing useful: fails everything
ROLLOUTS = ["choose[M] then buy", "search[red cotton shirt] then buy", "wait"]
CRITERIA = [
    {"title": "Size M was chosen", "essential": True},
    {"title": "The bought item is a shirt", "essential": True},
    {"title": "A search names the wanted item", "essential": False},
    {"title": "Every action is valid", "essential": False},
]
VERDICTS = {"choose[M]": [1, 1, -1, -1], "search[red": [-1, 1, 1, 1], "wait": [-1, -1, -1, -1]}


def scripted_judge_reply(body: dict):
    user = body["messages"][-1]["content"]
    full = [{**c, "description": c["title"] + ".", "evaluator_instruction": "Decide."} for c in CRITERIA]
    if "Write the criteria" in user:  # S1
        return ok(json.dumps({"criteria": [{**c, "grounding_references": []} for c in full]}))
    if "Propose extra criteria" in user:  # S2: nothing new
        return ok(json.dumps({"criteria": []}))
    if "Merge the candidate" in user:  # union: a judge that forgets the flag; the titles bring it back
        return ok(json.dumps({"criteria": [{k: v for k, v in c.items() if k != "essential"} for c in full]}))
    if "Score the rollout" in user:
        rollout = user.split("<rollout>", 1)[1].split("</rollout>", 1)[0]
        scores = next(v for k, v in VERDICTS.items() if k in rollout)
        entries = [{"rubric_title": c["title"], "score": s} for c, s in zip(CRITERIA, scores, strict=True)]
        return ok(json.dumps({"scores": entries}))
    raise AssertionError(f"unexpected request: {user[:80]}")


@pytest.mark.parametrize("gate", [False, True])
def test_pipeline_with_an_http_judge(gate, monkeypatch):
    monkeypatch.setenv("DRACO_GATE_TEST_KEY", "sk-test")
    with JudgeServer(default=scripted_judge_reply) as server:
        config = JudgeConfig(model="judge", base_url=server.base_url, api_key_env="DRACO_GATE_TEST_KEY", timeout=5.0)
        reward = DracoReward(RubricPipeline(Judge(config), essential_gate=gate), group_size=3)
        transcripts = [[{"action": a, "observation": "ok"}] for a in ROLLOUTS]
        rewards = reward(["buy a red cotton shirt in size M"] * 3, [""] * 3, transcript=transcripts)
    assert [c.essential for c in reward.last[0].criteria] == [True, True, False, False]
    if gate:
        # A: not gated, Eq. 2 (2 - 2) / 4 = 0; B fails the essential size: -1; C: -1
        assert rewards == [0.0, -1.0, -1.0]
    else:
        # Eq. 2: A (2 - 2) / 4 = 0, B (3 - 1) / 4 = 0.5 (out-scores the one that chose the size), C -1
        assert rewards == [0.0, 0.5, -1.0]
    # both: 2 of 3 rollouts fail an essential criterion, 2 essential criteria survive the group's dropout
    assert reward.last_metrics["draco/essential_fail_rate"] == pytest.approx(2 / 3)
    assert reward.last_metrics["draco/criteria_essential"] == 2.0


def test_oracle_marks_the_shops_outcome_checks_essential_and_gates_a_purchase_without_size():
    task = ShopEnv.make_tasks("train", 1, seed=3, difficulty=0)[0]
    assert [c.essential for c in shop_checks(task, [])] == SHOP_ESSENTIAL
    env = ShopEnv(0)
    env.reset(task)
    search = env.expert_action()
    env.step(search)
    click = env.expert_action()
    plays = [[search, click, f"choose[{task['target']['size']}]", "buy"], [search, click, "buy"], [search]]
    firsts, transcripts = [], []
    for actions in plays:
        env = ShopEnv(0)
        firsts.append(env.reset(task))
        transcripts.append([{"action": a, "observation": env.step(a)[0]} for a in actions])
    reward = DracoReward(RubricPipeline(OracleJudge([task]), essential_gate=True), group_size=3)
    # success 1; no size: -1 (Eq. 2 gave 0.6, tests/test_draco_reward_bench.py); nothing bought: -1
    assert reward(firsts, [""] * 3, transcript=transcripts, task_id=[task["task_id"]] * 3) == [1.0, -1.0, -1.0]


def test_trainer_smoke_with_the_gate(tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch):
    from tests.helpers.draco import DATA, SHOP_TASKS, Probe, check_batches, config, scripted_policy
    from trainers import agent_loop

    monkeypatch.setattr(agent_loop, "hf_generate", scripted_policy(p_expert=0.6))
    trainer = Probe(
        model=tiny_model_folder, args=config(tmp_path, draco_essential_gate=True), train_dataset=DATA,
        processing_class=tiny_tokenizer, env_factory=lambda row: ShopEnv(), judge=OracleJudge(SHOP_TASKS),
    )  # fmt: skip
    assert trainer.pipeline.essential_gate is True
    trainer.train()
    check_batches(trainer)
    records = trainer.draco_reward.last  # the last step's rows: C* with the flags, scoring verdicts, reward
    gated = [any(c.essential and v == -1 for c, v in zip(r.criteria, r.verdicts, strict=True)) for r in records]
    assert any(gated) and not all(gated)
    eq2 = [rubric_reward(r.verdicts, range(len(r.verdicts))) for r in records]
    for r, g, plain in zip(records, gated, eq2, strict=True):
        assert r.reward == (-1.0 if g else plain)
    assert any(g and plain > -1.0 for g, plain in zip(gated, eq2, strict=True))  # the gate changed some reward
