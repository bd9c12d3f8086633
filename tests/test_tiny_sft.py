"""The tiny default's warm start (envs/tiny.sft) runs its forwards as plain causal attention, without the padding
mask, and trains to what the masked forward trains to (docs/methods/grpo.md D15)."""

import contextlib
import random

import pytest
import torch

import envs.tiny
from envs.shop import ShopEnv
from envs.tiny import CHAT_TEMPLATE, TinySpec, build_model, build_tokenizer, played_demonstrations, sft


@pytest.fixture(scope="module")
def setup():
    tasks = ShopEnv.make_tasks("train", 48, seed=0)
    demos = played_demonstrations(lambda task: ShopEnv(), tasks, seed=0, noise=0.3)
    texts = [CHAT_TEMPLATE] + ["user\nassistant\nsystem\ntool\n"] * 20 + [m["content"] for d in demos for m in d]
    return demos, build_tokenizer(texts)


def trained(setup, tmp_path, spec) -> dict[str, torch.Tensor]:
    demos, tokenizer = setup
    random.seed(0)
    model = sft(build_model(spec, tokenizer), tokenizer, demos, spec, output_dir=str(tmp_path / "sft"))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_sft_drops_the_padding_mask_and_trains_as_with_it(setup, tmp_path, monkeypatch):
    spec = TinySpec(env="shop", sft_steps=3, sft_batch_size=8)
    dropped = []
    hook = envs.tiny.CausalWithoutMask._drop_right_padding_mask

    def counting(module, args, kwargs):
        out = hook(module, args, kwargs)
        dropped.append(out is not None)
        return out

    monkeypatch.setattr(envs.tiny.CausalWithoutMask, "_drop_right_padding_mask", staticmethod(counting))
    fast = trained(setup, tmp_path / "fast", spec)
    assert dropped == [True] * 3  # one forward per step, each padded on the right only, each without its mask
    monkeypatch.undo()

    class Masked(contextlib.nullcontext):  # the forward as TRL's SFTTrainer makes it: with the padding mask
        def __init__(self, model):
            super().__init__()

    monkeypatch.setattr(envs.tiny, "CausalWithoutMask", Masked)
    masked = trained(setup, tmp_path / "masked", spec)
    start = build_model(spec, setup[1]).state_dict()
    for name, value in masked.items():
        assert not torch.equal(value, start[name]) or "norm" in name, name  # SFT moved the weights
        torch.testing.assert_close(fast[name], value, rtol=1e-4, atol=1e-5, msg=name)


def test_a_moe_build_keeps_its_mask(setup, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(envs.tiny.CausalWithoutMask, "__enter__", lambda self: calls.append(self))
    trained(setup, tmp_path, TinySpec(env="shop", moe=True, sft_steps=1, sft_batch_size=4))
    assert calls == []  # the balance loss reads the mask
