"""The repository ships tiny builds prebuilt (envs/shipped/, envs/tiny.py SHIPPED_BUILDS): each copy is the build of
its current settings, nothing else lies there, an empty cache is filled from a copy without building, and (slow) a
rebuild of the quickstart's default from scratch reproduces it byte for byte."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from envs import tiny
from envs.tiny import SHIPPED, SHIPPED_BUILDS, TinySpec, tiny_model

FILES = ("model.safetensors", "tokenizer.json", "config.json", "tiny_spec.json")


def shipped_folder():
    return SHIPPED / f"tiny-shop-{TinySpec.parse('tiny:shop').key()}"


@pytest.mark.parametrize("name, settings", SHIPPED_BUILDS)
def test_every_shipped_build_is_current(name, settings):
    """A recipe change changes the key; then the copy must be rebuilt and shipped again (this test says so). Each
    declared build lies under the name `tiny_model` looks up and records the settings parsed now (env_kwargs "" is
    left out of the key, not out of the file)."""
    spec = TinySpec.parse(name, **settings)
    folder = SHIPPED / f"{name.replace(':', '-')}-{spec.key()}"
    assert folder.is_dir(), f"envs/shipped/ has no build named {folder.name}: rebuild {name} {settings} and ship it"
    assert json.loads((folder / "tiny_spec.json").read_text()) == asdict(spec)
    assert all((folder / f).is_file() for f in FILES)


def test_nothing_else_is_shipped():
    """No stale copy lying around: the folder holds the declared builds and nothing more."""
    names = {f"{n.replace(':', '-')}-{TinySpec.parse(n, **s).key()}" for n, s in SHIPPED_BUILDS}
    assert {p.name for p in SHIPPED.iterdir()} == names


@pytest.mark.parametrize("name, settings", SHIPPED_BUILDS)
def test_an_empty_cache_is_filled_from_the_shipped_copy(name, settings, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path))

    def no_build(*args, **kwargs):
        raise AssertionError(f"{name} {settings} was built although a shipped copy exists")

    monkeypatch.setattr(tiny, "build_and_save", no_build)
    folder = Path(tiny_model(name, **settings))
    shipped = SHIPPED / folder.name
    assert folder == tmp_path / "tiny" / shipped.name
    assert tiny.shipped_build(name, **settings) == shipped  # the tests' way to the copy names the one installed
    for file in FILES:
        assert (shipped / file).read_bytes() == (folder / file).read_bytes()
    assert list((tmp_path / "tiny").iterdir()) == [folder]  # no staging left


def test_other_settings_are_still_built(tmp_path, monkeypatch):
    """Only the exact default is shipped: another setting (here 1 SFT step on 16 demonstrations) builds as before."""
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path))
    folder = tiny_model("tiny:shop", sft_steps=1, num_demos=16)
    assert json.loads((tmp_path / "tiny" / folder.split("/")[-1] / "tiny_spec.json").read_text())["sft_steps"] == 1


@pytest.mark.slow
def test_a_rebuild_reproduces_the_shipped_build(tmp_path, monkeypatch):
    """The shipped copy is what the repository's own build makes. Built from scratch (about 2-3 minutes on 2 cores):
    tokenizer, config and settings are byte-identical; the weights are byte-identical on the machine that built the
    copy, and elsewhere (SFT's float reductions depend on the CPU) the rebuilt agent's greedy held-out success is
    within 0.1 of the shipped one's on 100 eval tasks."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_trl.evaluation import evaluate
    from envs.shop import ShopEnv
    from trainers.agent_loop import LoopSettings

    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path))
    monkeypatch.setattr(tiny, "SHIPPED", tmp_path / "nothing-shipped")
    rebuilt = tmp_path / "tiny" / shipped_folder().name
    assert tiny_model("tiny:shop") == str(rebuilt)
    for name in ("tokenizer.json", "config.json", "tiny_spec.json"):
        assert (shipped_folder() / name).read_bytes() == (rebuilt / name).read_bytes(), name
    a, b = load_file(shipped_folder() / "model.safetensors"), load_file(rebuilt / "model.safetensors")
    if all(torch.equal(a[k], b[k]) for k in a):
        print("rebuilt weights: byte-identical to the shipped copy")
        return
    tasks = ShopEnv.make_tasks("eval", 100, seed=0)
    success = []
    for folder in (shipped_folder(), rebuilt):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
        settings = LoopSettings(max_turn_tokens=24, max_completion_length=256)
        success.append(evaluate(model, tokenizer, ShopEnv, tasks, settings, greedy=True, progress=False)["success"])
    print(f"rebuilt weights differ from the shipped copy; greedy held-out success shipped/rebuilt: {success}")
    assert abs(success[0] - success[1]) <= 0.1, success
