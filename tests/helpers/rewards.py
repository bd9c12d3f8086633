"""Reward functions for smoke runs, named by import path (`--reward_funcs tests.helpers.rewards.distinct_characters`).

A short smoke run of a binary reward often gives a whole group one value, and so no gradient; a dense term gives every
group a spread (the TRL integration notes' advice for smoke tests)."""


def _text(completion) -> str:
    return completion if isinstance(completion, str) else "".join(m.get("content") or "" for m in completion)


def distinct_characters(completions, **_) -> list[float]:
    """The share of a completion's characters that are distinct (0 for an empty one).

    >>> distinct_characters(["abab", [{"role": "assistant", "content": "abc"}], ""])
    [0.5, 1.0, 0.0]
    """
    texts = [_text(c) for c in completions]
    return [len(set(t)) / len(t) if t else 0.0 for t in texts]
