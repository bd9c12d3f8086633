"""Layer 4: TRL guards. The private TRL methods the base overrides keep their 1.16.0 signatures, and the base trainer
with default hooks reproduces stock GRPOTrainer (advantages and loss) on a single-turn dataset."""

import inspect

import pytest
import torch
from conftest import CPU_ARGS
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

# The TRL private methods trainers/base.py overrides or calls, with their trl 1.16.0 parameter lists.
PINNED = {
    "_generate_and_score_completions": ["self", "inputs"],
    "_calculate_rewards": ["self", "inputs", "prompts", "completions", "completion_ids_list"],
    "_compute_loss": ["self", "model", "inputs"],
    "_get_per_token_logps_and_entropies": [
        "self",
        "model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
        "batch_size",
        "compute_entropy",
        "compute_aux_loss",
    ],
}


@pytest.mark.parametrize("name", sorted(PINNED))
def test_private_signatures_are_pinned(name):
    params = list(inspect.signature(getattr(GRPOTrainer, name)).parameters)
    expected = PINNED[name]
    assert params[: len(expected)] == expected, f"TRL changed GRPOTrainer.{name}: {params}; update trainers/base.py"


def distinct_chars(completions, **kwargs):
    return [len(set(c)) / (1 + len(c)) for c in completions]


def _config(cls, tmp_path, **kw):
    return cls(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        **CPU_ARGS,
        max_steps=1,
        disable_dropout=True,
        **kw,
    )


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_default_hooks_reproduce_stock_grpo(tiny_model_folder, tmp_path, scale_rewards):
    data = Dataset.from_list([{"prompt": f"say {w}"} for w in ["apple", "river", "stone", "cloud"]])
    stock = GRPOTrainer(
        model=tiny_model_folder,
        reward_funcs=[distinct_chars],
        train_dataset=data,
        args=_config(GRPOConfig, tmp_path / "a", scale_rewards=scale_rewards),
    )
    ours = AgentGRPOTrainer(
        model=tiny_model_folder,
        reward_funcs=[distinct_chars],
        train_dataset=data,
        args=_config(AgentGRPOConfig, tmp_path / "b", scale_rewards=scale_rewards),
    )
    rows = [{"prompt": f"say {w}"} for w in ["apple", "apple", "apple", "apple", "river", "river", "river", "river"]]
    torch.manual_seed(123)
    ref = stock._generate_and_score_completions([dict(r) for r in rows])
    torch.manual_seed(123)
    out = ours._generate_and_score_completions([dict(r) for r in rows])
    assert torch.equal(ref["completion_ids"], out["completion_ids"])
    mask = out["completion_mask"].bool()
    assert out["advantages"].shape == out["completion_ids"].shape  # (B, T)
    expected = ref["advantages"].unsqueeze(1).expand_as(out["advantages"])
    torch.testing.assert_close(out["advantages"][mask], expected[mask], rtol=1e-6, atol=1e-7)  # conventions.md C1
    assert (out["advantages"][~mask] == 0).all()
    assert ref["advantages"].abs().sum() > 0  # the comparison is not between two zero tensors
    loss_ref = stock.compute_loss(stock.model, ref)
    loss_ours = ours.compute_loss(ours.model, out)
    torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-6, atol=1e-7)


def test_rejects_plain_grpo_config(tiny_model_folder, tmp_path):
    data = Dataset.from_list([{"prompt": "say apple"}] * 4)
    with pytest.raises(TypeError, match="AgentGRPOConfig"):
        AgentGRPOTrainer(
            model=tiny_model_folder,
            reward_funcs=[distinct_chars],
            train_dataset=data,
            args=_config(GRPOConfig, tmp_path),
        )
