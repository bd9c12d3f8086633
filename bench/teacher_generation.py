"""AlignOPSD's teacher generation: one turn per live turn of an episode batch, three ways, side by side.

The contexts are those `AlignOPSDTrainer.compute_advantages` builds: for every turn of every episode, the episode's
prompt with the skill card in its system message, then the episode's tokens before that turn (alignopsd.md Eq. 2).
The episodes are played once, by the tiny default the terminal recipes start from (the shipped level-2 build that
reads guidance), at temperature 1; then the same contexts are sampled (temperature 1, at most `--teacher-tokens` new
tokens, `--rows` contexts a call, as the teacher samples them) by:

* `generate`: transformers' `model.generate` on left-padded contexts, each prefilled alone (the path of models whose
  cache is not one plain per-position cache, and the only path before the branches);
* `own loop, alone`: `sample_after_prefixes` with every context its own sequence: the project's decode loop, still a
  full prefill per context;
* `branches`: `sample_after_prefixes` on `shared_prefixes(contexts)`: each episode prefilled once per call, every turn
  branching from its cache (what `teacher_generate` does on a plain decoder).

The arms alternate `--repeats` times after one untimed warm-up call each; the table gives median seconds, the ratio
to `generate` and the tokens generated (the arms sample the same distribution, so their lengths agree up to noise).

    HF_HUB_OFFLINE=1 python bench/teacher_generation.py --episodes 64 --repeats 3

Writes bench/results/teacher_generation/result.json (every timed call, the contexts' lengths, settings, versions and
machine) and result.md, or into `--out`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import torch  # noqa: E402

from bench.record import RESULTS, write_result  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64, help="episodes played (one generation batch of the recipe)")
    p.add_argument("--repeats", type=int, default=3, help="timed calls per arm, alternating the arms")
    p.add_argument("--difficulty", type=int, default=2, help="terminal level (2: checklists of 14-17 steps)")
    p.add_argument("--max-turn-tokens", type=int, default=24, help="new tokens per turn when playing")
    p.add_argument("--max-completion-length", type=int, default=768, help="all turns of an episode together")
    p.add_argument("--teacher-tokens", type=int, default=24, help="alignopsd_teacher_max_tokens")
    p.add_argument("--rows", type=int, default=64, help="contexts per call (alignopsd_teacher_batch_size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--out", type=Path, default=RESULTS / "teacher_generation", help="folder for the result files")
    return p.parse_args(argv)


def teacher_contexts(rollouts, tokenizer, skill: str) -> list[list[int]]:
    """Every turn's teacher context, episode by episode and turn by turn, as `compute_advantages` builds them."""
    from envs.base import skill_card
    from trainers.agent_loop import render_prompt_ids
    from trainers.teacher import with_privileged_block

    contexts = []
    for r in rollouts:
        prompt = render_prompt_ids(
            tokenizer, with_privileged_block(r.prompt_messages, skill_card(skill)), r.prompt_tools
        )
        for t in sorted({i for i in r.turn_index if i >= 0}):
            contexts.append(prompt + r.completion_ids[: r.turn_index.index(t)])
    return contexts


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from agent_trl.evaluation import play_tasks
    from envs import ENVIRONMENTS
    from envs.tiny import tiny_model
    from trainers.agent_loop import LoopSettings
    from trainers.generation import left_padded, logits_processors, sample_after_prefixes, shared_prefixes
    from trainers.trl_api import cpu_fast_paths

    folder = tiny_model("tiny:terminal", difficulty=args.difficulty, guidance_frac=0.5)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    env_cls = ENVIRONMENTS["terminal"]
    tasks = env_cls.make_tasks("train", args.episodes, seed=args.seed, difficulty=args.difficulty)
    torch.manual_seed(args.seed)
    settings = LoopSettings(max_turn_tokens=args.max_turn_tokens, max_completion_length=args.max_completion_length)
    with cpu_fast_paths():
        rollouts = play_tasks(model, tok, lambda: env_cls(difficulty=args.difficulty), tasks, settings)
    contexts = teacher_contexts(rollouts, tok, env_cls(difficulty=args.difficulty).skill)
    eos, pad = [tok.eos_token_id], tok.pad_token_id
    processors = logits_processors(temperature=1.0)

    def generate() -> list[list[int]]:
        out = []
        for s in range(0, len(contexts), args.rows):
            ids, mask = left_padded(contexts[s : s + args.rows], pad, model.device)
            config = GenerationConfig(do_sample=True, top_k=0, max_new_tokens=args.teacher_tokens, pad_token_id=pad,
                                      eos_token_id=eos)  # fmt: skip
            with torch.no_grad():
                new = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
            out += new[:, ids.shape[1] :].tolist()
        return out

    def alone() -> list[list[int]]:
        branches = [(i, len(c)) for i, c in enumerate(contexts)]
        out = sample_after_prefixes(
            model, contexts, branches, args.teacher_tokens, processors, True, eos, pad, args.rows
        )
        return [ids for ids, _ in out]

    def branches() -> list[list[int]]:
        sequences, shared = shared_prefixes(contexts)
        out = sample_after_prefixes(
            model, sequences, shared, args.teacher_tokens, processors, True, eos, pad, args.rows
        )
        return [ids for ids, _ in out]

    def tokens(rows: list[list[int]]) -> int:
        total = 0
        for row in rows:
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            total += len([t for t in row[:cut] if t != pad])
        return total

    arms = {"generate": generate, "own loop, alone": alone, "branches": branches}
    times = {name: [] for name in arms}
    made = {name: [] for name in arms}
    with cpu_fast_paths():
        for fn in arms.values():
            fn()  # warm-up, untimed
        for _ in range(args.repeats):
            for name, fn in arms.items():
                clock = time.perf_counter()
                rows = fn()
                times[name].append(time.perf_counter() - clock)
                made[name].append(tokens(rows))
    base = statistics.median(times["generate"])
    turns = [len({i for i in r.turn_index if i >= 0}) for r in rollouts]
    lengths = [len(c) for c in contexts]
    lines = [
        f"{args.episodes} terminal level-{args.difficulty} episodes, {len(contexts)} turn contexts (turns per episode "
        f"{statistics.mean(turns):.1f}, context length mean {statistics.mean(lengths):.0f}, max {max(lengths)}), at "
        f"most {args.teacher_tokens} new tokens each, {args.rows} contexts a call, {torch.get_num_threads()} "
        "thread(s), median of "
        f"{args.repeats} timed calls per arm",
        "",
        "| arm | seconds (median) | vs generate | tokens generated (mean per call) |",
        "|---|---|---|---|",
    ]
    for name in arms:
        med = statistics.median(times[name])
        lines.append(f"| {name} | {med:.2f} | {base / med:.2f}x faster | {statistics.mean(made[name]):.0f} |")
    measured = {
        "seconds": times,
        "tokens": made,
        "context_lengths": lengths,
        "turns_per_episode": turns,
        "episode_success": [r.success for r in rollouts],
    }
    table = "\n".join(lines)
    write_result(args.out, "teacher_generation", {k: str(v) for k, v in vars(args).items()}, measured, table)
    print(table)


if __name__ == "__main__":
    main()
