"""An agent that follows every `next:` line of a checklist but never types the code (where a line asks for it, it
writes the distractor's code), with one off-line `mkdir` at turn 2, on 200 held-out tasks of levels 1 and 2.

    python bench/results/terminal_level2_closed/hint_follower/hint_follower.py             # the level as it is
    git show 0583d82:envs/terminal.py > /tmp/old_terminal.py
    python bench/results/terminal_level2_closed/hint_follower/hint_follower.py /tmp/old_terminal.py   # before the fix
"""

import importlib.util
import random
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
if len(sys.argv) > 1:  # another version of envs/terminal.py
    spec = importlib.util.spec_from_file_location("terminal_under_test", sys.argv[1])
    terminal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(terminal)
else:
    import envs.terminal as terminal

for level in (1, 2):
    wins = moved = 0
    for task in terminal.TerminalEnv.make_tasks("eval", 200, seed=3, difficulty=level):
        env = terminal.TerminalEnv(level)
        env.reset(task)
        memory, rng = task["memory"], random.Random(task["task_id"])
        for turn in range(env.max_turns):
            action = env.expert_action() if turn != 1 else f"mkdir extra{rng.randint(0, 9)}"
            words = shlex.split(action)
            action = " ".join(memory["decoy_code"] if w == memory["code"] else w for w in words)  # `>` unquoted
            moved += words[:2] == ["mv", memory["path"]]
            _, _, done, info = env.step(action)
            if done:
                wins += info["success"]
                break
    print(f"level {level}: {wins}/200 succeed without typing the code; mv of the key file named {moved} times")
