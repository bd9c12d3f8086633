"""Property tests of the pure parts of X-Tree (`trainers/xtree.py`; arXiv 2609.32993, docs/methods/xtree.md):
canonicalisation (Eq. 1), the step matcher, the greedy X-Score miner (Eq. 2-5), encoding, the tree file, offline
node RL (Eq. 6), the online skill bonus (Eq. 7-10) and the skill card (Eq. 11).

Expected values come from hand-worked small corpora (worked out in comments), closed forms, or small brute-force
reference computations written here (`ref_merge`, `replay_check`), never from the code under test."""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
import re
from collections import Counter

import pytest
import torch

from trainers import xtree
from trainers.xtree import (
    CorpusIndex,
    MinerConfig,
    Node,
    Trajectory,
    Tree,
    bonus_weights,
    canon,
    card_key,
    chain_stats,
    check_tree,
    context_of,
    dumps,
    encode,
    episodes_for,
    loads,
    matches,
    mine,
    node_instances,
    offline_reward,
    pair_statistics,
    raw_bonus,
    render_card,
    render_text,
    shape_rewards,
    split_half,
    tree_stats,
    win_rates,
)

# ---------------------------------------------------------------------------------------------------------------------
# helpers: synthetic corpora, hand-built trees and an independent reference of the merge procedure
# ---------------------------------------------------------------------------------------------------------------------


def traj(tid, tokens, success=True, family=None, task_id=None, goal=()):
    return Trajectory(
        id=tid,
        task_id=task_id or tid,
        success=success,
        tokens=list(tokens),
        actions=[f"{tid}:{i}" for i in range(len(tokens))],
        family=family,
        goal_attributes=list(goal),
    )


def repeat(prefix, n, tokens, success=True, family=None, start=0):
    return [traj(f"{prefix}{start + k:02d}", tokens, success, family) for k in range(n)]


def cfg(**kw):
    base = dict(max_skills=50, min_frequency=2, mdl_lambda=0.5, max_skill_len=8)
    base.update(kw)
    return MinerConfig(**base)


def children(tree):
    return [list(n.children) for n in tree.nodes]


def ref_merge(seq, u, v, new):
    """Reference Eq. 2 / merge: replace (u, v) left to right without overlap."""
    out, i = [], 0
    while i < len(seq):
        if i + 1 < len(seq) and seq[i] == u and seq[i + 1] == v:
            out.append(new)
            i += 2
        else:
            out.append(seq[i])
            i += 1
    return out


def ref_replay(nodes, seq):
    for n in nodes:
        seq = ref_merge(list(seq), n.children[0], n.children[1], n.id)
    return list(seq)


def hand_tree(pairs, success=None, counts=None, successful_only=False, min_frequency=5, env="toy"):
    """A tree from a merge list written by hand; Eq. 5 computed here (expansion, length, depth)."""
    exp, dep, nodes = {}, {}, []
    for i, (u, v) in enumerate(pairs):
        nid = f"S{i}"
        exp[nid] = exp.get(u, [u]) + exp.get(v, [v])
        dep[nid] = 1 + max(dep.get(u, 0), dep.get(v, 0))
        nodes.append(
            Node(
                id=nid,
                children=[u, v],
                depth=dep[nid],
                length=len(exp[nid]),
                expansion=list(exp[nid]),
                count=counts[i] if counts else min_frequency,
                success=None if success is None else success[i],
                example=None,
            )
        )
    return Tree(
        environment=env,
        corpus={"name": "hand", "n_trajectories": 0, "successful_only": successful_only},
        config={"min_frequency": min_frequency},
        nodes=nodes,
        primitives=[],
    )


ALPHABET = ("a<x>", "b<y>", "c<x>", "d<z>")
MOTIF = ["a<x>", "b<y>", "c<x>"]


def random_corpus(seed, n=30, p_success=0.6, families=("f1", "f2", "f3"), runs=True):
    """Random sequences over a 4-token alphabet with a planted motif (so merges happen) and runs of one symbol."""
    rng = random.Random(seed)
    out = []
    for k in range(n):
        tokens = [rng.choice(ALPHABET) for _ in range(rng.randint(1, 7))]
        if rng.random() < 0.7:
            at = rng.randint(0, len(tokens))
            tokens[at:at] = MOTIF
        if runs and rng.random() < 0.3:
            tokens += ["d<z>"] * rng.randint(2, 5)
        success = rng.random() < p_success
        out.append(traj(f"t{k:03d}", tokens, success, rng.choice(families), task_id=f"task{k // 2}"))
    return out


def replay_check(trajs, tree, config):
    """Instrumented brute force of the greedy miner (Eq. 2-5): at each merge step, recount every adjacent pair of the
    current corpus state, keep the eligible ones and check that the tree's node is the best under the stated
    tie-break (higher X, then higher f, then longer, then the smallest (expansion(u), expansion(v))). Also checks the
    node's recorded statistics. Returns (final corpus state, number of steps that had a tie on X)."""
    ordered = sorted(trajs, key=lambda t: t.id)
    state = [list(t.tokens) for t in ordered]
    exp: dict[str, tuple] = {}

    def E(s):
        return exp.get(s, (s,))

    only_wins = all(t.success for t in ordered)
    tie_steps = 0
    for step in range(len(tree.nodes) + 1):
        cands = []
        for u, v in sorted({(s[i], s[i + 1]) for s in state for i in range(len(s) - 1)}):
            per = [len(s) - len(ref_merge(s, u, v, "#")) for s in state]
            hits = [k for k, m in enumerate(per) for _ in range(m)]
            f = len(hits)
            length = len(E(u)) + len(E(v))
            succ = 1.0 if only_wins else sum(ordered[k].success for k in hits) / f
            fams = {ordered[k].family for k in hits} - {None}
            x = f * length**config.p_len * (succ + config.eps) ** config.p_succ
            ok = (
                f >= config.min_frequency
                and length <= config.max_skill_len
                and f - 1 > config.mdl_lambda * length
                and (config.min_families is None or len(fams) >= config.min_families)
                and (config.min_success_rate is None or succ >= config.min_success_rate)
                and x > 0
            )
            if ok:
                cands.append(((-x, -f, -length, E(u), E(v)), (u, v, f, length, succ, x, hits)))
        if step == len(tree.nodes):
            if len(tree.nodes) < config.max_skills:
                assert not cands, f"miner stopped with eligible pairs left: {[c[1][:2] for c in cands]}"
            break
        assert cands, f"node {step} merged although no pair was eligible"
        key, (u, v, f, length, succ, x, hits) = min(cands)
        tie_steps += sum(c[0][0] == key[0] for c in cands) > 1
        node = tree.nodes[step]
        assert node.id == f"S{step}"
        assert node.children == [u, v], f"step {step}: chose {node.children}, best is {[u, v]}"
        assert node.count == f and node.length == length and node.score == x
        assert node.success == (None if only_wins else succ)
        assert node.n_episodes == len(set(hits))
        fam_eps = Counter(ordered[k].family for k in set(hits) if ordered[k].family is not None)
        assert (node.families or {}) == dict(fam_eps)
        exp[node.id] = E(u) + E(v)
        assert node.expansion == list(exp[node.id])
        state = [ref_merge(s, u, v, node.id) for s in state]
    return state, tie_steps


MIXED_CFG = MinerConfig(max_skills=30, min_frequency=3, mdl_lambda=0.5, max_skill_len=6)
FILTER_CFG = MinerConfig(
    max_skills=30,
    min_frequency=2,
    mdl_lambda=0.3,
    max_skill_len=5,
    min_success_rate=0.4,
    min_families=2,
    p_len=2.0,
    p_succ=0.5,
    eps=0.05,
)
CORPORA = {
    "mixed": (lambda: random_corpus(1), MIXED_CFG),
    "filters": (lambda: random_corpus(2, n=40), FILTER_CFG),
    "success_only": (lambda: random_corpus(3, p_success=1.0), MIXED_CFG),
    "capped": (lambda: random_corpus(4), MinerConfig(max_skills=3, min_frequency=3, mdl_lambda=0.5, max_skill_len=8)),
}


@pytest.fixture(scope="module")
def mined():
    out = {}
    for name, (make, config) in CORPORA.items():
        trajs = make()
        tree, occ = mine(trajs, config, environment="toy", corpus_name=name)
        out[name] = (trajs, config, tree, occ)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Canonicalisation (Eq. 1): properties 1-2, context_of
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, ctx, first, second, token, slot",
    [
        ("shop", {}, "click[B7K2]", "click[otter]", "click<item>", "item"),
        ("shop", {}, "search[red cotton shirt]", "search[blue wool hat under 30]", "search<query>", "query"),
        ("shop", {"goal_attributes": ["size"]}, "choose[m]", "choose[xl]", "click<option-size>", "option"),
        ("shop", {"goal_attributes": ["colour"]}, "choose[red]", "choose[blue]", "click<option-colour>", "option"),
        ("shop", {}, "choose[m]", "choose[pink]", "click<option>", "option"),
        ("search", {}, "search[Zorvak Telmi]", "I look it up. search[Other Name]", "search<query>", "query"),
        ("search", {}, "answer[Paris]", "so: answer[Lima]", "answer<message>", "answer"),
        ("terminal", {}, "echo apple > zeta.txt", "echo pear > logs/b.txt", "write<file>", "line"),
        ("terminal", {}, "echo apple >> zeta.txt", "echo x >> y", "write<append>", "line"),
        ("terminal", {}, "cat notes.txt", "cat a/b/c.md", "read<path>", "line"),
        ("terminal", {}, "rm -rf logs", "rm -r data", "remove<dir>", "line"),
        ("terminal", {}, "rm a.txt", "rm b.txt", "remove<file>", "line"),
        ("terminal", {}, "mkdir out", "mkdir -p deep/er", "mkdir<path>", "line"),
    ],
)
def test_canon_invariance_keeps_values_in_slots(env, ctx, first, second, token, slot):
    """Property 1: actions differing only in ids / typed values / option values / object names share a token; the
    slots keep the values and the raw action string."""
    (t1, s1), (t2, s2) = canon(env, first, ctx), canon(env, second, ctx)
    assert t1 == t2 == token
    assert s1["raw"] == first and s2["raw"] == second
    assert s1[slot] != s2[slot]


def test_canon_slot_values_are_the_typed_values():
    """Property 1: the slots hold exactly what was removed from the action."""
    assert canon("shop", "click[B7K2]")[1]["item"] == "B7K2"
    assert canon("shop", "search[ red shirt ]")[1]["query"] == "red shirt"
    assert canon("shop", "choose[M]", {"goal_attributes": ["size"]}) == (
        "click<option-size>",
        {"raw": "choose[M]", "option": "m", "surface": "choose[<obj>]"},
    )
    assert canon("search", "search[a] then search[Zorvak Telmi]")[1]["query"] == "Zorvak Telmi"  # the last one
    assert canon("terminal", "cat   'my notes.txt'")[1]["line"] == "cat my notes.txt"


@pytest.mark.parametrize(
    "env, action, ctx, token",
    [
        ("shop", "buy", {}, "click<buy>"),
        ("shop", "buy[]", {}, "click<buy>"),
        ("shop", "Click[b01]", {}, "click<item>"),
        ("shop", "choose[red]", {"goal_attributes": ["size"]}, "click<option>"),  # colour not asked for
        ("shop", "choose[m]", {"goal_attributes": ["colour"]}, "click<option>"),  # size not asked for
        ("shop", "choose[M]", {"goal_attributes": ["size", "colour"]}, "click<option-size>"),
        ("shop", "choose[velvet]", {"goal_attributes": ["size", "colour"]}, "click<option>"),  # no option kind
        ("shop", "add", {}, "click<add>"),  # the shopping lists' actions (levels 1 and 2)
        ("shop", "ADD[ ]", {}, "click<add>"),
        ("shop", "checkout[mango]", {}, "click<checkout>"),
        ("shop", "checkout", {}, "other<object>"),  # the coupon is part of the action
        ("shop", "jump[3]", {}, "other<object>"),
        ("shop", "I will search[shirt]", {}, "other<object>"),  # the shop needs the bare action
        ("search", "hello there", {}, "other<object>"),
        ("terminal", "echo hi", {}, "write<stdout>"),
        ("terminal", "cat a.txt | grep x", {}, "read<pipe>"),
        ("terminal", "ls", {}, "observe<cwd>"),
        ("terminal", "ls -la docs", {}, "observe<path>"),
        ("terminal", "pwd", {}, "observe<cwd>"),
        ("terminal", "cd /tmp", {}, "navigate<path>"),
        ("terminal", "submit", {}, "submit<task>"),
        ("terminal", "done", {}, "submit<task>"),
        ("terminal", "$ cp a.txt b.txt", {}, "copy<path>"),
        ("terminal", "frobnicate x", {}, "other<object>"),
        ("terminal", "echo 'unterminated", {}, "other<object>"),
        ("terminal", "", {}, "other<object>"),
    ],
)
def test_canon_tables(env, action, ctx, token):
    """Properties 2-3: per-environment tables; unknown verbs become `other<object>`."""
    assert canon(env, action, ctx)[0] == token


@pytest.mark.parametrize(
    "action, names, token",
    [
        ("click [42]", ["click", "type"], "click<object>"),
        ("CLICK [42]", ["click"], "click<object>"),
        ("  type [3] hello", ["click", "type"], "type<object>"),
        ("scroll down", ["click", "type"], "other<object>"),
        ("click [42]", [], "click<object>"),  # no action names listed: any word is a verb
        ("Look_Around now", [], "look_around<object>"),
        ("42 go", [], "other<object>"),
        ("[42]", ["click"], "other<object>"),
    ],
)
def test_canon_generic_fallback(action, names, token):
    """Property 2: an environment without a table uses the generic fallback: its first word as the verb with role
    `object`; when the environment lists action names, a word outside them (or no word) is `other<object>`."""
    tok, slots = canon("someweb", action, {"action_names": names})
    assert tok == token
    assert slots["raw"] == action


def test_canon_without_context_and_unknown_env():
    """Property 2: without a context the generic table takes any first word and the shop asks for no attribute."""
    assert canon("unknown-env", "click [1]")[0] == "click<object>"
    assert canon("unknown-env", "  ")[0] == "other<object>"
    assert canon("shop", "choose[m]")[0] == "click<option>"


@pytest.mark.parametrize(
    "env, action, ctx",
    [
        ("shop", "choose[M]", {"goal_attributes": ["size"]}),
        ("search", "search[x] answer[y]", {}),
        ("terminal", "rm -rf logs", {"family": "cleanup"}),
        ("web", "click [4]", {"action_names": ("click",)}),
    ],
)
def test_canon_is_pure(env, action, ctx):
    """Property 2: same input and context give the same output; the context is not modified; outputs are fresh."""
    before = copy.deepcopy(ctx)
    first = canon(env, action, ctx)
    first[1]["raw"] = "mutated"
    second, third = canon(env, action, ctx), canon(env, action, copy.deepcopy(ctx))
    assert second == third and second[1]["raw"] == action
    assert ctx == before


def test_context_of():
    """Eq. 1 context: goal attributes the target specifies (colour only at shop level 4), family, action names."""
    t = {"target": {"size": "m", "colour": "red"}, "difficulty": 1, "kind": "cleanup"}
    assert context_of(t, ("a",)) == {"goal_attributes": ["size"], "family": "cleanup", "action_names": ("a",)}
    t2 = {"target": {"size": "m", "colour": "red"}, "difficulty": 4, "family": "fam"}
    assert context_of(t2)["goal_attributes"] == ["size", "colour"]
    assert context_of(t2)["family"] == "fam"
    assert context_of({**t2, "difficulty": 2})["goal_attributes"] == ["size"]  # the colour is no option there
    shopping_list = {"targets": [{"size": "s", "colour": "red"}, {"size": "m", "colour": "blue"}], "difficulty": 2}
    assert context_of(shopping_list)["goal_attributes"] == ["size"]
    assert context_of({})["goal_attributes"] == [] and context_of({})["family"] is None


@pytest.mark.parametrize(
    "action, token, line",
    [
        ("echo apple > zeta.txt", "write<file>", "echo apple > zeta.txt"),
        ("echo apple>zeta.txt", "write<file>", "echo apple > zeta.txt"),
        ("echo apple>>zeta.txt", "write<append>", "echo apple >> zeta.txt"),
        ("cat notes.txt | grep apple", "read<pipe>", "cat notes.txt | grep apple"),
        ("cat notes.txt|grep apple", "read<pipe>", "cat notes.txt | grep apple"),
        ("echo '>' note", "write<stdout>", "echo > note"),
    ],
)
def test_canon_terminal_roles_follow_the_shell(action, token, line):
    """Property 1: commands the terminal's shell runs identically (with or without spaces around an operator) get one
    token; a quoted operator is a plain word (envs/terminal.py splits lines the same way)."""
    tok, slots = canon("terminal", action)
    assert tok == token and slots["line"] == line and slots["raw"] == action


def test_canon_search_needs_a_word_boundary_like_the_environment():
    """Eq. 1 / search table: the environment ignores `research[x]` (its regex needs \\b), so it is no action."""
    assert canon("search", "research[Zorvak]")[0] == "other<object>"


# ---------------------------------------------------------------------------------------------------------------------
# The step matcher (D5)
# ---------------------------------------------------------------------------------------------------------------------


def shop(action, goal=("size",)):
    return canon("shop", action, {"goal_attributes": list(goal)})


def test_matcher_shop_search_by_word_jaccard():
    """D5: shop searches match by word-set Jaccard >= 0.5 (case-insensitive words)."""
    gold = shop("search[red cotton shirt]")
    assert matches("shop", gold, shop("search[Red SHIRT]")) == (True, "")  # 2/3
    assert matches("shop", gold, shop("search[red cotton shirt]")) == (True, "")  # 1
    assert matches("shop", gold, shop("search[blue shirt]")) == (False, "slot")  # 1/4
    two = shop("search[red shirt]")
    assert matches("shop", two, shop("search[red shirt cheap cotton]")) == (True, "")  # 2/4: exactly 0.5
    assert matches("shop", two, shop("search[red shirt cheap cotton wool]")) == (False, "slot")  # 2/5
    assert matches("shop", gold, shop("search[red shirt]"), jaccard=0.7) == (False, "slot")  # 2/3 < 0.7
    assert matches("shop", shop("search[]"), shop("search[]")) == (False, "slot")  # no words at all


def test_matcher_ids_and_options_case_insensitive():
    """D5: item ids and option values match case-insensitively; another id is a slot mismatch."""
    assert matches("shop", shop("click[B7K2]"), shop("click[b7k2]")) == (True, "")
    assert matches("shop", shop("click[B7K2]"), shop("click[B7K3]")) == (False, "slot")
    assert matches("shop", shop("choose[M]"), shop("choose[m]")) == (True, "")
    assert matches("shop", shop("choose[m]"), shop("choose[l]")) == (False, "slot")
    assert matches("shop", shop("checkout[mango]"), shop("checkout[ MANGO ]")) == (True, "")
    assert matches("shop", shop("checkout[mango]"), shop("checkout[otter]")) == (False, "slot")
    assert matches("shop", shop("add"), shop("add[]")) == (True, "")
    assert matches("shop", shop("add"), shop("buy")) == (False, "token")
    # slots given by hand, as a logged file may hold them
    gold = ("click<item>", {"item": "Otter"})
    assert matches("shop", gold, ("click<item>", {"item": " OTTER "})) == (True, "")
    assert matches("search", canon("search", "answer[paris  france]"), canon("search", "answer[ Paris France ]")) == (
        True,
        "",
    )
    assert matches("search", canon("search", "answer[Paris]"), canon("search", "answer[Lima]")) == (False, "slot")


def test_matcher_reasons_token_slot_parse():
    """D5: the three rejection reasons: parse failure (`other`), token mismatch, slot mismatch."""
    gold = shop("click[B7K2]")
    assert matches("shop", gold, shop("search[B7K2]")) == (False, "token")
    assert matches("shop", gold, shop("open the item please")) == (False, "parse")
    assert matches("shop", shop("buy"), shop("jump")) == (False, "parse")
    assert matches("shop", shop("buy"), shop("buy")) == (True, "")  # no key slot: the token decides
    assert matches("shop", shop("choose[m]", ("size",)), shop("choose[red]", ("size", "colour"))) == (False, "token")
    assert matches("shop", gold, shop("click[zzz]")) == (False, "slot")


def test_matcher_terminal_lines():
    """D5: terminal command lines compare after shlex splitting (quotes and spacing do not matter)."""
    gold = canon("terminal", "cat notes.txt")
    assert matches("terminal", gold, canon("terminal", "cat   notes.txt")) == (True, "")
    assert matches("terminal", gold, canon("terminal", "cat 'notes.txt'")) == (True, "")
    assert matches("terminal", gold, canon("terminal", "$ cat notes.txt")) == (True, "")
    assert matches("terminal", gold, canon("terminal", "cat other.txt")) == (False, "slot")
    assert matches("terminal", gold, canon("terminal", "rm notes.txt")) == (False, "token")
    assert matches("terminal", gold, canon("terminal", "cat 'oops")) == (False, "parse")


def test_matcher_terminal_compares_tokens_not_joined_text():
    """D5: the terminal matcher compares command lines token by token, so a quoted name is not two names."""
    gold = canon("terminal", "touch 'my file'")
    assert matches("terminal", gold, canon("terminal", "touch my file")) == (False, "slot")


# ---------------------------------------------------------------------------------------------------------------------
# Mining: properties 4-11
# ---------------------------------------------------------------------------------------------------------------------


def test_mining_is_permutation_invariant(mined):
    """Property 4: any permutation of the input gives the same merge list, byte-identical JSON and sidecar."""
    for name, (trajs, config, tree, occ) in mined.items():
        ref = dumps(tree)
        rng = random.Random(name)
        for _ in range(6):
            shuffled = list(trajs)
            rng.shuffle(shuffled)
            t2, occ2 = mine(shuffled, config, environment="toy", corpus_name=name)
            assert dumps(t2) == ref
            assert occ2 == occ


def test_mining_is_deterministic_over_all_orders_of_a_small_corpus():
    """Property 4: all 5! orders of a small corpus give the same bytes."""
    trajs = [
        traj("e", ["a", "b", "a", "b"]),
        traj("c", ["a", "b", "c"], False, "f"),
        traj("a", ["b", "c", "a", "b"], True, "g"),
        traj("d", ["c", "a", "b"]),
        traj("b", ["a", "b", "c", "c"], False),
    ]
    outs = {dumps(mine(p, cfg(min_frequency=2, mdl_lambda=0.2))[0]) for p in itertools.permutations(trajs)}
    assert len(outs) == 1
    assert json.loads(outs.pop())["n_nodes"] >= 1


def test_mining_rejects_duplicate_ids():
    with pytest.raises(ValueError):
        mine([traj("x", ["a", "b"]), traj("x", ["a", "b"])], cfg())


def test_pairs_never_span_two_trajectories():
    """Property 5: a pair that only occurs across a boundary is never counted or merged."""
    # concatenated (in id order) these read a b a b a b ... with 5 (a, b) and 5 (b, a) pairs
    trajs = [traj(f"t{k:02d}", ["a"] if k % 2 == 0 else ["b"]) for k in range(10)]
    assert pair_statistics([t.tokens for t in trajs]) == {}
    tree, occ = mine(trajs, cfg(min_frequency=2, mdl_lambda=0.0))
    assert tree.nodes == [] and occ == []
    # x a | b y: only (x, a) and (b, y) exist
    stats = pair_statistics([["x", "a"], ["b", "y"]] * 3)
    assert set(stats) == {("x", "a"), ("b", "y")}
    assert stats[("x", "a")] == [(0, 0), (2, 0), (4, 0)]
    tree, _ = mine([traj(f"t{k}", ["x", "a"] if k % 2 else ["b", "y"]) for k in range(8)], cfg(min_frequency=2))
    assert ["a", "b"] not in [n.expansion for n in tree.nodes]
    assert sorted(map(tuple, children(tree))) == [("b", "y"), ("x", "a")]


@pytest.mark.parametrize("n", range(0, 9))
def test_runs_count_without_overlap(n):
    """Property 6: in a run of n identical symbols f = floor(n / 2), at positions 0, 2, 4, ..."""
    stats = pair_statistics([["a"] * n])
    expected = [(0, i) for i in range(0, 2 * (n // 2), 2)]
    assert stats.get(("a", "a"), []) == expected


def test_non_overlap_in_mixed_sequences():
    """Property 6: counting restarts after the previous counted occurrence ends; pairs in other runs still count."""
    stats = pair_statistics([["a", "a", "a", "b", "a", "a", "a", "a"], ["a", "a", "a"]])
    assert stats[("a", "a")] == [(0, 0), (0, 4), (0, 6), (1, 0)]
    assert stats[("a", "b")] == [(0, 2)] and stats[("b", "a")] == [(0, 3)]


def test_merge_replaces_exactly_the_counted_run_pairs():
    """Property 6: 6 x (a a a): f(a, a) = 6 (one per run), the merge gives (S0 a), then (S0, a) gives S1;
    occurrences at 0-2 and 0-3."""
    trajs = repeat("r", 6, ["a"] * 3)
    tree, occ = mine(trajs, cfg(min_frequency=2))
    assert children(tree) == [["a", "a"], ["S0", "a"]]
    assert [n.count for n in tree.nodes] == [6, 6]
    assert sorted((o.node, o.start, o.end) for o in occ) == sorted([("S0", 0, 2)] * 6 + [("S1", 0, 3)] * 6)
    # a run of five becomes S0 S0 a (spans 0-2, 2-4, 4-5)
    assert encode(hand_tree([("a", "a")]), ["a"] * 5) == [("S0", 0, 2), ("S0", 2, 4), ("a", 4, 5)]
    # 4 x (a a a a): f = 8 (two per run); then (S0, S0) with f = 4
    tree, occ = mine(repeat("q", 4, ["a"] * 4), cfg(min_frequency=2))
    assert children(tree) == [["a", "a"], ["S0", "S0"]] and [n.count for n in tree.nodes] == [8, 4]
    assert Counter(o.node for o in occ) == {"S0": 8, "S1": 4}


def test_compression_test_boundary():
    """Property 7 / Eq. 4: with eta = 1 and l = 2 a pair needs f - 1 > 2: f = 3 is refused, f = 4 merged."""
    assert mine(repeat("t", 3, ["a", "b"]), cfg(min_frequency=1, mdl_lambda=1.0))[0].nodes == []
    assert children(mine(repeat("t", 4, ["a", "b"]), cfg(min_frequency=1, mdl_lambda=1.0))[0]) == [["a", "b"]]


def test_min_frequency_boundary():
    """Property 7 / Eq. 4: f >= min_frequency."""
    assert mine(repeat("t", 3, ["a", "b"]), cfg(min_frequency=4, mdl_lambda=0.0))[0].nodes == []
    assert len(mine(repeat("t", 4, ["a", "b"]), cfg(min_frequency=4, mdl_lambda=0.0))[0].nodes) == 1


def test_max_skill_len():
    """Property 7: no expansion longer than max_skill_len. 6 x (a b c): (a, b) and (b, c) tie, (a, b) is smaller;
    then (S0, c) has length 3."""
    trajs = repeat("t", 6, ["a", "b", "c"])
    assert children(mine(trajs, cfg(max_skill_len=2))[0]) == [["a", "b"]]
    assert children(mine(trajs, cfg(max_skill_len=3))[0]) == [["a", "b"], ["S0", "c"]]


def test_huge_eta_gives_no_merge(mined):
    """Property 7: when f - 1 <= eta * l for every pair, nothing is merged."""
    for trajs, _, _, _ in mined.values():
        total = sum(len(t.tokens) for t in trajs)
        tree, occ = mine(trajs, MinerConfig(min_frequency=1, mdl_lambda=total))
        assert tree.nodes == [] and occ == []


def test_max_skills_cap_is_a_prefix(mined):
    """Property 7: never more than max_skills nodes; a capped run is a prefix of the uncapped one."""
    trajs, config, tree, _ = mined["mixed"]
    assert 4 <= len(tree.nodes) <= config.max_skills
    for k in range(len(tree.nodes) + 2):
        capped, occ = mine(trajs, cfg(**{**config.to_json(), "max_skills": k}))
        assert len(capped.nodes) == min(k, len(tree.nodes))
        assert capped.nodes == tree.nodes[:k]
        assert occ == [o for o in mine(trajs, config)[1] if int(o.node[1:]) < k]
    assert len(mined["capped"][2].nodes) == 3


def test_min_families_and_success_rate_filters():
    """Property 7 / Eq. 4: |fam(uv)| >= min_families (None families do not count), succ(uv) >= min_success_rate."""
    one_family = repeat("t", 6, ["a", "b"], family="f")
    assert mine(one_family, cfg(min_families=2))[0].nodes == []
    assert len(mine(one_family, cfg(min_families=1))[0].nodes) == 1
    two = one_family[:3] + repeat("u", 3, ["a", "b"], family="g")
    assert len(mine(two, cfg(min_families=2))[0].nodes) == 1
    assert mine(repeat("t", 6, ["a", "b"]), cfg(min_families=1))[0].nodes == []  # no labelled family
    half = repeat("w", 4, ["a", "b"]) + repeat("l", 4, ["a", "b"], success=False)  # succ = 0.5
    assert len(mine(half, cfg(min_success_rate=0.5))[0].nodes) == 1
    assert mine(half, cfg(min_success_rate=0.51))[0].nodes == []


@pytest.mark.parametrize("name", list(CORPORA))
def test_greedy_choice_instrumented(mined, name):
    """Properties 7-8: at every merge step the chosen pair is eligible (Eq. 4) and is the best eligible pair under
    the tie-break, by brute force over the corpus state; recorded count, score, success, n_episodes, families and
    expansion agree; the miner stops only when nothing is eligible or at max_skills."""
    trajs, config, tree, _ = mined[name]
    assert len(tree.nodes) >= 3
    _, ties = replay_check(trajs, tree, config)
    if name == "success_only":  # integer scores: the tie-break is exercised
        assert ties >= 1
    for n in tree.nodes:
        assert n.count >= config.min_frequency and n.length <= config.max_skill_len
        assert n.count - 1 > config.mdl_lambda * n.length and n.score > 0


def test_tie_break_higher_f_first():
    """Property 8: 4x(a b c) 4x(a b) 6x(d e): S0 = (a, b) with X = 16; then (S0, c) X = 4*3 = 12 ties (d, e)
    X = 6*2 = 12, and the higher f = 6 wins."""
    trajs = repeat("p", 4, ["a", "b", "c"]) + repeat("q", 4, ["a", "b"]) + repeat("r", 6, ["d", "e"])
    tree, _ = mine(trajs, cfg())
    assert children(tree) == [["a", "b"], ["d", "e"], ["S0", "c"]]
    assert [n.score for n in tree.nodes] == [16.0, 12.0, 12.0]


def test_tie_break_longer_first():
    """Property 8: with p_len = 0, X = f * succ: S0 = (a, b) (f = 8); then (S0, c) and (d, e) both have f = 4 and
    X = 4, and the longer (S0, c) wins."""
    trajs = repeat("p", 4, ["a", "b", "c"]) + repeat("q", 4, ["a", "b"]) + repeat("r", 4, ["d", "e"])
    tree, _ = mine(trajs, cfg(p_len=0.0))
    assert children(tree) == [["a", "b"], ["S0", "c"], ["d", "e"]]


def test_tie_break_by_expansion_not_by_node_id():
    """Property 8: (c d) f = 9 -> S0, (a b) f = 8 -> S1; then (S0, x) and (S1, x) tie on X = 15, f = 5, l = 3;
    expansion (a, b) < (c, d), so (S1, x) is merged first although "S0" < "S1"."""
    trajs = (
        repeat("p", 5, ["c", "d", "x"])
        + repeat("q", 4, ["c", "d"])
        + repeat("r", 5, ["a", "b", "x"])
        + repeat("s", 3, ["a", "b"])
    )
    tree, _ = mine(trajs, cfg())
    assert children(tree) == [["c", "d"], ["a", "b"], ["S1", "x"], ["S0", "x"]]
    assert [n.score for n in tree.nodes] == [18.0, 16.0, 15.0, 15.0]


def test_tie_break_lexicographic_on_primitives():
    """Property 8: 4x(c d) and 4x(a b): same X, f and length; ('a',), ('b',) < ('c',), ('d',)."""
    tree, _ = mine(repeat("z", 4, ["c", "d"]) + repeat("y", 4, ["a", "b"]), cfg())
    assert children(tree) == [["a", "b"], ["c", "d"]]


def test_failed_only_pair_is_never_merged():
    """Property 9: with p_succ = 1 and eps = 0 a pair seen only in failed episodes has X = 0 and is never merged,
    even when it is the most frequent; with eps > 0 it becomes eligible (X = 10 * 2 * 0.1 = 2)."""
    trajs = repeat("f", 10, ["x", "y"], success=False) + repeat("s", 5, ["a", "b"])
    tree, _ = mine(trajs, cfg())
    assert children(tree) == [["a", "b"]]
    assert tree.nodes[0].success == 1.0
    assert ["x", "y"] in children(mine(trajs, cfg(eps=0.1))[0])


def test_more_successful_pair_first():
    """Property 9: (a b) and (c d) each f = 6, l = 2; 4 vs 5 successes: X = 8 vs 10, so (c, d) goes first although
    (a, b) is lexicographically smaller."""
    trajs = (
        repeat("a", 4, ["a", "b"])
        + repeat("a", 2, ["a", "b"], success=False, start=4)
        + repeat("c", 5, ["c", "d"])
        + repeat("c", 1, ["c", "d"], success=False, start=5)
    )
    tree, _ = mine(trajs, cfg())
    assert children(tree) == [["c", "d"], ["a", "b"]]
    assert tree.nodes[0].success == pytest.approx(5 / 6) and tree.nodes[1].success == pytest.approx(4 / 6)
    assert tree.nodes[0].score == pytest.approx(10.0) and tree.nodes[1].score == pytest.approx(8.0)


def test_x_score_closed_form():
    """Eq. 3: X = f * l^p_len * (succ + eps)^p_succ."""
    assert xtree.x_score(6, 3, 0.5, 1.0, 1.0, 0.0) == 9.0
    assert xtree.x_score(4, 3, 0.5, 2.0, 1.0, 0.0) == 18.0  # 4 * 9 * 0.5
    assert xtree.x_score(4, 3, 0.21, 1.0, 2.0, 0.04) == pytest.approx(4 * 3 * 0.0625)  # 0.25^2
    assert xtree.x_score(5, 2, 0.0, 1.0, 1.0, 0.0) == 0.0


def tree_invariant_problems(tree):
    """Property 10 written out here, independently of check_tree."""
    out, seen = [], set()
    by_id = {n.id: n for n in tree.nodes}
    for n in tree.nodes:
        u, v = n.children
        out += [f"{n.id} child order" for c in (u, v) if c in by_id and c not in seen]
        eu = by_id[u].expansion if u in by_id else [u]
        ev = by_id[v].expansion if v in by_id else [v]
        du = by_id[u].depth if u in by_id else 0
        dv = by_id[v].depth if v in by_id else 0
        if n.expansion != eu + ev:
            out.append(f"{n.id} expansion")
        if n.length != len(n.expansion):
            out.append(f"{n.id} length")
        if n.depth != 1 + max(du, dv):
            out.append(f"{n.id} depth")
        if n.count < tree.config["min_frequency"]:
            out.append(f"{n.id} count")
        seen.add(n.id)
    return out


def test_tree_invariants(mined):
    """Property 10: expansion = left ++ right, length = len(expansion), depth = 1 + max child depth, children precede
    parents, count >= min_frequency; check_tree agrees."""
    depths = set()
    for _, _, tree, _ in mined.values():
        assert tree_invariant_problems(tree) == []
        assert check_tree(tree) == []
        depths |= {n.depth for n in tree.nodes}
    assert max(depths) >= 2  # some nesting happened


def test_check_tree_reports_violations():
    """Property 10: check_tree finds each kind of violation."""
    good = hand_tree([("a", "b"), ("S0", "c"), ("d", "e")], min_frequency=5)
    assert check_tree(good) == []

    def broken(edit):
        t = hand_tree([("a", "b"), ("S0", "c"), ("d", "e")], min_frequency=5)
        edit(t.nodes)
        return check_tree(Tree(t.environment, t.corpus, t.config, t.nodes, t.primitives))

    def set_(i, k, v):
        return lambda nodes: setattr(nodes[i], k, v)

    cases = [
        set_(1, "expansion", ["a", "c", "b"]),
        set_(1, "length", 4),
        set_(1, "depth", 1),
        set_(2, "count", 4),
        lambda nodes: nodes.reverse(),  # S1 and S0 now come after their parents
    ]
    for edit in cases:
        problems = broken(edit)
        assert problems, edit
    assert any("S1" in p for p in broken(set_(1, "depth", 1)))
    assert any("S2" in p for p in broken(set_(2, "count", 4)))


def test_length_accounting_and_sidecar(mined):
    """Property 11: corpus length drops by exactly sum(count); the sidecar holds count occurrences per node, each
    spanning its node's expansion in its trajectory; the example is the first occurrence's actions."""
    for trajs, _, tree, occ in mined.values():
        by_id = {t.id: t for t in trajs}
        before = sum(len(t.tokens) for t in trajs)
        after = sum(len(ref_replay(tree.nodes, t.tokens)) for t in trajs)
        assert before - after == sum(n.count for n in tree.nodes)
        assert Counter(o.node for o in occ) == {n.id: n.count for n in tree.nodes}
        nodes = {n.id: n for n in tree.nodes}
        for o in occ:
            assert by_id[o.traj_id].tokens[o.start : o.end] == nodes[o.node].expansion
        for n in tree.nodes:
            first = next(o for o in occ if o.node == n.id)
            assert first.traj_id == min(o.traj_id for o in occ if o.node == n.id)
            assert n.example == by_id[first.traj_id].actions[first.start : first.end]
        assert tree.primitives == [
            {"token": k, "count": c} for k, c in sorted(Counter(x for t in trajs for x in t.tokens).items())
        ]
        assert tree.n_primitives == len(tree.primitives)
        assert tree.corpus["n_trajectories"] == len(trajs)
        assert tree.successful_only == all(t.success for t in trajs)


# ---------------------------------------------------------------------------------------------------------------------
# Encoding: property 12
# ---------------------------------------------------------------------------------------------------------------------


def test_encode_reproduces_the_final_corpus(mined):
    """Property 12: replaying the merges on the mining corpus reproduces the miner's final corpus (brute-force state
    of the instrumented run, and the top-level occurrences of the sidecar); spans partition every sequence."""
    for trajs, config, tree, occ in mined.values():
        state, _ = replay_check(trajs, tree, config)
        ordered = sorted(trajs, key=lambda t: t.id)
        for t, final in zip(ordered, state, strict=True):
            tiles = encode(tree, t.tokens)
            assert [s for s, _, _ in tiles] == final
            assert tiles[0][1] == 0 if tiles else t.tokens == []
            assert all(a < b for _, a, b in tiles)
            assert [b for _, _, b in tiles[:-1]] == [a for _, a, _ in tiles[1:]]
            assert tiles[-1][2] == len(t.tokens)
            spans = {(o.node, o.start, o.end) for o in occ if o.traj_id == t.id}
            top = {
                s
                for s in spans
                if not any(o != s and o[1] <= s[1] and s[2] <= o[2] for o in spans)  # not inside another
            }
            assert {tile for tile in tiles if tile[0] in tree.by_id} == top


def test_encode_new_sequences_tiles_and_expands(mined):
    """Property 12: on unseen sequences the tiling equals the reference replay, its spans partition the sequence and
    every tile expands to the primitives it covers."""
    rng = random.Random(7)
    _, _, tree, _ = mined["mixed"]
    for _ in range(60):
        seq = [rng.choice(ALPHABET) for _ in range(rng.randint(0, 14))]
        tiles = encode(tree, seq)
        assert [s for s, _, _ in tiles] == ref_replay(tree.nodes, seq)
        pos = 0
        for s, a, b in tiles:
            assert a == pos and b > a
            assert (tree.by_id[s].expansion if s in tree.by_id else [s]) == seq[a:b]
            pos = b
        assert pos == len(seq)


def self_encoding_violations(tree):
    return [n.id for n in tree.nodes if encode(tree, n.expansion) != [(n.id, 0, n.length)]]


def test_self_encoding_violations_are_counted():
    """Property 12 (diagnostic): encoding a node's expansion need not give the node alone. Hand case: S0 = (b, c),
    S1 = (a, b), S2 = (S1, c); expansion(S2) = a b c is tiled a | S0 because (b, c) is replayed first."""
    tree = hand_tree([("b", "c"), ("a", "b"), ("S1", "c")])
    assert encode(tree, ["a", "b", "c"]) == [("a", 0, 1), ("S0", 1, 3)]
    assert self_encoding_violations(tree) == ["S2"]
    assert self_encoding_violations(hand_tree([("a", "b"), ("S0", "c"), ("c", "d")])) == []


def test_self_encoding_of_mined_trees_is_a_valid_tiling(mined):
    """Property 12 (diagnostic): for mined trees count self-encoding violations; each tiling is still a partition."""
    for _, _, tree, _ in mined.values():
        violations = self_encoding_violations(tree)
        assert len(violations) <= len(tree.nodes)
        for n in tree.nodes:
            tiles = encode(tree, n.expansion)
            flat = [p for s, _, _ in tiles for p in (tree.by_id[s].expansion if s in tree.by_id else [s])]
            assert flat == n.expansion


# ---------------------------------------------------------------------------------------------------------------------
# The tree file: property 13, render_text, plot_tree
# ---------------------------------------------------------------------------------------------------------------------


def test_json_round_trip_of_mined_trees(mined, tmp_path):
    """Property 13: loads(dumps(t)) == t field by field; dumps is stable; save twice is byte-identical; the sidecar
    round-trips."""
    for name, (_, _, tree, occ) in mined.items():
        text = dumps(tree)
        back = loads(text)
        assert back == tree
        assert back.nodes == tree.nodes
        assert (back.environment, back.corpus, back.config, back.primitives, back.n_primitives, back.extra) == (
            tree.environment,
            tree.corpus,
            tree.config,
            tree.primitives,
            tree.n_primitives,
            tree.extra,
        )
        assert dumps(back) == text
        path = tmp_path / f"{name}.json"
        xtree.save(tree, str(path), occ)
        first = path.read_bytes()
        xtree.save(xtree.load(str(path)), str(path), occ)
        assert path.read_bytes() == first == text.encode("utf-8")
        assert xtree.load_occurrences(str(path)) == occ
        assert (tmp_path / f"{name}.occ.jsonl").exists()
        assert not list(tmp_path.glob("*.tmp"))


def released_style_text():
    """A tree file in the released schema, written here in the documented key order, with unknown keys."""
    node0 = {
        "id": "S0",
        "children": ["search<query>", "click<item>"],
        "depth": 1,
        "length": 2,
        "expansion": ["search<query>", "click<item>"],
        "count": 12,
        "success": None,
        "example": ["search<query>(red shirt)", "click<item>(B7K2)"],
        "comment": "kept",
    }
    node1 = {
        "id": "S1",
        "children": ["S0", "click<buy>"],
        "depth": 2,
        "length": 3,
        "expansion": ["search<query>", "click<item>", "click<buy>"],
        "count": 7,
        "success": 0.25,
        "example": None,
        "score": 5.25,
        "n_episodes": 7,
        "families": {"f": 7},
        "zz_extra": [1, {"é": "ü"}],
    }
    data = {
        "environment": "WebShop é",
        "corpus": {"name": "ETO", "n_trajectories": 20, "successful_only": False},
        "n_primitives": 17,
        "n_nodes": 2,
        "config": {"max_skills": 60, "min_frequency": 5, "mdl_lambda": 0.5, "max_skill_len": 8},
        "format": "released v0",
        "nodes": [node0, node1],
        "notes": "unknown top-level key",
        "generated_by": {"tool": "x"},
    }
    return json.dumps(data, ensure_ascii=False, indent=1) + "\n"


def test_json_unknown_keys_order_and_encoding():
    """Property 13: unknown keys at top level and in nodes survive, written after the known keys; UTF-8 text with
    ensure_ascii off and indent 1; dumps(loads(text)) is byte-identical for a file in the documented order."""
    text = released_style_text()
    tree = loads(text)
    assert tree.extra == {"notes": "unknown top-level key", "generated_by": {"tool": "x"}}
    assert tree.nodes[0].extra == {"comment": "kept"} and tree.nodes[1].extra == {"zz_extra": [1, {"é": "ü"}]}
    assert tree.n_primitives == 17 and tree.primitives is None and tree.format == "released v0"
    out = dumps(tree)
    assert out == text
    assert "é" in out and "\\u00e9" not in out
    assert out.startswith('{\n "environment": "WebShop é",\n "corpus": {\n  "name"')
    keys = list(json.loads(out))
    assert keys == ["environment", "corpus", "n_primitives", "n_nodes", "config", "format", "nodes", "notes",
                    "generated_by"]  # fmt: skip
    node_keys = list(json.loads(out)["nodes"][1])
    assert node_keys == ["id", "children", "depth", "length", "expansion", "count", "success", "example", "score",
                         "n_episodes", "families", "zz_extra"]  # fmt: skip
    assert loads(out) == tree and loads(out).nodes == tree.nodes


def test_json_primitives_and_n_nodes_written():
    """Property 13: primitives are written when present, after the nodes; n_nodes is the node count."""
    tree = hand_tree([("a", "b")])
    tree.primitives = [{"token": "a", "count": 3}, {"token": "b", "count": 2}]
    data = json.loads(dumps(tree))
    assert list(data)[-1] == "primitives" and data["primitives"] == tree.primitives
    assert data["n_nodes"] == 1 and data["format"] == "xtree/1"


def test_null_success_reads_as_one():
    """Property 13 / D11: null success reads as 1.0; a number is kept; a primitive reads as 1.0."""
    tree = loads(released_style_text())
    assert tree.success("S0") == 1.0
    assert tree.success("S1") == 0.25
    assert tree.success("click<buy>") == 1.0
    assert tree.length("S1") == 3 and tree.length("click<buy>") == 1
    assert tree.depth("S1") == 2 and tree.depth("click<buy>") == 0


def test_occurrences_path():
    assert xtree.occurrences_path("dir/t.json") == "dir/t.occ.jsonl"
    assert xtree.occurrences_path("dir/t") == "dir/t.occ.jsonl"


def test_render_text_deepest_first():
    """render_text: header with counts; top nodes deepest first, children indented under their parent."""
    tree = hand_tree([("a", "b"), ("S0", "c"), ("d", "e")], counts=[9, 6, 7], successful_only=True)
    tree.n_primitives = 5
    lines = render_text(tree).splitlines()
    assert "3 skills over 5 primitives" in lines[0] and "(successful only)" in lines[0]
    assert lines[1].startswith("  S1 ") and "a -> b -> c" in lines[1]
    assert lines[2].startswith("    S0 ")
    assert lines[3].startswith("  S2 ")
    assert len(lines) == 4
    assert "S2" not in render_text(tree, max_nodes=1)
    mixed = hand_tree([("a", "b")], success=[0.5])
    assert "(successful only)" not in render_text(mixed).splitlines()[0]
    assert "success 0.50" in render_text(mixed)


def test_plot_tree_writes_png(tmp_path):
    tree = hand_tree([("a", "b"), ("S0", "c")], success=[0.5, None])
    path = tmp_path / "tree.png"
    xtree.plot_tree(tree, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------------------------------------------------------------
# Offline node RL: properties 15 and 17
# ---------------------------------------------------------------------------------------------------------------------


def test_offline_reward_closed_form():
    """Property 15 / Eq. 6: r = a_step m / L + a_comp (1 + kappa depth) 1[m = L]."""
    assert offline_reward(0, 4, 2) == 0.0
    assert offline_reward(3, 4, 1) == pytest.approx(0.525)  # 0.7 * 3/4
    assert offline_reward(4, 4, 1) == pytest.approx(1.15)  # 0.7 + 0.3 * 1.5
    assert offline_reward(2, 2, 3) == pytest.approx(1.45)  # 0.7 + 0.3 * 2.5
    assert offline_reward(1, 1, 0) == pytest.approx(1.0)  # 0.7 + 0.3
    assert offline_reward(2, 3, 1, a_step=1.0, a_comp=2.0, kappa=1.0) == pytest.approx(2 / 3)
    assert offline_reward(3, 3, 1, a_step=1.0, a_comp=2.0, kappa=1.0) == pytest.approx(5.0)  # 1 + 2 * 2


def test_offline_reward_properties():
    """Property 15: m = 0 gives 0; strictly increasing in m; full match a_step + a_comp (1 + kappa depth); first
    mismatch at step k gives a_step k / L; depends only on (m, L, depth)."""
    for length in range(1, 7):
        for depth in range(0, 4):
            rs = [offline_reward(m, length, depth) for m in range(length + 1)]
            assert rs[0] == 0.0
            assert all(a < b for a, b in itertools.pairwise(rs))
            assert rs[-1] == pytest.approx(0.7 + 0.3 * (1 + 0.5 * depth))
            for k in range(length):
                assert rs[k] == pytest.approx(0.7 * k / length)
            assert rs == [offline_reward(m, length, depth) for m in range(length + 1)]
    for bad in [(-1, 3, 1), (4, 3, 1), (0, 0, 0)]:
        with pytest.raises(ValueError):
            offline_reward(*bad)


def test_split_half_is_seeded_and_balanced():
    """D4: the split is a deterministic seeded function of the task id, roughly half and half."""
    ids = [f"task-{k}" for k in range(400)]
    halves = [split_half(t, 0) for t in ids]
    assert halves == [split_half(t, 0) for t in ids]
    assert set(halves) == {"A", "B"}
    assert 150 <= halves.count("A") <= 250
    assert halves != [split_half(t, 1) for t in ids]


@pytest.fixture(scope="module")
def instance_corpus():
    trajs = random_corpus(11, n=60, p_success=0.6)
    tree, occ = mine(trajs, MinerConfig(max_skills=20, min_frequency=3, mdl_lambda=0.5, max_skill_len=6))
    return trajs, tree, occ


def candidates(tree, occ, trajs, seed, source="successful"):
    """Brute-force candidates per node: occurrences in half-B trajectories (successful ones for `successful`)."""
    by_id = {t.id: t for t in trajs}
    out = {}
    for n in tree.nodes:
        out[n.id] = {
            (o.node, o.traj_id, o.start, o.end)
            for o in occ
            if o.node == n.id
            and split_half(by_id[o.traj_id].task_id, seed) == "B"
            and (source == "all" or by_id[o.traj_id].success)
        }
    return out


@pytest.mark.parametrize("seed", [0, 3])
def test_node_instances(instance_corpus, seed):
    """Property 17: deterministic; only successful trajectories of half B; per-node cap respected (min(cap, n) kept);
    no half-A instance; node order, then (traj_id, start); independent of input order."""
    trajs, tree, occ = instance_corpus
    cap = 3
    cands = candidates(tree, occ, trajs, seed)
    assert any(len(c) > cap for c in cands.values())  # the cap binds somewhere
    halves = {split_half(t.task_id, seed) for t in trajs}
    assert halves == {"A", "B"}
    assert any(not t.success and split_half(t.task_id, seed) == "B" for t in trajs)
    out = node_instances(tree, occ, trajs, seed=seed, max_per_node=cap)
    assert out == node_instances(tree, list(reversed(occ)), list(reversed(trajs)), seed=seed, max_per_node=cap)
    per_node = Counter(o.node for o, _ in out)
    for n in tree.nodes:
        assert per_node[n.id] == min(cap, len(cands[n.id]))
    for o, t in out:
        assert o.traj_id == t.id and t.success and split_half(t.task_id, seed) == "B"
        assert (o.node, o.traj_id, o.start, o.end) in cands[o.node]
    order = [tree.nodes.index(tree.by_id[o.node]) for o, _ in out]
    assert order == sorted(order)
    for n in tree.nodes:
        within = [(o.traj_id, o.start) for o, _ in out if o.node == n.id]
        assert within == sorted(within)
    # no cap: exactly the candidates
    full = node_instances(tree, occ, trajs, seed=seed, max_per_node=10**6)
    assert {(o.node, o.traj_id, o.start, o.end) for o, _ in full} == set().union(*cands.values())
    assert len(full) == sum(len(c) for c in cands.values())


def test_node_instances_source_all_and_errors(instance_corpus):
    """Property 17 / X4: source `all` adds failed half-B trajectories, still never half A; a bad source raises."""
    trajs, tree, occ = instance_corpus
    full = node_instances(tree, occ, trajs, seed=0, max_per_node=10**6, source="all")
    cands = candidates(tree, occ, trajs, 0, source="all")
    assert {(o.node, o.traj_id, o.start, o.end) for o, _ in full} == set().union(*cands.values())
    assert any(not t.success for _, t in full)
    assert all(split_half(t.task_id, 0) == "B" for _, t in full)
    with pytest.raises(ValueError):
        node_instances(tree, occ, trajs, source="failed")


def test_node_instances_seed_changes_the_selection(instance_corpus):
    """Property 17: the capped choice follows the seeded hash order, so another seed picks another set."""
    trajs, tree, occ = instance_corpus
    picks = {
        tuple((o.node, o.traj_id, o.start) for o, _ in node_instances(tree, occ, trajs, seed=s, max_per_node=2))
        for s in range(6)
    }
    assert len(picks) > 1


# ---------------------------------------------------------------------------------------------------------------------
# Online bonus: properties 18-20
# ---------------------------------------------------------------------------------------------------------------------


def test_win_rates_threshold_nan_and_denominator():
    """Eq. 7 / C18: wins are R >= threshold; NaN counts as a failure; the denominator is G."""
    r = torch.tensor([1.0, float("nan"), 0.99, 2.0])
    assert win_rates(r, 4).tolist() == [0.5]
    assert win_rates(r, 2).tolist() == [0.5, 0.5]
    assert win_rates(r, 2, threshold=0.99).tolist() == [0.5, 1.0]
    assert win_rates(torch.full((3,), float("nan")), 3).tolist() == [0.0]


def test_bonus_weights_properties():
    """Property 18: lambda = lambda0 at w = 0, 0 for w >= w_max, non-increasing, within [0, lambda0]."""
    w = torch.linspace(0, 1, 101, dtype=torch.float64)
    lam = bonus_weights(w, 0.75, 0.4)
    assert lam[0].item() == 0.75
    assert torch.all(lam[w >= 0.4] == 0)
    assert torch.all(lam[1:] <= lam[:-1])
    assert torch.all((lam >= 0) & (lam <= 0.75))
    expected = [0.75 * max(0.0, 1 - x / 0.4) for x in w.tolist()]
    assert lam.tolist() == pytest.approx(expected, abs=1e-12)
    assert bonus_weights(torch.tensor([0.2], dtype=torch.float64)).item() == pytest.approx(0.375)


def group_rows(verifier, bonus):
    return torch.tensor(list(zip(verifier, bonus, strict=True)), dtype=torch.float64)


def test_shape_rewards_hand_case():
    """Eq. 10: group 0 (w = 0.5 >= 0.4) gets no bonus: shaped = verifier exactly. Group 1 (w = 0.25):
    lambda = 0.75 * (1 - 0.625) = 0.28125, bonus = 0.28125 * 2 * B / 0.4."""
    rows = group_rows([1, 1, 0, 0, 1, 0, 0, 0], [0.5, 0.2, 0.0, 0.9, 0.1, 0.4, 0.2, 0.0])
    out = shape_rewards(rows, 4)
    assert torch.equal(out.rewards[:, 0], rows[:, 0])
    assert out.rewards[:4, 1].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert out.rewards[4:, 1].tolist() == pytest.approx([0.140625, 0.5625, 0.28125, 0.0], abs=1e-15)
    assert out.wins.tolist() == [0.5, 0.25]
    assert out.weights.tolist() == pytest.approx([0.0, 0.28125])
    assert out.inversions == 0
    # w exactly at w_max: 2 of 5
    five = shape_rewards(group_rows([1, 1, 0, 0, 0], [0.3, 0.1, 0.9, 0.2, 0.5]), 5)
    assert five.rewards[:, 1].tolist() == [0.0] * 5


def test_shape_all_failed_group_orders_like_the_bonus():
    """Property 19: when all rollouts fail, the advantage order equals the order of B_i, ties stay ties."""
    bonus = [0.3, 0.0, 0.3, 0.9, 0.1]
    out = shape_rewards(group_rows([0] * 5, bonus), 5)
    r = out.rewards.sum(dim=1)
    adv = (r - r.mean()) / (r.std() + 1e-4)
    for i, j in itertools.product(range(5), repeat=2):
        assert (adv[i] > adv[j]) == (bonus[i] > bonus[j])
        assert (adv[i] == adv[j]) == (bonus[i] == bonus[j])
    assert out.rewards[:, 1].tolist() == pytest.approx([1.5 * b / 0.9 for b in bonus], abs=1e-15)


def test_shape_zero_max_gives_zero_bonus_without_nan():
    """Property 19 / Eq. 10: max_j B_j = 0 gives a zero bonus and no NaN (also for NaN or negative raw bonuses)."""
    rows = group_rows([0, 0, 0, 0, 0, 0], [0.0, 0.0, 0.0, float("nan"), -1.0, 0.0])
    out = shape_rewards(rows, 3)
    assert not torch.isnan(out.rewards).any()
    assert out.rewards[:, 1].tolist() == [0.0] * 6


def test_shape_bounds_independence_and_order():
    """Property 19: the normalised bonus lies in [0, lambda_g c] and reaches it at the group max; groups are
    independent and the row order is preserved."""
    g = torch.Generator().manual_seed(0)
    n_groups, G = 12, 4
    verifier = (torch.rand(n_groups * G, generator=g) < 0.3).double()
    raw = torch.rand(n_groups * G, generator=g, dtype=torch.float64)
    raw[:G] = 0.0
    rows = torch.stack([verifier, raw], dim=1)
    out = shape_rewards(rows, G)
    bonus = out.rewards[:, 1].view(n_groups, G)
    lam_c = out.weights * 2.0
    assert torch.all(bonus >= 0) and torch.all(bonus <= lam_c.unsqueeze(1) + 1e-15)
    nonzero = raw.view(n_groups, G).max(dim=1).values > 0
    assert torch.equal(bonus.max(dim=1).values[nonzero], lam_c[nonzero])
    for k in range(n_groups):
        one = shape_rewards(rows[k * G : (k + 1) * G], G)
        assert torch.equal(one.rewards, out.rewards[k * G : (k + 1) * G])
    perm = torch.randperm(n_groups, generator=g)
    rows_p = rows.view(n_groups, G, 2)[perm].reshape(-1, 2)
    out_p = shape_rewards(rows_p, G)
    assert torch.equal(out_p.rewards, out.rewards.view(n_groups, G, 2)[perm].reshape(-1, 2))
    assert torch.equal(out_p.weights, out.weights[perm])


def test_shape_inversions_and_success_dominance():
    """X9 / D9: G = 10, one win: w = 0.1, lambda = 0.5625, lambda c = 1.125 > 1, so a failed rollout with the top
    bonus (1.125) outranks the winner (1.0): one inversion. success_dominance caps lambda at 0.999 / 2."""
    rows = group_rows([1] + [0] * 9, [0.0, 1.0, 0.5] + [0.0] * 7)
    out = shape_rewards(rows, 10)
    assert out.weights.tolist() == pytest.approx([0.5625])
    assert out.inversions == 1
    capped = shape_rewards(rows, 10, success_dominance=True)
    assert capped.weights.tolist() == pytest.approx([0.4995])
    assert capped.inversions == 0
    assert capped.rewards[1, 1].item() == pytest.approx(0.999)


def test_shape_rewards_validates_shape():
    for bad, G in [(torch.zeros(5, 2), 2), (torch.zeros(4, 3), 2), (torch.zeros(4), 2)]:
        with pytest.raises(ValueError):
            shape_rewards(bad, G)


def test_shape_keeps_dtype_and_nan_verifier():
    """Eq. 10: the verifier column is returned unchanged (a NaN stays NaN) and the dtype is kept."""
    rows = torch.tensor([[float("nan"), 0.5], [0.0, 1.0]], dtype=torch.float32)
    out = shape_rewards(rows, 2)
    assert out.rewards.dtype == torch.float32
    assert math.isnan(out.rewards[0, 0].item()) and out.rewards[1, 0].item() == 0.0
    assert out.rewards[:, 1].tolist() == pytest.approx([0.75, 1.5])  # w = 0: 0.75 * 2 * [0.5, 1]


def bonus_tree():
    """S0 = (a, b) depth 1 succ 0.5; S1 = (S0, c) depth 2 succ null; S2 = (c, d) depth 1 succ 0.25;
    S3 = (S0, S2) depth 2, length 4; S4 = (S1, d) depth 3, length 4 (same span as S3, deeper)."""
    return hand_tree(
        [("a", "b"), ("S0", "c"), ("c", "d"), ("S0", "S2"), ("S1", "d")], success=[0.5, None, 0.25, 1.0, 0.75]
    )


def test_raw_bonus_hand_cases():
    """Eq. 8-9: depth mode sums 1 + kappa_b depth over top-level nodes; success_coverage sums succ l / T (null = 1);
    leftover primitives add 0; no action gives 0 (C19)."""
    tree = bonus_tree()
    tiling = [("S1", 0, 3), ("d", 3, 4)]
    assert raw_bonus(tree, tiling, "depth", 4) == 2.0  # 1 + 0.5 * 2
    assert raw_bonus(tree, tiling, "success_coverage", 4) == 0.75  # 1.0 * 3 / 4
    tiling = [("S0", 0, 2), ("S2", 2, 4), ("e", 4, 5)]
    assert raw_bonus(tree, tiling, "depth", 5) == 3.0  # 1.5 + 1.5
    assert raw_bonus(tree, tiling, "success_coverage", 5) == pytest.approx((0.5 * 2 + 0.25 * 2) / 5)
    assert raw_bonus(tree, tiling, "depth", 5, kappa_b=1.0) == 4.0
    prims = [("a", 0, 1), ("c", 1, 2), ("e", 2, 3)]
    assert raw_bonus(tree, prims, "depth", 3) == 0.0 and raw_bonus(tree, prims, "success_coverage", 3) == 0.0
    for mode in ("depth", "success_coverage"):
        assert raw_bonus(tree, [], mode, 0) == 0.0
    with pytest.raises(ValueError):
        raw_bonus(tree, tiling, "coverage", 5)


def test_raw_bonus_deeper_node_never_lowers_depth_bonus():
    """Property 20: replacing a tiling node by a deeper node of the same span never lowers B (S3 -> S4, span 0-4)."""
    tree = bonus_tree()
    assert tree.by_id["S3"].expansion == tree.by_id["S4"].expansion == ["a", "b", "c", "d"]
    shallow = raw_bonus(tree, [("S3", 0, 4), ("x", 4, 5)], "depth", 5)
    deep = raw_bonus(tree, [("S4", 0, 4), ("x", 4, 5)], "depth", 5)
    assert (shallow, deep) == (2.0, 2.5)


def test_raw_bonus_bounds_on_encoded_rollouts(mined):
    """Property 20: B >= 0 in both modes and B <= 1 in success_coverage mode, on tilings from encode."""
    rng = random.Random(5)
    for _, _, tree, _ in mined.values():
        for _ in range(40):
            seq = [rng.choice(ALPHABET) for _ in range(rng.randint(0, 12))]
            if rng.random() < 0.5:
                seq[0:0] = MOTIF * 2
            tiles = encode(tree, seq)
            depth = raw_bonus(tree, tiles, "depth", len(seq))
            cov = raw_bonus(tree, tiles, "success_coverage", len(seq))
            assert depth >= 0 and 0 <= cov <= 1
            n_nodes = sum(s in tree.by_id for s, _, _ in tiles)
            assert (depth > 0) == (n_nodes > 0)


# ---------------------------------------------------------------------------------------------------------------------
# Cards: property 22
# ---------------------------------------------------------------------------------------------------------------------


def family_index():
    """Family fa: e1, e2 = a b c x y (success), e3 = a b d (fail), e4 = a b (success); family fb: e6 = a b c."""
    rows = [
        ("e1", "fa", True, ["a", "b", "c", "x", "y"], ["open <obj>", "list", "copy <obj> <obj>", "go <obj>", "look"]),
        ("e2", "fa", True, ["a", "b", "c", "x", "y"], ["open <obj>", "list", "copy <obj> <obj>", "go <obj>", "look"]),
        ("e3", "fa", False, ["a", "b", "d"], ["peek <obj>", "list", "drop <obj>"]),
        ("e4", "fa", True, ["a", "b"], ["peek <obj>", "list"]),
        ("e6", "fb", True, ["a", "b", "c"], ["zap <obj>", "list", "copy <obj> <obj>"]),
    ]
    trajs = [traj(i, toks, ok, fam) for i, fam, ok, toks, _ in rows]
    return CorpusIndex(trajectories=trajs, surfaces={i: s for i, _, _, _, s in rows})


def family_tree():
    """Supports in fa: S0 [a b] 4; S1 [x y] 2 (depth 1); S2 [b c] 2 (depth 1); S3 [a b c] 2 (depth 2); S4 [b d] 1."""
    return hand_tree([("a", "b"), ("x", "y"), ("b", "c"), ("S0", "c"), ("b", "d")])


def chain_ids(card):
    return re.findall(r"^- .*\[(S\d+), depth \d+, \d+ episodes", card, flags=re.M)


def test_card_family_chains_ordering_and_surfaces():
    """Property 22 / Eq. 11: chains with support >= min_chain_support, by support desc, then depth desc, then node
    index; each step in its most frequent surface form (ties: smallest), names abstracted as <obj>."""
    tree, index = family_tree(), family_index()
    card = render_card(tree, index, "fa", "family_chains", max_chains=6, min_chain_support=2)
    assert chain_ids(card) == ["S0", "S3", "S1", "S2"]
    lines = {re.search(r"\[(S\d+),", ln).group(1): ln for ln in card.splitlines() if ln.startswith("- ")}
    # S0 in fa: a is "open <obj>" twice and "peek <obj>" twice -> the smallest, "open <obj>"
    assert lines["S0"].startswith("- open <obj> -> list [S0, depth 1, 4 episodes, 2 task types]")
    assert lines["S3"].startswith("- open <obj> -> list -> copy <obj> <obj> [S3, depth 2, 2 episodes, 2 task types]")
    assert lines["S1"].startswith("- go <obj> -> look [S1, depth 1, 2 episodes]")
    assert "zap" not in card and "(5 episodes)" not in card and "(4 episodes)" in card.splitlines()[0]
    assert "<obj>" in lines["S0"]
    assert card.splitlines()[-1].startswith("Plan:")


def test_card_max_chains_and_support_filter():
    """Property 22: at most max_chains chain lines; chains below min_chain_support are left out."""
    tree, index = family_tree(), family_index()
    for k in range(0, 6):
        ids = chain_ids(render_card(tree, index, "fa", "family_chains", max_chains=k, min_chain_support=2))
        assert ids == ["S0", "S3", "S1", "S2"][:k]
    assert chain_ids(render_card(tree, index, "fa", "family_chains", min_chain_support=1)) == [
        "S0",
        "S3",
        "S1",
        "S2",
        "S4",
    ]
    assert chain_ids(render_card(tree, index, "fa", "family_chains", min_chain_support=3)) == ["S0"]


def test_card_is_pure():
    """Property 22: same inputs give byte-identical text, and nothing is modified."""
    tree, index = family_tree(), family_index()
    before = (dumps(tree), copy.deepcopy(index))
    a = render_card(tree, index, "fa", "family_chains", min_chain_support=2)
    b = render_card(tree, index, "fa", "family_chains", min_chain_support=2)
    c = render_card(family_tree(), family_index(), "fa", "family_chains", min_chain_support=2)
    assert a == b == c
    assert (dumps(tree), index) == before
    g = goal_setup()
    assert render_card(*g, "size", "goal_attribute") == render_card(*goal_setup(), "size", "goal_attribute")


def test_card_surfaces_from_real_actions_use_obj():
    """Property 22: a card built from canonicalised terminal actions shows no file name, only <obj>."""
    trajs, surfaces = [], {}
    for k in range(5):
        acts = [f"cat notes{k}.txt", f"grep apple{k} notes{k}.txt", f"cp notes{k}.txt backup{k}.txt"]
        canon_ = [canon("terminal", a) for a in acts]
        trajs.append(traj(f"e{k}", [t for t, _ in canon_], True, "copyfam"))
        surfaces[f"e{k}"] = [s["surface"] for _, s in canon_]
    tree = hand_tree([("read<path>", "find<path>"), ("S0", "copy<path>")])
    card = render_card(tree, CorpusIndex(trajs, surfaces), "copyfam", "family_chains", min_chain_support=5)
    assert "- cat <obj> -> grep <obj> <obj> -> cp <obj> <obj> [S1" in card
    assert not re.search(r"notes|apple|backup", card)


def goal_setup():
    """E_size (10 episodes, 6 successes, base 0.6): e1, e2 s i o b (S), e3 s i o b (F); e4, e5 s w o b (S),
    e6 s w o b (F); e7, e8 s i b (F); e9, e10 o s (S). e11 s i o b (S) asks for colour only (not in E_size)."""
    s, i, o, b, w = "search<query>", "click<item>", "click<option-size>", "click<buy>", "click<option>"
    rows = [
        ([s, i, o, b], True), ([s, i, o, b], True), ([s, i, o, b], False),
        ([s, w, o, b], True), ([s, w, o, b], True), ([s, w, o, b], False),
        ([s, i, b], False), ([s, i, b], False), ([o, s], True), ([o, s], True),
    ]  # fmt: skip
    trajs = [traj(f"e{k + 1:02d}", toks, ok, goal=["size"]) for k, (toks, ok) in enumerate(rows)]
    trajs.append(traj("e11", [s, i, o, b], True, goal=["colour"]))
    # node 0 (s i) and 5 (i b) hold no click<option-size>; 1 (w o): 3 eps 2/3; 2 (o b): 6 eps 4/6;
    # 3 (i o): 3 eps 2/3; 4 (o s): 2 eps 1.0
    tree = hand_tree([(s, i), (w, o), (o, b), (i, o), (o, s), (i, b)])
    return tree, CorpusIndex(trajs)


def goal_lines(card):
    return [ln for ln in card.splitlines() if ln.startswith("- ")]


def test_card_goal_attribute_ordering_and_above_base():
    """Property 22 / Eq. 11: chains containing click<option-KEY>, by succ desc, then support desc, then node order;
    "ABOVE base" iff succ >= base + margin (base = 0.6)."""
    tree, index = goal_setup()
    eps = episodes_for(index, "size", "goal_attribute")
    assert len(eps) == 10
    assert chain_stats(tree, eps, tree.nodes[2]) == (6, pytest.approx(4 / 6))
    assert chain_stats(tree, eps, tree.nodes[4]) == (2, 1.0)
    card = render_card(tree, index, "size", "goal_attribute", min_chain_support=2, above_margin=0.1)
    lines = goal_lines(card)
    expected = [
        ("click<option-size> -> search<query>", "100% of 2", "ABOVE base"),
        ("click<option-size> -> click<buy>", "67% of 6", "at base"),
        ("click<option> -> click<option-size>", "67% of 3", "at base"),
        ("click<item> -> click<option-size>", "67% of 3", "at base"),
    ]
    assert len(lines) == len(expected)
    for line, (chain, stats, mark) in zip(lines, expected, strict=True):
        assert line.startswith(f"- {chain}: {stats} episodes, {mark}")
    assert "60%" in card.splitlines()[0] and "10 episodes" in card.splitlines()[0]
    assert "a wasted step" in lines[2] and "a wasted step" not in lines[1]
    lower = goal_lines(render_card(tree, index, "size", "goal_attribute", min_chain_support=2, above_margin=0.05))
    assert all("ABOVE base" in ln for ln in lower)  # 2/3 >= 0.65
    top = goal_lines(render_card(tree, index, "size", "goal_attribute", min_chain_support=3, max_chains=2))
    assert [ln.split(":")[0] for ln in top] == [f"- {expected[1][0]}", f"- {expected[2][0]}"]


def test_card_above_base_boundary():
    """Property 22: ABOVE base iff succ >= base + margin, at the exact boundary (0.75 = 0.5 + 0.25 in binary)."""
    s, o, b = "search<query>", "click<option-size>", "click<buy>"
    trajs = [traj(f"e{k}", [s, o, b], k < 3, goal=["size"]) for k in range(4)]  # [o b]: 3 of 4
    trajs += [traj(f"f{k}", [s, b], k < 1, goal=["size"]) for k in range(4)]  # base (3 + 1) / 8 = 0.5
    tree, index = hand_tree([(o, b)]), CorpusIndex(trajs)
    at = goal_lines(render_card(tree, index, "size", "goal_attribute", min_chain_support=1, above_margin=0.25))
    assert len(at) == 1 and "ABOVE base" in at[0]
    over = goal_lines(render_card(tree, index, "size", "goal_attribute", min_chain_support=1, above_margin=0.2500001))
    assert len(over) == 1 and "at base" in over[0]


def test_card_key_and_episodes():
    """D14: family when labelled; else the asked goal attribute of highest corpus frequency (ties by name); else the
    first canonical action. E_k per style."""
    fam = family_index()
    assert card_key(fam, "fa", ["size"], "a") == ("fa", "family_chains")
    plain = CorpusIndex(
        [traj("p1", ["s", "o"], goal=["size"]), traj("p2", ["s"], goal=["size", "colour"]), traj("p3", ["o"])]
    )
    assert card_key(plain, "fa", ["colour", "size"], "s") == ("size", "goal_attribute")  # size 2, colour 1
    assert card_key(plain, None, ["colour"], "s") == ("colour", "goal_attribute")
    assert card_key(plain, None, ["weight"], "s") == ("s", "first_action")
    tie = CorpusIndex([traj("q1", ["s"], goal=["size"]), traj("q2", ["s"], goal=["colour"])])
    assert card_key(tie, None, ["size", "colour"], "s") == ("colour", "goal_attribute")
    assert [t.id for t in episodes_for(plain, "s", "first_action")] == ["p1", "p2"]
    assert [t.id for t in episodes_for(plain, "colour", "goal_attribute")] == ["p2"]
    assert [t.id for t in episodes_for(fam, "fb", "family_chains")] == ["e6"]
    card = render_card(hand_tree([("s", "o")]), plain, "s", "first_action", min_chain_support=1)
    assert chain_ids(card) == ["S0"] and "(2 episodes)" in card.splitlines()[0]


def test_tree_stats_on_a_hand_corpus():
    """§8 miner report: five episodes (a, b) and one (c): one merge S0 = (a, b) with count 5. The corpus shrinks
    from 11 symbols to 6 (compression 6/11), 10 of 11 actions lie inside a depth-1 tile (coverage 10/11), and S0's own
    expansion encodes to S0 alone."""
    trajs = [Trajectory(f"t{i}", f"t{i}", True, ["a", "b"]) for i in range(5)] + [Trajectory("u", "u", True, ["c"])]
    tree, _ = mine(trajs, MinerConfig(min_frequency=2, mdl_lambda=0.0))
    stats = tree_stats(tree, trajs)
    assert stats["nodes"] == 1 and stats["depths"] == {"1": 1} and stats["max_depth"] == 1
    assert stats["compression"] == pytest.approx(6 / 11) and stats["coverage"] == pytest.approx(10 / 11)
    assert stats["self_encoding_failures"] == [] and stats["score"] == {"p_len": 1.0, "p_succ": 1.0, "eps": 0.0}
