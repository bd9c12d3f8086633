"""Play one episode of an environment against a served model, through its OpenAI-compatible API.

    python -m agent_trl.play --base_url http://127.0.0.1:8000/v1 --environment shop [--model NAME] [--difficulty 0]
        [--task_index 0] [--split eval] [--max_turns N] [--max_turn_tokens 32] [--temperature 0]
        [--system_prompt TEXT] [--out episode.json]

The environment is any the trainer accepts (a built-in name, an ecosystem `<source>:<name>`, or `package.module:Class`
with `--environment_kwargs`), resolved by `envs.sources.load_environment` as train.py resolves it; the task is the
`--task_index`-th of its `make_tasks(split, ...)` (`--split eval`, `--task_seed 0` and `--difficulty 0` give the
run's held-out tasks, in their order), or `--task JSON` for an environment without a task generator.

The chat is the one the agent saw in training (trainers/agent_loop.py `play`): the run's `--system_prompt` if it had
one (else none of our own: the server's chat template adds its default one, if any, as the tokenizer did in
training); the first user message is
`env.reset(task)` (a reset that returns chat messages gives the whole prompt); each reply's text is the action
`env.step` receives; each observation comes back as the next message in the environment's `observation_role`
(`tool` for TRL-style tool classes, whose `tools` schemas go with every request). Steps run through the agent loop's
`step_all`: an exception in the environment becomes an error observation, a step past `--env_timeout` ends the
episode. The episode ends when the environment says done, or after `max_turns` turns (the environment's own unless
given): a cut, which counts as a failure, as in training.

What differs from training: the server renders the conversation as text and tokenises it anew each turn, where the
agent loop appends token ids (for a template that rewrites past turns, e.g. one that drops past reasoning, the
contexts differ); each turn is capped at `--max_turn_tokens` (the trainer's `max_turn_tokens`, default 32), but the
episode's `max_completion_length` is not counted (no tokenizer here). A reply whose tool calls the server parsed out
(`message.tool_calls`) is turned back into `<tool_call>{...}</tool_call>` text, the form `envs.base.ToolEnv` reads.

Prints the transcript turn by turn and the outcome (success, reward = the sum of the turn rewards, turns); `--out`
writes it all as JSON: the task, the chat messages as sent, per turn the action, observation, reward, whether the
environment rejected it and whether the reply was cut at the token cap.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from pathlib import Path

import openai

from envs.sources import load_environment
from rewards.judge import check_endpoint
from trainers.agent_loop import step_all, with_system


def fail(message: str) -> SystemExit:
    return SystemExit(f"error: {message}")


def action_text(message) -> str:
    """The assistant turn as text: its content plus any tool calls the server parsed out of it, written back as the
    `<tool_call>` blocks the model emitted."""
    text = message.content or ""
    for call in message.tool_calls or []:
        try:
            arguments = json.loads(call.function.arguments or "{}")
        except json.JSONDecodeError:
            arguments = call.function.arguments
        text += "<tool_call>\n" + json.dumps({"name": call.function.name, "arguments": arguments}) + "\n</tool_call>"
    return text


def choose_task(source, split: str, index: int, seed: int, difficulty: int, task: str | dict | None) -> dict:
    if task is not None:
        if isinstance(task, dict):
            return task
        try:
            return json.loads(task)
        except json.JSONDecodeError as e:
            raise fail(f"--task is not JSON ({e})") from e
    if source.make_tasks is None:
        raise fail(f"environment {source.name!r} has no task generator (make_tasks); give one task with --task JSON")
    if index < 0:
        raise fail(f"--task_index must be >= 0, got {index}")
    return source.make_tasks(split, index + 1, seed=seed, difficulty=difficulty)[index]


def play_episode(
    base_url: str,
    environment: str,
    model: str | None = None,
    environment_kwargs: dict | None = None,
    difficulty: int = 0,
    split: str = "eval",
    task_index: int = 0,
    task_seed: int = 0,
    task: str | dict | None = None,
    max_turns: int | None = None,
    max_turn_tokens: int = 32,
    temperature: float = 0.0,
    api_key_env: str = "OPENAI_API_KEY",
    timeout: float = 60.0,
    env_timeout: float = 30.0,
    echo: bool = True,
    system_prompt: str | None = None,
) -> dict:
    """Play one episode (see the module docstring); returns the record `--out` writes."""
    say = print if echo else (lambda *a, **k: None)
    source = load_environment(environment, environment_kwargs, difficulty)
    generated = task is None
    task = choose_task(source, split, task_index, task_seed, difficulty, task)
    if problem := check_endpoint(base_url, api_key_env, timeout=min(timeout, 10.0)):
        raise fail(
            f"--base_url: {problem}. Start a server first, e.g. `transformers serve MODEL_DIR --port 8000` or "
            "`vllm serve MODEL_DIR`, and give its URL ending in /v1"
        )
    client = openai.OpenAI(
        base_url=base_url, api_key=os.environ.get(api_key_env) or "EMPTY", timeout=timeout, max_retries=1
    )
    try:
        if model is None:  # the server's first (often only) model
            listed = [m.id for m in client.models.list().data]
            if not listed:
                raise fail(f"the server at {base_url} lists no model; give --model")
            model = listed[0]
        env = source.factory(task)
        first = env.reset(task)
        messages = copy.deepcopy(first) if isinstance(first, list) else with_system(first, system_prompt)
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        turns = max_turns if max_turns is not None else env.max_turns
        say(f"{source.name} task {task.get('task_id', task_index)} (difficulty {difficulty}), model {model!r}")
        for m in messages:
            say(f"[{m['role']}] {m['content']}")
        transcript, done, info = [], False, {}
        for k in range(turns):
            try:
                reply = client.chat.completions.create(
                    model=model,
                    messages=messages,
                    max_tokens=max_turn_tokens,
                    temperature=temperature,
                    **({"tools": env.tools} if env.tools else {}),
                )
            except openai.APIConnectionError as e:
                raise fail(f"turn {k + 1}: the server at {base_url} stopped answering ({e.__cause__ or e})") from e
            except openai.APIStatusError as e:
                raise fail(f"turn {k + 1}: the server answered HTTP {e.status_code}: {e.message}") from e
            choice = reply.choices[0]
            action = action_text(choice.message)
            ((observation, reward, done, info),) = step_all([env], [action], env_timeout)
            messages.append({"role": "assistant", "content": action})
            transcript.append(
                {
                    "turn": k + 1,
                    "action": action,
                    "observation": observation,
                    "reward": float(reward),
                    "invalid": bool(info.get("invalid", False)),
                    "cut": choice.finish_reason == "length",
                }
            )
            say(f"--- turn {k + 1}")
            say(f"[assistant] {action}" + ("   (cut at max_turn_tokens)" if transcript[-1]["cut"] else ""))
            say(f"[{env.observation_role}] {observation}   (reward {float(reward):g})")
            if done:
                break
            messages.append({"role": env.observation_role, "content": observation})
    finally:
        client.close()
    record = {
        "environment": source.name,
        "difficulty": difficulty,
        "split": split if generated else None,
        "task_index": task_index if generated else None,
        "task": task,
        "model": model,
        "base_url": base_url,
        "temperature": temperature,
        "messages": messages,
        "transcript": transcript,
        "success": bool(info.get("success", False)),
        "reward": sum(t["reward"] for t in transcript),
        "turns": len(transcript),
        "truncated": not done,
        "final_info": info,
    }
    ended = "the environment ended it" if done else f"cut after {turns} turns (max_turns)"
    say(f"success: {record['success']}  reward: {record['reward']:g}  turns: {record['turns']}  ({ended})")
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m agent_trl.play", description=__doc__.split("\n")[0])
    parser.add_argument("--base_url", required=True, help="The server's OpenAI-compatible URL, ending in /v1.")
    parser.add_argument("--model", default=None, help="Model name to request (default: the server's first model).")
    parser.add_argument("--environment", required=True, help="As train.py's `environment` field.")
    parser.add_argument("--environment_kwargs", default=None, help="Keyword arguments of the environment (JSON).")
    parser.add_argument("--difficulty", type=int, default=0)
    parser.add_argument("--split", default="eval", choices=("eval", "train"), help="Task split (eval: held out).")
    parser.add_argument("--task_index", type=int, default=0, help="Which task of the split (0: the first).")
    parser.add_argument("--task_seed", type=int, default=0, help="Seed of the task generator (train.py's task_seed).")
    parser.add_argument("--task", default=None, help="One task as JSON, instead of the generator's.")
    parser.add_argument("--max_turns", type=int, default=None, help="Most turns (default: the environment's own).")
    parser.add_argument("--max_turn_tokens", type=int, default=32, help="Most new tokens per turn.")
    parser.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (0: greedy).")
    parser.add_argument("--system_prompt", default=None, help="The run's system_prompt, sent as a system message.")
    parser.add_argument("--api_key_env", default="OPENAI_API_KEY", help="Variable holding the server's key, if any.")
    parser.add_argument("--timeout", type=float, default=60.0, help="Seconds to wait for one reply.")
    parser.add_argument("--env_timeout", type=float, default=30.0, help="Seconds one environment step may take.")
    parser.add_argument("--out", default=None, help="Write the episode as JSON to this file.")
    args = parser.parse_args(argv)
    kwargs = None
    if args.environment_kwargs:
        try:
            kwargs = json.loads(args.environment_kwargs)
        except json.JSONDecodeError as e:
            raise fail(f"--environment_kwargs is not JSON ({e})") from e
    fields = {k: v for k, v in vars(args).items() if k not in ("out", "environment_kwargs")}
    record = play_episode(environment_kwargs=kwargs, **fields)
    if args.out:
        Path(args.out).write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
