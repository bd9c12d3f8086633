"""bench/draco_reward.py: its statistics on hand-computed inputs, the corruptions, and DRACO's reward on a hand-built
shop group through the real pipeline and oracle judge."""

import doctest
import math
import random
from argparse import Namespace

import pytest
import torch

import bench.draco_reward
from bench.draco_reward import (
    VARIANTS,
    corrupt,
    pairwise_auc,
    play,
    positive_push_on_success,
    replay,
    run_setting,
    score,
    search_guess,
    step_shares,
    weighted_rubric_reward,
)
from envs import SearchEnv, ShopEnv, TerminalEnv
from rewards.rubrics import rubric_reward
from trainers.draco import draco_step_weights


def test_doctests():
    assert doctest.testmod(bench.draco_reward).failed == 0


def test_pairwise_auc_counts_ties_half():
    rewards = [[1.0, 1.0, 0.0, 2.0], [0.5, 0.5], [0.3, 0.1]]
    success = [[True, False, False, False], [True, False], [False, False]]
    # group 1: success 1.0 vs failures 1.0 (tie), 0.0 (win), 2.0 (loss); group 2: a tie; group 3: no success
    # pairs 4, wins 1, ties 2 -> AUC (1 + 0.5 * 2) / 4 = 0.5, strict 1 / 4
    assert pairwise_auc(rewards, success) == (0.5, 0.25, 4)
    auc, strict, pairs = pairwise_auc([[1.0, 0.0]], [[True, True]])
    assert math.isnan(auc) and math.isnan(strict) and pairs == 0


def test_weighted_reward_is_eq2_with_unit_weights_and_weights_criteria():
    rng = random.Random(0)
    for _ in range(200):
        v = [rng.choice([-1, 0, 1]) for _ in range(rng.randint(1, 8))]
        surviving = sorted(rng.sample(range(len(v)), rng.randint(0, len(v))))
        assert weighted_rubric_reward(v, surviving, [1.0] * len(v)) == pytest.approx(rubric_reward(v, surviving))
    # passes 0 and 1 (weights 3, 1), fails 2 (weight 1), 3 is N/A: (3 + 1 - 1) / (3 + 1 + 1) = 0.6
    assert weighted_rubric_reward([1, 1, -1, 0], [0, 1, 2, 3], [3, 1, 1, 5]) == pytest.approx(0.6)
    assert weighted_rubric_reward([1, -1], [0, 1], [0.0, 0.0]) == 0.0  # nothing weighted applies


def test_positive_push_on_success():
    # positive mass 2 + 1 + 1 = 4, of which 2 + 1 on successes -> 0.75
    assert positive_push_on_success([2.0, 1.0, 1.0, -4.0], [True, True, False, False]) == 0.75
    assert math.isnan(positive_push_on_success([0.0, 0.0], [True, False]))


def shop_task() -> dict:
    return ShopEnv.make_tasks("train", 1, seed=3, difficulty=0)[0]


def test_shop_corruptions_skip_and_stop():
    task = shop_task()
    env = ShopEnv(0)
    env.reset(task)
    transcript = []
    for _ in range(2):  # expert search, then click: the item page
        action = env.expert_action()
        transcript.append({"action": action, "observation": env.step(action)[0]})
    assert env.expert_action() == f"choose[{task['target']['size']}]"
    rng = random.Random(0)
    assert corrupt("skip", env, task, transcript, rng) == "buy"  # the step after choose
    assert corrupt("stop", env, task, transcript, rng) == "buy"
    assert replay(ShopEnv, task, [t["action"] for t in transcript]).state_key() == env.state_key()
    for _ in range(20):  # valid on the item page: a size of this item, buy, or a new search
        action = corrupt("random", env, task, transcript, rng)
        assert action in [f"choose[{s}]" for s in env.item["sizes"]] + ["buy"] or action.startswith("search[")
    with pytest.raises(ValueError, match="unknown corruption"):
        corrupt("nap", env, task, transcript, rng)


def test_terminal_and_search_stops():
    task = TerminalEnv.make_tasks("train", 1, seed=0, difficulty=0)[0]
    env = TerminalEnv(0)
    env.reset(task)
    assert corrupt("stop", env, task, [], random.Random(0)) == "submit"
    task = SearchEnv.make_tasks("train", 1, seed=0, difficulty=3)[0]  # level 3 (level 1 before the renumbering)
    env = SearchEnv(3)
    env.reset(task)
    assert search_guess(task, []) == task["hops"][0]  # nothing read yet: the question's entity
    first_search = env.expert_action()
    observation = env.step(first_search)[0]
    # level 3: the first hop's document ranks first and ends with the bridge entity (envs/search.py docstring)
    assert search_guess(task, [{"action": first_search, "observation": observation}]) == task["hops"][1]
    transcript = [{"action": first_search, "observation": observation}]
    assert corrupt("skip", env, task, transcript, random.Random(0)) == f"answer[{task['hops'][1]}]"


def test_play_without_noise_is_the_expert_and_succeeds():
    for env_cls in (ShopEnv, TerminalEnv, SearchEnv):
        task = env_cls.make_tasks("train", 1, seed=0, difficulty=0)[0]
        r = play(env_cls, task, 0.0, random.Random(0))
        assert r["success"] and r["type"] == "success" and r["kinds"] == [None] * len(r["transcript"])


def scripted(task: dict, actions: list[str]) -> dict:
    env = ShopEnv(0)
    first = env.reset(task)
    transcript = [{"action": a, "observation": env.step(a)[0]} for a in actions]
    return {"first": first, "transcript": transcript, "success": env.success, "env_reward": 0.0, "type": ""}


def test_draco_reward_of_a_hand_built_shop_group():
    task = shop_task()
    env = ShopEnv(0)
    env.reset(task)
    search = env.expert_action()
    env.step(search)
    click = env.expert_action()
    choose = f"choose[{task['target']['size']}]"
    group = [
        scripted(task, [search, click, choose, "buy"]),  # success
        scripted(task, [search, click, "buy"]),  # bought the right item without a size
        scripted(task, [search]),  # cut after the search: nothing bought
    ]
    assert [g["success"] for g in group] == [True, False, False]
    reward, pipeline, rewards = score([group], [task], 3)
    # Every rollout passes the search and process checks (the union drops them); the no-purchase rollout fails all
    # five outcome criteria, so all five survive dropout (Eq. 1). Eq. 2: success 5/5 -> 1; no size: (4 - 1) / 5 =
    # 0.6; nothing bought: (0 - 5) / 5 = -1.
    assert rewards == pytest.approx([1.0, 0.6, -1.0])
    res = pipeline.results[0]
    assert len(res.merged) == 5 and res.surviving == [0, 1, 2, 3, 4]
    # the S1 tier subtracts 2 from the two rollouts failing an S1 criterion; the gate is +1 / -1
    assert VARIANTS["S1 tier (Eq. 2 - 2 on an S1 fail)"](res, group, task) == pytest.approx([1.0, -1.4, -3.0])
    assert VARIANTS["S1 gate (+1 / -1)"](res, group, task) == [1.0, -1.0, -1.0]
    # static rubric: 7 checks (5 outcome, search, process); no size: 6 pass, 1 fail -> 5/7; nothing: 2 - 5 -> -3/7
    assert VARIANTS["static rubric, no dropout"](res, group, task) == pytest.approx([1.0, 5 / 7, -3 / 7])


def test_run_setting_small():
    args = Namespace(tasks=3, rollouts=6, group_sizes=[3, 6], main_group=6, seed=0, essential_gate=False)
    out = run_setting("shop", 0, 0.5, args)
    main = out["group_sizes"]["6"]
    assert main["groups"] == 3 and out["group_sizes"]["3"]["groups"] == 6
    assert main["static_order_agreement"] == 1.0  # ±1 oracle verdicts: Eq. 2 orders a group as the static rubric
    ref = main["variants"]["reference: success"]
    assert math.isnan(ref["auc"]) or (ref["auc"] == 1.0 and ref["push_on_success"] == 1.0)
    assert sum(t["count"] for t in main["variants"]["DRACO (Eq. 2)"]["types"].values()) == 18


def test_strict_weights_against_draco_on_a_purchase_without_size():
    # steps: 1 search, 2 click, 3 buy. Criteria: search (PASS, step 1), four outcome criteria (PASS, steps 2 and 3),
    # size (FAIL, step 3). DRACO's Eq. 4: Q = [1, 1, 4/5]; strict: Q = [1, 1, 0].
    verdicts = torch.tensor([[1, 1, 1, 1, 1, -1]] * 2)
    z = torch.zeros(2, 6, 3, dtype=torch.bool)
    z[:, 0, 0] = True
    z[:, 1:5, 1:3] = True
    z[:, 5, 2] = True
    adv, valid = torch.tensor([1.0, -1.0]), torch.ones(2, 3, dtype=torch.bool)  # a winner and a loser
    w, _ = draco_step_weights(verdicts, z, adv, valid)
    rho, fallback = step_shares(w, valid)
    # winner: w = [1, 1, 0.8], buy share 0.8 / 2.8 = 2/7; loser: w = [0, 0, 0.2], all the push on buy
    torch.testing.assert_close(rho, torch.tensor([[5 / 14, 5 / 14, 2 / 7], [0.0, 0.0, 1.0]], dtype=torch.float64))
    assert fallback.tolist() == [False, False]
    rho, _ = step_shares(draco_step_weights(verdicts, z, adv, valid, strict=True)[0], valid)
    # strict winner: w = [1, 1, 0] -> the buy is not reinforced; loser: w = [0, 0, 1]
    torch.testing.assert_close(rho, torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float64))
