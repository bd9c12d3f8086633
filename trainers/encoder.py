"""Frozen text encoders for matching reasoning (or actions) across rollouts, docs/methods/alignopsd.md D7.

An encoder maps texts to unit-norm vectors, deterministically (the same text gives the same vector whatever else is in
the batch), and never changes during training. Two are offered:

* `NgramEncoder` (the offline default): hashed character n-grams (n = 3 by default) of the whitespace-normalised,
  lower-cased text, counted with sublinear term frequency (1 + log count) into a fixed number of buckets, then
  L2-normalised. No weights, no download; its similarity is lexical, which suits short agent actions and templated
  reasoning, and it passes the calibration check on the built-in environments.
* `HFEncoder` (any sentence-embedding model folder, e.g. Qwen3-Embedding-0.6B): last-token pooling, left padding,
  truncation that keeps the last `max_length` tokens, L2 normalisation, eval mode under `no_grad`.

`calibration(encoder, texts, groups, gamma)` is the start-up check: the median similarity between texts of different
tasks must be at most γ − 0.2, otherwise similarities near γ cannot mean "the same decision" (alignopsd.md D7).
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter

import torch
from torch import Tensor


class NgramEncoder:
    """Hashed character n-gram vectors (see the module docstring); `dim` buckets, n-grams of length `n`."""

    def __init__(self, dim: int = 4096, n: int = 3):
        if dim < 1 or n < 1:
            raise ValueError(f"dim and n must be >= 1, got {dim}, {n}")
        self.dim, self.n = dim, n

    def __repr__(self) -> str:
        return f"NgramEncoder(dim={self.dim}, n={self.n})"

    def _bucket(self, gram: str) -> int:
        return int.from_bytes(hashlib.blake2b(gram.encode(), digest_size=8).digest(), "little") % self.dim

    def encode(self, texts: list[str]) -> Tensor:
        """(len(texts), dim) float32 unit vectors; an empty text gives the zero vector.

        >>> e = NgramEncoder(dim=64)
        >>> v = e.encode(["buy", "buy ", "search[socks]"])
        >>> round(float(v[0] @ v[1]), 6), float(v[0].norm()) == 1.0
        (1.0, True)
        """
        out = torch.zeros(len(texts), self.dim, dtype=torch.float64)
        for i, text in enumerate(texts):
            t = " ".join(text.lower().split())
            if not t:
                continue
            padded = f" {t} "
            grams = Counter(padded[k : k + self.n] for k in range(max(1, len(padded) - self.n + 1)))
            for gram, count in grams.items():
                out[i, self._bucket(gram)] += 1.0 + math.log(count)
            out[i] /= out[i].norm()
        return out.float()


class HFEncoder:
    """A sentence-embedding model from a local folder (see the module docstring)."""

    def __init__(self, path: str, max_length: int = 4096, device: str | torch.device = "cpu", batch_size: int = 16):
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left", truncation_side="left")
        self.model = AutoModel.from_pretrained(path).to(device).eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        self.max_length, self.batch_size, self.path = max_length, batch_size, path

    def __repr__(self) -> str:
        return f"HFEncoder({self.path!r}, max_length={self.max_length})"

    @torch.no_grad()
    def encode(self, texts: list[str]) -> Tensor:
        out = torch.zeros(len(texts), self.model.config.hidden_size)
        live = [i for i, t in enumerate(texts) if t.strip()]
        for s in range(0, len(live), self.batch_size):
            rows = live[s : s + self.batch_size]
            enc = self.tokenizer(
                [texts[i] for i in rows],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            ).to(self.model.device)
            hidden = self.model(**enc).last_hidden_state  # (b, L, H), left-padded: the last position is the last token
            out[rows] = torch.nn.functional.normalize(hidden[:, -1].float(), dim=-1).cpu()
        return out


def build_encoder(spec: str, device: str | torch.device = "cpu", max_length: int = 4096):
    """`ngram` (the offline default) or a local model folder (`HFEncoder`)."""
    if spec == "ngram":
        return NgramEncoder()
    import os

    if not os.path.isdir(spec):
        raise ValueError(f"encoder {spec!r} is neither 'ngram' nor a local model folder")
    return HFEncoder(spec, max_length=max_length, device=device)


def calibration(encoder, texts: list[str], groups: list[int], gamma: float) -> float | None:
    """The median cosine similarity between non-empty texts of different tasks (`groups`); None with fewer than two
    tasks. Raises when it exceeds γ − 0.2 (alignopsd.md D7): the encoder cannot separate decisions at γ."""
    keep = [i for i, t in enumerate(texts) if t.strip()]
    if len({groups[i] for i in keep}) < 2:
        return None
    vectors = encoder.encode([texts[i] for i in keep])
    sims = vectors @ vectors.T
    g = torch.tensor([groups[i] for i in keep])
    cross = sims[g.unsqueeze(0) != g.unsqueeze(1)]
    median = float(torch.quantile(cross.double(), 0.5))  # the middle two averaged when the count is even
    if median > gamma - 0.2:
        raise ValueError(
            f"encoder {encoder!r}: the median similarity between different tasks' texts is {median:.3f} > "
            f"gamma - 0.2 = {gamma - 0.2:.3f}; use another encoder (alignopsd_encoder) or recalibrate alignopsd_gamma"
        )
    return median
