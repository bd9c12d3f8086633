"""Rebuild the shipped default (tiny:shop) with the warm start's masked forward (as before grpo.md D15's fast path)
and print its greedy held-out success on the 100 eval tasks of tests/test_tiny_shipped.py's rebuild test."""

import os
import sys
import tempfile
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["AGENT_TRL_CACHE"] = tempfile.mkdtemp()
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import envs.tiny as tiny  # noqa: E402
from bench.sft_speed import masked_forward  # noqa: E402
from envs.shop import ShopEnv  # noqa: E402
from trainers.agent_loop import LoopSettings, evaluate  # noqa: E402

tiny.SHIPPED = Path(tempfile.mkdtemp())  # build, do not copy the shipped folder
with masked_forward():
    folder = tiny.tiny_model("tiny:shop")
tasks = ShopEnv.make_tasks("eval", 100, seed=0)
model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
settings = LoopSettings(max_turn_tokens=24, max_completion_length=256)
success = evaluate(model, tokenizer, ShopEnv, tasks, settings, greedy=True, progress=False)["success"]
print("masked rebuild greedy success:", success)
