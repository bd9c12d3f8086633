"""TASPO's analyzer (taspo.md §4.3-4.4, Eq. 3-6, D7, D8, D10, D11): the extraction and match prompts, the validation of
an extraction (`clean_items`), leave-one-out, the privileged block (`compose`), the analyzer stage (`analyze`) over a
scripted analyzer, the API analyzer against the loopback OpenAI-compatible server (`tests/judge_server.py`) with
malformed answers, hangs and a step deadline, and the offline `OracleAnalyzer` on the built-in shop and search tasks.
The turn weights and the trainer are in tests/test_taspo.py, which reuses `Scripted` from here."""

from __future__ import annotations

import asyncio
import json
import random
import re
import time

import pydantic
import pytest
from conftest import CPU_ARGS
from datasets import Dataset

from envs.base import noisy_expert_episode
from envs.search import SearchEnv
from envs.shop import ShopEnv
from rewards.analyzer import (
    Applicable,
    Evidence,
    ExtractedItems,
    Item,
    OracleAnalyzer,
    clean_items,
    compose,
    extraction_messages,
    leave_one_out,
    match_messages,
    path_steps,
)
from rewards.judge import Judge
from rewards.rubrics import clip_middle, render_task
from tests.helpers.analyzer import (
    KEY_ENV,
    SENTINEL,
    Scripted,
    all_listed,
    listed_items,
    shown_rollouts,
)
from tests.judge_server import JudgeServer, hang, ok
from trainers.taspo import RowRecord, TASPOConfig, analyze, build_analyzer

# ---------------------------------------------------------------------------------------------------------------------
# A scripted analyzer and hand-built records


def record(group: int, success: bool, adv: float, actions: list[str], final: str = "", extra=None) -> RowRecord:
    """A row: one turn per action, observation "saw <action>" except the final one (`final`); `extra` keys are added
    to every turn (as the agent loop's `reward` and `invalid` are)."""
    transcript = [{"action": a, "observation": f"saw {a}", **(extra or {})} for a in actions]
    transcript[-1]["observation"] = final
    return RowRecord(group=group, task="[USER]\nsay apple", transcript=transcript, success=success, adv=adv)


# ---------------------------------------------------------------------------------------------------------------------
# Prompts (§4.3, §4.4, D8)


def test_extraction_prompt_shows_the_successes_numbered_and_clipped():
    """taspo.md §4.3: the task and each successful rollout with its id, turns numbered from 1, the visible action
    (reasoning removed) and the observation clipped to 1,000 characters (750 head + " … " + 250 tail); the rules
    (at most 12 items, every item cites a location) and the `{"items": [...]}` answer format."""
    long = "a" * 800 + "b" * 400 + "c" * 300  # 1,500 characters
    transcript = [
        {"action": "<think>my secret plan</think>search[socks]", "observation": long, "reward": 987.125},
        {"action": "buy", "observation": "bought"},
    ]
    (system, user) = extraction_messages("[USER]\nbuy socks", [(3, transcript), (5, transcript[:1])])
    assert system["role"] == "system" and user["role"] == "user"
    text = user["content"]
    assert text.startswith("<task>\n[USER]\nbuy socks\n</task>")
    assert shown_rollouts(text) == [3, 5]
    assert "[ASSISTANT] step 1\nsearch[socks]\n" in text and "[ASSISTANT] step 2\nbuy\n" in text
    assert "my secret plan" not in text and "987.125" not in text
    clipped = "a" * 750 + " … " + "c" * 250  # the first 750 and the last 250 characters
    assert clipped in text and "a" * 751 not in text and "c" * 251 not in text and "bbb" not in text
    assert "at most 12 items" in text and '{"items": [' in text


def test_match_prompt_is_outcome_blind_and_lists_no_evidence():
    """taspo.md §4.4, D8, §7 item 14: the path holds the actions and observations, without the environment message
    after the final action; a sentinel in the reward, the success flag, the info and the final message never reaches
    the prompt, and neither does the items' evidence. The prompt tells the analyzer not to judge success."""
    transcript = [
        {"action": "search[socks]", "observation": "results: socks", "reward": SENTINEL, "success": SENTINEL},
        {"action": "buy", "observation": f"{SENTINEL}: task complete, reward 1", "info": {"success": SENTINEL}},
    ]
    assert path_steps(transcript) == [
        {"action": "search[socks]", "observation": "results: socks"},
        {"action": "buy", "observation": ""},
    ]
    assert path_steps([]) == []
    evidence = [Evidence(rollout=0, turn=1, action="EVIDENCE-ACTION", observation="EVIDENCE-OBS")]
    items = [Item(id="e1", rule="buy socks", condition="socks are listed", evidence=evidence)]
    (_, user) = match_messages("[USER]\nbuy socks", items, transcript)
    text = user["content"]
    assert "results: socks" in text and "[ASSISTANT] step 2\nbuy" in text  # the path is there...
    assert SENTINEL not in text and "task complete" not in text  # ...without the outcome
    assert "EVIDENCE" not in text
    assert listed_items(text) == [{"id": "e1", "rule": "buy socks", "condition": "socks are listed"}]
    assert "Do not judge whether the" in text and '{"applicable": [' in text


# ---------------------------------------------------------------------------------------------------------------------
# Validation, leave-one-out, compose (§4.3, Eq. 4, Eq. 6)


def item(id: str, *evidence: tuple[int, int], rule: str = "r") -> Item:
    return Item(id=id, rule=rule, condition="c", evidence=[Evidence(rollout=r, turn=j) for r, j in evidence])


def test_clean_items_drops_renumbers_and_truncates():
    """taspo.md §4.3 validation, §7 item 17: evidence on a rollout not shown or a turn out of range (0, or past the
    rollout's last turn) is discarded; an item left without evidence (or given none) is dropped; duplicate ids are
    renumbered; the order is kept; of more than 12 surviving items the first 12 are kept."""
    turns = {0: 2, 4: 3}  # shown rollouts 0 (2 turns) and 4 (3 turns)
    raw = [
        item("a", (0, 1), (7, 1), (0, 3), (0, 0), (4, 3)),  # keeps (0, 1) and (4, 3)
        item("b", (1, 1), (4, 4)),  # nothing valid: dropped
        Item(id="c", rule="r", condition="c"),  # no evidence at all: dropped
        item("a", (4, 1), rule="second a"),  # duplicate id
        item("a", (4, 2), rule="third a"),
        item("a-2", (0, 2)),  # collides with the renumbered second "a"
    ]
    kept = clean_items(raw, turns)
    assert [(e.id, e.rule) for e in kept] == [("a", "r"), ("a-2", "second a"), ("a-3", "third a"), ("a-2-2", "r")]
    assert [(z.rollout, z.turn) for z in kept[0].evidence] == [(0, 1), (4, 3)]
    assert len({e.id for e in kept}) == len(kept)
    assert raw[0].id == "a" and len(raw[0].evidence) == 5  # the input is not changed
    many = [item(f"x{k}", (0, 1)) for k in range(15)]
    many.insert(3, item("bad", (9, 1)))  # invalid items do not count towards the 12
    assert [e.id for e in clean_items(many, turns)] == [f"x{k}" for k in range(12)]
    assert clean_items([], turns) == [] and clean_items(many, {}) == []


def test_schemas_defaults():
    """taspo.md §4.3 fields: `action` and `observation` of an evidence entry may be missing (they default to ""), an
    item without `evidence` validates (and is then dropped by `clean_items`); `rollout`, `turn`, `id`, `rule` and
    `condition` are required, so an answer lacking one fails validation and is re-asked (D11)."""
    e = Evidence.model_validate({"rollout": 1, "turn": 2})
    assert (e.action, e.observation) == ("", "")
    assert Item.model_validate({"id": "x", "rule": "r", "condition": "c"}).evidence == []
    for bad in ({"id": "x", "condition": "c"}, {"id": "x", "rule": "r", "condition": "c", "evidence": [{"turn": 1}]}):
        with pytest.raises(pydantic.ValidationError):
            ExtractedItems.model_validate({"items": [bad]})
    assert Applicable.model_validate({"applicable": []}).applicable == []


def test_leave_one_out():
    """taspo.md Eq. 4, §7 item 13: an item is in E_{x,−i} iff it cites a rollout other than i; an item whose only
    evidence is from τ_i is never there; an unsuccessful τ_i (cited nowhere) receives every item."""
    own1 = item("own1", (1, 1), (1, 2))  # only rollout 1, twice
    own3 = item("own3", (3, 2))
    both = item("both", (1, 1), (3, 1))
    items = [own1, own3, both]
    assert [e.id for e in leave_one_out(items, 1)] == ["own3", "both"]
    assert [e.id for e in leave_one_out(items, 3)] == ["own1", "both"]
    assert [e.id for e in leave_one_out(items, 0)] == ["own1", "own3", "both"]  # a failure: everything
    assert leave_one_out([own1], 1) == [] and leave_one_out([], 0) == []


def test_compose_header_numbered_lines_and_budget():
    """taspo.md Eq. 6, §4.5: a header line (privileged guidance, training only), then "<k>. When <condition>:
    <rule>" per item in the analyzer's order; the evidence is never shown; trailing items are dropped while the text
    exceeds the token budget; no item -> ""."""
    items = [
        Item(id="a", rule="search first", condition="the task starts",
             evidence=[Evidence(rollout=0, turn=1, action="SECRET-ACTION", observation="SECRET-OBS")]),
        Item(id="b", rule="click the cheapest", condition="results are shown"),
        Item(id="c", rule="buy", condition="an item is open"),
    ]  # fmt: skip
    words = lambda text: len(text.split())  # noqa: E731 - a token counter: whitespace words
    text = compose(items, words, 1000)
    header, *lines = text.split("\n")
    assert "privileged guidance" in header.lower() and "training only" in header
    assert lines == [
        "1. When the task starts: search first",  # 7 words
        "2. When results are shown: click the cheapest",  # 8 words
        "3. When an item is open: buy",  # 7 words
    ]
    assert "SECRET" not in text
    n_header = words(header)
    full = n_header + 7 + 8 + 7
    assert words(text) == full
    assert compose(items, words, full) == text  # exactly at the budget: kept
    assert compose(items, words, full - 1).split("\n")[1:] == lines[:2]  # one word over: the last item goes
    assert compose(items, words, n_header + 7 + 8 - 1).split("\n")[1:] == lines[:1]
    assert compose(items, words, n_header + 7 - 1) == ""  # not even one item fits
    assert compose([], words, 1000) == ""


# ---------------------------------------------------------------------------------------------------------------------
# The analyzer stage over a scripted analyzer (§4.1, Eq. 3-5, D7, D10, D11)


def batch_of_groups() -> list[RowRecord]:
    """Group 0: successes 0, 1 and failures 2, 3. Group 1: success 4, failure 5. Group 2: failures with A = 0.
    Group 3: successes with A = 0 (zero variance). Group 4: failures with A ≠ 0 (partial rewards, no success)."""
    spec = [
        (0, True, 1.0), (0, True, 1.0), (0, False, -1.0), (0, False, -1.0),
        (1, True, 0.7), (1, False, -0.7),
        (2, False, 0.0), (2, False, 0.0),
        (3, True, 0.0), (3, True, 0.0),
        (4, False, 0.5), (4, False, -0.5),
    ]  # fmt: skip
    return [record(g, s, a, [f"r{i}a;", f"r{i}b;"], final=f"end {i}") for i, (g, s, a) in enumerate(spec)]


def test_analyze_leave_one_out_calls_and_reasons():
    """taspo.md §4.1 steps 2-3, Eq. 3-5, D7, D10, §7 items 13 and 15: one extraction per group with a success and a
    row with A ≠ 0, showing only that group's successes; one match per row with A ≠ 0 and a non-empty leave-one-out
    set, listing exactly E_{x,−i}; no call for zero-variance groups or groups without a success."""
    analyzer = Scripted()
    records = batch_of_groups()
    stage = analyze(analyzer, records)
    # extraction: group 0 shows rollouts 0, 1 -> items own0, own1, shared; group 1 shows 4 -> own4, shared
    # leave-one-out: row 0 -> own1, shared; row 1 -> own0, shared; rows 2, 3 -> all three; row 4 -> nothing (its
    # items cite only itself: no call); row 5 -> own4, shared. Groups 2, 3, 4: no call at all.
    assert sorted(analyzer.schemas()) == ["Applicable"] * 5 + ["ExtractedItems"] * 2
    extractions = sorted(shown_rollouts(c.text) for c in analyzer.calls if c.schema == "ExtractedItems")
    assert extractions == [[0, 1], [4]]
    for c in analyzer.calls:
        if c.schema == "ExtractedItems":  # failures never shown for extraction
            assert not any(f"r{i}a;" in c.text for i in (2, 3, 5, 6, 7, 10, 11))
    want = {0: ["own1", "shared"], 1: ["own0", "shared"], 2: ["own0", "own1", "shared"],
            3: ["own0", "own1", "shared"], 5: ["own4", "shared"]}  # fmt: skip
    for i, ids in want.items():
        assert [e["id"] for e in listed_items(analyzer.match_prompt(f"r{i}a;"))] == ids
        assert [e.id for e in stage.items[i]] == ids  # Eq. 5: every candidate matched
    for i in (4, 6, 7, 8, 9, 10, 11):
        assert not any(f"r{i}a;" in c.text for c in analyzer.calls if c.schema == "Applicable")
        assert stage.items[i] == []
    assert stage.reasons == [None] * 4 + ["no_pi", None] + ["zero_adv"] * 4 + ["no_pi"] * 2
    assert stage.extracted == [3, 2] and stage.loo == [2, 2, 3, 3, 2]
    assert stage.groups_with_success == pytest.approx(3 / 5)


def test_analyze_matching_keeps_only_chosen_known_ids():
    """taspo.md Eq. 5, §4.4: E_i is the candidates whose id the analyzer returned, in the candidates' order; unknown
    ids are ignored; an empty answer leaves the row without PI (`no_pi`)."""
    answers = {"r2a;": ["shared", "ghost", "own0"], "r3a;": [], "r0a;": ["own0"], "r1a;": ["shared"]}

    def match(text):
        (marker,) = [m for m in answers if m in text]
        return {"applicable": answers[marker]}

    stage = analyze(Scripted(match=match), batch_of_groups()[:4])
    assert [e.id for e in stage.items[2]] == ["own0", "shared"]  # candidates' order; "ghost" ignored
    assert stage.items[0] == [] and stage.reasons[0] == "no_pi"  # own0 is row 0's own item: not a candidate
    assert stage.items[3] == [] and stage.reasons[3] == "no_pi"
    assert [e.id for e in stage.items[1]] == ["shared"] and stage.reasons[1] is None


def test_analyze_is_outcome_blind():
    """taspo.md §7 item 14, D8: a sentinel in the reward, the success flag and the final environment message of
    every rollout's transcript (a successful target included) never appears in a match prompt. The successes'
    final messages do reach the extraction prompt (§4.3 shows them), so the sentinel was within reach."""
    leak = {"reward": SENTINEL, "success": SENTINEL, "info": {"success": SENTINEL}}
    records = [
        record(0, True, 1.0, ["r0a;", "r0b;"], final=f"{SENTINEL} done, you win", extra=leak),
        record(0, True, 1.0, ["r1a;", "r1b;"], final=f"{SENTINEL} done, you win", extra=leak),
        record(0, False, -1.0, ["r2a;", "r2b;"], final=f"{SENTINEL} failed", extra=leak),
    ]
    analyzer = Scripted()
    analyze(analyzer, records)
    matches = [c.text for c in analyzer.calls if c.schema == "Applicable"]
    assert len(matches) == 3  # the two successes (each other's items) and the failure
    assert all(SENTINEL not in text and "you win" not in text for text in matches)
    assert all("saw r" in text for text in matches)  # the earlier observations are shown
    (extraction,) = [c.text for c in analyzer.calls if c.schema == "ExtractedItems"]
    assert f"{SENTINEL} done, you win" in extraction


def test_analyze_never_raises_and_falls_back():
    """taspo.md D11, §7 item 17: an analyzer that raises or answers None gives `analyzer_failure` to the affected
    rows (the whole group for an extraction, the target for a match); no exception escapes."""

    def boom(text):
        raise RuntimeError("analyzer crashed")

    stage = analyze(Scripted(extract=boom), batch_of_groups()[:6])
    assert stage.reasons == ["analyzer_failure"] * 6  # both groups' extractions failed: all their rows (A ≠ 0)
    assert stage.items == [[]] * 6 and stage.extracted == [] and stage.loo == []

    def picky(text):  # fails the match of row 2 only
        return None if "r2a;" in text else all_listed(text)

    stage = analyze(Scripted(match=picky), batch_of_groups()[:4])
    assert stage.reasons == [None, None, "analyzer_failure", None]
    assert stage.items[2] == [] and [e.id for e in stage.items[3]] == ["own0", "own1", "shared"]


def test_analyze_honours_the_step_deadline():
    """taspo.md §5 (step deadline), §7 item 18: extraction answers at once, matching hangs; with a 0.5 s deadline
    for the whole stage, `analyze` returns within about that time and the targets fall back (`analyzer_failure`)."""

    async def slow(text):
        await asyncio.sleep(5)
        return all_listed(text)

    analyzer = Scripted(match=slow)
    start = time.monotonic()
    stage = analyze(analyzer, batch_of_groups()[:4], deadline_s=0.5)
    assert time.monotonic() - start < 2.0
    assert stage.extracted == [3]  # the extraction made it in time
    assert stage.reasons == ["analyzer_failure"] * 4
    m = analyzer.metrics(prefix="taspo/analyzer_")
    assert m["taspo/analyzer_failures/deadline"] == 4 and m["taspo/analyzer_unscorable"] == 4


# ---------------------------------------------------------------------------------------------------------------------
# The API analyzer against the loopback server (§7 items 17-18, D11)


def analyzer_config(tmp_path, server: JudgeServer, **kw) -> TASPOConfig:
    settings = dict(
        output_dir=str(tmp_path), **CPU_ARGS, analyzer_backend="openai", analyzer_model="analyzer-test",
        analyzer_base_url=server.base_url, analyzer_api_key_env=KEY_ENV, analyzer_timeout=0.3,
    )  # fmt: skip
    return TASPOConfig(**(settings | kw))


def api_analyzer(tmp_path, server: JudgeServer, **kw) -> Judge:
    judge = build_analyzer(analyzer_config(tmp_path, server, **kw), [])
    assert isinstance(judge, Judge)
    judge.config.backoff_base = 0.01  # keep the retries fast
    return judge


def schema_of(body) -> str:
    return "Applicable" if '"title":"Applicable"' in body["messages"][0]["content"] else "ExtractedItems"


def user_text(body) -> str:
    return body["messages"][1]["content"]


@pytest.fixture
def server(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "sk-test")
    with JudgeServer(default=lambda body: ok("{}")) as srv:
        yield srv


def test_api_analyzer_settings_follow_the_config(tmp_path, server):
    """taspo.md §5, D11: temperature 0, 3 attempts (2 transport retries, 2 repairs), 32 in flight, the configured
    timeout, endpoint and model; the API key is read from the named variable."""
    judge = build_analyzer(analyzer_config(tmp_path, server), [])
    c = judge.config
    assert (c.model, c.base_url, c.api_key_env) == ("analyzer-test", server.base_url, KEY_ENV)
    assert (c.temperature, c.max_retries, c.max_repairs, c.max_concurrency, c.timeout) == (0.0, 2, 2, 32, 0.3)
    assert judge.max_repairs == 2


def test_api_analyzer_parses_fenced_bare_and_prose_answers_and_cleans(tmp_path, server):
    """taspo.md §7 item 17, §4.3-4.4: a fenced extraction with prose around it, a bare array of items and of ids,
    and an answer with trailing prose all parse; the extraction is cleaned as specified (unknown rollout, turn out of
    range, no evidence, duplicate id, evidence without action/observation); unknown match ids are ignored."""
    group0 = {"items": [
        {"id": "e1", "rule": "R1", "condition": "C1", "evidence": [
            {"rollout": 0, "turn": 1, "action": "r0a;", "observation": "o"},
            {"rollout": 7, "turn": 1}, {"rollout": 0, "turn": 3}, {"rollout": 0, "turn": 0}]},
        {"id": "e1", "rule": "R2", "condition": "C2", "evidence": [{"rollout": 0, "turn": 2}]},
        {"id": "e3", "rule": "R3", "condition": "C3", "evidence": [{"rollout": 1, "turn": 1}]},
        {"id": "e4", "rule": "R4", "condition": "C4"},
        {"id": "e5", "rule": "R5", "condition": "C5", "evidence": [{"rollout": 0, "turn": 2}]},
    ]}  # fmt: skip
    group1 = [{"id": "b1", "rule": "RB", "condition": "CB", "evidence": [{"rollout": 3, "turn": 1}]}]
    replies = {
        ("ExtractedItems", "r0a;"): f"Here you go:\n```json\n{json.dumps(group0)}\n```\nThese are all.",
        ("ExtractedItems", "r3a;"): json.dumps(group1),  # a bare array for the one-field envelope
        ("Applicable", "r1a;"): '["e1-2", "e5", "nope"]',  # a bare array of ids
        ("Applicable", "r2a;"): 'Sure. {"applicable": ["e1"]} Let me know if you need more.',
        ("Applicable", "r4a;"): '{"applicable": ["b1"]}',
    }

    def reply(body):
        (text,) = [t for (s, marker), t in replies.items() if s == schema_of(body) and marker in user_text(body)]
        return ok(text)

    server.default = reply
    records = [
        record(0, True, 1.0, ["r0a;", "r0b;"]), record(0, False, -1.0, ["r1a;", "r1b;"]),
        record(0, False, -1.0, ["r2a;"]), record(1, True, 1.0, ["r3a;"]), record(1, False, -1.0, ["r4a;"]),
    ]  # fmt: skip
    with api_analyzer(tmp_path, server) as judge:
        stage = analyze(judge, records)
        m = judge.metrics(prefix="taspo/analyzer_")
    # group 0 keeps e1 (evidence (0, 1) only), e1 -> e1-2, e5; e3 (rollout 1 not shown) and e4 (no evidence) go
    assert stage.extracted == [3, 1]
    assert [e.id for e in stage.items[1]] == ["e1-2", "e5"]
    (e1,) = stage.items[2]
    assert e1.id == "e1" and e1.evidence == [Evidence(rollout=0, turn=1, action="r0a;", observation="o")]
    assert [e.id for e in stage.items[4]] == ["b1"]
    assert stage.reasons == ["no_pi", None, None, "no_pi", None]  # the successes have no second success
    assert len(server.requests) == 5 and m["taspo/analyzer_parse_failures"] == 0 and m["taspo/analyzer_calls"] == 5


def test_api_analyzer_reasks_with_the_validation_error(tmp_path, server):
    """taspo.md D11: an extraction whose item lacks its `rule` fails validation; the retry carries the answer and the
    validation error, and the repaired answer is used."""
    bad = {"items": [{"id": "e1", "condition": "C1", "evidence": [{"rollout": 0, "turn": 1}]}]}
    good = {"items": [{"id": "e1", "rule": "R1", "condition": "C1", "evidence": [{"rollout": 0, "turn": 1}]}]}
    server.script(ok(json.dumps(bad)), ok(json.dumps(good)))
    server.default = lambda body: ok('{"applicable": ["e1"]}')
    with api_analyzer(tmp_path, server) as judge:
        stage = analyze(judge, [record(0, True, 1.0, ["r0a;"]), record(0, False, -1.0, ["r1a;"])])
        m = judge.metrics(prefix="taspo/analyzer_")
    first, second, third = server.requests
    repair = second.body["messages"]
    assert repair[:-2] == first.body["messages"]
    assert repair[-2] == {"role": "assistant", "content": json.dumps(bad)}
    assert "could not be used" in repair[-1]["content"] and "rule" in repair[-1]["content"]
    assert schema_of(third.body) == "Applicable"
    assert [e.id for e in stage.items[1]] == ["e1"] and stage.reasons == ["no_pi", None]
    assert m["taspo/analyzer_parse_failures"] == 1 and m["taspo/analyzer_repairs"] == 1


def test_api_analyzer_unrecoverable_answers_fall_back(tmp_path, server):
    """taspo.md D11, §7 item 17: answers that never parse are re-asked up to 3 attempts, then the extraction's group
    (every row with A ≠ 0) or the match's target falls back (`analyzer_failure`); nothing raises."""
    server.default = lambda body: ok("I am not able to produce JSON today.")
    records = [record(0, True, 1.0, ["r0a;"]), record(0, False, -1.0, ["r1a;"]), record(0, False, 0.0, ["r2a;"])]
    with api_analyzer(tmp_path, server) as judge:
        stage = analyze(judge, records)
        m = judge.metrics(prefix="taspo/analyzer_")
    assert stage.reasons == ["analyzer_failure", "analyzer_failure", "zero_adv"]
    assert len(server.requests) == 3  # 1 + 2 repairs, then no match call
    assert m["taspo/analyzer_parse_failures"] == 3 and m["taspo/analyzer_unscorable"] == 1

    good = {"items": [{"id": "e1", "rule": "R", "condition": "C", "evidence": [{"rollout": 0, "turn": 1}]}]}

    def reply(body):  # extraction fine, row 2's match never parses
        if schema_of(body) == "ExtractedItems":
            return ok(json.dumps(good))
        return ok("no idea") if "r2a;" in user_text(body) else ok('{"applicable": ["e1"]}')

    server.reset()
    server.default = reply
    records = [record(0, True, 1.0, ["r0a;"]), record(0, False, -1.0, ["r1a;"]), record(0, False, -1.0, ["r2a;"])]
    with api_analyzer(tmp_path, server) as judge:
        stage = analyze(judge, records)
    assert stage.reasons == ["no_pi", None, "analyzer_failure"]
    assert len(server.requests) == 1 + 1 + 3


def test_api_analyzer_timeouts_are_retried_then_fall_back(tmp_path, server):
    """taspo.md §7 item 18, D11: a hang past the 0.3 s timeout is retried (and the retry's answer used); an
    endpoint that always hangs gives up after 3 attempts, the group falls back, and `taspo/analyzer_timeouts`
    counts every timed-out attempt."""
    good = {"items": [{"id": "e1", "rule": "R", "condition": "C", "evidence": [{"rollout": 0, "turn": 1}]}]}
    server.default = lambda body: ok(json.dumps(good) if schema_of(body) == "ExtractedItems" else '["e1"]')
    server.script(hang(3.0))
    records = [record(0, True, 1.0, ["r0a;"]), record(0, False, -1.0, ["r1a;"])]
    with api_analyzer(tmp_path, server) as judge:
        stage = analyze(judge, records)
        m = judge.metrics(prefix="taspo/analyzer_", reset=True)
        assert stage.reasons == ["no_pi", None] and [e.id for e in stage.items[1]] == ["e1"]
        assert m["taspo/analyzer_timeouts"] == 1 and m["taspo/analyzer_retries"] == 1

        server.default = lambda body: hang(3.0)
        start = time.monotonic()
        stage = analyze(judge, records)
        elapsed = time.monotonic() - start
        m = judge.metrics(prefix="taspo/analyzer_")
    assert stage.reasons == ["analyzer_failure", "analyzer_failure"]
    assert m["taspo/analyzer_timeouts"] == 3 and m["taspo/analyzer_retries"] == 2
    assert elapsed < 2.5  # three 0.3 s attempts, not three 3 s hangs


def test_api_analyzer_step_deadline(tmp_path, server):
    """taspo.md §5 step deadline, §7 item 18: an endpoint slower than the deadline is cut at the deadline; the stage
    returns promptly with `analyzer_failure` for the group."""
    server.default = lambda body: ok('{"items": []}', delay=5.0)
    records = [record(0, True, 1.0, ["r0a;"]), record(0, False, -1.0, ["r1a;"])]
    with api_analyzer(tmp_path, server, analyzer_timeout=10.0) as judge:
        start = time.monotonic()
        stage = analyze(judge, records, deadline_s=0.3)
        elapsed = time.monotonic() - start
        m = judge.metrics(prefix="taspo/analyzer_")
    assert elapsed < 2.0
    assert stage.reasons == ["analyzer_failure", "analyzer_failure"]
    assert m["taspo/analyzer_failures/deadline"] == 1


# ---------------------------------------------------------------------------------------------------------------------
# The offline oracle (D15) and build_analyzer


def expert_steps(env_cls, task: dict, transcript: list[dict]) -> set[int]:
    """The 1-based turns where the transcript's action is the environment expert's action at that point."""
    env = env_cls()
    env.reset(task)
    hits = set()
    for j, turn in enumerate(transcript, 1):
        if " ".join(turn["action"].split()) == " ".join(env.expert_action().split()):
            hits.add(j)
        env.step(turn["action"])
    return hits


@pytest.mark.parametrize("env_cls", [ShopEnv, SearchEnv])
def test_oracle_extracts_expert_steps_and_matches_by_observation(env_cls):
    """taspo.md D15, Eq. 3-5: from the transcripts shown, the oracle's items cite exactly the turns where the
    rollout took the expert's action, in shown rollouts only; an item whose condition is the observation after the
    expert's first step matches a path that shows that observation and not a path that never does; the item of the
    first step (its condition is the task itself) matches both."""
    tasks = env_cls.make_tasks("train", 3, seed=4)
    task = tasks[0]
    analyzer = OracleAnalyzer(tasks)
    prompt = render_task(env_cls().reset(task))
    expert = noisy_expert_episode(env_cls(), task, 0.0, random.Random(0))[1]
    noisy = noisy_expert_episode(env_cls(), task, 0.5, random.Random(3))[1]
    shown = {2: expert, 5: noisy}
    answer = analyzer.score_sync(extraction_messages(prompt, list(shown.items())), ExtractedItems)
    assert answer is not None and answer.items
    cited = {(z.rollout, z.turn) for e in answer.items for z in e.evidence}
    want = {(r, j) for r, tr in shown.items() for j in expert_steps(env_cls, task, tr)}
    assert len(answer.items) <= 12 and cited == want
    assert clean_items(answer.items, {r: len(tr) for r, tr in shown.items()}) == answer.items  # all valid
    first = [e for e in answer.items if (2, 1) in {(z.rollout, z.turn) for z in e.evidence}]
    second = [e for e in answer.items if (2, 2) in {(z.rollout, z.turn) for z in e.evidence}]
    assert len(first) == len(second) == 1
    assert expert[0]["action"] in first[0].rule and expert[1]["action"] in second[0].rule
    assert " ".join(expert[0]["observation"].split())[:50] in second[0].condition  # "... has just shown «obs»"

    def matched(path):
        result = analyzer.score_sync(match_messages(prompt, answer.items, path), Applicable)
        assert result is not None
        return set(result.applicable)

    again = noisy_expert_episode(env_cls(), task, 0.0, random.Random(9))[1]  # another expert attempt
    assert {first[0].id, second[0].id} <= matched(again)
    never = [{"action": "dance", "observation": "error: unknown action"}, {"action": "sing", "observation": "?"}]
    assert first[0].id in matched(never) and second[0].id not in matched(never)


def test_oracle_unknown_task_is_unscorable_never_raises():
    """taspo.md D15: a prompt for a task the oracle does not know, or an unexpected schema, gives None (unscorable)
    instead of raising; unparsable items give an empty match."""
    tasks = ShopEnv.make_tasks("train", 1, seed=4)
    analyzer = OracleAnalyzer(tasks)
    transcript = [{"action": "buy", "observation": "bought"}]
    unknown = extraction_messages("[USER]\nInstruction: a task nobody posed", [(0, transcript)])
    assert analyzer.score_sync(unknown, ExtractedItems) is None
    assert analyzer.score_sync(match_messages("[USER]\nQuestion: who?", [], transcript), Applicable) is None
    assert analyzer.score_sync([{"role": "user", "content": "no sections at all"}], ExtractedItems) is None
    known = render_task(ShopEnv().reset(tasks[0]))

    class Other(pydantic.BaseModel):
        x: int

    assert analyzer.score_sync(extraction_messages(known, [(0, transcript)]), Other) is None
    garbled = [
        {"role": "user", "content": f"<task>\n{known}\n</task>\n\n<items>\nnot json\n</items>\n\n<path>\n\n</path>"}
    ]
    assert analyzer.score_sync(garbled, Applicable) == Applicable(applicable=[])
    assert analyzer.metrics()["judge/unscorable"] == 4


def test_oracle_through_the_stage():
    """taspo.md §4.1 with the oracle on shop: a failing rollout receives the items (from the expert's success) whose
    observation its own path shows, and only those."""
    tasks = ShopEnv.make_tasks("train", 2, seed=4)
    task = tasks[0]
    prompt = render_task(ShopEnv().reset(task))
    expert = noisy_expert_episode(ShopEnv(), task, 0.0, random.Random(0))[1]
    noisy = noisy_expert_episode(ShopEnv(), task, 0.6, random.Random(3))[1]
    records = [
        RowRecord(group=0, task=prompt, transcript=expert, success=True, adv=1.0),
        RowRecord(group=0, task=prompt, transcript=noisy, success=False, adv=-1.0),
    ]
    stage = analyze(OracleAnalyzer(tasks), records)
    assert stage.extracted and stage.extracted[0] >= 1
    seen = [s["observation"] for s in path_steps(noisy)] + [prompt.split("[USER]\n", 1)[1]]  # and the task
    shown_obs = {clip_middle(" ".join(text.split()), 200) for text in seen}
    for e in stage.items[1]:
        condition = re.fullmatch(r"the environment has just shown «(.*)»", e.condition, flags=re.DOTALL).group(1)
        assert condition in shown_obs
    assert stage.items[1]  # at least the first step's item (its condition is the task)


def test_build_analyzer_oracle_needs_tasks(tmp_path):
    """taspo.md D15: the default `oracle` backend learns the tasks of the datasets' `task` column; without one it
    refuses to start."""
    args = TASPOConfig(output_dir=str(tmp_path), **CPU_ARGS)
    assert args.analyzer_backend == "oracle"
    tasks = ShopEnv.make_tasks("train", 2, seed=4)
    data = Dataset.from_list([{"prompt": "x", "task": json.dumps(t)} for t in tasks])
    oracle = build_analyzer(args, [data, None])
    assert isinstance(oracle, OracleAnalyzer)
    prompt = extraction_messages(render_task(ShopEnv().reset(tasks[1])), [(0, [{"action": "buy", "observation": ""}])])
    assert oracle.score_sync(prompt, ExtractedItems) is not None  # the task is known
    with pytest.raises(ValueError, match="task"):
        build_analyzer(args, [Dataset.from_list([{"prompt": "hi"}]), None])
