"""The held-out evaluation a run reports before and after training: sampled and greedy, on the environment's eval
tasks (success, pass^k) or, single-turn, on the dataset's held-out prompts (reward). `python -m agent_trl.evaluate`
plays the same episodes with the same settings (`loop_settings`, `prompt_sampling`) after training."""

from __future__ import annotations

from functools import partial

from agent_trl.arguments import RunArguments
from agent_trl.sources import Sources
from trainers.agent_loop import LoopSettings, evaluate, evaluate_prompts


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
