"""Collapse alarm: warn once, with the numbers, when a run drifts towards degenerate episodes.

`CollapseAlarm` is fed one generation batch's statistics at a time (numbers in, `Alarm`s out; it knows nothing about
trainers) and remembers only what it needs: per kind, whether the run has been healthy on that metric yet, the
current streak and the last `patience` values. `AgentGRPOTrainer` feeds it on the main process from the gathered
`env/*` metrics and logs each alarm once (`logger.warning`, plus `alarm/<kind>` = 1 in the metrics of that batch).

The kinds, each firing at most once per run, on the `patience`-th consecutive batch in its band, and only after an
earlier batch outside the band (a run that drifts there, not an environment where the band is normal):

1. `short_turns`: `env/tokens_per_turn` <= `short_turn_tokens` (2): turns of one or two tokens, i.e. the policy ends
   its turns at once and the episode runs out of turns without acting.
2. `capped_turns`: `env/tokens_per_turn` >= `cap_fraction` x `max_turn_tokens` (0.9 x 24 = 21.6 on tiny:shop): the
   policy stopped emitting the end-of-turn id, every turn runs to the cap.
3. `truncated`: `env/truncated` >= `truncated_frac` (0.95): (almost) every episode is cut by a budget. The bootstrapped
   fraction of a critic trainer is a subset of the truncated rows, so this covers it.
4. `success`: `env/success` <= `success_zero` (0.02, at most one success in 50 rollouts) after some batch reached
   `success_floor` (0.05): the policy collapsed.
5. `no_variance`: TRL's `frac_reward_zero_std` >= `zero_std_frac` (0.95) for `no_variance_patience` (5) batches: almost
   every group's rollouts got equal rewards, so the group advantage is 0 and GRPO-style updates learn nothing. Unlike
   the others it needs no earlier healthy batch: tasks too hard (every rollout fails) or too easy from the start are
   worth a warning too.

Defaults, replayed on the `log_history` of the stored runs under `bench/results/` (`replay`; one observation per
logged entry, a mean over 5 optimizer steps): `truncated` or `success` fire on every tiny:shop run that collapsed (the
six PPO runs of `shop_methods`, the three `draco_shop` runs and `quickstart@loss_type=dapo-s1` of `shop_draco`),
`short_turns` on PPO with a value head (seeds 0 and 1), `capped_turns` on dapo seed 1 and PPO seed 2, `no_variance`
on the six PPO runs and dapo seed 1 (not on the DRACO runs, whose rubric reward keeps varying); nothing fires on the
other runs (GRPO, MPO, the search and terminal runs). Live, one observation is one generation batch, so an
alarm fires after `patience` batches, sooner and on noisier numbers than in the replay.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

KINDS = ("short_turns", "capped_turns", "truncated", "success", "no_variance")


@dataclass(frozen=True)
class Alarm:
    """One fired alarm: `kind` (logged as `alarm/<kind>`), the `metric` it watched, its last `patience` `values`
    (oldest first) and a `message` saying what it usually means."""

    kind: str
    metric: str
    values: tuple[float, ...]
    message: str


class _Watch:
    """One kind's memory. It arms on a value outside the band (`inside`) for which `arms` holds (None: any), then fires
    on the `patience`-th value in a row inside the band; it fires once."""

    def __init__(
        self,
        inside: Callable[[float], bool],
        patience: int,
        arms: Callable[[float], bool] | None = None,
        armed: bool = False,
    ):
        self.inside, self.arms = inside, arms
        self.recent: deque[float] = deque(maxlen=patience)
        self.armed, self.fired = armed, False
        self.streak = 0
        self.peak = -math.inf  # largest value seen (the success message quotes it)

    def state_dict(self) -> dict:
        return {"recent": list(self.recent), "armed": self.armed, "fired": self.fired, "streak": self.streak,
                "peak": self.peak}  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.recent = deque(state["recent"], maxlen=self.recent.maxlen)
        self.armed, self.fired, self.streak, self.peak = state["armed"], state["fired"], state["streak"], state["peak"]

    def update(self, value: float | None) -> bool:
        if value is None or math.isnan(value) or self.fired:  # no information: the streak neither breaks nor grows
            return False
        self.recent.append(value)
        self.peak = max(self.peak, value)
        if not self.inside(value):
            self.armed = self.armed or self.arms is None or self.arms(value)
            self.streak = 0
            return False
        self.streak += self.armed
        self.fired = self.streak == self.recent.maxlen
        return self.fired


class CollapseAlarm:
    """Watches the turn length, truncated fraction and success of successive generation batches; see the module
    docstring for the kinds.

    Args:
        max_turn_tokens (`int`): the per-turn cap of new tokens (`AgentGRPOConfig.max_turn_tokens`).
        patience (`int`, *optional*, defaults to `3`): consecutive batches in the band before an alarm fires.
        short_turn_tokens (`float`, *optional*, defaults to `2.0`): mean tokens per turn at or below which turns count
            as empty.
        cap_fraction (`float`, *optional*, defaults to `0.9`): mean tokens per turn at or above this fraction of
            `max_turn_tokens` count as pinned at the cap.
        truncated_frac (`float`, *optional*, defaults to `0.95`): truncated fraction at or above which episodes count
            as all cut.
        success_floor (`float`, *optional*, defaults to `0.05`): success a batch must have reached before a fall to
            zero counts.
        success_zero (`float`, *optional*, defaults to `0.02`): success at or below which a batch counts as zero
            (at most one success in 50 rollouts).
        zero_std_frac (`float`, *optional*, defaults to `0.95`): fraction of zero-variance groups at or above which a
            batch counts as carrying no learning signal.
        no_variance_patience (`int`, *optional*, defaults to `5`): consecutive such batches before `no_variance` fires.
        ignore (`Sequence[str]`, *optional*, defaults to `()`): kinds never watched, for trainers whose `env/*`
            numbers mean something else (X-Tree's node RL: `env/success` is a node matched in full, and its depth
            curriculum lowers it by design).
    """

    def __init__(
        self,
        max_turn_tokens: int,
        patience: int = 3,
        short_turn_tokens: float = 2.0,
        cap_fraction: float = 0.9,
        truncated_frac: float = 0.95,
        success_floor: float = 0.05,
        success_zero: float = 0.02,
        zero_std_frac: float = 0.95,
        no_variance_patience: int = 5,
        ignore: Sequence[str] = (),
    ):
        if max_turn_tokens < 1:
            raise ValueError(f"max_turn_tokens must be >= 1, got {max_turn_tokens}")
        if patience < 1 or no_variance_patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience} (no_variance_patience {no_variance_patience})")
        if success_floor <= success_zero:
            raise ValueError(f"success_floor ({success_floor}) must be above success_zero ({success_zero})")
        unknown = sorted(set(ignore) - set(KINDS))
        if unknown:
            raise ValueError(f"unknown alarm kinds to ignore: {unknown}; the kinds are {list(KINDS)}")
        self.ignore = frozenset(ignore)
        self.max_turn_tokens = max_turn_tokens
        self.cap_tokens = cap_fraction * max_turn_tokens
        self.short_turn_tokens, self.truncated_frac, self.zero_std_frac = (
            short_turn_tokens,
            truncated_frac,
            zero_std_frac,
        )
        self.watches = {
            "short_turns": _Watch(lambda v: v <= short_turn_tokens, patience),
            "capped_turns": _Watch(lambda v: v >= self.cap_tokens, patience),
            "truncated": _Watch(lambda v: v >= truncated_frac, patience),
            "success": _Watch(lambda v: v <= success_zero, patience, arms=lambda v: v >= success_floor),
            "no_variance": _Watch(lambda v: v >= zero_std_frac, no_variance_patience, armed=True),
        }

    def state_dict(self) -> dict:
        """What the alarm remembers, per kind (JSON-ready; saved in checkpoints so a resumed run fires where the
        uninterrupted one would)."""
        return {kind: watch.state_dict() for kind, watch in self.watches.items()}

    def load_state_dict(self, state: dict) -> None:
        for kind, watch_state in state.items():
            if kind in self.watches:
                self.watches[kind].load_state_dict(watch_state)

    def update(
        self,
        tokens_per_turn: float | None,
        truncated: float | None,
        success: float | None,
        zero_std: float | None = None,
    ) -> list[Alarm]:
        """Feed one generation batch: mean model tokens per assistant turn, fraction of episodes cut by a budget,
        fraction judged successful, fraction of groups whose rewards are all equal (None or NaN: not measured).
        Returns the alarms that fire on this batch."""
        values = {
            "short_turns": tokens_per_turn,
            "capped_turns": tokens_per_turn,
            "truncated": truncated,
            "success": success,
            "no_variance": zero_std,
        }
        return [
            self._alarm(kind)
            for kind, value in values.items()
            if kind not in self.ignore and self.watches[kind].update(value)
        ]

    def _alarm(self, kind: str) -> Alarm:
        watch = self.watches[kind]
        shown = ", ".join(f"{v:.3g}" for v in watch.recent)
        last = f"over the last {len(watch.recent)} generation batches"
        metric, what = {
            "short_turns": (
                "env/tokens_per_turn",
                f"mean tokens per assistant turn {shown} {last} (<= {self.short_turn_tokens:g}): the policy ends its "
                "turns at once, so episodes run out of turns without acting. On tiny:shop this came with PPO "
                "bootstrapping budget-cut episodes (an unfinished episode earned V(s) > 0, a wrong answer 0); check "
                "bootstrap_truncated (conventions.md C4)",
            ),
            "capped_turns": (
                "env/tokens_per_turn",
                f"mean tokens per assistant turn {shown} {last}: turns run to the {self.max_turn_tokens}-token cap "
                "(max_turn_tokens), the policy stopped emitting the end-of-turn id. Under one token mean over the "
                "batch (TRL's loss_type 'dapo') long failed episodes dominate the loss and push that id down; "
                "consider loss_type: grpo (conventions.md C22). Under grpo the quickstart's late drift to the cap was "
                "held by a small KL term to the starting policy (beta: 0.02, grpo.md D13)",
            ),
            "truncated": (
                "env/truncated",
                f"fraction of episodes cut by the turn or token budget {shown} {last} (>= {self.truncated_frac:g}): "
                "the policy stopped finishing episodes. A critic that bootstraps cut episodes pays an unfinished "
                "episode V(s) > 0 against 0 for a wrong answer; check bootstrap_truncated (conventions.md C4) and the "
                "budgets (max_turns, max_completion_length)",
            ),
            "no_variance": (
                "frac_reward_zero_std",
                f"fraction of groups whose rollouts all got the same reward {shown} {last} (>= "
                f"{self.zero_std_frac:g}): the group advantage is 0 almost everywhere, so GRPO-style updates learn "
                "nothing. The tasks are too hard (every rollout fails: an easier difficulty, a warmer start, a "
                "denser reward) or already solved (every rollout succeeds)",
            ),
            "success": (
                "env/success",
                f"training success {shown} {last}, after reaching {watch.peak:.3g}: the policy collapsed. The other "
                "env/* metrics show which degenerate episodes it fell into; a lower learning rate, loss_type: grpo "
                "(conventions.md C22) or a small KL term to the starting policy (beta: 0.02, grpo.md D13) are the "
                "first things to try",
            ),
        }[kind]
        return Alarm(kind, metric, tuple(watch.recent), f"collapse alarm, {metric}: {what}.")


def replay(log_history: list[dict], max_turn_tokens: int, **settings) -> list[tuple[int, Alarm]]:
    """Feed a finished run's `log_history` (summary.json, trainer_state.json) to a fresh `CollapseAlarm`, one logged
    entry per observation; returns `(step, alarm)` pairs in the order they fire. Entries without `env/turns` (the
    run's closing summary) are skipped. Logs written before `env/tokens_per_turn` existed use
    `completions/mean_length / env/turns` in its place: TRL's mean length counts model tokens only (its `tool_mask`),
    so the ratio is total model tokens over total turns, up to the averaging over the logged steps."""
    alarm, fired = CollapseAlarm(max_turn_tokens, **settings), []
    for entry in log_history:
        if "env/turns" not in entry:
            continue
        tokens_per_turn = entry.get("env/tokens_per_turn")
        if tokens_per_turn is None and "completions/mean_length" in entry:
            tokens_per_turn = entry["completions/mean_length"] / entry["env/turns"]
        zero_std = entry.get("frac_reward_zero_std")
        new = alarm.update(tokens_per_turn, entry.get("env/truncated"), entry.get("env/success"), zero_std)
        fired += [(entry["step"], a) for a in new]
    return fired
