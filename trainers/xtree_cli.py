"""Mine, print and draw X-Trees (docs/methods/xtree.md):

    python -m trainers.xtree_cli mine --environment shop --episodes 500 --out runs/xtree/shop.json
    python -m trainers.xtree_cli show runs/xtree/shop.json
    python -m trainers.xtree_cli plot runs/xtree/shop.json --out runs/xtree/shop.png

    python -m trainers.xtree_cli cards --environment terminal --out runs/xtree/terminal_cards
    python -m trainers.xtree_cli instances --environment shop

`instances` builds node RL's instances as `xtree_use: nodes` would (same corpus, tree and selection) and prints what
they teach: the action each instance opens with, after which step, against what the corpus's successful episodes do
after that step (docs/methods/xtree.md D21), with the trainer's start-up warning when one action opens nearly all.

`mine` reads logged episodes (`--trajectories FILE.jsonl`: one JSON object per line with `actions` and `success`), or
logs one noisy-expert episode per training task of a built-in environment, mines the tree, writes it with its
occurrence sidecar (.occ.jsonl) and a picture (.png) beside it, and prints it. `cards` writes a dataset folder
(train.jsonl, test.jsonl: the environment's train and eval tasks) whose `xtree_card` column holds each task's skill
card (docs/methods/xtree.md §4.5), for β-OPSD's teacher: `python train.py --config configs/beta_opsd_shop.yaml
--dataset_name runs/xtree/shop_cards --opsd_privileged column:xtree_card`.
"""

from __future__ import annotations

import argparse
import json
import os

from trainers.xtree import (
    CorpusIndex,
    MinerConfig,
    Trajectory,
    canon,
    card_key,
    check_tree,
    context_of,
    load,
    mine,
    plot_tree,
    render_card,
    render_text,
    save,
)

# ---------------------------------------------------------------------------------------------------------------------


def _corpus_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--environment", default="shop")
    p.add_argument("--difficulty", type=int, default=0)
    p.add_argument("--episodes", type=int, default=500, help="logged episodes (one per training task)")
    p.add_argument("--noise", type=float, default=0.3, help="chance that the expert takes a plausible wrong action")
    p.add_argument("--seed", type=int, default=0, help="seed of the tasks and of the logged expert")
    p.add_argument("--successful_only", action="store_true", help="mine on the successful episodes only")
    types = {"min_success_rate": float, "min_families": int}
    for name, value in MinerConfig().__dict__.items():
        p.add_argument(f"--{name}", type=types.get(name, type(value)), default=value, help="miner setting (Eq. 3-4)")


def read_trajectories(path: str, environment: str) -> list[Trajectory]:
    """Logged episodes from a JSONL file, one per line: `actions` (the raw action strings, in order) and `success`
    (bool) are required; `id` (default: the line number), `task_id` (default: the id), `task` (a dict the
    canonicaliser reads, e.g. a shop task's `target`) and `family` are optional. `environment` picks the
    canonicalisation table (shop, search, terminal; any other name: the first word of each action)."""
    if not os.path.isfile(path):
        raise SystemExit(f"error: --trajectories file {path!r} does not exist")
    trajs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"error: {path}:{n} is not JSON ({e.msg})") from e
            if not isinstance(row, dict):
                raise SystemExit(f"error: {path}:{n} is not a JSON object")
            actions, success = row.get("actions"), row.get("success")
            if not isinstance(actions, list) or not all(isinstance(a, str) for a in actions):
                raise SystemExit(f"error: {path}:{n}: `actions` must be a list of strings")
            if not isinstance(success, bool):
                raise SystemExit(f"error: {path}:{n}: `success` must be true or false, got {success!r}")
            ctx = context_of(row.get("task") or {})
            tid = str(row.get("id", n))
            trajs.append(Trajectory(id=tid, task_id=str(row.get("task_id", tid)), success=success,
                                    tokens=[canon(environment, a, ctx)[0] for a in actions], actions=actions,
                                    family=row.get("family", ctx["family"]),
                                    goal_attributes=list(ctx["goal_attributes"])))  # fmt: skip
    if not trajs:
        raise SystemExit(f"error: {path} holds no episode")
    return trajs


def _corpus(args):
    """The environment class, its training tasks, the logged corpus and the mined tree of `args`."""
    from envs import ENVIRONMENTS
    from trainers.xtree_trainer import expert_corpus

    cfg = MinerConfig(**{k: getattr(args, k) for k in MinerConfig().__dict__})
    if getattr(args, "trajectories", None):
        trajs = read_trajectories(args.trajectories, args.environment)
        mined = [t for t in trajs if t.success] if args.successful_only else trajs
        if not mined:
            raise SystemExit("error: no episode to mine (none succeeded)")
        tree, occ = mine(mined, cfg, environment=args.environment, corpus_name=args.trajectories)
        return None, trajs, {}, tree, occ
    if args.environment not in ENVIRONMENTS:
        raise SystemExit(f"error: --environment must be one of {sorted(ENVIRONMENTS)}, got {args.environment!r}")
    env_cls = ENVIRONMENTS[args.environment]
    tasks = env_cls.make_tasks("train", args.episodes, seed=args.seed, difficulty=args.difficulty)
    trajs, logs = expert_corpus(lambda task: env_cls(args.difficulty), tasks, args.noise, args.seed)
    mined = [t for t in trajs if t.success] if args.successful_only else trajs
    if not mined:
        raise SystemExit("error: no episode to mine (no logged episode succeeded)")
    tree, occ = mine(mined, cfg, environment=args.environment, corpus_name=f"noisy expert ({args.noise})")
    return env_cls, trajs, logs, tree, occ


def task_card(tree, index: CorpusIndex, env, task: dict, env_name: str, **card_settings) -> str:
    """The card of one task (docs/methods/xtree.md D14): keyed by its family, else the goal attribute it asks for,
    else the expert's first canonical action on it."""
    ctx = context_of(task, getattr(env, "action_names", ()))
    env.reset(task)
    first = canon(env_name, env.expert_action(), ctx)[0]
    key, style = card_key(index, ctx["family"], ctx["goal_attributes"], first)
    return render_card(tree, index, key, style, **card_settings)


def instances_report(trajs, logs, tree, occ, args) -> str:
    """Node RL's instances on this corpus and tree: per depth, per opening action, and per step before the instance
    (its last prefix step's canonical token, or `start`) the openings against the successful episodes' next steps."""
    from collections import Counter, defaultdict

    from trainers.xtree_trainer import instance_openings, instance_rows, opening_warning

    rows = instance_rows(trajs, logs, tree, occ, args)
    if not rows:
        return "no instance: no successful logged episode of half B contains a tree node"
    by_id = {t.id: t for t in trajs}
    opened = defaultdict(Counter)  # token before the instance -> opening tokens
    for r in rows:
        inst = json.loads(r["task"])["xtree_instance"]
        s = len(inst["prefix"])
        opened[by_id[inst["traj_id"]].tokens[s - 1] if s else "start"][inst["gold_tokens"][0]] += 1
    corpus = defaultdict(Counter)  # token before a step -> the step, in successful episodes
    for t in trajs:
        if t.success:
            for before, step in zip(["start", *t.tokens], t.tokens, strict=False):  # each step after the one before
                corpus[before][step] += 1
    openings = instance_openings(rows)

    def fmt(counts: Counter) -> str:
        return ", ".join(f"{k} {v}" for k, v in counts.most_common())

    lines = [
        f"{len(rows)} instances from {len(tree.nodes)} skills; per depth "
        f"{dict(sorted(Counter(r['depth'] for r in rows).items()))}",
        f"opening action: {fmt(openings)}",
        "after            | instances open with | successful episodes continue with",
    ]
    for before, counts in sorted(opened.items(), key=lambda kv: -sum(kv[1].values())):
        lines.append(f"{before:16s} | {fmt(counts)} | {fmt(corpus[before])}")
    warning = opening_warning(openings)
    lines.append(f"warning: {warning}" if warning else "no warning: no action opens nearly every instance")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """python -m trainers.xtree_cli {mine,show,plot,cards,instances} ...; see `--help`."""
    parser = argparse.ArgumentParser(prog="python -m trainers.xtree_cli", description="Mine, print and draw X-Trees.")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mine", help="mine a tree from logged episodes (a JSONL file, or an environment expert)")
    _corpus_arguments(m)
    m.add_argument("--trajectories", help="JSONL of logged episodes (see read_trajectories); default: log the expert")
    m.add_argument("--out", required=True, help="tree file (.json); the occurrences go beside it (.occ.jsonl)")
    s = sub.add_parser("show", help="print a tree")
    s.add_argument("tree")
    s.add_argument("--max_nodes", type=int, default=None)
    p = sub.add_parser("plot", help="draw a tree as a PNG")
    p.add_argument("tree")
    p.add_argument("--out", required=True)
    c = sub.add_parser("cards", help="write train/test task files with each task's skill card (xtree_card column)")
    _corpus_arguments(c)
    c.add_argument("--train_tasks", type=int, default=2000)
    c.add_argument("--test_tasks", type=int, default=200)
    c.add_argument("--max_chains", type=int, default=6)
    c.add_argument("--min_chain_support", type=int, default=5)
    c.add_argument("--above_margin", type=float, default=0.01)
    c.add_argument("--out", required=True, help="folder for train.jsonl, test.jsonl and the tree")
    i = sub.add_parser("instances", help="what node RL's instances on a mined tree open with (xtree.md D21)")
    _corpus_arguments(i)
    from trainers.xtree_trainer import XTreeConfig

    defaults = XTreeConfig.__dataclass_fields__
    for name in ("xtree_max_instances_per_node", "xtree_gold", "xtree_instance_source", "xtree_mixing"):
        value = defaults[name].default
        i.add_argument(f"--{name}", type=type(value), default=value, help=defaults[name].metadata.get("help"))
    args = parser.parse_args(argv)
    if args.command == "show":
        tree = load(args.tree)
        print(render_text(tree, args.max_nodes))
        problems = check_tree(tree)
        if problems:
            print(f"{len(problems)} invariant violations, first: {problems[0]}")
        return
    if args.command == "plot":
        plot_tree(load(args.tree), args.out)
        print(f"wrote {args.out}")
        return
    env_cls, trajs, logs, tree, occ = _corpus(args)
    if args.command == "instances":
        if not logs:
            raise SystemExit("error: instances replay a built-in environment's logged expert; give --environment")
        print(instances_report(trajs, logs, tree, occ, args))
        return
    if args.command == "mine":
        save(tree, args.out, occ)
        plot_tree(tree, args.out[: -len(".json")] + ".png" if args.out.endswith(".json") else args.out + ".png")
        print(render_text(tree))
        return
    from trainers.xtree_trainer import corpus_index

    os.makedirs(args.out, exist_ok=True)
    save(tree, os.path.join(args.out, "xtree.json"), occ)
    index = corpus_index(trajs, logs)
    settings = {"max_chains": args.max_chains, "min_chain_support": args.min_chain_support,
                "above_margin": args.above_margin}  # fmt: skip
    env = env_cls(args.difficulty)
    for split, n, name in [("train", args.train_tasks, "train.jsonl"), ("eval", args.test_tasks, "test.jsonl")]:
        tasks = env_cls.make_tasks(split, n, seed=args.seed, difficulty=args.difficulty)
        with open(os.path.join(args.out, name), "w", encoding="utf-8") as f:
            for task in tasks:
                card = task_card(tree, index, env, task, args.environment, **settings)
                f.write(json.dumps({"task": json.dumps(task), "xtree_card": card}) + "\n")
    print(f"wrote {args.train_tasks} train and {args.test_tasks} test tasks with cards to {args.out}; a card:")
    print(card)


if __name__ == "__main__":
    main()
