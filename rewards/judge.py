"""Model judges: an API judge over the `openai` client and an in-process self-judge, behind one async `score`.

A judge turns chat `messages` into an instance of a pydantic `schema`, or `None` when it cannot (the row is then
unscorable, as TRL treats a `None` reward). It never raises into the training loop. See docs/methods/draco.md §4.5-4.7
(self-judge votes, client, failures, timeouts, Eq. 11 cost) and `docs/methods/t1.md` §4.6 (auditor output contract).

What the API judge (`Judge`) does:

1. Sends `chat.completions` requests to any OpenAI-compatible `base_url` (OpenAI, vLLM, `transformers serve`) on an
   `AsyncOpenAI` client whose own retries are disabled, so the judge counts and controls every attempt.
2. Bounds the requests in flight with a semaphore (`max_concurrency`) and each request with a hard timeout.
3. Retries 408/409/429/5xx, timeouts and connection errors (a truncated body or a reset connection is one) with
   exponential backoff and jitter, `backoff_base * 2**attempt`, waiting at least the server's `retry-after`.
4. Asks for JSON (`response_format` plus a schema hint in the system prompt), strips `<think>` reasoning, accepts
   fenced JSON, JSON inside prose and a bare array for a one-field envelope, and validates against the schema. On an
   invalid answer it re-asks with the validation error appended (`max_repairs` times), then gives up (`None`).
5. Caches validated answers on disk (sqlite3) under a hash of (model, messages, schema, sampling, vote index), so a
   rerun or a resume costs nothing and makes no request. Failures are never cached.
6. Counts calls, cache hits, requests, retries, repairs, timeouts, failures by reason, tokens and USD cost (Eq. 11)
   and reports them as a flat dict (`metrics()`).

The API key is read from the environment variable named by `JudgeConfig.api_key_env` when the client is built. It is
never stored in the config, in a repr, in a log line, in a metric or in a cache key.

All requests of a `Judge` run on its own background event loop thread, so `await judge.score(...)` works from any
event loop and `judge.score_sync(...)` works from plain code, even code already running inside an event loop.

`LocalModelJudge` is the self-judge of DRACO §4.5: the same interface, answered by a transformers model and tokenizer
in a worker thread (chat template, sampled at temperature 0.6 / top-p 0.95 by default). It has no cache, because the
policy it wraps changes every step (DRACO D9). `combine_votes` is the pure k-sample combining rule (DRACO Eq. 10 as
amended by conventions.md C10).

`API_MODEL_FIELDS` is the one definition of the endpoint settings that a config exposes as flat fields (TRL's parser
and the YAML recipes need flat fields): DRACO's judge (`judge_*`), TASPO's analyzer (`analyzer_*`), the Funnel's editor
(`editor_*`) and the task audit's options each declare their copy with an `APIModelFields` (prefix, settings, per-use
defaults and help) and build their `JudgeConfig` with its `judge_config`.

Deliberately left out: streaming, tool calls, `n > 1` sampling in one request (votes are separate requests with
distinct cache keys), input-budget shortening (the rubric stages own their prompts), and per-phase bookkeeping (use
one judge per phase and a metric prefix per judge).

Logged metrics (`metrics(prefix="judge/")`; DRACO can pass `prefix="draco/judge_"`):
- `calls`: `score` calls; `cache_hits`: answered from the disk cache; `requests`: requests sent (retries included).
- `retries`: requests re-sent after a transport error; `repairs`: re-asks after an invalid answer.
- `timeouts`: timed-out attempts; `parse_failures`: answers that failed JSON or schema validation.
- `failures/<reason>`: failed attempts by reason (`timeout`, `connection`, `rate_limit`, `server_error`, `http_<code>`,
  `bad_response`, `generation`, `internal`, `cache`, `deadline`).
- `unscorable`: `score` calls that returned `None`.
- `tokens_in`, `tokens_cached`, `tokens_out`: from the responses' `usage`; `usage_estimated`: responses without usage,
  whose tokens were estimated as characters / 4.
- `cost_usd`: Eq. 11 summed over this step's requests; `cost_usd_cum`: the same since the judge was built.
- `latency_s_p50`, `latency_s_p95`: request latency; `gpu_s`: self-judge generation seconds.
- `vote_disagreement`: share of voted criteria whose parsed samples disagree.
"""

from __future__ import annotations

import abc
import argparse
import asyncio
import email.utils
import hashlib
import json
import logging
import math
import os
import random
import re
import sqlite3
import threading
import time
import urllib.parse
from collections import defaultdict
from collections.abc import Awaitable, Callable, Coroutine, Hashable, Iterator, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Self, TypeVar

import httpx
import openai
import pydantic

logger = logging.getLogger(__name__)

Messages = list[dict[str, Any]]
M = TypeVar("M", bound=pydantic.BaseModel)
K = TypeVar("K", bound=Hashable)
T = TypeVar("T")

PASS, FAIL, NOT_APPLICABLE = 1, -1, 0
VOTE_RULES = ("all", "majority")
RESPONSE_FORMATS = ("json_object", "json_schema", "none")
# keyword arguments `chat.completions.create` takes itself; any other sampling setting goes into `extra_body`
_CREATE_PARAMS = frozenset(
    {"temperature", "top_p", "max_tokens", "max_completion_tokens", "seed", "stop", "presence_penalty"}
    | {"frequency_penalty", "logit_bias", "reasoning_effort"}
)
_COUNTERS = (
    "calls cache_hits requests retries repairs timeouts parse_failures unscorable tokens_in tokens_cached tokens_out "
    "usage_estimated cost_usd gpu_s"
).split()
REPAIR_PROMPT = (
    "Your previous reply could not be used: {error}\n"
    "Reply again with only one JSON object that validates against the requested schema, and nothing else."
)
SCHEMA_HINT = "Answer with one JSON object that validates against this JSON schema, and nothing else:\n{schema}"


@dataclass
class JudgeConfig:
    """Settings of one API judge (one model at one endpoint). The API key itself is never part of it."""

    model: str = field(metadata={"help": "Model id sent to the endpoint, e.g. `gpt-4.1-mini` or a vLLM model name."})
    base_url: str | None = field(
        default=None, metadata={"help": "OpenAI-compatible base URL (`http://host:8000/v1`); None means OpenAI."}
    )
    api_key_env: str = field(
        default="OPENAI_API_KEY",
        metadata={"help": "Name of the environment variable holding the API key; unset sends a placeholder key."},
    )
    max_concurrency: int = field(default=32, metadata={"help": "Most requests in flight (DRACO §4.6: 32)."})
    timeout: float = field(default=180.0, metadata={"help": "Seconds per request attempt (DRACO §4.6: 180)."})
    max_retries: int = field(
        default=2, metadata={"help": "Re-sends after a transport error: 2 gives 3 attempts (DRACO §4.6)."}
    )
    backoff_base: float = field(default=1.0, metadata={"help": "Backoff before retry n is backoff_base * 2**n s."})
    backoff_max: float = field(default=60.0, metadata={"help": "Longest wait before a retry, retry-after included."})
    temperature: float = field(default=0.1, metadata={"help": "Judge sampling temperature (DRACO §4.2: 0.1)."})
    max_tokens: int | None = field(default=16384, metadata={"help": "Judge max output tokens (DRACO §5: 16,384)."})
    top_p: float | None = field(default=None, metadata={"help": "Nucleus sampling; None leaves the server default."})
    seed: int | None = field(default=None, metadata={"help": "Sampling seed sent to the endpoint, if any."})
    extra_body: dict[str, Any] = field(
        default_factory=dict, metadata={"help": "Extra request fields, e.g. {'top_k': 20} for vLLM."}
    )
    response_format: str = field(
        default="json_object", metadata={"help": "Structured output: `json_object`, `json_schema` or `none`."}
    )
    schema_hint: bool = field(default=True, metadata={"help": "Append the JSON schema to the system prompt."})
    max_repairs: int = field(
        default=1, metadata={"help": "Re-asks with the validation error after an invalid answer, then None."}
    )
    cache_path: str | None = field(default=None, metadata={"help": "sqlite3 file of cached answers; None: no cache."})
    max_answer_bytes: int = field(
        default=4 * 2**20,
        metadata={
            "help": "Largest response body accepted (4 MiB); a larger one is a failed call (`too_large`), not read "
            "when the server states its length."
        },
    )
    price_input_per_mtok: float = field(default=0.0, metadata={"help": "USD per million prompt tokens (Eq. 11)."})
    price_cached_per_mtok: float | None = field(
        default=None, metadata={"help": "USD per million cached prompt tokens; None: the prompt price."}
    )
    price_output_per_mtok: float = field(default=0.0, metadata={"help": "USD per million completion tokens."})
    votes: int = field(default=1, metadata={"help": "Samples per `vote` call (k)."})
    vote_rule: str = field(default="all", metadata={"help": "How `vote` combines samples: `all` or `majority`."})

    def __post_init__(self) -> None:
        if self.vote_rule not in VOTE_RULES:
            raise ValueError(f"JudgeConfig.vote_rule must be one of {VOTE_RULES}, got {self.vote_rule!r}")
        if self.response_format not in RESPONSE_FORMATS:
            raise ValueError(
                f"JudgeConfig.response_format must be one of {RESPONSE_FORMATS}, got {self.response_format!r}"
            )
        for name in ("max_concurrency", "votes"):
            if getattr(self, name) < 1:
                raise ValueError(f"JudgeConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_retries", "max_repairs"):
            if getattr(self, name) < 0:
                raise ValueError(f"JudgeConfig.{name} must be >= 0, got {getattr(self, name)}")
        if not self.timeout > 0:
            raise ValueError(f"JudgeConfig.timeout must be > 0, got {self.timeout}")


# ---------------------------------------------------------------------------------------------------------------------
# One API model's settings as flat, prefixed fields of a config (`judge_model`, `analyzer_timeout`, ...): TRL's parser
# and the YAML recipes need flat fields, so each use's config declares its copy by hand, and an `APIModelFields`
# names that copy (to build its `JudgeConfig`, check it, or add it to an argparse parser).

# The settings a use may expose: its field name -> (the `JudgeConfig` field it sets, type, help text; `{role}` is the
# use's prefix). The default is `JudgeConfig`'s own (None for `model`) unless the use says otherwise.
API_MODEL_FIELDS: dict[str, tuple[str, type, str]] = {
    "model": ("model", str, "Model id at the endpoint (`openai` only)."),
    "base_url": ("base_url", str, "OpenAI-compatible base URL; None: OpenAI."),
    "api_key_env": ("api_key_env", str, "Env variable holding the API key."),
    "cache_path": ("cache_path", str, "sqlite3 cache of {role} answers."),
    "concurrency": ("max_concurrency", int, "Most {role} calls in flight."),
    "timeout": ("timeout", float, "Seconds per {role} call attempt."),
    "max_retries": ("max_retries", int, "Transport re-sends after a failed request."),
    "max_repairs": ("max_repairs", int, "Re-asks with the validation error after an invalid answer."),
    "temperature": ("temperature", float, "Sampling temperature of the {role}."),
    "max_tokens": ("max_tokens", int, "Max output tokens of the {role}."),
    "price_input_per_mtok": ("price_input_per_mtok", float, "USD per million prompt tokens."),
    "price_output_per_mtok": ("price_output_per_mtok", float, "USD per million completion tokens."),
}


@dataclass(frozen=True)
class APIModelFields:
    """One use's copy of `API_MODEL_FIELDS`: the settings `names` as `{prefix}_{name}` fields (`{name}` with an empty
    prefix), with `defaults` and `help` where this use differs; a default of `dataclasses.MISSING` is required. The
    endpoint is on when the config's `selector` field is `"openai"`.

    >>> use = APIModelFields("critic", ("model", "timeout"), selector="critic_backend", defaults={"timeout": 60.0})
    >>> use.field_names(), use.default("timeout"), use.help_text("timeout")
    (['critic_model', 'critic_timeout'], 60.0, 'Seconds per critic call attempt.')
    """

    prefix: str
    names: tuple[str, ...]
    selector: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)
    help: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for given in (self.names, self.defaults, self.help):
            if unknown := [n for n in given if n not in API_MODEL_FIELDS or n not in self.names]:
                raise ValueError(f"{self.prefix!r}: {unknown} are not fields of this use (see API_MODEL_FIELDS)")

    def flat(self, name: str) -> str:
        return f"{self.prefix}_{name}" if self.prefix else name

    def field_names(self) -> list[str]:
        return [self.flat(n) for n in self.names]

    def default(self, name: str) -> Any:
        if name in self.defaults:
            return self.defaults[name]
        own = {f.name: f.default for f in fields(JudgeConfig)}[API_MODEL_FIELDS[name][0]]
        return None if own is MISSING else own  # `model`: no id until the use names one

    def help_text(self, name: str) -> str:
        return self.help.get(name, API_MODEL_FIELDS[name][2].format(role=self.prefix))

    def declaration_problems(self, cls: type) -> list[str]:
        """How the dataclass `cls` (a method's config) differs from this use: a field of the use it does not
        declare, or declares with another default or help text. Each config writes its use's fields out by hand, so
        they can be read and searched where they are; tests/test_judge.py holds every one to its use with this."""
        declared = {f.name: f for f in fields(cls)}
        problems = []
        for name in self.names:
            flat = self.flat(name)
            if flat not in declared:
                problems.append(f"{cls.__name__} does not declare {flat}")
                continue
            default, help_text = self.default(name), self.help_text(name)
            if declared[flat].default != default or declared[flat].metadata.get("help") != help_text:
                problems.append(f"{cls.__name__}.{flat}: default or help differs from {self.prefix}'s use")
        return problems

    def add_arguments(self, parser: argparse.ArgumentParser, flags: Mapping[str, str] | None = None) -> None:
        """The same fields as `argparse` options (`--{prefix}_{name}`, or the flag `flags` names)."""
        for name in self.names:
            default = self.default(name)
            parser.add_argument(
                (flags or {}).get(name, f"--{self.flat(name)}"),
                dest=self.flat(name),
                type=API_MODEL_FIELDS[name][1],
                default=None if default is MISSING else default,
                required=default is MISSING,
                help=self.help_text(name),
            )

    def check(self, config: Any) -> None:
        """The rule every use shares: an endpoint that is on needs a model id."""
        if self.selector and getattr(config, self.selector) == "openai" and not getattr(config, self.flat("model")):
            raise ValueError(f"{self.flat('model')} is required when {self.selector} is 'openai'")

    def judge_config(self, config: Any, **settings: Any) -> JudgeConfig:
        """The `JudgeConfig` of this use's fields of `config` (a config or an argparse namespace); `settings` are
        `JudgeConfig` fields the use fixes or derives rather than exposes (e.g. the audit's temperature 0)."""
        values = {API_MODEL_FIELDS[n][0]: getattr(config, self.flat(n)) for n in self.names}
        return JudgeConfig(**(values | settings))


# ---------------------------------------------------------------------------------------------------------------------
# Pure helpers: parsing, cost, vote combining


def strip_reasoning(text: str) -> str:
    """Remove `<think>...</think>` reasoning (DRACO D5); an unclosed `<think>` drops everything after it.

    >>> strip_reasoning('<think>hmm {"a": 0}</think> {"a": 1}')
    '{"a": 1}'
    >>> strip_reasoning('reasoning without an opening tag</think>{"a": 2}')
    '{"a": 2}'
    """
    text = re.sub(r"<think>.*?</think>", "", text, flags=re.DOTALL)
    if "</think>" in text:  # the chat template opened <think> inside the prompt
        text = text.rsplit("</think>", 1)[1]
    if "<think>" in text:  # reasoning cut off by the token limit: only what came before it is an answer
        text = text.split("<think>", 1)[0]
    return text.strip()


def _json_candidates(text: str, limit: int = 64) -> Iterator[Any]:
    """Yield JSON values found in `text`: the whole text (and nothing else when it is one JSON value), then fenced
    blocks, then each top-level balanced value in order. A value nested inside another is never a candidate of its
    own: `{"answer": 7, "detail": {"value": 8}}` is an answer of the wrong shape, not an answer of 8."""
    try:
        yield json.loads(text)
        return
    except json.JSONDecodeError:
        pass
    for block in re.findall(r"```[A-Za-z]*\s*\n?(.*?)```", text, flags=re.DOTALL):
        try:
            yield json.loads(block)
        except json.JSONDecodeError:
            pass
    decoder = json.JSONDecoder()
    i, tried = 0, 0
    while tried < limit:
        starts = [j for j in (text.find("{", i), text.find("[", i)) if j >= 0]
        if not starts:
            return
        i, tried = min(starts), tried + 1
        try:
            value, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            i += 1
            continue
        yield value
        i = end  # past the whole value: its inner values are part of it


def parse_output(text: str, schema: type[M]) -> M:
    """Parse a judge's text into `schema`: reasoning stripped, first JSON value that validates wins.

    A bare JSON array is wrapped into the envelope when the schema has exactly one field (DRACO D6).
    Raises `ValueError` with a short, model-readable reason when nothing validates.

    >>> class Out(pydantic.BaseModel):
    ...     scores: list[int]
    >>> parse_output('Sure! ```json\\n{"scores": [1, -1]}\\n```', Out).scores
    [1, -1]
    >>> parse_output("[0, 1]", Out).scores
    [0, 1]
    """
    fields = list(schema.model_fields)
    first_error: str | None = None
    for value in _json_candidates(strip_reasoning(text)):
        if isinstance(value, list) and len(fields) == 1:
            value = {fields[0]: value}
        try:
            return schema.model_validate(value)
        except pydantic.ValidationError as err:
            if first_error is None:
                first_error = f"the JSON does not match the schema: {err}"
    raise ValueError(first_error or "the reply contains no JSON value")


def call_cost_usd(
    prompt_tokens: int,
    cached_tokens: int,
    completion_tokens: int,
    price_input_per_mtok: float,
    price_cached_per_mtok: float,
    price_output_per_mtok: float,
) -> float:
    """USD of one call, docs/methods/draco.md Eq. 11: [(u_in − u_cached)·π_in + u_cached·π_cached + u_out·π_out] / 1e6.

    >>> call_cost_usd(1000, 400, 200, 2.0, 0.5, 8.0)  # (600*2 + 400*0.5 + 200*8) / 1e6
    0.003
    """
    usd = (prompt_tokens - cached_tokens) * price_input_per_mtok  # Eq. 11: uncached prompt tokens
    usd += cached_tokens * price_cached_per_mtok + completion_tokens * price_output_per_mtok
    return usd / 1e6


def combine_votes(
    samples: Sequence[Mapping[K, int] | None], rule: str = "all", criteria: Sequence[K] | None = None
) -> dict[K, int] | None:
    """Combine k per-criterion verdicts (+1 pass, −1 fail, 0 not applicable); `None` marks a sample that did not parse.

    `rule="all"` is DRACO Eq. 10 as amended by conventions.md C10: a criterion passes only if every one of the k
    samples parsed and passed it; it fails if any parsed sample failed it; otherwise it is not applicable.
    `rule="majority"`: pass if more than k/2 samples pass it, fail if more than k/2 fail it, else not applicable.
    Criteria are those of `criteria` plus any a parsed sample mentions; one no sample mentions is 0.
    Returns `None` (unscorable) when no sample parsed.

    >>> combine_votes([{"a": 1, "b": 1}, {"a": 1, "b": -1}, {"a": 1, "b": 1}])
    {'a': 1, 'b': -1}
    >>> combine_votes([{"a": 1}, None, {"a": 1}])  # C10: a pass needs all k samples
    {'a': 0}
    """
    if rule not in VOTE_RULES:
        raise ValueError(f"rule must be one of {VOTE_RULES}, got {rule!r}")
    parsed = [s for s in samples if s is not None]
    if not parsed:
        return None
    keys = dict.fromkeys(list(criteria or []) + [c for s in parsed for c in s])
    k = len(samples)
    out: dict[K, int] = {}
    for c in keys:
        votes = [None if s is None else s.get(c) for s in samples]
        n_pass, n_fail = votes.count(PASS), votes.count(FAIL)
        if rule == "all":
            out[c] = FAIL if n_fail else PASS if n_pass == k else NOT_APPLICABLE  # Eq. 10 / C10
        else:
            out[c] = PASS if n_pass > k / 2 else FAIL if n_fail > k / 2 else NOT_APPLICABLE
    return out


def with_schema_hint(messages: Sequence[Mapping[str, Any]], schema: type[pydantic.BaseModel]) -> Messages:
    """Copy of `messages` whose system prompt ends with the schema hint (a system message is added if none)."""
    hint = SCHEMA_HINT.format(schema=json.dumps(schema.model_json_schema(), separators=(",", ":")))
    out = [dict(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        out[0]["content"] = f"{out[0]['content']}\n\n{hint}"
    else:
        out.insert(0, {"role": "system", "content": hint})
    return out


def parse_retry_after(headers: Mapping[str, str] | None) -> float | None:
    """Seconds to wait from `retry-after-ms`, `retry-after` (seconds or an HTTP date), or None."""
    if not headers:
        return None
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            try:
                seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
            except (TypeError, ValueError, IndexError):
                continue
        if math.isfinite(seconds):
            return max(0.0, seconds)
    return None


class AnswerTooLarge(Exception):
    """A response body beyond `JudgeConfig.max_answer_bytes` (found from its Content-Length, before it is read)."""


def classify_error(err: BaseException) -> tuple[str, bool, float | None]:
    """Map an exception from a request to (reason, retryable, retry-after seconds)."""
    cause = err
    while cause is not None:  # the openai client wraps what the HTTP layer raised
        if isinstance(cause, AnswerTooLarge):
            return "too_large", False, None
        cause = cause.__cause__ or cause.__context__
    if isinstance(err, TimeoutError | openai.APITimeoutError):
        return "timeout", True, None
    if isinstance(err, openai.APIConnectionError | ConnectionError | EOFError):  # includes truncated bodies
        return "connection", True, None
    if isinstance(err, openai.APIStatusError):
        status = err.status_code
        retry_after = parse_retry_after(err.response.headers)
        if status == 429:
            return "rate_limit", True, retry_after
        if status >= 500:
            return "server_error", True, retry_after
        return f"http_{status}", status in (408, 409), retry_after
    if isinstance(err, ValueError | openai.APIResponseValidationError):  # an undecodable body or no choices
        return "bad_response", True, None
    return "internal", False, None


def _percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


# ---------------------------------------------------------------------------------------------------------------------
# Accounting and cache


class JudgeStats:
    """Thread-safe counters of one judge; `reset()` starts a new step and keeps the cumulative cost."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self.cost_usd_cum = 0.0
        self.reset()

    def reset(self) -> None:
        with self._lock:  # re-entrant: `as_dict(reset=True)` calls this while holding it
            self.counts: defaultdict[str, float] = defaultdict(float)
            self.latencies: list[float] = []
            self.vote_criteria = 0
            self.vote_disagreements = 0

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self.counts[name] += value
            if name == "cost_usd":
                self.cost_usd_cum += value

    def add_latency(self, seconds: float) -> None:
        with self._lock:
            self.latencies.append(seconds)

    def add_votes(self, criteria: int, disagreements: int) -> None:
        with self._lock:
            self.vote_criteria += criteria
            self.vote_disagreements += disagreements

    def as_dict(self, prefix: str = "judge/", reset: bool = False) -> dict[str, float]:
        """Flat metrics dict; with `reset=True` the step counters restart in the same atomic step."""
        with self._lock:
            out = {f"{prefix}{name}": self.counts.get(name, 0.0) for name in _COUNTERS}
            out.update({f"{prefix}{k}": v for k, v in sorted(self.counts.items()) if k.startswith("failures/")})
            out[f"{prefix}cost_usd_cum"] = self.cost_usd_cum
            out[f"{prefix}latency_s_p50"] = _percentile(self.latencies, 50)
            out[f"{prefix}latency_s_p95"] = _percentile(self.latencies, 95)
            out[f"{prefix}vote_disagreement"] = (
                self.vote_disagreements / self.vote_criteria if self.vote_criteria else math.nan
            )
        if reset:
            self.reset()
        return out


class JudgeCache:
    """sqlite3 table key -> validated JSON answer. One connection behind a lock, so threads may share it."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(self.path, check_same_thread=False, timeout=30.0)
        with self._lock, self._conn:
            self._conn.execute(
                "CREATE TABLE IF NOT EXISTS answers "
                "(key TEXT PRIMARY KEY, model TEXT, schema TEXT, value TEXT NOT NULL, created REAL)"
            )

    def get(self, key: str) -> str | None:
        with self._lock:
            row = self._conn.execute("SELECT value FROM answers WHERE key = ?", (key,)).fetchone()
        return None if row is None else row[0]

    def put(self, key: str, value: str, model: str = "", schema: str = "") -> None:
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT OR REPLACE INTO answers VALUES (?, ?, ?, ?, ?)", (key, model, schema, value, time.time())
            )

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM answers").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._conn.close()


# ---------------------------------------------------------------------------------------------------------------------
# Judges


class BaseJudge(abc.ABC):
    """What every judge offers: async `score` (the one method a subclass must write), batches, votes, sync calls.

    A subclass (the API judge, the self-judge, a scripted oracle) implements `score` and returns `None` instead of
    raising. It calls `super().__init__()` to get `stats` and the background loop used by the sync wrappers.
    """

    def __init__(self, votes: int = 1, vote_rule: str = "all", max_repairs: int = 1) -> None:
        if vote_rule not in VOTE_RULES:
            raise ValueError(f"vote_rule must be one of {VOTE_RULES}, got {vote_rule!r}")
        self.votes = votes
        self.vote_rule = vote_rule
        self.max_repairs = max_repairs
        self.stats = JudgeStats()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._loop_lock = threading.Lock()

    @abc.abstractmethod
    async def score(
        self, messages: Sequence[Mapping[str, Any]], schema: type[M], *, vote_index: int = 0, **sampling: Any
    ) -> M | None:
        """Judge `messages`; return a `schema` instance, or None when unscorable. Never raises."""

    async def score_many(
        self,
        batch: Sequence[Sequence[Mapping[str, Any]]],
        schema: type[M],
        *,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> list[M | None]:
        """Score every conversation of `batch` concurrently (the judge bounds the requests in flight).

        When `deadline_s` passes, calls still pending are cancelled and return None (DRACO §4.6 step deadline).
        """
        tasks = [asyncio.ensure_future(self.score(m, schema, **sampling)) for m in batch]
        if not tasks:
            return []
        done, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if pending:
            logger.warning(
                "judge deadline of %.1f s passed: %d of %d calls cancelled", deadline_s, len(pending), len(tasks)
            )
            self.stats.add("failures/deadline", len(pending))
            self.stats.add("unscorable", len(pending))
        results: list[M | None] = []
        for task in tasks:
            if task in done and task.exception() is None:
                results.append(task.result())
            else:
                if task in done:  # a subclass broke the never-raise contract; keep the batch alive anyway
                    logger.warning("judge raised %s; row is unscorable", type(task.exception()).__name__)
                    self.stats.add("failures/internal")
                    self.stats.add("unscorable")
                results.append(None)
        return results

    async def sample_votes(
        self, messages: Sequence[Mapping[str, Any]], schema: type[M], k: int | None = None, **sampling: Any
    ) -> list[M | None]:
        """k independent samples (vote indices 0..k-1, so each has its own cache entry); None where one failed."""
        k = self.votes if k is None else k
        return list(await asyncio.gather(*(self.score(messages, schema, vote_index=i, **sampling) for i in range(k))))

    async def vote(
        self,
        messages: Sequence[Mapping[str, Any]],
        schema: type[M],
        verdicts: Callable[[M], Mapping[K, int]],
        *,
        k: int | None = None,
        rule: str | None = None,
        criteria: Sequence[K] | None = None,
        **sampling: Any,
    ) -> dict[K, int] | None:
        """Sample k answers, map each to per-criterion verdicts with `verdicts`, combine with `combine_votes`.

        Returns None (unscorable) when no sample parsed.
        """
        samples = await self.sample_votes(messages, schema, k, **sampling)
        per_sample: list[Mapping[K, int] | None] = []
        for sample in samples:
            try:
                per_sample.append(None if sample is None else verdicts(sample))
            except Exception as err:  # a verdict extractor that chokes counts as an unparsed sample
                logger.warning("vote extractor raised %s; sample dropped", type(err).__name__)
                self.stats.add("parse_failures")
                per_sample.append(None)
        combined = combine_votes(per_sample, rule or self.vote_rule, criteria)
        if combined is None:
            return None
        parsed = [s for s in per_sample if s is not None]
        disagree = sum(len({s.get(c, NOT_APPLICABLE) for s in parsed}) > 1 for c in combined)
        self.stats.add_votes(len(combined), disagree)
        return combined

    async def _parse_with_repairs(
        self, messages: Messages, schema: type[M], complete: Callable[[Messages], Awaitable[str | None]]
    ) -> M | None:
        """Ask, validate, and re-ask with the validation error up to `max_repairs` times; None when it never parses."""
        for repair in range(self.max_repairs + 1):
            text = await complete(messages)
            if text is None:  # transport failure after all retries, already counted
                break
            try:
                return parse_output(text, schema)
            except ValueError as err:
                self.stats.add("parse_failures")
                reason = str(err)[:2000]
                logger.info(
                    "judge answer invalid for %s (repair %d of %d): %s",
                    schema.__name__,
                    repair,
                    self.max_repairs,
                    reason[:200],
                )
                if repair == self.max_repairs:
                    break
                self.stats.add("repairs")
                messages = [
                    *messages,
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": REPAIR_PROMPT.format(error=reason)},
                ]
        self.stats.add("unscorable")
        return None

    # -- sync use from the training loop ------------------------------------------------------------------------------

    def _background_loop(self) -> asyncio.AbstractEventLoop:
        """The judge's own event loop, running in a daemon thread (started on first use)."""
        with self._loop_lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name=f"{type(self).__name__}-loop", daemon=True)
                thread.start()
                self._loop, self._loop_thread = loop, thread
            return self._loop

    def run_sync(self, awaitable: Awaitable[T]) -> T:
        """Run `awaitable` on the judge's background loop and wait for it; safe inside a running event loop."""
        loop = self._background_loop()
        if _running_loop() is loop:
            raise RuntimeError("run_sync called from the judge's own loop; await the coroutine instead")

        async def _await() -> T:
            return await awaitable

        return asyncio.run_coroutine_threadsafe(_await(), loop).result()

    def score_sync(
        self, messages: Sequence[Mapping[str, Any]], schema: type[M], *, vote_index: int = 0, **sampling: Any
    ) -> M | None:
        """Blocking `score`."""
        return self.run_sync(self.score(messages, schema, vote_index=vote_index, **sampling))

    def score_many_sync(
        self,
        batch: Sequence[Sequence[Mapping[str, Any]]],
        schema: type[M],
        *,
        deadline_s: float | None = None,
        **sampling: Any,
    ) -> list[M | None]:
        """Blocking `score_many`."""
        return self.run_sync(self.score_many(batch, schema, deadline_s=deadline_s, **sampling))

    # -- accounting and lifetime --------------------------------------------------------------------------------------

    def metrics(self, prefix: str = "judge/", reset: bool = False) -> dict[str, float]:
        """Flat dict of this step's counters (see the module docstring); `reset=True` then starts a new step."""
        return self.stats.as_dict(prefix, reset=reset)

    def reset_metrics(self) -> None:
        self.stats.reset()

    def _close_on_loop(self) -> Coroutine[Any, Any, None] | None:
        """Coroutine releasing loop-bound resources before the loop stops (subclasses override)."""
        return None

    def close(self) -> None:
        """Stop the background loop (releasing the HTTP client on it). The judge may be used again afterwards."""
        with self._loop_lock:
            loop, thread = self._loop, self._loop_thread
            self._loop = self._loop_thread = None
        if loop is None:
            return
        closing = self._close_on_loop()
        if closing is not None:
            try:
                asyncio.run_coroutine_threadsafe(closing, loop).result(timeout=5)
            except Exception as err:  # closing is best effort
                logger.debug("judge client close failed: %s", type(err).__name__)
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=5)
        if not loop.is_running():
            loop.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_loopback(base_url: str | None) -> bool:
    """Is `base_url` a server on this machine (localhost, 127.x, ::1)?

    >>> is_loopback("http://127.0.0.1:8000/v1"), is_loopback("http://localhost/v1"), is_loopback(None)
    (True, True, False)
    """
    host = urllib.parse.urlsplit(base_url).hostname if base_url else None
    return host == "localhost" or (host or "").startswith("127.") or host == "::1"


def check_endpoint(base_url: str | None, api_key_env: str, timeout: float = 10.0) -> str | None:
    """Why an OpenAI-compatible endpoint cannot serve a judge, or None when it answers. One `GET /models` with the key
    read from `api_key_env`: a refused, unresolvable or timed-out connection and a 401/403 are reasons; any other
    answer, a 404 or 501 from a server without that route included, means the server is there. Run at start-up, so a
    wrong `base_url` or key stops a run before a model is loaded, not after every reward came back None."""
    api_key = os.environ.get(api_key_env)
    where = f"the endpoint {base_url}" if base_url else "the OpenAI API"
    if base_url is None and not api_key:
        return f"environment variable {api_key_env} is not set, and {where} needs a key"
    client = openai.OpenAI(api_key=api_key or "EMPTY", base_url=base_url, timeout=timeout, max_retries=0)
    try:
        client.models.list()
    except (openai.AuthenticationError, openai.PermissionDeniedError) as err:
        given = f"the key in {api_key_env}" if api_key else f"no key ({api_key_env} is not set)"
        return f"{where} answered HTTP {err.status_code} to {given}"
    except openai.APIConnectionError as err:  # refused, unresolvable, reset or timed out
        return f"{where} cannot be reached ({type(err).__name__}: {err.__cause__ or err})"
    except openai.APIStatusError:
        return None
    finally:
        client.close()
    return None


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class Judge(BaseJudge):
    """API judge over `openai.AsyncOpenAI` against any OpenAI-compatible endpoint; see the module docstring."""

    def __init__(self, config: JudgeConfig) -> None:
        super().__init__(votes=config.votes, vote_rule=config.vote_rule, max_repairs=config.max_repairs)
        self.config = config
        self.cache = JudgeCache(config.cache_path) if config.cache_path else None
        # built on the background loop at first use, so they belong to that loop
        self._client: openai.AsyncOpenAI | None = None
        self._semaphore: asyncio.Semaphore | None = None

    def __repr__(self) -> str:
        c = self.config
        return f"Judge(model={c.model!r}, base_url={c.base_url!r}, api_key_env={c.api_key_env!r})"

    def request_settings(self, schema: type[pydantic.BaseModel], **sampling: Any) -> dict[str, Any]:
        """Keyword arguments for `chat.completions.create`: config sampling, overridden by `sampling`."""
        c = self.config
        settings: dict[str, Any] = {"temperature": c.temperature, "top_p": c.top_p, "max_tokens": c.max_tokens}
        settings["seed"] = c.seed
        settings.update(sampling)
        settings = {k: v for k, v in settings.items() if v is not None}
        extra = dict(c.extra_body) | {k: settings.pop(k) for k in list(settings) if k not in _CREATE_PARAMS}
        if extra:
            settings["extra_body"] = extra
        if c.response_format == "json_object":
            settings["response_format"] = {"type": "json_object"}
        elif c.response_format == "json_schema":
            json_schema = {"name": schema.__name__, "schema": schema.model_json_schema(), "strict": False}
            settings["response_format"] = {"type": "json_schema", "json_schema": json_schema}
        return settings

    def cache_key(
        self,
        messages: Sequence[Mapping[str, Any]],
        schema: type[pydantic.BaseModel],
        vote_index: int,
        settings: Mapping[str, Any],
    ) -> str:
        """sha256 of (model, messages, schema name and JSON schema, request settings, hint flag, vote index)."""
        payload = {
            "model": self.config.model,
            "messages": list(messages),
            "schema": schema.__name__,
            "json_schema": schema.model_json_schema(),
            "settings": dict(settings),
            "schema_hint": self.config.schema_hint,
            "vote_index": vote_index,
        }
        blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, default=str)
        return hashlib.sha256(blob.encode()).hexdigest()

    async def score(
        self, messages: Sequence[Mapping[str, Any]], schema: type[M], *, vote_index: int = 0, **sampling: Any
    ) -> M | None:
        loop = self._background_loop()
        coro = self._score(messages, schema, vote_index, sampling)
        if _running_loop() is loop:
            return await coro
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    async def _score(
        self, messages: Sequence[Mapping[str, Any]], schema: type[M], vote_index: int, sampling: dict[str, Any]
    ) -> M | None:
        self.stats.add("calls")
        try:
            settings = self.request_settings(schema, **sampling)
            key = self.cache_key(messages, schema, vote_index, settings)
            cached = self._cache_get(key, schema)
            if cached is not None:
                self.stats.add("cache_hits")
                return cached
            request = with_schema_hint(messages, schema) if self.config.schema_hint else [dict(m) for m in messages]
            result = await self._parse_with_repairs(request, schema, lambda msgs: self._complete(msgs, settings))
            if result is not None:
                self._cache_put(key, result, schema)
            return result
        except Exception as err:  # the judge never raises into the training loop
            logger.warning("judge %s: unexpected %s: %s", self.config.model, type(err).__name__, err)
            self.stats.add("failures/internal")
            self.stats.add("unscorable")
            return None

    def _cache_get(self, key: str, schema: type[M]) -> M | None:
        if self.cache is None:
            return None
        try:
            value = self.cache.get(key)
            return None if value is None else schema.model_validate_json(value)
        except (sqlite3.Error, pydantic.ValidationError) as err:
            logger.warning("judge cache read failed (%s); asking the model", type(err).__name__)
            self.stats.add("failures/cache")
            return None

    def _cache_put(self, key: str, result: pydantic.BaseModel, schema: type[pydantic.BaseModel]) -> None:
        if self.cache is None:
            return
        try:
            self.cache.put(key, result.model_dump_json(), self.config.model, schema.__name__)
        except sqlite3.Error as err:
            logger.warning("judge cache write failed (%s)", type(err).__name__)
            self.stats.add("failures/cache")

    def _client_and_semaphore(self) -> tuple[openai.AsyncOpenAI, asyncio.Semaphore]:
        """Build the client on first use (on the background loop); the key is read here and kept only by the client."""
        if self._client is None or self._semaphore is None:
            api_key = os.environ.get(self.config.api_key_env)
            if not api_key and not is_loopback(self.config.base_url):  # a server on this machine needs no key
                logger.warning(
                    "environment variable %s is not set; sending a placeholder API key", self.config.api_key_env
                )
            most = self.config.max_answer_bytes

            async def refuse_large(response: httpx.Response) -> None:  # before the body is read
                length = response.headers.get("content-length")
                if length is not None and length.isdigit() and int(length) > most:
                    await response.aclose()
                    raise AnswerTooLarge(f"the response body is {int(length):,} bytes, over max_answer_bytes {most:,}")

            self._client = openai.AsyncOpenAI(
                api_key=api_key or "EMPTY",
                base_url=self.config.base_url,
                timeout=self.config.timeout,
                max_retries=0,
                http_client=httpx.AsyncClient(timeout=self.config.timeout, event_hooks={"response": [refuse_large]}),
            )
            self._semaphore = asyncio.Semaphore(self.config.max_concurrency)
        return self._client, self._semaphore

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        """Equal-jitter exponential backoff, at least `retry_after`, at most `backoff_max`."""
        delay = min(self.config.backoff_max, self.config.backoff_base * 2**attempt)
        delay = delay / 2 + random.uniform(0, delay / 2)
        if retry_after is not None:
            delay = max(delay, retry_after)
        return min(delay, self.config.backoff_max)

    async def _complete(self, messages: Messages, settings: dict[str, Any]) -> str | None:
        """One answer text from the endpoint with transport retries; None when every attempt failed."""
        c = self.config
        client, semaphore = self._client_and_semaphore()
        for attempt in range(c.max_retries + 1):
            if attempt:
                self.stats.add("retries")
            try:
                async with semaphore:
                    self.stats.add("requests")
                    start = time.monotonic()
                    response = await asyncio.wait_for(
                        client.chat.completions.create(model=c.model, messages=messages, **settings), c.timeout
                    )
                    self.stats.add_latency(time.monotonic() - start)
                if not response.choices:
                    raise ValueError("the response has no choices")
            except Exception as err:
                reason, retryable, retry_after = classify_error(err)
                self.stats.add(f"failures/{reason}")
                if reason == "timeout":
                    self.stats.add("timeouts")
                last = attempt == c.max_retries or not retryable
                logger.warning(
                    "judge %s: attempt %d of %d failed (%s)%s",
                    c.model,
                    attempt + 1,
                    c.max_retries + 1,
                    reason,
                    "; giving up" if last else "; retrying",
                )
                if last:
                    return None
                await asyncio.sleep(self._backoff(attempt, retry_after))
                continue
            text = response.choices[0].message.content
            self._account(response.usage, messages, text or "")
            if len((text or "").encode()) > c.max_answer_bytes:  # a body sent without its length, read whole
                self.stats.add("failures/too_large")
                logger.warning("judge %s: an answer over max_answer_bytes (%d); dropped", c.model, c.max_answer_bytes)
                return None
            return text or ""
        return None

    def _account(self, usage: Any, messages: Messages, text: str) -> None:
        """Tokens and Eq. 11 cost of one response; without `usage`, tokens are characters / 4 and flagged."""
        c = self.config
        if usage is None or usage.prompt_tokens is None:
            n_in = math.ceil(sum(len(str(m.get("content") or "")) for m in messages) / 4)
            n_out, n_cached = math.ceil(len(text) / 4), 0
            self.stats.add("usage_estimated")
        else:
            n_in, n_out = usage.prompt_tokens, usage.completion_tokens or 0
            details = usage.prompt_tokens_details
            n_cached = (details.cached_tokens or 0) if details is not None else 0
        cached_price = c.price_input_per_mtok if c.price_cached_per_mtok is None else c.price_cached_per_mtok
        self.stats.add("tokens_in", n_in)
        self.stats.add("tokens_cached", n_cached)
        self.stats.add("tokens_out", n_out)
        self.stats.add(
            "cost_usd",
            call_cost_usd(n_in, n_cached, n_out, c.price_input_per_mtok, cached_price, c.price_output_per_mtok),
        )

    def _close_on_loop(self) -> Coroutine[Any, Any, None] | None:
        client, self._client, self._semaphore = self._client, None, None
        return None if client is None else client.close()

    def close(self) -> None:
        """Release the HTTP client, the background loop and the cache. Later calls work but are no longer cached."""
        super().close()
        if self.cache is not None:
            self.cache.close()
            self.cache = None


class LocalModelJudge(BaseJudge):
    """Self-judge (DRACO §4.5): the same `score` answered by a transformers `model` with its `tokenizer`, in process.

    Generation runs in a worker thread (so the async API holds) under a lock (one generation at a time), with the model
    in eval mode for the call. No cache: the judged policy changes every step. Sampling follows DRACO D12 (temperature
    0.6, top-p 0.95); pass `temperature=0` for greedy decoding. A generation that reaches `timeout` seconds is counted
    as a timeout and gives None. Tokens come from the generation; USD uses `price_per_mtok` (default 0).
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        temperature: float = 0.6,
        top_p: float = 0.95,
        max_new_tokens: int = 16384,
        timeout: float = 180.0,
        max_repairs: int = 1,
        votes: int = 3,
        vote_rule: str = "all",
        schema_hint: bool = True,
        price_per_mtok: float = 0.0,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(votes=votes, vote_rule=vote_rule, max_repairs=max_repairs)
        self.model = model
        self.tokenizer = tokenizer
        self.sampling: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens}
        self.timeout = timeout
        self.schema_hint = schema_hint
        self.price_per_mtok = price_per_mtok
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self._generate_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"LocalModelJudge(model={type(self.model).__name__}, sampling={self.sampling})"

    async def score(
        self, messages: Sequence[Mapping[str, Any]], schema: type[M], *, vote_index: int = 0, **sampling: Any
    ) -> M | None:
        """`vote_index` only labels the sample: with sampling on, every call draws afresh."""
        self.stats.add("calls")
        try:
            request = with_schema_hint(messages, schema) if self.schema_hint else [dict(m) for m in messages]
            return await self._parse_with_repairs(
                request, schema, lambda msgs: asyncio.to_thread(self._complete, msgs, sampling)
            )
        except Exception as err:  # never raise into the training loop
            logger.warning("self-judge: unexpected %s: %s", type(err).__name__, err)
            self.stats.add("failures/internal")
            self.stats.add("unscorable")
            return None

    def _complete(self, messages: Messages, sampling: dict[str, Any]) -> str | None:
        self.stats.add("requests")
        with self._generate_lock:  # one generation at a time; waiting for the lock is not generation time
            start = time.monotonic()
            try:
                text, n_in, n_out = self.generate(messages, **sampling)
            except Exception as err:
                logger.warning("self-judge generation failed: %s: %s", type(err).__name__, err)
                self.stats.add("failures/generation")
                return None
            elapsed = time.monotonic() - start
        self.stats.add("gpu_s", elapsed)
        self.stats.add_latency(elapsed)
        self.stats.add("tokens_in", n_in)
        self.stats.add("tokens_out", n_out)
        self.stats.add("cost_usd", (n_in + n_out) * self.price_per_mtok / 1e6)
        if elapsed >= self.timeout:
            logger.warning("self-judge generation hit the %.1f s timeout", self.timeout)
            self.stats.add("failures/timeout")
            self.stats.add("timeouts")
            return None
        return text

    def generate(self, messages: Messages, **sampling: Any) -> tuple[str, int, int]:
        """Render `messages` with the chat template and generate; returns (text, prompt tokens, new tokens).

        Not locked: `score` serialises its calls; a direct caller must not run it concurrently with `score`.
        """
        import torch  # imported here so that API-only users of this module do not pay for torch

        settings = {**self.sampling, **sampling}
        if settings.get("temperature", 1.0) <= 0:  # greedy
            settings.pop("temperature", None)
            settings.pop("top_p", None)
            settings["do_sample"] = False
        else:
            settings.setdefault("do_sample", True)
        pad_id = (
            self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        )
        with torch.inference_mode():
            inputs = self.tokenizer.apply_chat_template(
                messages,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=True,
                return_tensors="pt",
                **self.chat_template_kwargs,
            )
            inputs = {k: v.to(self.model.device) for k, v in inputs.items()}
            was_training = self.model.training
            self.model.eval()
            try:
                out = self.model.generate(**inputs, max_time=self.timeout, pad_token_id=pad_id, **settings)
            finally:
                self.model.train(was_training)
        n_in = inputs["input_ids"].shape[1]
        new_ids = out[0, n_in:]  # (T_new,)
        text = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        return text, int(n_in), int(new_ids.numel())


__all__ = [
    "API_MODEL_FIELDS",
    "FAIL",
    "NOT_APPLICABLE",
    "PASS",
    "APIModelFields",
    "BaseJudge",
    "Judge",
    "JudgeCache",
    "JudgeConfig",
    "JudgeStats",
    "LocalModelJudge",
    "call_cost_usd",
    "classify_error",
    "combine_votes",
    "parse_output",
    "parse_retry_after",
    "strip_reasoning",
    "with_schema_hint",
]
