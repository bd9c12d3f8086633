"""The environment protocol, and an adapter that runs TRL-style tool environments unchanged.

An environment is an object with

* `reset(task) -> observation`: start an episode on `task` (a JSON-serialisable dict); the observation is the text of
  the first user message (instruction plus whatever the agent sees first), or a list of chat messages when the
  episode starts from a conversation so far (X-Tree's node instances, `trainers/xtree_trainer.py`): the agent loop
  then uses that list as the prompt;
* `step(action_text) -> (observation, reward, done, info)`: apply the agent's whole turn (the decoded assistant text);
  `reward` is this turn's reward (the outcome reward arrives on the final turn), `info["success"]` is set when `done`;
* `state_key() -> str` (optional): a description of the current state, equal for states where an action means the
  same (GiGPO's anchors, docs/methods/gigpo.md D1). When an environment gives none (an empty string), `state_key_of`
  uses the whitespace-normalised observation the agent saw last.

Built-in environments (`envs/shop.py`, `envs/terminal/`, `envs/search.py`) subclass `Env` and also provide a seeded
task generator with disjoint train and eval splits (`make_tasks`), an expert (`expert_action`) for demonstrations,
and a plausible wrong action (`noisy_action`) for noisy demonstrations. Environments know nothing about trainers.

`ProtocolEnv` runs any object with `reset` and `step` (no base class needed). `ToolEnv` wraps a class written for
TRL's `environment_factory` (a `reset(**row)` method, public typed tool methods
with Google-style docstrings, optional `get_reward()`): tool calls in the assistant text are parsed, the methods are
called, and their results come back as `tool` messages; a turn without a tool call ends the episode.
"""

from __future__ import annotations

import inspect
import json
import random
import re
from collections.abc import Callable
from typing import Any

from transformers.utils import get_json_schema


class Env:
    """Base class of the built-in environments. Subclasses set `name` and implement the methods below."""

    name: str = "env"
    #: most assistant turns an episode may take before the agent loop cuts it (a budget cut, not an env termination)
    max_turns: int = 8
    #: chat role of the observations returned by `step` ("user" for text environments, "tool" for tool results)
    observation_role: str = "user"
    #: bump when the text of demonstrations changes: it is part of the tiny default's cache key (`envs.tiny`)
    demo_version: int = 0
    #: per difficulty, a version that replaces `demo_version` in that level's key, for a level whose tasks changed
    #: alone (a cached build of the level as it was is then never reused)
    level_demo_versions: dict[int, int] = {}
    #: SFT steps the tiny default needs here (None: `envs.tiny.TinySpec.sft_steps`, 300)
    tiny_sft_steps: int | None = None
    #: per difficulty, SFT steps that replace `tiny_sft_steps` at that level (a long level needs a longer warm start)
    tiny_level_sft_steps: dict[int, int] = {}
    #: per difficulty, the share of the tiny default's demonstrations played under guidance (`envs.tiny.TinySpec`'s
    #: `guidance_frac`, default 0) at that level, for a level whose build starts only with them
    tiny_level_guidance_frac: dict[int, float] = {}
    #: per difficulty, the per-turn noise of the tiny default's demonstrations (`envs.tiny.TinySpec`'s `noise`, 0.3)
    #: at that level, for a level whose episodes are long enough that the default makes most demonstrations fail
    tiny_level_noise: dict[int, float] = {}
    #: JSON schemas of the tools rendered into the prompt by the chat template, or None for plain text actions
    tools: list[dict] | None = None
    #: True when an episode cut by a budget would really have gone on (an open-ended task with no final verdict):
    #: critic trainers then bootstrap it from the value. False (every built-in): a cut episode is a finished failure
    #: (docs/methods/conventions.md C4)
    continues_past_cut: bool = False
    #: how to do this environment's tasks well, in a few sentences: privileged information for self-distillation
    #: methods (docs/methods/alignopsd.md D6); "" when the environment ships none
    skill: str = ""

    #: how the task scheduler compares environments (docs/methods/envsched.md D7): the names of the actions or tools,
    #: the keys of the environment's state, and the kind of verifier; see `descriptor`
    action_names: tuple[str, ...] = ()
    state_keys: tuple[str, ...] = ()
    verifier: str = ""

    def __init__(self, difficulty: int = 0):
        self.difficulty = difficulty

    def descriptor(self, task: dict | None = None) -> dict:
        """{"tools", "state_keys", "verifier"} of this environment (envsched.md Eq. 10): the tool names of `tools`,
        else `action_names`; `state_keys`; `verifier`, else the environment's name."""
        tools = [t.get("function", t).get("name", "") for t in (self.tools or [])] or list(self.action_names)
        return {"tools": sorted(tools), "state_keys": sorted(self.state_keys), "verifier": self.verifier or self.name}

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        """`n` tasks of `split` ("train" or "eval"); the two splits never share a task."""
        raise NotImplementedError

    def reset(self, task: dict) -> str:
        raise NotImplementedError

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        raise NotImplementedError

    def state_key(self) -> str:
        return ""

    def first_observation(self, task: dict) -> str | list[dict]:
        """What `reset(task)` would show first, for a run's dataset rows (TRL's `prompt` column); an environment
        whose reset is costly (an episode in another framework) returns it without starting one."""
        return self.reset(task)

    def expert_action(self) -> str:
        """The correct next action in the current state."""
        raise NotImplementedError

    def noisy_action(self, rng: random.Random) -> str:
        """A plausible but wrong next action (used to make demonstrations noisy)."""
        raise NotImplementedError

    def sound_action(self, action: str) -> bool:
        """Is `action` sound play in the current state: one a careful player could take, not only the expert's?
        By default, the expert's action (whitespace and case ignored); an environment where many moves are good
        overrides it (TextArena's GuessTheNumber: any guess the hints still allow). bench/credit_signal.py labels
        turns with it (`--label sound`)."""
        return " ".join(action.lower().split()) == " ".join(self.expert_action().lower().split())

    def privileged(self, task: dict) -> str | None:
        """What a teacher may read about `task` that the agent does not see: by default the plan the expert follows
        from the start, its actions in order ("Plan: a | b | c"), played on a fresh copy of this environment (this
        one's state is not touched). None when the environment has no expert or the expert does not finish within
        `max_turns`. β-OPSD's teacher reads it (docs/methods/beta-opsd.md D8); an environment may override it with
        any text, e.g. the documents that hold an answer."""
        env = type(self).__new__(type(self))
        env.__dict__.update({k: v for k, v in self.__dict__.items() if not k.startswith("_")})
        try:
            env.reset(task)
            actions = []
            for _ in range(self.max_turns):
                action = env.expert_action()
                actions.append(action)
                if env.step(action)[2]:
                    return "Plan: " + " | ".join(a.strip() for a in actions)
        except NotImplementedError:
            return None
        return None


#: the line above an environment's `skill` text in a teacher's context: AlignOPSD's privileged block
#: (docs/methods/alignopsd.md D6), and one of the tiny default's guidance forms (`envs.tiny`)
SKILL_HEADER = "Privileged skill information (used in training only):"


def skill_card(text: str) -> str:
    """`text` under `SKILL_HEADER`, or "" for no text.

    >>> skill_card(" Search first. ")
    'Privileged skill information (used in training only):\nSearch first.'
    """
    return f"{SKILL_HEADER}\n{text.strip()}" if text.strip() else ""


def noisy_expert_episode(env: Env, task: dict, noise: float, rng: random.Random) -> tuple[str, list[dict], bool]:
    """Play `env`'s expert on `task`, each turn taking `noisy_action` instead with probability `noise`.

    Returns the first observation, the transcript (per turn: action, observation, reward) and whether the environment
    ended the episode (False when `max_turns` ran out). Used for SFT demonstrations and scripted judge tests.
    """
    first = env.reset(task)
    transcript = []
    for _ in range(env.max_turns):
        action = env.noisy_action(rng) if rng.random() < noise else env.expert_action()
        observation, reward, done, _ = env.step(action)
        transcript.append({"action": action, "observation": observation, "reward": reward})
        if done:
            return first, transcript, True
    return first, transcript, False


def row_task(row: dict) -> dict:
    """The task of a dataset row: its `task` column (a JSON string or a dict), else the whole row (as TRL's
    `reset(**row)`)."""
    if "task" not in row:
        return row
    return json.loads(row["task"]) if isinstance(row["task"], str) else row["task"]


class ProtocolEnv(Env):
    """Runs any object with `reset(task) -> str` and `step(action) -> (observation, reward, done, info)` (duck typing,
    no base class needed) as an `Env`. Optional attributes of the object are used when present: `state_key()`,
    `tools`, `observation_role`, `max_turns`, `continues_past_cut`; otherwise the `Env` defaults apply."""

    def __init__(self, inner: Any):
        super().__init__()
        self.inner = inner
        self.name = type(inner).__name__
        for attr in ("tools", "observation_role", "max_turns", "continues_past_cut"):
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))

    def reset(self, task: dict) -> str:
        return self.inner.reset(task)

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        return self.inner.step(action)

    def state_key(self) -> str:
        key = self.inner.state_key() if hasattr(self.inner, "state_key") else None
        return "" if key is None else str(key)  # "": no key of its own, the observation stands in (state_key_of)


def state_key_of(env: Env, observation: str) -> str | None:
    """The key of `env`'s current state (gigpo.md D1): `env.state_key()` when it returns a non-empty key, else the
    observation the agent saw last (`observation`), whitespace-normalised (conventions.md C13). None when
    `state_key()` raises: the step still runs and only its key is missing.

    >>> state_key_of(Env(), "  You are in\\n room 2 ")
    'You are in room 2'
    """
    try:
        key = env.state_key()
    except Exception:  # an environment bug must not stop the episode (gigpo.md §7 item 15)
        return None
    key = " ".join(str(key).split()) if key is not None else ""
    return key or " ".join(str(observation).split())


def check_split(split: str) -> None:
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")


def split_of(text: str, eval_fraction: float = 0.2) -> str:
    """Deterministic split of a task by the text that defines it, so train and eval never share a task.

    A stable hash (not Python's salted `hash`) of the defining text decides: about `eval_fraction` of all possible
    tasks are eval tasks, the rest train tasks.
    >>> split_of("buy a red shirt") in ("train", "eval")
    True
    """
    import hashlib

    h = int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64
    return "eval" if h < eval_fraction else "train"


_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> list[dict]:
    """Tool calls in an assistant turn, Qwen/Hermes style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    A call whose body is not a JSON object with a string `name` is returned as `{"error": "..."}`.
    >>> parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    [{'name': 'add', 'arguments': {'a': 1}}]
    >>> parse_tool_calls("no call here")
    []
    """
    calls = []
    for body in _TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append({"error": f"tool call is not valid JSON: {e.msg}"})
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append({"error": "tool call must be a JSON object with a string 'name'"})
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models emit the arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                calls.append({"error": "tool call 'arguments' is not a JSON object"})
                continue
        calls.append({"name": call["name"], "arguments": args if isinstance(args, dict) else {}})
    return calls


def tool_methods(cls: type) -> dict[str, Callable]:
    """Public methods of a TRL-style environment class that become tools (everything but `reset`/`get_reward`)."""
    return {
        name: fn
        for name, fn in inspect.getmembers(cls, inspect.isfunction)
        if not name.startswith("_") and name not in ("reset", "get_reward")
    }


class ToolEnv(Env):
    """Runs an unchanged TRL-style tool environment class through the `Env` protocol.

    The task dict (the dataset row when it has no `task` column) is passed to the class's `reset(**task)`, as TRL
    passes the row; a string it returns is appended to the first observation. The first observation is
    `task["prompt"]` when it is a string, or the content of its last user message when it is a message list. Tool
    errors (unknown tool, bad arguments, an exception inside the tool) become error observations, never exceptions.
    A turn without a tool call ends the episode. Each step's reward is the change of `get_reward()` (0 when the class
    has none), so the episode's reward is `get_reward()` however the episode ends, a budget cut included;
    `info["success"]` is `get_reward() > 0`.

    Differences from TRL's own tool loop: a malformed call (bad JSON, no string `name`) is an error observation and
    the episode goes on (TRL ends it, reading the turn as plain text); several calls in one turn come back as one
    observation; error text is JSON with the exception's type.
    """

    observation_role = "tool"

    def __init__(self, env_cls: type, max_turns: int = 8, env_kwargs: dict | None = None):
        super().__init__()
        self.env_cls = env_cls
        self.env_kwargs = dict(env_kwargs or {})
        self.name = env_cls.__name__
        self.max_turns = max_turns
        self._methods = tool_methods(env_cls)
        if not self._methods:
            raise ValueError(f"{env_cls.__name__} has no public tool methods (methods not starting with '_')")
        self.tools = [get_json_schema(fn) for fn in self._methods.values()]
        self.instance: Any = None
        self._n_calls = 0
        self._reward = 0.0

    def _total_reward(self) -> float:
        return float(self.instance.get_reward()) if hasattr(self.instance, "get_reward") else 0.0

    def reset(self, task: dict) -> str:
        self.instance = self.env_cls(**self.env_kwargs)
        self._n_calls, self._reward = 0, 0.0
        extra = self.instance.reset(**task)
        prompt = task.get("prompt", "")
        if isinstance(prompt, list):
            prompt = next((m["content"] for m in reversed(prompt) if m.get("role") == "user"), "")
        return prompt + (extra if isinstance(extra, str) else "")

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        calls = parse_tool_calls(action)
        if not calls:
            return "", self._reward_change(), True, {"success": self._reward > 0, "tool_calls": 0}
        results = []
        for call in calls:
            self._n_calls += 1
            if "error" in call:
                results.append(json.dumps({"error": call["error"]}))
                continue
            fn = self._methods.get(call["name"])
            if fn is None:
                results.append(json.dumps({"error": f"unknown tool {call['name']!r}"}))
                continue
            try:
                results.append(str(getattr(self.instance, call["name"])(**call["arguments"])))
            except Exception as e:  # a failing tool is an observation for the agent, as in TRL's tool loop
                results.append(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        reward = self._reward_change()
        return "\n".join(results), reward, False, {"success": self._reward > 0, "tool_calls": len(calls)}

    def _reward_change(self) -> float:
        total = self._total_reward()
        change, self._reward = total - self._reward, total
        return change
