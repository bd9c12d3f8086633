"""Token lengths of search episodes at a level, with the tiny default's tokenizer (the folder `tiny_model` built).

    AGENT_TRL_CACHE=/tmp/search_levels_cache .venv/bin/python bench/results/search_levels/episode_tokens.py \
        --model /tmp/search_levels_cache/tiny/<folder> --difficulty 1

Prints, over held-out tasks: the prompt's tokens (the chat-rendered question and the assistant header) and the
completion's (every later turn, model and environment tokens, as the chat template renders them) for the expert, for
the noisy expert (noise 0.3, the demonstrations' mix) and for episodes that take the noisy expert's worst mistakes
until `max_turns`; and how many name words of `NAME_POOL` are not one token (after a space, after "[", alone).
"""

import argparse
import random

from transformers import AutoTokenizer

from envs.base import noisy_expert_episode
from envs.search import NAME_POOL, SearchEnv


def wrong_search(env: SearchEnv, rng: random.Random) -> str:
    while not (action := env.noisy_action(rng)).startswith("search["):
        pass
    return action


def lengths(tok, first: str, transcript: list[dict], done: bool) -> tuple[int, int]:
    messages = [{"role": "user", "content": first}]
    for k, turn in enumerate(transcript):
        messages.append({"role": "assistant", "content": turn["action"]})
        if not (done and k == len(transcript) - 1):
            messages.append({"role": "user", "content": turn["observation"]})

    def count(chat: list[dict], **kwargs) -> int:
        return len(tok(tok.apply_chat_template(chat, tokenize=False, **kwargs), add_special_tokens=False)["input_ids"])

    prompt = count(messages[:1], add_generation_prompt=True)
    return prompt, count(messages) - prompt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--difficulty", type=int, required=True)
    parser.add_argument("--tasks", type=int, default=200)
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    for form in (" {}", "[{}", "{}"):  # after a space (documents, questions), in an action, at a line's start
        split = [w for w in NAME_POOL if len(tok(form.format(w), add_special_tokens=False)["input_ids"]) != 1]
        print(f"NAME_POOL words not one token as {form!r}: {len(split)} of {len(NAME_POOL)} {split[:5]}")
    env = SearchEnv(args.difficulty)
    tasks = SearchEnv.make_tasks("eval", args.tasks, seed=0, difficulty=args.difficulty)
    for name, noise in (("expert", 0.0), ("noisy expert 0.3", 0.3), ("noisy expert 1.0 (searches only)", None)):
        rng, rows = random.Random(0), []
        for task in tasks:
            if noise is None:  # wrong searches until the budget is spent: the longest episode the loop allows
                first = env.reset(task)
                transcript = []
                for _ in range(env.max_turns):
                    action = wrong_search(env, rng)
                    obs, reward, done, _ = env.step(action)
                    transcript.append({"action": action, "observation": obs, "reward": reward})
                done = False
            else:
                first, transcript, done = noisy_expert_episode(env, task, noise, rng)
            rows.append((len(transcript), *lengths(tok, first, transcript, done)))
        turns, prompts, completions = zip(*rows, strict=True)
        longest = max(p + c for _, p, c in rows)
        print(
            f"{name}: turns {min(turns)}-{max(turns)} (mean {sum(turns) / len(turns):.2f}); prompt tokens "
            f"{min(prompts)}-{max(prompts)}; completion tokens {min(completions)}-{max(completions)} (mean "
            f"{sum(completions) / len(completions):.0f}); prompt + completion at most {longest}"
        )
    print(f"max_turns {env.max_turns}")


if __name__ == "__main__":
    main()
