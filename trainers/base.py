"""AgentGRPOTrainer: GRPOTrainer with multi-turn environments and two hooks.

What it adds to `trl.GRPOTrainer` (TRL 1.16.0), of which it is a drop-in (TRL's parameters in TRL's order, a plain
`GRPOConfig` or None accepted, TRL's reward sources and errors):

1. `env_factory(row) -> Env` (keyword-only): when given, rollouts are played by `trainers/agent_loop.py` through TRL's
   public `rollout_func` hook (batched multi-turn generation, token-in/token-out, env tokens masked out of the loss),
   and the default reward is `AgentGRPOConfig.reward` (the environment's, `env_reward`). It cannot be combined with
   another rollout source (`rollout_func`, `environment_factory`, `tools`).
2. The rollout batch (`RolloutBatch`, docs/layout.md#the-rollout-batch) is assembled after TRL has generated and
   scored, and handed to `compute_advantages(batch) -> (B, T)`, the first hook. The default reproduces stock GRPO:
   TRL's group advantage on every model token, 0 on environment tokens and padding.
3. `policy_loss(model, inputs)`, the second hook, is called from `_compute_loss`; the default is TRL's own loss.
   Subclasses build theirs from `forward_logps` (the one copy of TRL's forward setup) and pure functions of
   `trainers/losses.py`.
4. `routing_replay: true` (MoE policies, R3): `RoutingReplay` in `trainers/routing_replay.py`, called at named points.
5. `scheduler: envsched`: the task scheduler of `trainers/envsched.py` (`TaskScheduling`, called at named points)
   chooses each generation batch's tasks (through TRL's sampler seam) and is updated with the batch's gathered
   rewards; its state travels in `agent_state.json`.
6. `save_episodes: true`: `trainers/episodes.py` writes each training batch's episodes to `episodes.jsonl`.

TRL's private API is reached only through `trainers/trl_api.py` (the TRL boundary, `TRLSeams`), whose public names
this class overrides: `generate_and_score`, `calculate_rewards`, `micro_batch_loss`, `token_logps`, `train_sampler`
(EnvSched's sampler under `scheduler: envsched`, trainers/envsched.py), and `save_checkpoint` / `load_checkpoint`,
which also write and read `monitor_state()` (`agent_state.json`: the collapse alarm's and the no-signal guard's
memory, and what subclasses add), so a resumed run warns and stops where the uninterrupted one would. Its two CPU
switches (TRL's fused log-prob head scores only labelled positions, docs/methods/grpo.md D12; `sdpa` attention reads
grouped key/value heads in place, D14) are on only while the trainer trains, generates a batch or runs a log-prob
forward (`cpu_fast_paths`). `keep_freed_memory: true` (opt-in) keeps glibc from handing freed memory back between CPU
steps (D14).

One generation batch, in the order TRL calls the seams (`trainer.generation_step`, a `GenerationStep`, carries what
one seam hands the next; it exists only while the batch is made):
1. `generate_and_score(inputs)`: opens the generation step with this process's dataset rows, then runs TRL's method.
2. Inside it, TRL calls `rollout_func` (`_rollout_func`): the agent loop plays the rows' tasks
   (`agent_loop.trainer_rollouts`) and the step keeps each row's model tokens.
3. TRL's old-log-prob and reference passes call `token_logps`, which scores the step's model tokens only (D12).
4. TRL merges the rollout fields into the rows and calls `calculate_rewards`: the gathered reward columns pass
   through `shape_rewards` and the step keeps them, with this process's weighted rewards. TRL normalises them per
   group into its advantages and returns.
5. Back in `generate_and_score`: the `RolloutBatch` is built from TRL's output and the step, `compute_advantages`
   (hook 1) replaces TRL's advantages, the `env/*` metrics, episodes and the no-signal guard run, and the step ends.
Then, per micro-batch of the optimisation, `micro_batch_loss` calls `policy_loss` (hook 2), whose forwards go
through `token_logps` with the loss mask: passed as `scored` by `forward_logps`, or set by `scoring_loss` around
TRL's own loss, which makes its forward itself.

Decision ids (`Dn`) without a page are docs/methods/grpo.md's.

Logged metrics (besides TRL's), every generation batch, over all processes:
- `env/success`: fraction of rollouts the environment judged successful.
- `env/turns`: mean assistant turns per episode.
- `env/truncated`: fraction of episodes cut by a turn or token budget.
- `env/errors`: environment exceptions and timeouts per rollout.
- `reward/unscorable_frac`: rollouts that got no reward (every reward function returned None); the no-signal guard
  (`max_unscorable_frac`) stops a run in which it stays high.
- `env/tokens_per_turn`: the batch's model tokens over its assistant turns (1-2: turns end at once; near
  `max_turn_tokens`: the end-of-turn id is no longer emitted).
- `sched/*` with `scheduler: envsched` (trainers/envsched.py).
- `alarm/<kind>`: 1 on the batch where the collapse alarm of that kind fires (`collapse_alarm`, `trainers/alarm.py`:
  `short_turns`, `capped_turns`, `truncated`, `success`, `no_variance`), with a warning naming the numbers.
- MoE policies: the `routing/*` metrics listed in `trainers/routing_replay.py`.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import functools
import json
import logging
import os
import shutil
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass, field, fields

import torch
from accelerate.utils import gather, gather_object
from trl import GRPOConfig

from envs.base import Env
from rewards.verifiers import assertion_count_reward, binary_success_reward
from trainers import agent_loop
from trainers.alarm import CollapseAlarm
from trainers.cpu_paths import CausalWithoutMask, ScoredLabels, keep_freed_memory
from trainers.envsched import TaskScheduling
from trainers.episodes import EpisodesWriter
from trainers.routing_replay import RoutingReplay
from trainers.trl_api import TRLSeams, cpu_fast_paths, get_config_model_id

logger = logging.getLogger(__name__)


REWARDS = ("env", "binary", "assertion_count")
SCHEDULERS = ("uniform", "envsched")
MONITOR_STATE = "agent_state.json"  # `AgentGRPOTrainer.monitor_state()` in each checkpoint


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
    keep_freed_memory: bool = field(
        default=False,
        metadata={
            "help": "On a CPU, ask glibc's allocator (once, for the whole process) to keep freed memory for reuse "
            "instead of handing it back to the system, so that each training step reuses the last step's activation "
            "memory instead of page-faulting it in again, zeroed (docs/methods/grpo.md D14). The process keeps its "
            "peak heap size. No effect on GPUs or where the C library is not glibc."
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
    collapse_alarm: bool = field(
        default=True,
        metadata={
            "help": "Warn once per kind (logger.warning, and alarm/<kind> = 1 in the metrics) when training episodes "
            "drift towards degenerate ones: turns pinned at 1-2 tokens or at max_turn_tokens, (almost) every episode "
            "cut by a budget, or success falling to 0 after having been above it, each for 3 generation batches in "
            "a row (trainers/alarm.py). Needs env_factory; False turns it off."
        },
    )

    save_episodes: bool = field(
        default=False,
        metadata={
            "help": "Append every training batch's episodes to <output_dir>/episodes.jsonl, one JSON line per "
            "episode: step, group, task, reward, TRL's group advantage, success, truncated, and per turn the action, "
            "the observation, the environment's reward, whether it rejected the action, and the model tokens the "
            "turn took. `python bench/episodes.py <file>` summarises it per step. Needs env_factory."
        },
    )
    max_unscorable_frac: float = field(
        default=0.5,
        metadata={
            "help": "The no-signal guard: when more than this fraction of a generation batch's rollouts has no "
            "reward (every reward function returned None, e.g. a judge that cannot be reached or rejects its key) "
            "for unscorable_patience batches in a row, the run saves a checkpoint and stops with an error naming "
            "the numbers, instead of training on nothing. 1.0 turns it off. The fraction is logged as "
            "reward/unscorable_frac."
        },
    )
    unscorable_patience: int = field(
        default=3, metadata={"help": "Generation batches in a row above max_unscorable_frac before the run stops."}
    )
    scheduler: str = field(
        default="uniform",
        metadata={
            "help": "Which tasks a generation batch trains on: 'uniform' (TRL's shuffled sampler) or 'envsched' "
            "(trainers/envsched.py, docs/methods/envsched.md: tasks chosen by their reward variance and "
            "uncertainty, a task-environment graph for tasks with little history, per-environment quotas, a "
            "similarity penalty and an exploration share). Needs env_factory and max_steps; its state is saved in "
            "checkpoints."
        },
    )
    sched_half_life: float | None = field(
        default=None, metadata={"help": "Half-life of the reward history in generation batches; None: max(10, 2N/B)."}
    )
    sched_uncertainty_bonus: float = field(default=0.5, metadata={"help": "c_u of envsched.md Eq. 8."})
    sched_env_share: float | None = field(
        default=0.25,
        metadata={"help": "Largest share of a batch one environment may take (ρ_max, Eq. 16); None: no quota."},
    )
    sched_similarity_penalty: float = field(default=0.1, metadata={"help": "λ_sim of envsched.md Eq. 18."})
    sched_explore: float = field(default=0.1, metadata={"help": "Share of a batch drawn uniformly (Eq. 17)."})
    sched_neighbours: int = field(default=10, metadata={"help": "k of the task graph's kNN (Eq. 11)."})
    sched_embeddings: bool = field(
        default=True,
        metadata={"help": "Hashed n-gram embeddings of the task text in the similarity (envsched.md Eq. 10, D7)."},
    )
    sched_reward_range: list[float] = field(
        default_factory=lambda: [0.0, 1.0], metadata={"help": "[lo, hi] mapped to [0, 1] for scheduling (Eq. 1)."}
    )

    def __post_init__(self):
        check_sampling_and_batches(self)  # before TRL's own post-init, which divides by some of these
        if self.bf16 is None and not self.fp16:  # TRL's default is bf16, which a CPU-only machine refuses
            self.bf16 = bf16_available(self.use_cpu)
        super().__post_init__()
        if not 0.0 <= self.max_unscorable_frac <= 1.0:
            raise ValueError(f"max_unscorable_frac must be in [0, 1], got {self.max_unscorable_frac}")
        if self.unscorable_patience < 1:
            raise ValueError(f"unscorable_patience must be >= 1, got {self.unscorable_patience}")
        if self.env_timeout <= 0:
            raise ValueError(f"env_timeout must be > 0 seconds, got {self.env_timeout}")
        if self.max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1, got {self.max_turn_tokens}")
        if self.max_turns is not None and self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1 or None, got {self.max_turns}")
        if self.reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {self.reward!r}")
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"scheduler must be one of {SCHEDULERS}, got {self.scheduler!r}")
        if self.scheduler == "envsched":
            if self.max_steps is None or self.max_steps < 1:  # envsched.md D18: no epochs
                raise ValueError("scheduler 'envsched' has no epochs: set max_steps (envsched.md D18)")
            lo, hi = (list(self.sched_reward_range) + [None, None])[:2]
            if len(self.sched_reward_range) != 2 or not hi > lo:
                raise ValueError(f"sched_reward_range must be [lo, hi] with hi > lo, got {self.sched_reward_range}")
            if self.sched_env_share is not None and not 0 < self.sched_env_share <= 1:
                raise ValueError(f"sched_env_share must be in (0, 1] or None, got {self.sched_env_share}")
            if not 0 <= self.sched_explore <= 1 or self.sched_neighbours < 1 or self.sched_uncertainty_bonus < 0:
                raise ValueError(
                    "sched_explore must be in [0, 1], sched_neighbours >= 1, sched_uncertainty_bonus >= 0"
                )
            if self.sched_half_life is not None and self.sched_half_life <= 0:
                raise ValueError(f"sched_half_life must be > 0 or None, got {self.sched_half_life}")
            self.ignore_data_skip = True  # a resumed run serves the scheduler's pending draws (envsched.md D17)
        if self.routing_replay and self.router_aux_loss_coef != 0.0:
            # derived: routing-replay.md D10, the load-balancing loss is off under replay (None = the model's own)
            was = "None (the model's own)" if self.router_aux_loss_coef is None else self.router_aux_loss_coef
            logger.warning("routing_replay forces router_aux_loss_coef %s -> 0.0 (routing-replay.md D10)", was)
            self.router_aux_loss_coef = 0.0


def bf16_available(use_cpu: bool) -> bool:
    """Whether a run with `bf16` left unset trains in bfloat16: TRL's default (True) where transformers accepts bf16
    mixed precision on an accelerator (its own test: a GPU that supports bfloat16, or XLA), float32 on a CPU
    (`use_cpu`, or no such accelerator), where TRL's default would stop the run."""
    from transformers import training_args  # its names, looked up at call time (as TrainingArguments does)

    if use_cpu:
        return False
    return bool(training_args.is_torch_bf16_gpu_available() or training_args.is_torch_xla_available())


LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")  # TRL 1.16's GRPO losses


def check_sampling_and_batches(args: GRPOConfig) -> None:
    """Values of TRL's GRPO fields that would otherwise crash without naming themselves (a division by zero in TRL's
    post-init), fail after the model is loaded (an unknown loss type), or sample nonsense (temperature 0, top_p > 1).
    Raises ValueError naming the field."""
    problems = [
        f"{name} must be {rule}, got {value}"
        for name, value, ok, rule in [
            (
                "num_generations",
                args.num_generations,
                lambda v: v is None or v >= 2,
                ">= 2 (a group of one has no advantage)",
            ),
            ("per_device_train_batch_size", args.per_device_train_batch_size, lambda v: v >= 1, ">= 1"),
            ("gradient_accumulation_steps", args.gradient_accumulation_steps, lambda v: v >= 1, ">= 1"),
            ("steps_per_generation", args.steps_per_generation, lambda v: v is None or v >= 1, ">= 1 or None"),
            ("generation_batch_size", args.generation_batch_size, lambda v: v is None or v >= 1, ">= 1 or None"),
            ("num_iterations", args.num_iterations, lambda v: v >= 1, ">= 1"),
            ("max_completion_length", args.max_completion_length, lambda v: v is None or v >= 1, ">= 1"),
            ("temperature", args.temperature, lambda v: v > 0, "> 0 (sampling divides the logits by it)"),
            ("top_p", args.top_p, lambda v: 0 < v <= 1, "in (0, 1]"),
            ("beta", args.beta, lambda v: v >= 0, ">= 0"),
            ("epsilon", args.epsilon, lambda v: v >= 0, ">= 0"),
            ("learning_rate", args.learning_rate, lambda v: v >= 0, ">= 0"),
            ("seed", args.seed, lambda v: 0 <= v < 2**32, "in [0, 2**32)"),
        ]
        if not ok(value)
    ]
    if args.loss_type not in LOSS_TYPES:
        problems.append(f"loss_type must be one of {LOSS_TYPES}, got {args.loss_type!r}")
    if problems:
        raise ValueError("; ".join(problems))


class NoRewardSignal(RuntimeError):
    """Raised by the no-signal guard (`AgentGRPOConfig.max_unscorable_frac`) after it saved a checkpoint."""


@dataclass
class RolloutBatch:
    """The rollout-batch data contract (docs/layout.md#the-rollout-batch) for this process's B rows. T = padded
    completion length, K = the most turns of any row on ANY process (so gathered tensors agree)."""

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
    continues: torch.Tensor  # (B,) bool, truncated in an environment whose episodes go on past a cut (C4)
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


@dataclass
class GenerationStep:
    """One generation batch on its way through TRL's `generate_and_score`: made when the batch starts, filled by the
    seams TRL calls inside it (in the order the module docstring gives), read to build the `RolloutBatch`, and dropped
    when the batch ends; nothing in it outlives its batch. The trainer holds it as `trainer.generation_step` (None
    between batches)."""

    rows: list[dict]  # this process's dataset rows, each task's row G times in TRL's order: the tasks the loop plays
    model_tokens: list[list[int]] | None = None  # per row, 1 on the completion's model tokens: set by the rollout
    # function for TRL's old and reference passes (docs/methods/grpo.md D12), dropped when TRL's method returns
    rewards_per_func: torch.Tensor | None = None  # (N_global, F) reward columns as TRL gathered them; NaN: no answer
    rewards: torch.Tensor | None = None  # (B,) this process's rows' weighted rewards, as TRL weighs them; NaN: none

    def take_rewards(self, rewards_per_func: torch.Tensor, weights: torch.Tensor, start: int, n: int) -> None:
        """Keep TRL's gathered reward columns and the weighted reward of this process's `n` rows, which start at row
        `start` of the gathered batch (TRL orders it by process)."""
        rewards = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
        rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan
        self.rewards_per_func, self.rewards = rewards_per_func, rewards[start : start + n]


def turns_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Turn index (B, T) derived from a loss mask: turn k is the k-th maximal run of 1s; -1 elsewhere.

    >>> turns_from_mask(torch.tensor([[1, 1, 0, 1, 0, 0]])).tolist()
    [[0, 0, -1, 1, -1, -1]]
    """
    m = mask.long()
    starts = m * (1 - torch.nn.functional.pad(m, (1, 0))[:, :-1])  # 1 at the first token of each run
    return torch.where(m.bool(), starts.cumsum(dim=1) - 1, torch.full_like(m, -1))


class AgentGRPOTrainer(TRLSeams):
    """GRPOTrainer for multi-turn agents; see the module docstring. `env_factory(row) -> Env` builds the environment of
    a dataset row (whose `task` column holds the task); without it the trainer is stock GRPO (single turn)."""

    config_class: type[AgentGRPOConfig] = AgentGRPOConfig  # the config `args` becomes; subclasses set their own

    @classmethod
    def as_config(cls, args: GRPOConfig | None, model) -> AgentGRPOConfig:
        """`args` as a `cls.config_class`. None becomes the default config, named as TRL names it (`<model>-GRPO`);
        a config whose class `config_class` extends (a plain `GRPOConfig`, or an `AgentGRPOConfig` given to a subclass)
        is copied field by field, the fields it lacks at their defaults."""
        if isinstance(args, cls.config_class):
            return args
        if args is None:  # as GRPOTrainer.__init__ does
            model_name = model if isinstance(model, str) else get_config_model_id(model.config)
            return cls.config_class(f"{model_name.split('/')[-1]}-GRPO")
        if not isinstance(args, GRPOConfig) or not issubclass(cls.config_class, type(args)):
            raise TypeError(
                f"args must be a {cls.config_class.__name__}, a GRPOConfig it extends, or None; got "
                f"{type(args).__name__}"
            )
        values = {f.name: getattr(args, f.name) for f in fields(args) if f.init}
        # GRPOConfig.__post_init__ derived generation_batch_size from steps_per_generation; setting both is refused
        values["generation_batch_size"] = None
        return cls.config_class(**values)

    def __init__(
        self,
        model,
        reward_funcs=None,
        args: GRPOConfig | None = None,
        train_dataset=None,
        eval_dataset=None,
        processing_class=None,
        reward_processing_classes=None,
        callbacks=None,
        optimizers=(None, None),
        quantization_config=None,
        peft_config=None,
        tools=None,
        rollout_func=None,
        environment_factory=None,
        *,
        env_factory: Callable[[dict], Env] | None = None,
    ):
        """TRL's parameters in TRL's order (a drop-in for `GRPOTrainer`), plus the keyword-only `env_factory`.
        `args` may be a plain `GRPOConfig` or None (see `as_config`); reward sources and their errors are TRL's."""
        args = self.as_config(args, model)
        if env_factory is not None:
            for name, value in [("rollout_func", rollout_func), ("environment_factory", environment_factory)]:
                if value is not None:
                    raise ValueError(
                        f"env_factory and {name} are two rollout sources; pass one. env_factory plays episodes in "
                        f"trainers/agent_loop.py (handed to TRL as its rollout_func), {name} replaces that loop"
                    )
            if tools:
                raise ValueError(
                    "env_factory and tools are two rollout sources; pass one. tools run TRL's own tool loop; in the "
                    "agent loop a tool environment class runs through envs.base.ToolEnv"
                )
            rollout_func = self._rollout_func
            reward_funcs = reward_funcs if reward_funcs is not None else [reward_function(args)]
        self.env_factory = env_factory
        if args.save_episodes and env_factory is None:
            raise ValueError("save_episodes writes the agent loop's episodes: it needs env_factory")
        self.episodes = EpisodesWriter(args.output_dir) if args.save_episodes else None  # episodes.jsonl
        self.generation_step: GenerationStep | None = None  # the generation batch under way (see GenerationStep)
        self._loss_scored: torch.Tensor | None = None  # the loss mask of TRL's own loss forward (`scoring_loss`, D12)
        self.task_scheduling = TaskScheduling()  # EnvSched (scheduler: envsched), called at named points like R3
        if args.scheduler == "envsched":  # envsched.md: built before TRL's init, which builds no sampler yet
            train_dataset = self.task_scheduling.attach(self, args, train_dataset)
        self.routing_replay = RoutingReplay(self)  # MoE routing replay state (routing-replay.md D7-D9), set up below
        super().__init__(
            model=model,
            reward_funcs=reward_funcs,
            args=args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=processing_class,
            reward_processing_classes=reward_processing_classes,
            callbacks=callbacks,
            optimizers=optimizers,
            quantization_config=quantization_config,
            peft_config=peft_config,
            tools=tools,
            rollout_func=rollout_func,
            environment_factory=environment_factory,
        )
        self.loop_settings = agent_loop.LoopSettings(
            max_turn_tokens=self.args.max_turn_tokens,
            max_completion_length=self.args.max_completion_length,
            max_turns=self.args.max_turns,
            env_timeout=self.args.env_timeout,
        )
        self.collapse_alarm = (
            CollapseAlarm(self.args.max_turn_tokens, ignore=self.alarm_ignores()) if self.args.collapse_alarm else None
        )
        self._unscorable_streak: list[float] = []  # unscorable fractions of the last batches above the guard's bound
        if self.routing_replay.setup(self.accelerator.unwrap_model(self.model)):  # refuses unsupported setups
            self.aux_loss_enabled = False  # router_aux_loss_coef is 0.0 (__post_init__, routing-replay.md D10)
        if self.args.keep_freed_memory and self.accelerator.device.type == "cpu":
            keep_freed_memory()  # D14: a CPU step reuses its freed activations instead of faulting them in again

    def train_sampler(self, dataset=None):
        sampler = self.task_scheduling.sampler(self)  # EnvSched's, under `scheduler: envsched`
        return sampler if sampler is not None else super().train_sampler(dataset)

    @property
    def task_scheduler(self):
        """The EnvSched scheduler of the run (`trainers.envsched.EnvScheduler`), None without `scheduler: envsched`."""
        return self.task_scheduling.scheduler

    @property
    def replay_routing(self) -> bool:
        """True once init found a supported MoE policy with `routing_replay` on; the agent loop then records routes."""
        return self.routing_replay.active

    # ----------------------------------------------------------------------------------------------------------------
    # Hook 1: advantages
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        """(B, T) advantages. Default: stock GRPO, the row's group advantage on its model tokens, 0 elsewhere."""
        return batch.advantages.unsqueeze(1) * batch.mask  # (B, T)

    # Hook 2: the policy loss
    def policy_loss(self, model, inputs: dict) -> torch.Tensor:
        """Scalar loss for one micro-batch. Default: TRL's own GRPO loss (ratio, clipping, KL, aggregation), its
        log-probs scored on the model's tokens only (docs/methods/grpo.md D12)."""
        with self.scoring_loss(self.loss_mask(inputs)):
            return self.trl_loss(model, inputs)

    # ----------------------------------------------------------------------------------------------------------------
    # Helpers for subclasses
    def num_live_global(self, n: int) -> int:
        """Live episodes over all processes (keeps generate calls in step across ranks)."""
        if self.accelerator.num_processes == 1:
            return n
        return int(self.accelerator.reduce(torch.tensor(n, device=self.accelerator.device), reduction="sum").item())

    def forward_logps(self, model, inputs: dict, compute_entropy: bool = False, scored: torch.Tensor | None = None):
        """Per-token log-probs (B, T), entropies and the MoE aux loss of the completion under `model`, with TRL's fused
        forward (temperature applied). The one copy of TRL's loss-side forward setup for text models. Only the
        positions of `scored` (B, T), by default the loss mask, are projected through the LM head; the rest get
        log-prob 0 (docs/methods/grpo.md D12). A pass that wants only the backbone (a value head's) scores none."""
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
        return self.token_logps(
            model,
            input_ids,
            attention_mask,
            completion_ids.size(1),
            compute_entropy=compute_entropy,
            compute_aux_loss=self.aux_loss_enabled,
            scored=self.loss_mask(inputs) if scored is None else scored,
        )

    @contextlib.contextmanager
    def scoring_loss(self, scored: torch.Tensor):
        """The log-prob forward that TRL's own loss (`trl_loss`) makes inside this block scores only the positions of
        `scored` (B, T) (docs/methods/grpo.md D12): TRL calls `token_logps` itself, so the mask cannot be passed."""
        self._loss_scored = scored
        try:
            yield
        finally:
            self._loss_scored = None

    def loss_mask(self, inputs: dict) -> torch.Tensor:
        """(B, T) model tokens of the micro-batch: `completion_mask * tool_mask`, as TRL forms it."""
        mask = inputs["completion_mask"]
        return mask * inputs["tool_mask"] if inputs.get("tool_mask") is not None else mask

    def alarm_ignores(self) -> tuple[str, ...]:
        """Collapse-alarm kinds this trainer's `env/*` numbers cannot inform (trainers/alarm.py); none here."""
        return ()

    def free_routing(self) -> AbstractContextManager[None]:
        """Policy forwards inside this block route freely even when replay is on (e.g. a critic adapter on the
        policy's base, routing-replay.md D7). Under activation checkpointing, run them before the actor forward."""
        return self.routing_replay.free_routing()

    # ----------------------------------------------------------------------------------------------------------------
    # TRL's seams (trainers/trl_api.py)
    def train(self, *args, **kwargs):
        with cpu_fast_paths():  # docs/methods/grpo.md D12, D14; undone when training ends
            return super().train(*args, **kwargs)

    def calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's reward columns (N_global, F, gathered across processes), through `shape_rewards`, kept in the
        generation step once, with this process's rows' weighted rewards, as TRL hands them to its advantages."""
        rewards_per_func = super().calculate_rewards(inputs, prompts, completions, completion_ids_list)
        rewards_per_func = self.shape_rewards(rewards_per_func)
        if self.generation_step is not None:
            start = self.accelerator.process_index * len(prompts)  # TRL orders the gathered rows by process
            self.generation_step.take_rewards(rewards_per_func, self.reward_weights, start, len(prompts))
        return rewards_per_func

    def shape_rewards(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """The gathered reward columns (N_global, F) TRL goes on with (its group normalisation, the rollout batch's
        rewards). Default: unchanged; X-Tree reweighs its bonus column here."""
        return rewards_per_func

    def micro_batch_loss(self, model, inputs):
        with self.routing_replay.micro_batch(inputs, self._first_micro_step):  # routing-replay.md D4, Eq. 9, Eq. 10
            return self.policy_loss(model, inputs)

    def training_step(self, model, inputs, num_items_in_batch):
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.routing_replay.release()  # routing-replay.md D8: routes leave only after the backward has run
        if self.micro_step % self.current_gradient_accumulation_steps == 0:  # an optimizer step's last micro-step
            self.routing_replay.log_step_metrics()
        return loss

    def token_logps(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        scored: torch.Tensor | None = None,
        **multimodal,
    ):
        """TRL's log-prob forward, wrapped in `replay_routes` (routing-replay.md Eq. 3) for the policy's own passes.
        Only the positions of `scored` (B, T) are projected through the LM head (grpo.md D12): the project's own
        forwards pass it (`forward_logps`: the loss mask); TRL's loss forward gets the mask `scoring_loss` set, and
        TRL's old and reference passes over a generation batch the model's tokens of the generation step. A batch
        padded only on the right runs without a padding mask (D15)."""
        forward = super().token_logps
        settings = (logits_to_keep, batch_size, compute_entropy, compute_aux_loss, multimodal)
        if scored is None:
            scored, self._loss_scored = self._loss_scored, None  # one forward: the loss's own
        step = self.generation_step
        if scored is None and step is not None and step.model_tokens is not None:
            if len(step.model_tokens) == input_ids.size(0):  # TRL's old / reference pass: 0 past each row's end
                T = logits_to_keep
                scored = torch.tensor([m[:T] + [0] * (T - len(m[:T])) for m in step.model_tokens], dtype=torch.long)
        if scored is not None and scored.shape != (input_ids.size(0), logits_to_keep):
            raise RuntimeError(
                f"loss mask {tuple(scored.shape)} does not cover the forward's completion "
                f"({input_ids.size(0)}, {logits_to_keep})"
            )
        # D15: no mask for right padding, except where the mask also serves the MoE balance loss, routing replay's
        # record or a multimodal model's inputs
        images = any(value is not None for value in multimodal.values())  # TRL's loss passes them all, as None
        causal = not (compute_aux_loss or images or self.routing_replay.active)
        with ExitStack() as hooks:
            hooks.enter_context(cpu_fast_paths())  # D12, D14
            if scored is not None:
                hooks.enter_context(ScoredLabels(model, scored))
            if causal:
                hooks.enter_context(CausalWithoutMask(model))
            return self.routing_replay.logps(forward, model, input_ids, attention_mask, *settings)

    def generate_and_score(self, inputs):
        self.generation_step = GenerationStep(rows=inputs)
        try:
            return self._generate_and_score(inputs, self.generation_step)
        finally:
            self.generation_step = None

    def _generate_and_score(self, inputs: list[dict], step: GenerationStep) -> dict:
        with self.routing_replay.generation(), cpu_fast_paths():  # no replay in generation (routing-replay.md D7)
            try:
                out = super().generate_and_score(inputs)
            finally:
                step.model_tokens = None  # set by the rollout function, for the passes inside TRL's method only
            self.routing_replay.add_routes(out)  # out["routing"] (B, S, L, k), batch-first (routing-replay.md D4)
        self.routing_replay.log_batch_metrics(out)  # routing-replay.md Eq. 8, Eq. 10
        scored = out["completion_mask"] * out["tool_mask"] if out.get("tool_mask") is not None else None
        for key in ("old_per_token_logps", "ref_per_token_logps"):  # 0 off the model's tokens, like the loss's (D12)
            if scored is not None and out.get(key) is not None:
                out[key] = out[key] * scored
        batch = self._rollout_batch(inputs, out, step.rewards)
        if self.model.training:
            self.task_scheduling.update(self, inputs, batch)
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
        if self.episodes is not None and self.model.training:
            self.episodes.write(self, batch)
        self._guard_reward_signal(step.rewards_per_func)
        return out

    # ----------------------------------------------------------------------------------------------------------------
    # Checkpoints carry the monitors' memory
    def monitor_state(self) -> dict:
        """What the run's monitors remember between generation batches (JSON-ready); subclasses add theirs."""
        alarm = self.collapse_alarm.state_dict() if self.collapse_alarm is not None else None
        state = {"collapse_alarm": alarm, "unscorable_streak": list(self._unscorable_streak)}
        if self.task_scheduling.active:
            state["scheduler"] = self.task_scheduling.state_dict()
        return state

    def load_monitor_state(self, state: dict) -> None:
        if self.collapse_alarm is not None and state.get("collapse_alarm"):
            self.collapse_alarm.load_state_dict(state["collapse_alarm"])
        self._unscorable_streak = list(state.get("unscorable_streak", []))
        if self.task_scheduling.active and state.get("scheduler"):
            self.task_scheduling.load_state_dict(state["scheduler"])

    def save_checkpoint(self, model, trial):
        """Write agent_state.json first: the trainer writes trainer_state.json last, and a checkpoint without it is
        incomplete, so a complete checkpoint always has both."""
        folder = self.checkpoint_folder(trial)
        with disk_full_named(folder):
            if self.args.should_save:
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, MONITOR_STATE), "w") as f:
                    json.dump(self.monitor_state(), f)
            super().save_checkpoint(model, trial)

    def load_checkpoint(self, resume_from_checkpoint, model=None):
        quiet = TiedKeysFilter(model if model is not None else self.model)  # a tied lm_head is not saved, by design
        trainer_logger = logging.getLogger("transformers.trainer")
        trainer_logger.addFilter(quiet)
        try:
            super().load_checkpoint(resume_from_checkpoint, model)
        finally:
            trainer_logger.removeFilter(quiet)
        path = os.path.join(resume_from_checkpoint, MONITOR_STATE)
        if os.path.isfile(path):  # absent in checkpoints written before it existed: the monitors start afresh
            with open(path) as f:
                self.load_monitor_state(json.load(f))

    # ----------------------------------------------------------------------------------------------------------------
    # The agent loop as TRL's rollout_func, and the routing replay's read of TRL's step counter
    def _rollout_func(self, prompts: list, trainer) -> dict[str, list]:
        """TRL's `rollout_func`: the agent loop; route records stay on the trainer, where the old-log-prob pass that
        TRL runs before merging rollout fields into the rows finds them (routing-replay.md D7)."""
        rollouts = agent_loop.trainer_rollouts(prompts, self, self.generation_step.rows)
        self.routing_replay.take_rollouts(rollouts)  # keeps the route records (routing-replay.md §3), logs Eq. 11
        self.generation_step.model_tokens = [r.env_mask for r in rollouts]  # what TRL's old and reference passes score
        return agent_loop.to_trl(rollouts)

    def _first_micro_step(self) -> bool:
        return self.micro_step % self.current_gradient_accumulation_steps == 0

    # ----------------------------------------------------------------------------------------------------------------
    def _rollout_batch(self, inputs: list[dict], out: dict, rewards: torch.Tensor) -> RolloutBatch:
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
        start = self.accelerator.process_index * B
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
            continues=torch.tensor([bool(row.get("continues", False)) for row in inputs], device=device),
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
        rows = gather_object(  # turn_index is -1 on environment tokens: the rest are the model's
            [
                (
                    r["success"],
                    len(r["turn_rewards"]),
                    r["truncated"],
                    r["env_errors"],
                    sum(k >= 0 for k in r["turn_index"]),
                )
                for r in batch.rows
            ]
        )
        n, turns = max(1, len(rows)), sum(r[1] for r in rows)
        stats = {
            "env/success": sum(r[0] for r in rows) / n,
            "env/turns": turns / n,
            "env/truncated": sum(r[2] for r in rows) / n,
            "env/errors": sum(r[3] for r in rows) / n,
            "env/tokens_per_turn": sum(r[4] for r in rows) / max(1, turns),  # all model tokens over all turns
        }
        for name, value in stats.items():
            self.log_metric(name, value)
        if self.collapse_alarm is not None and self.model.training and self.accelerator.is_main_process:
            zero_std = self.logged_metrics("train").get("frac_reward_zero_std", [None])[-1]  # TRL's, this batch
            watched = (stats["env/tokens_per_turn"], stats["env/truncated"], stats["env/success"], zero_std)
            for alarm in self.collapse_alarm.update(*watched):
                logger.warning("%s", alarm.message)
                self.log_metric(f"alarm/{alarm.kind}", 1.0)

    def _guard_reward_signal(self, rpf: torch.Tensor) -> None:
        """Log `reward/unscorable_frac` (rollouts for which every reward function returned None, over all processes)
        and stop the run, after saving a checkpoint, when it stays above `max_unscorable_frac` for
        `unscorable_patience` training batches in a row. Every process sees the same gathered rewards, so all stop
        together."""
        frac = torch.isnan(rpf).all(dim=1).float().mean().item() if len(rpf) else 0.0
        self.log_metric("reward/unscorable_frac", frac)
        if not self.model.training:
            return
        streak = self._unscorable_streak
        if frac > self.args.max_unscorable_frac:
            streak.append(frac)
        else:
            streak.clear()
        if len(streak) < self.args.unscorable_patience:
            return
        saved = "nothing was trained yet, so no checkpoint was saved"
        if self.state.global_step > 0:
            self.save_checkpoint(self.model, trial=None)
            saved = f"saved checkpoint-{self.state.global_step} in {self.args.output_dir}"
        shown = ", ".join(f"{x:.0%}" for x in streak)
        raise NoRewardSignal(
            f"{len(streak)} generation batches in a row had more than {self.args.max_unscorable_frac:.0%} of their "
            f"rollouts without a reward ({shown}): every reward function ({', '.join(self.reward_func_names)}) "
            "returned None for them. A judge that cannot be reached or rejects its API key does this; the logged "
            "judge metrics (e.g. judge/failures/*, draco/judge_failures/*) say which. Training stopped instead of "
            f"training on nothing ({saved}); fix the reward source and resume with --resume_from_checkpoint true. "
            "max_unscorable_frac and unscorable_patience set this guard"
        )


#: below this much free space, a failed write is put down to a full disk (torch's own message never says so)
DISK_FULL_BYTES = 64 * 2**20


@contextlib.contextmanager
def disk_full_named(folder: str):
    """Turn a write that failed for lack of space into an error that says so: ENOSPC or EDQUOT, or torch's
    "unexpected pos ..." / "PytorchStreamWriter failed" when the disk holding `folder` has less than
    `DISK_FULL_BYTES` free. Anything else passes through unchanged."""
    try:
        yield
    except (OSError, RuntimeError) as err:
        full = isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)
        probe = folder
        while probe and not os.path.isdir(probe):
            probe = os.path.dirname(probe)
        free = shutil.disk_usage(probe or ".").free
        if not full and not free < DISK_FULL_BYTES:
            raise
        raise DiskFull(
            f"writing {folder} failed: the disk holding it is full ({free / 2**20:.0f} MiB free; the write stopped "
            f"with {type(err).__name__}: {str(err)[:120]}). The folder is incomplete, and resuming skips it; free "
            "some space (or point output_dir at a larger disk) and resume with --resume_from_checkpoint true"
        ) from err


class DiskFull(OSError):
    """A checkpoint or model write failed because the disk is full; the message says what to do."""


class TiedKeysFilter(logging.Filter):
    """Drops transformers' "There were missing keys in the checkpoint model loaded: [...]" when every missing key is
    a parameter tied to another (the tied `lm_head.weight` of a model with tied embeddings, which safetensors saves
    once): the load is complete, and the message would read as a broken checkpoint. Any other missing key is kept."""

    PREFIX = "There were missing keys in the checkpoint model loaded: "

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        counts = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        self.tied = {name for name, p in model.named_parameters(remove_duplicate=False) if counts[id(p)] > 1}

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if not message.startswith(self.PREFIX):
            return True
        try:
            missing = ast.literal_eval(message[len(self.PREFIX) :].rstrip("."))
        except (ValueError, SyntaxError):
            return True
        return not (missing and set(missing) <= self.tied)


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
