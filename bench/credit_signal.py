"""Does a step-credit method push the right turns? Its per-turn credit against the environment's expert, on the tiny
default at the start of training.

    python bench/credit_signal.py                                  # TASPO and AlignOPSD on shop and search
    python bench/credit_signal.py --methods taspo --envs shop --batches 1 --out /tmp/credit_signal   # a quick look
    python bench/credit_signal.py --tiny_guidance_frac 0.5 --out bench/results/credit_signal_guided  # another build
    python bench/credit_signal.py --envs terminal --out bench/results/credit_signal_terminal2  # terminal level 2
    python bench/credit_signal.py --envs search --set difficulty=2 max_completion_length=960 \
        --out bench/results/credit_signal_search2                  # the recipes' fields overridden (search level 2)
    python bench/credit_signal.py --recipe configs/smollm2_guess_the_number.yaml --batches 12 \
        --set per_device_train_batch_size=16 --out bench/results/credit_signal_smollm2   # the real model, multi-turn
    python bench/credit_signal.py --recipe configs/smollm2_guess_the_number.yaml --methods alignopsd --label sound \
        --set per_device_train_batch_size=16 alignopsd_match_on=action --out bench/results/credit_signal_smollm2_sound

For each method and environment, the method's trainer is built from its shipped recipe (`configs/<method>_<env>.yaml`,
parsed and built as train.py does: 8 tasks x 8 rollouts per generation batch) on the tiny default agent, or with
`--recipe` from that one recipe with its trainer replaced by the method's (the real model's recipe: its environment,
model, system prompt and sampling; a recipe with `serve_model` gets its served judge or analyzer, agent_trl/served.py),
and plays
`--batches` generation batches of training tasks through `trainer.train()` at learning rate 0 (every batch is played
by the SFT start, where the credit matters most). Each turn of each rollout is labelled by replaying the rollout in
a fresh environment: an **expert turn** is one whose action equals the environment's expert action in that state
(`expert_action`, whitespace and case ignored), or with `--label sound` one whose action is sound play there
(`Env.sound_action`: on GuessTheNumber any guess the hints still allow, not only the middle one); the labels are never
shown to the methods.

Measured per method and environment, over the rows the method credited (A != 0, not in fallback):
* the ordering share: over pairs (expert turn, other turn) of one row, how often the method's per-turn credit orders
  them the helpful way: on a rollout better than its group (A > 0) the expert turn gets the larger share, on a worse
  one (A < 0) the smaller (less blame); ties count 1/2, so 0.5 is no information. The credit is the multiplier w of
  TASPO and AlignOPSD (credit-interface.md Eq. I-2), which moves a rollout's advantage between its own turns. (GiGPO
  is left out: its step advantage compares actions taken from one state across rollouts, not the turns of a row.)
* the mean credit on expert turns and on other turns, for A > 0 and A < 0 separately, and the number of pairs;
* the ordering share over the pairs that leave the opening turn out, and the mean credit of opening turns (on a
  guessing game every opening guess is sound play, whatever the teacher thinks of it).

Writes bench/results/credit_signal/result.json and result.md, or into `--out`.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from trl import get_peft_config  # noqa: E402

import train  # noqa: E402
from agent_trl.run_info import resolve_model  # noqa: E402
from agent_trl.sources import load_sources  # noqa: E402
from bench.record import RESULTS, write_result  # noqa: E402
from envs.base import row_task  # noqa: E402
from trainers import TRAINERS  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def recipe_argv(
    method: str, env: str, seed: int, workdir: str, extra: list[str] = (), recipe: Path | None = None
) -> list[str]:
    """train.py's command line for `configs/<method>_<env>.yaml`, or for `recipe` run by `method`; `extra`: more
    fields (`--tiny_guidance_frac 0.5`)."""
    if recipe is None:
        argv = ["--config", str(ROOT / "configs" / f"{method}_{env}.yaml")]
    else:
        argv = ["--config", str(recipe), "--trainer", method]
    argv += ["--seed", str(seed), *extra]
    return argv + ["--output_dir", os.path.join(workdir, f"{method}_{env}"), "--report_to", "none"]


def build(method: str, env: str, seed: int, workdir: str, extra: list[str] = (), recipe=None, stack=None):
    """The trainer of `configs/<method>_<env>.yaml` (or of `recipe` run by `method`), parsed and built exactly as
    train.py builds it (no evaluation, no training), and its environment source. A recipe's `serve_model` is served
    until `stack` closes."""
    run, config, model_args, trainer_cls = train.parse(recipe_argv(method, env, seed, workdir, extra, recipe))
    if run.serve_model is not None:
        train.start_server(run, config, stack)
    sources = load_sources(run, config)
    folder = resolve_model(model_args.model_name_or_path, run, sources)
    trainer = trainer_cls(
        model=folder,
        args=config,
        train_dataset=sources.train,
        processing_class=AutoTokenizer.from_pretrained(folder, padding_side="left"),
        env_factory=sources.environment.factory,
        peft_config=get_peft_config(model_args),  # the recipe's LoRA, as train.py builds it
    )
    return trainer, sources


def expert_labels(source, row: dict, transcript: list[dict], label: str = "expert") -> list[bool]:
    """Per turn, replayed in a fresh environment: did the rollout take the expert's action in that state (`expert`),
    or a sound one (`sound`: `Env.sound_action`, e.g. any guess the hints still allow)?"""
    env, task = source.factory(row), row_task(row)
    env.reset(task)
    labels = []
    for turn in transcript:
        if label == "sound":
            labels.append(bool(env.sound_action(turn["action"])))
        else:
            expert = env.expert_action()
            labels.append(" ".join(turn["action"].lower().split()) == " ".join(expert.lower().split()))
        env.step(turn["action"])
    return labels


def measure(
    method: str,
    env: str,
    batches: int,
    seed: int,
    workdir: str,
    extra: list[str] = (),
    recipe: Path | None = None,
    label: str = "expert",
) -> dict:
    with ExitStack() as stack:
        trainer, sources = build(method, env, seed, workdir, extra, recipe, stack)
        return measure_trainer(trainer, sources, method, env, batches, label)


def measure_trainer(trainer, sources, method: str, env: str, batches: int, label: str = "expert") -> dict:
    source = sources.environment
    trainer.args.max_steps, trainer.args.learning_rate = batches, 0.0  # every batch is played by the SFT start
    trainer.args.logging_steps = batches
    trainer.train()
    stats = {(sign, kind): [] for sign in ("winner", "loser") for kind in ("expert", "other", "first")}
    helpful = pairs = later_helpful = later_pairs = 0.0
    for i, (batch, credit) in enumerate(trainer.recorded):
        print(
            f"{method} {env} batch {i}: success {sum(r['success'] for r in batch.rows)}/{len(batch.rows)}, "
            f"credited {int(((batch.advantages != 0) & ~credit.fallback).sum())}",
            file=sys.stderr,
        )
        for b, row in enumerate(batch.rows):
            a = float(batch.advantages[b])
            if a == 0 or bool(credit.fallback[b]):
                continue
            labels = expert_labels(source, row, row["transcript"], label)
            live = [k for k in range(len(labels)) if bool((batch.turn_index[b] == k).any())]  # turns with tokens
            values = {k: float(credit.values[b, k]) for k in live}
            sign = "winner" if a > 0 else "loser"
            for k in live:
                stats[(sign, "expert" if labels[k] else "other")].append(values[k])
                if k == 0:
                    stats[(sign, "first")].append(values[k])  # the opening turn, whatever its label
            experts = [k for k in live if labels[k]]
            others = [k for k in live if not labels[k]]
            for e in experts:
                for o in others:
                    if values[e] == values[o]:
                        score = 0.5
                    elif a > 0:
                        score = float(values[e] > values[o])  # larger credit on the expert turn
                    else:
                        score = float(values[e] < values[o])  # less blame on the expert turn
                    pairs, helpful = pairs + 1, helpful + score
                    if e > 0 and o > 0:  # the same pairs without the opening turn
                        later_pairs, later_helpful = later_pairs + 1, later_helpful + score
    out = {"pairs": pairs, "ordering_share": helpful / pairs if pairs else None}
    out |= {"later_pairs": later_pairs, "later_ordering_share": later_helpful / later_pairs if later_pairs else None}
    for (sign, kind), values in stats.items():
        out[f"{sign}_{kind}_mean"] = sum(values) / len(values) if values else None
        out[f"{sign}_{kind}_turns"] = len(values)
    return out


def recipe_environment(recipe: Path) -> str:
    """The environment a recipe names, as a table label (`textarena:GuessTheNumber-v0` -> `GuessTheNumber-v0`)."""
    environment = yaml.safe_load(recipe.read_text()).get("environment")
    if not environment:
        raise SystemExit(f"error: --recipe {recipe}: names no environment (the credit is per turn of an episode)")
    return str(environment).rpartition(":")[2]


def set_fields(items: list[str], guidance_frac: float | None = None) -> list[str]:
    """`--set` items (FIELD=VALUE) and `--tiny_guidance_frac` as train.py's command-line fields."""
    fields = [arg for item in items for arg in (f"--{item.partition('=')[0]}", item.partition("=")[2])]
    return fields + ([] if guidance_frac is None else ["--tiny_guidance_frac", str(guidance_frac)])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    methods = ["taspo", "alignopsd"]
    parser.add_argument("--methods", nargs="+", default=methods, choices=methods)
    parser.add_argument(
        "--envs",
        nargs="+",
        default=["shop", "search"],
        choices=["shop", "search", "terminal"],
        help="environments; terminal's recipes are its level 2 on the build that reads guidance",
    )
    parser.add_argument("--batches", type=int, default=3, help="generation batches (8 tasks x 8 rollouts) each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tiny_guidance_frac",
        type=float,
        default=None,
        help="build the tiny default with this share of guidance demonstrations (default: the recipe's)",
    )
    parser.add_argument(
        "--set", nargs="*", default=[], metavar="FIELD=VALUE", help="overrides of every recipe's fields (a level...)"
    )
    parser.add_argument(
        "--recipe",
        type=Path,
        default=None,
        help="run every method on this recipe (its trainer replaced) instead of configs/<method>_<env>.yaml; "
        "--envs is then ignored",
    )
    parser.add_argument(
        "--label",
        choices=["expert", "sound"],
        default="expert",
        help="which turns count as good: the expert's action, or any sound one (Env.sound_action, e.g. a guess the "
        "hints still allow; for a start model that never plays the expert's exact move)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "credit_signal")
    opts = parser.parse_args(argv)
    bad = [item for item in opts.set if not item.partition("=")[0] or "=" not in item]
    if bad:
        parser.error(f"--set takes FIELD=VALUE items, got {bad}")
    fields = set_fields(opts.set, opts.tiny_guidance_frac)
    results: dict[str, dict] = {}
    for name in opts.methods:
        trainer_cls = TRAINERS[name][0]

        class Recording(trainer_cls):
            def compute_advantages(self, batch):
                out = super().compute_advantages(batch)
                self.__dict__.setdefault("recorded", []).append((batch, self.credit))
                return out

        TRAINERS[name] = (Recording, TRAINERS[name][1])
    envs = opts.envs if opts.recipe is None else [recipe_environment(opts.recipe)]
    with tempfile.TemporaryDirectory() as workdir:
        for env in envs:
            for name in opts.methods:
                results[f"{name}/{env}"] = measure(
                    name, env, opts.batches, opts.seed, workdir, fields, opts.recipe, opts.label
                )
                print(name, env, results[f"{name}/{env}"], file=sys.stderr)
    lines = [
        f"| method | environment | ordering share (0.5: none) | pairs | without the opening turn (pairs) | "
        f"A > 0: {opts.label} / other turns | A < 0: {opts.label} / other turns | opening turn: A > 0 / A < 0 |",
        "|---|---|---:|---:|---:|---|---|---|",
    ]

    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    for key, r in results.items():
        name, env = key.split("/")
        lines.append(
            f"| {name} | {env} | {fmt(r['ordering_share'])} | {int(r['pairs'])} | "
            f"{fmt(r['later_ordering_share'])} ({int(r['later_pairs'])}) | "
            f"{fmt(r['winner_expert_mean'])} / {fmt(r['winner_other_mean'])} | "
            f"{fmt(r['loser_expert_mean'])} / {fmt(r['loser_other_mean'])} | "
            f"{fmt(r['winner_first_mean'])} / {fmt(r['loser_first_mean'])} |"
        )
    lines.append(
        "\nCredit per turn: the multiplier w (1 = GRPO's share). Ordering share: within-row "
        f"({opts.label} turn, other turn) "
        "pairs ordered the helpful way (see bench/credit_signal.py)."
    )
    text = "\n".join(lines)
    print("\n" + text)
    settings = vars(opts) | {"out": str(opts.out), "recipe": None if opts.recipe is None else str(opts.recipe)}
    write_result(opts.out, "credit_signal", settings, results, text)
    return results


if __name__ == "__main__":
    main()
