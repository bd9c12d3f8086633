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
from envs.terminal import ASSERTION_KINDS, CODES, CONTENT, KEYS, NAMES, Shell, TerminalEnv, check_assertions

LEVELS = (0, 1, 2, 3, 4)
LONG = (1, 2)  # the long-horizon checklist levels
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
        # levels 0, 3, 4: 1-3, 3-6, 3-6 assertions and 1-3 commands. Long levels: read, mkdir, 4-5 (level 2: 10-13)
        # middle steps, rm of the key file, the code's write; a check each (the read none, a middle step 1 or 2 and
        # 1 for its distractor), plus the key's decoy: level 1 has 1+4+3 = 8 to 1+5*3+3 = 19, level 2 14 to 43
        lo, hi = {0: (1, 3), 1: (8, 19), 2: (14, 43)}.get(difficulty, (3, 6))
        assert lo <= len(t["assertions"]) <= hi, t
        lo, hi = {1: (8, 9), 2: (14, 17)}.get(difficulty, (1, 3))
        assert lo <= len(t["solution"]) <= hi
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
    # a grep for one word must hit exactly the lines holding that word (level-4 tasks count and find by grep), and a
    # checklist's code is told from every other word it could be confused with
    words = CONTENT + KEYS + CODES
    assert len(set(words)) == len(words)
    assert not [(a, b) for a in words for b in words if a != b and a in b]
    assert not [(a, b) for a in CODES for b in NAMES if a in b or b in a]


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
        assert info["assertions_passed"] == info["assertions_total"] == len(task["assertions"]) + 1  # + submitted
        assert all(s[2] == 0.0 and not s[3] and s[4]["success"] is False for s in middle)
        # before submit the report's own check fails, whatever the file system holds
        assert all(s[4]["assertions_passed"] < s[4]["assertions_total"] for s in middle)
        assert all(isinstance(s[4]["assertions_passed"], int) for s in steps)


def test_expert_level0_copies_every_argument_from_the_instruction():
    for task in TerminalEnv.make_tasks("train", 200, difficulty=0):
        words = set(task["instruction"].split())
        for command in task["solution"]:
            prog, *args = shlex.split(command)
            assert {a for a in args if not a.startswith("-") and a not in (">", ">>")} <= words, command


def test_level4_answer_is_in_the_output_of_the_read_command():
    for task in TerminalEnv.make_tasks("train", 200, difficulty=4):
        read, *writes = task["solution"]
        assert read.split()[0] in READ_COMMANDS
        env = TerminalEnv(4)
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
    move = next(t for t in TerminalEnv.make_tasks("train", 50, difficulty=3) if t["kind"] == "move_into")
    assert move["solution"][1] in noisy_samples(move)  # a skipped step: mv before mkdir
    count = next(t for t in TerminalEnv.make_tasks("train", 50, difficulty=4) if t["kind"] == "count_lines")
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
        for turn in range(env.max_turns if difficulty in LONG else 20):  # the long levels: within their budget
            action = env.expert_action()
            if turn < 4 and rng.random() < 0.5:
                action = env.noisy_action(rng)
                action = "ls" if action == "submit" else action
            _, reward, done, info = env.step(action)
            if done:
                break
        assert done and info["success"] and reward == 1.0, (task["instruction"], env.shell.files)


def test_assertion_count_tracks_progress():
    env = TerminalEnv(3)
    task = next(t for t in TerminalEnv.make_tasks("train", 50, difficulty=3) if t["kind"] == "three_lines")
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
# The long-horizon levels (1 and 2): a checklist named one step at a time, a code needed long after it was shown
# ---------------------------------------------------------------------------------------------------------------------

# the first training task of level 1 (seed 0); its checks and episode below are worked out by hand from these files
LEVEL1_STEPS = [
    "read vault.txt", "create the directory kappa", "copy omega.txt to kappa/photos.txt",
    "rename docs.txt to assets.csv", "write desert to inbox.txt", "delete vault.txt", "move orders.log into kappa",
    "rename images.md to archive.log", "write the code from vault.txt to report.log",
]  # fmt: skip
LEVEL1_FILES = {
    "vault.txt": "code: east\n", "vault.md": "code: south\n", "omega.txt": "ready\ncopper\n",
    "omega.log": "amber\ndesert\n",
    "docs.txt": "mango\ncopper\n", "docs.log": "ready\ncanyon\n", "orders.log": "coral\nurgent\n",
    "orders.md": "desert\ncherry\n", "images.md": "apple\nbanana\n", "images.txt": "marble\nolive\n",
}  # fmt: skip
LEVEL1_COMMANDS = [
    "cat vault.txt", "mkdir kappa", "cp omega.txt kappa/photos.txt", "mv docs.txt assets.csv",
    "echo desert > inbox.txt", "rm vault.txt", "mv orders.log kappa/", "mv images.md archive.log",
    "echo east > report.log",
]  # fmt: skip


def _a(kind: str, path: str, content: str) -> dict:
    return {"kind": kind, "path": path, "content": content}


def level1_task() -> dict:
    return TerminalEnv.make_tasks("train", 1, seed=0, difficulty=1)[0]


def test_level1_task_is_the_checklist_worked_out_by_hand():
    task = level1_task()
    assert task["instruction"] == "do these steps in order, then submit: " + "; ".join(LEVEL1_STEPS)
    assert task["files"] == LEVEL1_FILES and task["solution"] == LEVEL1_COMMANDS
    assert task["memory"] == {"path": "vault.txt", "code": "east", "decoy": "vault.md", "decoy_code": "south"}
    e = "file_equals"
    expected = [
        ("dir_exists", "kappa", None),
        (e, "kappa/photos.txt", "ready\ncopper\n"), (e, "omega.txt", "ready\ncopper\n"),  # copy: both copies
        ("file_absent", "docs.txt", None), (e, "assets.csv", "mango\ncopper\n"),  # rename
        (e, "inbox.txt", "desert"),
        ("file_absent", "orders.log", None), (e, "kappa/orders.log", "coral\nurgent\n"),  # move
        ("file_absent", "images.md", None), (e, "archive.log", "apple\nbanana\n"),
        ("file_absent", "vault.txt", None),  # the key file goes
        (e, "report.log", "east"),  # the code, shown only by the first command
        # the distractors beside the key and the files the steps touch stay as they were
        (e, "vault.md", "code: south\n"), (e, "omega.log", "amber\ndesert\n"), (e, "docs.log", "ready\ncanyon\n"),
        (e, "orders.md", "desert\ncherry\n"), (e, "images.txt", "marble\nolive\n"),
    ]  # fmt: skip
    got = [(a["kind"], a["path"], a.get("content")) for a in task["assertions"]]
    assert sorted(got, key=str) == sorted(expected, key=str)


def test_level1_hand_played_episode():
    task = level1_task()
    env = TerminalEnv(1)
    assert env.reset(task) == f"Task: {task['instruction']}\nnext: read vault.txt\n$ "
    # checks passing before each command's effect: the 5 distractors and omega.txt (the copy's source) hold at start;
    # then mkdir +1, cp +1, mv +2 (absent, equals), echo +1, rm +1, mv +2, mv +2, the code +1: 17 of 17 assertions;
    # the report's 18th check, submitted, holds only after submit
    passed = [6, 7, 8, 10, 11, 12, 14, 16, 17]
    outputs = ["code: east\n"] + [""] * 8
    for k, command in enumerate(LEVEL1_COMMANDS):
        assert env.expert_action() == command
        observation, reward, done, info = env.step(command)
        following = LEVEL1_STEPS[k + 1] if k + 1 < len(LEVEL1_STEPS) else "submit"
        assert observation == f"{outputs[k]}next: {following}\n$ ", command
        assert (reward, done, info) == (0.0, False, {"assertions_passed": passed[k], "assertions_total": 18,
                                                     "success": False})  # fmt: skip
    assert env.expert_action() == "submit"
    assert env.step("submit") == ("submitted: 17/17 checks pass", 1.0, True,
                                  {"assertions_passed": 18, "assertions_total": 18, "success": True})  # fmt: skip


def test_level1_next_line_follows_mistakes():
    task = level1_task()
    env = TerminalEnv(1)
    env.reset(task)
    # reading the distractor beside the key shows another code: the step stays
    observation, _, _, info = env.step("cat vault.md")
    assert observation == "code: south\nnext: read vault.txt\n$ " and info["assertions_passed"] == 6
    # skipping the read: the step done, but the code must still be read while its file holds it
    assert env.step("mkdir kappa")[0] == "next: read vault.txt\n$ "
    assert env.step("cat vault.txt")[0] == "code: east\nnext: copy omega.txt to kappa/photos.txt\n$ "
    env.step("cp omega.txt kappa/photos.txt")
    env.step("mv docs.txt assets.csv")
    # a wrong word: the same step again, and copying it repairs the file
    assert env.step("echo desrt > inbox.txt")[0] == "next: write desert to inbox.txt\n$ "
    assert env.step("echo desert > inbox.txt")[0] == "next: delete vault.txt\n$ "
    for command in LEVEL1_COMMANDS[5:8]:
        env.step(command)
    # the code written from the wrong file fails its check and is named again; the code itself is never shown
    observation, _, _, info = env.step("echo south > report.log")
    assert observation == "next: write the code from vault.txt to report.log\n$ " and info["assertions_passed"] == 16
    assert "east" not in observation and not any("east" in c.split() for c in env.shell.files.values())
    assert env.step("echo east > report.log")[3]["assertions_passed"] == 17


def test_level1_key_deleted_before_it_was_read_leaves_the_code_unknowable():
    task = level1_task()
    env = TerminalEnv(1)
    env.reset(task)
    env.step("rm vault.txt")  # the info is gone: the next line moves on and never shows it
    observations = [env.step(c)[0] for c in LEVEL1_COMMANDS[1:5] + LEVEL1_COMMANDS[6:8]]
    assert observations[-1] == "next: write the code from vault.txt to report.log\n$ "
    assert not any("east" in o.split() for o in observations)
    assert env.expert_action() == "echo east > report.log"  # the expert knows the task; the agent cannot


@pytest.mark.parametrize("difficulty", LONG)
@pytest.mark.parametrize("detour", [None, "mkdir extra", "mv KEY TARGET", "cp KEY TARGET"])
def test_long_levels_only_typing_the_code_passes_the_last_check(difficulty, detour):
    """An agent that follows every `next:` line but writes the distractor's code where the line asks for the code
    never succeeds, whatever it did off the line at turn 2 (an unnamed mkdir, or the key file moved or copied onto
    the target): once the line is left, its repairs never name a copy or move that puts the code in the target. The
    same agent typing the code succeeds every time."""
    for task in TerminalEnv.make_tasks("eval", 60, seed=5, difficulty=difficulty):
        memory = task["memory"]
        target = shlex.split(task["solution"][-1])[-1]
        outcomes = []
        for types_code in (False, True):
            env = TerminalEnv(difficulty)
            env.reset(task)
            for turn in range(env.max_turns):
                action = env.expert_action()
                if turn == 1 and detour:
                    action = detour.replace("KEY", memory["path"]).replace("TARGET", target)
                words = shlex.split(action)
                if not types_code and memory["code"] in words:
                    # plain words throughout (names and codes need no quotes): `>` stays an operator
                    action = " ".join(memory["decoy_code"] if w == memory["code"] else w for w in words)
                _, _, done, info = env.step(action)
                if done:
                    break
            outcomes.append(info["success"])
        assert outcomes == [False, True], (task["task_id"], detour)


@pytest.mark.parametrize("difficulty", LONG)
def test_long_levels_no_command_puts_the_code_alone_in_a_file(difficulty):
    """Random command lines that copy, move, redirect or cut whole lines between every file of a task (the key file,
    its distractor and the target included) and write any word but the code: after each, no file holds the code
    alone, so no sequence of them passes the target's check."""
    rng = random.Random(difficulty)
    for task in TerminalEnv.make_tasks("train", 40, seed=6, difficulty=difficulty):
        memory = task["memory"]
        env = TerminalEnv(difficulty)
        env.reset(task)
        env.step(f"cat {memory['path']}")
        paths = [*task["files"], shlex.split(task["solution"][-1])[-1], "scratch.txt"]
        words = ["code", "code:", memory["code"], memory["decoy_code"], *CONTENT[:5]]
        for _ in range(60):
            a, b, word = rng.choice(paths), rng.choice(paths), rng.choice(words)
            command = rng.choice([
                f"cp {a} {b}", f"mv {a} {b}", f"cat {a} > {b}", f"cat {a} >> {b}", f"head -n 1 {a} > {b}",
                f"tail -1 {a} > {b}", f"grep {word} {a} > {b}", f"grep -v {word} {a} > {b}",
                f"cat {a} | grep {word} | tail -n 1 > {b}", f"wc -w {a} > {b}",
                f"echo {rng.choice(CONTENT)} >> {b}",
            ])  # fmt: skip
            env.step(command)
            assert all(c.strip() != memory["code"] for c in env.shell.files.values()), (task["task_id"], command)


# the first training task of level 2 (seed 0): the commands translated by hand from its instruction
LEVEL2_COMMANDS = [
    "cat tests.md", "mkdir output", "mv cache.log output/", "mkdir assets", "mkdir config", "mkdir alpha",
    "mv zeta.txt assets/", "mkdir videos", "mv sigma.csv output/", "echo tiger >> kappa.md",
    "echo desert > results.csv", "rm tests.md", "mv gamma.txt beta.log", "echo cherry >> drafts.csv",
    "echo walrus >> notes.txt", "mkdir invoices", "echo winter > queue.md",
]  # fmt: skip


def test_level2_hand_played_episode():
    task = TerminalEnv.make_tasks("train", 1, seed=0, difficulty=2)[0]
    steps = task["instruction"].removeprefix("do these steps in order, then submit: ").split("; ")
    assert steps == [
        "read tests.md", "create the directory output", "move cache.log into output", "create the directory assets",
        "create the directory config", "create the directory alpha", "move zeta.txt into assets",
        "create the directory videos", "move sigma.csv into output", "append tiger to kappa.md",
        "write desert to results.csv", "delete tests.md", "rename gamma.txt to beta.log",
        "append cherry to drafts.csv", "append walrus to notes.txt", "create the directory invoices",
        "write the code from tests.md to queue.md",
    ]  # fmt: skip
    assert task["files"]["tests.md"] == "code: winter\n"  # the key file
    assert task["files"]["tests.log"] == "code: summer\n"  # its distractor
    env = TerminalEnv(2)
    assert env.max_turns == 28 and env.reset(task).endswith("\nnext: read tests.md\n$ ")
    observations = []
    for k, command in enumerate(LEVEL2_COMMANDS):
        assert env.expert_action() == command
        observation, reward, done, info = env.step(command)
        observations.append(observation)
        assert observation.endswith(f"next: {(steps + ['submit'])[k + 1]}\n$ ") and not done
    assert observations[0] == "code: winter\nnext: create the directory output\n$ "
    # the code shows once, at turn 1, 16 turns before it is written; by then no file holds it
    assert [k for k, o in enumerate(observations) if "winter" in o.split()] == [0]
    assert "winter" not in task["instruction"].split()
    assert info["assertions_passed"] == len(task["assertions"]) == info["assertions_total"] - 1  # all but submitted
    assert env.step("submit")[1:3] == (1.0, True)
    assert env.privileged(task) == "Plan: " + " | ".join([*LEVEL2_COMMANDS, "submit"])


@pytest.mark.parametrize(("difficulty", "turns", "gap"), [(1, (9, 10), 7), (2, (15, 18), 13)])
def test_long_levels_turns_distractors_and_the_early_code(difficulty, turns, gap):
    """On 100 tasks: the expert's turns, the distractor beside every file a step touches, the code shown once and
    needed at the end (at least `gap` turns later: read first, the write last, the key file deleted in between)."""
    for task in TerminalEnv.make_tasks("eval", 100, seed=1, difficulty=difficulty):
        memory, solution = task["memory"], task["solution"]
        env = TerminalEnv(difficulty)
        assert turns[0] <= len(play_expert(task)) <= turns[1] < env.max_turns
        assert solution[0] == f"cat {memory['path']}" and solution[-1].split()[1] == memory["code"]
        assert len(solution) - 1 >= gap and solution.index(f"rm {memory['path']}") >= len(solution) // 2
        assert memory["code"] not in task["instruction"].split()
        assert [p for p, c in task["files"].items() if memory["code"] in c.split()] == [memory["path"]]
        assert task["files"][memory["decoy"]] == f"code: {memory['decoy_code']}\n" and memory["decoy_code"] in CODES
        stems = [p.partition(".")[0] for p in task["files"]]
        assert all(stems.count(s) == 2 for s in stems)  # each file has its distractor: same stem, other extension
        named = {w for c in solution for w in shlex.split(c)}
        distractors = [p for p in task["files"] if p not in named]  # no step names them: they must stay as they are
        assert len(distractors) == len(task["files"]) // 2
        assert all(_a("file_equals", p, task["files"][p]) in task["assertions"] for p in distractors)


def test_long_levels_noisy_actions_include_the_wrong_file_and_the_wrong_code():
    task = level1_task()
    assert "cat vault.md" in noisy_samples(task)  # the distractor beside the key
    assert "mkdir kappa" in noisy_samples(task)  # skipping the read
    assert "echo south > report.log" in noisy_samples(task, prefix=8)  # the code read from the distractor


def test_long_levels_skill_and_budget():
    assert TerminalEnv(1).skill == TerminalEnv(2).skill != TerminalEnv.skill
    assert TerminalEnv(0).skill == TerminalEnv(3).skill == TerminalEnv(4).skill == TerminalEnv.skill
    assert "next:" in TerminalEnv(1).skill and "echo <code> > G" in TerminalEnv(1).skill
    assert [TerminalEnv(d).max_turns for d in LEVELS] == [8, 16, 28, 8, 8]
    assert TerminalEnv.max_turns == 8


def test_renumbered_levels_draw_the_tasks_of_old_levels_1_and_2():
    # the first training tasks (seed 0) that levels 1 and 2 drew before the long-horizon levels
    assert TerminalEnv.make_tasks("train", 1, difficulty=3)[0]["instruction"] == (
        "move summary.md into a new directory invoices"
    )
    assert TerminalEnv.make_tasks("train", 1, difficulty=4)[0]["instruction"] == (
        "write the number of lines in notes.md to videos.csv"
    )
    tasks = TerminalEnv.make_tasks("eval", 20, difficulty=3)
    assert all(t["difficulty"] == 3 and t["task_id"].startswith("terminal-d3-") and "memory" not in t for t in tasks)
    env = TerminalEnv(3)
    assert env.reset(tasks[0]) == f"Task: {tasks[0]['instruction']}\n$ "  # no next line below the long levels
    assert env.step("ls")[0].endswith("\n$ ") and "next:" not in env.step("ls")[0]


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
    # every assertion of the task holds; the report's own check, submitted, does not
    assert info["assertions_passed"] == len(task["assertions"]) == info["assertions_total"] - 1 and not done
    assert reward == 0.0 and info["success"] is False


def test_the_count_reward_pays_submitting():
    """T1's r = P / S on the report: an episode that did every step but was cut before `submit` earns one check, 1 / S,
    less than the same episode submitted (the report counts `submitted`), and only the submitted one succeeds."""
    from rewards.verifiers import assertion_count_reward

    task = TerminalEnv.make_tasks("train", 1, difficulty=2)[0]
    env = TerminalEnv(2)
    env.reset(task)
    for command in task["solution"]:
        *_, cut = env.step(command)
    *_, submitted = env.step("submit")
    n = len(task["assertions"])
    assert (cut["assertions_passed"], cut["success"]) == (n, False)
    assert (submitted["assertions_passed"], submitted["success"]) == (n + 1, True)
    cut_reward, submitted_reward = assertion_count_reward(["", ""], final_info=[cut, submitted], assertion_scale=35)
    assert (cut_reward, submitted_reward) == (n / 35, (n + 1) / 35)


def test_state_key():
    task = TerminalEnv.make_tasks("train", 1, difficulty=3)[0]
    a, b = TerminalEnv(3), TerminalEnv(3)
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
    modules = sorted(Path(terminal.__file__).parent.glob("*.py"))
    assert [m.name for m in modules] == ["__init__.py", "env.py", "shell.py", "tasks.py"]
    trees = [ast.parse(m.read_text()) for m in modules]
    nodes = [n for tree in trees for n in ast.walk(tree)]
    imported = {a.name.split(".")[0] for n in nodes if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in nodes if isinstance(n, ast.ImportFrom) and n.module}
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
