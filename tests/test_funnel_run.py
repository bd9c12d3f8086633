"""`agent_trl.funnel_run`: the Funnel's run path reports in summary.json what every run reports (held-out after,
wall seconds, rollouts per step, log history) plus the loop's own result, with the loop and the evaluation stubbed
(the real loop end to end: tests/test_funnel_trainer.py)."""

import json
import time
from types import SimpleNamespace

import pytest

import trainers.funnel_loop
from agent_trl import funnel_run
from agent_trl.funnel_run import run_funnel_report


@pytest.fixture
def loop(monkeypatch) -> list:
    """The loop's calls; it returns its result (history, rollouts, log_history) and the final policy."""
    calls = []

    def run_funnel(run, config, model_args, sources, model_path, tokenizer):
        calls.append(model_path)
        result = {"history": [{"kind": "state"}], "rollouts": {"total": 16}, "log_history": [{"step": 1, "loss": 0.5}]}
        return result, "policy"

    monkeypatch.setattr(trainers.funnel_loop, "run_funnel", run_funnel)
    monkeypatch.setattr(funnel_run, "held_out", lambda model, *a: {"sampled": {"success": 0.5}, "model": model})
    return calls


def test_the_loops_result_goes_into_the_summary(tmp_path, loop, capsys):
    config = SimpleNamespace(output_dir=str(tmp_path), generation_batch_size=8)
    model_args = SimpleNamespace(model_name_or_path="/built/tiny")
    summary = {"model": "tiny:shop", "before": {"sampled": {"success": 0.25}}}
    run = SimpleNamespace(skip_eval=False)
    out = run_funnel_report(run, config, model_args, None, "tokenizer", summary, "tiny:shop", time.time() - 10)
    assert loop == ["/built/tiny"] and out is summary
    assert summary["funnel"] == {"history": [{"kind": "state"}], "rollouts": {"total": 16}}  # log_history on its own
    assert summary["after"] == {"sampled": {"success": 0.5}, "model": "policy"}  # the loop's final policy, state-free
    assert summary["log_history"] == [{"step": 1, "loss": 0.5}]
    assert summary["rollouts_per_step"] == 8  # one generation batch a consolidation step
    assert 10 <= summary["wall_seconds"] < 20
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert "held-out success after the Funnel (state-free): " in capsys.readouterr().out


def test_skip_eval_skips_the_evaluation_after(tmp_path, loop):
    config = SimpleNamespace(output_dir=str(tmp_path), generation_batch_size=8)
    model_args = SimpleNamespace(model_name_or_path="m")
    summary = run_funnel_report(SimpleNamespace(skip_eval=True), config, model_args, None, "t", {}, "m", time.time())
    assert "after" not in summary and set(summary) == {"funnel", "wall_seconds", "rollouts_per_step", "log_history"}
