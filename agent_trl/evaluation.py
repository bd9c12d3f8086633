"""The held-out evaluation a run reports before and after training: sampled and greedy, on the environment's eval
tasks (success, pass^k) or, single-turn, on the dataset's held-out prompts (reward). `python -m agent_trl.evaluate`
plays the same episodes with the same settings (`loop_settings`, `prompt_sampling`) after training.

`held_out` picks what to evaluate from a run's sources; `evaluate` plays the agent loop on eval tasks (`play_tasks`
keeps the episodes, `evaluation_metrics` counts them) and `evaluate_prompts` samples and scores a dataset's held-out
prompts (`score_prompts`, `prompt_metrics`), both with the generation engine of training (`trainers/generation.py`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from tqdm.auto import tqdm

from agent_trl.arguments import RunArguments
from agent_trl.sources import Sources
from envs.base import Env
from trainers.agent_loop import LoopSettings, Rollout, play, with_system
from trainers.generation import hf_generate
from trainers.trl_api import cpu_fast_paths


def loop_settings(config) -> LoopSettings:
    """The episode budgets of the trainer config: tokens per turn, per episode, and turns."""
    return LoopSettings(config.max_turn_tokens, config.max_completion_length, config.max_turns)


def prompt_sampling(config) -> dict:
    """The sampling settings of the trainer config a single-turn dataset is evaluated with (top_k None: no top-k)."""
    return dict(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k or 0)


def held_out_logs(summary: dict) -> dict[str, float]:
    """The held-out numbers of a run's summary (`before`, `after`) as flat metrics for a tracker:
    `held_out/<when>/<sampled|greedy>/<name>`, numbers only (a mixed pool's `by_env` as `by_env/<env>`).

    >>> held_out_logs({"before": {"greedy": {"success": 0.5, "by_env": {"shop": 1.0}}}, "model": "tiny"})
    {'held_out/before/greedy/success': 0.5, 'held_out/before/greedy/by_env/shop': 1.0}
    """
    logs = {}
    for when in ("before", "after"):
        for mode, numbers in summary.get(when, {}).items():
            for name, value in numbers.items():
                if isinstance(value, dict):
                    logs.update({f"held_out/{when}/{mode}/{name}/{k}": float(v) for k, v in value.items()})
                else:
                    logs[f"held_out/{when}/{mode}/{name}"] = float(value)
    return logs


def held_out(model, tokenizer, sources: Sources, run: RunArguments, config) -> dict:
    """`{"sampled": ..., "greedy": ...}`: the held-out rows played with the config's sampling settings (eval_samples
    episodes per task, or completions per prompt of a dataset) and greedily; the dictionaries `evaluate` /
    `evaluate_prompts` return."""
    if sources.environment is None:
        kw = dict(
            max_new_tokens=config.max_completion_length,
            batch_size=run.eval_batch_size,
            reward_weights=config.reward_weights,
        )
        tasks = sources.eval_rows
        sampling = prompt_sampling(config)
        kw["success_threshold"] = run.success_threshold
        return {
            "sampled": evaluate_prompts(
                model, tokenizer, tasks, sources.reward_funcs, **sampling, samples=run.eval_samples, **kw
            ),
            "greedy": evaluate_prompts(model, tokenizer, tasks, sources.reward_funcs, greedy=True, **kw),
        }
    factory = partial(sources.environment.factory, {})
    kw = dict(settings=loop_settings(config), batch_size=run.eval_batch_size, system_prompt=run.system_prompt)
    tasks = sources.eval_rows
    return {
        "sampled": evaluate(
            model, tokenizer, factory, tasks, temperature=config.temperature, samples=run.eval_samples, **kw
        ),
        "greedy": evaluate(model, tokenizer, factory, tasks, greedy=True, **kw),
    }


@cpu_fast_paths()  # the trainer's CPU switches (docs/methods/grpo.md D12, D14), as in training
def play_tasks(
    model,
    tokenizer,
    env_cls: type[Env] | Callable[[], Env],
    tasks: list[dict],
    settings: LoopSettings | None = None,
    temperature: float = 1.0,
    greedy: bool = False,
    batch_size: int = 64,
    samples: int = 1,
    progress: bool = True,
    system_prompt: str | None = None,
) -> list[Rollout]:
    """`samples` episodes of each task, `batch_size` at a time, in eval mode (the model's mode is restored after).
    Task-major: episode s of task i is rollout i * samples + s. `system_prompt`: a system message before each first
    observation (`with_system`), as training's rows have it."""
    was_training = model.training
    model.eval()
    generate = hf_generate(model, tokenizer, temperature=temperature, do_sample=not greedy)
    jobs = [t for t in tasks for _ in range(samples)]
    rollouts: list[Rollout] = []
    bar = tqdm(total=len(jobs), desc="greedy eval" if greedy else "sampled eval", disable=not progress, leave=False)
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        prompts = None if system_prompt is None else [with_system([], system_prompt) for _ in chunk]
        rollouts += play(generate, tokenizer, [env_cls() for _ in chunk], chunk, prompts, settings=settings)
        bar.update(len(chunk))
    bar.close()
    model.train(was_training)
    return rollouts


def evaluation_metrics(rollouts: list[Rollout], tasks: list[dict], samples: int) -> dict[str, float]:
    """What `evaluate` reports of `play_tasks`' rollouts: success, reward, pass^samples (tasks solved in every one of
    their episodes), turns, and success per environment for a mixed pool."""
    successes = torch.tensor([r.success for r in rollouts], dtype=torch.float64).view(len(tasks), samples)
    rewards = torch.tensor([r.env_reward for r in rollouts], dtype=torch.float64)
    out = {
        "success": successes.mean().item(),
        "reward": rewards.mean().item(),
        f"pass^{samples}": successes.min(dim=1).values.mean().item(),
        "turns": sum(len(r.turn_rewards) for r in rollouts) / len(rollouts),
    }
    if samples > 1:  # tasks solved in at least one of their episodes
        out[f"pass@{samples}"] = successes.max(dim=1).values.mean().item()
    envs = [str(t.get("env")) for t in tasks] if all(isinstance(t, dict) and t.get("env") for t in tasks) else []
    if len(set(envs)) > 1:  # a mixed pool: success per environment too
        out["by_env"] = {
            name: successes[[i for i, e in enumerate(envs) if e == name]].mean().item() for name in sorted(set(envs))
        }
    return out


def evaluate(
    model,
    tokenizer,
    env_cls: type[Env] | Callable[[], Env],
    tasks: list[dict],
    settings: LoopSettings | None = None,
    temperature: float = 1.0,
    greedy: bool = False,
    batch_size: int = 64,
    samples: int = 1,
    progress: bool = True,
    system_prompt: str | None = None,
) -> dict[str, float]:
    """Held-out success and reward: `samples` episodes per task (pass^k counts tasks solved in all of them); the
    episodes themselves: `play_tasks`, the numbers: `evaluation_metrics`."""
    kw = dict(temperature=temperature, greedy=greedy, batch_size=batch_size, samples=samples, progress=progress)
    kw["system_prompt"] = system_prompt
    return evaluation_metrics(play_tasks(model, tokenizer, env_cls, tasks, settings, **kw), tasks, samples)


def prompt_ids_like_trl(tokenizer, prompts: list) -> list[list[int]]:
    """Prompt ids as TRL's GRPOTrainer makes them: the chat template with the generation prompt for conversational
    prompts (message lists), the plain tokenizer for text prompts."""
    if isinstance(prompts[0], list):
        out = tokenizer.apply_chat_template(prompts, add_generation_prompt=True, tokenize=True, return_dict=True)
        return [list(ids) for ids in out["input_ids"]]
    return [list(ids) for ids in tokenizer(text=prompts)["input_ids"]]


@cpu_fast_paths()  # the trainer's CPU switches (docs/methods/grpo.md D12, D14), as in training
def score_prompts(
    model,
    tokenizer,
    rows: list[dict],
    reward_funcs: Sequence[Callable],
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    batch_size: int = 64,
    samples: int = 1,
    progress: bool = True,
) -> tuple[list[str], torch.Tensor]:
    """`samples` completions of each row (prompts rendered as TRL renders them; row-major: completion s of row i is
    i * samples + s), scored by `reward_funcs` with TRL's call (`prompts`, `completions`, `completion_ids`, the other
    columns as lists). Returns (completion texts, scores (N * samples, F), NaN where a function returned None)."""
    was_training = model.training
    model.eval()
    generate = hf_generate(
        model, tokenizer, temperature=temperature, top_p=top_p, top_k=top_k, do_sample=not greedy, reuse_cache=False
    )
    jobs = [r for r in rows for _ in range(samples)]
    scores, all_texts = [], []
    bar = tqdm(total=len(jobs), desc="greedy eval" if greedy else "sampled eval", disable=not progress, leave=False)
    for start in range(0, len(jobs), batch_size):
        chunk = jobs[start : start + batch_size]
        prompts = [r["prompt"] for r in chunk]
        completion_ids = []
        for ids, _ in generate(prompt_ids_like_trl(tokenizer, prompts), max_new_tokens):
            completion_ids.append(ids[: ids.index(tokenizer.eos_token_id)] if tokenizer.eos_token_id in ids else ids)
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        all_texts += texts
        completions = [
            [{"role": "assistant", "content": t}] if isinstance(p, list) else t
            for p, t in zip(prompts, texts, strict=True)
        ]
        columns = {k: [r[k] for r in chunk] for k in chunk[0] if k not in ("prompt", "completion", "completion_ids")}
        noop = lambda *args, **kwargs: None  # noqa: E731  (TRL's log_extra / log_metric, not recorded here)
        per_func = [
            func(
                prompts=prompts,
                completions=completions,
                completion_ids=completion_ids,
                trainer_state=None,
                log_extra=noop,
                log_metric=noop,
                **columns,
            )
            for func in reward_funcs
        ]
        scores.append(torch.tensor([[float("nan") if v is None else float(v) for v in f] for f in per_func]).T)
        bar.update(len(chunk))
    bar.close()
    model.train(was_training)
    return all_texts, torch.cat(scores).to(torch.float64)  # (N * samples, F)


def prompt_outcomes(
    scores: torch.Tensor, weights: torch.Tensor, threshold: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per completion, from its scores (N, F) and the reward weights (F,): success (N,) and the weighted reward (N,),
    a None counting 0. Success: the weighted reward is at least `threshold`, or with `threshold` None every function
    returned a positive value (a None fails)."""
    reward = (scores.nan_to_num(0.0) * weights).sum(dim=1)  # (N,)
    success = (scores > 0).all(dim=1) if threshold is None else reward >= threshold
    return success, reward


def evaluate_prompts(
    model,
    tokenizer,
    rows: list[dict],
    reward_funcs: Sequence[Callable],
    reward_weights: Sequence[float] | None = None,
    max_new_tokens: int = 256,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    batch_size: int = 64,
    progress: bool = True,
    samples: int = 1,
    success_threshold: float | None = None,
) -> dict[str, float]:
    """Held-out score of a single-turn dataset: `samples` completions per row (`score_prompts`), averaged over all.

    Returns `reward` (the `reward_weights`-weighted sum, mean over completions; a function's None counts as 0),
    `rewards/<name>` (each function's mean over the completions it scored), and `success`: the fraction of
    completions that succeed (`prompt_outcomes`: by default every function returned a positive value, for a 0/1
    exact-match reward the accuracy; with `success_threshold` the weighted reward is at least it); with `samples` > 1
    also `pass@<samples>` and `pass^<samples>` (rows solved by at least one, and by all, of their completions)."""
    weights = torch.tensor(list(reward_weights) if reward_weights else [1.0] * len(reward_funcs), dtype=torch.float64)
    if len(weights) != len(reward_funcs):
        raise ValueError(f"{len(reward_funcs)} reward functions but {len(weights)} reward_weights")
    kw = dict(temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy, batch_size=batch_size)
    kw.update(samples=samples, progress=progress)
    _, scores = score_prompts(model, tokenizer, rows, reward_funcs, max_new_tokens, **kw)  # (N * samples, F)
    return prompt_metrics(scores, weights, reward_funcs, samples, success_threshold)


def prompt_metrics(
    scores: torch.Tensor,
    weights: torch.Tensor,
    reward_funcs: Sequence[Callable],
    samples: int = 1,
    success_threshold: float | None = None,
) -> dict[str, float]:
    """What `evaluate_prompts` reports of the scores (N, F) of N completions (row-major, `samples` per row): success
    and reward (`prompt_outcomes`, mean over completions), with `samples` > 1 pass@ and pass^ over each row's
    completions, and `rewards/<name>`, each function's mean over the completions it scored."""
    success, reward = prompt_outcomes(scores, weights, success_threshold)  # (N,), (N,)
    out = {"success": success.double().mean().item(), "reward": reward.mean().item()}
    if samples > 1:
        per_row = success.double().view(-1, samples)  # (rows, samples)
        out[f"pass@{samples}"] = per_row.max(dim=1).values.mean().item()
        out[f"pass^{samples}"] = per_row.min(dim=1).values.mean().item()
    for i, func in enumerate(reward_funcs):
        column = scores[:, i]
        name = getattr(func, "__name__", f"reward_{i}")
        out[f"rewards/{name}"] = column[~column.isnan()].mean().item() if (~column.isnan()).any() else float("nan")
    return out
