"""The reasoning-gym adapter (`envs/adapters/reasoning_gym.py`, `environment: reasoning_gym:<task>`) on the package's
real `aiw` generator: reset/step/score against the package's own items and scorer, `<answer>` tags, the multi-turn
`attempts` variant, an empty answer, a budget ended by the environment inside `trainers.agent_loop.play`, the
start-up errors (bad task name, bad environment_kwargs, package missing) and the tiny default's expert and
demonstrations.

Expected values are derived without the adapter: an aiw item at curriculum level 0 is a siblings question ("X has N
sisters and she also has M brothers. How many sisters does <her / Y's> brother have?"), whose answer is N + 1 (the
brother's sisters are X's N sisters plus X); partial scores come from reasoning-gym's scorer rule (oracle inside the
answer: len(oracle) / len(answer)), worked by hand and cross-checked against `score_answer` called directly.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import reasoning_gym
from reasoning_gym.factory import CURRICULA

from envs.adapters import adapter_class
from envs.sources import load_environment
from envs.tiny import build_tokenizer, check_expert, demonstrations
from trainers.agent_loop import LoopSettings, play

SPEC = "reasoning_gym:aiw"


def hand_answer(question: str) -> str:
    """The siblings question's answer by hand: the brother's sisters are the N sisters plus the girl herself."""
    n = int(re.search(r"(\d+) sisters", question).group(1))
    assert "How many sisters does" in question  # level 0 of aiw asks only siblings questions
    return str(n + 1)


def package_item(task: dict) -> dict:
    """The item of `task` straight from the package: level 0 of aiw's curriculum, the generator at the task's seed."""
    curriculum = CURRICULA["aiw"]()
    curriculum.set_global_level(0)
    config = dataclasses.asdict(curriculum.generate_configuration({}))
    config = {k: v for k, v in config.items() if k not in ("seed", "size")}
    return reasoning_gym.create_dataset("aiw", seed=task["seed"], size=task["index"] + 1, **config)[task["index"]]


@pytest.fixture(scope="module")
def single():
    return adapter_class(SPEC, {})


@pytest.fixture(scope="module")
def tasks(single):
    return single.make_tasks("train", 4, seed=0)


def test_reset_shows_the_package_item_and_its_own_answer_scores_one(single, tasks):
    for task in tasks:
        env = single()
        question = env.reset(task)
        item = package_item(task)
        assert question == item["question"]
        assert item["answer"] == hand_answer(question)
        observation, reward, done, info = env.step(hand_answer(question))
        assert (observation, reward, done) == ("correct", 1.0, True)
        assert info["success"] is True and info["score"] == 1.0


def test_a_wrong_answer_gets_the_package_score_and_fails(single, tasks):
    env = single()
    question = env.reset(tasks[0])
    right = hand_answer(question)
    wrong = "1" + right + "0"  # holds the oracle: len(right) / (len(right) + 2), e.g. "5" -> "150": 1/3
    expected = len(right) / (len(right) + 2)
    assert reasoning_gym.get_score_answer_fn("aiw")(wrong, package_item(tasks[0])) == pytest.approx(expected)
    observation, reward, done, info = env.step(wrong)
    assert reward == pytest.approx(expected) and done and info["success"] is False
    assert observation == f"wrong (score {expected:.2f})"
    env.reset(tasks[0])
    _, reward, done, info = env.step("no idea")  # no oracle digits: reasoning-gym scores it 0
    assert (reward, done, info["success"]) == (0.0, True, False)


def test_the_last_answer_tag_is_the_answer(single, tasks):
    env = single()
    right = hand_answer(env.reset(tasks[1]))
    wrong = str(int(right) + 1)
    turn = f"Let me think. Maybe <answer>{wrong}</answer>? No: the girl counts too.\n<answer> {right} </answer>"
    _, reward, done, info = env.step(turn)
    assert (reward, done, info["success"]) == (1.0, True, True)
    env.reset(tasks[1])
    _, reward, _, info = env.step(f"<answer>{right}</answer> then <answer>{wrong}</answer>")
    assert info["success"] is False and reward < 1.0  # the last tag counts, not the first


def test_attempts_give_feedback_until_the_last_answer():
    cls = adapter_class(SPEC, {"attempts": 3})
    task = cls.make_tasks("train", 1, seed=0)[0]
    env = cls()
    right = hand_answer(env.reset(task))
    wrong = [str(int(right) + k) for k in (1, 2, 3)]  # other numbers: no oracle inside, each scores 0
    for attempt in wrong[:2]:
        observation, reward, done, info = env.step(attempt)
        assert (observation, reward, done, info["success"]) == ("wrong (score 0.00); try again", 0.0, False, False)
    observation, reward, done, info = env.step(wrong[2])
    assert (observation, reward, done, info["success"]) == ("wrong (score 0.00)", 0.0, True, False)
    with pytest.raises(RuntimeError):
        env.step(right)  # the episode is over
    env.reset(task)
    env.step(wrong[0])
    assert env.step(right)[1:3] == (1.0, True)  # a right second answer ends it with success


def test_an_empty_answer_is_an_error_observation_and_the_episode_goes_on():
    cls = adapter_class(SPEC, {"attempts": 2})
    task = cls.make_tasks("train", 1, seed=0)[0]
    env = cls()
    right = hand_answer(env.reset(task))
    observation, reward, done, info = env.step("<answer>  </answer>")
    assert observation.startswith("error:") and (reward, done) == (0.0, False)
    assert info["success"] is False and info["invalid"] is True
    _, reward, done, info = env.step(right)
    assert (reward, done, info["success"]) == (1.0, True, True)


def test_an_always_wrong_agent_is_stopped_by_the_environment_after_its_attempts():
    cls = adapter_class(SPEC, {"attempts": 2})
    task = cls.make_tasks("train", 1, seed=0)[0]
    right = hand_answer(package_item(task)["question"])
    action = right + "0"  # e.g. "50" for "5": holds the oracle, score len(right) / (len(right) + 1) = 1/2
    tokenizer = build_tokenizer(["user assistant system", action, "wrong score try again correct"] * 20, 300)
    ids = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(contexts, max_new_tokens):
        return [(list(ids), [-0.1] * len(ids)) for _ in contexts]

    settings = LoopSettings(max_turn_tokens=64, max_completion_length=4000, max_turns=10)  # more turns than attempts
    (rollout,) = play(generate, tokenizer, [cls()], [task], settings=settings)
    partial = len(right) / (len(right) + 1)
    assert [t["action"] for t in rollout.transcript] == [action, action]
    assert rollout.done and not rollout.truncated and not rollout.success
    assert rollout.turn_rewards == pytest.approx([0.0, partial])  # the episode's reward: the last answer's score


def test_an_unknown_task_names_the_field_and_a_close_name():
    with pytest.raises(SystemExit) as e:
        load_environment("reasoning_gym:no_such_task")
    assert "environment" in str(e.value) and "no_such_task" in str(e.value)
    with pytest.raises(SystemExit) as e:
        load_environment("reasoning_gym:aiww")
    assert "aiww" in str(e.value) and "did you mean aiw" in str(e.value)


def test_bad_environment_kwargs_name_the_field_and_the_key():
    with pytest.raises(SystemExit) as e:
        load_environment(SPEC, {"no_such_setting": 1})
    assert "environment_kwargs" in str(e.value) and "no_such_setting" in str(e.value)
    with pytest.raises(SystemExit) as e:
        load_environment(SPEC, {"attempts": 0})
    assert "environment_kwargs" in str(e.value) and "attempts" in str(e.value)


def test_load_environment_builds_the_adapter_with_its_tasks():
    source = load_environment(SPEC, {"attempts": 2})
    env = source.factory({})
    assert env.max_turns == 2 and env.name == SPEC
    train, evals = source.make_tasks("train", 30, seed=0), source.make_tasks("eval", 10, seed=0)
    env_train, env_eval = source.factory({}), source.factory({})
    questions = {env_train.reset(t) for t in train}
    assert not questions & {env_eval.reset(t) for t in evals}  # the splits share no question


def test_the_expert_passes_the_tiny_default_check(single):
    check_expert(single, f"tiny:{SPEC}", 0, n=5)  # returns without SystemExit


def test_demonstrations_are_the_items_answers_and_replay_to_success(single):
    demos = demonstrations(single, n=4, seed=0, difficulty=0, noise=0.0)
    tasks = single.make_tasks("train", 4, seed=0)
    assert len(demos) == 4
    for demo, task in zip(demos, tasks, strict=True):
        assert [m["role"] for m in demo] == ["user", "assistant"]  # one answer ends a single-turn episode
        assert demo[0]["content"] == package_item(task)["question"]
        assert demo[1]["content"] == hand_answer(demo[0]["content"])
        env = single()
        env.reset(task)
        _, _, done, info = env.step(demo[1]["content"])
        assert done and info["success"]
