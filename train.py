"""Train an agent: python train.py --config configs/NAME.yaml [--field value ...]

CPU smoke run (tiny default agent, built offline, a few minutes on 2 cores):
    python train.py --config configs/quickstart.yaml
A real pretrained model on a CPU (SmolLM2-135M-Instruct, `smollm2`, installed by `make setup`; 15-30 minutes):
    python train.py --config configs/smollm2_guess_the_number.yaml
One GPU, a real model with LoRA:
    python train.py --config configs/quickstart.yaml --model_name_or_path Qwen/Qwen3-0.6B --use_peft \
        --use_cpu false --bf16 true --max_turn_tokens 64 --max_completion_length 512

Your own data, rewards and environment (fields of RunArguments in agent_trl/arguments.py; `--help` lists them all):
    python train.py --dataset_name data/arith.jsonl --reward_funcs exact_match_reward --model_name_or_path MODEL
    python train.py --config configs/quickstart.yaml --environment mypackage.envs:GuessEnv --dataset_name tasks.jsonl

Order: parse -> environment, dataset and rewards (checked) -> model (+ LoRA/QLoRA) -> evaluate -> train -> evaluate
-> report (summary.json and curves.png in output_dir). Each step's code is in agent_trl/, one module per concern.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from contextlib import ExitStack
from dataclasses import asdict

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed  # noqa: E402
from trl import ModelConfig, TrlParser, get_peft_config, get_quantization_config  # noqa: E402

from agent_trl.arguments import RunArguments  # noqa: E402
from agent_trl.config_file import check_config_file, join_negative_numbers, unknown_fields  # noqa: E402
from agent_trl.evaluation import held_out, held_out_logs  # noqa: E402
from agent_trl.funnel_run import run_funnel_report  # noqa: E402
from agent_trl.preflight import check_report_to, check_run, context_problem  # noqa: E402
from agent_trl.resume import StopOnSignal, close_process_group, resume_checkpoint  # noqa: E402
from agent_trl.run_info import adapter_settings, count_parameters, resolve_model, versions  # noqa: E402
from agent_trl.served import point_at, servable_roles, serve  # noqa: E402
from agent_trl.sources import load_sources  # noqa: E402
from envs.adapters import is_adapter_spec  # noqa: E402
from envs.sources import load_environment  # noqa: E402
from rewards.loading import RewardFunctionError  # noqa: E402
from trainers import TRAINERS  # noqa: E402
from trainers.agent_loop import EnvironmentFailure  # noqa: E402
from trainers.base import DiskFull, NoRewardSignal, disk_full_named  # noqa: E402
from trainers.reporting import run_curves, speed, write_summary  # noqa: E402


def parse(argv: list[str] | None = None):
    """The run fields, the chosen trainer's config and TRL's ModelConfig from `argv` (default: sys.argv), checked,
    and the trainer class; `--help` lists the fields of all three."""
    argv = join_negative_numbers(sys.argv[1:] if argv is None else argv)
    check_config_file(argv)
    wants_help = any(a in ("-h", "--help") for a in argv)
    probe_argv = [a for a in argv if a not in ("-h", "--help")]  # --help lists the chosen trainer's fields too
    try:
        probe_parser = TrlParser((RunArguments,), allow_abbrev=False)  # `--reward` is not `--reward_funcs`
        probe, _ = probe_parser.parse_args_and_config(probe_argv, return_remaining_strings=True)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    if probe.trainer not in TRAINERS:
        raise SystemExit(f"error: trainer {probe.trainer!r} is unknown; choose one of {sorted(TRAINERS)}")
    trainer_cls, config_cls = TRAINERS[probe.trainer]
    if not wants_help and (unknown := unknown_fields(argv, (RunArguments, config_cls, ModelConfig))):
        raise SystemExit("error: " + "; ".join(unknown))
    parser = TrlParser((RunArguments, config_cls, ModelConfig), allow_abbrev=False)  # --learning_rat is not a field
    if wants_help:
        parser.parse_args(["--help"])
    try:  # the configs check their fields when built; their ValueErrors name the field
        run, config, model_args = parser.parse_args_and_config(argv)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from e
    if run.environment is not None and run.environment.lower() != "none" and not is_adapter_spec(run.environment):
        load_environment(run.environment, {}, run.difficulty)  # resolves the name or path; builds nothing
    check_report_to(config)
    return run, config, model_args, trainer_cls


def main(argv: list[str] | None = None) -> dict:
    run, config, model_args, trainer_cls = parse(argv)
    with ExitStack() as stack:  # a served judge (serve_model) lives as long as the run, however the run ends
        if run.serve_model is not None:
            start_server(run, config, stack)
        return train(run, config, model_args, trainer_cls)


def start_server(run: RunArguments, config, stack: ExitStack) -> None:
    """`transformers serve` on `run.serve_model` until `stack` closes, the config's openai endpoints pointed at it."""
    if run.serve_threads < 1:
        raise SystemExit(f"error: serve_threads must be >= 1, got {run.serve_threads}")
    if not (roles := servable_roles(config)):
        raise SystemExit(
            f"error: serve_model is set, but trainer {run.trainer!r} has no judge, analyzer or editor with backend "
            "`openai` and base_url unset to point at it; set e.g. judge_backend: openai, or drop serve_model"
        )
    log = os.path.join(config.output_dir, "serve.log")
    print(f"serving {run.serve_model} for the {', '.join(roles)} with transformers serve (log: {log})")
    endpoint = stack.enter_context(serve(run.serve_model, threads=run.serve_threads, log_path=log))
    point_at(config, endpoint)
    print(f"served at {endpoint.base_url}")


def train(run: RunArguments, config, model_args, trainer_cls) -> dict:
    check_run(run, config, model_args)
    checkpoint = resume_checkpoint(config)
    start = time.time()
    try:  # validates environment, dataset and rewards before any model is loaded
        sources = load_sources(run, config)
    except ValueError as e:  # e.g. an environment refusing a difficulty
        raise SystemExit(f"error: {e}") from e
    print(f"training on {sources.described}")
    name = model_args.model_name_or_path
    if not name:
        raise SystemExit(
            "error: model_name_or_path is required: a model folder, a Hub id, or the tiny default (tiny:<env> for an "
            "environment, tiny for a dataset)"
        )
    model_args.model_name_or_path = resolve_model(name, run, sources)
    if problem := context_problem(config, model_args.model_name_or_path):
        raise SystemExit(f"error: {problem}")
    quantization = get_quantization_config(model_args)
    config.model_init_kwargs = {
        "dtype": model_args.dtype or "float32",
        **({"device_map": "cpu"} if quantization and config.use_cpu else {}),
    }
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, padding_side="left")
    summary = {"run": asdict(run), "model": name, "trainer": run.trainer, "data": sources.described}
    if sources.audit is not None:
        summary["audit_filter"] = sources.audit
    summary["adapter"], summary["versions"] = adapter_settings(model_args), versions()
    stored = stored_before(config.output_dir, summary) if checkpoint is not None and not run.skip_eval else None
    if stored is not None:  # a resumed run: the interrupted run measured the same start on the same tasks
        summary["before"] = stored
        print(f"held-out success before RL (measured by the interrupted run, summary.json): {json.dumps(stored)}")
    elif not run.skip_eval:
        model = AutoModelForCausalLM.from_pretrained(model_args.model_name_or_path, dtype=torch.float32)
        set_seed(config.seed)  # reproducible sampled held-out episodes; the trainer seeds again before RL
        summary["before"] = held_out(model, tokenizer, sources, run, config)
        print(f"held-out success before RL: {json.dumps(summary['before'])}")
        del model
    env = sources.environment
    if run.trainer == "funnel":  # a loop of phases around consolidation trainers (docs/methods/funnel.md)
        return run_funnel_report(run, config, model_args, sources, tokenizer, summary, name, start)
    trainer = trainer_cls(
        model=model_args.model_name_or_path,
        reward_funcs=sources.reward_funcs,
        args=config,
        train_dataset=sources.train,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
        quantization_config=quantization,
        **({"env_factory": env.factory} if env is not None else {}),
    )
    summary["parameters"] = p = count_parameters(trainer.model)
    if quantization is not None:
        bits = "4-bit " + model_args.bnb_4bit_quant_type if model_args.load_in_4bit else "8-bit"
        print(f"quantized to {bits} with bitsandbytes: {p['quantized']:,} of {p['total']:,} parameters")
    if model_args.use_peft or quantization is not None:
        print(f"trainable parameters: {p['trainable']:,} of {p['total']:,} ({100 * p['trainable'] / p['total']:.2f}%)")
    if checkpoint is not None:
        print(f"resuming from {checkpoint}")
    updates_per_generation = config.num_iterations * config.steps_per_generation // config.gradient_accumulation_steps
    with StopOnSignal(max(1, updates_per_generation)) as stop:
        trainer.add_callback(stop)
        try:
            trainer.train(resume_from_checkpoint=checkpoint)
        except NoRewardSignal as err:  # the trainer saved a checkpoint; keep the summary so far, then stop loudly
            raise stopped(trainer, config, summary, "no reward signal", str(err)) from err
        except (RewardFunctionError, EnvironmentFailure) as err:  # a user's reward or environment broke: keep what
            saved = "nothing was trained yet, so no checkpoint was saved"  # was trained, and name it
            if (step := trainer.state.global_step) > 0:
                trainer.save_checkpoint(trainer.model, trial=None)
                saved = f"saved checkpoint-{step} in {config.output_dir}; fix it, then --resume_from_checkpoint true"
            reason = "reward function error" if isinstance(err, RewardFunctionError) else "environment error"
            raise stopped(trainer, config, summary, reason, f"{err} ({saved})") from err
        except DiskFull as err:  # a checkpoint write ran out of space: no summary can be written either
            raise SystemExit(f"error: {err}") from err
        except KeyboardInterrupt as err:  # a second signal (or Ctrl-C outside the handler): stop now, say where
            name = stop.requested or "SIGINT"
            step = trainer.state.global_step
            summary["interrupted"] = {"signal": name, "step": step, "exit_status": exit_status(name), "at_once": True}
            summary["log_history"] = trainer.state.log_history
            if trainer.accelerator.is_main_process:
                write_summary(os.path.join(config.output_dir, "summary.json"), summary)
            print(
                f"stopped at once by a second signal at step {step}: the latest complete checkpoint is the one to "
                "resume from (--resume_from_checkpoint true skips a checkpoint left half-written)"
            )
            raise SystemExit(exit_status(name)) from err
    try:
        with disk_full_named(config.output_dir):
            trainer.save_model(config.output_dir)
    except DiskFull as err:
        raise SystemExit(f"error: {err}") from err
    if stop.requested is not None:
        status = exit_status(stop.requested)
        summary["interrupted"] = {"signal": stop.requested, "step": trainer.state.global_step, "exit_status": status}
        summary["checkpoint"] = os.path.join(config.output_dir, f"checkpoint-{trainer.state.global_step}")
        print(
            f"stopped by {stop.requested} at step {trainer.state.global_step}; resume with --resume_from_checkpoint "
            f"{summary['checkpoint']}"
        )
    if not run.skip_eval and stop.requested is None:
        model = trainer.accelerator.unwrap_model(trainer.model)
        summary["after"] = held_out(model, tokenizer, sources, run, config)
        print(f"held-out success after RL: {json.dumps(summary['after'])}")
    if config.report_to and (logs := held_out_logs(summary)):  # the trackers get them at the last step, shown as
        logs = {f"eval_{k}": v for k, v in logs.items()}  # eval/held_out/... (transformers' rewrite_logs)
        trainer.callback_handler.on_log(config, trainer.state, trainer.control, logs)
    summary["wall_seconds"] = round(time.time() - start, 1)
    summary["speed"] = pace = speed(trainer.state.log_history)
    per_step = pace["train_seconds_per_step"] or pace["seconds_per_step"]
    print(f"time per step: {per_step} s; peak memory (resident): {pace['peak_memory_gib']} GiB")
    # new rollouts per optimizer step: one generation batch feeds num_iterations x (steps_per_generation / GA) steps
    summary["rollouts_per_step"] = config.generation_batch_size / max(1, updates_per_generation)  # global batch
    summary["log_history"] = trainer.state.log_history
    if trainer.accelerator.is_main_process:
        write_summary(os.path.join(config.output_dir, "summary.json"), summary)
        run_curves(summary, config.output_dir)
    return summary


def stored_before(output_dir: str, summary: dict) -> dict | None:
    """The held-out evaluation before RL that an interrupted run of the same settings (run fields, model, data) wrote
    in output_dir's summary.json; None when there is none or the settings differ (it is then measured again)."""
    try:
        with open(os.path.join(output_dir, "summary.json")) as f:
            previous = json.load(f)
    except (OSError, ValueError):
        return None
    same = all(
        previous.get(key) == json.loads(json.dumps(summary[key], default=str)) for key in ("run", "model", "data")
    )
    return previous.get("before") if same else None


def stopped(trainer, config, summary: dict, reason: str, message: str) -> SystemExit:
    """Write summary.json with the logs so far and why the run stopped; the SystemExit to raise with the message."""
    summary["stopped"] = {"reason": reason, "step": trainer.state.global_step, "error": message}
    summary["log_history"] = trainer.state.log_history
    if trainer.accelerator.is_main_process:
        write_summary(os.path.join(config.output_dir, "summary.json"), summary)
    return SystemExit(f"error: {message}")


def exit_status(signal_name: str) -> int:
    """The shell's status for a run stopped by a signal: 128 + its number (SIGINT 130, SIGTERM 143)."""
    return 128 + int(signal.Signals[signal_name])


def cli() -> None:
    """The `agent-trl-train` command of the installed package: the same as `python train.py`. A run stopped by a
    signal (with its checkpoint and summary.json written) exits with 128 + the signal's number, as a shell reports a
    process the signal ended, so that a scheduler can tell it from a finished run (docs/running.md)."""
    summary = main()
    close_process_group()
    if interrupted := summary.get("interrupted"):
        sys.exit(interrupted["exit_status"])


if __name__ == "__main__":
    cli()
