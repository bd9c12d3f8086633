"""Reward functions by name or import path, as `trl grpo --reward_funcs` takes them.

A name is one of `REWARD_NAMES`: TRL's own reward functions (`trl.rewards`; `accuracy_reward` and
`reasoning_accuracy_reward` need `math-verify`, which requirements.txt installs) and this project's
(`rewards/verifiers.py`). Anything else with a dot is an import path, `package.module.function` or
`package.module:function`, with the working directory importable. Several functions are summed with the config's
`reward_weights` (TRL's field), as TRL does.

`check_reward_funcs` reads each function's signature against what TRL will call it with, so that a missing dataset
column or a reward factory passed in place of a reward stops the run at start-up instead of raising TypeError in the
first training step.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import math
import numbers
from collections.abc import Callable, Sequence

from trl.rewards import accuracy_reward, get_soft_overlong_punishment, reasoning_accuracy_reward, think_format_reward

from rewards.verifiers import assertion_count_reward, binary_success_reward, exact_match_reward

logger = logging.getLogger(__name__)


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


class RewardFunctionError(RuntimeError):
    """A reward function raised, or returned something TRL cannot use; the message names the function."""


def checked_reward(func: Callable, name: str) -> Callable:
    """`func`, with what it returns checked before TRL turns it into a tensor: one entry per completion, each a real
    number or None (no reward). A non-finite number (inf, -inf, nan) counts as None, with a warning, so that the
    no-signal guard sees it instead of a step training with loss 0 on an infinite reward. Anything else, and any
    exception inside it, stops the step with a `RewardFunctionError` naming the function. Coroutine functions (which
    TRL awaits) are returned as they are."""
    if inspect.iscoroutinefunction(func):
        return func
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):  # a builtin or C callable: completions are then found by keyword only
        signature = inspect.Signature()

    @functools.wraps(func)
    def reward(*args, **kwargs):
        try:
            out = func(*args, **kwargs)
        except Exception as e:
            raise RewardFunctionError(f"reward function {name!r} raised {type(e).__name__}: {e}") from e
        completions = kwargs.get("completions")
        if completions is None and args:  # called positionally, as a user might outside TRL
            with contextlib.suppress(TypeError, ValueError):
                completions = signature.bind_partial(*args, **kwargs).arguments.get("completions", args[0])
        expected = None if completions is None else len(completions)
        if isinstance(out, (str, bytes)) or not isinstance(out, Sequence):
            raise RewardFunctionError(
                f"reward function {name!r} returned a {type(out).__name__}; it must return a list with one number "
                "(or None) per completion"
            )
        if expected is not None and len(out) != expected:
            raise RewardFunctionError(
                f"reward function {name!r} returned {len(out)} values for {expected} completions; it must return one "
                "number (or None) per completion"
            )
        bad = next((x for x in out if x is not None and not isinstance(x, numbers.Real)), None)
        if bad is not None:
            raise RewardFunctionError(
                f"reward function {name!r} returned a {type(bad).__name__} ({bad!r:.40}) among its rewards; each "
                "must be a number or None"
            )
        nonfinite = [i for i, x in enumerate(out) if x is not None and not math.isfinite(x)]
        if nonfinite:
            logger.warning(
                "reward function %r returned a non-finite value (%s) for %d of %d completions: counted as no reward "
                "(None)",
                name,
                out[nonfinite[0]],
                len(nonfinite),
                len(out),
            )
            out = [None if i in set(nonfinite) else x for i, x in enumerate(out)]
        return out

    return reward


def load_reward_funcs(names: list[str], max_completion_length: int = 256) -> list[Callable]:
    """The reward functions `names` point to, each checked by `checked_reward` when called; a clear error for a
    name that is neither known nor importable."""
    from envs.sources import import_object

    funcs = []
    for name in names:
        if name in REWARD_NAMES:
            funcs.append(checked_reward(REWARD_NAMES[name](max_completion_length), name))
        elif "." in name or ":" in name:
            func = import_object(name, "reward_funcs entry")
            if not callable(func):
                raise SystemExit(f"error: reward_funcs entry {name!r} is a {type(func).__name__}, not a function")
            funcs.append(checked_reward(func, name) if inspect.isfunction(func) else func)
        else:
            raise SystemExit(
                f"error: reward_funcs entry {name!r} is unknown; use one of {sorted(REWARD_NAMES)} or an import path "
                "(package.module.function)"
            )
    return funcs


# What TRL 1.16's `GRPOTrainer._calculate_rewards` passes every reward function, all as keyword arguments, besides the
# dataset columns (less `prompt`, `completion` and `completion_ids`, which it passes as the first three)
TRL_REWARD_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def check_reward_funcs(
    names: Sequence[str],
    funcs: Sequence[Callable],
    columns: Sequence[str],
    fields: Sequence[str] = (),
    where: str = "the dataset",
) -> None:
    """Stop, naming the fix, when TRL's call `f(prompts=..., completions=..., completion_ids=..., trainer_state=...,
    log_extra=..., log_metric=..., **columns, **fields)` of a reward in `funcs` (the entries `names` resolved to) would
    raise TypeError: a required parameter that is neither TRL's argument nor one of `columns` (the rows' columns,
    `where` names them in the message) nor of `fields` (what the agent loop adds to each row with an environment), or
    no `**kwargs` to take the rest. A function whose parameters take none of those is a factory that builds a reward.
    Parameters with defaults are fine; callables without a readable signature are not checked."""
    passed = {*TRL_REWARD_ARGUMENTS, *(c for c in columns if c not in ("prompt", "completion")), *fields}
    has = f"{where} has: {', '.join(columns)}" + (f"; the agent loop adds: {', '.join(fields)}" if fields else "")
    for name, func in zip(names, funcs, strict=True):
        short = name.replace(":", ".").rsplit(".", 1)[-1]
        try:
            params = list(inspect.signature(func).parameters.values())
        except (TypeError, ValueError):  # a builtin or C callable: nothing to read
            continue
        keywords = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        takes_rest = any(p.kind is p.VAR_KEYWORD for p in params)
        if not takes_rest and not passed & set(keywords):
            built = f"`my_reward = {short}({', '.join(f'{k}=...' for k in keywords)})`"
            if inspect.isclass(func):
                raise SystemExit(
                    f"error: reward_funcs entry {name!r}: `{short}` is a class: it takes ({', '.join(keywords)}) and "
                    f"builds an object, not rewards; build it in a file of yours, e.g. my_rewards.py: {built}, and "
                    "pass my_rewards.my_reward"
                )
            raise SystemExit(
                f"error: reward_funcs entry {name!r}: `{short}` takes ({', '.join(keywords)}), and TRL calls a "
                "reward as f(prompts=..., completions=..., completion_ids=..., **columns), all as keywords, so none "
                f"of its parameters would be given. If it is a reward, name its parameters as TRL passes them: "
                f"def {short}(completions, **kwargs) (a completion is a list of messages, or a string for a text "
                f"prompt). If it builds a reward (a factory), build it in a file of yours, e.g. my_rewards.py: "
                f"{built}, and pass my_rewards.my_reward"
            )
        required = [p.name for p in params if p.default is p.empty and p.name in keywords]
        missing = next((k for k in required if k not in passed), None)
        if missing in ("prompt", "completion"):
            raise SystemExit(
                f"error: reward `{short}` takes `{missing}`, which TRL never passes: it passes the batch as `prompts` "
                f"and `completions`; rename the parameter to `{missing}s`"
            )
        if missing is not None:
            raise SystemExit(
                f"error: reward `{short}` needs a `{missing}` column; {has}. Rename the column that holds it to "
                f"`{missing}`, or wrap the reward in a function of yours that passes it"
            )
        if not takes_rest:
            extra = sorted(passed - set(keywords))
            raise SystemExit(
                f"error: reward `{short}` takes no **kwargs, but TRL calls it with every column and argument as a "
                f"keyword, also {', '.join(extra)}; add **kwargs: def {short}({', '.join(keywords)}, **kwargs)"
            )
