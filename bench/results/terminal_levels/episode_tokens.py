"""Episode token lengths at terminal levels 1 and 2 under the tokenizer a tiny default's build trains (envs.tiny: the
same 2,000 noisy demonstrations, seed 0, noise 0.3), against the tiny model's 1024 positions.

    HF_HUB_OFFLINE=1 OMP_NUM_THREADS=1 .venv/bin/python bench/results/terminal_levels/episode_tokens.py

Prompt: the first user message with the assistant header; completion: everything after it (every assistant turn and
every observation, as `max_completion_length` counts them). Episodes: the expert alone (noise 0), and noisy experts
(noise 0.3 as the demonstrations, 0.5), whose repairs make them longer, on 200 eval tasks.
"""

import random
import statistics

from envs.base import noisy_expert_episode
from envs.terminal import TerminalEnv
from envs.tiny import CHAT_TEMPLATE, build_tokenizer, demonstrations


def n_tokens(tok, messages: list[dict], prompt: bool = False) -> int:
    return len(tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt, return_dict=False))


for level in (1, 2):
    demos = demonstrations(TerminalEnv, 2000, seed=0, difficulty=level, noise=0.3)
    texts = [CHAT_TEMPLATE] + ["user\nassistant\nsystem\ntool\n"] * 200 + [m["content"] for d in demos for m in d]
    tok = build_tokenizer(texts, 1024)
    full = [n_tokens(tok, d) for d in demos]
    env = TerminalEnv(level)
    print(f"level {level} (max_turns {env.max_turns}): SFT demonstrations: tokens max {max(full)}, "
          f"mean {statistics.mean(full):.0f}")  # fmt: skip
    tasks = TerminalEnv.make_tasks("eval", 200, seed=0, difficulty=level)
    rng = random.Random(0)
    for noise in (0.0, 0.3, 0.5):
        rows = []
        for task in tasks:
            first, transcript, _ = noisy_expert_episode(env, task, noise, rng)
            messages = [{"role": "user", "content": first}]
            for turn in transcript:
                messages += [{"role": "assistant", "content": turn["action"]}]
                messages += [{"role": "user", "content": turn["observation"]}]
            prompt = n_tokens(tok, messages[:1], prompt=True)
            rows.append((prompt, n_tokens(tok, messages) - prompt, len(transcript)))
        prompts, completions, turns = zip(*rows, strict=True)
        print(f"  noise {noise}: prompt max {max(prompts)}; completion mean {statistics.mean(completions):.0f}, "
              f"max {max(completions)}; prompt + completion max {max(p + c for p, c, _ in rows)}; "
              f"turns {min(turns)}-{max(turns)}; per turn max {max(c / t for _, c, t in rows):.1f}")  # fmt: skip
    actions = [len(tok(m["content"])["input_ids"]) for d in demos for m in d if m["role"] == "assistant"]
    print(f"  one action: at most {max(actions)} tokens")
