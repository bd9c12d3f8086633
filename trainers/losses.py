"""Ratios, surrogates, value losses and aggregators: pure tensor functions (tensors and plain numbers in, tensors out).

Conventions (docs/layout.md#the-rollout-batch): B rows, T completion tokens, K turns; `mask` (B, T) is 1 on model
tokens and 0 on environment tokens and padding; `turn_index` (B, T) is k on the model tokens of turn k and -1
elsewhere. Per-token losses are returned as (B, T) tensors that are exactly 0 off the mask (C6), and environment tokens
receive exactly zero gradient; aggregate them with `aggregate_loss` (TRL's `loss_type`s) or `masked_token_mean`. Inputs
off the mask may hold anything finite or not (padding log-probs, NaN advantages): they are replaced by 0 before any
arithmetic, so they never leak NaN into values or gradients.

Arithmetic runs in float64 and the result is cast back to the dtype of the main input (conventions.md C2); the
casts are differentiable.

Sources: T1, https://huggingface.co/papers/2609.11042 (`t1.md`: token ratio, clipped actor and critic losses); MPO,
no arXiv id yet (`mpo.md`: dual clip). MPO's turn-level ratio and actor loss live in `trainers/mpo.py`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _masked64(x: Tensor, mask: Tensor) -> Tensor:
    """x in float64 with 0 off the mask (keeps the graph; masked entries get exactly zero gradient)."""
    return torch.where(mask.bool(), x.to(torch.float64), 0.0)


def masked_token_mean(per_token: Tensor, mask: Tensor, num_tokens: float | Tensor | None = None) -> Tensor:
    """Token-mean aggregation L = Σ_{b,t} m_{b,t} x_{b,t} / N_tok (mpo.md Eq. 16, t1.md Eq. 11-12; TRL `"dapo"`).

    N_tok defaults to Σ m of this batch. Pass the number of loss tokens of the whole optimizer step (all gradient
    accumulation micro-batches on all ranks, divided by the number of ranks when gradients are averaged over ranks, as
    TRL does with `num_items_in_batch`) to make accumulated micro-batches equal one big batch. N_tok is clamped to at
    least 1, so an all-masked batch gives 0, not NaN (C6).

    Args:
        per_token (`Tensor`): (B, T) per-token values.
        mask (`Tensor`): (B, T) loss mask.
        num_tokens (`float` or `Tensor`, *optional*): N_tok; defaults to Σ mask.

    Returns:
        `Tensor`: 0-d, in the dtype of `per_token`.

    >>> masked_token_mean(torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    tensor(2.)
    """
    total = _masked64(per_token, mask).sum()
    n = mask.bool().sum() if num_tokens is None else num_tokens
    n = torch.as_tensor(n, dtype=torch.float64, device=per_token.device).clamp(min=1.0)
    return (total / n).to(per_token.dtype)


def dapo_token_count(
    num_items_in_batch: Tensor, num_processes: int, steps_per_generation: int, training: bool
) -> Tensor:
    """N_tok for `masked_token_mean` on one micro-batch, as TRL's `loss_type="dapo"` normalises: the loss tokens of the
    whole generation batch (`num_items_in_batch`, all ranks) per rank and, in training, per micro-batch of the
    generation batch. Divide the aggregated loss by the gradient-accumulation steps as well (TRL multiplies this
    normaliser by them instead). TRL 1.16 computes it inline in `GRPOTrainer._compute_loss` and exposes no function
    for it; tests/test_trl_parity.py checks that TRL's dapo loss equals the loss built with this count.

    Args:
        num_items_in_batch (`Tensor`): 0-d, TRL's `inputs["num_items_in_batch"]`.
        num_processes (`int`): ranks whose gradients are averaged.
        steps_per_generation (`int`): micro-batches per generation batch.
        training (`bool`): False in evaluation, where the batch is neither split nor accumulated.

    Returns:
        `Tensor`: 0-d, at least 1 / (num_processes * steps_per_generation).

    >>> dapo_token_count(torch.tensor(40), num_processes=2, steps_per_generation=2, training=True)
    tensor(10.)
    """
    n_tok = num_items_in_batch.clamp(min=1.0) / num_processes  # tokens per rank
    return n_tok / steps_per_generation if training else n_tok  # per micro-batch (TRL's "dapo" normaliser)


LOSS_TYPES = ("grpo", "dapo", "bnpo", "dr_grpo")  # TRL's aggregations of the clipped surrogate (conventions.md C22)


def aggregate_loss(
    per_token: Tensor,
    mask: Tensor,
    loss_type: str,
    num_tokens: float | Tensor | None = None,
    max_completion_length: int | None = None,
) -> Tensor:
    """Aggregate one micro-batch's per-token loss as TRL's `GRPOTrainer` does for `loss_type` (grpo.md Eq. 6-8,
    conventions.md C22), before the division by the gradient-accumulation steps:

        grpo:     (1 / B) Σ_b Σ_t m_{b,t} x_{b,t} / max(1, Σ_t m_{b,t})    mean over each row's loss tokens, then rows
        dapo:     Σ_{b,t} m_{b,t} x_{b,t} / N_tok                             N_tok from `dapo_token_count`
        bnpo:     Σ_{b,t} m_{b,t} x_{b,t} / max(1, Σ_{b,t} m_{b,t})           token mean over this micro-batch
        dr_grpo:  Σ_{b,t} m_{b,t} x_{b,t} / (B * max_completion_length)       Dr. GRPO, https://huggingface.co/papers/2503.20783

    A row without loss tokens adds 0 but still counts in B (as in TRL). TRL's other loss types change the per-token
    loss itself (`cispo`, `sapo`, `vespo`) or need sequence-level ratios (`luspo`); they are refused.

    Args:
        per_token (`Tensor`): (B, T) per-token values (0 off the mask or not: masked entries are ignored).
        mask (`Tensor`): (B, T) loss mask.
        loss_type (`str`): one of `LOSS_TYPES`.
        num_tokens (`float` or `Tensor`, *optional*): N_tok, required for `"dapo"`.
        max_completion_length (`int`, *optional*): the config's `max_completion_length`, required for `"dr_grpo"`.

    Returns:
        `Tensor`: 0-d, in the dtype of `per_token`.

    >>> x, m = torch.tensor([[1.0, 2.0, 9.0], [3.0, 0.0, 0.0]]), torch.tensor([[1, 1, 0], [1, 0, 0]])
    >>> aggregate_loss(x, m, "grpo"), aggregate_loss(x, m, "dr_grpo", max_completion_length=3)
    (tensor(2.2500), tensor(1.))
    """
    if loss_type == "dapo":
        if num_tokens is None:
            raise ValueError("loss_type 'dapo' needs num_tokens (N_tok, from dapo_token_count)")
        return masked_token_mean(per_token, mask, num_tokens)  # grpo.md Eq. 7
    if loss_type == "bnpo":
        return masked_token_mean(per_token, mask)  # grpo.md Eq. 8
    x = _masked64(per_token, mask)  # (B, T)
    if loss_type == "grpo":
        n_row = mask.bool().sum(dim=1).clamp(min=1).to(torch.float64)  # (B,)
        return (x.sum(dim=1) / n_row).mean().to(per_token.dtype)  # grpo.md Eq. 6
    if loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        return (x.sum() / (x.shape[0] * max_completion_length)).to(per_token.dtype)  # Dr. GRPO's constant normaliser
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


def clipped_surrogate(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    c_dual: float | None = None,
) -> Tensor:
    """Per-token PPO clipped surrogate for a given ratio, with an optional dual clip (mpo.md Eq. 16, t1.md Eq. 11).

        L = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A);     dual clip, for A < 0: L <- min(L, -c_dual * A)

    The dual clip caps the loss at c_dual * |A|, so a token with A < 0 and rho > c_dual gets zero gradient.

    Args:
        ratio (`Tensor`): (B, T) importance ratio rho (token ratio, or `turn_importance_ratio`).
        advantages (`Tensor`): (B, T) A (no gradient is taken through it).
        mask (`Tensor`): (B, T) loss mask.
        eps_low (`float`): lower clip range.
        eps_high (`float`): upper clip range.
        c_dual (`float`, *optional*): dual-clip constant (3.0 in MPO); None disables it.

    Returns:
        `Tensor`: (B, T) per-token loss, 0 off the mask, in the dtype of `ratio`.
    """
    rho = _masked64(ratio, mask)  # (B, T)
    adv = _masked64(advantages.detach(), mask)  # (B, T)
    loss = torch.maximum(-adv * rho, -adv * rho.clamp(1.0 - eps_low, 1.0 + eps_high))  # Eq. 16 / t1.md Eq. 11
    if c_dual is not None:
        loss = torch.where(adv < 0, torch.minimum(loss, -c_dual * adv), loss)  # Eq. 16, dual clip
    return torch.where(mask.bool(), loss, 0.0).to(ratio.dtype)


def clipped_surrogate_loss(
    logps: Tensor,
    old_logps: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    c_dual: float | None = None,
) -> Tensor:
    """Per-token PPO loss with the token ratio rho_j = exp(log pi_theta - log pi_old) (t1.md Eq. 10-11,
    https://huggingface.co/papers/2609.11042): L_j = -min(rho_j A_j, clip(rho_j, 1 - eps_low, 1 + eps_high) A_j).

    Args:
        logps (`Tensor`): (B, T) log pi_theta of the sampled tokens (differentiable).
        old_logps (`Tensor`): (B, T) log pi_old (treated as constant).
        advantages (`Tensor`): (B, T) A.
        mask (`Tensor`): (B, T) loss mask.
        eps_low (`float`): lower clip range (0.2 in T1).
        eps_high (`float`): upper clip range (0.2 in T1).
        c_dual (`float`, *optional*): dual clip, see `clipped_surrogate`.

    Returns:
        `Tensor`: (B, T) per-token loss, 0 off the mask, in the dtype of `logps`.
    """
    log_ratio = _masked64(logps, mask) - _masked64(old_logps.detach(), mask)  # (B, T), 0 off the mask
    ratio = torch.exp(log_ratio)  # t1.md Eq. 10
    return clipped_surrogate(ratio, advantages, mask, eps_low, eps_high, c_dual).to(logps.dtype)  # t1.md Eq. 11


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, clip: float) -> Tensor:
    """Per-token clipped value loss (mpo.md Eq. 18, t1.md Eq. 12, https://huggingface.co/papers/2609.11042).

        L_V = max((V - R)^2, (V_clip - R)^2),     V_clip = V_old + clip(V - V_old, -clip, +clip)

    `clip` is absolute, in reward units. When |V - V_old| > clip and the clipped branch has the larger error, the
    gradient w.r.t. V is zero. There is no 1/2 factor; weight the aggregate with the trainer's value coefficient.

    Args:
        values (`Tensor`): (B, T) V_phi (differentiable).
        old_values (`Tensor`): (B, T) V_old, the values the advantages were built from (constant).
        returns (`Tensor`): (B, T) critic targets R (constant).
        mask (`Tensor`): (B, T) loss mask.
        clip (`float`): value clip epsilon_v (0.2).

    Returns:
        `Tensor`: (B, T) per-token loss, 0 off the mask, in the dtype of `values`.
    """
    v = _masked64(values, mask)  # (B, T)
    v_old = _masked64(old_values.detach(), mask)  # (B, T)
    ret = _masked64(returns.detach(), mask)  # (B, T)
    v_clip = v_old + (v - v_old).clamp(-clip, clip)  # Eq. 18
    loss = torch.maximum((v - ret) ** 2, (v_clip - ret) ** 2)  # Eq. 18 / t1.md Eq. 12
    return torch.where(mask.bool(), loss, 0.0).to(values.dtype)


@torch.no_grad()
def clip_fractions(
    ratio: Tensor,
    advantages: Tensor,
    mask: Tensor,
    eps_low: float,
    eps_high: float,
    c_dual: float | None = None,
) -> dict[str, Tensor]:
    """Fractions of loss tokens on which a clip is active (for `actor/clip_frac`, `mpo/token_clip_frac`,
    `mpo/dual_clip_frac`): `clip_frac` counts tokens whose clipped branch binds (A > 0 and rho > 1 + eps_high, or A < 0
    and rho < 1 - eps_low); `dual_clip_frac` counts tokens with A < 0 and rho > c_dual (0 without a dual clip).

    Args:
        ratio (`Tensor`): (B, T) rho.
        advantages (`Tensor`): (B, T) A.
        mask (`Tensor`): (B, T) loss mask.
        eps_low (`float`): lower clip range.
        eps_high (`float`): upper clip range.
        c_dual (`float`, *optional*): dual-clip constant.

    Returns:
        `dict[str, Tensor]`: 0-d float64 tensors `clip_frac` and `dual_clip_frac` (0 when there is no loss token).
    """
    m = mask.bool()
    rho, adv = _masked64(ratio, m), _masked64(advantages, m)
    clipped = ((adv > 0) & (rho > 1.0 + eps_high)) | ((adv < 0) & (rho < 1.0 - eps_low))
    dual = (adv < 0) & (rho > c_dual) if c_dual is not None else torch.zeros_like(m)
    n = m.sum().double().clamp(min=1.0)
    return {"clip_frac": (clipped & m).sum() / n, "dual_clip_frac": (dual & m).sum() / n}
