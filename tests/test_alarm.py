"""The collapse alarm (trainers/alarm.py): the detector on literal sequences, a replay of stored runs, and the
trainer's `env/tokens_per_turn` metric and alarm wiring."""

import json
import logging
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv, RecordingTrainer
from datasets import Dataset

from trainers.alarm import KINDS, CollapseAlarm, replay
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def feed(alarm: CollapseAlarm, tokens=None, truncated=None, success=None) -> list[tuple[int, str]]:
    """Feed equal-length sequences (None: not measured); returns (batch index, kind) of every alarm fired."""
    n = max(len(s) for s in (tokens, truncated, success) if s is not None)
    tokens, truncated, success = (s if s is not None else [None] * n for s in (tokens, truncated, success))
    return [(i, a.kind) for i in range(n) for a in alarm.update(tokens[i], truncated[i], success[i])]


def test_short_turns_fire_once_on_the_patience_th_batch():
    # patience 3, band <= 2: batch 0 (5.0) arms; 2.0, 1.5, 1.0 at batches 2-4 are 3 in a row -> fires at 4, once
    fired = feed(CollapseAlarm(max_turn_tokens=24), tokens=[5.0, 4.0, 2.0, 1.5, 1.0, 1.0, 1.0])
    assert fired == [(4, "short_turns")]


def test_capped_turns_streak_breaks_and_restarts():
    # cap 24 x 0.9 = 21.6: 22, 23 (streak 2), 21 breaks it, then 22, 22.5, 23.9 -> 3 in a row at batch 6
    alarm = CollapseAlarm(max_turn_tokens=24)
    fired = feed(alarm, tokens=[6.0, 22.0, 23.0, 21.0, 22.0, 22.5, 23.9, 24.0, 24.0])
    assert fired == [(6, "capped_turns")]
    a = CollapseAlarm(max_turn_tokens=24)
    for v in [6.0, 22.0, 22.5]:
        a.update(v, None, None)
    (last,) = a.update(23.9, None, None)
    assert last.metric == "env/tokens_per_turn" and last.values == (22.0, 22.5, 23.9)
    assert "24-token cap" in last.message and "23.9" in last.message and "loss_type: grpo" in last.message
    assert "beta: 0.02" in last.message  # the KL term that held the quickstart (grpo.md D13)


def test_truncated_needs_a_lower_batch_first():
    # 0.96-0.98 from the start never arm (an environment where every episode is cut); 0.8 arms; then 0.95 (>= 0.95),
    # 0.99, 1.0 -> fires at batch 6
    fired = feed(CollapseAlarm(max_turn_tokens=24), truncated=[0.96, 0.97, 0.98, 0.8, 0.95, 0.99, 1.0, 1.0])
    assert fired == [(6, "truncated")]


def test_success_falls_to_zero_after_the_floor():
    alarm = CollapseAlarm(max_turn_tokens=24)
    # 0.03 < floor 0.05: zeros after it do not count (a run that never learned is not a collapse)
    assert feed(alarm, success=[0.03, 0.0, 0.0, 0.0]) == []
    # 0.1 reaches the floor; 0.0, 0.01, 0.02 are all <= 0.02 -> fires at batch 3 of this feed; later zeros: no repeat
    assert feed(alarm, success=[0.1, 0.0, 0.01, 0.02, 0.0, 0.0]) == [(3, "success")]


def test_an_ignored_kind_never_fires_and_the_others_still_do():
    # the success drop of the test above, with "success" ignored (X-Tree node RL): nothing; the turn cap still fires
    alarm = CollapseAlarm(max_turn_tokens=24, ignore=("success",))
    assert feed(alarm, success=[0.1, 0.0, 0.01, 0.02, 0.0, 0.0]) == []
    assert feed(alarm, tokens=[6.0, 22.0, 23.0, 24.0]) == [(3, "capped_turns")]
    with pytest.raises(ValueError, match="unknown alarm kinds to ignore: \\['sucess'\\]"):
        CollapseAlarm(max_turn_tokens=24, ignore=("sucess",))


def test_success_above_zero_breaks_the_streak_and_nan_is_no_information():
    # 0.1 arms; 0.0, 0.0 (streak 2); 0.03 > 0.02 breaks; NaN skipped; 0.0, 0.0, NaN, 0.0 -> third zero at batch 7
    nan = math.nan
    fired = feed(CollapseAlarm(max_turn_tokens=24), success=[0.1, 0.0, 0.0, 0.03, nan, 0.0, 0.0, nan, 0.0])
    assert fired == [(8, "success")]


def test_patience_is_respected():
    drop = [0.8] + [1.0] * 4  # one lower batch, then 4 at 1.0
    assert feed(CollapseAlarm(max_turn_tokens=24, patience=5), truncated=drop) == []
    assert feed(CollapseAlarm(max_turn_tokens=24, patience=5), truncated=drop + [1.0]) == [(5, "truncated")]
    assert feed(CollapseAlarm(max_turn_tokens=24, patience=1), truncated=drop) == [(1, "truncated")]


def test_no_variance_needs_no_healthy_batch_first_and_its_streak_breaks():
    alarm = CollapseAlarm(max_turn_tokens=24)
    zero_std = [1.0, 1.0, 0.96, 0.5, 1.0, 1.0, 1.0, 0.95, 1.0, 1.0]  # a streak of 3, broken; then 5 from index 4
    fired = [i for i, z in enumerate(zero_std) if alarm.update(6.0, 0.5, 0.0, z)]
    assert fired == [8] and [a.kind for a in alarm.update(6.0, 0.5, 0.0, 1.0)] == []  # once per run
    assert "frac_reward_zero_std" in alarm._alarm("no_variance").message


def test_healthy_run_fires_nothing():
    # GRPO on tiny:shop: turns of 5-9 tokens, truncated 0.8 -> 0.3, success 0.1 -> 0.6, with noise
    tokens = [5.1, 5.6, 6.3, 7.9, 9.1, 8.2, 6.8, 6.4, 6.2, 6.5]
    truncated = [0.80, 0.78, 0.70, 0.62, 0.55, 0.48, 0.50, 0.41, 0.33, 0.30]
    success = [0.10, 0.16, 0.22, 0.30, 0.41, 0.38, 0.47, 0.52, 0.60, 0.61]
    assert feed(CollapseAlarm(max_turn_tokens=24), tokens, truncated, success) == []


def test_each_kind_fires_at_most_once_and_all_can_fire_together():
    # one healthy batch, then everything degenerate at once: every kind but short_turns (tokens at the cap) fires at
    # batch 3; the next collapse of short turns fires short_turns once (armed since batch 0)
    alarm = CollapseAlarm(max_turn_tokens=10)
    fired = feed(alarm, tokens=[5.0, 9.5, 9.5, 9.5], truncated=[0.5, 1.0, 1.0, 1.0], success=[0.3, 0.0, 0.0, 0.0])
    assert sorted(fired) == [(3, "capped_turns"), (3, "success"), (3, "truncated")]
    assert feed(alarm, tokens=[1.0] * 6, truncated=[1.0] * 6, success=[0.0] * 6) == [(2, "short_turns")]
    assert {k for _, k in fired} | {"short_turns", "no_variance"} == set(KINDS)  # no_variance: its own test


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_turn_tokens=0), "max_turn_tokens"),
        (dict(max_turn_tokens=24, patience=0), "patience"),
        (dict(max_turn_tokens=24, success_floor=0.0), "success_floor"),
    ],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CollapseAlarm(**kwargs)


def test_replay_of_stored_runs():
    """PPO with bootstrapping collapsed on tiny:shop; GRPO did not (bench/results/shop_methods; logs every 5 steps,
    max_turn_tokens 24 in configs/mpo_shop.yaml and configs/quickstart.yaml)."""
    collapsed = json.loads((RESULTS / "shop_methods" / "mpo_shop@trainer=ppo-s0" / "summary.json").read_text())
    # env/truncated at steps 50, 55, 60, 65: 0.867, 0.969, 1.0, 1.0 -> 55, 60, 65 in a row, fires at 65
    # env/success at steps 50-70: 0.102, 0.026, 0.0, 0.0, 0.0 -> 0.026 > 0.02, so 60, 65, 70: fires at 70
    # mean_length / turns at steps 95-110: 16.5/8 = 2.06, 1.97, 1.79, 1.52 -> 100, 105, 110 <= 2: fires at 110
    # frac_reward_zero_std at steps 55-80: 0.948, then 1.0 from 60 on -> 60, 65, 70, 75, 80 >= 0.95: fires at 80
    fired = [(step, a.kind) for step, a in replay(collapsed["log_history"], max_turn_tokens=24)]
    assert fired == [(65, "truncated"), (70, "success"), (80, "no_variance"), (110, "short_turns")]
    healthy = json.loads((RESULTS / "shop_methods" / "quickstart-s0" / "summary.json").read_text())
    # tokens per turn 5.8-8.0, truncated <= 0.77, success >= 0.09: nowhere near a band
    assert replay(healthy["log_history"], max_turn_tokens=24) == []


def test_trainer_logs_tokens_per_turn_and_fires_alarms(tiny_model_folder, tmp_path, caplog):
    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple", "river", "stone"]}}] * 4)
    args = AgentGRPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=40,
        max_turn_tokens=4,
        **CPU_ARGS,
    )
    trainer = RecordingTrainer(model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda r: EchoEnv())
    assert isinstance(trainer.collapse_alarm, CollapseAlarm)  # collapse_alarm: true by default
    # a patience-1 alarm armed by one healthy batch (3 tokens per turn: outside both turn bands), so that each batch
    # below decides by itself what fires
    trainer.collapse_alarm = CollapseAlarm(max_turn_tokens=4, patience=1)
    trainer.collapse_alarm.update(tokens_per_turn=3.0, truncated=0.0, success=1.0)
    trainer.model.train()  # as inside train(): metrics go to "train" and the alarm is fed
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="trainers.base"):
        trainer.generate_and_score([dict(r) for r in data] * 2)
    batch, metrics = trainer.seen, trainer.logged_metrics("train")
    # independently of the rows' turn_index lists the metric reads: model tokens are the loss mask's 1s, and the
    # turns of a row are its largest turn index + 1
    tokens = batch.mask.sum().item()  # (B, T) -> all model tokens
    turns = (batch.turn_index.max(dim=1).values + 1).sum().item()  # (B,) -> all turns
    assert metrics["env/tokens_per_turn"] == [pytest.approx(tokens / turns)]
    assert metrics["env/turns"] == [pytest.approx(turns / batch.mask.shape[0])]
    # what fired follows from this batch's numbers against the bands (cap 0.9 x 4 = 3.6; success <= 0.02)
    expected = {"capped_turns"} if tokens / turns >= 3.6 else set()
    expected |= {"truncated"} if metrics["env/truncated"][0] >= 0.95 else set()
    expected |= {"success"} if metrics["env/success"][0] <= 0.02 else set()
    assert expected, "the random tiny policy fails every episode, so at least the success alarm fires"
    assert {k for k in metrics if k.startswith("alarm/")} == {f"alarm/{k}" for k in expected}
    assert all(metrics[f"alarm/{k}"] == [1.0] for k in expected)
    assert sum(r.getMessage().startswith("collapse alarm") for r in caplog.records) == len(expected)

    # literal rows: 2 + 1 + 3 model tokens in 3 turns, and 1 in 1 turn -> 7 / 4 = 1.75 tokens per turn (<= 2)
    rows = [
        {"success": False, "turn_rewards": [0, 0, 0], "truncated": False, "env_errors": 0},
        {"success": False, "turn_rewards": [0], "truncated": False, "env_errors": 0},
    ]
    rows[0]["turn_index"] = [0, 0, -1, -1, 1, -1, 2, 2, 2]
    rows[1]["turn_index"] = [0, -1, -1]
    trainer._log_env_metrics(SimpleNamespace(rows=rows))
    assert metrics["env/tokens_per_turn"][-1] == 1.75
    assert metrics["alarm/short_turns"] == [1.0]  # armed by the 3.0 above

    args.collapse_alarm = False
    off = AgentGRPOTrainer(model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda r: EchoEnv())
    assert off.collapse_alarm is None
