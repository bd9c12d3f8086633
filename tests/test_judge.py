"""Judge client tests against a real loopback OpenAI-compatible server (`tests/judge_server.py`), plus the self-judge.

Layer 1: pure helpers (parsing, Eq. 11 cost, vote combining). Layer 2: the judge contract under faults (500, 429 with
retry-after, hangs, malformed JSON, truncated bodies): no exception escapes, retries are counted, results are right;
the cache, the concurrency bound, key hygiene, accounting, votes, deadlines and the sync wrapper.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
import typing
from dataclasses import MISSING, dataclass, field, fields
from types import SimpleNamespace

import pydantic
import pytest

from rewards import audit
from rewards.judge import (
    API_MODEL_FIELDS,
    FAIL,
    NOT_APPLICABLE,
    PASS,
    APIModelFields,
    Judge,
    JudgeConfig,
    LocalModelJudge,
    call_cost_usd,
    combine_votes,
    parse_output,
    parse_retry_after,
    strip_reasoning,
)
from tests.conftest import CPU_ARGS
from tests.judge_server import JudgeServer, Reply, error, hang, ok, truncated
from trainers.draco import JUDGE, DRACOConfig, build_judge
from trainers.funnel import EDITOR, FunnelConfig
from trainers.funnel_loop import FunnelLoop
from trainers.taspo import ANALYZER, TASPOConfig

SECRET = "sk-test-7f3a9c0d5e1b-never-log-me"
KEY_ENV = "AGENT_TRL_TEST_JUDGE_KEY"
MESSAGES = [{"role": "system", "content": "You grade answers."}, {"role": "user", "content": "Is 2 + 2 = 4?"}]


class Verdict(pydantic.BaseModel):
    score: int
    reason: str = ""


class CriterionScore(pydantic.BaseModel):
    id: str
    score: int


class Scores(pydantic.BaseModel):
    scores: list[CriterionScore]


def scores_json(**verdicts: int) -> str:
    return json.dumps({"scores": [{"id": k, "score": v} for k, v in verdicts.items()]})


def to_verdicts(sample: Scores) -> dict[str, int]:
    return {s.id: s.score for s in sample.scores}


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(KEY_ENV, SECRET)
    with JudgeServer(default=lambda body: ok('{"score": 1, "reason": "fine"}')) as srv:
        yield srv


def make_judge(server: JudgeServer, **overrides) -> Judge:
    settings = dict(
        model="test-judge",
        base_url=server.base_url,
        api_key_env=KEY_ENV,
        timeout=0.3,
        max_retries=2,
        backoff_base=0.01,
        backoff_max=1.0,
    )
    return Judge(JudgeConfig(**(settings | overrides)))


# ---------------------------------------------------------------------------------------------------------------------
# Layer 1: pure helpers


def test_parse_output_tolerates_fences_prose_reasoning_and_bare_arrays():
    assert parse_output('{"score": 2}', Verdict).score == 2
    assert parse_output('```json\n{"score": 3}\n```', Verdict).score == 3
    assert parse_output('Here you go: {"score": 4, "reason": "ok"} -- hope it helps', Verdict).score == 4
    assert parse_output('<think>{"score": 9}</think>\n{"score": 5}', Verdict).score == 5
    # the first balanced value that validates wins: "[1]" in prose does not block the envelope after it
    assert parse_output('see [1] then {"score": 6}', Verdict).score == 6
    # a bare array is wrapped into a one-field envelope (DRACO D6)
    assert parse_output('[{"id": "c1", "score": 1}]', Scores).scores[0].id == "c1"
    with pytest.raises(ValueError, match="no JSON"):
        parse_output("not json at all", Verdict)
    with pytest.raises(ValueError, match="does not match the schema"):
        parse_output('{"score": "high"}', Verdict)
    assert strip_reasoning("<think>unfinished reasoning") == ""
    # a value nested inside an answer of the wrong shape is not an answer (it used to give 8 and 7)
    for wrapped in ('{"result": 7, "detail": {"score": 8}}', 'Answer: {"answer": {"score": 7}} done'):
        with pytest.raises(ValueError, match="does not match the schema"):
            parse_output(wrapped, Verdict)


def test_call_cost_usd_eq11():
    # (1000 - 400) * 2.0 + 400 * 0.5 + 200 * 8.0 = 1200 + 200 + 1600 = 3000 micro-USD
    assert call_cost_usd(1000, 400, 200, 2.0, 0.5, 8.0) == pytest.approx(0.003)
    assert call_cost_usd(0, 0, 0, 2.0, 0.5, 8.0) == 0.0


def test_parse_retry_after():
    assert parse_retry_after({"retry-after": "0.2"}) == pytest.approx(0.2)
    assert parse_retry_after({"retry-after-ms": "150"}) == pytest.approx(0.15)
    assert parse_retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}) == 0.0  # a date in the past
    assert parse_retry_after({}) is None


def test_combine_votes_all_rule_c10():
    # DRACO §7 item 20, under conventions.md C10
    assert combine_votes([{"c": 1}, {"c": 1}, {"c": 1}]) == {"c": PASS}
    assert combine_votes([{"c": 1}, {"c": 1}, {"c": -1}]) == {"c": FAIL}
    assert combine_votes([{"c": 1}, {"c": 0}, {"c": 1}]) == {"c": NOT_APPLICABLE}
    assert combine_votes([{"c": 0}, {"c": 0}, {"c": 0}]) == {"c": NOT_APPLICABLE}
    # one sample unparsable: a fail among the other two still fails, a pass needs all k (C10)
    assert combine_votes([{"c": 1}, None, {"c": -1}]) == {"c": FAIL}
    assert combine_votes([{"c": 1}, None, {"c": 1}]) == {"c": NOT_APPLICABLE}
    # missing in one sample, none failing: not applicable; missing everywhere: 0
    assert combine_votes([{"a": 1, "b": 1}, {"a": 1}, {"a": 1, "b": 1}], criteria=["a", "b", "z"]) == {
        "a": PASS,
        "b": NOT_APPLICABLE,
        "z": NOT_APPLICABLE,
    }
    assert combine_votes([None, None, None]) is None
    with pytest.raises(ValueError):
        combine_votes([{"c": 1}], rule="any")


def test_combine_votes_majority_rule():
    assert combine_votes([{"c": 1}, {"c": 1}, {"c": -1}], "majority") == {"c": PASS}
    assert combine_votes([{"c": -1}, {"c": 1}, {"c": -1}], "majority") == {"c": FAIL}
    assert combine_votes([{"c": 1}, {"c": 0}, {"c": -1}], "majority") == {"c": NOT_APPLICABLE}
    assert combine_votes([{"c": 1}, None, {"c": 1}], "majority") == {"c": PASS}  # 2 of 3 pass


def test_config_validation_names_the_field():
    with pytest.raises(ValueError, match="vote_rule"):
        JudgeConfig(model="m", vote_rule="any")
    with pytest.raises(ValueError, match="max_concurrency"):
        JudgeConfig(model="m", max_concurrency=0)


# ---------------------------------------------------------------------------------------------------------------------
# Layer 1: one API model's settings as flat config fields (APIModelFields), in each of its four uses

# The endpoint fields as each config declared them by hand before `APIModelFields`: (name, type, default, help).
HAND_WRITTEN = {
    DRACOConfig: [
        ("judge_model", str | None, None, "Model id at the endpoint (`openai` only)."),
        ("judge_base_url", str | None, None, "OpenAI-compatible base URL; None: OpenAI."),
        ("judge_api_key_env", str, "OPENAI_API_KEY", "Env variable holding the API key."),
        ("judge_cache_path", str | None, None, "sqlite3 cache of judge answers."),
        ("judge_concurrency", int, 32, "Most judge calls in flight (§4.6: 32)."),
        ("judge_timeout", float, 180.0, "Seconds per judge call attempt (§4.6: 180)."),
        ("judge_max_retries", int, 2, "Transport re-sends per call: 3 attempts (§4.6)."),
        ("judge_temperature", float | None, None,
         "Judge temperature; None: 0.1 for an API judge (§4.2), 0.6 for self (D12)."),
        ("judge_max_tokens", int, 16384, "Judge max output tokens (§5: 16,384)."),
        ("judge_price_input_per_mtok", float, 0.0, "USD per million prompt tokens."),
        ("judge_price_output_per_mtok", float, 0.0, "USD per million completion tokens."),
    ],
    TASPOConfig: [
        ("analyzer_model", str | None, None, "Model id at the endpoint (`openai` only)."),
        ("analyzer_base_url", str | None, None, "OpenAI-compatible base URL; None: OpenAI."),
        ("analyzer_api_key_env", str, "OPENAI_API_KEY", "Env variable holding the API key."),
        ("analyzer_cache_path", str | None, None, "sqlite3 cache of analyzer answers."),
        ("analyzer_concurrency", int, 32, "Most analyzer calls in flight (taspo.md §5)."),
        ("analyzer_timeout", float, 180.0, "Seconds per analyzer call attempt (§5)."),
        ("analyzer_max_retries", int, 2, "Transport re-sends: 2 gives 3 attempts (D11)."),
        ("analyzer_max_repairs", int, 2,
         "Re-asks with the validation error after an invalid answer: 3 attempts (D11)."),
        ("analyzer_temperature", float, 0.0, "Analyzer temperature (taspo.md §5)."),
        ("analyzer_max_tokens", int, 4096, "Analyzer max output tokens."),
        ("analyzer_price_input_per_mtok", float, 0.0, "USD per million prompt tokens."),
        ("analyzer_price_output_per_mtok", float, 0.0, "USD per million completion tokens."),
    ],
    FunnelConfig: [
        ("editor_model", str | None, None, "Model id at the endpoint ('openai' editor)."),
        ("editor_base_url", str | None, None, "OpenAI-compatible base URL; None: OpenAI."),
        ("editor_api_key_env", str, "OPENAI_API_KEY", "Env variable holding the API key."),
        ("editor_cache_path", str | None, None,
         "sqlite3 cache of editor answers; None: <output_dir>/editor_cache.sqlite."),
        ("editor_timeout", float, 120.0, "Seconds per editor request attempt."),
        ("editor_max_retries", int, 2, "Transport re-sends after a failed request (§4.3)."),
    ],
}  # fmt: skip
USES = [(DRACOConfig, JUDGE), (TASPOConfig, ANALYZER), (FunnelConfig, EDITOR)]
AUDIT_ARGV = ["--tasks", "t.jsonl", "--out", "o", "--base_url", "http://h/v1", "--model", "m"]
AUDIT_HELP = [  # the audit's help texts before `APIModelFields`
    "--cache CACHE_PATH sqlite3 cache of auditor answers (optional)", "auditor model id at the endpoint",
    "OpenAI-compatible base URL, e.g. http://host:8000/v1", "environment variable holding the API key",
    "most requests in flight", "seconds per request attempt", "re-sends after a transport error",
]  # fmt: skip


@pytest.mark.parametrize(("config_class", "use"), USES, ids=["judge", "analyzer", "editor"])
def test_generated_fields_keep_the_hand_written_names_types_defaults_and_help(config_class, use):
    declared = {f.name: f for f in fields(config_class)}
    hints = typing.get_type_hints(config_class)
    found = [(n, hints[n], declared[n].default, declared[n].metadata["help"]) for n in use.field_names()]
    assert found == HAND_WRITTEN[config_class]
    names = list(declared)  # the block sits right after its selector (`judge_backend`, `analyzer_backend`, `editor`)
    at = names.index(use.selector) + 1
    assert names[at : at + len(found)] == use.field_names()


def test_audit_options_keep_their_flags_defaults_and_help(capsys):
    args = audit.parse_args(AUDIT_ARGV)
    assert (args.model, args.base_url, args.api_key_env, args.cache_path) == ("m", "http://h/v1", "OPENAI_API_KEY",
                                                                              None)  # fmt: skip
    assert (args.concurrency, args.timeout, args.max_retries) == (16, 180.0, 2)
    extra = ["--cache", "c.sqlite", "--concurrency", "4", "--timeout", "9", "--max_retries", "0", "--api_key_env", "K"]
    given = audit.parse_args(AUDIT_ARGV + extra)
    assert (given.cache_path, given.concurrency, given.timeout, given.max_retries, given.api_key_env) == (
        "c.sqlite", 4, 9.0, 0, "K")  # fmt: skip
    for missing in ("--model", "--base_url"):  # both required, as before
        at = AUDIT_ARGV.index(missing)
        with pytest.raises(SystemExit):
            audit.parse_args(AUDIT_ARGV[:at] + AUDIT_ARGV[at + 2 :])
        assert f"required: {missing}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        audit.parse_args(["--help"])
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the help lines
    for text in AUDIT_HELP:
        assert text in shown
    assert "--cache_path" not in shown  # the flag kept its old name


def test_judge_config_maps_every_field_of_each_use():
    """Each exposed field lands in its `JudgeConfig` field (`*_concurrency` in `max_concurrency`); the others keep
    `JudgeConfig`'s defaults (the editor's `max_repairs` 1) unless the caller sets them (`seed`)."""
    values = {"model": "m", "base_url": "http://h/v1", "api_key_env": "K", "cache_path": "c.sqlite", "concurrency": 3,
              "timeout": 7.5, "max_retries": 4, "max_repairs": 5, "temperature": 0.7, "max_tokens": 99,
              "price_input_per_mtok": 1.25, "price_output_per_mtok": 2.5}  # fmt: skip
    target = {"concurrency": "max_concurrency"}
    defaults = JudgeConfig(model="m")
    for use in (JUDGE, ANALYZER, EDITOR, audit.AUDITOR):
        built = use.judge_config(SimpleNamespace(**{use.flat(n): values[n] for n in use.names}), seed=11)
        assert built.seed == 11
        for name in API_MODEL_FIELDS:
            field_name = target.get(name, name)
            expected = values[name] if name in use.names else getattr(defaults, field_name)
            assert getattr(built, field_name) == expected, (use.prefix, name)


def test_the_judge_and_the_editor_get_the_settings_they_had(tmp_path):
    """DRACO's API judge and the Funnel's editor, built from their configs: the fields plus what each use fixes
    (DRACO: `votes`; the editor: repairs = retries, temperature 0, seed 0, 2,048 tokens, a cache in output_dir)."""
    draco = DRACOConfig(output_dir=str(tmp_path), **CPU_ARGS, judge_backend="openai", judge_model="j",
                        judge_concurrency=8, judge_price_output_per_mtok=2.0)  # fmt: skip
    judged = {"model": "j", "base_url": None, "max_concurrency": 8, "timeout": 180.0, "max_retries": 2,
              "max_repairs": 1, "temperature": 0.1, "max_tokens": 16384, "votes": 1, "cache_path": None,
              "price_output_per_mtok": 2.0}  # fmt: skip
    with build_judge(draco, []) as judge:
        assert {k: getattr(judge.config, k) for k in judged} == judged
    funnel = FunnelConfig(output_dir=str(tmp_path), **CPU_ARGS, editor="openai", editor_model="e",
                          editor_max_retries=3, max_steps=1)  # fmt: skip
    loop = SimpleNamespace(config=funnel, out=tmp_path, environment="a web shop")  # what `_make_editor` reads
    edited = {
        "model": "e",
        "timeout": 120.0,
        "max_retries": 3,
        "max_repairs": 3,
        "max_concurrency": 32,
        "temperature": 0.0,
        "seed": 0,
        "max_tokens": 2048,
        "cache_path": str(tmp_path / "editor_cache.sqlite"),
    }
    with FunnelLoop._make_editor(loop).judge as judge:
        assert {k: getattr(judge.config, k) for k in edited} == edited


@pytest.mark.parametrize(
    ("config_class", "settings", "message"),
    [
        (DRACOConfig, {"judge_backend": "openai"}, "judge_model is required when judge_backend is 'openai'"),
        (TASPOConfig, {"analyzer_backend": "openai"}, "analyzer_model is required when analyzer_backend is 'openai'"),
        (FunnelConfig, {"editor": "openai", "max_steps": 1}, "editor_model is required when editor is 'openai'"),
    ],
)
def test_an_endpoint_that_is_on_needs_a_model(tmp_path, config_class, settings, message):
    with pytest.raises(ValueError, match=message):
        config_class(output_dir=str(tmp_path), **CPU_ARGS, **settings)
    model_field = message.split()[0]
    assert getattr(config_class(output_dir=str(tmp_path), **CPU_ARGS, **settings, **{model_field: "m"}),
                   model_field) == "m"  # fmt: skip


@pytest.mark.parametrize(
    ("use", "config_class"), [(JUDGE, DRACOConfig), (ANALYZER, TASPOConfig), (EDITOR, FunnelConfig)]
)
def test_each_config_declares_its_endpoint_fields_as_its_use_names_them(use, config_class):
    """The method configs write their endpoint fields out by hand (so `grep judge_timeout` finds a declaration);
    each field's default and help text are held to the use's, so the two cannot drift."""
    assert use.declaration_problems(config_class) == []
    names = [f.name for f in fields(config_class)]
    at = names.index(use.selector)
    assert names[at + 1 : at + 1 + len(use.names)] == use.field_names()  # right after the switch that turns them on


def test_a_copy_that_drifts_from_its_use_is_named_and_an_unknown_setting_is_refused():
    use = APIModelFields("critic", ("model", "timeout"), selector="critic_backend", defaults={"timeout": 60.0})

    @dataclass
    class Critic:
        critic_backend: str = "oracle"
        critic_model: str | None = field(default=None, metadata={"help": "Model id at the endpoint (`openai` only)."})
        critic_timeout: float = field(default=60.0, metadata={"help": "Seconds per critic call attempt."})

    @dataclass
    class Drifted:
        critic_backend: str = "oracle"
        critic_timeout: float = field(default=30.0, metadata={"help": "Seconds per critic call attempt."})

    assert use.declaration_problems(Critic) == []
    assert use.declaration_problems(Drifted) == [
        "Drifted does not declare critic_model",
        "Drifted.critic_timeout: default or help differs from critic's use",
    ]
    assert APIModelFields("x", ("model",), defaults={"model": MISSING}).default("model") is MISSING
    with pytest.raises(ValueError, match="max_tokenz"):
        APIModelFields("critic", ("model", "max_tokenz"))
    with pytest.raises(ValueError, match="timeout"):  # a default for a field the use does not have
        APIModelFields("critic", ("model",), defaults={"timeout": 1.0})


# ---------------------------------------------------------------------------------------------------------------------
# Layer 2: the judge against the loopback server


def test_success_sends_key_and_json_request(server):
    with make_judge(server) as judge:
        result = judge.score_sync(MESSAGES, Verdict)
        assert result == Verdict(score=1, reason="fine")
    (request,) = server.requests
    assert request.headers["authorization"] == f"Bearer {SECRET}"
    assert request.body["model"] == "test-judge"
    assert request.body["temperature"] == 0.1
    assert request.body["response_format"] == {"type": "json_object"}
    assert "JSON schema" in request.body["messages"][0]["content"]  # the hint joins the system prompt
    assert request.body["messages"][1:] == MESSAGES[1:]


def test_server_error_is_retried(server):
    server.script(error(500), error(503))
    with make_judge(server) as judge:
        assert judge.score_sync(MESSAGES, Verdict).score == 1
        m = judge.metrics()
    assert len(server.requests) == 3
    assert m["judge/requests"] == 3 and m["judge/retries"] == 2
    assert m["judge/failures/server_error"] == 2 and m["judge/unscorable"] == 0


def test_rate_limit_honours_retry_after(server):
    server.script(error(429, retry_after=0.2))
    with make_judge(server, backoff_base=0.001) as judge:
        assert judge.score_sync(MESSAGES, Verdict).score == 1
        m = judge.metrics()
    first, second = server.requests
    assert second.started - first.finished >= 0.2  # backoff alone would be about 1 ms
    assert m["judge/failures/rate_limit"] == 1 and m["judge/retries"] == 1


def test_hang_past_timeout_is_retried(server):
    server.script(hang(3.0))
    with make_judge(server) as judge:
        start = time.monotonic()
        assert judge.score_sync(MESSAGES, Verdict).score == 1
        elapsed = time.monotonic() - start
        m = judge.metrics()
    assert elapsed < 2.0  # the 0.3 s timeout cut the 3 s hang
    assert m["judge/timeouts"] == 1 and m["judge/failures/timeout"] == 1 and m["judge/retries"] == 1


def test_truncated_body_is_a_transport_error(server):
    server.script(truncated('{"score": 7}'))
    with make_judge(server) as judge:
        assert judge.score_sync(MESSAGES, Verdict).score == 1
        m = judge.metrics()
    assert len(server.requests) == 2
    assert m["judge/failures/connection"] == 1 and m["judge/retries"] == 1 and m["judge/parse_failures"] == 0


def test_every_attempt_failing_gives_none_without_raising(server):
    server.script(error(500), hang(3.0), truncated())
    with make_judge(server) as judge:
        assert judge.score_sync(MESSAGES, Verdict) is None
        m = judge.metrics()
    assert len(server.requests) == 3  # max_retries=2 -> 3 attempts
    assert m["judge/unscorable"] == 1 and m["judge/retries"] == 2
    assert m["judge/failures/server_error"] == m["judge/failures/timeout"] == m["judge/failures/connection"] == 1


def test_client_error_is_not_retried(server):
    server.script(error(400))
    with make_judge(server) as judge:
        assert judge.score_sync(MESSAGES, Verdict) is None
        m = judge.metrics()
    assert len(server.requests) == 1 and m["judge/failures/http_400"] == 1 and m["judge/retries"] == 0


def test_malformed_json_gets_one_repair(server):
    server.script(ok("I think the answer is fine."))
    with make_judge(server) as judge:
        assert judge.score_sync(MESSAGES, Verdict).score == 1
        m = judge.metrics()
    first, second = server.requests
    repair = second.body["messages"]
    assert repair[:-2] == first.body["messages"]
    assert repair[-2] == {"role": "assistant", "content": "I think the answer is fine."}
    assert "could not be used" in repair[-1]["content"] and "no JSON" in repair[-1]["content"]
    assert m["judge/parse_failures"] == 1 and m["judge/repairs"] == 1 and m["judge/unscorable"] == 0


def test_malformed_twice_is_unscorable(server):
    server.script(ok("nope"), ok('{"score": "high"}'))
    with make_judge(server) as judge:
        assert judge.score_sync(MESSAGES, Verdict) is None
        m = judge.metrics()
    assert len(server.requests) == 2
    assert m["judge/parse_failures"] == 2 and m["judge/repairs"] == 1 and m["judge/unscorable"] == 1


def test_cache_makes_reruns_free(server, tmp_path):
    path = str(tmp_path / "judge.sqlite")
    with make_judge(server, cache_path=path) as judge:
        assert judge.score_sync(MESSAGES, Verdict).score == 1
        assert judge.score_sync(MESSAGES, Verdict).score == 1
        assert len(server.requests) == 1
        assert judge.metrics()["judge/cache_hits"] == 1
        # other sampling settings or another vote index are other questions
        judge.score_sync(MESSAGES, Verdict, temperature=0.7)
        judge.score_sync(MESSAGES, Verdict, vote_index=1)
        assert len(server.requests) == 3
    with make_judge(server, cache_path=path) as resumed:  # a new judge on the same file: still free
        assert resumed.score_sync(MESSAGES, Verdict) == Verdict(score=1, reason="fine")
        assert len(server.requests) == 3
        assert resumed.metrics()["judge/cost_usd"] == 0.0


def test_failures_are_not_cached(server, tmp_path):
    server.script(error(400))
    with make_judge(server, cache_path=str(tmp_path / "c.sqlite")) as judge:
        assert judge.score_sync(MESSAGES, Verdict) is None
        assert judge.score_sync(MESSAGES, Verdict).score == 1
    assert len(server.requests) == 2


def test_concurrency_bound(server):
    server.default = lambda body: ok('{"score": 1}', delay=0.1)
    batch = [[{"role": "user", "content": f"question {i}"}] for i in range(12)]
    with make_judge(server, max_concurrency=3, timeout=2.0) as judge:
        results = asyncio.run(judge.score_many(batch, Verdict))
    assert [r.score for r in results] == [1] * 12
    assert server.max_in_flight == 3


def test_deadline_cancels_pending_calls(server):
    server.default = lambda body: ok('{"score": 1}', delay=2.0)
    batch = [[{"role": "user", "content": f"question {i}"}] for i in range(4)]
    with make_judge(server, timeout=5.0) as judge:
        start = time.monotonic()
        results = judge.score_many_sync(batch, Verdict, deadline_s=0.2)
        assert time.monotonic() - start < 1.5
        m = judge.metrics()
    assert results == [None] * 4
    assert m["judge/failures/deadline"] == 4 and m["judge/unscorable"] == 4


def test_api_key_never_leaks(server, tmp_path, caplog):
    caplog.set_level(logging.DEBUG)  # every logger, the openai and httpx ones included
    path = tmp_path / "judge.sqlite"
    server.script(error(500), ok("garbage"), error(400))
    with make_judge(server, cache_path=str(path)) as judge:
        judge.score_sync(MESSAGES, Verdict)  # 500 -> retry -> garbage -> repair -> ok
        judge.score_sync([{"role": "user", "content": "other"}], Verdict)  # 400 -> None
        texts = [caplog.text, repr(judge), repr(judge.config), str(judge.metrics()), str(vars(judge.config))]
    assert all(r.headers["authorization"] == f"Bearer {SECRET}" for r in server.requests)  # it was sent...
    assert caplog.text  # ...the logs were captured...
    for text in texts:  # ...and it appears nowhere else
        assert SECRET not in text
    assert SECRET.encode() not in path.read_bytes()


def test_token_and_cost_accounting(server):
    usage = {"prompt_tokens": 1000, "completion_tokens": 200, "prompt_tokens_details": {"cached_tokens": 400}}
    server.script(ok("bad", usage=usage), ok('{"score": 1}', usage=usage))
    prices = dict(price_input_per_mtok=2.0, price_cached_per_mtok=0.5, price_output_per_mtok=8.0)
    with make_judge(server, **prices) as judge:
        judge.score_sync(MESSAGES, Verdict)  # one repair: two calls, both paid (Eq. 11 sums retries)
        m = judge.metrics(reset=True)
        assert m["judge/tokens_in"] == 2000 and m["judge/tokens_cached"] == 800 and m["judge/tokens_out"] == 400
        assert m["judge/cost_usd"] == pytest.approx(2 * 0.003)
        assert m["judge/usage_estimated"] == 0
        # reset starts a new step but keeps the cumulative cost
        m = judge.metrics()
        assert m["judge/calls"] == 0 and m["judge/cost_usd"] == 0 and m["judge/cost_usd_cum"] == pytest.approx(0.006)
        assert math.isnan(m["judge/latency_s_p50"])


def test_missing_usage_is_estimated(server):
    server.script(ok('{"score": 1}', usage=None))
    with make_judge(server, price_input_per_mtok=1.0) as judge:
        judge.score_sync([{"role": "user", "content": "x" * 400}], Verdict, max_tokens=None)
        m = judge.metrics()
    assert m["judge/usage_estimated"] == 1
    assert m["judge/tokens_in"] >= 100  # 400 characters / 4, plus the schema hint
    assert m["judge/cost_usd"] == pytest.approx(m["judge/tokens_in"] / 1e6)


def test_vote_all_and_majority(server, tmp_path):
    answers = iter([scores_json(a=1, b=1, c=0), scores_json(a=1, b=-1, c=0), "unparsable", "still unparsable"])
    server.default = lambda body: ok(next(answers, scores_json(a=1, b=1, c=1)))
    path = str(tmp_path / "votes.sqlite")
    with make_judge(server, votes=3, cache_path=path, max_concurrency=1) as judge:
        # three samples: (+1,+1,0), (+1,-1,0), unparsed twice -> None
        combined = asyncio.run(judge.vote(MESSAGES, Scores, to_verdicts))
        assert combined == {"a": NOT_APPLICABLE, "b": FAIL, "c": NOT_APPLICABLE}  # C10: "a" lacks the third pass
        assert len(server.requests) == 4
        assert judge.metrics()["judge/vote_disagreement"] == pytest.approx(1 / 3)  # only "b" disagrees
        # again under majority: vote indices 0 and 1 come from the cache, the failed one is asked anew -> (+1, +1, +1)
        again = asyncio.run(judge.vote(MESSAGES, Scores, to_verdicts, rule="majority"))
        assert len(server.requests) == 5
    # majority over (+1,+1,0), (+1,-1,0), (+1,+1,+1): a passes 3 of 3, b passes 2 of 3, c passes 1 of 3 and fails none
    assert again == {"a": PASS, "b": PASS, "c": NOT_APPLICABLE}


def test_sync_wrapper_inside_a_running_loop_and_threads(server):
    with make_judge(server) as judge:

        async def inside_a_loop() -> Verdict | None:
            return judge.score_sync(MESSAGES, Verdict)  # blocks this loop, but the judge's own loop does the work

        assert asyncio.run(inside_a_loop()).score == 1
        results: list[Verdict | None] = []
        threads = [threading.Thread(target=lambda: results.append(judge.score_sync(MESSAGES, Verdict))) for _ in "abc"]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.score for r in results] == [1, 1, 1]
        # plain `await` from two separate event loops, one after the other
        assert asyncio.run(judge.score(MESSAGES, Verdict)).score == 1
        assert asyncio.run(judge.score(MESSAGES, Verdict)).score == 1


def test_undecodable_response_body_is_retried(server):
    server.script(Reply(body=b"<html>proxy error</html>"), Reply(body=b'{"id": "x", "choices": []}'))
    with make_judge(server) as judge:
        assert judge.score_sync(MESSAGES, Verdict).score == 1
        m = judge.metrics()
    assert m["judge/failures/bad_response"] == 2 and m["judge/retries"] == 2 and m["judge/unscorable"] == 0


# ---------------------------------------------------------------------------------------------------------------------
# Self-judge


@pytest.fixture(scope="module")
def tiny_model_and_tokenizer():
    """A 2-layer Qwen2 with a byte-level BPE tokenizer, built offline."""
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    corpus = [template, '{"score": 1, "reason": "fine"}', "You grade answers. Is 2 + 2 = 4?"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=template
    )
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32), tokenizer


def test_local_judge_random_model_is_unscorable(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    model.train()
    judge = LocalModelJudge(model, tokenizer, max_new_tokens=8, timeout=30.0)
    result = asyncio.run(judge.score(MESSAGES, Verdict))
    m = judge.metrics()
    assert result is None  # garbage from random weights, no exception
    assert m["judge/requests"] == 2 and m["judge/parse_failures"] == 2 and m["judge/unscorable"] == 1
    assert m["judge/tokens_in"] > 0 and 0 < m["judge/tokens_out"] <= 16 and m["judge/gpu_s"] > 0
    assert model.training  # the train/eval mode is restored
    text, n_in, n_out = judge.generate(MESSAGES, temperature=0)  # greedy path runs too
    assert isinstance(text, str) and n_in > 0 and n_out <= 8
    judge.close()


def test_local_judge_parses_and_votes(tiny_model_and_tokenizer, monkeypatch):
    model, tokenizer = tiny_model_and_tokenizer
    judge = LocalModelJudge(model, tokenizer)
    answers = iter([scores_json(a=1, b=1), scores_json(a=1, b=-1), f"<think>hmm</think>{scores_json(a=1, b=1)}"])
    seen: list[list[dict]] = []

    def fake_generate(messages, **sampling):
        seen.append(messages)
        return next(answers), 50, 10

    monkeypatch.setattr(judge, "generate", fake_generate)
    combined = asyncio.run(judge.vote(MESSAGES, Scores, to_verdicts))  # k = 3, unanimity by default
    assert combined == {"a": PASS, "b": FAIL}
    assert len(seen) == 3 and "JSON schema" in seen[0][0]["content"]
    m = judge.metrics()
    assert m["judge/calls"] == 3 and m["judge/tokens_in"] == 150 and m["judge/tokens_out"] == 30
    assert m["judge/cost_usd"] == 0.0  # local price defaults to 0 (DRACO §4.7)
    # the sync wrapper works for the self-judge too
    monkeypatch.setattr(judge, "generate", lambda messages, **kw: ('{"score": 3}', 5, 5))
    assert judge.score_sync(MESSAGES, Verdict).score == 3
    judge.close()


def test_an_answer_over_max_answer_bytes_is_a_failed_call_not_read(server):
    """Issue 65: a 200 MiB judge answer was read whole (867 MB for one call). A body whose stated length is over
    `max_answer_bytes` is refused before it is read, counted as `too_large`, not retried; a short one still works."""
    server.script(ok('{"score": 1, "reason": "' + "x" * 5000 + '"}'))
    with make_judge(server, max_answer_bytes=2000, max_repairs=0) as judge:
        assert judge.score_sync(MESSAGES, Verdict) is None
        assert judge.score_sync(MESSAGES, Verdict).score == 1  # the default reply: small
        m = judge.metrics()
    assert m["judge/failures/too_large"] == 1 and m["judge/retries"] == 0 and len(server.requests) == 2
