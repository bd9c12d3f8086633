"""The gymnasium adapter (`envs/adapters/gymnasium.py`, `environment: gymnasium:<env id>`) on the package's real
toy-text environments: FrozenLake walked by a path worked out by hand, a hole, a turn without a move word, a budget cut
inside `trainers.agent_loop.play`, Blackjack's `stick` against the package's own outcome, Taxi's expert, random maps
per task with disjoint splits, the start-up errors and the tiny default's expert and demonstrations.

The default 4x4 lake (gymnasium's "4x4" map) is

    S F F F        row 0
    F H F H        row 1: holes at (1,1) and (1,3)
    F F F H        row 2: hole at (2,3)
    H F F G        row 3: hole at (3,0), goal at (3,3)

so down, down, right, right, down, right walks (0,0) (1,0) (2,0) (2,1) (2,2) (3,2) (3,3) around every hole, the
shortest way is 3 downs and 3 rights (6 moves), down then right steps into the hole at (1,1), and left from the start
bumps the west edge and stays put (never ending on its own).
"""

from __future__ import annotations

import gymnasium
import pytest

from envs.adapters import adapter_class
from envs.sources import load_environment
from envs.tiny import build_tokenizer, check_expert, demonstrations
from trainers.agent_loop import LoopSettings, play

LAKE = ["SFFF", "FHFH", "FFFH", "HFFG"]
STEPS = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def board(desc: list[str], at: tuple[int, int]) -> str:
    """The adapter's rendering of a lake, written out by hand: cells spaced, `@` on the agent, then its row and
    column and the tile each move leads onto (or the edge)."""
    rows = [list(r) for r in desc]
    rows[at[0]][at[1]] = "@"
    words = {"S": "start", "F": "ice", "H": "hole", "G": "goal"}
    around = []
    for move, (dr, dc) in STEPS.items():  # left, down, right, up
        r, c = at[0] + dr, at[1] + dc
        around.append(f"{move} {words[desc[r][c]] if 0 <= r < len(desc) and 0 <= c < len(desc[0]) else 'edge'}")
    return "\n".join(" ".join(r) for r in rows) + f"\nRow {at[0]}, column {at[1]}: " + ", ".join(around) + "."


def walk(desc: list[str], moves: list[str]) -> tuple[int, int]:
    """Where `moves` lead on a non-slippery lake (walls stop a move), checked to avoid holes."""
    row, col = 0, 0
    for move in moves:
        dr, dc = STEPS[move]
        row, col = min(max(row + dr, 0), len(desc) - 1), min(max(col + dc, 0), len(desc[0]) - 1)
        assert desc[row][col] != "H", (moves, row, col)
    return row, col


@pytest.fixture(scope="module")
def lake():
    return adapter_class("gymnasium:FrozenLake-v1", {"is_slippery": False})


def test_the_hand_path_reaches_the_goal(lake):
    env = lake()
    first = env.reset(lake.make_tasks("train", 1, seed=0)[0])
    assert first.endswith(board(LAKE, (0, 0))) and "left, down, right, up" in first
    path = ["down", "down", "right", "right", "down", "right"]
    cells = [(1, 0), (2, 0), (2, 1), (2, 2), (3, 2), (3, 3)]
    for k, (move, cell) in enumerate(zip(path, cells, strict=True)):
        observation, reward, done, info = env.step(f"I will go {move}")
        assert observation == board(LAKE, cell)
        last = k == len(path) - 1
        assert (reward, done, info["success"]) == ((1.0, True, True) if last else (0.0, False, False))


def test_stepping_into_a_hole_ends_the_episode_as_a_failure(lake):
    env = lake()
    env.reset(lake.make_tasks("train", 1, seed=0)[0])
    assert env.step("down")[2] is False
    observation, reward, done, info = env.step("right")  # (1,0) -> (1,1): a hole
    assert observation == board(LAKE, (1, 1))
    assert (reward, done, info["success"]) == (0.0, True, False)


def test_a_turn_without_a_move_word_is_an_error_and_changes_nothing(lake):
    env = lake()
    env.reset(lake.make_tasks("train", 1, seed=0)[0])
    env.step("down")
    observation, reward, done, info = env.step("I am not sure where to go")
    assert observation.startswith("error:") and "left, down, right, up" in observation
    assert (reward, done, info["success"], info["invalid"]) == (0.0, False, False, True)
    assert env.step("down")[0] == board(LAKE, (2, 0))  # the error turn did not move the agent
    assert env.step("not left but right")[0] == board(LAKE, (2, 1))  # the last move word counts


def test_a_lake_that_never_ends_is_cut_by_the_turn_budget():
    cls = adapter_class("gymnasium:FrozenLake-v1", {"is_slippery": False, "turn_budget": 3})
    assert cls.max_turns == 3
    tokenizer = build_tokenizer(["user assistant system left down right up S F H G @"] * 20, 300)
    ids = tokenizer("left", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(contexts, max_new_tokens):
        return [(list(ids), [-0.1] * len(ids)) for _ in contexts]

    settings = LoopSettings(max_turn_tokens=64, max_completion_length=4000)
    task = cls.make_tasks("train", 1, seed=0)[0]
    (rollout,) = play(generate, tokenizer, [cls()], [task], settings=settings)
    assert rollout.truncated and not rollout.success
    assert [t["action"] for t in rollout.transcript] == ["left"] * 3
    assert [t["observation"] for t in rollout.transcript] == [board(LAKE, (0, 0))] * 3  # the west edge: no move
    assert rollout.turn_rewards == [0.0, 0.0, 0.0]


def test_the_default_turn_budget_is_the_time_limit_capped_at_four_per_cell(lake):
    # FrozenLake-v1's time limit is 100 steps; 4 x 16 cells = 64 is lower
    assert lake.max_turns == 64
    assert adapter_class("gymnasium:Blackjack-v1", {}).max_turns == 8


def test_blackjack_stick_gets_the_packages_own_outcome():
    cls = adapter_class("gymnasium:Blackjack-v1", {})
    for task in cls.make_tasks("train", 5, seed=0):
        reference = gymnasium.make("Blackjack-v1")
        (player, dealer, ace), _ = reference.reset(seed=task["seed"])
        _, expected, terminated, _, _ = reference.step(0)  # 0: stick, the dealer plays out
        env = cls()
        first = env.reset(task)
        assert f"Your hand: {player}{' (usable ace)' if ace else ''}. Dealer shows: {dealer}." in first
        _, reward, done, info = env.step("stick")
        assert terminated and done
        assert reward == expected and info["success"] == (expected > 0)


def test_the_taxi_expert_delivers_the_passenger():
    cls = adapter_class("gymnasium:Taxi-v4", {})
    for task in cls.make_tasks("train", 2, seed=0):
        env = cls()
        env.reset(task)
        for _ in range(cls.max_turns):
            action = env.expert_action()
            assert action in ("south", "north", "east", "west", "pickup", "dropoff")
            observation, reward, done, info = env.step(action)
            if done:
                break
        assert done and info["success"] and reward == 20.0  # gymnasium's Taxi: +20 for a correct drop-off
        assert action == "dropoff"


def test_random_maps_are_played_per_task_and_never_shared_by_the_splits():
    cls = adapter_class("gymnasium:FrozenLake-v1", {"is_slippery": False, "random_map": 4})
    train, evals = cls.make_tasks("train", 8, seed=0), cls.make_tasks("eval", 8, seed=0)
    assert not {tuple(t["desc"]) for t in train} & {tuple(t["desc"]) for t in evals}  # no held-out map trained on
    for task in train[:3] + evals[:3]:
        env = cls()
        assert env.reset(task).endswith(board(task["desc"], (0, 0)))  # the task's map is the one played
        assert task["desc"][0][0] == "S" and task["desc"][-1][-1] == "G"
    assert len({tuple(t["desc"]) for t in train + evals}) > 1  # not one map for all


def test_random_maps_give_each_task_of_a_split_its_own_map():
    # "every task is its own N x N map": two tasks of one split on one map (non-slippery) are one episode twice
    cls = adapter_class("gymnasium:FrozenLake-v1", {"is_slippery": False, "random_map": 4})
    for split in ("train", "eval"):
        maps = [tuple(t["desc"]) for t in cls.make_tasks(split, 8, seed=0)]
        assert len(set(maps)) == len(maps), (split, maps)


def test_the_expert_walks_random_maps_to_the_goal():
    cls = adapter_class("gymnasium:FrozenLake-v1", {"is_slippery": False, "random_map": 4})
    for task in cls.make_tasks("train", 3, seed=0):
        env = cls()
        env.reset(task)
        moves = []
        for _ in range(cls.max_turns):
            moves.append(env.expert_action())
            _, _, done, info = env.step(moves[-1])
            if done:
                break
        assert info["success"] and walk(task["desc"], moves) == (3, 3)


def test_an_unsupported_id_names_the_field():
    with pytest.raises(SystemExit) as e:
        load_environment("gymnasium:CartPole-v1")
    assert "environment" in str(e.value) and "CartPole-v1" in str(e.value) and "FrozenLake-v1" in str(e.value)
    with pytest.raises(SystemExit) as e:
        load_environment("gymnasium:FrozenLake-v2")
    assert "did you mean FrozenLake-v1" in str(e.value)


def test_bad_environment_kwargs_name_the_field_and_the_key():
    with pytest.raises(SystemExit) as e:
        load_environment("gymnasium:FrozenLake-v1", {"no_such_argument": True})
    assert "environment_kwargs" in str(e.value) and "no_such_argument" in str(e.value)
    with pytest.raises(SystemExit) as e:
        load_environment("gymnasium:Taxi-v4", {"random_map": 4})  # only the lakes have maps
    assert "environment_kwargs" in str(e.value) and "random_map" in str(e.value)


@pytest.mark.parametrize(
    "spec, kwargs",
    [("gymnasium:FrozenLake-v1", {"is_slippery": False}), ("gymnasium:Taxi-v4", {}), ("gymnasium:Blackjack-v1", {})],
)
def test_the_experts_pass_the_tiny_default_check(spec, kwargs):
    check_expert(adapter_class(spec, kwargs), f"tiny:{spec}", 0, n=4)


def test_demonstrations_are_shortest_paths_that_replay_to_success(lake):
    demos = demonstrations(lake, n=4, seed=0, difficulty=0, noise=0.0)
    for demo, task in zip(demos, lake.make_tasks("train", 4, seed=0), strict=True):
        moves = [m["content"] for m in demo if m["role"] == "assistant"]
        assert len(moves) == 6 and walk(LAKE, moves) == (3, 3)  # 3 downs, 3 rights: the shortest way
        assert sorted(moves) == ["down"] * 3 + ["right"] * 3
        env = lake()
        assert demo[0]["content"] == env.reset(task)
        for move in moves:
            _, _, done, info = env.step(move)
        assert done and info["success"]
