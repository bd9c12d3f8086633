"""Contract tests of the shop environment (`envs/shop.py`): seeded tasks, disjoint splits, the expert, the verifier,
error handling and state keys. Offline and fast (in-process catalogues only)."""

from __future__ import annotations

import json
import random
import re

import pytest

from envs.base import split_of
from envs.shop import ShopEnv

LEVELS = (0, 3, 4)  # one purchase each; the shopping lists (levels 1 and 2) are tested below
EXPERT_TURNS = {0: 4, 3: 4, 4: 5}


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
        ShopEnv.make_tasks("train", 5, difficulty=5)


@pytest.mark.parametrize("level", LEVELS)
def test_train_and_eval_are_disjoint(level):
    train = ShopEnv.make_tasks("train", 400, seed=0, difficulty=level)
    evals = ShopEnv.make_tasks("eval", 400, seed=0, difficulty=level)
    assert not {t["instruction"] for t in train} & {t["instruction"] for t in evals}
    assert not {t["task_id"] for t in train} & {t["task_id"] for t in evals}
    assert all(split_of(t["instruction"]) == "train" for t in train)
    assert all(split_of(t["instruction"]) == "eval" for t in evals)


def test_episode_transcripts_are_deterministic():
    tasks = ShopEnv.make_tasks("train", 30, seed=1, difficulty=4) + ShopEnv.make_tasks("eval", 30, seed=1)
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


@pytest.mark.parametrize("level", [3, 4])
def test_higher_levels_need_content_matching(level):
    positions, same_title_decoys = [], 0
    for task in ShopEnv.make_tasks("train", 200, seed=0, difficulty=level):
        env = ShopEnv()
        env.reset(task)
        obs, *_ = env.step(env.expert_action())
        ids = listed_ids(obs)
        assert env.target_id in ids and len(ids) == {3: 4, 4: 6}[level]
        positions.append(ids.index(env.target_id))
        title = re.search(rf"\[{env.target_id}\] ([a-z ]+) \$", obs).group(1)
        same_title_decoys += obs.count(f"] {title} $") > 1  # a twin above the price is listed too
    assert set(positions) == set(range(len(ids)))  # the match can be anywhere in the listing
    assert 15 <= positions.count(0) <= 80  # first in about 1/4 (level 3) or 1/6 (level 4) of the tasks
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
        assert len(env.catalogue) == {0: 8, 3: 12, 4: 16}[level]
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
            if level == 4:
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
        assert done and reward == (0.6 if level == 4 else 0.8) and not info["success"]
        assert not info["matched"]["size"]

        sizes = page.split("sizes: ")[1].split()
        wrong = next(s for s in sizes if s != t["size"])
        go_to_item(env, task)
        env.step(f"choose[{wrong}]")
        if level == 4:
            env.step(f"choose[{t['colour']}]")
        _, reward, done, info = env.step("buy")
        assert done and reward == 0.8 and not info["success"]
        assert info["matched"] == {"type": True, "material": True, "colour": True, "size": False, "price": True}

        if level == 4:
            colours = page.split("colours: ")[1].split(".")[0].split()
            go_to_item(env, task)
            env.step(f"choose[{t['size']}]")
            env.step(f"choose[{next(c for c in colours if c != t['colour'])}]")
            _, reward, _, info = env.step("buy")
            assert reward == 0.8 and not info["success"] and not info["matched"]["colour"]


def test_invalid_actions_give_error_observations():
    task = ShopEnv.make_tasks("train", 1, seed=0, difficulty=4)[0]
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
    task = ShopEnv.make_tasks("eval", 1, seed=0, difficulty=4)[0]
    t = task["target"]
    a, b = ShopEnv(), ShopEnv()
    a.reset(task), b.reset(task)
    keys = [a.state_key()]
    assert keys == ["start"]
    for _ in range(EXPERT_TURNS[4]):
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


# --- the shopping lists: levels 1 and 2 --------------------------------------------------------------------------

LIST_LEVELS = (1, 2)
LIST_TURNS = {1: 9, 2: 17}  # 4 turns per list item (search, click, choose, add), then checkout
ATTRIBUTES = ("type", "material", "colour", "size", "price")


def hand_task(level: int) -> dict:
    """A list task written by hand (targets, coupon and instruction; only the catalogue comes from the seed)."""
    targets = [
        {"type": "shirt", "material": "cotton", "colour": "red", "size": "m", "max_price": 40},
        {"type": "hat", "material": "wool", "colour": "blue", "size": "s", "max_price": 30},
        {"type": "coat", "material": "denim", "colour": "black", "size": "xl", "max_price": 80},
        {"type": "scarf", "material": "silk", "colour": "green", "size": "xs", "max_price": 20},
    ][: {1: 2, 2: 4}[level]]
    lines = [
        "red cotton shirt, size m, under 40 dollars",
        "blue wool hat, size s, under 30 dollars",
        "black denim coat, size xl, under 80 dollars",
        "green silk scarf, size xs, under 20 dollars",
    ][: len(targets)]
    instruction = "i need a " + "; then a ".join(lines) + "; pay with coupon [mango]"
    return {
        "task_id": f"shop-{level}-example",
        "env": "shop",
        "difficulty": level,
        "instruction": instruction,
        "targets": targets,
        "coupon": "mango",
        "catalogue_seed": 7,
    }


def add_to_cart(env: ShopEnv, target: dict, item_id: str | None = None, size: str | None = "", query: str = "") -> str:
    """Search for `target` (default: with the expert's words), open `item_id` (default: the first result), choose
    `size` (default the target's, None: none) and add; returns the add's observation."""
    t = target
    query = query or f"{t['colour']} {t['material']} {t['type']} size {t['size']} under {t['max_price']}"
    obs, *_ = env.step(f"search[{query}]")
    obs, *_ = env.step(f"click[{item_id or listed_ids(obs)[0]}]")
    assert obs.startswith("item "), obs
    if size is not None:
        env.step(f"choose[{size or t['size']}]")
    return env.step("add")[0]


@pytest.mark.parametrize("level", LIST_LEVELS)
def test_expert_transcript_of_a_shopping_list(level):
    task = hand_task(level)
    env = ShopEnv(difficulty=level)
    assert env.max_turns == {1: 16, 2: 28}[level]
    first = env.reset(task)
    assert first == (
        f"Instruction: {task['instruction']}\nActions: search[words], click[id], choose[option], add, checkout[coupon]"
    )
    lines = task["instruction"].removeprefix("i need a ").split("; pay with")[0].split("; then a ")
    bought = []
    for k, line in enumerate(lines):
        size = line.split("size ")[1].split(",")[0]
        obs, reward, done, _ = env.step(env.expert_action())
        assert env.expert_action() == f"click[{listed_ids(obs)[0]}]"  # the match is listed first
        assert (reward, done) == (0.0, False)
        item_id = listed_ids(obs)[0]
        obs, *_ = env.step(env.expert_action())
        title = line.split(",")[0]
        assert obs.startswith(f"item {item_id}: {title} $") and "sizes: " in obs
        assert int(obs.split("$")[1].split(".")[0]) <= int(line.split("under ")[1].split(" ")[0])
        assert env.expert_action() == f"choose[{size}]"
        assert env.step(env.expert_action())[0] == f"selected: size {size}"
        assert env.expert_action() == "add"
        obs, reward, done, _ = env.step("add")
        if k + 1 < len(lines):
            assert obs == f"added {item_id} to the cart. next: a {lines[k + 1]}"
        else:
            assert obs == f"added {item_id} to the cart. the list is done: check out with your coupon"
        assert (reward, done) == (0.0, False)
        bought.append(item_id)
    assert env.expert_action() == "checkout[mango]"
    obs, reward, done, info = env.step("checkout[mango]")
    assert obs == f"checked out {len(lines)} items. score 1.00"
    assert (reward, done, info["success"], info["coupon"], info["bought"]) == (1.0, True, True, True, bought)
    assert info["matched"] == [dict.fromkeys(ATTRIBUTES, True)] * len(lines)


def test_the_expert_queries_copy_the_instruction_then_the_latest_observation():
    task = hand_task(2)
    env = ShopEnv(difficulty=2)
    env.reset(task)
    queries = []
    for _ in range(LIST_TURNS[2]):
        action = env.expert_action()
        if action.startswith("search["):
            queries.append(action)
        env.step(action)
    assert queries == [
        "search[red cotton shirt size m under 40 dollars]",
        "search[blue wool hat size s under 30 dollars]",
        "search[black denim coat size xl under 80 dollars]",
        "search[green silk scarf size xs under 20 dollars]",
    ]


@pytest.mark.parametrize("level", LIST_LEVELS)
def test_list_tasks_are_seeded_distinct_and_disjoint(level):
    tasks = ShopEnv.make_tasks("train", 60, seed=3, difficulty=level)
    assert tasks == ShopEnv.make_tasks("train", 60, seed=3, difficulty=level)
    assert tasks != ShopEnv.make_tasks("train", 60, seed=4, difficulty=level)
    assert len({t["instruction"] for t in tasks}) == 60 and json.loads(json.dumps(tasks)) == tasks
    for t in tasks:
        n = {1: 2, 2: 4}[level]
        assert t["difficulty"] == level and t["task_id"].startswith(f"shop-{level}-") and "target" not in t
        assert len(t["targets"]) == n and len({x["type"] for x in t["targets"]}) == n  # distinct types
        assert t["instruction"].startswith("i need a ") and t["instruction"].endswith(
            f"; pay with coupon [{t['coupon']}]"
        )
        assert t["instruction"].count("; then a ") == n - 1
    train = ShopEnv.make_tasks("train", 400, seed=0, difficulty=level)
    evals = ShopEnv.make_tasks("eval", 400, seed=0, difficulty=level)
    assert not {t["instruction"] for t in train} & {t["instruction"] for t in evals}
    assert all(split_of(t["instruction"]) == "train" for t in train)
    assert all(split_of(t["instruction"]) == "eval" for t in evals)


@pytest.mark.parametrize("level", LIST_LEVELS)
def test_list_expert_succeeds_in_its_turns(level):
    for split in ("train", "eval"):
        for task in ShopEnv.make_tasks(split, 50, seed=0, difficulty=level):
            env = ShopEnv()  # a level-0 instance takes the task's level (and its turn budget) on reset
            transcript = play(task)
            turns = len(transcript) - 1
            action, obs, reward, done, success, _ = transcript[-1]
            assert (action, done, success, reward) == (f"checkout[{task['coupon']}]", True, True, 1.0), transcript
            assert turns == LIST_TURNS[level] and 9 <= turns <= 20
            assert all(row[2] == 0.0 and not row[3] for row in transcript[:-1])
            assert env.reset(task) and env.max_turns == {1: 16, 2: 28}[level] > turns


@pytest.mark.parametrize("level", LIST_LEVELS)
def test_each_list_item_has_one_fit_listed_first_and_twins_punish_sloppy_queries(level):
    misled = dear_shown = 0
    tasks = ShopEnv.make_tasks("train", 100, seed=1, difficulty=level)
    for task in tasks:
        env = ShopEnv()
        env.reset(task)
        assert len(env.catalogue) == {1: 10, 2: 16}[level] and len({it["id"] for it in env.catalogue}) == len(
            env.catalogue
        )
        for k, t in enumerate(task["targets"]):
            fits = [
                it["id"]
                for it in env.catalogue
                if (it["type"], it["material"], it["colours"]) == (t["type"], t["material"], [t["colour"]])
                and t["size"] in it["sizes"]
                and it["price"] <= t["max_price"]
            ]
            assert fits == [env.target_ids[k]]
            title = (t["type"], t["material"], [t["colour"]])
            twins = [it for it in env.catalogue if (it["type"], it["material"], it["colours"]) == title]
            assert len(twins) == 3  # the match, one lacking the size, one above the price
            words = f"{t['colour']} {t['material']} {t['type']}"
            obs, *_ = env.step(f"search[{words} size {t['size']} under {t['max_price']} dollars]")
            assert listed_ids(obs)[0] == env.target_ids[k]
            obs, *_ = env.step(f"search[{words} under {t['max_price']} dollars]")  # without the size
            misled += listed_ids(obs)[0] != env.target_ids[k]
            obs, *_ = env.step(f"search[{words}]")  # without size and price: the dear twin can be listed
            dear_shown += any(it["price"] > t["max_price"] for it in twins if it["id"] in listed_ids(obs))
    n = sum(len(t["targets"]) for t in tasks)
    assert 0.3 * n <= misled <= 0.7 * n  # the twin without the size ties with the match: first about half the time
    assert dear_shown >= 0.5 * n


def test_list_reward_is_partial_credit_over_the_items_and_the_coupon():
    task = hand_task(1)
    red, blue = task["targets"]
    env = ShopEnv()

    def checkout(word: str) -> tuple[float, dict]:
        _, reward, done, info = env.step(f"checkout[{word}]")
        assert done
        return reward, info

    env.reset(task)
    add_to_cart(env, red)
    add_to_cart(env, blue)
    reward, info = checkout("lemon")  # both items right, the wrong coupon: (1 + 1 + 0) / 3
    assert reward == pytest.approx(2 / 3) and not info["success"] and info["coupon"] is False

    env.reset(task)
    add_to_cart(env, red)
    add_to_cart(env, blue, size=None)  # the hat without its size: 4 of 5 attributes
    reward, info = checkout("MANGO")  # the coupon is case-insensitive: (1 + 0.8 + 1) / 3
    assert reward == pytest.approx(2.8 / 3) and not info["success"] and info["coupon"]
    assert info["matched"][1] == {**dict.fromkeys(ATTRIBUTES, True), "size": False}

    env.reset(task)
    add_to_cart(env, red)
    reward, info = checkout("mango")  # checked out early: the hat's entry is empty, (1 + 0 + 1) / 3
    assert reward == pytest.approx(2 / 3) and info["matched"][1] == dict.fromkeys(ATTRIBUTES, False)

    env.reset(task)
    reward, info = checkout("mango")  # nothing in the cart: (0 + 0 + 1) / 3
    assert reward == pytest.approx(1 / 3) and info["bought"] == []

    env.reset(task)
    dear = next(it for it in env.catalogue if it["type"] == "shirt" and it["price"] > 40)
    add_to_cart(env, red, item_id=dear["id"], query="red cotton shirt size m")  # no price: the dear twin is listed
    add_to_cart(env, blue)
    reward, info = checkout("mango")  # the shirt costs too much: (0.8 + 1 + 1) / 3
    assert reward == pytest.approx(2.8 / 3) and not info["matched"][0]["price"] and info["bought"][0] == dear["id"]

    env.reset(task)
    add_to_cart(env, blue)  # the list's order counts: the hat goes into the shirt's entry, the shirt into the hat's
    add_to_cart(env, red)
    shirt = next(it for it in env.catalogue if it["id"] == env.target_ids[0])
    reward, info = checkout("mango")
    # the hat (blue wool, size s, at most 30 dollars) against the shirt's line (red cotton, size m, 40): the price
    # only; the shirt (at most 40 dollars) against the hat's line: the price when it is at most 30 too
    assert info["matched"][0] == {**dict.fromkeys(ATTRIBUTES, False), "price": True}
    assert info["matched"][1] == {**dict.fromkeys(ATTRIBUTES, False), "price": shirt["price"] <= 30}
    assert reward == pytest.approx((0.2 + 0.2 * (shirt["price"] <= 30) + 1) / 3)


def test_list_levels_refuse_invalid_actions():
    task = hand_task(1)
    env = ShopEnv()
    env.reset(task)

    def assert_error(action: str, message: str | None = None) -> None:
        key = env.state_key()
        obs, reward, done, info = env.step(action)
        assert obs.startswith("error:") and reward == 0.0 and not done, (action, obs)
        assert info == {"success": False, "invalid": True}
        assert message is None or obs == f"error: {message}"
        assert env.state_key() == key  # the state is unchanged

    assert_error("add", "open an item first")
    assert_error("buy", "buy is not an action here: add the item to the cart, then checkout[coupon]")
    for action in ["checkout", "checkout[]", "checkout[ ]", "add[x]", "add checkout[mango]", "remove[fox]"]:
        assert_error(action)
    add_to_cart(env, task["targets"][0])
    assert_error("click[" + env.target_ids[0] + "]", "click needs search results")
    assert_error("add", "open an item first")
    add_to_cart(env, task["targets"][1])
    env.step("search[red cotton shirt size m under 40 dollars]")
    env.step(f"click[{env.target_ids[0]}]")
    assert_error("add", "the list is done: checkout[coupon]")
    obs, reward, done, info = env.step(" Checkout [ mango ] ")  # from any page, leniently parsed
    assert done and reward == 1.0 and info["success"]
    assert env.step("checkout[mango]") == ("error: the episode is over", 0.0, True, {"success": True, "invalid": True})


def test_other_levels_know_no_cart():
    for level in LEVELS:
        env = ShopEnv()
        env.reset(ShopEnv.make_tasks("train", 1, seed=0, difficulty=level)[0])
        for action in ("add", "checkout[mango]"):
            assert env.step(action)[0] == "error: unknown action"
        assert env.max_turns == ShopEnv.max_turns == 8 and "add" not in env.action_names


def test_list_state_keys_hold_the_cart():
    task = hand_task(1)
    a, b = ShopEnv(), ShopEnv()
    a.reset(task), b.reset(task)
    keys = [a.state_key()]
    assert keys == ["start|cart="]
    for _ in range(LIST_TURNS[1]):
        action = a.expert_action()
        a.step(action)
        b.step(action)
        assert a.state_key() == b.state_key()
        keys.append(a.state_key())
    first, second = a.target_ids
    assert len(set(keys)) == len(keys) == 10  # every step changed the state
    assert keys[3] == f"item:{first}:size=m|cart="
    assert keys[4] == f"cart|cart={first}:m"
    assert keys[-1] == f"done|cart={first}:m,{second}:s"
    a.reset(task)
    add_to_cart(a, task["targets"][0], size=None)
    assert a.state_key() == f"cart|cart={first}:-"  # the same page with another cart is another state


@pytest.mark.parametrize("level", LIST_LEVELS)
def test_list_noisy_actions_are_plausible_and_the_expert_recovers(level):
    kinds: set[str] = set()
    for i, task in enumerate(ShopEnv.make_tasks("train", 40, seed=6, difficulty=level)):
        rng = random.Random(i)
        for noisy_turn in range(LIST_TURNS[level]):  # one noisy action at each point of the expert's path
            env = ShopEnv(difficulty=level)
            env.reset(task)
            for _ in range(noisy_turn):
                env.step(env.expert_action())
            noisy = env.noisy_action(rng)
            assert noisy != env.expert_action()
            kinds.add(noisy.split("[")[0])
            obs, reward, done, info = env.step(noisy)
            assert not obs.startswith("error: unknown action"), noisy
            turns = noisy_turn + 1
            while not done and turns < env.max_turns:
                obs, reward, done, info = env.step(env.expert_action())
                turns += 1
            assert done  # the expert finishes from every noisy state
            if noisy == "add" or noisy.startswith("checkout["):  # added early (no size) or a wrong coupon: final
                assert not info["success"] and reward < 1.0
            else:
                assert info["success"] and turns <= LIST_TURNS[level] + 2, (noisy, turns)
    assert kinds == {"search", "click", "choose", "add", "checkout"}


@pytest.mark.parametrize("level", LIST_LEVELS)
def test_list_noisy_checkout_names_a_coupon_the_episode_never_showed(level):
    """The noisy checkout is a coupon word other than the task's, so it copies nothing the episode showed (a build
    would learn that copy instead of recalling the coupon); over 20 tasks, 40 draws each, at least 19 words come up."""
    typed: set[str] = set()
    for i, task in enumerate(ShopEnv.make_tasks("train", 20, seed=2, difficulty=level)):
        env = ShopEnv(difficulty=level)
        shown = [env.reset(task)]
        while not env.expert_action().startswith("checkout["):
            shown.append(env.step(env.expert_action())[0])
        shown_words = set(re.findall(r"\w+", " ".join(shown).replace(f"coupon [{task['coupon']}]", "")))
        rng = random.Random(i)
        for _ in range(40):
            word = re.fullmatch(r"checkout\[(\w+)\]", env.noisy_action(rng)).group(1)
            assert word != task["coupon"] and word not in shown_words, (word, shown)
            typed.add(word)
    assert len(typed) >= 19


def test_list_noisy_expert_keeps_some_successes_and_fits_the_budget():
    for level, (low, high) in {1: (0.3, 0.65), 2: (0.15, 0.5)}.items():
        wins = cut = 0
        tasks = ShopEnv.make_tasks("train", 200, seed=0, difficulty=level)
        for i, task in enumerate(tasks):
            transcript = play(task, "noisy", seed=i)
            wins += transcript[-1][4]
            cut += not transcript[-1][3]
        assert low <= wins / len(tasks) <= high and cut / len(tasks) <= 0.15, (level, wins, cut)


@pytest.mark.parametrize("level", LIST_LEVELS)
def test_list_privileged_plan_is_the_experts(level):
    task = ShopEnv.make_tasks("eval", 1, seed=0, difficulty=level)[0]
    plan = ShopEnv().privileged(task)  # played at the task's level, whatever the instance's
    steps = plan.removeprefix("Plan: ").split(" | ")
    assert len(steps) == LIST_TURNS[level] and steps[-1] == f"checkout[{task['coupon']}]"
    assert [s.split("[")[0] for s in steps[:4]] == ["search", "click", "choose", "add"]


def test_levels_3_and_4_are_the_former_levels_1_and_2():
    """Their tasks are drawn from the former levels' seeds (values recorded from the code before the renumbering)."""
    three = ShopEnv.make_tasks("train", 1, seed=0, difficulty=3)[0]
    assert three["task_id"] == "shop-3-71c61cc6a9" and three["catalogue_seed"] == 3985899235
    assert three["instruction"] == "i need a black silk cardigan, size m, under 40 dollars"
    env = ShopEnv()
    env.reset(three)
    assert env.step(env.expert_action())[0] == (
        "results: [YYMU] black silk cardigan $50 | [FXFQ] black fleece cardigan $31 | [EFMK] grey silk cardigan $72 "
        "| [3GWW] black silk cardigan $25"
    )
    four = ShopEnv.make_tasks("train", 1, seed=0, difficulty=4)[0]
    assert four["task_id"] == "shop-4-0077637685" and four["catalogue_seed"] == 1097724060
    env.reset(four)
    assert env.step(env.expert_action())[0] == (
        "results: [LCBG] fleece blouse $22 | [2HRS] fleece coat $54 | [QJ6D] fleece sweater $68 | [EKVF] fleece "
        "sweater $72 | [U5MG] silk sweater $33 | [G69M] fleece sweater $52"
    )


def test_shop_tools_refuses_the_list_levels():
    from envs.shop_tools import ShopTools, make_rows

    for level in LIST_LEVELS:
        with pytest.raises(ValueError, match="add and checkout"):
            make_rows("train", 2, difficulty=level)
        with pytest.raises(ValueError, match="add and checkout"):
            ShopTools().reset(task=ShopEnv.make_tasks("train", 1, difficulty=level)[0])
    assert len(make_rows("train", 2, difficulty=3)) == 2
