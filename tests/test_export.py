"""`agent_trl.export`: a LoRA adapter merged into its base generates what base + adapter generate, the folder is what
"ready for vLLM" promises (module docstring), the model card carries summary.json's facts, and every refusal is clear
and leaves nothing half-written. Also `push_to_hub` with the Hub offline: refused at start-up, before any model."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from huggingface_hub import constants
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from agent_trl import export as export_module
from agent_trl import run_info
from agent_trl.export import export
from agent_trl.preflight import hub_problem
from trainers.reporting import write_summary

PROMPT = [{"role": "user", "content": "say river"}]

#: what a run of train.py records (keys as train.main writes them); the numbers are made up and distinct
SUMMARY = {
    "run": {"trainer": "gigpo", "environment": "shop", "difficulty": 1, "num_train_tasks": 64, "num_eval_tasks": 20,
            "eval_samples": 2, "task_seed": 3},
    "model": "tiny:shop",
    "trainer": "gigpo",
    "data": "shop tasks",
    "adapter": {"use_peft": True, "lora_r": 4, "lora_alpha": 64, "lora_dropout": 0.0,
                "lora_target_modules": "all-linear"},
    "versions": {"torch": "9.9.9-trained", "trl": "1.16.0", "transformers": "5.24.0", "peft": "0.21.2"},
    "before": {"sampled": {"success": 0.125, "reward": 0.25}, "greedy": {"success": 0.375, "reward": 0.5}},
    "after": {"sampled": {"success": 0.625, "reward": 0.75}, "greedy": {"success": 0.875, "reward": 1.0}},
    "parameters": {"trainable": 1234, "total": 56789},
    "rollouts_per_step": 16.0,
    "log_history": [{"loss": 0.1, "step": 1}, {"loss": 0.2, "step": 7}],
}  # fmt: skip


def greedy_ids(model, tokenizer, n: int = 12) -> list[int]:
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)  # no early stop: n to compare
    return out[0, ids["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def run_folder(tiny_model_folder, tiny_tokenizer, tmp_path_factory):
    """A run folder as train.py leaves it with --use_peft: a LoRA adapter (random nonzero A and B, large scale so it
    changes greedy tokens), the tokenizer and summary.json; its base is tiny_model_folder."""
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    config = LoraConfig(r=4, lora_alpha=64, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(base, config)
    with torch.no_grad():  # peft's random init of B is small; scale it up so the adapter moves the greedy tokens
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.5)
    folder = tmp_path_factory.mktemp("runs") / "run"
    peft_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    write_summary(folder / "summary.json", SUMMARY)
    return folder


def test_merged_model_generates_what_base_plus_adapter_generates(run_folder, tiny_model_folder, tmp_path):
    out = export(str(run_folder), str(tmp_path / "merged"))
    tokenizer = AutoTokenizer.from_pretrained(out)
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_folder)
    base_ids = greedy_ids(base, tokenizer)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_folder), str(run_folder))
    adapted_ids = greedy_ids(adapted, tokenizer)
    assert adapted_ids != base_ids  # the adapter matters, so equality below says the merge happened
    assert greedy_ids(merged, tokenizer) == adapted_ids
    ids = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        torch.testing.assert_close(merged(**ids).logits, adapted(**ids).logits, rtol=1e-4, atol=1e-5)
    assert not any("lora" in name for name, _ in merged.named_parameters())


def test_export_is_ready_for_vllm(run_folder, tiny_tokenizer, tmp_path):
    out = export(str(run_folder), str(tmp_path / "merged"))
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )  # fmt: skip  (1: safetensors only; no *.bin, adapter files, optimizer state or stray jinja file)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["model_type"] == "qwen2"  # 2
    assert config["dtype"] == "float32" and config["use_cache"] is True
    generation = json.loads((out / "generation_config.json").read_text())
    eos = generation["eos_token_id"]
    assert tiny_tokenizer.eos_token_id in (eos if isinstance(eos, list) else [eos])  # 3: stops at <|im_end|>
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["chat_template"] == tiny_tokenizer.chat_template  # 4: the template the agent trained under
    assert tok_config["eos_token"] == "<|im_end|>" and tok_config["pad_token"] == tiny_tokenizer.pad_token
    assert "local_files_only" not in tok_config and "is_local" not in tok_config
    reloaded = AutoTokenizer.from_pretrained(out)
    rendered = reloaded.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert rendered == tiny_tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert (out.stat().st_mode & 0o777) != 0o700  # an ordinary folder, not mkdtemp's private one


def test_the_model_card_carries_the_summary(run_folder, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("trainer: gigpo\nlearning_rate: 7.5e-4  # a recipe line\n")
    out = export(str(run_folder), str(tmp_path / "merged"), dtype="bfloat16", config=str(config))
    card = (out / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\n") and "- gigpo\n" in card
    assert "| trainer | `gigpo` |" in card and "| model trained | `tiny:shop` |" in card
    assert "| optimizer steps | 7 |" in card and "| rollouts per step | 16 |" in card  # the last logged step
    assert "| parameters (trainable / total) | 1,234 / 56,789 |" in card
    assert "lora_r=4, lora_alpha=64" in card and "weights in bfloat16" in card
    assert "learning_rate: 7.5e-4  # a recipe line" in card  # the config file, verbatim
    assert "| `difficulty` | `1` |" in card and "| `num_train_tasks` | `64` |" in card  # non-default run fields
    assert "| environment | `shop` (difficulty 1) |" in card and "| training tasks | 64 (task_seed 3) |" in card
    assert "| held-out tasks | 20: 2 sampled episodes each, one greedy |" in card
    # before/after from SUMMARY, three decimals
    assert "| sampled | success | 0.125 | 0.625 |" in card and "| greedy | reward | 0.500 | 1 |" in card
    assert "| torch | 9.9.9-trained | " in card  # versions trained with, beside those exported with
    assert f"transformers serve {out}" in card and f"vllm serve {out}" in card
    assert "python -m agent_trl.play --base_url http://127.0.0.1:8000/v1 --environment shop" in card
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_a_checkpoint_reads_the_run_summary_and_says_whose_numbers_they_are(run_folder, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_folder, run / "checkpoint-3")
    (run / "checkpoint-3" / "summary.json").unlink()
    write_summary(run / "summary.json", SUMMARY)
    card = (export(str(run / "checkpoint-3"), str(tmp_path / "out")) / "README.md").read_text()
    assert "| sampled | success | 0.125 | 0.625 |" in card
    assert "`after` belongs to the run's final model, not to this checkpoint" in card


def test_a_run_with_only_checkpoints_names_the_latest(run_folder, tmp_path):
    run = tmp_path / "run"
    for n in (2, 10):
        shutil.copytree(run_folder, run / f"checkpoint-{n}")
    with pytest.raises(SystemExit, match=r"only checkpoints; export one of them, e.g. --model .*checkpoint-10$"):
        export(str(run), str(tmp_path / "out"))


def test_a_folder_without_summary_exports_and_says_what_is_unknown(tiny_model_folder, tmp_path):
    out = export(tiny_model_folder, str(tmp_path / "plain"))
    card = (out / "README.md").read_text()
    assert "Unknown: no summary.json was found" in card and "held-out results before and after" in card
    assert "| torch | unknown | " in card and "## Recipe" not in card
    saved = AutoModelForCausalLM.from_pretrained(out).state_dict()
    for name, w in AutoModelForCausalLM.from_pretrained(tiny_model_folder).state_dict().items():
        assert torch.equal(saved[name], w), name  # a full model is saved as it is


def test_no_merge_keeps_the_adapter(run_folder, tmp_path):
    out = export(str(run_folder), str(tmp_path / "adapter"), merge=False)
    assert {p.name for p in out.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors", "README.md"}
    assert not (out / "model.safetensors").exists()
    card = (out / "README.md").read_text()
    assert "library_name: peft" in card and "--enable-lora --lora-modules agent=" in card


def test_refusals_are_clear(run_folder, tiny_model_folder, tmp_path, monkeypatch):
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.txt").write_text("x")
    with pytest.raises(SystemExit, match="is not a model, adapter or run folder"):
        export(str(junk), str(tmp_path / "o1"))
    with pytest.raises(SystemExit, match="is not a folder"):
        export(str(tmp_path / "missing"), str(tmp_path / "o2"))
    moved = tmp_path / "moved"  # an adapter whose base folder is gone
    shutil.copytree(run_folder, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "no-such-base")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    gone = r"base model of .* cannot be found offline \(model_name_or_path .* is not a folder\); give --base"
    with pytest.raises(SystemExit, match=gone):
        export(str(moved), str(tmp_path / "o3"))
    assert export(str(moved), str(tmp_path / "o3"), base=tiny_model_folder).is_dir()  # --base finds it
    config["base_model_name_or_path"] = "nobody/not-cached-model"  # a Hub id, offline and not in the cache
    (moved / "adapter_config.json").write_text(json.dumps(config))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit, match="'nobody/not-cached-model' is not a folder and not in the local Hugging"):
        export(str(moved), str(tmp_path / "o4"))
    with pytest.raises(SystemExit, match="is the exported folder or holds it"):
        export(str(run_folder), str(run_folder.parent), overwrite=True)
    assert not list(tmp_path.glob(".o*")) and not (tmp_path / "o1").exists()


def test_a_non_empty_out_is_kept_unless_overwrite(tiny_model_folder, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(SystemExit, match="exists and is not empty; choose another folder or add --overwrite"):
        export(tiny_model_folder, str(out))
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    export(tiny_model_folder, str(out), overwrite=True)
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary folder left beside it
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (export(tiny_model_folder, str(empty)) / "config.json").is_file()  # an empty folder is fine


def test_a_failure_mid_export_leaves_nothing(tiny_model_folder, tmp_path, monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(export_module, "model_card", broken)  # after the weights and tokenizer are written
    with pytest.raises(RuntimeError, match="disk full"):
        export(tiny_model_folder, str(tmp_path / "out"))
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "old"  # with --overwrite, the old folder survives a failed export
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(RuntimeError, match="disk full"):
        export(tiny_model_folder, str(out), overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["old"] and (out / "keep.txt").read_text() == "mine"


def test_the_cli(tiny_model_folder, tmp_path, capsys):
    out = export_module.main(["--model", tiny_model_folder, "--out", str(tmp_path / "cli"), "--dtype", "float16"])
    assert json.loads((out / "config.json").read_text())["dtype"] == "float16"
    assert capsys.readouterr().out.strip().endswith(f"-> {out}")


# --------------------------------------------------------------------------------------------------------- push_to_hub


def test_push_to_hub_offline_stops_the_run_before_any_model(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(run_info, "tiny_model", lambda *a, **k: pytest.fail("built a model before checking the Hub"))
    argv = ["--config", "configs/quickstart.yaml", "--output_dir", str(tmp_path / "run"), "--push_to_hub", "true"]
    with pytest.raises(SystemExit) as stop:
        train.main(argv)
    message = str(stop.value)
    assert "push_to_hub needs the Hugging Face Hub, and HF_HUB_OFFLINE is set" in message
    assert "train without push_to_hub (the model is saved in output_dir) and upload it later" in message
    assert not (tmp_path / "run" / "summary.json").exists()


def test_push_to_hub_without_a_token_is_named(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    monkeypatch.setattr(huggingface_hub.HfApi, "whoami", lambda *a, **k: pytest.fail("asked the Hub without a token"))

    class Config:
        push_to_hub, hub_token = True, None

    assert "push_to_hub needs a Hub token (hub_token, HF_TOKEN or `hf auth login`)" in hub_problem(Config())
    Config.push_to_hub = False
    assert hub_problem(Config()) is None
