"""`agent_trl.resume`, called directly: which checkpoint `resume_from_checkpoint` names, whether a checkpoint is
complete, the signal callback's stop at a generation-batch boundary, and the process-group teardown
(tests/test_resume.py runs them through `train.main`, a real SIGTERM and a real `kill -9` included)."""

import json
import logging
import os
import signal
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl

from agent_trl.resume import StopOnSignal, checkpoint_complete, close_process_group, resume_checkpoint


def checkpoint(folder, state: str | None = "{}"):
    """A checkpoint folder; `state` is its trainer_state.json text (None: not written)."""
    folder.mkdir(parents=True)
    if state is not None:
        (folder / "trainer_state.json").write_text(state)
    return str(folder)


@pytest.mark.parametrize(
    ("state", "complete"),
    [("{}", True), (json.dumps({"global_step": 4}), True), (None, False), ('{"global_st', False), ("[1, 2]", False)],
)
def test_checkpoint_complete(tmp_path, state, complete):
    """Written to the end: trainer_state.json (the trainer's last file) exists and is a JSON object."""
    assert checkpoint_complete(checkpoint(tmp_path / "checkpoint-4", state)) is complete


def config(tmp_path, **fields) -> SimpleNamespace:
    base = dict(resume_from_checkpoint=None, output_dir=str(tmp_path), save_strategy="no", save_steps=500,
                steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1)  # fmt: skip
    return SimpleNamespace(**{**base, **fields})


@pytest.mark.parametrize("value", [None, False, ""])
def test_no_value_is_a_fresh_run(tmp_path, value):
    checkpoint(tmp_path / "checkpoint-2")  # present, but not asked for
    assert resume_checkpoint(config(tmp_path, resume_from_checkpoint=value)) is None


@pytest.mark.parametrize("value", ["true", "True", True])
def test_true_picks_the_latest_complete_checkpoint(tmp_path, caplog, value):
    for step in (2, 10):
        checkpoint(tmp_path / f"checkpoint-{step}")
    checkpoint(tmp_path / "checkpoint-12", state=None)  # killed while saving
    checkpoint(tmp_path / "checkpoint-x")  # not checkpoint-<number>
    (tmp_path / "checkpoint-20").write_text("a file")  # not a folder
    with caplog.at_level(logging.WARNING, logger="agent_trl.resume"):
        found = resume_checkpoint(config(tmp_path, resume_from_checkpoint=value))
    assert found == str(tmp_path / "checkpoint-10")  # by step number: 10 after 2 (as text, "2" > "10")
    assert [r.getMessage() for r in caplog.records] == [
        f"resume_from_checkpoint: skipping {tmp_path / 'checkpoint-12'}, an incomplete checkpoint (no readable "
        "trainer_state.json)"
    ]


@pytest.mark.parametrize("made", [False, True])
def test_true_without_a_complete_checkpoint_stops(tmp_path, made):
    out = tmp_path / "run"
    if made:
        checkpoint(out / "checkpoint-2", state=None)
    with pytest.raises(SystemExit) as err:
        resume_checkpoint(config(tmp_path, output_dir=str(out), resume_from_checkpoint="true"))
    assert err.value.code == (
        f"error: resume_from_checkpoint true, but output_dir {str(out)!r} holds no complete checkpoint-N folder"
    )


def test_a_path_must_be_a_complete_checkpoint_folder(tmp_path):
    good = checkpoint(tmp_path / "anywhere" / "checkpoint-7")
    assert resume_checkpoint(config(tmp_path, resume_from_checkpoint=good)) == good
    half = checkpoint(tmp_path / "half", state=None)
    with pytest.raises(SystemExit) as err:
        resume_checkpoint(config(tmp_path, resume_from_checkpoint=half))
    assert err.value.code == (
        f"error: resume_from_checkpoint {half!r} is not a complete checkpoint (no readable trainer_state.json)"
    )
    nowhere = str(tmp_path / "nowhere")
    with pytest.raises(SystemExit) as err:
        resume_checkpoint(config(tmp_path, resume_from_checkpoint=nowhere))
    assert err.value.code == f"error: resume_from_checkpoint {nowhere!r} is not a folder"


@pytest.mark.parametrize(
    ("fields", "suggested"),
    [
        # 4 steps_per_generation x 1 iteration / 2 accumulation = 2 optimizer steps a batch; 3 -> 2 x round(1.5) = 4
        (dict(steps_per_generation=4, gradient_accumulation_steps=2, save_steps=3), 4),
        (dict(steps_per_generation=2, save_steps=1), 2),  # 2 x max(1, round(0.5) = 0)
        (dict(steps_per_generation=2, num_iterations=3, save_steps=10), 12),  # 6 a batch: 6 x round(10 / 6 = 1.67)
    ],
)
def test_checkpoints_inside_a_generation_batch_are_refused(tmp_path, fields, suggested):
    with pytest.raises(SystemExit, match=f"cannot resume exactly; use save_steps {suggested}$"):
        resume_checkpoint(config(tmp_path, save_strategy="steps", **fields))


@pytest.mark.parametrize(
    "fields",
    [
        dict(save_strategy="steps", steps_per_generation=2, save_steps=4),  # on a boundary
        dict(save_strategy="steps", steps_per_generation=2, gradient_accumulation_steps=2, save_steps=3),  # 1 a batch
        dict(save_strategy="epoch", steps_per_generation=2, save_steps=3),  # save_steps unused
    ],
)
def test_checkpoints_on_batch_boundaries_pass(tmp_path, fields):
    assert resume_checkpoint(config(tmp_path, **fields)) is None


def step_end(stop: StopOnSignal, step: int) -> TrainerControl:
    return stop.on_step_end(None, SimpleNamespace(global_step=step), TrainerControl())


def test_a_requested_stop_waits_for_the_batch_boundary():
    stop = StopOnSignal(per_batch=2)
    control = step_end(stop, 2)
    assert not control.should_save and not control.should_training_stop  # no signal yet
    stop.requested = "SIGTERM"
    control = step_end(stop, 3)  # inside a batch
    assert not control.should_save and not control.should_training_stop
    control = step_end(stop, 4)
    assert control.should_save and control.should_training_stop


def test_the_first_signal_asks_the_second_stops_now(capsys):
    stop = StopOnSignal(per_batch=1)
    stop._handle(signal.SIGINT, None)
    assert stop.requested == "SIGINT"
    assert "SIGINT: stopping at the next generation-batch boundary with a checkpoint" in capsys.readouterr().out
    with pytest.raises(KeyboardInterrupt):
        stop._handle(signal.SIGTERM, None)
    assert stop.requested == "SIGINT"


def test_handlers_are_installed_inside_and_restored_after():
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with StopOnSignal(per_batch=1) as stop:
        assert signal.getsignal(signal.SIGTERM) == stop._handle and signal.getsignal(signal.SIGINT) == stop._handle
        os.kill(os.getpid(), signal.SIGTERM)  # the real signal, caught by the handler
        assert stop.requested == "SIGTERM"
    assert {sig: signal.getsignal(sig) for sig in before} == before


@pytest.mark.parametrize(("initialized", "calls"), [(False, []), (True, ["barrier", "destroy"])])
def test_close_process_group_waits_for_every_rank_then_destroys(monkeypatch, initialized, calls):
    seen = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.distributed, "barrier", lambda: seen.append("barrier"))
    monkeypatch.setattr(torch.distributed, "destroy_process_group", lambda: seen.append("destroy"))
    close_process_group()
    assert seen == calls


def test_checkpoints_are_the_numbered_folders_in_order(tmp_path):
    from agent_trl.resume import checkpoints

    for name in ("checkpoint-10", "checkpoint-2", "checkpoint-x", "other"):
        (tmp_path / name).mkdir()
    (tmp_path / "checkpoint-3").write_text("a file, not a checkpoint")
    assert checkpoints(str(tmp_path)) == [str(tmp_path / "checkpoint-2"), str(tmp_path / "checkpoint-10")]
    assert checkpoints(str(tmp_path / "missing")) == []
