"""The frozen encoders of AlignOPSD (trainers/encoder.py, alignopsd.md D7 and Eq. 3): the hashed character n-gram
encoder against hand-computed cosines and a plain dictionary re-implementation written here, determinism across batch
compositions, unit norm, the start-up calibration check, `build_encoder`, and the model-folder encoder on the tiny
model (last-token pooling under left padding)."""

from __future__ import annotations

import math
import random
import statistics

import pytest
import torch

from trainers.encoder import HFEncoder, NgramEncoder, build_encoder, calibration

BIG = 1 << 20  # buckets: with a few dozen distinct 3-grams a collision is (checked to be) absent


def plain_ngram_vector(text: str, n: int = 3) -> dict[str, float]:
    """The documented vector without hashing: lower-case, collapse whitespace, pad with one space on each side,
    count the character n-grams, weight 1 + log(count), L2-normalise; {} for a text with nothing left."""
    t = " ".join(text.lower().split())
    if not t:
        return {}
    padded = f" {t} "
    counts: dict[str, int] = {}
    for k in range(max(1, len(padded) - n + 1)):
        gram = padded[k : k + n]
        counts[gram] = counts.get(gram, 0) + 1
    weights = {g: 1.0 + math.log(c) for g, c in counts.items()}
    norm = math.sqrt(sum(w * w for w in weights.values()))
    return {g: w / norm for g, w in weights.items()}


def plain_cosine(a: str, b: str) -> float:
    va, vb = plain_ngram_vector(a), plain_ngram_vector(b)
    return sum(w * vb.get(g, 0.0) for g, w in va.items())


def assert_no_collision(encoder: NgramEncoder, texts: list[str]) -> None:
    grams = {g for t in texts for g in plain_ngram_vector(t, encoder.n)}
    buckets = {encoder._bucket(g) for g in grams}
    assert len(buckets) == len(grams), "a hash collision: pick other strings (the comparison assumes none)"


def test_ngram_cosines_by_hand():
    """alignopsd.md D7: character 3-grams of the space-padded text with sublinear counts. " ab " has the grams
    {" ab", "ab "}, " abc " has {" ab", "abc", "bc "}: one shared, so cos = 1/sqrt(2 * 3). " aaaa " has " aa", "aaa"
    twice and "aa ": weights (1, 1 + ln 2, 1); " aa " has " aa", "aa ": cos = 2 / (sqrt 2 * sqrt(2 + (1 + ln 2)^2)).
    Disjoint grams give 0; identical texts give 1."""
    e = NgramEncoder(dim=BIG)
    texts = ["ab", "abc", "aaaa", "aa", "xyz"]
    assert_no_collision(e, texts)
    v = e.encode(texts).double()
    assert float(v[0] @ v[1]) == pytest.approx(1 / math.sqrt(6), abs=1e-6)
    assert float(v[2] @ v[3]) == pytest.approx(2 / (math.sqrt(2) * math.sqrt(2 + (1 + math.log(2)) ** 2)), abs=1e-6)
    assert float(v[0] @ v[4]) == 0.0
    assert float(v[1] @ v[1]) == pytest.approx(1.0, abs=1e-6)
    # the non-zero coordinates are exactly the weights: " aaaa " -> (1, 1 + ln 2, 1) / norm in three buckets
    nz = sorted(v[2][v[2] != 0].tolist())
    norm = math.sqrt(2 + (1 + math.log(2)) ** 2)
    assert nz == pytest.approx([1 / norm, 1 / norm, (1 + math.log(2)) / norm], abs=1e-6)


def test_ngram_matches_a_dictionary_reimplementation():
    """alignopsd.md D7, Eq. 3: on seeded random short texts (mixed case, runs of spaces, tabs and newlines) every
    pairwise cosine equals the one of the dictionary re-implementation above (no hashing), to 1e-6."""
    rng = random.Random(29)
    alphabet = "abcAB \t\n"
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 14))) for _ in range(24)]
    e = NgramEncoder(dim=BIG)
    assert_no_collision(e, texts)
    v = e.encode(texts).double()
    got = v @ v.T
    for i, a in enumerate(texts):
        for j, b in enumerate(texts):
            assert float(got[i, j]) == pytest.approx(plain_cosine(a, b), abs=1e-6), (a, b)


def test_ngram_deterministic_across_batch_compositions():
    """alignopsd.md D7: the same text gives the same vector whatever else is in the batch and in whatever order
    (1e-6), and two encoders built alike agree (no per-instance state)."""
    rng = random.Random(7)
    pool = ["search[socks]", "buy", "click[size 8]", "", "think about the price", "a", "back to search"]
    alone = {t: NgramEncoder().encode([t])[0] for t in pool}
    for _ in range(10):
        batch = [rng.choice(pool) for _ in range(rng.randint(1, 9))]
        rng.shuffle(batch)
        out = NgramEncoder().encode(batch)
        for i, t in enumerate(batch):
            torch.testing.assert_close(out[i], alone[t], atol=1e-6, rtol=0)
    assert not torch.allclose(alone["buy"], alone["a"])  # different texts do give different vectors


def test_ngram_unit_norm_and_zero_for_empty():
    """alignopsd.md D7: L2-normalised for any text with a character left after normalisation; the zero vector for
    '' and whitespace-only text; float32, (len(texts), dim)."""
    texts = ["x", "Buy socks", " " * 5, "", "\n\t", "a" * 300, "ünïcödé ☃"]
    out = NgramEncoder(dim=64).encode(texts)
    assert out.shape == (7, 64) and out.dtype == torch.float32
    norms = out.double().norm(dim=1).tolist()
    assert norms[0] == pytest.approx(1.0, abs=1e-6) and norms[1] == pytest.approx(1.0, abs=1e-6)
    assert norms[5] == pytest.approx(1.0, abs=1e-6) and norms[6] == pytest.approx(1.0, abs=1e-6)
    assert norms[2] == norms[3] == norms[4] == 0.0
    assert NgramEncoder(dim=64).encode([]).shape == (0, 64)


def test_ngram_normalises_case_and_whitespace():
    """alignopsd.md D7: lower-cased and whitespace-normalised (runs of spaces, tabs, newlines and the ends collapse),
    so these spellings give one vector; removing a space inside the text or changing a letter does not."""
    e = NgramEncoder()
    same = e.encode(["buy socks", "Buy  Socks", "  BUY\tsocks\n", "buy\n\nsocks "])
    for k in range(1, 4):
        torch.testing.assert_close(same[k], same[0], atol=1e-6, rtol=0)
    other = e.encode(["buysocks", "buy sacks"])
    for k in range(2):
        assert float(other[k].double() @ same[0].double()) < 0.99


def test_ngram_rejects_bad_sizes():
    """alignopsd.md D7: dim and n must be at least 1."""
    with pytest.raises(ValueError, match="dim and n"):
        NgramEncoder(dim=0)
    with pytest.raises(ValueError, match="dim and n"):
        NgramEncoder(n=0)


def plain_median_cross(texts: list[str], groups: list[int]) -> float:
    """Median of the cosines of the non-empty texts of different groups, one value per unordered pair, with the
    dictionary re-implementation."""
    keep = [i for i, t in enumerate(texts) if t.strip()]
    sims = [plain_cosine(texts[i], texts[j]) for i in keep for j in keep if i < j and groups[i] != groups[j]]
    return statistics.median(sims)


def test_calibration_is_the_median_cross_task_similarity():
    """alignopsd.md D7: the value is the median similarity between non-empty texts of different tasks, computed here
    with the plain re-implementation (9 and 15 unordered pairs: an odd count, so the median is one pair's value).
    Empty texts do not take part (with them the median here would be 0), pairs within one task neither."""
    e = NgramEncoder(dim=BIG)
    texts = ["search socks", "search red shoes", "search hats", "search sock", "search shoe", "search cats"]
    texts += ["", "  ", "\n", "", " ", "\t"]  # three empty texts per task
    groups = [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 1]
    assert_no_collision(e, texts)
    want = plain_median_cross(texts, groups)
    assert want > 0.3  # with the empty texts' zero similarities (27 of 36 pairs) the median would be 0
    assert calibration(e, texts, groups, gamma=0.8) == pytest.approx(want, abs=1e-6)
    texts2 = [*texts, "click now"]  # 3 x 3 + 3 + 3 = 15 cross pairs
    groups2 = [*groups, 2]
    assert calibration(e, texts2, groups2, gamma=0.8) == pytest.approx(plain_median_cross(texts2, groups2), abs=1e-6)


def test_calibration_needs_two_tasks():
    """alignopsd.md D7: with fewer than two tasks that have a non-empty text there is nothing to compare: None."""
    e = NgramEncoder()
    assert calibration(e, ["a", "b", "c"], [0, 0, 0], gamma=0.8) is None
    assert calibration(e, ["a", "b", ""], [0, 0, 1], gamma=0.8) is None  # task 1 has only an empty text
    assert calibration(e, [], [], gamma=0.8) is None


class AnisotropicEncoder:
    """Every text maps near one direction (cosines about 0.9999): the failure D7's check is for."""

    def __repr__(self) -> str:
        return "AnisotropicEncoder()"

    def encode(self, texts: list[str]) -> torch.Tensor:
        g = torch.Generator().manual_seed(len(texts))
        v = torch.ones(len(texts), 16) + 0.01 * torch.randn(len(texts), 16, generator=g)
        return torch.nn.functional.normalize(v, dim=-1)


def test_calibration_rejects_an_anisotropic_encoder():
    """alignopsd.md D7: a median cross-task similarity above gamma - 0.2 stops training with an error naming the
    encoder and gamma; the lexical encoder on distinct texts passes with the same gamma, and the limit is
    gamma - 0.2 (a median of 0.7 passes gamma = 0.95, fails gamma = 0.85)."""
    texts, groups = ["search socks", "buy now", "click red", "back"], [0, 0, 1, 1]
    with pytest.raises(ValueError, match=r"AnisotropicEncoder\(\).*gamma"):
        calibration(AnisotropicEncoder(), texts, groups, gamma=0.8)
    assert calibration(NgramEncoder(), texts, groups, gamma=0.8) < 0.6

    class Fixed:  # two unit vectors at cosine 0.7
        def encode(self, texts):
            return torch.tensor([[1.0, 0.0], [0.7, math.sqrt(1 - 0.49)]])

    assert calibration(Fixed(), ["a", "b"], [0, 1], gamma=0.95) == pytest.approx(0.7, abs=1e-6)
    with pytest.raises(ValueError, match="gamma"):
        calibration(Fixed(), ["a", "b"], [0, 1], gamma=0.85)


def test_build_encoder(tmp_path):
    """alignopsd.md D7: `ngram` is the n-gram encoder with 4,096 buckets and 3-grams; anything else must be a local
    folder, else a clear error (a missing path and a file are both refused)."""
    e = build_encoder("ngram")
    assert isinstance(e, NgramEncoder) and (e.dim, e.n) == (4096, 3)
    a_file = tmp_path / "weights.bin"
    a_file.write_text("x")
    for spec in (str(tmp_path / "missing"), str(a_file), "Qwen/Qwen3-Embedding-0.6B"):
        with pytest.raises(ValueError, match="neither 'ngram' nor a local model folder"):
            build_encoder(spec)


@pytest.fixture(scope="module")
def hf_encoder(tiny_model_folder):
    return HFEncoder(tiny_model_folder)


def test_hf_encoder_unit_norm_and_empty(hf_encoder, tiny_model_folder):
    """alignopsd.md D7: unit-norm vectors of the hidden size, the zero vector for empty and whitespace-only texts,
    frozen (eval mode, no gradient); `build_encoder` on the folder gives this encoder."""
    texts = ["say apple", "", "say river stone", "   ", "apple"]
    out = hf_encoder.encode(texts)
    assert out.shape == (5, hf_encoder.model.config.hidden_size)
    norms = out.double().norm(dim=1).tolist()
    assert norms[1] == norms[3] == 0.0
    assert [norms[i] for i in (0, 2, 4)] == pytest.approx([1.0, 1.0, 1.0], abs=1e-5)
    assert not hf_encoder.model.training
    assert not any(p.requires_grad for p in hf_encoder.model.parameters())
    assert isinstance(build_encoder(tiny_model_folder), HFEncoder)


def test_hf_encoder_deterministic_across_batch_size_and_padding(hf_encoder):
    """alignopsd.md D7: last-token pooling under left padding, so a text gives the same vector alone, in a batch
    with longer texts (it is left-padded there), and split over several forwards (batch_size 2); 1e-5."""
    short = "say apple"
    longer = ["say river stone cloud amber maple delta", "say orbit pearl quartz", "say apple apple apple apple"]
    alone = hf_encoder.encode([short])[0]
    mixed = hf_encoder.encode([longer[0], short, "", longer[1], longer[2]])
    torch.testing.assert_close(mixed[1], alone, atol=1e-5, rtol=0)
    for k, text in enumerate(longer):
        torch.testing.assert_close(mixed[[0, 3, 4][k]], hf_encoder.encode([text])[0], atol=1e-5, rtol=0)
    small = HFEncoder.__new__(HFEncoder)  # the same model, two texts per forward
    small.__dict__ |= hf_encoder.__dict__ | {"batch_size": 2}
    torch.testing.assert_close(small.encode([longer[0], short, "", longer[1], longer[2]]), mixed, atol=1e-5, rtol=0)
    assert float(alone.double() @ mixed[0].double()) < 1 - 1e-4  # the pooled vectors do depend on the text
