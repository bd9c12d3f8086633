"""docs/methods/grpo.md D14: what the trainer changes when it runs on a CPU, and that the results stay the same."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainers.base  # noqa: F401  (the attention switch is made on import)

ROOT = Path(__file__).resolve().parent.parent


def test_grouped_key_heads_are_read_in_place_on_cpu(tiny_model_folder, monkeypatch):
    """On CPU, sdpa attention lets each key/value head serve its query heads without copying it (`repeat_kv`), and
    the logits and gradients equal those of transformers' copying path, with left padding in the batch."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import sdpa_attention

    use_gqa = sdpa_attention.use_gqa_in_sdpa
    assert use_gqa.shares_key_heads_on_cpu
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

    shared, shared_grads = forward_backward()
    assert copies == []
    monkeypatch.setattr(sdpa_attention, "use_gqa_in_sdpa", use_gqa.__wrapped__)
    copied, copied_grads = forward_backward()
    assert len(copies) == 2 * config.num_hidden_layers  # keys and values of every layer were copied
    torch.testing.assert_close(shared, copied, rtol=1e-5, atol=1e-6)
    for a, b in zip(shared_grads, copied_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_other_devices_keep_transformers_choice():
    """Off the CPU the switch defers to transformers: with a mask it declines, as transformers does on CUDA."""
    from transformers.integrations import sdpa_attention

    use_gqa = sdpa_attention.use_gqa_in_sdpa
    key = torch.empty(1, 2, 5, 8, device="meta")
    mask = torch.empty(1, 1, 1, 5, dtype=torch.bool, device="meta")
    assert use_gqa(mask, key, key) is use_gqa.__wrapped__(mask, key, key) is False
    on_cpu = torch.zeros(1, 2, 5, 8)
    assert use_gqa(torch.ones(1, 1, 1, 5, dtype=torch.bool), on_cpu, on_cpu) is True


FAULTS = """
import resource, sys
sys.path.insert(0, sys.argv[2])
import torch
if sys.argv[1] == "keep":
    from trainers.base import keep_freed_memory
    assert keep_freed_memory()

def step():  # a step's activations: tensors of 4-24 MB alive together, freed at its end
    live = [torch.ones(mb * 2**18) for mb in (24, 8, 16, 4, 20, 12)]
    return len(live)

step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_freed_memory_is_reused_without_page_faults():
    """With `keep_freed_memory`, five more steps of 84 MB of activations reuse the first step's memory: at most a
    block or two is faulted in again (a 4 kB page each; which blocks fit the freed holes depends on the heap's
    layout), where under glibc's defaults a fifth to two fifths of the pages are handed back and faulted in anew.
    Run in fresh processes, since the setting lasts for the process."""

    def faults(mode: str) -> int:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        out = subprocess.run(
            [sys.executable, "-c", FAULTS, mode, str(ROOT)], capture_output=True, text=True, env=env, check=True
        )
        return int(out.stdout.split()[-1])

    pages = 5 * 84 * 2**20 // 4096  # every page of the five steps
    default, kept = faults("default"), faults("keep")
    assert default > pages // 6, default
    assert kept < pages // 12, kept  # a 12 MB block is 3072 pages


def test_keep_freed_memory_declines_without_glibc(monkeypatch):
    """A C library that is not glibc is left alone."""
    import ctypes

    from trainers.base import keep_freed_memory

    class NotGlibc:
        def __getattr__(self, name):
            raise AttributeError(name)

    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: NotGlibc())
    assert keep_freed_memory() is False


def test_a_cpu_trainer_keeps_freed_memory(tiny_model_folder, tmp_path, monkeypatch):
    """Building a trainer whose policy is on the CPU asks for the allocator setting, once."""
    from conftest import CPU_ARGS, EchoEnv
    from datasets import Dataset

    from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

    calls = []
    monkeypatch.setattr(trainers.base, "keep_freed_memory", lambda: calls.append(1) or True)
    args = AgentGRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, **CPU_ARGS)
    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple"]}}] * 4)
    AgentGRPOTrainer(model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda row: EchoEnv())
    assert calls == [1]
