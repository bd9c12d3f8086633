"""Helpers for tests of TextArena's GuessTheNumber, played directly (tests/test_adapter_textarena.py) or through
OpenEnv (tests/test_adapter_openenv.py): the secret TextArena itself draws, and a bisection player that reads only
the hints of the observations."""

from __future__ import annotations

import random
import re

import textarena


def package_secret(seed: int) -> int:
    """The number TextArena itself draws for `seed` (its global `random` restored afterwards)."""
    state = random.getstate()
    try:
        raw = textarena.make("GuessTheNumber-v0-raw")
        raw.reset(num_players=1, seed=seed)
        return raw.game_number
    finally:
        random.setstate(state)


def bisect_play(env, first: str) -> tuple[list[int], list[tuple]]:
    """Play by bisection on the words "higher" / "lower" of each observation, from the range in the first one;
    (guesses, step results). Stops after 11 guesses, the most TextArena's game allows."""
    low, high = map(int, re.search(r"between (\d+) and (\d+)", first).groups())
    guesses, results = [], []
    while True:
        guess = (low + high) // 2
        guesses.append(guess)
        results.append(env.step(f"I guess [{guess}]"))
        observation, _, done, _ = results[-1]
        if done or len(guesses) > 10:
            return guesses, results
        if "higher" in observation:
            low = guess + 1
        elif "lower" in observation:
            high = guess - 1
        else:
            raise AssertionError(f"no hint in {observation!r}")
