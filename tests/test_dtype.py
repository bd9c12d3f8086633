"""Issue 39: without `--config` (TRL's default `bf16`), a run on a CPU-only machine trains in float32 instead of
stopping with transformers' bf16 error; a GPU that supports bfloat16 keeps TRL's default."""

import pytest
import torch

from trainers.base import AgentGRPOConfig, bf16_available


def test_bf16_follows_the_hardware(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert bf16_available(use_cpu=False) is True
    assert bf16_available(use_cpu=True) is False  # asked for the CPU: float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)  # e.g. a T4
    assert bf16_available(use_cpu=False) is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if hasattr(torch, "xpu"):
        monkeypatch.setattr(torch.xpu, "is_available", lambda: False)
    assert bf16_available(use_cpu=False) is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_a_default_config_builds_on_a_cpu_only_machine(tmp_path):
    config = AgentGRPOConfig(output_dir=str(tmp_path))  # TRL alone: "Your setup doesn't support bf16/gpu"
    assert config.bf16 is False and config.device.type == "cpu"
    assert AgentGRPOConfig(output_dir=str(tmp_path), fp16=False, bf16=False).bf16 is False


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU-only case")
def test_the_command_line_without_a_config_parses_on_a_cpu(tmp_path):
    """The user's step: `python train.py --environment shop --model_name_or_path tiny:shop` (no --config)."""
    import train

    run, config, model_args, _ = train.parse(
        ["--environment", "shop", "--model_name_or_path", "tiny:shop", "--output_dir", str(tmp_path)]
    )
    assert config.bf16 is False and run.environment == "shop"
