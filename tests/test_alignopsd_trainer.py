"""AlignOPSD's trainer (alignopsd.md §7, the properties that need the teacher passes): the packed cross passes of
`score_after_prefixes` against separate plain forwards (teacher-pass.md D6), and `AlignOPSDTrainer.compute_advantages`
on a real generation batch of the tiny echo setup: the credit-interface output (Eq. 24), zero-variance and no-PI
groups (D8, D5), teacher timeouts, encoder failure and the calibration check (D8, D7), what is matched (D6), process
equivalence (D10) and the config checks.

The batch: 12 echo episodes of 4 turns from a scripted policy (the expert's word except at a few chosen turns, where
it says "quartz"), three tasks of G = 4 rollouts each. Group 0 and group 1 have varied returns; group 2 never misses,
so all its A are 0. The privileged information is a `hint` column (`alignopsd_pi="column:hint"`); matching is by
action. Where a test needs matches, the teacher's generation is replaced by the word its context asks for (the last
"say <word>"), so a student turn that said the expected word matches every sibling's teacher at that turn with
similarity 1 and nothing else (the words of one task are far apart for the n-gram encoder at γ = 0.8)."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
import torch
from conftest import CPU_ARGS, EchoEnv
from datasets import Dataset

import trainers.alignopsd as alignopsd_module
import trainers.generation as generation
from trainers import agent_loop
from trainers.alignopsd import AlignOPSDConfig, AlignOPSDTrainer, thinking_text, visible_text
from trainers.teacher import score_after_prefixes, teacher_logps

TASKS = [
    ["apple", "river", "stone", "cloud"],
    ["amber", "maple", "delta", "orbit"],
    ["pearl", "quartz", "apple", "river"],
]
MISS = "quartz"  # said instead of the expected word at these (row, turn); never expected in groups 0 and 1
MISSES = {(1, 1), (2, 0), (2, 2), (3, 1), (4, 2), (6, 0)}
G = 4
HINTS = [f"Hint {g}: repeat exactly the word you are asked to say." for g in range(3)]
TEMPERATURE = 0.7


def settings(tmp_path, **kw) -> dict:
    return (
        dict(
            output_dir=str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=G,
            max_completion_length=100,
            max_turn_tokens=4,
            temperature=TEMPERATURE,
            alignopsd_pi="column:hint",
            alignopsd_match_on="action",
            alignopsd_teacher_max_tokens=4,
            **CPU_ARGS,
        )
        | kw
    )


def scripted_policy(model, tokenizer, **kwargs):
    """agent_loop's generate: row i says the word its context asks for, or MISS at its turns in MISSES (every
    episode has 4 words and runs 4 turns, so the i-th context of the k-th call is row i's turn k)."""
    calls = {"k": 0}

    def generate(contexts, max_new_tokens):
        k = calls["k"]
        calls["k"] += 1
        out = []
        for i, ctx in enumerate(contexts):
            word = MISS if (i, k) in MISSES else asked_word(tokenizer, ctx)
            ids = tokenizer(word, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            out.append((ids, [-1.0] * len(ids)))
        return out

    return generate


def asked_word(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids).rsplit("say ", 1)[-1].split("<|im_end|>")[0].strip()


class Recording(AlignOPSDTrainer):
    def compute_advantages(self, batch):
        out = super().compute_advantages(batch)
        self.seen = (batch, out)
        return out


@pytest.fixture(scope="module")
def setup(tiny_model_folder, tmp_path_factory):
    """The trainer and one real generation batch (through `_generate_and_score_completions`), with its output."""
    rows = [{"prompt": "say x", "task": {"words": w}, "hint": h} for w, h in zip(TASKS, HINTS, strict=True)]
    data = Dataset.from_list(rows)
    args = AlignOPSDConfig(**settings(tmp_path_factory.mktemp("alignopsd")))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(agent_loop, "hf_generate", scripted_policy)
        trainer = Recording(model=tiny_model_folder, train_dataset=data, args=args, env_factory=lambda r: EchoEnv())
        trainer.model.train()  # metrics go to "train", as inside train()
        mp.setattr(trainer, "teacher_generate", ExpertTeacher(trainer))
        torch.manual_seed(0)
        trainer.generate_and_score([dict(data[i // G]) for i in range(len(TASKS) * G)])
    batch, out = trainer.seen
    trainer.first_credit = trainer.credit  # later calls replace trainer.credit
    hits = [
        [r["action"] == TASKS[b // G][t] for t, r in enumerate(row["transcript"])] for b, row in enumerate(batch.rows)
    ]
    assert [len(h) for h in hits] == [4] * 12 and all(not hits[b][t] for b, t in MISSES)  # the script ran as meant
    adv = batch.advantages.tolist()
    assert all(a == 0 for a in adv[8:]) and all(a != 0 for a in adv[4:8]) and adv[0] > 0 > adv[2]
    return trainer, batch, out


class ExpertTeacher:
    """Replaces `teacher_generate`: the word each teacher context asks for; records the contexts it got."""

    def __init__(self, trainer):
        self.tok, self.contexts = trainer.processing_class, []

    def __call__(self, contexts):
        self.contexts += [list(c) for c in contexts]
        return [asked_word(self.tok, c) for c in contexts], 0, 0  # texts, timeouts, generated tokens (unused)


def step(trainer, batch, monkeypatch, calibrated=True):
    """One `compute_advantages` call on `batch` with the expert teacher; returns the output, the step's metrics and
    the teacher (with the contexts it got)."""
    recorder = ExpertTeacher(trainer)
    monkeypatch.setattr(trainer, "teacher_generate", recorder)
    monkeypatch.setattr(trainer, "_calibrated", calibrated)
    trainer.logged_metrics("train").clear()
    out = trainer.compute_advantages(batch)
    metrics = {k: v[-1] for k, v in trainer.logged_metrics("train").items()}
    return out, metrics, recorder


def loss_tokens(batch) -> torch.Tensor:
    return (batch.turn_index >= 0).sum(dim=1)  # (B,) N


def turn_counts(batch) -> torch.Tensor:
    K = batch.turn_valid.shape[1]
    return torch.stack([(batch.turn_index == k).sum(dim=1) for k in range(K)], dim=1)  # (B, K)


def check_conservation(trainer, batch, out, credit=None):
    """Credit-interface token_sum: Σ_k n_k w_k = N in float64 (relative 1e-9), the float32 output sums to A · N
    (relative 1e-6, its own rounding), it is A · w_k on turn k's tokens and 0 on tokens with turn_index −1."""
    B, T = batch.completion_ids.shape
    assert out.shape == (B, T) and out.dtype == batch.advantages.dtype
    assert torch.isfinite(out).all()
    assert torch.equal(out[batch.turn_index < 0], torch.zeros_like(out[batch.turn_index < 0]))
    w = (credit if credit is not None else trainer.credit).values  # (B, K) float64
    n = turn_counts(batch).double()
    N = loss_tokens(batch).double()
    for b in range(B):
        assert abs(float((n[b] * w[b]).sum()) - float(N[b])) <= 1e-9 * float(N[b]), f"row {b}: Σ n w != N"
        A = float(batch.advantages[b])
        assert float(out[b].double().sum()) == pytest.approx(A * float(N[b]), rel=1e-6, abs=1e-6), f"row {b}"
        on = batch.turn_index[b] >= 0
        want = A * w[b][batch.turn_index[b][on]]
        torch.testing.assert_close(out[b][on].double(), want, atol=1e-6, rtol=1e-6)
        assert bool((w[b] > 0).all())


def nan_or_zero(x: float) -> bool:
    return math.isnan(x) or x == 0.0


# ---------------------------------------------------------------------------------------------------------------------
# score_after_prefixes: packed cross passes (teacher-pass.md D6)


def plain_continuation_logps(model, prefix: list[int], y: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / temperature) of y after prefix, from one unpadded forward of prefix + y."""
    ids = torch.tensor([prefix + y])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float() / temperature
    logp = torch.log_softmax(logits[len(prefix) - 1 : -1], dim=-1)
    return logp.gather(1, torch.tensor(y).unsqueeze(1)).squeeze(1)


def packing_case(trainer):
    g = torch.Generator().manual_seed(20)
    vocab = trainer.model.config.vocab_size

    def ids(k):
        return torch.randint(5, vocab, (k,), generator=g).tolist()

    sequences = [ids(12), ids(9), ids(15)]
    jobs = [
        (0, 3, ids(4)),
        (0, 7, ids(5)),
        (0, 3, ids(2)),  # the same prefix as the first job, another continuation
        (1, 1, ids(3)),
        (0, 12, ids(1)),  # the whole sequence as prefix, a one-token continuation
        (1, 9, ids(6)),
        (2, 15, ids(3)),
    ]
    return sequences, jobs


@pytest.mark.parametrize("rows_per_forward", [1, 16])
def test_packed_cross_passes_equal_separate_forwards(setup, rows_per_forward):
    """teacher-pass.md D6 (alignopsd.md Eq. 7, the log p_s): several jobs sharing one sequence (the same prefix twice,
    the full sequence as prefix) and jobs over three sequences, scored one packed row per sequence, equal a plain
    unpadded forward of prefix + continuation each, at the sampling temperature (atol 1e-5), whether the rows go one
    per forward or all together; eval mode inside, the training mode restored after."""
    trainer, _, _ = setup
    sequences, jobs = packing_case(trainer)
    trainer.model.train()
    got = score_after_prefixes(trainer, sequences, jobs, rows_per_forward=rows_per_forward)
    assert trainer.model.training
    assert len(got) == len(jobs)
    trainer.model.eval()
    try:
        for (r, p, y), logps in zip(jobs, got, strict=True):
            want = plain_continuation_logps(trainer.model, sequences[r][:p], y, TEMPERATURE)
            assert logps.shape == (len(y),) and logps.dtype == torch.float32
            torch.testing.assert_close(logps, want, atol=1e-5, rtol=1e-5)
        at_one = plain_continuation_logps(trainer.model, sequences[0][:3], jobs[0][2], 1.0)
        assert not torch.allclose(got[0], at_one, atol=1e-3)  # the temperature is applied
    finally:
        trainer.model.train()


def test_packed_rows_hold_the_given_continuation_ids(setup):
    """teacher-pass.md D6 (ids never re-tokenised): the packed row of a sequence is its tokens up to its longest
    prefix, then every continuation's ids exactly as given, in job order, then padding; one row per sequence."""
    trainer, _, _ = setup
    sequences, jobs = packing_case(trainer)
    seen = []
    handle = trainer.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append(kwargs["input_ids"].clone()), with_kwargs=True
    )
    try:
        score_after_prefixes(trainer, sequences, jobs, rows_per_forward=16)
    finally:
        handle.remove()
    assert len(seen) == 1 and seen[0].shape[0] == 3
    for r, row in enumerate(seen[0].tolist()):
        mine = [(p, y) for rr, p, y in jobs if rr == r]
        want = sequences[r][: max(p for p, _ in mine)] + [t for _, y in mine for t in y]
        assert row[: len(want)] == want, f"packed row of sequence {r}"


def test_packed_prefix_outside_the_sequence_raises(setup):
    """teacher-pass.md D6: a prefix must have at least one token and at most the sequence's length."""
    trainer, _, _ = setup
    sequences, _ = packing_case(trainer)
    with pytest.raises(ValueError, match="prefix length 13 is outside sequence 0"):
        score_after_prefixes(trainer, sequences, [(0, 13, [5])])
    with pytest.raises(ValueError, match="prefix length 0 is outside sequence 1"):
        score_after_prefixes(trainer, sequences, [(0, 2, [5]), (1, 0, [5])])


# ---------------------------------------------------------------------------------------------------------------------
# The trainer on a real generation batch


@pytest.mark.parametrize(("projection", "temperature"), [("legacy", 0.5), ("bounded", 0.5), ("bounded", 0.02)])
def test_output_conserves_the_token_sum(setup, monkeypatch, projection, temperature):
    """alignopsd.md Eq. 23-24 and credit-interface.md Eq. I-2 (token_sum): (B, T), no NaN, 0 on environment tokens,
    A·w_k on turn k's tokens with Σ n w = N per row (relative 1e-9), so a credited row's output sums to A·N; w within
    the mode's bounds ([0.5, 2.5] legacy, [0.9, 1.1] bounded, Eq. 23) and not all 1 (the credit moves). At T = 0.02 the
    raw density leaves the bounded mode's [0.8, 1.2], so the projection (Eq. 22, D4) is what keeps the budget. The
    matches follow the script: a turn matches iff it said the expected word (match_rate = hits / turns of the credited
    groups), with 3 sources at similarity 1, so α = 0.8 (Eq. 8-9); semantic cuts appear (Eq. 17)."""
    trainer, batch, _ = setup
    monkeypatch.setattr(trainer.args, "alignopsd_projection", projection)
    monkeypatch.setattr(trainer.args, "alignopsd_temperature", temperature)
    out, metrics, _ = step(trainer, batch, monkeypatch)
    if temperature < 0.1:
        assert metrics["alignopsd/projection_active_frac"] > 0
    check_conservation(trainer, batch, out)
    w = trainer.credit.values[:8]
    lo, hi = (0.5, 2.5) if projection == "legacy" else (0.9, 1.1)
    assert bool((w >= lo - 1e-12).all()) and bool((w <= hi + 1e-12).all())
    assert float((w - 1).abs().max()) > 1e-3
    hits = sum(
        row["transcript"][t]["action"] == TASKS[b // G][t] for b, row in enumerate(batch.rows[:8]) for t in range(4)
    )
    assert metrics["alignopsd/match_rate"] == pytest.approx(hits / 32)
    assert metrics["alignopsd/sources_per_turn_mean"] == pytest.approx(3.0)
    assert metrics["alignopsd/alpha_mean"] == pytest.approx(0.8, abs=1e-5)
    assert metrics["alignopsd/boundaries_semantic"] > 0
    assert metrics["alignopsd/budget_residual_max"] <= 1e-9
    assert metrics["credit/conservation_residual_max"] <= 1e-9


def test_the_generation_batch_output(setup):
    """alignopsd.md Eq. 24 through `_generate_and_score_completions`: the advantages TRL receives are the hook's,
    conserving A · N per row, with the zero-variance group at 0 (D8)."""
    trainer, batch, out = setup
    check_conservation(trainer, batch, out, trainer.first_credit)
    assert torch.equal(out[8:], torch.zeros_like(out[8:]))
    assert trainer.first_credit.reasons[8:] == ["zero_adv"] * 4


def test_cross_passes_score_the_student_ids_after_the_source_context(setup, monkeypatch):
    """alignopsd.md Eq. 2, Eq. 7 (teacher-pass.md D6, Eq. 2): every cross job's prefix is exactly a teacher context
    that was generated from (the source's PI prompt and the tokens before its turn), and its continuation is a target
    turn's own completion ids, of another rollout of the same task, never re-tokenised; the diagonal and student passes
    (`teacher_logps`) get the batch's own completion ids."""
    trainer, batch, _ = setup
    jobs_seen = []

    def spy(tr, sequences, jobs, rows_per_forward=16):
        jobs_seen.append((sequences, jobs))
        return score_after_prefixes(tr, sequences, jobs, rows_per_forward)

    def logps_spy(tr, b, blocks, *a, **kw):
        ids_seen.append(b.completion_ids)
        return teacher_logps(tr, b, blocks, *a, **kw)

    ids_seen = []
    monkeypatch.setattr(alignopsd_module, "score_after_prefixes", spy)
    monkeypatch.setattr(alignopsd_module, "teacher_logps", logps_spy)
    _, metrics, teacher = step(trainer, batch, monkeypatch)
    assert len(ids_seen) == 1 and torch.equal(ids_seen[0], batch.completion_ids)  # diagonal and student passes
    ((sequences, jobs),) = jobs_seen
    hits = sum(
        row["transcript"][t]["action"] == TASKS[b // G][t] for b, row in enumerate(batch.rows[:8]) for t in range(4)
    )
    assert len(jobs) == 3 * hits  # each matched turn: one source per sibling, 3 siblings
    contexts = {tuple(c) for c in teacher.contexts}
    T = batch.completion_ids.shape[1]
    turn_ids = {
        (b, t): batch.completion_ids[b][batch.turn_index[b] == t].tolist() for b in range(12) for t in range(4)
    }
    for r, p, y in jobs:
        assert tuple(sequences[r][:p]) in contexts, "a cross prefix is not a generated teacher context"
        assert sequences[r][-T:] == batch.completion_ids[r].tolist()
        j = int(batch.turn_index[r][p - (len(sequences[r]) - T)])  # the source turn starts at the prefix's end
        targets = [b for b in range(12) if b // G == r // G and b != r and turn_ids[(b, j)] == y]
        assert targets, f"job on source ({r}, {j}): its continuation is no sibling's turn-{j} ids"
        assert all(batch.rows[b]["transcript"][j]["action"] == asked_word(trainer.processing_class, sequences[r][:p])
                   for b in targets)  # fmt: skip


def test_zero_variance_groups_get_zeros_and_no_teacher_work(setup, monkeypatch):
    """alignopsd.md D8: the group whose every A is 0 gets Â ≡ 0 (reason `zero_adv`), no teacher generation (the
    contexts are exactly the live turns of the other groups' rows, none holds its hint), no teacher forcing (no block
    in `teacher_logps`, never a cross pass source)."""
    trainer, batch, _ = setup
    blocks_seen, jobs_seen = [], []

    def logps_spy(tr, b, blocks, *a, **kw):
        blocks_seen.append(list(blocks))
        return teacher_logps(tr, b, blocks, *a, **kw)

    def cross_spy(tr, sequences, jobs, rows_per_forward=16):
        jobs_seen.append(jobs)
        return score_after_prefixes(tr, sequences, jobs, rows_per_forward)

    monkeypatch.setattr(alignopsd_module, "teacher_logps", logps_spy)
    monkeypatch.setattr(alignopsd_module, "score_after_prefixes", cross_spy)
    out, _, teacher = step(trainer, batch, monkeypatch)
    assert torch.equal(out[8:], torch.zeros_like(out[8:]))
    assert trainer.credit.reasons[8:] == ["zero_adv"] * 4 and bool(trainer.credit.fallback[8:].all())
    live = batch.turn_valid & (turn_counts(batch) > 0)
    assert len(teacher.contexts) == int(live[:8].sum()) == 32
    tok = trainer.processing_class
    assert not any(HINTS[2] in tok.decode(c) for c in teacher.contexts)
    assert sum(HINTS[0] in tok.decode(c) for c in teacher.contexts) == 16
    (blocks,) = blocks_seen
    assert blocks[8:] == [None] * 4 and all(blocks[:8])
    assert all(r < 8 for r, _, _ in jobs_seen[0])


def test_zero_variance_groups_are_not_embedded(setup, monkeypatch):
    """alignopsd.md D8: groups whose every A is 0 run no embedding either. After the first batch's calibration (which
    looks at every task), no text of the zero-variance group reaches the encoder; "pearl" is checked, the one word only
    its students said (its other words also occur in the credited groups)."""
    trainer, batch, _ = setup
    encoded = []
    real = trainer.encoder.encode

    def spy(texts):
        encoded.append(list(texts))
        return real(texts)

    monkeypatch.setattr(trainer.encoder, "encode", spy)
    step(trainer, batch, monkeypatch, calibrated=True)
    texts = [t for call in encoded for t in call]
    assert texts, "the credited groups' texts are embedded"
    assert "pearl" not in texts, (
        "trainers/alignopsd.py compute_advantages embeds the student texts of every row, including the zero-variance "
        "group's (texts = ... + [text for r in records for text in r[4]]), against alignopsd.md D8 ('groups whose "
        "every A is 0 run no generation, embedding or forcing')"
    )


def test_group_without_pi_gets_grpo_exactly(setup, monkeypatch):
    """alignopsd.md D5 and D8: one row with a whitespace-only hint sends its whole group to the fallback: exactly the
    GRPO broadcast A on its loss tokens, reason `no_pi`, no teacher generation for it, `no_pi_frac` 1/3; the other
    credited group keeps its AlignOPSD weights (not the broadcast)."""
    trainer, batch, _ = setup
    rows = [dict(r) for r in batch.rows]
    rows[5]["hint"] = "  \n"  # group 1
    no_pi = dataclasses.replace(batch, rows=rows)
    out, metrics, teacher = step(trainer, no_pi, monkeypatch)
    grpo = batch.advantages.unsqueeze(1) * (batch.turn_index >= 0)
    assert torch.equal(out[4:8], grpo[4:8])
    assert trainer.credit.reasons[4:8] == ["no_pi"] * 4 and bool(trainer.credit.fallback[4:8].all())
    assert trainer.credit.reasons[:4] == [None] * 4
    assert not torch.allclose(out[:4], grpo[:4].to(out.dtype), atol=1e-4)
    assert len(teacher.contexts) == 16 and not any(
        HINTS[1] in trainer.processing_class.decode(c) for c in teacher.contexts
    )
    assert metrics["alignopsd/no_pi_frac"] == pytest.approx(1 / 3)
    assert metrics["credit/fallback_rate/no_pi"] == pytest.approx(4 / 12)
    check_conservation(trainer, no_pi, out)


def test_teacher_timeout_makes_every_turn_ineligible(setup, monkeypatch):
    """alignopsd.md D8 and D3: with a deadline already past, the real `teacher_generate` generates nothing: every
    context counts in `alignopsd/teacher_timeouts` (32 = the live turns of the credited groups), every teacher text is
    empty, so no turn is a source (no eligible pair: no similarity quantile, match rate 0, no α), while the step
    completes and the diagonal gaps still give conserving weights."""
    trainer, batch, _ = setup
    monkeypatch.setattr(trainer.args, "alignopsd_teacher_deadline", 1e-9)
    calls = []
    real = AlignOPSDTrainer.teacher_generate.__get__(trainer)

    def counting(contexts):
        calls.append(len(contexts))
        return real(contexts)

    monkeypatch.setattr(trainer, "teacher_generate", counting)
    monkeypatch.setattr(trainer, "_calibrated", True)
    trainer.logged_metrics("train").clear()
    out = trainer.compute_advantages(batch)
    metrics = {k: v[-1] for k, v in trainer.logged_metrics("train").items()}
    assert calls == [32]
    assert metrics["alignopsd/teacher_timeouts"] == 32.0
    assert metrics["alignopsd/teacher_empty_thinking_frac"] == 1.0
    assert nan_or_zero(metrics["alignopsd/match_rate"])
    assert nan_or_zero(metrics["alignopsd/alpha_mean"])
    assert math.isnan(metrics["alignopsd/encoder_sim_p50"])
    assert metrics["alignopsd/boundaries_semantic"] == 0.0
    assert trainer.credit.reasons[:8] == [None] * 8
    check_conservation(trainer, batch, out)
    assert float((trainer.credit.values[:8] - 1).abs().max()) > 1e-3  # the diagonal gaps still move credit


def test_encoder_failure_degrades_to_diagonal_teachers(setup, monkeypatch):
    """alignopsd.md D8: an encoder that raises after calibration leaves H undefined: α = 0, no matches, no semantic
    boundaries, the step completes, and the weights are those of the diagonal gaps over one span per row, computed here
    from `teacher_logps` in plain Python (Eq. 18-21, h = r inside the bounds, Eq. 23): ḡ_t the turn mean of
    (with − without), s = sign(A) ḡ, q = softmax(log n + s / T), w = 0.5 + 0.5 N q / n. The same batch with a
    working encoder has α = 0.8 and semantic cuts (the degradation is real)."""
    trainer, batch, _ = setup
    _, working, _ = step(trainer, batch, monkeypatch)
    assert (
        working["alignopsd/alpha_mean"] == pytest.approx(0.8, abs=1e-5)
        and working["alignopsd/boundaries_semantic"] > 0
    )

    def broken(texts):
        raise RuntimeError("encoder out of memory")

    monkeypatch.setattr(trainer.encoder, "encode", broken)
    out, metrics, _ = step(trainer, batch, monkeypatch, calibrated=True)
    assert nan_or_zero(metrics["alignopsd/alpha_mean"]) and nan_or_zero(metrics["alignopsd/match_rate"])
    assert metrics["alignopsd/boundaries_semantic"] == 0.0 and metrics["alignopsd/segments_per_traj_mean"] == 1.0
    check_conservation(trainer, batch, out)
    blocks = [trainer.pi_block(r) if b < 8 else None for b, r in enumerate(batch.rows)]
    scored = teacher_logps(trainer, batch, blocks)
    n = turn_counts(batch).double()
    T = trainer.args.alignopsd_temperature
    for b in range(8):
        diff = scored.with_block[b].double() - scored.without_block[b].double()  # corrected_gap subtracts in float64
        gap = [float(diff[batch.turn_index[b] == t].mean())
               for t in range(4)]  # fmt: skip
        A = float(batch.advantages[b])
        s = [math.copysign(1.0, A) * g if A != 0 else 0.0 for g in gap]
        logits = [math.log(float(n[b, t])) + s[t] / T for t in range(4)]
        z = sum(math.exp(x) for x in logits)
        r = [float(n[b].sum()) * math.exp(logits[t]) / z / float(n[b, t]) for t in range(4)]
        assert all(0.0 <= x <= 4.0 for x in r)  # inside the legacy bounds: the projection keeps r
        want = torch.tensor([0.5 + 0.5 * x for x in r], dtype=torch.float64)
        torch.testing.assert_close(trainer.credit.values[b, :4], want, atol=1e-9, rtol=1e-9)


class AnisotropicEncoder:
    def __repr__(self) -> str:
        return "AnisotropicEncoder()"

    def encode(self, texts):
        g = torch.Generator().manual_seed(0)
        v = torch.ones(len(texts), 8) + 0.01 * torch.randn(len(texts), 8, generator=g)
        return torch.nn.functional.normalize(v, dim=-1)


def test_calibration_on_the_first_batch(setup, monkeypatch):
    """alignopsd.md D7: the first batch checks the encoder: an anisotropic one stops the step with an error naming it
    and gamma; the n-gram encoder passes, logs its median (at most γ − 0.2) and is not checked again."""
    trainer, batch, _ = setup
    good = trainer.encoder
    monkeypatch.setattr(trainer, "encoder", AnisotropicEncoder())
    with pytest.raises(ValueError, match=r"AnisotropicEncoder\(\).*gamma"):
        step(trainer, batch, monkeypatch, calibrated=False)
    monkeypatch.setattr(trainer, "encoder", good)
    _, metrics, _ = step(trainer, batch, monkeypatch, calibrated=False)
    assert metrics["alignopsd/encoder_calibration_median"] <= trainer.args.alignopsd_gamma - 0.2
    assert trainer._calibrated
    monkeypatch.setattr(trainer, "encoder", AnisotropicEncoder())  # no second check: H is just useless now
    step(trainer, batch, monkeypatch, calibrated=True)


def test_thinking_and_visible_text():
    """alignopsd.md D6: `thinking` is the text inside the first closed <think>…</think>; an unclosed tag (a cut-off or
    malformed generation) counts as none; `action` matching uses the visible text without the reasoning (an unclosed
    tag drops what follows it)."""
    assert thinking_text("<think> go left </think>left") == "go left"
    assert thinking_text("<think>a</think> x <think>b</think>") == "a"
    assert thinking_text("<think>\nmulti\nline\n</think>") == "multi\nline"
    assert thinking_text("<think>cut off") == ""
    assert thinking_text("no tags at all") == ""
    assert thinking_text("") == ""
    assert visible_text("<think>plan</think> buy now") == "buy now"
    assert visible_text("search[socks] <think>cut off") == "search[socks]"
    assert visible_text("<think>cut off") == ""
    assert visible_text("  click  ") == "click"


def test_matching_on_thinking_without_thinking_warns(setup, monkeypatch, caplog):
    """alignopsd.md D6 and D3: matching by thinking on bare actions leaves every student turn without a text: the first
    batch warns, no turn is a target (match rate undefined, α never set), and the weights still conserve."""
    trainer, batch, _ = setup
    monkeypatch.setattr(trainer.args, "alignopsd_match_on", "thinking")
    with caplog.at_level(logging.WARNING, logger="trainers.alignopsd"):
        out, metrics, _ = step(trainer, batch, monkeypatch, calibrated=False)
    assert any("alignopsd_match_on: action" in r.getMessage() for r in caplog.records)
    assert metrics["alignopsd/empty_thinking_frac"] == 1.0
    assert math.isnan(metrics["alignopsd/match_rate"]) and nan_or_zero(metrics["alignopsd/alpha_mean"])
    check_conservation(trainer, batch, out)


@pytest.mark.parametrize(
    ("match_on", "generated", "ends", "want"),
    [
        ("thinking", "<think>go", True, ""),
        ("thinking", "<think>go</think> left", True, "go"),
        ("action", "<think>go</think> left", True, "left"),
        ("action", "<think>go", True, ""),
        ("action", "left", False, None),  # no end token, shorter than the limit: stopped by the deadline
    ],
)
@pytest.mark.parametrize("path", ["branches", "generate"])
def test_teacher_generation_text_is_parsed(setup, monkeypatch, match_on, generated, ends, want, path):
    """alignopsd.md D6 and D8, through the real `teacher_generate`, on both of its paths: a fake sampler (the branch
    sampler of a plain decoder, or `generate` for other models; each checks the rollout's sampling temperature and the
    token limit) returns `generated`, then the end token and more tokens; the text is cut at the end token and reduced
    to the thinking or the visible text: an unclosed <think> gives an empty text (`teacher_empty_thinking_frac` 1), a
    closed one its thinking; tokens after the end never count. A generation without an end token and shorter than the
    limit was stopped by the deadline: a timeout."""
    from transformers.generation.logits_process import TemperatureLogitsWarper

    trainer, batch, _ = setup
    tok = trainer.processing_class
    ids = tok(generated, add_special_tokens=False)["input_ids"]
    new = ids + ([tok.eos_token_id] + tok(" junk", add_special_tokens=False)["input_ids"] if ends else [])
    assert ends or len(ids) < trainer.args.alignopsd_teacher_max_tokens

    def fake_generate(input_ids, attention_mask, generation_config):
        assert generation_config.temperature == TEMPERATURE and generation_config.max_new_tokens == 4
        return torch.cat([input_ids, torch.tensor([new]).expand(input_ids.shape[0], -1)], dim=1)

    def fake_branches(model, sequences, branches, max_new_tokens, processors, *args, **kwargs):
        temperatures = [p.temperature for p in processors if isinstance(p, TemperatureLogitsWarper)]
        assert temperatures == [TEMPERATURE] and max_new_tokens == 4
        assert len(sequences) == 8  # the credited episodes: each one sequence, its turns branches of it
        return [(list(new), [0.0] * len(new)) for _ in branches]  # uncut: teacher_generate cuts at the end id itself

    encoded = []
    real = trainer.encoder.encode
    monkeypatch.setattr(trainer.encoder, "encode", lambda texts: encoded.append(list(texts)) or real(texts))
    if path == "generate":
        monkeypatch.setattr(generation, "growing_cache", lambda model: None)
        monkeypatch.setattr(trainer.model, "generate", fake_generate)
    else:
        monkeypatch.setattr(generation, "sample_after_prefixes", fake_branches)
    monkeypatch.setattr(trainer.args, "alignopsd_match_on", match_on)
    monkeypatch.setattr(trainer, "_calibrated", True)
    trainer.logged_metrics("train").clear()
    trainer.compute_advantages(batch)
    metrics = {k: v[-1] for k, v in trainer.logged_metrics("train").items()}
    texts = {t for call in encoded for t in call}
    assert not any("<think>" in t or "</think>" in t or "junk" in t for t in texts)
    assert metrics["alignopsd/teacher_empty_thinking_frac"] == (0.0 if want else 1.0)
    if want is None:
        assert metrics["alignopsd/teacher_timeouts"] == 32.0 and metrics["alignopsd/teacher_gen_tokens_mean"] == 0.0
    else:
        assert metrics["alignopsd/teacher_timeouts"] == 0.0
        assert metrics["alignopsd/teacher_gen_tokens_mean"] == len(ids)  # up to the end token
    if want:
        assert want in texts


def test_teacher_turns_branch_from_one_prefill_per_episode(setup, monkeypatch):
    """The real sampler on the tiny model: the 32 live turns of the 8 credited episodes are branches of 8 sequences
    (each episode's privileged prompt and completion), every branch's context is the context the turn would get alone,
    and each generation ends within the 4-token limit or by an end id; nothing times out."""
    trainer, batch, _ = setup
    seen = []
    real = generation.sample_after_prefixes

    def recording(model, sequences, branches, *args, **kwargs):
        seen.append((sequences, branches))
        return real(model, sequences, branches, *args, **kwargs)

    contexts = []
    real_generate = AlignOPSDTrainer.teacher_generate.__get__(trainer)
    monkeypatch.setattr(generation, "sample_after_prefixes", recording)
    monkeypatch.setattr(trainer, "teacher_generate", lambda cs: contexts.extend(cs) or real_generate(cs))
    monkeypatch.setattr(trainer, "_calibrated", True)
    trainer.logged_metrics("train").clear()
    trainer.compute_advantages(batch)
    metrics = {k: v[-1] for k, v in trainer.logged_metrics("train").items()}
    ((sequences, branches),) = seen
    assert len(sequences) == 8 and len(branches) == len(contexts) == 32
    assert [sequences[r][:p] for r, p in branches] == [list(c) for c in contexts]
    assert metrics["alignopsd/teacher_timeouts"] == 0.0
    assert 0 < metrics["alignopsd/teacher_gen_tokens_mean"] <= 4


# ---------------------------------------------------------------------------------------------------------------------
# Process equivalence (alignopsd.md D10, D2)


class ProcessView:
    """The trainer's accelerator seen as process `index` of `count`; everything else is the real one's."""

    def __init__(self, real, index: int, count: int):
        self._real, self.process_index, self.num_processes = real, index, count

    def __getattr__(self, name):
        return getattr(self._real, name)


class Pending(Exception):
    """A fake gather whose other process has not reached it yet."""


def slice_batch(batch, lo: int, hi: int):
    kw = {}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        kw[f.name] = v[lo:hi] if isinstance(v, (torch.Tensor, list)) else v
    return dataclasses.replace(batch, **kw)


def test_process_equivalence(setup, monkeypatch):
    """alignopsd.md D10 and D2: two processes holding rows 0-5 and 6-11 (group 1 spans both), with `gather_object`
    simulated (each call returns both processes' objects, in process order, once both have made it), give θ and the
    boundary counts of the one-process run exactly, and its w and advantages up to the float noise of forwards padded
    to other widths (1e-6); each half alone would give other weights for the group they split (the gather matters)."""
    trainer, batch, _ = setup
    full, one, _ = step(trainer, batch, monkeypatch)
    w_full = trainer.credit.values.clone()
    halves = [slice_batch(batch, 0, 6), slice_batch(batch, 6, 12)]
    real = trainer.accelerator
    store: list[dict[int, object]] = []
    now = {"p": 0, "i": 0}

    def fake_gather_object(obj):
        i = now["i"]
        now["i"] += 1
        if len(store) <= i:
            store.append({})
        store[i][now["p"]] = obj
        if len(store[i]) < 2:
            raise Pending
        return [x for p in (0, 1) for x in store[i][p]]

    monkeypatch.setattr(alignopsd_module, "gather_object", fake_gather_object)
    monkeypatch.setattr(trainer, "teacher_generate", ExpertTeacher(trainer))
    monkeypatch.setattr(trainer, "_calibrated", True)
    done = {}
    for _ in range(8):
        for p in (0, 1):
            if p in done:
                continue
            now.update(p=p, i=0)
            monkeypatch.setattr(trainer, "accelerator", ProcessView(real, p, 2))
            trainer.logged_metrics("train").clear()
            try:
                out = trainer.compute_advantages(halves[p])
            except Pending:
                continue
            metrics = {k: v[-1] for k, v in trainer.logged_metrics("train").items()}
            done[p] = (out, trainer.credit.values.clone(), metrics)
    assert sorted(done) == [0, 1] and len(store) == 5  # adv, groups, blocks, records, boundary distances
    outs, ws, ms = zip(*(done[p] for p in (0, 1)), strict=True)
    assert ms[0]["alignopsd/theta"] == ms[1]["alignopsd/theta"] == one["alignopsd/theta"]
    for kind in ("semantic", "guided", "forced"):
        name = f"alignopsd/boundaries_{kind}"
        assert ms[0][name] + ms[1][name] == one[name]
    torch.testing.assert_close(torch.cat(ws), w_full, atol=1e-6, rtol=0)  # forwards padded per process: float noise
    torch.testing.assert_close(torch.cat(outs), full, atol=1e-6, rtol=0)
    monkeypatch.setattr(trainer, "accelerator", real)
    alone = []
    for h in halves:
        step(trainer, h, monkeypatch)
        alone.append(trainer.credit.values.clone())
    assert not torch.allclose(torch.cat(alone)[4:8], w_full[4:8], atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------------
# Config


def test_config_validation(tmp_path):
    """alignopsd.md §5 defaults and D5-D7 choices: the PI spec, what is matched, the projection mode, γ in (0, 1),
    L_max ≥ 2 L_min − 1 (Eq. 17), at least one teacher token; valid edge values pass."""
    args = AlignOPSDConfig(**settings(tmp_path))
    assert (args.alignopsd_gamma, args.alignopsd_top_k, args.alignopsd_alpha_max) == (0.8, 3, 0.8)
    assert (args.alignopsd_l_min, args.alignopsd_l_max, args.alignopsd_temperature, args.alignopsd_beta) == (
        2,
        8,
        0.5,
        0.5,
    )
    assert (args.alignopsd_projection, args.alignopsd_encoder) == ("legacy", "ngram")
    for ok in (dict(alignopsd_pi="skills"), dict(alignopsd_l_min=3, alignopsd_l_max=5), dict(alignopsd_gamma=0.5),
               dict(alignopsd_projection="bounded"), dict(alignopsd_teacher_max_tokens=1)):  # fmt: skip
        AlignOPSDConfig(**settings(tmp_path, **ok))
    bad = [
        (dict(alignopsd_pi="hint"), "alignopsd_pi"),
        (dict(alignopsd_pi="columns:hint"), "alignopsd_pi"),
        (dict(alignopsd_match_on="thoughts"), "alignopsd_match_on"),
        (dict(alignopsd_projection="wide"), "alignopsd_projection"),
        (dict(alignopsd_gamma=0.0), "alignopsd_gamma"),
        (dict(alignopsd_gamma=1.0), "alignopsd_gamma"),
        (dict(alignopsd_gamma=1.5), "alignopsd_gamma"),
        (dict(alignopsd_l_min=3, alignopsd_l_max=4), "alignopsd_l_max"),
        (dict(alignopsd_teacher_max_tokens=0), "alignopsd_teacher_max_tokens"),
        (dict(alignopsd_top_k=0), "alignopsd_top_k"),
    ]
    for kw, name in bad:
        with pytest.raises(ValueError, match=name):
            AlignOPSDConfig(**settings(tmp_path, **kw))


def test_trainer_needs_an_environment(tiny_model_folder, tmp_path):
    """alignopsd.md §4.1: the teacher re-reads multi-turn rollouts, so a trainer without an environment is refused."""
    data = Dataset.from_list([{"prompt": "say apple", "hint": "h"}])
    with pytest.raises(ValueError, match="needs an environment"):
        AlignOPSDTrainer(
            model=tiny_model_folder,
            train_dataset=data,
            args=AlignOPSDConfig(**settings(tmp_path)),
            reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        )
