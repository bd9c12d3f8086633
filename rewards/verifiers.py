"""Programmatic rewards (TRL reward-function signature) and the T1 token-in/token-out audit counters.

Reward functions take `completions` plus per-row keyword arguments (dataset columns and rollout extra fields arrive as
lists with one entry per row) and return one float per row, or `None` when the reward does not apply (the row is
unscorable, as TRL treats `None`). They know nothing about trainers.

* `assertion_count_reward`: the dense T1 reward r = P / S (t1.md Eq. 1) with the binary fallback (Eq. 2, D9) and the
  fallback causes tagged in the order of conventions.md C20.
* `assertion_blend_reward`: the ablation-only variant r = clip(max(b, 0.4 P/A), 0, max(1, b)) (t1.md Eq. 3).
* `binary_success_reward`: r = b, the pass/fail of the whole verifier (the critic warm-up reward, t1.md D3).
* `exact_match_reward`: 1 when a completion's final answer equals the dataset's `answer` (or `solution`) column.
* `tito_mismatch_count`: the drift count of t1.md Eq. 17 (must be 0); `retokenization_mismatch_count`: how many loss
  tokens a decode-then-encode round trip would change (informational).

Paper: T1, https://huggingface.co/papers/2609.11042.

Decision ids (`Dn`) without a page are docs/methods/t1.md's.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

DEFAULT_ASSERTION_SCALE = 20.0  # S (t1.md Eq. 1, D10): fixed for the run, never derived from a batch
BLEND_WEIGHT = 0.4  # t1.md Eq. 3
FALLBACK_CAUSES = (
    "infra_dropped",
    "verifier_error",
    "no_report",
    "parse_error",
    "zero_assertions",
    "inconsistent",
)  # conventions.md C20: the first that matches wins; otherwise the cause is "count"
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
VERIFIER_STATUSES = ("ok", "infra_dropped", "verifier_error", "no_report", "parse_error")


def assertion_reward_cause(passed: int | None, total: int | None, status: str | None = None) -> str:
    """The reward cause of one trial (t1.md D9), tagged by the first that matches (conventions.md C20):
    infrastructure dropped, verifier error, no report, parse error, zero assertions, inconsistent, count.

    `status` is what the environment or harness knows and the counts cannot show: `"infra_dropped"` (a sandbox or
    infrastructure fault not caused by the agent), `"verifier_error"` (the verifier timed out or crashed),
    `"no_report"` (no per-assertion report), `"parse_error"` (a report that could not be parsed), or `None`/`"ok"`.
    A missing count (`None`) with no other status means there is no report.

    >>> [assertion_reward_cause(3, 5), assertion_reward_cause(6, 5), assertion_reward_cause(None, None, "parse_error")]
    ['count', 'inconsistent', 'parse_error']
    """
    if status not in (None, *VERIFIER_STATUSES):
        raise ValueError(f"unknown verifier status {status!r}; expected one of {VERIFIER_STATUSES}")
    if status in ("infra_dropped", "verifier_error", "no_report"):
        return status
    if status != "parse_error" and (passed is None or total is None):
        return "no_report"
    if status == "parse_error":
        return "parse_error"
    if total == 0:
        return "zero_assertions"
    if passed < 0 or total < 0 or passed > total:
        return "inconsistent"
    return "count"


def _fallback_reward(cause: str, success: Any) -> float | None:
    """Reward of a row whose report is unusable (t1.md Eq. 2, D9): None (row excluded) for infrastructure faults, 0 for
    a verifier error, otherwise the binary pass b (None when b is unknown too)."""
    if cause == "infra_dropped":
        return None
    if cause == "verifier_error":
        return 0.0
    return None if success is None else float(bool(success))


def _column(name: str, values: Sequence | None, final_info: Sequence | None, n: int) -> list:
    """One entry per row: the explicit column if given, else the field of the rollout's final `info`, else None."""
    if values is not None:
        return list(values)
    if final_info is not None:
        return [(info or {}).get(name) for info in final_info]
    return [None] * n


def _rows(
    completions: list,
    assertions_passed: Sequence | None,
    assertions_total: Sequence | None,
    success: Sequence | None,
    verifier_status: Sequence | None,
    final_info: Sequence | None,
) -> list[tuple[Any, Any, Any, str]]:
    n = len(completions)
    cols = [
        _column(name, values, final_info, n)
        for name, values in (
            ("assertions_passed", assertions_passed),
            ("assertions_total", assertions_total),
            ("success", success),
            ("verifier_status", verifier_status),
        )
    ]
    return [(p, a, b, assertion_reward_cause(p, a, s)) for p, a, b, s in zip(*cols, strict=True)]


def _log_causes(causes: list[str], kwargs: dict) -> None:
    """Fallback fractions through TRL's `log_metric` hook (t1.md §8), causes through `log_extra` (completion table)."""
    log_metric, log_extra = kwargs.get("log_metric"), kwargs.get("log_extra")
    if callable(log_metric) and causes:
        log_metric("t1/reward_fallback_frac", sum(c != "count" for c in causes) / len(causes))
        for cause in FALLBACK_CAUSES:  # a fixed key set, so every process logs the same names
            log_metric(f"t1/reward_fallback/{cause}", sum(c == cause for c in causes) / len(causes))
    if callable(log_extra):
        log_extra("reward_cause", causes)


def assertion_count_reward(
    completions: list,
    assertions_passed: Sequence[int | None] | None = None,
    assertions_total: Sequence[int | None] | None = None,
    success: Sequence[bool | float | None] | None = None,
    verifier_status: Sequence[str | None] | None = None,
    final_info: Sequence[dict | None] | None = None,
    assertion_scale: float = DEFAULT_ASSERTION_SCALE,
    **kwargs,
) -> list[float | None]:
    """Dense assertion-count reward r = P / S (t1.md Eq. 1), with the binary fallback r = b (Eq. 2, D9).

    P is the absolute number of passing assertions (not divided by A); S = `assertion_scale` is fixed for the run
    (default 20, t1.md D10; bind another value with `functools.partial` plus `functools.update_wrapper`, never from a
    batch). Rewards above 1 are allowed and never clipped (D11). When the per-assertion report is unusable the row gets
    the binary pass b; a verifier error gives 0; an infrastructure fault gives `None` (the trainer must also drop the
    row from the loss). Causes follow conventions.md C20 (`assertion_reward_cause`).

    Per-row inputs are the columns `assertions_passed`, `assertions_total`, `success` (b) and `verifier_status`; a
    column that is absent is read from the rollout's `final_info` dict (the terminal environment's `info`). With
    TRL's `log_metric` / `log_extra` hooks present it logs `t1/reward_fallback_frac`, `t1/reward_fallback/<cause>` and
    a `reward_cause` column.

    >>> assertion_count_reward(["", ""], assertions_passed=[7, 25], assertions_total=[10, 30])
    [0.35, 1.25]
    >>> assertion_count_reward(["", ""], assertions_passed=[None, 0], assertions_total=[None, 0], success=[True, 0])
    [1.0, 0.0]
    """
    rows = _rows(completions, assertions_passed, assertions_total, success, verifier_status, final_info)
    _log_causes([cause for *_, cause in rows], kwargs)
    out: list[float | None] = []
    for p, _, b, cause in rows:
        out.append(p / assertion_scale if cause == "count" else _fallback_reward(cause, b))  # Eq. 1, Eq. 2
    return out


def assertion_blend_reward(
    completions: list,
    assertions_passed: Sequence[int | None] | None = None,
    assertions_total: Sequence[int | None] | None = None,
    success: Sequence[bool | float | None] | None = None,
    verifier_status: Sequence[str | None] | None = None,
    final_info: Sequence[dict | None] | None = None,
    **kwargs,
) -> list[float | None]:
    """Comparison variant for ablations only: r = clip(max(b, 0.4 * P/A), 0, max(1, b)) (t1.md Eq. 3), in
    [0, max(1, b)] and 1 when b = 1. Rows with an unusable report fall back as in `assertion_count_reward`; a usable
    report with b unknown counts b as 0.

    >>> assertion_blend_reward(["", ""], assertions_passed=[5, 10], assertions_total=[10, 10], success=[False, True])
    [0.2, 1.0]
    """
    rows = _rows(completions, assertions_passed, assertions_total, success, verifier_status, final_info)
    _log_causes([cause for *_, cause in rows], kwargs)
    out: list[float | None] = []
    for p, a, b, cause in rows:
        if cause != "count":
            out.append(_fallback_reward(cause, b))
            continue
        bf = float(bool(b)) if b is not None else 0.0
        out.append(min(max(max(bf, BLEND_WEIGHT * p / a), 0.0), max(1.0, bf)))  # Eq. 3
    return out


def binary_success_reward(
    completions: list,
    success: Sequence[bool | float | None] | None = None,
    final_info: Sequence[dict | None] | None = None,
    **kwargs,
) -> list[float | None]:
    """Binary pass/fail of the whole verifier, r = b in {0, 1} (t1.md Eq. 2; the critic warm-up reward, D3). Reads the
    `success` column, else `final_info["success"]`; `None` where neither says.

    >>> binary_success_reward(["", ""], success=[True, False])
    [1.0, 0.0]
    >>> binary_success_reward(["", ""], final_info=[{"success": True}, {}])
    [1.0, None]
    """
    col = _column("success", success, final_info, len(completions))
    return [None if b is None else float(bool(b)) for b in col]


# ---------------------------------------------------------------------------------------------------------------------
# Token-in / token-out audit (t1.md §4.5)


def _ints(row: Any) -> list[int]:
    return [int(x) for x in (row.tolist() if hasattr(row, "tolist") else row)]


def tito_mismatch_count(
    completion_ids: Sequence[Sequence[int]],
    loss_mask: Sequence[Sequence[int]],
    sampled_ids: Sequence[Sequence[int]],
) -> tuple[int, int]:
    """Drift count of t1.md Eq. 17: loss-bearing positions whose id is not the id the sampler emitted at that point.

    The provenance of the project's stitched stream is positional: in each row, the positions with m = 1, in order,
    must hold exactly the concatenation of the ids the sampler emitted for the row's turns (every sampled id, nothing
    else). Position i of that subsequence is a mismatch when its id differs from sampled id i or there is no sampled id
    i; every sampled id with no loss position left for it counts too. D = mismatches / loss tokens must be exactly 0
    (t1.md D14: a non-zero count is a bug, not noise). A tokenizer whose decode-then-encode is not the identity does
    not change this count as long as the rollout never re-encodes (t1.md §7 item 31).

    Args:
        completion_ids (`Sequence[Sequence[int]]`): per row, the stitched completion ids (a (B, T) tensor works too).
        loss_mask (`Sequence[Sequence[int]]`): per row, 1 on loss-bearing (model) positions, same lengths.
        sampled_ids (`Sequence[Sequence[int]]`): per row, the sampled ids of all its turns, concatenated in order.

    Returns:
        `tuple[int, int]`: (mismatches, loss tokens); the drift rate is mismatches / max(loss tokens, 1).

    >>> tito_mismatch_count([[5, 6, 1, 7, 0]], [[1, 1, 0, 1, 0]], [[5, 6, 7]])
    (0, 3)
    >>> tito_mismatch_count([[5, 6, 1, 8, 0]], [[1, 1, 0, 1, 0]], [[5, 6, 7]])
    (1, 3)
    """
    mismatches = loss_tokens = 0
    for ids, mask, sampled in zip(completion_ids, loss_mask, sampled_ids, strict=True):
        stream = [i for i, m in zip(_ints(ids), _ints(mask), strict=True) if m]  # ids at m = 1 positions, in order
        ref = _ints(sampled)
        loss_tokens += len(stream)
        mismatches += sum(j >= len(ref) or x != ref[j] for j, x in enumerate(stream))  # Eq. 17
        mismatches += max(len(ref) - len(stream), 0)  # sampled ids that never reached the stream
    return mismatches, loss_tokens


def retokenization_mismatch_count(
    completion_ids: Sequence[Sequence[int]],
    loss_mask: Sequence[Sequence[int]],
    reencode: Callable[[list[int]], list[int]],
) -> tuple[int, int]:
    """How many loss tokens a text round trip would change: each turn (a maximal run of loss positions) is passed to
    `reencode` (decode then encode, e.g. `lambda ids: tok.encode(tok.decode(ids), add_special_tokens=False)`) and each
    of its positions counts when the re-encoded id there differs or is missing.

    Informational only: it measures how much a harness that re-tokenised text would drift (what the B3 repair of
    t1.md §4.5 handles), not the drift of the ids actually trained on. That is `tito_mismatch_count`, which must be 0.

    Args:
        completion_ids (`Sequence[Sequence[int]]`): per row, the completion ids.
        loss_mask (`Sequence[Sequence[int]]`): per row, 1 on loss positions.
        reencode (`Callable[[list[int]], list[int]]`): maps a turn's ids to the ids of its re-encoded text.

    Returns:
        `tuple[int, int]`: (mismatching loss tokens, loss tokens).

    >>> merge_1_2 = lambda ids: [12, *ids[2:]] if ids[:2] == [1, 2] else ids  # a tokenizer that merges "1" "2"
    >>> retokenization_mismatch_count([[1, 2, 9, 3, 4]], [[1, 1, 0, 1, 1]], merge_1_2)  # turn [1, 2] -> [12]
    (2, 4)
    """
    mismatches = loss_tokens = 0
    for ids, mask in zip(completion_ids, loss_mask, strict=True):
        run: list[int] = []
        for x, m in [*zip(_ints(ids), _ints(mask), strict=True), (0, 0)]:  # a trailing 0 closes the last run
            if m:
                run.append(x)
                continue
            if run:
                ref = reencode(list(run))
                loss_tokens += len(run)
                mismatches += sum(j >= len(ref) or y != ref[j] for j, y in enumerate(run))
                run = []
    return mismatches, loss_tokens


def final_answer(text: str) -> str | None:
    """The answer a completion gives: what follows the last "answer:" (any case; "####" also counts), else its last
    number, else None. Trailing punctuation and commas inside numbers are dropped.

    >>> [final_answer("3 + 4 = 7. Answer: 7."), final_answer("so it is 1,250 apples"), final_answer("no idea")]
    ['7', '1250', None]
    """
    lowered = text.lower()
    marker = max(lowered.rfind("answer:"), lowered.rfind("####"))
    if marker >= 0:
        answer = text[marker:].split(":", 1)[-1] if lowered[marker] == "a" else text[marker + 4 :]
        answer = answer.strip().rstrip(".!").strip()
        return answer.replace(",", "") if _NUMBER.fullmatch(answer) else answer or None
    numbers = _NUMBER.findall(text)
    return numbers[-1].replace(",", "") if numbers else None


def _text(completion: Any) -> str:
    """A completion's text: a string, or the content of the last message of a conversational completion."""
    return completion[-1]["content"] if isinstance(completion, list) else completion


def exact_match_reward(completions: Sequence, answer: Sequence | None = None, solution: Sequence | None = None, **_):
    """1.0 when the completion's final answer (`final_answer`) equals the reference in the `answer` (or `solution`)
    column after trimming, case-folding and, for numbers, comparing values; else 0.0.

    >>> exact_match_reward(["Answer: 12", "it is 12.0", "13"], answer=["12", "12", "12"])
    [1.0, 1.0, 0.0]
    """
    references = answer if answer is not None else solution
    if references is None:
        raise ValueError("exact_match_reward needs an `answer` (or `solution`) column in the dataset")
    return [float(_same(final_answer(_text(c)), str(ref))) for c, ref in zip(completions, references, strict=True)]


def _same(given: str | None, reference: str) -> bool:
    if given is None:
        return False
    given, reference = given.strip().casefold(), reference.strip().casefold().replace(",", "")
    try:
        return float(given) == float(reference)
    except ValueError:
        return given == reference
