"""X-Tree's trainer and node environment (docs/methods/xtree.md, arXiv 2609.32993): the prefix of a node instance
replays to the recorded state key and stays out of the completion and the loss (§7 property 16); the episode ends at
the first mismatch with Eq. 6's reward; the bonus column the trainer hands to TRL is Eq. 10 of the raw columns, group
by group, rows in order (property 19); the configuration guards (property 21); a run through train.py in each use."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv
from datasets import Dataset

from envs.shop import ShopEnv
from envs.terminal import TerminalEnv
from trainers import xtree
from trainers.agent_loop import LoopSettings, play
from trainers.base import GenerationStep
from trainers.trl_api import TRLSeams
from trainers.xtree_trainer import (
    NodeEnv,
    PrefixMismatch,
    XTreeConfig,
    XTreeTrainer,
    expert_corpus,
    instance_openings,
    instance_rows,
    opening_warning,
)


def corpus_and_rows(env_cls, n=200, noise=0.3, **fields):
    tasks = env_cls.make_tasks("train", n, seed=0)
    trajs, logs = expert_corpus(lambda t: env_cls(), tasks, noise=noise, seed=0)
    tree, occ = xtree.mine(trajs, xtree.MinerConfig())
    args = XTreeConfig(output_dir="unused", xtree_use="nodes", **CPU_ARGS, **fields)
    return trajs, logs, tree, occ, instance_rows(trajs, logs, tree, occ, args), args


def instance_of(row: dict) -> dict:
    return json.loads(row["task"])


@pytest.mark.parametrize("env_cls", [ShopEnv, TerminalEnv])
def test_prefix_replays_to_the_recorded_state_and_becomes_past_turns(env_cls):
    """Property 16 / D19: reset replays the logged prefix in the live environment, reaches the state key recorded
    before the gold step, and returns the conversation: the first observation, then each prefix action as an
    assistant turn followed by its logged observation."""
    trajs, logs, tree, occ, rows, args = corpus_and_rows(env_cls)
    by_id = {t.id: t for t in trajs}
    with_prefix = [r for r in rows if instance_of(r)["xtree_instance"]["prefix"]]
    assert with_prefix, "the corpus should give instances that start after step 0"
    for row in with_prefix[:20]:
        inst = instance_of(row)["xtree_instance"]
        env = NodeEnv(env_cls(), args)
        messages = env.reset(instance_of(row))
        s = len(inst["prefix"])
        log = logs[inst["traj_id"]]
        expected = [{"role": "user", "content": log.observations[0]}]
        for k in range(s):
            expected += [{"role": "assistant", "content": by_id[inst["traj_id"]].actions[k]},
                         {"role": env_cls.observation_role, "content": log.observations[k + 1]}]  # fmt: skip
        assert messages == expected
        assert env.inner.state_key() == log.state_keys[s] == inst["state_key"]


def test_a_log_that_does_not_replay_is_refused():
    """D18: an instance whose recorded state key differs from the replayed one raises at reset."""
    *_, rows, args = corpus_and_rows(ShopEnv)
    task = instance_of(next(r for r in rows if instance_of(r)["xtree_instance"]["prefix"]))
    task["xtree_instance"]["state_key"] = "results:somewhere-else"
    with pytest.raises(PrefixMismatch, match="recorded"):
        NodeEnv(ShopEnv(), args).reset(task)


def test_gold_continuation_earns_the_full_reward_and_a_mismatch_ends_the_episode():
    """Eq. 6 through the environment: the gold actions give a_step + a_comp (1 + κ depth) after L steps; a wrong
    action at step k ends the episode at once with a_step k / L; an unparsable action is a parse mismatch."""
    *_, rows, args = corpus_and_rows(ShopEnv)
    inst_rows = [r for r in rows if len(instance_of(r)["xtree_instance"]["gold_tokens"]) >= 3]
    task = instance_of(inst_rows[0])
    inst = task["xtree_instance"]
    L, depth = len(inst["gold_tokens"]), inst["depth"]
    env = NodeEnv(ShopEnv(), args)
    env.reset(task)
    for k, slots in enumerate(inst["gold_slots"]):
        observation, reward, done, info = env.step(slots["raw"])
        assert observation == inst["observations"][k]  # D6: the logged observation comes back
        assert done == (k == L - 1)
    assert reward == pytest.approx(0.7 + 0.3 * (1 + 0.5 * depth)) and info["success"] and info["m"] == L
    env = NodeEnv(ShopEnv(), args)
    env.reset(task)
    env.step(inst["gold_slots"][0]["raw"])
    _, reward, done, info = env.step("buy" if inst["gold_tokens"][1] != "click<buy>" else "search[hat]")
    assert done and reward == pytest.approx(0.7 * 1 / L) and info["reason"] in ("token", "slot")
    env = NodeEnv(ShopEnv(), args)
    env.reset(task)
    _, reward, done, info = env.step("I am not sure")
    assert done and reward == 0.0 and info["reason"] == "parse" and not info["success"]


def test_the_prefix_is_prompt_never_completion(tiny_tokenizer):
    """Property 16: played through the agent loop, the prefix is rendered into the prompt ids; the completion holds
    only the policy's own turns (env_mask 1) and the observations after them."""
    *_, rows, args = corpus_and_rows(ShopEnv)
    row = next(r for r in rows if len(instance_of(r)["xtree_instance"]["prefix"]) >= 2)
    inst = instance_of(row)["xtree_instance"]
    gold = inst["gold_slots"][0]["raw"]
    ids = tiny_tokenizer(gold, add_special_tokens=False)["input_ids"] + [tiny_tokenizer.eos_token_id]

    def generate(contexts, max_new_tokens):
        return [(list(ids), [0.0] * len(ids)) for _ in contexts]

    settings = LoopSettings(max_turn_tokens=len(ids), max_completion_length=4000)
    (rollout,) = play(generate, tiny_tokenizer, [NodeEnv(ShopEnv(), args)], [instance_of(row)], settings=settings)
    prompt = tiny_tokenizer.decode(rollout.prompt_ids)
    for action in inst["prefix"]:
        assert tiny_tokenizer.decode(tiny_tokenizer(action, add_special_tokens=False)["input_ids"]) in prompt
    assert rollout.completion_ids[: len(ids)] == ids and rollout.env_mask[: len(ids)] == [1] * len(ids)
    sampled = [t for t, m in zip(rollout.completion_ids, rollout.env_mask, strict=True) if m]
    assert len(sampled) == len(ids) * len(rollout.turn_rewards)  # only the policy's turns carry env_mask 1
    assert rollout.transcript[0]["action"] == tiny_tokenizer.decode(ids[:-1])


def make_trainer(folder, out_dir, **fields):
    args = XTreeConfig(
        output_dir=str(out_dir),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        num_generations=2,
        max_completion_length=30,
        max_turn_tokens=4,
        max_steps=1,
        xtree_corpus_episodes=40,
        xtree_min_frequency=3,
        **CPU_ARGS,
        **fields,
    )
    tasks = EchoEnv.make_tasks("train", 40)
    data = Dataset.from_list([{"prompt": "say", "task": t, "task_id": t["task_id"]} for t in tasks])
    return XTreeTrainer(model=folder, args=args, train_dataset=data, env_factory=lambda r: EchoEnv())


def test_bonus_column_is_eq_10_per_group_in_row_order(tiny_model_folder, tmp_path, monkeypatch):
    """Property 19 through the trainer: the tensor handed to TRL keeps the verifier column and replaces the raw
    bonus by λ_g c B_i / max_j B_j, computed here by hand for three groups of G = 2: no win (λ = 0.75), one win of
    two (w = 0.5 >= w_max: λ = 0), and no win with max B = 0 (bonus 0, no NaN)."""
    trainer = make_trainer(tiny_model_folder, tmp_path)
    raw = torch.tensor([[0.0, 1.0], [0.0, 3.0], [1.0, 2.0], [0.0, 5.0], [0.0, 0.0], [float("nan"), 0.0]])
    monkeypatch.setattr(TRLSeams, "calculate_rewards", lambda self, *a: raw.clone())  # TRL's gathered columns
    trainer.generation_step = GenerationStep(rows=[{}] * 6)  # as generate_and_score opens it
    out = trainer.calculate_rewards([], [""] * 6, [], [])
    lam = 0.75  # w = 0 in group 0: λ0 (1 - 0/0.4)
    expected_bonus = [lam * 2.0 * 1 / 3, lam * 2.0 * 3 / 3, 0.0, 0.0, 0.0, 0.0]
    assert torch.equal(out[:, 0].nan_to_num(-1), raw[:, 0].nan_to_num(-1))
    assert out[:, 1].tolist() == pytest.approx(expected_bonus)
    step = trainer.generation_step  # what the rollout batch and the advantages read: the shaped columns
    assert step.rewards_per_func is out
    weighted = [a + b for a, b in zip([0.0, 0.0, 1.0, 0.0, 0.0, 0.0], expected_bonus, strict=True)]  # weights 1, 1
    assert step.rewards.tolist() == pytest.approx(weighted)  # a NaN verifier cell counts 0 beside a bonus (nansum)


def test_the_trainer_writes_and_draws_its_tree(tiny_model_folder, tmp_path):
    """The tree mined at start-up (from EchoEnv's noisy expert: words are verbs of the generic table) is written as
    xtree.json with its occurrences and drawn as xtree.png; the bonus form follows the corpus (D11)."""
    trainer = make_trainer(tiny_model_folder, tmp_path)
    saved = xtree.load(str(tmp_path / "xtree.json"))
    assert saved == trainer.tree and saved.nodes and (tmp_path / "xtree.png").is_file()
    assert len(xtree.load_occurrences(str(tmp_path / "xtree.json"))) == sum(n.count for n in saved.nodes)
    assert trainer.bonus_mode == ("depth" if saved.successful_only else "success_coverage")
    assert [f.__name__ for f in trainer.reward_funcs] == ["env_reward", "xtree_bonus_raw"]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"multi_objective_aggregation": "normalize_then_sum"}, "sum_then_normalize"),
        ({"reward_weights": [1.0, 2.0]}, "reward_weights"),
        ({"xtree_use": "card"}, "xtree_use"),
        ({"xtree_bonus_mode": "width"}, "xtree_bonus_mode"),
    ],
)
def test_configuration_guards(fields, message):
    """Property 21: the bonus needs sum_then_normalize and weights [1, 1]; unknown choices are refused by name."""
    with pytest.raises(ValueError, match=message):
        XTreeConfig(output_dir="unused", **CPU_ARGS, **fields)


def test_a_second_verifier_is_refused(tiny_model_folder, tmp_path):
    """Property 21: the bonus column goes beside exactly one verifier reward."""
    args = XTreeConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=2, **CPU_ARGS)
    data = Dataset.from_list([{"prompt": "say", "task": t} for t in EchoEnv.make_tasks("train", 8)])
    with pytest.raises(ValueError, match="one verifier"):
        XTreeTrainer(model=tiny_model_folder, reward_funcs=[lambda **k: [], lambda **k: []], args=args,
                     train_dataset=data, env_factory=lambda r: EchoEnv())  # fmt: skip


def test_instances_follow_the_depth_curriculum():
    """§4.3: with depth_curriculum the rows come in ascending node depth; plain mixing is a seeded shuffle (the same
    rows, the same order for the same seed)."""
    *_, rows, _ = corpus_and_rows(ShopEnv, xtree_mixing="depth_curriculum")
    depths = [r["depth"] for r in rows]
    assert depths == sorted(depths) and len(set(depths)) > 1
    *_, plain, _ = corpus_and_rows(ShopEnv, xtree_mixing="plain")
    *_, again, _ = corpus_and_rows(ShopEnv, xtree_mixing="plain")
    assert plain == again and sorted(map(json.dumps, plain)) == sorted(map(json.dumps, rows))
    assert [r["depth"] for r in plain] != depths


SMALL = ["--tiny_sft_steps", "1", "--tiny_num_demos", "32", "--max_steps", "2", "--per_device_train_batch_size", "8",
         "--num_generations", "4", "--num_train_tasks", "60", "--num_eval_tasks", "6", "--logging_steps", "1",
         "--xtree_corpus_episodes", "60"]  # fmt: skip


@pytest.mark.parametrize("use", ["bonus", "nodes"])
def test_train_py_runs_each_use(tmp_path, use):
    """`python train.py --config configs/xtree_shop.yaml` (shrunk) in each use: held-out results before and after,
    the tree beside the run, and the use's metrics in the log."""
    import train

    out = tmp_path / "run"
    summary = train.main(["--config", "configs/xtree_shop.yaml", *SMALL, "--xtree_use", use, "--output_dir", str(out)])
    assert summary["trainer"] == "xtree" and {"before", "after"} <= set(summary)
    assert (out / "xtree.json").is_file() and (out / "xtree.png").is_file()
    logged = {k for row in summary["log_history"] for k in row}
    assert ("xtree/lambda_mean" in logged) == (use == "bonus") and ("xtree/match_frac" in logged) == (use == "nodes")


def test_cards_command_writes_a_dataset_beta_opsd_reads(tmp_path):
    """Use (c): `python -m trainers.xtree_cli cards` writes train/test rows whose xtree_card column is the task's card
    (render_card of its family's episodes); the rows load as a dataset with the task column."""
    from trainers.xtree_cli import main

    main(["cards", "--environment", "terminal", "--episodes", "120", "--train_tasks", "12", "--test_tasks", "4",
          "--out", str(tmp_path)])  # fmt: skip
    rows = [json.loads(line) for line in (tmp_path / "train.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and len((tmp_path / "test.jsonl").read_text().splitlines()) == 4
    for row in rows:
        task = json.loads(row["task"])
        assert row["xtree_card"].startswith(f"Skills for task type {task['kind']} (")
        assert "Plan:" in row["xtree_card"] and task["instruction"] not in row["xtree_card"]
    random.Random(0).shuffle(rows)  # cards depend on the task's key only: equal keys, equal cards
    by_kind: dict[str, set] = {}
    for row in rows:
        by_kind.setdefault(json.loads(row["task"])["kind"], set()).add(row["xtree_card"])
    assert all(len(cards) == 1 for cards in by_kind.values())


SCRIPT = Path(__file__).with_name("distributed_xtree_run.py")


@pytest.mark.distributed
def test_two_processes_shape_the_same_rewards(tiny_model_folder, tmp_path):
    """Property 19, last part: with two processes (torchrun, gloo) each computes its rollouts' raw bonus, TRL gathers
    the columns, and both processes hand the same shaped tensor to TRL, equal to Eq. 10 of the gathered raw columns
    computed once, as a single process would."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRL_EXPERIMENTAL_SILENCE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(SCRIPT),
               tiny_model_folder, str(tmp_path)]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["batches"] == ranks[1]["batches"] and len(ranks[0]["batches"]) == 3
    for batch in ranks[0]["batches"]:
        raw, shaped = torch.tensor(batch["raw"]), torch.tensor(batch["shaped"])
        assert raw.shape == (8, 2)  # 2 processes x 4 rows, gathered
        for g in range(0, 8, 2):  # Eq. 7 and 10 by hand, one group of G = 2 at a time
            rows = raw[g : g + 2]
            w = float((rows[:, 0] >= 1.0).float().mean())
            lam = 0.75 * min(max(1 - w / 0.4, 0.0), 1.0)
            top = float(rows[:, 1].max())
            expected = [lam * 2.0 * float(b) / top if top > 0 else 0.0 for b in rows[:, 1]]
            assert shaped[g : g + 2, 1].tolist() == pytest.approx(expected)
            assert torch.equal(shaped[g : g + 2, 0], rows[:, 0])
    assert any(max(b[1] for b in batch["raw"]) > 0 for batch in ranks[0]["batches"])  # some rollout had a skill


def test_mine_reads_a_users_logged_episodes(tmp_path, capsys):
    """`mine --trajectories FILE.jsonl` on an environment without a table: the first word of each action is its verb.
    Three copies each of a success (open, go, take) and a failure (go, take): (go, take) has f = 6, succ 1/2, X = 6,
    and wins the tie with (open, go) (X = 3 * 2 * 1 = 6) by its higher f; then (open, S0) has f = 3, succ 1, X = 9.
    The tree is written with its sidecar and printed. A malformed line is refused."""
    from trainers.xtree_cli import main

    lines = [{"id": str(i), "actions": ["open door", "go north", "take key"], "success": True} for i in range(3)]
    lines += [{"id": str(i + 3), "actions": ["go north", "take key"], "success": False} for i in range(3)]
    (tmp_path / "own.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
    out = tmp_path / "own.json"
    main(["mine", "--environment", "mygame", "--trajectories", str(tmp_path / "own.jsonl"), "--min_frequency", "2",
          "--mdl_lambda", "0", "--out", str(out)])  # fmt: skip
    tree = xtree.load(str(out))
    assert [(n.expansion, n.count, n.success) for n in tree.nodes] == [
        (["go<object>", "take<object>"], 6, 0.5),
        (["open<object>", "go<object>", "take<object>"], 3, 1.0),
    ]
    assert len(xtree.load_occurrences(str(out))) == 9 and "S1 (depth 2, count 3" in capsys.readouterr().out
    (tmp_path / "bad.jsonl").write_text('{"actions": ["a"], "success": "yes"}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1: `success` must be true or false"):
        main(["mine", "--environment", "mygame", "--trajectories", str(tmp_path / "bad.jsonl"), "--out", str(out)])
    (tmp_path / "list.jsonl").write_text('["open door"]\n')
    with pytest.raises(SystemExit, match="list.jsonl:1 is not a JSON object"):
        main(["mine", "--environment", "mygame", "--trajectories", str(tmp_path / "list.jsonl"), "--out", str(out)])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["mine", "--environment", "mygame", "--trajectories", str(tmp_path / "none.jsonl"), "--out", str(out)])


def test_expert_gold_keeps_random_steps_out_of_continuations():
    """D20: with xtree_gold expert no instance's gold continuation holds a step the logged expert took at random (its
    prefix may); xtree_gold logged keeps such instances (the shop's noisy corpus has them)."""
    trajs, logs, tree, occ, rows, _ = corpus_and_rows(ShopEnv, n=300, xtree_gold="expert")
    *_, logged_rows, _ = corpus_and_rows(ShopEnv, n=300, xtree_gold="logged")

    def gold_noise(row):
        inst = instance_of(row)["xtree_instance"]
        s = len(inst["prefix"])
        return logs[inst["traj_id"]].noisy[s : s + len(inst["gold_tokens"])]

    assert rows and not any(any(gold_noise(r)) for r in rows)
    assert any(any(gold_noise(r)) for r in logged_rows)
    assert any(any(logs[instance_of(r)["xtree_instance"]["traj_id"]].noisy[: len(instance_of(r)["xtree_instance"]
               ["prefix"])]) for r in rows)  # fmt: skip


def test_the_opening_warning_fires_on_the_tree_node_rl_collapsed_on():
    """D21: every node of the shop's noisy-expert tree starts with the search, so every instance opens with it and the
    start-up warning fires (node RL collapsed there); on the noise-free expert's tree and the terminal's, neither of
    which collapsed, it stays quiet."""
    _, _, tree, _, rows, _ = corpus_and_rows(ShopEnv, n=500)
    assert tree.nodes and {n.expansion[0] for n in tree.nodes} == {"search<query>"}  # read off the tree itself
    assert instance_openings(rows) == Counter({"search<query>": len(rows)})
    assert "begin with search<query>" in opening_warning(instance_openings(rows))
    for env_cls, noise in ((ShopEnv, 0.0), (TerminalEnv, 0.3)):
        *_, rows, _ = corpus_and_rows(env_cls, n=500, noise=noise)
        openings = instance_openings(rows)
        assert len(openings) > 1 and sum(openings.values()) == len(rows)
        assert opening_warning(openings) is None


def test_the_opening_warning_threshold():
    assert "9 of 10 instances begin with a" in opening_warning(Counter(a=9, b=1))  # 0.9 of them: warns
    assert opening_warning(Counter(a=8, b=2)) is None and opening_warning(Counter()) is None
    assert opening_warning(Counter(a=8, b=2), share=0.8) is not None


def test_node_rl_does_not_watch_training_success(tiny_model_folder, tmp_path):
    """Node RL's env/success is a node matched in full (the depth curriculum lowers it by design), so its collapse
    alarm leaves success out; the bonus use keeps every kind."""
    for use, ignored in (("nodes", {"success"}), ("bonus", set())):
        trainer = make_trainer(tiny_model_folder, tmp_path / use, xtree_use=use)
        assert trainer.collapse_alarm.ignore == ignored


def test_instances_command_shows_what_node_rl_opens_with(capsys):
    """`python -m trainers.xtree_cli instances`: the rows the trainer would build (same count), their openings per
    step before them, and the D21 warning on the shop's noisy tree only."""
    from trainers.xtree_cli import main

    main(["instances", "--environment", "shop", "--episodes", "300"])
    out = capsys.readouterr().out
    _, _, _, _, rows, _ = corpus_and_rows(ShopEnv, n=300)
    assert out.startswith(f"{len(rows)} instances") and f"opening action: search<query> {len(rows)}\n" in out
    assert "warning: X-Tree node RL" in out
    main(["instances", "--environment", "shop", "--episodes", "300", "--noise", "0"])
    out = capsys.readouterr().out
    assert "no warning" in out and "click<item>" in out.splitlines()[1]
