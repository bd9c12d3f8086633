"""Layer 4: TRL guards. The TRL attributes, batch keys and helpers the code reads are still there (the signatures of
the private methods the boundary overrides are pinned by tests/test_trl_api.py), and the base trainer with default
hooks reproduces stock GRPOTrainer (advantages and loss) on a single-turn dataset."""

import inspect
from collections.abc import Callable

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv, count_lm_head_rows
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from trainers.base import AgentGRPOConfig, AgentGRPOTrainer


def distinct_chars(completions, **kwargs):
    return [len(set(c)) / (1 + len(c)) for c in completions]


def _config(cls, tmp_path, **kw):
    fields = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=8, learning_rate=1e-3)
    return cls(output_dir=str(tmp_path), **CPU_ARGS, max_steps=1, disable_dropout=True, **(fields | kw))


@pytest.mark.parametrize("scale_rewards", ["group", "none"])
def test_default_hooks_reproduce_stock_grpo(tiny_model_folder, tmp_path, scale_rewards):
    data = Dataset.from_list([{"prompt": f"say {w}"} for w in ["apple", "river", "stone", "cloud"]])
    stock = GRPOTrainer(
        model=tiny_model_folder,
        reward_funcs=[distinct_chars],
        train_dataset=data,
        args=_config(GRPOConfig, tmp_path / "a", scale_rewards=scale_rewards, max_completion_length=64),
    )
    ours = AgentGRPOTrainer(
        model=tiny_model_folder,
        reward_funcs=[distinct_chars],
        train_dataset=data,
        args=_config(AgentGRPOConfig, tmp_path / "b", scale_rewards=scale_rewards, max_completion_length=64),
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
    assert (~mask).any()  # 64 tokens: some completions end early, so the batch has padding to check
    assert (out["advantages"][~mask] == 0).all()
    assert ref["advantages"].abs().sum() > 0  # the comparison is not between two zero tensors
    loss_ref = stock.compute_loss(stock.model, ref)
    loss_ours = ours.compute_loss(ours.model, out)
    torch.testing.assert_close(loss_ours, loss_ref, rtol=1e-6, atol=1e-7)


# TRL trainer attributes with no public accessor that the project reads, and the type it expects. Where: base =
# trainers/base.py, loop = trainers/agent_loop.py, replay = trainers/routing_replay.py (RoutingReplay.setup).
TRL_ATTRIBUTES = {
    "_metrics": dict,  # base.log_metric appends to _metrics[mode][name]; TRL's log() averages and clears them
    "_step": int,  # base.training_step, base._first_micro_step: micro-steps run so far
    "use_vllm": bool,  # replay (refused with vLLM), loop.trainer_rollouts
    "tools": list,  # replay (refused when TRL's tool loop is on)
    "aux_loss_enabled": bool,  # base.forward_logps; base.__init__ turns it off under routing replay
    "reward_weights": torch.Tensor,  # base._rollout_batch: (F,) weights of the reward columns
    "num_generations": int,  # base._rollout_batch: G in training
    "num_generations_eval": int,  # base._rollout_batch: G in evaluation
    "temperature": float,  # loop.trainer_rollouts: the sampling settings of HF generation
    "top_p": float,
    "top_k": int,
    "min_p": (float, type(None)),
    "repetition_penalty": float,
    "eos_token_ids": list,  # loop.trainer_rollouts: ids that end a turn
    "rollout_func": (type(None), Callable),  # tests/test_routing_integration.py wraps it
    "environments": (type(None), list),  # bench/rollout.py: TRL's environment instances of the last batch
    "current_gradient_accumulation_steps": int,  # transformers.Trainer, set by train(): base.training_step
}


@pytest.fixture(scope="module")
def trained(tiny_model_folder, tmp_path_factory):
    """The base trainer after one optimizer step of two micro-steps (TRL's attributes, no environment)."""
    data = Dataset.from_list([{"prompt": f"say {w}"} for w in ["apple", "river", "stone", "cloud"]])
    args = AgentGRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trained")),
        per_device_train_batch_size=4,  # two micro-batches of 4: one group of G = 4 each
        gradient_accumulation_steps=2,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        **CPU_ARGS,
    )
    trainer = AgentGRPOTrainer(model=tiny_model_folder, reward_funcs=[distinct_chars], train_dataset=data, args=args)
    trainer.train()
    return trainer


@pytest.mark.parametrize("name", sorted(TRL_ATTRIBUTES))
def test_trl_attribute_is_pinned(trained, name):
    assert hasattr(trained, name), f"TRL no longer sets GRPOTrainer.{name}; update the code that reads it"
    value = getattr(trained, name)
    assert isinstance(value, TRL_ATTRIBUTES[name]), f"GRPOTrainer.{name} is now {type(value).__name__}"


def test_step_counts_micro_steps(trained):
    # max_steps=1 optimizer step of gradient_accumulation_steps=2 micro-steps: training_step ran twice
    assert trained.current_gradient_accumulation_steps == 2
    assert trained._step == 2


def test_log_averages_metrics(trained):
    assert set(trained._metrics) == {"train", "eval"}
    trained.log_metric("pin/value", 1.0)
    trained.log_metric("pin/value", 4.0)
    trained.log({})
    assert trained.state.log_history[-1]["pin/value"] == 2.5  # (1 + 4) / 2
    assert "pin/value" not in trained._metrics["train"]  # cleared for the next logging step


def test_rollout_fields_reach_the_batch_under_the_names_base_reads(tiny_model_folder, tmp_path):
    """The agent loop returns `env_mask` and `logprobs` through TRL's `rollout_func`; TRL must hand them on as
    `tool_mask` and `sampling_per_token_logps`, and an off-policy batch must carry `old_per_token_logps` (base.py
    reads all three with `.get`, so a rename would silently drop them)."""
    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple", "river"]}}] * 4)
    args = AgentGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        steps_per_generation=2,  # one generation, two optimizer steps: off-policy, so TRL runs the old-log-prob pass
        num_generations=4,
        max_completion_length=48,  # room for the observation of turn 1 and a second turn
        max_turn_tokens=3,
        **CPU_ARGS,
    )
    trainer = AgentGRPOTrainer(
        model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda row: EchoEnv()
    )
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([dict(r) for r in data] * 2)
    assert {"prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "advantages"} <= out.keys()
    assert {"tool_mask", "sampling_per_token_logps", "old_per_token_logps"} <= out.keys()
    assert (out["tool_mask"] == 0).any()  # the observation tokens of the second turn, from env_mask


def test_private_helpers_are_pinned():
    """TRL helpers outside the trainer class that the project calls, with the parameters it passes."""
    from trl.chat_template_utils import qwen3_template  # envs/shop_tools.py: the response template of tool calls
    from trl.generation.vllm_generation import VLLMGeneration  # trainers/generation.py: vllm_generate
    from trl.models import unwrap_model_for_generation  # trainers/agent_loop.py: trainer_rollouts
    from trl.trainer.utils import get_config_model_id  # trainers/base.py: as_config names the default config

    assert list(inspect.signature(get_config_model_id).parameters) == ["config"]
    assert list(inspect.signature(unwrap_model_for_generation).parameters)[:2] == ["model", "accelerator"]
    generate = list(inspect.signature(VLLMGeneration.generate).parameters)
    assert generate[:4] == ["self", "prompts", "images", "num_generations"]
    # agent_loop calls trainer.vllm_generation.generate(...); TRL sets that attribute only with use_vllm (GPU)
    assert "self.vllm_generation = VLLMGeneration(" in inspect.getsource(GRPOTrainer.__init__)
    assert isinstance(qwen3_template, dict)


def test_trl_names_the_critic_trainers_read(tiny_model_folder, tmp_path):
    """What trainers/ppo.py (and mpo.py through it) still take from TRL without a public function: the batch key
    `num_items_in_batch` and the "dapo" normaliser that `trainers.losses.dapo_token_count` mirrors (TRL computes it
    inline in `_compute_loss`), the trainer attribute `router_aux_loss_coef`, and
    `trl.trainer.disable_dropout_in_model` (applied to the critic)."""
    from trl.trainer import disable_dropout_in_model

    from trainers.losses import dapo_token_count, masked_token_mean

    critic = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Dropout(0.5))
    disable_dropout_in_model(critic)
    assert critic[1].p == 0
    data = Dataset.from_list([{"prompt": f"say {w}"} for w in ["apple", "river"]])
    args = _config(GRPOConfig, tmp_path, loss_type="dapo", steps_per_generation=2, gradient_accumulation_steps=2)
    stock = GRPOTrainer(model=tiny_model_folder, reward_funcs=[distinct_chars], train_dataset=data, args=args)
    assert isinstance(stock.router_aux_loss_coef, float)  # ppo.py: loss + router_aux_loss_coef * aux
    stock.model.train()
    stock.current_gradient_accumulation_steps = 2  # as Trainer's loop sets it for each accumulation window
    torch.manual_seed(0)
    out = stock._generate_and_score_completions([{"prompt": "say apple"}] * 4 + [{"prompt": "say river"}] * 4)
    mask = out["completion_mask"].float()  # (B, T) single turn: no tool mask
    assert out["num_items_in_batch"].item() == mask.sum().item()  # the generation batch's loss tokens (1 process)
    out.pop("old_per_token_logps", None)  # on-policy: the ratio is exactly 1, so TRL's per-token loss is -A
    adv = out["advantages"].unsqueeze(1).expand_as(mask)  # (B, T)
    assert adv.abs().sum() > 0
    n_tok = dapo_token_count(out["num_items_in_batch"], num_processes=1, steps_per_generation=2, training=True)
    expected = masked_token_mean(-adv, mask, n_tok) / 2  # what AgentPPOTrainer.policy_loss does with the actor term
    torch.testing.assert_close(stock.compute_loss(stock.model, out), expected, rtol=1e-5, atol=1e-7)


def test_fused_head_scores_only_labelled_positions_on_cpu(tiny_model_folder, monkeypatch):
    """docs/methods/grpo.md D12: on CPU TRL's fused head projects only positions with a label (`cpu_fast_paths` of
    trainers/trl_api.py turns its compact path on), and its log-probs equal a log-softmax over the plain model's logits
    there, 0 elsewhere."""
    import trl.trainer.utils as trl_utils
    from transformers import AutoModelForCausalLM

    from trainers.trl_api import cpu_fast_paths

    fused = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    trl_utils.add_fused_lm_head(fused)
    rows = count_lm_head_rows(monkeypatch)
    torch.manual_seed(0)
    ids = torch.randint(5, 300, (2, 10))
    labels = ids.clone()
    labels[0, :6] = -100  # row 0: positions 6-9 labelled
    labels[1, [0, 1, 4, 5]] = -100  # row 1: positions 2, 3, 6-9 labelled
    with torch.no_grad(), cpu_fast_paths():
        out = fused(input_ids=ids, labels=labels, fused_lm_head=True)
        logits = plain(input_ids=ids).logits
    assert rows == [4 + 6]  # labelled positions after the first (position 0 predicts nothing)
    expected = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    scored = labels[:, 1:] != -100
    torch.testing.assert_close(out.log_probs[scored], expected[scored], rtol=1e-5, atol=1e-5)
    assert (out.log_probs[~scored] == 0).all()


def echo_batch(model, tmp_path, **settings):
    """A trainer on EchoEnv and one generation batch of it: 2- and 3-turn episodes (so rows carry observations and
    padding), two minibatches per generation (off-policy, so TRL runs its old-log-prob pass)."""
    two, three = {"words": ["apple", "river"]}, {"words": ["apple", "river", "stone"]}
    data = Dataset.from_list([{"prompt": "say apple", "task": t} for t in [two] * 4 + [three] * 4])
    args = AgentGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        steps_per_generation=2,
        num_generations=4,
        max_completion_length=64,
        max_turn_tokens=3,
        **settings,
        **CPU_ARGS,
    )
    trainer = AgentGRPOTrainer(model=model, train_dataset=data, args=args, env_factory=lambda row: EchoEnv())
    torch.manual_seed(0)
    return trainer, trainer._generate_and_score_completions([dict(r) for r in data])


def test_loss_scores_only_model_tokens(tiny_model_folder, tmp_path, monkeypatch):
    """docs/methods/grpo.md D12: the loss's log-prob forward scores the loss mask's positions only (no environment
    token, no padding, no prompt), and gives the same loss and gradient as TRL's forward over every position; the old
    log-probs are 0 off the mask like the loss's own."""
    trainer, out = echo_batch(tiny_model_folder, tmp_path)
    mask = out["completion_mask"] * out["tool_mask"]  # (B, T)
    assert (out["old_per_token_logps"][mask == 0] == 0).all()
    assert (out["old_per_token_logps"][mask == 1] != 0).all()
    batch = {k: v[:4] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in out.items()}  # the 2-turn rows
    assert (batch["tool_mask"] == 0).any() and (batch["completion_mask"] == 0).any()  # observations and padding
    batch["advantages"] = torch.linspace(-1.0, 1.0, 4).unsqueeze(1) * batch["completion_mask"]  # a signal everywhere
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 2
    rows = count_lm_head_rows(monkeypatch)
    loss = trainer.compute_loss(model, batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    assert rows == [int(mask[:4].sum())]
    rows.clear()
    everywhere = GRPOTrainer._compute_loss(trainer, model, batch)  # TRL's forward: every attended position
    everywhere.backward()
    assert rows == [int(batch["completion_mask"].sum())]
    torch.testing.assert_close(loss, everywhere, rtol=1e-6, atol=1e-7)
    for g, p in zip(grads, [p for p in model.parameters() if p.grad is not None], strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in grads)
    with torch.no_grad():
        logps, _, _ = trainer.forward_logps(model, batch)
        full, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, model, torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1),
            torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1), batch["completion_ids"].size(1),
        )  # fmt: skip
    on = mask[:4].bool()
    assert (logps[~on] == 0).all() and (full[~on & batch["completion_mask"].bool()] != 0).all()
    torch.testing.assert_close(logps[on], full[on], rtol=1e-5, atol=1e-6)


def test_old_and_reference_passes_score_only_model_tokens(tiny_model_folder, tmp_path, monkeypatch):
    """docs/methods/grpo.md D12: TRL's no-grad passes over a generation batch (old log-probs, reference log-probs)
    project only the model's tokens, and equal a full pass of the same model there."""
    rows = count_lm_head_rows(monkeypatch)
    trainer, out = echo_batch(tiny_model_folder, tmp_path, beta=0.04)  # beta > 0: TRL's reference pass too
    mask = out["completion_mask"] * out["tool_mask"]  # (B, T)
    assert (out["tool_mask"] == 0).any() and (out["completion_mask"] == 0).any()  # observations and padding
    assert sum(rows) == 2 * int(mask.sum())  # two passes, each over the model's tokens only (in TRL's chunks)
    assert trainer.generation_step is None  # nothing carries over into the loss's forwards
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    on = mask.bool()
    with torch.no_grad():
        for key, model in (("old_per_token_logps", trainer.model), ("ref_per_token_logps", trainer.ref_model)):
            full, _, _ = GRPOTrainer._get_per_token_logps_and_entropies(
                trainer, model, ids, attention, ids.size(1) - out["prompt_ids"].size(1)
            )
            assert (out[key][~on] == 0).all() and (full[~on & out["completion_mask"].bool()] != 0).all()
            torch.testing.assert_close(out[key][on], full[on], rtol=1e-5, atol=1e-6)


def test_pads_right_only():
    """docs/methods/grpo.md D15: a mask qualifies when each row is ones then zeros, and not otherwise."""
    from trainers.cpu_paths import pads_right_only

    assert pads_right_only(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]))
    assert not pads_right_only(torch.tensor([[1, 1, 0, 0], [0, 1, 1, 1]]))  # left padding in row 1
    assert not pads_right_only(torch.tensor([[1, 0, 1, 1]]))  # a gap inside the row


def attention_calls(monkeypatch) -> list[tuple[bool, bool]]:
    """(mask given, is_causal) of every call of PyTorch's attention while the test runs."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(*args, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask is not None, is_causal))
        return sdpa(*args, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_right_padded_forwards_run_as_plain_causal_attention(tiny_model_folder, tmp_path, monkeypatch):
    """docs/methods/grpo.md D15: on a batch padded only on the right, the log-prob forwards hand attention no mask
    (plain causal attention), and the loss, its gradient and the log-probs equal those of the same forwards with
    transformers' padding mask."""
    import trainers.cpu_paths

    trainer, out = echo_batch(tiny_model_folder, tmp_path)
    batch = {k: v[:8] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in out.items()}
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    assert trainers.cpu_paths.pads_right_only(attention) and (attention == 0).any()  # 2- and 3-turn episodes
    batch["advantages"] = torch.linspace(-1.0, 1.0, 8).unsqueeze(1) * batch["completion_mask"]
    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 2
    calls = attention_calls(monkeypatch)

    def loss_grads_logps():
        calls.clear()
        model.zero_grad()
        loss = trainer.compute_loss(model, batch)
        loss.backward()
        with torch.no_grad():
            logps, _, _ = trainer.forward_logps(model, batch)
        return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None], logps

    causal = loss_grads_logps()
    assert calls and set(calls) == {(False, True)}  # every layer of both forwards: no mask, causal
    monkeypatch.setattr(trainers.cpu_paths, "pads_right_only", lambda mask: False)
    masked = loss_grads_logps()
    assert calls and set(calls) == {(True, False)}  # transformers' (B, 1, S, S) mask
    torch.testing.assert_close(causal[0], masked[0], rtol=1e-6, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in causal[1])
    for a, b in zip(causal[1], masked[1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    scored = (batch["completion_mask"] * batch["tool_mask"]).bool()
    torch.testing.assert_close(causal[2][scored], masked[2][scored], rtol=1e-6, atol=1e-6)


def test_left_padded_forwards_keep_their_mask(tiny_model_folder, tmp_path, monkeypatch):
    """docs/methods/grpo.md D15: prompts of different lengths are padded on the left; that mask is kept."""
    trainer, out = echo_batch(tiny_model_folder, tmp_path)
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    attention = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    attention[0, :2] = 0  # row 0's prompt two tokens shorter
    calls = attention_calls(monkeypatch)
    with torch.no_grad():
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, attention, out["completion_ids"].size(1))
    assert calls and set(calls) == {(True, False)}
