"""train.py end to end: one ordinary `train.main` run, offline, on a tiny default built small (1 SFT step on 32
demonstrations, a few seconds), 2 GRPO steps, held-out evaluation before and after, and the run folder it leaves:
summary.json, curves.png and the trained policy.

The 1-step agent earns no reward from the shop, so the run also gives `distinct_chars` (below, by import path as a
user would): the reward then varies inside the groups, the gradient is not 0 and the saved policy is a trained one."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import train
from agent_trl import curves


def distinct_chars(completions, **kwargs) -> list[float]:
    """A reward that differs between rollouts of an untrained agent: the share of distinct characters.

    >>> distinct_chars(["aab", "abc"])
    [0.5, 0.75]
    """
    return [len(set(c)) / (1 + len(c)) for c in completions]


def test_train_main_writes_summary_curves_and_model(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = ["--trainer", "grpo", "--environment", "shop", "--model_name_or_path", "tiny:shop"]
    argv += ["--reward_funcs", "trainers.base.env_reward", "tests.test_train_run.distinct_chars"]  # summed
    argv += ["--tiny_sft_steps", "1", "--tiny_num_demos", "32"]  # a weak agent, built in seconds
    argv += ["--num_train_tasks", "8", "--num_eval_tasks", "3", "--eval_samples", "2", "--eval_batch_size", "6"]
    argv += ["--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "4"]
    argv += ["--num_generations", "2", "--max_turns", "2", "--max_turn_tokens", "8", "--max_completion_length", "64"]
    argv += ["--learning_rate", "1e-3", "--lr_scheduler_type", "constant", "--weight_decay", "0.5"]
    argv += ["--logging_steps", "1", "--save_strategy", "no", "--report_to", "none"]
    argv += ["--use_cpu", "true", "--bf16", "false", "--activation_checkpointing", "false", "--seed", "0"]
    summary = train.main(argv)

    (built,) = (tmp_path / "cache" / "tiny").glob("tiny-shop-*")  # built into AGENT_TRL_CACHE
    written = json.loads((out / "summary.json").read_text())
    assert written["model"] == "tiny:shop" and written["trainer"] == "grpo" and written["run"]["tiny_sft_steps"] == 1
    assert written["before"] == summary["before"] and written["after"] == summary["after"]
    for when in ("before", "after"):
        sampled, greedy = written[when]["sampled"], written[when]["greedy"]
        assert set(sampled) == {"success", "reward", "pass^2", "pass@2", "turns"}  # 2 sampled episodes per task
        assert set(greedy) == {"success", "reward", "pass^1", "turns"}  # greedy: one episode per task
        # 3 tasks x 2 episodes: success is a multiple of 1/6; pass^2 <= success <= pass@2; greedy pass^1 = success
        assert 0.0 <= sampled["pass^2"] <= sampled["success"] <= sampled["pass@2"] <= 1.0
        assert greedy["pass^1"] == greedy["success"]
        assert abs(sampled["success"] * 6 - round(sampled["success"] * 6)) < 1e-9
        assert 1.0 <= sampled["turns"] <= 2.0 and 1.0 <= greedy["turns"] <= 2.0  # max_turns 2
    # one generation batch of 4 rollouts (2 tasks x 2) per optimizer step: 4 rows x 1 step per batch
    assert written["rollouts_per_step"] == 4.0
    steps = [row for row in written["log_history"] if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    for row in steps:
        assert math.isfinite(row["loss"]) and 0.0 <= row["env/success"] <= 1.0 and 1.0 <= row["env/turns"] <= 2.0
        assert {"env/truncated", "env/errors"} <= set(row)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # `python -m agent_trl.curves` draws the same picture again from the stored summary alone
    (again := tmp_path / "again").mkdir()
    (again / "summary.json").write_text((out / "summary.json").read_text())
    assert curves.main([str(again)]) == [again / "curves.png"]
    assert (again / "curves.png").read_bytes() == (out / "curves.png").read_bytes()
    model = AutoModelForCausalLM.from_pretrained(out)  # the saved policy reloads
    assert model.config.hidden_size == 128 and (out / "tokenizer.json").exists()
    # The saved weights are the trained ones: the reward varies inside the groups, so a step has a gradient, and
    # every weight moved by more than AdamW's decoupled weight decay alone would move it (2 steps at lr 1e-3, wd 0.5
    # scale each decayed weight by (1 - 5e-4)^2; biases and norm weights are not decayed, transformers' decay groups).
    assert all(row["frac_reward_zero_std"] < 1.0 for row in steps)  # some group of each step has varied rewards
    assert all(math.isfinite(row["grad_norm"]) for row in steps) and any(row["grad_norm"] > 0 for row in steps)
    start, saved = load_file(built / "model.safetensors"), load_file(out / "model.safetensors")
    assert sorted(saved) == sorted(start)
    for name, w in start.items():
        decayed = name.endswith(".weight") and "norm" not in name
        decay_only = w.double() * (1 - 1e-3 * 0.5) ** 2 if decayed else w.double()
        moved = not torch.allclose(saved[name].double(), decay_only, rtol=1e-6, atol=0.0)
        assert moved, f"{name}: saved weights are the built ones {'decayed' if decayed else 'unchanged'}"
