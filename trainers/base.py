"""AgentGRPOTrainer: GRPOTrainer with multi-turn environments and two hooks. Only this file touches TRL internals.

What it adds to `trl.GRPOTrainer` (TRL 1.16.0):

1. `env_factory(row) -> Env`: when given, rollouts are played by `trainers/agent_loop.py` through TRL's public
   `rollout_func` hook (batched multi-turn generation, token-in/token-out, env tokens masked out of the loss), and the
   default reward is the environment's (`env_reward`).
2. The rollout batch of DESIGN.md (`RolloutBatch`) is assembled after TRL has generated and scored, and handed to
   `compute_advantages(batch) -> (B, T)`, the first hook. The default reproduces stock GRPO: TRL's group advantage on
   every model token, 0 on environment tokens and padding.
3. `policy_loss(model, inputs)`, the second hook, is called from `_compute_loss`; the default is TRL's own loss.
   Subclasses build theirs from `forward_logps` (the one copy of TRL's forward setup) and pure functions of
   `trainers/losses.py`.
4. `routing_replay: true` (MoE policies, R3, docs/methods/routing-replay.md): the agent loop records every router's
   top-k expert ids during HF generation; the per-row records (stitched over turns, D5) are laid out in TRL's training
   layout as the batch-first `routing` (B, S, L, k) tensor of the batch, so TRL shuffles and splits it with the rows
   (D4). The policy's own log-prob forwards (old-log-prob pass, actor forward and its checkpoint recompute) replay the
   recorded selection with gate weights from the live router logits (Eq. 3); the reference pass (a separate model, or
   the PEFT policy with adapters disabled), a separate critic and generation route freely (D7). The load-balancing loss
   and Mixtral jitter are forced to 0 (D10). Unsupported setups raise at init (D1, D12, D13).

Private TRL methods overridden here, pinned by `tests/test_trl_parity.py`: `_generate_and_score_completions`,
`_calculate_rewards`, `_compute_loss`, `_get_per_token_logps_and_entropies` (plus the public `training_step`).

Logged metrics (besides TRL's): `env/success` (fraction of rollouts the environment judged successful),
`env/turns` (mean assistant turns), `env/truncated` (fraction cut by a turn or token budget), `env/errors` (environment
exceptions and timeouts per rollout). MoE policies (routing-replay.md §8): `routing/logp_gap` (Eq. 10, mean |old-policy
log-prob - sampler log-prob| over model tokens; on-policy runs use the first actor forward on the batch; logged with
and without replay), and with replay on: `routing/replay_active` (1), `routing/flip_frac` and
`routing/flip_token_frac` (Eq. 9, free routing vs the record, one micro-batch every 10 optimizer steps),
`routing/prefix_recompute_mismatch_frac` (Eq. 11), `routing/record_bytes_per_token` and `routing/record_mb` (Eq. 8,
the batch's `routing` tensor over all processes), `routing/router_grad_norm` (when the routers are trainable).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather, gather_object
from peft import PeftModel
from torch.distributed.tensor import DTensor
from trl import GRPOConfig, GRPOTrainer

from envs.base import Env
from rewards.verifiers import assertion_count_reward, binary_success_reward
from trainers import agent_loop
from trainers.routing_replay import (
    RouteRecorder,
    find_routers,
    force_replay_settings,
    is_moe,
    record_bytes_per_token,
    replay_routes,
    routes_to_training_layout,
    routing_flips,
)

logger = logging.getLogger(__name__)

FLIP_EVERY = 10  # routing-replay.md §5 / D14: the flip diagnostic runs on one micro-batch every 10 optimizer steps


REWARDS = ("env", "binary", "assertion_count")


@dataclass
class AgentGRPOConfig(GRPOConfig):
    """GRPOConfig plus the agent loop's budgets. `max_completion_length` is the budget of ALL turns of an episode,
    model and environment tokens together."""

    max_turns: int | None = field(
        default=None, metadata={"help": "Most assistant turns per episode; None uses the environment's own limit."}
    )
    max_turn_tokens: int = field(default=32, metadata={"help": "Most new tokens the model may sample in one turn."})
    env_timeout: float = field(
        default=30.0, metadata={"help": "Seconds an environment step may take before the episode is ended."}
    )
    reward: str = field(
        default="env",
        metadata={
            "help": "Reward when no reward_funcs are given: 'env' (the environment's own reward, e.g. the shop's "
            "fraction of matched attributes), 'binary' (1 on success, else 0; t1.md Eq. 2) or 'assertion_count' "
            "(passing assertions / assertion_scale, t1.md Eq. 1; terminal environment)."
        },
    )
    assertion_scale: float = field(
        default=20.0, metadata={"help": "S of the assertion-count reward, fixed for the run (t1.md Eq. 1, D10)."}
    )
    reuse_kv_cache: bool = field(
        default=True,
        metadata={
            "help": "HF generation in the agent loop keeps each episode's KV cache from one turn to the next and "
            "prefills only the new ids (the observation and the last sampled id); False prefills the whole context "
            "every turn. Off by itself when routing_replay records routes or the model's cache is not a plain "
            "per-position cache (sliding-window, linear attention)."
        },
    )
    routing_replay: bool = field(
        default=False,
        metadata={
            "help": "MoE rollout routing replay (R3, docs/methods/routing-replay.md): record the experts the sampler "
            "chose in the agent loop and replay them in the old-policy and actor log-prob forwards (gate weights "
            "from the live router logits, so the router keeps its gradient). Forces router_aux_loss_coef and Mixtral "
            "router jitter to 0. A no-op for dense models; needs env_factory and HF generation (no vLLM); works with "
            "LoRA."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1, got {self.max_turn_tokens}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 or None, got {self.max_turns}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {self.reward!r}")
        if self.routing_replay and self.router_aux_loss_coef != 0.0:
            # derived: routing-replay.md D10, the load-balancing loss is off under replay (None = the model's own)
            was = "None (the model's own)" if self.router_aux_loss_coef is None else self.router_aux_loss_coef
            logger.warning("routing_replay forces router_aux_loss_coef %s -> 0.0 (routing-replay.md D10)", was)
            self.router_aux_loss_coef = 0.0


@dataclass
class RolloutBatch:
    """The rollout-batch data contract (DESIGN.md) for this process's B rows. T = padded completion length, K = the
    most turns of any row on ANY process (so gathered tensors agree)."""

    completion_ids: torch.Tensor  # (B, T) right-padded
    completion_mask: torch.Tensor  # (B, T) 1 on real completion tokens (model and environment)
    env_mask: torch.Tensor  # (B, T) 1 on tokens the policy sampled, 0 on environment tokens and padding
    turn_index: torch.Tensor  # (B, T) k on tokens of assistant turn k, -1 elsewhere
    turn_rewards: torch.Tensor  # (B, K) per-turn environment reward, 0 where a row has no turn k
    turn_valid: torch.Tensor  # (B, K) bool, k < number of turns of the row
    rewards: torch.Tensor  # (B,) weighted sum of reward functions (NaN = unscorable), as TRL forms it
    advantages: torch.Tensor  # (B,) TRL's group advantage (Eq. I-1 of the credit interface)
    sampling_logps: torch.Tensor | None  # (B, T) log-probs under the sampling policy, 0 on environment tokens
    group_ids: torch.Tensor  # (B,) global group index: rows of one task in one generation batch share it
    truncated: torch.Tensor  # (B,) bool, the episode was cut by a budget (not ended by the environment)
    task_ids: list  # (B,) task id of each row (None without an environment)
    state_keys: list  # (B, K) environment state before each turn
    transcripts: list  # (B,) per turn: action, observation, reward
    rows: list  # (B,) the dataset rows with the rollout's extra fields merged in
    prompt_ids: torch.Tensor | None = None  # (B, P) left-padded
    prompt_mask: torch.Tensor | None = None  # (B, P)
    extras: dict = field(default_factory=dict)  # batch-first tensors a hook adds; they reach the loss inputs

    @property
    def mask(self) -> torch.Tensor:
        """Loss mask (B, T): model tokens only."""
        return self.completion_mask * self.env_mask


def turns_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Turn index (B, T) derived from a loss mask: turn k is the k-th maximal run of 1s; -1 elsewhere.

    >>> turns_from_mask(torch.tensor([[1, 1, 0, 1, 0, 0]])).tolist()
    [[0, 0, -1, 1, -1, -1]]
    """
    m = mask.long()
    starts = m * (1 - torch.nn.functional.pad(m, (1, 0))[:, :-1])  # 1 at the first token of each run
    return torch.where(m.bool(), starts.cumsum(dim=1) - 1, torch.full_like(m, -1))


class AgentGRPOTrainer(GRPOTrainer):
    """GRPOTrainer for multi-turn agents; see the module docstring. `env_factory(row) -> Env` builds the environment of
    a dataset row (whose `task` column holds the task); without it the trainer is stock GRPO (single turn)."""

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: AgentGRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        env_factory: Callable[[dict], Env] | None = None,
        **kwargs,
    ):
        if not isinstance(args, AgentGRPOConfig):
            raise TypeError(f"args must be an AgentGRPOConfig (or a subclass), got {type(args).__name__}")
        if env_factory is not None:
            kwargs["rollout_func"] = self._rollout_func
            reward_funcs = reward_funcs if reward_funcs is not None else [reward_function(args)]
        if reward_funcs is None:
            raise ValueError("reward_funcs is required when no env_factory is given")
        self.env_factory = env_factory
        self._rows: list[dict] = []
        # Routing replay state (routing-replay.md D7-D9), read by `_policy_routing` and the log-prob forward
        self.replay_routing = False  # True once init found a supported MoE policy with replay on
        self._rollout_routes: list[torch.Tensor] | None = None  # per-row records of the batch being generated
        self._routing: torch.Tensor | None = None  # (B, S, L, k) routes of the batch the policy forwards run on
        self._replay_hooks = ExitStack()  # replay installed for a grad forward, kept until its backward has run (D8)
        self._replay_held = False  # `_replay_hooks` holds an installed replay
        self._free_routing = 0  # depth of `free_routing()` blocks
        self._gap_inputs: dict | None = None  # on-policy Eq. 10: the micro-batch whose first actor forward is measured
        self._gap_sums = torch.zeros(2, dtype=torch.float64)  # Eq. 10 numerator and denominator, this optimizer step
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            **kwargs,
        )
        self.loop_settings = agent_loop.LoopSettings(
            max_turn_tokens=self.args.max_turn_tokens,
            max_completion_length=self.args.max_completion_length,
            max_turns=self.args.max_turns,
            env_timeout=self.args.env_timeout,
        )
        policy = self.accelerator.unwrap_model(self.model)
        self.policy_is_moe = is_moe(policy)
        if self.args.routing_replay:
            self._init_routing_replay(policy)

    def _init_routing_replay(self, policy) -> None:
        """Refuse unsupported setups at init (D1, D12, D13) and force the replay settings (D10)."""
        if find_routers(policy) is None:  # raises for an MoE family without a replay adapter (D12)
            logger.info("routing_replay: %s has no MoE router; replay is a no-op", type(policy).__name__)
            return
        if self.use_vllm:
            raise ValueError(
                "routing_replay needs the sampler's routes, and TRL's vLLM client does not return them "
                "(routing-replay.md D1); set use_vllm: false (HF generation records them) or routing_replay: false"
            )
        if self.env_factory is None or self.tools:
            raise ValueError(
                "routing_replay records routes in the project's agent loop (trainers/agent_loop.py): pass env_factory "
                "and no tools/environment_factory (routing-replay.md D13)"
            )
        force_replay_settings(policy)  # logs a warning per forced value (D10)
        self.aux_loss_enabled = False  # router_aux_loss_coef is 0.0 (AgentGRPOConfig.__post_init__)
        self.replay_routing = True

    # ----------------------------------------------------------------------------------------------------------------
    # Hook 1: advantages
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """(B, T) advantages. Default: stock GRPO, the row's group advantage on its model tokens, 0 elsewhere."""
        return batch.advantages.unsqueeze(1) * batch.mask  # (B, T)

    # Hook 2: the policy loss
    def policy_loss(self, model, inputs: dict) -> torch.Tensor:
        """Scalar loss for one micro-batch. Default: TRL's own GRPO loss (ratio, clipping, KL, aggregation)."""
        return GRPOTrainer._compute_loss(self, model, inputs)

    # ----------------------------------------------------------------------------------------------------------------
    # Helpers for subclasses
    def num_live_global(self, n: int) -> int:
        """Live episodes over all processes (keeps generate calls in step across ranks)."""
        if self.accelerator.num_processes == 1:
            return n
        return int(self.accelerator.reduce(torch.tensor(n, device=self.accelerator.device), reduction="sum").item())

    def forward_logps(self, model, inputs: dict, compute_entropy: bool = False):
        """Per-token log-probs (B, T), entropies and the MoE aux loss of the completion under `model`, with TRL's fused
        forward (temperature applied). The one copy of TRL's loss-side forward setup for text models."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        return self._get_per_token_logps_and_entropies(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=compute_entropy,
            compute_aux_loss=self.aux_loss_enabled,
        )

    def loss_mask(self, inputs: dict) -> torch.Tensor:
        """(B, T) model tokens of the micro-batch: `completion_mask * tool_mask`, as TRL forms it."""
        mask = inputs["completion_mask"]
        return mask * inputs["tool_mask"] if inputs.get("tool_mask") is not None else mask

    def log_metric(self, name: str, value: float) -> None:
        mode = "train" if self.model.training else "eval"
        self._metrics[mode][name].append(float(value))

    @contextmanager
    def free_routing(self) -> Iterator[None]:
        """Policy forwards inside this block route freely even when replay is on (e.g. a critic adapter on the
        policy's base, routing-replay.md D7). Under activation checkpointing, run them before the actor forward."""
        self._free_routing += 1
        try:
            yield
        finally:
            self._free_routing -= 1

    # ----------------------------------------------------------------------------------------------------------------
    # TRL overrides (signatures pinned by tests/test_trl_parity.py)
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards_per_func  # (N_global, F), gathered across processes by TRL
        return rewards_per_func

    def _compute_loss(self, model, inputs):
        if self.replay_routing:
            if inputs.get("routing") is None:
                raise ValueError(
                    "routing replay is on but the micro-batch has no `routing` tensor: batches must come from this "
                    "trainer's `_generate_and_score_completions` with the agent loop (routing-replay.md D4)"
                )
            if self.model.training and self.state.global_step % FLIP_EVERY == 0 and self._first_micro_step():
                self._log_flips(inputs)
        if self.policy_is_moe and self.model.training and inputs.get("old_per_token_logps") is None:
            self._gap_inputs = inputs  # on-policy: Eq. 10 from the first actor forward at the behaviour weights (D14)
        self._routing = inputs.get("routing") if self.replay_routing else None  # this micro-batch's routes
        try:
            return self.policy_loss(model, inputs)
        finally:
            self._routing, self._gap_inputs = None, None

    def training_step(self, model, inputs, num_items_in_batch):
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self._release_replay()  # routing-replay.md D8: routes leave only after the backward has run
        if self._step % self.current_gradient_accumulation_steps == 0:  # an optimizer step's last micro-step
            self._log_step_routing_metrics()
        return loss

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        """TRL's log-prob forward, wrapped in `replay_routes` (routing-replay.md Eq. 3) for the policy's own passes."""
        routing = self._policy_routing(model, input_ids, attention_mask, logits_to_keep)
        if routing is None:
            if self._replay_held and self.accelerator.unwrap_model(model) is self.accelerator.unwrap_model(self.model):
                self._end_replay_before_free_forward()  # the same routers: a held replay must not apply here
            logps, entropies, aux_loss = super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal,
            )
        else:
            logps, entropies, aux_loss = self._replayed_logps(
                model,
                routing,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                multimodal,
            )
        if self._gap_inputs is not None and torch.is_grad_enabled() and self._is_policy(model):
            self._add_gap(logps.detach(), self._gap_inputs)  # on-policy Eq. 10 (D14)
            self._gap_inputs = None
        return logps, entropies, aux_loss

    def _generate_and_score_completions(self, inputs):
        self._rows = inputs  # agent_loop.rollout_func reads the task of each row from here
        self._release_replay()  # nothing replays during generation (D7)
        self._rollout_routes, self._routing = None, None
        try:
            out = super()._generate_and_score_completions(inputs)
            if self.replay_routing:  # D4: batch-first, so TRL shuffles and splits it with the rows
                if self._routing is None:  # no old-log-prob pass laid it out already
                    self._routing = self._layout_routes(out["prompt_mask"], out["completion_ids"].size(1))
                out["routing"] = self._routing  # (B, S, L, k); policy forwards on this batch replay it until the loss
        finally:
            self._rollout_routes = None
        if self.policy_is_moe:
            self._log_batch_routing_metrics(out)
        batch = self._rollout_batch(inputs, out)
        advantages = self.compute_advantages(batch)
        if advantages.shape != batch.completion_ids.shape:
            raise RuntimeError(
                f"compute_advantages returned {tuple(advantages.shape)}, expected (B, T) = "
                f"{tuple(batch.completion_ids.shape)}"
            )
        out["advantages"] = (advantages * batch.mask).to(out["advantages"].dtype)  # 0 on environment tokens
        out["turn_index"] = batch.turn_index
        for key, value in batch.extras.items():
            if not (isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == len(inputs)):
                raise RuntimeError(f"batch.extras[{key!r}] must be a batch-first tensor with {len(inputs)} rows")
            out[key] = value
        self._log_env_metrics(batch)
        return out

    # ----------------------------------------------------------------------------------------------------------------
    # Routing replay (docs/methods/routing-replay.md)
    def _rollout_func(self, prompts: list, trainer) -> dict[str, list]:
        """TRL's `rollout_func`: the agent loop; route records stay on the trainer, where the old-log-prob pass that
        TRL runs before merging rollout fields into the rows finds them (D7)."""
        rollouts = agent_loop.trainer_rollouts(prompts, self)
        if self.replay_routing:
            for b, r in enumerate(rollouts):
                n_fed = len(r.prompt_ids) + len(r.completion_ids)  # N_b
                if r.routes is None or r.routes.shape[0] != n_fed - 1:
                    found = None if r.routes is None else tuple(r.routes.shape)
                    raise ValueError(
                        f"routing replay: rollout {b} feeds {n_fed} tokens but its route record is {found}, not "
                        f"({n_fed - 1}, L, k) (routing-replay.md §3)"
                    )
            self._rollout_routes = [r.routes for r in rollouts]
            mismatch = torch.tensor([sum(r.route_mismatch for r in rollouts), sum(r.route_compared for r in rollouts)])
            mismatch = self.accelerator.reduce(mismatch.to(self.accelerator.device), reduction="sum")
            self.log_metric("routing/prefix_recompute_mismatch_frac", mismatch[0] / mismatch[1].clamp(min=1))  # Eq. 11
        return agent_loop.to_trl(rollouts)

    def _layout_routes(self, prompt_mask: torch.Tensor, completion_width: int) -> torch.Tensor:
        """The rollout's per-row records in TRL's training layout, (B, P + T, L, k), -1 where there is none (D4)."""
        if self._rollout_routes is None:
            raise ValueError(
                "routing replay: no route records for this batch; were the rollouts played by the agent loop?"
            )
        prompt_lens = prompt_mask.sum(1).cpu()  # (B,)
        records_len = torch.tensor([r.shape[0] for r in self._rollout_routes])  # (B,) N_b - 1
        completion_lens = records_len + 1 - prompt_lens  # (B,) every completion token is fed: model and environment
        if completion_lens.min() < 1 or completion_lens.max() > completion_width:
            raise ValueError(
                f"routing replay: route records of {records_len.tolist()} rows do not fit prompts of "
                f"{prompt_lens.tolist()} tokens and a completion width of {completion_width}"
            )
        completion_mask = torch.arange(completion_width)[None, :] < completion_lens[:, None]  # (B, T)
        return routes_to_training_layout(
            self._rollout_routes, prompt_mask, completion_mask.long().to(prompt_mask.device)
        )

    def _is_policy(self, model) -> bool:
        """True for a forward of the policy with its own adapter: not a separate reference or critic model, not the
        PEFT reference (adapters disabled, or TRL's "ref" adapter), routing-replay.md D7."""
        policy = self.accelerator.unwrap_model(self.model)
        if self.accelerator.unwrap_model(model) is not policy:
            return False
        if isinstance(policy, PeftModel):
            return policy.active_adapter != "ref" and policy.get_model_status().enabled is not False
        return True

    def _policy_routing(self, model, input_ids, attention_mask, logits_to_keep) -> torch.Tensor | None:
        """The (B, S, L, k) routes to replay in this forward, or None to route freely (D7). Raises when routes are
        due but missing or misaligned (§2 item 5: never a silent fallback to free routing)."""
        if not self.replay_routing or self._free_routing or not self._is_policy(model):
            return None
        if self._routing is None and self._rollout_routes is not None:  # the old-log-prob pass inside generation
            prompt_mask = attention_mask[:, : input_ids.size(1) - logits_to_keep]  # (B, P)
            self._routing = self._layout_routes(prompt_mask, logits_to_keep)
        if self._routing is None:
            raise ValueError(
                "routing replay: a policy log-prob forward ran without routes; call it from `_compute_loss` (whose "
                "inputs carry `routing`) or inside `free_routing()` for a pass that must route freely"
            )
        if self._routing.shape[:2] != input_ids.shape:
            raise ValueError(
                f"routing replay: routing covers (B, S) = {tuple(self._routing.shape[:2])} but the forward's "
                f"input_ids are {tuple(input_ids.shape)}; slice `routing` exactly like the rows of the batch (D4, D9)"
            )
        return self._routing

    def _replayed_logps(
        self,
        model,
        routing,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size,
        compute_entropy,
        compute_aux_loss,
        multimodal,
    ):
        if any(value is not None for value in multimodal.values()):
            raise ValueError("routing replay supports text-only policies (no multimodal inputs)")
        B = input_ids.size(0)
        chunk = batch_size or B
        if torch.is_grad_enabled() and chunk < B:
            raise ValueError("routing replay: a forward with gradient must run as one chunk (D8, D9)")
        logps, entropies, aux_losses = [], [], []
        settings = (logits_to_keep, None, compute_entropy, compute_aux_loss)
        for start in range(0, B, chunk):
            rows = slice(start, start + chunk)
            replay = replay_routes(model, routing[rows], attention_mask[rows])  # Eq. 3, the chunk's row slice (D9)
            if torch.is_grad_enabled():  # D8: held until the step's backward (and checkpoint recompute) has run
                self._end_replay_before_free_forward()
                self._replay_hooks.enter_context(replay)
                self._replay_held = True
                replay = nullcontext()
            with replay:
                out = super()._get_per_token_logps_and_entropies(
                    model, input_ids[rows], attention_mask[rows], *settings
                )
            logps.append(out[0])
            entropies.append(out[1])
            aux_losses.append(out[2])
        return (
            torch.cat(logps, dim=0),
            torch.cat(entropies, dim=0) if compute_entropy else None,
            torch.stack(aux_losses).mean() if compute_aux_loss else None,  # as TRL averages its chunks
        )

    def _end_replay_before_free_forward(self) -> None:
        """Remove a replay installed for an earlier grad forward of this step; refuse when its backward would need it
        (an activation-checkpoint recompute would route freely, D8)."""
        if self._replay_held and self.args.activation_checkpointing:
            raise RuntimeError(
                "routing replay: with activation checkpointing, a training step may run one replayed policy forward "
                "with gradient, and any other policy forward must come before it (D8)"
            )
        self._release_replay()

    def _release_replay(self) -> None:
        self._replay_hooks.close()
        self._replay_held = False

    def _first_micro_step(self) -> bool:
        return self._step % self.current_gradient_accumulation_steps == 0

    def _add_gap(self, logps: torch.Tensor, inputs: dict) -> None:
        """Accumulate Eq. 10 over micro-batches: sum m |log pi_train - q| and sum m."""
        sampling = inputs.get("sampling_per_token_logps")
        if sampling is None:
            return
        mask = self.loss_mask(inputs).double()  # (B, T) model tokens
        diff = (logps.double() - sampling.double()).abs().nan_to_num(0.0)  # (B, T)
        self._gap_sums += torch.stack([(diff * mask).sum(), mask.sum()]).cpu()  # Eq. 10, numerator and denominator

    def _log_batch_routing_metrics(self, out: dict) -> None:
        """Per generation batch: Eq. 10 from the old-log-prob pass, and the size of the routes (Eq. 8)."""
        if out.get("old_per_token_logps") is not None:  # off-policy: the old pass ran at the behaviour weights
            self._add_gap(out["old_per_token_logps"], out)
            self._flush_gap()
        if not self.replay_routing:
            return
        routing = out["routing"]  # (B, S, L, k)
        self.log_metric("routing/replay_active", 1.0)
        self.log_metric("routing/record_bytes_per_token", record_bytes_per_token(routing))  # Eq. 8: L * k * 2
        nbytes = torch.tensor(float(routing.numel() * routing.element_size()), device=self.accelerator.device)
        self.log_metric("routing/record_mb", self.accelerator.reduce(nbytes, reduction="sum") / 2**20)  # Eq. 8

    def _flush_gap(self) -> None:
        sums = self.accelerator.reduce(self._gap_sums.to(self.accelerator.device), reduction="sum")  # global sums
        if sums[1] > 0:
            self.log_metric("routing/logp_gap", sums[0] / sums[1])  # Eq. 10: divides by sum m
        self._gap_sums.zero_()

    def _log_step_routing_metrics(self) -> None:
        """At an optimizer step's last micro-step: the on-policy Eq. 10 and the router gradient norm."""
        if self.policy_is_moe:
            self._flush_gap()  # on-policy: the actor forwards of this step ran at the behaviour weights (D14)
        if not self.replay_routing:
            return
        policy = self.accelerator.unwrap_model(self.model)
        grads = [r.weight.grad for r in find_routers(policy).modules if r.weight.grad is not None]  # None under ZeRO-3
        grads = [g.full_tensor() if isinstance(g, DTensor) else g for g in grads]  # FSDP2 shards: a collective
        if grads:
            self.log_metric("routing/router_grad_norm", torch.stack([g.detach().float().norm() for g in grads]).norm())

    def _log_flips(self, inputs: dict) -> None:
        """Eq. 9 on this micro-batch: a free-routing forward without gradient against the record (D14)."""
        policy = self.accelerator.unwrap_model(self.model)
        input_ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)  # (B, S)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)  # (B, S)
        with torch.no_grad(), self.free_routing(), RouteRecorder(policy) as recorder:
            self._get_per_token_logps_and_entropies(
                policy, input_ids, attention_mask, inputs["completion_ids"].size(1)
            )
        live = recorder.indices(input_ids.size(0))  # (B, S, L, k)
        rows = self.loss_mask(inputs).sum(1, keepdim=True) > 0  # (B, 1) rows bearing model tokens
        flip_frac, flip_token_frac = routing_flips(inputs["routing"], live, mask=attention_mask.bool() & rows)  # Eq. 9
        flips = self.accelerator.gather(torch.stack([flip_frac, flip_token_frac]).float()[None])  # (processes, 2)
        self.log_metric("routing/flip_frac", flips[:, 0].mean())
        self.log_metric("routing/flip_token_frac", flips[:, 1].mean())

    # ----------------------------------------------------------------------------------------------------------------
    def _rollout_batch(self, inputs: list[dict], out: dict) -> RolloutBatch:
        device = self.accelerator.device
        completion_ids, completion_mask = out["completion_ids"], out["completion_mask"]
        B, T = completion_ids.shape
        tool_mask = out.get("tool_mask")
        env_mask = tool_mask if tool_mask is not None else torch.ones_like(completion_mask)
        if "turn_index" in inputs[0]:
            turn_index = torch.full((B, T), -1, dtype=torch.long, device=device)
            for b, row in enumerate(inputs):
                ti = torch.tensor(row["turn_index"][:T], dtype=torch.long, device=device)
                turn_index[b, : len(ti)] = ti
            turn_index = torch.where((completion_mask * env_mask).bool(), turn_index, -1)
        else:
            turn_index = turns_from_mask(completion_mask * env_mask)
        local_k = int(turn_index.max().item()) + 1 if B else 0
        K = max(1, int(gather(torch.tensor([local_k], device=device)).max().item()))
        turn_rewards = torch.zeros(B, K, dtype=torch.float64, device=device)
        turn_valid = torch.zeros(B, K, dtype=torch.bool, device=device)
        for b, row in enumerate(inputs):
            r = row.get("turn_rewards")
            n = len(r) if r is not None else int(turn_index[b].max().item()) + 1
            turn_valid[b, :n] = True
            if r:
                turn_rewards[b, : len(r)] = torch.tensor(r, dtype=torch.float64, device=device)
        # rewards as TRL weighs them, sliced to this process (TRL's own slice, grpo_trainer.py:2813)
        rpf = self._rewards_per_func
        rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rpf).all(dim=1)] = torch.nan
        start = self.accelerator.process_index * B
        rewards = rewards[start : start + B]
        num_generations = self.num_generations if self.model.training else self.num_generations_eval
        group_ids = torch.arange(start, start + B, device=device) // num_generations
        return RolloutBatch(
            completion_ids=completion_ids,
            completion_mask=completion_mask,
            env_mask=env_mask,
            turn_index=turn_index,
            turn_rewards=turn_rewards,
            turn_valid=turn_valid,
            rewards=rewards,
            advantages=out["advantages"],
            sampling_logps=out.get("sampling_per_token_logps"),
            group_ids=group_ids,
            truncated=torch.tensor([bool(row.get("truncated", False)) for row in inputs], device=device),
            task_ids=[row.get("task_id") for row in inputs],
            state_keys=[row.get("state_keys", []) for row in inputs],
            transcripts=[row.get("transcript", []) for row in inputs],
            rows=inputs,
            prompt_ids=out["prompt_ids"],
            prompt_mask=out["prompt_mask"],
        )

    def _log_env_metrics(self, batch: RolloutBatch) -> None:
        if self.env_factory is None:
            return
        rows = gather_object(
            [(r["success"], len(r["turn_rewards"]), r["truncated"], r["env_errors"]) for r in batch.rows]
        )
        n = max(1, len(rows))
        self.log_metric("env/success", sum(r[0] for r in rows) / n)
        self.log_metric("env/turns", sum(r[1] for r in rows) / n)
        self.log_metric("env/truncated", sum(r[2] for r in rows) / n)
        self.log_metric("env/errors", sum(r[3] for r in rows) / n)


def reward_function(args: AgentGRPOConfig) -> Callable:
    """The reward function `args.reward` names."""
    if args.reward == "assertion_count":
        f = functools.partial(assertion_count_reward, assertion_scale=args.assertion_scale)
        return functools.update_wrapper(f, assertion_count_reward)  # TRL names reward columns by __name__
    return binary_success_reward if args.reward == "binary" else env_reward


def env_reward(completions, env_reward=None, **kwargs) -> list[float | None]:
    """The environment's own episode reward (sum of its per-turn rewards), passed through from the agent loop.

    >>> env_reward(["a", "b"], env_reward=[1.0, 0.25])
    [1.0, 0.25]
    """
    if env_reward is None:
        raise ValueError("env_reward needs the agent loop's `env_reward` field; train with an environment")
    return [float(r) if r is not None else None for r in env_reward]
