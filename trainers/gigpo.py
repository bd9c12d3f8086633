"""GiGPO: group-in-group advantages from anchor states, https://huggingface.co/papers/2505.10978,
docs/methods/gigpo.md.

Changes relative to GRPO:
1. Anchor groups: within each task group, the steps that start from the same environment state (its `state_key`, or
   the whitespace-normalised observation before the step when the environment defines none) form one group, across
   rollouts and across time (gigpo.md Eq. 3); optionally near-identical states merge (Eq. 9).
2. Inside an anchor group, steps are compared by their discounted return from that step on (Eq. 4-5), and the step
   advantage A^S is added to GRPO's episode advantage on the step's tokens: A^E + ω·A^S (Eq. 6-7, the additive form
   of credit-interface.md Eq. I-3).

Unchanged: TRL's group advantage A^E (Eq. 2, `scale_rewards` picks the normalisation of both levels, D4), sampling,
the clipped surrogate, the KL term and the loss aggregation. Only `compute_advantages` is overridden. With several
processes the keys and rewards of the whole batch are gathered and every process computes the same A^S (D11).

This file reads top to bottom: `GiGPOConfig`, the pure math (`anchor_key`, `anchor_groups`, `discounted_returns`,
`step_advantages`, `gigpo_advantages`, `# Eq. N` on the implementing lines), then `GiGPOTrainer`.

Logged metrics (besides the `credit/*` set of credit-interface.md §10): `gigpo/step_group_size_mean`,
`gigpo/singleton_frac`, `gigpo/group_size_frac/<1|2-5|6-9|10-49|50+>`, `gigpo/anchor_coverage`,
`gigpo/adv_episode_abs_mean`, `gigpo/adv_step_abs_mean`, `gigpo/adv_step_std`, `gigpo/sign_flip_turn_frac`,
`gigpo/zero_var_groups_with_step_signal`, `gigpo/similarity_merges`, `gigpo/missing_key_frac`, `gigpo/return_mean`
(gigpo.md §8).

Decision ids (`Dn`) without a page are docs/methods/gigpo.md's.
"""

from __future__ import annotations

import difflib
import logging
import math
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather, gather_object
from torch import Tensor

from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, RolloutBatch
from trainers.credit import CreditOutput, credit_metrics, redistribute_additive

logger = logging.getLogger(__name__)

STD_EPS = 1e-4  # gigpo.md D6: TRL's epsilon


@dataclass
class GiGPOConfig(AgentGRPOConfig):
    """AgentGRPOConfig plus GiGPO's step level (`docs/methods/gigpo.md` §5)."""

    gigpo_step_weight: float = field(
        default=1.0, metadata={"help": "ω, weight of the step advantage A^S beside GRPO's A^E (gigpo.md Eq. 6)."}
    )
    gigpo_gamma: float = field(default=0.95, metadata={"help": "Discount of the step returns (gigpo.md Eq. 4, D3)."})
    gigpo_similarity: float | None = field(
        default=None,
        metadata={
            "help": "η: merge states whose matching ratio is >= η into one anchor (gigpo.md Eq. 9); None: exact keys "
            "only (D2). The paper uses 0.9 on search QA."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        if not self.gigpo_step_weight >= 0:
            raise ValueError(f"gigpo_step_weight must be >= 0, got {self.gigpo_step_weight}")
        if not 0 <= self.gigpo_gamma <= 1:
            raise ValueError(f"gigpo_gamma must be in [0, 1], got {self.gigpo_gamma}")
        if self.gigpo_similarity is not None and not 0 < self.gigpo_similarity <= 1:
            raise ValueError(f"gigpo_similarity must be in (0, 1] or None, got {self.gigpo_similarity}")


# ---------------------------------------------------------------------------------------------------------------------
# Anchor keys and groups (Eq. 3, Eq. 9)


def anchor_key(key) -> str | None:
    """A state key with whitespace normalised (gigpo.md D1, conventions.md C13); None stays None.

    >>> anchor_key("  room 1\\n\\t key ")
    'room 1 key'
    """
    return None if key is None else " ".join(str(key).split())


def similarity(a: str, b: str) -> float:
    """The matching-subsequence ratio 2·M / (|a| + |b|) (gigpo.md Eq. 9).

    >>> similarity("abcd", "abce")
    0.75
    """
    if a == b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def anchor_groups(
    keys: list[list[str | None]], group_ids: list[int], num_turns: int, eta: float | None = None
) -> tuple[Tensor, int]:
    """Anchor-group labels (B, K) int64 (gigpo.md Eq. 3): steps of one task group with the same normalised key share
    a label; steps whose key is None and turns a row lacks get -1 (singletons, D12). With `eta` (Eq. 9), a state joins
    the first cluster of its task group whose first member it matches with ratio >= eta, visiting rows in batch order
    and each row's turns in order; otherwise it starts a cluster.

    Returns the labels and the number of states merged into a cluster whose first member differs from them.

    >>> anchor_groups([["a", "b"], ["a ", "c"], ["a", None]], [0, 0, 1], 2)[0].tolist()
    [[0, 1], [0, 2], [3, -1]]
    """
    labels = torch.full((len(keys), num_turns), -1, dtype=torch.long)
    clusters: dict[tuple[int, str], int] = {}  # (task group, key) -> label
    firsts: dict[int, list[tuple[str, int]]] = {}  # task group -> (first member, label) of each cluster, in order
    merges = 0
    for b, (row, g) in enumerate(zip(keys, group_ids, strict=True)):
        for k, raw in enumerate(row[:num_turns]):
            key = anchor_key(raw)
            if key is None:
                continue
            label = clusters.get((g, key))
            if label is None and eta is not None:
                for first, other in firsts.get(g, []):
                    if similarity(key, first) >= eta:  # Eq. 9: the first matching cluster, in order of appearance
                        label, merges = other, merges + 1
                        break
            if label is None:
                label = len(clusters)
                firsts.setdefault(g, []).append((key, label))
            clusters[(g, key)] = label
            labels[b, k] = label
    return labels, merges


# ---------------------------------------------------------------------------------------------------------------------
# Returns and advantages (Eq. 1-7)


def step_rewards(turn_rewards: Tensor, turn_valid: Tensor, rewards: Tensor) -> Tensor:
    """r_ij (B, K) float64 whose sum over a row's turns is its trained reward R(τ_i) (gigpo.md Eq. 1, D8): the
    environment's per-turn rewards, plus whatever part of the row's reward they do not account for (a final-only
    reward, a binary or assertion reward, a user's reward function) on the row's last turn. A row with a non-finite
    reward is all NaN.

    >>> valid = torch.tensor([[True, True, False]])
    >>> step_rewards(torch.tensor([[0.0, 0.5, 0.0]]), valid, torch.tensor([1.0])).tolist()  # 0.5 more on turn 1
    [[0.0, 1.0, 0.0]]
    """
    valid = turn_valid.bool()
    r = torch.where(valid, turn_rewards.to(torch.float64), 0.0)  # (B, K)
    R = rewards.to(torch.float64)  # (B,)
    last = (valid.long().cumsum(dim=1) == valid.sum(dim=1, keepdim=True)) & valid  # (B, K) the row's last turn
    r = r + last * (torch.where(torch.isfinite(R), R, 0.0) - r.sum(dim=1)).unsqueeze(1)  # Eq. 1: Σ_j r_ij = R(τ_i)
    return torch.where(torch.isfinite(R).unsqueeze(1), r, math.nan)


def discounted_returns(rewards: Tensor, turn_valid: Tensor, gamma: float) -> Tensor:
    """R_ij = Σ_{k ≥ j} γ^{k−j} r_ik (gigpo.md Eq. 4), (B, K) float64, 0 on turns a row lacks.

    >>> discounted_returns(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3, dtype=torch.bool), 0.5).tolist()
    [[0.25, 0.5, 1.0]]
    """
    valid = turn_valid.bool()
    r = torch.where(valid, rewards.to(torch.float64), 0.0)  # (B, K)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    for k in range(r.shape[1] - 1, -1, -1):
        running = r[:, k] + gamma * running  # Eq. 4
        out[:, k] = running
    return torch.where(valid, out, 0.0)


def step_advantages(returns: Tensor, labels: Tensor, scale: bool) -> Tensor:
    """A^S_ij = (R_ij − mean of its anchor group) / F^S (gigpo.md Eq. 5), (B, K) float64. F^S is the group's Bessel
    std + 1e-4 when `scale`, else 1 (D4, D6). Label -1, singletons and constant-return groups give 0; a group with a
    non-finite return gives 0 to its members.

    >>> step_advantages(torch.tensor([[1.0, 0.0], [3.0, 5.0]]), torch.tensor([[0, -1], [0, 1]]), False).tolist()
    [[-1.0, 0.0], [1.0, 0.0]]
    """
    out = torch.zeros(returns.shape, dtype=torch.float64, device=returns.device)
    R = returns.to(torch.float64)
    for label in torch.unique(labels[labels >= 0]).tolist():
        members = labels == label  # (B, K)
        values = R[members]
        if values.numel() < 2 or not bool(torch.isfinite(values).all()):
            continue  # D6: singletons get 0
        centred = values - values.mean()  # Eq. 5
        if scale:
            centred = centred / (values.std(unbiased=True) + STD_EPS)  # D6: Bessel std + epsilon
        out[members] = centred
    return out


@dataclass
class GiGPOStats:
    """What one batch's step level did, for the gigpo/* metrics (gigpo.md §8)."""

    labels: Tensor  # (B, K) anchor labels, -1 for steps in no group
    step_adv: Tensor  # (B, K) A^S
    returns: Tensor  # (B, K) R_ij
    merges: int  # states merged by Eq. 9 that were not exact matches
    missing: int  # steps whose key was None


def gigpo_step_level(
    turn_valid: Tensor,
    turn_rewards: Tensor,
    rewards: Tensor,
    keys: list[list[str | None]],
    group_ids: list[int],
    gamma: float = 0.95,
    scale: bool = True,
    eta: float | None = None,
) -> GiGPOStats:
    """GiGPO's step level for a batch of whole task groups, gigpo.md Eq. 1, 3-5 and 9: anchor groups, discounted step
    returns and A^S (on the CPU, float64). `keys` hold the state before each turn (any whitespace); None or absent
    keys make singletons (A^S = 0, D12). Every turn a row has takes part, rejected actions included (D7); a row with
    a non-finite reward gets A^S = 0 and puts NaN in its groups' statistics (they give 0 too).

    Args:
        turn_valid (`Tensor`): (B, K) bool.
        turn_rewards (`Tensor`): (B, K) environment reward after each turn.
        rewards (`Tensor`): (B,) the trained reward R(τ_i) that TRL normalised into A^E (NaN: unscorable).
        keys (`list[list[str | None]]`): (B, K) state keys.
        group_ids (`list[int]`): (B,) task group of each row; anchors never cross task groups.
        gamma (`float`): γ (Eq. 4). scale (`bool`): std normalisation (D4). eta (`float`, *optional*): Eq. 9.
    """
    K = turn_valid.shape[1]
    valid = turn_valid.bool().cpu()
    labels, merges = anchor_groups(keys, group_ids, K, eta)  # Eq. 3, Eq. 9
    labels = torch.where(valid, labels, -1)
    missing = sum(anchor_key(row[k]) is None for row in keys for k in range(min(len(row), K)))
    r = step_rewards(turn_rewards.cpu(), valid, rewards.cpu())  # Eq. 1 (D8)
    returns = discounted_returns(torch.nan_to_num(r, nan=0.0), valid, gamma)  # Eq. 4
    returns = torch.where(torch.isnan(r), math.nan, returns)
    a_s = step_advantages(returns, labels, scale)  # Eq. 5
    return GiGPOStats(labels=labels, step_adv=a_s, returns=returns, merges=merges, missing=missing)


@torch.no_grad()
def gigpo_advantages(
    adv: Tensor,
    turn_index: Tensor,
    turn_valid: Tensor,
    turn_rewards: Tensor,
    rewards: Tensor,
    keys: list[list[str | None]],
    group_ids: list[int],
    omega: float = 1.0,
    gamma: float = 0.95,
    scale: bool = True,
    eta: float | None = None,
    start: int = 0,
) -> tuple[CreditOutput, GiGPOStats]:
    """GiGPO's per-token advantages, gigpo.md Eq. 1-7: A^E_i + ω·A^S_ij on the loss tokens of step j, 0 on tokens of
    no step (the additive form, credit-interface.md Eq. I-3). `adv` (b,) is A^E, TRL's group advantage (Eq. 2); ω ≥ 0
    (Eq. 6); `turn_valid`, `turn_rewards`, `rewards`, `keys` and `group_ids` describe the whole batch (B rows) and are
    those of `gigpo_step_level`, which runs over all of it.

    `adv` and `turn_index` (b, T) are rows [start, start + b) of that batch, the rows that get advantages: by default
    the whole batch (start 0, b = B); with several processes, one process's rows of the gathered batch (D11).
    The statistics returned cover the whole batch.

    >>> out, _ = gigpo_advantages(torch.tensor([0.0, 0.0]), torch.tensor([[0, -1, 1], [0, -1, -1]]),
    ...     torch.tensor([[True, True], [True, False]]), torch.zeros(2, 2), torch.tensor([1.0, 1.0]),
    ...     [["s", "t"], ["s"]], [0, 0], gamma=0.5, scale=False)
    >>> out.advantages.tolist()  # both succeed; at "s" the 1-step rollout's return 1 beats 0.5
    [[-0.25, 0.0, 0.0], [0.25, 0.0, 0.0]]
    """
    b = adv.shape[0]
    if not 0 <= start <= start + b <= turn_valid.shape[0]:
        raise ValueError(f"rows [{start}, {start + b}) are not inside the batch of {turn_valid.shape[0]} rows")
    stats = gigpo_step_level(turn_valid, turn_rewards, rewards, keys, group_ids, gamma, scale, eta)  # Eq. 1, 3-5, 9
    own = stats.step_adv[start : start + b].to(adv.device)  # (b, K) A^S of the rows that get advantages
    valid = turn_valid[start : start + b].to(adv.device)  # (b, K)
    out = redistribute_additive(adv, turn_index, own, valid, omega)  # Eq. 6-7
    return out, stats


def gigpo_metrics(stats: GiGPOStats, adv: Tensor, turn_valid: Tensor, group_ids: list[int], omega: float) -> dict:
    """The gigpo/* metrics of gigpo.md §8 over the rows given (normally the whole gathered batch)."""
    nan = math.nan
    valid = turn_valid.bool().cpu()
    labels, a_s = stats.labels, stats.step_adv
    steps = int(valid.sum())
    sizes = torch.zeros_like(labels)  # (B, K) size of each step's anchor group; 1 for steps in no group
    for label in torch.unique(labels[labels >= 0]).tolist():
        members = labels == label
        sizes[members] = int(members.sum())
    sizes = torch.where(valid & (labels < 0), 1, sizes)[valid].double()  # over the steps
    metrics = {
        "gigpo/step_group_size_mean": float(sizes.mean()) if steps else nan,
        "gigpo/singleton_frac": float((sizes == 1).double().mean()) if steps else nan,
        "gigpo/anchor_coverage": float((sizes >= 2).double().mean()) if steps else nan,
    }
    for name, lo, hi in (("1", 1, 1), ("2-5", 2, 5), ("6-9", 6, 9), ("10-49", 10, 49), ("50+", 50, math.inf)):
        share = float(((sizes >= lo) & (sizes <= hi)).double().mean()) if steps else nan
        metrics[f"gigpo/group_size_frac/{name}"] = share
    a_e = adv.detach().to(torch.float64).cpu()  # (B,)
    step_a_s = a_s[valid]
    metrics["gigpo/adv_episode_abs_mean"] = float(a_e.abs().mean()) if a_e.numel() else nan
    metrics["gigpo/adv_step_abs_mean"] = float(step_a_s.abs().mean()) if steps else nan
    metrics["gigpo/adv_step_std"] = float(step_a_s.std(unbiased=False)) if steps else nan
    e = a_e.unsqueeze(1).expand_as(a_s)  # (B, K)
    considered = valid & (e != 0)
    flips = considered & (torch.sign(e + omega * a_s) != torch.sign(e))
    metrics["gigpo/sign_flip_turn_frac"] = float(flips.sum() / considered.sum()) if bool(considered.any()) else nan
    zero_var = 0
    groups = torch.tensor(group_ids)
    for g in torch.unique(groups).tolist():
        rows = groups == g
        if bool((a_e[rows] == 0).all()) and bool((a_s[rows] != 0).any()):
            zero_var += 1  # σ(R) = 0 in the group (every A^E is 0) but the step level still speaks
    metrics["gigpo/zero_var_groups_with_step_signal"] = float(zero_var)
    metrics["gigpo/similarity_merges"] = float(stats.merges)
    metrics["gigpo/missing_key_frac"] = stats.missing / steps if steps else nan
    finite = stats.returns[valid & torch.isfinite(stats.returns)]
    metrics["gigpo/return_mean"] = float(finite.mean()) if finite.numel() else nan
    return metrics


# ---------------------------------------------------------------------------------------------------------------------
# The trainer


class GiGPOTrainer(AgentGRPOTrainer):
    """GiGPO on the agent GRPO base; see the module docstring. The parameters are the base's, in TRL's order."""

    config_class = GiGPOConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.credit = None  # the latest batch's `CreditOutput`, for inspection
        self._warned_no_keys = False

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        args, acc = self.args, self.accelerator
        B, K = batch.turn_valid.shape
        keys, group_ids = batch.state_keys, batch.group_ids.tolist()
        adv_all, valid_all, turn_rewards_all, rewards_all = (
            batch.advantages,
            batch.turn_valid,
            batch.turn_rewards,
            batch.rewards,
        )
        if acc.num_processes > 1:  # D11: every process computes the whole batch's A^S and keeps its rows
            keys, group_ids = gather_object(keys), gather_object(group_ids)
            adv_all, valid_all = gather(batch.advantages), gather(batch.turn_valid)
            turn_rewards_all, rewards_all = gather(batch.turn_rewards), gather(batch.rewards)
        if all(anchor_key(k) is None for row in keys for k in row):  # D12: nothing to anchor on
            if not self._warned_no_keys:
                logger.warning("GiGPO: the environment gives no state keys; training as plain GRPO (gigpo.md D12)")
                self._warned_no_keys = True
            self.log_metric("credit/fallback_rate/no_state_keys", 1.0)
            return super().compute_advantages(batch)
        start = acc.process_index * B if acc.num_processes > 1 else 0
        scale = args.scale_rewards != "none"  # D4: one switch for both levels
        out, stats = gigpo_advantages(  # Eq. 1-7 over the whole batch, advantages for this process's rows
            batch.advantages, batch.turn_index, valid_all, turn_rewards_all, rewards_all, keys, group_ids,
            args.gigpo_step_weight, args.gigpo_gamma, scale, args.gigpo_similarity, start=start,
        )  # fmt: skip
        self.credit = out
        metrics = credit_metrics(out, batch.advantages, batch.turn_index, batch.turn_valid, "additive")
        metrics |= gigpo_metrics(stats, adv_all, valid_all, group_ids, args.gigpo_step_weight)
        for name, value in metrics.items():
            self.log_metric(name, value)
        return out.advantages  # (B, T)
