"""The Experience Funnel's run path (`trainer: funnel`, docs/methods/funnel.md): a loop of phases around consolidation
trainers instead of one `trainer.train()`, reported in the same summary.json as every run plus the loop's own."""

from __future__ import annotations

import json
import os
import time

from agent_trl.evaluation import held_out
from trainers.reporting import write_summary


def run_funnel_report(run, config, model_args, sources, tokenizer, summary, name, start) -> dict:
    """The Experience Funnel's loop (trainers/funnel_loop.py), then the same held-out report as every run, state-free,
    plus the loop's own: the test split under the final, residual and full states, gate decisions, rollouts spent."""
    from trainers.funnel_loop import run_funnel

    result, model = run_funnel(run, config, model_args, sources, model_args.model_name_or_path, tokenizer)
    summary["funnel"] = {k: v for k, v in result.items() if k != "log_history"}
    if not run.skip_eval:
        summary["after"] = held_out(model, tokenizer, sources, run, config)
        print(f"held-out success after the Funnel (state-free): {json.dumps(summary['after'])}")
    summary["wall_seconds"] = round(time.time() - start, 1)
    summary["rollouts_per_step"] = config.generation_batch_size
    summary["log_history"] = result["log_history"]
    write_summary(os.path.join(config.output_dir, "summary.json"), summary)
    return summary
