"""DRACO's shop data, scripted policy, probe trainer and config: used by test_draco, test_draco_essential_gate and
test_every_trainer_trains."""

from __future__ import annotations

import json
import random
import re

import torch
from datasets import Dataset

from envs.shop import ShopEnv
from trainers.draco import DRACOConfig, DRACOTrainer

SHOP_TASKS = ShopEnv.make_tasks("train", 4, seed=0)


BY_INSTRUCTION = {t["instruction"]: t for t in SHOP_TASKS}


DATA = Dataset.from_list(
    [{"prompt": ShopEnv().reset(t), "task": json.dumps(t), "task_id": t["task_id"]} for t in SHOP_TASKS]
)


def shadow_shop(text: str, by_instruction: dict[str, dict] = BY_INSTRUCTION) -> ShopEnv:
    """A fresh shop on the task a decoded context names, with the context's assistant actions replayed in it."""
    env = ShopEnv()
    env.reset(by_instruction[text.split("Instruction: ", 1)[1].split("\n", 1)[0]])
    for action in re.findall(r"<\|im_start\|>assistant\n(.*?)<\|im_end\|>", text, flags=re.DOTALL):
        env.step(action)
    return env


def scripted_policy(p_expert: float, seed: int = 0):
    """An `hf_generate` stand-in: replays the context's actions in a shadow shop and emits the expert's next action
    with probability `p_expert`, else a plausible mistake. The tiny random model is still the trained policy."""
    rng = random.Random(seed)

    def factory(model, tokenizer, **kwargs):
        def generate(contexts, max_new_tokens):
            out = []
            for ctx in contexts:
                env = shadow_shop(tokenizer.decode(ctx))
                action = env.expert_action() if rng.random() < p_expert else env.noisy_action(rng)
                ids = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                out.append((ids, [-1.0] * len(ids)))
            return out

        return generate

    return factory


def config(tmp_path, **kw) -> DRACOConfig:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=8, num_generations=4, max_completion_length=400,
        max_turn_tokens=64, max_turns=6, learning_rate=1e-2, report_to="none", seed=0, bf16=False, use_cpu=True,
        activation_checkpointing=False, save_strategy="no", logging_steps=1, max_steps=2, disable_dropout=True,
    )  # fmt: skip
    return DRACOConfig(**(settings | kw))


class Probe(DRACOTrainer):
    """Records every batch with its (B, T) advantages and the credit output."""

    def compute_advantages(self, batch):
        out = super().compute_advantages(batch)
        self.seen = [*getattr(self, "seen", []), (batch, out, self.credit)]
        return out


def check_batches(trainer: Probe) -> None:
    for batch, out, credit in trainer.seen:
        adv, mask = batch.advantages.double(), batch.mask.double()
        assert out.shape == batch.completion_ids.shape and torch.isfinite(out).all()
        torch.testing.assert_close(out.double().sum(1), adv * mask.sum(1), rtol=1e-5, atol=1e-4)  # conservation
        assert (out[batch.turn_index < 0] == 0).all()
        assert ((torch.sign(out) == 0) | (torch.sign(out) == torch.sign(adv).unsqueeze(1))).all()
        if credit is not None:
            for b in credit.fallback.nonzero().flatten():  # fallback rows are exactly the GRPO broadcast
                assert torch.equal(out[b], batch.advantages[b] * batch.mask[b])
