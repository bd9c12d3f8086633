"""X-Tree: a skill tree mined from logged agent trajectories, like a BPE tokenizer over actions; arXiv 2609.32993,
docs/methods/xtree.md.

This file holds the method's pure parts, top to bottom:

1. Canonicalisation (Eq. 1): `canon(env, action, ctx) -> (token, slots)` turns one environment action into a typed
   token `verb<role>` (tables per environment) and keeps what it removed (ids, typed text, option values) in `slots`.
   `matches` is the step matcher of offline node RL (D5).
2. Mining (Eq. 2-5): `mine(trajectories, MinerConfig) -> (Tree, occurrences)`, greedy X-Score merging with a fixed
   tie-break, deterministic under any order of the input. `encode` replays the merges on a new sequence (its tiling).
3. The tree file: `dumps`/`loads`/`save`/`load` (JSON, key order fixed, unknown keys kept, two saves byte-identical);
   `render_text` and `plot_tree` show it.
4. Offline node RL: `split_half` (D4), `node_instances`, and the reward `offline_reward` (Eq. 6).
5. The online skill bonus: `win_rates` and `bonus_weights` (Eq. 7), `raw_bonus` (Eq. 8-9), `shape_rewards` (Eq. 10).
6. The skill card: `CorpusIndex`, `render_card` (Eq. 11).

The trainer and the logged environment live in `trainers/xtree_trainer.py`; `python -m trainers.xtree_cli` mines,
prints and draws trees.

Decision ids (`Dn`) without a page are docs/methods/xtree.md's.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

FORMAT = "xtree/1"

# ---------------------------------------------------------------------------------------------------------------------
# 1. Canonicalisation (Eq. 1)
# ---------------------------------------------------------------------------------------------------------------------

_WORD = re.compile(r"[a-z0-9]+")

#: terminal command -> verb (D3); redirections and flags pick the role
_TERMINAL_VERBS = {
    "echo": "write",
    "touch": "create",
    "mkdir": "mkdir",
    "rm": "remove",
    "cp": "copy",
    "mv": "move",
    "cat": "read",
    "head": "read",
    "tail": "read",
    "grep": "find",
    "ls": "observe",
    "wc": "count",
    "cd": "navigate",
    "pwd": "observe",
    "submit": "submit",
    "done": "submit",
    "exit": "submit",
}


def _other(action: str) -> tuple[str, dict]:
    return "other<object>", {"raw": action, "surface": "other"}


def canon_shop(action: str, ctx: dict) -> tuple[str, dict]:
    """The shop's table (WebShop's, docs/methods/xtree.md D3): `search[q]` -> `search<query>`, `click[id]` ->
    `click<item>`, `buy` -> `click<buy>`, `choose[v]` -> `click<option-KEY>` when v is a value of an option kind
    (size, colour) that the goal specifies (`ctx["goal_attributes"]`), else `click<option>`; the shopping lists'
    `add` -> `click<add>` and `checkout[w]` -> `click<checkout>` (slot `coupon`).

    >>> canon_shop("choose[m]", {"goal_attributes": ["size"]})[0]
    'click<option-size>'
    >>> canon_shop("choose[red]", {"goal_attributes": ["size"]})[0]
    'click<option>'
    """
    from envs.shop import _ACTION, _CART_ACTION, COLOURS, SIZES

    m = _ACTION.fullmatch(action.strip())  # the shop's own grammar
    if m is None:
        cart = _CART_ACTION.fullmatch(action.strip())  # the shopping lists' add and checkout (levels 1 and 2)
        if cart is None:
            return _other(action)
        if cart.group(3):
            return "click<add>", {"raw": action, "surface": "add"}
        return "click<checkout>", {"raw": action, "coupon": cart.group(2).strip(), "surface": "checkout[<obj>]"}
    verb = (m.group(1) or m.group(3)).lower()
    arg = (m.group(2) or "").strip()
    if verb == "search":
        return "search<query>", {"raw": action, "query": arg, "surface": "search[<obj>]"}
    if verb == "click":
        return "click<item>", {"raw": action, "item": arg, "surface": "click[<obj>]"}
    if verb == "buy":
        return "click<buy>", {"raw": action, "surface": "buy"}
    value = arg.lower()
    kind = "size" if value in SIZES else "colour" if value in COLOURS else None
    asked = kind is not None and kind in ctx.get("goal_attributes", ())
    token = f"click<option-{kind}>" if asked else "click<option>"
    return token, {"raw": action, "option": value, "surface": "choose[<obj>]"}


def canon_search(action: str, ctx: dict) -> tuple[str, dict]:
    """Search QA: the last `search[q]` or `answer[a]` of the turn -> `search<query>` or `answer<message>`.

    >>> canon_search("I look it up. search[Zorvak Telmi]", {})[1]["query"]
    'Zorvak Telmi'
    """
    from envs.search import _ACTION

    found = _ACTION.findall(action)  # the environment's own grammar: the last action of the turn counts
    if not found:
        return _other(action)
    verb, arg = found[-1][0].lower(), found[-1][1].strip()
    if verb == "search":
        return "search<query>", {"raw": action, "query": arg, "surface": "search[<obj>]"}
    return "answer<message>", {"raw": action, "answer": arg, "surface": "answer[<obj>]"}


def canon_terminal(action: str, ctx: dict) -> tuple[str, dict]:
    """The terminal: the command's verb (`_TERMINAL_VERBS`), and a role from its shape: `write<file>` (echo > f),
    `write<append>` (echo >> f), `write<stdout>`, `remove<dir>` (rm -r), `remove<file>`, `read<pipe>` (a pipeline),
    `<path>` for the other commands with operands, `<cwd>` without; `submit<task>`. The line is split as the
    environment's shell splits it (quotes, and operators with or without spaces around them).

    >>> token, slots = canon_terminal("echo apple>zeta.txt", {})
    >>> token, slots["line"]
    ('write<file>', 'echo apple > zeta.txt')
    >>> canon_terminal("rm -rf logs", {})[0]
    'remove<dir>'
    """
    from envs.terminal.shell import command_line, tokenize

    try:
        tokens = tokenize(command_line(action))
    except ValueError:
        return _other(action)
    words = [text for kind, text in tokens if kind == "word"]
    ops = [text for kind, text in tokens if kind == "op"]
    if not words or words[0] not in _TERMINAL_VERBS:
        return _other(action)
    verb = _TERMINAL_VERBS[words[0]]
    operands = [w for w in words[1:] if not w.startswith("-")]
    flags = "".join(w[1:] for w in words[1:] if w.startswith("-") and not w.startswith("--"))
    if verb == "submit":
        role = "task"
    elif "|" in ops:
        role = "pipe"
    elif verb == "write":
        role = "append" if ">>" in ops else "file" if ">" in ops else "stdout"
    elif verb == "remove":
        role = "dir" if "r" in flags.lower() else "file"
    else:
        role = "path" if operands else "cwd"
    surface = words[0] + " <obj>" * min(len(operands), 3) if operands and verb != "submit" else words[0]
    slots = {"raw": action, "words": [list(t) for t in tokens], "line": " ".join(text for _, text in tokens)}
    return f"{verb}<{role}>", {**slots, "surface": surface}


def canon_generic(action: str, ctx: dict) -> tuple[str, dict]:
    """Any other environment: the verb is the action's first word (letters and underscores, lower-cased), e.g.
    `search[...]` -> `search<object>`; when the environment lists its action names (`ctx["action_names"]`) a word
    outside them becomes `other`. The role is `object` (Eq. 1's fallbacks)."""
    m = re.match(r"\s*([A-Za-z_]+)", action)
    verb = m.group(1).lower() if m else ""
    names = {n.lower() for n in ctx.get("action_names", ())}
    if not verb or (names and verb not in names):
        return _other(action)
    return f"{verb}<object>", {"raw": action, "surface": verb}


CANONICALISERS = {"shop": canon_shop, "search": canon_search, "terminal": canon_terminal}


def canon(env: str, action: str, ctx: dict | None = None) -> tuple[str, dict]:
    """Eq. 1: `(verb<role>, slots)` of `action` in environment `env` (`ctx`: `context_of(task)`). Pure; the token
    never holds an id, a value or typed text, `slots["raw"]` is the action as given."""
    return CANONICALISERS.get(env, canon_generic)(action, ctx or {})


def context_of(task: dict, action_names: Sequence[str] = ()) -> dict:
    """What canonicalisation may read of a task: the option kinds its goal specifies (`goal_attributes`), its family
    (the terminal's task `kind`) and the environment's action names (the generic table)."""
    target = task.get("target") or next(iter(task.get("targets") or []), {})  # the shop's (a list's: alike)
    # the colour is an option to choose at the shop's level 4 only
    goal = [k for k in ("size", "colour") if k in target and (k != "colour" or task.get("difficulty") == 4)]
    return {"goal_attributes": goal, "family": task.get("kind") or task.get("family"), "action_names": action_names}


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def matches(env: str, gold: tuple[str, dict], action: tuple[str, dict], jaccard: float = 0.5) -> tuple[bool, str]:
    """The step matcher of the logged environment (docs/methods/xtree.md D5): same token and same key slot.
    Returns (match, reason) with reason "" on a match, else "parse" (the action is `other`), "token" or "slot".
    Search queries match by word-set Jaccard >= `jaccard`; item ids, option values, answers and coupons
    case-insensitively; terminal command lines word by word as the shell splits them (quoted spaces kept)."""
    token, slots = action
    if token.startswith("other<"):
        return False, "parse"
    if token != gold[0]:
        return False, "token"
    g = gold[1]
    if "query" in g:
        a, b = _words(g["query"]), _words(slots.get("query", ""))
        ok = bool(a | b) and len(a & b) / len(a | b) >= jaccard
    elif "item" in g or "option" in g or "answer" in g or "coupon" in g:
        key = next(k for k in ("item", "option", "answer", "coupon") if k in g)
        ok = " ".join(str(g[key]).lower().split()) == " ".join(str(slots.get(key, "")).lower().split())
    elif "words" in g:  # shell words with their boundaries: `touch 'a b'` is not `touch a b`
        ok = g["words"] == slots.get("words")
    else:
        ok = True
    return ok, "" if ok else "slot"


# ---------------------------------------------------------------------------------------------------------------------
# 2. Mining (Eq. 2-5) and encoding
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class MinerConfig:
    """The miner's settings (docs/methods/xtree.md §5); the defaults are the project's for a new environment."""

    max_skills: int = 128
    min_frequency: int = 5
    mdl_lambda: float = 0.5
    max_skill_len: int = 8
    min_success_rate: float | None = None
    min_families: int | None = None
    p_len: float = 1.0
    p_succ: float = 1.0
    eps: float = 0.0

    def to_json(self) -> dict:
        out = {"max_skills": self.max_skills, "min_frequency": self.min_frequency, "mdl_lambda": self.mdl_lambda,
               "max_skill_len": self.max_skill_len}  # fmt: skip
        if self.min_success_rate is not None:
            out["min_success_rate"] = self.min_success_rate
        if self.min_families is not None:
            out["min_families"] = self.min_families
        out.update(p_len=self.p_len, p_succ=self.p_succ, eps=self.eps)
        return out


@dataclass
class Trajectory:
    """One logged episode, canonicalised: its tokens and the raw actions they came from."""

    id: str
    task_id: str
    success: bool
    tokens: list[str]
    actions: list[str] = field(default_factory=list)
    family: str | None = None
    goal_attributes: list[str] = field(default_factory=list)


@dataclass
class Node:
    id: str
    children: list[str]
    depth: int
    length: int
    expansion: list[str]
    count: int
    success: float | None
    example: list[str] | None
    score: float | None = None
    n_episodes: int | None = None
    families: dict[str, int] | None = None
    extra: dict = field(default_factory=dict)  # unknown keys of a loaded file, written back after the known ones


@dataclass
class Tree:
    environment: str
    corpus: dict
    config: dict
    nodes: list[Node]
    primitives: list[dict] | None = None
    n_primitives: int | None = None
    format: str = FORMAT
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.by_id = {n.id: n for n in self.nodes}
        if self.n_primitives is None:
            self.n_primitives = len(self.primitives or [])

    def length(self, symbol: str) -> int:
        node = self.by_id.get(symbol)
        return 1 if node is None else node.length

    def depth(self, symbol: str) -> int:
        node = self.by_id.get(symbol)
        return 0 if node is None else node.depth

    def success(self, symbol: str) -> float:
        """A node's success rate for scoring and bonuses; null reads as 1.0 (docs/methods/xtree.md D11)."""
        node = self.by_id.get(symbol)
        return 1.0 if node is None or node.success is None else float(node.success)

    @property
    def successful_only(self) -> bool:
        return bool(self.corpus.get("successful_only", False))

    def __eq__(self, other) -> bool:
        return isinstance(other, Tree) and dumps(self) == dumps(other)


@dataclass(frozen=True)
class Occurrence:
    node: str
    traj_id: str
    start: int  # primitive step index
    end: int  # exclusive


def _counted(seq: Sequence[str], u: str, v: str) -> list[int]:
    """Positions i where (seq[i], seq[i+1]) = (u, v) is counted: left to right, never overlapping (Eq. 2, D2)."""
    out, i = [], 0
    while i < len(seq) - 1:
        if seq[i] == u and seq[i + 1] == v:
            out.append(i)
            i += 2
        else:
            i += 1
    return out


def pair_statistics(corpus: Sequence[Sequence[str]]) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """Eq. 2: every adjacent pair of every sequence with its counted positions (trajectory index, position), counted
    left to right without overlap and never across two sequences. `len(value)` is f_uv."""
    stats: dict[tuple[str, str], list[tuple[int, int]]] = {}
    for t, seq in enumerate(corpus):
        last_end: dict[tuple[str, str], int] = {}
        for i in range(len(seq) - 1):
            pair = (seq[i], seq[i + 1])
            if i > last_end.get(pair, -1):
                stats.setdefault(pair, []).append((t, i))
                last_end[pair] = i + 1
    return stats


def x_score(f: int, length: int, succ: float, p_len: float, p_succ: float, eps: float) -> float:
    """Eq. 3: X(u, v) = f_uv * (l_u + l_v)^p_len * (succ(uv) + eps)^p_succ.

    >>> x_score(6, 3, 0.5, 1.0, 1.0, 0.0)
    9.0
    """
    return f * length**p_len * (succ + eps) ** p_succ


def eligible(f: int, length: int, succ: float, n_families: int, score: float, cfg: MinerConfig) -> bool:
    """Eq. 4: frequency, length, the compression test f - 1 > eta * l, families, success rate, a positive score."""
    return (
        f >= cfg.min_frequency
        and length <= cfg.max_skill_len
        and f - 1 > cfg.mdl_lambda * length
        and (cfg.min_families is None or n_families >= cfg.min_families)
        and (cfg.min_success_rate is None or succ >= cfg.min_success_rate)
        and score > 0
    )


def _merge(seq: list[str], spans: list[tuple[int, int]], u: str, v: str, new: str) -> tuple[list, list, list[int]]:
    """`seq` with its counted (u, v) pairs replaced by `new`, left to right; returns the new sequence, its spans and
    the replaced positions."""
    at = set(_counted(seq, u, v))
    out, out_spans, i = [], [], 0
    while i < len(seq):
        if i in at:
            out.append(new)
            out_spans.append((spans[i][0], spans[i + 1][1]))
            i += 2
        else:
            out.append(seq[i])
            out_spans.append(spans[i])
            i += 1
    return out, out_spans, sorted(at)


def mine(
    trajectories: Iterable[Trajectory], cfg: MinerConfig, environment: str = "", corpus_name: str = ""
) -> tuple[Tree, list[Occurrence]]:
    """The greedy miner (docs/methods/xtree.md §4.2): merge the eligible pair of highest X-Score (Eq. 3-4) into a new
    node (Eq. 5) until `max_skills` nodes exist or no pair is eligible. Ties: higher f, then longer, then the smallest
    (expansion(u), expansion(v)). Trajectories are sorted by id first, so any input order gives the same tree."""
    trajs = sorted(trajectories, key=lambda t: t.id)
    if len({t.id for t in trajs}) != len(trajs):
        raise ValueError("trajectory ids must be unique")
    successful_only = all(t.success for t in trajs)
    corpus = [list(t.tokens) for t in trajs]
    spans = [[(i, i + 1) for i in range(len(t.tokens))] for t in trajs]
    expansion: dict[str, tuple[str, ...]] = {}
    depth: dict[str, int] = {}

    def exp(s: str) -> tuple[str, ...]:
        return expansion.get(s, (s,))

    nodes: list[Node] = []
    occurrences: list[Occurrence] = []
    while len(nodes) < cfg.max_skills:
        best, best_key = None, None
        for (u, v), where in pair_statistics(corpus).items():
            f = len(where)
            length = len(exp(u)) + len(exp(v))
            wins = sum(trajs[t].success for t, _ in where)
            succ = 1.0 if successful_only else wins / f
            fams = {trajs[t].family for t, _ in where if trajs[t].family is not None}
            score = x_score(f, length, succ, cfg.p_len, cfg.p_succ, cfg.eps)
            if not eligible(f, length, succ, len(fams), score, cfg):
                continue
            key = (-score, -f, -length, exp(u), exp(v))
            if best_key is None or key < best_key:
                best, best_key = (u, v, f, length, succ, score, fams, where), key
        if best is None:
            break
        u, v, f, length, succ, score, fams, where = best
        new = f"S{len(nodes)}"
        expansion[new] = exp(u) + exp(v)  # Eq. 5
        depth[new] = 1 + max(depth.get(u, 0), depth.get(v, 0))
        episodes = sorted({t for t, _ in where})
        first_t, first_i = where[0]
        lo, hi = spans[first_t][first_i][0], spans[first_t][first_i + 1][1]
        families = Counter(trajs[t].family for t in episodes if trajs[t].family is not None)
        for t in sorted({t for t, _ in where}):
            corpus[t], spans[t], replaced = _merge(corpus[t], spans[t], u, v, new)
            occurrences += [Occurrence(new, trajs[t].id, *spans[t][_index_after(replaced, k)]) for k in replaced]
        nodes.append(
            Node(
                id=new,
                children=[u, v],
                depth=depth[new],
                length=length,
                expansion=list(expansion[new]),
                count=f,
                success=None if successful_only else succ,
                example=list(trajs[first_t].actions[lo:hi]) or None,
                score=score,
                n_episodes=len(episodes),
                families=dict(sorted(families.items())) or None,
            )
        )
    counts = Counter(tok for t in trajs for tok in t.tokens)
    tree = Tree(
        environment=environment,
        corpus={"name": corpus_name, "n_trajectories": len(trajs), "successful_only": successful_only},
        config=cfg.to_json(),
        nodes=nodes,
        primitives=[{"token": tok, "count": c} for tok, c in sorted(counts.items())],
    )
    return tree, occurrences


def _index_after(replaced: list[int], k: int) -> int:
    """Index in the merged sequence of the pair that stood at position `k` (each earlier merge shifted it by one)."""
    return k - replaced.index(k)


def encode(tree: Tree, tokens: Sequence[str]) -> list[tuple[str, int, int]]:
    """The tiling of a canonical sequence: replay every merge in node order, each left to right without overlap;
    returns the top-level symbols with their primitive spans `(symbol, start, end)`."""
    seq = list(tokens)
    spans = [(i, i + 1) for i in range(len(seq))]
    for node in tree.nodes:
        u, v = node.children
        if u in seq and v in seq:
            seq, spans, _ = _merge(seq, spans, u, v, node.id)
    return [(s, a, b) for s, (a, b) in zip(seq, spans, strict=True)]


# ---------------------------------------------------------------------------------------------------------------------
# 3. The tree file
# ---------------------------------------------------------------------------------------------------------------------

_TOP = ("environment", "corpus", "n_primitives", "n_nodes", "config", "format", "nodes", "primitives")
_NODE = ("id", "children", "depth", "length", "expansion", "count", "success", "example")
_NODE_OPTIONAL = ("score", "n_episodes", "families")


def _node_json(n: Node) -> dict:
    out = {k: getattr(n, k) for k in _NODE}
    out.update({k: getattr(n, k) for k in _NODE_OPTIONAL if getattr(n, k) is not None})
    out.update(n.extra)
    return out


def dumps(tree: Tree) -> str:
    """The tree as JSON text: UTF-8, indent 1, keys in the fixed order, unknown keys after the known ones."""
    out = {
        "environment": tree.environment,
        "corpus": tree.corpus,
        "n_primitives": tree.n_primitives,
        "n_nodes": len(tree.nodes),
        "config": tree.config,
        "format": tree.format,
        "nodes": [_node_json(n) for n in tree.nodes],
    }
    if tree.primitives is not None:
        out["primitives"] = tree.primitives
    out.update(tree.extra)
    return json.dumps(out, ensure_ascii=False, indent=1) + "\n"


def loads(text: str) -> Tree:
    """A tree from JSON text (this project's files and the released schema alike; unknown keys are kept)."""
    data = json.loads(text)
    nodes = []
    for d in data["nodes"]:
        known = {k: d.get(k) for k in _NODE + _NODE_OPTIONAL}
        extra = {k: v for k, v in d.items() if k not in known}
        nodes.append(Node(**known, extra=extra))
    return Tree(
        environment=data.get("environment", ""),
        corpus=data.get("corpus", {}),
        config=data.get("config", {}),
        nodes=nodes,
        primitives=data.get("primitives"),
        n_primitives=data.get("n_primitives"),
        format=data.get("format", FORMAT),
        extra={k: v for k, v in data.items() if k not in _TOP},
    )


def save(tree: Tree, path: str, occurrences: Sequence[Occurrence] | None = None) -> None:
    """Write the tree (and its occurrence sidecar `<path>.occ.jsonl`), each through a temporary file and a rename."""
    _atomic_write(path, dumps(tree))
    if occurrences is not None:
        lines = "".join(json.dumps(o.__dict__) + "\n" for o in occurrences)
        _atomic_write(occurrences_path(path), lines)


def _atomic_write(path: str, text: str) -> None:
    import os

    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def occurrences_path(path: str) -> str:
    return path[: -len(".json")] + ".occ.jsonl" if path.endswith(".json") else path + ".occ.jsonl"


def load(path: str) -> Tree:
    with open(path, encoding="utf-8") as f:
        return loads(f.read())


def load_occurrences(path: str) -> list[Occurrence]:
    with open(occurrences_path(path), encoding="utf-8") as f:
        return [Occurrence(**json.loads(line)) for line in f if line.strip()]


def check_tree(tree: Tree) -> list[str]:
    """The invariants every tree keeps (docs/methods/xtree.md §7 property 10); returns what is violated."""
    problems, seen = [], set()
    min_f = tree.config.get("min_frequency")
    for n in tree.nodes:
        u, v = n.children
        for c in (u, v):
            if c in tree.by_id and c not in seen:
                problems.append(f"{n.id}: child {c} comes after it")
        exp_u = tree.by_id[u].expansion if u in tree.by_id else [u]
        exp_v = tree.by_id[v].expansion if v in tree.by_id else [v]
        if n.expansion != exp_u + exp_v:
            problems.append(f"{n.id}: expansion is not the children's")
        if n.length != len(n.expansion):
            problems.append(f"{n.id}: length {n.length} != {len(n.expansion)}")
        if n.depth != 1 + max(tree.depth(u), tree.depth(v)):
            problems.append(f"{n.id}: depth {n.depth}")
        if min_f is not None and n.count < min_f:
            problems.append(f"{n.id}: count {n.count} < min_frequency {min_f}")
        seen.add(n.id)
    return problems


def tree_stats(tree: Tree, trajectories: Sequence[Trajectory]) -> dict:
    """The miner's report (docs/methods/xtree.md §8): nodes, depth histogram, compression (corpus length after the
    merges over before), coverage (share of actions inside depth >= 1 tiles), self-encoding failures (nodes whose own
    expansion does not encode to themselves alone) and the X-Score settings."""
    before = sum(len(t.tokens) for t in trajectories)
    tilings = [encode(tree, t.tokens) for t in trajectories]
    covered = sum(b - a for tiling in tilings for s, a, b in tiling if tree.depth(s) >= 1)
    failures = [n.id for n in tree.nodes if [s for s, _, _ in encode(tree, n.expansion)] != [n.id]]
    depths = Counter(n.depth for n in tree.nodes)
    return {
        "nodes": len(tree.nodes),
        "depths": {str(d): depths[d] for d in sorted(depths)},
        "max_depth": max(depths, default=0),
        "compression": sum(len(t) for t in tilings) / before if before else 1.0,
        "coverage": covered / before if before else 0.0,
        "self_encoding_failures": failures,
        "score": {k: tree.config.get(k) for k in ("p_len", "p_succ", "eps")},
    }


def render_text(tree: Tree, max_nodes: int | None = None) -> str:
    """The tree as text, deepest skills first: each top node (one no other node uses) with its children indented."""
    used = {c for n in tree.nodes for c in n.children}
    tops = sorted((n for n in tree.nodes if n.id not in used), key=lambda n: (-n.depth, -n.count, _index(n.id)))
    lines = [
        f"{tree.environment or 'tree'}: {len(tree.nodes)} skills over {tree.n_primitives} primitives, corpus "
        f"{tree.corpus.get('n_trajectories', '?')} trajectories"
        + (" (successful only)" if tree.successful_only else "")
    ]

    def walk(symbol: str, indent: int) -> None:
        node = tree.by_id.get(symbol)
        if node is None:
            lines.append("  " * indent + symbol)
            return
        succ = "" if node.success is None else f", success {node.success:.2f}"
        lines.append(f"{'  ' * indent}{node.id} (depth {node.depth}, count {node.count}{succ}): "
                     + " -> ".join(node.expansion))  # fmt: skip
        for child in node.children:
            if child in tree.by_id:
                walk(child, indent + 1)

    for n in tops[:max_nodes]:
        walk(n.id, 1)
    return "\n".join(lines)


def _index(node_id: str) -> int:
    return int(node_id[1:]) if node_id[1:].isdigit() else 0


def plot_tree(tree: Tree, path: str, max_tops: int = 12) -> None:
    """Draw the tree: each top skill as a binary tree, primitives at the bottom, nodes coloured by success."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    used = {c for n in tree.nodes for c in n.children}
    tops = sorted((n for n in tree.nodes if n.id not in used), key=lambda n: (-n.depth, -n.count, _index(n.id)))
    tops = tops[:max_tops]
    width = max(1, sum(n.length for n in tops)) + len(tops)
    height = max([n.depth for n in tops] or [1]) + 1
    fig, ax = plt.subplots(figsize=(min(40, 1.1 * width + 2), 1.2 * height + 1.5))
    cmap = plt.get_cmap("RdYlGn")
    x0 = 0.0

    def draw(symbol: str, left: float) -> tuple[float, float]:
        node = tree.by_id.get(symbol)
        if node is None:
            ax.text(left + 0.5, 0, symbol, ha="center", va="top", rotation=60, fontsize=7)
            ax.plot(left + 0.5, 0, "o", color="0.6", markersize=4)
            return left + 0.5, 0.0
        u, v = node.children
        xu, yu = draw(u, left)
        xv, yv = draw(v, left + tree.length(u))
        x, y = (xu + xv) / 2, float(node.depth)
        ax.plot([xu, x, xv], [yu, y, yv], color="0.5", linewidth=0.8)
        ax.plot(x, y, "o", color=cmap(tree.success(symbol)), markersize=9, markeredgecolor="0.2")
        ax.text(x, y + 0.15, f"{node.id}\n×{node.count}", ha="center", va="bottom", fontsize=7)
        return x, y

    for n in tops:
        draw(n.id, x0)
        x0 += n.length + 1
    ax.set_ylim(-2.2, height + 0.6)
    ax.set_xlim(-0.5, max(x0, 1))
    ax.axis("off")
    ax.set_title(
        f"X-Tree of {tree.environment or 'a corpus'}: {len(tree.nodes)} skills "
        f"(largest {len(tops)} shown; colour: success rate)",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------------
# 4. Offline node RL (Eq. 6)
# ---------------------------------------------------------------------------------------------------------------------


def split_half(task_id: str, seed: int) -> str:
    """Half "A" (SFT) or "B" (node RL) of a task, by a seeded hash of its id (docs/methods/xtree.md D4)."""
    h = hashlib.sha256(f"{seed}|{task_id}".encode()).digest()
    return "A" if h[0] % 2 == 0 else "B"


def _order(seed: int, *parts) -> str:
    return hashlib.sha256("|".join(map(str, (seed, *parts))).encode()).hexdigest()


def node_instances(
    tree: Tree,
    occurrences: Sequence[Occurrence],
    trajectories: Sequence[Trajectory],
    seed: int = 0,
    max_per_node: int = 32,
    source: str = "successful",
) -> list[tuple[Occurrence, Trajectory]]:
    """Candidate offline instances (§4.3): per node of depth >= 1, its recorded occurrences that lie in trajectories
    of half B (and successful ones with `source="successful"`), at most `max_per_node` per node in seeded hash order.
    Returned in node order, then occurrence order."""
    if source not in ("successful", "all"):
        raise ValueError(f"source must be 'successful' or 'all', got {source!r}")
    by_id = {t.id: t for t in trajectories}
    out = []
    for node in tree.nodes:
        if node.depth < 1:
            continue
        cands = []
        for o in occurrences:
            t = by_id.get(o.traj_id)
            if o.node != node.id or t is None or split_half(t.task_id, seed) != "B":
                continue
            if source == "successful" and not t.success:
                continue
            cands.append((o, t))
        cands.sort(key=lambda ot: _order(seed, ot[0].node, ot[0].traj_id, ot[0].start))
        chosen = cands[:max_per_node]
        chosen.sort(key=lambda ot: (ot[0].traj_id, ot[0].start))
        out += chosen
    return out


def offline_reward(
    m: int, length: int, depth: int, a_step: float = 0.7, a_comp: float = 0.3, kappa: float = 0.5
) -> float:
    """Eq. 6: r = a_step * m / L + a_comp * (1 + kappa * depth) * 1[m = L].

    >>> offline_reward(2, 4, 2)
    0.35
    >>> round(offline_reward(4, 4, 2), 6)
    1.3
    """
    if not 0 <= m <= length or length < 1:
        raise ValueError(f"need 0 <= m <= L and L >= 1, got m={m}, L={length}")
    return a_step * m / length + (a_comp * (1 + kappa * depth) if m == length else 0.0)


# ---------------------------------------------------------------------------------------------------------------------
# 5. The online skill bonus (Eq. 7-10)
# ---------------------------------------------------------------------------------------------------------------------


def win_rates(verifier: torch.Tensor, group_size: int, threshold: float = 1.0) -> torch.Tensor:
    """Eq. 7, w_g: each group's share of rollouts whose verifier reward is >= `threshold`; an unscorable (NaN)
    reward counts as a failure and the denominator is G (C18)."""
    wins = torch.nan_to_num(verifier.double(), nan=-math.inf) >= threshold
    return wins.view(-1, group_size).double().mean(dim=1)


def bonus_weights(w: torch.Tensor, lambda0: float = 0.75, w_max: float = 0.4) -> torch.Tensor:
    """Eq. 7, lambda_g = lambda0 * clip(1 - w_g / w_max, 0, 1)."""
    return lambda0 * (1 - w / w_max).clamp(0.0, 1.0)


def raw_bonus(
    tree: Tree, tiling: Sequence[tuple[str, int, int]], mode: str, n_actions: int, kappa_b: float = 0.5
) -> float:
    """B_i of one rollout from its tiling: Eq. 8 (`depth`: sum of 1 + kappa_b * depth over top-level nodes of depth
    >= 1) or Eq. 9 (`success_coverage`: sum of succ(n) * l(n) / T_i). Leftover primitives add 0; a rollout with no
    action has bonus 0 (C19)."""
    if n_actions == 0:
        return 0.0
    nodes = [tree.by_id[s] for s, _, _ in tiling if s in tree.by_id and tree.by_id[s].depth >= 1]
    if mode == "depth":
        return float(sum(1 + kappa_b * n.depth for n in nodes))
    if mode == "success_coverage":
        return float(sum(tree.success(n.id) * n.length for n in nodes)) / n_actions
    raise ValueError(f"bonus mode must be 'depth' or 'success_coverage', got {mode!r}")


@dataclass
class Shaped:
    rewards: torch.Tensor  # (N, 2): the verifier column unchanged, the bonus column lambda_g * c * B_i / max_j B_j
    weights: torch.Tensor  # (N/G,) lambda_g
    wins: torch.Tensor  # (N/G,) w_g
    inversions: int  # failed rollouts ranked above a successful one of the same group


def shape_rewards(
    rewards: torch.Tensor,
    group_size: int,
    lambda0: float = 0.75,
    w_max: float = 0.4,
    c: float = 2.0,
    threshold: float = 1.0,
    success_dominance: bool = False,
) -> Shaped:
    """Eq. 10 on the gathered (N, 2) tensor [verifier, raw bonus] in group order: the bonus column becomes
    lambda_g * c * B_i / max_j B_j (0 where the group's max is 0). Summed with weights [1, 1] by TRL this is
    r_i = R_i + lambda_g * c * B_i / max_j B_j. `success_dominance` caps lambda_g <= (1 - 1e-3) / c (D9)."""
    if rewards.dim() != 2 or rewards.shape[1] != 2 or rewards.shape[0] % group_size:
        raise ValueError(f"need an (N, 2) tensor with N a multiple of G={group_size}, got {tuple(rewards.shape)}")
    verifier = rewards[:, 0]
    w = win_rates(verifier, group_size, threshold)
    lam = bonus_weights(w, lambda0, w_max)
    if success_dominance:
        lam = lam.clamp(max=(1 - 1e-3) / c)
    raw = torch.nan_to_num(rewards[:, 1].double(), nan=0.0).clamp(min=0.0).view(-1, group_size)
    top = raw.max(dim=1, keepdim=True).values
    scaled = torch.where(top > 0, raw / top.clamp(min=1e-300), torch.zeros_like(raw))
    bonus = (lam.unsqueeze(1) * c * scaled).reshape(-1)
    out = rewards.clone()
    out[:, 1] = bonus.to(rewards.dtype)
    total = (torch.nan_to_num(verifier.double(), nan=0.0) + bonus).view(-1, group_size)
    won = (torch.nan_to_num(verifier.double(), nan=-math.inf) >= threshold).view(-1, group_size)
    inversions = 0
    for g in range(total.shape[0]):
        if won[g].any():
            best_win = total[g][won[g]].min()
            inversions += int((total[g][~won[g]] > best_win).sum())
    return Shaped(out, lam, w, inversions)


# ---------------------------------------------------------------------------------------------------------------------
# 6. The skill card (Eq. 11)
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class CorpusIndex:
    """What cards read of the corpus: per episode its canonical sequence, family, success, goal attributes and the
    abstracted surface form of each step."""

    trajectories: list[Trajectory]
    surfaces: dict[str, list[str]] = field(default_factory=dict)  # trajectory id -> surface form per step

    def attribute_priority(self) -> list[str]:
        """Goal attributes by corpus frequency, most frequent first (ties by name)."""
        counts = Counter(a for t in self.trajectories for a in t.goal_attributes)
        return [a for a, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def _contains(seq: Sequence[str], sub: Sequence[str]) -> bool:
    n = len(sub)
    return any(list(seq[i : i + n]) == list(sub) for i in range(len(seq) - n + 1))


def card_key(index: CorpusIndex, task_family: str | None, goal_attributes: Sequence[str], first_action: str | None):
    """The card's key (D14) and style: the task family when families are labelled (`family_chains`), else the
    highest-priority goal attribute the task asks for (`goal_attribute`), else the expert's first canonical action
    (`first_action`)."""
    if task_family is not None and any(t.family is not None for t in index.trajectories):
        return task_family, "family_chains"
    asked = [a for a in index.attribute_priority() if a in goal_attributes]
    if asked:
        return asked[0], "goal_attribute"
    return first_action, "first_action"


def episodes_for(index: CorpusIndex, key: str, style: str) -> list[Trajectory]:
    """E_k of Eq. 11."""
    if style == "family_chains":
        return [t for t in index.trajectories if t.family == key]
    if style == "goal_attribute":
        return [t for t in index.trajectories if key in t.goal_attributes]
    return [t for t in index.trajectories if t.tokens[:1] == [key]]


def chain_stats(tree: Tree, episodes: Sequence[Trajectory], node: Node) -> tuple[int, float]:
    """Eq. 11: support_k(n) (episodes containing expansion(n) contiguously) and succ_k(n) (their success rate)."""
    having = [t for t in episodes if _contains(t.tokens, node.expansion)]
    return len(having), (sum(t.success for t in having) / len(having) if having else 0.0)


def _surface(index: CorpusIndex, episodes: Sequence[Trajectory], node: Node) -> list[str]:
    """The most frequent surface form of each step of `node` among its occurrences in `episodes` (ties: smallest)."""
    forms: list[Counter] = [Counter() for _ in node.expansion]
    n = len(node.expansion)
    for t in episodes:
        surf = index.surfaces.get(t.id, [])
        for i in range(len(t.tokens) - n + 1):
            if t.tokens[i : i + n] == node.expansion and len(surf) >= i + n:
                for j in range(n):
                    forms[j][surf[i + j]] += 1
    return [
        min(c.items(), key=lambda kv: (-kv[1], kv[0]))[0] if c else tok
        for c, tok in zip(forms, node.expansion, strict=True)
    ]


def render_card(
    tree: Tree,
    index: CorpusIndex,
    key: str,
    style: str,
    max_chains: int = 6,
    min_chain_support: int = 5,
    above_margin: float = 0.01,
) -> str:
    """A skill card (docs/methods/xtree.md §4.5, Eq. 11): pure, no model call. `family_chains` and `first_action`
    list chains by support (then depth, then node order) in their most frequent surface form; `goal_attribute`
    lists chains containing `click<option-KEY>` by success rate (then support), each marked "ABOVE base" when
    succ_k >= base_k + `above_margin`."""
    episodes = episodes_for(index, key, style)
    base = sum(t.success for t in episodes) / len(episodes) if episodes else 0.0
    stats = []
    for i, node in enumerate(tree.nodes):
        if node.depth < 1:
            continue
        if style == "goal_attribute" and f"click<option-{key}>" not in node.expansion:
            continue
        support, succ = chain_stats(tree, episodes, node)
        if support >= min_chain_support:
            stats.append((node, support, succ, i))
    if style == "goal_attribute":
        stats.sort(key=lambda s: (-s[2], -s[1], s[3]))
        lines = [f"Skills for goals that specify {key} ({len(episodes)} episodes, base success {base:.0%}):"]
        for node, support, succ, _ in stats[:max_chains]:
            mark = "ABOVE base" if succ >= base + above_margin else "at base"
            gloss = "; ".join(_gloss(tok, key) for tok in node.expansion)
            lines.append(f"- {' -> '.join(node.expansion)}: {succ:.0%} of {support} episodes, {mark} ({gloss})")
        lines.append(f"Plan: follow the best chain above and choose the {key} the goal names before buying.")
        return "\n".join(lines)
    stats.sort(key=lambda s: (-s[1], -s[0].depth, s[3]))
    what = f"task type {key}" if style == "family_chains" else f"tasks that start with {key}"
    lines = [f"Skills for {what} ({len(episodes)} episodes):"]
    for node, support, _, _ in stats[:max_chains]:
        fams = {t.family for t in index.trajectories if _contains(t.tokens, node.expansion) and t.family is not None}
        more = f", {len(fams)} task types" if len(fams) > 1 else ""
        chain = " -> ".join(_surface(index, episodes, node))
        lines.append(f"- {chain} [{node.id}, depth {node.depth}, {support} episodes{more}]")
    lines.append("Plan: reproduce the standard chain for this task, with the names the instruction gives.")
    return "\n".join(lines)


def _gloss(token: str, key: str) -> str:
    if token == "click<option>" or (token.startswith("click<option-") and token != f"click<option-{key}>"):
        return "a wasted step"
    return {
        "search<query>": "search with the goal's words",
        "click<item>": "open the matching item",
        f"click<option-{key}>": f"choose the {key} the goal names",
        "click<buy>": "buy",
        "click<add>": "add the item to the cart",
        "click<checkout>": "check out with the instruction's coupon",
    }.get(token, token)
