"""verifiers 0.4 environments as an environment: `environment: verifiers:<module>`.

`<module>` is a verifiers taskset package, imported as Python imports it (`examples.verifiers_siblings`, the working
directory importable): a `vf.Taskset` of `vf.Task`s whose `@vf.reward` functions score a finished conversation, plus,
when the module exports one, its own `vf.Env` whose `run()` holds the multi-turn logic (the environment's replies
between turns); its `vf.Toolset`s are the agent's tools. Nothing of it is re-implemented here: every episode is
verifiers' own `Env.run_episode`, with its stop conditions, turn limit, tool servers and scoring.

How the project's model takes part: verifiers runs an agent program (a harness) that asks an OpenAI-compatible
endpoint for each assistant message. Here the harness is a small in-process chat loop (`TurnHarness`, registered as
the verifiers harness `agent_trl_turns`: the same loop as verifiers' `null` harness, chat plus the task's tools,
without starting a program per turn), and the endpoint is a real OpenAI-compatible HTTP server on 127.0.0.1
(`_Endpoint`) that parks each request until the agent loop has sampled the turn: `reset` returns the conversation of
the first request (system prompt, user prompt, tool schemas), `step` answers the parked request with the turn
(`<tool_call>{...}</tool_call>` becomes an OpenAI tool call) and returns what verifiers sent next (the environment's
reply, or the tool results), or, when the episode is over, its reward: the trainable agent's `trace.reward`, the
weighted sum of the task's reward functions. Success is a reward of at least `success_threshold` (default 1) on an
episode verifiers marks ok.

Tasks are the taskset's (`load()`), each a `TaskData` as JSON; train and eval tasks are told apart by a hash of the
task (`envs.base.split_of`). `environment_kwargs`: `taskset` (fields of the taskset's config), `env` (fields of the
env's config, e.g. an attempt limit), `turn_budget` (verifiers' own `max_turns` for the agent, default 8),
`success_threshold`, `step_timeout` (seconds, default 60) and `expert` (a format string over the task's fields, e.g.
`"{answer}"`: the answer the tiny default's demonstrations give; its plausible mistake is another task's).

Offline: every role runs this harness on verifiers' `subprocess` runtime, never a remote sandbox, and the only
endpoint is the local one; verifiers makes no other connection here.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import os
import queue
import random
import sys
import threading
import time
import types
import uuid
from contextlib import AsyncExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import verifiers.v1 as vf
from openai import APIStatusError, AsyncOpenAI
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp

from envs.adapters import check_kwargs
from envs.base import Env, check_split, parse_tool_calls, split_of

HARNESS_ID = "agent_trl_turns"
KEY_VARIABLE = "AGENT_TRL_LOCAL_KEY"  # the local endpoint's key: any text, read by verifiers' client from here
SETTINGS = {
    "taskset": "fields of the taskset's config",
    "env": "fields of the env's config",
    "turn_budget": "most assistant turns (verifiers' max_turns; default 8)",
    "success_threshold": "the reward that counts as success (default 1.0)",
    "step_timeout": "seconds a turn may take (default 60)",
    "expert": "format string over a task's fields giving the expert's answer (tiny default), e.g. '{answer}'",
}


class TurnHarness(vf.Harness[vf.HarnessConfig]):
    """verifiers' agent program, run in this process: chat with the rollout's endpoint, call the task's tools."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_MCP = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(m) for m in prompt]
        # one HTTP client for every launch on this loop: building one (its TLS context) costs tens of milliseconds
        client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, http_client=_http_client())
        async with AsyncExitStack() as stack:
            tools, dispatch, servers = [], {}, {}
            if mcp_urls:
                timeout = self.config.tool_timeout
                spec = {"mcpServers": {n: {"url": u, "timeout": timeout} for n, u in mcp_urls.items()}}
                tools, dispatch, servers = await connect_mcp(spec, stack)
            while True:
                try:
                    reply = await client.chat.completions.create(
                        model=ctx.model, messages=messages, **({"tools": tools} if tools else {})
                    )
                except APIStatusError as e:  # verifiers refused the call (a stop condition, the turn limit)
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=str(e))
                message = reply.choices[0].message
                messages.append(message.model_dump(exclude_none=True))
                if not message.tool_calls:
                    return vf.ProgramResult(exit_code=0, stdout="", stderr="")
                for call in message.tool_calls:
                    try:
                        args = json.loads(call.function.arguments or "{}")
                        known = call.function.name in dispatch
                        content = await call_mcp(servers, dispatch, call.function.name, args) if known else (
                            f"error: unknown tool {call.function.name!r}")  # fmt: skip
                    except json.JSONDecodeError as e:
                        content = f"error: tool arguments are not JSON ({e})"
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": content,
                                     "name": call.function.name})  # fmt: skip


_HTTP: dict[int, httpx.AsyncClient] = {}  # id(event loop) -> the harness's shared client


def _http_client() -> httpx.AsyncClient:
    loop = id(asyncio.get_running_loop())
    if loop not in _HTTP:
        _HTTP[loop] = httpx.AsyncClient(timeout=None)
    return _HTTP[loop]


def _register_harness() -> None:
    """verifiers finds a harness by importing a module named as its id that exports the class."""
    if HARNESS_ID not in sys.modules:
        module = types.ModuleType(HARNESS_ID, "the project's in-process harness for verifiers")
        module.TurnHarness, module.__all__ = TurnHarness, ["TurnHarness"]
        sys.modules[HARNESS_ID] = module


class _Episode:
    """The queue between one running verifiers episode and the agent loop."""

    def __init__(self):
        self.events: queue.Queue = queue.Queue()  # ("request", body, answer box) | ("done", episode) | ("error", e)


class _Endpoint:
    """An OpenAI-compatible chat endpoint on 127.0.0.1: `POST /v1/chat/completions` for model `<episode>` waits until
    the agent loop answers (`_Box.put`), then returns that message as a chat completion. Episodes share the URL and
    differ by model name, so verifiers keeps one client for all of them."""

    def __init__(self):
        self.episodes: dict[str, _Episode] = {}
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                key = body.get("model", "")
                episode = endpoint.episodes.get(key)
                if episode is None:
                    return self._send(404, {"error": {"message": f"no episode {key!r}"}})
                box = _Box()
                episode.events.put(("request", body, box))
                message = box.get()
                if message is None:  # the episode was abandoned (a new reset, a budget cut)
                    return self._send(409, {"error": {"message": "episode abandoned"}})
                choice = {"index": 0, "message": message,
                          "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}  # fmt: skip
                usage = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
                self._send(200, {"id": f"local-{uuid.uuid4().hex[:12]}", "object": "chat.completion",
                                 "created": int(time.time()), "model": body.get("model", "agent"), "choices": [choice],
                                 "usage": usage})  # fmt: skip

            def _send(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = _QuietServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A caller that hung up (an abandoned episode's harness) is not an error worth a traceback."""
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Box:
    """One value handed from one thread to another."""

    def __init__(self):
        self._ready, self._value = threading.Event(), None

    def put(self, value) -> None:
        self._value = value
        self._ready.set()

    def get(self):
        self._ready.wait()
        return self._value


class _Runner:
    """One asyncio loop in a daemon thread that runs every episode, and the local endpoint they call."""

    _instance: _Runner | None = None
    _lock = threading.Lock()

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.endpoint = _Endpoint()
        self.serving: dict[int, object] = {}

    @classmethod
    def get(cls) -> _Runner:
        with cls._lock:
            if cls._instance is None:
                cls._instance = _Runner()
            return cls._instance

    async def serve(self, env: vf.Env) -> None:
        """Enter `env.serving()` once (taskset-wide tool servers live for the whole run)."""
        if id(env) not in self.serving:
            context = env.serving()
            await context.__aenter__()
            self.serving[id(env)] = context


class VerifiersEnv(Env):
    """One verifiers environment; the subclass made by `environment_class` sets `vf_env` and the settings."""

    name = "verifiers"
    verifier = "verifiers"
    vf_env: vf.Env | None = None
    success_threshold: float = 1.0
    step_timeout: float = 60.0
    expert: str | None = None
    _ids = itertools.count()

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        self.task = None
        self.episode: _Episode | None = None
        self.key: str | None = None
        self.box: _Box | None = None
        self.future = None
        self.done = False
        self.observation_role = "user"
        self.tools = None

    # tasks ----------------------------------------------------------------------------------------------------
    @classmethod
    def all_tasks(cls) -> list[dict]:
        """The taskset's tasks as JSON, loaded once per class (a taskset is a fixed list)."""
        if "_all_tasks" not in cls.__dict__:
            cls._all_tasks = [t.data.model_dump(mode="json", exclude_defaults=True) for t in cls.vf_env.taskset]
        return cls._all_tasks

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        """The first `n` of the taskset's tasks that fall in `split` (a taskset is a fixed list: fewer if it has
        fewer; its own order, shuffled by `seed` when `seed` is not 0)."""
        check_split(split)
        if difficulty != 0:
            raise ValueError("difficulty: a verifiers taskset has one level (0); its settings are environment_kwargs")
        tasks = [dict(t) for t in cls.all_tasks() if split_of(json.dumps(t, sort_keys=True)) == split]
        if seed:
            random.Random(seed).shuffle(tasks)
        if not tasks:
            raise ValueError(f"{cls.name}: the taskset has no {split} tasks (it needs about 5 tasks or more)")
        return [{**t, "task_id": t.get("id") or f"{split}-{i}"} for i, t in enumerate(tasks[:n])]

    def _vf_task(self, task: dict):
        task_cls = type(self.vf_env.taskset).task_type()
        data = task_cls.data_type().model_validate({k: v for k, v in task.items() if k != "task_id"})
        return task_cls(data, self.vf_env.taskset.config.task)

    # one episode ----------------------------------------------------------------------------------------------
    def reset(self, task: dict) -> str | list[dict]:
        self.close()
        _register_harness()
        runner = _Runner.get()
        self.task, self.done = task, False
        self.key = f"ep{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        episode = self.episode = _Episode()  # this episode's queue: an abandoned run must not write to the next one's
        runner.endpoint.episodes[self.key] = episode
        client = vf.EvalClientConfig(base_url=f"{runner.endpoint.url}/v1", api_key_var=KEY_VARIABLE)
        context = vf.ModelContext(model=self.key, client=client)  # the model name tells the endpoint the episode

        async def run():
            try:
                await runner.serve(self.vf_env)
                episode.events.put(("done", await self.vf_env.run_episode(self._vf_task(task), context)))
            except BaseException as e:  # noqa: BLE001 (reported to the waiting thread, cancellation included)
                episode.events.put(("error", e))
                if isinstance(e, asyncio.CancelledError):
                    raise

        self.future = asyncio.run_coroutine_threadsafe(run(), runner.loop)
        kind, *event = self._next()
        if kind != "request":
            raise RuntimeError(f"{self.name}: the episode ended before the agent's first turn: {event[0]}")
        body, self.box = event
        self.tools = body.get("tools") or None
        messages = [_plain(m) for m in body.get("messages", [])]
        if len(messages) == 1 and messages[0]["role"] == "user":
            return messages[0]["content"]
        return messages

    def _next(self):
        try:
            return self.episode.events.get(timeout=self.step_timeout)
        except queue.Empty:
            return ("error", TimeoutError(f"no answer from verifiers within {self.step_timeout:g}s"))

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done or self.box is None:
            raise RuntimeError("reset(task) must start an episode before step")
        box, self.box = self.box, None
        box.put(_assistant(action))
        kind, *event = self._next()
        if kind == "request":
            body, self.box = event
            role, text = _new_messages(body.get("messages", []))
            self.observation_role = role
            return text, 0.0, False, {"success": False}
        self.done = True
        self.close()  # over, or failed (a timeout: verifiers' run is cancelled, not left waiting)
        if kind == "error":
            error = event[0]
            return (f"error: {type(error).__name__}: {error}", 0.0, True, {"success": False, "env_error": True})
        return self._score(event[0])

    def _score(self, episode) -> tuple[str, float, bool, dict]:
        traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or list(episode.traces)
        trace = traces[-1]
        reward = float(trace.reward)
        info = {
            "success": bool(episode.ok) and reward >= self.success_threshold,
            "rewards": {k: (v.score if v is not None else None) for k, v in trace.rewards.items()},
            "metrics": dict(trace.metrics),
            "stop_condition": trace.stop_condition,
            "errors": [e.message for e in (*episode.errors, *trace.errors)],
        }
        return "", reward, True, info

    def _forget(self) -> None:
        if self.key is not None:
            _Runner.get().endpoint.episodes.pop(self.key, None)

    def close(self) -> None:
        """Abandon an unfinished episode (its parked request is refused and verifiers winds it down)."""
        if self.box is not None:
            self.box.put(None)
            self.box = None
        if self.future is not None and not self.future.done():
            self.future.cancel()
        self._forget()
        self.future = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to wind down
            pass

    def first_observation(self, task: dict) -> str | list[dict]:
        """The prompt of `task` without running an episode (the dataset rows of a run need only this)."""
        system, prompt = TurnHarness(vf.HarnessConfig(id=HARNESS_ID)).resolve_prompt(self._vf_task(task).data)
        head = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            return head + [{"role": "user", "content": prompt}] if system else prompt
        return head + [_plain(message_to_wire(m)) for m in prompt or []]

    # the tiny default's expert ----------------------------------------------------------------------------------
    def expert_action(self) -> str:
        if self.expert is None:
            raise NotImplementedError("set environment_kwargs expert, a format string over a task's fields")
        return self.expert.format(**self.task)

    def noisy_action(self, rng: random.Random) -> str:
        tasks = self.all_tasks()
        return self.expert.format(**rng.choice(tasks)) if self.expert is not None else ""


def _plain(message: dict) -> dict:
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return {"role": message.get("role", "user"), "content": content or ""}


def _new_messages(messages: list[dict]) -> tuple[str, str]:
    """What verifiers added after the agent's last turn, and its role ("tool" when it is only tool results)."""
    last = max((i for i, m in enumerate(messages) if m.get("role") == "assistant"), default=-1)
    new = [_plain(m) for m in messages[last + 1 :] if m.get("role") != "system"]
    role = "tool" if new and all(m["role"] == "tool" for m in new) else "user"
    return role, "\n\n".join(m["content"] for m in new)


def _assistant(text: str) -> dict:
    """An assistant turn as an OpenAI message: `<tool_call>` blocks become tool calls (a malformed one stays text)."""
    calls = [c for c in parse_tool_calls(text) if "error" not in c]
    if not calls:
        return {"role": "assistant", "content": text}
    tool_calls = [{"id": f"call_{i}", "type": "function",
                   "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                  for i, c in enumerate(calls)]  # fmt: skip
    content = text.split("<tool_call>")[0].strip()
    return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}


def environment_class(name: str, kwargs: dict) -> type[VerifiersEnv]:
    """The environment class of verifiers taskset module `name` with `kwargs`; a wrong module or field stops here."""
    spec = f"verifiers:{name}"
    check_kwargs(spec, kwargs, SETTINGS)
    os.environ.setdefault(KEY_VARIABLE, "local")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if os.getcwd() not in paths:  # verifiers starts tool servers as child processes: they import the module too
        os.environ["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *paths])
    try:
        module = importlib.import_module(name)
    except ImportError as e:
        raise SystemExit(f"error: environment {spec!r}: cannot import {name!r} ({e})") from e
    plugin = name.replace(".", "__")  # verifiers imports plugins by a top-level name
    sys.modules.setdefault(plugin, module)
    _register_harness()
    try:
        config_cls = vf.env_config_type(plugin)
        roles = [f for f, info in config_cls.model_fields.items() if isinstance(info.default, vf.AgentConfig)]
        seat = {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"},
                "max_turns": int(kwargs.get("turn_budget", 8))}  # fmt: skip
        taskset = {"id": plugin, **kwargs.get("taskset", {})}
        config = vf.resolve_env_config({"taskset": taskset, **{r: seat for r in roles}, **kwargs.get("env", {})})
        vf_env = vf.load_environment(config)
    except (TypeError, AttributeError, ValueError) as e:  # no taskset exported, a wrong config field (pydantic)
        raise SystemExit(f"error: environment {spec!r} is not a verifiers 0.4 taskset, or environment_kwargs do "
                         f"not fit its config: {e}") from e  # fmt: skip
    attrs = {"name": spec, "vf_env": vf_env, "max_turns": int(kwargs.get("turn_budget", 8)) + 1,
             "success_threshold": float(kwargs.get("success_threshold", 1.0)),
             "step_timeout": float(kwargs.get("step_timeout", 60.0)), "expert": kwargs.get("expert")}  # fmt: skip
    return type("Verifiers_" + plugin, (VerifiersEnv,), attrs)
