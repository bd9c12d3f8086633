"""Environments from the ecosystem, run as the project's `Env`: `environment: <source>:<name>` in a config.

| source | `environment:` | what runs | reward |
| --- | --- | --- | --- |
| reasoning-gym | `reasoning_gym:<task>` | the package's procedural generator | its `score_answer` |
| TextArena | `textarena:<game id>` | a single-player game (`GuessTheNumber-v0`) | the game's outcome |
| gymnasium | `gymnasium:<env id>` | a toy-text env (FrozenLake, Taxi, Blackjack, CliffWalking) in words | its reward |
| verifiers | `verifiers:<module>` | a verifiers 0.4 taskset (and its Env) built locally | its reward functions |
| OpenEnv | `openenv:<module:Class>` | an OpenEnv `Environment`, in-process or served on loopback | its reward |

`environment_kwargs` go to the adapter (each module's docstring lists them: the package's own task settings plus a
few of the adapter's). Every adapter class is a subclass of `envs.base.Env` made for one `<source>:<name>` and its
settings (`environment_class`), so it carries the package's tasks (`make_tasks`, disjoint train and eval splits) and,
where the package allows one, an expert for the tiny default's demonstrations (`tiny:<source>:<name>`).

The packages are optional extras (`pip install -e '.[envs]'`); a source whose package is missing stops at start-up
with the install command. Nothing here downloads anything at run time.
"""

from __future__ import annotations

import difflib
import importlib
import json
from functools import cache

from envs.base import Env, check_split, split_of

#: `environment:` prefix -> (adapter module, the PyPI package it needs, an example name)
SOURCES: dict[str, tuple[str, str, str]] = {
    "reasoning_gym": ("envs.adapters.reasoning_gym", "reasoning-gym", "reasoning_gym:word_sequence_reversal"),
    "textarena": ("envs.adapters.textarena", "textarena", "textarena:GuessTheNumber-v0"),
    "gymnasium": ("envs.adapters.gymnasium", "gymnasium", "gymnasium:FrozenLake-v1"),
    "verifiers": ("envs.adapters.verifiers", "verifiers", "verifiers:mypackage.my_env"),
    "openenv": ("envs.adapters.openenv", "openenv-core", "openenv:mypackage.server:MyEnvironment"),
}


def is_adapter_spec(spec: str | None) -> bool:
    """Whether an `environment:` value names an ecosystem source (`<source>:<name>`)."""
    return bool(spec) and spec.partition(":")[0] in SOURCES


def adapter_class(spec: str, kwargs: dict | None = None) -> type[Env]:
    """The `Env` subclass of `<source>:<name>` with `kwargs` (environment_kwargs); mistakes stop with a message that
    names the field. Classes are cached, so one spec and settings always give the same class."""
    return _adapter_class(spec, json.dumps(kwargs or {}, sort_keys=True, default=str))


@cache
def _adapter_class(spec: str, kwargs_json: str) -> type[Env]:
    source, _, name = spec.partition(":")
    module_name, package, example = SOURCES[source]
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise SystemExit(
            f"error: environment {spec!r} needs the {package} package, which is not installed ({e}); install the "
            "environment extras: pip install -e '.[envs]'"
        ) from e
    if not name:
        raise SystemExit(f"error: environment {spec!r}: name the {source} environment after the colon, e.g. {example}")
    return module.environment_class(name, json.loads(kwargs_json))


def check_kwargs(spec: str, kwargs: dict, allowed: dict[str, str]) -> None:
    """Refuse environment_kwargs that `spec`'s adapter does not take; `allowed` maps each name to what it sets."""
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        listed = "; ".join(f"{k}: {v}" for k, v in sorted(allowed.items())) or "none"
        raise SystemExit(f"error: environment_kwargs {unknown} are not settings of {spec!r}; it takes {listed}")


def unknown_name(spec: str, kind: str, name: str, known, listed: str) -> SystemExit:
    """The start-up error for a name the package does not have: close names, and where the full list is."""
    close = difflib.get_close_matches(name, list(known), n=3)
    hint = f"; did you mean {' or '.join(close)}?" if close else ""
    return SystemExit(f"error: environment {spec!r}: {kind} {name!r}{hint} ({listed})")


def seed_tasks(split: str, n: int, seed: int, name: str) -> list[dict]:
    """`n` tasks of `split` that are seeds of the package's own reset, from `seed * 1_000_003` on; a hash of
    `name/seed` decides each seed's split (`envs.base.split_of`), so train and eval never share a seed."""
    check_split(split)
    tasks, s = [], seed * 1_000_003
    while len(tasks) < n:
        if split_of(f"{name}/{s}") == split:
            tasks.append({"task_id": f"{split}-{len(tasks)}", "seed": s})
        s += 1
    return tasks
