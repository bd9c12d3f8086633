"""The README's runnable command blocks (each marked `<!-- runnable -->` before its fence) run as a new user would run
them, one after the other, from the repository root. Two things change, as in the library example's test: sizes
(`train.py` commands get a few steps, few tasks and a 2-step tiny build appended; TrlParser lets later flags win) and
`runs/` becomes a temporary folder. Every command must exit 0, and a training command must write its summary."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from agent_trl.real_model import real_model

ROOT = Path(__file__).resolve().parent.parent
SHORT = (
    "--max_steps 1 --num_train_tasks 16 --num_eval_tasks 4 --per_device_train_batch_size 8 --num_generations 4 "
    "--tiny_sft_steps 2 --max_completion_length 64 --logging_steps 1"
)


def runnable_blocks(text: str) -> list[list[str]]:
    """The commands of every ```bash block right after a `<!-- runnable -->` line; a trailing backslash joins lines,
    a `#` comment is dropped."""
    blocks = []
    for match in re.finditer(r"<!-- runnable -->\n```bash\n(.*?)```", text, flags=re.S):
        joined = match.group(1).replace("\\\n", " ")
        commands = [line.split("  #")[0].strip() for line in joined.splitlines()]
        blocks.append([c for c in commands if c and not c.startswith("#")])
    return blocks


def test_the_block_reader():
    text = (
        "intro\n```bash\npython not_this.py\n```\n<!-- runnable -->\n```bash\n"
        "python a.py --x 1 \\\n    --y 2     # a comment\n# a whole comment\npython b.py\n```\n"
    )
    assert runnable_blocks(text) == [["python a.py --x 1      --y 2", "python b.py"]]


def test_the_readme_has_the_three_runnable_sections():
    blocks = runnable_blocks((ROOT / "README.md").read_text())
    commands = [c for block in blocks for c in block]
    assert len(blocks) == 4 and len(commands) == 6, commands
    for file in ("smollm2_guess_the_number", "smollm2_arith", "examples.my_reward", "examples/local_model.py",
                 "examples.guess_env"):  # fmt: skip
        assert any(file in c for c in commands), file


def test_every_runnable_readme_command_runs(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "AGENT_TRL_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "real").symlink_to(Path(real_model()).parent)  # the real model, converted once (make setup)
    runs = tmp_path / "runs"
    for block in runnable_blocks((ROOT / "README.md").read_text()):
        for command in block:
            words = shlex.split(command.replace("runs/", f"{runs}/"))
            assert words[0] == "python", command
            words[0] = sys.executable
            training = words[1] == "train.py"
            if training:
                words += shlex.split(SHORT)
            done = subprocess.run(words, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"{command}\n{done.stderr[-3000:]}"
            if training:
                out = Path(words[words.index("--output_dir") + 1])
                summary = json.loads((out / "summary.json").read_text())
                assert summary["log_history"], command
