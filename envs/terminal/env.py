"""`TerminalEnv`: the simulated terminal as an environment (tasks, expert, noisy actions, skill text)."""

from __future__ import annotations

import hashlib
import json
import random

from envs.base import Env, check_split, split_of
from envs.terminal.shell import (
    SUBMIT_WORDS,
    Shell,
    ancestors,
    check_assertions,
    command_line,
    command_words,
    norm_path,
    parent_dir,
    q,
    tokenize,
    truncate_output,
)
from envs.terminal.tasks import CHECKLIST, CONTENT, LEVELS, NAMES, SEED_LEVEL, describe_step

# ---------------------------------------------------------------------------------------------------------------------
# The environment
# ---------------------------------------------------------------------------------------------------------------------


CHECKLIST_SKILL = (
    "Each reply of the terminal ends with next: <step>; run the one command it names, copying names exactly: read F "
    "is cat F, create the directory D is mkdir D, write W to F is echo W > F, append W to F is echo W >> F, copy A "
    "to B is cp A B, rename A to B is mv A B, move A into D is mv A D/, delete F is rm F. The code that cat shows "
    "at the start is needed at the end, after its file is deleted: write the code from F to G is echo <code> > G. "
    "Type submit when next says submit."
)


class TerminalEnv(Env):
    """A simulated shell over an in-memory file system; one command per turn, `submit` to finish (see module doc)."""

    name = "terminal"
    action_names = ("command", "submit")
    state_keys = ("files", "dirs")
    verifier = "assertions"
    skill = (
        "Run the one shell command that does what the task says, copying names and text exactly from the task "
        "(mkdir -p for directories, echo <text> > <file> to write, >> to append, rm, cp, mv); one command per turn; "
        "type submit when every requirement holds."
    )
    max_turns = 8  # levels 0, 3 and 4; the long-horizon levels set their own (`CHECKLIST`)
    #: 1: levels 1 and 2 are the checklists (a build of the former 1 or 2 is stale); 2: the key file's line is
    #: `code: <code>`, so moving it onto the target no longer passes the last check
    level_demo_versions = {1: 2, 2: 2}
    #: the checklists need a longer warm start than level 0's 300 steps (bench/results/terminal_levels/)
    tiny_level_sft_steps = {1: 2000, 2: 2000}

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        if difficulty in CHECKLIST:  # the long-horizon levels: their own budget and skill
            self.max_turns = CHECKLIST[difficulty][1]
            self.skill = CHECKLIST_SKILL
        self.task: dict = {}
        self.shell = Shell()
        self.done = False
        self._history: list[str] = []
        self._plan: list[str] = []
        self._plan_states: list[tuple] = []
        self._memory: dict | None = None  # a checklist task's key file and code (levels 1 and 2)
        self._seen = False  # whether a command's output has shown the code

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        check_split(split)
        if difficulty not in LEVELS:
            raise ValueError(f"difficulty must be one of {sorted(LEVELS)}, got {difficulty!r}")
        level = f"long{difficulty}" if difficulty in CHECKLIST else SEED_LEVEL.get(difficulty, difficulty)
        rng = random.Random(f"terminal|{split}|{level}|{seed}")
        tasks: list[dict] = []
        seen: set[str] = set()
        for _ in range(100 * n + 1000):
            if len(tasks) == n:
                break
            task = rng.choice(LEVELS[difficulty])(rng)
            key = f"terminal|{task['instruction']}"  # the instruction defines the task and decides its split
            if task["instruction"] in seen or split_of(key) != split:
                continue
            seen.add(task["instruction"])
            task_id = f"terminal-d{difficulty}-{hashlib.sha256(key.encode()).hexdigest()[:10]}"
            tasks.append({"task_id": task_id, "env": "terminal", "difficulty": difficulty, "split": split, **task})
        if len(tasks) < n:
            raise ValueError(f"only {len(tasks)} distinct {split} tasks at difficulty {difficulty}, {n} requested")
        return tasks

    def reset(self, task: dict) -> str:
        self.task = task
        self.shell = Shell(task.get("files", {}), task.get("dirs", []))
        self.done = False
        self._history = []
        self._plan = list(task.get("solution", []))
        self._memory, self._seen = task.get("memory"), False
        scratch = self.shell.copy()
        self._plan_states = [scratch.snapshot()]
        for command in self._plan:
            scratch.run(command)
            self._plan_states.append(scratch.snapshot())
        return f"Task: {task['instruction']}\n{self._next_line()}$ "

    def _next_line(self) -> str:
        """A checklist task's `next: <step>` line (the expert's next command in words), else ""."""
        return f"next: {describe_step(self._expert()[0], self._memory)}\n" if self._memory else ""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done:
            return "the episode is over", 0.0, True, self._info(final=True)
        command = command_line(action)
        if command.lower() in SUBMIT_WORDS:
            self.done = True
            info = self._info(final=True)
            passed, total = info["assertions_passed"] - 1, info["assertions_total"] - 1  # the task's, not `submitted`
            return f"submitted: {passed}/{total} checks pass", float(info["success"]), True, info
        output = self.shell.run(command)
        self._history.append(command)
        if self._memory and self._memory["code"] in output.split():
            self._seen = True
        observation = (truncate_output(output) + "\n" if output else "") + self._next_line() + "$ "
        return observation, 0.0, False, self._info(final=False)

    def state_key(self) -> str:
        files, dirs, cwd = self.shell.snapshot()
        blob = json.dumps([files, dirs, cwd], separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

    def _info(self, final: bool) -> dict:
        """P and A over the task's assertions plus one check of its own, `submitted` (only `submit` ends an episode
        here), so that P = A exactly when the episode succeeds and a count of passing checks pays submitting too."""
        passed = [*check_assertions(self.shell.files, self.shell.dirs, self.task.get("assertions", [])), final]
        # success is only ever True on the submit turn, even when every assertion already holds
        return {"assertions_passed": sum(passed), "assertions_total": len(passed), "success": all(passed)}

    # -- expert and noise ---------------------------------------------------------------------------------------------
    def expert_action(self) -> str:
        return self._expert()[0]

    def _expert(self) -> tuple[str, int | None]:
        """(command, index of the command in the solution, or None when it is a repair or `submit`)."""
        if self.done:
            return "submit", None
        memory = self._memory
        if memory and not self._seen and memory["code"] in self.shell.files.get(norm_path(memory["path"]), "").split():
            return f"cat {q(memory['path'])}", 0  # a checklist's code is read first, while its file still holds it
        current = self.shell.snapshot()
        on_path = [k for k, state in enumerate(self._plan_states) if state == current]
        if on_path:
            k = max(on_path)
            first = k
            while first > 0 and self._plan_states[first - 1] == current:  # read-only steps just before k
                first -= 1
            for i in range(first, k):
                if self._plan[i] not in self._history and not self._seen:  # a checklist's one read: the code shown
                    return self._plan[i], i
            if k < len(self._plan):
                return self._plan[k], k
        return self._repair(), None

    def _repair(self) -> str:
        """A command that fixes the first failing assertion (positive ones first), or `submit` when all pass."""
        shell = self.shell
        assertions = self.task.get("assertions", [])
        failing = [
            a
            for a, ok in zip(assertions, check_assertions(shell.files, shell.dirs, assertions), strict=True)
            if not ok
        ]
        if not failing:
            return "submit"
        if shell.cwd:
            return "cd /"
        target = dict(self._plan_states[-1][0]) if self._plan else None
        absent = [norm_path(a["path"]) for a in assertions if a["kind"] == "file_absent"]
        for assertion in failing:
            if assertion["kind"] != "file_absent" and (command := self._fix(assertion, target, absent)):
                return command
        for assertion in failing:
            if assertion["kind"] == "file_absent":
                path = norm_path(assertion["path"])
                return f"rm -r {q(path)}" if shell.is_dir(path) else f"rm {q(path)}"
        return "submit"

    def _fix(self, assertion: dict, target: dict[str, str] | None, absent: list[str]) -> str | None:
        shell, path = self.shell, norm_path(assertion["path"])
        blocker = next((a for a in ancestors(path) if a in shell.files), None)
        if blocker is not None:
            return f"rm {q(blocker)}"
        if assertion["kind"] == "dir_exists":
            return f"rm {q(path)}" if path in shell.files else f"mkdir -p {q(path)}"
        if shell.is_dir(path):
            return f"rm -r {q(path)}"
        if not shell.is_dir(parent_dir(path)):
            return f"mkdir -p {q(parent_dir(path))}"
        current = shell.files.get(path)
        if target is not None and path in target:
            want = target[path]
        elif assertion["kind"] == "file_equals":
            want = str(assertion["content"]).rstrip("\n") + "\n"
        elif assertion["kind"] == "file_contains":
            want = (
                (current or "") + ("\n" if current and not current.endswith("\n") else "") + assertion["text"] + "\n"
            )
        elif assertion["kind"] == "file_exists":
            want = ""
        else:
            return None
        if current == want:
            return None
        if want == "":
            return f"rm {q(path)}" if current else f"touch {q(path)}"
        source = next((f for f in sorted(shell.files) if f != path and shell.files[f] == want), None)
        if source is not None:
            if target is not None:
                gone = source not in target
            else:
                gone = any(source == a or source.startswith(f"{a}/") for a in absent)
            return f"{'mv' if gone else 'cp'} {q(source)} {q(path)}"
        lines = want.splitlines(keepends=True)
        if current is not None and want.startswith(current) and (current == "" or current.endswith("\n")):
            line, op = lines[len(current.splitlines())], ">>"
        else:
            line, op = lines[0], ">"
        if line.endswith("\n"):
            return f"echo {q(line[:-1])} {op} {q(path)}"
        return f"echo -n {q(line)} {op} {q(path)}"

    def noisy_action(self, rng: random.Random) -> str:
        """A plausible wrong command: early `submit`, a wrong file name, wrong content, or a skipped step.

        When the expert would read (a level-2 look-up), the noise acts without reading and guesses wrong; when it would
        submit, the noise spoils a checked file.
        """
        expert, index = self._expert()
        if expert == "submit":
            return self._spoil(rng)
        base = expert
        changing = [i for i in range(len(self._plan)) if self._plan_states[i] != self._plan_states[i + 1]]
        if index is not None and index not in changing:  # a read: skip it and guess
            base = next((self._plan[i] for i in changing if i > index), expert)
        options = ["submit"]
        for perturb in (_perturb_path, _perturb_content):
            if (wrong := perturb(base, rng)) and wrong != expert:
                options.append(wrong)
        if index is not None and index in changing:
            options += [self._plan[i] for i in changing if i > index][:1]  # a missing step
        if self._memory:  # a checklist: read the distractor beside the key file, write the distractor's code
            memory, argv = self._memory, command_words(expert)
            if argv[:1] == ["cat"]:
                options += [f"cat {q(memory['decoy'])}", base]
            elif len(argv) == 4 and argv[1] == memory["code"]:
                options.append(f"echo {q(memory['decoy_code'])} > {q(argv[3])}")
        return rng.choice(options)

    def _spoil(self, rng: random.Random) -> str:
        positive = [a for a in self.task.get("assertions", []) if a["kind"] != "file_absent"]
        if not positive:
            absent = [a for a in self.task.get("assertions", []) if a["kind"] == "file_absent"]
            return f"mkdir -p {q('/' + norm_path(rng.choice(absent)['path']))}" if absent else "ls"
        assertion = rng.choice(positive)
        path = q("/" + norm_path(assertion["path"]))
        if assertion["kind"] == "dir_exists":
            return f"rm -r {path}"
        if assertion["kind"] in ("file_equals", "file_contains"):
            expected = str(assertion.get("content", assertion.get("text", ""))).strip()
            return f"echo {rng.choice([w for w in CONTENT if w != expected and expected not in w])} > {path}"
        return f"rm {path}"


def _argument_roles(tokens: list[tuple[str, str]]) -> tuple[list[int], list[int]]:
    """Indices of the path tokens and of the echoed-content tokens of one simple command."""
    paths, content, targets = [], [], set()
    prog, skip, operand = None, False, 0
    for i, (kind, text) in enumerate(tokens):
        if kind == "op":
            targets.add(i + 1)
        elif i in targets:
            paths.append(i)
        elif prog is None:
            prog = text
        elif prog == "echo":
            content += [i] if text != "-n" else []
        elif skip:
            skip = False
        elif prog in ("head", "tail") and text == "-n":
            skip = True
        elif not text.startswith("-"):
            operand += 1
            paths += [i] if not (prog == "grep" and operand == 1) else []
    return paths, content


def _rebuild(tokens: list[tuple[str, str]]) -> str:
    return " ".join(text if kind == "op" else q(text) for kind, text in tokens)


def _perturb_path(command: str, rng: random.Random) -> str | None:
    """The command with one path component renamed (`zeta.txt` -> `kappa.txt`), or None if it has no path."""
    tokens = tokenize(command)
    paths, _ = _argument_roles(tokens)
    if not paths:
        return None
    i = rng.choice(paths)
    parts = tokens[i][1].split("/")
    j = rng.choice([k for k, part in enumerate(parts) if part])
    stem, dot, ext = parts[j].partition(".")
    parts[j] = rng.choice([n for n in NAMES if n != stem]) + dot + ext
    tokens[i] = ("word", "/".join(parts))
    return _rebuild(tokens)


def _perturb_content(command: str, rng: random.Random) -> str | None:
    """The echo command with one word replaced (another word, or a number off by one or two), or None."""
    tokens = tokenize(command)
    _, content = _argument_roles(tokens)
    if not content:
        return None
    i = rng.choice(content)
    text = tokens[i][1]
    if text.isdigit():
        wrong = str(rng.choice([v for v in (int(text) - 1, int(text) + 1, int(text) + 2) if v >= 0]))
    else:
        wrong = rng.choice([w for w in CONTENT if w != text])
    tokens[i] = ("word", wrong)
    return _rebuild(tokens)
