"""Layer 5: GRPO with routing replay under two CPU processes (torchrun, gloo) matches one process.

Runs `tests/distributed_grpo_run.py` twice through `torchrun --standalone` (1 and 2 processes, OMP_NUM_THREADS=1) on
a tiny Qwen3-MoE built here, then compares the first step's per-row advantages (groups straddle the two ranks), and
checks that both ranks made the same number of generate calls although rank 0's episodes end two turns earlier.
Run with `pytest -m distributed`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from trainers.routing_replay import find_routers

pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("distributed_grpo_run.py")


def torchrun(nproc: int, folder: str, out_dir: Path) -> list[dict]:
    out_dir.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    done = subprocess.run([*command, str(SCRIPT), folder, str(out_dir)], env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_two_processes_match_one(tiny_tokenizer, tmp_path):
    from envs.tiny import TinySpec, build_model

    model = build_model(TinySpec(env="echo", moe=True, hidden_size=32, intermediate_size=64), tiny_tokenizer)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for router in find_routers(model).modules:
            router.weight.copy_(torch.randn(router.weight.shape, generator=generator) * 0.5)
    folder = tmp_path / "tiny-moe"
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)

    (single,) = torchrun(1, str(folder), tmp_path / "one")
    ranks = torchrun(2, str(folder), tmp_path / "two")
    assert single["world"] == 1
    assert [r["world"] for r in ranks] == [2, 2] and all("MULTI_CPU" in r["distributed_type"] for r in ranks)
    # group statistics gathered across ranks: the same per-row advantages as one process (a group straddles ranks)
    merged = {**ranks[0]["advantages"], **ranks[1]["advantages"]}
    assert merged.keys() == single["advantages"].keys() and len(merged) == 12
    for key, value in single["advantages"].items():
        assert merged[key] == pytest.approx(value, abs=1e-6), key
    assert any(abs(v) > 0.1 for v in merged.values())
    # equal generate calls per step although rank 0 finished two turns earlier (it generated on a dummy context)
    assert [r["turns"] for r in ranks] == [1, 3]
    assert ranks[0]["calls"]["generate"] == ranks[1]["calls"]["generate"] == 3
    assert ranks[0]["calls"]["dummy"] == 2 and ranks[1]["calls"]["dummy"] == 0
    # routing replay ran on both ranks, and the on-policy actor forward reproduced the sampler (Eq. 10)
    for r in [single, *ranks]:
        assert r["logs"]["routing/replay_active"] == 1.0 and r["routing_shape"][2:] == [2, 2]
        assert r["logs"]["routing/logp_gap"] < 1e-6 and r["logs"]["routing/router_grad_norm"] > 0
