"""Where terminal level-2 episodes fail, from `agent_trl.evaluate` transcripts (the closed level: the key file's line
is `code: <code>`, the last step "write the code from K to T" needs the code typed).

Per `name=path` (transcripts.jsonl, plain or .gz) and mode, over the failed episodes:
* slip: the first command that is not the one the previous `next:` line named (each step in the expert's form; the
  last step's form is `echo <code> > T`, with the code the first `cat K` showed), before the last step;
* wrong code: the policy kept to the named commands up to the last step, then wrote something other than the code;
* other: neither (it kept to the line and stopped early, say);
and, of the failures, how many were cut (turn cap or token budget, `truncated`) and how many repeat one command 5 or
more times in a row. A slip can be repaired (the `next:` line then names the repair): the successes with one are
counted too. `mkdir -p D` counts as `mkdir D`.

    python failures.py mpo-s0=transcripts_mpo_s0.jsonl.gz grpo-s0=transcripts_grpo_s0.jsonl.gz
"""

import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "terminal_level2_guided" / "shortcut"))
from shortcut import FORMS as NAMED_FORMS  # noqa: E402  the `next:` lines' steps in the expert's forms
from shortcut import rows  # noqa: E402

#: shortcut.py skips the free-text steps; here "write" and "append" are checked too
FORMS = [*NAMED_FORMS, (r"write (\S+) to (\S+)", "echo {0} > {1}"), (r"append (\S+) to (\S+)", "echo {0} >> {1}")]


def named(observation: str, code: str | None) -> tuple[str, bool] | None:
    """The command the observation's `next:` line names and whether it is the last step's write of the code."""
    if "next:" not in observation:
        return None
    line = observation.rsplit("next:", 1)[-1].split("\n")[0].strip()
    if m := re.fullmatch(r"write the code from \S+ to (\S+)", line):
        return f"echo {code} > {m.group(1)}", True
    for pattern, form in FORMS:
        if m := re.fullmatch(pattern, line):
            return form.format(*m.groups()), False
    return None


def kind(e) -> str:
    observation, code = e["first_observation"], None
    for turn in e["transcript"]:
        action = " ".join(turn["action"].split()).replace("mkdir -p ", "mkdir ")
        expected = named(observation, code)
        if expected is not None and action != expected[0]:
            return "wrong code" if expected[1] else "slip"
        if code is None and (m := re.search(r"^code: (\S+)", turn.get("observation") or "", re.M)):
            code = m.group(1)
        observation = turn.get("observation") or ""
    return "other"


def unsubmitted(e) -> bool:
    """Every step done (the last observation's `next:` line says `submit`) and the episode ended without submitting."""
    last = (e["transcript"][-1].get("observation") or "") if e["transcript"] else ""
    return "next: submit" in last and not any(t["action"].strip() == "submit" for t in e["transcript"])


def loops(e, n=5) -> bool:
    actions = [t["action"].strip() for t in e["transcript"]]
    return any(len(set(actions[i : i + n])) == 1 for i in range(len(actions) - n + 1))


for arg in sys.argv[1:]:
    name, path = arg.split("=", 1)
    for mode in ("sampled", "greedy"):
        es = [e for e in rows(path) if e["mode"] == mode]
        failed = [e for e in es if not e["success"]]
        kinds = collections.Counter(kind(e) for e in failed)
        print(
            f"{name} {mode}: {len(es) - len(failed)}/{len(es)} succeed; {len(failed)} failures: slip {kinds['slip']},"
            f" wrong code {kinds['wrong code']}, other {kinds['other']}; cut"
            f" {sum(e['truncated'] for e in failed)}, one command 5+ times in a row {sum(map(loops, failed))},"
            f" every step done but never submitted {sum(map(unsubmitted, failed))};"
            f" successes with a slip {sum(kind(e) == 'slip' for e in es if e['success'])}"
        )
