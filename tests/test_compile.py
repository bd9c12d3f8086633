"""`torch_compile: true` (docs/methods/grpo.md D16): a compiled policy samples the same greedy episodes as the eager
one, gives the same loss and gradient up to float rounding, and trains the same through the trainer.

The compiled tests are marked `slow`: inductor compiles each graph to C++ (tens of seconds per graph on a 2-core
machine, and several graphs per test: prefill, decode, narrowed batches, forward and backward); on the shared 2-core
machine they took 203 s, 46 s and 182 s. Run them with `pytest -m slow tests/test_compile.py`.
"""

from __future__ import annotations

import pytest
import torch

from trainers.agent_loop import LoopSettings, play
from trainers.generation import hf_generate


def shipped_shop_agent():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from envs.tiny import shipped_build

    folder = shipped_build()
    return AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)


def test_growing_layer_length_is_its_keys_length():
    """`GrowingLayer.get_seq_length` reads its int `length` (what lets a compiled forward trace the cache): it equals
    the keys' length after every operation the agent loop makes on the cache."""
    from trainers.trl_api import GrowingLayer

    layer = GrowingLayer()
    assert layer.get_seq_length() == 0
    checks = []
    layer.update(torch.randn(4, 2, 3, 8), torch.randn(4, 2, 3, 8))  # prefill: 3 positions
    checks.append(3)
    for _ in range(5):  # decode steps, past the first doubling of the buffers (room 6)
        layer.update(torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8))
        checks.append(layer.keys.shape[-2])
        assert layer.get_seq_length() == layer.keys.shape[-2]
    layer.narrow(torch.arange(4), torch.tensor([1, 3]), 4, 16)
    layer.update(torch.randn(2, 2, 1, 8), torch.randn(2, 2, 1, 8))
    assert layer.get_seq_length() == layer.keys.shape[-2] == 9
    layer.widen(torch.tensor([1, 3]))
    assert layer.get_seq_length() == layer.keys.shape[-2] == 9
    layer.batch_select_indices(torch.tensor([0, 2]))
    assert layer.get_seq_length() == layer.keys.shape[-2] == 9
    layer.crop(-2)
    assert layer.get_seq_length() == layer.keys.shape[-2] == 7
    assert checks == [3, 4, 5, 6, 7, 8]


@pytest.mark.slow
def test_compiled_decode_loop_plays_the_same_greedy_episodes():
    """The agent loop's own decode loop (`sample_tokens`, KV cache reused across turns, batches narrowed) over the
    compiled shipped shop agent plays the eager model's greedy episodes token for token, with the same sampling
    log-probs up to float rounding, and compiles without a graph break."""
    from envs.shop import ShopEnv

    model, tok = shipped_shop_agent()
    tasks = ShopEnv.make_tasks("eval", 12, seed=0)
    settings = LoopSettings(max_turn_tokens=16, max_completion_length=200)
    eager = play(hf_generate(model, tok, do_sample=False), tok, [ShopEnv() for _ in tasks], tasks, settings=settings)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(model, dynamic=True)
    runs = play(hf_generate(compiled, tok, do_sample=False), tok, [ShopEnv() for _ in tasks], tasks, settings=settings)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) == 0
    assert len({len(r.turn_rewards) for r in eager}) > 1  # episodes of different lengths
    for a, b in zip(eager, runs, strict=True):
        assert a.completion_ids == b.completion_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.slow
def test_compiled_loss_and_gradient_match_eager():
    """The log-prob loss of a right-padded batch of the shipped shop agent and its gradient, through the compiled
    model (as `torch_compile: true` makes TRL's loss call it) and the eager one: equal up to float rounding."""
    model, _ = shipped_shop_agent()
    model.train()
    torch.manual_seed(0)
    ids = torch.randint(5, model.config.vocab_size, (8, 40))  # (B, S)
    mask = torch.ones_like(ids)
    mask[:4, 30:] = 0  # right padding
    labels = ids.masked_fill(mask == 0, -100)

    def loss_and_grads(m):
        m.zero_grad()
        logits = m(input_ids=ids, attention_mask=mask).logits[:, :-1]  # (B, S - 1, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten())
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, grads = loss_and_grads(model)
    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=True)
    loss_c, grads_c = loss_and_grads(compiled)
    torch.testing.assert_close(loss_c, loss, atol=1e-5, rtol=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_c[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.slow
def test_trainer_with_torch_compile_trains_like_eager(tiny_model_folder, tmp_path):
    """`torch_compile: true` through the trainer (accelerate compiles the policy; the agent loop samples with it):
    two sampled GRPO steps on the echo environment from the same seed log the same losses and rewards and end at the
    same weights as the eager trainer, up to float rounding."""
    from conftest import CPU_ARGS, EchoEnv
    from datasets import Dataset

    from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple", "river", "stone"]}}] * 8)
    runs = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        args = AgentGRPOConfig(
            output_dir=str(tmp_path / str(compiled)), per_device_train_batch_size=8, num_generations=4,
            max_completion_length=40, max_turn_tokens=4, max_steps=2, learning_rate=1e-2,
            torch_compile=compiled, **CPU_ARGS,
        )  # fmt: skip
        trainer = AgentGRPOTrainer(
            model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda r: EchoEnv()
        )
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        runs[compiled] = logs, weights
    (eager_logs, eager_w), (comp_logs, comp_w) = runs[False], runs[True]
    assert len(eager_logs) == len(comp_logs) == 2
    for a, b in zip(eager_logs, comp_logs, strict=True):
        for key in ("loss", "reward", "completions/mean_length", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    for name, w in eager_w.items():
        torch.testing.assert_close(comp_w[name], w, atol=1e-5, rtol=1e-4, msg=name)
