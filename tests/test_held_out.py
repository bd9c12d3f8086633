"""`agent_trl.evaluation.held_out`: what the before/after evaluation hands to `agent_trl.evaluation.evaluate` (with an
environment) or `evaluate_prompts` (single-turn), sampled and greedy (the evaluators themselves:
tests/test_evaluate.py)."""

from types import SimpleNamespace

import pytest

from agent_trl import evaluation
from agent_trl.evaluation import held_out
from trainers.agent_loop import LoopSettings

CONFIG = SimpleNamespace(max_completion_length=96, max_turn_tokens=24, max_turns=3, reward_weights=[1.0, 0.5],
                         temperature=0.7, top_p=0.9, top_k=None)  # fmt: skip
RUN = SimpleNamespace(eval_batch_size=5, eval_samples=4, success_threshold=None, system_prompt="Be brief.")


@pytest.fixture
def calls(monkeypatch) -> list:
    """Each evaluator call as (name, args, kwargs); a call returns its mode, so the result shows which went where."""
    seen = []

    def recorder(name):
        def call(*args, **kwargs):
            seen.append((name, args, kwargs))
            return "greedy" if kwargs.get("greedy") else "sampled"

        return call

    monkeypatch.setattr(evaluation, "evaluate", recorder("evaluate"))
    monkeypatch.setattr(evaluation, "evaluate_prompts", recorder("evaluate_prompts"))
    return seen


def test_a_dataset_is_scored_by_its_reward_functions(calls):
    rows, funcs = [{"prompt": "1+1=", "answer": "2"}], [len]
    sources = SimpleNamespace(environment=None, eval_rows=rows, reward_funcs=funcs)
    assert held_out("model", "tokenizer", sources, RUN, CONFIG) == {"sampled": "sampled", "greedy": "greedy"}
    shared = {"max_new_tokens": 96, "batch_size": 5, "reward_weights": [1.0, 0.5], "success_threshold": None}
    sampling = {"temperature": 0.7, "top_p": 0.9, "top_k": 0}  # top_k None -> 0 (no top-k)
    assert calls == [
        ("evaluate_prompts", ("model", "tokenizer", rows, funcs), {**sampling, "samples": 4, **shared}),
        ("evaluate_prompts", ("model", "tokenizer", rows, funcs), {"greedy": True, **shared}),
    ]  # eval_samples completions per prompt when sampled, one greedy


def test_an_environment_plays_eval_samples_episodes_a_task(calls):
    built = []
    environment = SimpleNamespace(factory=lambda row: built.append(row) or "env")
    tasks = [{"words": ["apple"]}]
    sources = SimpleNamespace(environment=environment, eval_rows=tasks, reward_funcs=None)
    assert held_out("model", "tokenizer", sources, RUN, CONFIG) == {"sampled": "sampled", "greedy": "greedy"}
    (name, args, sampled), (_, greedy_args, greedy) = calls
    assert name == "evaluate" and args[:2] == greedy_args[:2] == ("model", "tokenizer")
    assert args[3] == greedy_args[3] == tasks
    settings = LoopSettings(max_turn_tokens=24, max_completion_length=96, max_turns=3)
    shared = {"settings": settings, "batch_size": 5, "system_prompt": "Be brief."}  # the run's system prompt
    assert sampled == {"temperature": 0.7, "samples": 4, **shared}
    assert greedy == {"greedy": True, **shared}
    assert args[2]() == "env" and built == [{}]  # the factory builds from an empty row: the task comes at reset
