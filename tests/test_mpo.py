"""Layer 3: CPU smoke runs of the MPO trainer (`trainers/mpo.py`) on the tiny random model with `EchoEnv`: separate
critic at 15x the actor's learning rate, turn-level ratio with an off-policy minibatch, `turn_index` in the loss
inputs, advantages equal to `mpo_advantages` on the batch with each turn's mean preserved (mpo.md Eq. 11), and the
value-variance diagnostics (mpo.md §8)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.test_ppo import make_trainer as make_ppo_trainer
from trainers.advantages import mpo_advantages
from trainers.mpo import MPOConfig, MPOTrainer


def make_trainer(folder, tokenizer, tmp_path, **kw):
    # mpo.md D15: 1 epoch x 2 minibatches (test_ppo's builder sets steps_per_generation=2), so the turn ratio matters
    return make_ppo_trainer(folder, tokenizer, tmp_path, trainer_cls=MPOTrainer, config_cls=MPOConfig, **kw)


def logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def test_mpo_smoke_separate_critic(tiny_model_folder, tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path)
    assert trainer.model.critic is trainer.critic  # mpo.md D12: a separate critic by default
    inputs_seen = []
    original = trainer.policy_loss

    def capture(model, inputs):
        inputs_seen.append(inputs)
        return original(model, inputs)

    trainer.policy_loss = capture
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    losses = logged(trainer, "loss")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p)]
    assert unchanged == []  # actor and critic (backbone + head) all moved
    groups = {g["role"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert groups == {"actor": 1e-2, "critic": pytest.approx(1.5e-1)}  # mpo.md §5: 15x
    first = inputs_seen[0]
    assert first["turn_index"].shape == first["advantages"].shape  # the base adds turn_index to the loss inputs
    assert first.get("old_per_token_logps") is not None  # 2 minibatches: TRL keeps the behaviour log-probs
    assert logged(trainer, "mpo/turn_log_ratio_abs_mean")[-1] > 0  # the second minibatch is off-policy
    assert logged(trainer, "mpo/mean_constraint_max_err")[0] < 1e-5  # Eq. 11
    assert logged(trainer, "mpo/turns_per_traj_mean") == [3.0]
    assert logged(trainer, "t1/tito_mismatch_tokens") == [0.0]
    assert logged(trainer, "critic/explained_variance")
    for key in ("mpo/token_clip_frac", "mpo/dual_clip_frac", "mpo/turn_clip_frac", "mpo/sign_flip_frac"):
        assert 0.0 <= min(logged(trainer, key)) and max(logged(trainer, key)) <= 1.0, key


def test_mpo_advantages_on_the_batch(tiny_model_folder, tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path, critic_model_name_or_path=None, max_steps=1)
    torch.nn.init.normal_(trainer.critic.weight, std=0.5)  # non-zero values inside and between turns
    seen = []
    original = trainer.compute_advantages
    trainer.compute_advantages = lambda batch: seen.append((batch, original(batch))) or seen[-1][1]
    trainer.train()
    batch, adv = seen[0]
    mask, turn_index = batch.mask, batch.turn_index
    assert ((mask == 0) & (batch.completion_mask == 1)).any()  # environment tokens between turns
    assert not batch.truncated.any()  # terminated rows: the terminal value is 0 (C4)
    a = trainer.args
    ref = mpo_advantages(
        batch.extras["old_values"],
        mask,
        turn_index,
        trainer.turn_reward_matrix(batch),
        batch.truncated,
        gamma=a.turn_gamma,
        turn_lambda=0.8,
        intra_turn_lambda=0.95,
        beta=1.0,
        turn_valid=batch.turn_valid,
    )
    torch.testing.assert_close(adv, ref.advantages)
    torch.testing.assert_close(batch.extras["returns"], ref.returns)
    assert (adv[mask == 0] == 0).all()
    for b in range(mask.shape[0]):  # Eq. 11: every turn's mean advantage is exactly A_k
        for k in range(int(turn_index[b].max()) + 1):
            sel = turn_index[b] == k
            assert adv[b][sel].double().mean().item() == pytest.approx(float(ref.turn_advantages[b, k]), abs=1e-5)
    # the value-variance diagnostic is defined once the critic's values vary (mpo.md Eq. 20-21)
    share, pooled = logged(trainer, "mpo/inter_turn_var_share"), logged(trainer, "mpo/inter_turn_var_share_pooled")
    assert len(share) == 1 and 0.0 <= share[0] <= pooled[0] <= 1.0


def test_mpo_config_validation(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", activation_checkpointing=False)
    config = MPOConfig(**common)
    assert (config.turn_lambda, config.intra_turn_lambda, config.token_residual_scale) == (0.8, 0.95, 1.0)
    assert config.critic_model_name_or_path == "policy" and config.critic_lr_multiplier == 15.0
    assert not config.whiten_advantages
    with pytest.raises(ValueError, match="turn_ratio"):
        MPOConfig(turn_ratio="sum", **common)
    with pytest.raises(ValueError, match="value_target"):
        MPOConfig(value_target="td", **common)
