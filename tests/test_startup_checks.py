"""Issue 39, step by step through `train.main`: a reward that TRL could not call (a missing dataset column, a factory
in place of a reward, no **kwargs), and a user's `rewards.py` / `envs.py` hidden by the project's packages of the same
name, stop the run at start-up with a message naming the fix, before any model is resolved or loaded."""

from __future__ import annotations

import json
import sys
import tomllib
from pathlib import Path

import pytest
from datasets import Dataset, DatasetDict

import train
from envs.sources import PROJECT_PACKAGES
from rewards.loading import check_reward_funcs

REPO = Path(__file__).resolve().parent.parent
QUIET = ["--use_cpu", "true", "--bf16", "false", "--report_to", "none"]
SHOP = [
    "--environment",
    "shop",
    "--num_train_tasks",
    "4",
    "--num_eval_tasks",
    "2",
    "--model_name_or_path",
    "tiny:shop",
]
SHOP += QUIET


class ReachedModel(Exception):
    """Raised where a model would be resolved: start-up passed."""


def _reached(*args, **kwargs):
    raise ReachedModel


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """An empty working directory holding a prompt/answer dataset; every model load raises `ReachedModel`."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # import_object adds the working directory; undo it afterwards
    for name in ("resolve_model", "AutoModelForCausalLM", "AutoTokenizer"):
        monkeypatch.setattr(train, name, _reached)
    rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(10)]
    (tmp_path / "arith.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def start(workdir: Path, *argv: str) -> str:
    """The error `train.main` stops with; fails the test when start-up passes and a model would be loaded."""
    with pytest.raises(SystemExit) as err:
        train.main([*argv, "--output_dir", str(workdir / "run")])
    return str(err.value.code)


def passes_start_up(workdir: Path, *argv: str) -> None:
    with pytest.raises(ReachedModel):
        train.main([*argv, "--output_dir", str(workdir / "run")])


# rewards a user writes, named by import path tests.test_startup_checks.<name>
def needs_success(completions, success, **kwargs) -> list[float]:
    return [float(s) for s in success]


def no_kwargs(completions, answer) -> list[float]:
    return [0.0 for _ in completions]


def with_defaults(completions, answer, scale: float = 1.0, **kwargs) -> list[float]:
    return [scale for _ in completions]


def make_reward(threshold: float) -> object:
    return lambda completions, **kwargs: [threshold for _ in completions]


DATASET = ["--dataset_name", "arith.jsonl", "--environment", "none", "--model_name_or_path", "tiny", *QUIET]


def test_accuracy_reward_without_a_solution_column(workdir):
    message = start(workdir, *DATASET, "--reward_funcs", "accuracy_reward")
    assert "reward `accuracy_reward` needs a `solution` column; the dataset has: prompt, answer" in message


def test_a_factory_by_import_path(workdir):
    message = start(workdir, *DATASET, "--reward_funcs", "trl.rewards.get_repetition_penalty_reward")
    assert "`get_repetition_penalty_reward` takes (ngram_size, max_penalty)" in message
    assert "If it builds a reward (a factory)" in message and "get_repetition_penalty_reward(ngram_size=..." in message
    message = start(workdir, *DATASET, "--reward_funcs", "tests.test_startup_checks.make_reward")
    assert "`make_reward` takes (threshold)" in message


def wrong_names(text):  # a reward whose parameter is not one TRL passes
    return [0.0]


def test_a_reward_with_parameters_trl_does_not_pass_gets_both_fixes(workdir):
    """Issue 65: `def r(text)` is a reward with the wrong parameter names, not a factory; the message gives the
    signature TRL calls and the factory case, without claiming which it is."""
    message = start(workdir, *DATASET, "--reward_funcs", "tests.test_startup_checks.wrong_names")
    assert "`wrong_names` takes (text)" in message
    assert "def wrong_names(completions, **kwargs)" in message and "If it builds a reward (a factory)" in message


def test_a_reward_without_kwargs(workdir):
    message = start(workdir, *DATASET, "--reward_funcs", "tests.test_startup_checks.no_kwargs")
    assert "`no_kwargs` takes no **kwargs" in message and "trainer_state" in message
    assert "def no_kwargs(completions, answer, **kwargs)" in message


def test_an_agent_loop_field_is_there_with_an_environment_only(workdir):
    passes_start_up(workdir, *SHOP, "--reward_funcs", "tests.test_startup_checks.needs_success")
    message = start(workdir, *DATASET, "--reward_funcs", "tests.test_startup_checks.needs_success")
    assert "needs a `success` column; the dataset has: prompt, answer" in message
    message = start(workdir, *SHOP, "--reward_funcs", "accuracy_reward")  # env rows: prompt, task, task_id
    assert "needs a `solution` column; the dataset has: prompt, task, task_id; the agent loop adds:" in message
    assert "env_reward" in message and "success" in message and "env_mask" not in message


def test_defaults_and_a_second_good_reward_pass(workdir):
    rewards = ["tests.test_startup_checks.with_defaults", "exact_match_reward", "think_format_reward"]
    passes_start_up(workdir, *DATASET, "--reward_funcs", *rewards)


def test_the_held_out_split_is_checked_too(workdir):
    train_rows = [{"prompt": f"{i} + 1 =", "answer": str(i + 1)} for i in range(8)]
    test_rows = [{"prompt": "1 + 1 =", "solution": "2"}]  # the held-out rewards are scored on these columns
    DatasetDict({"train": Dataset.from_list(train_rows), "test": Dataset.from_list(test_rows)}).save_to_disk("data")
    argv = ["--dataset_name", "data", *DATASET[2:], "--reward_funcs", "exact_match_reward"]
    passes_start_up(workdir, *argv)  # exact_match_reward reads `answer` or `solution`, both with defaults
    message = start(workdir, *argv[:-1], "tests.test_startup_checks.with_defaults")
    assert "needs a `answer` column; the held-out split has: prompt, solution" in message


def test_prompt_as_a_parameter_names_trls_plural():
    def reads_prompt(prompt, completions, **kwargs):
        return [0.0]

    with pytest.raises(SystemExit, match="takes `prompt`, which TRL never passes.*rename the parameter to `prompts`"):
        check_reward_funcs(["mine.reads_prompt"], [reads_prompt], ["prompt", "answer"])


# -- names the project's packages hide ----------------------------------------------------------------------------
def test_a_users_rewards_py_is_named_as_shadowed(workdir):
    (workdir / "rewards.py").write_text("def my_reward(completions, **kwargs):\n    return [1.0] * len(completions)\n")
    message = start(workdir, *DATASET, "--reward_funcs", "rewards.my_reward")
    assert "`rewards` is this project's own package, which hides your rewards.py in the working directory" in message
    assert "rename your file, e.g. to my_rewards.py, and pass my_rewards.my_reward" in message
    assert "has no attribute" not in message


def test_a_users_envs_py_is_named_as_shadowed(workdir):
    (workdir / "envs.py").write_text("class MyEnv:\n    def reset(self, task):\n        return ''\n")
    message = start(workdir, "--environment", "envs:MyEnv", *QUIET)  # found while parsing, before load_sources
    assert "hides your envs.py" in message and "pass my_envs:MyEnv" in message


def test_a_users_rewards_folder_is_named_as_shadowed(workdir):
    (workdir / "rewards").mkdir()
    (workdir / "rewards" / "mine.py").write_text("def f(completions, **kwargs):\n    return [1.0]\n")
    message = start(workdir, *DATASET, "--reward_funcs", "rewards.mine.f")  # an ImportError, not a missing name
    assert "hides your rewards/ in the working directory" in message and "rename your folder" in message


def test_without_a_shadowed_file_the_message_is_the_plain_one(workdir, monkeypatch):
    message = start(workdir, *DATASET, "--reward_funcs", "rewards.my_reward")
    assert "module 'rewards' has no attribute 'my_reward'" in message
    monkeypatch.chdir(REPO)  # the project's own rewards/ is the package itself, not a user's folder
    assert "has no attribute 'my_reward'" in start(workdir, *DATASET[:1], str(workdir / "arith.jsonl"),
                                                   *DATASET[2:], "--reward_funcs", "rewards.my_reward")  # fmt: skip


def test_the_project_packages_are_those_pyproject_installs():
    setup = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    installed = {p for p in setup["packages"] if "." not in p} | set(setup["py-modules"])
    assert set(PROJECT_PACKAGES) == installed
