"""A user's own dataset, rewards and environment through train.py: the commands that used to fail, end to end on a
random tiny model (offline, a few seconds each), and the single-turn held-out evaluation checked by hand."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import WORDS
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from agent_trl.evaluation import evaluate_prompts

RUN = ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2"]
RUN += ["--learning_rate", "1e-3", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]
RUN += ["--use_cpu", "true", "--bf16", "false", "--activation_checkpointing", "false", "--seed", "0"]
RUN += ["--eval_batch_size", "4"]

USER_CODE = '''
from envs.base import Env


def says_word(completions, word, **kwargs):
    """1 when the completion contains the row's word."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(w in t) for t, w in zip(texts, word)]


class Repeat:
    """Duck-typed: repeat the word; one turn."""

    def reset(self, task):
        self.word = task["word"]
        return f"say {self.word}"

    def step(self, action):
        right = action.strip() == self.word
        return "", float(right), True, {"success": right}
'''


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_code.py").write_text(textwrap.dedent(USER_CODE))
    rows = [{"prompt": [{"role": "user", "content": f"say {w}"}], "word": w, "answer": w} for w in WORDS * 3]
    (tmp_path / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_dataset_with_reward_import_path_trains_single_turn(workdir, tiny_model_folder):
    """The issue's failing command: --dataset_name FILE --reward_funcs module.function (plus a named reward)."""
    out = workdir / "run"
    argv = ["--dataset_name", "words.jsonl", "--reward_funcs", "my_code.says_word", "exact_match_reward"]
    argv += ["--reward_weights", "1.0", "0.5", "--model_name_or_path", tiny_model_folder, "--output_dir", str(out)]
    argv += ["--max_completion_length", "6", "--num_eval_tasks", "4", *RUN]
    summary = train.main(argv)
    written = json.loads((out / "summary.json").read_text())
    assert (
        written["data"]
        == "words.jsonl: 26 training rows, 4 held-out rows (4 rows held out of 'train' (no 'test' split))"
    )
    for when in ("before", "after"):
        for mode in ("sampled", "greedy"):
            scores = written[when][mode]
            assert set(scores) == {"success", "reward", "rewards/says_word", "rewards/exact_match_reward"}
            # reward = 1.0 x says_word + 0.5 x exact_match, each a mean of 0/1 values over the 4 held-out rows
            expected = scores["rewards/says_word"] + 0.5 * scores["rewards/exact_match_reward"]
            assert math.isclose(scores["reward"], expected, abs_tol=1e-12)
            assert all(abs(v * 8 - round(v * 8)) < 1e-9 for v in scores.values())  # quarters, and halves of them
    steps = [row for row in written["log_history"] if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2] and all("rewards/says_word/mean" in row for row in steps)
    assert written["parameters"]["trainable"] == written["parameters"]["total"] > 0  # full fine-tuning
    assert written["adapter"]["use_peft"] is False and written["versions"]["trl"] == "1.16.0"
    assert summary["after"] == written["after"] and (out / "curves.png").exists()


def test_env_by_import_path_with_tasks_from_a_dataset(workdir, tiny_model_folder):
    """--environment module:Class (duck typed) with its tasks from a dataset's rows; the trainer plays episodes."""
    out = workdir / "run"
    argv = ["--environment", "my_code:Repeat", "--dataset_name", "words.jsonl", "--model_name_or_path"]
    argv += [tiny_model_folder, "--output_dir", str(out), "--max_turn_tokens", "4", "--max_completion_length", "16"]
    argv += ["--num_eval_tasks", "4", *RUN]
    written = train.main(argv)
    assert set(written["after"]["sampled"]) == {"success", "reward", "pass^1", "turns"}
    assert written["after"]["sampled"]["turns"] == 1.0  # Repeat ends every episode after one turn
    steps = [row for row in written["log_history"] if "loss" in row]
    assert all(row["env/turns"] == 1.0 for row in steps)


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--dataset_name", "words.jsonl"], "needs reward_funcs"),
        (
            ["--dataset_name", "words.jsonl", "--reward_funcs", "exact_match_reward", "--trainer", "ppo"],
            "needs an env",
        ),
        (
            ["--dataset_name", "words.jsonl", "--reward_funcs", "exact_match_reward", "--reward_weights", "1", "2"],
            "reward_weights has 2 entries for 1 reward functions",
        ),
        (["--environment", "my_code:Repeat"], "has no task generator"),
        (["--dataset_name", "noprompt.jsonl", "--reward_funcs", "exact_match_reward"], "has no `prompt` column"),
        (["--dataset_name", "words.jsonl", "--reward_funcs", "my_code.nothing"], "has no attribute 'nothing'"),
        (["--report_to", "wandb"], "report_to \\['wandb'\\] is not installed"),
    ],
)
def test_mistakes_stop_before_any_model_is_loaded(workdir, monkeypatch, argv, needle):
    (workdir / "noprompt.jsonl").write_text("".join(json.dumps({"question": w}) + "\n" for w in WORDS))
    monkeypatch.setattr(train, "resolve_model", lambda *a: pytest.fail("loaded a model before validating the input"))
    with pytest.raises(SystemExit, match=needle):
        train.main([*argv, "--output_dir", str(workdir / "run"), "--use_cpu", "true", "--bf16", "false"])


def test_help_lists_every_field(capsys):
    with pytest.raises(SystemExit):
        train.parse(["--trainer", "ppo", "--help"])
    shown = capsys.readouterr().out
    for name in (
        "--dataset_name",
        "--reward_funcs",
        "--environment_kwargs",
        "--max_turn_tokens",
        "--learning_rate",
        "--vf_coef",
        "--lora_r",
        "--load_in_4bit",
        "--num_generations",
    ):
        assert name in shown, name


def test_evaluate_prompts_scores_by_hand(tiny_model_folder):
    """Rewards with known values per row, and the completions they see equal plain greedy generation."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_folder, padding_side="left")
    rows = [
        {"prompt": [{"role": "user", "content": f"say {w}"}], "value": v}
        for w, v in zip(WORDS[:4], [1, 0, 2, None], strict=True)
    ]
    seen = []

    def first(completions, value, **kwargs):
        seen.extend(c[-1]["content"] for c in completions)
        return [None if v is None else float(v) for v in value]

    def second(completions, **kwargs):
        return [0.5] * len(completions)

    scores = evaluate_prompts(
        model,
        tokenizer,
        rows,
        [first, second],
        reward_weights=[2.0, 1.0],
        max_new_tokens=5,
        greedy=True,
        batch_size=3,
        progress=False,
    )
    # per row: 2 x value (None counts 0) + 0.5 -> 2.5, 0.5, 4.5, 0.5; mean 2.0. success: both > 0 on rows 0 and 2
    assert scores["reward"] == pytest.approx(2.0) and scores["success"] == pytest.approx(0.5)
    assert scores["rewards/first"] == pytest.approx(1.0) and scores["rewards/second"] == pytest.approx(0.5)
    expected = []
    for row in rows:  # one prompt at a time: no padding, the reference a user would write
        ids = tokenizer.apply_chat_template(
            row["prompt"], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        with torch.no_grad():
            new = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append(tokenizer.decode(new[0, ids.shape[1] :], skip_special_tokens=True))
    assert seen == expected


def test_tiny_default_for_a_dataset_is_cached_and_warm_started_on_its_answers(tmp_path, monkeypatch):
    import envs.tiny as tiny

    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    chats = [{"prompt": [{"role": "user", "content": f"say {w}"}], "answer": w} for w in WORDS * 2]
    texts = [{"prompt": f"say {w}:", "completion": w} for w in WORDS * 2]
    captured = {}
    real_build = tiny.build_and_save

    def spy(spec, tokenizer, demos, folder):
        captured[folder.name] = demos
        real_build(spec, tokenizer, demos, folder)

    monkeypatch.setattr(tiny, "build_and_save", spy)
    small = dict(sft_steps=2, hidden_size=32, intermediate_size=64, sft_batch_size=4)
    clean = tiny.tiny_dataset_model(chats, noise=0.0, **small)
    demos = captured[Path(clean).name]
    # noise 0: each row trained on its own answer, as a chat ending in the assistant's answer
    assert [d["messages"] for d in demos] == [
        [*r["prompt"], {"role": "assistant", "content": r["answer"]}] for r in chats
    ]
    noisy = tiny.tiny_dataset_model(chats, noise=1.0, **small)  # every answer swapped for a row's answer
    swapped = [d["messages"][-1]["content"] for d in captured[Path(noisy).name]]
    assert noisy != clean and set(swapped) <= set(WORDS)
    # each drawn from all 20 answers (10 words, twice each): it differs from its own row's with probability 0.9, so
    # about 18 of 20 differ; fewer than 10 would have probability below 1e-5
    assert sum(a != r["answer"] for a, r in zip(swapped, chats, strict=True)) >= 10
    plain = tiny.tiny_dataset_model(texts, noise=0.0, **small)  # text prompts: prompt and completion
    assert captured[Path(plain).name] == [{"prompt": r["prompt"], "completion": r["completion"]} for r in texts]
    # cached: the same rows and settings come back from the cache without a build
    monkeypatch.setattr(tiny, "build_and_save", lambda *a: pytest.fail("rebuilt a cached model"))
    assert tiny.tiny_dataset_model(chats, noise=0.0, **small) == clean
    tokenizer = AutoTokenizer.from_pretrained(clean)
    assert tokenizer.apply_chat_template(chats[0]["prompt"], add_generation_prompt=True, tokenize=False).endswith(
        "<|im_start|>assistant\n"
    )
    assert AutoModelForCausalLM.from_pretrained(clean).config.hidden_size == 32


def test_train_with_the_tiny_default_of_a_dataset(workdir, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(workdir / "cache"))
    argv = ["--dataset_name", "words.jsonl", "--reward_funcs", "exact_match_reward", "--model_name_or_path", "tiny"]
    argv += ["--tiny_sft_steps", "2", "--max_completion_length", "4", "--num_eval_tasks", "4"]
    argv += ["--output_dir", str(workdir / "run"), *RUN]
    summary = train.main(argv)
    assert summary["model"] == "tiny" and list((workdir / "cache" / "tiny").glob("tiny-dataset-*"))
    assert set(summary["after"]["greedy"]) == {"success", "reward", "rewards/exact_match_reward"}
    # `tiny` with an environment is the environment's own tiny default, and Repeat has no expert to build it from
    with pytest.raises(SystemExit, match="Repeat has none. To train on it, give your class an expert, as envs.base"):
        train.main(
            [
                "--environment",
                "my_code:Repeat",
                "--dataset_name",
                "words.jsonl",
                "--model_name_or_path",
                "tiny",
                "--output_dir",
                str(workdir / "run2"),
                "--use_cpu",
                "true",
                "--bf16",
                "false",
            ]
        )


def test_quickstart_config_with_a_dataset(workdir, tiny_model_folder):
    """The issue's command: the quickstart config (environment: shop) plus a dataset of prompts. The shop cannot start
    an arithmetic row, and the error says so at start-up; `--environment none` trains the prompts single-turn."""
    config = str(Path(__file__).resolve().parents[1] / "configs" / "quickstart.yaml")
    argv = ["--config", config, "--dataset_name", "words.jsonl", "--reward_funcs", "my_code.says_word"]
    argv += ["--model_name_or_path", tiny_model_folder, "--output_dir", str(workdir / "run")]
    with pytest.raises(SystemExit, match="environment 'shop' cannot start the first task .*environment: none"):
        train.main(argv)
    small = ["--max_steps", "1", "--per_device_train_batch_size", "4", "--num_generations", "2"]
    small += ["--max_completion_length", "4", "--num_eval_tasks", "4", "--eval_batch_size", "4"]
    summary = train.main([*argv, "--environment", "none", *small])
    assert summary["run"]["environment"] is None and "rewards/says_word" in summary["after"]["sampled"]


def test_lora_run_reports_its_adapter_and_tensorboard_logs(workdir, tiny_model_folder, capsys):
    out = workdir / "run"
    argv = ["--dataset_name", "words.jsonl", "--reward_funcs", "exact_match_reward", "--model_name_or_path"]
    argv += [tiny_model_folder, "--output_dir", str(out), "--max_completion_length", "4", "--num_eval_tasks", "4"]
    argv += ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--lora_target_modules", "q_proj", "v_proj"]
    argv += [*RUN, "--report_to", "tensorboard", "--skip_eval"]  # the last --report_to given wins
    summary = train.main(argv)
    p = summary["parameters"]
    # LoRA on q_proj and v_proj of 2 layers, r = 4: A (r x in) + B (out x r) per module; hidden 32, kv heads 2 x 8
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(tiny_model_folder)
    head = c.hidden_size // c.num_attention_heads
    q = 4 * c.hidden_size + c.hidden_size * 4
    v = 4 * c.hidden_size + (c.num_key_value_heads * head) * 4
    assert p["trainable"] == c.num_hidden_layers * (q + v) and p["total"] > p["trainable"]
    assert summary["adapter"]["use_peft"] is True and summary["adapter"]["lora_r"] == 4
    assert f"trainable parameters: {p['trainable']:,} of {p['total']:,}" in capsys.readouterr().out
    assert list(out.rglob("events.out.tfevents*"))  # the tracker wrote its log


@pytest.mark.parametrize(
    "argv",
    [
        ["--num_train_tasks", "0"],
        ["--num_eval_tasks", "0"],
        ["--dataset_name", "words.jsonl", "--reward_funcs", "exact_match_reward", "--num_train_tasks", "0"],
    ],
)
def test_no_training_on_nothing(workdir, argv):
    with pytest.raises(SystemExit, match="must .*>= 1"):
        train.main([*argv, "--output_dir", str(workdir / "run"), "--use_cpu", "true", "--bf16", "false"])
