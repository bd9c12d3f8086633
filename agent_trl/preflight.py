"""Start-up checks of a run's fields, model, output_dir and tracker: each mistake that would otherwise fail late (after
a model load, or at the final save), crash without naming itself, stall, or train on nothing stops here with a
message naming the field."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import re
import shutil
import tempfile

from agent_trl.arguments import RunArguments
from agent_trl.real_model import is_real
from agent_trl.real_model import model_problem as real_model_problem
from envs import ENVIRONMENTS
from envs.adapters import is_adapter_spec
from envs.tiny import is_tiny
from rewards.judge import check_endpoint

logger = logging.getLogger(__name__)


#: Most tasks a run generates: making and resetting tasks is not free (about 4,000 a second on tiny:shop), and
#: evaluation plays every held-out task several times; above these a mistyped number would stall start-up for minutes.
MAX_TRAIN_TASKS, MAX_EVAL_TASKS = 200_000, 20_000


def check_run(run: RunArguments, config, model_args) -> None:
    """Fields whose bad values would otherwise fail late (after a model load, or at the final save), crash without
    naming themselves, stall, or train on nothing: each stops here with a message naming the field. (The trainer
    configs check their own fields when they are built; see `trainers.base.check_sampling_and_batches`.)"""
    problems = [
        f"{name} must be >= {low}, got {value}"
        for name, value, low in [
            ("eval_samples", run.eval_samples, 1),
            ("eval_batch_size", run.eval_batch_size, 1),
            ("num_train_tasks", run.num_train_tasks, 1),
            ("num_eval_tasks", run.num_eval_tasks, 1),
            ("tiny_sft_steps", run.tiny_sft_steps, 0),
            ("tiny_num_demos", run.tiny_num_demos, 1),
            ("tiny_noise", run.tiny_noise, 0),
            ("tiny_privileged_frac", run.tiny_privileged_frac, 0),
            ("tiny_guidance_frac", run.tiny_guidance_frac, 0),
        ]
        if value is not None and value < low
    ]
    for name, value, most in [
        ("num_train_tasks", run.num_train_tasks, MAX_TRAIN_TASKS),
        ("num_eval_tasks", run.num_eval_tasks, MAX_EVAL_TASKS),
    ]:
        if value is not None and value > most:
            problems.append(f"{name} {value:,} is more than the {most:,} a run generates; give a smaller number")
    for name in ("tiny_noise", "tiny_privileged_frac", "tiny_guidance_frac"):
        if (value := getattr(run, name)) is not None and value > 1:
            problems.append(f"{name} must be in [0, 1], got {value}")
    shares = (run.tiny_privileged_frac, run.tiny_guidance_frac)
    if None not in shares and all(0 <= x <= 1 for x in shares) and sum(shares) > 1:
        problems.append(
            f"tiny_privileged_frac + tiny_guidance_frac must be at most 1, got {run.tiny_privileged_frac} + "
            f"{run.tiny_guidance_frac}"
        )
    if config.max_steps == 0:
        problems.append("max_steps 0 trains nothing; give a positive number (or -1 to train by num_train_epochs)")
    if getattr(model_args, "use_peft", False) and model_args.lora_r < 1:
        problems.append(f"lora_r must be >= 1 with use_peft, got {model_args.lora_r}")
    if problem := model_problem(model_args.model_name_or_path):
        problems.append(problem)
    for role in ("judge", "analyzer", "editor"):  # an API judge that cannot answer would make every reward None
        if getattr(config, f"{role}_backend", None) == "openai" or getattr(config, role, None) == "openai":
            base_url, key_env = getattr(config, f"{role}_base_url"), getattr(config, f"{role}_api_key_env")
            timeout = min(float(getattr(config, f"{role}_timeout", 30.0)), 30.0)
            if problem := check_endpoint(base_url, key_env, timeout):
                problems.append(f"{role}_base_url / {role}_api_key_env: {problem}")
    if problem := hub_problem(config):
        problems.append(problem)
    problems += field_problems(config, model_args)
    if problems:
        raise SystemExit("error: " + "; ".join(problems))
    try:  # a run that cannot save its model must not train first
        os.makedirs(config.output_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=config.output_dir):
            pass
    except OSError as e:
        raise SystemExit(f"error: output_dir {config.output_dir!r} cannot be written: {e}") from e
    if problem := disk_problem(config.output_dir, model_args.model_name_or_path, model_args.use_peft):
        raise SystemExit(f"error: {problem}")
    multi_turn = run.dataset_name is None or (run.environment or "none").lower() != "none"
    if multi_turn and config.max_completion_length < 2 * config.max_turn_tokens:
        logger.warning(
            "max_completion_length %d is less than two turns of max_turn_tokens %d: a multi-turn episode will be cut "
            "after its first turn",
            config.max_completion_length,
            config.max_turn_tokens,
        )


#: an environment variable's name: what `*_api_key_env` holds (the key itself must never reach a config or a log)
VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def field_problems(config, model_args) -> list[str]:
    """Values that TRL or transformers would take silently, or fail on only after the model load: each named with
    what to give instead. A `*_api_key_env` that is not a variable name is refused without echoing it (it is most
    likely the key itself, which would otherwise be printed and saved in training_args.bin)."""
    problems = []
    temperature = getattr(config, "temperature", 1.0)
    if temperature is not None and not (math.isfinite(temperature) and temperature > 0):
        problems.append(f"temperature must be a finite number > 0, got {temperature} (inf samples uniformly)")
    norm = getattr(config, "max_grad_norm", None)
    if norm is not None and not (math.isfinite(norm) and norm >= 0):
        problems.append(f"max_grad_norm must be a finite number >= 0 (0 turns clipping off), got {norm}")
    strategy = getattr(config, "save_strategy", "no")
    if str(getattr(strategy, "value", strategy)) == "steps" and config.save_steps <= 0:
        problems.append(f"save_steps must be > 0 with save_strategy steps, got {config.save_steps}")
    for name in ("judge_api_key_env", "analyzer_api_key_env", "editor_api_key_env"):
        value = getattr(config, name, None)
        if value is not None and not VARIABLE_NAME.fullmatch(value):
            problems.append(
                f"{name} names the environment variable that holds the key (e.g. OPENAI_API_KEY), and the value "
                "given is not a variable name (not shown here, in case it is the key itself); export the key as a "
                f"variable and give its name"
            )
    if getattr(config, "use_vllm", False) and importlib.util.find_spec("vllm") is None:
        problems.append("use_vllm needs vLLM, which is not installed (pip install vllm, on a machine with a GPU)")
    four, eight = getattr(model_args, "load_in_4bit", False), getattr(model_args, "load_in_8bit", False)
    if (four or eight) and not model_args.use_peft:
        bits = "load_in_4bit" if four else "load_in_8bit"
        problems.append(f"{bits} trains quantized weights only through an adapter: add use_peft (QLoRA)")
    return problems


def context_problem(config, folder: str) -> str | None:
    """A completion budget beyond the model's positions would run past its context (or, with a never-ending
    environment, never end): refused at start-up, with the model's number. Unknown for a model without
    `max_position_embeddings` in its config."""
    path = os.path.join(os.path.expanduser(folder), "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        model_config = json.load(f)
    positions = model_config.get("max_position_embeddings") or model_config.get("text_config", {}).get(
        "max_position_embeddings"
    )
    budget = config.max_completion_length
    if positions and budget is not None and budget >= positions:
        return (
            f"max_completion_length {budget:,} is not below the model's {positions:,} positions (the prompt needs "
            "some too); give a smaller number"
        )
    return None


def hub_problem(config) -> str | None:
    """Why `push_to_hub` cannot work, found at start-up: TRL's trainer creates the Hub repository when it is built
    (after the model load and the held-out evaluation before training) and pushes at every save and at the end, so an
    offline Hub or a missing token would fail after that work, or after training, before summary.json is written.
    Refused here instead, before anything runs: the Hub is off (HF_HUB_OFFLINE), no token is known (`hub_token`,
    HF_TOKEN or `hf auth login`), or the Hub does not accept the token (one `whoami` call). A connection that drops
    after start-up still fails TRL's final push, after the model is saved in output_dir but before summary.json."""
    if not getattr(config, "push_to_hub", False):
        return None
    from huggingface_hub import HfApi, constants, get_token

    fix = "train without push_to_hub (the model is saved in output_dir) and upload it later (`hf upload`)"
    if constants.HF_HUB_OFFLINE:
        return f"push_to_hub needs the Hugging Face Hub, and HF_HUB_OFFLINE is set; unset it, or {fix}"
    token = config.hub_token or get_token()
    if not token:
        where = "hub_token, HF_TOKEN or `hf auth login`"
        return f"push_to_hub needs a Hub token ({where}) and none is set; log in, or {fix}"
    try:
        HfApi().whoami(token=token)
    except Exception as e:  # unreachable, or a rejected token: the error says which
        return f"push_to_hub: the Hub did not accept the token ({type(e).__name__}: {e}); fix it, or {fix}"
    return None


MIN_FREE_BYTES = 100 * 2**20  # the floor of free space: a tiny run's checkpoints and summary take a few MiB


def disk_problem(output_dir: str, model: str | None, use_peft: bool) -> str | None:
    """Whether output_dir's disk can hold what the run writes, judged before training: a checkpoint holds the weights
    and, without LoRA, Adam's two moments (3x the weights), and the final model once more. Weights are known for a
    model folder; otherwise only the floor (`MIN_FREE_BYTES`) is checked. A full disk mid-save leaves an incomplete
    checkpoint, which resuming skips (`checkpoint_complete`), but the time since the last checkpoint is lost."""
    free = shutil.disk_usage(output_dir).free
    weights = 0
    if model and os.path.isdir(os.path.expanduser(model)):
        folder = os.path.expanduser(model)
        weights = sum(
            os.path.getsize(os.path.join(folder, f))
            for f in os.listdir(folder)
            if f.endswith((".safetensors", ".bin"))
        )
    need = max(MIN_FREE_BYTES, (weights // 10 if use_peft else 4 * weights))
    if free < need:
        return (
            f"output_dir {output_dir!r} has {free / 2**20:,.0f} MiB free; a checkpoint and the final model need about "
            f"{need / 2**20:,.0f} MiB. Free space or choose another output_dir"
        )
    return None


def model_problem(name: str | None) -> str | None:
    """Why `model_name_or_path` cannot be loaded, found without loading it; None when it looks loadable."""
    if not name:
        return None  # asked for after the data is checked (main)
    if is_real(name):
        return real_model_problem(name)
    if is_tiny(name):
        kind, _, env = name.partition(":")
        if env and env not in ENVIRONMENTS and not is_adapter_spec(env):
            return (
                f"model_name_or_path {name!r}: no tiny default for {env!r}; use {kind}:<one of {sorted(ENVIRONMENTS)}>"
            )
        return None
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            return f"model_name_or_path {name!r} is a folder without config.json, not a saved model"
        return None
    if name.startswith(("/", "./", "../", "~")) or os.path.exists(path):
        return f"model_name_or_path {name!r} is not a folder"
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return f"model_name_or_path {name!r} is neither a folder nor a Hub model id (owner/name)"
    if constants.HF_HUB_OFFLINE and not isinstance(try_to_load_from_cache(name, "config.json"), str):
        return (
            f"model_name_or_path {name!r} is not a folder and not in the local Hugging Face cache, and HF_HUB_OFFLINE "
            "forbids a download"
        )
    return None


def check_report_to(config) -> None:
    """An experiment tracker that is not installed fails here, at start-up, not after the first evaluation."""
    from transformers.integrations import get_available_reporting_integrations

    available = get_available_reporting_integrations()
    missing = [name for name in config.report_to or [] if name not in ("none", "all") and name not in available]
    if missing:
        raise SystemExit(
            f"error: report_to {missing} is not installed (installed trackers: {available or 'none'}); install it, "
            "or use report_to: tensorboard (installed by requirements.txt) or none"
        )
