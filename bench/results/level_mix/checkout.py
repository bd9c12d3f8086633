"""What a shop build types at checkout, teacher-forced on the expert's own episodes of held-out tasks: the
probability of the first token of the right coupon, of the last id in the cart (what half the noisy checkouts typed
in the shop's demonstrations before their version 2: `ShopEnv.level_demo_versions`), and of any coupon word.

    OMP_NUM_THREADS=1 python bench/results/level_mix/checkout.py <shop model folder> [level] [n tasks]
"""

import re
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from envs.shop import COUPONS, ShopEnv
from envs.tiny import played_demonstrations

FOLDER = sys.argv[1]
LEVEL = int(sys.argv[2]) if len(sys.argv) > 2 else 2
N = int(sys.argv[3]) if len(sys.argv) > 3 else 200

tokenizer = AutoTokenizer.from_pretrained(FOLDER)
model = AutoModelForCausalLM.from_pretrained(FOLDER).eval()
tasks = ShopEnv.make_tasks("eval", N, seed=0, difficulty=LEVEL)
demos = played_demonstrations(lambda task: ShopEnv(difficulty=LEVEL), tasks, seed=0, noise=0.0)


def first_token(word: str) -> int:
    """The token after `checkout` when the action types `word` (`[word` or `[`, by the tokenizer)."""
    ids = tokenizer("checkout[" + word + "]", add_special_tokens=False)["input_ids"]
    return ids[1]


if len({first_token(c) for c in COUPONS}) != len(COUPONS):
    raise SystemExit("the coupons do not start with distinct tokens after checkout: score the next token instead")
right = last_id = any_coupon = 0.0
for messages in demos:
    coupon = re.search(r"checkout\[(\w+)\]", messages[-1]["content"]).group(1)
    clicks = re.findall(r"click\[(\w+)\]", " ".join(m["content"] for m in messages if m["role"] == "assistant"))
    prefix = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True) + "checkout"
    ids = tokenizer(prefix, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
    right += float(probs[first_token(coupon)])
    last_id += float(probs[first_token(clicks[-1])])
    any_coupon += float(sum(probs[first_token(c)] for c in COUPONS))
n = len(demos)
print(
    f"shop level {LEVEL}, {FOLDER}, {n} expert episodes, the token after 'checkout': P(right coupon) {right / n:.3f}, "
    f"P(last id in the cart) {last_id / n:.3f}, P(any of the {len(COUPONS)} coupons) {any_coupon / n:.3f}"
)
