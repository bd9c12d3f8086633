"""Routing replay (R3) inside AgentGRPOTrainer (routing-replay.md §7 items 3, 4, 9, 11, 13-16, in a trainer).

A tiny Qwen3-MoE (hidden 32, 2 layers, 8 experts, top-2) is built in-process with `envs.tiny.build_model` (no SFT) and
its routers drawn from N(0, 0.5), since Qwen3-MoE zero-initialises them and every token would tie. Everything runs in
fp32 with temperature 1, top_k 0 and dropout off, so that the sampler's log-probs are the model's exact distribution.
Rollouts play `EchoEnv` (3 turns), so every record is stitched over turns (D5).
"""

import json

import pytest
import torch
from conftest import EchoEnv
from datasets import Dataset
from torch import nn

from trainers.base import AgentGRPOConfig, AgentGRPOTrainer
from trainers.routing_replay import NO_ROUTE, RouteRecorder, find_routers
from trainers.trl_api import TRLSeams


def distinct_chars(completions, **kwargs):
    """Dense reward so that GRPO groups have non-zero spread (a random tiny model never solves EchoEnv)."""
    return [len(set(str(c))) / (1 + len(str(c))) for c in completions]


@pytest.fixture(scope="module")
def moe_folder(tiny_tokenizer, tmp_path_factory):
    from envs.tiny import TinySpec, build_model

    model = build_model(TinySpec(env="echo", moe=True, hidden_size=32, intermediate_size=64), tiny_tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in find_routers(model).modules:  # non-zero router init (§7)
            router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * 0.5)
    folder = tmp_path_factory.mktemp("tiny-moe-echo")
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return str(folder)


def echo_dataset(n: int = 4) -> Dataset:
    tasks = EchoEnv.make_tasks("train", n)
    return Dataset.from_list([{"prompt": "x", "task": json.dumps(t), "task_id": t["task_id"]} for t in tasks])


def make_trainer(folder, tokenizer, tmp_path, peft_config=None, **overrides) -> AgentGRPOTrainer:
    settings = dict(
        output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=48,
        max_turn_tokens=4, learning_rate=1e-2, report_to="none", seed=0, bf16=False, use_cpu=True,
        activation_checkpointing=False, save_strategy="no", logging_steps=1, max_steps=1, disable_dropout=True,
        temperature=1.0, top_k=0, routing_replay=True, steps_per_generation=2,  # 2 > GA = 1: old logps are computed
    )  # fmt: skip
    settings.update(overrides)
    return AgentGRPOTrainer(
        model=folder, reward_funcs=[distinct_chars], args=AgentGRPOConfig(**settings), train_dataset=echo_dataset(),
        processing_class=tokenizer, env_factory=lambda row: EchoEnv(), peft_config=peft_config,
    )  # fmt: skip


def generation_batch(trainer: AgentGRPOTrainer, seed: int = 0) -> dict:
    data = trainer.train_dataset
    rows = [dict(data[0]) for _ in range(4)] + [dict(data[1]) for _ in range(4)]  # two groups of G = 4
    torch.manual_seed(seed)
    return trainer.generate_and_score(rows)


@pytest.fixture(scope="module")
def replayed(moe_folder, tiny_tokenizer, tmp_path_factory) -> tuple[AgentGRPOTrainer, dict]:
    """One trainer and one generation batch shared by the tests that leave the weights as they found them."""
    trainer = make_trainer(moe_folder, tiny_tokenizer, tmp_path_factory.mktemp("replayed"))
    return trainer, generation_batch(trainer)


def perturb_routers(model: nn.Module, std: float = 0.5, seed: int = 1) -> None:
    """Stand-in for an optimizer step that moves the routers (§7 item 1)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for router in find_routers(model).modules:
            router.weight.add_(torch.randn(router.weight.shape, generator=generator) * std)


def actor_logps(trainer: AgentGRPOTrainer, batch: dict, monkeypatch) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Run the trainer's actor forward (compute_loss, no grad, eval mode) and return its per-token log-probs (B, T)
    and the expert ids the experts modules actually received, per MoE layer ((B * S, k) each)."""
    captured, used = [], []
    original = trainer.token_logps

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        captured.append(out[0].detach())
        return out

    monkeypatch.setattr(trainer, "token_logps", spy)
    experts = [m for name, m in trainer.model.named_modules() if name.endswith("mlp.experts")]
    handles = [m.register_forward_pre_hook(lambda mod, args: used.append(args[1].clone())) for m in experts]
    trainer.model.eval()
    try:
        with torch.no_grad():
            trainer.compute_loss(trainer.model, batch)
    finally:
        for handle in handles:
            handle.remove()
        trainer.model.train()
        monkeypatch.undo()
    assert len(captured) == 1 and len(used) == len(experts)
    return captured[0], used


def flips_against_record(routing: torch.Tensor, used: list[torch.Tensor]) -> int:
    """(position, layer) decisions with a record whose expert set differs from the one used."""
    B, S, L, k = routing.shape
    flips = 0
    for layer, ids in enumerate(used):
        recorded = routing[:, :, layer].reshape(B * S, k).long()  # (B*S, k)
        valid = recorded[:, 0] >= 0
        same = (recorded.sort(-1).values == ids.sort(-1).values).all(-1)
        flips += int((valid & ~same).sum())
    return flips


def model_tokens(batch: dict) -> torch.Tensor:
    return (batch["completion_mask"] * batch["tool_mask"]).bool()  # (B, T)


def test_routing_is_aligned_and_replay_reproduces_the_sampler(replayed, monkeypatch):
    trainer, batch = replayed
    assert trainer.replay_routing and not trainer.aux_loss_enabled and trainer.args.router_aux_loss_coef == 0.0
    assert trainer.model.config.router_aux_loss_coef == 0.0  # forced (D10, §7 item 14)
    routing = batch["routing"]
    B, P = batch["prompt_ids"].shape
    T = batch["completion_ids"].shape[1]
    assert routing.shape == (B, P + T, 2, 2) and routing.dtype == torch.int16  # (B, S, L, k), Eq. 8: 8 bytes/token
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1).bool()  # (B, S)
    last = attention.shape[1] - 1 - attention.flip(1).long().argmax(1)  # (B,) each row's final position
    has_record = (routing >= 0).all(-1).all(-1)  # (B, S)
    expected = attention.clone()
    expected[torch.arange(B), last] = False  # the final position is never fed back (§3)
    assert torch.equal(has_record, expected)
    assert (routing[~expected] == NO_ROUTE).all()
    assert (batch["turn_index"].amax(1) == 2).all()  # three assistant turns: records were stitched (D5)
    # alignment at unchanged weights: the record equals a free forward's routes over the training layout (§7 item 5)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    with torch.no_grad(), RouteRecorder(trainer.model) as recorder:
        trainer.model(input_ids=input_ids, attention_mask=attention.long())
    free = recorder.indices(B)  # (B, S, L, k)
    same = (free.sort(-1).values == routing.sort(-1).values).all(-1)  # (B, S, L)
    assert same[expected].all()
    # the replayed old-policy and actor log-probs reproduce the sampler's (§7 item 4, as a trainer)
    mask = model_tokens(batch)
    sampling = batch["sampling_per_token_logps"]
    torch.testing.assert_close(batch["old_per_token_logps"][mask], sampling[mask], atol=1e-6, rtol=0)
    logps, used = actor_logps(trainer, batch, monkeypatch)
    torch.testing.assert_close(logps[mask], sampling[mask], atol=1e-6, rtol=0)
    assert flips_against_record(routing, used) == 0


def test_replay_pins_recorded_experts_after_a_router_update(replayed, monkeypatch):
    trainer, batch = replayed
    routers = find_routers(trainer.model).modules
    saved = [r.weight.detach().clone() for r in routers]
    perturb_routers(trainer.model)
    try:
        logps, used = actor_logps(trainer, batch, monkeypatch)
        with trainer.free_routing():
            free, used_free = actor_logps(trainer, batch, monkeypatch)
    finally:
        with torch.no_grad():
            for router, weight in zip(routers, saved, strict=True):
                router.weight.copy_(weight)
    assert flips_against_record(batch["routing"], used) == 0  # §7 item 3: zero flips under index replay
    assert flips_against_record(batch["routing"], used_free) > 0  # §7 item 2: the check is not vacuous
    mask = model_tokens(batch)
    assert (free - logps)[mask].abs().max() > 1e-6


def test_router_gets_gradient_in_a_training_step_with_activation_checkpointing(moe_folder, tiny_tokenizer, tmp_path):
    """Two optimizer steps on one generation batch: the second trains at weights the sampler did not use, so routing
    matters, and its backward recompute must replay too (§7 item 9, D8): checkpointing on and off agree."""
    runs = {}
    for checkpointing in (False, True):
        trainer = make_trainer(
            moe_folder, tiny_tokenizer, tmp_path / str(checkpointing), max_steps=2,
            activation_checkpointing=checkpointing,
        )  # fmt: skip
        routers = find_routers(trainer.model).modules
        before = [r.weight.detach().clone() for r in routers]
        trainer.train()
        first, second = trainer.state.log_history[:2]
        assert first["routing/replay_active"] == 1.0 and first["routing/flip_frac"] == 0.0  # at behaviour weights
        assert first["routing/logp_gap"] < 1e-6  # Eq. 10 from the old-log-prob pass
        assert first["routing/record_bytes_per_token"] == 8  # Eq. 8: L * k * 2 = 2 * 2 * 2
        assert first["routing/prefix_recompute_mismatch_frac"] == 0.0  # Eq. 11: a deterministic re-prefill
        assert second["routing/router_grad_norm"] > 0  # Eq. 7: the router is in the graph through the gate weights
        assert all(not torch.equal(b, r.weight) for b, r in zip(before, routers, strict=True))
        runs[checkpointing] = second
    for key in ("routing/router_grad_norm", "grad_norm", "loss"):
        assert runs[True][key] == pytest.approx(runs[False][key], rel=1e-5, abs=1e-9), key


@pytest.mark.parametrize("use_peft", [True, False])
def test_reference_routes_freely_and_lora_replays(moe_folder, tiny_tokenizer, tmp_path, use_peft, monkeypatch):
    """beta > 0: the reference (PEFT: the policy with adapters disabled; else a separate model) routes freely, the
    old-log-prob pass replays (§7 items 13 and 16). The routers move between sampling and the trainer passes."""
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]) if use_peft else None
    trainer = make_trainer(moe_folder, tiny_tokenizer, tmp_path, peft_config=peft_config, beta=0.1)
    rollout = trainer.rollout_func

    def rollout_then_update(prompts, trainer_):
        out = rollout(prompts, trainer_)
        perturb_routers(trainer.model)  # after sampling, before TRL's old-logp and reference passes
        if not use_peft:
            perturb_routers(trainer.ref_model)
        return out

    trainer.rollout_func = rollout_then_update
    batch = generation_batch(trainer)
    mask = model_tokens(batch)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    T = batch["completion_ids"].shape[1]
    reference = trainer.model if use_peft else trainer.ref_model
    with torch.no_grad():  # TRL's own forward: free routing at the updated routers (LoRA B = 0: same function)
        free = TRLSeams.token_logps(trainer, reference, input_ids, attention, T)[0]  # the boundary's call of TRL
    torch.testing.assert_close(batch["ref_per_token_logps"][mask], free[mask], atol=1e-6, rtol=0)
    replayed, used = actor_logps(trainer, batch, monkeypatch)
    assert flips_against_record(batch["routing"], used) == 0
    torch.testing.assert_close(batch["old_per_token_logps"][mask], replayed[mask], atol=1e-6, rtol=0)
    assert (batch["old_per_token_logps"] - batch["ref_per_token_logps"])[mask].abs().max() > 1e-6
    if use_peft:  # a real step under replay trains the adapters through the replayed forward
        trainer.rollout_func = rollout
        lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
        trainer.train()
        assert all(not torch.equal(p, dict(trainer.model.named_parameters())[n]) for n, p in lora.items())


def test_missing_or_misaligned_routes_raise(replayed):
    trainer, batch = replayed
    holed = batch["routing"].clone()
    holed[0, batch["prompt_ids"].shape[1]] = NO_ROUTE  # the first completion position of row 0 needs a record
    trainer.model.eval()
    try:
        with pytest.raises(ValueError, match="no `routing`"):
            trainer.compute_loss(trainer.model, {k: v for k, v in batch.items() if k != "routing"})
        with pytest.raises(ValueError, match="routing covers"):
            trainer.compute_loss(trainer.model, {**batch, "routing": batch["routing"][:, 1:]})
        with pytest.raises(ValueError, match="missing record"):
            trainer.compute_loss(trainer.model, {**batch, "routing": holed})
    finally:
        trainer.model.train()


def test_init_refuses_an_unsupported_moe_family_and_is_a_no_op_for_dense(tiny_tokenizer, tiny_model_folder, tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=len(tiny_tokenizer), hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, pad_token_id=tiny_tokenizer.pad_token_id,
    )  # fmt: skip
    with pytest.raises(ValueError, match="no replay adapter"):
        make_trainer(Qwen2MoeForCausalLM(config), tiny_tokenizer, tmp_path / "qwen2moe")
    dense = make_trainer(tiny_model_folder, tiny_tokenizer, tmp_path / "dense")
    assert not dense.replay_routing and "routing" not in generation_batch(dense)
