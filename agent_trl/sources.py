"""What a run trains and evaluates on: the environment, the training rows and held-out tasks, the reward functions, all
resolved and checked (`load_sources`) before any model is loaded; `audit_filter` keeps the tasks the task audit
accepted."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from datasets import Dataset

from agent_trl.arguments import RunArguments
from envs.base import row_task
from envs.sources import EnvironmentSource, check_environment, load_environment, load_splits
from rewards.loading import check_reward_funcs, load_reward_funcs
from trainers.agent_loop import to_trl, with_system

# What the agent loop adds to each row the reward functions see, with an environment: the extra fields of its TRL
# `rollout_func` return (`to_trl`), less the ids and log-probs TRL keeps and `env_mask` (TRL pops it: the tool mask)
LOOP_FIELDS = tuple(k for k in to_trl([]) if k not in ("prompt_ids", "completion_ids", "logprobs", "env_mask"))


@dataclass
class Sources:
    """What a run trains and evaluates on: an environment (None: single-turn prompts), its rows, reward functions."""

    environment: EnvironmentSource | None
    train: Dataset
    eval_rows: list[dict]
    reward_funcs: list | None
    described: str
    audit: dict | None = None  # what `audit_filter` kept and dropped
    environment_kwargs: dict | None = None  # as parsed from the config


def empty_prompts(prompts) -> list[int]:
    """Indices of prompts with no text: an empty or blank string, or a chat whose messages are all blank.

    >>> empty_prompts(["a", " ", [{"role": "user", "content": ""}], [{"role": "user", "content": "b"}], None])
    [1, 2, 4]
    """

    def text(prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list):
            return "".join(str(m.get("content") or "") for m in prompt if isinstance(m, dict))
        return ""

    return [i for i, prompt in enumerate(prompts) if not text(prompt).strip()]


def audit_filter(tasks: list[dict], folder: str, keep_unaudited: bool = False) -> tuple[list[tuple[int, dict]], dict]:
    """The training tasks the task audit accepted (t1.md §4.6): matched by `task_id` with the records of
    `python -m rewards.audit --out FOLDER`; an accepted record's task replaces the row's (a repair changes only the
    instruction). Returns ([(index in `tasks`, task to train on)], counts); a folder without audit records, or a
    filter that keeps nothing, stops the run."""
    from rewards.audit import read_records

    path = Path(folder)
    if not (path / "accepted.jsonl").is_file() and not (path / "rejected.jsonl").is_file():
        raise SystemExit(f"error: audit_filter {folder!r} holds no accepted.jsonl or rejected.jsonl (the --out folder "
                         "of python -m rewards.audit)")  # fmt: skip
    accepted = {r["task_id"]: r for r in read_records(path / "accepted.jsonl")}
    rejected = {r["task_id"] for r in read_records(path / "rejected.jsonl")}
    kept, counts = [], {"folder": str(folder), "tasks": len(tasks), "kept": 0, "repaired": 0, "dropped_rejected": 0,
                        "dropped_unaudited": 0, "kept_unaudited": 0}  # fmt: skip
    for i, task in enumerate(tasks):
        ident = str(task.get("task_id")) if task.get("task_id") is not None else None
        if ident in accepted:
            record = accepted[ident]
            counts["repaired"] += bool(record.get("repaired"))
            kept.append((i, dict(record.get("task") or task)))
        elif ident in rejected:
            counts["dropped_rejected"] += 1
        elif keep_unaudited:
            counts["kept_unaudited"] += 1
            kept.append((i, task))
        else:
            counts["dropped_unaudited"] += 1
    counts["kept"] = len(kept)
    if not kept:
        raise SystemExit(f"error: audit_filter {folder!r} leaves no training task ({counts['dropped_rejected']} "
                         f"rejected, {counts['dropped_unaudited']} never audited); check that the audit ran on these "
                         "tasks (task_id must match) or set audit_keep_unaudited")  # fmt: skip
    print(f"audit filter: {counts['kept']} of {counts['tasks']} training tasks kept ({counts['dropped_rejected']} "
          f"rejected, {counts['dropped_unaudited']} never audited, {counts['repaired']} repaired)")  # fmt: skip
    return kept, counts


def env_rows(source: EnvironmentSource, tasks: list[dict]) -> Dataset:
    """Dataset rows of `tasks`: the first observation as the prompt, the task as JSON (read back by `row_task`)."""
    return Dataset.from_list(
        [
            {
                "prompt": source.factory(task).first_observation(task),
                "task": json.dumps(task),
                "task_id": task.get("task_id", i),
            }
            for i, task in enumerate(tasks)
        ]
    )


def load_sources(run: RunArguments, config) -> Sources:
    """Resolve environment, dataset and rewards; every mistake stops here, before a model is loaded. The reward
    functions are checked against the columns of the training rows (plus `LOOP_FIELDS` with an environment) and,
    single-turn, of the held-out rows they also score. `system_prompt` is put into every training prompt and every
    held-out prompt of a dataset (an environment's held-out episodes get it from the evaluation: `held_out`)."""
    sources = _resolve_sources(run, config)
    if run.system_prompt is not None:
        system = run.system_prompt
        sources.train = sources.train.map(lambda row: {"prompt": with_system(row["prompt"], system)})
        if sources.environment is None:
            sources.eval_rows = [{**row, "prompt": with_system(row["prompt"], system)} for row in sources.eval_rows]
    if sources.reward_funcs is not None:
        fields = LOOP_FIELDS if sources.environment is not None else ()
        check_reward_funcs(run.reward_funcs, sources.reward_funcs, sources.train.column_names, fields)
        held_out = list(sources.eval_rows[0]) if sources.environment is None and sources.eval_rows else []
        if held_out and set(held_out) != set(sources.train.column_names):
            check_reward_funcs(run.reward_funcs, sources.reward_funcs, held_out, where="the held-out split")
    return sources


def _resolve_sources(run: RunArguments, config) -> Sources:
    if isinstance(run.environment, str) and run.environment.lower() == "none":
        run.environment = None  # single-turn training on the dataset's prompts
    elif run.environment is None and run.dataset_name is None:
        run.environment = "shop"
    kwargs = run.environment_kwargs
    if isinstance(kwargs, str):
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError as e:
            raise SystemExit(f"error: environment_kwargs {kwargs!r} is not JSON ({e})") from e
    if kwargs is not None and not isinstance(kwargs, dict):
        raise SystemExit(f"error: environment_kwargs must be a mapping of keyword arguments, got {kwargs!r}")
    source = load_environment(run.environment, kwargs, run.difficulty) if run.environment else None
    reward_funcs = load_reward_funcs(run.reward_funcs, config.max_completion_length) if run.reward_funcs else None
    if source is None and reward_funcs is None:
        raise SystemExit(
            f"error: dataset_name {run.dataset_name!r} without an environment trains single-turn GRPO and needs "
            "reward_funcs (e.g. --reward_funcs exact_match_reward or mypackage.rewards.my_reward)"
        )
    if source is None and run.audit_filter:
        raise SystemExit("error: audit_filter filters an environment's tasks; a single-turn dataset has none")
    if source is None and run.trainer != "grpo":
        raise SystemExit(
            f"error: trainer {run.trainer!r} needs an environment; a single-turn dataset trains with grpo"
        )
    if config.reward_weights is not None and len(config.reward_weights) != len(reward_funcs or [None]):
        raise SystemExit(
            f"error: reward_weights has {len(config.reward_weights)} entries for {len(reward_funcs or [None])} "
            "reward functions"
        )
    if run.dataset_name is None:
        if source.make_tasks is None:
            raise SystemExit(
                f"error: environment {run.environment!r} has no task generator (make_tasks); give its tasks with "
                "dataset_name (one task per row: a `task` column, or the row itself)"
            )
        n_train = 2000 if run.num_train_tasks is None else run.num_train_tasks
        train_tasks = source.make_tasks("train", n_train, seed=run.task_seed, difficulty=run.difficulty)
        eval_tasks = source.make_tasks("eval", run.num_eval_tasks, seed=run.task_seed, difficulty=run.difficulty)
        audit = None
        if run.audit_filter:
            kept, audit = audit_filter(train_tasks, run.audit_filter, run.audit_keep_unaudited)
            train_tasks = [task for _, task in kept]
        check_environment(source, train_tasks[0])
        rows = env_rows(source, train_tasks)
        return Sources(source, rows, eval_tasks, reward_funcs, f"{source.name} tasks", audit, kwargs)
    train, test, where = load_splits(
        run.dataset_name,
        run.dataset_config,
        run.dataset_train_split,
        run.dataset_test_split,
        run.num_eval_tasks,
        run.task_seed,
    )
    if run.num_train_tasks is not None:
        train = train.select(range(min(run.num_train_tasks, len(train))))
    test = test.select(range(min(run.num_eval_tasks, len(test))))
    described = f"{run.dataset_name}: {len(train)} training rows, {len(test)} held-out rows ({where})"
    if source is None:
        missing = [name for name, split in [("train", train), ("test", test)] if "prompt" not in split.column_names]
        if missing:
            raise SystemExit(
                f"error: dataset_name {run.dataset_name!r} has no `prompt` column ({', '.join(missing)} split has "
                f"{train.column_names if 'train' in missing else test.column_names}); rename the column that holds "
                "the prompt, as TRL expects"
            )
        for name, split in (("train", train), ("test", test)):
            if empty := empty_prompts(split["prompt"]):
                shown = ", ".join(str(i) for i in empty[:5]) + (", ..." if len(empty) > 5 else "")
                raise SystemExit(
                    f"error: dataset_name {run.dataset_name!r}: {len(empty)} of {len(split)} rows of the {name} split "
                    f"have an empty prompt (rows {shown}); a model has nothing to answer there. Drop those rows or "
                    "fill their prompt"
                )
        return Sources(None, train, list(test), reward_funcs, described)
    train_tasks = [row_task(row) for row in train]
    audit = None
    if run.audit_filter:  # the kept rows, each with its task as the audit left it (repaired or not)
        kept, audit = audit_filter(train_tasks, run.audit_filter, run.audit_keep_unaudited)
        rows = []
        for i, task in kept:
            row = dict(train[i])
            if "task" in row:
                row["task"] = json.dumps(task) if isinstance(row["task"], str) else task
            else:
                row.update(task)
            rows.append(row)
        train, train_tasks = Dataset.from_list(rows), [task for _, task in kept]
        described += f"; audit filter kept {audit['kept']} of {audit['tasks']}"
    check_environment(source, train_tasks[0])
    if "prompt" not in train.column_names:  # TRL needs one; the agent loop replaces it with reset's observation
        train = train.add_column("prompt", [source.factory(t).first_observation(t) for t in train_tasks])
    return Sources(source, train, [row_task(row) for row in test], reward_funcs, described, audit, kwargs)
