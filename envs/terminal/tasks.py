"""The simulated terminal's tasks: the word lists and one template per task kind, by difficulty level (see the package
docstring for the levels)."""

from __future__ import annotations

import random
from collections.abc import Callable

from envs.terminal.shell import ancestors, command_words

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
        "dirs": sorted({a for p in files for a in ancestors(p)}),
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


def describe_step(command: str, memory: dict | None = None) -> str:
    """The words that name a command in a checklist (its `next:` line); the inverse of the expert's command forms.

    >>> describe_step("echo apple >> logs/a.txt"), describe_step("mv a.txt logs/"), describe_step("mv a.txt b.md")
    ('append apple to logs/a.txt', 'move a.txt into logs', 'rename a.txt to b.md')
    >>> describe_step("echo ruby > b.md", {"path": "k.txt", "code": "ruby"})
    'write the code from k.txt to b.md'
    """
    match command_words(command):
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
CHECKLIST = {1: ((4, 5), 16), 2: ((10, 13), 28)}
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

    lo, hi = CHECKLIST[level][0]
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
    steps = "; ".join(describe_step(c, memory) for c in solution)
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
SEED_LEVEL = {3: 1, 4: 2}
