"""Continue a tiny default's warm start past its SFT steps, in chunks, and save each: how many more steps search
level 2 needs to start, without building again from step 0 (on this machine a build runs about 2.3 s a step).
The continuation repeats the build's recipe (`envs/tiny.py`: the same demonstrations, tokenizer, learning rate,
constant schedule after 10 warm-up steps, batch size) on the saved model; its optimizer state starts afresh, so it
approximates a longer build rather than reproducing one.

python bench/results/search_levels/continue_sft.py <built tiny folder> <out folder> <steps per chunk> <chunks> \
    [level ...]
Each chunk is saved as <out folder>/plus<steps so far>, a folder `python -m agent_trl.evaluate --model` reads. Levels
named at the end: train on the demonstrations of each (as many per level as the build had, from the same training-task
seed; the build's own level among them for its demonstrations), e.g. `1 2` for a level-2 build (../level_mix/)."""

import dataclasses
import json
import sys
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.sources import load_environment
from envs.tiny import TinySpec, played_demonstrations, sft

built, out, chunk, chunks = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
spec = TinySpec(**json.loads((built / "tiny_spec.json").read_text()))
levels = [int(v) for v in sys.argv[5:]] or [spec.difficulty]
demos = []
for level in levels:
    source = load_environment(spec.env, json.loads(spec.env_kwargs) if spec.env_kwargs else None, level)
    tasks = source.make_tasks("train", spec.num_demos, seed=spec.seed, difficulty=level)
    fracs = (spec.privileged_frac, spec.guidance_frac)
    demos += played_demonstrations(source.factory, tasks, spec.seed, spec.noise, *fracs)
tokenizer = AutoTokenizer.from_pretrained(built)
model = AutoModelForCausalLM.from_pretrained(built)
for i in range(1, chunks + 1):
    step_spec = dataclasses.replace(spec, sft_steps=chunk, seed=spec.seed + i)  # a fresh batch order each chunk
    model = sft(model, tokenizer, demos, step_spec, output_dir=str(out / "sft"))
    folder = out / f"plus{i * chunk}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    steps = spec.sft_steps + i * chunk
    info = {**dataclasses.asdict(spec), "sft_steps": steps}
    if levels != [spec.difficulty]:
        info["continued_on_levels"] = levels
    (folder / "tiny_spec.json").write_text(json.dumps(info, indent=2))
    print(f"saved {folder} ({steps} SFT steps in all)", flush=True)
