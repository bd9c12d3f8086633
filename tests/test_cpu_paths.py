"""docs/methods/grpo.md D14: what the trainer changes when it runs on a CPU, and that the results stay the same."""

import torch

import trainers.base
from trainers.trl_api import cpu_fast_paths


def test_grouped_key_heads_are_read_in_place_on_cpu(tiny_model_folder, monkeypatch):
    """On CPU, sdpa attention lets each key/value head serve its query heads without copying it (`repeat_kv`), and
    the logits and gradients equal those of transformers' copying path, with left padding in the batch."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import sdpa_attention

    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder, attn_implementation="sdpa")
    config = model.config
    assert config.num_key_value_heads < config.num_attention_heads  # the tiny models group their heads
    copies = []
    repeat_kv = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda h, n: copies.append(h.shape) or repeat_kv(h, n))
    torch.manual_seed(0)
    ids = torch.randint(5, 300, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding: transformers builds an explicit mask
    mask[1, :2] = 0

    def forward_backward():
        model.zero_grad()
        logits = model(input_ids=ids, attention_mask=mask).logits
        logits[mask.bool()].float().square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    with cpu_fast_paths():
        shared, shared_grads = forward_backward()
    assert copies == []
    copied, copied_grads = forward_backward()  # transformers' own choice again once the block has closed
    assert len(copies) == 2 * config.num_hidden_layers  # keys and values of every layer were copied
    torch.testing.assert_close(shared, copied, rtol=1e-5, atol=1e-6)
    for a, b in zip(shared_grads, copied_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_other_devices_keep_transformers_choice():
    """Off the CPU the switch defers to transformers: with a mask it declines, as transformers does on CUDA."""
    from transformers.integrations import sdpa_attention

    own = sdpa_attention.use_gqa_in_sdpa
    key = torch.empty(1, 2, 5, 8, device="meta")
    mask = torch.empty(1, 1, 1, 5, dtype=torch.bool, device="meta")
    on_cpu = torch.zeros(1, 2, 5, 8)
    with cpu_fast_paths():
        use_gqa = sdpa_attention.use_gqa_in_sdpa
        assert use_gqa is not own and use_gqa.__wrapped__ is own
        assert use_gqa(mask, key, key) is own(mask, key, key) is False
        assert use_gqa(torch.ones(1, 1, 1, 5, dtype=torch.bool), on_cpu, on_cpu) is True
    assert sdpa_attention.use_gqa_in_sdpa is own


def test_keep_freed_memory_sets_no_trim_and_a_32_mb_mmap_threshold(monkeypatch):
    """On glibc the setting is two `mallopt` calls: M_TRIM_THRESHOLD (-1) to the largest int, M_MMAP_THRESHOLD (-3) to
    32 MB (<malloc.h>). How many page faults it saves is measured by `bench/allocator.py`, not here."""
    import ctypes

    from trainers.cpu_paths import keep_freed_memory

    calls = []

    class Glibc:
        def gnu_get_libc_version(self):
            return b"2.39"

        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: Glibc())
    assert keep_freed_memory() is True
    assert calls == [(-1, 2**31 - 1), (-3, 32 * 1024 * 1024)]


def test_keep_freed_memory_declines_without_glibc(monkeypatch):
    """A C library that is not glibc is left alone."""
    import ctypes

    from trainers.cpu_paths import keep_freed_memory

    class NotGlibc:
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: NotGlibc())
    assert keep_freed_memory() is False


def test_a_cpu_trainer_keeps_freed_memory_only_when_asked(tiny_model_folder, tmp_path, monkeypatch):
    """`keep_freed_memory: true` on a CPU trainer asks for the allocator setting once; the default asks nothing."""
    from conftest import CPU_ARGS, EchoEnv
    from datasets import Dataset

    from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

    calls = []
    monkeypatch.setattr(trainers.base, "keep_freed_memory", lambda: calls.append(1) or True)
    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple"]}}] * 4)
    for keep in (False, True):
        args = AgentGRPOConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, keep_freed_memory=keep,
            **CPU_ARGS,
        )  # fmt: skip
        AgentGRPOTrainer(model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda row: EchoEnv())
        assert calls == [1] * keep
