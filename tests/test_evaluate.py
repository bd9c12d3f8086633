"""`agent_trl.evaluation.evaluate`, which produces every held-out number train.py reports: success, reward, pass^k and
turns over `samples` episodes per task, counted here by hand for a scripted policy on the echo environment; and on
the tiny model, greedy evaluation is deterministic."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from conftest import EchoEnv
from transformers import AutoModelForCausalLM

from agent_trl import evaluation
from agent_trl.evaluation import evaluate
from trainers.agent_loop import LoopSettings

# distinct first words, so each task's first context is its own
TASKS = [
    {"task_id": "t0", "words": ["apple", "river", "stone"]},
    {"task_id": "t1", "words": ["cloud", "amber", "maple"]},
    {"task_id": "t2", "words": ["delta", "orbit", "river"]},
    {"task_id": "t3", "words": ["pearl", "quartz", "apple"]},
    {"task_id": "t4", "words": ["stone", "cloud", "delta"]},
]
SETTINGS = LoopSettings(max_turn_tokens=16, max_completion_length=256)


class ScriptedBackend:
    """Stands in for `hf_generate`: each episode answers the word its last observation asks for, or "nothing" where
    the script says so. Greedy misses "river". Sampling misses "apple", and misses turn 0 on every second sight of the
    same first context when the first word is "cloud" or "delta" (one of the two episodes of those tasks)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, model, tokenizer, temperature: float = 1.0, do_sample: bool = True, **kwargs):
        self.calls.append({"temperature": temperature, "do_sample": do_sample})
        sights: Counter = Counter()

        def generate(contexts: list[list[int]], max_new_tokens: int) -> list[tuple]:
            out = []
            for context in contexts:
                text = tokenizer.decode(context)
                asked = re.findall(r"say (\w+)", text)
                word, turn = asked[-1], len(asked) - 1
                miss = word == ("apple" if do_sample else "river")
                if do_sample and turn == 0:
                    sights[text] += 1
                    miss |= asked[0] in ("cloud", "delta") and sights[text] % 2 == 0
                ids = tokenizer("nothing" if miss else word, add_special_tokens=False)["input_ids"]
                ids = ids + [tokenizer.eos_token_id]
                assert len(ids) <= max_new_tokens
                out.append((ids, [0.0] * len(ids)))
            return out

        return generate


@pytest.fixture
def tiny_model(tiny_model_folder):
    return AutoModelForCausalLM.from_pretrained(tiny_model_folder)


def test_evaluate_counts_success_reward_and_pass_k(tiny_model, tiny_tokenizer, monkeypatch):
    backend = ScriptedBackend()
    monkeypatch.setattr(evaluation, "hf_generate", backend)
    tiny_model.train()
    kw = dict(settings=SETTINGS, progress=False)
    # batches of 3 split the two episodes of t1 and of t4 across generate calls
    sampled = evaluate(tiny_model, tiny_tokenizer, EchoEnv, TASKS, temperature=0.7, samples=2, batch_size=3, **kw)
    greedy = evaluate(tiny_model, tiny_tokenizer, EchoEnv, TASKS, greedy=True, batch_size=2, **kw)
    assert backend.calls == [{"temperature": 0.7, "do_sample": True}, {"temperature": 1.0, "do_sample": False}]
    assert tiny_model.training  # evaluation puts the model back in the mode it found it in
    # Echo: per-turn reward 1 on a match, done after the 3rd word, success = all 3 matched.
    # Sampled, 2 episodes per task (hits, success):
    #   t0 misses apple on turn 0 -> (2, no), (2, no)      t1 first word cloud -> (3, yes), (2, no)
    #   t2 first word delta -> (3, yes), (2, no)           t3 misses apple on turn 2 -> (2, no), (2, no)
    #   t4 -> (3, yes), (3, yes)
    # success 4/10; pass^2 counts tasks solved in both episodes: t4 only, 1/5; pass@2 those solved in at least one:
    # t1, t2, t4, 3/5; reward (4+5+5+4+6)/10 = 2.4
    assert sampled == pytest.approx({"success": 0.4, "reward": 2.4, "pass^2": 0.2, "pass@2": 0.6, "turns": 3.0})
    # Greedy misses river: t0 (hits 2) and t2 (hits 2) fail, t1, t3, t4 succeed (3 each):
    # success 3/5, pass^1 = success, reward (2+3+2+3+3)/5 = 2.6
    assert greedy == pytest.approx({"success": 0.6, "reward": 2.6, "pass^1": 0.6, "turns": 3.0})


def test_greedy_evaluation_of_the_tiny_model_is_deterministic(tiny_model, tiny_tokenizer, monkeypatch):
    played: list = []
    real_play = evaluation.play
    monkeypatch.setattr(evaluation, "play", lambda *a, **k: played.append(real_play(*a, **k)) or played[-1])
    tasks = EchoEnv.make_tasks("eval", 6)

    def run(seed: int, **kw) -> tuple[dict, list]:
        played.clear()
        torch.manual_seed(seed)
        result = evaluate(tiny_model, tiny_tokenizer, EchoEnv, tasks, settings=SETTINGS, progress=False, **kw)
        return result, [r for chunk in played for r in chunk]

    first, rollouts = run(1, greedy=True, temperature=1.0)
    second, again = run(2, greedy=True, temperature=0.3)  # greedy decoding reads neither the seed nor the temperature
    assert [r.sampled_ids for r in rollouts] == [r.sampled_ids for r in again] and first == second
    _, sampled_1 = run(1, temperature=1.0)
    _, sampled_2 = run(2, temperature=1.0)
    assert [r.sampled_ids for r in sampled_1] != [r.sampled_ids for r in sampled_2]  # sampling does read the seed
    # greedy is the argmax: the first turn of each episode, decoded here one token at a time without the loop
    for r in rollouts:
        want: list[int] = []
        while len(want) < SETTINGS.max_turn_tokens and tiny_tokenizer.eos_token_id not in want:
            with torch.no_grad():
                want.append(int(tiny_model(torch.tensor([r.prompt_ids + want])).logits[0, -1].argmax()))
        assert r.sampled_ids[: len(want)] == want
    assert first["turns"] == 3.0  # echo ends after its 3rd word whatever is said; the budget allows 3 turns
    assert 0.0 <= first["success"] == first["pass^1"] <= 1.0 and 0.0 <= first["reward"] <= 3.0
