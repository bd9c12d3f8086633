"""Continue a tiny default's warm start on demonstrations of several levels: does a word recalled at a shorter range
(level 1) teach the recall at the longer range of level 2? The continuation repeats the build's recipe
(`envs/tiny.py`: noise, learning rate, constant schedule after 10 warm-up steps, batch size) on the saved model, with
the build's own demonstrations of its level plus, for each other level named, as many of that level's (the same
training-task seed, so the same generator); its optimizer state starts afresh, so it approximates a longer build
rather than reproducing one.

python bench/results/level_mix/continue_mix.py <built tiny folder> <out folder> <steps> <level> [<level> ...]
The levels name every level whose demonstrations are trained on (the build's own included, e.g. `1 2` for a level-2
build; `2` alone is the control: the same continuation without the other level). Saved as <out folder>/plus<steps>,
a folder `python -m agent_trl.evaluate --model` reads."""

import dataclasses
import json
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.sources import load_environment
from envs.tiny import TinySpec, played_demonstrations, sft

built, out, steps = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
levels = [int(v) for v in sys.argv[4:]]
spec = TinySpec(**json.loads((built / "tiny_spec.json").read_text()))
demos = []
for level in levels:
    source = load_environment(spec.env, json.loads(spec.env_kwargs) if spec.env_kwargs else None, level)
    tasks = source.make_tasks("train", spec.num_demos, seed=spec.seed, difficulty=level)
    demos += played_demonstrations(
        source.factory, tasks, spec.seed, spec.noise, spec.privileged_frac, spec.guidance_frac
    )
print(f"{len(demos)} demonstrations of levels {levels}", flush=True)
tokenizer = AutoTokenizer.from_pretrained(built)
model = AutoModelForCausalLM.from_pretrained(built)
model = sft(model, tokenizer, demos, dataclasses.replace(spec, sft_steps=steps, seed=spec.seed + 1), str(out / "sft"))
folder = out / f"plus{steps}"
model.save_pretrained(folder)
tokenizer.save_pretrained(folder)
(folder / "tiny_spec.json").write_text(
    json.dumps(
        {**dataclasses.asdict(spec), "sft_steps": spec.sft_steps + steps, "continued_on_levels": levels}, indent=2
    )
)
print(f"saved {folder} ({spec.sft_steps + steps} SFT steps in all)", flush=True)
