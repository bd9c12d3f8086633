"""`agent_trl.play` against tests/judge_server.py (a real OpenAI-compatible server on loopback, scripted replies): the
expert's actions, scripted, win the episode; the requests carry the chat the agent loop renders (first observation as
the user message, each action as the assistant's, each observation in the environment's role, the tools); an
unreachable server is a clear error. tests/test_serve.py plays against `transformers serve` on a real model."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

from agent_trl.play import action_text, main, play_episode
from envs.shop import ShopEnv
from tests.judge_server import JudgeServer, ok


def expert_episode(task: dict) -> tuple[str, list[tuple[str, str, float]]]:
    """The shop expert's episode on `task`, played on its own environment: (first observation, [(action,
    observation, reward)])."""
    env = ShopEnv(difficulty=0)
    first, steps = env.reset(task), []
    for _ in range(env.max_turns):
        action = env.expert_action()
        observation, reward, done, _ = env.step(action)
        steps.append((action, observation, reward))
        if done:
            return first, steps
    raise AssertionError("the expert did not finish")


def test_scripted_expert_actions_win_and_the_chat_is_the_agents():
    task = ShopEnv.make_tasks("eval", 3, seed=0, difficulty=0)[2]
    first, steps = expert_episode(task)
    with JudgeServer() as server:
        server.script(*[ok(action) for action, _, _ in steps])
        record = play_episode(server.base_url, "shop", task_index=2, max_turn_tokens=24, echo=False)
        bodies = [r.body for r in server.requests]
    assert record["success"] is True and record["truncated"] is False
    assert record["reward"] == sum(reward for _, _, reward in steps) == 1.0
    assert [(t["action"], t["observation"], t["reward"]) for t in record["transcript"]] == steps
    assert record["task"] == task and record["model"] == "judge"  # the server's first listed model
    assert len(bodies) == len(steps)
    for k, body in enumerate(bodies):  # turn k sees the first observation, then k (action, observation) pairs
        expected = [{"role": "user", "content": first}]
        for action, observation, _ in steps[:k]:
            expected += [{"role": "assistant", "content": action}, {"role": "user", "content": observation}]
        assert body["messages"] == expected
        assert body["model"] == "judge" and body["max_tokens"] == 24 and body["temperature"] == 0.0
        assert "tools" not in body


def test_wrong_actions_run_out_of_turns():
    with JudgeServer(default=lambda body: ok("click[nothing]")) as server:
        record = play_episode(server.base_url, "shop", max_turns=3, model="m", echo=False)
    assert record["success"] is False and record["truncated"] is True and record["turns"] == 3
    assert len(server.requests) == 3 and all(t["invalid"] for t in record["transcript"])  # the shop rejects it


class Counter:
    """A TRL-style tool environment: reach `target` by calling `add`."""

    def reset(self, target: int = 3, **kwargs) -> str:
        self.total, self.target = 0, target
        return f" Reach {target}."

    def add(self, n: int) -> str:
        """Add a number to the total.

        Args:
            n: The number to add.
        """
        self.total += n
        return f"total {self.total}"

    def get_reward(self) -> float:
        return float(self.total == self.target)


def test_a_tool_environment_by_import_path_gets_its_tools_and_tool_role():
    call = '<tool_call>\n{"name": "add", "arguments": {"n": 3}}\n</tool_call>'
    with JudgeServer() as server:
        server.script(ok(call), ok("done"))
        task = json.dumps({"prompt": "Count.", "target": 3})
        record = play_episode(server.base_url, "tests.test_play:Counter", task=task, model="m", echo=False)
        bodies = [r.body for r in server.requests]
    assert record["success"] is True and record["reward"] == 1.0 and record["turns"] == 2  # no call: the end
    assert [t["observation"] for t in record["transcript"]] == ["total 3", ""]
    assert bodies[0]["tools"][0]["function"]["name"] == "add"
    assert bodies[1]["messages"] == [
        {"role": "user", "content": "Count. Reach 3."},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": "total 3"},
    ]


def test_tool_calls_parsed_by_the_server_become_text_again():
    function = SimpleNamespace(name="add", arguments='{"n": 2}')
    message = SimpleNamespace(content="", tool_calls=[SimpleNamespace(function=function)])
    assert action_text(message) == '<tool_call>\n{"name": "add", "arguments": {"n": 2}}\n</tool_call>'
    assert action_text(SimpleNamespace(content="buy", tool_calls=None)) == "buy"


def test_an_unreachable_server_is_a_clear_error():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(SystemExit, match=rf"--base_url: the endpoint http://127.0.0.1:{port}/v1 cannot be reached"):
        play_episode(f"http://127.0.0.1:{port}/v1", "shop", echo=False)


def test_an_unknown_environment_is_named():
    with pytest.raises(SystemExit, match="environment 'nope' is unknown"):
        play_episode("http://127.0.0.1:1/v1", "nope", echo=False)


def test_the_cli_prints_turn_by_turn_and_writes_json(tmp_path, capsys):
    task = ShopEnv.make_tasks("eval", 1)[0]
    first, steps = expert_episode(task)
    out = tmp_path / "episode.json"
    with JudgeServer() as server:
        server.script(*[ok(action) for action, _, _ in steps])
        main(["--base_url", server.base_url, "--environment", "shop", "--out", str(out)])
    printed = capsys.readouterr().out
    assert f"[user] {first}" in printed and f"--- turn {len(steps)}" in printed
    assert f"[assistant] {steps[0][0]}\n[user] {steps[0][1]}   (reward 0)" in printed
    assert f"success: True  reward: 1  turns: {len(steps)}  (the environment ended it)" in printed
    written = json.loads(out.read_text())
    assert written["success"] is True and written["split"] == "eval" and written["task_index"] == 0
    assert [t["action"] for t in written["transcript"]] == [a for a, _, _ in steps]
