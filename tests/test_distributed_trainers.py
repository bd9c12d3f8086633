"""Layer 5 for the trainers that gather across processes beyond GRPO's group statistics: GiGPO (step groups), TASPO
(the analyzer's batch), AlignOPSD (the batch threshold and sources), DRACO (the reward stage on the main process),
β-OPSD, the Funnel's consolidation and MPO (the critic's statistics) give each row's first-batch token advantages the
same on two CPU processes (torchrun, gloo) as on one. GRPO, PPO, X-Tree and EnvSched have their own two-process
tests; tests/test_markers.py checks that every trainer of `TRAINERS` is run by one of them.

Runs `tests/distributed_trainers_run.py` twice (1 and 2 processes), every trainer in one launch; the episodes do not
depend on the split (see that script). Run with `pytest -m distributed`.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed
SCRIPT = Path(__file__).with_name("distributed_trainers_run.py")
NAMES = ["gigpo", "taspo", "alignopsd", "draco", "beta_opsd", "funnel", "mpo"]


def torchrun(nproc: int, folder: str, out_dir: Path) -> dict[str, list[dict]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    done = subprocess.run([*command, str(SCRIPT), folder, str(out_dir), *NAMES], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    return {n: [json.loads((out_dir / n / f"rank{r}.json").read_text()) for r in range(nproc)] for n in NAMES}


def test_two_processes_give_each_row_the_advantages_of_one(tiny_model_folder, tmp_path):
    one = torchrun(1, tiny_model_folder, tmp_path / "one")
    two = torchrun(2, tiny_model_folder, tmp_path / "two")
    for name in NAMES:
        (single,) = one[name]
        assert single["world"] == 1 and [r["world"] for r in two[name]] == [2, 2], name
        merged = {**two[name][0]["advantages"], **two[name][1]["advantages"]}
        assert sorted(merged, key=int) == sorted(single["advantages"], key=int) == [str(i) for i in range(12)], name
        for row, tokens in single["advantages"].items():
            assert merged[row] == pytest.approx(tokens, abs=1e-5), (name, row)
        values = [v for tokens in single["advantages"].values() for v in tokens]
        assert any(abs(v) > 1e-3 for v in values), f"{name}: every advantage is 0; the comparison would be empty"
