"""AlignOPSD: decision-aligned self-distillation signals used as credit, https://huggingface.co/papers/2609.33391,
docs/methods/alignopsd.md.

Changes relative to GRPO: the policy with privileged information (the environment's skill text, or a per-task hint) in
its system message is the teacher; each turn's student tokens are scored by its own teacher context and by the
teacher contexts of the sibling turns whose text matches it (M1, a corrected gap per token); each rollout is cut into
decision spans and the gaps allocate its advantage to spans, then to turns, with the token sum kept (M2). Unchanged:
TRL's group advantage, the clipped surrogate, the KL term, the loss aggregation. Only `compute_advantages` is
overridden.

This file reads top to bottom: the pure math (below; `# Eq. N` of alignopsd.md on the implementing lines), then
`AlignOPSDConfig` and `AlignOPSDTrainer`.

M1, rectification (one target turn t; its selected sources s come from sibling rollouts of the same task):
* `select_sources` (Eq. 5): keep eligible sources with similarity ≥ γ, the best one per sibling rollout, then the
  K best, ties broken by (−H, rollout, turn);
* `source_weights` (Eq. 6), `cross_logps` (Eq. 7, a probability mixture), `confidence` (Eq. 8), `corrected_gap`
  (Eq. 9-11).

M2, semi-Markov credit (one row of K turns):
* `profiles` (Eq. 12-13), `jsd_bits` (Eq. 14), `boundary_validity` (Eq. 15), `batch_threshold` (Eq. 16),
  `segment` (Eq. 17: semantic boundaries, then guided and forced repair cuts);
* `allocate` (Eq. 18-21: span budgets and turn shares with Σ n r = N), `project_density` (Eq. 22, with the
  clamp-and-correct loop that makes the budget exact), `mix` (Eq. 23).

Notation: n_t model tokens of turn t, N = Σ n_t, s_t = sign(A) · ḡ_t the outcome-aligned evidence, T the credit
temperature.

Decision ids (`Dn`) without a page are docs/methods/alignopsd.md's.
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass, field

import torch
from accelerate.utils import gather_object
from torch import Tensor

from envs.base import skill_card
from rewards.judge import strip_reasoning
from trainers.agent_loop import render_prompt_ids
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, RolloutBatch
from trainers.credit import credit_metrics, redistribute_multiplicative, turn_token_counts
from trainers.encoder import build_encoder, calibration
from trainers.generation import sample_continuations
from trainers.teacher import score_after_prefixes, teacher_logps, with_privileged_block
from trainers.trl_api import unwrap_model_for_generation

logger = logging.getLogger(__name__)

# ---------------------------------------------------------------------------------------------------------------------
# M1: source selection and the corrected gap (Eq. 5-11)


def select_sources(
    sims: list[float], rollouts: list[int], turns: list[int], gamma: float = 0.8, k: int = 3
) -> list[int]:
    """Indices of the selected sources of one target turn (Eq. 5), best first. The candidates are the eligible
    sources (Eq. 4: same task, another rollout, both thinkings non-empty), with similarity `sims[c]`, rollout
    `rollouts[c]` and turn `turns[c]`. Order of the rules: threshold γ, then one source per sibling rollout (its best),
    then the K best; ties by (−H, rollout, turn).

    >>> select_sources([0.9, 0.95, 0.85, 0.7], rollouts=[1, 1, 2, 3], turns=[0, 4, 2, 1], gamma=0.8, k=3)
    [1, 2]
    """
    order = sorted(range(len(sims)), key=lambda c: (-sims[c], rollouts[c], turns[c]))
    chosen, seen = [], set()
    for c in order:
        if sims[c] < gamma:  # threshold first
            continue
        if rollouts[c] in seen:  # at most one source per sibling rollout: its best
            continue
        seen.add(rollouts[c])
        chosen.append(c)
    return chosen[:k]  # then the top K


def source_weights(sims: Tensor, tau_agg: float = 0.10) -> Tensor:
    """ω_s = softmax_s(H[s, t] / τ_agg) over the selected sources (Eq. 6), float64."""
    return torch.softmax(sims.to(torch.float64) / tau_agg, dim=0)


def cross_logps(source_logps: Tensor, weights: Tensor) -> Tensor:
    """log p_cross(y_u) = logsumexp_s(log ω_s + log p_s(y_u)) (Eq. 7): a mixture of probabilities, not a weighted
    mean of log-probs. `source_logps` (S, n) per selected source and token, `weights` (S,); returns (n,) float64.

    >>> p = cross_logps(torch.log(torch.tensor([[0.5], [0.1]], dtype=torch.float64)), torch.tensor([0.5, 0.5]))
    >>> round(float(p.exp()), 9)  # (0.5 + 0.1) / 2
    0.3
    """
    return torch.logsumexp(torch.log(weights.to(torch.float64)).unsqueeze(1) + source_logps.to(torch.float64), dim=0)


def confidence(sims: Tensor, weights: Tensor, gamma: float = 0.8) -> float:
    """ρ = Σ_s ω_s · clamp((H[s, t] − γ) / (1 − γ), 0, 1) ∈ [0, 1] (Eq. 8); 0 with no source.

    >>> round(confidence(torch.tensor([0.9, 1.0], dtype=torch.float64), torch.tensor([0.5, 0.5]), 0.8), 9)  # .25+.5
    0.75
    """
    if sims.numel() == 0:
        return 0.0
    margin = ((sims.to(torch.float64) - gamma) / (1.0 - gamma)).clamp(0.0, 1.0)
    return float((weights.to(torch.float64) * margin).sum())


def corrected_gap(
    diag_logps: Tensor,
    student_logps: Tensor,
    source_logps: Tensor | None = None,
    sims: Tensor | None = None,
    gamma: float = 0.8,
    alpha_max: float = 0.8,
    tau_agg: float = 0.10,
) -> tuple[Tensor, float]:
    """The corrected gap g_u = log p_corr(y_u) − log π_old(y_u) of one target turn's tokens (Eq. 9-11), with
    log p_corr = (1 − α) log p_diag + α log p_cross and α = α_max · ρ (Eq. 9-10). Without selected sources α = 0 and
    p_corr is the diagonal teacher. Returns g (n,) float64, detached, and α.

    Args:
        diag_logps (`Tensor`): (n,) the turn's tokens under its own teacher context.
        student_logps (`Tensor`): (n,) the same tokens under the student context (no privileged information).
        source_logps (`Tensor`, *optional*): (S, n) under each selected source's teacher context.
        sims (`Tensor`, *optional*): (S,) H of the selected sources.
    """
    diag = diag_logps.detach().to(torch.float64)
    if source_logps is None or sims is None or sims.numel() == 0:
        return diag - student_logps.detach().to(torch.float64), 0.0
    sims = sims.detach()  # g is detached (Eq. 11): ω and α must not carry a graph through H either
    weights = source_weights(sims, tau_agg)  # Eq. 6
    alpha = alpha_max * confidence(sims, weights, gamma)  # Eq. 8-9
    corr = (1.0 - alpha) * diag + alpha * cross_logps(source_logps.detach(), weights)  # Eq. 7, Eq. 10
    return corr - student_logps.detach().to(torch.float64), alpha  # Eq. 11


# ---------------------------------------------------------------------------------------------------------------------
# M2: profiles, boundaries and segments (Eq. 12-17)


def profiles(sims: Tensor, eligible: Tensor, gamma: float = 0.8, tau_p: float = 0.10) -> tuple[Tensor, Tensor]:
    """Correspondence profiles of a row's K turns over the task's M sources (Eq. 12) and their validity (Eq. 13).

    P_t = softmax over all eligible sources of H[s, t] / τ_p (dense: no threshold, no top K); a turn with no eligible
    source has an all-zero profile and is invalid; valid(t) ⇔ max over eligible s of H[s, t] ≥ γ.

    Args:
        sims (`Tensor`): (K, M) H[s, t] for the row's target turns t (rows) and the task's sources s (columns).
        eligible (`Tensor`): (K, M) bool, Eq. 4.

    Returns:
        P (K, M) float64 and valid (K,) bool.
    """
    h = sims.to(torch.float64)
    elig = eligible.bool()
    logits = torch.where(elig, h / tau_p, -math.inf)
    any_source = elig.any(dim=1)
    p = torch.where(any_source.unsqueeze(1), torch.softmax(torch.where(any_source.unsqueeze(1), logits, 0.0), 1), 0.0)
    p = torch.where(elig, p, 0.0)
    best = torch.where(elig, h, -math.inf).amax(dim=1)
    return p, any_source & (best >= gamma)


def jsd_bits(p: Tensor, q: Tensor) -> float:
    """JSD(p, q) / log 2 ∈ [0, 1] (Eq. 14), with 0 · log 0 = 0.

    >>> jsd_bits(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])), jsd_bits(torch.ones(2) / 2, torch.ones(2) / 2)
    (1.0, 0.0)
    """
    p, q = p.to(torch.float64), q.to(torch.float64)
    m = 0.5 * (p + q)

    def kl(a: Tensor) -> Tensor:
        return torch.where(a > 0, a * (torch.log(a) - torch.log(m.clamp(min=1e-300))), 0.0).sum()

    return float(min(max((0.5 * kl(p) + 0.5 * kl(q)) / math.log(2.0), 0.0), 1.0))


def boundary_distances(p: Tensor, valid: Tensor, eligible: Tensor) -> tuple[Tensor, Tensor]:
    """d_t = JSD(P_{t−1}, P_t) / log 2 for the boundaries t = 1..K−1 of a row (Eq. 14), and their validity (Eq. 15):
    both turns valid and the same set of eligible sources. Returns d (K,) float64 and ok (K,) bool, index 0 unused."""
    K = p.shape[0]
    d = torch.zeros(K, dtype=torch.float64)
    ok = torch.zeros(K, dtype=torch.bool)
    for t in range(1, K):
        d[t] = jsd_bits(p[t - 1], p[t])
        ok[t] = bool(valid[t - 1]) and bool(valid[t]) and torch.equal(eligible[t - 1].bool(), eligible[t].bool())
    return d, ok


def batch_threshold(distances: Tensor, quantile: float = 0.80, lo: float = 0.01, hi: float = 0.10) -> float:
    """θ = clip(Quantile_0.8 of the valid boundary distances of the whole batch, 0.01, 0.10), linear interpolation;
    +∞ when there is none (Eq. 16).

    >>> batch_threshold(torch.tensor([0.0, 0.05, 0.2])), batch_threshold(torch.tensor([]))
    (0.1, inf)
    """
    if distances.numel() == 0:
        return math.inf
    return min(max(float(torch.quantile(distances.to(torch.float64), quantile)), lo), hi)


@dataclass
class Segmentation:
    """A row's partition into spans (Eq. 17): `starts` are the first turns of the spans, in order (0 first)."""

    starts: list[int]
    semantic: int  # boundaries from step 1
    guided: int  # repair cuts at a valid boundary with d ≥ 0.01
    forced: int  # repair cuts nearest the midpoint

    def spans(self, num_turns: int) -> list[tuple[int, int]]:
        ends = [*self.starts[1:], num_turns]
        return list(zip(self.starts, ends, strict=True))


def segment(
    d: Tensor, ok: Tensor, theta: float, l_min: int = 2, l_max: int = 8, guided_min: float = 0.01
) -> Segmentation:
    """The partition of a row's K turns into spans (Eq. 17). `d`, `ok`: (K,) boundary distances and validity (index t
    is the boundary between turns t − 1 and t; index 0 unused).

    1. Semantic: valid boundaries with d_t > θ, strongest first (ties: smaller t), each accepted when both pieces it
       makes keep at least `l_min` turns given those already accepted.
    2. Repair: while a span is longer than `l_max`, the leftmost such span [a, b) is cut at a feasible p (at least
       `l_min` turns on each side): the valid p with the largest d_p ≥ `guided_min` (ties: leftmost), else the
       feasible p nearest the midpoint (ties: left).

    A row shorter than `l_min` is one span; otherwise every span has length in [l_min, l_max] (needs l_max ≥
    2·l_min − 1).

    >>> segment(torch.tensor([0.0, 0.5, 0.0, 0.3, 0.0]), torch.ones(5, dtype=torch.bool), theta=0.1).starts
    [0, 3]
    """
    if l_max < 2 * l_min - 1:
        raise ValueError(f"l_max must be >= 2 * l_min - 1, got l_min {l_min}, l_max {l_max}")
    K = d.shape[0]
    cuts: list[int] = []
    semantic = guided = forced = 0
    if K >= l_min:
        candidates = [t for t in range(1, K) if bool(ok[t]) and float(d[t]) > theta]
        candidates.sort(key=lambda t: (-float(d[t]), t))
        for t in candidates:  # step 1
            edges = sorted([0, *cuts, K])
            left = max(e for e in edges if e < t)
            right = min(e for e in edges if e > t)
            if t - left >= l_min and right - t >= l_min:
                cuts.append(t)
                semantic += 1
        while True:  # step 2
            edges = sorted([0, *cuts, K])
            long = [(a, b) for a, b in zip(edges, edges[1:], strict=False) if b - a > l_max]
            if not long:
                break
            a, b = long[0]
            feasible = [p for p in range(a + l_min, b - l_min + 1)]
            strong = [p for p in feasible if bool(ok[p]) and float(d[p]) >= guided_min]
            if strong:
                p = sorted(strong, key=lambda p: (-float(d[p]), p))[0]
                guided += 1
            else:
                mid = (a + b) / 2
                p = sorted(feasible, key=lambda p: (abs(p - mid), p))[0]
                forced += 1
            cuts.append(p)
    return Segmentation(starts=sorted([0, *cuts]), semantic=semantic, guided=guided, forced=forced)


# ---------------------------------------------------------------------------------------------------------------------
# M2: credit allocation, projection and mixing (Eq. 18-23)


def allocate(evidence: Tensor, counts: Tensor, spans: list[tuple[int, int]], temperature: float = 0.5) -> Tensor:
    """Raw density r_t (Eq. 19-21) of one row: span budgets b_σ = softmax_σ(log N_σ + S_σ / T) with S_σ the unweighted
    mean evidence of the span, turn shares q_t = softmax_{t ∈ σ}(log n_t + s_t / T), r_t = N · b_σ · q_t / n_t, so
    that Σ n_t r_t = N. `evidence` (K,) s_t = sign(A) · ḡ_t (Eq. 18); `counts` (K,) n_t ≥ 1; float64.

    >>> allocate(torch.tensor([0.3, 0.3, 0.3]), torch.tensor([1, 2, 5]), [(0, 1), (1, 3)]).tolist()  # equal evidence
    [1.0, 1.0, 1.0]
    """
    s = evidence.to(torch.float64)
    n = counts.to(torch.float64)
    N = n.sum()
    span_logits = torch.stack([torch.log(n[a:b].sum()) + s[a:b].mean() / temperature for a, b in spans])
    budgets = torch.softmax(span_logits, dim=0)  # Eq. 19
    r = torch.zeros_like(s)
    for (a, b), budget in zip(spans, budgets, strict=True):
        share = torch.softmax(torch.log(n[a:b]) + s[a:b] / temperature, dim=0)  # Eq. 20
        r[a:b] = N * budget * share / n[a:b]  # Eq. 21
    return r


def project_density(
    r: Tensor, counts: Tensor, lo: float = 0.0, hi: float = 4.0, iters: int = 200, tol: float = 1e-9
) -> tuple[Tensor, bool]:
    """h = argmin Σ n (h − r)² subject to lo ≤ h ≤ hi and Σ n h = N (Eq. 22): h = clamp(r − λ, lo, hi) with λ by
    bisection, then the budget residual added to the coordinates strictly inside the bounds, clamped again and
    repeated until every value is within its bounds and the token sum is within `tol` · N of N (conventions.md C21,
    alignopsd.md D4).
    Returns h (K,) float64 and False when every coordinate sat at a bound with a residual left (logged by the caller).

    >>> h, _ = project_density(torch.tensor([2.5, 0.25, 0.25]), torch.tensor([1, 1, 1]), hi=2.0)
    >>> [round(x, 9) for x in h.tolist()]  # a plain clamp gives [2, 0.25, 0.25], whose sum 2.5 misses N = 3
    [2.0, 0.5, 0.5]
    """
    r = r.to(torch.float64)
    n = counts.to(torch.float64)
    N = float(n.sum())
    if N * lo > N + 1e-12 or N * hi < N - 1e-12:
        raise ValueError(f"the bounds [{lo}, {hi}] cannot hold a density of mean 1")
    if bool(((r >= lo) & (r <= hi)).all()) and abs(float((n * r).sum()) - N) <= tol * N:
        return r.clone(), True  # already feasible: h = r
    low, high = float(r.min()) - hi, float(r.max()) - lo  # Σ n clamp(r − λ) is non-increasing in λ
    for _ in range(iters):
        lam = 0.5 * (low + high)
        if float((n * (r - lam).clamp(lo, hi)).sum()) > N:
            low = lam
        else:
            high = lam
    h = (r - 0.5 * (low + high)).clamp(lo, hi)
    for _ in range(100):  # C21: residual correction on the free coordinates, clamped, until exact
        residual = N - float((n * h).sum())
        if abs(residual) <= tol * N:
            return h, True
        free = (h > lo) & (h < hi)
        if not bool(free.any()):
            return h, False
        h = torch.where(free, h + residual / float(n[free].sum()), h).clamp(lo, hi)
    return h, abs(N - float((n * h).sum())) <= tol * N


def mix(h: Tensor, beta: float = 0.5) -> Tensor:
    """w_t = (1 − β) + β · h_t (Eq. 23); Σ n w = N when Σ n h = N.

    >>> mix(torch.tensor([0.0, 2.0])).tolist()
    [0.5, 1.5]
    """
    return (1.0 - beta) + beta * h.to(torch.float64)


def row_weights(
    gap_means: Tensor,
    adv: float,
    counts: Tensor,
    spans: list[tuple[int, int]],
    temperature: float = 0.5,
    bounds: tuple[float, float] = (0.0, 4.0),
    beta: float = 0.5,
) -> tuple[Tensor, bool]:
    """w of one row from its turns' mean corrected gaps ḡ_t (Eq. 18-23): s = sign(A) · ḡ, raw density, projection,
    mixing. A = 0 gives w ≡ 1 (s ≡ 0). Returns w (K,) float64 and the projection's success flag."""
    gap_means = gap_means.detach()  # w is detached (Eq. 24: Â = A · sg(w))
    s = math.copysign(1.0, adv) * gap_means.to(torch.float64) if adv != 0 else torch.zeros(gap_means.shape[0])
    r = allocate(s, counts, spans, temperature)  # Eq. 19-21
    h, ok = project_density(r, counts, *bounds)  # Eq. 22
    return mix(h, beta), ok  # Eq. 23


# ---------------------------------------------------------------------------------------------------------------------
# The trainer


@dataclass
class AlignOPSDConfig(AgentGRPOConfig):
    """AgentGRPOConfig plus AlignOPSD's fields (`docs/methods/alignopsd.md` §5)."""

    alignopsd_pi: str = field(
        default="skills",
        metadata={
            "help": "Privileged information: `skills` (the environment's `skill` text) or `column:<name>` (a dataset "
            "column of per-task hints) (alignopsd.md D6)."
        },
    )
    alignopsd_match_on: str = field(
        default="thinking",
        metadata={
            "help": "What is embedded and matched: `thinking` (text inside <think>...</think>, the paper's) or "
            "`action` (the visible turn text, for policies that do not think; alignopsd.md D5)."
        },
    )
    alignopsd_encoder: str = field(
        default="ngram",
        metadata={"help": "`ngram` (offline hashed n-grams) or a local embedding-model folder (§4.4)."},
    )
    alignopsd_encoder_max_length: int = field(default=4096, metadata={"help": "Encoder input tokens (kept: last)."})
    alignopsd_gamma: float = field(default=0.8, metadata={"help": "γ: match threshold (alignopsd.md Eq. 5, Eq. 13)."})
    alignopsd_top_k: int = field(default=3, metadata={"help": "K: most sources per target turn (Eq. 5)."})
    alignopsd_alpha_max: float = field(
        default=0.8, metadata={"help": "α_max: most rectification (Eq. 9); 0 keeps each turn's own gap alone (§8)."}
    )
    alignopsd_tau_agg: float = field(default=0.10, metadata={"help": "τ_agg of the source weights (Eq. 6)."})
    alignopsd_tau_p: float = field(default=0.10, metadata={"help": "τ_p of the profiles (Eq. 12)."})
    alignopsd_l_min: int = field(default=2, metadata={"help": "Shortest span, turns (Eq. 17)."})
    alignopsd_l_max: int = field(default=8, metadata={"help": "Longest span, turns (Eq. 17)."})
    alignopsd_temperature: float = field(default=0.5, metadata={"help": "T: credit temperature (Eq. 19-20)."})
    alignopsd_beta: float = field(default=0.5, metadata={"help": "β: mixing of the density (Eq. 23)."})
    alignopsd_projection: str = field(
        default="legacy", metadata={"help": "`legacy` (h in [0, 4]) or `bounded` (h in [0.8, 1.2]) (Eq. 22)."}
    )
    alignopsd_teacher_max_tokens: int = field(default=2048, metadata={"help": "Teacher generation tokens per turn."})
    alignopsd_teacher_batch_size: int | None = field(
        default=None, metadata={"help": "Teacher generations per generate call; None: per_device_train_batch_size."}
    )
    alignopsd_teacher_deadline: float = field(
        default=600.0, metadata={"help": "Seconds for a step's teacher generations; unfinished ones are empty (D5)."}
    )

    def __post_init__(self):
        super().__post_init__()
        if not (self.alignopsd_pi == "skills" or self.alignopsd_pi.startswith("column:")):
            raise ValueError(f"alignopsd_pi must be 'skills' or 'column:<name>', got {self.alignopsd_pi!r}")
        if self.alignopsd_match_on not in ("thinking", "action"):
            raise ValueError(f"alignopsd_match_on must be 'thinking' or 'action', got {self.alignopsd_match_on!r}")
        if self.alignopsd_projection not in PROJECTIONS:
            raise ValueError(f"alignopsd_projection must be one of {sorted(PROJECTIONS)}")
        if not 0 < self.alignopsd_gamma < 1:
            raise ValueError(f"alignopsd_gamma must be in (0, 1), got {self.alignopsd_gamma}")
        if self.alignopsd_top_k < 1 or self.alignopsd_teacher_max_tokens < 1:
            raise ValueError("alignopsd_top_k and alignopsd_teacher_max_tokens must be >= 1")
        if not 0 <= self.alignopsd_alpha_max <= 1 or not 0 < self.alignopsd_beta <= 1:
            raise ValueError("alignopsd_alpha_max must be in [0, 1] and alignopsd_beta in (0, 1]")
        if min(self.alignopsd_tau_agg, self.alignopsd_tau_p, self.alignopsd_temperature) <= 0:
            raise ValueError("alignopsd_tau_agg, alignopsd_tau_p and alignopsd_temperature must be > 0")
        if self.alignopsd_l_min < 1 or self.alignopsd_l_max < 2 * self.alignopsd_l_min - 1:
            raise ValueError("alignopsd_l_max must be >= 2 * alignopsd_l_min - 1 (alignopsd.md Eq. 17)")


PROJECTIONS = {"legacy": (0.0, 4.0), "bounded": (0.8, 1.2)}


def thinking_text(text: str) -> str:
    """The text inside the first `<think>…</think>`; '' when there is none or it is never closed (alignopsd.md D5).

    >>> thinking_text("<think> go left </think>left"), thinking_text("<think>cut off")
    ('go left', '')
    """
    m = re.search(r"<think>(.*?)</think>", text, flags=re.DOTALL)
    return m.group(1).strip() if m else ""


def visible_text(text: str) -> str:
    """The turn's text without its reasoning (what `action` matching embeds)."""
    return strip_reasoning(text)


class AlignOPSDTrainer(AgentGRPOTrainer):
    """AlignOPSD on the agent GRPO base (alignopsd.md); only `compute_advantages` is overridden. The parameters are
    the base's, in TRL's order."""

    config_class = AlignOPSDConfig

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.env_factory is None:
            raise ValueError("AlignOPSD needs an environment: its teacher re-reads multi-turn rollouts")
        self.encoder = build_encoder(
            self.args.alignopsd_encoder, self.accelerator.device, self.args.alignopsd_encoder_max_length
        )
        self.credit = None
        self._calibrated = False

    # -- privileged information (D6) ----------------------------------------------------------------------------------
    def pi_block(self, row: dict) -> str:
        spec = self.args.alignopsd_pi
        text = self.env_factory(row).skill if spec == "skills" else str(row.get(spec.partition(":")[2]) or "")
        return skill_card(text)

    def _texts(self, raw: str) -> str:
        return thinking_text(raw) if self.args.alignopsd_match_on == "thinking" else visible_text(raw)

    @torch.no_grad()
    def teacher_generate(self, contexts: list[list[int]]) -> tuple[list[str], int, int]:
        """One free teacher generation per context (alignopsd.md Eq. 2), at the rollout's sampling settings, in chunks,
        under the step's deadline; an unfinished generation gives ''. Returns texts, timeouts, generated tokens.

        The generation engine's `sample_continuations` samples them. The contexts of one episode's turns extend one
        another, so on a plain decoder they are sampled as branches of one sequence: each chunk prefills an episode
        once and every turn branches from its cache. Prefilling every context alone cost a step of a 20-turn episode
        batch seven times GRPO's (bench/results/terminal_level2_guided/alignopsd_s0_stopped). Other models
        (sliding-window or linear-attention layers, weights sharded over processes) go through `generate`, a context a
        row."""
        args, tok = self.args, getattr(self.processing_class, "tokenizer", self.processing_class)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        eos = sorted(set(self.eos_token_ids or [tok.eos_token_id]))
        limit = args.alignopsd_teacher_max_tokens
        texts, timeouts, tokens = [""] * len(contexts), 0, 0
        size = args.alignopsd_teacher_batch_size or args.per_device_train_batch_size
        sampling = dict(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, min_p=self.min_p)
        sampling["repetition_penalty"] = self.repetition_penalty
        with unwrap_model_for_generation(self.model_wrapped, self.accelerator) as model:
            generated = sample_continuations(
                model, contexts, limit, eos, pad, size, time.monotonic() + args.alignopsd_teacher_deadline, **sampling
            )
        for i, row in enumerate(generated):
            cut = next((k for k, t in enumerate(row or []) if t in eos), None)
            if cut is None and len(row or []) < limit:
                timeouts += 1  # stopped by the deadline, or never started: unfinished (D5)
                continue
            row = row[:cut] if cut is not None else row
            tokens += len(row)
            texts[i] = self._texts(tok.decode(row, skip_special_tokens=True))
        return texts, timeouts, tokens

    def compute_advantages(self, batch: RolloutBatch) -> torch.Tensor:
        args, acc = self.args, self.accelerator
        device = batch.advantages.device
        B, K = batch.turn_valid.shape
        tok = getattr(self.processing_class, "tokenizer", self.processing_class)
        n = turn_token_counts(batch.turn_index, K)  # (B, K)
        live = batch.turn_valid.bool() & (n > 0)
        groups = batch.group_ids.tolist()
        adv = batch.advantages.tolist()
        metrics: dict[str, float] = {}
        # groups whose every A is 0 skip everything (D8); a group without PI falls back (D5)
        blocks = [self.pi_block(row) for row in batch.rows]
        start_row = acc.process_index * B if acc.num_processes > 1 else 0
        all_adv, all_groups, all_blocks = adv, groups, blocks
        if acc.num_processes > 1:
            all_adv, all_groups, all_blocks = gather_object(adv), gather_object(groups), gather_object(blocks)
        active = {g for g, a in zip(all_groups, all_adv, strict=True) if a != 0}
        no_pi = {g for g, b in zip(all_groups, all_blocks, strict=True) if not b}
        work = [b for b in range(B) if groups[b] in active and groups[b] not in no_pi]
        # teacher prompts, the turn starts and the student's texts of this process's rows
        pi_prompts: list[list[int]] = [[] for _ in range(B)]
        for b in work:
            msgs = with_privileged_block(batch.rows[b]["prompt_messages"], blocks[b])
            pi_prompts[b] = render_prompt_ids(tok, msgs, batch.rows[b].get("prompt_tools"))
        starts = torch.full((B, K), -1, dtype=torch.long)
        for b in range(B):
            for t in range(K):
                where = (batch.turn_index[b] == t).nonzero().flatten()
                if where.numel():
                    starts[b, t] = int(where[0])
        contexts, slots = [], []
        for b in work:
            for t in range(K):
                if bool(live[b, t]):
                    contexts.append(pi_prompts[b] + batch.completion_ids[b, : int(starts[b, t])].tolist())
                    slots.append((b, t))
        clock = time.monotonic()
        generated, timeouts, gen_tokens = self.teacher_generate(contexts)  # Eq. 2
        metrics["alignopsd/teacher_gen_s"] = time.monotonic() - clock
        teacher = [["" for _ in range(K)] for _ in range(B)]
        for (b, t), text in zip(slots, generated, strict=True):
            teacher[b][t] = text
        student = [
            [self._texts(row["transcript"][t]["action"]) if t < len(row["transcript"]) else "" for t in range(K)]
            for row in batch.rows
        ]
        # every process sees the batch's texts, prompts and completions (sources can be on another process)
        record = [
            (pi_prompts[b], batch.completion_ids[b].tolist(), starts[b].tolist(), teacher[b], student[b])
            for b in range(B)
        ]
        records = gather_object(record) if acc.num_processes > 1 else record
        # H per task group (Eq. 3), eligibility (Eq. 4)
        clock = time.monotonic()
        sims_of, encoder_ok = {}, True
        try:
            texts = [text for r in records for text in r[3]] + [text for r in records for text in r[4]]
            if not self._calibrated:  # the first batch: the encoder must separate tasks at γ (§4.4 item 4, D5)
                groups_of_texts = [g for g in all_groups for _ in range(K)] * 2
                median = calibration(self.encoder, texts, groups_of_texts, args.alignopsd_gamma)
                if median is not None:
                    metrics["alignopsd/encoder_calibration_median"] = median
                self._calibrated = True
                empty = [not student[b][t] for b in range(B) for t in range(K) if bool(live[b, t])]
                if empty and sum(empty) > len(empty) / 2:
                    logger.warning(
                        "AlignOPSD: %d of %d turns have no %s to match; those turns get no sources and no semantic "
                        "boundaries (alignopsd.md D5). A policy that does not think should use alignopsd_match_on: "
                        "action",
                        sum(empty),
                        len(empty),
                        "thinking" if args.alignopsd_match_on == "thinking" else "visible text",
                    )
            used = [g in active and g not in no_pi for g in all_groups for _ in range(K)] * 2  # D8: skipped groups
            vectors = self.encoder.encode([t if keep else "" for t, keep in zip(texts, used, strict=True)])
            vectors = vectors.to(torch.float64)  # an empty text is the zero vector; skipped groups cost nothing
            M = len(records) * K
            teacher_vec, student_vec = vectors[:M].view(len(records), K, -1), vectors[M:].view(len(records), K, -1)
            for g in set(all_groups):
                rows = [i for i, x in enumerate(all_groups) if x == g]
                sims_of[g] = (rows, torch.einsum("rkd,sjd->rksj", student_vec[rows], teacher_vec[rows]))
        except ValueError:
            raise  # the calibration check: stop with its message (§4.4 item 4)
        except Exception as err:  # D8: an encoder failure leaves H undefined: α = 0, no semantic boundaries
            logger.warning(
                "AlignOPSD encoder failed (%s: %s): diagonal teachers only this step", type(err).__name__, err
            )
            encoder_ok = False
        metrics["alignopsd/encoder_s"] = time.monotonic() - clock
        # M1 for this process's rows: diagonal and student passes, then the cross passes (Eq. 5-11)
        clock = time.monotonic()
        fallback = torch.zeros(B, dtype=torch.bool, device=device)
        reasons: list[str | None] = [None] * B
        try:
            scored = teacher_logps(self, batch, [blocks[b] if b in work else None for b in range(B)])
        except (RuntimeError, ValueError) as err:
            logger.warning("AlignOPSD teacher pass failed (%s: %s); rows keep GRPO", type(err).__name__, err)
            scored = None
        gaps = torch.zeros(B, K, dtype=torch.float64)  # ḡ (Eq. 18)
        cross_jobs, cross_meta = [], []
        selections: dict[tuple[int, int], tuple[list[tuple[int, int]], Tensor]] = {}
        stats = {"sources": [], "rho": [], "alpha": [], "off": [], "disp": [], "sims": [], "matched": 0, "targets": 0}
        for b in range(B):
            if groups[b] not in active:
                reasons[b], fallback[b] = "zero_adv", True
                continue
            if groups[b] in no_pi:
                reasons[b], fallback[b] = "no_pi", True
                continue
            if scored is None:
                reasons[b], fallback[b] = "teacher_failure", True
                continue
            gi = start_row + b
            for t in range(K):
                if not bool(live[b, t]) or not student[b][t] or not encoder_ok:
                    continue
                rows, sims = sims_of[groups[b]]
                me = rows.index(gi)
                cand, cand_sims, cand_rows, cand_turns = [], [], [], []
                for ri, r in enumerate(rows):
                    if r == gi:
                        continue  # Eq. 4: another rollout only
                    for j in range(K):
                        if records[r][3][j]:
                            cand.append((r, j))
                            cand_sims.append(float(sims[me, t, ri, j]))
                            cand_rows.append(r)
                            cand_turns.append(j)
                stats["targets"] += 1
                stats["sims"] += cand_sims
                chosen = select_sources(cand_sims, cand_rows, cand_turns, args.alignopsd_gamma, args.alignopsd_top_k)
                if not chosen:
                    continue
                stats["matched"] += 1
                picked = [cand[c] for c in chosen]
                selections[(b, t)] = (picked, torch.tensor([cand_sims[c] for c in chosen], dtype=torch.float64))
                y = batch.completion_ids[b][batch.turn_index[b] == t].tolist()
                for r, j in picked:
                    prompt, turn_starts = records[r][0], records[r][2]
                    cross_jobs.append((r, len(prompt) + turn_starts[j], y))  # y after source (r, j)'s context
                    cross_meta.append((b, t))
        sequences = [r[0] + r[1] for r in records]  # each row's teacher prompt and completion
        cross = score_after_prefixes(self, sequences, cross_jobs)  # the log p_s of Eq. 7, one forward per source row
        by_target: dict[tuple[int, int], list[Tensor]] = {}
        for key, logps in zip(cross_meta, cross, strict=True):
            by_target.setdefault(key, []).append(logps)
        metrics["alignopsd/teacher_forward_s"] = time.monotonic() - clock
        g_sum = []
        for b in range(B):
            if fallback[b]:
                continue
            for t in range(K):
                if not bool(live[b, t]):
                    continue
                on = batch.turn_index[b] == t
                diag, own = scored.with_block[b][on], scored.without_block[b][on]
                sel = selections.get((b, t))
                if sel is None:
                    g, alpha = corrected_gap(diag, own)  # Eq. 11 with α = 0
                else:
                    picked, sims = sel
                    src = torch.stack(by_target[(b, t)])  # (S, n)
                    g, alpha = corrected_gap(
                        diag, own, src, sims, args.alignopsd_gamma, args.alignopsd_alpha_max, args.alignopsd_tau_agg
                    )
                    w = source_weights(sims, args.alignopsd_tau_agg)
                    stats["sources"].append(len(picked))
                    stats["rho"].append(alpha / args.alignopsd_alpha_max if args.alignopsd_alpha_max else 0.0)
                    stats["alpha"].append(alpha)
                    stats["off"].append(
                        float(sum(wi for wi, (_, j) in zip(w.tolist(), picked, strict=True) if j != t))
                    )
                    stats["disp"] += [abs(j - t) for _, j in picked]
                gaps[b, t] = float(g.mean())  # Eq. 18
                g_sum.append(float(g.mean()))
        # M2: profiles, boundaries, θ over the whole batch (Eq. 12-16, D10), segments, weights (Eq. 17-23)
        bounds = PROJECTIONS[args.alignopsd_projection]
        rows_m2 = {}
        local_d = []
        for b in range(B):
            if fallback[b]:
                continue
            turns = [t for t in range(K) if bool(live[b, t])]
            if encoder_ok:
                rows, sims = sims_of[groups[b]]
                me = rows.index(start_row + b)
                cols = [
                    (ri, j) for ri, r in enumerate(rows) if r != start_row + b for j in range(K) if records[r][3][j]
                ]
                h = torch.zeros(len(turns), max(1, len(cols)), dtype=torch.float64)
                elig = torch.zeros_like(h, dtype=torch.bool)
                for a, t in enumerate(turns):
                    for c, (ri, j) in enumerate(cols):
                        h[a, c] = sims[me, t, ri, j]
                        elig[a, c] = bool(student[b][t])
                p, valid = profiles(h, elig, args.alignopsd_gamma, args.alignopsd_tau_p)  # Eq. 12-13
                d, ok = boundary_distances(p, valid, elig)  # Eq. 14-15
            else:
                d, ok = torch.zeros(len(turns), dtype=torch.float64), torch.zeros(len(turns), dtype=torch.bool)
            rows_m2[b] = (turns, d, ok)
            local_d += [float(d[k]) for k in range(1, len(turns)) if bool(ok[k])]
        all_d = gather_object(local_d) if acc.num_processes > 1 else local_d
        theta = batch_threshold(torch.tensor(all_d, dtype=torch.float64))  # Eq. 16
        w_full = torch.ones(B, K, dtype=torch.float64)
        seg_counts = {"semantic": 0, "guided": 0, "forced": 0}
        seg_lens, segs_per_row, residuals, at_bound = [], [], [], []
        boundaries = valid_boundaries = 0
        for b, (turns, d, ok) in rows_m2.items():
            seg = segment(d, ok, theta, args.alignopsd_l_min, args.alignopsd_l_max)  # Eq. 17
            spans = seg.spans(len(turns))
            for name in seg_counts:
                seg_counts[name] += getattr(seg, name)
            seg_lens += [e - s for s, e in spans]
            segs_per_row.append(len(spans))
            boundaries += max(0, len(turns) - 1)
            valid_boundaries += int(ok[1:].sum()) if len(turns) > 1 else 0
            counts = n[b, turns]
            w, feasible = row_weights(
                gaps[b, turns], adv[b], counts, spans, args.alignopsd_temperature, bounds, args.alignopsd_beta
            )  # Eq. 18-23
            if not feasible:
                logger.warning("AlignOPSD projection left a residual on a row (conventions.md C21)")
            h = (w - (1.0 - args.alignopsd_beta)) / args.alignopsd_beta  # Eq. 23 inverted: the projected density
            at_bound += [abs(x - bounds[0]) < 1e-9 or abs(x - bounds[1]) < 1e-9 for x in h.tolist()]
            nf = counts.to(torch.float64)
            residuals.append(abs(float((nf * w).sum()) - float(nf.sum())) / float(nf.sum()))
            w_full[b, turns] = w
        out = redistribute_multiplicative(  # Eq. 24 (credit-interface.md Eq. I-2)
            batch.advantages, batch.turn_index, w_full.to(device), batch.turn_valid, fallback, reasons, n
        )
        self.credit = out
        metrics |= credit_metrics(out, batch.advantages, batch.turn_index, batch.turn_valid)
        metrics |= alignopsd_metrics(live, fallback, w_full, student, teacher, work, stats, g_sum, no_pi, all_groups)
        metrics.update(
            {
                "alignopsd/teacher_timeouts": float(timeouts),
                "alignopsd/teacher_gen_tokens_mean": gen_tokens / len(contexts) if contexts else math.nan,
                "alignopsd/theta": theta,
                "alignopsd/valid_boundary_frac": valid_boundaries / boundaries if boundaries else math.nan,
                "alignopsd/segments_per_traj_mean": _mean(segs_per_row),
                "alignopsd/segment_len_mean": _mean(seg_lens),
                "alignopsd/projection_active_frac": _mean([float(x) for x in at_bound]),
                "alignopsd/budget_residual_max": max(residuals) if residuals else math.nan,
            }
        )
        metrics |= {f"alignopsd/boundaries_{kind}": float(count) for kind, count in seg_counts.items()}
        for name, value in metrics.items():
            self.log_metric(name, value)
        return out.advantages


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def alignopsd_metrics(live, fallback, w_full, student, teacher, work, stats, gaps, no_pi, groups) -> dict[str, float]:
    """The texts', M1's and the weights' `alignopsd/*` metrics of one batch (alignopsd.md; `stats` is M1's tally)."""
    nan = math.nan
    B, K = live.shape
    turns = [(b, t) for b in range(B) for t in range(K) if bool(live[b, t])]
    worked = set(work)
    m = {
        "alignopsd/empty_thinking_frac": _mean([float(not student[b][t]) for b, t in turns]),
        "alignopsd/teacher_empty_thinking_frac": _mean([float(not teacher[b][t]) for b, t in turns if b in worked]),
        "alignopsd/match_rate": stats["matched"] / stats["targets"] if stats["targets"] else nan,
        "alignopsd/sources_per_turn_mean": _mean(stats["sources"]),
        "alignopsd/rho_mean": _mean(stats["rho"]),
        "alignopsd/alpha_mean": _mean(stats["alpha"]),
        "alignopsd/off_turn_share": _mean(stats["off"]),
        "alignopsd/turn_displacement_median": float(torch.tensor(stats["disp"]).float().median())
        if stats["disp"]
        else nan,
        "alignopsd/gap_mean": _mean(gaps),
        "alignopsd/gap_abs_mean": _mean([abs(x) for x in gaps]),
        "alignopsd/no_pi_frac": len(no_pi) / len(set(groups)) if groups else nan,
    }
    sims = stats["sims"]
    for q, name in ((0.1, "p10"), (0.5, "p50"), (0.9, "p90")):
        m[f"alignopsd/encoder_sim_{name}"] = float(torch.quantile(torch.tensor(sims), q)) if sims else nan
    credited = ~fallback.cpu()
    w = w_full[credited.unsqueeze(1).expand_as(w_full) & live.cpu()]
    m["alignopsd/w_min"] = float(w.min()) if w.numel() else nan
    m["alignopsd/w_max"] = float(w.max()) if w.numel() else nan
    m["alignopsd/w_std"] = float(w.std(unbiased=False)) if w.numel() else nan
    return m
