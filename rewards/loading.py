"""Reward functions by name or import path, as `trl grpo --reward_funcs` takes them.

A name is one of `REWARD_NAMES`: TRL's own reward functions (`trl.rewards`; `accuracy_reward` and
`reasoning_accuracy_reward` need `math-verify`, which requirements.txt installs) and this project's
(`rewards/verifiers.py`). Anything else with a dot is an import path, `package.module.function` or
`package.module:function`, with the working directory importable. Several functions are summed with the config's
`reward_weights` (TRL's field), as TRL does.
"""

from __future__ import annotations

from collections.abc import Callable

from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward

from rewards.verifiers import assertion_count_reward, binary_success_reward, exact_match_reward


def _overlong(max_completion_length: int) -> Callable:
    # TRL's script fixes 1280 / 256; here the punishment starts at the last quarter of the run's own budget
    f = get_soft_overlong_punishment(
        max_completion_len=max_completion_length, soft_punish_cache=max_completion_length // 4
    )
    f.__name__ = "soft_overlong_punishment"
    return f


REWARD_NAMES: dict[str, Callable[[int], Callable]] = {
    "accuracy_reward": lambda _: accuracy_reward,
    "reasoning_accuracy_reward": lambda _: reasoning_accuracy_reward,
    "think_format_reward": lambda _: think_format_reward,
    "get_soft_overlong_punishment": _overlong,
    "exact_match_reward": lambda _: exact_match_reward,
    "binary_success_reward": lambda _: binary_success_reward,
    "assertion_count_reward": lambda _: assertion_count_reward,
}


def load_reward_funcs(names: list[str], max_completion_length: int = 256) -> list[Callable]:
    """The reward functions `names` point to; a clear error for a name that is neither known nor importable."""
    from envs.sources import import_object

    funcs = []
    for name in names:
        if name in REWARD_NAMES:
            funcs.append(REWARD_NAMES[name](max_completion_length))
        elif "." in name or ":" in name:
            func = import_object(name, "reward_funcs entry")
            if not callable(func):
                raise SystemExit(f"error: reward_funcs entry {name!r} is a {type(func).__name__}, not a function")
            funcs.append(func)
        else:
            raise SystemExit(
                f"error: reward_funcs entry {name!r} is unknown; use one of {sorted(REWARD_NAMES)} or an import path "
                "(package.module.function)"
            )
    return funcs
