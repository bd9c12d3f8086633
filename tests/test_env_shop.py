"""Contract tests of the shop environment (`envs/shop.py`): seeded tasks, disjoint splits, the expert, the verifier,
error handling and state keys. Offline and fast (in-process catalogues only)."""

from __future__ import annotations

import json
import random
import re

import pytest

from envs.base import split_of
from envs.shop import ShopEnv

LEVELS = (0, 1, 2)
EXPERT_TURNS = {0: 4, 1: 4, 2: 5}


def listed_ids(observation: str) -> list[str]:
    return re.findall(r"\[([A-Za-z0-9]+)\]", observation)


def play(task: dict, policy: str = "expert", seed: int = 0, p_noise: float = 0.3) -> list[tuple]:
    """One episode; returns [(action, observation, reward, done, success, state_key), ...] after the reset row."""
    env, rng = ShopEnv(), random.Random(seed)
    transcript = [("", env.reset(task), 0.0, False, False, env.state_key())]
    for _ in range(env.max_turns):
        noisy = policy == "noisy" and rng.random() < p_noise
        action = env.noisy_action(rng) if noisy else env.expert_action()
        obs, reward, done, info = env.step(action)
        transcript.append((action, obs, reward, done, info["success"], env.state_key()))
        if done:
            break
    return transcript


def go_to_item(env: ShopEnv, task: dict, item_id: str | None = None) -> str:
    """Reset, search with the expert's query, open `item_id` (default: the match); returns the item page."""
    env.reset(task)
    env.step(env.expert_action())
    obs, _, _, _ = env.step(f"click[{item_id or env.target_id}]")
    assert obs.startswith("item "), obs
    return obs


@pytest.mark.parametrize("level", LEVELS)
def test_make_tasks_seeded_distinct_and_serialisable(level):
    tasks = ShopEnv.make_tasks("train", 60, seed=3, difficulty=level)
    assert tasks == ShopEnv.make_tasks("train", 60, seed=3, difficulty=level)
    assert tasks != ShopEnv.make_tasks("train", 60, seed=4, difficulty=level)
    assert len(tasks) == 60
    assert len({t["task_id"] for t in tasks}) == 60
    assert len({t["instruction"] for t in tasks}) == 60
    assert json.loads(json.dumps(tasks)) == tasks
    for t in tasks:
        assert t["env"] == "shop" and t["difficulty"] == level
        target = t["target"]
        words = f"{target['colour']} {target['material']} {target['type']}, size {target['size']}"
        assert t["instruction"] == f"i need a {words}, under {target['max_price']} dollars"


def test_make_tasks_rejects_bad_arguments():
    with pytest.raises(ValueError):
        ShopEnv.make_tasks("test", 5)
    with pytest.raises(ValueError):
        ShopEnv.make_tasks("train", 5, difficulty=3)


@pytest.mark.parametrize("level", LEVELS)
def test_train_and_eval_are_disjoint(level):
    train = ShopEnv.make_tasks("train", 400, seed=0, difficulty=level)
    evals = ShopEnv.make_tasks("eval", 400, seed=0, difficulty=level)
    assert not {t["instruction"] for t in train} & {t["instruction"] for t in evals}
    assert not {t["task_id"] for t in train} & {t["task_id"] for t in evals}
    assert all(split_of(t["instruction"]) == "train" for t in train)
    assert all(split_of(t["instruction"]) == "eval" for t in evals)


def test_episode_transcripts_are_deterministic():
    tasks = ShopEnv.make_tasks("train", 30, seed=1, difficulty=2) + ShopEnv.make_tasks("eval", 30, seed=1)
    for i, task in enumerate(tasks):
        first = play(task, "noisy", seed=i)
        assert first == play(json.loads(json.dumps(task)), "noisy", seed=i)
        assert len(first) >= 2


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("split", ["train", "eval"])
def test_expert_succeeds_on_every_task(level, split):
    for task in ShopEnv.make_tasks(split, 200, seed=0, difficulty=level):
        transcript = play(task)
        turns = len(transcript) - 1
        action, obs, reward, done, success, _ = transcript[-1]
        assert (action, done, success, reward) == ("buy", True, True, 1.0), transcript
        assert 3 <= turns <= ShopEnv.max_turns and turns == EXPERT_TURNS[level]
        assert all(row[2] == 0.0 and not row[3] for row in transcript[:-1])  # outcome reward on the final turn only
        assert max(len(row[1].split()) for row in transcript) <= 50  # short observations


def test_expert_transcript_at_level_0():
    task = {
        "task_id": "shop-0-example",
        "env": "shop",
        "difficulty": 0,
        "instruction": "i need a red cotton shirt, size m, under 40 dollars",
        "target": {"type": "shirt", "material": "cotton", "colour": "red", "size": "m", "max_price": 40},
        "catalogue_seed": 7,
    }
    transcript = play(task)
    assert transcript[0][1].startswith("Instruction: i need a red cotton shirt, size m, under 40 dollars")
    actions = [row[0] for row in transcript[1:]]
    ids = listed_ids(transcript[1][1])
    assert actions == ["search[red cotton shirt size m under 40 dollars]", f"click[{ids[0]}]", "choose[m]", "buy"]
    assert transcript[2][1].startswith(f"item {ids[0]}: red cotton shirt $")
    assert transcript[3][1] == "selected: size m"


def test_level_0_lists_the_match_first_and_sloppy_queries_can_mislead():
    misled = 0
    for task in ShopEnv.make_tasks("train", 200, seed=0, difficulty=0):
        env = ShopEnv()
        env.reset(task)
        obs, *_ = env.step(env.expert_action())
        assert listed_ids(obs)[0] == env.target_id  # positional copying suffices
        env.reset(task)
        t = task["target"]
        obs, *_ = env.step(f"search[{t['colour']} {t['material']} {t['type']} under {t['max_price']} dollars]")
        assert env.target_id in listed_ids(obs)
        misled += listed_ids(obs)[0] != env.target_id  # the twin without the size ties with the match
    assert 40 <= misled <= 160  # about half


@pytest.mark.parametrize("level", [1, 2])
def test_higher_levels_need_content_matching(level):
    positions, same_title_decoys = [], 0
    for task in ShopEnv.make_tasks("train", 200, seed=0, difficulty=level):
        env = ShopEnv()
        env.reset(task)
        obs, *_ = env.step(env.expert_action())
        ids = listed_ids(obs)
        assert env.target_id in ids and len(ids) == {1: 4, 2: 6}[level]
        positions.append(ids.index(env.target_id))
        title = re.search(rf"\[{env.target_id}\] ([a-z ]+) \$", obs).group(1)
        same_title_decoys += obs.count(f"] {title} $") > 1  # a twin above the price is listed too
    assert set(positions) == set(range(len(ids)))  # the match can be anywhere in the listing
    assert 15 <= positions.count(0) <= 80  # first in about 1/4 (level 1) or 1/6 (level 2) of the tasks
    assert same_title_decoys >= 100


@pytest.mark.parametrize("level", LEVELS)
def test_exactly_one_item_fits_each_instruction(level):
    for task in ShopEnv.make_tasks("eval", 100, seed=5, difficulty=level):
        env = ShopEnv()
        env.reset(task)
        t = task["target"]
        fits = [
            it["id"]
            for it in env.catalogue
            if (it["type"], it["material"]) == (t["type"], t["material"])
            and t["colour"] in it["colours"]
            and t["size"] in it["sizes"]
            and it["price"] <= t["max_price"]
        ]
        assert fits == [env.target_id]
        assert len(env.catalogue) == {0: 8, 1: 12, 2: 16}[level]
        assert len({it["id"] for it in env.catalogue}) == len(env.catalogue)


@pytest.mark.parametrize("level", LEVELS)
def test_buying_a_wrong_item_is_rejected(level):
    wrong_buys = 0
    for task in ShopEnv.make_tasks("train", 50, seed=2, difficulty=level):
        env = ShopEnv()
        env.reset(task)
        obs, *_ = env.step(env.expert_action())
        t = task["target"]
        for item_id in listed_ids(obs):
            if item_id == env.target_id:
                continue
            go_to_item(env, task, item_id)
            env.step(f"choose[{t['size']}]")  # an error observation when the item lacks the size
            if level == 2:
                env.step(f"choose[{t['colour']}]")
            obs_buy, reward, done, info = env.step("buy")
            assert done and not info["success"] and reward < 1.0, obs_buy
            assert reward == sum(info["matched"].values()) / 5
            assert info["bought"] == item_id
            wrong_buys += 1
    assert wrong_buys >= 50


@pytest.mark.parametrize("level", LEVELS)
def test_wrong_or_missing_options_are_rejected(level):
    for task in ShopEnv.make_tasks("train", 30, seed=4, difficulty=level):
        t, env = task["target"], ShopEnv()
        page = go_to_item(env, task)
        _, reward, done, info = env.step("buy")  # bought early, before choosing
        assert done and reward == (0.6 if level == 2 else 0.8) and not info["success"]
        assert not info["matched"]["size"]

        sizes = page.split("sizes: ")[1].split()
        wrong = next(s for s in sizes if s != t["size"])
        go_to_item(env, task)
        env.step(f"choose[{wrong}]")
        if level == 2:
            env.step(f"choose[{t['colour']}]")
        _, reward, done, info = env.step("buy")
        assert done and reward == 0.8 and not info["success"]
        assert info["matched"] == {"type": True, "material": True, "colour": True, "size": False, "price": True}

        if level == 2:
            colours = page.split("colours: ")[1].split(".")[0].split()
            go_to_item(env, task)
            env.step(f"choose[{t['size']}]")
            env.step(f"choose[{next(c for c in colours if c != t['colour'])}]")
            _, reward, _, info = env.step("buy")
            assert reward == 0.8 and not info["success"] and not info["matched"]["colour"]


def test_invalid_actions_give_error_observations():
    task = ShopEnv.make_tasks("train", 1, seed=0, difficulty=2)[0]
    env = ShopEnv()
    env.reset(task)
    t = task["target"]

    def assert_error(action: str) -> None:
        key = env.state_key()
        obs, reward, done, info = env.step(action)
        assert obs.startswith("error:") and reward == 0.0 and not done, (action, obs)
        assert info["success"] is False and info["invalid"] is True
        assert env.state_key() == key  # the state is unchanged

    for action in ["", "hello", "search[]", "search[ , ]", "click[B7K2]", "choose[m]", "buy", "search[a] click[b]"]:
        assert_error(action)
    env.step(env.expert_action())
    for action in ["click[ZZZZ]", "click[]", "choose[m]", "buy", "search red shirt", "[buy]"]:
        assert_error(action)
    env.step(env.expert_action())
    for action in ["click[" + env.target_id + "]", "choose[xxl]", "choose[" + t["material"] + "]", "choose[]"]:
        assert_error(action)
    for _ in range(3):  # the expert still finishes after the errors: choose, choose, buy
        _, reward, done, info = env.step(env.expert_action())
    assert info["success"] and reward == 1.0
    obs, reward, done, info = env.step("buy")
    assert obs.startswith("error:") and reward == 0.0 and done and info["success"]


def test_actions_are_parsed_leniently():
    task = ShopEnv.make_tasks("train", 1, seed=0, difficulty=0)[0]
    t, env = task["target"], ShopEnv()
    env.reset(task)
    obs, *_ = env.step(
        f"  SEARCH [ {t['colour']} {t['material']} {t['type']} size {t['size']}, under {t['max_price']} ]\n"
    )
    assert listed_ids(obs)[0] == env.target_id
    obs, *_ = env.step(f"\nclick[ {env.target_id.lower()} ]  ")
    assert obs.startswith(f"item {env.target_id}:")
    assert env.step(f" Choose[{t['size'].upper()}] ")[0] == f"selected: size {t['size']}"
    assert env.step(" buy \n")[1] == 1.0


def test_state_keys():
    task = ShopEnv.make_tasks("eval", 1, seed=0, difficulty=2)[0]
    t = task["target"]
    a, b = ShopEnv(), ShopEnv()
    a.reset(task), b.reset(task)
    keys = [a.state_key()]
    assert keys == ["start"]
    for _ in range(EXPERT_TURNS[2]):
        action = a.expert_action()
        a.step(action)
        b.step(action)
        assert a.state_key() == b.state_key()  # equal states, equal keys
        keys.append(a.state_key())
    assert len(set(keys)) == len(keys) == 6  # every step changed the state
    assert keys[3] == f"item:{a.target_id}:size={t['size']}:colour=-"
    assert keys[-1] == f"done:{a.target_id}:size={t['size']}:colour={t['colour']}"

    a.reset(task)
    search = a.expert_action()
    a.step(search)
    results_key = a.state_key()
    assert results_key.startswith("results:") and a.target_id in results_key
    a.step(a.expert_action())
    assert a.state_key() == keys[2]  # the same page reached again has the same key
    a.step(f"choose[{t['size']}]")
    size_key = a.state_key()
    a.step(f"choose[{t['size']}]")
    assert a.state_key() == size_key  # choosing the same option again changes nothing
    a.step(search)  # the same search again, from the item page
    assert a.state_key() == results_key


@pytest.mark.parametrize("level", LEVELS)
def test_noisy_actions_are_plausible_wrong_and_recoverable(level):
    kinds: set[str] = set()
    for i, task in enumerate(ShopEnv.make_tasks("train", 60, seed=6, difficulty=level)):
        rng = random.Random(i)
        for noisy_turn in range(EXPERT_TURNS[level]):  # one noisy action at each point of the expert's path
            env = ShopEnv()
            env.reset(task)
            for _ in range(noisy_turn):
                env.step(env.expert_action())
            noisy = env.noisy_action(rng)
            assert noisy != env.expert_action()
            kinds.add(noisy.split("[")[0])
            obs, reward, done, info = env.step(noisy)
            assert not obs.startswith("error: unknown action")
            turns = noisy_turn + 1
            while not done and turns < ShopEnv.max_turns:
                obs, reward, done, info = env.step(env.expert_action())
                turns += 1
            if noisy != "buy":  # anything but an early buy is recoverable within the turn budget
                assert done and info["success"]
            else:
                assert not info["success"] and reward < 1.0
    assert kinds == {"search", "click", "choose", "buy"}
