"""The no-signal guard (AgentGRPOConfig.max_unscorable_frac): a run whose rollouts keep coming back without a reward
stops, after saving a checkpoint, with an error naming the numbers, instead of training on nothing."""

from __future__ import annotations

import json

import pytest

import train
from tests.judge_server import JudgeServer, error

BASE = ["--environment", "shop", "--model_name_or_path", "tiny:shop", "--tiny_sft_steps", "1"]
BASE += ["--tiny_num_demos", "32", "--num_train_tasks", "16", "--skip_eval", "true"]
BASE += ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_turns", "2", "--max_turn_tokens", "8"]
BASE += ["--max_completion_length", "64", "--logging_steps", "1", "--report_to", "none", "--use_cpu", "true"]
BASE += ["--bf16", "false", "--seed", "0", "--max_steps", "6"]

CALLS: list[int] = []


def never_scored(completions, **kwargs) -> list[None]:
    """A reward source that is always down."""
    return [None] * len(completions)


def down_for_two_batches(completions, **kwargs) -> list[float | None]:
    """None for the first two generation batches, then 1.0: a reward source that recovers."""
    CALLS.append(1)
    return [None if len(CALLS) <= 2 else 1.0] * len(completions)


def test_a_reward_that_never_comes_stops_the_run_after_saving(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    argv = [*BASE, "--reward_funcs", "tests.test_guard.never_scored", "--output_dir", str(out)]
    with pytest.raises(SystemExit, match=r"3 generation batches in a row .* \(100%, 100%, 100%\).*never_scored"):
        train.main(argv)
    # batches were generated before steps 1, 2 and 3: the third came after two optimizer steps, saved there
    assert (out / "checkpoint-2" / "trainer_state.json").exists()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"]["reason"] == "no reward signal" and summary["stopped"]["step"] == 2
    logged = [row["reward/unscorable_frac"] for row in summary["log_history"] if "reward/unscorable_frac" in row]
    assert logged == [1.0, 1.0]  # the two steps trained before the stop, each logged truthfully


def test_a_reward_source_that_recovers_does_not_stop_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    CALLS.clear()
    out = tmp_path / "run"
    argv = [*BASE, "--reward_funcs", "tests.test_guard.down_for_two_batches", "--output_dir", str(out)]
    summary = train.main(argv)
    logged = [row["reward/unscorable_frac"] for row in summary["log_history"] if "reward/unscorable_frac" in row]
    assert logged == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0] and "stopped" not in summary


def test_draco_against_a_judge_that_fails_every_call_stops(tmp_path, monkeypatch):
    """The worst case of a hostile probe: DRACO with an API judge that answers every request with an error. The
    endpoint is reachable (so the start-up check passes), every rubric call fails, every rollout is unscorable, and the
    run stops instead of training on rewards of 0."""
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("GUARD_TEST_KEY", "sk-guard")
    out = tmp_path / "run"
    with JudgeServer(default=lambda body: error(500)) as server:
        judge = ["--judge_backend", "openai", "--judge_model", "m", "--judge_base_url", server.base_url]
        judge += ["--judge_api_key_env", "GUARD_TEST_KEY", "--judge_max_retries", "0", "--judge_timeout", "5"]
        with pytest.raises(SystemExit, match="without a reward"):
            train.main([*BASE, "--trainer", "draco", *judge, "--output_dir", str(out)])
        assert server.model_probes == 1 and len(server.requests) > 0
    summary = json.loads((out / "summary.json").read_text())
    rates = [row["draco/unscorable_rate"] for row in summary["log_history"] if "draco/unscorable_rate" in row]
    assert rates and all(r == 1.0 for r in rates)  # logged truthfully (it used to say 0.0)
