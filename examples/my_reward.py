"""A reward function of your own, in TRL's reward signature.

    python train.py --config configs/dataset_quickstart.yaml --reward_funcs examples.my_reward.last_number_matches

TRL calls it with the batch's `prompts`, `completions` (chat messages here, since the dataset's prompts are messages)
and every other dataset column as a list of the same length, here `answer`. It returns one float per completion, or
None for a completion it cannot score (that row is left out of the advantage, as TRL does).
"""

import re


def last_number_matches(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last number in the completion equals the row's `answer`, else 0.0.

    >>> last_number_matches([[{"role": "assistant", "content": "7 and 8, so 8"}], "nine"], answer=["8", "9"])
    [1.0, 0.0]
    """
    scores = []
    for completion, reference in zip(completions, answer, strict=True):
        text = completion[-1]["content"] if isinstance(completion, list) else completion
        numbers = re.findall(r"-?\d+", text)
        scores.append(1.0 if numbers and numbers[-1] == str(reference).strip() else 0.0)
    return scores
