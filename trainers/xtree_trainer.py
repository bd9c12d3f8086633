"""X-Tree's trainer: the online skill bonus and offline node RL on a mined tree; arXiv 2609.32993,
docs/methods/xtree.md.

Changes relative to GRPO (`trainer: xtree`):

* At start-up the tree is loaded (`xtree_tree`) or mined (trainers/xtree.py) from logged episodes of the training
  tasks (`expert_corpus`: the environment's noisy expert, which is also what the tiny default was warm-started on).
  It is written beside the run as `xtree.json` (+ `xtree.occ.jsonl`) and drawn as `xtree.png`.
* `xtree_use: bonus` (use b): a second reward function returns each rollout's raw skill bonus B_i (Eq. 8-9), and
  `_calculate_rewards` rescales that column per group (Eq. 7, 10), so r_i = R_i + lambda_g * c * B_i / max_j B_j and
  TRL's group advantage does the rest.
* `xtree_use: nodes` (use a): the training rows become node instances (half B of the task pool, successful episodes,
  `xtree.node_instances`); `NodeEnv` replays each instance's prefix in the live environment (checking that the
  replayed state key is the recorded one), puts it in the prompt as past turns, and plays the policy's continuation
  against the logged gold actions, ending at the first mismatch, with the reward of Eq. 6.

Unchanged: sampling, the loss, the advantage code. Held-out evaluation is on whole tasks, as for every trainer.

Logged metrics (`xtree/`): bonus use: `lambda_mean`, `w0_frac`, `wmax_frac`, `raw_bonus_mean`, `raw_bonus_max`,
`bonus_var_share`, `bonus_inversions`, `rollout_coverage`, `rollout_tile_depth`, `verifier_success`; node use:
`match_frac` (mean m/L), `full_frac`, `full_frac/depth<d>`, `reward/depth<d>`, `reject/<parse|token|slot>` (share of
rollouts ended by each kind of mismatch), `first_mismatch/<k>` (share whose first mismatch was gold step k).

Decision ids (`Dn`) without a page are docs/methods/xtree.md's.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from datasets import Dataset

from envs.base import Env, row_task, state_key_of
from trainers import xtree
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, RolloutBatch, env_reward, reward_function

logger = logging.getLogger(__name__)

USES = ("bonus", "nodes")
OPENING_WARN_SHARE = 0.9  # xtree.md D21: noisy shop tree 96/96 (collapsed), noise-free 64/96, terminal 60/170
BONUS_MODES = ("auto", "depth", "success_coverage")
MIXINGS = ("plain", "depth_curriculum")


@dataclass
class XTreeConfig(AgentGRPOConfig):
    """AgentGRPOConfig plus X-Tree's tree, bonus and node settings (`docs/methods/xtree.md` §5)."""

    xtree_use: str = field(
        default="bonus",
        metadata={"help": "'bonus': the online skill bonus (Eq. 7-10); 'nodes': offline node RL on partial rollouts "
                  "from tree-node prefixes (Eq. 6)."},
    )  # fmt: skip
    xtree_tree: str | None = field(
        default=None,
        metadata={"help": "A tree file (.json, with its .occ.jsonl for nodes) from `python -m trainers.xtree mine`; "
                  "None: mine one at start-up from noisy-expert episodes of the training tasks."},
    )  # fmt: skip
    xtree_corpus_episodes: int = field(
        default=500, metadata={"help": "Logged episodes the tree is mined from (one per training task, in order)."}
    )
    xtree_corpus_noise: float = field(
        default=0.3, metadata={"help": "Chance that the logged expert takes a plausible wrong action (D16)."}
    )
    xtree_max_skills: int = field(default=128, metadata={"help": "Most tree nodes (merges)."})
    xtree_min_frequency: int = field(default=5, metadata={"help": "Least pair count f_uv for a merge (Eq. 4)."})
    xtree_mdl_lambda: float = field(default=0.5, metadata={"help": "η of the compression test f - 1 > η·ℓ (Eq. 4)."})
    xtree_max_skill_len: int = field(default=8, metadata={"help": "Longest skill, in primitive actions (Eq. 4)."})
    xtree_p_len: float = field(default=1.0, metadata={"help": "Length exponent of the X-Score (Eq. 3, D1)."})
    xtree_p_succ: float = field(default=1.0, metadata={"help": "Success exponent of the X-Score (Eq. 3, D1)."})
    xtree_eps: float = field(default=0.0, metadata={"help": "Success offset ε of the X-Score (Eq. 3, D1)."})
    xtree_lambda0: float = field(
        default=0.75, metadata={"help": "λ0, the bonus weight of a group with no win (Eq. 7)."}
    )
    xtree_w_max: float = field(default=0.4, metadata={"help": "Win rate at which the bonus has faded out (Eq. 7)."})
    xtree_c: float = field(default=2.0, metadata={"help": "c, the scale of the normalised bonus (Eq. 10)."})
    xtree_kappa_b: float = field(default=0.5, metadata={"help": "κ_b, depth coefficient of the depth bonus (Eq. 8)."})
    xtree_bonus_mode: str = field(
        default="auto",
        metadata={"help": "'depth' (Eq. 8), 'success_coverage' (Eq. 9), or 'auto': depth when the tree's corpus is "
                  "successful episodes only, else success_coverage (D11)."},
    )  # fmt: skip
    xtree_success_threshold: float = field(
        default=1.0, metadata={"help": "A verifier reward >= this counts as a win in w_g (Eq. 7, D12)."}
    )
    xtree_success_dominance: bool = field(
        default=False, metadata={"help": "Cap λ_g <= (1 - 1e-3)/c so no failure outranks a success (D9)."}
    )
    xtree_a_step: float = field(default=0.7, metadata={"help": "a_step, weight of the matched share m/L (Eq. 6)."})
    xtree_a_comp: float = field(default=0.3, metadata={"help": "a_comp, the completion bonus (Eq. 6)."})
    xtree_kappa: float = field(default=0.5, metadata={"help": "κ, depth growth of the completion bonus (Eq. 6)."})
    xtree_max_instances_per_node: int = field(default=32, metadata={"help": "Node RL instances kept per node."})
    xtree_mixing: str = field(
        default="depth_curriculum",
        metadata={"help": "Order of node instances: 'plain' (seeded shuffle) or 'depth_curriculum' (ascending "
                  "depth, shuffled within a depth)."},
    )  # fmt: skip
    xtree_instance_source: str = field(
        default="successful", metadata={"help": "'successful' (D4) or 'all' episodes of half B feed node instances."}
    )
    xtree_gold: str = field(
        default="expert",
        metadata={"help": "Node instances whose gold continuation is: 'expert' (no step the logged expert took at "
                  "random, D20) or 'logged' (any occurrence in a successful episode)."},
    )  # fmt: skip
    xtree_jaccard: float = field(
        default=0.5, metadata={"help": "Word-set Jaccard at which a search query matches the logged one (D5)."}
    )

    def __post_init__(self):
        super().__post_init__()
        problems = []
        if self.xtree_use not in USES:
            problems.append(f"xtree_use must be one of {USES}, got {self.xtree_use!r}")
        if self.xtree_bonus_mode not in BONUS_MODES:
            problems.append(f"xtree_bonus_mode must be one of {BONUS_MODES}, got {self.xtree_bonus_mode!r}")
        if self.xtree_mixing not in MIXINGS:
            problems.append(f"xtree_mixing must be one of {MIXINGS}, got {self.xtree_mixing!r}")
        if self.xtree_gold not in ("expert", "logged"):
            problems.append(f"xtree_gold must be 'expert' or 'logged', got {self.xtree_gold!r}")
        if self.xtree_instance_source not in ("successful", "all"):
            problems.append(f"xtree_instance_source must be 'successful' or 'all', got {self.xtree_instance_source!r}")
        if not 0 < self.xtree_w_max:
            problems.append(f"xtree_w_max must be > 0, got {self.xtree_w_max}")
        if self.xtree_corpus_episodes < 1:
            problems.append(f"xtree_corpus_episodes must be >= 1, got {self.xtree_corpus_episodes}")
        if self.xtree_use == "bonus":  # §7 property 21: Eq. 10 needs the plain weighted sum of two columns
            if self.multi_objective_aggregation != "sum_then_normalize":
                problems.append(
                    "the X-Tree bonus needs multi_objective_aggregation 'sum_then_normalize' (Eq. 10 adds the scaled "
                    f"bonus to the verifier reward), got {self.multi_objective_aggregation!r}"
                )
            if self.reward_weights is not None and list(self.reward_weights) != [1.0, 1.0]:
                problems.append(f"the X-Tree bonus needs reward_weights [1, 1] (Eq. 10), got {self.reward_weights}")
        if problems:
            raise ValueError("; ".join(problems))

    def miner(self) -> xtree.MinerConfig:
        return xtree.MinerConfig(
            max_skills=self.xtree_max_skills,
            min_frequency=self.xtree_min_frequency,
            mdl_lambda=self.xtree_mdl_lambda,
            max_skill_len=self.xtree_max_skill_len,
            p_len=self.xtree_p_len,
            p_succ=self.xtree_p_succ,
            eps=self.xtree_eps,
        )


# ---------------------------------------------------------------------------------------------------------------------
# The logged corpus
# ---------------------------------------------------------------------------------------------------------------------


@dataclass
class Logged:
    """What the corpus keeps of one episode beyond its canonical tokens: the task, every observation (the first, then
    the one after each action), the state key before each action, each action's slots and whether it was random."""

    task: dict
    observations: list[str]  # o_0 .. o_T (o_0 = the first observation)
    state_keys: list[str | None]  # before each action
    slots: list[dict]
    noisy: list[bool] = field(default_factory=list)  # per action: the logged expert took a plausible wrong action


def env_name(env: Env, task: dict) -> str:
    return str(task.get("env") or env.name)


def expert_corpus(
    factory: Callable[[dict], Env], tasks: list[dict], noise: float, seed: int = 0
) -> tuple[list[xtree.Trajectory], dict[str, Logged]]:
    """Log one noisy-expert episode per task (`envs.base.noisy_expert_episode`'s policy, seeded per task) and
    canonicalise it. Returns the trajectories and, per trajectory id, what node RL needs to replay it."""
    trajs, logs = [], {}
    for i, task in enumerate(tasks):
        env = factory(task)
        rng = random.Random(f"xtree-corpus|{seed}|{task.get('task_id', i)}")
        first = env.reset(task)
        observations, keys, actions, noisy, success = [first], [], [], [], False
        for _ in range(env.max_turns):
            keys.append(state_key_of(env, observations[-1]))
            noisy.append(rng.random() < noise)
            action = env.noisy_action(rng) if noisy[-1] else env.expert_action()
            observation, _, done, info = env.step(action)
            actions.append(action)
            observations.append(observation)
            if done:
                success = bool(info.get("success", False))
                break
        name = env_name(env, task)
        ctx = xtree.context_of(task, getattr(env, "action_names", ()))
        canonical = [xtree.canon(name, a, ctx) for a in actions]
        tid = str(task.get("task_id", i))
        trajs.append(
            xtree.Trajectory(
                id=f"{tid}#{i}",
                task_id=tid,
                success=success,
                tokens=[t for t, _ in canonical],
                actions=actions,
                family=ctx["family"],
                goal_attributes=list(ctx["goal_attributes"]),
            )
        )
        logs[trajs[-1].id] = Logged(task, observations, keys, [s for _, s in canonical], noisy)
    return trajs, logs


def corpus_index(trajs: list[xtree.Trajectory], logs: dict[str, Logged]) -> xtree.CorpusIndex:
    """The corpus as cards read it (Eq. 11): episodes, and each step's abstracted surface form."""
    surfaces = {t.id: [slot.get("surface", tok) for slot, tok in zip(logs[t.id].slots, t.tokens, strict=True)]
                for t in trajs}  # fmt: skip
    return xtree.CorpusIndex(list(trajs), surfaces)


# ---------------------------------------------------------------------------------------------------------------------
# Use (a): the node environment
# ---------------------------------------------------------------------------------------------------------------------


class PrefixMismatch(RuntimeError):
    """Replaying a logged prefix did not reach the logged state: the log and the environment disagree."""


class NodeEnv(Env):
    """One offline node instance (docs/methods/xtree.md §4.3) on top of the live environment `inner`.

    `reset` replays the instance's prefix actions in `inner` and checks that the state key reached equals the recorded
    one (else `PrefixMismatch`); it returns the conversation so far (the first observation, then the prefix as past
    assistant and environment turns, ending with o_s), which the agent loop puts in the prompt. `step` matches the
    policy's action against the next gold action (`xtree.matches`); a match steps `inner` with the gold action and
    returns its observation, and the episode ends at the first mismatch (an unparsable action is one) or after L
    matches, with the reward of Eq. 6 on the last turn. `info` holds `m`, `L`, `depth` and the rejection `reason`."""

    def __init__(self, inner: Env, settings: XTreeConfig | None = None):
        super().__init__(inner.difficulty)
        self.inner = inner
        self.name = inner.name
        self.max_turns = inner.max_turns
        self.observation_role = inner.observation_role
        self.tools = inner.tools
        self.settings = settings or XTreeConfig(output_dir="unused", report_to="none")
        self.instance: dict = {}
        self.m = 0
        self.done = False

    def reset(self, task: dict) -> list[dict]:
        inst = task["xtree_instance"]
        self.instance, self.m, self.done = inst, 0, False
        base_task = inst["task"]
        first = self.inner.reset(base_task)
        messages = [{"role": "user", "content": first}]
        for k, action in enumerate(inst["prefix"]):
            observation, _, done, _ = self.inner.step(action)
            if done:
                raise PrefixMismatch(f"the environment ended the episode inside the prefix, at step {k}")
            messages += [
                {"role": "assistant", "content": action},
                {"role": self.observation_role, "content": observation},
            ]
        key = state_key_of(self.inner, messages[-1]["content"])
        if key != inst["state_key"]:
            raise PrefixMismatch(
                f"replaying the prefix of {inst['node']} in {inst['traj_id']} reached state {key!r}, the log recorded "
                f"{inst['state_key']!r}"
            )
        return messages

    def state_key(self) -> str:
        return self.inner.state_key()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done:
            return "the episode is over", 0.0, True, self._info("")
        inst, s = self.instance, self.settings
        ctx = xtree.context_of(inst["task"], getattr(self.inner, "action_names", ()))
        name = str(inst["task"].get("env") or self.inner.name)
        gold = (inst["gold_tokens"][self.m], inst["gold_slots"][self.m])
        ok, reason = xtree.matches(name, gold, xtree.canon(name, action, ctx), s.xtree_jaccard)
        if ok:
            observation = self.inner.step(inst["gold_slots"][self.m]["raw"])[0]
            self.m += 1
        else:
            observation = "the step does not match the recorded one"
        L = len(inst["gold_tokens"])
        if ok and self.m < L:
            return observation, 0.0, False, self._info("")
        self.done = True
        reward = xtree.offline_reward(self.m, L, inst["depth"], s.xtree_a_step, s.xtree_a_comp, s.xtree_kappa)
        return observation, reward, True, self._info(reason)

    def _info(self, reason: str) -> dict:
        L = len(self.instance.get("gold_tokens", [])) or 1
        return {"success": self.m == L, "m": self.m, "L": L, "depth": self.instance.get("depth", 0), "reason": reason}


def instance_rows(
    trajs: list[xtree.Trajectory],
    logs: dict[str, Logged],
    tree: xtree.Tree,
    occurrences: list[xtree.Occurrence],
    args: XTreeConfig,
) -> list[dict]:
    """Dataset rows of the node instances (§4.3), ordered by `xtree_mixing`; each row's task carries the instance.
    With `xtree_gold: expert` an occurrence whose gold continuation holds a step the logged expert took at random is
    no instance (D20); its prefix may hold such steps."""
    if args.xtree_gold == "expert":
        occurrences = [o for o in occurrences if not any(logs[o.traj_id].noisy[o.start : o.end])]
    chosen = xtree.node_instances(
        tree, occurrences, trajs, args.seed, args.xtree_max_instances_per_node, args.xtree_instance_source
    )
    rows = []
    for occ, traj in chosen:
        log = logs[traj.id]
        s, e = occ.start, occ.end
        node = tree.by_id[occ.node]
        inst = {
            "node": occ.node,
            "traj_id": traj.id,
            "task": log.task,
            "prefix": traj.actions[:s],
            "state_key": log.state_keys[s],
            "gold_tokens": traj.tokens[s:e],
            "gold_slots": log.slots[s:e],
            "observations": log.observations[s + 1 : e + 1],
            "depth": node.depth,
        }
        task = {"task_id": f"{traj.task_id}@{occ.node}:{s}", "env": log.task.get("env"), "xtree_instance": inst}
        rows.append({"prompt": log.observations[s], "task": json.dumps(task), "task_id": task["task_id"],
                     "depth": node.depth})  # fmt: skip
    rng = random.Random(f"xtree-mixing|{args.seed}")
    rng.shuffle(rows)
    if args.xtree_mixing == "depth_curriculum":
        rows.sort(key=lambda r: r["depth"])  # stable: shuffled within each depth
    return rows


def instance_openings(rows: list[dict]) -> Counter:
    """How many node instances begin with each canonical action (their first gold token). Every rollout of node RL is
    scored on its first step, so this is what it teaches most (docs/methods/xtree.md D21)."""
    return Counter(json.loads(r["task"])["xtree_instance"]["gold_tokens"][0] for r in rows)


def opening_warning(openings: Counter, share: float = OPENING_WARN_SHARE) -> str | None:
    """The start-up warning of xtree.md D21, or None: one action opens at least `share` of the instances, so node RL
    will reward it from every state it starts in, including states where the task needs something else."""
    if not openings:
        return None
    (top, count), total = openings.most_common(1)[0], sum(openings.values())
    if count < share * total:
        return None
    return (
        f"X-Tree node RL: {count} of {total} instances begin with {top}, so node RL will teach the policy to answer "
        f"every state it starts from with {top}. On tiny:shop's noisy-expert tree every instance began with a search, "
        "some on an item page, and held-out success fell to 0 on every seed (docs/methods/xtree.md D21). Look at the "
        "tree (python -m trainers.xtree_cli show); a tree whose nodes start later in the episode (there: "
        "xtree_corpus_noise 0) or the skill bonus (xtree_use: bonus) did not collapse"
    )


# ---------------------------------------------------------------------------------------------------------------------
# The trainer
# ---------------------------------------------------------------------------------------------------------------------


class XTreeTrainer(AgentGRPOTrainer):
    """GRPO with an X-Tree: the skill bonus (`xtree_use: bonus`) or node RL (`xtree_use: nodes`); see the module
    docstring. Needs `env_factory`."""

    config_class = XTreeConfig

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, *pargs, env_factory=None, **kwargs):
        args = self.as_config(args, model)
        if env_factory is None:
            raise ValueError("trainer xtree needs an environment (env_factory): the tree is mined from its episodes")
        if train_dataset is None or len(train_dataset) == 0:
            raise ValueError("trainer xtree needs a non-empty train_dataset of environment tasks")
        if args.xtree_use == "bonus":  # checked before any episode is logged
            verifier = reward_funcs if reward_funcs is not None else [reward_function(args)]
            if not isinstance(verifier, list):
                verifier = [verifier]
            if len(verifier) != 1:
                raise ValueError(
                    f"the X-Tree bonus adds its column to exactly one verifier reward, got {len(verifier)}"
                )
        tasks = [row_task(row) for row in train_dataset]
        self.action_names = tuple(getattr(env_factory(train_dataset[0]), "action_names", ()) or ())
        trajs, logs = [], {}
        if not args.xtree_tree or args.xtree_use == "nodes":  # a bonus on a given tree needs no logged episode
            try:
                trajs, logs = expert_corpus(lambda t: env_factory({"task": t}), tasks[: args.xtree_corpus_episodes],
                                            args.xtree_corpus_noise, args.seed)  # fmt: skip
            except NotImplementedError as e:
                raise ValueError(
                    "X-Tree logs the environment's noisy expert (expert_action, noisy_action) to mine its tree and "
                    f"replay node prefixes, and this environment has none ({e!r}). Mine a tree from your own logged "
                    "episodes (python -m trainers.xtree_cli mine --trajectories FILE.jsonl) and use it as a bonus "
                    "(xtree_tree: FILE, xtree_use: bonus)"
                ) from e
        if args.xtree_tree:
            self.tree = xtree.load(args.xtree_tree)
            occurrences = xtree.load_occurrences(args.xtree_tree) if args.xtree_use == "nodes" else []
        else:
            self.tree, occurrences = xtree.mine(trajs, args.miner(), environment=tasks[0].get("env", ""),
                                                corpus_name=f"noisy expert ({args.xtree_corpus_noise})")  # fmt: skip
        if not self.tree.nodes:
            raise ValueError(
                f"the X-Tree has no skill: no pair of actions passed the miner's thresholds (min_frequency "
                f"{args.xtree_min_frequency}, mdl_lambda {args.xtree_mdl_lambda}) on {len(trajs)} episodes; log more "
                "episodes (xtree_corpus_episodes) or lower the thresholds"
            )
        mode = args.xtree_bonus_mode
        self.bonus_mode = mode if mode != "auto" else ("depth" if self.tree.successful_only else "success_coverage")
        if args.xtree_use == "nodes":
            missing = {o.traj_id for o in occurrences} - {t.id for t in trajs}
            if missing:
                raise ValueError(
                    f"the occurrences of xtree_tree {args.xtree_tree!r} name {len(missing)} episodes this run did not "
                    f"log (e.g. {sorted(missing)[0]!r}); node RL replays the episodes the tree was mined from: mine "
                    "it from this run's training tasks (or leave xtree_tree unset)"
                )
            rows = instance_rows(trajs, logs, self.tree, occurrences, args)
            if not rows:
                raise ValueError(
                    "X-Tree node RL found no instance: no successful logged episode of half B contains a tree node; "
                    "log more episodes (xtree_corpus_episodes) or lower xtree_corpus_noise"
                )
            self.instance_depths = Counter(r["depth"] for r in rows)
            self.instance_openings = instance_openings(rows)
            train_dataset = Dataset.from_list(rows)
            args.shuffle_dataset = False  # the order is xtree_mixing's
            if reward_funcs is None:  # Eq. 6 is the node environment's own reward, whatever `reward` says
                reward_funcs = [env_reward]
            base_factory = env_factory

            def env_factory(row, _base=base_factory, _args=args):  # noqa: F811
                task = row_task(row)
                if "xtree_instance" in task:
                    return NodeEnv(_base({"task": task["xtree_instance"]["task"]}), _args)
                return _base(row)

        else:
            reward_funcs = [verifier[0], self._bonus_function()]
        self._tiling_stats: list[tuple[float, float]] = []  # (coverage, mean tile depth) per rollout of the batch
        super().__init__(model, reward_funcs, args, train_dataset, *pargs, env_factory=env_factory, **kwargs)
        self.tree_stats = xtree.tree_stats(self.tree, trajs) if trajs else None
        if self.accelerator.is_main_process:
            self.write_tree(occurrences)

    def write_tree(self, occurrences) -> None:
        os.makedirs(self.args.output_dir, exist_ok=True)
        path = os.path.join(self.args.output_dir, "xtree.json")
        xtree.save(self.tree, path, occurrences)
        xtree.plot_tree(self.tree, os.path.join(self.args.output_dir, "xtree.png"))
        depths = Counter(n.depth for n in self.tree.nodes)
        print(f"X-Tree: {len(self.tree.nodes)} skills, depths {dict(sorted(depths.items()))} -> {path}")
        if self.tree_stats is not None:
            stats = self.tree_stats
            with open(os.path.join(self.args.output_dir, "xtree_stats.json"), "w") as f:
                json.dump(stats, f, indent=1)
            print(f"X-Tree on its corpus: compression {stats['compression']:.3f}, coverage {stats['coverage']:.3f}, "
                  f"{len(stats['self_encoding_failures'])} self-encoding failures")  # fmt: skip
        if self.args.xtree_use == "nodes":
            print(f"X-Tree node RL: instances per depth {dict(sorted(self.instance_depths.items()))}, "
                  f"first gold action {dict(self.instance_openings.most_common())}")  # fmt: skip
            warning = opening_warning(self.instance_openings)
            if warning:
                logger.warning("%s", warning)

    def alarm_ignores(self) -> tuple[str, ...]:
        """Node RL's `env/success` is a node matched in full, which the depth curriculum lowers by design: the
        success alarm would fire on a healthy run (and cannot see a held-out collapse)."""
        return ("success",) if self.args.xtree_use == "nodes" else ()

    # --- use (b) -----------------------------------------------------------------------------------------------------
    def _bonus_function(self) -> Callable:
        def xtree_bonus_raw(completions, transcript=None, task=None, **kwargs) -> list[float]:
            """B_i of each rollout (Eq. 8-9) from its environment actions, encoded with the tree."""
            if transcript is None:
                raise ValueError("the X-Tree bonus needs the agent loop's transcript; train with an environment")
            tasks = task if task is not None else [{}] * len(transcript)
            out = []
            for turns, t in zip(transcript, tasks, strict=True):
                t = json.loads(t) if isinstance(t, str) else (t or {})
                name = str(t.get("env") or self.tree.environment)
                ctx = xtree.context_of(t, self.action_names)
                tokens = [xtree.canon(name, turn["action"], ctx)[0] for turn in turns]
                tiling = xtree.encode(self.tree, tokens)
                self._note_tiling(tiling, len(tokens))
                out.append(xtree.raw_bonus(self.tree, tiling, self.bonus_mode, len(tokens), self.args.xtree_kappa_b))
            return out

        return xtree_bonus_raw

    def _note_tiling(self, tiling, n_actions: int) -> None:
        nodes = [(s, a, b) for s, a, b in tiling if s in self.tree.by_id]
        self._tiling_stats.append(
            (sum(b - a for _, a, b in nodes) / n_actions if n_actions else 0.0,
             sum(self.tree.depth(s) for s, _, _ in tiling) / len(tiling) if tiling else 0.0)
        )  # fmt: skip

    def shape_rewards(self, rewards):
        """Use (b): the bonus column reweighed per group (the gathered reward columns, after TRL's reward functions
        ran and before its group normalisation)."""
        tiling, self._tiling_stats = self._tiling_stats, []  # what this batch's bonus function recorded
        if self.args.xtree_use != "bonus":
            return rewards
        a = self.args
        group = self.num_generations if self.model.training else self.num_generations_eval
        shaped = xtree.shape_rewards(rewards, group, a.xtree_lambda0, a.xtree_w_max, a.xtree_c,
                                     a.xtree_success_threshold, a.xtree_success_dominance)  # fmt: skip
        raw = torch.nan_to_num(rewards[:, 1].double())
        verifier = torch.nan_to_num(rewards[:, 0].double())
        total = verifier + shaped.rewards[:, 1].double()
        var_total = total.view(-1, group).var(dim=1, unbiased=False).mean()
        var_bonus = shaped.rewards[:, 1].double().view(-1, group).var(dim=1, unbiased=False).mean()
        self.log_metric("xtree/lambda_mean", shaped.weights.mean().item())
        self.log_metric("xtree/w0_frac", (shaped.wins == 0).double().mean().item())
        self.log_metric("xtree/wmax_frac", (shaped.wins >= a.xtree_w_max).double().mean().item())
        self.log_metric("xtree/raw_bonus_mean", raw.mean().item())
        self.log_metric("xtree/raw_bonus_max", raw.max().item())
        self.log_metric("xtree/bonus_var_share", (var_bonus / var_total).item() if var_total > 0 else 0.0)
        self.log_metric("xtree/bonus_inversions", float(shaped.inversions))
        self.log_metric("xtree/verifier_success", (verifier >= a.xtree_success_threshold).double().mean().item())
        stats = gather_object(tiling)
        if stats:
            self.log_metric("xtree/rollout_coverage", sum(c for c, _ in stats) / len(stats))
            self.log_metric("xtree/rollout_tile_depth", sum(d for _, d in stats) / len(stats))
        return shaped.rewards

    # --- use (a) metrics ---------------------------------------------------------------------------------------------
    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        if self.args.xtree_use == "nodes":
            self._log_node_metrics(batch)
        return super().compute_advantages(batch)

    def _log_node_metrics(self, batch: RolloutBatch) -> None:
        a = self.args
        infos = gather_object([row.get("final_info") or {} for row in batch.rows])
        infos = [i for i in infos if "L" in i]
        if not infos:
            return
        self.log_metric("xtree/match_frac", sum(i["m"] / i["L"] for i in infos) / len(infos))
        self.log_metric("xtree/full_frac", sum(i["m"] == i["L"] for i in infos) / len(infos))
        by_depth: dict[int, list] = {}
        for i in infos:
            by_depth.setdefault(i["depth"], []).append(i)
        for d, group in sorted(by_depth.items()):
            self.log_metric(f"xtree/full_frac/depth{d}", sum(i["m"] == i["L"] for i in group) / len(group))
            rewards = [xtree.offline_reward(i["m"], i["L"], d, a.xtree_a_step, a.xtree_a_comp, a.xtree_kappa)
                       for i in group]  # fmt: skip
            self.log_metric(f"xtree/reward/depth{d}", sum(rewards) / len(rewards))
        reasons = Counter(i["reason"] for i in infos if i["reason"])
        for reason in ("parse", "token", "slot"):
            self.log_metric(f"xtree/reject/{reason}", reasons.get(reason, 0) / len(infos))
        firsts = Counter(i["m"] for i in infos if i["m"] < i["L"])
        for k, n in sorted(firsts.items()):
            self.log_metric(f"xtree/first_mismatch/{k}", n / len(infos))
