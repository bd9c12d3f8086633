"""`system_prompt`: one system message before every prompt a run trains and evaluates on (a dataset's text or chat
prompts, an environment's first observation), in the held-out episodes as in training, and in `play`."""

import json
from types import SimpleNamespace

import torch
from conftest import EchoEnv
from transformers import AutoModelForCausalLM

from agent_trl.arguments import RunArguments
from agent_trl.evaluation import play_tasks
from agent_trl.sources import load_sources
from trainers.agent_loop import with_system

SYSTEM = "Reply with one word."


def config(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"max_completion_length": 64, "reward_weights": None, **fields})


def test_with_system_puts_one_system_message_first():
    system = {"role": "system", "content": SYSTEM}
    assert with_system("2 + 2?", SYSTEM) == [system, {"role": "user", "content": "2 + 2?"}]
    chat = [{"role": "system", "content": "old"}, {"role": "user", "content": "hi"}]
    chat.append({"role": "assistant", "content": "a"})
    assert with_system(chat, SYSTEM) == [system, *chat[1:]]  # the old one replaced
    assert chat[0]["content"] == "old"  # the caller's list is not changed
    assert with_system([], SYSTEM) == [system]
    assert with_system("2 + 2?", None) == "2 + 2?" and with_system(chat, None) is chat


def test_a_dataset_trains_and_is_held_out_with_it(tmp_path):
    data = tmp_path / "mixed.jsonl"
    rows = [{"prompt": f"say {i}", "answer": str(i)} for i in range(10)]  # text prompts
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = RunArguments(dataset_name=str(data), reward_funcs=["exact_match_reward"], num_eval_tasks=2)
    run.system_prompt = SYSTEM
    sources = load_sources(run, config())
    prompts = [*sources.train["prompt"], *(r["prompt"] for r in sources.eval_rows)]
    assert len(prompts) == 10
    for prompt in prompts:  # every text prompt became a chat of the system message and the text as the user's
        assert prompt[0] == {"role": "system", "content": SYSTEM}
        assert prompt[1]["role"] == "user" and prompt[1]["content"].startswith("say ") and len(prompt) == 2
    assert sorted(p[1]["content"] for p in prompts) == sorted(r["prompt"] for r in rows)
    without = load_sources(RunArguments(dataset_name=str(data), reward_funcs=["exact_match_reward"]), config())
    assert isinstance(without.train[0]["prompt"], str)  # unset: the prompts as the file has them


def test_an_environments_rows_and_held_out_episodes_get_it(tiny_tokenizer, tiny_model_folder):
    run = RunArguments(environment="shop", num_train_tasks=3, num_eval_tasks=1, system_prompt=SYSTEM)
    sources = load_sources(run, config())
    first = json.loads(sources.train[0]["task"])
    observation = sources.environment.factory(first).first_observation(first)
    assert sources.train[0]["prompt"] == [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": observation},
    ]
    # held out: the episodes' prompt is the system message and the first observation, rendered by the chat template
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder, dtype=torch.float32)
    tasks = EchoEnv.make_tasks("eval", 2)
    (with_it, _), (plain, _) = (
        play_tasks(model, tiny_tokenizer, EchoEnv, tasks, samples=1, progress=False, system_prompt=system)
        for system in (SYSTEM, None)
    )
    assert with_it.prompt_messages == [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "say "
                                       + tasks[0]["words"][0]}]  # fmt: skip
    assert plain.prompt_messages == [{"role": "user", "content": "say " + tasks[0]["words"][0]}]
    system_ids = tiny_tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}], add_generation_prompt=False, tokenize=False
    )
    assert tiny_tokenizer.decode(with_it.prompt_ids).startswith(system_ids)
    assert not tiny_tokenizer.decode(plain.prompt_ids).startswith(system_ids)
