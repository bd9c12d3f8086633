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

The package: `shell.py` (the file system's checks and the shell), `tasks.py` (word lists and task templates by level),
`env.py` (`TerminalEnv`).
"""

from envs.terminal.env import CHECKLIST_SKILL, TerminalEnv
from envs.terminal.shell import ASSERTION_KINDS, SUBMIT_WORDS, Shell, check_assertion, check_assertions, command_line
from envs.terminal.tasks import CODES, CONTENT, EXTENSIONS, KEY_LABEL, KEYS, LEVELS, NAMES

__all__ = [
    "ASSERTION_KINDS",
    "CHECKLIST_SKILL",
    "CODES",
    "CONTENT",
    "EXTENSIONS",
    "KEYS",
    "KEY_LABEL",
    "LEVELS",
    "NAMES",
    "SUBMIT_WORDS",
    "Shell",
    "TerminalEnv",
    "check_assertion",
    "check_assertions",
    "command_line",
]
