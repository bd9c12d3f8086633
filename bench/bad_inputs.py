"""The bad-input matrix: how `train.py` answers mistakes a user makes in a config or on the command line.

    python bench/bad_inputs.py                      # this checkout; writes bench/results/bad_inputs/
    python bench/bad_inputs.py --repo /path/to/old  # another checkout of the project (e.g. an older commit)

Each case is one mistake on top of a small, valid tiny:shop run. It is played in-process with `train.main`, with every
way of building or loading a model replaced by a sentinel (`ReachedModel`) and a 60 s alarm, and classified:

- `clear`: the run stopped before any model was built, with a message that names the field;
- `unclear`: it stopped early, but the message does not name the field;
- `traceback`: an exception other than the project's own error (a crash, not a message);
- `late`: it passed start-up and went on to build a model (the mistake shows up after a model load, in training, or
  never);
- `hang`: nothing happened within 60 s;
- `warned` (for settings that are legal but degenerate): a warning naming the field was logged before the model.

`tests/test_bad_inputs.py` runs the same cases and asserts `clear` (or `warned`) for each.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import logging
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent

BASE = """trainer: grpo
environment: shop
model_name_or_path: tiny:shop
output_dir: {out}
use_cpu: true
bf16: false
report_to: none
num_train_tasks: 16
num_eval_tasks: 4
per_device_train_batch_size: 4
num_generations: 2
max_steps: 2
"""


@dataclass(frozen=True)
class Case:
    """One mistake: `yaml` lines added to BASE (after `{out}`, `{tmp}` and `{port}` are filled in), `args` added on
    the command line; the outcome must name `needle`. `expect`: "error", or "warning" (legal but degenerate)."""

    name: str
    needle: str
    yaml: str = ""
    args: tuple[str, ...] = ()
    expect: str = "error"
    base: str = BASE
    setup: str | None = None  # name of a function below that prepares files under {tmp}
    env: dict = field(default_factory=dict)


def _closed_port() -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


NO_MODEL = BASE.replace("model_name_or_path: tiny:shop\n", "")  # a case names its own model
NO_ENV = BASE.replace("environment: shop\n", "environment: none\n").replace("tiny:shop", "tiny")

CASES = [
    # what to train
    Case("unknown trainer", "trainer 'grpoo'", "trainer: grpoo\n"),
    Case("unknown environment", "environment 'shoop'", "environment: shoop\n"),
    Case("environment_kwargs not JSON", "environment_kwargs", args=("--environment_kwargs", "{bad json")),
    Case("environment_kwargs unknown keyword", "environment_kwargs", "environment_kwargs: {colour: red}\n"),
    Case("difficulty out of range", "difficulty", "difficulty: 9\n"),
    Case("dataset file missing", "dataset_name", "dataset_name: {tmp}/no_such.jsonl\n"),
    Case(
        "dataset without prompt column",
        "prompt",
        "dataset_name: {tmp}/noprompt.jsonl\nreward_funcs: [exact_match_reward]\n",
        base=NO_ENV,
        setup="no_prompt_dataset",
    ),
    Case("unknown reward function", "reward_funcs", "reward_funcs: [no_such_reward]\n"),
    Case("reward_weights length", "reward_weights", "reward_weights: [1.0, 2.0]\n"),
    Case("unknown reward", "reward", "reward: bogus\n"),
    Case(
        "ppo without an environment",
        "trainer 'ppo' needs an environment",
        "trainer: ppo\ndataset_name: {tmp}/arith.jsonl\nreward_funcs: [exact_match_reward]\n",
        base=NO_ENV,
        setup="arith_dataset",
    ),
    # how many tasks and episodes
    Case("num_train_tasks 0", "num_train_tasks", args=("--num_train_tasks", "0")),
    Case("num_eval_tasks 0", "num_eval_tasks", args=("--num_eval_tasks", "0")),
    Case("num_eval_tasks huge", "num_eval_tasks", args=("--num_eval_tasks", "10000000")),
    Case("num_train_tasks huge", "num_train_tasks", args=("--num_train_tasks", "100000000")),
    Case("eval_samples 0", "eval_samples", "eval_samples: 0\n"),
    Case("eval_batch_size 0", "eval_batch_size", "eval_batch_size: 0\n"),
    Case("tiny_sft_steps negative", "tiny_sft_steps", "tiny_sft_steps: -1\n"),
    Case("tiny_num_demos 0", "tiny_num_demos", "tiny_num_demos: 0\n"),
    # optimisation
    Case("num_generations 0", "num_generations", "num_generations: 0\n"),
    Case("num_generations 1", "num_generations", "num_generations: 1\n"),
    Case("batch not divisible by num_generations", "num_generations", "num_generations: 3\n"),
    Case("num_iterations 0", "num_iterations", "num_iterations: 0\n"),
    Case("negative learning rate (space)", "learning_rate", args=("--learning_rate", "-1e-3")),
    Case("negative learning rate (=)", "learning_rate", args=("--learning_rate=-1e-3",)),
    Case("learning_rate not a number", "learning_rate", "learning_rate: abc\n"),
    Case("max_steps 0", "max_steps", "max_steps: 0\n"),
    Case("gradient_accumulation_steps 0", "gradient_accumulation_steps", "gradient_accumulation_steps: 0\n"),
    Case("steps_per_generation 0", "steps_per_generation", "steps_per_generation: 0\n"),
    Case("temperature 0", "temperature", "temperature: 0\n"),
    Case("top_p above 1", "top_p", "top_p: 1.5\n"),
    Case("beta negative", "beta", "beta: -0.1\n"),
    Case("epsilon negative", "epsilon", "epsilon: -0.2\n"),
    Case("unknown loss_type", "loss_type", "loss_type: bogus\n"),
    Case("seed negative", "seed", "seed: -1\n"),
    # budgets of an episode
    Case("max_turn_tokens 0", "max_turn_tokens", "max_turn_tokens: 0\n"),
    Case("max_turns 0", "max_turns", "max_turns: 0\n"),
    Case("max_completion_length 0", "max_completion_length", "max_completion_length: 0\n"),
    Case("env_timeout 0", "env_timeout", "env_timeout: 0\n"),
    Case(
        "max_completion_length below one turn", "max_completion_length", "max_completion_length: 8\n", expect="warning"
    ),
    Case(
        "max_completion_length below two turns",
        "max_completion_length",
        "max_completion_length: 40\n",
        expect="warning",
    ),
    Case("max_unscorable_frac above 1", "max_unscorable_frac", "max_unscorable_frac: 2\n"),
    Case("unscorable_patience 0", "unscorable_patience", "unscorable_patience: 0\n"),
    # the model
    Case(
        "model folder missing",
        "model_name_or_path",
        "model_name_or_path: /no/such/model\n",
        base=NO_MODEL,
    ),
    Case(
        "model folder without config.json",
        "model_name_or_path",
        "model_name_or_path: {tmp}/empty_model\n",
        base=NO_MODEL,
        setup="empty_model",
    ),
    Case(
        "unknown tiny environment",
        "model_name_or_path",
        "model_name_or_path: tiny:shoop\n",
        base=NO_MODEL,
    ),
    Case(
        "Hub id not cached offline",
        "model_name_or_path",
        "model_name_or_path: nosuchorg/nosuchmodel\n",
        base=NO_MODEL,
        env={"HF_HUB_OFFLINE": "1"},
    ),
    Case(
        "malformed Hub id",
        "model_name_or_path",
        "model_name_or_path: a/b/c/d\n",
        base=NO_MODEL,
    ),
    Case("lora_r 0", "lora_r", "use_peft: true\nlora_r: 0\n"),
    # where it writes, and resuming
    Case("output_dir not writable", "output_dir", args=("--output_dir", "{tmp}/a_file/run"), setup="a_file"),
    Case("output_dir disk full", "output_dir", setup="full_disk"),
    Case("resume path missing", "resume_from_checkpoint", "resume_from_checkpoint: {tmp}/no_such_checkpoint\n"),
    Case("resume true without checkpoints", "resume_from_checkpoint", "resume_from_checkpoint: true\n"),
    Case(
        "save_steps inside a generation batch",
        "save_steps",
        "steps_per_generation: 2\nsave_strategy: steps\nsave_steps: 3\n",
    ),
    Case("report_to not installed", "report_to", "report_to: [wandbx]\n"),
    # the config file itself
    Case("duplicated YAML key", "learning_rate", "learning_rate: 0.001\nlearning_rate: 0.01\n"),
    Case("unknown field", "learnin_rate", "learnin_rate: 0.1\n"),
    Case("config file missing", "no_such.yaml", base="", args=("--config", "{tmp}/no_such.yaml")),
    Case("YAML syntax error", "line", "learning_rate: [0.1\n"),
    Case("YAML not a mapping", "mapping", base="- a list\n- not a mapping\n"),
    # method fields
    Case("ppo vf_coef negative", "vf_coef", "trainer: ppo\nvf_coef: -1\n"),
    Case("ppo gamma above 1", "gamma", "trainer: ppo\ngamma: 1.5\n"),
    Case("gigpo step weight negative", "gigpo_step_weight", "trainer: gigpo\ngigpo_step_weight: -1\n"),
    Case("taspo unknown analyzer", "analyzer_backend", "trainer: taspo\nanalyzer_backend: bogus\n"),
    Case("draco openai judge without model", "judge_model", "trainer: draco\njudge_backend: openai\n"),
    Case(
        "draco judge unreachable",
        "judge_base_url",
        "trainer: draco\njudge_backend: openai\njudge_model: m\njudge_base_url: http://127.0.0.1:{port}/v1\n",
    ),
    Case("draco judge_votes 0", "judge_votes", "trainer: draco\njudge_votes: 0\n"),
    Case("alignopsd unknown pi", "alignopsd_pi", "trainer: alignopsd\nalignopsd_pi: bogus\n"),
    # issue 65: values TRL takes silently or fails on late, and what a new user types
    Case("temperature inf", "temperature", "temperature: .inf\n"),
    Case("max_grad_norm negative", "max_grad_norm", "max_grad_norm: -1\n"),
    Case("save_steps 0", "save_steps", "save_strategy: steps\nsave_steps: 0\n"),
    Case("use_vllm without vLLM", "use_vllm", "use_vllm: true\n"),
    Case("4-bit without LoRA", "load_in_4bit", "load_in_4bit: true\n"),
    Case(
        "API key pasted as judge_api_key_env",
        "judge_api_key_env",
        "trainer: draco\njudge_backend: oracle\njudge_api_key_env: sk-proj-abc123DEF456\n",
    ),
    Case("misspelled flag", "did you mean learning_rate", args=("--learnin_rate", "0.1")),
    Case("a prefix of a flag", "did you mean learning_rate", args=("--learning_rat", "0.1")),
    Case("config is a folder", "is a folder", base="", args=("--config", "{tmp}")),
    Case(
        "dataset with an empty prompt",
        "empty prompt",
        "dataset_name: {tmp}/empty_prompt.jsonl\nreward_funcs: [exact_match_reward]\n",
        base=NO_ENV,
        setup="empty_prompt_dataset",
    ),
    Case(
        "completion budget beyond the model",
        "max_completion_length",
        "model_name_or_path: {tmp}/short_model\nmax_completion_length: 100000000\nmax_turns: 1000000000\n",
        base=NO_MODEL,
        setup="short_model",
    ),
]


def empty_prompt_dataset(tmp: Path) -> None:
    (tmp / "empty_prompt.jsonl").write_text(
        '{"prompt": "1+1=", "answer": "2"}\n' * 7 + '{"prompt": "", "answer": "0"}\n'
    )


def short_model(tmp: Path) -> None:
    """A model folder whose config gives 1,024 positions (nothing loads it: start-up reads config.json)."""
    (tmp / "short_model").mkdir()
    (tmp / "short_model" / "config.json").write_text('{"model_type": "qwen2", "max_position_embeddings": 1024}')


def no_prompt_dataset(tmp: Path) -> None:
    (tmp / "noprompt.jsonl").write_text('{"question": "1+1", "answer": "2"}\n' * 8)


def arith_dataset(tmp: Path) -> None:
    (tmp / "arith.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n' * 8)


def empty_model(tmp: Path) -> None:
    (tmp / "empty_model").mkdir()


def full_disk(tmp: Path) -> None:
    """A disk with 1 MiB free, as `shutil.disk_usage` reports it to train.py (restored by `play`)."""
    import shutil

    real = shutil.disk_usage
    _RESTORE.append(lambda: setattr(shutil, "disk_usage", real))
    shutil.disk_usage = lambda path: real(path)._replace(free=2**20)


_RESTORE: list = []  # undo steps of a setup, run by `play` afterwards


def a_file(tmp: Path) -> None:
    (tmp / "a_file").write_text("a file, not a folder")


class ReachedModel(Exception):
    """Raised where a model would be built or loaded: the case passed start-up."""


class Hang(Exception):
    pass


def _sentinel(*args, **kwargs):
    raise ReachedModel


def merged(base: str, extra: str) -> str:
    """`base` YAML lines without the keys `extra` sets, then `extra` (which may set a key twice on purpose)."""
    keys = {line.split(":", 1)[0] for line in extra.splitlines() if ":" in line and not line.startswith(" ")}
    kept = [line for line in base.splitlines(keepends=True) if line.split(":", 1)[0] not in keys]
    return "".join(kept) + extra


def shown(message: str) -> str:
    """The line of a message a user reads first: the `error:` line if there is one, else the last line."""
    lines = [line for line in message.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or [""])[-1].strip()


def play(train, case: Case, tmp: Path, timeout: int = 60) -> tuple[str, str]:
    """Run one case in-process; returns (outcome, message)."""
    values = {"out": tmp / "out", "tmp": tmp, "port": _closed_port()}

    def fill(text: str) -> str:
        for key, value in values.items():
            text = text.replace("{" + key + "}", str(value))
        return text

    if case.setup:
        globals()[case.setup](tmp)
    argv = [fill(a) for a in case.args]
    if case.base or case.yaml:
        path = tmp / "run.yaml"
        path.write_text(fill(merged(case.base, case.yaml)))
        argv = ["--config", str(path), *argv]
    # the tiny builds, patched where resolve_model looks them up: agent_trl.run_info (train, in an older checkout)
    builds = [m for m in (train, sys.modules.get("agent_trl.run_info")) if m is not None]
    patches = [(m, n) for m in builds for n in ("tiny_model", "tiny_dataset_model")]
    patches += [(train, "AutoModelForCausalLM"), (train, "AutoTokenizer")]
    saved = {(m, n): getattr(m, n) for m, n in patches if hasattr(m, n)}
    stub = type("Stub", (), {"from_pretrained": staticmethod(_sentinel)})
    for (module, name), value in saved.items():
        setattr(module, name, _sentinel if callable(value) and not isinstance(value, type) else stub)
    old_env = {k: os.environ.get(k) for k in case.env}
    os.environ.update(case.env)
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record)

    handler = Keep(level=logging.WARNING)
    logging.getLogger().addHandler(handler)

    def alarm(signum, frame):
        raise Hang

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(timeout)
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            train.main(argv)
        outcome, message = "late", "returned"
    except ReachedModel:
        outcome, message = "late", "reached the model"
    except Hang:
        outcome, message = "hang", f"nothing after {timeout} s"
    except SystemExit as e:
        message = str(e.code) if isinstance(e.code, str) else err.getvalue()  # argparse prints, then exits 2
        outcome = "clear" if case.needle in message else "unclear"
    except Exception as e:  # noqa: BLE001 - a crash is what this bench counts
        outcome, message = "traceback", f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        logging.getLogger().removeHandler(handler)
        for (module, name), value in saved.items():
            setattr(module, name, value)
        while _RESTORE:
            _RESTORE.pop()()
        for k, v in old_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if case.expect == "warning":
        warned = [r.getMessage() for r in records if case.needle in r.getMessage()]
        if outcome == "late" and warned:
            outcome, message = "warned", warned[0]
    return outcome, message.strip()


def load_train(repo: Path):
    sys.path.insert(0, str(repo))
    os.chdir(repo)
    return importlib.import_module("train")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repo", type=Path, default=HERE, help="checkout whose train.py is probed")
    parser.add_argument("--out", type=Path, default=None, help="result folder (default bench/results/bad_inputs)")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    out = (args.out or HERE / "bench" / "results" / "bad_inputs").resolve()  # before load_train changes folder
    train = load_train(args.repo.resolve())
    rows, counts = [], {}
    for case in CASES:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.monotonic()
            outcome, message = play(train, case, Path(tmp))
        counts[outcome] = counts.get(outcome, 0) + 1
        rows.append(
            {
                "case": case.name,
                "expect": case.expect,
                "outcome": outcome,
                "message": message[-2000:],
                "seconds": round(time.monotonic() - start, 2),
            }
        )
        print(f"{outcome:9s} {case.name}: {shown(message)[:150]}", flush=True)
    print(counts)
    sys.path.insert(0, str(HERE))
    from bench.record import write_result

    table = "| outcome | cases |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in sorted(counts.items()))
    table += "\n| case | outcome | message |\n|---|---|---|\n"
    table += "".join(f"| {r['case']} | {r['outcome']} | {shown(r['message'])[:160]} |\n" for r in rows)
    out.mkdir(parents=True, exist_ok=True)
    write_result(
        out, "bad_inputs", {"repo": str(args.repo), "cases": len(CASES)}, {"counts": counts, "rows": rows}, table
    )


if __name__ == "__main__":
    main()
