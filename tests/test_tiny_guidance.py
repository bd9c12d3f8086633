"""The tiny default's guidance demonstrations (`TinySpec.guidance_frac`, `envs.tiny.guidance_block`): noise-free
expert episodes under a system message in one of the forms the teacher methods show their teacher."""

from __future__ import annotations

import random

import pytest

from envs import ENVIRONMENTS
from envs.base import SKILL_HEADER
from envs.tiny import GUIDANCE_FORMS, TinySpec, demonstrations, guidance_block
from rewards.analyzer import ExtractedItems, OracleAnalyzer, expert_items, extraction_messages
from rewards.rubrics import render_task


def assistant_actions(demo: list[dict]) -> list[str]:
    return [m["content"] for m in demo if m["role"] == "assistant"]


def replay_is_expert(env_name: str, task: dict, actions: list[str]) -> bool:
    """Every action equals the expert's in the state it was taken in, and the episode ends in success."""
    env = ENVIRONMENTS[env_name]()
    env.reset(task)
    info, done = {}, False
    for action in actions:
        if action != env.expert_action():
            return False
        _, _, done, info = env.step(action)
    return done and bool(info.get("success"))


@pytest.mark.parametrize("env_name", ["shop", "search", "terminal"])
def test_every_guided_demo_follows_the_expert_under_its_block(env_name):
    env_cls = ENVIRONMENTS[env_name]
    tasks = env_cls.make_tasks("train", 30, seed=0)
    demos = demonstrations(env_cls, 30, seed=0, difficulty=0, noise=0.3, guidance_frac=1.0)
    forms = set()
    for task, demo in zip(tasks, demos, strict=True):
        system, user = demo[0], demo[1]
        assert system["role"] == "system" and user["role"] == "user"
        assert "Plan:" not in user["content"]  # the task's message is the plain first observation
        actions = assistant_actions(demo)
        assert replay_is_expert(env_name, task, actions)  # no noise under guidance
        block = system["content"]
        if block.startswith("Plan: "):
            forms.add("plan")
            assert block == "Plan: " + " | ".join(a.strip() for a in actions)
        elif block.startswith(SKILL_HEADER):
            forms.add("skill")
            assert block == SKILL_HEADER + "\n" + env_cls.skill.strip()
        else:
            forms.add("rules")
            lines = block.split("\n")
            assert lines[0] == "Privileged guidance for this task (used in training only):"
            # each rule is one of the oracle's for this episode, in turn order, numbered from 1
            env = env_cls()
            first = env.reset(task)
            quoted = []
            for action in actions:
                seen = " ".join(first.split())
                assert len(seen) < 200  # level-0 observations are quoted whole (the oracle clips longer ones)
                quoted.append((seen, action))
                first = env.step(action)[0]
            rules = [line.split(". ", 1) for line in lines[1:]]
            assert [n for n, _ in rules] == [str(k) for k in range(1, len(rules) + 1)]
            expected = [f"When the environment has just shown «{seen}»: take the action «{a}»" for seen, a in quoted]
            texts = [text for _, text in rules]
            assert texts and all(t in expected for t in texts)
            assert [expected.index(t) for t in texts] == sorted(expected.index(t) for t in texts)
    assert forms == set(GUIDANCE_FORMS)


def test_the_shares_of_guided_demos_and_of_their_forms():
    demos = demonstrations(ENVIRONMENTS["shop"], 400, seed=1, difficulty=0, noise=0.3, guidance_frac=0.5)
    guided = [d for d in demos if d[0]["role"] == "system"]
    # Binomial(400, 0.5): mean 200, sd 10; 5 sd either side
    assert 150 <= len(guided) <= 250
    counts = {"plan": 0, "skill": 0, "rules": 0}
    for d in guided:
        block = d[0]["content"]
        counts["plan" if block.startswith("Plan:") else "skill" if block.startswith(SKILL_HEADER) else "rules"] += 1
    for n in counts.values():  # each form 1/3 of the guided demos: about 67 of 200, sd about 7
        assert abs(n - len(guided) / 3) <= 35
    assert any(
        not replay_is_expert("shop", t, assistant_actions(d))
        for t, d in zip(ENVIRONMENTS["shop"].make_tasks("train", 400, seed=1), demos, strict=True)
        if d[0]["role"] != "system"
    )  # the others stay noisy


def test_no_guidance_leaves_the_demos_and_the_key_as_before():
    shop = ENVIRONMENTS["shop"]
    assert demonstrations(shop, 50, seed=0, difficulty=0, noise=0.3, guidance_frac=0.0) == demonstrations(
        shop, 50, seed=0, difficulty=0, noise=0.3
    )
    assert all(d[0]["role"] == "user" for d in demonstrations(shop, 50, seed=0, difficulty=0, noise=0.3))
    plain, guided = TinySpec(env="shop"), TinySpec(env="shop", guidance_frac=0.5)
    assert TinySpec(env="shop", guidance_frac=0.0).key() == plain.key()
    assert guided.key() != plain.key() != TinySpec(env="shop", guidance_frac=0.25).key()


def test_privileged_and_guided_demos_are_distinct_shares():
    demos = demonstrations(
        ENVIRONMENTS["search"], 200, seed=0, difficulty=0, noise=0.3, privileged_frac=0.5, guidance_frac=0.5
    )
    for d in demos:  # a demo shows the plan in its user message, or guidance in a system message, never both
        assert not (d[0]["role"] == "system" and "Plan:" in d[1]["content"])
    privileged = sum("Plan:" in d[0]["content"] for d in demos if d[0]["role"] == "user")
    guided = sum(d[0]["role"] == "system" for d in demos)
    # privileged ~ Binomial(200, 1/2) (sd 7); guided: half of the rest, ~ Binomial(200, 1/4) (sd 6)
    assert 65 <= privileged <= 135 and 20 <= guided <= 80


def test_expert_items_are_what_the_oracle_extracts_from_an_expert_rollout():
    shop = ENVIRONMENTS["shop"]
    task = shop.make_tasks("train", 1, seed=3)[0]
    env = shop()
    first = env.reset(task)
    transcript, done = [], False
    while not done:
        action = env.expert_action()
        observation, reward, done, _ = env.step(action)
        transcript.append({"action": action, "observation": observation})
    messages = extraction_messages(render_task(first), [(0, transcript)])
    oracle = OracleAnalyzer([task]).answer(messages[1]["content"], ExtractedItems)
    ours = expert_items(first, [(t["action"], t["observation"]) for t in transcript])
    assert [(e["rule"], e["condition"]) for e in oracle["items"]] == [(e.rule, e.condition) for e in ours]
    assert len(ours) == 4  # search, click, choose, buy at level 0
    assert ours[0].condition == f"the environment has just shown «{' '.join(first.split())}»"
    assert ours[1].rule == f"take the action «{transcript[1]['action']}»"


def test_guidance_forms_skip_a_missing_skill_card():
    class NoSkill(ENVIRONMENTS["shop"]):
        skill = ""

    env = NoSkill()
    task = NoSkill.make_tasks("train", 1, seed=0)[0]
    first = env.reset(task)
    transcript = [{"action": "search[x]", "observation": "results: none"}]
    blocks = {guidance_block(env, first, transcript, random.Random(k))[:20] for k in range(40)}
    assert blocks == {"Plan: search[x]", "Privileged guidance "}  # the plan and the rules, never an empty card
