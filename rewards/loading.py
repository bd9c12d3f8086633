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

import inspect
from collections.abc import Callable, Sequence

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
            what = "a class: it takes" if inspect.isclass(func) else "a factory: it takes"
            built = "builds an object" if inspect.isclass(func) else "returns a reward function"
            raise SystemExit(
                f"error: reward_funcs entry {name!r}: `{short}` is {what} ({', '.join(keywords)}) and {built}, not "
                f"rewards; wrap it in a file of yours, e.g. my_rewards.py: `my_reward = {short}("
                f"{', '.join(f'{k}=...' for k in keywords)})`, and pass my_rewards.my_reward"
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
