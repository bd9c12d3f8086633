"""PPO for agents: a learned critic, token GAE over model tokens, clipped surrogate and clipped value loss; T1's critic
practices as options. The one deliberate second base: `trainers/mpo.py` builds on it.

T1: https://huggingface.co/papers/2609.11042 (`docs/methods/t1.md`). PPO: https://huggingface.co/papers/1707.06347.

What changes relative to GRPO (`AgentGRPOTrainer`):

1. **A critic instead of the group baseline.** Either a zero-initialised `nn.Linear(hidden, 1)` value head on the
   policy's backbone (default; attached to the underlying model, `get_base_model()` under PEFT, so the optimizer and
   DDP pick it up; with LoRA the head trains alongside the adapter), fed by a forward hook on the backbone, so one
   forward gives log-probs and values; or a separate critic (`critic_model_name_or_path`: a causal LM's backbone plus
   a head, parameters disjoint from the actor's, t1.md D2). Values are aligned like log-probs: the value of
   completion token t is the state before it, `values[:, :-1][:, -T:]`.
2. **Token GAE over model tokens only** (t1.md Eq. 6-8): environment tokens are not time steps, the recursion skips
   them. Per-turn environment rewards sit on the last model token of their turn, a trajectory reward on the last
   model token of the row (conventions.md C3). An episode cut by a budget is a finished failure with terminal value 0,
   like a terminated one (C4, the T1 rule, t1.md D8), unless its environment declares `continues_past_cut`: then it
   bootstraps from the value of the state after its last token. `bootstrap_truncated: true` bootstraps every cut
   episode (the old default, which collapsed PPO on tiny:shop), `false` none.
3. **Old values V^old** come from a no-grad forward right after generation (before any update on the batch) and reach
   the loss as `old_values` and `returns` in `batch.extras`.
4. **Loss** = clipped surrogate (t1.md Eq. 11) + `vf_coef` x clipped value loss (t1.md Eq. 12), both aggregated as
   TRL's `loss_type` says (`grpo`, `dapo`, `bnpo` or `dr_grpo`, conventions.md C22; TRL's default `dapo` is one token
   mean over the optimizer step), divided by the accumulation steps (TRL's `loss_is_scaled_for_ga`). No KL term
   (`beta` must be 0), no entropy bonus.
5. **T1 options**: `critic_lr_multiplier` (own optimizer parameter group, t1.md Eq. 13), `critic_warmup_steps`
   (critic-only optimizer steps: actor loss x 0 and actor gradients dropped, so actor weights stay bit-identical,
   t1.md D4), explained variance every generation batch from all-reduced sums (t1.md Eq. 14-15) with a warning when
   it stays negative (D16; undefined -> NaN, no warning, C5), `reward: assertion_count` (dense r = P/S, t1.md Eq. 1)
   and a token-in/token-out audit (t1.md Eq. 17; a mismatch is a hard error, D14).

PPO concepts on TRL's GRPO machinery: PPO epochs = `num_iterations`; minibatches per generation batch =
`steps_per_generation / gradient_accumulation_steps` (each generation batch is shuffled and split into
`steps_per_generation` micro-batches; an optimizer step every `gradient_accumulation_steps` of them). T1 and MPO use
1 epoch x 2 minibatches (`steps_per_generation: 2` with `gradient_accumulation_steps: 1`).

What stays the same: generation, the agent loop, reward functions, TRL's shuffling/splitting and `old_per_token_logps`.
Left out: groups. TRL's `GRPOConfig` insists on `num_generations >= 2`; the critic trainer ignores groups entirely
(no group statistic is used), so keep G small (default 2); T1/MPO's G = 1 needs a TRL change. Per-group gradient-norm
clipping (t1.md D2) is not implemented: the Trainer's global clip applies to actor and critic together.

Logged metrics:
- `critic/explained_variance`: 1 - Var[R - V_old] / Var[R] over the global batch's model tokens (NaN: undefined).
- `critic/ev_defined`: 1 when the explained variance is defined (C5), else 0.
- `critic/ev_negative_streak`: consecutive generation batches with negative explained variance after the warm-up.
- `critic/value_mean`, `critic/return_mean`: mean V_old and mean return R over model tokens.
- `critic/value_loss`: clipped value loss (token mean, before `vf_coef`).
- `critic/value_clip_frac`: fraction of model tokens whose value moved more than `cliprange_value` from V_old.
- `critic/only_phase`: 1 during the critic-only warm-up steps.
- `critic/lr`: the critic parameter group's learning rate.
- `actor/loss`: clipped surrogate (token mean; multiplied by 0 during the warm-up).
- `actor/clip_frac`: fraction of model tokens whose clipped branch binds.
- `actor/approx_kl`: mean of (ratio - 1) - log ratio over model tokens (k3 estimator, old vs current policy).
- `actor/entropy`: mean token entropy of the policy.
- `ppo/advantage_mean`, `ppo/advantage_std`: over model tokens, after optional whitening.
- `ppo/bootstrapped_frac`: fraction of rows bootstrapping from the value (cut by a budget and bootstrapped, C4).
- `t1/tito_mismatch_tokens`: loss-bearing tokens whose id is not the id the sampler emitted (must be 0).

Decision ids (`Dn`) without a page are docs/methods/t1.md's (this file's critic practices are T1's).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, field

import torch
from peft import PeftModel
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from rewards.verifiers import tito_mismatch_count
from trainers.advantages import (
    explained_variance_from_sums,
    explained_variance_sums,
    masked_sums,
    place_turn_rewards,
    token_gae,
    whiten,
)
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, RolloutBatch
from trainers.losses import (
    LOSS_TYPES,
    aggregate_loss,
    clip_fractions,
    clipped_surrogate_loss,
    clipped_value_loss,
    dapo_token_count,
)
from trainers.trl_api import disable_dropout_in_model, name_or_path

logger = logging.getLogger(__name__)


@dataclass
class PPOConfig(AgentGRPOConfig):
    """AgentGRPOConfig plus the critic. Changed defaults: `num_generations=2` (groups are unused),
    `ddp_find_unused_parameters=False` (the hook-fed head is not in forward's output), `disable_dropout=True` (exact
    old log-probs and values)."""

    num_generations: int | None = field(
        default=2, metadata={"help": "Rollouts per task. The critic ignores groups; TRL requires at least 2."}
    )
    ddp_find_unused_parameters: bool | None = field(
        default=False, metadata={"help": "Must stay False: the value head is fed by a hook, not by forward's output."}
    )
    disable_dropout: bool = field(default=True, metadata={"help": "Disable dropout (exact old log-probs and values)."})
    gamma: float = field(default=1.0, metadata={"help": "Discount per model token (t1.md Eq. 6; T1: 1.0)."})
    lam: float = field(default=0.95, metadata={"help": "GAE lambda (t1.md Eq. 7; TRL's PPOTrainer 0.95, T1 1.0)."})
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the clipped value loss (TRL's PPOTrainer: 0.1)."})
    cliprange_value: float = field(
        default=0.2, metadata={"help": "Value clip epsilon_v, absolute in reward units (t1.md Eq. 12)."}
    )
    whiten_advantages: bool = field(
        default=True, metadata={"help": "Whiten advantages over the model tokens of the global batch (T1/MPO: off)."}
    )
    bootstrap_truncated: bool | None = field(
        default=None,
        metadata={
            "help": "Which budget-cut episodes bootstrap from the value: None (default) only those whose environment "
            "declares `continues_past_cut` (none of the built-in ones: a cut episode is a finished failure, "
            "conventions.md C4); True every one; False none (t1.md D8)."
        },
    )
    critic_model_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "None: value head on the policy's backbone ('none' on the command line, e.g. to unset MPO's "
            "default). A path or Hub id: a separate critic (that causal LM's backbone plus a head); 'policy' loads "
            "the policy's own starting checkpoint as the critic (t1.md D2)."
        },
    )
    critic_num_layers: int | None = field(
        default=None,
        metadata={
            "help": "Keep only the first N decoder layers of a separate critic (its final norm and the head follow "
            "layer N): a cheaper critic, in step time and memory, than a full copy of the policy. None keeps all."
        },
    )
    value_head_detached: bool = field(
        default=False,
        metadata={
            "help": "The value head reads the policy's last hidden states without sending its loss's gradient into "
            "them: the value loss trains the head alone, at critic_lr_multiplier x the learning rate, and the actor's "
            "gradient is the one it would be with no critic. A critic at almost no extra cost, with the policy's own "
            "features (ppo.md D14). Only with the value head (critic_model_name_or_path unset)."
        },
    )
    value_head_hidden: int | None = field(
        default=None,
        metadata={
            "help": "Width of a hidden layer in the value head (hidden size -> N -> GELU -> 1); None: one linear map "
            "(ppo.md D14). Only with the value head."
        },
    )
    critic_init_path: str | None = field(
        default=None,
        metadata={"help": "critic.pt of an earlier run (warm critic, t1.md D3); weights only, names must match."},
    )
    critic_lr_multiplier: float = field(
        default=1.0, metadata={"help": "Critic learning rate = this x learning_rate (t1.md Eq. 13; T1/MPO: 15)."}
    )
    critic_warmup_steps: int = field(
        default=0, metadata={"help": "First optimizer steps that train only the critic (t1.md D4: 2 when warm)."}
    )
    ev_negative_patience: int = field(
        default=5, metadata={"help": "Warn when the explained variance is negative this many batches in a row (D16)."}
    )
    tito_audit: bool = field(
        default=True, metadata={"help": "Audit token-in/token-out every batch; a mismatch raises (t1.md Eq. 17, D14)."}
    )

    def __post_init__(self):
        super().__post_init__()
        critic = self.critic_model_name_or_path
        if isinstance(critic, str) and critic.lower() in ("none", "null"):
            self.critic_model_name_or_path = None  # the command line's way to ask for the value head
        if self.beta != 0.0:
            raise ValueError(
                f"beta must be 0: the critic trainers have no KL term (t1.md §5), got {self.beta}; pass --beta 0 "
                "(configs/quickstart.yaml sets 0.02 for GRPO)"
            )
        if self.loss_type not in LOSS_TYPES:  # conventions.md C22; the others change the per-token loss itself
            raise ValueError(
                f"loss_type must be one of {LOSS_TYPES} for the critic trainers (conventions.md C22), got "
                f"{self.loss_type!r}"
            )
        for name in ("gamma", "lam"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.vf_coef < 0:
            raise ValueError(f"vf_coef must be >= 0, got {self.vf_coef}")
        if self.cliprange_value <= 0:
            raise ValueError(f"cliprange_value must be > 0, got {self.cliprange_value}")
        if self.critic_lr_multiplier <= 0:
            raise ValueError(f"critic_lr_multiplier must be > 0, got {self.critic_lr_multiplier}")
        if self.critic_warmup_steps < 0:
            raise ValueError(f"critic_warmup_steps must be >= 0, got {self.critic_warmup_steps}")
        if self.critic_model_name_or_path is not None:
            for name in ("value_head_detached", "value_head_hidden"):
                if getattr(self, name) not in (None, False):
                    raise ValueError(
                        f"{name} shapes the value head on the policy's backbone, but critic_model_name_or_path "
                        f"({self.critic_model_name_or_path!r}) asks for a separate critic; unset one of them"
                    )
        if self.value_head_hidden is not None and self.value_head_hidden < 1:
            raise ValueError(f"value_head_hidden must be >= 1, got {self.value_head_hidden}")
        if self.critic_num_layers is not None:
            if self.critic_model_name_or_path is None:
                raise ValueError(
                    "critic_num_layers needs a separate critic (critic_model_name_or_path, e.g. 'policy'): the value "
                    "head reads the policy's own last layer"
                )
            if self.critic_num_layers < 1:
                raise ValueError(f"critic_num_layers must be >= 1, got {self.critic_num_layers}")


def zero_value_head(hidden_size: int, width: int | None = None) -> nn.Module:
    """A scalar head whose output starts at 0: one zero linear map, or hidden -> width -> GELU -> a zero linear map."""
    head = nn.Linear(hidden_size if width is None else width, 1)
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    return head if width is None else nn.Sequential(nn.Linear(hidden_size, width), nn.GELU(), head)


def keep_first_layers(backbone: nn.Module, n: int) -> None:
    """Cut a transformers backbone to its first `n` decoder layers, in place (its config too). Decoder-only models
    keep their layers in a `layers` list and run `layers[: config.num_hidden_layers]`; the final norm stays."""
    layers = getattr(backbone, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ValueError(
            f"critic_num_layers: {type(backbone).__name__} keeps no `layers` list of decoder layers; leave it unset"
        )
    if n > len(layers):
        raise ValueError(f"critic_num_layers is {n}, but the critic has only {len(layers)} decoder layers")
    backbone.layers = layers[:n]
    config = backbone.config
    config.num_hidden_layers = n
    if isinstance(getattr(config, "layer_types", None), list):  # one entry per layer, checked against the count
        config.layer_types = config.layer_types[:n]


class Critic(nn.Module):
    """A separate value model: a causal LM's backbone plus a zero-initialised scalar head. (B, L) ids -> (B, L)."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.head = zero_value_head(hidden_size)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1)  # (B, L)


class AgentPPOTrainer(AgentGRPOTrainer):
    """PPO with a critic for multi-turn agents, plus T1's critic practices; see the module docstring (which also lists
    the logged metrics). Overrides the two hooks and the public `create_optimizer` / `save_model`.

    The two hooks hold the critic machinery every critic method shares; a subclass (MPO) plugs in its own math by
    overriding `estimate_advantages` (called by `compute_advantages`) and `actor_loss` (called by `policy_loss`)."""

    config_class = PPOConfig

    def __init__(self, model, reward_funcs=None, args: PPOConfig | None = None, *rest, **kwargs):
        super().__init__(model, reward_funcs, args, *rest, **kwargs)
        args = self.args  # a PPOConfig: the base converts a plain GRPOConfig or None (`config_class`)
        # per-turn environment rewards go on their turns (C3); any other reward is a trajectory reward
        self.per_turn_rewards = reward_funcs is None and args.reward == "env"
        base = self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model
        hidden = base.config.get_text_config().hidden_size
        self._capture: list[Tensor] | None = None  # values the backbone hook collects while not None
        self._old_pass_values: list[Tensor] | None = None  # a value head's values from TRL's old-log-prob pass
        if args.critic_model_name_or_path is None:
            self.critic: nn.Module = zero_value_head(hidden, args.value_head_hidden)
            base.value_head = self.critic  # a submodule of the policy: optimizer and DDP pick it up
            base.base_model.register_forward_hook(self._value_hook)
        else:
            path = name_or_path(base.config) if args.critic_model_name_or_path == "policy" else None
            lm = AutoModelForCausalLM.from_pretrained(path or args.critic_model_name_or_path, dtype=base.dtype)
            if args.critic_num_layers is not None:
                keep_first_layers(lm.base_model, args.critic_num_layers)
            self.critic = Critic(lm.base_model, lm.config.get_text_config().hidden_size)
            base.critic = self.critic
        self.critic.to(base.device)
        if args.critic_init_path:
            self.critic.load_state_dict(torch.load(args.critic_init_path, map_location=base.device, weights_only=True))
        if args.disable_dropout:
            disable_dropout_in_model(self.critic)
        self.ev_negative_streak = 0

    # ----------------------------------------------------------------------------------------------------------------
    # Values
    def _value_hook(self, module, args, output) -> None:
        if self._capture is not None:
            hidden = output.last_hidden_state  # (B, L, H)
            if self.args.value_head_detached:  # ppo.md D14: the value loss trains the head alone
                hidden = hidden.detach()
            dtype = next(self.critic.parameters()).dtype
            self._capture.append(self.critic(hidden.to(dtype)).squeeze(-1).float())  # (B, L)

    def critic_values(self, inputs: dict) -> Tensor:
        """A separate critic's values (B, L) at every position of prompt + completion, with no policy forward."""
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # (B, L)
        attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (B, L)
        with self.accelerator.autocast():
            return self.critic(ids, attn).float()  # (B, L)

    def forward_with_values(self, model, inputs: dict, compute_entropy: bool = False, with_logps: bool = True):
        """`forward_logps` plus the critic's values (B, L) at every position of prompt + completion. With
        `with_logps=False`, values only: the log-probs come back 0, and a value head's pass skips the LM head (grpo.md
        D12)."""
        if isinstance(self.critic, Critic):
            logps, entropies, aux = self.forward_logps(model, inputs, compute_entropy)
            return logps, entropies, aux, self.critic_values(inputs)
        scored = None if with_logps else torch.zeros_like(inputs["completion_mask"])
        self._capture = []  # the value hook fills it
        try:
            logps, entropies, aux = self.forward_logps(model, inputs, compute_entropy, scored)
            values = torch.cat(self._capture, dim=0)  # (B, L)
        finally:
            self._capture = None
        return logps, entropies, aux, values

    def generate_and_score(self, inputs):
        """The base's, with a value head's values read off TRL's old-log-prob pass when TRL runs one (minibatches
        after the first are off-policy): the backbone forward that gives the old log-probs feeds the head too, so
        `old_values` needs no pass of its own (ppo.md D7). Not under MoE routing replay, where that pass replays the
        rollout's routes while values route freely (routing-replay.md D7)."""
        share = not isinstance(self.critic, Critic) and not self.routing_replay.active
        self._old_pass_values = [] if share else None
        try:
            return super().generate_and_score(inputs)
        finally:
            self._old_pass_values = None

    def token_logps(self, model, input_ids, *args, **kwargs):
        if self._old_pass_values is None or torch.is_grad_enabled() or self._capture is not None:
            return super().token_logps(model, input_ids, *args, **kwargs)
        self._capture = []  # the value hook fills it, one entry per chunk of the pass
        try:
            out = super().token_logps(model, input_ids, *args, **kwargs)
            self._old_pass_values.extend(self._capture)
        finally:
            self._capture = None
        return out

    @torch.no_grad()
    def old_values(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """V_old before each completion token (B, T) and after each (B, T), float32: a value head's are read off TRL's
        old-log-prob pass when it ran (`_generate_and_score_completions`); otherwise they come from a no-grad forward
        in chunks of `per_device_train_batch_size` rows, the critic's alone when it is separate, else the policy's
        (whose backbone feeds the value head; its log-probs are not needed)."""
        (B, T), n = batch.completion_ids.shape, self.args.per_device_train_batch_size
        if self._old_pass_values:
            values = torch.cat(self._old_pass_values, dim=0)  # (B, L)
            L = batch.prompt_ids.shape[1] + T
            if values.shape != (B, L):
                raise RuntimeError(f"the old-log-prob pass valued {tuple(values.shape)} positions, expected {(B, L)}")
            return values[:, :-1][:, -T:], values[:, -T:]
        keys = {"prompt_ids": batch.prompt_ids, "prompt_mask": batch.prompt_mask}
        keys.update(completion_ids=batch.completion_ids, completion_mask=batch.completion_mask)
        separate, chunks = isinstance(self.critic, Critic), []
        with self.free_routing():  # MoE replay: the rollout's routes are gone by now; values route freely
            for s in range(0, B, n):
                chunk = {k: v[s : s + n] for k, v in keys.items()}
                if separate:
                    chunks.append(self.critic_values(chunk))  # (n, L)
                else:
                    chunks.append(self.forward_with_values(self.model, chunk, with_logps=False)[3])
        values = torch.cat(chunks, dim=0)  # (B, L)
        return values[:, :-1][:, -T:], values[:, -T:]  # state before / after each completion token

    # ----------------------------------------------------------------------------------------------------------------
    # Rewards and masks
    def turn_reward_matrix(self, batch: RolloutBatch) -> Tensor:
        """(B, K) float64 rewards per turn: the environment's per-turn rewards, or the trajectory reward on the last
        turn (mpo.md Eq. 4; conventions.md C3). NaN (unscorable) rewards become 0; such rows carry no loss."""
        if self.per_turn_rewards:
            return batch.turn_rewards.to(torch.float64)
        B, K = batch.turn_valid.shape
        last = (batch.turn_valid.sum(dim=1) - 1).clamp(min=0)  # (B,)
        r = torch.nan_to_num(batch.rewards.to(torch.float64), nan=0.0)  # (B,)
        out = torch.zeros(B, K, dtype=torch.float64, device=r.device)
        return out.scatter(1, last.unsqueeze(1), r.unsqueeze(1)) * batch.turn_valid.any(dim=1, keepdim=True)

    def batch_mask(self, batch: RolloutBatch) -> Tensor:
        """(B, T) loss mask without unscorable rows (t1.md D9: they train neither actor nor critic); records the
        row flags in `batch.extras["scorable"]` for the loss."""
        scorable = ~torch.isnan(batch.rewards)  # (B,)
        batch.extras["scorable"] = scorable.float()
        return batch.mask * scorable.unsqueeze(1)

    def boot_values(self, batch: RolloutBatch, after: Tensor) -> Tensor:
        """(B,) the value of the state after the last completion token (C4)."""
        T = batch.completion_mask.shape[1]
        pos = torch.arange(T, device=after.device).expand_as(after)
        last = torch.where(batch.completion_mask.bool(), pos, 0).amax(dim=1, keepdim=True)  # (B, 1)
        return after.gather(1, last).squeeze(1)  # (B,)

    # ----------------------------------------------------------------------------------------------------------------
    # Hook 1: advantages
    def compute_advantages(self, batch: RolloutBatch) -> Tensor:
        """The critic's steps around the estimator: loss mask without unscorable rows (t1.md D9), V_old, truncation and
        bootstrap values (C4), `estimate_advantages`, optional whitening, the loss inputs `old_values` and `returns`,
        the critic and advantage metrics and the TITO audit."""
        a = self.args
        mask = self.batch_mask(batch)  # (B, T)
        values, after = self.old_values(batch)  # (B, T), (B, T)
        truncated = batch.continues if a.bootstrap_truncated is None else batch.truncated & a.bootstrap_truncated  # C4
        boot = self.boot_values(batch, after)  # (B,)
        adv, ret = self.estimate_advantages(batch, mask, values, truncated, boot)  # (B, T), (B, T)
        if a.whiten_advantages:
            adv = whiten(adv, mask, self.reduce_sum(masked_sums(adv, mask)))  # one affine map over the global batch
        batch.extras.update(old_values=values, returns=ret)
        self.log_critic_metrics(ret, values, mask)
        self.log_advantage_metrics(adv, mask, truncated)
        self.audit_tito(batch)
        return adv

    def estimate_advantages(
        self, batch: RolloutBatch, mask: Tensor, values: Tensor, truncated: Tensor, boot: Tensor
    ) -> tuple[Tensor, Tensor]:
        """The estimator: advantages and critic targets, both (B, T), from the loss mask, V_old (B, T), the rows that
        bootstrap (B,) and their bootstrap values (B,). PPO: token GAE over model tokens (t1.md Eq. 6-8)."""
        r_tok = place_turn_rewards(self.turn_reward_matrix(batch), batch.turn_index, mask)  # (B, T) C3
        return token_gae(r_tok, values, mask, truncated, self.args.gamma, self.args.lam, boot)  # t1.md Eq. 6-8

    # Hook 2: the loss
    def policy_loss(self, model, inputs: dict) -> Tensor:
        """actor + vf_coef * critic for one micro-batch, both aggregated as `loss_type` says (TRL's aggregations;
        default "dapo", one token mean over the optimizer step; conventions.md C22), scaled for gradient accumulation.
        One forward gives log-probs and values; the actor's per-token loss comes from `actor_loss`, the critic's is the
        clipped value loss (t1.md Eq. 12)."""
        a, train = self.args, self.model.training
        logps, entropies, aux, values_all = self.forward_with_values(model, inputs, compute_entropy=True)
        mask = self.loss_mask(inputs) * inputs["scorable"].unsqueeze(1)  # (B, T) without unscorable rows (D9)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old  # on-policy: ratio 1 (TRL skips the old forward)
        actor_tok, actor_sums = self.actor_loss(logps, old, inputs, mask)  # (B, T), local token sums to log
        values = values_all[:, :-1][:, -mask.shape[1] :]  # (B, T) state before each completion token
        n_tok = dapo_token_count(
            inputs["num_items_in_batch"], self.accelerator.num_processes, a.steps_per_generation, train
        )
        agg = {"loss_type": a.loss_type, "num_tokens": n_tok, "max_completion_length": a.max_completion_length}
        actor = aggregate_loss(actor_tok, mask, **agg)  # t1.md Eq. 11, aggregated per conventions.md C22
        vf_tok = clipped_value_loss(values, inputs["old_values"], inputs["returns"], mask, a.cliprange_value)  # Eq. 12
        critic = aggregate_loss(vf_tok, mask, **agg)  # t1.md Eq. 12, the actor's aggregation (ppo.md D8)
        loss = (0.0 if self.critic_only() else 1.0) * actor + a.vf_coef * critic  # t1.md D4: critic-only phase
        if aux is not None:
            loss = loss + self.router_aux_loss_coef * aux
        with torch.no_grad():
            m = mask.bool()
            log_ratio = (logps - old).double()  # (B, T)
            moved = ((values - inputs["old_values"]).abs() > a.cliprange_value) & m
            sums = {
                "actor/loss": actor_tok.double()[m].sum(),
                "actor/approx_kl": (log_ratio.exp() - 1 - log_ratio)[m].sum(),  # k3 estimator
                "actor/entropy": entropies.double()[m].sum(),
                "critic/value_loss": vf_tok.double()[m].sum(),
                "critic/value_clip_frac": moved.sum().double(),
            }
            self.log_token_means({**sums, **actor_sums}, m.sum().double())
        if train:
            self.log_metric("critic/only_phase", float(self.critic_only()))
            for group in self.optimizer.param_groups:
                if group.get("role") == "critic":
                    self.log_metric("critic/lr", group["lr"])
                    break
            return loss / self.current_gradient_accumulation_steps  # TRL's loss_is_scaled_for_ga
        return loss

    def actor_loss(
        self, logps: Tensor, old_logps: Tensor, inputs: dict, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """The actor's per-token loss (B, T), 0 off `mask`, and local token sums of its own metrics (logged as means
        over the loss tokens). PPO: the clipped surrogate with the token ratio (t1.md Eq. 10-11)."""
        eps_low, eps_high = self.clip_range()
        adv = inputs["advantages"]  # (B, T)
        actor_tok = clipped_surrogate_loss(logps, old_logps, adv, mask, eps_low, eps_high)  # t1.md Eq. 10-11
        with torch.no_grad():
            ratio = torch.exp((logps - old_logps) * mask)  # (B, T) t1.md Eq. 10
            clip = clip_fractions(ratio, adv, mask, eps_low, eps_high)["clip_frac"]
        return actor_tok, {"actor/clip_frac": clip * mask.sum()}

    # ----------------------------------------------------------------------------------------------------------------
    # Helpers shared with MPO
    def clip_range(self) -> tuple[float, float]:
        """(eps_low, eps_high) from the config, as TRL reads them: `epsilon_high` defaults to `epsilon`."""
        a = self.args
        return a.epsilon, a.epsilon if a.epsilon_high is None else a.epsilon_high

    def critic_only(self) -> bool:
        return self.model.training and self.state.global_step < self.args.critic_warmup_steps

    def reduce_sum(self, x: Tensor) -> Tensor:
        return self.accelerator.reduce(x, reduction="sum")

    def reduce_sums(self, sums: dict[str, Tensor]) -> dict[str, float]:
        """Named local sums (0-d tensors), summed over processes in one all-reduce."""
        total = self.reduce_sum(torch.stack([s.double().reshape(()) for s in sums.values()]))
        return dict(zip(sums, total.tolist(), strict=True))

    def log_token_means(self, sums: dict[str, Tensor], count: Tensor) -> None:
        """Log global means: each entry is a local sum, `count` the local count; one all-reduce for all."""
        total = self.reduce_sums({**sums, "count": count})
        n = max(total.pop("count"), 1.0)
        for name, value in total.items():
            self.log_metric(name, value / n)

    def log_critic_metrics(self, returns: Tensor, values: Tensor, mask: Tensor) -> float:
        """Explained variance from all-reduced sums (t1.md Eq. 14-15); warns when negative for a streak (D16)."""
        sums = self.reduce_sum(explained_variance_sums(returns, values, mask))  # (5,) Eq. 15
        ev = explained_variance_from_sums(sums)  # t1.md Eq. 14, NaN when undefined (C5)
        self.log_metric("critic/explained_variance", ev)
        self.log_metric("critic/ev_defined", float(not math.isnan(ev)))
        if self.model.training and self.state.global_step >= self.args.critic_warmup_steps:
            self.ev_negative_streak = self.ev_negative_streak + 1 if ev < 0 else 0
            if self.ev_negative_streak >= self.args.ev_negative_patience:
                logger.warning(
                    f"critic explained variance {ev:.3f} has been negative for {self.ev_negative_streak} batches: "
                    "the critic is not tracking returns (t1.md D16); consider a larger critic_lr_multiplier"
                )
        self.log_metric("critic/ev_negative_streak", self.ev_negative_streak)
        m = mask.bool()
        self.log_token_means(
            {"critic/value_mean": values.double()[m].sum(), "critic/return_mean": returns.double()[m].sum()}, m.sum()
        )
        return ev

    def log_advantage_metrics(self, adv: Tensor, mask: Tensor, bootstrapped: Tensor) -> None:
        n, s, q = self.reduce_sum(masked_sums(adv, mask)).tolist()
        mean = s / max(n, 1.0)
        self.log_metric("ppo/advantage_mean", mean)
        self.log_metric("ppo/advantage_std", math.sqrt(max(q / max(n, 1.0) - mean * mean, 0.0)))
        rows = self.reduce_sum(torch.tensor([bootstrapped.sum().item(), bootstrapped.numel()], dtype=torch.float64))
        self.log_metric("ppo/bootstrapped_frac", (rows[0] / rows[1].clamp(min=1.0)).item())

    def audit_tito(self, batch: RolloutBatch) -> None:
        """t1.md Eq. 17: every loss position must hold the id the sampler emitted; a mismatch is a hard error (D14)."""
        if not self.args.tito_audit or not batch.rows or "sampled_ids" not in batch.rows[0]:
            return
        sampled = [row["sampled_ids"] for row in batch.rows]
        bad, n = tito_mismatch_count(batch.completion_ids.tolist(), batch.mask.long().tolist(), sampled)
        bad = int(self.reduce_sum(torch.tensor(bad, dtype=torch.float64, device=self.accelerator.device)).item())
        self.log_metric("t1/tito_mismatch_tokens", bad)
        if bad:
            raise RuntimeError(f"token-in/token-out audit: {bad} loss tokens differ from the sampled ids (t1.md D14)")

    # ----------------------------------------------------------------------------------------------------------------
    # Optimizer: a critic parameter group (t1.md Eq. 13) and the critic-only warm-up (t1.md D4)
    def create_optimizer(self, model=None) -> torch.optim.Optimizer:
        """`Trainer.create_optimizer` (its decay / no-decay groups, optimizer class and kwargs), with each group split
        into an actor part and a critic part at `critic_lr_multiplier` x its learning rate (t1.md Eq. 13), then the
        critic-only warm-up hook (t1.md D4). Groups carry `role`: "actor" or "critic"."""
        if self.optimizer is not None:
            return self.optimizer
        optimizer = super().create_optimizer(model)
        critic = {id(p) for p in self.critic.parameters() if p.requires_grad}
        if {id(p) for group in optimizer.param_groups for p in group["params"]} & critic != critic:
            raise ValueError(
                "the critic needs its own parameter group (t1.md Eq. 13), but the optimizer was not built from "
                f"Trainer's parameter groups (optim={self.args.optim!r}); use a standard optimizer such as adamw_torch"
            )
        critic_groups = []
        for group in optimizer.param_groups:
            params = group["params"]
            critic_groups.append({**group, "params": [p for p in params if id(p) in critic], "role": "critic"})
            critic_groups[-1]["lr"] = group["lr"] * self.args.critic_lr_multiplier  # t1.md Eq. 13
            group.update(params=[p for p in params if id(p) not in critic], role="actor")
        optimizer.param_groups[:] = [group for group in optimizer.param_groups if group["params"]]
        for group in critic_groups:
            if group["params"]:
                optimizer.add_param_group(group)
        optimizer.register_step_pre_hook(self._freeze_actor_during_warmup)
        return optimizer

    def _freeze_actor_during_warmup(self, optimizer, args, kwargs) -> None:
        """Critic-only steps: drop the actor's gradients so its weights (and optimizer state) stay untouched."""
        if self.state.global_step < self.args.critic_warmup_steps:
            for group in optimizer.param_groups:
                if group.get("role") == "actor":
                    for p in group["params"]:
                        p.grad = None

    def monitor_state(self) -> dict:
        return {**super().monitor_state(), "ev_negative_streak": self.ev_negative_streak}

    def load_monitor_state(self, state: dict) -> None:
        super().load_monitor_state(state)
        self.ev_negative_streak = state.get("ev_negative_streak", 0)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """The policy as usual, plus `critic.pt` (critic weights only; under PEFT the head is not in the adapter)."""
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            folder = output_dir or self.args.output_dir
            os.makedirs(folder, exist_ok=True)
            torch.save(self.critic.state_dict(), os.path.join(folder, "critic.pt"))
