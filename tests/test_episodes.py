"""`save_episodes` (trainers/base.py) and its summary (bench/episodes.py)."""

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv, RecordingTrainer
from datasets import Dataset

from trainers.base import AgentGRPOConfig, AgentGRPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import episodes as summary  # noqa: E402


def make_trainer(model, output_dir):
    data = Dataset.from_list([{"prompt": "say apple", "task": {"words": ["apple", "river", "stone"]}}] * 4)
    args = AgentGRPOConfig(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=40,
        max_turn_tokens=4,
        save_episodes=True,
        **CPU_ARGS,
    )
    trainer = RecordingTrainer(model=model, train_dataset=data, args=args, env_factory=lambda r: EchoEnv())
    trainer.model.train()  # as inside train(): only training batches are saved
    return trainer, [dict(r) for r in data] * 2


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_training_batch_is_saved_with_its_turns(tiny_model_folder, tmp_path):
    trainer, inputs = make_trainer(tiny_model_folder, tmp_path)
    torch.manual_seed(0)
    saved = []
    for step in (0, 1):
        trainer.state.global_step = step
        trainer.generate_and_score(inputs)
        saved.append(trainer.seen)
    episodes = lines(tmp_path / "episodes.jsonl")
    assert [e["step"] for e in episodes] == [1] * 8 + [2] * 8  # the first optimizer step that trains on the batch
    for e, (batch, i) in zip(episodes, [(b, i) for b in saved for i in range(8)], strict=True):
        # independently of the turn_index the writer counts: a row's model tokens are its loss mask's 1s, its turns
        # the environment's transcript
        assert sum(t["tokens"] for t in e["turns"]) == batch.mask[i].sum().item()
        assert [t["action"] for t in e["turns"]] == [t["action"] for t in batch.transcripts[i]]
        assert [t["observation"] for t in e["turns"]] == [t["observation"] for t in batch.transcripts[i]]
        assert e["advantage"] == pytest.approx(batch.advantages[i].item())
        assert e["reward"] == pytest.approx(batch.rewards[i].item())
        assert e["group"] == batch.group_ids[i].item() and e["truncated"] == bool(batch.truncated[i])
        assert e["success"] == batch.rows[i]["success"]

    trainer.model.eval()  # evaluation batches are not training data: nothing is written
    trainer.generate_and_score(inputs)
    assert len(lines(tmp_path / "episodes.jsonl")) == 16


def test_a_resumed_run_replaces_the_steps_its_checkpoint_did_not_keep(tiny_model_folder, tmp_path):
    path = tmp_path / "episodes.jsonl"
    old = [{"step": s, "turns": [], "marker": "old"} for s in (1, 1, 2, 3)]
    path.write_text("".join(json.dumps(e) + "\n" for e in old))
    trainer, inputs = make_trainer(tiny_model_folder, tmp_path)
    trainer.state.global_step = 2  # resumed from checkpoint-2: steps 1-2 are kept, step 3 is played again
    trainer.generate_and_score(inputs)
    episodes = lines(path)
    assert [(e["step"], e.get("marker")) for e in episodes] == [(1, "old"), (1, "old"), (2, "old")] + [(3, None)] * 8

    fresh, inputs = make_trainer(tiny_model_folder, tmp_path)  # a new run into the same folder: the file starts over
    fresh.generate_and_score(inputs)
    assert [e["step"] for e in lines(path)] == [1] * 8


def test_save_episodes_needs_an_environment(tiny_model_folder, tmp_path):
    args = AgentGRPOConfig(output_dir=str(tmp_path), save_episodes=True, **CPU_ARGS)
    with pytest.raises(ValueError, match="save_episodes .* needs env_factory"):
        AgentGRPOTrainer(model=tiny_model_folder, reward_funcs=[lambda **kw: [0.0]], args=args)


def episode(step, success, turns, advantage):
    turns = [{"tokens": n, "invalid": bad} for n, bad in turns]
    return {"step": step, "success": success, "advantage": advantage, "turns": turns}


def test_summary_counts_by_hand(tmp_path):
    episodes = [
        episode(1, True, [(3, False), (12, False)], 0.9),  # long accepted turn in a success
        episode(2, False, [(20, True), (5, True), (12, True)], -0.3),  # two long rejected turns in a failure
        episode(3, False, [(11, False)], 0.0),  # 11 < 12: not long
        episode(4, False, [(15, False)], 0.0),  # long accepted in a failure, second window
    ]
    first, second = summary.summarise(episodes, every=3, long_tokens=12)
    assert first["steps"] == "1-3" and first["episodes"] == 3
    assert first["success"] == pytest.approx(1 / 3)
    assert first["turns"] == pytest.approx(6 / 3)
    assert first["tokens_per_turn"] == pytest.approx((3 + 12 + 20 + 5 + 12 + 11) / 6)
    assert first["rejected_turns"] == pytest.approx(3 / 6)
    assert first["long_turns"] == {
        "accepted, success": 1,
        "accepted, failure": 0,
        "rejected, success": 0,
        "rejected, failure": 2,
    }
    assert first["long_turns_by_advantage"] == {"< 0": 2, "= 0": 0, "> 0": 1}
    assert second["steps"] == "4-6" and second["long_turns"]["accepted, failure"] == 1
    assert second["long_turns_by_advantage"] == {"< 0": 0, "= 0": 1, "> 0": 0}
    assert [r["steps"] for r in summary.summarise(episodes, every=1)] == ["1", "2", "3", "4"]
    with pytest.raises(ValueError, match="every and long_tokens"):
        summary.summarise(episodes, every=0)

    path = tmp_path / "episodes.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in episodes))
    out = tmp_path / "summary"
    rows = summary.main([str(path), "--every", "3", "--out", str(out)])
    assert rows == [first, second]
    assert json.loads((out / "result.json").read_text())["rows"] == rows
    text = (out / "result.md").read_text()
    assert "| 1-3 | 3 | 0.333 |" in text and "| 2 / 0 / 1 |" in text and (out / "episodes.png").stat().st_size > 0
    packed = tmp_path / "episodes.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write(path.read_text())
    assert summary.main([str(packed), "--every", "3"]) == rows
