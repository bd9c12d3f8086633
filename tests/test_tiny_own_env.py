"""The tiny default of a user's own environment (`--environment package.module:Class --model_name_or_path tiny`):
built from the class's expert and keyed by its import path, settings and source file; a tiny default meeting another
environment than its own, and a class without an expert, stop at start-up with the fix."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

import train
from agent_trl.arguments import RunArguments
from agent_trl.run_info import resolve_model
from agent_trl.sources import Sources
from envs.sources import load_environment
from envs.tiny import TinySpec, check_played_expert, played_demonstrations, tiny_model
from examples.guess_env import GuessEnv

ROOT = Path(__file__).resolve().parent.parent
GUESS = "examples.guess_env:GuessEnv"
# the README test's shortening of a train.py command (tests/test_readme.py), and a 64-demonstration build
SHORT = ["--max_steps", "1", "--num_train_tasks", "16", "--num_eval_tasks", "4", "--per_device_train_batch_size", "8"]
SHORT += ["--num_generations", "4", "--tiny_sft_steps", "2", "--max_completion_length", "64", "--logging_steps", "1"]
SHORT += ["--tiny_num_demos", "64"]

NO_EXPERT = '''
from envs.base import Env


class Echo(Env):
    """Say the word back; no expert."""

    name = "echo"

    @classmethod
    def make_tasks(cls, split, n, seed=0, difficulty=0):
        return [{"word": f"{split}{i}"} for i in range(n)]

    def reset(self, task):
        self.word = task["word"]
        return f"say {self.word}"

    def step(self, action):
        ok = action.strip() == self.word
        return "", float(ok), True, {"success": ok}


class DuckExpert:
    """No base class, an expert of its own (run through envs.sources.ExpertProtocolEnv)."""

    max_turns = 2

    def reset(self, task):
        self.word = task["word"]
        return f"say {self.word}"

    def step(self, action):
        ok = action.strip() == self.word
        return "", float(ok), True, {"success": ok}

    def expert_action(self):
        return self.word

    def noisy_action(self, rng):
        return "nothing"


class DuckExpertOnly(DuckExpert):
    noisy_action = None  # an expert without its plausible mistake
'''


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tiny"


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A module of the user's, importable from the working directory as `mine`."""
    (tmp_path / "mine.py").write_text(NO_EXPERT)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "mine"


def test_the_users_step_trains_guess_env_from_tiny(cache, tmp_path):
    """The issue's command with `tiny`: GuessEnv's own tiny default is built (its expert, hi=20) and trained."""
    out = tmp_path / "run"
    argv = ["--config", str(ROOT / "configs/quickstart.yaml"), "--environment", GUESS, "--environment_kwargs"]
    argv += ['{"hi": 20}', "--model_name_or_path", "tiny", "--output_dir", str(out), *SHORT]
    written = train.main(argv)
    (built,) = cache.iterdir()
    assert built.name.startswith("tiny-examples.guess_env-GuessEnv-")
    spec = json.loads((built / "tiny_spec.json").read_text())
    assert spec["env"] == GUESS and spec["env_kwargs"] == '{"hi": 20}' and spec["sft_steps"] == 2
    assert spec["num_demos"] == 64
    assert written["model"] == "tiny" and [row["step"] for row in written["log_history"] if "loss" in row] == [1]
    assert json.loads((out / "summary.json").read_text())["after"]["sampled"]["turns"] >= 1


def test_demonstrations_are_guess_envs_bisection_with_its_settings():
    """Played on environments built as the run builds them: hi=20 opens with (1+20)//2 = 10, hi=50 with 25; without
    noise every episode ends "correct" (bisection finds any number of [1, 50] in at most 6 guesses)."""
    for hi, first in [(20, "10"), (50, "25")]:
        source = load_environment(GUESS, {"hi": hi})
        tasks = source.make_tasks("train", 30, seed=0)
        demos = played_demonstrations(source.factory, tasks, seed=0, noise=0.0)
        assert all(d[1] == {"role": "assistant", "content": first} for d in demos)
        assert all(len(d) <= 2 * 6 and d[-1]["role"] == "assistant" for d in demos)
        for demo, task in zip(demos, tasks, strict=True):
            env = GuessEnv(hi=hi)
            env.reset(task)
            assert demo[-1]["content"] == str(env.secret)  # the last guess is the secret
    noisy = played_demonstrations(load_environment(GUESS, {"hi": 20}).factory, tasks, seed=0, noise=0.3)
    assert sum(d[1]["content"] != "10" for d in noisy) > 0  # some first turns are the noisy action


def test_the_build_is_keyed_by_import_path_settings_and_source(user_module, tmp_path):
    (tmp_path / "game.py").write_text((ROOT / "examples/guess_env.py").read_text())
    key = TinySpec.parse("tiny:game:GuessEnv").key()
    assert key != TinySpec.parse(f"tiny:{GUESS}").key()  # the same text under another import path
    assert key != TinySpec.parse("tiny:game:GuessEnv", env_kwargs='{"hi": 50}').key()
    assert key == TinySpec.parse("tiny:game:GuessEnv").key()
    with (tmp_path / "game.py").open("a") as f:
        f.write("# an edit\n")
    assert TinySpec.parse("tiny:game:GuessEnv").key() != key  # an edited class rebuilds


def test_a_cached_build_is_reused_and_dataset_tasks_name_their_own(cache):
    settings = dict(sft_steps=1, num_demos=8, env_kwargs='{"hi": 8}')
    folder = tiny_model(f"tiny:{GUESS}", **settings)
    assert tiny_model(f"tiny:{GUESS}", **settings) == folder and len(list(cache.iterdir())) == 1
    rows = [{"task_id": "a", "seed": 4}, {"task_id": "b", "seed": 6}]  # tasks as a dataset would give them
    from_rows = tiny_model(f"tiny:{GUESS}", tasks=rows, **settings)
    assert from_rows.startswith(folder + "-") and len(list(cache.iterdir())) == 2


def test_tiny_passes_a_datasets_tasks_for_a_class_without_make_tasks(monkeypatch):
    import agent_trl.run_info as run_info

    calls = []
    monkeypatch.setattr(run_info, "tiny_model", lambda *a, **k: calls.append((a, k)) or "/built")
    source = load_environment(GUESS, {"hi": 20})
    source.make_tasks = None  # as a class with no generator of its own
    rows = [{"prompt": "p", "task": json.dumps({"seed": 2})}, {"prompt": "q", "task": json.dumps({"seed": 4})}]
    run = RunArguments(environment="examples.guess_env.GuessEnv", tiny_sft_steps=3)
    assert resolve_model("tiny", run, Sources(source, rows, [], None, "", None, {"hi": 20})) == "/built"
    assert calls == [
        ((f"tiny:{GUESS}",), {"difficulty": 0, "seed": 0, "sft_steps": 3, "env_kwargs": '{"hi": 20}',
                              "tasks": [{"seed": 2}, {"seed": 4}]}),
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("model", "environment", "made", "runs_on"),
    [
        ("tiny:shop", GUESS, "'shop'", f"'{GUESS}'"),
        ("tiny:shop", "search", "'shop'", "'search'"),
        ("tiny:textarena:GuessTheNumber-v0", GUESS, "'textarena:GuessTheNumber-v0'", f"'{GUESS}'"),
    ],
)
def test_a_tiny_default_of_another_environment_is_refused(cache, model, environment, made, runs_on):
    """The issue's silent case (quickstart's tiny:shop on GuessEnv) stops at start-up, before anything is built."""
    argv = ["--config", str(ROOT / "configs/quickstart.yaml"), "--environment", environment]
    argv += ["--model_name_or_path", model, *SHORT]
    with pytest.raises(SystemExit) as e:
        train.main(argv)
    message = str(e.value)
    assert message.startswith(f"error: model_name_or_path '{model}' is the tiny default of {made}, and this run ")
    assert f"trains on {runs_on}" in message and "Use model_name_or_path: tiny (" in message
    assert not cache.exists()


@pytest.mark.parametrize(
    ("recorded", "environment", "refused"),
    [
        ("shop", GUESS, True),
        ("dataset", GUESS, True),  # a dataset's tiny default
        ("examples.guess_env.GuessEnv", GUESS, False),  # the other spelling of the same class
        ("shop", "shop", False),
        ("echo", GUESS, False),  # not an environment's name: a folder this project did not build for one
        ("examples.guess_env:GuessEnv", None, True),  # an environment's tiny default on a dataset's prompts
        ("openenv:examples.openenv_textarena:TextArenaEnvironment", "openenv:ws://127.0.0.1:8000", False),  # unknown
    ],
)
def test_a_folder_records_what_it_was_built_for(tmp_path, recorded, environment, refused):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tiny_spec.json").write_text(json.dumps({"env": recorded, "seed": 0}))
    # a server is not contacted here: only its presence matters to resolve_model
    source = None if environment is None else object() if "://" in environment else load_environment(environment)
    run = RunArguments(environment=environment)
    sources = Sources(source, [], [], None, "")
    if not refused:
        assert resolve_model(str(folder), run, sources) == str(folder)
        return
    with pytest.raises(SystemExit, match=re.escape("(its tiny_spec.json says so), and this run trains on")) as e:
        resolve_model(str(folder), run, sources)
    assert f"'{folder}' is the tiny default of " in str(e.value)


def test_a_class_without_an_expert_stops_with_what_it_needs(cache, user_module, tmp_path):
    with pytest.raises(SystemExit) as e:
        train.main(["--environment", f"{user_module}:Echo", "--model_name_or_path", "tiny", *SHORT,
                    "--output_dir", str(tmp_path / "run"), "--use_cpu", "true", "--bf16", "false"])  # fmt: skip
    message = str(e.value)
    assert message.startswith(f"error: model_name_or_path 'tiny:{user_module}:Echo': the tiny default learns from an ")
    assert "and echo has none" in message and "expert_action(self) -> str" in message
    assert "noisy_action(self, rng) -> str" in message and "a model folder, or a Hub id" in message
    assert not list(cache.glob("*/model.safetensors"))


def test_a_duck_typed_class_with_an_expert_is_played(user_module):
    source = load_environment(f"{user_module}:DuckExpert")
    tasks = [{"word": "cat"}, {"word": "dog"}]
    check_played_expert(source.factory, tasks, "tiny")  # succeeds: returns
    demos = played_demonstrations(source.factory, tasks, seed=0, noise=0.0)
    expected = [[{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": w}] for w in ("cat", "dog")]
    assert demos == expected
    assert source.factory(tasks[0]).noisy_action(random.Random(0)) == "nothing"
    only = load_environment(f"{user_module}:DuckExpertOnly")  # without noisy_action: no expert the build can use
    with pytest.raises(SystemExit, match="DuckExpertOnly has none"):
        check_played_expert(only.factory, tasks, "tiny")
