"""Layer 2: the example TRL-style tool environment (`envs/shop_tools.py`) through the adapter `ToolEnv`, and through
TRL's own tool loop. Scripted policies play the shop's expert as tool calls; no model has to learn anything."""

import copy
import json
import math

import pytest
import torch
from conftest import CPU_ARGS
from datasets import Dataset

from envs.base import ToolEnv
from envs.shop import ShopEnv
from envs.shop_tools import (
    FINAL_ANSWER,
    TOOL_SCHEMAS,
    ShopTools,
    make_rows,
    structured,
    tool_call,
    tool_call_text,
    tool_demonstrations,
    tools_system_message,
)
from trainers.agent_loop import LoopSettings, play, render_prompt_ids
from trainers.trl_api import generation_batch

WIDE = LoopSettings(max_turn_tokens=400, max_completion_length=4000)  # scripted turns are long with a 400-word BPE


class Exploding(ShopTools):
    """ShopTools plus a tool that raises."""

    def explode(self, reason: str) -> str:
        """Raise an error.

        Args:
            reason: Why.
        """
        raise RuntimeError(f"kaboom: {reason}")


def expert_turn(tools: ShopTools) -> str:
    shop = tools._env
    return FINAL_ANSWER if shop.page == "done" else tool_call_text(shop.expert_action())


def scripted(tokenizer, envs, tasks, first_turns=(), sampled=None):
    """A GenerateFn that plays the shop expert's tool calls for the episode whose instruction is in the context.

    `first_turns` are texts emitted (in order) before the expert takes over; `sampled` collects every emitted id list.
    """
    by_instruction = {t["instruction"]: env for env, t in zip(envs, tasks, strict=True)}
    turn = {}

    def generate(contexts, max_new_tokens):
        out = []
        for ctx in contexts:
            instruction = tokenizer.decode(ctx).split("Instruction: ", 1)[1].split("<|im_end|>", 1)[0]
            k = turn.get(instruction, 0)
            turn[instruction] = k + 1
            text = first_turns[k] if k < len(first_turns) else expert_turn(by_instruction[instruction].instance)
            ids = (tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id])[:max_new_tokens]
            if sampled is not None:
                sampled.setdefault(instruction, []).append(ids)
            out.append((ids, [-0.5] * len(ids)))
        return out

    return generate


def shop_tasks(n):
    return ShopEnv.make_tasks("train", n, seed=3)


def test_tool_call_text_is_what_the_template_renders(tiny_tokenizer):
    for action in ("search[red cotton shirt size m under 40 dollars]", "click[B7K2]", "choose[xl]", "buy"):
        call = tool_call(action)
        message = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": call}]}
        rendered = tiny_tokenizer.apply_chat_template([{"role": "user", "content": "x"}, message], tokenize=False)
        assert f"<|im_start|>assistant\n{tool_call_text(action)}<|im_end|>" in rendered
    with pytest.raises(ValueError):
        tool_call("dance")


def test_expert_tool_calls_succeed_through_the_adapter(tiny_tokenizer):
    tasks = shop_tasks(4)
    envs = [ToolEnv(ShopTools) for _ in tasks]
    rollouts = play(scripted(tiny_tokenizer, envs, tasks), tiny_tokenizer, envs, tasks, settings=WIDE)
    for r, env in zip(rollouts, envs, strict=True):
        assert r.done and not r.truncated and r.success
        assert [t["action"].split('"name": "')[1].split('"')[0] for t in r.transcript[:-1]] == [
            "search",
            "click",
            "choose",
            "buy",
        ]
        assert r.transcript[-1]["action"] == FINAL_ANSWER  # a turn without a tool call ends the episode
        assert r.turn_rewards == [0.0, 0.0, 0.0, 1.0, 0.0]  # the change of get_reward(), on the buying turn
        assert env.instance.get_reward() == 1.0
        assert r.transcript[3]["observation"].startswith("bought ")


def test_a_budget_cut_after_buying_keeps_the_reward(tiny_tokenizer):
    tasks = shop_tasks(2)
    envs = [ToolEnv(ShopTools) for _ in tasks]
    settings = LoopSettings(
        max_turn_tokens=WIDE.max_turn_tokens, max_completion_length=WIDE.max_completion_length, max_turns=4
    )  # cut right after `buy`, before the closing answer
    rollouts = play(scripted(tiny_tokenizer, envs, tasks), tiny_tokenizer, envs, tasks, settings=settings)
    assert all(r.truncated and r.success and r.env_reward == 1.0 for r in rollouts)


def test_reset_takes_the_trl_row_or_the_adapter_task():
    row = make_rows("train", 1, seed=3)[0]
    task = json.loads(row["task"])
    via_trl, via_adapter = ShopTools(), ShopTools()
    assert via_trl.reset(**row) == via_adapter.reset(**task) == f"Instruction: {task['instruction']}"
    for tools in (via_trl, via_adapter):  # the expert through the tool methods themselves
        while tools._env.page != "done":
            call = tool_call(tools._env.expert_action())
            getattr(tools, call["name"])(**call["arguments"])
        assert tools.get_reward() == 1.0
        assert tools.buy().startswith("error") and tools.get_reward() == 1.0  # a late call keeps the reward
        tools.reset(**row)  # pooled instances are reused: reset clears the episode
        assert tools.get_reward() == 0.0 and tools._env.page == "start"


def test_tool_errors_become_observations(tiny_tokenizer):
    env = ToolEnv(Exploding)
    env.reset(shop_tasks(1)[0])
    cases = {
        '<tool_call>\n{"name": "fly", "arguments": {}}\n</tool_call>': "unknown tool 'fly'",
        "<tool_call>\n{not json}\n</tool_call>": "not valid JSON",
        '<tool_call>\n{"name": "search", "arguments": {"words": "x"}}\n</tool_call>': "TypeError",
        '<tool_call>\n{"name": "explode", "arguments": {"reason": "test"}}\n</tool_call>': "RuntimeError: kaboom",
        '<tool_call>\n{"name": "click", "arguments": {"item_id": "ZZZZ"}}\n</tool_call>': "error: click needs",
    }
    for action, expected in cases.items():
        observation, reward, done, info = env.step(action)
        assert expected in observation and not done and reward == 0.0
        assert info["tool_calls"] == 1

    # inside the loop: three bad turns, then the expert still finishes the episode
    tasks = shop_tasks(2)
    envs = [ToolEnv(Exploding) for _ in tasks]
    bad = list(cases)[:3]
    generate = scripted(tiny_tokenizer, envs, tasks, first_turns=bad)
    rollouts = play(generate, tiny_tokenizer, envs, tasks, settings=WIDE)
    for r in rollouts:
        assert [t["observation"] for t in r.transcript[:3]] == [
            json.dumps({"error": "unknown tool 'fly'"}),
            r.transcript[1]["observation"],
            r.transcript[2]["observation"],
        ]
        assert "not valid JSON" in r.transcript[1]["observation"] and "TypeError" in r.transcript[2]["observation"]
        assert r.success and len(r.turn_rewards) == 3 + 5 and r.env_errors == 0


def test_a_turn_without_a_tool_call_ends_the_episode(tiny_tokenizer):
    env = ToolEnv(ShopTools)
    env.reset(shop_tasks(1)[0])
    assert env.step("I would rather not.") == ("", 0.0, True, {"success": False, "tool_calls": 0})
    tasks = shop_tasks(2)
    envs = [ToolEnv(ShopTools) for _ in tasks]
    generate = scripted(tiny_tokenizer, envs, tasks, first_turns=["hello"])
    rollouts = play(generate, tiny_tokenizer, envs, tasks, settings=WIDE)
    assert all(r.done and not r.truncated and not r.success and len(r.turn_rewards) == 1 for r in rollouts)


def test_prompt_renders_the_tool_schemas_as_trl_does(tiny_tokenizer):
    env = ToolEnv(ShopTools)
    assert env.tools == TOOL_SCHEMAS
    assert [s["function"]["name"] for s in TOOL_SCHEMAS] == ["buy", "choose", "click", "search"]
    messages = [{"role": "user", "content": env.reset(shop_tasks(1)[0])}]
    ids = render_prompt_ids(tiny_tokenizer, messages, env.tools)
    text = tiny_tokenizer.decode(ids)
    for schema in TOOL_SCHEMAS:
        assert "\n" + json.dumps(schema) + "\n" in text
    # TRL passes the bound tool methods of its instance; transformers turns them into the same schemas
    instance = ShopTools()
    methods = [instance.buy, instance.choose, instance.click, instance.search]
    trl_ids = tiny_tokenizer.apply_chat_template(
        messages, tools=methods, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert trl_ids == ids


def test_demonstrations_render_exactly_like_rl_conversations(tiny_tokenizer):
    system = tools_system_message(tiny_tokenizer)
    for demo in tool_demonstrations(20, seed=1):
        assert demo[0]["role"] == "user"
        # the final answer, or a tool result when a noisy episode runs out of turns before buying
        assert demo[-1] == {"role": "assistant", "content": FINAL_ANSWER} or demo[-1]["role"] == "tool"
        sft_text = tiny_tokenizer.apply_chat_template([system, *demo], tokenize=False)
        rl_text = tiny_tokenizer.apply_chat_template(structured(demo), tools=TOOL_SCHEMAS, tokenize=False)
        assert sft_text == rl_text


def test_tito_with_tool_messages(tiny_tokenizer):
    tok = tiny_tokenizer
    tasks = shop_tasks(3)
    envs = [ToolEnv(ShopTools) for _ in tasks]
    sampled = {}
    rollouts = play(scripted(tok, envs, tasks, sampled=sampled), tok, envs, tasks, settings=WIDE)
    for task, r in zip(tasks, rollouts, strict=True):
        assert len(r.completion_ids) == len(r.logprobs) == len(r.env_mask) == len(r.turn_index)
        model_tokens = [t for t, m in zip(r.completion_ids, r.env_mask, strict=True) if m == 1]
        assert model_tokens == [i for turn in sampled[task["instruction"]] for i in turn]  # exactly the sampled ids
        assert all((lp == 0.0) == (m == 0) for lp, m in zip(r.logprobs, r.env_mask, strict=True))
        assert all((k >= 0) == (m == 1) for k, m in zip(r.turn_index, r.env_mask, strict=True))
        messages = [{"role": "user", "content": f"Instruction: {task['instruction']}"}]
        for t, turn in enumerate(r.transcript):
            messages.append({"role": "assistant", "content": turn["action"]})
            if t < len(r.transcript) - 1:
                messages.append({"role": "tool", "content": turn["observation"]})
        rendered = tok.apply_chat_template(structured(messages), tools=TOOL_SCHEMAS, tokenize=False)
        assert tok.decode(r.prompt_ids + r.completion_ids) == rendered.rstrip("\n")
        env_text = tok.decode([t for t, m in zip(r.completion_ids, r.env_mask, strict=True) if m == 0])
        assert env_text.count("<tool_response>") == 4  # four tool results, all masked as environment tokens


def _config(cls, tmp_path, **kw):
    return cls(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        num_generations=2,
        learning_rate=1e-3,
        **CPU_ARGS,
        max_steps=1,
        disable_dropout=True,
        **kw,
    )


def test_agent_grpo_smoke_step_with_tool_env(tiny_model_folder, tmp_path):
    from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

    trainer = AgentGRPOTrainer(
        model=tiny_model_folder,
        args=_config(AgentGRPOConfig, tmp_path, max_completion_length=16, max_turn_tokens=4, max_turns=2),
        train_dataset=Dataset.from_list(make_rows("train", 1, seed=5)),
        env_factory=lambda row: ToolEnv(ShopTools),
    )
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 1 and math.isfinite(losses[0])


def test_runs_unchanged_in_trls_own_tool_loop(tiny_tokenizer, tiny_model_folder, tmp_path):
    """GRPOTrainer(environment_factory=ShopTools): reset(**row) with the JSON task, tools called, get_reward scored.
    A test-only subclass forces the shop expert's tool calls in place of the random model's samples."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    tok = copy.deepcopy(tiny_tokenizer)
    tok.response_template = copy.deepcopy(qwen3_template)

    class ExpertGRPO(GRPOTrainer):
        def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
            out = []
            for ids in prompt_ids:
                instruction = tok.decode(ids).split("Instruction: ", 1)[1].split("<|im_end|>", 1)[0]
                env = next(e for e in self.environments if e._env.task["instruction"] == instruction)
                out.append(tok(expert_turn(env), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
            return out, None  # as TRL's transformers path: no sampling log-probs

    rows = make_rows("train", 2, seed=5)
    # with this 400-word BPE the schemas alone take about 1000 tokens; TRL rolls back tool results past the model's
    # context, so widen it (the scripted turns never run the model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder, max_position_embeddings=4096)
    trainer = ExpertGRPO(
        model=model,
        processing_class=tok,
        args=_config(GRPOConfig, tmp_path, max_completion_length=1500, max_tool_calling_iterations=6),
        train_dataset=Dataset.from_list(rows),
        environment_factory=ShopTools,
    )
    inputs = [dict(r) for r in rows for _ in range(2)]
    torch.manual_seed(0)
    out = generation_batch(trainer, inputs)  # stock GRPOTrainer: its generation batch through the TRL boundary
    assert [env.get_reward() for env in trainer.environments] == [1.0] * 4
    mask = out["completion_mask"] * out["tool_mask"]  # (B, T) model tokens
    starts = (mask[:, 1:] > mask[:, :-1]).sum(1) + mask[:, 0]
    assert starts.tolist() == [5] * 4  # search, click, choose, buy, final answer
