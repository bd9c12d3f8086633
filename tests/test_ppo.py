"""Layer 3: CPU smoke runs of the PPO trainer (`trainers/ppo.py`) on the tiny random model with `EchoEnv`: value head
and separate critic, LoRA, critic-only warm-up, the critic parameter group, explained variance, the TITO audit, and
token GAE over model tokens only (environment tokens skipped) checked against a plain-Python reference."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv, count_lm_head_rows

from tests.helpers.ppo import (
    AlternatingEcho,
    capture_audits,
    capture_batches,
    check_loss_aggregation,
    check_tito_audit,
    logged,
    make_trainer,
)
from trainers.advantages import place_turn_rewards, token_gae
from trainers.base import reward_function
from trainers.losses import LOSS_TYPES
from trainers.mpo import MPOConfig
from trainers.ppo import PPOConfig


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_value_head_ppo_smoke(tiny_model_folder, tiny_tokenizer, tmp_path, caplog):
    trainer = make_trainer(
        tiny_model_folder, tiny_tokenizer, tmp_path, critic_lr_multiplier=10.0, ev_negative_patience=1
    )
    head = trainer.model.value_head
    assert head is trainer.critic and head.weight.abs().sum() == 0  # zero-initialised, attached to the policy
    before = snapshot(trainer.model)
    audited = capture_audits(trainer)
    trainer.train()
    losses = logged(trainer, "loss")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    changed = {n: not torch.equal(before[n], p) for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert all(changed.values()), [n for n, c in changed.items() if not c]  # every parameter moved, the head too
    assert changed["value_head.weight"] and changed["value_head.bias"]
    groups = {g["role"]: g["lr"] for g in trainer.optimizer.param_groups}
    assert groups == {"actor": 1e-2, "critic": pytest.approx(1e-1)}  # t1.md Eq. 13
    # one generation batch, valued by the zero-initialised head before any update: V_old = 0, so
    # EV = 1 - Var[R - 0] / Var[R] = 0 exactly (t1.md Eq. 14), and it is defined (the returns vary)
    assert logged(trainer, "critic/explained_variance") == [pytest.approx(0.0, abs=1e-9)]
    assert logged(trainer, "critic/ev_defined") == [1.0]
    assert len(audited) == 1 and logged(trainer, "t1/tito_mismatch_tokens") == [0.0]  # t1.md Eq. 17
    check_tito_audit(trainer, audited[0])
    assert logged(trainer, "actor/approx_kl")[-1] > 0  # the second minibatch is off-policy
    # explained variance: an anti-correlated critic warns at once with ev_negative_patience=1 (t1.md D16)
    mask = torch.ones(1, 3)
    with caplog.at_level(logging.WARNING, logger="trainers.ppo"):
        ev = trainer.log_critic_metrics(torch.tensor([[0.0, 1.0, 2.0]]), torch.tensor([[2.0, 1.0, 0.0]]), mask)
    assert ev < 0 and "negative" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="trainers.ppo"):  # C5: undefined -> NaN, no warning
        assert math.isnan(trainer.log_critic_metrics(torch.ones(1, 3), torch.zeros(1, 3), mask))
    assert "negative" not in caplog.text
    # the TITO audit: a loss token that is not the sampled id is a hard error (t1.md D14)
    bad = SimpleNamespace(rows=[{"sampled_ids": [5, 6, 7]}], completion_ids=torch.tensor([[5, 6, 1, 8]]))
    bad.mask = torch.tensor([[1, 1, 0, 1]])
    with pytest.raises(RuntimeError, match="token-in/token-out"):
        trainer.audit_tito(bad)


def reference_gae(rewards, values, mask, boot, gamma, lam):
    """Plain GAE on the compressed sequence of model tokens of one row (t1.md Eq. 6-8)."""
    pos = [t for t, m in enumerate(mask) if m]
    r, v = [rewards[t] for t in pos], [values[t] for t in pos]
    out, carry = [0.0] * len(mask), 0.0
    for j in reversed(range(len(pos))):
        v_next = v[j + 1] if j + 1 < len(pos) else boot
        carry = r[j] + gamma * v_next - v[j] + gamma * lam * carry
        out[pos[j]] = carry
    return out


class OpenEndedEchoEnv(EchoEnv):
    """EchoEnv whose episodes would go on past a budget cut: critic trainers bootstrap them (conventions.md C4)."""

    continues_past_cut = True


@pytest.mark.parametrize(
    "env_cls, setting", [(EchoEnv, None), (EchoEnv, True), (OpenEndedEchoEnv, None), (OpenEndedEchoEnv, False)]
)
def test_gae_skips_environment_tokens_and_bootstraps_only_continuing_cut_episodes(
    env_cls, setting, tiny_model_folder, tiny_tokenizer, tmp_path
):
    """Token GAE over model tokens against a plain-Python reference. C4: by default a cut episode is a failure with
    terminal value 0; only an environment that declares `continues_past_cut` bootstraps from the value after the
    last token; `bootstrap_truncated` true / false overrides that."""
    trainer = make_trainer(
        tiny_model_folder,
        tiny_tokenizer,
        tmp_path,
        max_steps=1,
        max_turns=2,
        whiten_advantages=False,
        gamma=0.9,
        lam=0.8,
    )
    trainer.args.bootstrap_truncated = setting  # before any batch: the hooks read it per batch
    trainer.env_factory = lambda row: env_cls()
    torch.nn.init.normal_(trainer.critic.weight, std=0.5)  # non-zero values, so alignment and bootstrapping matter
    seen = capture_batches(trainer)
    trainer.train()
    batch, adv, v_all = seen[0]
    mask = batch.mask
    assert batch.truncated.all()  # max_turns 2 of 3 words: every episode is cut by the turn budget
    assert ((mask == 0) & (batch.completion_mask == 1)).any()  # there are environment tokens between turns
    bootstraps = setting is True or (setting is None and env_cls.continues_past_cut)
    assert batch.continues.tolist() == [env_cls.continues_past_cut] * len(batch.continues)
    assert logged(trainer, "ppo/bootstrapped_frac") == [1.0 if bootstraps else 0.0]
    T = batch.completion_ids.shape[1]
    values, after = v_all[:, :-1][:, -T:], v_all[:, -T:]
    old = batch.extras["old_values"]
    torch.testing.assert_close(old, values, atol=1e-5, rtol=1e-5)
    r_tok = place_turn_rewards(trainer.turn_reward_matrix(batch), batch.turn_index, mask)  # (B, T)
    for b in range(mask.shape[0]):
        last = int(batch.completion_mask[b].nonzero().max())
        assert r_tok[b, int(mask[b].nonzero().max())] == pytest.approx(float(batch.rewards[b]))  # last model token
        boot = float(after[b, last]) if bootstraps else 0.0  # the value after the last token, or a terminal 0
        ref = reference_gae(r_tok[b].tolist(), old[b].tolist(), mask[b].tolist(), boot, 0.9, 0.8)
        torch.testing.assert_close(adv[b].double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5, rtol=1e-5)
    rows = batch.truncated & bootstraps
    expected, ret = token_gae(r_tok, old, mask, rows, 0.9, 0.8, trainer.boot_values(batch, after))
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(batch.extras["returns"], ret)
    assert (adv[mask == 0] == 0).all()  # no advantage on environment tokens or padding


def test_critic_warmup_keeps_actor_bit_identical(tiny_model_folder, tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path, critic_warmup_steps=2)
    before = snapshot(trainer.model)
    trainer.train()
    for name, p in trainer.model.named_parameters():
        moved = not torch.equal(before[name], p)
        assert moved == name.startswith("value_head."), name  # t1.md §7 item 19: only the critic moves
    assert logged(trainer, "critic/only_phase") == [1.0, 1.0]


def test_lora_value_head_trains_alongside_the_adapter(tiny_model_folder, tiny_tokenizer, tmp_path):
    from peft import LoraConfig

    lora = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM"
    )
    trainer = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path, peft_config=lora, critic_lr_multiplier=5.0)
    base = trainer.model.get_base_model()
    assert base.value_head is trainer.critic
    before = snapshot(trainer.model)
    trainer.train()
    for name, p in trainer.model.named_parameters():
        moved = not torch.equal(before[name], p)
        assert moved == p.requires_grad, name  # adapter and head move, the frozen base does not
        assert p.requires_grad == ("lora_" in name or "value_head" in name), name
    critic_group = next(g for g in trainer.optimizer.param_groups if g["role"] == "critic")
    assert {id(p) for p in critic_group["params"]} <= {id(p) for p in trainer.critic.parameters()}
    assert critic_group["lr"] == pytest.approx(5e-2)
    trainer.save_model(str(tmp_path / "saved"))  # the head is not in the adapter: critic.pt carries it
    state = torch.load(tmp_path / "saved" / "critic.pt", weights_only=True)
    torch.testing.assert_close(state["weight"], trainer.critic.weight.detach())


def check_warm_start(trainer, folder, tokenizer, tmp_path, **critic) -> None:
    """Save `trainer` into tmp_path/a; a new trainer with the same critic settings and `critic_init_path` pointing at
    the saved critic.pt must hold exactly the same critic weights (t1.md D3)."""
    trainer.save_model(str(tmp_path / "a"))
    saved = str(tmp_path / "a" / "critic.pt")
    warm = make_trainer(folder, tokenizer, tmp_path / "b", critic_init_path=saved, **critic)
    for (n, p), q in zip(trainer.critic.state_dict().items(), warm.critic.state_dict().values(), strict=True):
        assert torch.equal(p, q), n


def test_separate_critic_own_group_and_warm_start(tiny_model_folder, tiny_tokenizer, tmp_path):
    trainer = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path / "a", critic_model_name_or_path="policy")
    critic_ids = {id(p) for p in trainer.critic.parameters()}
    policy = [p for p in trainer.model.parameters() if id(p) not in critic_ids]
    assert critic_ids.isdisjoint({id(p) for p in policy}) and len(critic_ids) > 2  # backbone + head (t1.md D2)
    before = snapshot(trainer.model)
    trainer.train()
    assert all(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    # warm start (t1.md D3): a new run loads the critic weights exactly; mismatching names raise
    check_warm_start(trainer, tiny_model_folder, tiny_tokenizer, tmp_path, critic_model_name_or_path="policy")
    with pytest.raises(RuntimeError):
        make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path / "c", critic_init_path=str(tmp_path / "a/critic.pt"))


@pytest.mark.parametrize("steps_per_generation", [2, 1])
def test_value_head_old_values_share_trls_old_logprob_pass(
    steps_per_generation, tiny_model_folder, tiny_tokenizer, tmp_path
):
    """With two minibatches per generation batch TRL runs a no-grad old-log-prob pass, and the value head reads V_old
    off it: no value pass of its own. With one, TRL runs none and `old_values` makes its own. Either way V_old is the
    head on the backbone's hidden states before any update, recomputed here by a plain forward."""
    trainer = make_trainer(
        tiny_model_folder,
        tiny_tokenizer,
        tmp_path,
        max_steps=1,
        steps_per_generation=steps_per_generation,
        per_device_train_batch_size=8 // steps_per_generation,  # 8 rows per generation batch either way
    )
    torch.nn.init.normal_(trainer.critic.weight)  # values that differ by position
    seen = capture_batches(trainer)
    own_passes, original = [], trainer.forward_with_values

    def counting(*args, **kwargs):
        own_passes.append(torch.is_grad_enabled())
        return original(*args, **kwargs)

    trainer.forward_with_values = counting
    estimate, own = trainer.estimate_advantages, []

    def with_own_pass(batch, *args, **kwargs):  # after V_old, before any update: the values of a pass of its own
        shared, trainer._old_pass_values = trainer._old_pass_values, None
        try:
            own.append(trainer.old_values(batch)[0])
        finally:
            trainer._old_pass_values = shared
        return estimate(batch, *args, **kwargs)

    trainer.estimate_advantages = with_own_pass
    trainer.train()
    (batch, _, v_all), T = seen[0], seen[0][0].completion_ids.shape[1]
    torch.testing.assert_close(batch.extras["old_values"], v_all[:, :-1][:, -T:].float())
    assert torch.equal(batch.extras["old_values"], own[0])  # the shared values are those of the own pass, bit for bit
    no_grad_passes = own_passes.count(False) - 8 // trainer.args.per_device_train_batch_size  # less this test's own
    assert no_grad_passes == (0 if steps_per_generation == 2 else 1)  # 8 rows: one chunk of 8 when it runs its own


def test_critic_num_layers_keeps_the_first_layers_and_the_final_norm(tiny_model_folder, tiny_tokenizer, tmp_path):
    from transformers import AutoModel

    trainer = make_trainer(
        tiny_model_folder, tiny_tokenizer, tmp_path / "a", critic_model_name_or_path="policy", critic_num_layers=1
    )
    backbone = trainer.critic.backbone
    assert len(backbone.layers) == 1 and backbone.config.num_hidden_layers == 1
    assert len(trainer.model.model.layers) == 2  # the policy keeps its two layers
    # reference: the full model's hidden state after its first layer, through the final norm, through the head
    torch.manual_seed(0)
    torch.nn.init.normal_(trainer.critic.head.weight)
    full = AutoModel.from_pretrained(tiny_model_folder)
    ids = torch.randint(5, 300, (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        hidden = full(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[1]  # (2, 7, H)
        expected = trainer.critic.head(full.norm(hidden)).squeeze(-1)
        got = trainer.critic(ids, mask)
    torch.testing.assert_close(got[mask.bool()], expected[mask.bool()])
    trainer.train()  # trains and saves with the cut critic; a warm start needs the same cut
    check_warm_start(
        trainer, tiny_model_folder, tiny_tokenizer, tmp_path, critic_model_name_or_path="policy", critic_num_layers=1
    )
    with pytest.raises(ValueError, match="only 2 decoder layers"):
        make_trainer(
            tiny_model_folder, tiny_tokenizer, tmp_path / "c", critic_model_name_or_path="policy", critic_num_layers=3
        )
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", activation_checkpointing=False)
    with pytest.raises(ValueError, match="needs a separate critic"):
        PPOConfig(critic_num_layers=1, **common)
    with pytest.raises(ValueError, match="critic_num_layers must be >= 1"):
        PPOConfig(critic_model_name_or_path="policy", critic_num_layers=0, **common)


def test_config_reward_selection_and_validation(tmp_path):
    common = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", activation_checkpointing=False)
    f = reward_function(PPOConfig(reward="assertion_count", assertion_scale=4.0, **common))
    assert f.__name__ == "assertion_count_reward"
    assert f(["", ""], final_info=[{"assertions_passed": 3, "assertions_total": 3}, {}], success=[None, True]) == [
        0.75,
        1.0,
    ]  # r = P/S = 3/4 (t1.md Eq. 1); no report -> binary fallback b = 1 (Eq. 2)
    assert reward_function(PPOConfig(reward="binary", **common)).__name__ == "binary_success_reward"
    assert reward_function(PPOConfig(**common)).__name__ == "env_reward"  # the environment's own reward
    with pytest.raises(ValueError, match="reward"):
        PPOConfig(reward="nope", **common)
    with pytest.raises(ValueError, match="beta must be 0.*pass --beta 0"):
        PPOConfig(beta=0.1, **common)
    assert PPOConfig(**common).loss_type == "dapo"  # TRL's default: a config that says nothing keeps the token mean
    for loss_type in ("sapo", "cispo", "luspo", "vespo"):  # they change the per-token loss, not its aggregation
        with pytest.raises(ValueError, match="loss_type"):
            PPOConfig(loss_type=loss_type, **common)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_loss_type_aggregates_actor_and_critic(loss_type, tiny_model_folder, tiny_tokenizer, tmp_path):
    trainer = make_trainer(
        tiny_model_folder, tiny_tokenizer, tmp_path, loss_type=loss_type, max_steps=1,
        env_factory=lambda row: AlternatingEcho(),
    )  # fmt: skip
    check_loss_aggregation(trainer, loss_type)


def test_value_head_pass_without_logps_skips_the_lm_head(tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch):
    """`old_values` asks a value head's pass for values only (docs/methods/grpo.md D12): the same values as a pass that
    also scores the loss mask, no position projected through the LM head, and log-probs 0."""
    trainer = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path)
    torch.nn.init.normal_(trainer.critic.weight)  # a head that is not all zeros, so the values differ by position
    ids = torch.tensor([[3, 4, 5], [0, 6, 7]])  # left-padded prompts
    inputs = {"prompt_ids": ids, "prompt_mask": (ids > 0).long(), "completion_ids": torch.tensor([[8, 9, 10, 0]] * 2)}
    inputs["completion_mask"] = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    rows = count_lm_head_rows(monkeypatch)
    with torch.no_grad():
        logps, _, _, values = trainer.forward_with_values(trainer.model, inputs)
        no_logps, _, _, only_values = trainer.forward_with_values(trainer.model, inputs, with_logps=False)
    assert rows == [5, 0]  # the loss mask's 3 + 2 completion tokens, then none
    torch.testing.assert_close(only_values, values, rtol=0, atol=0)
    assert values.abs().sum() > 0 and (no_logps == 0).all() and (logps[inputs["completion_mask"].bool()] != 0).all()


@pytest.mark.parametrize("detached", [True, False])
def test_detached_value_head_leaves_the_actor_gradient_alone(detached, tiny_model_folder, tiny_tokenizer, tmp_path):
    """ppo.md D14: with the head detached, the backbone's gradient is the same whatever the value loss weighs, and the
    head still learns; attached, the value loss reaches the backbone (so the check can fail)."""
    trainer = make_trainer(
        tiny_model_folder, tiny_tokenizer, tmp_path, value_head_detached=detached, value_head_hidden=8,
        learning_rate=0.0, max_steps=1,
    )  # fmt: skip
    seen, original = [], trainer.policy_loss
    trainer.policy_loss = lambda model, inputs: seen.append(inputs) or original(model, inputs)
    trainer.train()
    trainer.policy_loss = original
    torch.manual_seed(0)
    for p in trainer.critic.parameters():  # a head whose output is not 0, so its input's gradient is not 0 either
        torch.nn.init.normal_(p, std=0.5)

    def grads(vf_coef: float) -> dict[str, torch.Tensor]:
        trainer.model.zero_grad()
        trainer.args.vf_coef = vf_coef
        trainer.policy_loss(trainer.model, seen[0]).backward()
        return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}

    with_value_loss, without = grads(1.0), grads(0.0)
    backbone = [n for n in with_value_loss if not n.startswith("value_head.")]
    assert len(backbone) > 1
    assert all(torch.equal(with_value_loss[n], without[n]) for n in backbone) == detached
    head = [n for n in with_value_loss if n.startswith("value_head.")]
    assert len(head) == 4 and all(with_value_loss[n].abs().sum() > 0 for n in head)  # two layers: weights and biases


def test_value_head_options_need_the_value_head(tmp_path):
    with pytest.raises(ValueError, match="value_head_detached shapes the value head"):
        PPOConfig(output_dir=str(tmp_path), critic_model_name_or_path="policy", value_head_detached=True, **CPU_ARGS)
    with pytest.raises(ValueError, match="value_head_hidden must be >= 1"):
        PPOConfig(output_dir=str(tmp_path), value_head_hidden=0, **CPU_ARGS)
    config = MPOConfig(
        output_dir=str(tmp_path), critic_model_name_or_path="none", value_head_detached=True, **CPU_ARGS
    )
    assert config.critic_model_name_or_path is None  # the command line's way to unset MPO's separate critic
