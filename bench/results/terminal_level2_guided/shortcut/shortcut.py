"""How terminal level-2 policies get the code to its target, from `agent_trl.evaluate` transcripts.

A level-2 checklist ends with "delete K; write the code from K to T", K the key file read at the first step. Followed
in order, the last step needs the code from the first turn's observation. The end state is also reached by `mv K T`
while K still holds the code (the shortcut), and the terminal's `next:` line names that command once the policy has
left the expert's plan: off the plan, the line is the repair of the first failing check (`envs/terminal.py`,
`_expert` and `_repair`), and the repair of "T holds the code" while K still holds it is the rename.

Per `name=path` (transcripts.jsonl, plain or .gz) and mode, the script prints:
* shortcut: episodes with the command `mv K T`, and how many of them succeeded;
* hinted: episodes where a `next:` line named "rename K to T";
* without the shortcut: how many of the other episodes succeeded (the code written from the first turn's memory);
* the first turn whose command is not the one the previous `next:` line named (in the expert's forms; "write"
  and "append" lines are skipped, since their command is free text), and that command's first word.

    python shortcut.py grpo-s0=/tmp/grpo_first/s0/transcripts.jsonl aopsd-s0=/tmp/aopsd_first/s0/transcripts.jsonl
"""

import collections
import gzip
import json
import re
import sys

FORMS = [
    (r"read (\S+)", "cat {0}"),
    (r"create the directory (\S+)", "mkdir {0}"),
    (r"copy (\S+) to (\S+)", "cp {0} {1}"),
    (r"rename (\S+) to (\S+)", "mv {0} {1}"),
    (r"move (\S+) into (\S+)", "mv {0} {1}/"),
    (r"delete (\S+)", "rm {0}"),
    (r"submit", "submit"),
]


def rows(path):
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        return [json.loads(line) for line in f]


def named_command(observation: str) -> str | None:
    """The command the observation's `next:` line names, in the expert's form; None for free-text or no line."""
    if "next:" not in observation:
        return None
    line = observation.rsplit("next:", 1)[-1].split("\n")[0].strip()
    for pattern, form in FORMS:
        if m := re.fullmatch(pattern, line):
            return form.format(*m.groups())
    return None


def episode(e) -> tuple[bool, bool, int | None, str]:
    """(used the shortcut, was hinted it, first turn off the line or None, that turn's first word)."""
    key = re.search(r"read (\S+?);", e["first_observation"]).group(1)
    target = re.search(r"write the code from \S+ to (\S+?)(?:\n|$)", e["first_observation"]).group(1)
    actions = [t.get("action", "").strip() for t in e["transcript"]]
    shortcut = any(re.fullmatch(rf"mv\s+{re.escape(key)}\s+{re.escape(target)}", a) for a in actions)
    hinted = any(f"next: rename {key} to {target}" in (t.get("observation") or "") for t in e["transcript"])
    observation, off, word = e["first_observation"], None, ""
    for k, (turn, action) in enumerate(zip(e["transcript"], actions, strict=True)):
        want = named_command(observation)
        if want is not None and action != want:
            off, word = k, (action.split() or [""])[0]
            break
        observation = turn.get("observation") or ""
    return shortcut, hinted, off, word


if __name__ == "__main__":  # failures.py (terminal_level2_closed) imports FORMS and rows
    for arg in sys.argv[1:]:
        name, path = arg.split("=", 1)
        for mode in ("sampled", "greedy"):
            eps = [r for r in rows(path) if r["mode"] == mode]
            stats = [(episode(e), e["success"]) for e in eps]
            used = [ok for (s, *_), ok in stats if s]
            other = [ok for (s, *_), ok in stats if not s]
            offs = collections.Counter(x[2] for x, _ in stats if x[2] is not None)
            words = collections.Counter(x[3] for x, _ in stats if x[2] is not None)
            print(
                f"{name} {mode}: success {sum(ok for _, ok in stats)}/{len(eps)}; shortcut {len(used)}/{len(eps)} "
                f"(succeeded {sum(used)}); hinted {sum(x[1] for x, _ in stats)}; without the shortcut succeeded "
                f"{sum(other)}/{len(other)}; first turn off the line {dict(sorted(offs.items()))} "
                f"(never: {len(eps) - sum(offs.values())}), command {dict(words.most_common(3))}"
            )
