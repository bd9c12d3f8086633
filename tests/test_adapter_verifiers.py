"""The verifiers adapter (`envs/adapters/verifiers.py`, `environment: verifiers:<module>`) against the real verifiers
0.4 package: every episode is verifiers' own `Env.run_episode` through the adapter's in-process harness and loopback
endpoint. Covered: a round trip on the shipped example (`examples/verifiers_siblings.py`: the `attempts` retry env and
its `correct` reward), the task splits, a multi-turn episode with a `vf.Toolset` MCP server (a taskset written under
tmp_path), malformed and empty actions, verifiers' own turn limit (directly and inside `trainers.agent_loop.play`),
abandoned episodes and concurrent ones, the start-up errors, and the tiny default's expert, demonstrations and
`first_observation`.

Expected values are derived without the adapter: questions and answers are read from data/siblings.jsonl (the
example's task `siblings-<i>` is row i of the file); the example scores the LAST integer of the reply (its
`final_number`: regex `-?\\d+`, the last match) against the row's answer, and says "Wrong. Try again." after a wrong
answer while attempts remain; the tool taskset's prices are the test's own table, and verifiers advertises a toolset's
tool as `<TOOL_PREFIX>_<method>` with the method's docstring as its description.
"""

from __future__ import annotations

import json
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from envs.adapters import adapter_class
from envs.adapters.verifiers import _Runner
from envs.tiny import build_tokenizer, check_expert, demonstrations
from trainers.agent_loop import LoopSettings, play

MODULE = "examples.verifiers_siblings"
SPEC = f"verifiers:{MODULE}"
SETTINGS = {"env": {"attempts": 2}, "expert": "{answer}"}
DATA = Path(__file__).resolve().parents[1] / "data" / "siblings.jsonl"
ROWS = [json.loads(line) for line in DATA.open() if line.strip()]
WRONG = "Wrong. Try again."  # the example env's reply to a wrong answer while attempts remain


def row(task: dict) -> dict:
    """The file row of a task: the example names row i `siblings-<i>`."""
    prefix, _, index = task["id"].rpartition("-")
    assert prefix == "siblings"
    return ROWS[int(index)]


def wrong_number(task: dict) -> str:
    return str(int(row(task)["answer"]) + 1)


def episodes() -> dict:
    return _Runner.get().endpoint.episodes


@pytest.fixture(scope="module")
def siblings():
    return adapter_class(SPEC, SETTINGS)


@pytest.fixture(scope="module")
def tasks(siblings):
    return siblings.make_tasks("train", 8, seed=0)


# 1. round trip ---------------------------------------------------------------------------------------------------
def test_reset_shows_the_file_question_and_the_right_answer_scores_one(siblings, tasks):
    for task in tasks[:3]:
        env = siblings()
        assert env.reset(task) == row(task)["question"]
        assert env.tools is None  # the example has no toolset
        observation, reward, done, info = env.step(row(task)["answer"])
        assert (observation, reward, done) == ("", 1.0, True)
        assert info["success"] is True and info["rewards"] == {"correct": 1.0}
        with pytest.raises(RuntimeError):
            env.step(row(task)["answer"])  # the episode is over


def test_a_wrong_answer_is_told_so_and_a_right_second_answer_scores_one(siblings, tasks):
    env = siblings()
    env.reset(tasks[0])
    observation, reward, done, info = env.step(wrong_number(tasks[0]))
    assert (observation, reward, done, info["success"]) == (WRONG, 0.0, False, False)
    assert env.observation_role == "user"
    observation, reward, done, info = env.step(f"Sorry, it is {row(tasks[0])['answer']}.")
    assert (reward, done, info["success"], info["rewards"]) == (1.0, True, True, {"correct": 1.0})


def test_two_wrong_answers_end_the_episode_with_reward_zero(siblings, tasks):
    env = siblings()
    env.reset(tasks[1])
    assert env.step(wrong_number(tasks[1]))[:3] == (WRONG, 0.0, False)
    observation, reward, done, info = env.step(wrong_number(tasks[1]))
    assert (reward, done, info["success"], info["rewards"]) == (0.0, True, False, {"correct": 0.0})


def test_with_one_attempt_a_single_wrong_answer_ends_it():
    cls = adapter_class(SPEC, {"env": {"attempts": 1}})
    task = cls.make_tasks("train", 1, seed=0)[0]
    env = cls()
    env.reset(task)
    observation, reward, done, info = env.step(wrong_number(task))
    assert (reward, done, info["success"]) == (0.0, True, False)


def test_the_last_number_of_the_answer_counts(tasks):
    cls = adapter_class(SPEC, {"env": {"attempts": 1}})
    task = tasks[2]
    right, wrong = row(task)["answer"], wrong_number(task)
    env = cls()
    env.reset(task)
    _, reward, done, info = env.step(f"I think {wrong}, no {right}")  # final_number: the last match, `right`
    assert (reward, done, info["success"]) == (1.0, True, True)
    env = cls()
    env.reset(task)
    _, reward, done, info = env.step(f"I think {right}, no {wrong}")  # the last match is `wrong`
    assert (reward, done, info["success"]) == (0.0, True, False)


# 2. tasks --------------------------------------------------------------------------------------------------------
def test_train_and_eval_are_disjoint_and_cover_every_row(siblings):
    train = siblings.make_tasks("train", 10**6)
    evals = siblings.make_tasks("eval", 10**6)
    train_ids, eval_ids = {t["id"] for t in train}, {t["id"] for t in evals}
    assert len(train_ids) == len(train) and len(eval_ids) == len(evals)
    assert not train_ids & eval_ids
    assert train_ids | eval_ids == {f"siblings-{i}" for i in range(len(ROWS))}
    assert len(ROWS) == 2000  # counted in data/siblings.jsonl
    for task in train + evals:
        assert (task["prompt"], task["answer"]) == (row(task)["question"], row(task)["answer"])
    assert 0 < len(evals) < len(train)  # about a fifth are eval tasks (split_of's eval_fraction 0.2)


def test_n_caps_the_tasks_and_difficulty_one_is_refused(siblings):
    assert len(siblings.make_tasks("train", 5)) == 5
    assert siblings.make_tasks("train", 5) == siblings.make_tasks("train", 10**6)[:5]
    assert len(siblings.make_tasks("eval", 3)) == 3
    with pytest.raises(ValueError):
        siblings.make_tasks("train", 5, difficulty=1)
    with pytest.raises(ValueError):
        siblings.make_tasks("test", 5)


# 3. tools --------------------------------------------------------------------------------------------------------
TOOLS_PY = '''
import verifiers.v1 as vf

PRICES = {"fig": 7, "kiwi": 4}


class MarketState(vf.State):
    lookups: list[str] = []


class MarketToolset(vf.Toolset[vf.ToolsetConfig, MarketState]):
    TOOL_PREFIX = "market"

    @vf.tool
    def price(self, item: str) -> str:
        """Return the price of an item in dollars."""
        self.state.lookups = [*self.state.lookups, item]
        return str(PRICES[item]) if item in PRICES else f"unknown item {item!r}"


if __name__ == "__main__":
    MarketToolset.run()
'''

TASKSET_PY = """
import verifiers.v1 as vf
from vfa_test_market.tools import PRICES, MarketState, MarketToolset


class MarketData(vf.TaskData):
    item: str
    qty: int


class MarketTaskConfig(vf.TaskConfig):
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class MarketTask(vf.Task[MarketData, MarketState, MarketTaskConfig]):
    @classmethod
    def toolsets(cls, config):
        return [MarketToolset(config.tools)]

    @vf.reward
    async def correct(self, trace: vf.Trace) -> float:
        want = str(PRICES[self.data.item] * self.data.qty)
        return float(vf.extract_boxed_answer(trace.last_reply).strip() == want)

    @vf.metric
    async def looked_up_item(self, trace: vf.Trace) -> float:
        return float(self.data.item in trace.state.lookups)


class MarketConfig(vf.TasksetConfig):
    task: MarketTaskConfig = MarketTaskConfig()


class MarketTaskset(vf.Taskset[MarketTask, MarketConfig]):
    def load(self):
        for i in range(8):
            item, qty = ("fig", "kiwi")[i % 2], i + 2
            data = MarketData(id=f"market-{i}", item=item, qty=qty, system_prompt="Use the tools.",
                              prompt=f"How much do {qty} {item}s cost? Answer in \\\\boxed{{}}.")
            yield MarketTask(data, self.config.task)


__all__ = ["MarketTaskset"]
"""

PRICES = {"fig": 7, "kiwi": 4}  # the table written into the tool server above


def tool_call(name: str, arguments: dict) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_a_toolset_episode_advertises_calls_and_scores_the_tools(tmp_path, monkeypatch):
    package = tmp_path / "vfa_test_market"
    package.mkdir()
    (package / "tools.py").write_text(textwrap.dedent(TOOLS_PY))
    (package / "__init__.py").write_text(textwrap.dedent(TASKSET_PY))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # verifiers starts the tool server as `python -m` in a child
    cls = adapter_class("verifiers:vfa_test_market", {})
    task = cls.make_tasks("train", 1)[0]
    question = f"How much do {task['qty']} {task['item']}s cost? Answer in \\boxed{{}}."
    expected_first = [{"role": "system", "content": "Use the tools."}, {"role": "user", "content": question}]

    env = cls()
    assert env.first_observation(task) == expected_first  # no episode, no tool server
    assert env.reset(task) == expected_first  # a system prompt: the observation is the conversation
    (schema,) = env.tools
    assert schema["type"] == "function"
    assert schema["function"]["name"] == "market_price"  # TOOL_PREFIX "market" + method "price"
    assert schema["function"]["description"] == "Return the price of an item in dollars."
    assert schema["function"]["parameters"]["properties"]["item"]["type"] == "string"
    assert schema["function"]["parameters"]["required"] == ["item"]

    observation, reward, done, info = env.step("Looking up. " + tool_call("market_price", {"item": task["item"]}))
    assert (observation, reward, done) == (str(PRICES[task["item"]]), 0.0, False)
    assert env.observation_role == "tool"
    observation, reward, done, _ = env.step(tool_call("market_price", {"item": "fig"}) + tool_call(
        "market_price", {"item": "kiwi"}))  # fmt: skip
    assert (observation, reward, done) == ("7\n\n4", 0.0, False)  # two calls, both results, in order
    assert env.observation_role == "tool"
    observation, reward, done, _ = env.step(tool_call("no_such_tool", {}))
    assert "no_such_tool" in observation and (reward, done) == (0.0, False)  # an error the agent can read
    assert env.observation_role == "tool"

    answer = PRICES[task["item"]] * task["qty"]
    observation, reward, done, info = env.step(f"That is \\boxed{{{answer}}}.")
    assert (reward, done, info["success"]) == (1.0, True, True)
    assert info["rewards"] == {"correct": 1.0}
    assert info["metrics"]["looked_up_item"] == 1.0  # the tool server's state reached verifiers' trace


# 4. malformed and empty actions ----------------------------------------------------------------------------------
def test_a_tool_call_with_invalid_json_stays_plain_text(siblings, tasks):
    task = tasks[3]
    env = siblings()
    env.reset(task)
    bad = '<tool_call>{"name": "answer", "arguments": {"value": %s}</tool_call>'  # one closing brace short
    observation, reward, done, info = env.step(bad % wrong_number(task))
    assert (observation, reward, done, info["success"]) == (WRONG, 0.0, False, False)
    # plain text reaches the env whole: the right number inside the broken call is read as the answer
    observation, reward, done, info = env.step(bad % row(task)["answer"])
    assert (reward, done, info["success"]) == (1.0, True, True)


def test_an_empty_action_scores_zero():
    cls = adapter_class(SPEC, {"env": {"attempts": 1}})
    env = cls()
    env.reset(cls.make_tasks("train", 1)[0])
    observation, reward, done, info = env.step("")
    assert (reward, done, info["success"], info["rewards"]) == (0.0, True, False, {"correct": 0.0})
    assert not info.get("env_error")


# 5. turn budget --------------------------------------------------------------------------------------------------
BUDGET = {"env": {"attempts": 5}, "turn_budget": 2}


def test_verifiers_max_turns_ends_the_episode_after_the_budget(tasks):
    cls = adapter_class(SPEC, BUDGET)
    env = cls()
    env.reset(tasks[4])
    assert env.step(wrong_number(tasks[4]))[:3] == (WRONG, 0.0, False)
    observation, reward, done, info = env.step(wrong_number(tasks[4]))
    assert (reward, done, info["success"], info["stop_condition"]) == (0.0, True, False, "max_turns")


def test_play_with_an_always_wrong_agent_stops_at_the_turn_budget(tasks):
    cls = adapter_class(SPEC, BUDGET)
    task = tasks[5]
    action = f"The answer is {wrong_number(task)}"
    corpus = ["user assistant system The answer is", action, WRONG, row(task)["question"]] * 20
    tokenizer = build_tokenizer(corpus, 300)
    ids = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(contexts, max_new_tokens):
        return [(list(ids), [-0.1] * len(ids)) for _ in contexts]

    settings = LoopSettings(max_turn_tokens=64, max_completion_length=4000)  # turns: the environment's own
    (rollout,) = play(generate, tokenizer, [cls()], [task], settings=settings)
    assert rollout.prompt_messages == [{"role": "user", "content": row(task)["question"]}]
    assert [t["action"] for t in rollout.transcript] == [action, action]
    assert rollout.transcript[0]["observation"] == WRONG
    assert rollout.done and not rollout.truncated and not rollout.success  # verifiers ended it, not a budget cut
    assert rollout.turn_rewards == [0.0, 0.0]
    assert rollout.final_info["stop_condition"] == "max_turns"


# 6. abandoning and concurrency -----------------------------------------------------------------------------------
def test_a_second_reset_abandons_the_first_episode_and_the_new_one_works(siblings, tasks):
    env = siblings()
    env.reset(tasks[0])
    first = env.key
    assert first in episodes()
    assert env.reset(tasks[1]) == row(tasks[1])["question"]
    assert first not in episodes() and env.key in episodes()
    second = env.key
    _, reward, done, info = env.step(row(tasks[1])["answer"])
    assert (reward, done, info["success"]) == (1.0, True, True), info
    assert second not in episodes()


def test_close_mid_episode_unregisters_it_and_the_env_plays_again(siblings, tasks):
    env = siblings()
    env.reset(tasks[2])
    key = env.key
    env.close()
    assert key not in episodes()
    assert env.reset(tasks[4]) == row(tasks[4])["question"]  # the closed instance starts a fresh episode
    assert key not in episodes()
    _, reward, done, info = env.step(row(tasks[4])["answer"])
    assert (reward, done, info["success"]) == (1.0, True, True), info
    other = siblings()  # and other instances are not disturbed
    other.reset(tasks[3])
    assert other.step(row(tasks[3])["answer"])[1:3] == (1.0, True)


def test_eight_concurrent_episodes_each_score_their_own_task(siblings, tasks):
    def episode(i: int):
        task = tasks[i]
        env = siblings()
        first = env.reset(task)
        retry = env.step(wrong_number(task))[:3]
        last = row(task)["answer"] if i % 2 == 0 else wrong_number(task)  # even threads right, odd ones wrong
        _, reward, done, info = env.step(last)
        return first, retry, (reward, done, info["success"]), env.key

    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(episode, range(8)))
    for i, (first, retry, end, key) in enumerate(results):
        assert first == row(tasks[i])["question"]
        assert retry == (WRONG, 0.0, False)
        assert end == ((1.0, True, True) if i % 2 == 0 else (0.0, True, False))
        assert key not in episodes()
    assert len({r[3] for r in results}) == 8  # one endpoint key per episode


# 7. start-up errors ----------------------------------------------------------------------------------------------
def test_a_missing_module_names_the_field_and_the_module():
    with pytest.raises(SystemExit) as e:
        adapter_class("verifiers:no_such_vf_module_xyz", {})
    assert "environment" in str(e.value) and "no_such_vf_module_xyz" in str(e.value)


def test_a_module_that_is_not_a_taskset_stops():
    with pytest.raises(SystemExit) as e:
        adapter_class("verifiers:json", {})
    assert "json" in str(e.value)


def test_an_unknown_environment_kwargs_key_names_the_field_and_key():
    with pytest.raises(SystemExit) as e:
        adapter_class(SPEC, {"attemptz": 2})
    assert "environment_kwargs" in str(e.value) and "attemptz" in str(e.value)


def test_an_env_config_field_of_the_wrong_type_stops():
    with pytest.raises(SystemExit) as e:
        adapter_class(SPEC, {"env": {"attempts": "many"}})
    assert "attempts" in str(e.value)


# 8. tiny default -------------------------------------------------------------------------------------------------
def test_the_expert_passes_the_tiny_check_and_no_expert_stops(siblings):
    check_expert(siblings, f"tiny:{SPEC}", 0)  # returns without SystemExit
    with pytest.raises(SystemExit) as e:
        check_expert(adapter_class(SPEC, {"env": {"attempts": 2}}), f"tiny:{SPEC}", 0, n=2)
    assert "expert" in str(e.value)


def test_demonstrations_answer_with_the_rows_answers(siblings):
    demos = demonstrations(siblings, 3, seed=0, difficulty=0, noise=0.0)
    train = siblings.make_tasks("train", 3, seed=0)
    assert len(demos) == 3
    for demo, task in zip(demos, train, strict=True):
        assert demo == [{"role": "user", "content": row(task)["question"]},
                        {"role": "assistant", "content": row(task)["answer"]}]  # fmt: skip


def test_first_observation_is_the_reset_observation_without_an_episode(siblings, tasks):
    env = siblings()
    before = set(episodes())
    observation = env.first_observation(tasks[6])
    assert set(episodes()) == before
    assert observation == row(tasks[6])["question"]
    assert env.reset(tasks[6]) == observation
    env.close()
