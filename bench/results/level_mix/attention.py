"""Which heads look at the recalled word where the last action types it: on the expert's own episodes of held-out
tasks (no noise), teacher-forced, the attention weight that each head of each layer puts, from the position that
predicts the word, on the token where the word was shown (its first occurrence in the episode), averaged over the
episodes; and, per head of the last layer, the key it attends to most (token, distance back) in the first episodes.

- shop: the coupon in `checkout[<coupon>]`, shown in the instruction (`pay with coupon [<coupon>]`).
- search: the first town in `answer[<first> to <last>]`, shown in the first search's result (`born in <town>`).
- terminal: the code in the last `echo <code> > <file>`, shown by the first `cat` (`code: <code>`).

    OMP_NUM_THREADS=1 python bench/results/level_mix/attention.py shop <model folder> [n tasks] [level]
"""

import re
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs import ENVIRONMENTS
from envs.tiny import played_demonstrations

ENV, FOLDER = sys.argv[1], sys.argv[2]
N = int(sys.argv[3]) if len(sys.argv) > 3 else 50
LEVEL = int(sys.argv[4]) if len(sys.argv) > 4 else 2
PATTERN = {"shop": r"checkout\[(\w+)\]", "search": r"answer\[(\w+) to \w+\]", "terminal": r"echo (\w+) > \S+"}[ENV]
SHOWN_TOP = 6  # episodes whose most-attended keys are printed

tokenizer = AutoTokenizer.from_pretrained(FOLDER)
model = AutoModelForCausalLM.from_pretrained(FOLDER, attn_implementation="eager").eval()  # eager returns weights
env_cls = ENVIRONMENTS[ENV]
tasks = env_cls.make_tasks("eval", N, seed=0, difficulty=LEVEL)
demos = played_demonstrations(lambda task: env_cls(difficulty=LEVEL), tasks, seed=0, noise=0.0)
layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
on_word = torch.zeros(layers, heads)
top_keys: dict[int, list[tuple[str, int]]] = {h: [] for h in range(heads)}
distances = []
for messages in demos:
    turn = max(i for i, m in enumerate(messages) if m["role"] == "assistant" and re.search(PATTERN, m["content"]))
    match = re.search(PATTERN, messages[turn]["content"])
    text = tokenizer.apply_chat_template(messages[: turn + 1], tokenize=False)
    start = text.rindex(messages[turn]["content"]) + match.start(1)  # the word's first character in the action
    encoding = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    offsets, ids = encoding["offset_mapping"], encoding["input_ids"]
    # the token whose prediction is the word's first token: the one before the token holding the word's start
    query = next(i for i, (a, b) in enumerate(offsets) if a <= start < b) - 1
    shown_at = re.search(rf"\b{match.group(1)}\b", text).start()  # first occurrence: where the episode showed it
    shown = next(i for i, (a, b) in enumerate(offsets) if a <= shown_at < b)
    distances.append(query - shown)
    with torch.no_grad():
        attentions = model(torch.tensor([ids[: query + 1]]), output_attentions=True).attentions
    for layer in range(layers):
        on_word[layer] += attentions[layer][0, :, query, shown]
    last = attentions[-1][0, :, query, :]
    for h in range(heads):
        key = int(last[h].argmax())
        top_keys[h].append((tokenizer.convert_ids_to_tokens(ids[key]), query - key))

n = len(demos)
distances.sort()
print(
    f"{ENV} level {LEVEL}, {FOLDER}: {n} expert episodes; the word was shown {distances[0]}-{distances[-1]} tokens "
    f"before the position that predicts it (median {distances[n // 2]})"
)
for layer in range(layers):
    weights = [round(float(x), 3) for x in on_word[layer] / n]
    print(f"layer {layer}: mean attention on the shown word, per head: {weights}")
for h in range(heads):
    print(f"layer {layers - 1} head {h}: most-attended key (token, distance back): {top_keys[h][:SHOWN_TOP]}")
