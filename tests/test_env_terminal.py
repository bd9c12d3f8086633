"""Contract tests of the simulated terminal (`envs/terminal.py`): seeded tasks, disjoint splits, the expert, noisy
actions, the assertion counts, shell semantics, state keys, the time and size bounds on hostile commands, and that no
host command is ever run. Offline and fast."""

from __future__ import annotations

import ast
import builtins
import json
import os
import random
import shlex
import subprocess
import time
import tracemalloc
from pathlib import Path

import pytest

import envs.terminal as terminal
from envs.base import split_of
from envs.terminal import ASSERTION_KINDS, CONTENT, KEYS, Shell, TerminalEnv, check_assertions

LEVELS = (0, 1, 2)
READ_COMMANDS = ("wc", "grep", "head", "cat", "ls", "tail")


def play_expert(task: dict) -> list[tuple[str, str, float, bool, dict]]:
    """One expert episode within `max_turns`; returns [(action, observation, reward, done, info), ...]."""
    env = TerminalEnv(task["difficulty"])
    env.reset(task)
    steps = []
    for _ in range(env.max_turns):
        action = env.expert_action()
        steps.append((action, *env.step(action)))
        if steps[-1][3]:
            break
    return steps


def shell(files: dict[str, str] | None = None, dirs: list[str] | None = None) -> Shell:
    return Shell(files or {}, dirs or [])


# ---------------------------------------------------------------------------------------------------------------------
# Tasks and splits
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("difficulty", LEVELS)
def test_make_tasks_is_seeded(difficulty):
    a = TerminalEnv.make_tasks("train", 30, seed=3, difficulty=difficulty)
    b = TerminalEnv.make_tasks("train", 30, seed=3, difficulty=difficulty)
    c = TerminalEnv.make_tasks("train", 30, seed=4, difficulty=difficulty)
    assert a == b
    assert [t["task_id"] for t in a] != [t["task_id"] for t in c]


@pytest.mark.parametrize("difficulty", LEVELS)
def test_tasks_are_distinct_json_and_well_formed(difficulty):
    tasks = TerminalEnv.make_tasks("eval", 100, seed=0, difficulty=difficulty)
    assert json.loads(json.dumps(tasks)) == tasks
    assert len({t["task_id"] for t in tasks}) == len({t["instruction"] for t in tasks}) == 100
    for t in tasks:
        assert t["env"] == "terminal" and t["difficulty"] == difficulty and t["split"] == "eval"
        assert {a["kind"] for a in t["assertions"]} <= set(ASSERTION_KINDS)
        lo, hi = (1, 3) if difficulty == 0 else (3, 6)
        assert lo <= len(t["assertions"]) <= hi, t
        assert 1 <= len(t["solution"]) <= 3
        # the initial state is not already a solution
        start = Shell(t["files"], t["dirs"])
        assert not all(check_assertions(start.files, start.dirs, t["assertions"]))


@pytest.mark.parametrize("difficulty", LEVELS)
def test_train_and_eval_never_share_a_task(difficulty):
    train = TerminalEnv.make_tasks("train", 200, seed=0, difficulty=difficulty)
    train_other_seed = TerminalEnv.make_tasks("train", 200, seed=1, difficulty=difficulty)
    evals = TerminalEnv.make_tasks("eval", 200, seed=0, difficulty=difficulty)
    eval_instructions = {t["instruction"] for t in evals}
    assert not eval_instructions & {t["instruction"] for t in train + train_other_seed}
    assert not {t["task_id"] for t in evals} & {t["task_id"] for t in train + train_other_seed}
    assert all(split_of(f"terminal|{t['instruction']}") == "eval" for t in evals)
    assert all(split_of(f"terminal|{t['instruction']}") == "train" for t in train)


def test_make_tasks_rejects_bad_arguments():
    with pytest.raises(ValueError):
        TerminalEnv.make_tasks("test", 3)
    with pytest.raises(ValueError):
        TerminalEnv.make_tasks("train", 3, difficulty=7)


def test_word_lists_make_greps_exact():
    # a grep for one word must hit exactly the lines holding that word (level-2 tasks count and find by grep)
    words = CONTENT + KEYS
    assert len(set(words)) == len(words)
    assert not [(a, b) for a in words for b in words if a != b and a in b]


# ---------------------------------------------------------------------------------------------------------------------
# The expert
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("difficulty", LEVELS)
def test_expert_passes_every_assertion_within_max_turns(difficulty):
    tasks = TerminalEnv.make_tasks("train", 200, difficulty=difficulty) + TerminalEnv.make_tasks(
        "eval", 200, difficulty=difficulty
    )
    for task in tasks:
        steps = play_expert(task)
        actions = [s[0] for s in steps]
        *middle, (_, _, reward, done, info) = steps
        assert actions == [*task["solution"], "submit"], task["instruction"]
        assert done and reward == 1.0 and info["success"] is True
        assert info["assertions_passed"] == info["assertions_total"] == len(task["assertions"])
        assert all(s[2] == 0.0 and not s[3] and s[4]["success"] is False for s in middle)
        assert all(isinstance(s[4]["assertions_passed"], int) for s in steps)


def test_expert_level0_copies_every_argument_from_the_instruction():
    for task in TerminalEnv.make_tasks("train", 200, difficulty=0):
        words = set(task["instruction"].split())
        for command in task["solution"]:
            prog, *args = shlex.split(command)
            assert {a for a in args if not a.startswith("-") and a not in (">", ">>")} <= words, command


def test_level2_answer_is_in_the_output_of_the_read_command():
    for task in TerminalEnv.make_tasks("train", 200, difficulty=2):
        read, *writes = task["solution"]
        assert read.split()[0] in READ_COMMANDS
        env = TerminalEnv(2)
        env.reset(task)
        key = env.state_key()
        output, *_ = env.step(read)
        assert env.state_key() == key  # reading changes nothing
        hidden = {w.rstrip("/") for c in writes for w in shlex.split(c)[1:]} - set(task["instruction"].split())
        hidden -= {">", ">>", "-p"}
        assert hidden and all(w in output for w in hidden), (task["instruction"], output, hidden)


# ---------------------------------------------------------------------------------------------------------------------
# Noisy actions and the assertion count
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("difficulty", LEVELS)
def test_noisy_last_step_fails_with_a_partial_count(difficulty):
    rng = random.Random(difficulty)
    partial = 0
    for task in TerminalEnv.make_tasks("eval", 100, seed=5, difficulty=difficulty):
        env = TerminalEnv(difficulty)
        env.reset(task)
        for _ in task["solution"][:-1]:
            env.step(env.expert_action())
        expert = env.expert_action()
        noisy = env.noisy_action(rng)
        assert noisy != expert
        _, reward, done, info = env.step(noisy)
        if not done:
            _, reward, done, info = env.step("submit")
        assert done and reward == 0.0 and info["success"] is False, (task["instruction"], noisy)
        assert info["assertions_passed"] < info["assertions_total"]
        partial += info["assertions_passed"] > 0
        if difficulty > 0:  # several assertions: earlier steps and untouched files still count
            assert info["assertions_passed"] > 0, (task["instruction"], noisy)
    assert partial > 0


def noisy_samples(task: dict, prefix: int = 0, draws: int = 200) -> set[str]:
    """Noisy actions drawn with many seeds after the first `prefix` solution steps."""
    seen = set()
    for seed in range(draws):
        env = TerminalEnv(task["difficulty"])
        env.reset(task)
        for command in task["solution"][:prefix]:
            env.step(command)
        seen.add(env.noisy_action(random.Random(seed)))
    return seen


def test_noisy_actions_cover_the_documented_mistakes():
    write = next(t for t in TerminalEnv.make_tasks("train", 50, difficulty=0) if t["kind"] == "write")
    (expert,) = write["solution"]  # echo WORD > PATH
    _, word, _, path = expert.split()
    seen = noisy_samples(write)
    assert expert not in seen
    assert "submit" in seen  # early submit
    wrong_content = {s for s in seen if s.startswith("echo ") and s.endswith(f"> {path}")}
    wrong_name = {s for s in seen if s.startswith(f"echo {word} > ")} - {expert}
    assert wrong_content and wrong_name
    assert seen == {"submit"} | wrong_content | wrong_name
    move = next(t for t in TerminalEnv.make_tasks("train", 50, difficulty=1) if t["kind"] == "move_into")
    assert move["solution"][1] in noisy_samples(move)  # a skipped step: mv before mkdir
    count = next(t for t in TerminalEnv.make_tasks("train", 50, difficulty=2) if t["kind"] == "count_lines")
    guesses = noisy_samples(count) - {"submit"}  # instead of reading, write a wrong guess
    assert guesses and all(g.startswith("echo ") and g != count["solution"][1] for g in guesses)


def test_noisy_action_after_success_spoils_a_checked_file():
    task = TerminalEnv.make_tasks("train", 1, difficulty=0)[0]
    env = TerminalEnv(0)
    env.reset(task)
    for command in task["solution"]:
        env.step(command)
    assert env.expert_action() == "submit"
    _, _, _, info = env.step(env.noisy_action(random.Random(0)))
    assert info["assertions_passed"] < info["assertions_total"]


@pytest.mark.parametrize("difficulty", LEVELS)
def test_expert_recovers_from_noisy_states(difficulty):
    rng = random.Random(difficulty)
    for task in TerminalEnv.make_tasks("train", 100, seed=2, difficulty=difficulty):
        env = TerminalEnv(difficulty)
        env.reset(task)
        for turn in range(20):
            action = env.expert_action()
            if turn < 4 and rng.random() < 0.5:
                action = env.noisy_action(rng)
                action = "ls" if action == "submit" else action
            _, reward, done, info = env.step(action)
            if done:
                break
        assert done and info["success"] and reward == 1.0, (task["instruction"], env.shell.files)


def test_assertion_count_tracks_progress():
    env = TerminalEnv(1)
    task = next(t for t in TerminalEnv.make_tasks("train", 50, difficulty=1) if t["kind"] == "three_lines")
    env.reset(task)
    counts = [env.step(c)[3]["assertions_passed"] for c in task["solution"]]
    # after line 1: exists + contains w1; line 2: + contains w2; line 3: + line_count + contains w3 + equals
    assert counts == [2, 3, 6]
    assert env.step("rm " + task["assertions"][0]["path"])[3]["assertions_passed"] == 0


def test_check_assertions_kinds():
    files, dirs = {"d/a.txt": "x\ny\n", "b.txt": ""}, {"d"}
    assertions = [
        {"kind": "file_exists", "path": "d/a.txt"},
        {"kind": "file_exists", "path": "d"},  # a directory is not a file
        {"kind": "file_absent", "path": "c.txt"},
        {"kind": "file_absent", "path": "d"},
        {"kind": "dir_exists", "path": "/d/"},
        {"kind": "file_equals", "path": "d/a.txt", "content": "x\ny"},
        {"kind": "file_equals", "path": "b.txt", "content": "x"},
        {"kind": "file_contains", "path": "d/a.txt", "text": "y"},
        {"kind": "line_count", "path": "d/a.txt", "lines": 2},
        {"kind": "line_count", "path": "missing.txt", "lines": 0},
    ]
    assert check_assertions(files, dirs, assertions) == [
        True,
        False,
        True,
        False,
        True,
        True,
        False,
        True,
        True,
        False,
    ]


# ---------------------------------------------------------------------------------------------------------------------
# The environment protocol
# ---------------------------------------------------------------------------------------------------------------------


def test_reset_and_observations_are_short():
    task = TerminalEnv.make_tasks("train", 1, difficulty=0)[0]
    env = TerminalEnv(0)
    assert env.reset(task) == f"Task: {task['instruction']}\n$ "
    assert env.step("echo hi")[0] == "hi\n$ "
    assert env.step("mkdir zz")[0] == "$ "
    env.step("echo " + " ".join(CONTENT[:30]) + " > long.txt")
    env.step("echo " + " ".join(CONTENT[:30]) + " >> long.txt")
    observation = env.step("cat long.txt")[0]
    assert observation.endswith(" ...(truncated)\n$ ")
    assert len(observation.split()) == 40 + 2  # 40 words, the marker, the prompt


def test_action_text_is_parsed_from_the_turn():
    env = TerminalEnv(0)
    env.reset({"instruction": "x", "files": {"a.txt": "hi\n"}, "assertions": []})
    assert env.step("```bash\n$ cat a.txt\n```")[0] == "hi\n$ "
    assert env.step("`cat a.txt`")[0] == "hi\n$ "
    assert env.step("cat a.txt\nrm a.txt")[0] == "hi\n$ "  # one command per turn: the first line
    assert "a.txt" in env.shell.files


@pytest.mark.parametrize("word", ["submit", "done", "exit", " Submit \n"])
def test_submit_words_end_the_episode(word):
    task = TerminalEnv.make_tasks("train", 1, difficulty=0)[0]
    env = TerminalEnv(0)
    env.reset(task)
    _, reward, done, info = env.step(word)
    assert done and reward == 0.0 and info["success"] is False
    assert env.step("ls")[2] is True  # stepping after the end neither raises nor reopens the episode


def test_all_assertions_passing_is_not_success_before_submit():
    task = TerminalEnv.make_tasks("train", 1, difficulty=0)[0]
    env = TerminalEnv(0)
    env.reset(task)
    for command in task["solution"]:
        _, reward, done, info = env.step(command)
    assert info["assertions_passed"] == info["assertions_total"] and not done
    assert reward == 0.0 and info["success"] is False


def test_state_key():
    task = TerminalEnv.make_tasks("train", 1, difficulty=1)[0]
    a, b = TerminalEnv(1), TerminalEnv(1)
    a.reset(task)
    b.reset(task)
    start = a.state_key()
    assert start == b.state_key() and len(start) == 16
    a.step("ls")
    a.step("cat nothing.txt")
    assert a.state_key() == start  # reading and failing change nothing
    a.step("mkdir tmpdir")
    assert a.state_key() != start
    a.step("cd tmpdir")
    in_dir = a.state_key()
    assert in_dir != start  # the working directory is part of the state
    a.step("cd ..")
    a.step("rm -r tmpdir")
    assert a.state_key() == start
    b.step("echo x > y.txt")
    assert b.state_key() not in (start, in_dir)


# ---------------------------------------------------------------------------------------------------------------------
# Shell semantics
# ---------------------------------------------------------------------------------------------------------------------


def test_redirection_and_append():
    sh = shell()
    assert sh.run("echo apple > a.txt") == ""
    sh.run("echo banana >> a.txt")
    sh.run("echo -n kiwi >> a.txt")
    assert sh.files["a.txt"] == "apple\nbanana\nkiwi"
    sh.run("echo fresh > a.txt")
    assert sh.run("cat a.txt") == "fresh"
    sh.run("echo hi>b.txt")  # operators need no spaces
    assert sh.files["b.txt"] == "hi\n"
    assert sh.run("cat missing.txt > c.txt") == "cat: missing.txt: No such file or directory"
    assert sh.files["c.txt"] == ""  # bash opens the redirection before the command runs
    assert sh.run("echo x > nodir/d.txt") == "bash: nodir/d.txt: No such file or directory"
    sh.run("mkdir d")
    assert sh.run("echo x > d") == "bash: d: Is a directory"


def test_quoting():
    sh = shell()
    sh.run("echo \"hello   world\" > 'my file.txt'")
    assert sh.files["my file.txt"] == "hello   world\n"
    assert sh.run("echo '>' a\\ b \"|\"") == "> a b |"
    assert sh.run("echo 'open") == "bash: syntax error: unterminated quoted string"
    assert sh.run("echo >") == "bash: syntax error near unexpected token `newline'"
    assert sh.run("| cat") == "bash: syntax error near unexpected token `|'"


def test_unknown_command_and_bad_options():
    sh = shell()
    assert sh.run("foo bar") == "bash: foo: command not found"
    assert sh.run("I will now create the file") == "bash: I: command not found"
    assert sh.run("ls -z") == "ls: invalid option -- 'z'"
    assert sh.run("head -n x a.txt") == "head: invalid number of lines: 'x'"
    assert sh.run("mv a.txt") == "mv: missing destination file operand after 'a.txt'"
    assert sh.run("rm") == "rm: missing operand"
    assert sh.run("") == ""


def test_ls_cat_and_missing_files():
    sh = shell({"b.txt": "one\ntwo\n", "d/c.md": "x\n"})
    assert sh.run("ls") == "b.txt  d/"
    assert sh.run("ls d") == "c.md"
    assert sh.run("ls nope") == "ls: cannot access 'nope': No such file or directory"
    assert sh.run("cat b.txt d/c.md") == "one\ntwo\nx"
    assert sh.run("cat x") == "cat: x: No such file or directory"
    assert sh.run("cat d") == "cat: d: Is a directory"


def test_mkdir_touch_cd_pwd():
    sh = shell()
    assert sh.run("mkdir a/b") == "mkdir: cannot create directory 'a/b': No such file or directory"
    sh.run("mkdir -p a/b")
    assert {"a", "a/b"} <= sh.dirs
    assert sh.run("mkdir a") == "mkdir: cannot create directory 'a': File exists"
    assert sh.run("mkdir -p a") == ""
    sh.run("cd a/b")
    assert sh.run("pwd") == "/a/b"
    sh.run("touch t.txt")
    assert sh.files["a/b/t.txt"] == ""
    sh.run("cd ..")
    assert sh.run("pwd") == "/a"
    assert sh.run("cd nowhere") == "bash: cd: nowhere: No such file or directory"
    assert sh.run("cd b/t.txt") == "bash: cd: b/t.txt: Not a directory"
    sh.run("cd")
    assert sh.run("pwd") == "/"
    assert sh.run("touch x/y.txt") == "touch: cannot touch 'x/y.txt': No such file or directory"


def test_mv_and_cp():
    sh = shell({"a.txt": "A\n", "b.txt": "B\n"}, ["logs"])
    sh.run("mv a.txt logs")  # into an existing directory
    assert "a.txt" not in sh.files and sh.files["logs/a.txt"] == "A\n"
    sh.run("mv b.txt c.txt")  # rename
    assert sh.files["c.txt"] == "B\n" and "b.txt" not in sh.files
    assert sh.run("mv c.txt new/") == "mv: cannot move 'c.txt' to 'new/': Not a directory"
    assert sh.run("mv ghost.txt logs") == "mv: cannot stat 'ghost.txt': No such file or directory"
    sh.run("cp c.txt logs/")
    assert sh.files["logs/c.txt"] == "B\n" and sh.files["c.txt"] == "B\n"
    assert sh.run("cp logs copy") == "cp: -r not specified; omitting directory 'logs'"
    sh.run("cp -r logs copy")
    assert sh.files["copy/a.txt"] == "A\n" and sh.files["logs/a.txt"] == "A\n"
    sh.run("mv copy logs")
    assert sh.files["logs/copy/c.txt"] == "B\n" and "copy" not in sh.dirs
    assert sh.run("mv logs logs/copy") == "mv: cannot move 'logs' into itself, 'logs/copy/logs'"


def test_rm():
    sh = shell({"d/e/f.txt": "x\n", "g.txt": "y\n"})
    assert sh.run("rm d") == "rm: cannot remove 'd': Is a directory"
    assert sh.run("rm nope") == "rm: cannot remove 'nope': No such file or directory"
    assert sh.run("rm -f nope") == ""
    sh.run("rm -r d")
    assert sh.files == {"g.txt": "y\n"} and sh.dirs == set()
    sh.run("rm g.txt")
    assert sh.files == {}


def test_wc_head_tail_grep_and_pipes():
    sh = shell({"f.txt": "apple pie\nbanana\napple tart\ncherry\n", "d/a.txt": "kiwi\n", "d/b.txt": "apple\n"})
    assert sh.run("wc -l f.txt") == "4 f.txt"
    assert sh.run("wc -w f.txt") == "6 f.txt"
    assert sh.run("wc f.txt") == "4 6 35 f.txt"
    assert sh.run("wc -l < f.txt") == "4"
    assert sh.run("cat f.txt | wc -l") == "4"
    assert sh.run("head -n 1 f.txt") == "apple pie"
    assert sh.run("tail -2 f.txt") == "apple tart\ncherry"
    assert sh.run("grep apple f.txt") == "apple pie\napple tart"
    assert sh.run("grep -c apple f.txt") == "2"
    assert sh.run("grep -v apple f.txt | grep -c a") == "1"
    assert sh.run("grep -r apple d") == "d/b.txt:apple"
    assert sh.run("grep -l apple f.txt d/a.txt d/b.txt") == "f.txt\nd/b.txt"
    assert sh.run("grep kiwi nope.txt") == "grep: nope.txt: No such file or directory"
    assert sh.run("grep -c apple f.txt > n.txt") == ""
    assert sh.files["n.txt"] == "2\n"


def test_sequences():
    sh = shell()
    assert sh.run("mkdir a && echo ok > a/x.txt; cat a/x.txt") == "ok"
    assert sh.run("cat nope && echo never; echo after") == "cat: nope: No such file or directory\nafter"


# ---------------------------------------------------------------------------------------------------------------------
# Bounds: hostile commands end quickly and stay small
# ---------------------------------------------------------------------------------------------------------------------

MARGIN_S = 2.0  # wall-time slack for a loaded 2-core machine
PEAK_BYTES = 8 * 2**20  # Python allocations of a step: 8x the 1 MiB disk and output caps (measured ~1.2 MiB)


def timed(fn, *args):
    """(result, wall seconds, peak bytes traced by tracemalloc) of one call."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        result = fn(*args)
    finally:
        elapsed = time.monotonic() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return result, elapsed, peak


def blank_env(files: dict[str, str]) -> TerminalEnv:
    env = TerminalEnv(0)
    env.reset({"instruction": "x", "files": files, "assertions": []})
    return env


def test_catastrophic_regex_ends_within_the_budget():
    # `(a+)+$` on 28 a's and a `!` tries 2^28 splits in Python's `re` (17.9 s measured); `regex` answers at once
    env = blank_env({"f": "a" * 28 + "!\n"})
    (observation, *_), elapsed, _ = timed(env.step, "grep -E '(a+)+$' f")
    assert observation == "$ "  # the line does not end in a's: no match, nothing printed
    assert elapsed < Shell.time_budget_s + MARGIN_S
    # `(a|aa)+$` on 40 a's and a `!` tries Fibonacci(40) ~ 1e8 splits, too many for `regex` too: it times out
    sh = shell({"f": "a" * 40 + "!\n"})
    sh.time_budget_s = 0.5
    out, elapsed, _ = timed(sh.run, "grep -E '(a|aa)+$' f")
    assert out == "grep: regular expression too complex (timed out)"
    assert 0.4 < elapsed < 0.5 + MARGIN_S


def test_timed_out_grep_leaves_the_shell_usable():
    env = blank_env({"f": "a" * 40 + "!\n"})
    env.shell.time_budget_s = 0.3
    key = env.state_key()
    # the timeout ends the whole command line: the echo after it never runs
    assert env.step("grep -E '(a|aa)+$' f; echo late > g")[0] == "grep: regular expression too complex (timed out)\n$ "
    assert env.state_key() == key
    assert env.step("echo ok > g")[0] == "$ "
    assert env.step("grep -c a f; cat g")[0] == "1\nok\n$ "


def test_time_budget_is_checked_between_commands_and_per_line():
    sh = shell()
    sh.time_budget_s = 0.0
    assert sh.run("echo hi > a.txt") == "bash: time limit exceeded (0s per command line)"
    assert "a.txt" not in sh.files  # stopped before the first command
    # 200k lines take grep about half a second; with a 0.05 s budget it stops partway through them
    sh = shell({"big.txt": "kiwi\n" * 200_000})
    sh.time_budget_s = 0.05
    out, elapsed, _ = timed(sh.run, "grep -c apple big.txt; echo never")
    assert out == "bash: time limit exceeded (0.05s per command line)"
    assert elapsed < 0.05 + MARGIN_S


def test_cat_chain_never_grows_past_the_caps():
    # each turn writes ten copies of the other file: 20 -> 200 -> 2,000 -> 20,000 -> 200,000 characters; the next
    # would be 2,000,000, past the 1 MiB (1,048,576) output cap, so those turns fail and leave the files alone
    env = blank_env({"a": "apple banana cherry\n"})
    tracemalloc.start()
    for turn in range(12):
        src, dst = ("a", "b") if turn % 2 == 0 else ("b", "a")
        start = time.monotonic()
        observation = env.step(f"cat {' '.join([src] * 10)} > {dst}")[0]
        assert time.monotonic() - start < Shell.time_budget_s + MARGIN_S
        assert sum(map(len, env.shell.files.values())) <= Shell.max_disk_chars
        full = turn >= 4 and turn % 2 == 0
        assert observation == ("cat: write error: No space left on device\n$ " if full else "$ "), turn
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < PEAK_BYTES
    assert (len(env.shell.files["a"]), len(env.shell.files["b"])) == (200_000, 20_000)
    # five copies (1,000,000) fit the output cap, but not the disk beside the 220,000 already there
    assert env.step("cat a a a a a > c")[0] == "cat: write error: No space left on device\n$ "
    assert "c" not in env.shell.files
    assert env.step("cat a a a a a a | wc -c")[0] == "cat: write error: No space left on device\n0\n$ "
    # cat stops at the sixth copy of a (1,200,000 > 1,048,576); joined whole, 1,000 copies would be 200 MB
    (observation, *_), _, peak = timed(env.step, "cat" + " a" * 1_000)
    assert observation == "cat: write error: No space left on device\n$ " and peak < PEAK_BYTES


def test_write_past_the_disk_cap_fails_like_a_full_disk():
    sh = shell({"a": "x" * 100})
    sh.max_disk_chars = 400
    assert sh.disk_usage() == 165  # 64 (the entry) + 1 (the path) + 100 (the content)
    assert sh.run("cat a a > b") == "cat: write error: No space left on device"  # b: 64 + 1 + 200 -> 430
    assert sh.files == {"a": "x" * 100}  # as before the command: b, which `>` created, is gone again
    assert sh.run("cat a > b") == ""  # 165 + 165 = 330
    assert sh.run("echo more >> b") == ""  # + 5 = 335
    assert sh.run("touch c") == ""  # + 64 + 1 = 400: exactly full
    assert sh.run("mkdir d") == "mkdir: No space left on device"
    assert sh.run("echo x > e") == "bash: e: No space left on device"  # creating e already fails
    assert "d" not in sh.dirs and "e" not in sh.files
    assert sh.run("rm c; mkdir d") == ""  # 400 - 65 + 65 = 400
    assert sh.run("echo yy >> b") == "bash: echo: write error: No space left on device"
    assert sh.run("echo x > b") == "" and sh.files["b"] == "x\n"  # shrinking a file always works: 297


def test_long_actions_are_refused_quickly_and_observations_are_capped():
    env = blank_env({})
    # one 1 MB word (5 + 1,000,000 characters), and a million characters of words (4 + 3 * 333,333)
    for action, length in (("echo " + "a" * 1_000_000, 1_000_005), ("echo" + " ab" * 333_333, 1_000_003)):
        (observation, *_), elapsed, peak = timed(env.step, action)
        assert observation == f"bash: command line too long ({length} characters, at most 10000)\n$ "
        assert elapsed < Shell.time_budget_s + MARGIN_S and peak < PEAK_BYTES
    assert env.step("echo hi\n" + "x" * 1_000_000)[0] == "hi\n$ "  # only the first line is the command
    # under the line cap, one 9,000-character word is cut at 2,000 characters (the 40-word cut does not see it)
    assert env.step("echo " + "b" * 9_000)[0] == "b" * 2_000 + " ...(truncated)\n$ "


def test_grep_refuses_a_pattern_that_unrolls_too_far():
    # `regex` compiles `(a{1000}){1000}` into a million nodes (about a second, with no timeout): refused up front
    sh = shell({"f": "a\n"})
    for pattern in ("(a{1000}){1000}", "((a{100}){100}){100}"):
        out, elapsed, _ = timed(sh.run, f"grep -E '{pattern}' f")
        assert out == "grep: regular expression too big" and elapsed < 0.5
    assert sh.run("grep -cE 'a{1}' f") == "1"  # small counts are fine


# ---------------------------------------------------------------------------------------------------------------------
# Safety: nothing runs on the host
# ---------------------------------------------------------------------------------------------------------------------


def test_module_imports_nothing_that_reaches_the_host():
    tree = ast.parse(Path(terminal.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    allowed = {"__future__", "collections", "envs", "hashlib", "json", "random", "re", "regex", "shlex", "time"}
    assert imported <= allowed
    assert not {"subprocess", "os", "shutil", "pathlib", "pty"} & imported


def test_episodes_never_call_the_host(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("the simulated terminal touched the host")

    for name in ("run", "Popen", "call", "check_call", "check_output"):
        monkeypatch.setattr(subprocess, name, forbidden)
    for name in ("system", "popen", "remove", "mkdir", "makedirs", "rename", "listdir", "chdir", "rmdir"):
        monkeypatch.setattr(os, name, forbidden)
    monkeypatch.setattr(builtins, "open", forbidden)
    rng = random.Random(0)
    for difficulty in LEVELS:
        for task in TerminalEnv.make_tasks("train", 20, seed=9, difficulty=difficulty):
            env = TerminalEnv(difficulty)
            env.reset(task)
            env.step("rm -rf / ; ls .. ; cat /etc/passwd ; cd / ; pwd")
            env.step(env.noisy_action(rng))
            for _ in range(env.max_turns):
                if env.step(env.expert_action())[2]:
                    break


def test_head_refuses_numbers_int_cannot_read_with_a_bash_error():
    shell = Shell({"a": "x\ny\n"})
    for bad in ("\u00b2", "9" * 5000):  # a superscript two passes str.isdigit; 5,000 digits pass int's limit
        assert shell.run(f"head -n {bad} a").startswith("head: invalid number of lines")
    assert shell.run("head -n 1 a") == "x"
