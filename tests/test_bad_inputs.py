"""The bad-input matrix (bench/bad_inputs.py): every mistake in it stops train.py before any model is built, with a
message naming the field, or, for a legal but degenerate setting, logs a warning naming it."""

import pytest

import train
from bench.bad_inputs import CASES, play


def test_the_matrix_is_large_and_covers_warnings():
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)
    assert {c.expect for c in CASES} == {"error", "warning"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_named_at_start_up(case, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENT_TRL_CACHE", str(tmp_path / "cache"))
    outcome, message = play(train, case, tmp_path)
    assert outcome == ("clear" if case.expect == "error" else "warned"), message
    assert case.needle in message
