"""`python -m agent_trl.evaluate` (`agent_trl.evaluate.main`): the pass@k / pass^k estimators by hand and by their
invariants; a run trained here for 2 steps (and its checkpoint) evaluated through the command, its numbers checked
against each other, against the transcripts and against train.py's held-out evaluation; a LoRA adapter folder
against its merged model; a single-turn dataset; the quickstart config with a `tiny:` name; the start-up errors.

`CoinEnv` gives the random tiny model (tests/conftest.py) about even odds per turn, so successes vary between the
samples of a task and the pass curves are not trivially 0 or 1."""

from __future__ import annotations

import json
import random

import pytest
import torch
from conftest import WORDS
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

import train
from agent_trl import evaluate as command
from agent_trl.evaluate import k_values, pass_at_k, pass_curves, pass_hat_k
from agent_trl.evaluation import held_out
from envs.base import Env

ENV = "tests.test_evaluate_command:CoinEnv"
SMALL = ["--max_turn_tokens", "6", "--max_completion_length", "48", "--use_cpu", "true", "--bf16", "false"]
SMALL += ["--report_to", "none", "--seed", "0"]
EVAL = ["--environment", ENV, "--num_eval_tasks", "6", "--samples", "4", "--eval_batch_size", "12", *SMALL]


class CoinEnv(Env):
    """Up to two turns; a turn succeeds when the action has an even number of characters."""

    name, max_turns = "coin", 2

    def reset(self, task):
        self.turn = 0
        return f"say {task['word']}"

    def step(self, action):
        self.turn += 1
        hit = len(action.strip()) % 2 == 0
        done = hit or self.turn == 2
        return ("" if done else "say again"), float(hit), done, {"success": hit}

    @classmethod
    def make_tasks(cls, split, n, seed=0, difficulty=0):
        return [{"task_id": f"{split}-{i}", "word": WORDS[(i + 5 * (split == "eval")) % len(WORDS)]} for i in range(n)]


def even_length(completions, **kwargs) -> list[float]:
    """1 for a completion of even length (a reward the random model earns about half the time)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(len(t) % 2 == 0) for t in texts]


# --------------------------------------------------------------------------------------------------------------------
# The estimators


def test_estimators_by_hand():
    # n = 4, c = 2: pass@2 = 1 - C(2,2)/C(4,2) = 1 - 1/6 = 5/6; pass^2 = C(2,2)/C(4,2) = 1/6;
    # pass@4 = 1 - C(2,4)/C(4,4) = 1 (C(2,4) = 0); pass^4 = C(2,4)/1 = 0; k = 1: c/n = 1/2 for both
    assert [pass_at_k(4, 2, k) for k in (1, 2, 4)] == pytest.approx([1 / 2, 5 / 6, 1.0])
    assert [pass_hat_k(4, 2, k) for k in (1, 2, 4)] == pytest.approx([1 / 2, 1 / 6, 0.0])
    # n = 8, c = 3: pass@2 = 1 - C(5,2)/C(8,2) = 1 - 10/28 = 9/14; pass^2 = C(3,2)/C(8,2) = 3/28
    assert pass_at_k(8, 3, 2) == pytest.approx(9 / 14) and pass_hat_k(8, 3, 2) == pytest.approx(3 / 28)
    assert pass_at_k(5, 0, 3) == 0.0 and pass_hat_k(5, 5, 3) == 1.0 and pass_hat_k(5, 2, 3) == 0.0
    assert k_values(1) == [1] and k_values(4) == [1, 2, 4] and k_values(6) == [1, 2, 4, 6] and k_values(8)[-1] == 8
    # tasks with 2, 0 and 4 successes of 4: pass@2 = (5/6 + 0 + 1)/3, pass^2 = (1/6 + 0 + 1)/3
    curves = pass_curves([2, 0, 4], 4)
    assert curves["pass@k"]["2"] == pytest.approx((5 / 6 + 1) / 3) and curves["pass^k"]["2"] == pytest.approx(7 / 18)
    assert list(curves["pass@k"]) == ["1", "2", "4"] and curves["pass^k"]["1"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_estimator_invariants():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 12)
        c = rng.randint(0, n)
        at = [pass_at_k(n, c, k) for k in range(1, n + 1)]
        hat = [pass_hat_k(n, c, k) for k in range(1, n + 1)]
        assert at[0] == pytest.approx(c / n) and hat[0] == pytest.approx(c / n)  # k = 1: the success rate
        assert all(a <= b + 1e-12 for a, b in zip(at, at[1:], strict=False))  # pass@k rises with k
        assert all(a >= b - 1e-12 for a, b in zip(hat, hat[1:], strict=False))  # pass^k falls
        assert all(h <= c / n + 1e-12 <= a + 2e-12 for a, h in zip(at, hat, strict=True))
        # "at least one of k succeeds" is "not all k fail": pass@k(c) = 1 - pass^k(n - c)
        assert at == pytest.approx([1 - pass_hat_k(n, n - c, k) for k in range(1, n + 1)])


# --------------------------------------------------------------------------------------------------------------------
# A trained run, its checkpoint, a LoRA adapter, a dataset, a tiny name


@pytest.fixture(scope="module")
def trained_run(tiny_model_folder, tmp_path_factory):
    """The random tiny model trained 2 GRPO steps on CoinEnv; saved at the end and as checkpoint-2."""
    out = tmp_path_factory.mktemp("coin-run")
    argv = ["--environment", ENV, "--model_name_or_path", tiny_model_folder, "--output_dir", str(out)]
    argv += ["--num_train_tasks", "8", "--skip_eval", "true", "--max_steps", "2", "--per_device_train_batch_size"]
    argv += ["4", "--num_generations", "2", "--learning_rate", "1e-3", "--save_strategy", "steps", "--save_steps"]
    argv += ["2", "--logging_steps", "1", "--activation_checkpointing", "false", *SMALL]
    train.main(argv)
    return out


def test_a_trained_run_evaluated_through_the_command(trained_run):
    result = command.main(["--model", str(trained_run), *EVAL])
    out = trained_run / "evaluation"  # the default: <model folder>/evaluation
    written = json.loads((out / "evaluation.json").read_text())
    assert written["sampled"] == result["sampled"] and written["model"] == str(trained_run)
    assert written["settings"]["samples"] == 4 and written["settings"]["ks"] == [1, 2, 4]
    assert written["versions"]["trl"] == "1.16.0" and written["run"]["num_eval_tasks"] == 6
    assert (out / "evaluation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    sampled, greedy = written["sampled"], written["greedy"]
    assert set(sampled) == {"success", "reward", "pass^4", "pass@4", "turns", "pass@k", "pass^k", "tasks", "episodes"}
    assert sampled["tasks"] == 6 and sampled["episodes"] == 24 and greedy["episodes"] == 6
    at, hat = list(sampled["pass@k"].values()), list(sampled["pass^k"].values())
    assert at[0] == pytest.approx(sampled["success"]) == hat[0]  # pass@1 = pass^1 = sampled success
    assert at == sorted(at) and hat == sorted(hat, reverse=True) and hat[-1] == pytest.approx(sampled["pass^4"])
    assert 0.0 < sampled["success"] < 1.0 and at[-1] > hat[-1]  # successes vary between samples (CoinEnv)
    assert 1.0 <= sampled["turns"] <= 2.0 and greedy["pass@k"] == {"1": greedy["success"]}

    lines = [json.loads(line) for line in (out / "transcripts.jsonl").read_text().splitlines()]
    assert [(r["mode"], r["task_index"], r["sample"]) for r in lines] == [
        ("sampled", i, s) for i in range(6) for s in range(4)
    ] + [("greedy", i, 0) for i in range(6)]
    for r in lines:  # each line's numbers are its own turns'
        assert r["turns"] == len(r["transcript"]) and r["reward"] == sum(t["reward"] for t in r["transcript"])
        assert r["success"] == (r["reward"] > 0) and r["first_observation"].startswith("say ")
        assert all(len(t["action"].strip()) % 2 == (not t["reward"]) for t in r["transcript"])
    counts = [sum(r["success"] for r in lines[4 * i : 4 * i + 4]) for i in range(6)]
    assert [t["successes"] for t in written["per_task"]] == counts
    assert [t["greedy_success"] for t in written["per_task"]] == [r["success"] for r in lines[24:]]
    assert pass_curves(counts, 4) == {"pass@k": sampled["pass@k"], "pass^k": sampled["pass^k"]}
    assert sampled["success"] == pytest.approx(sum(counts) / 24)
    assert sampled["reward"] == pytest.approx(sum(r["reward"] for r in lines[:24]) / 24)

    # train.py's held-out evaluation of the same model with the same seed gives the same numbers
    args, run, config, model_args = command.parse(["--model", str(trained_run), *EVAL])
    run.eval_samples = 4
    sources = command.load_sources(run, config)
    model = AutoModelForCausalLM.from_pretrained(trained_run)
    tokenizer = AutoTokenizer.from_pretrained(trained_run, padding_side="left")
    set_seed(config.seed)
    held = held_out(model, tokenizer, sources, run, config)
    assert held["sampled"] == {k: sampled[k] for k in held["sampled"]}
    assert held["greedy"] == {k: greedy[k] for k in held["greedy"]}

    # the checkpoint of the last step holds the same weights: the same greedy episodes
    from_checkpoint = command.main(["--model", str(trained_run / "checkpoint-2"), *EVAL, "--out", str(out / "ckpt")])
    assert from_checkpoint["greedy"] == greedy and from_checkpoint["sampled"] == sampled


def test_a_lora_adapter_equals_its_merged_model(tiny_model_folder, tmp_path):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)  # random A and B (init_lora_weights=False): the adapter changes the model
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_folder), config)
    peft_model.save_pretrained(tmp_path / "adapter")  # no tokenizer: the base's is used
    peft_model.merge_and_unload().save_pretrained(tmp_path / "merged")
    AutoTokenizer.from_pretrained(tiny_model_folder).save_pretrained(tmp_path / "merged")
    adapter = command.main(["--model", str(tmp_path / "adapter"), *EVAL])
    merged = command.main(["--model", str(tmp_path / "merged"), *EVAL])
    assert adapter["adapter_base"] == tiny_model_folder and merged["adapter_base"] is None
    episodes = {f: (tmp_path / f / "evaluation" / "transcripts.jsonl").read_text() for f in ("adapter", "merged")}
    assert episodes["adapter"] == episodes["merged"]  # the same sampled (same seed) and greedy episodes
    assert adapter["sampled"] == merged["sampled"] and adapter["greedy"] == merged["greedy"]
    command.main(["--model", tiny_model_folder, *EVAL, "--no_greedy", "--out", str(tmp_path / "base")])
    sampled = [line for line in episodes["adapter"].splitlines() if '"mode": "sampled"' in line]
    assert (tmp_path / "base" / "transcripts.jsonl").read_text().splitlines() != sampled  # the adapter was applied


def test_a_single_turn_dataset(tiny_model_folder, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"say {w}"}], "answer": w, "task_id": w} for w in WORDS * 3]
    (tmp_path / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["--dataset_name", str(tmp_path / "words.jsonl"), "--reward_funcs", f"{ENV.split(':')[0]}.even_length"]
    argv += ["--model", tiny_model_folder, "--num_eval_tasks", "5", "--samples", "3", "--out", str(tmp_path / "ev")]
    result = command.main([*argv, "--eval_batch_size", "4", *SMALL])
    lines = [json.loads(line) for line in (tmp_path / "ev" / "transcripts.jsonl").read_text().splitlines()]
    assert len(lines) == 5 * 3 + 5 and result["sampled"]["episodes"] == 15 and result["environment"] is None
    for r in lines:  # success = every reward function positive
        assert r["success"] == (r["rewards"]["even_length"] > 0) == (len(r["transcript"][0]["action"]) % 2 == 0)
    sampled = result["sampled"]
    assert sampled["success"] == pytest.approx(sum(r["success"] for r in lines[:15]) / 15) == sampled["pass@k"]["1"]
    assert sampled["rewards/even_length"] == pytest.approx(sampled["reward"]) and sampled["turns"] == 1.0
    assert list(sampled["pass@k"]) == ["1", "2", "3"] and result["per_task"][0]["task_id"] == lines[0]["task_id"]


def test_the_quickstart_config_with_a_tiny_name(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))  # the shipped tiny:shop is copied there
    argv = ["--config", "configs/quickstart.yaml", "--model", "tiny:shop", "--num_eval_tasks", "2", "--samples", "2"]
    result = command.main([*argv, "--max_turns", "3", "--no_greedy", "--out", str(tmp_path / "ev")])
    assert result["environment"] == "shop" and "greedy" not in result and result["sampled"]["episodes"] == 4
    assert result["model_folder"].startswith(str(tmp_path / "cache")) and result["sampled"]["turns"] <= 3
    assert all((tmp_path / "ev" / f).exists() for f in command.FILES)


# --------------------------------------------------------------------------------------------------------------------
# Start-up errors


def test_start_up_errors(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "run" / "checkpoint-3").mkdir(parents=True)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{")
    for name, base in (("gone", str(tmp_path / "gone-base")), ("hub", "nobody-here/absent-model")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": base}))
    env = ["--environment", "shop", *SMALL]
    cases = [
        (["--model", str(tmp_path / "missing"), *env], "does not exist"),
        (["--model", str(tmp_path / "run"), *env], "has no config.json .* give one, e.g. .*checkpoint-3"),
        (["--model", str(tmp_path / "broken"), *env], "config.json cannot be read"),
        (["--model", str(tmp_path / "gone"), *env], "its base model '.*gone-base' cannot be found offline"),
        (["--model", str(tmp_path / "hub"), *env], "base model 'nobody-here/absent-model' cannot be found offline"),
        (["--model", "tiny:nowhere", *env], "no tiny default for 'nowhere'"),
        (["--model", "tiny:shop", *SMALL], "nothing to evaluate on"),
        (["--model", "tiny:shop", "--environment", "none", *SMALL], "nothing to evaluate on"),
        (["--model", "tiny:shop", "--samples", "0", *env], "--samples must be >= 1, got 0"),
        (["--model", "tiny:shop", "--samples", "-2", *env], "--samples must be >= 1, got -2"),
        (["--model", "tiny:shop", "--eval_samples", "0", *env], "eval_samples must be >= 1, got 0"),
        (env, "give the model to evaluate"),
    ]
    monkeypatch.setattr(command, "load_sources", lambda *a: pytest.fail("got past the start-up checks"))
    for argv, needle in cases:
        with pytest.raises(SystemExit, match=needle):
            command.main(argv)
