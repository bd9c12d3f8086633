"""Layer 3: CPU smoke runs of the MPO trainer (`trainers/mpo.py`) on the tiny random model with `EchoEnv`: separate
critic at 15x the actor's learning rate, turn-level ratio with an off-policy minibatch, `turn_index` in the loss
inputs, advantages and returns equal to a plain-Python reference of mpo.md Eq. 3-10 and 17 on the batch, each turn's
mean preserved (Eq. 11), the TITO audit, and the explained-variance and value-variance diagnostics (mpo.md §8)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.ppo import (
    AlternatingEcho,
    capture_audits,
    capture_batches,
    check_loss_aggregation,
    check_tito_audit,
    logged,
)
from tests.helpers.ppo import make_trainer as make_ppo_trainer
from trainers.mpo import MPOConfig, MPOTrainer


def make_trainer(folder, tokenizer, tmp_path, **kw):
    # mpo.md D15: 1 epoch x 2 minibatches (test_ppo's builder sets steps_per_generation=2), so the turn ratio matters
    return make_ppo_trainer(folder, tokenizer, tmp_path, trainer_cls=MPOTrainer, config_cls=MPOConfig, **kw)


def reference_mpo(values, mask, turn_index, reward, lam, lam_intra, beta, gamma):
    """Plain-Python MPO on one terminated row, from mpo.md Eq. 3-10 and 17: the outcome reward on the last turn
    (Eq. 4), V_{K+1} = 0 (Eq. 3), turn GAE (Eq. 5-6), an intra-turn token GAE that bootstraps into the next turn's
    start value (Eq. 7-8), the mean-preserving projection (Eq. 9-10) and Monte-Carlo returns counted in turns (Eq. 17).
    Returns per-token advantages and returns (0 off the model tokens) and the turn advantages A_k."""
    pos: dict[int, list[int]] = {}
    for t, (m, k) in enumerate(zip(mask, turn_index, strict=True)):
        if m:
            pos.setdefault(k, []).append(t)
    K = len(pos)
    assert sorted(pos) == list(range(K))  # turns 0..K-1, each with a model token
    r = [0.0] * (K - 1) + [reward]  # Eq. 4
    v_start = [values[pos[k][0]] for k in range(K)] + [0.0]  # Eq. 3: V_k = V_{k,1}, V_{K+1} = 0
    turn_adv, carry = [0.0] * K, 0.0
    for k in reversed(range(K)):
        carry = r[k] + gamma * v_start[k + 1] - v_start[k] + gamma * lam * carry  # Eq. 5-6
        turn_adv[k] = carry
    adv, ret, g = [0.0] * len(mask), [0.0] * len(mask), 0.0
    for k in reversed(range(K)):
        g = r[k] + gamma * g  # Eq. 17: G_k = r_k + gamma * G_{k+1}, G_{K+1} = V_{K+1} = 0
        v = [values[t] for t in pos[k]]
        a, carry = [0.0] * len(v), 0.0
        for i in reversed(range(len(v))):
            nxt = v[i + 1] if i + 1 < len(v) else r[k] + gamma * v_start[k + 1]  # Eq. 7
            carry = nxt - v[i] + lam_intra * carry  # Eq. 8, never crossing the turn's end
            a[i] = carry
        for t, a_i in zip(pos[k], a, strict=True):
            adv[t] = turn_adv[k] + beta * (a_i - sum(a) / len(a))  # Eq. 9-10
            ret[t] = g
    return adv, ret, turn_adv


def test_mpo_smoke_separate_critic(tiny_model_folder, tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path)
    assert trainer.model.critic is trainer.critic  # mpo.md D12: a separate critic by default
    inputs_seen = []
    original = trainer.policy_loss

    def capture(model, inputs):
        inputs_seen.append(inputs)
        return original(model, inputs)

    trainer.policy_loss = capture
    batches, compute = [], trainer.compute_advantages
    trainer.compute_advantages = lambda batch: batches.append(batch) or compute(batch)
    audited = capture_audits(trainer)
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
    assert len(audited) == 1 and logged(trainer, "t1/tito_mismatch_tokens") == [0.0]
    check_tito_audit(trainer, audited[0])
    # Eq. 19 recomputed on the one generation batch: EV = 1 - Var[R - V_old] / Var[R] over its model tokens
    (batch,) = batches
    m = batch.mask.bool()
    r, v = batch.extras["returns"].double()[m], batch.extras["old_values"].double()[m]
    ev = 1.0 - (r - v).var(unbiased=False).item() / r.var(unbiased=False).item()
    assert logged(trainer, "critic/explained_variance") == [pytest.approx(ev, abs=1e-6)]
    for key in ("mpo/token_clip_frac", "mpo/dual_clip_frac", "mpo/turn_clip_frac", "mpo/sign_flip_frac"):
        assert 0.0 <= min(logged(trainer, key)) and max(logged(trainer, key)) <= 1.0, key


def test_mpo_advantages_on_the_batch(tiny_model_folder, tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path, critic_model_name_or_path=None, max_steps=1)
    torch.nn.init.normal_(trainer.critic.weight, std=0.5)  # non-zero values inside and between turns
    a = trainer.args
    assert (a.turn_lambda, a.intra_turn_lambda, a.token_residual_scale, a.turn_gamma) == (0.8, 0.95, 1.0, 1.0)
    seen = capture_batches(trainer)
    trainer.train()
    batch, adv, v_all = seen[0]
    mask, turn_index = batch.mask, batch.turn_index
    assert ((mask == 0) & (batch.completion_mask == 1)).any()  # environment tokens between turns
    assert not batch.truncated.any()  # terminated rows: the terminal value is 0 (C4)
    old = batch.extras["old_values"]
    torch.testing.assert_close(old, v_all[:, :-1][:, -mask.shape[1] :], atol=1e-5, rtol=1e-5)  # the values used
    for b in range(mask.shape[0]):
        assert int(turn_index[b][mask[b].bool()].max()) + 1 == int(batch.turn_valid[b].sum())  # outcome on turn K
        ref_adv, ref_ret, ref_turn = reference_mpo(
            old[b].tolist(), mask[b].tolist(), turn_index[b].tolist(), float(batch.rewards[b]), 0.8, 0.95, 1.0, 1.0
        )
        torch.testing.assert_close(adv[b].double(), torch.tensor(ref_adv, dtype=torch.float64), atol=1e-5, rtol=1e-5)
        ret = batch.extras["returns"][b].double()
        torch.testing.assert_close(ret, torch.tensor(ref_ret, dtype=torch.float64), atol=1e-5, rtol=1e-5)
        for k, a_k in enumerate(ref_turn):  # Eq. 11: every turn's mean advantage is exactly A_k
            sel = (turn_index[b] == k) & mask[b].bool()
            assert adv[b][sel].double().mean().item() == pytest.approx(a_k, abs=1e-5)
    assert (adv[mask == 0] == 0).all()
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
    assert config.loss_type == "dapo"  # TRL's default: the global token mean of mpo.md Eq. 16
    with pytest.raises(ValueError, match="loss_type"):
        MPOConfig(loss_type="sapo", **common)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_mpo_loss_type_aggregates_actor_and_critic(loss_type, tiny_model_folder, tiny_tokenizer, tmp_path):
    # conventions.md C22: MPO's actor (turn ratio 1 before any update) and critic losses under TRL's loss_type
    trainer = make_trainer(
        tiny_model_folder, tiny_tokenizer, tmp_path, loss_type=loss_type, max_steps=1,
        env_factory=lambda row: AlternatingEcho(),
    )  # fmt: skip
    check_loss_aggregation(trainer, loss_type)


def test_mpo_with_a_detached_value_head(tiny_model_folder, tiny_tokenizer, tmp_path):
    """ppo.md D14 under MPO: the head and the actor both train, the head in its own group at 15x, and the explained
    variance is that of the head on V_old read off TRL's old-log-prob pass."""
    trainer = make_trainer(
        tiny_model_folder, tiny_tokenizer, tmp_path, critic_model_name_or_path=None, value_head_detached=True,
        value_head_hidden=8,
    )  # fmt: skip
    assert trainer.model.value_head is trainer.critic
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    assert all(math.isfinite(x) for x in logged(trainer, "loss"))
    unchanged = [n for n, p in trainer.model.named_parameters() if torch.equal(before[n], p)]
    assert unchanged == []  # the actor (its own loss) and the head (the value loss) both moved
    groups = {g["role"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert groups == {"actor": 1e-2, "critic": pytest.approx(1.5e-1)}
    assert len(logged(trainer, "critic/explained_variance")) == 1
