"""The simulated terminal's file system checks and its shell (see the package docstring for the command subset,
the bounds and the assertions)."""

from __future__ import annotations

import re
import shlex
import time
from collections.abc import Callable, Iterable, Iterator

import regex

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


def norm_path(path: str) -> str:
    """A path relative to the root, as stored: no leading or trailing `/`, no `.` or `..`."""
    parts: list[str] = []
    for part in path.split("/"):
        if part == "..":
            if parts:
                parts.pop()
        elif part not in ("", "."):
            parts.append(part)
    return "/".join(parts)


def parent_dir(path: str) -> str:
    return path.rpartition("/")[0]


def ancestors(path: str) -> list[str]:
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
    kind, path = assertion["kind"], norm_path(assertion["path"])
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


def tokenize(line: str) -> list[tuple[str, str]]:
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
        self.files: dict[str, str] = {norm_path(p): c for p, c in (files or {}).items()}
        self.dirs: set[str] = {norm_path(d) for d in (dirs or [])} - {""}
        for path in list(self.files) + list(self.dirs):  # parents of everything exist
            self.dirs.update(ancestors(path))
        self.cwd = norm_path(cwd)
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
        return norm_path(arg if arg.startswith("/") else f"{self.cwd}/{arg}")

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
        parent = parent_dir(path)
        if self.is_dir(parent):
            return ""
        if parent in self.files or any(a in self.files for a in ancestors(parent)):
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
            sequence = _parse(tokenize(line))
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
                if any(a in self.files for a in ancestors(path)):
                    err += f"mkdir: cannot create directory '{arg}': Not a directory\n"
                else:
                    self.dirs.update([*ancestors(path), path])
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
            if into:
                target, target_arg = norm_path(f"{dst}/{base}"), f"{dst_arg.rstrip('/')}/{base}"
            else:
                target, target_arg = dst, dst_arg

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


def command_line(action: str) -> str:
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


def truncate_output(text: str, max_words: int = MAX_OUTPUT_WORDS, max_chars: int = MAX_OUTPUT_CHARS) -> str:
    """The text cut after `max_words` words or `max_chars` characters, whichever comes first, with a marker."""
    head = text[:max_chars]
    words = list(re.finditer(r"\S+", head))
    if len(words) > max_words:
        return head[: words[max_words - 1].end()] + " ...(truncated)"
    return head + " ...(truncated)" if len(text) > max_chars else text


def command_words(command: str) -> list[str]:
    """The words of a command line as the shell splits them (shlex, POSIX); [] when it does not split."""
    try:
        return shlex.split(command)
    except ValueError:
        return []
