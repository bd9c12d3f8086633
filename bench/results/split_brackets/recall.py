"""How well a level-2 build recalls the word shown once at the start, measured apart from everything else an episode
asks of it: on the expert's own episodes of held-out tasks (no noise), teacher-forced, the probability the model gives
to that word where the last action types it, bracket included, and whether greedy decoding of it would be right.

- shop: the coupon in `checkout[<coupon>]`, shown in the instruction (`pay with coupon [<coupon>]`) about 17 turns
  earlier; against it, as a control, the first result's id in the first `click[<id>]`, shown one turn earlier.
- search: the first town in `answer[<first> to <last>]`, shown in the first search's result 7-9 turns earlier.
- terminal: the code in the last `echo <code> > <file>`, read from a file (`code: <code>`) about 15 turns earlier.

The character before the word (the bracket, or the terminal's space) is part of the scored span, so that a tokenizer
that joins it to the word (`[fig`) and one that splits it (`[`, `fig`) are scored on the same text. "greedy right":
every token of the span is the model's top choice.

    OMP_NUM_THREADS=1 python bench/results/split_brackets/recall.py shop <model folder> [n tasks] [level]

(level 2 unless given; level 1 has the same actions and asks for the word at a shorter range)
"""

import math
import re
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import ENVIRONMENTS
from envs.tiny import played_demonstrations

ENV, FOLDER = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200
LEVEL = int(sys.argv[4]) if len(sys.argv) > 4 else 2
# (name, pattern of the action that types the word (group 1), which of the matching actions is scored)
TARGETS = {
    "shop": [
        ("coupon at checkout", r"checkout\[(\w+)\]", "last"),
        ("first click (control)", r"click\[(\w+)\]", "first"),
    ],
    "search": [("first town in the answer", r"answer\[(\w+) to \w+\]", "last")],
    "terminal": [("code in the last write", r"echo (\w+) > \S+", "last")],
}[ENV]

tokenizer = AutoTokenizer.from_pretrained(FOLDER)
model = AutoModelForCausalLM.from_pretrained(FOLDER).eval()
env_cls = ENVIRONMENTS[ENV]
tasks = env_cls.make_tasks("eval", N, seed=0, difficulty=LEVEL)
demos = played_demonstrations(lambda task: env_cls(difficulty=LEVEL), tasks, seed=0, noise=0.0)


def span_logprob(messages: list[dict], turn: int, word_start: int, word_end: int) -> tuple[float, bool, list[str]]:
    """log P(characters [word_start, word_end) of assistant message `turn`) and whether each token is the argmax."""
    text = tokenizer.apply_chat_template(messages[: turn + 1], tokenize=False)
    content = messages[turn]["content"]
    base = text.rindex(content)
    lo, hi = base + word_start, base + word_end
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    ids = enc["input_ids"]
    positions = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < hi and b > lo]
    if enc["offset_mapping"][positions[0]][0] < lo or enc["offset_mapping"][positions[-1]][1] > hi:
        raise SystemExit(f"a token crosses the scored span in {content!r}: {tokenizer.tokenize(content)}")
    with torch.no_grad():
        logits = model(torch.tensor([ids[: positions[-1] + 1]])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    total = sum(logprobs[i - 1, ids[i]].item() for i in positions)
    greedy = all(logits[i - 1].argmax().item() == ids[i] for i in positions)
    return total, greedy, [tokenizer.convert_ids_to_tokens(ids[i]) for i in positions]


lengths = sorted(len(tokenizer.apply_chat_template(d, tokenize=True, return_dict=False)) for d in demos)
print(f"{ENV} level {LEVEL}: the expert's episodes are {lengths[0]}-{lengths[-1]} tokens (prompt and completion)")
for name, pattern, which in TARGETS:
    probs, right, example = [], 0, None
    for demo in demos:
        turns = [i for i, m in enumerate(demo) if m["role"] == "assistant" and re.fullmatch(pattern, m["content"])]
        turn = turns[-1] if which == "last" else turns[0]
        match = re.fullmatch(pattern, demo[turn]["content"])
        logp, greedy, pieces = span_logprob(demo, turn, match.start(1) - 1, match.end(1))  # `[word`
        probs.append(math.exp(logp))
        right += greedy
        example = example or (demo[turn]["content"], pieces)
    probs.sort()
    print(
        f"{ENV} level {LEVEL}, {name}: {len(probs)} expert episodes; P(right word) mean {sum(probs) / len(probs):.3f},"
        f" median {probs[len(probs) // 2]:.3f}; greedy right {right}; scored tokens of {example[0]!r}: {example[1]}"
    )
