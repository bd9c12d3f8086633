"""What a hostile probe and a new user hit (issue 65), each step reproduced through `train.main` or the part it
reaches: infinite rewards count as no reward, a reward returning the wrong thing or raising stops the run naming the
function (with a checkpoint and summary.json once something was trained), and values TRL would take silently or fail
on late stop at start-up naming the field."""

from __future__ import annotations

import json
import logging
import math
import textwrap
from pathlib import Path

import pytest
import torch
from conftest import WORDS

import train
from rewards.loading import RewardFunctionError, checked_reward

RUN = ["--per_device_train_batch_size", "4", "--num_generations", "2", "--learning_rate", "1e-3"]
RUN += ["--logging_steps", "1", "--save_strategy", "no", "--report_to", "none", "--skip_eval", "true"]
RUN += ["--use_cpu", "true", "--bf16", "false", "--activation_checkpointing", "false", "--seed", "0"]
RUN += ["--max_completion_length", "4"]

USER_REWARDS = """
CALLS = {"n": 0}


def infinite(completions, **kwargs):
    return [float("inf")] * len(completions)


def text(completions, **kwargs):
    return "1.0"


def scalar(completions, **kwargs):
    return 1.0


def short(completions, **kwargs):
    return [1.0]


def third_call_raises(completions, **kwargs):
    CALLS["n"] += 1
    if CALLS["n"] == 3:
        raise KeyError("answer")
    return [float(len(c[-1]["content"])) for c in completions]
"""


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "user_rewards.py").write_text(textwrap.dedent(USER_REWARDS))
    rows = [{"prompt": [{"role": "user", "content": f"say {w}"}], "answer": w} for w in WORDS * 3]
    (tmp_path / "words.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def run(workdir: Path, folder: str, reward: str, steps: int) -> tuple[str, dict]:
    """The SystemExit message of a run with `reward`, and its summary.json."""
    out = workdir / "run"
    argv = [
        "--dataset_name",
        "words.jsonl",
        "--reward_funcs",
        f"user_rewards.{reward}",
        "--model_name_or_path",
        folder,
    ]
    with pytest.raises(SystemExit) as err:
        train.main(argv + ["--output_dir", str(out), "--max_steps", str(steps), *RUN])
    return str(err.value.code), json.loads((out / "summary.json").read_text())


# --------------------------------------------------------------------------------------------------------------------
# rewards


def test_checked_reward_by_hand(caplog):
    completions = [[{"role": "assistant", "content": "a"}]] * 3
    same = checked_reward(lambda completions, **kw: [0.5, None, 1], "ok")
    assert same(prompts=["p"] * 3, completions=completions) == [0.5, None, 1]
    mixed = checked_reward(lambda completions, **kw: [math.inf, 2.0, -math.inf], "mixed")
    with caplog.at_level(logging.WARNING):
        assert mixed(completions=completions) == [None, 2.0, None]
    assert "'mixed' returned a non-finite value (inf) for 2 of 3 completions" in caplog.text
    for value, needle in [("1.0", "returned a str"), (1.0, "returned a float"), ([1.0], "returned 1 values for 3")]:
        with pytest.raises(RewardFunctionError, match=f"reward function 'bad' {needle}"):
            checked_reward(lambda completions, v=value, **kw: v, "bad")(completions=completions)
    with pytest.raises(RewardFunctionError, match=r"'bad' returned a str \('x'\) among its rewards"):
        checked_reward(lambda completions, **kw: [1.0, "x", None], "bad")(completions=completions)


def test_an_infinite_reward_is_no_reward_and_the_guard_stops_the_run(workdir, tiny_model_folder):
    """Before: loss 0 and grad norm 0 at every step, reward inf logged, exit 0. Now every rollout is unscorable,
    and after `unscorable_patience` (3) batches the no-signal guard stops with a checkpoint."""
    message, summary = run(workdir, tiny_model_folder, "infinite", steps=5)
    assert "generation batches in a row had more than" in message and "infinite" in message
    assert summary["stopped"]["reason"] == "no reward signal" and summary["stopped"]["step"] == 2
    fracs = [row["reward/unscorable_frac"] for row in summary["log_history"] if "reward/unscorable_frac" in row]
    assert len(fracs) >= 2 and set(fracs) == {1.0}  # the two trained steps'; the third batch stopped the run
    assert (workdir / "run" / "checkpoint-2").is_dir()


@pytest.mark.parametrize(
    ("reward", "needle"),
    [
        ("text", "'user_rewards.text' returned a str"),
        ("scalar", "'user_rewards.scalar' returned a float"),
        ("short", "'user_rewards.short' returned 1 values for 4 completions"),
    ],
)
def test_a_reward_returning_the_wrong_thing_is_named(workdir, tiny_model_folder, reward, needle):
    message, summary = run(workdir, tiny_model_folder, reward, steps=2)
    assert needle in message and "nothing was trained yet, so no checkpoint was saved" in message
    assert summary["stopped"] == {"reason": "reward function error", "step": 0, "error": message[len("error: ") :]}


def test_a_reward_that_raises_mid_run_leaves_a_checkpoint_and_a_summary(workdir, tiny_model_folder):
    """Before: an empty output folder. Now the two trained steps are kept and the message names the function."""
    message, summary = run(workdir, tiny_model_folder, "third_call_raises", steps=4)
    assert "reward function 'user_rewards.third_call_raises' raised KeyError: 'answer'" in message
    assert summary["stopped"]["step"] == 2 and "saved checkpoint-2" in message
    checkpoint = workdir / "run" / "checkpoint-2"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "model.safetensors").is_file()
    assert len([row for row in summary["log_history"] if "loss" in row]) == 2


# --------------------------------------------------------------------------------------------------------------------
# fields taken silently or failing late, refused at start-up


class ReachedModel(Exception):
    pass


@pytest.fixture
def startup(workdir, monkeypatch):
    """train.main up to the model load (which raises `ReachedModel`); returns its SystemExit message."""

    def reached(*args, **kwargs):
        raise ReachedModel

    for name in ("AutoModelForCausalLM", "AutoTokenizer"):
        monkeypatch.setattr(train, name, reached)
    resolve = train.resolve_model
    monkeypatch.setattr(train, "resolve_model", lambda name, *a: reached() if name == "tiny" else resolve(name, *a))

    def start(*argv: str, model: str = "tiny") -> str:
        base = ["--dataset_name", "words.jsonl", "--reward_funcs", "exact_match_reward", "--model_name_or_path", model]
        with pytest.raises(SystemExit) as err:
            train.main(base + ["--output_dir", str(workdir / "run"), *RUN, "--max_steps", "1", *argv])
        return str(err.value.code)

    return start


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--temperature", "inf"], "temperature must be a finite number > 0, got inf"),
        (["--max_grad_norm", "-1"], "max_grad_norm must be a finite number >= 0 (0 turns clipping off), got -1.0"),
        (["--save_strategy", "steps", "--save_steps", "0"], "save_steps must be > 0 with save_strategy steps"),
        (["--use_vllm", "true"], "use_vllm needs vLLM, which is not installed"),
        (["--load_in_4bit", "true"], "load_in_4bit trains quantized weights only through an adapter: add use_peft"),
    ],
)
def test_silently_taken_values_stop_at_start_up(startup, argv, needle):
    assert needle in startup(*argv)


def test_an_api_key_in_the_key_variable_field_is_refused_unechoed(startup, capsys):
    key = "sk-proj-abc123DEF456"
    message = startup("--trainer", "draco", "--judge_api_key_env", key, "--judge_backend", "oracle")
    assert "judge_api_key_env names the environment variable that holds the key" in message
    assert key not in message and key not in capsys.readouterr().out


def test_a_completion_budget_beyond_the_models_positions_stops(startup, tiny_model_folder):
    positions = json.loads((Path(tiny_model_folder) / "config.json").read_text())["max_position_embeddings"]
    message = startup("--max_completion_length", str(10**8), model=tiny_model_folder)
    assert f"max_completion_length 100,000,000 is not below the model's {positions:,} positions" in message


def test_a_config_folder_is_named_a_folder(workdir):
    (workdir / "configs").mkdir()
    (workdir / "configs" / "a.yaml").write_text("seed: 0\n")
    with pytest.raises(SystemExit, match=r"config 'configs' is a folder; give one YAML file in it \(e.g. configs/a"):
        train.main(["--config", "configs"])


def test_routing_replay_on_a_dense_model_is_said_at_start_up(caplog):
    from trainers.routing_replay import RoutingReplay

    class Args:
        routing_replay = True

    class Trainer:
        args = Args()

    dense = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with caplog.at_level(logging.WARNING):
        assert RoutingReplay(Trainer()).setup(dense) is False
    assert "routing_replay is on, but Sequential has no MoE router (a dense model): it does nothing" in caplog.text


@pytest.mark.parametrize(
    ("argv", "config", "needle"),
    [
        (
            ["--learnin_rate", "0.1"],
            None,
            "flag --learnin_rate is not a field of this trainer; did you mean learning_rate?",
        ),
        (
            ["--learning_rat", "0.1"],
            None,
            "flag --learning_rat is not a field of this trainer; did you mean learning_rate?",
        ),
        (
            [],
            "learnin_rate: 0.1\n",
            "config key learnin_rate is not a field of this trainer; did you mean learning_rate?",
        ),
        (["--zzz_qqq", "1"], None, "flag --zzz_qqq is not a field of this trainer; `python train.py --help` lists"),
    ],
)
def test_a_misspelled_field_gets_the_closest_name_and_a_prefix_is_not_taken(workdir, argv, config, needle):
    """Before: TRL's developer-facing text ("add them to the dataclass, or set fail_with_unknown_args=False"), and
    `--learning_rat` silently taken as `--learning_rate` (argparse's abbreviations)."""
    if config is not None:
        (workdir / "c.yaml").write_text(config)
        argv = ["--config", "c.yaml", *argv]
    with pytest.raises(SystemExit) as err:
        train.parse(argv)
    assert needle in str(err.value.code)


def test_a_dataset_with_empty_prompts_stops_at_start_up(workdir, startup):
    """Before: `KeyError: 'text'` from the tiny build's SFT (one empty prompt), `IndexError` after a step (all)."""
    (workdir / "data").mkdir()
    rows = [{"prompt": f"say {w}", "answer": w} for w in WORDS]
    rows[3] = {"prompt": "", "answer": "x"}
    rows[6] = {"prompt": [{"role": "user", "content": "  "}], "answer": "y"}
    (workdir / "data" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (workdir / "data" / "test.jsonl").write_text(json.dumps({"prompt": "say a", "answer": "a"}) + "\n")
    message = startup("--dataset_name", "data")
    assert f"2 of {len(WORDS)} rows of the train split have an empty prompt (rows 3, 6)" in message


def fake_checkpoint(folder: Path) -> Path:
    """A checkpoint folder as the trainer writes one: weights, optimizer state, trainer_state.json last."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    save_file({"w": torch.ones(64, 64), "b": torch.zeros(64)}, str(folder / "model.safetensors"))
    torch.save({"state": {0: torch.ones(8)}}, folder / "optimizer.pt")
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": int(folder.name.split("-")[1])}))
    return folder


def test_resume_skips_a_checkpoint_with_a_corrupt_weights_file(tmp_path, caplog):
    """Before: a safetensors traceback from the latest checkpoint (a readable trainer_state.json beside a cut
    model.safetensors). Now `true` falls back to the previous complete checkpoint, and a named one is refused with
    the file and its sizes."""
    from types import SimpleNamespace

    from agent_trl.resume import resume_checkpoint

    older, latest = fake_checkpoint(tmp_path / "checkpoint-2"), fake_checkpoint(tmp_path / "checkpoint-4")
    weights = latest / "model.safetensors"
    whole = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(whole - 100)
    config = SimpleNamespace(output_dir=str(tmp_path), resume_from_checkpoint="true", save_strategy="no")
    config.__dict__.update(steps_per_generation=1, num_iterations=1, gradient_accumulation_steps=1, save_steps=1)
    with caplog.at_level(logging.WARNING):
        assert resume_checkpoint(config) == str(older)
    cut = f"model.safetensors holds {whole - 100:,} bytes where its header describes {whole:,}"
    assert f"skipping {latest}, an incomplete checkpoint ({cut}" in caplog.text
    config.resume_from_checkpoint = str(latest)
    with pytest.raises(SystemExit, match=r"is not a complete checkpoint \(model.safetensors holds"):
        resume_checkpoint(config)
    (older / "optimizer.pt").write_bytes(b"not a zip")  # an overwritten optimizer state: no checkpoint is left
    config.resume_from_checkpoint = "true"
    with pytest.raises(SystemExit, match="holds no complete checkpoint-N folder"):
        resume_checkpoint(config)
    assert "optimizer.pt is not a readable torch file" in caplog.text


def test_curves_of_a_one_point_run_show_the_point(tmp_path):
    """Before: a run that logged once drew empty panels (a line needs two points). The point is now a marker: pixels
    of the training line's colour (matplotlib's first, #1f77b4) are on the image."""
    import matplotlib.image

    from trainers.reporting import plot_curves

    log = [{"step": 1, "reward": 0.5, "loss": 0.1, "env/success": 0.5}]
    path = plot_curves(log, tmp_path / "curves.png", rollouts_per_step=8)
    pixels = matplotlib.image.imread(path)[..., :3]
    blue = torch.tensor([0x1F, 0x77, 0xB4]) / 255
    near = (torch.as_tensor(pixels) - blue).abs().max(dim=-1).values < 0.05
    assert int(near.sum()) >= 10


def test_a_textarena_game_without_an_expert_points_to_the_real_model(tmp_path, monkeypatch):
    """`tiny:textarena:TowerOfHanoi-v0`: the message no longer asks to edit a class the user does not own."""
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    argv = ["--environment", "textarena:TowerOfHanoi-v0", "--model_name_or_path", "tiny:textarena:TowerOfHanoi-v0"]
    with pytest.raises(SystemExit) as err:
        train.main(argv + ["--output_dir", str(tmp_path / "run"), *RUN, "--max_steps", "1"])
    message = str(err.value.code)
    assert "has none" in message and "--model_name_or_path smollm2" in message
    assert "give your class an expert" not in message


def test_the_tiny_build_says_what_it_builds_and_a_ctrl_c_leaves_the_cache_clean(tmp_path, monkeypatch, capsys):
    from envs import tiny

    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "sft", interrupted)
    with pytest.raises(SystemExit, match="interrupted while building the tiny default: nothing was cached"):
        tiny.tiny_model("tiny:shop", sft_steps=7, num_demos=16)
    assert "building the tiny default once: 7 SFT steps on 16 demonstrations" in capsys.readouterr().out
    cached = tmp_path / "cache" / "tiny"
    assert not cached.exists() or not any(cached.iterdir())  # no folder, not even the staging one


def test_cut_environment_steps_are_counted_while_their_threads_run(caplog):
    """An environment step that loops forever is cut by env_timeout, but its thread cannot be killed: the warning now
    counts the abandoned threads still running, across calls, and forgets those that returned."""
    import threading

    from trainers import agent_loop

    release = threading.Event()

    class Hangs:
        def __init__(self, until=release):
            self.until = until

        def step(self, action):
            self.until.wait(30)
            return "", 0.0, True, {}

    class Quick:
        def step(self, action):
            return "ok", 1.0, True, {}

    agent_loop.ABANDONED.clear()
    with caplog.at_level(logging.WARNING, logger="trainers.agent_loop"):
        first = agent_loop.step_all([Hangs(), Quick()], ["a", "b"], timeout=0.2)
        agent_loop.step_all([Hangs()], ["a"], timeout=0.2)
    assert first[0][3] == {"env_timeout": True} and first[1][0] == "ok"
    messages = [r.getMessage() for r in caplog.records]
    assert "1 environment step(s) ran past env_timeout (0.2s) and were cut; 1 abandoned" in messages[0]
    assert "1 environment step(s) ran past env_timeout (0.2s) and were cut; 2 abandoned" in messages[1]
    release.set()  # the hung steps return: they are no longer counted
    for thread in list(agent_loop.ABANDONED):
        thread.join(5)
    caplog.clear()
    later = threading.Event()
    with caplog.at_level(logging.WARNING, logger="trainers.agent_loop"):
        agent_loop.step_all([Hangs(later)], ["a"], timeout=0.2)
    assert "; 1 abandoned step thread(s)" in caplog.records[0].getMessage()  # the two that returned are forgotten
    later.set()


def test_a_full_disk_while_saving_says_so(tmp_path, monkeypatch):
    """Before: torch's "unexpected pos 472448 vs 472336", which never mentions the disk. The same failure on a disk
    with almost nothing free now names the disk, the folder left incomplete and how to resume."""
    import errno
    import shutil
    from collections import namedtuple

    from trainers import base

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 2**20, 2**20))
    folder = str(tmp_path / "checkpoint-3")
    with pytest.raises(base.DiskFull, match=r"checkpoint-3 failed: the disk holding it is full \(1 MiB free"):
        with base.disk_full_named(folder):
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 472448 vs 472336")
    with pytest.raises(base.DiskFull, match="resume with --resume_from_checkpoint true"):
        with base.disk_full_named(folder):
            raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    with pytest.raises(RuntimeError, match="unexpected pos") as err:  # plenty of space: not put down to the disk
        with base.disk_full_named(folder):
            raise RuntimeError("unexpected pos 1 vs 2")
    assert not isinstance(err.value, base.DiskFull)


def test_an_environment_whose_reset_raises_is_named_with_its_task():
    """A reset that raises stops the batch with the class and the task named (train.py then saves a checkpoint and
    summary.json as for a reward that raises, above); a step that raises only ends its episode."""
    from trainers.agent_loop import EnvironmentFailure, reset_all

    class Fine:
        def reset(self, task):
            return "go"

    class Broken:
        def reset(self, task):
            raise FileNotFoundError("levels/7.txt")

    assert reset_all([Fine()], [{"level": 1}]) == ["go"]
    with pytest.raises(
        EnvironmentFailure, match=r'Broken.reset raised FileNotFoundError: levels/7.txt \(task \{"level": 7\}'
    ):
        reset_all([Fine(), Broken()], [{"level": 1}, {"level": 7}])


def test_the_documented_notebook_command_is_installed():
    """Many users type `jupyter nbconvert --execute`, which needs nbconvert (not installed); the docs give `jupyter
    execute`, which the set-up installs (nbclient): its command must be there."""
    import shutil
    import sys

    folder = str(Path(sys.executable).parent)
    assert shutil.which("jupyter-execute", path=folder) or shutil.which("jupyter-execute")
    page = (Path(__file__).resolve().parent.parent / "docs" / "development.md").read_text()
    assert "jupyter execute notebooks/" in " ".join(page.split())
