"""Can this model be DRACO's judge? Each rubric stage's request, as DRACO sends it, to a served model, and whether
the answer parses.

    python bench/judge_probe.py --serve_model smollm2 --out bench/results/judge_probe_smollm2

The model is served by `transformers serve` on loopback (agent_trl/served.py), as `serve_model` does for a run. One
GuessTheNumber game is played (the expert's bisection after a first guess of 1, so the game is won in a few guesses)
and shown to the judge in DRACO's wording (rewards/rubrics.py, with the schema hint rewards/judge.py adds): the task
rubric (S1), the trajectory rubric (S2), the scoring of one criterion and the credit of one verdict, each `--repeats`
times at DRACO's API-judge temperature. Written: every answer's opening and whether it validates against the stage's
schema (`rewards.judge.parse_output`, which also takes JSON inside prose or a code fence). A stage that never parses
gives DRACO no reward: its no-signal guard then stops the run.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openai  # noqa: E402

from agent_trl.served import serve  # noqa: E402
from bench.record import RESULTS, write_result  # noqa: E402
from envs.adapters import adapter_class  # noqa: E402
from rewards.judge import parse_output, with_schema_hint  # noqa: E402
from rewards.rubrics import (  # noqa: E402
    Attributions,
    Criterion,
    RolloutCriteria,
    Scores,
    TaskCriteria,
    credit_messages,
    render_steps,
    render_task,
    rollout_rubric_messages,
    scoring_messages,
    task_rubric_messages,
)

SYSTEM = "Play the game. Reply with only your guess in square brackets, like [10]."
CRITERION = Criterion(
    title="Finds the secret number",
    description="The game ends with the secret number guessed.",
    evaluator_instruction="Pass if the last observation says the guess was correct; fail otherwise.",
    essential=True,
)


def played_game() -> tuple[str, list[dict]]:
    """The task text and the transcript of one GuessTheNumber game: a first guess of 1, then bisection."""
    game = adapter_class("textarena:GuessTheNumber-v0", {})
    env = game()
    task = game.make_tasks("eval", 1, seed=0)[0]
    first = env.reset(task)
    transcript, action, done = [], "[1]", False
    while not done and len(transcript) < 10:
        observation, reward, done, _ = env.step(action)
        transcript.append({"action": action, "observation": observation, "reward": reward})
        action = env.expert_action() if not done else action
    return render_task([{"role": "system", "content": SYSTEM}, {"role": "user", "content": first}]), transcript


def stages(task: str, transcript: list[dict]) -> dict[str, tuple[list[dict], type]]:
    steps = render_steps(transcript)
    return {
        "task rubric (S1)": (task_rubric_messages(task), TaskCriteria),
        "trajectory rubric (S2)": (rollout_rubric_messages(task, steps, [CRITERION]), RolloutCriteria),
        "scoring": (scoring_messages(task, steps, [CRITERION]), Scores),
        "credit": (
            credit_messages(task, steps, len(transcript), [CRITERION], [1], ["the last step"]),
            Attributions,
        ),
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve_model", default="smollm2", help="a model folder, or the packaged real model")
    parser.add_argument("--repeats", type=int, default=3, help="requests per stage")
    parser.add_argument("--temperature", type=float, default=0.1, help="DRACO's API-judge default (draco.md §4.2)")
    parser.add_argument("--max_tokens", type=int, default=192, help="as configs/smollm2_draco_guess_the_number.yaml")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "judge_probe")
    args = parser.parse_args(argv)
    task, transcript = played_game()
    measured: dict[str, list[dict]] = {}
    with serve(args.serve_model, threads=args.threads) as endpoint:
        client = openai.OpenAI(base_url=endpoint.base_url, api_key="EMPTY", timeout=600)
        for name, (messages, schema) in stages(task, transcript).items():
            measured[name] = []
            for i in range(args.repeats):
                answer = client.chat.completions.create(
                    model=endpoint.model,
                    messages=with_schema_hint(messages, schema),
                    temperature=args.temperature,
                    max_tokens=args.max_tokens,
                    seed=i,
                )
                text = answer.choices[0].message.content or ""
                try:
                    parse_output(text, schema)
                    error = None
                except ValueError as err:
                    error = str(err).splitlines()[0][:160]
                measured[name].append({"parsed": error is None, "error": error, "answer": text})
                print(f"{name} #{i}: {'parsed' if error is None else 'no parse'}", file=sys.stderr)
    lines = ["| stage | answers that parse | the first answer begins |", "|---|---:|---|"]
    for name, answers in measured.items():
        opening = " ".join(answers[0]["answer"].split())[:120].replace("|", "/")
        lines.append(f"| {name} | {sum(a['parsed'] for a in answers)} / {len(answers)} | {opening} |")
    text = "\n".join(lines)
    print(text)
    write_result(args.out, "judge_probe", vars(args) | {"out": str(args.out)}, measured, text)
    return measured


if __name__ == "__main__":
    main()
