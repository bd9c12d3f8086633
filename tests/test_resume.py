"""Resuming a train.py run: `resume_from_checkpoint` (a path, or `true` for the latest complete checkpoint) continues
the run where the checkpoint left it, so the steps after it log what the uninterrupted run logged; bad values stop
before any model is built."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from agent_trl import resume, run_info

BASE = ["--trainer", "grpo", "--environment", "shop", "--model_name_or_path", "tiny:shop"]
BASE += ["--tiny_sft_steps", "1", "--tiny_num_demos", "32", "--num_train_tasks", "16", "--skip_eval", "true"]
BASE += ["--per_device_train_batch_size", "4", "--num_generations", "2", "--max_turns", "2", "--max_turn_tokens", "8"]
BASE += ["--max_completion_length", "64", "--learning_rate", "1e-2", "--lr_scheduler_type", "constant"]
BASE += ["--logging_steps", "1", "--report_to", "none", "--use_cpu", "true", "--bf16", "false"]
BASE += ["--activation_checkpointing", "false", "--seed", "0", "--max_steps", "4"]
BASE += ["--reward_funcs", "tests.test_resume.varied_reward"]  # a signal in every group: the steps really update


def varied_reward(completions, **kwargs) -> list[float]:
    """A reward that differs between the rollouts of a group (the tiny build of one SFT step rarely buys anything)."""
    return [float(len(str(c)) % 5) for c in completions]


SAVE = ["--save_strategy", "steps", "--save_steps", "2"]


def steps_of(out) -> dict[int, dict]:
    log = json.loads((out / "summary.json").read_text())["log_history"]
    return {row["step"]: row for row in log if "loss" in row}


@pytest.mark.parametrize(
    "method",
    [
        ["--trainer", "grpo"],  # one optimizer step per generation batch
        ["--trainer", "ppo", "--steps_per_generation", "2"],  # a value head, two steps per batch: save_steps 2 is a
    ],  # batch boundary
    ids=["grpo", "ppo"],
)
def test_resumed_run_logs_what_the_uninterrupted_run_logged(tmp_path, monkeypatch, caplog, method):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train.main([*BASE, *SAVE, *method, "--output_dir", str(whole)])
    assert (whole / "checkpoint-2" / "trainer_state.json").exists()
    # the run "was killed" after its step-2 checkpoint, and again while writing a later one (no trainer_state.json)
    shutil.copytree(whole / "checkpoint-2", resumed / "checkpoint-2")
    (resumed / "checkpoint-3").mkdir()
    with caplog.at_level("WARNING", logger="agent_trl.resume"):
        train.main([*BASE, *SAVE, *method, "--output_dir", str(resumed), "--resume_from_checkpoint", "true"])
    assert any("checkpoint-3" in r.getMessage() and "incomplete" in r.getMessage() for r in caplog.records)
    before, after = steps_of(whole), steps_of(resumed)
    state = json.loads((resumed / "checkpoint-2" / "trainer_state.json").read_text())
    assert [row["step"] for row in state["log_history"] if "loss" in row] == [1, 2]  # what the checkpoint carried
    assert sorted(after) == [1, 2, 3, 4]  # its history, then the steps the resumed run played
    # steps 1-2 were not played again: their wall-clock step times are the checkpoint's, which a replay (the old
    # behaviour, resume_from_checkpoint ignored) would have measured anew
    assert [after[s]["step_time"] for s in (1, 2)] == [before[s]["step_time"] for s in (1, 2)]
    for step in (3, 4):  # the same rollouts (sampler RNG restored) and the same updates
        keys = [k for k, v in before[step].items() if isinstance(v, float) and not k.endswith(("_time", "runtime"))]
        assert {"loss", "grad_norm"} <= set(keys) and before[step]["grad_norm"] > 0  # the step changed the model
        for key in keys:  # every logged number but timings
            assert after[step][key] == pytest.approx(before[step][key], rel=1e-6, abs=1e-9), (step, key)
    assert any("env/success" in before[step] and "env/success" in after[step] for step in (3, 4))  # rollouts compared


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--resume_from_checkpoint", "/no/such/checkpoint"], "resume_from_checkpoint '/no/such/checkpoint' is not a"),
        (["--resume_from_checkpoint", "true"], "holds no complete checkpoint-N folder"),
        # 2 optimizer steps per generation batch: a checkpoint after step 3 would sit inside a batch
        (["--steps_per_generation", "2", "--save_strategy", "steps", "--save_steps", "3"], "use save_steps 4"),
    ],
)
def test_bad_resume_settings_stop_before_any_model_is_built(tmp_path, monkeypatch, extra, needle):
    monkeypatch.setattr(run_info, "tiny_model", lambda *a, **k: pytest.fail("built a model before checking resume"))
    with pytest.raises(SystemExit, match=needle):
        train.main([*BASE, "--output_dir", str(tmp_path / "run"), *extra])


def test_a_folder_without_trainer_state_is_not_a_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(run_info, "tiny_model", lambda *a, **k: pytest.fail("built a model before checking resume"))
    (tmp_path / "half").mkdir()
    with pytest.raises(SystemExit, match="is not a complete checkpoint"):
        train.main([*BASE, "--output_dir", str(tmp_path / "run"), "--resume_from_checkpoint", str(tmp_path / "half")])


@pytest.mark.parametrize(
    ("method", "stops_at"),
    [(["--trainer", "grpo"], 1), (["--trainer", "ppo", "--steps_per_generation", "2"], 2)],
    ids=["grpo", "ppo"],
)
def test_sigterm_stops_at_a_batch_boundary_with_a_checkpoint(tmp_path, monkeypatch, method, stops_at):
    """SIGTERM during step 1 stops at the first generation-batch boundary (step 1 for GRPO, step 2 for PPO with two
    steps per batch), with a complete checkpoint there, a summary that says so and no held-out evaluation after; the
    run's signal handlers are put back afterwards."""
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    step_end = resume.StopOnSignal.on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # the real signal, through the handler main installed
        return step_end(self, args, state, control, **kwargs)

    monkeypatch.setattr(resume.StopOnSignal, "on_step_end", on_step_end)
    before = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "run"
    summary = train.main([*BASE, *method, "--output_dir", str(out), "--skip_eval", "false", "--num_eval_tasks", "2"])
    assert signal.getsignal(signal.SIGTERM) is before
    assert summary["interrupted"] == {"signal": "SIGTERM", "step": stops_at, "exit_status": 128 + 15}
    assert summary["checkpoint"] == str(out / f"checkpoint-{stops_at}")
    assert (out / f"checkpoint-{stops_at}" / "trainer_state.json").exists()
    assert "before" in summary and "after" not in summary
    assert max(steps_of(out)) == stops_at  # no step after the boundary


def test_the_command_exits_with_the_signals_status(monkeypatch):
    """A scheduler tells a stopped run from a finished one by the status: 128 + the signal's number, as a shell
    reports it (SIGINT 2 -> 130, SIGTERM 15 -> 143); a finished run exits 0."""
    for name, status in (("SIGINT", 130), ("SIGTERM", 143)):
        summary = {"interrupted": {"signal": name, "exit_status": status}}
        monkeypatch.setattr(train, "main", lambda s=summary: s)
        with pytest.raises(SystemExit) as err:
            train.cli()
        assert err.value.code == status == train.exit_status(name)
    monkeypatch.setattr(train, "main", lambda: {"after": {}})
    assert train.cli() is None


def test_a_second_signal_stops_at_once_with_a_summary(tmp_path, monkeypatch, capsys):
    """Two SIGTERMs in step 1: the second stops at once (KeyboardInterrupt), and the run still writes summary.json,
    says where to resume from, and exits 143 without a traceback."""
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    step_end = resume.StopOnSignal.on_step_end

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)  # the second: stop now
        return step_end(self, args, state, control, **kwargs)

    monkeypatch.setattr(resume.StopOnSignal, "on_step_end", on_step_end)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as err:
        train.main([*BASE, "--output_dir", str(out)])
    assert err.value.code == 143
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] == {"signal": "SIGTERM", "step": 1, "exit_status": 143, "at_once": True}
    assert "stopped at once by a second signal at step 1" in capsys.readouterr().out


KILLED_RUN = """
import os, signal, sys
import train
from transformers import Trainer

save = Trainer.save_model

def killed_while_saving(self, output_dir=None, *args, **kwargs):
    out = save(self, output_dir, *args, **kwargs)
    if output_dir and output_dir.endswith("checkpoint-4"):  # the model of checkpoint-4 is on disk, the rest never
        os.kill(os.getpid(), signal.SIGKILL)                 # will be: optimizer, scheduler, trainer state
    return out

Trainer.save_model = killed_while_saving
train.main(sys.argv[1:])
"""


@pytest.mark.parametrize(
    "method",
    [["--trainer", "grpo"], ["--trainer", "ppo", "--steps_per_generation", "2"]],
    ids=["grpo", "ppo"],
)
def test_kill_9_while_saving_then_resume_logs_what_the_uninterrupted_run_logged(tmp_path, monkeypatch, method):
    """A real SIGKILL of a train.py process, in the middle of writing its step-4 checkpoint (model written, optimizer
    not): `resume_from_checkpoint true` skips the half-written checkpoint-4, resumes from checkpoint-2, and steps 3-6
    log what an uninterrupted run logged."""
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    argv = [*BASE, *SAVE, *method, "--max_steps", "6"]
    train.main([*argv, "--output_dir", str(whole)])  # also builds the tiny default the killed run reuses
    repo = Path(train.__file__).resolve().parent
    env = {**os.environ, "AGENT_TRL_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    env["OMP_NUM_THREADS"] = str(torch.get_num_threads())  # as this process: other thread counts round differently
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_RUN, *argv, "--output_dir", str(killed)], cwd=repo, env=env, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL
    assert (killed / "checkpoint-4" / "model.safetensors").exists()  # half written: the model, nothing after it
    assert not (killed / "checkpoint-4" / "trainer_state.json").exists() and not (killed / "summary.json").exists()
    train.main([*argv, "--output_dir", str(killed), "--resume_from_checkpoint", "true"])
    before, after = steps_of(whole), steps_of(killed)
    assert sorted(after) == [1, 2, 3, 4, 5, 6]
    for step in (3, 4, 5, 6):
        keys = [k for k, v in before[step].items() if isinstance(v, float) and not k.endswith(("_time", "runtime"))]
        assert before[step]["grad_norm"] > 0  # the step changed the model
        assert set(keys) <= set(after[step])  # alarms included: the monitors' memory came back with the checkpoint
        for key in keys:
            assert after[step][key] == pytest.approx(before[step][key], rel=1e-6, abs=1e-9), (step, key)


def test_resuming_reuses_the_stored_start_and_loads_the_tied_head_quietly(tmp_path, monkeypatch, capsys, caplog):
    """Issue 65: a resumed run measured the held-out start again (minutes on a real model), and transformers said
    "There were missing keys in the checkpoint model loaded: ['lm_head.weight']" for the tiny model, whose head is
    tied to its embeddings and saved once. Now the interrupted run's stored start is reused and the message is gone."""
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    evaluated = []
    held_out = train.held_out
    monkeypatch.setattr(train, "held_out", lambda *a, **k: evaluated.append(1) or held_out(*a, **k))
    first = [*BASE, *SAVE, "--output_dir", str(out), "--skip_eval", "false", "--num_eval_tasks", "2"]
    start = train.main([*first, "--max_steps", "2"])["before"]
    assert len(evaluated) == 2  # before and after
    with caplog.at_level("WARNING"):
        resumed = train.main([*first, "--max_steps", "4", "--resume_from_checkpoint", "true"])
    assert len(evaluated) == 3  # after only
    assert resumed["before"] == start and "measured by the interrupted run" in capsys.readouterr().out
    assert not any("missing keys" in r.getMessage() for r in caplog.records)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out)  # the premise: a model whose head is its embeddings
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
