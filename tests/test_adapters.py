"""What every ecosystem source shares (the per-source behaviour is in tests/test_adapter_<source>.py): its shipped
recipe runs end to end through `train.main` as a user runs it, the config file as written with only its sizes cut (a
tiny default of 1 SFT step on 16 demonstrations, 2 RL steps, a few held-out tasks), building `tiny:<source>:<name>`
from the package's own tasks and expert, with nothing beyond the config; and a source whose package is not installed
stops at start-up with the install command."""

from __future__ import annotations

import json
import math
import sys

import pytest
import yaml

import train
from envs.adapters import SOURCES, _adapter_class
from envs.sources import load_environment

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


@pytest.mark.parametrize(
    "spec, package",
    [
        ("reasoning_gym:aiw", "reasoning_gym"),
        ("textarena:GuessTheNumber-v0", "textarena"),
        ("gymnasium:FrozenLake-v1", "gymnasium"),
        ("verifiers:examples.verifiers_siblings", "verifiers"),
        ("openenv:examples.openenv_textarena:TextArenaEnvironment", "openenv"),
    ],
)
def test_a_missing_package_stops_with_the_install_command(spec, package, monkeypatch):
    source = spec.partition(":")[0]
    for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it fails, as when it is not installed
    monkeypatch.setitem(sys.modules, package, None)
    monkeypatch.delitem(sys.modules, SOURCES[source][0], raising=False)  # the adapter module imports it anew
    _adapter_class.cache_clear()
    try:
        with pytest.raises(SystemExit) as e:
            load_environment(spec)
        message = str(e.value)
        assert spec in message and SOURCES[source][1] in message and "pip install -e '.[envs]'" in message
    finally:
        _adapter_class.cache_clear()
