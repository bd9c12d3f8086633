"""Shop levels 1 and 2 without a model: the expert's turns, the noisy expert's (noise 0.3, the tiny default's
demonstrations) success, turns and cuts, and episode lengths in tokens of a tokenizer built as the tiny default builds
its own (`envs.tiny.build_tokenizer` on the 2,000 noisy demonstrations).

    OMP_NUM_THREADS=1 .venv/bin/python bench/results/shop_levels/episode_stats.py
"""

import random
import statistics

from envs.base import noisy_expert_episode
from envs.shop import ShopEnv
from envs.tiny import CHAT_TEMPLATE, build_tokenizer, played_demonstrations


def tokens(tok, messages: list[dict], prompt: bool = False) -> int:
    return len(tok.apply_chat_template(messages, tokenize=True, return_dict=False, add_generation_prompt=prompt))


for level in (1, 2):
    tasks = ShopEnv.make_tasks("train", 2000, seed=0, difficulty=level)
    for noise in (0.0, 0.3):
        rng, wins, cut, turns = random.Random(1), 0, 0, []
        for task in tasks[:500]:
            _, transcript, done = noisy_expert_episode(ShopEnv(difficulty=level), task, noise, rng)
            wins += done and transcript[-1]["reward"] == 1.0
            cut += not done
            turns.append(len(transcript))
        turns.sort()
        print(
            f"level {level} noise {noise}: success {wins / 500:.3f}, cut at max_turns {ShopEnv(level).max_turns} "
            f"{cut / 500:.3f}, turns median {statistics.median(turns)} p90 {turns[450]} max {turns[-1]}"
        )
    demos = played_demonstrations(lambda task, level=level: ShopEnv(difficulty=level), tasks, 0, 0.3)
    texts = [CHAT_TEMPLATE] + ["user\nassistant\nsystem\ntool\n"] * 200 + [m["content"] for d in demos for m in d]
    tok = build_tokenizer(texts, 1024)
    noisy = sorted(tokens(tok, d) for d in demos)
    clean = played_demonstrations(lambda task, level=level: ShopEnv(difficulty=level), tasks[:200], 0, 0.0)
    expert = sorted(tokens(tok, d) for d in clean)
    prompt = sorted(tokens(tok, d[:1], prompt=True) for d in clean)
    print(
        f"level {level} tokens (prompt + completion, the chat template's): expert episode {expert[0]}-{expert[-1]} "
        f"(prompt {prompt[0]}-{prompt[-1]}); noisy demonstrations median {statistics.median(noisy)} p90 "
        f"{noisy[1800]} p99 {noisy[1980]} max {noisy[-1]}; over 1024 positions: {sum(n > 1024 for n in noisy)} of 2000"
    )
