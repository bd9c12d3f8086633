"""The Experience Funnel's outer loop (docs/methods/funnel.md §4.2); `trainer: funnel` in a config runs it:
`python train.py --config configs/funnel_shop.yaml`.

Per round k: collect evidence with the current state, let the editor propose ops, keep the edited state only if it
beats the incumbent on the selection-validation split under the current policy (Eq. 10). Every `consolidate_every`
rounds (and at the last, and when the state outgrows its budget): three-state selection (Eq. 1-3), a consolidation
(`FunnelTrainer`, Eq. 4-9) on state-free prompts, a checkpoint gate on state-free validation (Eq. 10) that restores
the previous weights bit for bit when it fails, and residual pruning of the state (Eq. 11).

Resumable between phases: after each phase the loop commits `funnel.json` (round, phase, states, gate history, RNG
states, rollout counts, which weights folder is current) with an atomic rename, after the weights it names are on
disk. A run killed at any point (kill -9 included) restarts from its last committed phase when started again with the
same output_dir; what the killed phase did is done again from the same RNG state.

Splits (D16): the selection-validation split D_sel is `gate_tasks` training tasks chosen by a seeded hash of their
task ids and removed from the training pool; the held-out tasks (`num_eval_tasks`) are the test split, read only by
the before/after reports. Every decision is logged in `funnel.json`'s `history` and drawn in `funnel.png`.

Decision ids (`Dn`) without a page are docs/methods/funnel.md's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import random
import shutil
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from envs.base import row_task
from rewards.judge import Judge
from trainers.agent_loop import LoopSettings, play
from trainers.funnel import EDITOR, FunnelConfig, FunnelTrainer, paired_gate, selection_weights
from trainers.funnel_state import (
    CardEditor,
    Evidence,
    LLMEditor,
    State,
    apply_edit_ops,
    render_state,
    state_tokens,
    task_family,
)
from trainers.generation import hf_generate
from trainers.reporting import plot_curves
from trainers.teacher import with_privileged_block

logger = logging.getLogger(__name__)
PROGRESS = "funnel.json"


# ---------------------------------------------------------------------------------------------------------------------
# Splits, prompts and paired rollouts


def split_tasks(rows: list[dict], n_sel: int, seed: int) -> tuple[list[dict], list[dict]]:
    """(D_train, D_sel): the `n_sel` task ids with the smallest sha256 of (seed, id) form D_sel (D16), every row of an
    id on the same side, so the two are disjoint by task id; the order of `rows` does not matter. A row without a
    `task_id` is keyed by its task JSON."""

    def ident(row):
        key = row.get("task_id")
        return json.dumps(row_task(row), sort_keys=True, default=str) if key is None else str(key)

    def rank(key):
        return hashlib.sha256(f"{seed}:{key}".encode()).hexdigest(), key

    ids = sorted({ident(r) for r in rows}, key=rank)
    if n_sel >= len(ids):
        raise ValueError(f"gate_tasks ({n_sel}) must be smaller than the distinct training tasks ({len(ids)})")
    chosen = set(ids[:n_sel])
    ordered = sorted(rows, key=lambda r: (rank(ident(r)), json.dumps(row_task(r), sort_keys=True, default=str)))
    return [r for r in ordered if ident(r) not in chosen], [r for r in ordered if ident(r) in chosen]


class _StateEnv:
    """An environment whose first observation carries the state block at a user-message position (D13); every other
    attribute is the wrapped environment's."""

    def __init__(self, env, block: str, position: str):
        self._env, self._block, self._position = env, block, position

    def reset(self, task):
        first = self._env.reset(task)
        return with_privileged_block(first, self._block, self._position)[0]["content"]

    def __getattr__(self, name):
        return getattr(self._env, name)


def play_condition(model, tokenizer, factory, tasks: list[dict], state: State | None, n: int, seed: int,
                   settings: LoopSettings, position: str, temperature: float, batch_size: int):  # fmt: skip
    """n episodes per task under prompt(x, state) (None or an empty state: the plain prompt), sampled from a generator
    seeded with `seed`, so conditions played with the same seed on the same tasks are paired (Eq. 1). Returns the
    rollouts, task-major ((task 0) x n, (task 1) x n, ...)."""
    was_training = model.training
    model.eval()
    generate = hf_generate(model, tokenizer, temperature=temperature)
    jobs = [t for t in tasks for _ in range(n)]
    envs, prompts = [], []
    for task in jobs:
        block = render_state(state, task_family(task)) if state is not None else None
        env = factory()
        if block and position != "system_end":
            env = _StateEnv(env, block, position)
        envs.append(env)
        prompts.append(with_privileged_block([{"role": "user", "content": ""}], block) if block and
                       position == "system_end" else [{"role": "user", "content": ""}])  # fmt: skip
    torch.manual_seed(seed)
    out = []
    for lo in range(0, len(jobs), batch_size):
        out += play(generate, tokenizer, envs[lo : lo + batch_size], jobs[lo : lo + batch_size],
                    prompts[lo : lo + batch_size], settings)  # fmt: skip
    model.train(was_training)
    return out


def rewards_of(rollouts, n: int) -> list[list[float]]:
    """(tasks, n) episodic rewards (D18) of task-major rollouts."""
    r = [float(x.env_reward) for x in rollouts]
    return [r[i : i + n] for i in range(0, len(r), n)]


# ---------------------------------------------------------------------------------------------------------------------
# Weights: snapshots, rollback, saving


def snapshot(model) -> dict[str, torch.Tensor]:
    """Copies of the trainable parameters (what a consolidation changes), for a bit-exact rollback (D15)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def restore(model, snap: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in snap.items():
            params[name].copy_(value)


def save_weights(model, folder: Path) -> None:
    """The trainable parameters, written to a temporary file and renamed into place."""
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "weights.pt.tmp"
    torch.save(snapshot(model), tmp)
    os.replace(tmp, folder / "weights.pt")


def load_weights(model, folder: Path) -> None:
    restore(model, torch.load(folder / "weights.pt", map_location="cpu", weights_only=True))


def rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])


# ---------------------------------------------------------------------------------------------------------------------
# The loop


class FunnelLoop:
    """One Funnel run; `run()` starts it or resumes it from `output_dir/funnel.json`."""

    def __init__(self, model, tokenizer, config: FunnelConfig, train_rows: list[dict], test_tasks: list[dict],
                 env_factory, environment: str, peft_config=None):  # fmt: skip
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.env_factory, self.environment, self.peft_config = env_factory, environment, peft_config
        self.out = Path(config.output_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.train_rows, self.sel_rows = split_tasks(train_rows, config.gate_tasks, config.seed)
        self.sel_tasks = [row_task(r) for r in self.sel_rows]
        self.test_tasks = test_tasks
        self.settings = LoopSettings(config.max_turn_tokens, config.max_completion_length, config.max_turns,
                                     env_timeout=config.env_timeout)  # fmt: skip
        self.factory = partial(env_factory, {})
        self.editor = self._make_editor()
        self.initial = snapshot(model)  # θ_0, for the final (θ_0, ∅) report
        self.progress = {
            "round": 0, "phase": "start", "state": State().to_dict(), "state_prev": State().to_dict(),
            "state_full": None, "weights": None, "history": [], "rollouts": {}, "log_history": [],
        }  # fmt: skip

    def _make_editor(self):
        c = self.config
        if c.editor == "card":
            return CardEditor()
        judge = Judge(EDITOR.judge_config(
            c, max_repairs=c.editor_max_retries, temperature=0.0, seed=0, max_tokens=2048,
            cache_path=c.editor_cache_path or str(self.out / "editor_cache.sqlite"),
        ))  # fmt: skip
        budgets = {"max_entries": c.max_entries, "max_entry_chars": c.max_entry_chars,
                   "max_ops_per_round": c.max_ops_per_round, "state_token_budget": c.state_token_budget}  # fmt: skip
        return LLMEditor(judge, self.environment, budgets, c.editor_evidence_rollouts)

    # -- bookkeeping --------------------------------------------------------------------------------------------------
    def count_tokens(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _spend(self, phase: str, n: int) -> None:
        self.progress["rollouts"][phase] = self.progress["rollouts"].get(phase, 0) + n

    def commit(self, phase: str) -> None:
        """Write funnel.json atomically: the point a resumed run restarts from."""
        self.progress["phase"] = phase
        self.progress["rng"] = {k: _jsonable(v) for k, v in rng_state().items()}
        tmp = self.out / (PROGRESS + ".tmp")
        tmp.write_text(json.dumps(self.progress, default=str))
        os.replace(tmp, self.out / PROGRESS)

    def resume(self) -> bool:
        path = self.out / PROGRESS
        if not path.is_file():
            return False
        self.progress = json.loads(path.read_text())
        if self.progress.get("weights"):
            load_weights(self.model, self.out / self.progress["weights"])
        set_rng_state({k: _from_jsonable(k, v) for k, v in self.progress["rng"].items()})
        logger.info("resuming the Funnel at round %d after phase %s", self.progress["round"], self.progress["phase"])
        return True

    @property
    def state(self) -> State:
        return State.from_dict(self.progress["state"])

    # -- phases ------------------------------------------------------------------------------------------------------
    def _play(self, tasks, state, n, seed, phase):
        c = self.config
        rollouts = play_condition(self.model, self.tokenizer, self.factory, tasks, state, n, seed, self.settings,
                                  c.state_position, c.temperature, 64)  # fmt: skip
        self._spend(phase, len(rollouts))
        return rollouts

    def _gate(self, cand_state, inc_state, seed, mode, phase):
        c = self.config
        cand = rewards_of(self._play(self.sel_tasks, cand_state, c.gate_rollouts, seed, phase), c.gate_rollouts)
        inc = rewards_of(self._play(self.sel_tasks, inc_state, c.gate_rollouts, seed, phase), c.gate_rollouts)
        return self.decide(cand, inc, mode)

    def decide(self, candidate, incumbent, mode: str):
        """Every gate's decision (Eq. 10 / Eq. 11) from per-task rewards (|D_sel|, n) of the two sides."""
        return paired_gate(candidate, incumbent, self.config.gate_z, mode)

    def _sample(self, rows, n, seed):
        rng = random.Random(seed)
        return [row_task(r) for r in rng.sample(rows, min(n, len(rows)))]

    def state_round(self, k: int) -> None:
        """Steps 1-3 of §4.2: evidence, proposal, state gate."""
        c, state = self.config, self.state
        tasks = self._sample(self.train_rows, c.collect_tasks, c.seed * 1000 + k)
        rollouts = self._play(tasks, state, c.collect_rollouts, c.seed * 7919 + k, "evidence")
        evidence = [_evidence(r, t) for r, t in zip(rollouts, [t for t in tasks for _ in range(c.collect_rollouts)],
                                                        strict=True)]  # fmt: skip
        history = [h for h in self.progress["history"] if h["kind"] == "state"]
        proposal = self.editor.propose(state, evidence, history)
        new, applied, dropped = self._apply(state, proposal.ops, k)
        version = sum(h["kind"] == "checkpoint" and h["accept"] for h in self.progress["history"])
        record = {"kind": "state", "round": k, "ops": applied, "dropped": dropped, "weights_version": version,
                  "evidence_success": sum(e.success for e in evidence) / max(1, len(evidence))}  # fmt: skip
        repeat = any(h.get("weights_version") == version and not h["accept"] and h["ops"] == applied
                     and h.get("state_before") == state.to_dict() for h in history)  # fmt: skip
        record["state_before"] = state.to_dict()
        if applied and repeat:  # D23: the same edit of the same state, already rejected under these weights
            record.update(accept=False, reason="repeats an edit rejected under the same weights")
        elif applied:
            gate = self._gate(new, state, c.seed * 104729 + k, "improve", "state_gate")
            record.update(gate.as_dict())
            if gate.accept:
                self.progress["state"] = new.to_dict()
        else:
            record.update(accept=False, reason="no applicable op")
        self._log(record)

    def _apply(self, state, ops, k, residual=False):
        c = self.config
        origin = "card" if c.editor == "card" else "llm"
        return apply_edit_ops(state, ops, k, max_entries=c.max_entries, max_entry_chars=c.max_entry_chars,
                              max_ops=c.max_ops_per_round, token_budget=c.state_token_budget,
                              count_tokens=self.count_tokens, residual=residual, origin=origin)  # fmt: skip

    def consolidate(self, k: int) -> None:
        """Step 4 of §4.2: selection, snapshot, consolidation, checkpoint gate, residual pruning."""
        c = self.config
        state, prev = self.state, State.from_dict(self.progress["state_prev"])
        pool = self._sample(self.train_rows, c.selection_tasks, c.seed * 31 + k)
        seed = c.seed * 15485863 + k
        n = c.selection_rollouts
        free = rewards_of(self._play(pool, None, n, seed, "selection"), n)
        new = rewards_of(self._play(pool, state, n, seed, "selection"), n) if state.entries else free
        prev_r = rewards_of(self._play(pool, prev, n, seed, "selection"), n) if prev.entries else free
        ids = [task_key(t) for t in pool]
        weights = selection_weights({x: {"free": f, "prev": p, "new": s} for x, f, p, s in
                                     zip(ids, free, prev_r, new, strict=True)}, c.alpha, c.benefit_margin,
                                    prev_is_empty=not prev.entries)  # fmt: skip  # Eq. 1-3
        counts = _transition_counts(weights, c.alpha)
        before = snapshot(self.model)  # D15
        if c.consolidation_pool == "train":  # D14: every training task, c = 0 outside the selection pool
            tasks = [row_task(r) for r in self.train_rows]
            trainer = self._trainer(tasks, [task_key(t) for t in tasks], weights, state, k)
        else:
            trainer = self._trainer(pool, ids, weights, state, k)
        spent = sum(self.progress["rollouts"].values())  # every rollout so far: evidence, gates, selection, training
        trainer.train()
        per_step = c.generation_batch_size / max(
            1, c.num_iterations * c.steps_per_generation // c.gradient_accumulation_steps
        )
        self._spend("consolidation", round(trainer.state.global_step * per_step))
        offset = self.progress.setdefault("steps_done", 0)  # consolidations' steps, one after another on the curves
        self.progress["log_history"] += [
            {**row, "step": row.get("step", 0) + offset, "consolidation": k,
             "rollouts_spent": spent + row.get("step", 0) * per_step}
            for row in trainer.state.log_history
        ]  # fmt: skip
        self.progress["steps_done"] = offset + trainer.state.global_step
        trainer.drop_teacher()
        after = snapshot(self.model)
        restore(self.model, before)  # the gate compares θ' against θ, both state-free
        inc = rewards_of(self._play(self.sel_tasks, None, c.gate_rollouts, seed + 1, "checkpoint_gate"),
                         c.gate_rollouts)  # fmt: skip
        restore(self.model, after)
        cand = rewards_of(self._play(self.sel_tasks, None, c.gate_rollouts, seed + 1, "checkpoint_gate"),
                          c.gate_rollouts)  # fmt: skip
        gate = self.decide(cand, inc, "improve")  # Eq. 10
        record = {"kind": "checkpoint", "round": k, "selection": counts, **gate.as_dict()}
        if not gate.accept:
            restore(self.model, before)  # bit for bit
            self._log(record)
            return
        folder = f"weights-{k}"
        save_weights(self.model, self.out / folder)
        old, self.progress["weights"] = self.progress["weights"], folder
        self.progress["state_full"] = self.progress["state"]
        self._log(record)
        self.residual(k)
        self.progress["state_prev"] = self.progress["state"]  # D9: what the policy was distilled with
        self.commit(f"consolidated-{k}")
        if old and old != folder:
            shutil.rmtree(self.out / old, ignore_errors=True)

    def residual(self, k: int) -> None:
        """Step 4.5 of §4.2: prune the state under the new policy (Eq. 11)."""
        c, state = self.config, self.state
        seed = c.seed * 2750159 + k
        if c.residual_mode == "off" or not state.entries:
            return
        if c.residual_mode == "leave_one_out":
            for entry in list(sorted(state.entries, key=lambda e: int(e.id[1:]))):
                candidate = state.without(entry.id)
                gate = self._gate(candidate, state, seed, "non_inferior", "residual_gate")
                self._log({"kind": "residual", "round": k, "retire": entry.id, **gate.as_dict()})
                if gate.accept:
                    state = candidate
        else:
            tasks = self._sample(self.train_rows, c.collect_tasks, seed)
            evidence = []
            jobs = [t for t in tasks for _ in range(c.collect_rollouts)]
            for st in (state, None):
                rollouts = self._play(tasks, st, c.collect_rollouts, seed, "evidence")
                evidence += [_evidence(r, t) for r, t in zip(rollouts, jobs, strict=True)]
            proposal = self.editor.propose(state, evidence, self.progress["history"], residual=True)
            candidate, applied, dropped = self._apply(state, proposal.ops, k, residual=True)
            record = {"kind": "residual", "round": k, "ops": applied, "dropped": dropped}
            if applied:
                gate = self._gate(candidate, state, seed, "non_inferior", "residual_gate")
                record.update(gate.as_dict())
                if gate.accept:
                    state = candidate
            self._log(record)
        self.progress["state"] = state.to_dict()

    def _trainer(self, pool, ids, weights, state, k) -> FunnelTrainer:
        from datasets import Dataset

        c = self.config
        values = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.init}
        values.update(output_dir=str(self.out / f"consolidation-{k}"), save_strategy="no", seed=c.seed + k,
                      generation_batch_size=None, report_to=["none"], model_init_kwargs=None)  # fmt: skip
        args = FunnelConfig(**values)
        first = [self.factory().reset(t) for t in pool]
        rows = Dataset.from_list([{"prompt": p, "task": json.dumps(t), "task_id": x}
                                  for p, t, x in zip(first, pool, ids, strict=True)])  # fmt: skip
        trainer = FunnelTrainer(model=self.model, args=args, train_dataset=rows, processing_class=self.tokenizer,
                                env_factory=self.env_factory)  # fmt: skip
        trainer.selection = weights
        trainer.state_block = lambda row: render_state(state, task_family(row_task(row)))
        return trainer

    def _log(self, record: dict) -> None:
        record["time"] = round(time.time(), 1)
        self.progress["history"].append(record)
        logger.info("funnel %s round %d: %s", record["kind"], record["round"], json.dumps(record, default=str))
        print(f"funnel {record['kind']} round {record['round']}: accept={record.get('accept')} "
              f"d={record.get('mean_diff', float('nan')):.3f} se={record.get('se', float('nan')):.3f}")  # fmt: skip

    def should_consolidate(self, k: int) -> bool:
        c = self.config
        over = state_tokens(self.state, self.count_tokens) > c.state_token_budget if self.state.entries else False
        return k % c.consolidate_every == 0 or k == c.rounds or over  # D6

    def run(self) -> dict:
        resumed = self.resume()
        if not resumed:
            self.commit("start")
        c = self.config
        k, phase = self.progress["round"], self.progress["phase"]
        if phase == "start" or phase.startswith("consolidated") or phase.startswith("kept"):
            k += 1
            phase = "next"
        while k <= c.rounds:
            self.progress["round"] = k
            if phase == "next":
                self.state_round(k)
                self.commit(f"state-{k}")
                phase = f"state-{k}"
            if self.should_consolidate(k):
                weights_before = self.progress["weights"]
                self.consolidate(k)
                if self.progress["weights"] == weights_before:  # rejected: nothing new on disk
                    self.commit(f"kept-{k}")
            else:
                self.commit(f"kept-{k}")
            k, phase = k + 1, "next"
        self.progress["round"] = c.rounds
        return self.report()

    def report(self) -> dict:
        """Final report on the test split (funnel.md §4.2): (θ, ∅), (θ, S_residual), (θ, S_full), (θ_0, ∅)."""
        c = self.config
        n = 1
        seed = c.seed * 99991
        full = State.from_dict(self.progress["state_full"]) if self.progress["state_full"] else self.state
        out = {}
        for name, st in [("policy_state_free", None), ("policy_residual_state", self.state),
                         ("policy_full_state", full)]:  # fmt: skip
            if st is not None and not st.entries:  # an empty state is the plain prompt: the same episodes
                out[name] = dict(out["policy_state_free"])
                continue
            rollouts = play_condition(self.model, self.tokenizer, self.factory, self.test_tasks, st, n, seed,
                                      self.settings, c.state_position, c.temperature, 100)  # fmt: skip
            out[name] = _success(rollouts)
        current = snapshot(self.model)
        restore(self.model, self.initial)
        rollouts = play_condition(self.model, self.tokenizer, self.factory, self.test_tasks, None, n, seed,
                                  self.settings, c.state_position, c.temperature, 100)  # fmt: skip
        out["initial_state_free"] = _success(rollouts)
        restore(self.model, current)
        history = self.progress["history"]
        gates = [h for h in history if "accept" in h and h["kind"] in ("state", "checkpoint")]
        result = {
            "test": out,
            "state": self.progress["state"],
            "history": history,
            "rollouts": dict(self.progress["rollouts"], total=sum(self.progress["rollouts"].values())),
            "accepted": {kind: sum(h["accept"] for h in gates if h["kind"] == kind) for kind in ("state",
                                                                                               "checkpoint")},
            "log_history": self.progress["log_history"],
        }  # fmt: skip
        plot_gates(history, self.out / "funnel.png")
        if self.progress["log_history"]:
            plot_curves(self.progress["log_history"], self.out / "curves.png", title="Funnel consolidations")
        return result


def task_key(task: dict) -> str:
    """A task's identity: its `task_id` when it has one, else its JSON."""
    ident = task.get("task_id")
    return str(ident) if ident is not None else json.dumps(task, sort_keys=True, default=str)


def _evidence(rollout, task) -> Evidence:
    steps = rollout.transcript
    return Evidence(
        task=str(task.get("instruction") or json.dumps(task, default=str))[:1000], family=task_family(task),
        reward=float(rollout.env_reward), success=bool(rollout.success), actions=[s["action"] for s in steps],
        final_observation=steps[-1]["observation"] if steps else "",
    )  # fmt: skip


def _success(rollouts) -> dict:
    return {"success": sum(r.success for r in rollouts) / max(1, len(rollouts)),
            "reward": sum(r.env_reward for r in rollouts) / max(1, len(rollouts))}  # fmt: skip


def _transition_counts(weights: dict, alpha: float) -> dict:
    values = list(weights.values())
    return {"newly_useful": sum(v == 1.0 for v in values), "persistently_useful": sum(v == alpha and v != 1.0
            for v in values), "not_selected": sum(v == 0.0 for v in values), "tasks": len(values)}  # fmt: skip


def _jsonable(value):
    if isinstance(value, torch.Tensor):
        return {"torch": value.tolist()}
    if isinstance(value, tuple) and value and value[0] == "MT19937":
        return {"numpy": [value[0], value[1].tolist(), *value[2:]]}
    return {"python": [value[0], list(value[1]), value[2]]}


def _from_jsonable(kind: str, value):
    if kind == "torch":
        return torch.tensor(value["torch"], dtype=torch.uint8)
    if kind == "numpy":
        v = value["numpy"]
        return (v[0], np.array(v[1], dtype=np.uint32), *v[2:])
    v = value["python"]
    return (v[0], tuple(v[1]), v[2])


def plot_gates(history: list[dict], path: Path) -> Path | None:
    """One panel per gate kind: the paired mean difference d̄ ± z·SE per round, filled when accepted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k in ("state", "checkpoint", "residual") if any(h["kind"] == k and "se" in h for h in history)]
    if not kinds:
        return None
    fig, axes = plt.subplots(1, len(kinds), figsize=(4 * len(kinds), 3.2), squeeze=False)
    for ax, kind in zip(axes[0], kinds, strict=True):
        rows = [h for h in history if h["kind"] == kind and "se" in h]
        for i, h in enumerate(rows):
            colour = "tab:green" if h["accept"] else "tab:red"
            ax.errorbar([i], [h["mean_diff"]], yerr=[h["se"]], fmt="o", color=colour,
                        mfc=colour if h["accept"] else "white")  # fmt: skip
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xticks(range(len(rows)), [f"r{h['round']}" for h in rows], fontsize=7)
        ax.set_title(f"{kind} gate (filled: accepted)", fontsize=10)
        ax.set_ylabel("candidate − incumbent reward")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def run_funnel(run, config: FunnelConfig, model_args, sources, model_path: str, tokenizer) -> tuple[dict, object]:
    """The run path of `trainer: funnel` (called by agent_trl/funnel_run.py): load the policy (LoRA if asked), run or
    resume the loop, save the model; returns the loop's result and the trained model."""
    from transformers import AutoModelForCausalLM
    from trl import get_peft_config

    if sources.environment is None:
        raise SystemExit("error: trainer 'funnel' needs an environment")
    dtype = (config.model_init_kwargs or {}).get("dtype", "float32")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype) if isinstance(dtype, str)
                                                 and dtype != "auto" else dtype)  # fmt: skip
    peft_config = get_peft_config(model_args)
    if peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, peft_config)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    loop = FunnelLoop(model, tokenizer, config, list(sources.train), sources.eval_rows, sources.environment.factory,
                      sources.environment.name)  # fmt: skip
    result = loop.run()
    model.save_pretrained(config.output_dir)
    tokenizer.save_pretrained(config.output_dir)
    return result, model
