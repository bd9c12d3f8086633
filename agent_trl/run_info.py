"""The model a run trains (`tiny`, `tiny:<env>` resolved to a built folder; any other name as given) and the facts
summary.json records about the run: LoRA / quantization settings, package versions, parameter counts."""

from __future__ import annotations

import json

from agent_trl.arguments import RunArguments
from agent_trl.sources import Sources
from envs import ENVIRONMENTS
from envs.adapters import is_adapter_spec
from envs.tiny import is_tiny, tiny_dataset_model, tiny_model


def resolve_model(name: str, run: RunArguments, sources: Sources) -> str:
    """The folder or Hub id to load: `tiny` (a dataset) and `tiny:<env>` are built, or read from the cache, with the
    run's tiny_* sizes; any other name is returned as given."""
    if not is_tiny(name):
        return name
    if name == "tiny" and sources.environment is None:  # a tiny default for the dataset, warm-started on its answers
        sizes = {"sft_steps": run.tiny_sft_steps, "num_demos": run.tiny_num_demos}
        sizes = {k: v for k, v in sizes.items() if v is not None}  # unset: the build's defaults
        if run.tiny_privileged_frac:
            raise SystemExit("error: tiny_privileged_frac needs an environment (its privileged text); not a dataset")
        return tiny_dataset_model(list(sources.train), seed=run.tiny_seed, **sizes)
    if ":" not in name:
        raise SystemExit(
            f"error: model_name_or_path {name!r}: `tiny` alone is the tiny default of a single-turn dataset; for an "
            f"environment it is tiny:<env> (tiny:{'|tiny:'.join(sorted(ENVIRONMENTS))}), and for your own "
            "environment name a model folder or Hub id"
        )
    settings = sources.environment_kwargs  # an ecosystem environment's tasks depend on them (envs/adapters/)
    sizes = {
        "sft_steps": run.tiny_sft_steps,
        "num_demos": run.tiny_num_demos,
        "privileged_frac": run.tiny_privileged_frac,
        "env_kwargs": json.dumps(settings, sort_keys=True) if settings and is_adapter_spec(run.environment) else None,
    }
    sizes = {k: v for k, v in sizes.items() if v is not None}  # unset: the build's defaults
    return tiny_model(name, difficulty=run.difficulty, seed=run.tiny_seed, **sizes)


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


def count_parameters(model) -> dict:
    """Trainable and total parameters of `model` (with LoRA, trainable counts only the adapters)."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return {"trainable": trainable, "total": total}
