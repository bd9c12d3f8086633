"""How well the self-distillation teacher does: the tiny default built to read privileged text, on held-out tasks,
with and without the plan in its first user message.

    python bench/privileged_teacher.py --env shop      # writes bench/results/privileged_teacher_shop/
    python bench/privileged_teacher.py --env search

β-OPSD's teacher is the initial policy reading `Env.privileged(task)` after the task (docs/methods/beta-opsd.md D8).
Pure distillation (λ_d = 1) moves the student towards that teacher, so the teacher's own success, played with the
plan in its context at the training temperature, is about the most pure distillation can reach; the plain row is the
student's start. Same tiny build as `configs/beta_opsd_<env>.yaml` (`tiny_privileged_frac`), same budgets, 200
held-out tasks, one sampled episode per task at temperature 1.0 (seed 0) and one greedy.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository's packages

from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed  # noqa: E402

from agent_trl.evaluation import evaluate
from bench.record import RESULTS, write_result  # noqa: E402
from envs import ENVIRONMENTS  # noqa: E402
from envs.tiny import tiny_model  # noqa: E402
from trainers.agent_loop import LoopSettings  # noqa: E402


def with_plan(cls: type):
    """`cls` whose first observation also holds the task's privileged text, after a blank line (teacher-pass.md D7's
    `first_user_after_task`, as the teacher sees it)."""

    class WithPlan(cls):
        def reset(self, task: dict) -> str:
            return f"{super().reset(task)}\n\n{cls(difficulty=self.difficulty).privileged(task)}"

    return WithPlan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--env", default="shop", choices=sorted(ENVIRONMENTS))
    parser.add_argument("--privileged_frac", type=float, default=0.5, help="tiny_privileged_frac of the build")
    parser.add_argument("--tasks", type=int, default=200, help="held-out tasks")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    cls = ENVIRONMENTS[args.env]
    folder = tiny_model(f"tiny:{args.env}", privileged_frac=args.privileged_frac)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    tasks = cls.make_tasks("eval", args.tasks, seed=0)
    settings = LoopSettings(max_turn_tokens=24, max_completion_length=256, max_turns=None)  # the recipes' budgets
    measured = {}
    for name, env in (("plain prompt (the student)", cls), ("plan after the task (the teacher)", with_plan(cls))):
        set_seed(0)
        sampled = evaluate(model, tokenizer, env, tasks, settings=settings, temperature=1.0, batch_size=100)
        greedy = evaluate(model, tokenizer, env, tasks, settings=settings, greedy=True, batch_size=100)
        measured[name] = {"sampled": sampled, "greedy": greedy}
        print(name, sampled["success"], greedy["success"], flush=True)
    table = "| prompt | sampled success | greedy success |\n|---|---|---|\n" + "".join(
        f"| {name} | {m['sampled']['success']:.3f} | {m['greedy']['success']:.3f} |\n" for name, m in measured.items()
    )
    out = args.out or RESULTS / f"privileged_teacher_{args.env}"
    out.mkdir(parents=True, exist_ok=True)
    settings = vars(args) | {"out": str(out), "model": f"tiny:{args.env}"}
    write_result(out, "privileged_teacher", settings, measured, table)


if __name__ == "__main__":
    main()
