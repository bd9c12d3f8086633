"""The PPO trainer factory and the checks PPO's and MPO's tests share: used by test_ppo, test_mpo."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv
from datasets import Dataset

from trainers.ppo import AgentPPOTrainer, PPOConfig


def distinct_chars(completions, **kwargs):
    """A dense reward so a random policy gets non-zero returns (the echo reward is 0 almost always)."""
    return [len(set(c)) / (1 + len(c)) for c in completions]


def make_trainer(folder, tokenizer, tmp_path, trainer_cls=AgentPPOTrainer, config_cls=PPOConfig, **kw):
    tasks = EchoEnv.make_tasks("train", 8)
    data = Dataset.from_list(
        [{"prompt": EchoEnv().reset(t), "task": json.dumps(t), "task_id": t["task_id"]} for t in tasks]
    )
    peft_config = kw.pop("peft_config", None)
    env_factory = kw.pop("env_factory", lambda row: EchoEnv())
    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        steps_per_generation=2,  # 2 minibatches per generation batch: the second one is off-policy
        max_completion_length=40,
        max_turn_tokens=4,
        max_steps=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        **CPU_ARGS,
    )
    settings.update(kw)
    return trainer_cls(
        model=folder,
        reward_funcs=[distinct_chars],
        args=config_cls(**settings),
        train_dataset=data,
        processing_class=tokenizer,
        env_factory=env_factory,
        peft_config=peft_config,
    )


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def capture_audits(trainer) -> list:
    """Wrap `trainer.audit_tito` so that every batch it audits is kept."""
    seen, original = [], trainer.audit_tito
    trainer.audit_tito = lambda batch: seen.append(batch) or original(batch)
    return seen


def capture_batches(trainer) -> list:
    """Wrap `trainer.compute_advantages` so that every batch is kept with its advantages and the critic's values
    v_all (B, L) before any update (value-head trainers: backbone + head, recomputed here by a plain forward)."""
    seen, original = [], trainer.compute_advantages

    def capture(batch):
        adv = original(batch)
        ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1)
        attn = torch.cat([batch.prompt_mask, batch.completion_mask], 1)
        with torch.no_grad():
            hidden = trainer.model.model(input_ids=ids, attention_mask=attn).last_hidden_state
            seen.append((batch, adv, trainer.critic(hidden).squeeze(-1)))  # v_all (B, L)
        return adv

    trainer.compute_advantages = capture
    return seen


def check_tito_audit(trainer, batch) -> None:
    """t1.md Eq. 17 on a real rollout batch, checked without the audit: the loss positions of every row hold exactly
    the ids the sampler emitted, on a non-zero number of tokens; one corrupted sampled id then makes the audit fail."""
    loss_tokens = 0
    for b, row in enumerate(batch.rows):
        kept = [int(i) for i, m in zip(batch.completion_ids[b].tolist(), batch.mask[b].tolist(), strict=True) if m]
        assert kept == list(row["sampled_ids"]), f"row {b}"
        loss_tokens += len(kept)
    assert loss_tokens > 0
    rows = [dict(row) for row in batch.rows]
    b = next(b for b, row in enumerate(rows) if row["sampled_ids"])
    rows[b]["sampled_ids"] = [rows[b]["sampled_ids"][0] + 1, *rows[b]["sampled_ids"][1:]]  # one id differs
    with pytest.raises(RuntimeError, match="1 loss tokens differ"):  # t1.md D14
        trainer.audit_tito(dataclasses.replace(batch, rows=rows))


def reference_aggregate(x: list, mask: list, loss_type: str, n_tok: float, max_completion_length: int) -> float:
    """Plain-Python aggregation of one micro-batch's per-token values under TRL's loss types (grpo.md Eq. 6-8, and
    Dr. GRPO's B x max_completion_length): `x` and `mask` are nested lists (B, T)."""
    rows = [[v for v, m in zip(x_row, m_row, strict=True) if m] for x_row, m_row in zip(x, mask, strict=True)]
    total = sum(sum(r) for r in rows)
    if loss_type == "grpo":
        return sum(sum(r) / max(len(r), 1) for r in rows) / len(rows)  # each row's token mean, then rows
    if loss_type == "bnpo":
        return total / max(sum(len(r) for r in rows), 1)  # this micro-batch's token mean
    if loss_type == "dapo":
        return total / n_tok  # the optimizer step's tokens per micro-batch
    return total / (len(rows) * max_completion_length)  # dr_grpo


class AlternatingEcho(EchoEnv):
    """EchoEnv whose every other instance allows 2 turns instead of 4, so that a batch holds rows of different lengths
    (with rows of one length the per-row and the per-token means coincide, and loss types cannot be told apart)."""

    made = itertools.count()

    def __init__(self):
        super().__init__()
        self.max_turns = 2 if next(AlternatingEcho.made) % 2 else EchoEnv.max_turns


def check_loss_aggregation(trainer, loss_type: str) -> None:
    """Train one optimizer step and check the first micro-batch's loss against `reference_aggregate`: before any
    update the ratio is 1 and V = V_old up to round-off, so the actor's per-token loss is -A (no clip binds) and the
    critic's (V_old - R)^2, and the loss must be agg(-A) + vf_coef * agg((V_old - R)^2) under `loss_type`, for actor
    and critic alike (conventions.md C22, ppo.md D8). It must also differ from the default `dapo` aggregation (or,
    for `dapo`, from `grpo`), so a trainer that ignored `loss_type` would fail."""
    seen, original = [], trainer.policy_loss

    def recording(model, inputs):
        loss = original(model, inputs)
        seen.append((inputs, loss.detach()))
        return loss

    trainer.policy_loss = recording
    trainer.train()
    inputs, loss = seen[0]
    mask = (inputs["completion_mask"] * inputs["tool_mask"] * inputs["scorable"].unsqueeze(1)).tolist()
    actor_tok = (-inputs["advantages"].double()).tolist()
    critic_tok = ((inputs["old_values"].double() - inputs["returns"].double()) ** 2).tolist()
    a = trainer.args
    n_tok = inputs["num_items_in_batch"].item() / a.steps_per_generation  # one process, GA = 1

    def expected(kind: str) -> float:
        agg = [reference_aggregate(x, mask, kind, n_tok, a.max_completion_length) for x in (actor_tok, critic_tok)]
        return agg[0] + a.vf_coef * agg[1]

    assert loss.item() == pytest.approx(expected(loss_type), abs=1e-5)
    # rows of equal lengths make the per-row and the per-token means coincide: the comparison below needs unequal ones
    assert len({sum(row) for row in mask}) > 1, "the micro-batch's rows have equal lengths (see AlternatingEcho)"
    other = "grpo" if loss_type == "dapo" else "dapo"
    assert abs(loss.item() - expected(other)) > 1e-3
