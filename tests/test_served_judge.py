"""A real judge: the real model (SmolLM2-135M-Instruct) served by `transformers serve` on a free loopback port
(agent_trl/served.py), read over HTTP by DRACO's judge, by verifiers' reference judge and by the task audit.

The judge need not be good, and at 135M parameters it is not: it writes prose where DRACO's stages ask for JSON. What
these tests check is that it is real: every request the judge counts reached the server (the server's own access log
agrees), the step finishes, the rows the judge could not score are counted as unscorable rather than scored, and the
server is gone when the run ends.
"""

from __future__ import annotations

import asyncio
import re
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

import train
from agent_trl.served import Endpoint, point_at, servable_roles, serve
from rewards import audit

ROOT = Path(__file__).resolve().parent.parent
DRACO = ROOT / "configs" / "smollm2_draco_guess_the_number.yaml"
CPU = ["--save_strategy", "no", "--report_to", "none", "--logging_steps", "1", "--seed", "0"]


def posts(log: Path) -> int:
    """Chat requests the server answered, from its access log."""
    return len(re.findall(r'"POST /v1/chat/completions HTTP/1\.1" 200', log.read_text()))


def refused(base_url: str) -> bool:
    host, port = re.match(r"http://([\d.]+):(\d+)/v1", base_url).groups()
    with socket.socket() as s:
        return s.connect_ex((host, int(port))) != 0


def test_point_at_fills_only_openai_roles_without_a_base_url():
    config = SimpleNamespace(
        judge_backend="openai", judge_base_url=None, judge_model="smollm2",
        analyzer_backend="oracle", analyzer_base_url=None, analyzer_model=None,
        editor_backend="openai", editor_base_url="http://elsewhere:1/v1", editor_model="m",
    )  # fmt: skip
    endpoint = Endpoint(base_url="http://127.0.0.1:5/v1", model="/folder", log_path=Path("serve.log"))
    assert servable_roles(config) == ["judge"]
    assert point_at(config, endpoint) == ["judge"]
    assert (config.judge_base_url, config.judge_model) == ("http://127.0.0.1:5/v1", "/folder")
    assert (config.analyzer_base_url, config.editor_base_url) == (None, "http://elsewhere:1/v1")  # left alone


def test_serve_model_on_a_trainer_with_no_endpoint_stops_before_serving(tmp_path, capsys):
    argv = ["--config", str(ROOT / "configs" / "smollm2_guess_the_number.yaml"), "--serve_model", "smollm2"]
    with pytest.raises(SystemExit, match="no judge, analyzer or editor with backend `openai`"):
        train.main(argv + ["--output_dir", str(tmp_path / "run")])
    assert "serving" not in capsys.readouterr().out and not (tmp_path / "run" / "serve.log").exists()


def test_serve_model_must_be_a_model_folder(tmp_path):
    with pytest.raises(SystemExit, match="is not a model folder"):
        with serve(str(tmp_path)):
            pass


def test_a_draco_step_judged_by_the_served_real_model(smollm2, tmp_path, capsys):
    """One DRACO step of the real recipe, its judge the start model served over HTTP: 2 groups of 2 rollouts."""
    out = tmp_path / "draco"
    argv = ["--config", str(DRACO), "--output_dir", str(out), "--max_steps", "1", "--skip_eval", "true"]
    argv += ["--per_device_train_batch_size", "4", "--num_generations", "2", "--num_train_tasks", "4"]
    argv += ["--max_turns", "2", "--max_turn_tokens", "6", "--max_completion_length", "64"]
    argv += ["--judge_max_tokens", "32", "--judge_temperature", "0", "--judge_stage_retries", "0"]
    argv += ["--judge_step_deadline", "900"]  # no call cut short: every request the judge sends is answered
    summary = train.main(argv + CPU)
    printed = capsys.readouterr().out
    base_url = re.search(r"served at (\S+)", printed).group(1)
    assert base_url.startswith("http://127.0.0.1:")
    (step,) = [row for row in summary["log_history"] if "loss" in row]

    # the judge's calls: one task rubric (S1) per group and one rollout rubric (S2) per rollout (draco.md §4.1)
    assert step["draco/judge_calls/task"] == 2 and step["draco/judge_calls/rollout"] == 4
    phases = sum(v for k, v in step.items() if k.startswith("draco/judge_calls/"))
    assert step["draco/judge_calls"] == phases
    # every request the judge counted reached the server and was answered: its access log agrees
    assert step["draco/judge_requests"] == posts(out / "serve.log") > 0
    resent = step["draco/judge_repairs"] + step["draco/judge_retries"]  # re-asks after bad answers; transport resends
    assert step["draco/judge_requests"] == step["draco/judge_calls"] + resent
    assert step["draco/judge_tokens_in"] > 0 and step["draco/judge_tokens_out"] > 0  # usage came from the server

    # scored and unscorable rows: the trainer's count of rows without a reward is the reward stage's
    unscorable = round(step["reward/unscorable_frac"] * 4)
    assert unscorable == round(step["draco/unscorable_rate"] * 4)
    if step["draco/criteria_merged"] == 0:  # the judge wrote no usable criterion: nothing can be scored
        assert unscorable == 4 and step["reward"] is None
        assert step["draco/judge_parse_failures"] > 0
        assert step["loss"] == 0 and step["grad_norm"] == 0  # no reward, no push: nothing trained on nothing
    else:  # some criteria: the rows of the groups that got them are scored
        assert unscorable < 4 and step["reward"] is not None
    assert refused(base_url)  # the server stopped with the run


def test_verifiers_reference_judge_reads_the_served_model(served_smollm2, smollm2):
    """verifiers' reference-answer judge, pointed at the endpoint, gets the served model's greedy answer."""
    from verifiers.v1.judges import ReferenceJudge, ReferenceJudgeConfig

    config = ReferenceJudgeConfig(
        model=served_smollm2.model, base_url=served_smollm2.base_url, api_key_var="AGENT_TRL_NO_KEY"
    )
    judge = ReferenceJudge(config)
    fields = {"question": "What is 2 + 3?", "answer": "5", "response": "2 + 3 = 5", "positive": "yes"}
    messages = judge.build_messages(**fields, negative="no")
    answer = asyncio.run(judge.complete(messages, temperature=0, max_tokens=8))

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    chat = [{"role": "user", "content": messages}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=8, do_sample=False)
    expected = tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.text == expected and answer.usage.prompt_tokens == ids["input_ids"].shape[1]


def test_the_audit_serves_its_auditor_or_takes_an_endpoint(smollm2, tmp_path, monkeypatch):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"task_id": "t0", "instruction": "x"}\n')
    base = ["--tasks", str(tasks), "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit):  # neither an endpoint nor a model to serve
        audit.parse_args(base)
    with pytest.raises(SystemExit):  # both
        audit.parse_args(base + ["--serve_model", "smollm2", "--model", "m", "--base_url", "http://x/v1"])
    seen = {}

    def fake_audit(args):
        seen.update(base_url=args.base_url, model=args.model, up=not refused(args.base_url))
        return {}

    monkeypatch.setattr(audit, "audit", fake_audit)
    audit.main(base + ["--serve_model", "smollm2"])
    assert seen["up"] and seen["model"] == smollm2
    assert refused(seen["base_url"]) and posts(tmp_path / "out" / "serve.log") == 0  # served, then stopped
