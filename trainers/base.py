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

Private TRL methods overridden here, pinned by `tests/test_trl_signatures.py`: `_generate_and_score_completions`,
`_calculate_rewards`, `_compute_loss`.

Logged metrics (besides TRL's): `env/success` (fraction of rollouts the environment judged successful),
`env/turns` (mean assistant turns), `env/truncated` (fraction cut by a turn or token budget), `env/errors` (environment
exceptions and timeouts per rollout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather, gather_object
from trl import GRPOConfig, GRPOTrainer

from envs.base import Env
from trainers import agent_loop


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

    def __post_init__(self):
        super().__post_init__()
        if self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1, got {self.max_turn_tokens}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 or None, got {self.max_turns}")


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
        if env_factory is not None:
            kwargs["rollout_func"] = agent_loop.rollout_func
            reward_funcs = reward_funcs if reward_funcs is not None else [env_reward]
        if reward_funcs is None:
            raise ValueError("reward_funcs is required when no env_factory is given")
        if not isinstance(args, AgentGRPOConfig):
            raise TypeError(f"args must be an AgentGRPOConfig (or a subclass), got {type(args).__name__}")
        self.env_factory = env_factory
        self.routing_recorder = None
        self._rows: list[dict] = []
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

    # ----------------------------------------------------------------------------------------------------------------
    # TRL overrides (signatures pinned by tests/test_trl_signatures.py)
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._rewards_per_func = rewards_per_func  # (N_global, F), gathered across processes by TRL
        return rewards_per_func

    def _compute_loss(self, model, inputs):
        return self.policy_loss(model, inputs)

    def _generate_and_score_completions(self, inputs):
        self._rows = inputs  # agent_loop.rollout_func reads the task of each row from here
        out = super()._generate_and_score_completions(inputs)
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


def env_reward(completions, env_reward=None, **kwargs) -> list[float | None]:
    """The environment's own episode reward (sum of its per-turn rewards), passed through from the agent loop.

    >>> env_reward(["a", "b"], env_reward=[1.0, 0.25])
    [1.0, 0.25]
    """
    if env_reward is None:
        raise ValueError("env_reward needs the agent loop's `env_reward` field; train with an environment")
    return [float(r) if r is not None else None for r in env_reward]
