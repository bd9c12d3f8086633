"""gymnasium's toy-text environments in words: `environment: gymnasium:<env id>`.

Supported: `FrozenLake-v1`, `FrozenLake8x8-v1`, `Taxi-v4`, `CliffWalking-v1`, `CliffWalkingSlippery-v1` and
`Blackjack-v1`. The environment is the package's own (`gymnasium.make(<env id>, **environment_kwargs)`, its time
limit included); this adapter only puts it into words. Each observation is the board (or the hand) as text, on the
lakes and the cliff also the agent's row and column and what each move leads onto (`down hole, right ice, ...`), and
the moves it takes; the agent answers with one move word (`left`, `down`, `right`, `up` on the lakes and the cliff;
`south`, `north`, `east`, `west`, `pickup`, `dropoff` in the taxi; `hit` or `stick` at the table), the last one in its
turn counting. A turn with no move word gets an error observation and changes nothing. The reward is the environment's;
success is reaching the goal (the lakes: reward 1; the cliff: the goal tile), a correct drop-off (taxi) or a won hand
(blackjack: reward > 0).

Tasks are seeds of `reset(seed=...)`, train and eval seeds told apart by a hash (`envs.base.split_of`). With
`random_map: N` (the lakes) every task is its own N x N map from gymnasium's `generate_random_map(N, p, seed)`
(`random_map_p`, default 0.8), so held-out episodes are new maps rather than new seeds of one map. `turn_budget` caps
the agent loop's turns (default: the environment's own time limit, at most 4 x the board's cells; blackjack 8).
Every other key of `environment_kwargs` goes to `gymnasium.make` (e.g. `is_slippery: false`).

Experts (the tiny default's demonstrations): the optimal action from value iteration on the environment's own
transition table (`unwrapped.P`, so slippery lakes are planned for their real odds); blackjack's basic strategy
without doubling or splitting. A plausible mistake is another legal move.
"""

from __future__ import annotations

import json
import random
import re

import gymnasium
import numpy as np
from gymnasium.envs.toy_text.frozen_lake import generate_random_map

from envs.adapters import seed_tasks, unknown_name
from envs.base import Env, check_split, split_of

GRID_MOVES = ("left", "down", "right", "up")  # FrozenLake's and CliffWalking's action ids 0-3 (CliffWalking: 0 up)
CLIFF_MOVES = ("up", "right", "down", "left")
TAXI_MOVES = ("south", "north", "east", "west", "pickup", "dropoff")
TABLE_MOVES = ("stick", "hit")
SUPPORTED = {
    "FrozenLake-v1": GRID_MOVES,
    "FrozenLake8x8-v1": GRID_MOVES,
    "CliffWalking-v1": CLIFF_MOVES,
    "CliffWalkingSlippery-v1": CLIFF_MOVES,
    "Taxi-v4": TAXI_MOVES,
    "Blackjack-v1": TABLE_MOVES,
}
ADAPTER_SETTINGS = ("turn_budget", "random_map", "random_map_p")


def value_iteration(transitions: dict, n_states: int, n_actions: int, gamma: float = 0.99) -> np.ndarray:
    """Optimal action values Q (n_states, n_actions) of a tabular model `P[s][a] = [(p, s', r, done), ...]`."""
    q = np.zeros((n_states, n_actions))
    for _ in range(2000):
        v = q.max(axis=1)
        new = np.array(
            [
                [sum(p * (r + (0.0 if done else gamma * v[s2])) for p, s2, r, done in transitions[s][a])
                 for a in range(n_actions)]
                for s in range(n_states)
            ]
        )  # fmt: skip
        if np.abs(new - q).max() < 1e-9:
            return new
        q = new
    return q


def blackjack_expert(player: int, dealer: int, usable_ace: bool) -> str:
    """Basic strategy without doubling or splitting: stand on hard 17+, on 13-16 against 2-6, on 12 against 4-6; stand
    on soft 19+, on soft 18 against 2-8; otherwise hit (dealer's ace is 1)."""
    if usable_ace:
        return "stick" if player >= 19 or (player == 18 and 2 <= dealer <= 8) else "hit"
    if player >= 17 or (13 <= player <= 16 and 2 <= dealer <= 6) or (player == 12 and 4 <= dealer <= 6):
        return "stick"
    return "hit"


class GymnasiumEnv(Env):
    """One toy-text environment; the subclass made by `environment_class` sets `env_id`, `make_kwargs`, `moves`."""

    name = "gymnasium"
    verifier = "gymnasium"
    demo_version = 1  # part of the tiny default's key: bump when the text of the board changes
    env_id: str = ""
    make_kwargs: dict = {}
    moves: tuple[str, ...] = ()
    random_map: int | None = None
    random_map_p: float = 0.8

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        self.env = None
        self.obs = None
        self.done = False
        self.desc: list[str] | None = None  # the task's own map (random_map)
        self._q: np.ndarray | None = None

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        if not cls.random_map:
            return seed_tasks(split, n, seed, cls.env_id)
        check_split(split)
        tasks, s, seen = [], seed * 1_000_003, set()
        while len(tasks) < n and s < seed * 1_000_003 + 1000 * n + 10_000:
            desc = generate_random_map(cls.random_map, cls.random_map_p, seed=s)
            s += 1
            if tuple(desc) in seen:  # no lake twice; the lake decides the split, so no held-out lake is trained on
                continue
            seen.add(tuple(desc))
            if split_of(f"{cls.env_id}/{json.dumps(desc)}") == split:
                tasks.append({"task_id": f"{split}-{len(tasks)}", "seed": s - 1, "desc": desc})
        if len(tasks) < n:
            raise ValueError(f"{cls.name}: only {len(tasks)} distinct {split} maps of side {cls.random_map} found; "
                             "ask for fewer tasks or a larger random_map")  # fmt: skip
        return tasks

    def reset(self, task: dict) -> str:
        kwargs = dict(self.make_kwargs)
        if "desc" in task:
            kwargs["desc"] = list(task["desc"])
        self.env = gymnasium.make(self.env_id, **kwargs)
        self.obs, _ = self.env.reset(seed=int(task["seed"]))
        self.done, self._q, self.desc = False, None, kwargs.get("desc")
        return f"{self.rules()}\n{self.describe()}"

    def rules(self) -> str:
        game = self.env_id.split("-")[0]
        goals = {
            "FrozenLake": "Walk from S to the goal G without stepping into a hole H.",
            "FrozenLake8x8": "Walk from S to the goal G without stepping into a hole H.",
            "CliffWalking": "Walk from S to the goal G without stepping off the cliff C.",
            "CliffWalkingSlippery": "Walk from S to the goal G without stepping off the cliff C.",
            "Taxi": "Pick the passenger up and drop them off at their destination.",
            "Blackjack": "Beat the dealer without going over 21.",
        }
        return f"{goals[game]} Answer with one move: {', '.join(self.moves)}."

    def describe(self) -> str:
        """The current state in words (the board with `@` for the agent, or the hand)."""
        u = self.env.unwrapped
        if self.env_id.startswith("Blackjack"):
            player, dealer, ace = self.obs
            return f"Your hand: {player}{' (usable ace)' if ace else ''}. Dealer shows: {dealer}."
        if self.env_id.startswith("Taxi"):
            row, col, passenger, destination = u.decode(self.obs)
            names = "RGYB"
            lines = [list(line.decode() for line in r) for r in u.desc]
            lines[1 + row][2 * col + 1] = "@"
            where = "in the taxi" if passenger == 4 else f"at {names[passenger]}"
            board = "\n".join("".join(r) for r in lines)
            return f"{board}\nPassenger {where}, destination {names[destination]}."
        rows, cols = u.desc.shape if hasattr(u, "desc") else u.shape
        row, col = divmod(int(self.obs), cols)
        if hasattr(u, "desc"):  # the lakes
            grid = [[c.decode() for c in r] for r in u.desc]
        else:  # the cliff: start bottom left, goal bottom right, the cliff between
            grid = [["."] * cols for _ in range(rows)]
            grid[-1] = ["S"] + ["C"] * (cols - 2) + ["G"]
        names = {"S": "start", "F": "ice", "H": "hole", "G": "goal", ".": "ground", "C": "cliff"}
        around = []  # what each move leads onto: a text agent reads it without finding itself on the board first
        for move in ("left", "down", "right", "up"):
            dr, dc = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}[move]
            r, c = row + dr, col + dc
            around.append(f"{move} {names[grid[r][c]] if 0 <= r < rows and 0 <= c < cols else 'edge'}")
        grid[row][col] = "@"
        return "\n".join(" ".join(r) for r in grid) + f"\nRow {row}, column {col}: " + ", ".join(around) + "."

    def parse(self, action: str) -> int | None:
        found = re.findall(r"\b(" + "|".join(self.moves) + r")\b", action.lower())
        return self.moves.index(found[-1]) if found else None

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.env is None or self.done:
            raise RuntimeError("reset(task) must start an episode before step")
        move = self.parse(action)
        if move is None:
            return (f"error: no move found; answer with one of: {', '.join(self.moves)}", 0.0, False,
                    {"success": False, "invalid": True})  # fmt: skip
        self.obs, reward, terminated, truncated, _ = self.env.step(move)
        self.done = bool(terminated or truncated)
        info = {"success": bool(terminated) and self.succeeded(float(reward)), "invalid": False}
        if truncated and not terminated:
            info["time_limit"] = True
        return self.describe(), float(reward), self.done, info

    def succeeded(self, reward: float) -> bool:
        """Whether the episode's last reward, on termination, is the environment's success."""
        if self.env_id.startswith("Taxi"):
            return reward == 20  # a correct drop-off (gymnasium's Taxi: +20)
        if self.env_id.startswith("CliffWalking"):
            return int(self.obs) == self.env.unwrapped.shape[0] * self.env.unwrapped.shape[1] - 1  # on the goal
        return reward > 0  # the lakes' goal (1), a won hand

    def state_key(self) -> str:
        return json.dumps([str(self.obs), self.desc], default=str)

    def expert_action(self) -> str:
        if self.env_id.startswith("Blackjack"):
            player, dealer, ace = self.obs
            return blackjack_expert(int(player), int(dealer), bool(ace))
        if self._q is None:
            u = self.env.unwrapped
            self._q = value_iteration(u.P, u.observation_space.n, u.action_space.n)
        return self.moves[int(np.argmax(self._q[int(self.obs)]))]

    def noisy_action(self, rng: random.Random) -> str:
        best = self.expert_action()
        return rng.choice([m for m in self.moves if m != best])


def environment_class(name: str, kwargs: dict) -> type[GymnasiumEnv]:
    """The environment class of toy-text env `name` with `kwargs`; a wrong name or argument stops here."""
    spec = f"gymnasium:{name}"
    if name not in SUPPORTED:
        listed = f"it plays {sorted(SUPPORTED)}"
        raise unknown_name(spec, "the gymnasium adapter does not play", name, SUPPORTED, listed)
    settings = {k: kwargs[k] for k in ADAPTER_SETTINGS if k in kwargs}
    make_kwargs = {k: v for k, v in kwargs.items() if k not in ADAPTER_SETTINGS}
    random_map = settings.get("random_map")
    if random_map is not None and (not name.startswith("FrozenLake") or not isinstance(random_map, int)
                                   or random_map < 2):  # fmt: skip
        raise SystemExit(f"error: environment_kwargs random_map is a lake side of 2 or more (FrozenLake only), "
                         f"got {random_map!r}")  # fmt: skip
    try:  # the package checks its own arguments
        probe = gymnasium.make(name, **make_kwargs)
        probe.reset(seed=0)
    except TypeError as e:
        raise SystemExit(f"error: environment_kwargs {make_kwargs} are not arguments of {spec!r}: {e}") from e
    u = probe.unwrapped
    cells = u.observation_space.n if hasattr(u.observation_space, "n") else 8
    if random_map:
        cells = random_map * random_map
    limit = probe.spec.max_episode_steps or 4 * cells
    budget = settings.get("turn_budget") or (8 if name.startswith("Blackjack") else int(min(limit, 4 * cells)))
    if not isinstance(budget, int) or budget < 1:
        raise SystemExit(f"error: environment_kwargs turn_budget must be a positive integer, got {budget!r}")
    return type(
        "Gymnasium_" + re.sub(r"\W", "_", name),
        (GymnasiumEnv,),
        {"name": spec, "env_id": name, "make_kwargs": make_kwargs, "moves": SUPPORTED[name], "max_turns": budget,
         "random_map": random_map, "random_map_p": float(settings.get("random_map_p", 0.8))},
    )  # fmt: skip
