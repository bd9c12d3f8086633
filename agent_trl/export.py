"""Export a trained model as a plain transformers folder, ready to serve, with a model card.

    python -m agent_trl.export --model RUN_OR_CHECKPOINT_OR_ADAPTER --out DIR [--no-merge] [--dtype auto] [--base B]
        [--config run.yaml] [--overwrite]

`--model` is one of:
* a run folder (train.py's `output_dir`): the saved model (a full model, or a LoRA adapter with `--use_peft`) and its
  `summary.json`;
* a checkpoint folder (`output_dir/checkpoint-N`): the model or adapter in it; `summary.json` is read from the run
  folder above it, and the card says its held-out numbers belong to the run's final model, not to this checkpoint;
* a LoRA adapter folder (`adapter_config.json`): merged into its base with peft's `merge_and_unload`. The base is
  adapter_config.json's `base_model_name_or_path` (for the tiny default a folder in `$AGENT_TRL_CACHE`), or `--base`;
  a QLoRA adapter is merged into the base loaded unquantized, in `--dtype`. With `--no-merge` the adapter is copied
  as it is (for `vllm serve BASE --enable-lora --lora-modules name=DIR`);
* a model folder (`config.json` and weights): loaded and saved again as it is (in `--dtype` when given).

"Ready for vLLM" means, concretely (each is checked by tests/test_export.py; vLLM itself is not installed here):
1. the weights are `*.safetensors` only (one file, or shards with `model.safetensors.index.json`): no `*.bin`, no
   optimizer state, no `adapter_config.json`, so `vllm serve DIR` loads a plain model, needing neither the base nor
   `--enable-lora`;
2. `config.json` names the model class in `architectures` (a `*ForCausalLM`, the key vLLM picks its implementation
   by) with `model_type` and `dtype`, and `use_cache: true` (training turns it off);
3. `generation_config.json` stops at the tokenizer's end-of-turn id (`eos_token_id` includes it; vLLM reads its
   default sampling settings and stop ids there);
4. the tokenizer (`tokenizer.json`, `tokenizer_config.json`) carries its chat template as `chat_template` inside
   tokenizer_config.json (not only in a `chat_template.jinja` beside it), with `eos_token` and `pad_token`:
   `/v1/chat/completions` renders conversations with the template the agent was trained under.
The folder is written by the transformers this project pins (5.x: `rope_parameters` in config.json, the tiny
default's tokenizer class `TokenizersBackend`), so "ready" means for a vLLM that runs on transformers 5 (as the vLLM
beside TRL 1.16's `use_vllm` does); a vLLM built on transformers 4.x may not read those keys.

The folder also gets `README.md`, a model card: the recipe (trainer, model, the run fields that differ from their
defaults, LoRA settings, and the YAML of `--config` when given), the data (environment or dataset, task counts), the
held-out numbers before and after training (summary.json), the versions trained and exported with, and how to load
and serve it. Without summary.json the model still exports and the card says what is unknown.

Nothing is half-written: the export is built in a hidden temporary folder beside `--out` and renamed into place at the
end. `--out` must not exist or be empty (or `--overwrite`, which replaces it only after the new one is complete).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
from datetime import UTC, datetime
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

DTYPES = ("auto", "float32", "bfloat16", "float16")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def fail(message: str) -> SystemExit:
    return SystemExit(f"error: {message}")


def has_weights(folder: Path) -> bool:
    """Whether `folder` holds a full model's weights (`training_args.bin` and adapter files are not)."""
    names = [f.name for f in folder.iterdir()]
    return any(n.endswith(".safetensors") and not n.startswith("adapter_") for n in names) or any(
        n.endswith(".bin") and n.startswith(("model", "pytorch_model")) for n in names
    )


def locate(path: str) -> tuple[Path, str, Path | None]:
    """(the folder holding the model, "adapter" or "model", summary.json or None) of `--model`."""
    from agent_trl.resume import checkpoints

    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise fail(f"--model {path!r} is not a folder (a run's output_dir, a checkpoint, an adapter or a model)")
    if (folder / "adapter_config.json").is_file():
        kind = "adapter"
    elif (folder / "config.json").is_file() and has_weights(folder):
        kind = "model"
    else:
        if found := checkpoints(str(folder)):  # a run stopped before its final save
            raise fail(
                f"--model {path!r} holds no saved model (no config.json with weights, no adapter_config.json), only "
                f"checkpoints; export one of them, e.g. --model {found[-1]}"
            )
        raise fail(
            f"--model {path!r} is not a model, adapter or run folder: it has no adapter_config.json and no "
            "config.json with *.safetensors or *.bin weights"
        )
    summary = next((p for p in (folder / "summary.json", folder.parent / "summary.json") if p.is_file()), None)
    if summary is not None and summary.parent != folder and not folder.name.startswith("checkpoint-"):
        summary = None  # a parent's summary.json describes that run, not an unrelated folder inside it
    return folder, kind, summary


def base_of(adapter: Path, base: str | None) -> str:
    """The base model of `adapter` (`--base` first), checked as train.py checks a model (`preflight.model_problem`:
    a folder with config.json, or a Hub id in the local cache when HF_HUB_OFFLINE forbids a download)."""
    from agent_trl.preflight import model_problem

    config = json.loads((adapter / "adapter_config.json").read_text())
    name = base or config.get("base_model_name_or_path")
    if not name:
        raise fail(f"{adapter}/adapter_config.json names no base model (base_model_name_or_path); give --base")
    if problem := model_problem(name):
        where = "--base" if base else f"the base model of {adapter}/adapter_config.json"
        raise fail(f"{where} cannot be found offline ({problem}); give --base FOLDER or --base HUB_ID")
    return os.path.expanduser(name)


def load_model(folder: Path, kind: str, base: str | None, dtype: str):
    """The model to save: a full model as it is, an adapter merged into its base (`merge_and_unload`)."""
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = dtype if dtype == "auto" else getattr(torch, dtype)
    source = base if kind == "adapter" else str(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except (OSError, ValueError) as e:
        raise fail(f"cannot load the model {source!r}: {e}") from e
    if kind == "adapter":
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, str(folder)).merge_and_unload()
        except (OSError, ValueError, RuntimeError) as e:  # e.g. an adapter of another base (shape mismatch)
            raise fail(f"cannot apply the adapter {folder} to its base {base!r}: {e}") from e
    return model


def load_tokenizer(folder: Path, base: str | None):
    from transformers import AutoTokenizer

    own = any((folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    source = str(folder) if own or base is None else base
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as e:
        raise fail(f"cannot load the tokenizer of {source!r}: {e}") from e


def stop_at_end_of_turn(generation_config, tokenizer) -> None:
    """Make the end-of-turn id one of `eos_token_id`, and give a pad id, so a server stops where the agent did."""
    eos = generation_config.eos_token_id
    ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    generation_config.eos_token_id = ids[0] if len(ids) == 1 else ids
    if generation_config.pad_token_id is None:
        generation_config.pad_token_id = tokenizer.pad_token_id


def drop_load_flags(path: Path) -> None:
    """Remove how this process loaded the tokenizer (`local_files_only`, `is_local`: transformers saves the flags of
    an offline load) from its tokenizer_config.json; they describe this machine, not the tokenizer."""
    config = json.loads(path.read_text())
    dropped = [config.pop(key) for key in ("local_files_only", "is_local") if key in config]
    if dropped:
        path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def out_problem(out: Path, source: Path, overwrite: bool) -> str | None:
    if out.exists() and not out.is_dir():
        return f"--out {str(out)!r} exists and is not a folder"
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        return f"--out {str(out)!r} exists and is not empty; choose another folder or add --overwrite"
    resolved, src = out.resolve(), source.resolve()
    if resolved == src or resolved in src.parents:
        return f"--out {str(out)!r} is the exported folder or holds it; choose a folder outside {str(source)!r}"
    return None


def export(
    model: str,
    out: str,
    merge: bool = True,
    dtype: str = "auto",
    base: str | None = None,
    config: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Export `model` (see the module docstring) into `out`; returns the folder written."""
    if dtype not in DTYPES:
        raise fail(f"--dtype {dtype!r} is not one of {DTYPES}")
    folder, kind, summary_path = locate(model)
    out_dir = Path(out).expanduser()
    if problem := out_problem(out_dir, folder, overwrite):
        raise fail(problem)
    if config is not None and not Path(config).is_file():
        raise fail(f"--config {config!r} is not a file")
    if not merge and kind != "adapter":
        raise fail(f"--no-merge keeps a LoRA adapter as it is; {folder} is a full model, not an adapter")
    base_name = base_of(folder, base) if kind == "adapter" else None
    try:
        summary = json.loads(summary_path.read_text()) if summary_path else None
    except (OSError, json.JSONDecodeError) as e:
        raise fail(f"{summary_path} cannot be read ({e})") from e
    tokenizer = load_tokenizer(folder, base_name)
    if not tokenizer.chat_template:
        print(f"warning: the tokenizer of {folder} has no chat template; /v1/chat/completions cannot render chats")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".partial", dir=out_dir.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary folder
        if merge:
            loaded = load_model(folder, kind, base_name, dtype)
            loaded.config.use_cache = True  # training turns the KV cache off; serving wants it
            stop_at_end_of_turn(loaded.generation_config, tokenizer)
            loaded.save_pretrained(tmp)  # safetensors (the default of transformers 5)
        else:
            for name in ADAPTER_FILES:
                if (folder / name).is_file():
                    shutil.copy2(folder / name, tmp / name)
        tokenizer.save_pretrained(tmp, save_jinja_files=False)  # the chat template inside tokenizer_config.json
        drop_load_flags(tmp / "tokenizer_config.json")
        card = model_card(
            summary=summary,
            summary_path=summary_path,
            source=folder,
            kind=kind,
            merged=merge,
            base=base_name,
            dtype=str(loaded.dtype).removeprefix("torch.") if merge else None,
            config_text=Path(config).read_text() if config else None,
            out=out_dir,
        )
        (tmp / "README.md").write_text(card)
        if problem := out_problem(out_dir, folder, overwrite):  # something appeared there meanwhile
            raise fail(problem)
        old = None
        if out_dir.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
            out_dir.rename(old / out_dir.name)
        try:
            tmp.rename(out_dir)
        except OSError:
            if old is not None:  # put the old folder back
                (old / out_dir.name).rename(out_dir)
                old.rmdir()
            raise
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


# ---------------------------------------------------------------------------------------------------------- model card


def _number(value) -> str:
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else f"{value:.3f}"
    return str(value)


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(_number(v) for v in row) + " |" for row in rows]


def _hub_id(name: str | None) -> bool:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not name or name.startswith(("/", ".", "~")) or name.count("/") != 1 or os.path.exists(name):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def recipe_section(summary: dict, config_text: str | None) -> list[str]:
    from agent_trl.arguments import RunArguments

    run = summary.get("run", {})
    defaults = {f.name: f.default for f in dataclasses.fields(RunArguments)}
    changed = [[f"`{k}`", f"`{json.dumps(v)}`"] for k, v in run.items() if k in defaults and v != defaults[k]]
    rows = [["trainer", f"`{summary.get('trainer', run.get('trainer', 'unknown'))}`"]]
    rows.append(["model trained", f"`{summary.get('model', 'unknown')}`"])
    steps = [row["step"] for row in summary.get("log_history", []) if "step" in row]
    if steps:
        rows.append(["optimizer steps", max(steps)])
    for key, name in [("rollouts_per_step", "rollouts per step"), ("wall_seconds", "wall time (s)")]:
        if key in summary:
            rows.append([name, summary[key]])
    params = summary.get("parameters")
    if params:
        rows.append(["parameters (trainable / total)", f"{params['trainable']:,} / {params['total']:,}"])
    adapter = summary.get("adapter") or {}
    if adapter.get("use_peft"):
        keys = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "load_in_4bit", "load_in_8bit")
        rows.append(["LoRA", ", ".join(f"{k}={adapter[k]}" for k in keys if k in adapter)])
    for key in ("stopped", "interrupted"):
        if key in summary:
            rows.append([key, f"`{json.dumps(summary[key])}`"])
    lines = ["## Recipe", ""] + _table(["", ""], rows) + [""]
    if changed:
        lines += ["Run fields that differ from their defaults (`agent_trl/arguments.py`):", ""]
        lines += _table(["field", "value"], changed) + [""]
    if config_text is not None:
        lines += ["The run's config file:", "", "```yaml", config_text.rstrip(), "```", ""]
    else:
        lines += [
            "The trainer's own settings (learning rate, batch sizes, KL, ...) are not in summary.json; the run's "
            "config file was not given (`--config`), so they are not recorded here.",
            "",
        ]
    return lines


def data_section(summary: dict) -> list[str]:
    run = summary.get("run", {})
    rows = []
    if run.get("environment"):
        rows.append(["environment", f"`{run['environment']}` (difficulty {run.get('difficulty', 0)})"])
        if run.get("environment_kwargs"):
            rows.append(["environment_kwargs", f"`{json.dumps(run['environment_kwargs'])}`"])
    if run.get("dataset_name"):
        rows.append(["dataset", f"`{run['dataset_name']}` (split `{run.get('dataset_train_split', 'train')}`)"])
    if summary.get("data"):
        rows.append(["described by the run", summary["data"]])
    if run.get("environment") and not run.get("dataset_name"):
        n = run.get("num_train_tasks")
        rows.append(["training tasks", f"{n} (task_seed {run.get('task_seed', 0)})" if n else "2000 (the default)"])
    if "num_eval_tasks" in run:
        k = run.get("eval_samples", 1)
        episodes = f"{k} sampled episode{'s' * (k > 1)} each, one greedy"
        rows.append(["held-out tasks", f"{run['num_eval_tasks']}: {episodes}"])
    audit = summary.get("audit_filter")
    if audit:
        rows.append(["task audit", f"kept {audit.get('kept')} of {audit.get('tasks')} training tasks"])
    return ["## Data", ""] + _table(["", ""], rows) + [""]


def results_section(summary: dict, checkpoint: bool) -> list[str]:
    before, after = summary.get("before"), summary.get("after")
    if not before and not after:
        return ["## Held-out results", "", "Unknown: the run skipped its held-out evaluation.", ""]
    rows = []
    for mode in ("sampled", "greedy"):
        metrics = dict.fromkeys([*((before or {}).get(mode, {})), *((after or {}).get(mode, {}))])
        for metric in metrics:
            values = [(side or {}).get(mode, {}).get(metric, "-") for side in (before, after)]
            rows.append([mode, metric, *values])
    lines = ["## Held-out results", ""]
    lines += ["Held-out tasks (the eval split, never trained on), before and after training (summary.json):", ""]
    lines += _table(["decoding", "metric", "before", "after"], rows) + [""]
    if checkpoint:
        lines += ["This export is a checkpoint: `after` belongs to the run's final model, not to this checkpoint.", ""]
    return lines


def versions_section(summary: dict | None) -> list[str]:
    from agent_trl.run_info import versions

    now = versions()
    trained = (summary or {}).get("versions", {})
    rows = [[name, trained.get(name, "unknown") if summary else "unknown", now.get(name)] for name in now]
    return ["## Versions", ""] + _table(["package", "trained with", "exported with"], rows) + [""]


def usage_section(out: Path, merged: bool, base: str | None, environment: str | None) -> list[str]:
    d = str(out)
    env = environment or "shop"
    if not merged:
        return [
            "## Load and serve",
            "",
            "A LoRA adapter (not merged). Load it on its base:",
            "",
            "```python",
            "from peft import AutoPeftModelForCausalLM",
            "from transformers import AutoTokenizer",
            f'model = AutoPeftModelForCausalLM.from_pretrained("{d}")',
            f'tokenizer = AutoTokenizer.from_pretrained("{d}")',
            "```",
            "",
            "```bash",
            f"vllm serve {base} --enable-lora --lora-modules agent={d}",
            f"python -m agent_trl.play --base_url http://127.0.0.1:8000/v1 --model agent --environment {env}",
            "```",
            "",
        ]
    return [
        "## Load and serve",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'model = AutoModelForCausalLM.from_pretrained("{d}")',
        f'tokenizer = AutoTokenizer.from_pretrained("{d}")',
        "```",
        "",
        "An OpenAI-compatible server (either), then one episode against it:",
        "",
        "```bash",
        f"transformers serve {d} --host 127.0.0.1 --port 8000      # pip install -e '.[envs]' (fastapi, uvicorn)",
        f"vllm serve {d} --port 8000",
        f"python -m agent_trl.play --base_url http://127.0.0.1:8000/v1 --environment {env}",
        "```",
        "",
    ]


def model_card(
    summary: dict | None,
    summary_path: Path | None,
    source: Path,
    kind: str,
    merged: bool,
    base: str | None,
    dtype: str | None,
    config_text: str | None,
    out: Path,
) -> str:
    """The README.md of an export: front matter, then recipe, data, held-out results, versions, load and serve."""
    run = (summary or {}).get("run", {})
    trainer = (summary or {}).get("trainer") or run.get("trainer")
    tags = ["agent-trl", "trl", *([trainer] if trainer else []), *(["lora"] if kind == "adapter" else [])]
    front = ["---", f"library_name: {'transformers' if merged else 'peft'}", "pipeline_tag: text-generation", "tags:"]
    front += [f"- {t}" for t in tags]
    if _hub_id(base):
        front.append(f"base_model: {base}")
    front.append("---")
    what = "LoRA adapter" if kind == "adapter" else "model"
    how = f"merged into its base `{base}`" if kind == "adapter" and merged else ""
    how = how or (f"on the base `{base}`, not merged" if kind == "adapter" else "saved as it was trained")
    lines = front + ["", f"# {out.name}", ""]
    lines += [
        f"An agent trained with agent-trl (a trainer for LLM agents on TRL): the {what} of `{source}`, {how}"
        + (f", weights in {dtype}" if dtype else "")
        + f". Exported by `python -m agent_trl.export` on {datetime.now(UTC):%Y-%m-%d}.",
        "",
    ]
    if summary is None:
        lines += [
            "## Training",
            "",
            f"Unknown: no summary.json was found in `{source}`"
            + (" or the run folder above it" if source.name.startswith("checkpoint-") else "")
            + ". The recipe (trainer and settings), the data, the held-out results before and after training and "
            "the versions it was trained with are not recorded.",
            "",
        ]
        if config_text is not None:
            lines += ["The run's config file (`--config`):", "", "```yaml", config_text.rstrip(), "```", ""]
    else:
        lines += [f"Facts below are read from `{summary_path}`.", ""]
        lines += recipe_section(summary, config_text)
        lines += data_section(summary)
        lines += results_section(summary, checkpoint=summary_path.parent != source)
    lines += versions_section(summary)
    lines += usage_section(out, merged, base, run.get("environment"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(prog="python -m agent_trl.export", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="A run folder, a checkpoint, a LoRA adapter or a model folder.")
    parser.add_argument("--out", required=True, help="Folder to write (must not exist, or be empty).")
    parser.add_argument(
        "--merge",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Merge a LoRA adapter into its base (default); --no-merge copies the adapter as it is.",
    )
    parser.add_argument("--dtype", default="auto", choices=DTYPES, help="Weights' dtype (auto: as saved).")
    parser.add_argument("--base", default=None, help="Base model of an adapter (default: its adapter_config.json's).")
    parser.add_argument("--config", default=None, help="The run's YAML config, copied into the model card.")
    parser.add_argument("--overwrite", action="store_true", help="Replace a non-empty --out (once the new is done).")
    args = parser.parse_args(argv)
    out = export(args.model, args.out, args.merge, args.dtype, args.base, args.config, args.overwrite)
    print(f"exported {args.model} -> {out}")
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
