"""The OpenEnv adapter (`envs/adapters/openenv.py`, `environment: openenv:<module:Class>`) on a real OpenEnv
Environment, `examples.openenv_textarena:TextArenaEnvironment` (TextArena's GuessTheNumber behind OpenEnv's models),
in-process and behind OpenEnv's own server on 127.0.0.1 (`serve: true`): a bisection player that reads only the hint
words wins; both transports give the same episodes; eight threads at once give what sequential play gives; a
malformed action is an error observation in both; the server stops; a budget cut inside `trainers.agent_loop.play`;
the start-up errors (not an Environment, serve without concurrent sessions, bad environment_kwargs, package missing);
the tiny default's expert, its key (transport settings are not part of the build) and demonstrations.

Expected values: GuessTheNumber-v0 draws from 1-20 (its prompt says so), so bisection needs at most
ceil(log2(21)) = 5 guesses; the secret of a seed is read from `textarena.make('GuessTheNumber-v0-raw')`.
"""

from __future__ import annotations

import json
import random
import socket
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from envs.adapters import adapter_class
from envs.sources import load_environment
from envs.tiny import TinySpec, build_tokenizer, check_expert, demonstrations
from tests.guess_the_number import bisect_play, package_secret
from trainers.agent_loop import LoopSettings, play

SPEC = "openenv:examples.openenv_textarena:TextArenaEnvironment"
INVALID_FORMAT = "You attempted an invalid move. Reason: Invalid move format."  # TextArena's SinglePlayerState text

SERIAL_MODULE = '''
from openenv.core.env_server.interfaces import Environment

from examples.openenv_textarena import GameAction, GameObservation, GameState


class SerialEnvironment(Environment[GameAction, GameObservation, GameState]):
    """An Environment that does not declare SUPPORTS_CONCURRENT_SESSIONS (OpenEnv's default: False)."""

    def reset(self, seed=None, episode_id=None, **kwargs):
        return GameObservation(text="say done")

    def step(self, action, timeout_s=None, **kwargs):
        won = action.message == "done"
        return GameObservation(text="ok", done=won, reward=float(won), success=won)

    @property
    def state(self):
        return GameState()
'''


@pytest.fixture(scope="module")
def local():
    return adapter_class(SPEC, {})


@pytest.fixture(scope="module")
def served():
    cls = adapter_class(SPEC, {"serve": True})
    yield cls
    cls.stop_server()


@pytest.fixture(scope="module")
def tasks(local):
    return local.make_tasks("train", 8, seed=0)


def bisect_episode(cls, task: dict) -> tuple[str, list[int], list[tuple]]:
    """A fresh episode of `cls` on `task`, played by bisection on the hints: (first observation, guesses, results)."""
    env = cls()
    first = env.reset(task)
    return (first, *bisect_play(env, first))


def test_in_process_bisection_wins_within_five_guesses(local, tasks):
    for task in tasks[:4]:
        first, guesses, results = bisect_episode(local, task)
        assert "between 1 and 20" in first
        assert len(guesses) <= 5 and guesses[-1] == package_secret(task["seed"])  # ceil(log2(21)) = 5
        observation, reward, done, info = results[-1]
        assert (reward, done, info["success"]) == (1.0, True, True)
        assert all(r[1:3] == (0.0, False) and not r[3]["success"] for r in results[:-1])
        assert "Congratulations" in observation


def test_served_episodes_are_the_in_process_ones(local, served, tasks):
    for task in tasks[:3]:
        assert bisect_episode(served, task) == bisect_episode(local, task)
    assert served._server is not None and served._server.url.startswith("http://127.0.0.1:")  # a real server


def test_in_process_play_leaves_global_random_alone(local, tasks):
    random.seed(99)
    before = random.getstate()
    bisect_episode(local, tasks[0])
    assert random.getstate() == before


@pytest.mark.parametrize("mode", ["in-process", "served"])
def test_eight_threads_play_what_sequential_play_gives(mode, local, served, tasks):
    cls = local if mode == "in-process" else served
    sequential = [bisect_episode(cls, t) for t in tasks]
    with ThreadPoolExecutor(max_workers=8) as pool:
        concurrent = list(pool.map(lambda t: bisect_episode(cls, t), tasks))
    assert concurrent == sequential
    assert all(results[-1][3]["success"] for _, _, results in concurrent)


def test_an_action_of_the_wrong_type_is_an_error_observation_in_process(local, tasks):
    env = local()
    env.reset(tasks[0])
    observation, reward, done, info = env.step('{"message": 5}')  # GameAction.message is a string
    assert observation.startswith("error:") and "message" in observation
    assert (reward, done, info["success"], info["invalid"]) == (0.0, False, False, True)
    observation, _, done, _ = env.step("no brackets")  # the game's own refusal comes back as an observation
    assert observation.startswith(INVALID_FORMAT) and not done
    _, reward, done, info = env.step(f"[{package_secret(tasks[0]['seed'])}]")  # the episode went on
    assert (reward, done, info["success"]) == (1.0, True, True)


def test_an_action_of_the_wrong_type_is_a_server_error_observation_when_served(served, tasks):
    env = served()
    env.reset(tasks[0])
    observation, reward, done, info = env.step('{"message": 5}')
    assert observation.startswith("error:") and "Server error" in observation
    assert (reward, done, info["success"], info["invalid"]) == (0.0, False, False, True)
    _, reward, done, info = env.step(f"[{package_secret(tasks[0]['seed'])}]")  # the session went on
    assert (reward, done, info["success"]) == (1.0, True, True)


def test_stop_server_closes_the_port(tasks):
    cls = adapter_class(SPEC, {"serve": True, "max_sessions": 4})  # its own class, so its own server
    try:
        first, guesses, results = bisect_episode(cls, tasks[1])
        assert results[-1][3]["success"]
        port = int(cls._server.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # accepting while it runs
    finally:
        cls.stop_server()
    assert cls._server is None
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
    assert bisect_episode(cls, tasks[1]) == (first, guesses, results)  # a later episode starts a new server
    cls.stop_server()


def test_an_episode_that_never_ends_is_cut_by_the_turn_budget(tasks):
    cls = adapter_class(SPEC, {"turn_budget": 2})
    task = next(t for t in tasks if package_secret(t["seed"]) != 1)  # "[1]" must not win
    action = "[1]"  # a valid guess, then a repeat (the game's first invalid move): not over in two turns
    tokenizer = build_tokenizer(["user assistant system", action, "The target number is higher."] * 20, 300)
    ids = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    def generate(contexts, max_new_tokens):
        return [(list(ids), [-0.1] * len(ids)) for _ in contexts]

    settings = LoopSettings(max_turn_tokens=64, max_completion_length=4000)
    (rollout,) = play(generate, tokenizer, [cls()], [task], settings=settings)
    assert rollout.truncated and not rollout.success
    assert [t["action"] for t in rollout.transcript] == [action, action]
    assert rollout.transcript[0]["observation"] == "The target number is higher."


def test_abandoned_and_first_observation_sessions_are_released(tasks):
    """A run's dataset rows (first_observation) and episodes the agent loop cuts never step to the end: each one's
    server session must still close, or a run exhausts the server's sessions (its capacity, here 4)."""
    cls = adapter_class(SPEC, {"serve": True, "max_sessions": 4})
    try:
        for task in tasks:  # 8 prompts through a server of 4 sessions
            assert cls().first_observation(task).startswith("You are Player 0")
        for task in tasks:  # 8 episodes reset, stepped once and dropped
            env = cls()
            env.reset(task)
            env.step("[1]")
            del env
        deadline = time.monotonic() + 10
        while cls._server.env_server.active_sessions and time.monotonic() < deadline:
            time.sleep(0.05)  # a dropped episode's socket closes on the client loop, a moment later
        assert cls._server.env_server.active_sessions == 0
        assert bisect_episode(cls, tasks[0])[2][-1][3]["success"]  # and the server still plays
    finally:
        cls.stop_server()


def test_a_class_that_is_not_an_environment_is_refused():
    with pytest.raises(SystemExit) as e:
        load_environment("openenv:envs.shop:ShopEnv")
    assert "environment" in str(e.value) and "envs.shop:ShopEnv" in str(e.value)
    assert "not an OpenEnv Environment" in str(e.value)
    with pytest.raises(SystemExit) as e:
        load_environment("openenv:no_such_module_here:Thing")
    assert "environment" in str(e.value) and "no_such_module_here" in str(e.value)


def test_serve_needs_concurrent_sessions(tmp_path, monkeypatch):
    (tmp_path / "serial_openenv_env.py").write_text(textwrap.dedent(SERIAL_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = "openenv:serial_openenv_env:SerialEnvironment"
    with pytest.raises(SystemExit) as e:
        load_environment(spec, {"serve": True})
    assert "SUPPORTS_CONCURRENT_SESSIONS" in str(e.value) and "serial_openenv_env:SerialEnvironment" in str(e.value)
    env = load_environment(spec).factory({})  # in-process it runs
    assert env.reset({"seed": 0}) == "say done"
    assert env.step("done")[1:3] == (1.0, True)


def test_bad_environment_kwargs_name_the_field_and_the_key():
    with pytest.raises(SystemExit) as e:
        load_environment(SPEC, {"no_such_setting": 1})
    assert "environment_kwargs" in str(e.value) and "no_such_setting" in str(e.value)
    with pytest.raises(SystemExit) as e:
        load_environment(SPEC, {"action_field": "move"})  # GameAction's field is `message`
    assert "environment_kwargs" in str(e.value) and "move" in str(e.value)


def test_the_environments_expert_passes_the_tiny_default_check(local):
    check_expert(local, f"tiny:{SPEC}", 0, n=5)


def test_transport_settings_are_not_part_of_the_tiny_build():
    name = f"tiny:{SPEC}"
    plain = TinySpec.parse(name)
    assert TinySpec.parse(name, env_kwargs=json.dumps({"serve": True})).key() == plain.key()
    assert TinySpec.parse(name, env_kwargs=json.dumps({"serve": True, "max_sessions": 8})).key() == plain.key()
    assert TinySpec.parse(name, env_kwargs=json.dumps({"turn_budget": 4})).key() != plain.key()  # a real setting


def test_demonstrations_are_the_experts_moves_and_replay_to_success(local):
    demos = demonstrations(local, n=4, seed=0, difficulty=0, noise=0.0)
    for demo, task in zip(demos, local.make_tasks("train", 4, seed=0), strict=True):
        first, guesses, results = bisect_episode(local, task)  # the bisection of this file, on the same task
        assert demo[0] == {"role": "user", "content": first}
        assert [m["content"] for m in demo[1::2]] == [f"[{g}]" for g in guesses]
        assert [m["content"] for m in demo[2::2]] == [r[0] for r in results[:-1]]
        env = local()
        env.reset(task)
        for message in demo[1::2]:
            _, _, done, info = env.step(message["content"])
        assert done and info["success"]
