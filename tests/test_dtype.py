"""Issue 39: without `--config` (TRL's default `bf16`), a run on a CPU-only machine trains in float32 instead of
stopping with transformers' bf16 error; a GPU that supports bfloat16 keeps TRL's default."""

import pytest
import torch

from trainers.base import AgentGRPOConfig, bf16_available


def test_bf16_follows_the_hardware(monkeypatch):
    """The test transformers makes before it accepts bf16 (training_args: a bf16 GPU, or XLA), unless on the CPU."""
    from transformers import training_args

    monkeypatch.setattr(training_args, "is_torch_xla_available", lambda: False)
    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: True)
    assert bf16_available(use_cpu=False) is True
    assert bf16_available(use_cpu=True) is False  # asked for the CPU: float32
    monkeypatch.setattr(training_args, "is_torch_bf16_gpu_available", lambda: False)  # a CPU-only machine, a T4
    assert bf16_available(use_cpu=False) is False
    monkeypatch.setattr(training_args, "is_torch_xla_available", lambda: True)
    assert bf16_available(use_cpu=False) is True


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
