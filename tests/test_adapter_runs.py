"""The shipped recipe of every ecosystem source runs end to end through `train.main`, as a user runs it: the config
file as written, only its sizes cut (a tiny default of 1 SFT step on 16 demonstrations, 2 RL steps, a few held-out
tasks). Each run builds `tiny:<source>:<name>` from the package's own tasks and expert, evaluates, trains and writes
summary.json; nothing beyond the config is given."""

from __future__ import annotations

import json
import math

import pytest
import yaml

import train

SMALL = ["--tiny_sft_steps", "1", "--tiny_num_demos", "16", "--num_train_tasks", "8", "--num_eval_tasks", "4"]
SMALL += ["--max_steps", "2", "--per_device_train_batch_size", "4", "--num_generations", "2", "--logging_steps", "1"]
SMALL += ["--eval_batch_size", "4"]


@pytest.mark.parametrize(
    "config",
    [
        "configs/reasoning_gym_aiw.yaml",
        "configs/textarena_guess_the_number.yaml",
        "configs/gymnasium_frozenlake.yaml",
        "configs/verifiers_siblings.yaml",
        "configs/openenv_guess_the_number.yaml",
    ],
)
def test_the_shipped_recipe_runs_with_nothing_but_its_config(config, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "run"
    summary = train.main(["--config", config, "--output_dir", str(out), *SMALL])
    environment = yaml.safe_load(open(config))["environment"]
    (built,) = (tmp_path / "cache" / "tiny").iterdir()  # the tiny default of this environment, built here
    assert built.name.startswith("tiny-" + environment.split(":")[0])
    written = json.loads((out / "summary.json").read_text())
    assert written["run"]["environment"] == environment and written["model"] == f"tiny:{environment}"
    for when in ("before", "after"):
        sampled = summary[when]["sampled"]
        assert 0.0 <= sampled["success"] <= 1.0 and sampled["turns"] >= 1.0  # 4 held-out tasks played
        assert abs(sampled["success"] * 4 - round(sampled["success"] * 4)) < 1e-9
    steps = [row for row in written["log_history"] if "loss" in row]
    assert [row["step"] for row in steps] == [1, 2]
    assert all(math.isfinite(row["loss"]) and 0.0 <= row["env/success"] <= 1.0 for row in steps)
    assert (out / "model.safetensors").exists()
