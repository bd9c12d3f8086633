"""`agent_trl.run_info`: which model a run loads (`resolve_model`, the tiny builds stubbed out) and the facts
summary.json records about it: adapter settings, package versions, parameter counts."""

import importlib.metadata
from types import SimpleNamespace

import pytest
import torch
import transformers
import trl
from trl import ModelConfig

from agent_trl.arguments import RunArguments
from agent_trl.run_info import adapter_settings, count_parameters, resolve_model, versions
from tests.helpers.run_info import sources


@pytest.mark.parametrize("name", ["Qwen/Qwen3-0.6B", "/models/mine", "tinyllama/TinyLlama-1.1B"])
def test_other_names_are_loaded_as_given(builds, name):
    assert resolve_model(name, RunArguments(), sources()) == name and builds == []


def test_tiny_for_a_dataset_builds_on_its_rows(builds):
    rows = [{"prompt": "1+1=", "answer": "2"}]
    run = RunArguments(tiny_seed=3, tiny_sft_steps=5)  # tiny_num_demos unset: the build's default
    assert resolve_model("tiny", run, sources(train=rows)) == "/built/tiny_dataset_model"
    assert builds == [("tiny_dataset_model", (rows,), {"seed": 3, "sft_steps": 5})]


def test_tiny_for_a_dataset_has_no_privileged_text(builds):
    with pytest.raises(SystemExit, match="^error: tiny_privileged_frac needs an environment"):
        resolve_model("tiny", RunArguments(tiny_privileged_frac=0.5), sources())
    assert builds == []


@pytest.mark.parametrize(("name", "built"), [("tiny", "tiny:terminal"), ("tiny-moe", "tiny-moe:terminal")])
def test_tiny_alone_is_the_tiny_default_of_the_runs_environment(builds, name, built):
    run = RunArguments(environment="terminal")
    assert resolve_model(name, run, sources(environment=object())) == "/built/tiny_model"
    assert builds == [("tiny_model", (built,), {"difficulty": 0, "seed": 0})]


def test_tiny_moe_alone_without_an_environment_is_refused(builds):
    message = "^error: model_name_or_path 'tiny-moe': tiny-moe is the tiny default of the run's environment, and this "
    with pytest.raises(SystemExit, match=message + "run has none; for a single-turn dataset it is `tiny`"):
        resolve_model("tiny-moe", RunArguments(), sources())
    assert builds == []


def test_tiny_for_an_environment_passes_the_set_sizes_only(builds):
    run = RunArguments(environment="shop", difficulty=1, tiny_seed=2, tiny_num_demos=7, tiny_privileged_frac=0.25)
    assert resolve_model("tiny-moe:shop", run, sources(environment=object())) == "/built/tiny_model"
    expected = {"difficulty": 1, "seed": 2, "num_demos": 7, "privileged_frac": 0.25}  # no sft_steps, no env_kwargs
    assert builds == [("tiny_model", ("tiny-moe:shop",), expected)]


def test_the_guidance_share_reaches_the_build(builds):
    run = RunArguments(environment="search", tiny_guidance_frac=0.5)
    resolve_model("tiny:search", run, sources(environment=object()))
    assert builds == [("tiny_model", ("tiny:search",), {"difficulty": 0, "seed": 0, "guidance_frac": 0.5})]
    with pytest.raises(SystemExit, match="^error: tiny_guidance_frac needs an environment"):
        resolve_model("tiny", RunArguments(tiny_guidance_frac=0.5), sources())


def test_the_noise_reaches_either_build(builds):
    run = RunArguments(environment="shop", difficulty=2, tiny_noise=0.1)
    resolve_model("tiny:shop", run, sources(environment=object()))
    rows = [{"prompt": "1+1=", "answer": "2"}]
    resolve_model("tiny", RunArguments(tiny_noise=0.0), sources(train=rows))  # 0 is a value: no noise, not unset
    assert builds == [
        ("tiny_model", ("tiny:shop",), {"difficulty": 2, "seed": 0, "noise": 0.1}),
        ("tiny_dataset_model", (rows,), {"seed": 0, "noise": 0.0}),
    ]


def test_an_ecosystem_environment_passes_its_settings_sorted(builds):
    run = RunArguments(environment="reasoning_gym:aiw")
    settings = {"size": 40, "seed": 1}
    resolve_model("tiny:reasoning_gym:aiw", run, sources(environment=object(), environment_kwargs=settings))
    assert builds[0][2]["env_kwargs"] == '{"seed": 1, "size": 40}'
    builds.clear()  # a built-in environment's kwargs do not change its tasks' build: not passed
    shop = sources(environment=object(), environment_kwargs={"a": 1})
    resolve_model("tiny:shop", RunArguments(environment="shop"), shop)
    assert "env_kwargs" not in builds[0][2]


def test_adapter_settings_records_the_lora_and_quantization_fields():
    args = ModelConfig(model_name_or_path="m", use_peft=True, lora_r=8, load_in_4bit=True)
    assert adapter_settings(args) == {
        "use_peft": True, "lora_r": 8, "lora_alpha": args.lora_alpha, "lora_dropout": args.lora_dropout,
        "lora_target_modules": args.lora_target_modules, "load_in_4bit": True, "load_in_8bit": False,
        "bnb_4bit_quant_type": args.bnb_4bit_quant_type, "use_bnb_nested_quant": args.use_bnb_nested_quant,
    }  # fmt: skip
    assert adapter_settings(SimpleNamespace(use_peft=False, other=1)) == {"use_peft": False}  # fields present only


def test_versions_names_every_runtime_package(monkeypatch):
    found = versions()
    assert list(found) == ["torch", "trl", "transformers", "peft", "accelerate", "datasets", "bitsandbytes"]
    assert found["trl"] == trl.__version__ and found["transformers"] == transformers.__version__
    real = importlib.metadata.version

    def version(name):
        if name == "bitsandbytes":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert versions()["bitsandbytes"] is None


def test_count_parameters():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))  # (3x2 + 2) + (2x1 + 1) = 11
    assert count_parameters(model) == {"trainable": 11, "total": 11, "quantized": 0}
    model[0].weight.requires_grad_(False)  # 6 frozen
    assert count_parameters(model) == {"trainable": 5, "total": 11, "quantized": 0}


def test_a_4bit_model_counts_its_layers_not_its_packed_bytes(tiny_model_folder):
    """Issue 39: QLoRA counted the packed 4-bit storage (two parameters a byte) as the total. Loaded in 4 bits on
    the CPU (bitsandbytes), the tiny model counts what it counts unquantized, and its linear layers as quantized."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    full = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")
    packed = AutoModelForCausalLM.from_pretrained(
        tiny_model_folder, quantization_config=quantization, device_map="cpu", dtype=torch.float32
    )
    total = sum(p.numel() for p in full.parameters())
    layers = [m for m in full.model.layers.modules() if isinstance(m, torch.nn.Linear)]  # what bitsandbytes packs
    assert sum(p.numel() for p in packed.parameters()) < total  # the storage: half of each packed weight
    counted = count_parameters(packed)
    assert counted["total"] == total
    assert counted["quantized"] == sum(m.weight.numel() for m in layers) > 0


def test_a_qlora_run_says_it_quantized(tmp_path, monkeypatch, capsys):
    """Issue 39: a QLoRA run prints that it quantized (bits, type, how many parameters) and counts the real total."""
    import train

    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    argv = ["--environment", "shop", "--model_name_or_path", "tiny:shop", "--use_peft", "--lora_r", "4"]
    argv += ["--lora_target_modules", "all-linear", "--load_in_4bit", "--skip_eval", "true", "--max_steps", "1"]
    argv += ["--num_train_tasks", "8", "--per_device_train_batch_size", "4", "--num_generations", "2"]
    argv += ["--max_turn_tokens", "4", "--max_completion_length", "32", "--output_dir", str(tmp_path / "run")]
    argv += ["--use_cpu", "true", "--report_to", "none", "--save_strategy", "no"]
    summary = train.main(argv)
    out = capsys.readouterr().out
    p = summary["parameters"]
    assert f"quantized to 4-bit nf4 with bitsandbytes: {p['quantized']:,} of {p['total']:,} parameters" in out
    assert 0 < p["trainable"] < p["quantized"] < p["total"]
