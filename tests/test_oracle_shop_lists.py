"""The oracle judge on the shop's shopping lists (levels 1 and 2; rewards/oracle.py `shop_list_checks`, draco.md D19).

The environment's expert passes every criterion; an early checkout, a wrong size and a wrong coupon each fail exactly
the criteria named here by hand from the task, citing the steps responsible; through the real rubric pipeline the
essential gate leaves those three no positive advantage in a group with the expert, where Eq. 2 pays two of them more
than the group mean. Offline and model-free: the judge replays the actions (layer 2)."""

import random

import pytest
import torch

from envs.base import noisy_expert_episode
from envs.shop import COUPONS, ShopEnv
from rewards.oracle import OracleJudge, shop_checks
from rewards.rubrics import LIMITS, GroupInput, RubricPipeline, render_task

TASKS = {level: ShopEnv.make_tasks("train", 3, seed=11, difficulty=level) for level in (1, 2)}
LEVEL_TASKS = [(level, i) for level in (1, 2) for i in range(3)]


def expert_actions(task: dict) -> list[str]:
    env = ShopEnv(task["difficulty"])
    env.reset(task)
    actions = []
    while env.page != "done":
        actions.append(env.expert_action())
        env.step(actions[-1])
    return actions


def entry_titles(task: dict, k: int) -> tuple[str, str]:
    """The two outcome titles of list item k (1-based), written out from the task."""
    t = task["targets"][k - 1]
    item = f"Cart entry {k} is a {t['colour']} {t['material']} {t['type']} at most {t['max_price']} dollars"
    return item, f"Size {t['size']} was chosen for cart entry {k}"


def mistakes(task: dict) -> dict[str, tuple[list[str], set[str]]]:
    """Three rollouts, each the expert's with one mistake, and the titles each must fail. The expert takes search,
    click, choose, add per item, so item k's choice is action 4(k-1)+3 and the checkout is action 4n+1."""
    expert, targets, coupon = expert_actions(task), task["targets"], task["coupon"]
    n = len(targets)
    early = [*expert[: 4 * (n - 1)], f"checkout[{coupon}]"]  # the last item is never searched nor added
    k = n - 1  # the wrong size goes to the item before the last (the first of a list of 2)
    assert expert[4 * (k - 1) + 2] == f"choose[{targets[k - 1]['size']}]"
    env = ShopEnv(task["difficulty"])
    env.reset(task)
    match = next(it for it in env.catalogue if it["id"] == env.target_ids[k - 1])
    wrong = next(s for s in match["sizes"] if s != targets[k - 1]["size"])  # offered, so the choice is valid
    wrong_size = list(expert)
    wrong_size[4 * (k - 1) + 2] = f"choose[{wrong}]"
    other = next(w for w in COUPONS if w != coupon)
    return {
        "early": (early, {*entry_titles(task, n), f"A search names the wanted {targets[-1]['type']}"}),
        "wrong size": (wrong_size, {entry_titles(task, k)[1]}),
        "wrong coupon": ([*expert[:-1], f"checkout[{other}]"], {f"The checkout uses coupon {coupon}"}),
    }


@pytest.mark.parametrize(("level", "i"), LEVEL_TASKS)
def test_expert_passes_every_criterion_and_the_rubric_fits_s1(level, i):
    task = TASKS[level][i]
    n = len(task["targets"])
    expert = expert_actions(task)
    assert len(expert) == 4 * n + 1  # 9 and 17 turns (envs/shop.py)
    checks = shop_checks(task, expert)
    assert all(c.verdict == 1 for c in checks), {c.title: c.verdict for c in checks}
    # per item: its entry and its size (essential), then the coupon (essential), a search per item, the process check
    expected = [title for k in range(1, n + 1) for title in entry_titles(task, k)]
    expected += [f"The checkout uses coupon {task['coupon']}"]
    expected += [f"A search names the wanted {t['type']}" for t in task["targets"]]
    expected += ["Every action is valid on its page"]
    assert [c.title for c in checks] == expected
    assert [c.essential for c in checks] == [True] * (2 * n + 1) + [False] * (n + 1)
    assert [c.process for c in checks] == [False] * (3 * n + 1) + [True]
    assert 3 * n + 1 <= LIMITS["task"]  # 7 and 13 task-level criteria: S1 keeps them all
    # credit: entry k's item cites its click and add (steps 4k-2, 4k), its size the choice and add (4k-1, 4k)
    by_title = {c.title: c.steps for c in checks}
    for k in range(1, n + 1):
        item, size = entry_titles(task, k)
        assert by_title[item] == [4 * k - 2, 4 * k] and by_title[size] == [4 * k - 1, 4 * k]
        assert by_title[f"A search names the wanted {task['targets'][k - 1]['type']}"] == [4 * k - 3]
    assert by_title[f"The checkout uses coupon {task['coupon']}"] == [4 * n + 1]


@pytest.mark.parametrize(("level", "i"), LEVEL_TASKS)
def test_each_mistake_fails_exactly_its_criteria_and_cites_its_steps(level, i):
    task = TASKS[level][i]
    n = len(task["targets"])
    for name, (actions, failing) in mistakes(task).items():
        checks = shop_checks(task, actions)
        assert {c.title for c in checks if c.verdict == -1} == failing, name
        assert all(c.verdict == 1 for c in checks if c.title not in failing), name
        steps = {c.title: c.steps for c in checks if c.verdict == -1}
        if name == "early":  # the missing entry is an omission: the last step (the checkout, 4(n-1)+1)
            item, size = entry_titles(task, n)
            assert steps[item] == steps[size] == [4 * (n - 1) + 1]
            assert steps[f"A search names the wanted {task['targets'][-1]['type']}"] == list(range(1, 4 * (n - 1), 4))
        elif name == "wrong size":  # the wrong choice of item n-1 and its add
            assert list(steps.values()) == [[4 * (n - 1) - 1, 4 * (n - 1)]]
        else:
            assert list(steps.values()) == [[4 * n + 1]]  # the checkout
        env = ShopEnv(level)
        env.reset(task)
        infos = [env.step(a)[3] for a in actions]
        assert infos[-1]["success"] is False and not any(info["invalid"] for info in infos)


@pytest.mark.parametrize("level", [1, 2])
def test_essential_checks_pass_exactly_when_the_environment_succeeds(level):
    rng = random.Random(level)
    outcomes = set()
    for task in TASKS[level]:
        for noise in (0.0, 0.1, 0.3, 0.6):
            for _ in range(4):
                _, transcript, _ = noisy_expert_episode(ShopEnv(level), task, noise, rng)
                actions = [turn["action"] for turn in transcript]
                env = ShopEnv(level)
                env.reset(task)
                success = any(env.step(a)[3]["success"] for a in actions)
                checks = shop_checks(task, actions)
                assert all(c.verdict == 1 for c in checks if c.essential) == success, actions
                assert all(c.steps and all(1 <= j <= len(actions) for j in c.steps) for c in checks)  # cited
                outcomes.add(success)
    assert outcomes == {True, False}  # both sides were exercised


def group_advantages(rewards) -> torch.Tensor:
    r = torch.tensor(rewards, dtype=torch.float64)  # (G,)
    return (r - r.mean()) / (r.std() + 1e-4)  # Eq. 3 (TRL's unbiased std)


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("gate", [False, True])
def test_the_gate_leaves_the_mistakes_no_positive_advantage(level, gate):
    task = TASKS[level][0]
    plays = [expert_actions(task)] + [actions for actions, _ in mistakes(task).values()]
    transcripts = []
    for actions in plays:
        env = ShopEnv(level)
        prompt = env.reset(task)
        transcripts.append([{"action": a, "observation": env.step(a)[0]} for a in actions])
    pipe = RubricPipeline(OracleJudge(TASKS[level]), essential_gate=gate)
    (res,) = pipe.score_groups([GroupInput(task["task_id"], render_task(prompt), transcripts)])
    # surviving (Eq. 1): the 5 criteria some rollout fails, the early checkout's 3, one size, the coupon
    assert len(res.surviving) == 5
    if gate:  # each mistake fails an essential criterion: -1
        assert res.rewards == [1.0, -1.0, -1.0, -1.0]
        assert all(a < 0 for a in group_advantages(res.rewards)[1:])
    else:  # Eq. 2: early (2 - 3) / 5, wrong size and wrong coupon (4 - 1) / 5; mean 0.5
        assert res.rewards == pytest.approx([1.0, -0.2, 0.6, 0.6])
        assert all(a > 0 for a in group_advantages(res.rewards)[2:])
    # credit through the prompts: the FAIL of the wrong size cites its choice and its add
    crits = [res.merged[c] for c in res.surviving]
    items = [(render_task(prompt), transcripts[2], crits, [res.verdicts[2][c] for c in res.surviving], [""] * 5)]
    (credit,) = pipe.credit_many(items)
    n = len(task["targets"])
    size = entry_titles(task, n - 1)[1]
    fails = [(c.title, steps) for c, v, steps in zip(crits, credit.verdicts, credit.steps, strict=True) if v == -1]
    assert fails == [(size, [4 * (n - 1) - 1, 4 * (n - 1)])]


def test_a_group_of_mistakes_alone_ties_under_the_gate():
    task = TASKS[1][1]
    transcripts = []
    for actions, _ in mistakes(task).values():
        env = ShopEnv(1)
        prompt = env.reset(task)
        transcripts.append([{"action": a, "observation": env.step(a)[0]} for a in actions])
    pipe = RubricPipeline(OracleJudge([task]), essential_gate=True)
    (res,) = pipe.score_groups([GroupInput(task["task_id"], render_task(prompt), transcripts)])
    assert res.rewards == [-1.0, -1.0, -1.0]  # no rollout reaches every named outcome: no update, none pushed up
    assert torch.all(group_advantages(res.rewards) == 0)
