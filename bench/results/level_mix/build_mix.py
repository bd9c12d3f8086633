"""A tiny default built from scratch on demonstrations of several levels, saved every few hundred SFT steps so that
the recall of each saved model can be probed while the build goes on: does a build that also sees the word recalled
at a shorter range (level 1) learn the recall at level 2's range, where a build on level 2 alone does not?

The recipe is `envs/tiny.py`'s (`TinySpec` defaults and the environment's level settings: noise 0.3, 2000
demonstrations per level on the training tasks, a tokenizer trained on their text, Qwen2 hidden 128 x 2 layers, SFT
batch 32 at 3e-3 constant after 10 warm-up steps), with the demonstrations of every level named, shuffled together by
the trainer. Checkpoints: <out>/checkpoint-<step> (model and tokenizer, what `recall.py` and `attention.py` read).

python bench/results/level_mix/build_mix.py <env> <out folder> <steps> <save every> <level> [<level> ...]

The builds of this folder's README ran on the shop's former demonstrations (demonstration version 1, whose noisy
checkout could copy the last id in the cart); the same command now plays the current ones.
"""

import dataclasses
import json
import sys
from pathlib import Path

from envs.sources import load_environment
from envs.tiny import TinySpec, build_model, demonstration_tokenizer, played_demonstrations, sft

env, out, steps, every = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
levels = [int(v) for v in sys.argv[5:]]
spec = TinySpec.parse(f"tiny:{env}", difficulty=max(levels))
spec = dataclasses.replace(spec, sft_steps=steps)
demos = []
for level in levels:
    source = load_environment(env, None, level)
    tasks = source.make_tasks("train", spec.num_demos, seed=spec.seed, difficulty=level)
    demos += played_demonstrations(source.factory, tasks, spec.seed, spec.noise)
print(f"{len(demos)} demonstrations of levels {levels}", flush=True)
tokenizer = demonstration_tokenizer(demos, spec)
model = build_model(spec, tokenizer)
out.mkdir(parents=True, exist_ok=True)
info = {**dataclasses.asdict(spec), "levels_trained": levels}
(out / "tiny_spec.json").write_text(json.dumps(info, indent=2))
sft(model, tokenizer, demos, spec, str(out), save_strategy="steps", save_steps=every, save_only_model=True)
