"""The advantages of a multi-turn batch, through the public seam `generate_and_score`: the default hook gives GRPO's
row advantage on the model's tokens of every turn and 0 on the environment's tokens between turns and on padding, and
the base zeroes those tokens again whatever a method's hook returns. Each test bites on its own zeroing (removing
either once passed every other test)."""

from __future__ import annotations

import torch
from datasets import Dataset

from tests.conftest import CPU_ARGS, EchoEnv, RecordingTrainer
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer


def distinct_chars(completions, **kwargs):
    """A dense reward: the share of distinct characters, different for almost every completion."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [len(set(t)) / (1 + len(t)) for t in texts]


def generated(trainer_cls, tiny_model_folder, tmp_path):
    """One generation batch of 2 tasks x 4 rollouts of up to 3 turns, and the trainer."""
    words = [["apple", "river", "stone"], ["cloud", "amber", "maple"]]
    data = Dataset.from_list([{"prompt": f"say {w[0]}", "words": w} for w in words])
    args = AgentGRPOConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=48,
        max_turn_tokens=4, max_steps=1, learning_rate=1e-3, disable_dropout=True, **CPU_ARGS,
    )  # fmt: skip
    trainer = trainer_cls(
        tiny_model_folder,
        reward_funcs=[distinct_chars],
        args=args,
        train_dataset=data,
        env_factory=lambda r: EchoEnv(),
    )
    torch.manual_seed(0)
    out = trainer.generate_and_score([dict(data[i // 4]) for i in range(8)])
    environment = out["completion_mask"].bool() & ~out["tool_mask"].bool()  # observations fed back between turns
    assert environment.any(), "the batch must hold environment tokens (several turns)"
    return trainer, out, environment


def test_default_hook_zeroes_environment_tokens_of_a_multi_turn_batch(tiny_model_folder, tmp_path):
    trainer, out, environment = generated(RecordingTrainer, tiny_model_folder, tmp_path)
    adv = trainer.compute_advantages(trainer.seen)  # the hook itself, on the batch it saw
    completion, model = out["completion_mask"].bool(), out["tool_mask"].bool()
    assert (adv[environment] == 0).all() and (adv[~completion] == 0).all()
    per_row = [adv[b][completion[b] & model[b]] for b in range(len(adv))]
    assert all(len(v) and torch.all(v == v[0]) for v in per_row)  # one number per row on its model tokens
    assert any(v[0] != 0 for v in per_row)  # and the batch has a signal: the zeros above are not everywhere
    assert torch.equal(out["advantages"], adv.to(out["advantages"].dtype))  # what TRL's loss reads


class EverywhereOne(AgentGRPOTrainer):
    """A method whose hook forgets the mask: advantage 1 on every position."""

    def compute_advantages(self, batch):
        return torch.ones_like(batch.completion_ids, dtype=torch.float32)


def test_the_base_zeroes_environment_tokens_whatever_the_hook_returns(tiny_model_folder, tmp_path):
    _, out, environment = generated(EverywhereOne, tiny_model_folder, tmp_path)
    model = out["completion_mask"].bool() & out["tool_mask"].bool()
    assert (out["advantages"][environment] == 0).all() and (out["advantages"][model] == 1).all()
