"""TextArena's single-player games as an environment: `environment: textarena:<game id>` (e.g. `GuessTheNumber-v0`).

The game is the package's own (`textarena.make(<game id>)`, without its observation wrappers): the first observation
is its prompt, each step plays the agent's whole turn as the game's action (most games read a move in square
brackets, `[5]`), and the observation is what the game said since (its messages to the player; the player's own move
is already in the chat). The game judges moves itself: an invalid move gets the game's own error message and, as in
TextArena, a second invalid move in a row loses. The reward is the game's outcome reward at the end (0 before);
success is an outcome reward of 1 (TextArena's win; games give a partial reward below it).

Tasks are seeds: a task is the game reset with `seed`, train and eval seeds told apart by a hash
(`envs.base.split_of`), so they never share a seed (small games, e.g. twenty possible numbers, do share positions).
`environment_kwargs`: the game's own constructor arguments (they override the registered ones, e.g. `max_number`),
plus `turn_budget`, the agent loop's turn budget (default twice the game's own turn limit, or 32; invalid moves do
not count as game turns).

TextArena seeds Python's global `random` in every reset and draws from it during play; here every call into a game
runs under one lock with the game's own generator state swapped in, so episodes played together (and the trainer)
never disturb each other. Word games call `nltk.download` at import: here no download is attempted (the machine may
be offline); a game whose NLTK data is not installed stops at start-up naming the resource.

Experts (for the tiny default's demonstrations, `tiny:textarena:<game id>`): GuessTheNumber, by bisection on the
hints so far (it never reads the secret). Other games train from a model folder or Hub id. GuessTheNumber also has a
skill text (`SKILLS`, the bisection strategy in words), the privileged guidance a teacher method reads.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import threading
from collections.abc import Callable, Iterator

import textarena as ta
from textarena.envs.registration import ENV_REGISTRY

from envs.adapters import seed_tasks, unknown_name
from envs.base import Env

_LOCK = threading.RLock()  # TextArena plays on Python's global `random`: one game at a time touches it


@contextlib.contextmanager
def _offline_nltk() -> Iterator[None]:
    """`nltk.download` answers from what is installed instead of the network while a game is made."""
    try:
        import nltk
    except ImportError:  # games that need no NLTK
        yield
        return

    def installed_only(resource=None, *args, **kwargs) -> bool:
        names = resource if isinstance(resource, list | tuple) else [resource]
        return all(_nltk_installed(str(n)) for n in names if n)

    original, nltk.download = nltk.download, installed_only
    try:
        yield
    finally:
        nltk.download = original


def _nltk_installed(name: str) -> bool:
    import nltk

    for kind in ("corpora", "taggers", "tokenizers", "models", "chunkers"):
        for suffix in ("", ".zip"):
            try:
                nltk.data.find(f"{kind}/{name}{suffix}")
                return True
            except LookupError:
                pass
    return False


def _hint_range(game) -> tuple[int, int]:
    """The lowest and highest number the hints so far leave possible."""
    low, high = game.min_number, game.max_number
    for guess, hint in game.state.game_state["guess_history"]:
        if hint == "higher":
            low = max(low, guess + 1)
        else:
            high = min(high, guess - 1)
    return low, high


def _guess_the_number(env: TextArenaEnv) -> str:
    """Bisection on the hints so far: the middle of the numbers still possible (never the secret itself)."""
    low, high = _hint_range(env.game)
    return f"[{(low + high) // 2}]"


def _guess_the_number_sound(env: TextArenaEnv, action: str) -> bool:
    """A guess the hints so far allow: a number from the lowest to the highest still possible (a number guessed
    before is outside them; the game reads the first `[n]` of a move)."""
    found = re.search(r"\[\s*(\d+)\s*\]", action)
    if found is None:
        return False
    low, high = _hint_range(env.game)
    guess = int(found.group(1))
    return low <= guess <= high


def _guess_the_number_mistake(env: TextArenaEnv, rng: random.Random) -> str:
    """A number the hints do not point to, or, one time in four, a number guessed before (the game refuses it)."""
    game = env.game
    if game.guessed_numbers and rng.random() < 0.25:
        return f"[{rng.choice(sorted(game.guessed_numbers))}]"
    left = [n for n in range(game.min_number, game.max_number + 1) if n not in game.guessed_numbers]
    return f"[{rng.choice(left or [game.min_number])}]"


#: game class name -> (expert, plausible mistake)
EXPERTS: dict[str, tuple[Callable, Callable]] = {
    "GuessTheNumberEnv": (_guess_the_number, _guess_the_number_mistake),
}

#: game class name -> whether a move is sound play (`Env.sound_action`): any move a careful player could make here
SOUND: dict[str, Callable] = {"GuessTheNumberEnv": _guess_the_number_sound}

#: game id -> how to play it well, in a few sentences (`Env.skill`): what a teacher method reads as privileged
#: guidance (AlignOPSD's skill card, docs/methods/alignopsd.md D6); the strategy its expert plays, in words
SKILLS: dict[str, str] = {
    "GuessTheNumber-v0": (
        "Keep the lowest and the highest number still possible: at the start, the range the game names. Guess the "
        "middle of them in square brackets, like [10] for 1 to 20. After 'higher', the lowest possible becomes your "
        "guess plus one; after 'lower', the highest possible becomes your guess minus one. Guess the middle again, "
        "and never repeat a guess: each guess halves what is left."
    ),
}


class TextArenaEnv(Env):
    """One TextArena game; the subclass made by `environment_class` sets `game_id`, `game_kwargs`, `max_turns`."""

    name = "textarena"
    verifier = "textarena"
    demo_version = 1  # part of the tiny default's key: bump when the experts' play changes
    game_id: str = ""
    game_kwargs: dict = {}

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        self.game = None
        self.history: list[str] = []  # what the player saw and did, in order (the state key)
        self._rng_state = None
        self.done = False

    @classmethod
    def make_game(cls):
        with _LOCK, _offline_nltk():
            env = ta.make(cls.game_id, **cls.game_kwargs)
        while isinstance(env, ta.Wrapper):  # the bare game: observations are rendered here, turn by turn
            env = env.env
        return env

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        return seed_tasks(split, n, seed, cls.game_id)

    def _call(self, fn: Callable):
        """Run `fn` with this game's generator state in Python's `random`, the caller's state put back after."""
        with _LOCK:
            outer = random.getstate()
            try:
                if self._rng_state is not None:
                    random.setstate(self._rng_state)
                out = fn()
                self._rng_state = random.getstate()
            finally:
                random.setstate(outer)
        return out

    def _observe(self) -> str:
        _, messages = self.game.get_observation()
        text = "\n".join(m for sender, m, _ in messages if sender != 0).strip()  # 0: the player's own move
        self.history.append(text)
        return text

    def reset(self, task: dict) -> str:
        self.game = self.make_game()
        self.history, self._rng_state, self.done = [], None, False
        return self._call(lambda: (self.game.reset(num_players=1, seed=int(task["seed"])), self._observe())[1])

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.game is None or self.done:
            raise RuntimeError("reset(task) must start an episode before step")
        self.history.append(action)

        def play():
            done, _ = self.game.step(action)
            # a refused move leaves TextArena's error count up (a valid one resets it); a second one ends the game
            state = self.game.state
            invalid = getattr(state, "error_count", 0) > 0 or bool(state.game_info.get(0, {}).get("invalid_move"))
            return done, invalid, self._observe()

        done, invalid, observation = self._call(play)
        if not done:
            return observation, 0.0, False, {"success": False, "invalid": invalid}
        self.done = True
        rewards, game_info = self._call(self.game.close)
        reward = float((rewards or {}).get(0, 0.0))
        reason = (game_info or {}).get(0, {}).get("reason") or ""
        observation = "\n".join(t for t in (observation, reason) if t)
        return observation, reward, True, {"success": reward >= 1.0, "invalid": invalid, "reason": reason}

    def state_key(self) -> str:
        return json.dumps(self.history)

    def _expert(self) -> tuple[Callable, Callable]:
        experts = EXPERTS.get(type(self.game).__name__)
        if experts is None:
            raise NotImplementedError(f"no expert for textarena:{self.game_id}")
        return experts

    def expert_action(self) -> str:
        return self._expert()[0](self)

    def sound_action(self, action: str) -> bool:
        sound = SOUND.get(type(self.game).__name__)
        return super().sound_action(action) if sound is None else sound(self, action)

    def noisy_action(self, rng: random.Random) -> str:
        return self._expert()[1](self, rng)


def environment_class(name: str, kwargs: dict) -> type[TextArenaEnv]:
    """The environment class of TextArena game `name` with `kwargs`; a wrong name, a game for more than one player, a
    wrong argument or missing NLTK data stops here."""
    spec = f"textarena:{name}"
    if name not in ENV_REGISTRY:
        listed = "python -c 'import textarena; textarena.pprint_registry_detailed()' lists them"
        raise unknown_name(spec, "TextArena has no game", name, ENV_REGISTRY, listed)
    settings = dict(kwargs)
    budget = settings.pop("turn_budget", None)
    if budget is not None and (not isinstance(budget, int) or budget < 1):
        raise SystemExit(f"error: environment_kwargs turn_budget must be a positive integer, got {budget!r}")
    class_name = "TextArena_" + re.sub(r"\W", "_", name)
    fields = {"name": spec, "game_id": name, "game_kwargs": settings, "skill": SKILLS.get(name, "")}
    cls = type(class_name, (TextArenaEnv,), fields)
    try:
        with _LOCK:
            outer = random.getstate()
            try:
                game = cls.make_game()
                game.reset(num_players=1, seed=0)
            finally:
                random.setstate(outer)
    except TypeError as e:
        raise SystemExit(f"error: environment_kwargs {kwargs} are not arguments of {spec!r}: {e}") from e
    except AssertionError as e:  # the states assert their player count
        raise SystemExit(f"error: environment {spec!r} is not a single-player game ({e})") from e
    except LookupError as e:  # NLTK data (nltk.data.find's message names the resource)
        first = str(e).strip().splitlines()
        resource = next((line.strip() for line in first if "Resource" in line), first[0] if first else "")
        raise SystemExit(
            f"error: environment {spec!r} needs NLTK data that is not installed ({resource}). Nothing is downloaded "
            "at run time; install it once where the network is reachable (python -m nltk.downloader <resource>) and "
            "point NLTK_DATA at it"
        ) from e
    own_limit = getattr(game, "max_turns", None)
    cls.max_turns = budget if budget is not None else (2 * own_limit if isinstance(own_limit, int) else 32)
    return cls
