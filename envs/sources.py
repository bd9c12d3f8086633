"""Where a run's tasks and environments come from: a built-in name, an import path, a dataset, or both.

`load_environment(spec, kwargs, difficulty)` resolves the `environment:` field of a config:

* a built-in name (`shop`, `terminal`, `search`): the class of `envs.ENVIRONMENTS`, built with `difficulty`;
* an ecosystem environment, `<source>:<name>` (`reasoning_gym:`, `textarena:`, `gymnasium:`, `verifiers:`,
  `openenv:`; `envs/adapters/`), its `environment_kwargs` the adapter's settings;
* an import path, `package.module:Class` or `package.module.Class` (the working directory is importable, as for
  `trl grpo --reward_funcs`), built with `environment_kwargs`:
  - a subclass of `envs.base.Env`, used as it is;
  - any other class with `reset` and `step` (the protocol of `envs/base.py`), wrapped in `ProtocolEnv`
    (`ExpertProtocolEnv` when it also has an expert, `expert_action` and `noisy_action`: the tiny default plays it);
  - a TRL-style tool class (`reset` plus public tool methods, no `step`), run through `ToolEnv`.

`load_splits(...)` reads a dataset with `datasets` in TRL's conventions (`dataset_name`, `dataset_config`,
`dataset_train_split`, `dataset_test_split`): a local file (.json, .jsonl, .csv, .parquet), a folder written by
`save_to_disk`, a folder of data files, or a Hub id. Without a test split, a seeded slice of the train split is held
out.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass

from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

from envs import ENVIRONMENTS
from envs.adapters import adapter_class, is_adapter_spec
from envs.base import Env, ProtocolEnv, ToolEnv, tool_methods

FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


class ExpertProtocolEnv(ProtocolEnv):
    """`ProtocolEnv` of a class that has an expert of its own, `expert_action()` and `noisy_action(rng)` as
    `envs.base.Env` defines them: the tiny default's demonstrations play it (`envs.tiny`)."""

    def expert_action(self) -> str:
        return self.inner.expert_action()

    def noisy_action(self, rng: random.Random) -> str:
        return self.inner.noisy_action(rng)


@dataclass
class EnvironmentSource:
    """A resolved `environment:` field. `factory(row)` builds the environment of one dataset row (what the trainer's
    `env_factory` takes); `make_tasks(split, n, seed, difficulty)` generates tasks, or is None when the environment
    has no generator and its tasks must come from a dataset."""

    name: str
    factory: Callable[[dict], Env]
    make_tasks: Callable[..., list[dict]] | None
    builtin: bool


# The top-level packages and module this project installs (pyproject.toml): an import path starting with one of them
# finds the project's, even where the working directory holds a file or folder of the same name
PROJECT_PACKAGES = ("agent_trl", "envs", "rewards", "trainers", "train")


def shadowed_by_project(module_name: str) -> str | None:
    """The file or folder of the working directory (`rewards.py`, `rewards/`) that this project's package of the
    same first name hides from `module_name`, or None."""
    top = module_name.split(".")[0]
    if top not in PROJECT_PACKAGES:
        return None
    own = os.path.realpath(importlib.import_module(top).__file__)  # .../rewards/__init__.py or .../train.py
    for mine in (f"{top}.py", top):
        path = os.path.join(os.getcwd(), mine)
        if os.path.exists(path) and os.path.realpath(path) not in (own, os.path.dirname(own)):
            return mine + ("/" if os.path.isdir(path) else "")
    return None


def _shadow_error(field_name: str, path: str, module_name: str, mine: str) -> SystemExit:
    top = module_name.split(".")[0]
    what = "folder" if mine.endswith("/") else "file"
    return SystemExit(
        f"error: {field_name} {path!r}: `{top}` is this project's own package, which hides your {mine} in the "
        f"working directory (the project installs the top-level names {', '.join(PROJECT_PACKAGES)}); rename your "
        f"{what}, e.g. to my_{mine}, and pass my_{path}"
    )


def import_object(path: str, field_name: str):
    """`package.module:attr` or `package.module.attr`, imported with the working directory on `sys.path`. When the
    module or attribute is missing from one of the project's packages that hides a file or folder of the working
    directory, the error says so."""
    module_name, sep, attr = path.partition(":")
    if not sep:
        module_name, _, attr = path.rpartition(".")
    if not module_name or not attr:
        raise SystemExit(f"error: {field_name} {path!r} is not an import path (package.module:Name)")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        mine = shadowed_by_project(module_name)
        if mine is not None:
            raise _shadow_error(field_name, path, module_name, mine) from e
        raise SystemExit(f"error: {field_name} {path!r}: cannot import module {module_name!r} ({e})") from e
    if not hasattr(module, attr):
        mine = shadowed_by_project(module_name)
        if mine is not None:
            raise _shadow_error(field_name, path, module_name, mine)
        raise SystemExit(f"error: {field_name} {path!r}: module {module_name!r} has no attribute {attr!r}")
    return getattr(module, attr)


def _accepts(cls: type, name: str) -> bool:
    try:
        params = inspect.signature(cls).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def load_environment(spec: str, kwargs: dict | None = None, difficulty: int = 0) -> EnvironmentSource:
    """Resolve an `environment:` field (see the module docstring). Errors name the field and say what is accepted."""
    kwargs = dict(kwargs or {})
    if spec in ENVIRONMENTS:
        cls = ENVIRONMENTS[spec]
        return EnvironmentSource(spec, lambda row: cls(difficulty=difficulty, **kwargs), cls.make_tasks, True)
    if is_adapter_spec(spec):
        adapted = adapter_class(spec, kwargs)
        return EnvironmentSource(spec, lambda row: adapted(difficulty=difficulty), adapted.make_tasks, False)
    if "." not in spec and ":" not in spec:
        raise SystemExit(
            f"error: environment {spec!r} is unknown; choose one of {sorted(ENVIRONMENTS)}, an ecosystem environment "
            "(reasoning_gym:<task>, textarena:<game>, gymnasium:<env id>, verifiers:<module>, openenv:<module:Class>) "
            "or give an import path (package.module:Class)"
        )
    obj = import_object(spec, "environment")
    if not inspect.isclass(obj):
        raise SystemExit(f"error: environment {spec!r} is a {type(obj).__name__}, not a class")
    if issubclass(obj, Env):
        if _accepts(obj, "difficulty"):
            kwargs.setdefault("difficulty", difficulty)
        own_tasks = obj.make_tasks.__func__ is not Env.make_tasks.__func__
        return EnvironmentSource(spec, lambda row: obj(**kwargs), obj.make_tasks if own_tasks else None, False)
    if callable(getattr(obj, "reset", None)) and callable(getattr(obj, "step", None)):
        make_tasks = getattr(obj, "make_tasks", None)
        expert = callable(getattr(obj, "expert_action", None)) and callable(getattr(obj, "noisy_action", None))
        wrapper = ExpertProtocolEnv if expert else ProtocolEnv
        return EnvironmentSource(spec, lambda row: wrapper(obj(**kwargs)), make_tasks, False)
    if callable(getattr(obj, "reset", None)) and tool_methods(obj):
        return EnvironmentSource(spec, lambda row: ToolEnv(obj, env_kwargs=kwargs), None, False)
    raise SystemExit(
        f"error: environment {spec!r} is neither an envs.base.Env subclass, nor a class with reset(task) and "
        "step(action), nor a TRL-style tool class (reset() plus public tool methods)"
    )


def check_environment(source: EnvironmentSource, task: dict) -> None:
    """Play one throwaway step on a fresh environment, so a wrong protocol fails at start-up and not mid-training."""
    try:
        env = source.factory(task)
    except TypeError as e:  # e.g. a keyword the class does not take
        raise SystemExit(
            f"error: environment {source.name!r} cannot be built from environment_kwargs ({type(e).__name__}: {e})"
        ) from e
    try:
        first = env.reset(task)
    except Exception as e:
        raise SystemExit(
            f"error: environment {source.name!r} cannot start the first task ({type(e).__name__}: {e}); the task was "
            f"{json.dumps(task, default=str)[:300]}. A dataset of prompts for single-turn training needs no "
            "environment (environment: none)"
        ) from e
    if not isinstance(first, str):
        raise SystemExit(f"error: environment {source.name!r}: reset(task) returned {type(first).__name__}, not str")
    try:
        out = env.step("")
    except Exception as e:
        raise SystemExit(f"error: environment {source.name!r}: step('') raised {type(e).__name__}: {e}") from e
    if not (isinstance(out, tuple) and len(out) == 4):
        raise SystemExit(
            f"error: environment {source.name!r}: step(action) must return (observation, reward, done, info), got "
            f"{out!r:.200}"
        )
    observation, reward, done, info = out
    problems = [
        f"{what} is {type(value).__name__}, expected {kind}"
        for what, value, ok, kind in [
            ("observation", observation, isinstance(observation, str), "str"),
            ("reward", reward, isinstance(reward, int | float) and not isinstance(reward, bool), "a number"),
            ("done", done, isinstance(done, bool), "bool"),
            ("info", info, isinstance(info, dict), "dict"),
        ]
        if not ok
    ]
    if problems:
        raise SystemExit(f"error: environment {source.name!r}: step(action) returned: {'; '.join(problems)}")


def _read(name: str, config: str | None) -> Dataset | DatasetDict:
    if os.path.isfile(name):
        ext = os.path.splitext(name)[1].lower()
        if ext not in FILE_BUILDERS:
            raise SystemExit(
                f"error: dataset_name {name!r}: files ending in {ext or '(nothing)'} cannot be read; use one of "
                f"{sorted(FILE_BUILDERS)}"
            )
        return load_dataset(FILE_BUILDERS[ext], data_files=name)
    if os.path.isdir(name):
        saved = any(os.path.exists(os.path.join(name, f)) for f in ("dataset_info.json", "dataset_dict.json"))
        return load_from_disk(name) if saved else load_dataset(name, name=config)
    try:
        return load_dataset(name, name=config)
    except Exception as e:  # offline, unknown id, private repo: the datasets error says which
        raise SystemExit(
            f"error: dataset_name {name!r} is not a local file or folder, and loading it from the Hub failed: {e}"
        ) from e


def load_splits(
    name: str,
    config: str | None = None,
    train_split: str = "train",
    test_split: str = "test",
    num_test: int = 200,
    seed: int = 0,
) -> tuple[Dataset, Dataset, str]:
    """(train, test, where the test rows came from). Without `test_split` in the data, `num_test` rows (at most a
    fifth) of the train split are held out, chosen by `seed`."""
    data = _read(name, config)
    if isinstance(data, Dataset):
        data = DatasetDict({train_split: data})
    if train_split not in data:
        raise SystemExit(
            f"error: dataset_train_split {train_split!r} is not in {name!r}; its splits are {sorted(data)}"
        )
    train = data[train_split]
    if len(train) == 0:
        raise SystemExit(f"error: split {train_split!r} of {name!r} has no rows")
    if test_split in data and test_split != train_split:
        return train, data[test_split], f"split {test_split!r}"
    n = min(num_test, len(train) // 5)
    if n == 0:
        raise SystemExit(
            f"error: {name!r} has no {test_split!r} split and {len(train)} rows are too few to hold out a fifth; "
            "add a test split or more rows"
        )
    parts = train.train_test_split(test_size=n, seed=seed)
    return parts["train"], parts["test"], f"{n} rows held out of {train_split!r} (no {test_split!r} split)"
