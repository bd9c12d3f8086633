"""Mine, print and draw X-Trees (docs/methods/xtree.md):

    python -m trainers.xtree_cli mine --environment shop --episodes 500 --out runs/xtree/shop.json
    python -m trainers.xtree_cli show runs/xtree/shop.json
    python -m trainers.xtree_cli plot runs/xtree/shop.json --out runs/xtree/shop.png

`mine` logs one noisy-expert episode per training task of a built-in environment, mines the tree, writes it with its
occurrence sidecar (.occ.jsonl) and a picture (.png) beside it, and prints it.
"""

from __future__ import annotations

import argparse

from trainers.xtree import MinerConfig, check_tree, load, mine, plot_tree, render_text, save

# ---------------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """python -m trainers.xtree_cli {mine,show,plot} ...; see `--help`."""
    parser = argparse.ArgumentParser(prog="python -m trainers.xtree_cli", description="Mine, print and draw X-Trees.")
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("mine", help="log expert episodes of a built-in environment and mine a tree from them")
    m.add_argument("--environment", default="shop")
    m.add_argument("--difficulty", type=int, default=0)
    m.add_argument("--episodes", type=int, default=500, help="logged episodes (one per training task)")
    m.add_argument("--noise", type=float, default=0.3, help="chance that the expert takes a plausible wrong action")
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--successful_only", action="store_true", help="mine on the successful episodes only")
    for name, value in MinerConfig().__dict__.items():
        m.add_argument(f"--{name}", type=type(value) if value is not None else float, default=value)
    m.add_argument("--out", required=True, help="tree file (.json); the occurrences go beside it (.occ.jsonl)")
    s = sub.add_parser("show", help="print a tree")
    s.add_argument("tree")
    s.add_argument("--max_nodes", type=int, default=None)
    p = sub.add_parser("plot", help="draw a tree as a PNG")
    p.add_argument("tree")
    p.add_argument("--out", required=True)
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
    from envs import ENVIRONMENTS
    from trainers.xtree_trainer import expert_corpus

    if args.environment not in ENVIRONMENTS:
        raise SystemExit(f"error: --environment must be one of {sorted(ENVIRONMENTS)}, got {args.environment!r}")
    env_cls = ENVIRONMENTS[args.environment]
    tasks = env_cls.make_tasks("train", args.episodes, seed=args.seed, difficulty=args.difficulty)
    trajs, _ = expert_corpus(lambda task: env_cls(args.difficulty), tasks, args.noise, args.seed)
    if args.successful_only:
        trajs = [t for t in trajs if t.success]
    cfg = MinerConfig(**{k: getattr(args, k) for k in MinerConfig().__dict__})
    tree, occ = mine(trajs, cfg, environment=args.environment, corpus_name=f"noisy expert ({args.noise})")
    save(tree, args.out, occ)
    plot_tree(tree, args.out[: -len(".json")] + ".png" if args.out.endswith(".json") else args.out + ".png")
    print(render_text(tree))


if __name__ == "__main__":
    main()
