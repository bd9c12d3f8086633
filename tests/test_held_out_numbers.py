"""Issue 39: a dataset's held-out success threshold is a field, eval_samples reaches a dataset's held-out evaluation
with pass@k and pass^k, and the held-out numbers reach the tracker. Expected values by hand."""

import json

import pytest
import torch

import train
from agent_trl.evaluation import held_out_logs, prompt_metrics, prompt_outcomes


def test_success_is_every_reward_positive_unless_a_threshold_is_set():
    scores = torch.tensor([[1.0, 0.5], [0.6, 0.0], [0.6, float("nan")]], dtype=torch.float64)  # (N, F)
    weights = torch.tensor([1.0, 1.0], dtype=torch.float64)
    success, reward = prompt_outcomes(scores, weights)
    assert success.tolist() == [True, False, False]  # a 0 and a None fail
    assert reward.tolist() == pytest.approx([1.5, 0.6, 0.6])  # None counts 0
    assert prompt_outcomes(scores, weights, threshold=1.0)[0].tolist() == [True, False, False]
    assert prompt_outcomes(scores, weights, threshold=0.6)[0].tolist() == [True, True, True]
    partial = torch.tensor([[0.6]], dtype=torch.float64)  # partial credit of a reward in [0, 1]
    one = torch.tensor([1.0], dtype=torch.float64)
    assert prompt_outcomes(partial, one)[0].tolist() == [True]  # read as a success by default
    assert prompt_outcomes(partial, one, threshold=1.0)[0].tolist() == [False]


def test_several_completions_per_prompt_give_pass_at_k_and_pass_hat_k():
    # 3 prompts x 2 completions, row-major; successes [1, 0], [1, 1], [0, 0]
    scores = torch.tensor([[1.0], [0.0], [1.0], [1.0], [0.0], [0.0]], dtype=torch.float64)
    out = prompt_metrics(scores, torch.tensor([1.0], dtype=torch.float64), [lambda **k: None], samples=2)
    assert out["success"] == pytest.approx(3 / 6)
    assert out["pass@2"] == pytest.approx(2 / 3)  # prompts 0 and 1 solved at least once
    assert out["pass^2"] == pytest.approx(1 / 3)  # prompt 1 solved both times
    assert "pass@1" not in prompt_metrics(scores, torch.tensor([1.0], dtype=torch.float64), [lambda **k: None])


def test_held_out_logs_are_flat_numbers():
    summary = {"before": {"sampled": {"success": 0.25, "pass^2": 0.0}}, "after": {"greedy": {"reward": 2.0}}}
    assert held_out_logs(summary) == {
        "held_out/before/sampled/success": 0.25,
        "held_out/before/sampled/pass^2": 0.0,
        "held_out/after/greedy/reward": 2.0,
    }
    assert held_out_logs({"model": "tiny"}) == {}


def test_a_dataset_run_samples_its_held_out_prompts_and_tells_the_tracker(tmp_path, monkeypatch, tiny_model_folder):
    """`--eval_samples 2` on a dataset: the sampled held-out numbers cover 2 completions per prompt (pass@2, pass^2);
    `--success_threshold` is read; with `report_to: tensorboard` the event file holds the held-out numbers."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rows = [{"prompt": [{"role": "user", "content": f"say {w}"}], "answer": w} for w in ["apple", "river"] * 10]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    argv = ["--dataset_name", str(data), "--reward_funcs", "exact_match_reward", "--model_name_or_path"]
    argv += [tiny_model_folder, "--num_eval_tasks", "4", "--eval_samples", "2", "--success_threshold", "1.0"]
    argv += ["--output_dir", str(out), "--max_steps", "1", "--per_device_train_batch_size", "4"]
    argv += ["--num_generations", "2", "--max_completion_length", "4", "--logging_steps", "1", "--save_strategy"]
    argv += ["no", "--report_to", "tensorboard", "--use_cpu", "true"]
    argv += ["--bf16", "false", "--seed", "0"]
    summary = train.main(argv)
    for when in ("before", "after"):
        sampled = summary[when]["sampled"]
        assert {"pass@2", "pass^2"} <= set(sampled)
        assert sampled["pass^2"] <= sampled["success"] <= sampled["pass@2"]
        assert "pass@2" not in summary[when]["greedy"]  # one greedy completion per prompt
    assert summary["run"]["success_threshold"] == 1.0
    tags = set()  # the trainer's writer closes when training ends; the held-out numbers may open a second file
    for events in out.rglob("events.out.tfevents.*"):
        tags |= set(EventAccumulator(str(events)).Reload().Tags()["scalars"])
    assert "train/loss" in tags
    assert {"eval/held_out/before/sampled/success", "eval/held_out/after/greedy/reward"} <= tags
