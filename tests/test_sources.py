"""Where tasks, environments and rewards come from (envs/sources.py, rewards/loading.py): built-in names, import
paths (Env subclasses, duck-typed classes, TRL-style tool classes), local datasets, and the errors for each mistake."""

from __future__ import annotations

import json
import textwrap

import pytest
from datasets import Dataset, DatasetDict

from envs.base import ProtocolEnv, ToolEnv
from envs.shop import ShopEnv
from envs.sources import check_environment, load_environment, load_splits
from rewards.loading import REWARD_NAMES, load_reward_funcs
from rewards.verifiers import exact_match_reward, final_answer

USER_ENVS = '''
import random

from envs.base import Env


class CountEnv(Env):
    """Say the next number: reward 1 per right number, done after `length` turns."""

    def __init__(self, length=2, difficulty=0):
        super().__init__(difficulty)
        self.length = length

    @classmethod
    def make_tasks(cls, split, n, seed=0, difficulty=0):
        return [{"task_id": f"{split}-{i}", "start": 10 * i + (split == "eval")} for i in range(n)]

    def reset(self, task):
        self.next, self.k = task["start"] + 1, 0
        return f"count from {task['start']}"

    def step(self, action):
        hit = action.strip() == str(self.next)
        self.next, self.k = self.next + 1, self.k + 1
        return "next", float(hit), self.k == self.length, {"success": hit}


class NoGenerator(Env):
    def reset(self, task):
        return "hi"

    def step(self, action):
        return "", 0.0, True, {"success": False}


class Guess:
    """No base class: reset/step by duck typing, with its own attributes."""

    max_turns = 3
    observation_role = "user"

    def __init__(self, secret=7):
        self.secret = secret

    def reset(self, task):
        self.turns = 0
        return "guess a number"

    def step(self, action):
        self.turns += 1
        right = action.strip() == str(self.secret)
        return ("right" if right else "wrong"), float(right), right, {"success": right}

    def state_key(self):
        return f"turns={self.turns}"


class BadStep:
    def reset(self, task):
        return "hi"

    def step(self, action):
        return "obs", 1.0, "yes"


class BadTypes:
    def reset(self, task):
        return "hi"

    def step(self, action):
        return "obs", "1", "no", {}


class Counter:
    """A TRL-style tool class: reset(**row) plus public tool methods, get_reward()."""

    def __init__(self, start=0):
        self.start = start

    def reset(self, **row):
        self.value = self.start
        return f" target {row.get('target', 0)}"

    def add(self, n: int) -> str:
        """Add to the counter.

        Args:
            n: How much to add.
        """
        self.value += n
        return str(self.value)

    def get_reward(self) -> float:
        return float(self.value == 3)


def not_a_class():
    return None


def exact(completions, answer, **kwargs):
    return [float(c.strip() == a) for c, a in zip(completions, answer)]
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch, request):
    """A module of user classes in the working directory, importable by path as a user's own code would be."""
    name = f"user_envs_{request.node.name.replace('[', '_').replace(']', '_').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(USER_ENVS))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_builtin_name_builds_the_class_at_the_difficulty():
    source = load_environment("shop", difficulty=1)
    env = source.factory({})
    assert isinstance(env, ShopEnv) and env.difficulty == 1 and source.builtin
    assert source.make_tasks == ShopEnv.make_tasks


def test_env_subclass_by_import_path_gets_its_kwargs_and_generator(user_module):
    for spec in (f"{user_module}:CountEnv", f"{user_module}.CountEnv"):
        source = load_environment(spec, {"length": 3})
        env = source.factory({})
        assert type(env).__name__ == "CountEnv" and env.length == 3 and not source.builtin
        tasks = source.make_tasks("train", 2, seed=0, difficulty=0)
        assert [t["start"] for t in tasks] == [0, 10]
        assert env.reset(tasks[1]) == "count from 10"
        assert env.step("11") == ("next", 1.0, False, {"success": True})


def test_env_subclass_without_a_generator_has_none(user_module):
    assert load_environment(f"{user_module}:NoGenerator").make_tasks is None


def test_duck_typed_class_runs_through_protocol_env(user_module):
    env = load_environment(f"{user_module}:Guess", {"secret": 4}).factory({})
    assert isinstance(env, ProtocolEnv) and env.max_turns == 3 and env.name == "Guess"
    assert env.reset({}) == "guess a number"
    assert env.step("5") == ("wrong", 0.0, False, {"success": False})
    assert env.state_key() == "turns=1"
    assert env.step("4") == ("right", 1.0, True, {"success": True})


def test_tool_class_runs_through_tool_env_with_kwargs(user_module):
    env = load_environment(f"{user_module}:Counter", {"start": 1}).factory({})
    assert isinstance(env, ToolEnv) and [t["function"]["name"] for t in env.tools] == ["add"]
    assert env.reset({"prompt": "count", "target": 3}) == "count target 3"
    obs, reward, done, info = env.step('<tool_call>{"name": "add", "arguments": {"n": 2}}</tool_call>')
    assert (obs, reward, done, info["success"]) == ("3", 1.0, False, True)  # 1 + 2 = 3: get_reward() went 0 -> 1


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("shoop", "environment 'shoop' is unknown"),
        ("no_such_module_xyz:Env", "cannot import module 'no_such_module_xyz'"),
        ("{mod}:Missing", "has no attribute 'Missing'"),
        ("{mod}:not_a_class", "is a function, not a class"),
        ("{mod}:exact", "is a function, not a class"),
        ("json:JSONDecoder", "neither an envs.base.Env subclass"),
    ],
)
def test_bad_environments_are_named(user_module, spec, needle):
    with pytest.raises(SystemExit, match=needle):
        load_environment(spec.format(mod=user_module))


def test_check_environment_names_a_wrong_step(user_module):
    with pytest.raises(SystemExit, match=r"reward is str, expected a number; done is str, expected bool"):
        check_environment(load_environment(f"{user_module}:BadTypes"), {})
    with pytest.raises(SystemExit, match=r"must return \(observation, reward, done, info\)"):
        check_environment(load_environment(f"{user_module}:BadStep"), {})
    check_environment(load_environment(f"{user_module}:CountEnv"), {"start": 0})  # a good one passes


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_without_test_split_holds_out_a_seeded_slice(tmp_path):
    rows = [{"prompt": f"q{i}", "answer": str(i)} for i in range(50)]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    train, test, where = load_splits(path, num_test=7, seed=3)
    assert (len(train), len(test)) == (43, 7) and "7 rows held out" in where
    assert set(train["prompt"]).isdisjoint(test["prompt"]) and set(train["prompt"]) | set(test["prompt"]) == {
        r["prompt"] for r in rows
    }
    again = load_splits(path, num_test=7, seed=3)[1]
    assert again["prompt"] == test["prompt"]  # the same seed holds out the same rows
    # at most a fifth is held out: 50 rows, num_test 200 -> 10
    assert len(load_splits(path, num_test=200)[1]) == 10


def test_csv_and_saved_dataset_dict_with_test_split(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("prompt,answer\nwhat is 1+1,2\nwhat is 2+2,4\n" + "".join(f"x{i},{i}\n" for i in range(8)))
    train, test, _ = load_splits(str(csv), num_test=2)
    assert len(train) + len(test) == 10 and train.column_names == ["prompt", "answer"]
    saved = tmp_path / "saved"
    DatasetDict(
        {"train": Dataset.from_list([{"prompt": "a"}] * 4), "test": Dataset.from_list([{"prompt": "b"}] * 3)}
    ).save_to_disk(str(saved))
    train, test, where = load_splits(str(saved))
    assert (len(train), len(test), set(test["prompt"]), where) == (4, 3, {"b"}, "split 'test'")


@pytest.mark.parametrize(
    ("name", "kwargs", "needle"),
    [
        ("data.txt", {}, "files ending in .txt cannot be read"),
        ("data.jsonl", {"train_split": "training"}, "dataset_train_split 'training' is not in"),
        ("tiny.jsonl", {}, "too few to hold out"),
        ("no/such/dataset", {}, "not a local file or folder"),
    ],
)
def test_bad_datasets_are_named(tmp_path, monkeypatch, name, kwargs, needle):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    write_jsonl(tmp_path / "data.jsonl", [{"prompt": "p"}] * 10)
    write_jsonl(tmp_path / "tiny.jsonl", [{"prompt": "p"}] * 4)
    (tmp_path / "data.txt").write_text("x")
    path = str(tmp_path / name) if (tmp_path / name).exists() else name
    with pytest.raises(SystemExit, match=needle):
        load_splits(path, **kwargs)


def test_reward_names_and_import_paths(user_module):
    funcs = load_reward_funcs(["exact_match_reward", f"{user_module}.exact", "get_soft_overlong_punishment"], 40)
    assert funcs[0].__wrapped__ is exact_match_reward and funcs[1](["1 ", "2"], answer=["1", "3"]) == [1.0, 0.0]
    # soft overlong punishment over the run's budget: 0 up to 40 - 10 tokens, then linear down to -1 at 40
    assert funcs[2](completion_ids=[[0] * 30, [0] * 35, [0] * 41]) == [0.0, -0.5, -1.0]
    assert set(REWARD_NAMES) >= {"accuracy_reward", "think_format_reward", "exact_match_reward"}
    with pytest.raises(SystemExit, match="reward_funcs entry 'exactmatch' is unknown"):
        load_reward_funcs(["exactmatch"])
    with pytest.raises(SystemExit, match="cannot import module"):
        load_reward_funcs(["nowhere_xyz.reward"])


def test_trl_accuracy_reward_is_usable():
    (accuracy,) = load_reward_funcs(["accuracy_reward"])  # needs math-verify, pinned in requirements.txt
    completions = [[{"role": "assistant", "content": r"The answer is $\frac{1}{2}$"}]] * 2
    assert accuracy(completions, solution=[r"$0.5$", r"$3$"]) == [1.0, 0.0]


def test_final_answer_and_exact_match_by_hand():
    assert final_answer("12 apples, then 3 more. Answer: 15.") == "15"
    assert final_answer("#### 1,024") == "1024"
    assert final_answer("first 3 then 4") == "4"
    assert final_answer("Answer: Paris") == "Paris" and final_answer("nothing") is None
    assert exact_match_reward(["Answer: paris", "Answer: 15.0", "15", "no"], answer=["Paris", "15", "16", "1"]) == [
        1.0,
        1.0,
        0.0,
        0.0,
    ]
    conversational = [[{"role": "assistant", "content": "so 6"}]]
    assert exact_match_reward(conversational, solution=["6"]) == [1.0]
    with pytest.raises(ValueError, match="answer"):
        exact_match_reward(["1"])
