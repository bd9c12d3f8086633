"""Serving an exported model with `transformers serve`, offline, on a free loopback port: the shipped tiny shop agent
(envs/shipped/) is exported, served, and answers a chat completion through the `openai` client with the tokens that
local greedy generation gives; `python -m agent_trl.play` against it plays the same greedy episodes as the agent loop
does in-process (trainers/agent_loop.py `play`). Skipped only when the `transformers serve` command is missing."""

from __future__ import annotations

import openai
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from agent_trl.export import export
from agent_trl.play import play_episode
from agent_trl.served import serve
from envs.shop import ShopEnv
from envs.tiny import shipped_build
from trainers.agent_loop import LoopSettings, play
from trainers.generation import hf_generate

TURN_TOKENS = 24  # the quickstart's max_turn_tokens


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base_url, exported folder) of `transformers serve` running on the exported tiny shop agent
    (agent_trl/served.py, as a run's `serve_model` starts it)."""
    folder = export(str(shipped_build()), str(tmp_path_factory.mktemp("serve") / "agent"))
    log = tmp_path_factory.mktemp("serve-log") / "serve.log"
    try:
        with serve(str(folder), log_path=log) as endpoint:
            yield endpoint.base_url, folder
    except SystemExit as e:
        if "No such command 'serve'" in str(e) or "needs the `transformers` command" in str(e):
            pytest.skip("the `transformers serve` command is missing from this transformers")
        raise


def test_a_chat_completion_is_local_greedy_generation(served):
    base_url, folder = served
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    messages = [{"role": "user", "content": ShopEnv().reset(ShopEnv.make_tasks("eval", 1)[0])}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=TURN_TOKENS, do_sample=False)
    expected = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert expected.startswith("search[")  # the agent's first move, so the comparison below is not of empty text
    with openai.OpenAI(base_url=base_url, api_key="EMPTY", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(
            model=str(folder), messages=messages, max_tokens=TURN_TOKENS, temperature=0
        )
    assert reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == ids["input_ids"].shape[1]  # the same chat template, rendered by the server


def test_play_against_the_server_plays_the_agent_loops_greedy_episodes(served):
    base_url, folder = served
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tasks = ShopEnv.make_tasks("eval", 3, seed=0, difficulty=0)
    settings = LoopSettings(max_turn_tokens=TURN_TOKENS, max_completion_length=10_000)  # play counts no episode budget
    local = play(
        hf_generate(model, tokenizer, do_sample=False), tokenizer, [ShopEnv() for _ in tasks], tasks, None, settings
    )
    assert len({r.success for r in local}) == 2  # these three tasks hold a won and a lost episode
    for i, rollout in enumerate(local):
        record = play_episode(base_url, "shop", task_index=i, max_turn_tokens=TURN_TOKENS, echo=False)
        assert record["model"] == str(folder)  # the server's only model
        assert [t["action"] for t in record["transcript"]] == [t["action"] for t in rollout.transcript]
        assert record["success"] == rollout.success and record["reward"] == rollout.env_reward
