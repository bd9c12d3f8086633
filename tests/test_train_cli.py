"""train.py start-up: a bad config stops at once with a message naming the field."""

from pathlib import Path

import pytest

import train
from agent_trl import run_info

GOOD = "trainer: grpo\nenvironment: shop\nmodel_name_or_path: tiny:shop\noutput_dir: {out}\nuse_cpu: true\n"


def config(tmp_path, extra: str = "", base: str = GOOD) -> list[str]:
    path = tmp_path / "run.yaml"
    path.write_text(base.format(out=tmp_path / "out") + extra)
    return ["--config", str(path)]


def test_good_config_parses(tmp_path):
    run, cfg, model_args, trainer_cls = train.parse(config(tmp_path, "learning_rate: 0.001\nmax_turn_tokens: 16\n"))
    assert (run.environment, cfg.learning_rate, cfg.max_turn_tokens) == ("shop", 0.001, 16)
    assert model_args.model_name_or_path == "tiny:shop" and trainer_cls.__name__ == "AgentGRPOTrainer"


def test_command_line_overrides_the_yaml(tmp_path):
    run, cfg, _, _ = train.parse(config(tmp_path, "learning_rate: 0.001\n") + ["--learning_rate", "0.01"])
    assert cfg.learning_rate == 0.01


def test_a_field_that_prefixes_another_is_not_abbreviated(tmp_path):
    """`--reward` is the config's reward field, not an abbreviation of the run field `--reward_funcs` (the probe parser
    that picks the trainer once refused it as ambiguous)."""
    run, cfg, _, _ = train.parse(config(tmp_path, "") + ["--reward", "env"])
    assert cfg.reward == "env" and run.reward_funcs is None


def test_unknown_field_is_named(tmp_path):
    with pytest.raises(SystemExit, match="learnin_rate"):
        train.parse(config(tmp_path, "learnin_rate: 0.1\n"))


def test_bad_value_is_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.parse(config(tmp_path, "learning_rate: abc\n"))
    assert "learning_rate" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "base", "needle"),
    [
        ("", GOOD.replace("trainer: grpo", "trainer: grpoo"), "trainer 'grpoo'"),
        ("", GOOD.replace("environment: shop", "environment: shoop"), "environment 'shoop'"),
        ("max_turn_tokens: 0\n", GOOD, "max_turn_tokens"),
    ],
)
def test_semantic_errors_are_named(tmp_path, extra, base, needle):
    with pytest.raises(SystemExit, match=needle):
        train.parse(config(tmp_path, extra, base))


def test_bad_difficulty_fails_before_any_model_is_built(tmp_path, monkeypatch):
    monkeypatch.setattr(
        run_info, "tiny_model", lambda *a, **k: pytest.fail("built a model before validating the tasks")
    )
    with pytest.raises(SystemExit, match="difficulty"):
        train.main(config(tmp_path, "difficulty: 9\n"))


SHIPPED_CONFIGS = sorted(str(p) for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_shipped_configs_are_found():
    assert SHIPPED_CONFIGS  # anchored to the repository, so the next test never silently collects nothing


@pytest.mark.parametrize("path", SHIPPED_CONFIGS)
def test_every_shipped_config_parses(path):
    # GPU recipes (bf16) cannot build a TrainingArguments on a CPU machine; every field name is still checked
    run, cfg, model_args, trainer_cls = train.parse(["--config", path, "--use_cpu", "true", "--bf16", "false"])
    assert run.trainer in train.TRAINERS and model_args.model_name_or_path


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ("eval_samples: 0\n", "eval_samples must be >= 1, got 0"),
        ("eval_batch_size: 0\n", "eval_batch_size must be >= 1, got 0"),
        ("num_iterations: 0\n", "num_iterations must be >= 1, got 0"),
        ("learning_rate: -0.001\n", "learning_rate must be >= 0, got -0.001"),
        ("max_steps: 0\n", "max_steps 0 trains nothing"),
        ("model_name_or_path: /no/such/model\n", "model_name_or_path '/no/such/model' is not a folder"),
    ],
)
def test_bad_run_fields_stop_before_any_model_is_built(tmp_path, monkeypatch, extra, needle):
    monkeypatch.setattr(run_info, "tiny_model", lambda *a, **k: pytest.fail("built a model before validating the run"))
    base = GOOD.replace("model_name_or_path: tiny:shop\n", "") if "model_name_or_path" in extra else GOOD
    with pytest.raises(SystemExit, match=needle):
        train.main(config(tmp_path, extra, base))


def test_unwritable_output_dir_stops_before_training(tmp_path, monkeypatch):
    monkeypatch.setattr(
        run_info, "tiny_model", lambda *a, **k: pytest.fail("built a model before checking output_dir")
    )
    blocker = tmp_path / "file"
    blocker.write_text("a file, not a folder")
    with pytest.raises(SystemExit, match="output_dir .* cannot be written"):
        train.main(config(tmp_path) + ["--output_dir", str(blocker / "run")])
