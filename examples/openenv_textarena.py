"""An OpenEnv environment, as a user writes one with openenv-core: TextArena's single-player games behind OpenEnv's
Action / Observation / State models. Train on it with no glue (configs/openenv_guess_the_number.yaml):

    environment: openenv:examples.openenv_textarena:TextArenaEnvironment
    environment_kwargs: {serve: true}      # through OpenEnv's own server on loopback; false (default): in-process

or serve it yourself, as any OpenEnv environment (`create_app(TextArenaEnvironment, GameAction, GameObservation)`
under uvicorn), and point `environment: openenv:ws://host:port` at it.

`reset(seed, game=...)` starts a game (`GuessTheNumber-v0` by default); the agent's text is the move. The optional
`expert_action()` / `noisy_action(rng)` give the project's tiny default its demonstrations (a bisection player for
GuessTheNumber).
"""

from __future__ import annotations

import random
import threading

import textarena as ta
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

_RANDOM = threading.Lock()  # TextArena plays on Python's global `random`; sessions take turns with it


class GameAction(Action):
    message: str = Field(..., description="the player's move, e.g. [10]")


class GameObservation(Observation):
    text: str = Field(default="", description="what the game said since the last move")
    success: bool = Field(default=False, description="the game was won")


class GameState(State):
    game: str = ""


class TextArenaEnvironment(Environment[GameAction, GameObservation, GameState]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # every session has its own game

    def __init__(self, game: str = "GuessTheNumber-v0"):
        super().__init__()
        self.default_game = game
        self.game = None
        self.rng_state = None
        self._state = GameState()

    def _play(self, fn):
        """Run `fn` with this game's own draws from `random`, the process's left as they were."""
        with _RANDOM:
            outer = random.getstate()
            try:
                if self.rng_state is not None:
                    random.setstate(self.rng_state)
                out = fn()
                self.rng_state = random.getstate()
            finally:
                random.setstate(outer)
        return out

    def _said(self) -> str:
        _, messages = self.game.get_observation()
        return "\n".join(text for sender, text, _ in messages if sender != 0).strip()

    def reset(self, seed: int | None = None, episode_id: str | None = None, game: str | None = None, **kwargs):
        name = game or self.default_game
        self.game = ta.make(name)
        while isinstance(self.game, ta.Wrapper):  # the bare game: this environment says what is new each turn
            self.game = self.game.env
        self.rng_state = None
        self._state = GameState(episode_id=episode_id, step_count=0, game=name)
        text = self._play(lambda: (self.game.reset(num_players=1, seed=seed), self._said())[1])
        return GameObservation(text=text, done=False, reward=0.0)

    def step(self, action: GameAction, timeout_s: float | None = None, **kwargs) -> GameObservation:
        self._state.step_count += 1
        done, text = self._play(lambda: (self.game.step(action.message)[0], self._said()))
        if not done:
            return GameObservation(text=text, done=False, reward=0.0)
        rewards, info = self._play(self.game.close)
        reward = float((rewards or {}).get(0, 0.0))
        text = "\n".join(t for t in (text, (info or {}).get(0, {}).get("reason", "")) if t)
        return GameObservation(text=text, done=True, reward=reward, success=reward >= 1.0)

    @property
    def state(self) -> GameState:
        return self._state

    # demonstrations for a tiny model (optional; the project's tiny default looks for these two)
    def expert_action(self) -> str:
        """GuessTheNumber by bisection on the hints so far."""
        low, high = self.game.min_number, self.game.max_number
        for guess, hint in self.game.state.game_state["guess_history"]:
            low, high = (max(low, guess + 1), high) if hint == "higher" else (low, min(high, guess - 1))
        return f"[{(low + high) // 2}]"

    def noisy_action(self, rng: random.Random) -> str:
        """A guess the hints rule out, or, one time in four, one made before."""
        guessed = sorted(self.game.guessed_numbers)
        if guessed and rng.random() < 0.25:
            return f"[{rng.choice(guessed)}]"
        return f"[{rng.randint(self.game.min_number, self.game.max_number)}]"
