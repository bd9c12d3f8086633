"""ShopTools: the shop (`envs/shop.py`) as a tool environment in TRL's `environment_factory` style.

The same class runs unchanged in two places:

* TRL's own tool loop, `GRPOTrainer(environment_factory=ShopTools)`: TRL builds `ShopTools()`, calls
  `reset(**row)` with the dataset row (`prompt`, `task` as a JSON string, `task_id`), renders the JSON schemas of the
  public methods `search`, `click`, `choose`, `buy` into the prompt, and scores the rollout with `get_reward()`;
* the project's agent loop, through the adapter `envs.base.ToolEnv(ShopTools)`. The agent loop parses the row's `task`
  column itself and the adapter calls `reset(**task)`, so `reset` accepts both forms (see `ShopTools.reset`).

An episode: the model calls `search`, `click`, `choose` and `buy` (one call per turn), then answers without a tool
call, which ends the episode in both loops. The reward is the shop's WebShop-style score of the purchase (1.0 when all
five attributes match), 0 until something is bought.

Also here: `tool_call_text` (a shop text action as a Qwen-style tool call), `tool_demonstrations` (noisy expert
episodes as chat messages whose plain-text rendering is byte-identical to the structured tool-call rendering), and
`tiny_tool_model`, the tiny tool-calling model built and cached like `envs.tiny.tiny_model`.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict

from transformers.utils import get_json_schema

from envs.base import ToolEnv, tool_methods
from envs.shop import LIST_LENGTH, ShopEnv
from envs.tiny import CHAT_TEMPLATE, TinySpec, build_and_save, build_tokenizer, cache_root, demonstrations

#: what the model says after buying: any turn without a tool call ends the episode
FINAL_ANSWER = "done"
#: bump when the tool model's build recipe changes (it is part of the cache key, with the schemas and the template)
RECIPE_VERSION = 1

_ACTION = re.compile(r"\s*(search|click|choose)\s*\[([^\[\]]*)\]\s*|\s*(buy)(?:\s*\[\s*\])?\s*", re.IGNORECASE)
_ARGUMENT = {"search": "query", "click": "item_id", "choose": "option"}


class ShopTools:
    """The shop as TRL tools: search the catalogue, open an item, choose its size (and colour), buy it.

    Every public method is a tool (TRL and `ToolEnv` both expose all public methods but `reset` and `get_reward`),
    so helpers start with `_`. Pool instances are reused by TRL across batches: `reset` clears all episode state.
    """

    def __init__(self):
        self._env = ShopEnv()
        self._reward = 0.0

    def reset(self, **kwargs) -> str:
        """Start the episode of a dataset row; returns the instruction, which TRL appends to the user message.

        Two call forms: TRL passes the row, whose `task` column holds the task as a JSON string (or dict); the
        project's agent loop parses that column and `ToolEnv` passes the task's own fields as keyword arguments.
        """
        task = kwargs.get("task", kwargs)
        task = json.loads(task) if isinstance(task, str) else task
        _check_level(task["difficulty"])
        self._env = ShopEnv(difficulty=task["difficulty"])
        self._env.reset(task)
        self._reward = 0.0
        return f"Instruction: {task['instruction']}"

    def search(self, query: str) -> str:
        """Search the shop.

        Args:
            query: Words of the wanted item.
        """
        return self._act(f"search[{query}]")

    def click(self, item_id: str) -> str:
        """Open an item of the search results.

        Args:
            item_id: Id of the item.
        """
        return self._act(f"click[{item_id}]")

    def choose(self, option: str) -> str:
        """Choose an option of the open item.

        Args:
            option: A size or colour.
        """
        return self._act(f"choose[{option}]")

    def buy(self) -> str:
        """Buy the open item."""
        return self._act("buy")

    def get_reward(self) -> float:
        """Score of the purchase: the fraction of the instruction's five attributes matched; 0 before buying."""
        return self._reward

    def _act(self, action: str) -> str:
        observation, reward, done, info = self._env.step(action)
        if done and not info.get("invalid"):  # the purchase; later calls answer "error: the episode is over"
            self._reward = float(reward)
        return observation


#: the JSON schemas of the tools, in the order TRL and ToolEnv render them (alphabetical, `inspect.getmembers`)
TOOL_SCHEMAS: list[dict] = [get_json_schema(fn) for fn in tool_methods(ShopTools).values()]


def tool_call(action: str) -> dict:
    """The tool call of a shop text action, as `{"name": ..., "arguments": {...}}`.

    >>> tool_call("click[B7K2]")
    {'name': 'click', 'arguments': {'item_id': 'B7K2'}}
    >>> tool_call("buy")
    {'name': 'buy', 'arguments': {}}
    """
    m = _ACTION.fullmatch(action)
    if m is None:
        raise ValueError(f"not a shop action: {action!r}")
    if m.group(3):
        return {"name": "buy", "arguments": {}}
    name = m.group(1).lower()
    return {"name": name, "arguments": {_ARGUMENT[name]: m.group(2).strip()}}


def tool_call_text(action: str) -> str:
    """A shop text action as the Qwen-style tool-call text the chat template renders for an assistant tool call.

    >>> print(tool_call_text("search[red cotton shirt]"))
    <tool_call>
    {"name": "search", "arguments": {"query": "red cotton shirt"}}
    </tool_call>
    """
    return "<tool_call>\n" + json.dumps(tool_call(action), ensure_ascii=False) + "\n</tool_call>"


def _check_level(difficulty: int) -> None:
    if difficulty in LIST_LENGTH:
        raise ValueError(
            f"ShopTools has no shop level {difficulty}: the shopping-list levels ({sorted(LIST_LENGTH)}) need the "
            "shop's add and checkout actions, which are no tools here; use the text environment `shop`"
        )


def make_rows(split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
    """Dataset rows for both loops: an empty user prompt (the instruction comes from `reset`, as in TRL's own
    environment-owned data), the task as a JSON string in column `task`, and its `task_id`. The shop's levels 0, 3
    and 4 (the shopping lists of levels 1 and 2 have no tools)."""
    _check_level(difficulty)
    return [
        {"prompt": [{"role": "user", "content": ""}], "task": json.dumps(task), "task_id": task["task_id"]}
        for task in ShopEnv.make_tasks(split, n, seed=seed, difficulty=difficulty)
    ]


class _ShopToolsDemo(ToolEnv):
    """`ToolEnv(ShopTools)` plus the shop's expert, speaking tool-call text; only used to record demonstrations."""

    def __init__(self, difficulty: int = 0):
        super().__init__(ShopTools)
        self.difficulty = difficulty

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        return ShopEnv.make_tasks(split, n, seed=seed, difficulty=difficulty)

    def expert_action(self) -> str:
        shop = self.instance._env
        return FINAL_ANSWER if shop.page == "done" else tool_call_text(shop.expert_action())

    def noisy_action(self, rng: random.Random) -> str:
        shop = self.instance._env
        return FINAL_ANSWER if shop.page == "done" else tool_call_text(shop.noisy_action(rng))


def tools_system_message(tokenizer, tools: list[dict] | None = None) -> dict:
    """The system message whose plain rendering equals the chat template's rendering of `tools`.

    SFT datasets keep every message as `{role, content}` (Arrow would merge the tools' differing argument structs
    and render `null` arguments), so the tool block travels as this system message instead of a `tools=` argument.
    """
    tools = TOOL_SCHEMAS if tools is None else tools
    probe = [{"role": "user", "content": "\x01"}]
    with_tools = tokenizer.apply_chat_template(probe, tools=tools, tokenize=False)
    plain = tokenizer.apply_chat_template(probe, tokenize=False)
    head = "<|im_start|>system\n"
    if not (with_tools.endswith(plain) and with_tools.startswith(head)):
        raise ValueError("the chat template does not render tools as a leading system message")
    block = with_tools[: len(with_tools) - len(plain)]
    if not block.endswith("<|im_end|>\n"):
        raise ValueError("the chat template's tool block does not end with '<|im_end|>\\n'")
    return {"role": "system", "content": block[len(head) : -len("<|im_end|>\n")]}


def tool_demonstrations(n: int, seed: int = 0, difficulty: int = 0, noise: float = 0.3) -> list[list[dict]]:
    """`n` noisy expert episodes on training tasks as `{role, content}` chat messages (no system message).

    Assistant turns are tool-call texts (`tool_call_text`) and the final answer `FINAL_ANSWER`; tool results are
    `tool` messages. With probability `noise` a turn is the shop's `noisy_action` (a plausible mistake) instead.
    """
    return demonstrations(_ShopToolsDemo, n, seed, difficulty, noise)


def structured(messages: list[dict]) -> list[dict]:
    """The same conversation with assistant tool calls as structured `tool_calls` (the form TRL's loop renders)."""
    out = []
    for m in messages:
        if m["role"] == "assistant" and m["content"].startswith("<tool_call>"):
            body = json.loads(m["content"].removeprefix("<tool_call>\n").removesuffix("\n</tool_call>"))
            out.append({"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": body}]})
        else:
            out.append(dict(m))
    return out


def tool_spec(difficulty: int = 0, seed: int = 0, **overrides) -> TinySpec:
    """The tiny tool model's settings: TinySpec defaults, except less noise (shorter episodes) and SFT batches of 16
    (tool episodes are about 3x longer than text ones). 300 steps take about 1.3 s each on two idle CPU cores."""
    settings = dict(noise=0.2, sft_batch_size=16, sft_steps=300)
    settings.update(overrides)
    return TinySpec(env="shop-tools", difficulty=difficulty, seed=seed, **settings)


def tool_model_key(spec: TinySpec, demos: list[list[dict]]) -> str:
    """Cache key: the spec, the recipe version, the tool schemas, the chat template and the demonstrations' text, so
    any change to them (an environment's observations included) rebuilds the model."""
    blob = json.dumps([asdict(spec), RECIPE_VERSION, TOOL_SCHEMAS, CHAT_TEMPLATE, demos], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_tool_model(difficulty: int = 0, seed: int = 0, **overrides) -> str:
    """Folder of a tiny Qwen2 SFT'd to play `ShopTools` with tool calls, built if not cached.

    Saved with a tokenizer that has the project's chat template and TRL's new-style Qwen3 `response_template`, so
    the folder works as is in `GRPOTrainer(model=folder, environment_factory=ShopTools)` and in the agent loop.
    Cached under `envs.tiny.cache_root()/"tiny"`, keyed by `tool_model_key`. Building takes about 300 SFT steps of
    1.3 s each on two idle CPU cores (23 minutes when the cores were shared with other jobs).
    """
    import copy

    from trl.chat_template_utils import qwen3_template

    spec = tool_spec(difficulty, seed, **overrides)
    demos = tool_demonstrations(spec.num_demos, spec.seed, spec.difficulty, spec.noise)  # about 1 s
    folder = cache_root() / "tiny" / f"tiny-shop-tools-{tool_model_key(spec, demos)}"
    if (folder / "model.safetensors").exists():
        return str(folder)
    schemas = [json.dumps(s, ensure_ascii=False) for s in TOOL_SCHEMAS]
    texts = [CHAT_TEMPLATE, "user assistant system tool", *schemas] + [m["content"] for d in demos for m in d]
    tokenizer = build_tokenizer(texts, spec.vocab_size)
    # Each schema line becomes one (non-special) token: the prompt text is unchanged, but the 4 JSON schemas cost 4
    # tokens instead of about 520 (the Qwen2 pre-tokeniser never merges across JSON punctuation), which halves the
    # tokens of a demonstration. A schema that changes no longer matches its token (and the cache key changes too).
    tokenizer.add_tokens(schemas)
    tokenizer.response_template = copy.deepcopy(qwen3_template)  # TRL's tool loop parses completions with it
    system = tools_system_message(tokenizer)
    demos = [[system, *d] for d in demos]
    # the SFT text must be byte-identical to what the RL loops render (tool schemas included)
    check = structured(demos[0][1:])
    if tokenizer.apply_chat_template(demos[0], tokenize=False) != tokenizer.apply_chat_template(
        check, tools=TOOL_SCHEMAS, tokenize=False
    ):
        raise RuntimeError("SFT rendering of the tool demonstrations differs from the structured tool rendering")
    build_and_save(spec, tokenizer, demos, folder)
    return str(folder)
