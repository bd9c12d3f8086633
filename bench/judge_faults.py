"""How the API judge (`rewards.judge.Judge`) holds up when its server misbehaves: injected faults, checked answers.

    python bench/judge_faults.py                                   # 720 calls, 30% faults, seed 0 (about 20 s)
    python bench/judge_faults.py --calls 100 --fault_rate 0.5 --out /tmp/judge_faults   # a quick look

The loopback server of `tests/judge_server.py` answers every request through a seeded responder
(`random.Random(seed)`): with probability `fault_rate` it injects one fault drawn uniformly from

* `http_500`: an HTTP 500 in OpenAI's error format;
* `http_429`: an HTTP 429 with `retry-after: 0.05`;
* `hang`: no answer for 3 x the judge's timeout, then the connection closes;
* `malformed`: a 200 whose message is not JSON (`Sure! {'value': 2n+1}`, single quotes);
* `truncated`: a 200 whose body is cut in half under a `Content-Length` for the whole;
* `wrong_schema`: a 200 whose message is valid JSON of another schema (`{"result": 2n+1}`);

and otherwise gives the right answer. Call i asks about its own number n = 1000 + i, and the right answer is
`{"value": 2n}` (schema `Doubled`), so every returned value is checked against this ground truth, never against the
judge's own output. Every fault that carries a number carries a wrong one (2n + 1), so a fault the judge wrongly
accepted would show up as a wrong value. The draws follow the order in which requests reach the server, which
concurrency changes from run to run, so the counts per kind vary slightly between runs with the same seed. The
server's listen backlog is raised from socketserver's 5 to `--backlog` (128): with 5, some of the 16 connections the
judge opens at once are dropped by the kernel and time out, faults nobody injected (`--backlog 5` shows them).

N calls (`--calls`) go through one `Judge` at once (`max_concurrency` 16, `timeout` 1 s, every other `JudgeConfig`
field at its default: `max_retries` 2, `max_repairs` 1, `backoff_base` 1 s), with a fresh sqlite cache in a temporary
folder, every log record (all loggers, DEBUG, the `openai` and HTTP client ones included) in a log file there, and a
fake API key `sk-bench-<32 hex>` in the variable named by `api_key_env`. Counted: exceptions raised to the caller
(each call is wrapped, so one never stops the bench), lost calls (not returned by `--deadline_s`), returned values
that are right or wrong, unscorable calls (None), faults injected per kind, the judge's `metrics()` and the wall time.
Then a replay: a new `Judge` on the same cache, against a server that now only answers 500, asks every question
again; a cached answer must come back unchanged and without a request, and a call that was unscorable (never cached)
must be asked again and give None. Last, every file under the temporary folder (the sqlite cache and the log) is read
and searched for the key; the requests that carried it in their `authorization` header are counted as the control
that it was really in use.

Writes bench/results/judge_faults/result.json (settings, counts, every call with the faults it met, the judge's
metrics) and result.md, or into `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import hashlib
import json
import logging
import os
import random
import re
import secrets
import sys
import tempfile
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

import pydantic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere: the repository's packages

from bench.record import RESULTS, write_result  # noqa: E402
from rewards.judge import Judge, JudgeConfig  # noqa: E402
from tests import judge_server  # noqa: E402
from tests.judge_server import JudgeServer, RecordedRequest, Reply, error, hang, ok, truncated  # noqa: E402

FAULTS = ("http_500", "http_429", "hang", "malformed", "truncated", "wrong_schema")
# the judge counter each fault kind should move (malformed and wrong_schema share `parse_failures`)
COUNTER = {
    "http_500": "failures/server_error",
    "http_429": "failures/rate_limit",
    "hang": "timeouts",
    "truncated": "failures/connection",
    "malformed": "parse_failures",
    "wrong_schema": "parse_failures",
}
KEY_ENV = "AGENT_TRL_BENCH_JUDGE_KEY"
ROOT = Path(__file__).resolve().parent.parent
SERVER = "tests/judge_server.py"
RETRY_AFTER_S = 0.05
QUESTION = re.compile(r"n = (\d+)\.")


class Doubled(pydantic.BaseModel):
    value: int


def messages(n: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You double numbers."},
        {"role": "user", "content": f"n = {n}. Reply with twice n as `value`."},
    ]


class FaultyResponder:
    """The server's default responder: the right answer, or with probability `rate` one fault drawn uniformly.

    Thread-safe (the server answers each request on its own thread); `log` keeps (n, kind, is_repair) per request.
    """

    def __init__(self, rate: float, seed: int, hang_s: float) -> None:
        self.rate, self.hang_s = rate, hang_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.log: list[tuple[int, str, bool]] = []
        self.kind_of: dict[int, str] = {}  # id(request body) -> fault kind; the server's records keep the bodies alive

    def __call__(self, body: Any) -> Reply:
        users = [m for m in (body or {}).get("messages", []) if m.get("role") == "user"]
        found = QUESTION.search(str(users[0]["content"])) if users else None
        if found is None:  # not a bench request; never happens, but must not kill a server thread
            return error(400)
        n, is_repair = int(found.group(1)), len(users) > 1
        with self.lock:
            kind = self.rng.choice(FAULTS) if self.rng.random() < self.rate else "none"
            self.log.append((n, kind, is_repair))
            self.kind_of[id(body)] = kind
        wrong = 2 * n + 1  # every fault that carries a number carries a wrong one
        if kind == "http_500":
            return error(500)
        if kind == "http_429":
            return error(429, retry_after=RETRY_AFTER_S)
        if kind == "hang":
            return hang(self.hang_s)
        if kind == "malformed":
            return ok(f"Sure! {{'value': {wrong}}}")
        if kind == "truncated":
            return truncated(json.dumps({"value": wrong}))
        if kind == "wrong_schema":
            return ok(json.dumps({"result": wrong}))
        return ok(json.dumps({"value": 2 * n}))


async def run_calls(judge: Judge, numbers: list[int], deadline_s: float) -> dict[int, dict]:
    """Score every n at once through `judge`; one record per n, whatever happened to it."""
    records: dict[int, dict] = {}

    async def one(n: int) -> None:
        start = time.monotonic()
        try:
            result = await judge.score(messages(n), Doubled)
        except Exception as err:  # the judge promises never to raise; count it if it does
            records[n] = {"outcome": "exception", "error": repr(err), "traceback": traceback.format_exc()}
        else:
            value = None if result is None else result.value
            outcome = "unscorable" if value is None else "correct" if value == 2 * n else "wrong"
            records[n] = {"outcome": outcome, "value": value}
        records[n]["seconds"] = time.monotonic() - start

    tasks = {asyncio.ensure_future(one(n)): n for n in numbers}
    _, pending = await asyncio.wait(tasks, timeout=deadline_s)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task, n in tasks.items():
        if task in pending:
            records[n] = {"outcome": "lost", "seconds": deadline_s}
        elif n not in records:  # cancelled from inside the judge: a CancelledError reached the caller
            records[n] = {"outcome": "exception", "error": "CancelledError", "traceback": "", "seconds": None}
    return records


def expected_unscorable(fault_rate: float, max_retries: int, max_repairs: int) -> float:
    """Share of calls the retry budget cannot save, if every request draws a fault independently.

    A request fails in transport with t = rate * 4/6 (500, 429, hang, truncated) and returns unusable text with
    q = rate * 2/6 (malformed, wrong schema). An ask fails when all its 1 + R attempts do (R = max_retries):
    f = t**(1 + R); it yields bad text with g = (1 - f) * q / (1 - t). A call is unscorable when an ask fails after
    only bad texts, or all 1 + P asks (P = max_repairs) yield bad text: f * sum_{k=0..P} g**k + g**(P + 1).
    """
    t, q = fault_rate * 4 / 6, fault_rate * 2 / 6
    f = t ** (1 + max_retries)
    g = (1 - f) * q / (1 - t) if t < 1 else 0.0
    return f * sum(g**k for k in range(max_repairs + 1)) + g ** (max_repairs + 1)


def judge_in_flight(requests: list[RecordedRequest], kind_of: dict[int, str], timeout: float) -> int:
    """Most requests in flight as the judge sees them: a hang counts until the judge's timeout, not until the server
    drops it (the server's own `max_in_flight` keeps counting hangs the judge has already given up on)."""
    events = []
    for r in requests:
        end = r.started + timeout if kind_of.get(id(r.body)) == "hang" else r.finished
        events += [(r.started, 1), (end, -1)]
    most = current = 0
    for _, step in sorted(events):  # at equal times an end (-1) sorts before a start
        current += step
        most = max(most, current)
    return most


def scan_for_key(folder: Path, key: str) -> dict[str, Any]:
    """Read every file under `folder`; which of them contain `key`."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    hits = [str(p.relative_to(folder)) for p in files if key.encode() in p.read_bytes()]
    listing = {str(p.relative_to(folder)): p.stat().st_size for p in files}
    return {"files_scanned": len(files), "files_with_key": len(hits), "hits": hits, "files": listing}


def report(m: dict, args: argparse.Namespace, date: str) -> str:
    """result.md: the outcome of the calls, the faults against the judge's counters, the replay and the key scan."""
    out, judge, c = m["outcomes"], m["judge_metrics"], m["settings"]["judge_config"]
    lines = [
        f"API judge under injected faults, run on {date} (UTC): {args.calls} calls, fault rate {args.fault_rate}, "
        f"seed {args.seed}, max_concurrency {args.concurrency}, timeout {args.timeout} s, "
        f"hang {m['settings']['hang_s']} s, retry-after {RETRY_AFTER_S} s, server backlog {args.backlog}; other "
        f"JudgeConfig fields at their defaults (max_retries {c['max_retries']}, max_repairs {c['max_repairs']}, "
        f"backoff_base {c['backoff_base']} s)\n",
        "| calls | correct | wrong | unscorable (None) | expected unscorable | exceptions | lost | "
        "requests (server / judge) | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {args.calls} | {out['correct']} | {out['wrong']} | {out['unscorable']} | "
        f"{m['expected_unscorable'] * args.calls:.1f} | {out['exception']} | {out['lost']} | "
        f"{m['requests']} / {judge['judge/requests']:.0f} | {m['wall_s']:.1f} |",
        "\nExpected unscorable: calls whose faults exhaust the retry and repair budget, if every request drew its "
        "fault independently (`expected_unscorable`); an unscorable call is the judge's designed answer (None).\n",
        "| fault kind | injected on a question | injected on a repair ask | judge counter | counter |",
        "|---|---|---|---|---|",
    ]
    for kind in FAULTS:
        first, repair = m["faults"][kind]["first"], m["faults"][kind]["repair"]
        counter = COUNTER[kind]
        shared = " (both)" if counter == "parse_failures" else ""
        lines.append(f"| {kind} | {first} | {repair} | `{counter}`{shared} | {judge.get('judge/' + counter, 0):.0f} |")
    total = sum(f["first"] + f["repair"] for f in m["faults"].values())
    retries, repairs = judge["judge/retries"], judge["judge/repairs"]
    lines.append(
        f"| all faults | {total} of {m['requests']} requests | | `retries` / `repairs` | "
        f"{retries:.0f} / {repairs:.0f} |"
    )
    lines.append(
        f"\nMost requests in flight: {m['max_in_flight_judge']} while the judge waits on them (max_concurrency "
        f"{args.concurrency}); {m['max_in_flight_server']} at the server, which keeps holding a hang for "
        f"{m['settings']['hang_s']} s after the judge gave up on it at {args.timeout} s."
    )
    if m["unscorable"]:
        lines.append("\nUnscorable calls and the faults each met, in order:")
        lines += [f"- n = {u['n']}: {', '.join(u['faults'])}" for u in m["unscorable"]]
    r = m["replay"]
    lines.append(
        f"\nReplay on the same cache against a server answering only 500: {r['correct']} of {out['correct']} "
        f"cached answers back unchanged ({r['cache_hits']:.0f} cache hits), {r['wrong']} wrong, {r['unscorable']} "
        f"None (the {out['unscorable']} calls that were unscorable, never cached; {r['requests']} requests)."
    )
    k = m["key_scan"]
    lines.append(
        f"\nAPI key: sent in {k['requests_with_key']} of {m['requests']} requests' `authorization` header (replay: "
        f"{k['replay_requests_with_key']} of {r['requests']}); found in "
        f"{k['files_with_key']} of {k['files_scanned']} files written under the temporary folder "
        f"({', '.join(k['files'])}; the log holds every DEBUG record, {k['log_lines']} lines)."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=720, help="judge calls, all submitted at once")
    parser.add_argument("--fault_rate", type=float, default=0.30, help="probability that a request gets a fault")
    parser.add_argument("--seed", type=int, default=0, help="seed of the fault draws")
    parser.add_argument("--concurrency", type=int, default=16, help="JudgeConfig.max_concurrency")
    parser.add_argument("--timeout", type=float, default=1.0, help="JudgeConfig.timeout (s); a hang lasts 3x this")
    parser.add_argument("--deadline_s", type=float, default=300.0, help="a call not back by then counts as lost")
    parser.add_argument(
        "--backlog",
        type=int,
        default=128,
        help="listen backlog of the loopback server; socketserver's default of 5 loses connections when 16 open at "
        "once, and the judge then sees timeouts that were never injected",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "judge_faults", help="folder for result.json and .md")
    args = parser.parse_args(argv)
    numbers = [1000 + i for i in range(args.calls)]
    key = f"sk-bench-{secrets.token_hex(16)}"
    os.environ[KEY_ENV] = key
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")

    with tempfile.TemporaryDirectory(prefix="judge_faults-") as tmp:
        folder = Path(tmp)
        log_path = folder / "judge_faults.log"
        handler = logging.FileHandler(log_path)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        root = logging.getLogger()
        old_level = root.level
        root.addHandler(handler)
        root.setLevel(logging.DEBUG)  # every logger's records, the openai and HTTP client ones included
        judge_server._Server.request_queue_size = args.backlog  # the server's own class, its `listen()` backlog
        responder = FaultyResponder(args.fault_rate, args.seed, hang_s=3 * args.timeout)
        try:
            with JudgeServer(default=responder) as server:
                config = JudgeConfig(
                    model="bench-judge",
                    base_url=server.base_url,
                    api_key_env=KEY_ENV,
                    max_concurrency=args.concurrency,
                    timeout=args.timeout,
                    cache_path=str(folder / "cache" / "judge.sqlite"),
                )
                start = time.monotonic()
                with Judge(config) as judge:
                    records = asyncio.run(run_calls(judge, numbers, args.deadline_s))
                    wall_s = time.monotonic() - start
                    judge_metrics = judge.metrics()
                requests = list(server.requests)
                max_in_flight = server.max_in_flight
                in_flight = judge_in_flight(requests, responder.kind_of, args.timeout)

                server.reset()
                server.default = lambda body: error(500)
                with Judge(config) as replay_judge:
                    replayed = asyncio.run(run_calls(replay_judge, numbers, args.deadline_s))
                    replay_metrics = replay_judge.metrics()
                replay_requests = len(server.requests)
                replay_with_key = sum(r.headers.get("authorization") == f"Bearer {key}" for r in server.requests)
                with_key = sum(r.headers.get("authorization") == f"Bearer {key}" for r in requests)
        finally:
            root.removeHandler(handler)
            handler.close()
            root.setLevel(old_level)
        key_scan = scan_for_key(folder, key)
        key_scan["requests_with_key"], key_scan["replay_requests_with_key"] = with_key, replay_with_key
        key_scan["log_lines"] = len(log_path.read_text().splitlines())
    del os.environ[KEY_ENV]

    outcomes = Counter(r["outcome"] for r in records.values())
    met: dict[int, list[str]] = {n: [] for n in numbers}
    for n, kind, is_repair in responder.log:
        met[n].append(f"{kind} (repair ask)" if is_repair else kind)
    faults = {kind: {"first": 0, "repair": 0} for kind in FAULTS}
    for _, kind, is_repair in responder.log:
        if kind != "none":
            faults[kind]["repair" if is_repair else "first"] += 1
    replay_outcomes = Counter(r["outcome"] for r in replayed.values())
    seconds = [r["seconds"] for r in records.values() if r.get("seconds") is not None]
    measured = {
        "settings": {
            "hang_s": 3 * args.timeout,
            "retry_after_s": RETRY_AFTER_S,
            "judge_config": {k: v for k, v in vars(config).items() if k not in ("base_url", "cache_path")},
        },
        "outcomes": {o: outcomes.get(o, 0) for o in ("correct", "wrong", "unscorable", "exception", "lost")},
        "sources": {  # what was measured: the judge and the server as they were on disk (the tree may be dirty)
            name: hashlib.sha256((ROOT / name).read_bytes()).hexdigest() for name in ("rewards/judge.py", SERVER)
        },
        "expected_unscorable": expected_unscorable(args.fault_rate, config.max_retries, config.max_repairs),
        "wall_s": wall_s,
        "call_seconds_max": max(seconds, default=None),
        "requests": len(requests),
        "max_in_flight_server": max_in_flight,  # hangs counted until the server drops them (3 x timeout)
        "max_in_flight_judge": in_flight,  # hangs counted until the judge's timeout; compare with max_concurrency
        "faults": faults,
        "judge_metrics": judge_metrics,
        "unscorable": [{"n": n, "faults": met[n]} for n in numbers if records[n]["outcome"] == "unscorable"],
        "problems": [
            {"n": n, **records[n], "faults": met[n]}
            for n in numbers
            if records[n]["outcome"] in ("wrong", "exception", "lost")
        ],
        "replay": {
            **{o: replay_outcomes.get(o, 0) for o in ("correct", "wrong", "unscorable", "exception", "lost")},
            "unchanged": sum(replayed[n].get("value") == records[n].get("value") for n in numbers),
            "requests": replay_requests,
            "cache_hits": replay_metrics["judge/cache_hits"],
            "judge_metrics": replay_metrics,
        },
        "key_scan": key_scan,
        "calls": [
            {"n": n, **{k: v for k, v in records[n].items() if k != "traceback"}, "faults": met[n]} for n in numbers
        ],
    }
    text = report(measured, args, date)
    assert key not in json.dumps(measured, default=str) + text  # nothing written below may carry the key
    written = write_result(args.out, "judge_faults", vars(args) | {"out": str(args.out)}, measured, text)
    summary = {
        k: measured[k] for k in ("outcomes", "wall_s", "requests", "max_in_flight_server", "max_in_flight_judge")
    }
    summary["faults"] = {k: v["first"] + v["repair"] for k, v in faults.items()}
    summary["judge"] = {k.removeprefix("judge/"): v for k, v in judge_metrics.items() if v and "latency" not in k}
    summary["replay"] = {k: v for k, v in measured["replay"].items() if k != "judge_metrics"}
    summary["key"] = {k: key_scan[k] for k in ("files_scanned", "files_with_key", "requests_with_key")}
    print(json.dumps(summary, indent=1, default=str))
    for problem in measured["problems"]:
        print(f"PROBLEM n={problem['n']}: {problem}", file=sys.stderr)
    print(f"wrote {' and '.join(map(str, written))}", file=sys.stderr)
    return measured


if __name__ == "__main__":
    main()
