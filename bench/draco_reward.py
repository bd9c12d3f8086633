"""Does DRACO's outcome-blind reward lead to success? Its rubric reward against the environment's success, offline.

    python bench/draco_reward.py                          # shop, search, terminal at levels 0 and 3, p 0.3 / 0.5 / 0.7
    python bench/draco_reward.py --essential-gate --out bench/results/draco_reward_essential_gate   # draco.md D19
    python bench/draco_reward.py --envs shop --levels 0 --tasks 20 --out /tmp/draco_reward   # a quick look

No model: every rollout is the environment's expert (`expert_action`) corrupted with probability `p` per turn by one of
four mistakes drawn uniformly (`corrupt`): **skip** the expert's step (play the step after it), a **random** action
valid on the current page or shell, **stop** early (the shop's `buy`, the terminal's `submit`, the search's answer
with the best guess so far) and the environment's own **wrong** action (`noisy_action`: a wrong option, item, file or
entity). Each task gets `--rollouts` (12) rollouts, grouped G at a time as DRACO samples them.

The reward is DRACO's, exactly as `DRACOTrainer` computes it: `rewards.rubrics.DracoReward` over a `RubricPipeline`
with the oracle judge (`rewards.oracle.OracleJudge`: the real prompts of rewards/rubrics.py answered from ground
truth), then TRL's group advantage (draco.md Eq. 3) and, at G = 6, the credit stage and DRACO's step weights
(`trainers.draco.draco_step_weights`, Eq. 4-6). With `--essential-gate` the pipeline runs with draco.md D19's
essential gate (`RubricPipeline(essential_gate=True)`, `DRACOConfig.draco_essential_gate`), so every table below is
that reward's. The environment's success is read only to evaluate. Measured per environment, level and p:

* agreement: the within-group pairwise AUC (the share of (success, failure) pairs of one group where the success has
  the higher reward, ties counting 1/2), the strict share (ties count 0), the mean reward of successes and failures,
  and the share of mixed groups where every success beats every failure;
* where the push goes: the share of the positive advantage mass that lands on successes (1 for a binary success
  reward; what is left goes to failures), and per failure type (`FAILURE_TYPES`, e.g. "bought, no size chosen"): its
  mean reward, how often it is its group's best rollout, how often its advantage is positive, in all groups, in
  mixed groups (a success and a failure) and in groups without a success;
* step credit: the share ρ_j = w_j / Σ_k w_k of a rollout's push that DRACO's step weights put on its last step (the
  shop's `buy`, the terminal's `submit`, the search's answer), for winners and losers, against 1/M;
* variants the method's page leaves open, computed from the same judge verdicts (`VARIANTS`): criterion weights (task
  rubric S1 above trajectory rubric S2), the static rubric (every oracle check, no union filter, no dropout), two
  outcome-first forms of Eq. 2 (a tier and a gate on the S1 criteria), the other side of D19 (the essential gate in a
  run without it, Eq. 2 without it in a run with it), and the group size G (the pipeline rerun for each G in
  `--group-sizes`); the environment's own reward and its success as references (`variants`).

Writes bench/results/draco_reward/result.json (every number, per setting, type and variant) and result.md (the
tables), or into `--out`. About 5 minutes on one busy CPU core for the default run.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository's packages

from bench.draco_cost import group_advantages  # noqa: E402
from bench.record import RESULTS, write_result  # noqa: E402
from envs import ENVIRONMENTS  # noqa: E402
from envs.base import Env  # noqa: E402
from envs.search import normalize_answer  # noqa: E402
from envs.shop import COLOURS, MATERIALS, TYPES  # noqa: E402
from envs.terminal import CONTENT, NAMES  # noqa: E402
from rewards.oracle import CHECKS, OracleJudge  # noqa: E402
from rewards.rubrics import (  # noqa: E402
    DracoReward,
    GroupInput,
    GroupResult,
    RubricPipeline,
    gated_rubric_reward,
    normalize_title,
    rubric_reward,
)
from trainers.draco import draco_citations, draco_step_weights  # noqa: E402

KINDS = ("skip", "random", "stop", "wrong")
MIN_COUNT = 20  # rollout types rarer than this in a setting are left out of result.md's type tables (kept in the JSON)


# ---------------------------------------------------------------------------------------------------------------------
# 1. Corrupted experts


def replay(env_cls: type[Env], task: dict, actions: Sequence[str]) -> Env:
    """A fresh environment on `task` after `actions` (the built-in environments are deterministic)."""
    env = env_cls(task["difficulty"])
    env.reset(task)
    for action in actions:
        env.step(action)
    return env


def search_guess(task: dict, transcript: Sequence[dict]) -> str:
    """The answer a policy that stops now would copy: the object of result (1) of the latest search, else the
    question's own entity (nothing has been read yet)."""
    for turn in reversed(transcript):
        text = turn["observation"]
        if text.startswith("results: (1) "):
            first = text.removeprefix("results: (1) ").split(" (2) ")[0].strip()
            if first in task["corpus"]:
                return task["facts"][task["corpus"].index(first)][2]
    return task["hops"][0]


def random_action(env: Env, task: dict, rng: random.Random) -> str:
    """An action valid in the current state (it parses and the page or shell accepts it), drawn uniformly."""
    if env.name == "shop":
        options = [f"search[{rng.choice(COLOURS)} {rng.choice(MATERIALS)} {rng.choice(TYPES)}]"]
        if env.page == "results":
            options += [f"click[{it['id']}]" for it in env.results]
        elif env.page == "item":
            options += [f"choose[{s}]" for s in env.item["sizes"]] + ["buy"]
        return rng.choice(options)
    if env.name == "terminal":
        files = sorted(env.shell.files)
        options = ["ls", f"echo {rng.choice(CONTENT)} > {rng.choice(NAMES)}.txt", f"mkdir {rng.choice(NAMES)}"]
        options += [f"cat {f}" for f in files] + [f"rm {f}" for f in files]
        return rng.choice(options)
    facts = task["facts"]
    return rng.choice([f"search[{s}]" for s, _, _ in facts] + [f"answer[{o}]" for _, _, o in facts])


def corrupt(kind: str, env: Env, task: dict, transcript: Sequence[dict], rng: random.Random) -> str:
    """The action of one corrupted turn; `kind` is one of `KINDS`.

    skip: the expert's action after the one it would take now (on the shop's item page: `buy` without the `choose`); in
    the search, where the next query or the answer is only known after the skipped search, skipping is answering now.
    stop: end the episode now (`buy`, `submit`, the answer with `search_guess`). random: `random_action`. wrong: the
    environment's `noisy_action`.
    """
    if kind == "wrong":
        return env.noisy_action(rng)
    if kind == "random":
        return random_action(env, task, rng)
    if kind == "stop" or (kind == "skip" and env.name == "search"):
        return {"shop": "buy", "terminal": "submit"}.get(env.name) or f"answer[{search_guess(task, transcript)}]"
    if kind == "skip":
        ahead = replay(type(env), task, [turn["action"] for turn in transcript])
        ahead.step(ahead.expert_action())
        return ahead.expert_action()
    raise ValueError(f"unknown corruption {kind!r}; expected one of {KINDS}")


def shop_failure(env: Env, task: dict, done: bool, info: dict) -> str:
    if not done:
        return "no purchase"
    m = info["matched"]
    parts = [] if m["type"] and m["material"] and m["colour"] else ["wrong item"]
    parts += [] if m["price"] else ["over price"]
    parts += [] if m["size"] else ["no size chosen" if "size" not in env.chosen else "wrong size"]
    return "bought, " + " + ".join(parts)


def terminal_failure(env: Env, task: dict, done: bool, info: dict) -> str:
    failing = info["assertions_total"] - info["assertions_passed"] - (not done)  # the report's own `submitted` check
    if done:
        return "submitted, 1 check failing" if failing == 1 else "submitted, 2+ checks failing"
    return "no submit, all checks hold" if failing == 0 else "no submit, checks failing"


def search_failure(env: Env, task: dict, done: bool, info: dict) -> str:
    if not done:
        return "no answer"
    answer = normalize_answer(info["answer"])
    if len(task["hops"]) > 1 and answer == normalize_answer(task["hops"][1]):
        return "answered the bridge entity"
    if answer == normalize_answer(task["hops"][0]):
        return "answered the question's entity"
    return "answered another fact"


#: environment -> (final env, task, ended by the environment, last info) -> failure type of an unsuccessful rollout
FAILURE_TYPES: dict[str, Callable[[Env, dict, bool, dict], str]] = {
    "shop": shop_failure,
    "terminal": terminal_failure,
    "search": search_failure,
}


def play(env_cls: type[Env], task: dict, p: float, rng: random.Random) -> dict:
    """One rollout of the expert corrupted with probability `p` per turn (a kind drawn uniformly from `KINDS`), cut
    at the environment's `max_turns`. Returns its first observation, transcript, corruption kinds per turn, success,
    the environment's final reward and its type ("success" or a `FAILURE_TYPES` label)."""
    env = env_cls(task["difficulty"])
    first = env.reset(task)
    transcript: list[dict] = []
    kinds: list[str | None] = []
    done, reward, info = False, 0.0, {}
    for _ in range(env.max_turns):
        kind = rng.choice(KINDS) if rng.random() < p else None
        action = env.expert_action() if kind is None else corrupt(kind, env, task, transcript, rng)
        observation, reward, done, info = env.step(action)
        transcript.append({"action": action, "observation": observation})
        kinds.append(kind)
        if done:
            break
    success = bool(done and info.get("success"))
    kind = "success" if success else FAILURE_TYPES[env.name](env, task, done, info)
    return {
        "first": first,
        "transcript": transcript,
        "kinds": kinds,
        "success": success,
        "env_reward": float(reward) if done else 0.0,
        "type": kind,
    }


# ---------------------------------------------------------------------------------------------------------------------
# 2. Pure statistics


def pairwise_auc(rewards: Sequence[Sequence[float]], success: Sequence[Sequence[bool]]) -> tuple[float, float, int]:
    """Within-group AUC of the reward for success: over every (success, failure) pair of one group, the share where
    the success has the higher reward, ties counting 1/2. Returns (AUC, the share with ties counting 0, pairs); NaN
    when no group has both.

    >>> pairwise_auc([[1.0, 0.5, 0.5], [0.2, 0.9]], [[True, False, False], [True, False]])  # wins 2 of 3 pairs
    (0.6666666666666666, 0.6666666666666666, 3)
    """
    wins = ties = pairs = 0
    for r, s in zip(rewards, success, strict=True):
        for i in (i for i in range(len(r)) if s[i]):
            for j in (j for j in range(len(r)) if not s[j]):
                pairs += 1
                wins += r[i] > r[j]
                ties += r[i] == r[j]
    if not pairs:
        return math.nan, math.nan, 0
    return (wins + 0.5 * ties) / pairs, wins / pairs, pairs


def weighted_rubric_reward(verdicts: Sequence[int], criteria: Sequence[int], weights: Sequence[float]) -> float:
    """Eq. 2 with criterion weights: (Σ w·[v = +1] − Σ w·[v = −1]) / Σ w·[v ≠ 0] over `criteria` (indices into
    `verdicts` and `weights`); 0 when nothing with a positive weight applies. All weights 1 is draco.md Eq. 2.

    >>> weighted_rubric_reward([1, 1, -1, 0], [0, 1, 2, 3], [1, 1, 3, 1])  # (1 + 1 - 3) / (1 + 1 + 3)
    -0.2
    """
    num = sum(weights[c] * verdicts[c] for c in criteria)
    den = sum(weights[c] * abs(verdicts[c]) for c in criteria)
    return num / den if den > 0 else 0.0


def positive_push_on_success(advantages: Sequence[float], success: Sequence[bool]) -> float:
    """The share of the positive advantage mass Σ max(A, 0) that lands on successful rollouts (NaN when no advantage
    is positive). A binary success reward gives 1; what a reward gives to failures is 1 minus this.

    >>> positive_push_on_success([1.5, 0.5, -1.0, -1.0], [True, False, False, False])
    0.75
    """
    total = sum(a for a in advantages if a > 0)
    return sum(a for a, s in zip(advantages, success, strict=True) if a > 0 and s) / total if total > 0 else math.nan


# ---------------------------------------------------------------------------------------------------------------------
# 3. Reward variants from one group's judge verdicts


class CapturingPipeline(RubricPipeline):
    """The real `RubricPipeline`; keeps the latest `GroupResult`s so that variants can reuse the judge's verdicts."""

    def score_groups(self, groups: Sequence[GroupInput]) -> list[GroupResult]:
        self.results = super().score_groups(groups)
        return self.results


def s1_flags(res: GroupResult) -> list[bool]:
    """Per merged criterion: from the task rubric (S1, task-level) rather than a trajectory rubric (S2)."""
    s1 = {normalize_title(c.title) for c in res.task_criteria}
    return [normalize_title(c.title) in s1 for c in res.merged]


def weighted(s1_weight: float, s2_weight: float) -> Callable[[GroupResult, list[dict], dict], list[float]]:
    """Eq. 2 over the surviving criteria with weight `s1_weight` on task-level (S1) criteria and `s2_weight` on
    trajectory (S2) ones (`weighted_rubric_reward`)."""

    def reward(res: GroupResult, rollouts: list[dict], task: dict) -> list[float]:
        w = [s1_weight if f else s2_weight for f in s1_flags(res)]
        return [weighted_rubric_reward(v, res.surviving, w) for v in res.verdicts]

    return reward


def s1_failed(res: GroupResult) -> list[bool]:
    """Per rollout: it fails some surviving task-level (S1) criterion."""
    flags = s1_flags(res)
    return [any(v[c] == -1 and flags[c] for c in res.surviving) for v in res.verdicts]


def tiered(res: GroupResult, rollouts: list[dict], task: dict) -> list[float]:
    """Eq. 2 minus 2 for a rollout that fails a task-level (S1) criterion: any rollout passing every S1 criterion
    ranks above every rollout failing one; the order within each tier is Eq. 2's."""
    return [r - 2.0 * f for r, f in zip(res.rewards, s1_failed(res), strict=True)]


def gate(res: GroupResult, rollouts: list[dict], task: dict) -> list[float]:
    """+1 when no task-level (S1) criterion fails, else −1: the judge's pass/fail verdict on the task rubric."""
    return [-1.0 if f else 1.0 for f in s1_failed(res)]


def static(res: GroupResult, rollouts: list[dict], task: dict) -> list[float]:
    """Eq. 2 over every check the oracle knows for the environment (S1 and process), without the union's filter or
    Eq. 1's dropout: a static rubric."""
    out = []
    for r in rollouts:
        v = [c.verdict for c in CHECKS[task["env"]](task, [t["action"] for t in r["transcript"]])]
        out.append(weighted_rubric_reward(v, range(len(v)), [1.0] * len(v)))
    return out


def essential_gate(res: GroupResult, rollouts: list[dict], task: dict) -> list[float]:
    """draco.md D19 from the group's verdicts: −1 on a failed surviving essential criterion, else Eq. 2."""
    essential = [c.essential for c in res.merged]
    return [gated_rubric_reward(v, res.surviving, essential) for v in res.verdicts]


def plain_eq2(res: GroupResult, rollouts: list[dict], task: dict) -> list[float]:
    """The paper's Eq. 2 from the group's verdicts (what a run without D19's gate pays)."""
    return [rubric_reward(v, res.surviving) for v in res.verdicts]


def main_name(gate: bool) -> str:
    """The key of DracoReward's own output: with or without draco.md D19's essential gate."""
    return "DRACO + essential gate (D19)" if gate else "DRACO (Eq. 2)"


def variants(gate: bool = False) -> dict[str, Callable[[GroupResult, list[dict], dict], list[float]]]:
    """variant -> (group result, its rollouts, task) -> rewards. The first is DracoReward's own output
    (`main_name(gate)`), the second the other side of D19 computed from the same verdicts."""
    other = {"Eq. 2, no gate": plain_eq2} if gate else {"essential gate (D19)": essential_gate}
    return {main_name(gate): lambda res, rollouts, task: list(res.rewards), **other, **OTHER_VARIANTS}


OTHER_VARIANTS: dict[str, Callable[[GroupResult, list[dict], dict], list[float]]] = {
    "S1 weight 3": weighted(3.0, 1.0),
    "S1 only (S2 weight 0)": weighted(1.0, 0.0),
    "static rubric, no dropout": static,
    "S1 tier (Eq. 2 - 2 on an S1 fail)": tiered,
    "S1 gate (+1 / -1)": gate,
    "reference: env reward": lambda res, rollouts, task: [r["env_reward"] for r in rollouts],
    "reference: success": lambda res, rollouts, task: [float(r["success"]) for r in rollouts],
}
VARIANTS = variants(False)  # a run without the gate (the default)


# ---------------------------------------------------------------------------------------------------------------------
# 4. One setting: rewards, advantages, credit


def score(
    rollouts: list[list[dict]], tasks: list[dict], G: int, gate: bool = False
) -> tuple[DracoReward, CapturingPipeline, list]:
    """DracoReward on every task's rollouts, G at a time, as DRACOTrainer calls it (one call, rows task-major); `gate`:
    draco.md D19's essential gate."""
    pipeline = CapturingPipeline(OracleJudge(tasks), essential_gate=gate)
    reward = DracoReward(pipeline, group_size=G)
    rows = [(t, r) for t, rs in zip(tasks, rollouts, strict=True) for r in rs]
    rewards = reward(
        [r["first"] for _, r in rows],
        [""] * len(rows),
        transcript=[r["transcript"] for _, r in rows],
        task_id=[t["task_id"] for t, _ in rows],
    )
    return reward, pipeline, rewards


def agreement(groups: list[dict], key: str) -> dict:
    """AUC, strict share, means, success-beats-all share and push on success for the rewards under `key`."""
    r = [g["rewards"][key] for g in groups]
    s = [[x["success"] for x in g["rollouts"]] for g in groups]
    auc, strict, pairs = pairwise_auc(r, s)
    flat = [(x, ok) for rg, sg in zip(r, s, strict=True) for x, ok in zip(rg, sg, strict=True)]
    mixed = [(rg, sg) for rg, sg in zip(r, s, strict=True) if any(sg) and not all(sg)]
    beats = [
        min(x for x, ok in zip(rg, sg, strict=True) if ok) > max(x for x, ok in zip(rg, sg, strict=True) if not ok)
        for rg, sg in mixed
    ]
    adv = [a for g in groups for a in g["adv"][key]]
    succ = [x for sg in s for x in sg]

    def mean(xs: list[float]) -> float:
        return sum(xs) / len(xs) if xs else math.nan

    return {
        "auc": auc,
        "strict_win": strict,
        "pairs": pairs,
        "reward_success": mean([x for x, ok in flat if ok]),
        "reward_failure": mean([x for x, ok in flat if not ok]),
        "mixed_groups": len(mixed),
        "success_beats_all_failures": mean([float(b) for b in beats]),
        "push_on_success": positive_push_on_success(adv, succ),
    }


def type_stats(groups: list[dict], key: str) -> dict[str, dict]:
    """Per rollout type: count, mean and max reward, best-in-group rate (the group's top reward with A > 0), A > 0
    rate, the same in mixed groups (a success and a failure) and in groups without a success, and mean A."""
    acc: dict[str, dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for g in groups:
        r, a = g["rewards"][key], g["adv"][key]
        top, has_success = max(r), any(x["success"] for x in g["rollouts"])
        mixed = has_success and not all(x["success"] for x in g["rollouts"])
        for x, ri, ai in zip(g["rollouts"], r, a, strict=True):
            d = acc[x["type"]]
            d["r"].append(ri)
            d["a"].append(ai)
            d["best"].append(float(ri == top and ai > 0))
            d["pos"].append(float(ai > 0))
            if mixed:
                d["pos_mixed"].append(float(ai > 0))
            if not has_success:
                d["pos_no_success"].append(float(ai > 0))
    out = {}
    for kind, d in acc.items():
        out[kind] = {
            "count": len(d["r"]),
            "reward_mean": sum(d["r"]) / len(d["r"]),
            "reward_max": max(d["r"]),
            "best_in_group": sum(d["best"]) / len(d["best"]),
            "adv_positive": sum(d["pos"]) / len(d["pos"]),
            "adv_positive_mixed_group": sum(d["pos_mixed"]) / len(d["pos_mixed"]) if d["pos_mixed"] else math.nan,
            "in_mixed_groups": len(d["pos_mixed"]),
            "adv_positive_no_success_group": (
                sum(d["pos_no_success"]) / len(d["pos_no_success"]) if d["pos_no_success"] else math.nan
            ),
            "in_no_success_groups": len(d["pos_no_success"]),
            "adv_mean": sum(d["a"]) / len(d["a"]),
        }
    return out


def step_shares(w: Tensor, turn_valid: Tensor) -> tuple[Tensor, Tensor]:
    """ρ_j = w_j / Σ_k w_k, the share of a row's push on step j (draco.md P5); a row whose weights sum to 0 takes the
    GRPO broadcast (Eq. 9), counted here as equal steps, ρ_j = 1/M. Returns ρ (B, K) and the fallback rows (B,).

    >>> rho, fb = step_shares(torch.tensor([[1.0, 3.0, 0.0], [0.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 1, 1]]))
    >>> rho.tolist(), fb.tolist()
    ([[0.25, 0.75, 0.0], [0.3333333333333333, 0.3333333333333333, 0.3333333333333333]], [False, True])
    """
    valid = turn_valid.bool()  # (B, K)
    w = torch.where(valid, w.to(torch.float64), 0.0)  # (B, K)
    total = w.sum(dim=1, keepdim=True)  # (B, 1)
    fallback = total.squeeze(1) <= 0  # (B,)
    uniform = valid.to(torch.float64) / valid.sum(dim=1, keepdim=True).clamp(min=1)  # (B, K)
    return torch.where(fallback.unsqueeze(1), uniform, w / total.clamp(min=1e-300)), fallback


def credit_shares(reward: DracoReward, pipeline: RubricPipeline, adv: Tensor, rollouts: list[dict]) -> dict:
    """The credit stage on every row with A ≠ 0, as DRACOTrainer.compute_advantages calls it, then DRACO's step
    weights (Eq. 4-6), and per rollout type:

    * the mean share ρ of the push on the last step for winners (A > 0) and losers (A < 0) over the rows that do not
      fall back (Eq. 9), against the uniform 1/M, and the fallback rates;
    * the net push on the last step per rollout, mean of A·ρ_last over every rollout of the type (the last step's
      weight in the loss under `loss_type: grpo`), with DRACO's weights, with draco.md D18's strict quality, and with
      no credit (the GRPO broadcast, counted as equal steps: A/M). Negative means the last action is discouraged.
    """
    records = reward.last
    todo = [b for b, r in enumerate(records) if adv[b] != 0 and r.verdicts is not None]
    items = [(r.task, r.transcript, r.criteria, r.verdicts, r.evidence) for r in (records[b] for b in todo)]
    results = pipeline.credit_many(items)
    B, K = len(records), max(len(r["transcript"]) for r in rollouts)
    C = max((len(r.criteria) for r in records), default=0)
    verdicts = torch.zeros(B, C, dtype=torch.long)  # (B, C); rows without a credit result stay 0 (fallback)
    steps: list[list[list[int]]] = [[] for _ in range(B)]
    for b, res in zip(todo, results, strict=True):
        if res is not None:
            verdicts[b, : len(res.verdicts)] = torch.tensor(res.verdicts, dtype=torch.long)
            steps[b] = res.steps
    turn_valid = torch.zeros(B, K, dtype=torch.bool)  # (B, K)
    for b, r in enumerate(rollouts):
        turn_valid[b, : len(r["transcript"])] = True
    citations = draco_citations(steps, K, C)  # (B, C, K)
    w, cited = draco_step_weights(verdicts, citations, adv, turn_valid)  # (B, K), (B,) Eq. 4-6
    rho, fallback = step_shares(w, turn_valid)  # (B, K), (B,)
    fallback |= ~cited  # Eq. 9 "no_citation" (a loser's weights are then all 1: the same equal shares)
    rho_strict, _ = step_shares(draco_step_weights(verdicts, citations, adv, turn_valid, strict=True)[0], turn_valid)
    acc: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for b, r in enumerate(rollouts):
        d, M, a = acc[r["type"]], len(r["transcript"]), float(adv[b])
        d["push_last_draco"].append(a * float(rho[b, M - 1]))
        d["push_last_strict"].append(a * float(rho_strict[b, M - 1]))
        d["push_last_no_credit"].append(a / M)
        if a == 0:
            continue
        side = "winner" if a > 0 else "loser"
        d[f"{side}_fallback"].append(float(fallback[b]))
        if not fallback[b]:
            d[f"{side}_last_share"].append(float(rho[b, M - 1]))
            d[f"{side}_last_share_strict"].append(float(rho_strict[b, M - 1]))
            d[f"{side}_uniform"].append(1.0 / M)
    return {
        kind: {k: sum(v) / len(v) for k, v in d.items()} | {f"n_{k}": len(v) for k, v in d.items()}
        for kind, d in acc.items()
    }


def run_setting(env_name: str, level: int, p: float, args: argparse.Namespace) -> dict:
    """All measurements of one (environment, level, p)."""
    env_cls = ENVIRONMENTS[env_name]
    tasks = env_cls.make_tasks("train", args.tasks, seed=args.seed, difficulty=level)
    rng = random.Random(f"draco_reward|{env_name}|{level}|{p}|{args.seed}")
    rollouts = [[play(env_cls, t, p, rng) for _ in range(args.rollouts)] for t in tasks]
    flat = [r for rs in rollouts for r in rs]
    out: dict = {"success_rate": sum(r["success"] for r in flat) / len(flat), "rollouts": len(flat)}
    out["corruptions_per_rollout"] = sum(k is not None for r in flat for k in r["kinds"]) / len(flat)
    out["turns_mean"] = sum(len(r["transcript"]) for r in flat) / len(flat)
    out["types"] = {k: sum(r["type"] == k for r in flat) for k in sorted({r["type"] for r in flat})}
    out["group_sizes"] = {}
    own, table = main_name(args.essential_gate), variants(args.essential_gate)
    for G in args.group_sizes:
        reward, pipeline, rewards = score(rollouts, tasks, G, args.essential_gate)
        groups = []
        for res, s in zip(pipeline.results, range(0, len(flat), G), strict=True):
            members = flat[s : s + G]
            task = tasks[s // args.rollouts]
            keys = table if G == args.main_group else [own]
            groups.append({"rollouts": members, "rewards": {k: table[k](res, members, task) for k in keys}})
        if [x for g in groups for x in g["rewards"][own]] != rewards:
            raise RuntimeError("the captured group results disagree with DracoReward's rewards")
        for key in groups[0]["rewards"]:
            adv = group_advantages([x for g in groups for x in g["rewards"][key]], G)  # (B,) Eq. 3
            for i, g in enumerate(groups):
                g.setdefault("adv", {})[key] = adv[i * G : (i + 1) * G].tolist()
        stats = {
            "groups": len(groups),
            "groups_with_success": sum(any(x["success"] for x in g["rollouts"]) for g in groups),
        }
        stats["zero_std_groups"] = sum(len(set(g["rewards"][own])) == 1 for g in groups)
        stats["variants"] = {k: agreement(groups, k) | {"types": type_stats(groups, k)} for k in groups[0]["rewards"]}
        if G == args.main_group:
            adv = torch.tensor([a for g in groups for a in g["adv"][own]], dtype=torch.float64)  # (B,)
            stats["credit"] = credit_shares(reward, pipeline, adv, flat)
            stats["static_order_agreement"] = order_agreement(groups, own)
        out["group_sizes"][str(G)] = stats
    return out


def order_agreement(groups: list[dict], key: str = "DRACO (Eq. 2)") -> float:
    """Share of within-group rollout pairs that DRACO's reward (`key`) and the static rubric order the same way (ties
    included): with ±1 oracle verdicts Eq. 2 is increasing in the number of passed checks within a group, so 1; D19's
    gate ties the rollouts that fail an essential criterion, so less."""
    same = total = 0
    for g in groups:
        a, b = g["rewards"][key], g["rewards"]["static rubric, no dropout"]
        for i in range(len(a)):
            for j in range(i + 1, len(a)):
                total += 1
                same += (a[i] > a[j]) - (a[i] < a[j]) == (b[i] > b[j]) - (b[i] < b[j])
    return same / total if total else math.nan


# ---------------------------------------------------------------------------------------------------------------------
# 5. Report


def fmt(x: float | None, digits: int = 2) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def report(results: dict, args: argparse.Namespace) -> str:
    main, key = str(args.main_group), main_name(args.essential_gate)
    eq2 = "Eq. 2, no gate" if args.essential_gate else key  # "top failure type": the one the paper's Eq. 2 pays most

    def top_failure(v: dict) -> str | None:
        fails = {k: t for k, t in v[eq2]["types"].items() if k != "success" and t["count"] >= MIN_COUNT}
        return max(fails, key=lambda k: fails[k]["reward_mean"]) if fails else None

    lines = [
        f"DRACO's outcome-blind reward (oracle judge) against success, on corrupted-expert rollouts: {args.tasks} "
        f"tasks x {args.rollouts} rollouts per (environment, level, p), groups of G = {main} unless stated, seed "
        f"{args.seed}. AUC: within-group pairwise AUC of the reward for success (ties 1/2); strict: ties count 0; "
        "beats all: mixed groups where every success out-rewards every failure; push on success: share of the "
        "positive advantage mass on successes (1 for a binary success reward). Type tables leave out types with fewer "
        f"than {MIN_COUNT} rollouts in a setting (result.json has them all).\n",
        f"### {key}: DracoReward's own reward per setting\n",
        "| env | level | p | success | AUC | strict | R success | R failure | beats all | push on success | "
        "top failure type under Eq. 2 (mean R) | its best-in-group | its A > 0 | its A > 0, mixed groups "
        "| its A > 0, no-success groups |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (env, level, p), res in results.items():
        st = res["group_sizes"][main]["variants"][key]
        top = top_failure(res["group_sizes"][main]["variants"])
        t = st["types"].get(top, {})
        lines.append(
            f"| {env} | {level} | {p} | {fmt(res['success_rate'])} | {fmt(st['auc'])} | {fmt(st['strict_win'])} | "
            f"{fmt(st['reward_success'])} | {fmt(st['reward_failure'])} | {fmt(st['success_beats_all_failures'])} | "
            f"{fmt(st['push_on_success'])} | {top} ({fmt(t.get('reward_mean'))}) | {fmt(t.get('best_in_group'))} | "
            f"{fmt(t.get('adv_positive'))} | {fmt(t.get('adv_positive_mixed_group'))} | "
            f"{fmt(t.get('adv_positive_no_success_group'))} |"
        )
    lines += [
        f"\n### Failure types under {key}, per setting\n",
        "| env | level | p | type | count | mean R | max R | best in group | A > 0 | A > 0, mixed groups "
        "| A > 0, no-success groups | mean A |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for (env, level, p), res in results.items():
        types = res["group_sizes"][main]["variants"][key]["types"]
        for kind, t in sorted(types.items(), key=lambda kv: -kv[1]["reward_mean"]):
            if t["count"] < MIN_COUNT:
                continue
            lines.append(
                f"| {env} | {level} | {p} | {kind} | {t['count']} | {fmt(t['reward_mean'])} | {fmt(t['reward_max'])} "
                f"| {fmt(t['best_in_group'])} | {fmt(t['adv_positive'])} | {fmt(t['adv_positive_mixed_group'])} | "
                f"{fmt(t['adv_positive_no_success_group'])} | {fmt(t['adv_mean'])} |"
            )
    names = list(variants(args.essential_gate))
    lines += [
        "\n### Variants (same rollouts and judge verdicts): AUC / beats all / push on success\n",
        "| env | level | p | " + " | ".join(names) + " |",
        "|---|---|---|" + "---|" * len(names),
    ]
    for (env, level, p), res in results.items():
        v = res["group_sizes"][main]["variants"]
        cells = [
            f"{fmt(v[k]['auc'])} / {fmt(v[k]['success_beats_all_failures'])} / {fmt(v[k]['push_on_success'])}"
            for k in names
        ]
        lines.append(f"| {env} | {level} | {p} | " + " | ".join(cells) + " |")
    lines += [
        "\n### Top failure type per variant: its A > 0 rate in groups without a success\n",
        "| env | level | p | type | " + " | ".join(names[:-1]) + " |",
        "|---|---|---|---|" + "---|" * (len(names) - 1),
    ]
    for (env, level, p), res in results.items():
        v = res["group_sizes"][main]["variants"]
        top = top_failure(v)
        if top is None:
            continue
        cells = [fmt(v[k]["types"][top]["adv_positive_no_success_group"]) for k in names[:-1]]
        lines.append(f"| {env} | {level} | {p} | {top} | " + " | ".join(cells) + " |")
    sizes = [str(G) for G in args.group_sizes]
    lines += [
        "\n### Group size G (the pipeline rerun per G on the same rollouts): AUC / push on success / groups with a "
        "success / zero-std groups\n",
        "| env | level | p | " + " | ".join(f"G = {G}" for G in sizes) + " |",
        "|---|---|---|" + "---|" * len(sizes),
    ]
    for (env, level, p), res in results.items():
        cells = []
        for G in sizes:
            st = res["group_sizes"][G]
            d = st["variants"][key]
            cells.append(
                f"{fmt(d['auc'])} / {fmt(d['push_on_success'])} / {st['groups_with_success']}/{st['groups']}"
                f" / {st['zero_std_groups']}"
            )
        lines.append(f"| {env} | {level} | {p} | " + " | ".join(cells) + " |")
    lines += [
        f"\n### Step credit (G = {main}): share ρ of a rollout's push on its last step (buy / submit / answer) with "
        "DRACO's weights (Eq. 4-6) / the strict Eq. 4 (a step any FAIL cites has Q = 0), against 1/M, over winners "
        "(A > 0) and losers (A < 0) not in the Eq. 9 fallback; net push: mean A·ρ_last over all rollouts of the type "
        "(DRACO / strict / no credit A/M)\n",
        "| env | level | p | type | winners: ρ_last DRACO / strict (1/M) | winners n (fallback) "
        "| losers: ρ_last DRACO / strict (1/M) | losers n (fallback) | net push on last step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (env, level, p), res in results.items():
        types = res["group_sizes"][main]["variants"][key]["types"]
        for kind, c in sorted(res["group_sizes"][main]["credit"].items()):
            if types[kind]["count"] < MIN_COUNT:
                continue
            side = {}
            for s in ("winner", "loser"):
                side[s] = (
                    f"{fmt(c.get(f'{s}_last_share'))} / {fmt(c.get(f'{s}_last_share_strict'))} "
                    f"({fmt(c.get(f'{s}_uniform'))}) | {c.get(f'n_{s}_fallback', 0)} ({fmt(c.get(f'{s}_fallback'))})"
                )
            push = " / ".join(fmt(c[f"push_last_{k}"], 3) for k in ("draco", "strict", "no_credit"))
            lines.append(f"| {env} | {level} | {p} | {kind} | {side['winner']} | {side['loser']} | {push} |")
    agree = [res["group_sizes"][main]["static_order_agreement"] for res in results.values()]
    lines.append(
        f"\nWithin-group order of DRACO's reward equals the static rubric's in {fmt(min(agree), 4)} (minimum "
        "over settings) of rollout pairs."
    )
    return "\n".join(lines)


def rounded(x: object, digits: int = 4) -> object:
    """`x` with every float rounded to `digits` and NaN as None (strict JSON, a smaller result.json).

    >>> rounded({"a": [0.123456, float("nan")], "b": 2})
    {'a': [0.1235, None], 'b': 2}
    """
    if isinstance(x, float):
        return None if math.isnan(x) else round(x, digits)
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [rounded(v, digits) for v in x]
    return x


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", nargs="+", default=["shop", "search", "terminal"], choices=sorted(ENVIRONMENTS))
    parser.add_argument(  # level 3 was numbered 1 before the long-horizon levels 1 and 2 came (same tasks)
        "--levels", nargs="+", type=int, default=[0, 3]
    )
    parser.add_argument("--noise", nargs="+", type=float, default=[0.3, 0.5, 0.7], help="corruption p per turn")
    parser.add_argument("--tasks", type=int, default=100)
    parser.add_argument("--rollouts", type=int, default=12, help="rollouts per task; every G must divide it")
    parser.add_argument("--group-sizes", nargs="+", type=int, default=[2, 3, 4, 6, 12])
    parser.add_argument("--main-group", type=int, default=6, help="G of the variant, type and credit tables")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--essential-gate", action="store_true", help="DracoReward with draco.md D19's essential gate (R = -1)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "draco_reward", help="folder for result.json and .md")
    args = parser.parse_args(argv)
    if args.main_group not in args.group_sizes or any(args.rollouts % G for G in args.group_sizes):
        parser.error(f"--main-group must be one of --group-sizes, each dividing --rollouts {args.rollouts}")
    results: dict = {}
    start = time.perf_counter()
    for env in args.envs:
        for level in args.levels:
            for p in args.noise:
                t0 = time.perf_counter()
                results[(env, level, p)] = res = run_setting(env, level, p, args)
                st = res["group_sizes"][str(args.main_group)]["variants"][main_name(args.essential_gate)]
                print(
                    f"{env} level {level} p {p}: success {res['success_rate']:.3f} AUC {fmt(st['auc'])} push on "
                    f"success {fmt(st['push_on_success'])} ({time.perf_counter() - t0:.1f} s)",
                    flush=True,
                )
    text = report(results, args)
    measured = {
        "settings": [{"env": e, "level": lv, "p": p, **r} for (e, lv, p), r in results.items()],
        "seconds": time.perf_counter() - start,
    }
    settings = vars(args) | {"out": str(args.out)}
    written = write_result(args.out, "draco_reward", settings, rounded(measured), text)
    print(f"wrote {' and '.join(map(str, written))}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
