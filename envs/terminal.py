"""A simulated terminal: an in-memory file system, a small shell, and tasks checked by a list of assertions.

Nothing here runs a host command or touches a real file. Every command is interpreted over two Python containers
(`files`: path -> content, `dirs`: set of paths), so episodes are fast, deterministic and safe on any machine. `/` is
the task's workspace root and the shell starts there.

Shell subset (the action is one command line per assistant turn: the first non-empty line of the turn runs; code
fences, a leading `$ ` and surrounding backticks are ignored)
  ls [-alF1] [path...]        one line of entries, directories with a trailing `/` (as `ls -F` shows them)
  cat [file...]               with no file it reads the pipe
  grep [-cilnrvFE] pattern [path...]
                              Python `re` syntax, matched by `regex` with a timeout (the same as grep's for plain
                              words); -r walks directories
  echo [-n] word...           usually with `> file` (overwrite) or `>> file` (append)
  mkdir [-p] dir...           touch file...           rm [-rf] path...
  cp [-r] src... dst          mv src... dst           (both go into dst when it is a directory)
  wc [-lwc] [file...]         head / tail [-n N | -N] [file...]           pwd           cd [dir]
Quoting follows shlex (POSIX) rules; `|` pipes, `<` reads a file, `>` / `>>` write one; `;` and `&&` chain commands.
Mistakes give bash-like error text ("bash: foo: command not found", "cat: x: No such file or directory"), never an
exception. Output is cut after 40 words or 2,000 characters. `submit` (or `done`, `exit`) ends the episode.

Bounds, so that every step is short and small even though the agent loop cannot stop a running step's thread (class
attributes of `Shell`, far above what a task needs: its files are a few lines). A command line over 10,000 characters
is refused before it is parsed. A command line runs for at most `time_budget_s` = 2 s, checked between commands, per
operand, per line grep reads and inside the regex engine; past it, it stops with `bash: time limit exceeded`. The
file system holds 1 MiB (contents and paths, plus 64 per file or directory, so empty files fill it too) and any one
command's output 1 MiB; a command that would pass either fails with `No space left on device` and leaves the file
system as it was before that command (bash would keep the file its `>` truncated). grep refuses a pattern whose
counted repeats would unroll too far (`regex` expands them when compiling, with no timeout).

Assertions (JSON dicts on the final file system; paths relative to `/`)
  {"kind": "file_exists", "path"}             a regular file is there
  {"kind": "file_absent", "path"}             neither a file nor a directory is there
  {"kind": "dir_exists", "path"}              a directory is there
  {"kind": "file_equals", "path", "content"}  the content, ignoring trailing newlines on both sides
  {"kind": "file_contains", "path", "text"}   a substring of the content
  {"kind": "line_count", "path", "lines"}     the number of lines

Reward: every step's `info` reports `assertions_passed` (P) and `assertions_total` (A): the task's assertions on the
current file system plus one more check, `submitted`, which holds once `submit` has ended the episode. The `submit`
turn ends the episode with reward 1.0 if all assertions pass, else 0.0, and `info["success"]`; every other turn has
reward 0. So P = A exactly on success, and the dense T1 reward P/S, computed elsewhere from `info`, pays the
submission as the verdict does (without that check, T1's policy at level 2 learned to do every step and never submit:
docs/methods/t1.md §9). Cutting an episode at `max_turns` is the agent loop's business; the last step's `info` then
still carries P and A, with `submitted` failing. The observation after `submit` counts the task's assertions only.

Difficulty levels (`make_tasks(..., difficulty=)`): 0 short; 1 and 2 long-horizon (10 and 15-18 expert turns) for the
tiny default and for step-credit methods; 3 and 4 short, 4 for real models.
  0  one or two commands whose arguments are copied verbatim from the instruction, 1-3 assertions: "create a file
     named zeta.txt containing apple" -> `echo apple > zeta.txt`, `submit`. Learnable by the 0.15M-parameter default
     agent in minutes (positional copying only).
  1  a checklist of 8-9 small steps, 9-10 expert turns with `submit`, `max_turns` 16, 8-19 assertions. The
     instruction lists the steps ("do these steps in order, then submit: read vault.txt; create the directory kappa;
     copy omega.txt to kappa/photos.txt; ...; delete vault.txt; ...; write the code from vault.txt to report.log")
     and, at these levels only, the first observation and every reply end with a `next: <step>` line naming the
     expert's next command in words (after a mistake the step is named again, or the repair), so each command is a
     positional copy from the latest observation: read F -> `cat F`, create the directory D -> `mkdir D`, write W to
     F -> `echo W > F`, append W to F -> `echo W >> F`, copy A to B -> `cp A B`, rename A to B -> `mv A B`, move A
     into D -> `mv A D/`, delete F -> `rm F`. The first step reads the key file, whose one line `code: <code>` (a code
     from `CODES`, used nowhere else) is shown by that `cat` only; a step in the second half deletes the key file,
     and the last step writes the code alone into a new file: information shown only at turn 1, needed 7 or more
     turns later (until the code is shown, the next step is reading it while its file still holds it). No file ever
     holds the code alone, and the shell's commands copy, move or cut whole lines, so the last check passes only
     when the agent types the code (the repairs a `next:` line names after a mistake included). Every file a step
     touches has a distractor beside it with the same stem and another extension (the key file's holds another
     code), checked unchanged; each step works on its own paths, so a step's checks still hold after all later steps.
  2  the same checklist with 14-17 steps (15-18 expert turns, `max_turns` 28, 14-43 assertions), the code needed 13
     or more turns after it was shown.
  3  two or three commands (mkdir + mv, cp + append, rm -r + write, several echo/append), 4-6 assertions; the
     arguments are still in the instruction.
  4  the answer is not in the instruction and must be read from the file system first (count lines, look a value
     up, find the file holding a word, name a directory after a file's first line), 3-4 assertions. Meant for real
     models: it needs content matching, which tiny models do not learn.
Levels 3 and 4 were levels 1 and 2 before the long-horizon levels; they draw the same tasks as then (seeded by their
old numbers). File names and contents are drawn per task from word lists; the split (`envs.base.split_of`) is decided
by the instruction, so a train task and an eval task never share an instruction.

The expert (`expert_action`) replays the task's canonical `solution` while the state is on its path (running its
read commands once) and otherwise repairs the first failing assertion, so it also finishes from noisy states. At the
long levels it first reads the key file while the code has not been shown and the file holds it; it knows the code
from the task, so it finishes even when the agent deleted the key unread (the agent then cannot).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import shlex
import time
from collections.abc import Callable, Iterable, Iterator

import regex

from envs.base import Env, check_split, split_of

NAMES = [
    "alpha", "beta", "gamma", "delta", "zeta", "theta", "kappa", "sigma", "omega", "lambda", "notes", "data",
    "report", "config", "backup", "logs", "cache", "docs", "src", "tmp", "archive", "drafts", "build", "output",
    "assets", "scripts", "media", "images", "music", "photos", "videos", "tests", "results", "queue", "inbox",
    "vault", "ledger", "index", "summary", "budget", "agenda", "journal", "recipes", "letters", "orders", "invoices",
]  # fmt: skip
#: file contents; no word is a substring of another, so a grep for one word matches exactly its lines
CONTENT = [
    "apple", "banana", "cherry", "grape", "lemon", "mango", "olive", "peach", "kiwi", "melon", "ready", "pending",
    "stable", "urgent", "silver", "golden", "copper", "marble", "forest", "river", "canyon", "desert", "island",
    "meadow", "harbor", "castle", "rocket", "planet", "comet", "falcon", "tiger", "zebra", "panda", "koala", "otter",
    "walrus", "violet", "indigo", "amber", "coral",
]  # fmt: skip
#: the key file's one line is this label and then the code (`code: east`); the distractor beside it, another code
KEY_LABEL = "code:"
#: the code a long-horizon task shows once (`cat` at turn 1) and asks for again at the end; used nowhere else
CODES = ["north", "south", "east", "west", "spring", "summer", "autumn", "winter", "ruby", "jade", "onyx", "pearl"]
KEYS = ["host", "port", "user", "mode", "level", "color", "region", "owner", "theme", "limit", "shell", "editor"]
EXTENSIONS = ["txt", "log", "md", "csv"]
ASSERTION_KINDS = ("file_exists", "file_absent", "dir_exists", "file_equals", "file_contains", "line_count")
SUBMIT_WORDS = ("submit", "done", "exit")
MAX_OUTPUT_WORDS = 40
MAX_OUTPUT_CHARS = 2_000  # the observation's cut for one long word (40 task words take a few hundred characters)
#: the largest `_pattern_size` grep compiles: about 100k `regex` nodes, ~30 ms and ~25 MB to compile
MAX_PATTERN_SIZE = 100_000

q = shlex.quote


# ---------------------------------------------------------------------------------------------------------------------
# Paths and assertions
# ---------------------------------------------------------------------------------------------------------------------


def _norm(path: str) -> str:
    """A path relative to the root, as stored: no leading or trailing `/`, no `.` or `..`."""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)


def _parent(path: str) -> str:
    return path.rpartition("/")[0]


def _ancestors(path: str) -> list[str]:
    """Strict ancestors of a stored path, outermost first (the root "" excluded)."""
    parts = path.split("/")
    return ["/".join(parts[:k]) for k in range(1, len(parts))]


def check_assertion(files: dict[str, str], dirs: set[str], assertion: dict) -> bool:
    """Whether one assertion holds on a file system.

    >>> check_assertion({"a.txt": "hi\\n"}, set(), {"kind": "file_equals", "path": "a.txt", "content": "hi"})
    True
    >>> check_assertion({}, {"logs"}, {"kind": "file_absent", "path": "logs"})
    False
    """
    kind, path = assertion["kind"], _norm(assertion["path"])
    content = files.get(path)
    if kind == "file_exists":
        return content is not None
    if kind == "file_absent":
        return content is None and path not in dirs and path != ""
    if kind == "dir_exists":
        return path in dirs or path == ""
    if content is None:
        return False
    if kind == "file_equals":
        return content.rstrip("\n") == str(assertion["content"]).rstrip("\n")
    if kind == "file_contains":
        return str(assertion["text"]) in content
    if kind == "line_count":
        return len(content.splitlines()) == int(assertion["lines"])
    raise ValueError(f"unknown assertion kind {kind!r}; expected one of {ASSERTION_KINDS}")


def check_assertions(files: dict[str, str], dirs: set[str], assertions: list[dict]) -> list[bool]:
    return [check_assertion(files, dirs, a) for a in assertions]


# ---------------------------------------------------------------------------------------------------------------------
# The shell
# ---------------------------------------------------------------------------------------------------------------------

_OPERATORS = ("&&", ">>", ";", "|", ">", "<", "&")


class _ShellSyntaxError(Exception):
    """A parse error; its message is the unexpected token."""


class _Stop(Exception):
    """Ends the whole command line; its message is the last thing the terminal shows (the time budget ran out)."""


class _Full(Exception):
    """A command would pass the disk's or its output's cap; its message is who reports it, e.g. `cat: write error`."""


class _Output:
    """Text collected in pieces, never more than `limit` characters. With `prog`, passing the limit raises `_Full`
    (a command's output); without, the rest is dropped (what the terminal keeps of a command line)."""

    def __init__(self, limit: int, prog: str | None = None):
        self.limit, self.prog = limit, prog
        self.parts: list[str] = []
        self.size = 0

    def write(self, text: str) -> None:
        if self.prog is not None and self.size + len(text) > self.limit:
            raise _Full(f"{self.prog}: write error")
        self.parts.append(text[: self.limit - self.size])
        self.size += len(self.parts[-1])

    def text(self) -> str:
        return "".join(self.parts)


def _pattern_size(pattern: str) -> int:
    """An upper bound on the nodes `regex` compiles a pattern into: its length times each counted repeat `{m,n}`.

    `regex` unrolls counted repeats when compiling, with no timeout: `(a{1000}){1000}` is a million nodes (~1 s).
    >>> _pattern_size("apple"), _pattern_size("(ab{10}){2,3}")
    (5, 390)
    """
    size = len(pattern)
    for numbers in re.findall(r"\{(\d*),?(\d*)\}", pattern):
        size *= max([int(n) if len(n) < 19 else 10**18 for n in numbers if n] + [1])  # 10**18: too big anyway
    return size


def _tokenize(line: str) -> list[tuple[str, str]]:
    """("word", text) and ("op", operator) tokens; words between operators are split by `shlex` (quotes, escapes).

    A quoted operator stays a word: `echo '>'` prints `>`. Raises ValueError on an unterminated quote.
    """
    tokens: list[tuple[str, str]] = []
    raw, quote, i = "", "", 0
    while i < len(line):
        ch = line[i]
        if quote:  # inside quotes: only the closing quote (and, in "...", a backslash escape) matter
            raw += ch
            if ch == "\\" and quote == '"' and i + 1 < len(line):
                raw += line[i + 1]
                i += 1
            elif ch == quote:
                quote = ""
            i += 1
            continue
        if ch == "\\" and i + 1 < len(line):
            raw += line[i : i + 2]
            i += 2
            continue
        if ch in "'\"":
            quote = ch
        op = next((o for o in _OPERATORS if line.startswith(o, i)), None)
        if op is None:
            raw += ch
            i += 1
            continue
        tokens.extend(("word", w) for w in shlex.split(raw))
        tokens.append(("op", op))
        raw = ""
        i += len(op)
    if quote:
        raise ValueError("unterminated quote")
    tokens.extend(("word", w) for w in shlex.split(raw))
    return tokens


class _Command:
    def __init__(self) -> None:
        self.argv: list[str] = []
        self.redirects: list[tuple[str, str]] = []  # (">" | ">>" | "<", target as typed)

    def empty(self) -> bool:
        return not self.argv and not self.redirects


def _parse(tokens: list[tuple[str, str]]) -> list[tuple[str, list[_Command]]]:
    """A list of (connector, pipeline); the connector (";" or "&&") joins the pipeline to the one before it."""
    sequence: list[tuple[str, list[_Command]]] = []
    pipeline, connector, i = [_Command()], ";", 0
    while i < len(tokens):
        kind, text = tokens[i]
        if kind == "word":
            pipeline[-1].argv.append(text)
        elif text in (">", ">>", "<"):
            if i + 1 == len(tokens) or tokens[i + 1][0] != "word":
                raise _ShellSyntaxError(tokens[i + 1][1] if i + 1 < len(tokens) else "newline")
            pipeline[-1].redirects.append((text, tokens[i + 1][1]))
            i += 1
        elif text == "|" and not pipeline[-1].empty():
            pipeline.append(_Command())
        elif text in (";", "&&") and not pipeline[-1].empty():
            sequence.append((connector, pipeline))
            pipeline, connector = [_Command()], text
        else:
            raise _ShellSyntaxError(text)
        i += 1
    if not pipeline[-1].empty():
        sequence.append((connector, pipeline))
    elif len(pipeline) > 1 or connector == "&&":
        raise _ShellSyntaxError("newline")
    return sequence


def _split_options(prog: str, args: list[str], allowed: str) -> tuple[set[str], list[str], str]:
    """(flags, operands, error) for short options such as `-rf`, anywhere on the line; `--` ends the options."""
    flags: set[str] = set()
    operands: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            operands.extend(args[i + 1 :])
            break
        if arg.startswith("-") and len(arg) > 1:
            for ch in arg[1:]:
                if ch not in allowed:
                    return flags, operands, f"{prog}: invalid option -- '{ch}'\n"
                flags.add(ch)
        else:
            operands.append(arg)
    return flags, operands, ""


Output = tuple[str, str]  # (stdout, stderr)


_BASH_BUILTINS = ("cd", "echo", "pwd")  # bash itself reports their errors: "bash: echo: write error: ..."
_ENTRY_CHARS = 64  # what each file or directory takes on the simulated disk besides its path and content


class Shell:
    """The simulated shell: a file system (`files`, `dirs`), a working directory, and `run(line) -> output`.

    Its bounds (see the module doc) are class attributes; set them on an instance or a subclass to change them.
    """

    time_budget_s: float = 2.0  # per command line; well under the agent loop's step timeout (`env_timeout`, 30 s)
    max_line_chars: int = 10_000  # a longer command line is refused before it is tokenised
    max_stream_chars: int = 1 << 20  # any one command's output (a pipe, or what it writes), and what a line shows
    max_disk_chars: int = 1 << 20  # the whole file system, as `disk_usage()` counts it

    def __init__(self, files: dict[str, str] | None = None, dirs: list[str] | set[str] | None = None, cwd: str = ""):
        self.files: dict[str, str] = {_norm(p): c for p, c in (files or {}).items()}
        self.dirs: set[str] = {_norm(d) for d in (dirs or [])} - {""}
        for path in list(self.files) + list(self.dirs):  # parents of everything exist
            self.dirs.update(_ancestors(path))
        self.cwd = _norm(cwd)
        self.builtins: dict[str, Callable[[list[str], str | None], Output]] = {
            "ls": self._ls, "cat": self._cat, "grep": self._grep, "echo": self._echo, "mkdir": self._mkdir,
            "touch": self._touch, "rm": self._rm, "cp": self._cp, "mv": self._mv, "wc": self._wc,
            "head": self._head, "tail": self._tail, "pwd": self._pwd, "cd": self._cd,
        }  # fmt: skip
        self._deadline = float("inf")  # of the command line that is running

    # -- state --------------------------------------------------------------------------------------------------------
    def snapshot(self) -> tuple:
        return tuple(sorted(self.files.items())), tuple(sorted(self.dirs)), self.cwd

    def copy(self) -> Shell:
        return Shell(dict(self.files), set(self.dirs), self.cwd)

    def disk_usage(self) -> int:
        """Characters the file system takes: each file's path and content, each directory's path, and `_ENTRY_CHARS`
        per file or directory.

        >>> Shell({"d/a.txt": "hi\\n"}).disk_usage()  # (64 + 7 + 3) + (64 + 1)
        139
        """
        entries = _ENTRY_CHARS * (len(self.files) + len(self.dirs))
        return entries + sum(len(p) + len(c) for p, c in self.files.items()) + sum(map(len, self.dirs))

    def is_dir(self, path: str) -> bool:
        return path == "" or path in self.dirs

    def exists(self, path: str) -> bool:
        return path in self.files or self.is_dir(path)

    def resolve(self, arg: str) -> str:
        if arg == "~" or arg.startswith("~/"):
            arg = "/" + arg[1:]
        return _norm(arg if arg.startswith("/") else f"{self.cwd}/{arg}")

    def _under(self, path: str) -> tuple[list[str], list[str]]:
        """Files and directories strictly below `path`, sorted."""
        prefix = f"{path}/" if path else ""
        files = sorted(f for f in self.files if f.startswith(prefix))
        return files, sorted(d for d in self.dirs if d.startswith(prefix))

    def _remove(self, path: str) -> None:
        files, dirs = self._under(path)
        for f in files:
            del self.files[f]
        self.dirs.difference_update(dirs)
        self.files.pop(path, None)
        self.dirs.discard(path)

    def _holds_cwd(self, path: str) -> bool:
        return self.cwd == path or self.cwd.startswith(f"{path}/") or path == ""

    def _read(self, prog: str, arg: str) -> tuple[str | None, str]:
        path = self.resolve(arg)
        if path in self.files:
            return self.files[path], ""
        if self.is_dir(path):
            return None, f"{prog}: {arg}: Is a directory\n"
        return None, f"{prog}: {arg}: No such file or directory\n"

    def _missing_parent(self, path: str) -> str:
        """Why `path` cannot be created: "" when its parent is a directory, else the error's reason."""
        parent = _parent(path)
        if self.is_dir(parent):
            return ""
        if parent in self.files or any(a in self.files for a in _ancestors(parent)):
            return "Not a directory"
        return "No such file or directory"

    # -- running ------------------------------------------------------------------------------------------------------
    def run(self, line: str) -> str:
        """Run one command line and return what the terminal shows (stderr and stdout, no trailing newline).

        A line over `max_line_chars` is refused; one running past `time_budget_s` stops where it is with an error;
        what it shows is kept to its first `max_stream_chars` characters.
        """
        if len(line) > self.max_line_chars:
            return f"bash: command line too long ({len(line)} characters, at most {self.max_line_chars})"
        try:
            sequence = _parse(_tokenize(line))
        except _ShellSyntaxError as e:
            return f"bash: syntax error near unexpected token `{e}'"
        except ValueError:
            return "bash: syntax error: unterminated quoted string"
        self._deadline = time.monotonic() + self.time_budget_s
        shown = _Output(self.max_stream_chars)
        status = 0
        try:
            for connector, pipeline in sequence:
                if connector == "&&" and status != 0:
                    continue
                stdin: str | None = None
                for command in pipeline:
                    self._time_left()  # between the commands of a pipeline or sequence
                    stdin, err, status = self._run_command(command, stdin)
                    shown.write(err)
                shown.write(stdin or "")
        except _Stop as e:
            shown.write(f"{e}\n")
        return shown.text().rstrip("\n")

    def _time_left(self) -> float:
        """Seconds left to the running command line; raises `_Stop` when there are none."""
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise self._time_up()
        return left

    def _time_up(self) -> _Stop:
        return _Stop(f"bash: time limit exceeded ({self.time_budget_s:g}s per command line)")

    def _each(self, items: Iterable[str]) -> Iterator[str]:
        """`items`, checking the time budget before each: the builtins loop over their operands with it."""
        for item in items:
            self._time_left()
            yield item

    def _check_disk(self, before: int, who: str) -> None:
        """Raise `_Full(who)` when the file system grew past `max_disk_chars` (freeing space is always allowed)."""
        used = self.disk_usage()
        if used > self.max_disk_chars and used > before:
            raise _Full(who)

    def _run_command(self, command: _Command, stdin: str | None) -> tuple[str, str, int]:
        """Run one simple command. One that would fill the disk past `max_disk_chars`, or write more than
        `max_stream_chars`, fails with "No space left on device" and leaves the file system as it was before it."""
        files, dirs, used = dict(self.files), set(self.dirs), self.disk_usage()
        try:
            return self._run_simple(command, stdin, used)
        except _Full as e:
            self.files, self.dirs = files, dirs
            return "", f"{e}: No space left on device\n", 1

    def _run_simple(self, command: _Command, stdin: str | None, used: int) -> tuple[str, str, int]:
        out_path = None
        for op, target in command.redirects:  # redirections are opened before the command runs, as in bash
            path = self.resolve(target)
            if op == "<":
                content, err = self._read("bash", target)
                if content is None:
                    return "", err, 1
                stdin = content
                continue
            if self.is_dir(path):
                return "", f"bash: {target}: Is a directory\n", 1
            if reason := self._missing_parent(path):
                return "", f"bash: {target}: {reason}\n", 1
            self.files[path] = "" if op == ">" else self.files.get(path, "")
            self._check_disk(used, f"bash: {target}")
            out_path = path
        if not command.argv:
            return "", "", 0
        name, args = command.argv[0], command.argv[1:]
        builtin = self.builtins.get(name)
        if builtin is None:
            return "", f"bash: {name}: command not found\n", 127
        out, err = builtin(args, stdin)
        who = f"bash: {name}" if name in _BASH_BUILTINS else name
        if len(out) > self.max_stream_chars:
            raise _Full(f"{who}: write error")
        if out_path is not None:
            if out_path in self.files:  # the command may have removed its own output file
                self.files[out_path] += out
            out = ""
        self._check_disk(used, f"{who}: write error" if out_path is not None else who)
        return out, err, 1 if err else 0

    # -- builtins: each takes (args, stdin) and returns (stdout, stderr) ----------------------------------------------
    def _ls(self, args: list[str], stdin: str | None) -> Output:
        flags, operands, err = _split_options("ls", args, "alF1")
        if err:
            return "", err
        operands = operands or ["."]
        out = _Output(self.max_stream_chars, "ls")
        for arg in self._each(operands):
            path = self.resolve(arg)
            if path in self.files:
                out.write(arg + "\n")
            elif self.is_dir(path):
                files, dirs = self._under(path)
                start = len(path) + 1 if path else 0
                names = [f[start:] for f in files if "/" not in f[start:]]
                names += [d[start:] + "/" for d in dirs if "/" not in d[start:]]
                names = sorted(n for n in names if "a" in flags or not n.startswith("."))
                block = (f"{arg}:\n" if len(operands) > 1 else "") + "  ".join(names)
                out.write(block + "\n" if block else "")
            else:
                err += f"ls: cannot access '{arg}': No such file or directory\n"
        return out.text(), err

    def _cat(self, args: list[str], stdin: str | None) -> Output:
        _, operands, err = _split_options("cat", args, "")
        if err:
            return "", err
        if not operands:
            return stdin or "", ""
        out = _Output(self.max_stream_chars, "cat")  # built piece by piece: it never holds more than its cap
        for arg in self._each(operands):
            content, e = self._read("cat", arg)
            out.write(content or "")
            err += e
        return out.text(), err

    def _grep(self, args: list[str], stdin: str | None) -> Output:
        flags, operands, err = _split_options("grep", args, "cilnrvFE")
        if err:
            return "", err
        if not operands:
            return "", "usage: grep [-cilnrvFE] PATTERN [FILE]...\n"
        pattern, paths = operands[0], operands[1:]
        if "F" not in flags and _pattern_size(pattern) > MAX_PATTERN_SIZE:
            return "", "grep: regular expression too big\n"
        try:
            compiled = regex.compile(
                regex.escape(pattern) if "F" in flags else pattern, regex.IGNORECASE if "i" in flags else 0
            )
        except regex.error:
            return "", f"grep: invalid regular expression '{pattern}'\n"
        errors = [err]
        labelled = "r" in flags or sum(self.resolve(arg) in self.files for arg in paths) > 1
        out = _Output(self.max_stream_chars, "grep")
        for label, content in self._grep_sources(paths, "r" in flags, stdin, errors):
            prefix, count = f"{label}:" if labelled else "", 0
            for n, line in enumerate(content.splitlines(), 1):
                if self._search(compiled, line) == ("v" in flags):
                    continue
                count += 1
                if "l" in flags:
                    break
                if "c" not in flags:
                    out.write(prefix + (f"{n}:" if "n" in flags else "") + line + "\n")
            if "l" in flags:
                out.write(label + "\n" if count else "")
            elif "c" in flags:
                out.write(f"{prefix}{count}\n")
        return out.text(), "".join(errors)

    def _grep_sources(
        self, paths: list[str], recursive: bool, stdin: str | None, errors: list[str]
    ) -> Iterator[tuple[str, str]]:
        """(label, content) of each file grep reads, one at a time; a path it cannot read adds to `errors`."""
        if not paths and not recursive:
            yield "(standard input)", stdin or ""
        for arg in self._each(paths or ["."] * recursive):
            path = self.resolve(arg)
            if path in self.files:
                yield arg, self.files[path]
            elif self.is_dir(path) and recursive:
                base = "" if not paths else arg.rstrip("/") + "/"
                start = len(path) + 1 if path else 0
                for f in self._each(self._under(path)[0]):
                    yield base + f[start:], self.files[f]
            elif self.is_dir(path):
                errors.append(f"grep: {arg}: Is a directory\n")
            else:
                errors.append(f"grep: {arg}: No such file or directory\n")

    def _search(self, compiled: regex.Pattern, line: str) -> bool:
        """Whether the pattern is in the line, given at most the time the command line has left."""
        left = self._time_left()
        try:
            return compiled.search(line, timeout=left) is not None
        except TimeoutError:
            if left > self.time_budget_s / 2:  # this one search took most of the budget: the pattern is to blame
                raise _Stop("grep: regular expression too complex (timed out)") from None
            raise self._time_up() from None  # the budget ran out over many lines

    def _echo(self, args: list[str], stdin: str | None) -> Output:
        if args and args[0] == "-n":
            return " ".join(args[1:]), ""
        return " ".join(args) + "\n", ""

    def _mkdir(self, args: list[str], stdin: str | None) -> Output:
        flags, operands, err = _split_options("mkdir", args, "p")
        if err:
            return "", err
        if not operands:
            return "", "mkdir: missing operand\n"
        for arg in self._each(operands):
            path = self.resolve(arg)
            if self.exists(path):
                if not ("p" in flags and self.is_dir(path)):
                    err += f"mkdir: cannot create directory '{arg}': File exists\n"
            elif "p" in flags:
                if any(a in self.files for a in _ancestors(path)):
                    err += f"mkdir: cannot create directory '{arg}': Not a directory\n"
                else:
                    self.dirs.update([*_ancestors(path), path])
            elif reason := self._missing_parent(path):
                err += f"mkdir: cannot create directory '{arg}': {reason}\n"
            else:
                self.dirs.add(path)
        return "", err

    def _touch(self, args: list[str], stdin: str | None) -> Output:
        _, operands, err = _split_options("touch", args, "")
        if not operands and not err:
            return "", "touch: missing file operand\n"
        for arg in self._each(operands if not err else []):
            path = self.resolve(arg)
            if self.exists(path):
                continue
            if reason := self._missing_parent(path):
                err += f"touch: cannot touch '{arg}': {reason}\n"
            else:
                self.files[path] = ""
        return "", err

    def _rm(self, args: list[str], stdin: str | None) -> Output:
        flags, operands, err = _split_options("rm", args, "rRf")
        if err:
            return "", err
        if not operands:
            return "", "" if "f" in flags else "rm: missing operand\n"
        for arg in self._each(operands):
            path = self.resolve(arg)
            if path in self.files:
                del self.files[path]
            elif not self.is_dir(path):
                err += "" if "f" in flags else f"rm: cannot remove '{arg}': No such file or directory\n"
            elif not flags & {"r", "R"}:
                err += f"rm: cannot remove '{arg}': Is a directory\n"
            elif self._holds_cwd(path):
                err += f"rm: refusing to remove '{arg}': it holds the working directory\n"
            else:
                self._remove(path)
        return "", err

    def _cp(self, args: list[str], stdin: str | None) -> Output:
        return self._transfer("cp", args, move=False)

    def _mv(self, args: list[str], stdin: str | None) -> Output:
        return self._transfer("mv", args, move=True)

    def _transfer(self, prog: str, args: list[str], move: bool) -> Output:
        flags, operands, err = _split_options(prog, args, "f" if move else "rRf")
        if err:
            return "", err
        if len(operands) < 2:
            after = f" after '{operands[0]}'" if operands else ""
            return "", f"{prog}: missing {'destination ' if operands else ''}file operand{after}\n"
        *sources, dst_arg = operands
        dst = self.resolve(dst_arg)
        into = self.is_dir(dst)
        if len(sources) > 1 and not into:
            return "", f"{prog}: target '{dst_arg}' is not a directory\n"
        for src_arg in self._each(sources):
            src = self.resolve(src_arg)
            if not self.exists(src) or src == "":
                err += f"{prog}: cannot stat '{src_arg}': No such file or directory\n"
                continue
            src_dir = self.is_dir(src)
            if src_dir and not move and not flags & {"r", "R"}:
                err += f"cp: -r not specified; omitting directory '{src_arg}'\n"
                continue
            base = src.rpartition("/")[2]
            target, target_arg = (_norm(f"{dst}/{base}"), f"{dst_arg.rstrip('/')}/{base}") if into else (dst, dst_arg)

            def cannot(
                reason: str, src_arg: str = src_arg, target_arg: str = target_arg, src_dir: bool = src_dir
            ) -> str:
                if move:
                    return f"mv: cannot move '{src_arg}' to '{target_arg}': {reason}\n"
                return f"cp: cannot create {'directory' if src_dir else 'regular file'} '{target_arg}': {reason}\n"

            if target == src:
                err += f"{prog}: '{src_arg}' and '{target_arg}' are the same file\n"
            elif src_dir and target.startswith(f"{src}/"):
                err += f"{prog}: cannot {'move' if move else 'copy'} '{src_arg}' into itself, '{target_arg}'\n"
            elif not src_dir and not into and dst_arg.endswith("/"):
                err += cannot("Not a directory")
            elif reason := self._missing_parent(target):
                err += cannot(reason)
            elif self.is_dir(target) and not src_dir:
                err += f"{prog}: cannot overwrite directory '{target_arg}' with non-directory\n"
            elif target in self.files and src_dir:
                err += f"{prog}: cannot overwrite non-directory '{target_arg}' with directory '{src_arg}'\n"
            elif move and src_dir and self._holds_cwd(src):
                err += cannot("it holds the working directory")
            elif move and self.is_dir(target) and any(self._under(target)):
                err += cannot("Directory not empty")
            elif not src_dir:
                self.files[target] = self.files[src]
                if move:
                    del self.files[src]
            else:
                files, dirs = self._under(src)
                self.dirs.update([target] + [target + d[len(src) :] for d in dirs])
                self.files.update({target + f[len(src) :]: self.files[f] for f in files})
                if move:
                    self._remove(src)
        return "", err

    def _wc(self, args: list[str], stdin: str | None) -> Output:
        flags, operands, err = _split_options("wc", args, "lwc")
        if err:
            return "", err
        sources: list[tuple[str, str]] = [] if operands else [("", stdin or "")]
        for arg in self._each(operands):
            content, e = self._read("wc", arg)
            err += e
            if content is not None:
                sources.append((arg, content))
        keys = [k for k in "lwc" if k in flags] or ["l", "w", "c"]
        totals = dict.fromkeys(keys, 0)
        lines = []
        for label, content in sources:
            self._time_left()
            counts = {"l": content.count("\n"), "w": len(content.split()), "c": len(content.encode())}
            for k in keys:
                totals[k] += counts[k]
            lines.append(" ".join(str(counts[k]) for k in keys) + (f" {label}" if label else ""))
        if len(sources) > 1:
            lines.append(" ".join(str(totals[k]) for k in keys) + " total")
        return "".join(line + "\n" for line in lines), err

    def _head(self, args: list[str], stdin: str | None) -> Output:
        return self._head_tail("head", args, stdin)

    def _tail(self, args: list[str], stdin: str | None) -> Output:
        return self._head_tail("tail", args, stdin)

    def _head_tail(self, prog: str, args: list[str], stdin: str | None) -> Output:
        n, operands, i = 10, [], 0
        while i < len(args):
            arg, value = args[i], None
            if arg == "-n":
                if i + 1 == len(args):
                    return "", f"{prog}: option requires an argument -- 'n'\n"
                value, i = args[i + 1], i + 1
            elif arg.startswith("-n") or re.fullmatch(r"-\d+", arg):
                value = arg[2:] if arg.startswith("-n") else arg[1:]
            elif arg.startswith("-") and len(arg) > 1:
                return "", f"{prog}: invalid option -- '{arg[1]}'\n"
            else:
                operands.append(arg)
            if value is not None:
                if not (value.isascii() and value.isdigit()) or len(value) > 9:  # "²" is a digit to isdigit()
                    return "", f"{prog}: invalid number of lines: '{value}'\n"
                n = int(value)
            i += 1
        sources: list[tuple[str, str]] = [] if operands else [("", stdin or "")]
        err = ""
        for arg in self._each(operands):
            content, e = self._read(prog, arg)
            err += e
            if content is not None:
                sources.append((arg, content))
        out = _Output(self.max_stream_chars, prog)
        for label, content in sources:
            self._time_left()
            lines = content.splitlines(keepends=True)
            part = lines[:n] if prog == "head" else lines[len(lines) - n :] if n else []
            out.write((f"==> {label} <==\n" if len(sources) > 1 else "") + "".join(part))
        return out.text(), err

    def _pwd(self, args: list[str], stdin: str | None) -> Output:
        return f"/{self.cwd}\n", ""

    def _cd(self, args: list[str], stdin: str | None) -> Output:
        if len(args) > 1:
            return "", "bash: cd: too many arguments\n"
        path = self.resolve(args[0]) if args else ""
        if self.is_dir(path):
            self.cwd = path
            return "", ""
        reason = "Not a directory" if path in self.files else "No such file or directory"
        return "", f"bash: cd: {args[0]}: {reason}\n"


def _command_line(action: str) -> str:
    """The command in an assistant turn: its first non-empty line outside code fences, without `$ ` or backticks."""
    for line in action.splitlines():
        line = line.strip()
        if not line or line.startswith("```"):
            continue
        if line.startswith("$ "):
            line = line[2:].strip()
        if len(line) > 1 and line[0] == line[-1] == "`":
            line = line.strip("`").strip()
        return line
    return ""


def _truncate(text: str, max_words: int = MAX_OUTPUT_WORDS, max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """The text cut after `max_words` words or `max_chars` characters, whichever comes first, with a marker."""
    head = text[:max_chars]
    words = list(re.finditer(r"\S+", head))
    if len(words) > max_words:
        return head[: words[max_words - 1].end()] + " ...(truncated)"
    return head + " ...(truncated)" if len(text) > max_chars else text


# ---------------------------------------------------------------------------------------------------------------------
# Task templates: each draws names and contents with `rng` and returns the task's defining fields
# ---------------------------------------------------------------------------------------------------------------------


def _file(rng: random.Random, stem: str) -> str:
    return f"{stem}.{rng.choice(EXTENSIONS)}"


def _text(words: list[str]) -> str:
    return "".join(f"{w}\n" for w in words)


def _a(kind: str, path: str, **value: str | int) -> dict:
    return {"kind": kind, "path": path, **value}


def _task(kind: str, instruction: str, files: dict[str, str], solution: list[str], assertions: list[dict]) -> dict:
    return {
        "kind": kind,
        "instruction": instruction,
        "files": files,
        "dirs": sorted({a for p in files for a in _ancestors(p)}),
        "assertions": assertions,
        "solution": solution,
    }


def _lines(rng: random.Random, lo: int, hi: int, pool: list[str] = CONTENT) -> list[str]:
    return [rng.choice(pool) for _ in range(rng.randint(lo, hi))]


# level 0: one or two commands, arguments copied from the instruction ------------------------------------------------


def _write(rng: random.Random) -> dict:
    stem, other = rng.sample(NAMES, 2)
    path, word = _file(rng, stem), rng.choice(CONTENT)
    return _task(
        "write",
        f"create a file named {path} containing {word}",
        {_file(rng, other): _text(_lines(rng, 1, 3))},
        [f"echo {word} > {path}"],
        [_a("file_exists", path), _a("file_equals", path, content=word)],
    )


def _make_dir(rng: random.Random) -> dict:
    outer, inner = rng.sample(NAMES, 2)
    return _task(
        "make_dir",
        f"create the directory {outer}/{inner}",
        {},
        [f"mkdir -p {outer}/{inner}"],
        [_a("dir_exists", outer), _a("dir_exists", f"{outer}/{inner}")],
    )


def _delete(rng: random.Random) -> dict:
    stem, other = rng.sample(NAMES, 2)
    path, keep = _file(rng, stem), _file(rng, other)
    return _task(
        "delete",
        f"delete the file {path}",
        {path: _text(_lines(rng, 1, 3)), keep: _text(_lines(rng, 1, 3))},
        [f"rm {path}"],
        [_a("file_absent", path), _a("file_exists", keep)],
    )


def _rename(rng: random.Random) -> dict:
    old, new = (_file(rng, s) for s in rng.sample(NAMES, 2))
    content = _text(_lines(rng, 1, 3))
    return _task(
        "rename",
        f"rename {old} to {new}",
        {old: content},
        [f"mv {old} {new}"],
        [_a("file_absent", old), _a("file_equals", new, content=content)],
    )


def _copy(rng: random.Random) -> dict:
    src, dst = (_file(rng, s) for s in rng.sample(NAMES, 2))
    content = _text(_lines(rng, 1, 3))
    return _task(
        "copy",
        f"copy {src} to {dst}",
        {src: content},
        [f"cp {src} {dst}"],
        [_a("file_equals", src, content=content), _a("file_equals", dst, content=content)],
    )


def _dir_and_file(rng: random.Random) -> dict:
    folder, stem = rng.sample(NAMES, 2)
    path, word = f"{folder}/{_file(rng, stem)}", rng.choice(CONTENT)
    return _task(
        "dir_and_file",
        f"create a directory named {folder} and a file {path} containing {word}",
        {},
        [f"mkdir {folder}", f"echo {word} > {path}"],
        [_a("dir_exists", folder), _a("file_exists", path), _a("file_equals", path, content=word)],
    )


# level 1: two or three commands, 4-6 assertions ---------------------------------------------------------------------


def _move_into(rng: random.Random) -> dict:
    stem, folder, other = rng.sample(NAMES, 3)
    path, keep = _file(rng, stem), _file(rng, other)
    content = _text(_lines(rng, 1, 3))
    return _task(
        "move_into",
        f"move {path} into a new directory {folder}",
        {path: content, keep: _text(_lines(rng, 1, 3))},
        [f"mkdir {folder}", f"mv {path} {folder}/"],
        [
            _a("dir_exists", folder),
            _a("file_absent", path),
            _a("file_exists", f"{folder}/{path}"),
            _a("file_equals", f"{folder}/{path}", content=content),
        ],
    )


def _copy_append(rng: random.Random) -> dict:
    src, dst = (_file(rng, s) for s in rng.sample(NAMES, 2))
    lines = _lines(rng, 1, 3)
    word = rng.choice([w for w in CONTENT if w not in lines])
    return _task(
        "copy_append",
        f"copy {src} to {dst} and append the line {word} to {dst}",
        {src: _text(lines)},
        [f"cp {src} {dst}", f"echo {word} >> {dst}"],
        [
            _a("file_equals", src, content=_text(lines)),
            _a("file_exists", dst),
            _a("file_contains", dst, text=lines[0]),
            _a("file_contains", dst, text=word),
            _a("line_count", dst, lines=len(lines) + 1),
        ],
    )


def _dir_two_files(rng: random.Random) -> dict:
    folder, a, b = rng.sample(NAMES, 3)
    pa, pb = f"{folder}/{_file(rng, a)}", f"{folder}/{_file(rng, b)}"
    wa, wb = rng.sample(CONTENT, 2)
    return _task(
        "dir_two_files",
        f"create a directory {folder} with a file {pa} containing {wa} and a file {pb} containing {wb}",
        {},
        [f"mkdir {folder}", f"echo {wa} > {pa}", f"echo {wb} > {pb}"],
        [
            _a("dir_exists", folder),
            _a("file_exists", pa),
            _a("file_equals", pa, content=wa),
            _a("file_exists", pb),
            _a("file_equals", pb, content=wb),
        ],
    )


def _clean_and_write(rng: random.Random) -> dict:
    folder, inner, other, stem = rng.sample(NAMES, 4)
    old, keep, path = f"{folder}/{_file(rng, inner)}", _file(rng, other), _file(rng, stem)
    word = rng.choice(CONTENT)
    return _task(
        "clean_and_write",
        f"delete the directory {folder} with everything in it and create a file {path} containing {word}",
        {old: _text(_lines(rng, 1, 3)), keep: _text(_lines(rng, 1, 3))},
        [f"rm -r {folder}", f"echo {word} > {path}"],
        [
            _a("file_absent", folder),
            _a("file_absent", old),
            _a("file_exists", keep),
            _a("file_exists", path),
            _a("file_equals", path, content=word),
        ],
    )


def _three_lines(rng: random.Random) -> dict:
    path = _file(rng, rng.choice(NAMES))
    words = rng.sample(CONTENT, 3)
    return _task(
        "three_lines",
        f"write the lines {words[0]}, {words[1]} and {words[2]} to {path}, one per line",
        {},
        [f"echo {words[0]} > {path}", f"echo {words[1]} >> {path}", f"echo {words[2]} >> {path}"],
        [_a("file_exists", path), _a("line_count", path, lines=3)]
        + [_a("file_contains", path, text=w) for w in words]
        + [_a("file_equals", path, content=_text(words))],
    )


# level 4 (level 2 before): the answer must be read from the file system first ----------------------------------------


def _count_lines(rng: random.Random) -> dict:
    src, dst = (_file(rng, s) for s in rng.sample(NAMES, 2))
    lines = _lines(rng, 2, 9)
    return _task(
        "count_lines",
        f"write the number of lines in {src} to {dst}",
        {src: _text(lines)},
        [f"wc -l {src}", f"echo {len(lines)} > {dst}"],
        [
            _a("file_exists", dst),
            _a("file_equals", dst, content=str(len(lines))),
            _a("line_count", dst, lines=1),
            _a("file_equals", src, content=_text(lines)),
        ],
    )


def _key_value(rng: random.Random) -> dict:
    src, dst = (_file(rng, s) for s in rng.sample(NAMES, 2))
    keys = rng.sample(KEYS, rng.randint(2, 4))
    values = [rng.choice(CONTENT) for _ in keys]
    key = rng.choice(keys)
    value = values[keys.index(key)]
    content = _text([f"{k}={v}" for k, v in zip(keys, values, strict=True)])
    return _task(
        "key_value",
        f"write the value of {key} in {src} to {dst}",
        {src: content},
        [f"grep {key} {src}", f"echo {value} > {dst}"],
        [
            _a("file_exists", dst),
            _a("file_equals", dst, content=value),
            _a("line_count", dst, lines=1),
            _a("file_equals", src, content=content),
        ],
    )


def _count_matches(rng: random.Random) -> dict:
    src, dst = (_file(rng, s) for s in rng.sample(NAMES, 2))
    pool = rng.sample(CONTENT, 4)
    word = pool[0]
    lines = [" ".join(rng.sample(pool, rng.randint(1, 2))) for _ in range(rng.randint(3, 7))]
    count = sum(word in line.split() for line in lines)
    return _task(
        "count_matches",
        f"write how many lines of {src} contain {word} to {dst}",
        {src: _text(lines)},
        [f"grep -c {word} {src}", f"echo {count} > {dst}"],
        [
            _a("file_exists", dst),
            _a("file_equals", dst, content=str(count)),
            _a("line_count", dst, lines=1),
            _a("file_equals", src, content=_text(lines)),
        ],
    )


def _find_file(rng: random.Random) -> dict:
    folder, dst_stem, *stems = rng.sample(NAMES, 5)
    word, *others = rng.sample(CONTENT, 7)
    paths = [f"{folder}/{_file(rng, s)}" for s in stems]
    contents = [_text(rng.sample(others, 2)) for _ in paths]
    hit = rng.randrange(len(paths))
    contents[hit] = _text(rng.sample([word, rng.choice(others)], 2))
    dst = _file(rng, dst_stem)
    return _task(
        "find_file",
        f"copy the file in {folder} that contains {word} to {dst}",
        dict(zip(paths, contents, strict=True)),
        [f"grep -r {word} {folder}", f"cp {paths[hit]} {dst}"],
        [
            _a("file_exists", dst),
            _a("file_equals", dst, content=contents[hit]),
            _a("file_contains", dst, text=word),
            _a("file_exists", paths[hit]),
        ],
    )


def _head_dir(rng: random.Random) -> dict:
    stem, folder = rng.sample(NAMES, 2)
    path = _file(rng, stem)
    content = _text([folder, *_lines(rng, 1, 3)])
    return _task(
        "head_dir",
        f"create a directory named after the first line of {path} and move {path} into it",
        {path: content},
        [f"head -n 1 {path}", f"mkdir {folder}", f"mv {path} {folder}/"],
        [
            _a("dir_exists", folder),
            _a("file_absent", path),
            _a("file_exists", f"{folder}/{path}"),
            _a("file_equals", f"{folder}/{path}", content=content),
        ],
    )


# levels 1 and 2: a long checklist of small steps, the terminal naming the next one -----------------------------------


def _describe(command: str, memory: dict | None = None) -> str:
    """The words that name a command in a checklist (its `next:` line); the inverse of the expert's command forms.

    >>> _describe("echo apple >> logs/a.txt"), _describe("mv a.txt logs/"), _describe("mv a.txt b.md")
    ('append apple to logs/a.txt', 'move a.txt into logs', 'rename a.txt to b.md')
    >>> _describe("echo ruby > b.md", {"path": "k.txt", "code": "ruby"})
    'write the code from k.txt to b.md'
    """
    match _argv(command):
        case ["submit"]:
            return "submit"
        case ["cat", path]:
            return f"read {path}"
        case ["mkdir", path] | ["mkdir", "-p", path]:
            return f"create the directory {path}"
        case ["echo", word, ">", path] if memory and word == memory["code"]:
            return f"write the code from {memory['path']} to {path}"
        case ["echo", word, ">", path]:
            return f"write {word} to {path}"
        case ["echo", word, ">>", path]:
            return f"append {word} to {path}"
        case ["cp", src, dst]:
            return f"copy {src} to {dst}"
        case ["mv", src, dst] if dst.endswith("/"):
            return f"move {src} into {dst[:-1]}"
        case ["mv", src, dst]:
            return f"rename {src} to {dst}"
        case ["rm", path]:
            return f"delete {path}"
        case ["rm", "-r", path]:
            return f"delete the directory {path}"
        case ["touch", path]:
            return f"create the empty file {path}"
        case ["cd", "/"]:
            return "go back to /"
    return f"run {command}"


#: per long-horizon level: the middle steps' count (besides the read, the first mkdir, deleting the key file and the
#: final write of the code), the most turns an episode may take, and the step kinds drawn for the middle
_CHECKLIST = {1: ((4, 5), 16), 2: ((10, 13), 28)}
_STEP_KINDS = ("write", "append", "copy", "rename", "move", "delete", "mkdir")


def _checklist(rng: random.Random, level: int) -> dict:
    """A checklist task: read the key file (its code is shown once), many small steps each named in the instruction
    and, one at a time, by the terminal's `next:` line, delete the key file, then write the code into a new file.

    Every file a step reads or moves has a distractor beside it with the same stem and another extension (the key
    file's holds another code); the checks keep each distractor unchanged. Each step works on its own paths, so a
    step's checks still hold after every later step."""
    stems = rng.sample(NAMES, len(NAMES))
    extension = {}  # stem -> the extension its file got, so its distractor gets another

    def new_file(stem: str) -> str:
        extension[stem] = rng.choice(EXTENSIONS)
        return f"{stem}.{extension[stem]}"

    def distractor(stem: str) -> str:
        return f"{stem}.{rng.choice([e for e in EXTENSIONS if e != extension[stem]])}"

    key_stem = stems.pop()
    key = new_file(key_stem)
    code, decoy_code = rng.sample(CODES, 2)
    decoy = distractor(key_stem)
    # the code is a word inside the key file's line, never the whole of any file: no copy, move or redirect of a file
    # (nor of a line, as grep, head and tail give) makes the target hold the code alone; only typing it does
    files = {key: f"{KEY_LABEL} {code}\n", decoy: f"{KEY_LABEL} {decoy_code}\n"}
    dirs = [stems.pop()]
    solution = [f"cat {key}", f"mkdir {dirs[0]}"]
    assertions = [_a("dir_exists", dirs[0])]
    kept: list[str] = [decoy]  # distractors, checked unchanged

    def existing() -> tuple[str, str]:
        stem = stems.pop()
        path, content = new_file(stem), _text(_lines(rng, 1, 2))
        other = distractor(stem)
        files[path], files[other] = content, _text(rng.sample([w for w in CONTENT if f"{w}\n" not in content], 2))
        kept.append(other)
        return path, content

    def place(stem: str) -> str:
        return f"{rng.choice(dirs)}/{new_file(stem)}" if rng.random() < 0.5 else new_file(stem)

    lo, hi = _CHECKLIST[level][0]
    kinds = [rng.choice(_STEP_KINDS) for _ in range(rng.randint(lo, hi))]
    for kind in kinds:
        if kind == "write":
            path, word = place(stems.pop()), rng.choice(CONTENT)
            solution.append(f"echo {word} > {path}")
            assertions.append(_a("file_equals", path, content=word))
        elif kind == "mkdir":
            dirs.append(stems.pop())
            solution.append(f"mkdir {dirs[-1]}")
            assertions.append(_a("dir_exists", dirs[-1]))
        else:
            src, content = existing()
            if kind == "append":
                word = rng.choice([w for w in CONTENT if f"{w}\n" not in content])
                solution.append(f"echo {word} >> {src}")
                assertions.append(_a("file_equals", src, content=f"{content}{word}\n"))
            elif kind == "copy":
                dst = place(stems.pop())
                solution.append(f"cp {src} {dst}")
                assertions += [_a("file_equals", dst, content=content), _a("file_equals", src, content=content)]
            elif kind == "rename":
                dst = new_file(stems.pop())
                solution.append(f"mv {src} {dst}")
                assertions += [_a("file_absent", src), _a("file_equals", dst, content=content)]
            elif kind == "move":
                folder = rng.choice(dirs)
                solution.append(f"mv {src} {folder}/")
                assertions += [_a("file_absent", src), _a("file_equals", f"{folder}/{src}", content=content)]
            else:  # delete
                solution.append(f"rm {src}")
                assertions.append(_a("file_absent", src))
    # the key file goes in the second half of the middle steps, so the code is shown only turns before it is needed
    at = rng.randint(2 + (len(kinds) + 1) // 2, len(solution))
    solution.insert(at, f"rm {key}")
    assertions.append(_a("file_absent", key))
    target = place(stems.pop())
    solution.append(f"echo {code} > {target}")
    assertions.append(_a("file_equals", target, content=code))
    assertions += [_a("file_equals", path, content=files[path]) for path in kept]
    memory = {"path": key, "code": code, "decoy": decoy, "decoy_code": decoy_code}
    steps = "; ".join(_describe(c, memory) for c in solution)
    task = _task("checklist", f"do these steps in order, then submit: {steps}", files, solution, assertions)
    return {**task, "memory": memory}


def _checklist_short(rng: random.Random) -> dict:
    return _checklist(rng, 1)


def _checklist_long(rng: random.Random) -> dict:
    return _checklist(rng, 2)


LEVELS: dict[int, tuple[Callable[[random.Random], dict], ...]] = {
    0: (_write, _make_dir, _delete, _rename, _copy, _dir_and_file),
    1: (_checklist_short,),
    2: (_checklist_long,),
    3: (_move_into, _copy_append, _dir_two_files, _clean_and_write, _three_lines),
    4: (_count_lines, _key_value, _count_matches, _find_file, _head_dir),
}
#: the number a level's tasks are seeded with: levels 3 and 4 were levels 1 and 2, and draw the same tasks as then
_SEED_LEVEL = {3: 1, 4: 2}


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
    max_turns = 8  # levels 0, 3 and 4; the long-horizon levels set their own (`_CHECKLIST`)
    #: 1: levels 1 and 2 are the checklists (a build of the former 1 or 2 is stale); 2: the key file's line is
    #: `code: <code>`, so moving it onto the target no longer passes the last check
    level_demo_versions = {1: 2, 2: 2}
    #: the checklists need a longer warm start than level 0's 300 steps (bench/results/terminal_levels/)
    tiny_level_sft_steps = {1: 2000, 2: 2000}

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        if difficulty in _CHECKLIST:  # the long-horizon levels: their own budget and skill
            self.max_turns = _CHECKLIST[difficulty][1]
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
        level = f"long{difficulty}" if difficulty in _CHECKLIST else _SEED_LEVEL.get(difficulty, difficulty)
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
        return f"next: {_describe(self._expert()[0], self._memory)}\n" if self._memory else ""

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done:
            return "the episode is over", 0.0, True, self._info(final=True)
        command = _command_line(action)
        if command.lower() in SUBMIT_WORDS:
            self.done = True
            info = self._info(final=True)
            passed, total = info["assertions_passed"] - 1, info["assertions_total"] - 1  # the task's, not `submitted`
            return f"submitted: {passed}/{total} checks pass", float(info["success"]), True, info
        output = self.shell.run(command)
        self._history.append(command)
        if self._memory and self._memory["code"] in output.split():
            self._seen = True
        observation = (_truncate(output) + "\n" if output else "") + self._next_line() + "$ "
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
        if memory and not self._seen and memory["code"] in self.shell.files.get(_norm(memory["path"]), "").split():
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
        absent = [_norm(a["path"]) for a in assertions if a["kind"] == "file_absent"]
        for assertion in failing:
            if assertion["kind"] != "file_absent" and (command := self._fix(assertion, target, absent)):
                return command
        for assertion in failing:
            if assertion["kind"] == "file_absent":
                path = _norm(assertion["path"])
                return f"rm -r {q(path)}" if shell.is_dir(path) else f"rm {q(path)}"
        return "submit"

    def _fix(self, assertion: dict, target: dict[str, str] | None, absent: list[str]) -> str | None:
        shell, path = self.shell, _norm(assertion["path"])
        blocker = next((a for a in _ancestors(path) if a in shell.files), None)
        if blocker is not None:
            return f"rm {q(blocker)}"
        if assertion["kind"] == "dir_exists":
            return f"rm {q(path)}" if path in shell.files else f"mkdir -p {q(path)}"
        if shell.is_dir(path):
            return f"rm -r {q(path)}"
        if not shell.is_dir(_parent(path)):
            return f"mkdir -p {q(_parent(path))}"
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
            memory, argv = self._memory, _argv(expert)
            if argv[:1] == ["cat"]:
                options += [f"cat {q(memory['decoy'])}", base]
            elif len(argv) == 4 and argv[1] == memory["code"]:
                options.append(f"echo {q(memory['decoy_code'])} > {q(argv[3])}")
        return rng.choice(options)

    def _spoil(self, rng: random.Random) -> str:
        positive = [a for a in self.task.get("assertions", []) if a["kind"] != "file_absent"]
        if not positive:
            absent = [a for a in self.task.get("assertions", []) if a["kind"] == "file_absent"]
            return f"mkdir -p {q('/' + _norm(rng.choice(absent)['path']))}" if absent else "ls"
        assertion = rng.choice(positive)
        path = q("/" + _norm(assertion["path"]))
        if assertion["kind"] == "dir_exists":
            return f"rm -r {path}"
        if assertion["kind"] in ("file_equals", "file_contains"):
            expected = str(assertion.get("content", assertion.get("text", ""))).strip()
            return f"echo {rng.choice([w for w in CONTENT if w != expected and expected not in w])} > {path}"
        return f"rm {path}"


def _argv(command: str) -> list[str]:
    try:
        return shlex.split(command)
    except ValueError:
        return []


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
    tokens = _tokenize(command)
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
    tokens = _tokenize(command)
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
