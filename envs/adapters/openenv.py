"""OpenEnv environments (`openenv-core`) as an environment: `environment: openenv:<module:Class>` or
`openenv:<server URL>`.

* `openenv:package.module:MyEnvironment` runs an `openenv.core.env_server.interfaces.Environment` subclass. By
  default in-process: one instance per episode, its `reset`/`step` called directly. With `serve: true` the adapter
  starts OpenEnv's own server for the class (`HTTPEnvServer` under uvicorn) on 127.0.0.1 at a free port, in this
  process, and every episode talks to it over OpenEnv's WebSocket protocol through OpenEnv's `GenericEnvClient`, as
  a remote environment would be played; the server stops at exit (or `stop_server()`).
* `openenv:ws://host:port` (or `http://`) connects to a server already running; the adapter starts nothing.

An episode is `reset(seed=..., **reset_kwargs, **task)` (a task's keys are the reset's keyword arguments; the
generated tasks are seeds, train and eval told apart by a hash), then one `step(Action)` per turn. The action is
built from the agent's turn: the text goes into the Action's text field (`action_field`, default its only required
string field), or, when the turn is a JSON object, that object is the action. An action the Action model refuses,
and an environment that raises, give an error observation (the episode goes on); a lost connection or a step past
`step_timeout` ends the episode with an error. The observation text is the Observation's `observation_field` (default
`text`, else its first string field, else its fields as JSON); the reward is the observation's; success is the
observation's `success` field where it has one, else a positive final reward.

`environment_kwargs`: `serve`, `action_field`, `observation_field`, `reset_kwargs` (a mapping sent with every reset),
`env_kwargs` (the class's constructor arguments), `turn_budget` (default 32), `max_sessions` (the server's concurrent
episodes, default 256: more than a run plays at once), `step_timeout` (seconds, default 60).

The tiny default (`tiny:openenv:<module:Class>`) learns from the class's own expert, when it has one: an
`expert_action()` method (and optionally `noisy_action(rng)`, a plausible mistake) on the environment instance.
Demonstrations are played in-process, so a served run and an in-process run share one build (`serve`,
`max_sessions` and `step_timeout` are not part of what the environment is: `transport_settings`).
"""

from __future__ import annotations

import asyncio
import atexit
import inspect
import json
import random
import socket
import threading
import time
import typing

import uvicorn
from fastapi import FastAPI
from openenv.core.env_server.http_server import HTTPEnvServer
from openenv.core.env_server.interfaces import Environment
from openenv.core.generic_client import GenericEnvClient
from pydantic import ValidationError

from envs.adapters import check_kwargs, seed_tasks
from envs.base import Env
from envs.sources import import_object

SETTINGS = {
    "serve": "run the class behind OpenEnv's own server on loopback (default false: in-process)",
    "action_field": "the Action field the agent's text goes into (default: its only required string field)",
    "observation_field": "the Observation field shown to the agent (default: text, else the first string field)",
    "reset_kwargs": "keyword arguments sent with every reset",
    "env_kwargs": "constructor arguments of the Environment class",
    "turn_budget": "most turns per episode (default 32)",
    "max_sessions": "concurrent episodes the server accepts (default 256)",
    "step_timeout": "seconds a step may take before the episode ends (default 60)",
}


def action_and_observation(env_cls: type) -> tuple[type, type]:
    """The Action and Observation classes of an Environment subclass: its generic arguments
    (`Environment[MyAction, MyObservation, MyState]`), else the annotations of its `step`."""
    for base in getattr(env_cls, "__orig_bases__", ()):
        args = typing.get_args(base)
        if len(args) >= 2 and all(inspect.isclass(a) for a in args[:2]):
            return args[0], args[1]
    hints = typing.get_type_hints(env_cls.step)
    action = hints.get("action")
    observation = hints.get("return")
    if inspect.isclass(action) and inspect.isclass(observation):
        return action, observation
    raise SystemExit(
        f"error: environment openenv:{env_cls.__module__}:{env_cls.__name__}: cannot tell its Action and Observation "
        "classes; declare them as Environment[MyAction, MyObservation, State] or annotate step(self, action: "
        "MyAction) -> MyObservation"
    )


def _string_fields(model: type) -> list[str]:
    return [name for name, f in model.model_fields.items() if f.annotation is str and name != "metadata"]


class _Server:
    """OpenEnv's server for one Environment class on 127.0.0.1, in a daemon thread, plus one event loop thread that
    drives every episode's WebSocket client (clients are async; the agent loop steps from worker threads)."""

    def __init__(self, env_cls: type, env_kwargs: dict, max_sessions: int):
        action_cls, observation_cls = action_and_observation(env_cls)
        app = FastAPI(docs_url=None, redoc_url=None)
        self.env_server = HTTPEnvServer(lambda: env_cls(**env_kwargs), action_cls, observation_cls,
                                        max_concurrent_envs=max_sessions)  # fmt: skip
        self.env_server.register_routes(app)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))  # the kernel's free port, held from here on (no race for it)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        # log_level critical: OpenEnv logs a harmless error each time a client closes its socket
        config = uvicorn.Config(app, log_level="critical", timeout_graceful_shutdown=2, ws_ping_interval=None)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the OpenEnv server for {env_cls.__name__} did not start")
            time.sleep(0.01)
        self.loop = _ClientLoop()

    def stop(self) -> None:
        self.loop.stop()
        self.server.should_exit = True
        self.thread.join(10)
        if self.thread.is_alive():  # open sockets keep a graceful shutdown waiting
            self.server.force_exit = True
            self.thread.join(10)
        self.sock.close()


class _ClientLoop:
    """One asyncio loop in a daemon thread; `run(coroutine, timeout)` from any thread."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine, timeout: float):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(5)


class OpenEnvEnv(Env):
    """One OpenEnv environment; the subclass made by `environment_class` sets the class or URL and the settings."""

    name = "openenv"
    verifier = "openenv"
    env_cls: type | None = None  # in-process or served; None with a URL
    url: str | None = None
    serve: bool = False
    action_field: str = "message"
    observation_field: str | None = None
    reset_kwargs: dict = {}
    env_kwargs: dict = {}
    step_timeout: float = 60.0
    max_sessions: int = 256
    #: settings of how episodes run, not of what they are: left out of the tiny default's key (`envs.tiny`)
    transport_settings = ("serve", "max_sessions", "step_timeout")
    _server: _Server | None = None
    _server_lock = threading.Lock()
    _urls_loop: _ClientLoop | None = None

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        self.env = None  # the in-process Environment instance
        self.client = None  # the episode's GenericEnvClient (served or remote)
        self.done = False

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        return seed_tasks(split, n, seed, cls.name)

    # transport -------------------------------------------------------------------------------------------------
    @classmethod
    def _loop_and_url(cls) -> tuple[_ClientLoop, str]:
        with cls._server_lock:
            if cls.url is not None:
                if cls._urls_loop is None:
                    cls._urls_loop = _ClientLoop()
                return cls._urls_loop, cls.url
            if cls._server is None:
                cls._server = _Server(cls.env_cls, cls.env_kwargs, cls.max_sessions)
                atexit.register(cls.stop_server)
            return cls._server.loop, cls._server.url

    @classmethod
    def stop_server(cls) -> None:
        """Stop the server this class started (and its client loop); a later episode starts a new one."""
        with cls._server_lock:
            if cls._server is not None:
                cls._server.stop()
                cls._server = None
            if cls._urls_loop is not None:
                cls._urls_loop.stop()
                cls._urls_loop = None

    def _remote(self, call):
        loop, _ = self._loop_and_url()
        return loop.run(call, self.step_timeout)

    def _drop_client(self, wait: bool = True) -> None:
        client, self.client = self.client, None
        if client is None:
            return
        loop, _ = self._loop_and_url()
        if not wait:  # e.g. from the garbage collector, which may run on the loop's own thread
            asyncio.run_coroutine_threadsafe(client.close(), loop.loop)
            return
        try:
            loop.run(client.close(), self.step_timeout)
        except Exception:  # the socket is gone already; nothing to close
            pass

    # the protocol ----------------------------------------------------------------------------------------------
    def reset(self, task: dict) -> str:
        self.close()
        self.done = False
        kwargs = {**self.reset_kwargs, **{k: v for k, v in task.items() if k != "task_id"}}
        if self.env_cls is not None and not self.serve:
            self.env = self.env_cls(**self.env_kwargs)
            return self._text(self.env.reset(**kwargs).model_dump())
        _, url = self._loop_and_url()
        self.client = GenericEnvClient(base_url=url, message_timeout_s=self.step_timeout)
        try:
            result = self._remote(self.client.reset(**kwargs))
        except RuntimeError as e:
            if "CAPACITY_REACHED" in str(e):
                raise RuntimeError(
                    f"{self.name}: the server holds {self.max_sessions} episodes at once and more were started; raise "
                    "environment_kwargs max_sessions above the episodes a run plays together (the generation batch, "
                    "eval_batch_size)"
                ) from e
            raise
        return self._text(result.observation)

    def first_observation(self, task: dict) -> str:
        """The first observation of `task`: a reset whose instance or session is closed at once."""
        try:
            return self.reset(task)
        finally:
            self.close()

    def _action(self, text: str) -> dict:
        stripped = text.strip()
        if stripped.startswith("{"):
            try:
                value = json.loads(stripped)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                return value
        return {self.action_field: text}

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done or (self.env is None and self.client is None):
            raise RuntimeError("reset(task) must start an episode before step")
        payload = self._action(action)
        if self.env is not None:
            action_cls, _ = action_and_observation(self.env_cls)
            try:
                observation = self.env.step(action_cls.model_validate(payload))
            except ValidationError as e:
                return self._refused(f"the action does not fit {action_cls.__name__}: {_first_error(e)}")
            except Exception as e:  # as OpenEnv's server does: the environment's error, and the episode goes on
                return self._refused(f"{type(e).__name__}: {e}")
            fields = observation.model_dump()
            return self._finish(fields, observation.reward, observation.done, fields.get("success"))
        try:
            result = self._remote(self.client.step(payload))
        except RuntimeError as e:  # an error frame (VALIDATION_ERROR, EXECUTION_ERROR): the session goes on
            if "Server error" in str(e):
                return self._refused(str(e))
            raise
        except Exception as e:  # timeout, lost connection: the socket cannot be trusted any more
            self._drop_client()
            self.done = True
            return (f"error: the environment server did not answer ({type(e).__name__}: {e})", 0.0, True,
                    {"success": False, "env_error": True})  # fmt: skip
        return self._finish(result.observation, result.reward, result.done, result.observation.get("success"))

    def _refused(self, why: str) -> tuple[str, float, bool, dict]:
        return f"error: {why}", 0.0, False, {"success": False, "invalid": True}

    def _finish(self, fields: dict, reward, done: bool, success) -> tuple[str, float, bool, dict]:
        reward = float(reward or 0.0)
        info = {"success": bool(success) if success is not None else reward > 0, "invalid": False}
        if done:
            self.done = True
            self.close()
        return self._text(fields), reward, bool(done), info

    def _text(self, fields: dict) -> str:
        if self.observation_field is not None:
            return str(fields.get(self.observation_field, ""))
        if isinstance(fields.get("text"), str):
            return fields["text"]
        strings = [k for k, v in fields.items() if isinstance(v, str) and k != "metadata"]
        if strings:
            return fields[strings[0]]
        shown = {k: v for k, v in fields.items() if k not in ("done", "reward", "metadata")}
        return json.dumps(shown, default=str)

    def close(self, wait: bool = True) -> None:
        """End the episode's instance or session (a finished episode closes itself)."""
        if self.env is not None:
            env, self.env = self.env, None
            env.close()
        self._drop_client(wait)

    def __del__(self):  # an episode the agent loop cut (its budget): its server session is released
        try:
            self.close(wait=False)
        except Exception:  # interpreter shutdown
            pass

    # the tiny default's expert: the environment's own, played in-process ------------------------------------
    def _expert_env(self):
        if self.env is None:
            raise NotImplementedError(
                "the expert of an OpenEnv environment runs in-process (an Environment class, not a server URL)"
            )
        if not callable(getattr(self.env, "expert_action", None)):
            raise NotImplementedError(f"{self.env_cls.__name__} has no expert_action() method")
        return self.env

    def expert_action(self) -> str:
        return str(self._expert_env().expert_action())

    def noisy_action(self, rng: random.Random) -> str:
        env = self._expert_env()
        mistake = getattr(env, "noisy_action", None)
        return str(mistake(rng) if callable(mistake) else env.expert_action())


def _first_error(e) -> str:
    first = e.errors()[0] if e.errors() else {}
    where = ".".join(str(x) for x in first.get("loc", ())) or "action"
    return f"{where}: {first.get('msg', str(e))}"


def environment_class(name: str, kwargs: dict) -> type[OpenEnvEnv]:
    """The environment class of `name` (an import path of an Environment subclass, or a server URL)."""
    spec = f"openenv:{name}"
    check_kwargs(spec, kwargs, SETTINGS)
    attrs = {"name": spec, "max_turns": int(kwargs.get("turn_budget", 32))}
    for key in ("serve", "action_field", "observation_field", "reset_kwargs", "env_kwargs"):
        if key in kwargs:
            attrs[key] = kwargs[key]
    attrs["step_timeout"] = float(kwargs.get("step_timeout", 60.0))
    attrs["max_sessions"] = int(kwargs.get("max_sessions", 256))
    if name.startswith(("http://", "https://", "ws://", "wss://")):
        if kwargs.get("serve"):
            raise SystemExit(f"error: environment_kwargs serve: {spec!r} is a server URL; serve starts a class")
        attrs["url"] = name
        return type("OpenEnv_remote", (OpenEnvEnv,), attrs)
    env_cls = import_object(name, "environment openenv:")
    if not (inspect.isclass(env_cls) and issubclass(env_cls, Environment)):
        raise SystemExit(
            f"error: environment {spec!r} is not an OpenEnv Environment subclass (openenv.core.env_server."
            "interfaces.Environment) nor a server URL"
        )
    action_cls, _ = action_and_observation(env_cls)
    if "action_field" not in kwargs:
        required = [f for f in _string_fields(action_cls) if action_cls.model_fields[f].is_required()]
        if len(required) != 1:
            raise SystemExit(
                f"error: environment {spec!r}: {action_cls.__name__} has {len(required)} required text fields "
                f"({required}); name the one the agent's text goes into with environment_kwargs action_field"
            )
        attrs["action_field"] = required[0]
    elif attrs["action_field"] not in action_cls.model_fields:
        raise SystemExit(f"error: environment_kwargs action_field {attrs['action_field']!r} is not a field of "
                         f"{action_cls.__name__} ({sorted(action_cls.model_fields)})")  # fmt: skip
    if kwargs.get("serve") and attrs["max_sessions"] > 1 and not getattr(env_cls, "SUPPORTS_CONCURRENT_SESSIONS", 0):
        raise SystemExit(
            f"error: environment {spec!r} with serve: OpenEnv runs concurrent episodes only for an Environment with "
            "SUPPORTS_CONCURRENT_SESSIONS = True (the agent loop plays a batch of episodes at once); set it on the "
            "class if its instances share no state, or run it in-process (serve: false)"
        )
    attrs["env_cls"] = env_cls
    return type(f"OpenEnv_{env_cls.__name__}", (OpenEnvEnv,), attrs)
