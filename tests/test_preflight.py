"""`agent_trl.preflight`: the start-up checks of a run's fields, model path, output_dir, free disk space and tracker,
called directly (tests/test_train_cli.py and tests/test_bad_inputs.py reach them through `train.main`)."""

import logging
import os
from types import SimpleNamespace

import pytest

from agent_trl import preflight
from agent_trl.arguments import RunArguments
from agent_trl.preflight import MIN_FREE_BYTES, check_report_to, check_run, disk_problem, model_problem
from envs import ENVIRONMENTS

MiB = 2**20


def free_space(monkeypatch, free: int) -> None:
    """output_dir's disk reports `free` bytes free."""
    real = preflight.shutil.disk_usage
    monkeypatch.setattr(preflight.shutil, "disk_usage", lambda path: real(path)._replace(free=free))


def model_folder(tmp_path, sizes: dict[str, int], name: str = "model"):
    """A saved model's folder with files of the given sizes (sparse: nothing is really written)."""
    folder = tmp_path / name
    folder.mkdir()
    for name, size in sizes.items():
        with open(folder / name, "wb") as f:
            f.truncate(size)
    return folder


def test_min_free_bytes_is_100_mib():
    assert MIN_FREE_BYTES == 100 * MiB


def test_disk_need_counts_the_weights_four_times_without_lora(tmp_path, monkeypatch):
    # weights 50 + 10 MiB (config.json is not a weight file) -> need max(100, 4 x 60) = 240 MiB
    folder = model_folder(tmp_path, {"model.safetensors": 50 * MiB, "extra.bin": 10 * MiB, "config.json": 30 * MiB})
    free_space(monkeypatch, 200 * MiB)
    expected = (
        f"output_dir {str(tmp_path)!r} has 200 MiB free; a checkpoint and the final model need about 240 MiB. Free "
        "space or choose another output_dir"
    )
    assert disk_problem(str(tmp_path), str(folder), use_peft=False) == expected
    free_space(monkeypatch, 240 * MiB)  # exactly enough
    assert disk_problem(str(tmp_path), str(folder), use_peft=False) is None


def test_disk_need_with_lora_is_a_tenth_of_the_weights_or_the_floor(tmp_path, monkeypatch):
    folder = model_folder(tmp_path, {"model.safetensors": 2000 * MiB})  # LoRA: 2000 / 10 = 200 MiB
    free_space(monkeypatch, 199 * MiB)
    assert "need about 200 MiB" in disk_problem(str(tmp_path), str(folder), use_peft=True)
    small = model_folder(tmp_path, {"model.safetensors": 60 * MiB}, "small")
    free_space(monkeypatch, 99 * MiB)  # 60 / 10 = 6 MiB, below the 100 MiB floor
    problem = disk_problem(str(tmp_path), str(small), use_peft=True)
    assert "has 99 MiB free; a checkpoint and the final model need about 100 MiB" in problem


def test_a_hub_id_is_held_to_the_floor_only(tmp_path, monkeypatch):
    free_space(monkeypatch, 100 * MiB)
    assert disk_problem(str(tmp_path), "Qwen/Qwen3-0.6B", use_peft=False) is None
    free_space(monkeypatch, 100 * MiB - 1)
    assert "need about 100 MiB" in disk_problem(str(tmp_path), "Qwen/Qwen3-0.6B", use_peft=False)


@pytest.mark.parametrize("name", [None, "", "tiny", "tiny:shop", "tiny-moe:terminal", "tiny:reasoning_gym:aiw"])
def test_loadable_names_have_no_problem(name):
    """Empty names are asked for after the data is checked; tiny defaults of built-in and ecosystem environments."""
    assert model_problem(name) is None


def test_an_unknown_tiny_environment_is_named():
    assert model_problem("tiny:shoop") == (
        f"model_name_or_path 'tiny:shoop': no tiny default for 'shoop'; use tiny:<one of {sorted(ENVIRONMENTS)}>"
    )
    assert model_problem("tiny-moe:shoop").endswith(f"use tiny-moe:<one of {sorted(ENVIRONMENTS)}>")


def test_model_folders(tmp_path):
    folder = model_folder(tmp_path, {})
    expected = f"model_name_or_path {str(folder)!r} is a folder without config.json, not a saved model"
    assert model_problem(str(folder)) == expected
    (folder / "config.json").write_text("{}")
    assert model_problem(str(folder)) is None
    a_file = str(tmp_path / "a_file")
    (tmp_path / "a_file").write_text("not a model")
    assert model_problem(a_file) == f"model_name_or_path {a_file!r} is not a folder"
    assert model_problem("./no/such/model") == "model_name_or_path './no/such/model' is not a folder"


def test_hub_ids(monkeypatch):
    from huggingface_hub import constants

    assert model_problem("not a hub id") == (
        "model_name_or_path 'not a hub id' is neither a folder nor a Hub model id (owner/name)"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert model_problem("nobody/no-such-model-anywhere") == (
        "model_name_or_path 'nobody/no-such-model-anywhere' is not a folder and not in the local Hugging Face cache, "
        "and HF_HUB_OFFLINE forbids a download"
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # online: downloaded at load time, nothing checked now
    assert model_problem("nobody/no-such-model-anywhere") is None


@pytest.mark.parametrize("report_to", [None, [], ["none"], ["all"], ["tensorboard"]])
def test_installed_trackers_pass(report_to):
    assert check_report_to(SimpleNamespace(report_to=report_to)) is None


def test_a_missing_tracker_stops_the_run():
    with pytest.raises(SystemExit, match=r"^error: report_to \['no_such_tracker'\] is not installed \(installed"):
        check_report_to(SimpleNamespace(report_to=["tensorboard", "no_such_tracker"]))


def config(tmp_path, **fields) -> SimpleNamespace:
    base = dict(max_steps=10, output_dir=str(tmp_path / "out" / "run"), max_completion_length=64, max_turn_tokens=32)
    return SimpleNamespace(**{**base, **fields})


def model_args(**fields) -> SimpleNamespace:
    return SimpleNamespace(**{"use_peft": False, "lora_r": 16, "model_name_or_path": "tiny:shop", **fields})


def test_a_good_run_passes_and_makes_its_output_dir(tmp_path, monkeypatch, caplog):
    free_space(monkeypatch, 10**12)
    with caplog.at_level(logging.WARNING, logger="agent_trl.preflight"):
        assert check_run(RunArguments(), config(tmp_path), model_args()) is None
    assert os.path.isdir(tmp_path / "out" / "run") and not caplog.records


def test_every_bad_field_is_named_in_one_message(tmp_path, monkeypatch):
    free_space(monkeypatch, 10**12)
    run = RunArguments(eval_samples=0, num_eval_tasks=30_000, tiny_privileged_frac=1.5)
    expected = (
        "error: eval_samples must be >= 1, got 0; "
        "num_eval_tasks 30,000 is more than the 20,000 a run generates; give a smaller number; "
        "tiny_privileged_frac must be in [0, 1], got 1.5; "
        "max_steps 0 trains nothing; give a positive number (or -1 to train by num_train_epochs); "
        "lora_r must be >= 1 with use_peft, got 0; "
        "model_name_or_path 'tiny:shoop': no tiny default for 'shoop'; "
        f"use tiny:<one of {sorted(ENVIRONMENTS)}>"
    )
    lora = model_args(use_peft=True, lora_r=0, model_name_or_path="tiny:shoop")
    with pytest.raises(SystemExit) as err:
        check_run(run, config(tmp_path, max_steps=0), lora)
    assert err.value.code == expected
    assert not os.path.exists(tmp_path / "out")  # stopped before output_dir is made


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        (dict(num_train_tasks=0), "num_train_tasks must be >= 1, got 0"),
        (dict(num_train_tasks=200_001), "num_train_tasks 200,001 is more than the 200,000 a run generates"),
        (dict(tiny_sft_steps=-1), "tiny_sft_steps must be >= 0, got -1"),
        (dict(tiny_num_demos=0), "tiny_num_demos must be >= 1, got 0"),
        (dict(tiny_privileged_frac=-0.1), "tiny_privileged_frac must be >= 0, got -0.1"),
        (dict(tiny_guidance_frac=-0.1), "tiny_guidance_frac must be >= 0, got -0.1"),
        (dict(tiny_noise=-0.1), "tiny_noise must be >= 0, got -0.1"),
        (dict(tiny_noise=1.5), r"tiny_noise must be in \[0, 1\], got 1.5"),
        (dict(tiny_guidance_frac=1.5), r"tiny_guidance_frac must be in \[0, 1\], got 1.5"),
        (
            dict(tiny_privileged_frac=0.5, tiny_guidance_frac=0.75),
            "tiny_privileged_frac \\+ tiny_guidance_frac must be at most 1, got 0.5 \\+ 0.75",
        ),
        (dict(eval_batch_size=0), "eval_batch_size must be >= 1, got 0"),
    ],
)
def test_each_count_is_checked(tmp_path, fields, needle):
    with pytest.raises(SystemExit, match=needle):
        check_run(RunArguments(**fields), config(tmp_path), model_args())


def test_the_largest_counts_pass(tmp_path, monkeypatch):
    free_space(monkeypatch, 10**12)
    run = RunArguments(num_train_tasks=200_000, num_eval_tasks=20_000, tiny_sft_steps=0, tiny_privileged_frac=1.0)
    assert check_run(run, config(tmp_path), model_args()) is None


def test_an_unwritable_output_dir_is_named(tmp_path):
    (tmp_path / "out").write_text("a file, not a folder")
    with pytest.raises(SystemExit, match=r"^error: output_dir '.*/out/run' cannot be written: "):
        check_run(RunArguments(), config(tmp_path), model_args())


def test_a_full_disk_stops_after_output_dir_is_made(tmp_path, monkeypatch):
    free_space(monkeypatch, MiB)
    with pytest.raises(SystemExit, match=r"^error: output_dir .* has 1 MiB free; .* need about 100 MiB"):
        check_run(RunArguments(), config(tmp_path), model_args())


def test_a_budget_shorter_than_two_turns_warns_on_multi_turn_runs_only(tmp_path, monkeypatch, caplog):
    free_space(monkeypatch, 10**12)
    short = config(tmp_path, max_completion_length=63, max_turn_tokens=32)  # 63 < 2 x 32
    with caplog.at_level(logging.WARNING, logger="agent_trl.preflight"):
        check_run(RunArguments(), short, model_args())
        check_run(RunArguments(dataset_name="d.jsonl"), short, model_args())  # single-turn: no warning
        check_run(RunArguments(dataset_name="d.jsonl", environment="shop"), short, model_args())
    assert [r.getMessage() for r in caplog.records] == [
        "max_completion_length 63 is less than two turns of max_turn_tokens 32: a multi-turn episode will be cut "
        "after its first turn"
    ] * 2
