"""DRACO (draco.md): rubric parsing, merge, dropout and the outcome-blind reward on literal examples (layer 1); the
judge stages over scripted judges and the oracle on the built-in environments (layer 2); DRACOTrainer smoke runs on
the tiny random model with the oracle judge and with the HTTP judge against the loopback server (layer 3)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from envs.base import noisy_expert_episode
from envs.search import SearchEnv
from envs.shop import ShopEnv
from envs.terminal import TerminalEnv
from rewards.judge import BaseJudge, Judge, LocalModelJudge
from rewards.oracle import OracleJudge, search_checks, shop_checks, terminal_checks
from rewards.rubrics import (
    Attributions,
    Criterion,
    DracoReward,
    GroupInput,
    MergedCriteria,
    RolloutCriteria,
    RubricPipeline,
    Scores,
    TaskCriteria,
    TaskCriterion,
    check_attributions,
    check_scores,
    dedupe_and_truncate,
    discriminative_dropout,
    fallback_merge,
    group_metrics,
    normalize_title,
    render_steps,
    render_task,
    rubric_reward,
)
from tests.helpers.draco import DATA, SHOP_TASKS, Probe, check_batches, config, scripted_policy
from tests.judge_server import JudgeServer, error, hang, ok, truncated
from trainers import agent_loop
from trainers.draco import DRACOTrainer, build_judge


def crit(title: str) -> dict:
    return {"title": title, "description": f"{title}.", "evaluator_instruction": "Decide."}


def criteria(*titles: str) -> list[Criterion]:
    return [Criterion(**crit(t)) for t in titles]


# ---------------------------------------------------------------------------------------------------------------------
# Layer 1: literal examples


def test_reward_eq2_and_dropout_eq1():
    # §7 item 1: R in [-1, 1], 0 when nothing applies, N/A never moves R, R = 2 * pass rate - 1
    assert rubric_reward([1, 1, -1, 0], [0, 1, 2, 3]) == pytest.approx(1 / 3)  # p = 2, f = 1
    assert rubric_reward([1, 1, -1], [0, 1, 2]) == pytest.approx(2 * (2 / 3) - 1)
    assert rubric_reward([0, 0], [0, 1]) == 0.0 and rubric_reward([1, -1], []) == 0.0
    assert rubric_reward(None, [0]) is None
    # §7 item 2, one criterion per column: {+1,+1,0} dropped, {+1,-1} kept, {-1,-1} kept, {0,0} dropped;
    # an unscored rollout (None) is ignored even where it would fail
    verdicts = [[1, 1, -1, 0, 1], [1, -1, -1, 0, 1], [0, 1, -1, 0, 1], None]
    assert discriminative_dropout(verdicts, 5) == [1, 2]
    assert discriminative_dropout([None, None], 3) == []


def test_titles_dedupe_and_limits_d7():
    assert normalize_title("Bought  the RIGHT item!") == "bought the right item"
    items = criteria("A b", "a B!", "c", " ", "d")
    kept, truncated_ = dedupe_and_truncate(items, 2)
    assert [c.title for c in kept] == ["A b", "c"] and truncated_  # duplicates keep the first; '' is dropped
    for n, limit in ((16, 15), (11, 10), (25, 24)):  # §7 item 19
        kept, truncated_ = dedupe_and_truncate(criteria(*(f"c{i}" for i in range(n))), limit)
        assert len(kept) == limit and truncated_ and kept[0].title == "c0"
    merged = fallback_merge([TaskCriterion(**crit("x"))], [[TaskCriterion(**crit("X.")), TaskCriterion(**crit("y"))]])
    assert [c.title for c in merged] == ["x", "y"]  # §4.6 union fallback: S1 then S2, deduplicated


def test_scoring_validation():
    rubric = criteria("alpha", "beta", "gamma")

    def scores(*entries):
        return Scores.model_validate({"scores": [{"rubric_title": t, "score": s} for t, s in entries]})

    verdicts, _, error_ = check_scores(scores(("alpha", 1), ("beta", -1), ("Gamma!", 0)), rubric)
    assert verdicts == [1, -1, 0] and error_ is None
    verdicts, _, error_ = check_scores(scores(("gamma", 1), ("alpha", -1), ("beta", 0)), rubric)
    assert verdicts == [-1, 0, 1] and error_ is None  # reordered but complete: matched by title
    verdicts, _, error_ = check_scores(scores(("alpha", 1), ("beta", -1)), rubric)
    assert verdicts == [1, -1, None] and "expected 3 scores" in error_  # wrong count -> re-ask
    verdicts, _, error_ = check_scores(scores(("alpha", 1), ("delta", -1), ("gamma", 1)), rubric)
    assert verdicts == [1, None, 1] and "delta" in error_  # title mismatch -> re-ask
    with pytest.raises(ValueError):  # wrong score values and types fail the schema (the judge re-asks)
        Scores.model_validate({"scores": [{"rubric_title": "alpha", "score": 2}]})


def test_credit_validation_c9():
    rubric = criteria("alpha", "beta", "gamma")
    result = Attributions.model_validate(
        {
            "attributions": [
                {"rubric_title": "alpha", "rubric_index": 1, "verdict": "pass", "relevant_steps": [2, 2, 7, 0]},
                {"rubric_title": "beta", "rubric_index": 2, "verdict": "NOT_APPLICABLE", "relevant_steps": []},
                {"rubric_title": "gamma", "rubric_index": 9, "verdict": "FAIL", "relevant_steps": [1, 3]},
            ]
        }
    )
    verdicts, steps, error_ = check_attributions(result, rubric, num_steps=3)
    # steps 7 and 0 are out of range, the repeat counts once; index 9 is wrong but the title matches gamma
    assert verdicts == [1, 0, -1] and steps == [[2], [], [1, 3]] and error_ is None
    empty = Attributions.model_validate(
        {"attributions": [{"rubric_title": "alpha", "rubric_index": 1, "verdict": "FAIL", "relevant_steps": [5]}]}
    )
    verdicts, steps, error_ = check_attributions(empty, rubric, num_steps=3)
    assert verdicts == [-1, None, None] and steps[0] == [] and "cites no step" in error_ and "[2, 3]" in error_


def test_rendering_numbers_steps_from_one_and_strips_reasoning():
    long_observation = "h" * 1000 + "t" * 1000
    transcript = [
        {"action": "<think>secret plan</think>search[red shirt]", "observation": long_observation, "reward": 0.0},
        {"action": "buy", "observation": "bought", "reward": 1.0},
    ]
    text = render_steps(transcript, observation_chars=1000)
    assert text.startswith("[ASSISTANT] step 1\nsearch[red shirt]") and "[ASSISTANT] step 2\nbuy" in text
    # D4: keep 1,000 of 2,000 characters: the first 3/4 (750, all "h") and the last 1/4 (250, all "t"); D5: no <think>
    assert "secret plan" not in text and "h" * 750 + " … " + "t" * 250 + "\n" in text
    assert "h" * 751 not in text and "t" * 251 not in text
    assert (
        render_task([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
        == "[SYSTEM]\nS\n\n[USER]\nU"
    )


# ---------------------------------------------------------------------------------------------------------------------
# Layer 2: the stages over a scripted judge


class ScriptedJudge(BaseJudge):
    """Answers per schema name from a callable `(messages, vote_index) -> dict | None` or a queue of dicts."""

    def __init__(self, answers: dict, votes: int = 1) -> None:
        super().__init__(votes=votes)
        self.answers = answers
        self.seen: list[tuple[str, list[dict], int]] = []

    async def score(self, messages, schema, *, vote_index=0, **sampling):
        self.seen.append((schema.__name__, list(messages), vote_index))
        answer = self.answers.get(schema.__name__)
        value = answer(messages, vote_index) if callable(answer) else (answer.pop(0) if answer else None)
        return None if value is None else schema.model_validate(value)

    def count(self, name: str) -> int:
        return sum(s == name for s, _, _ in self.seen)


def group(task: str = "Instruction: do it", n: int = 2) -> GroupInput:
    steps = [[{"action": f"act {i}-{j}", "observation": f"obs {j}"} for j in range(2)] for i in range(n)]
    return GroupInput("t1", f"[USER]\n{task}", steps)


def rollout_index(messages) -> int:
    return int(re.search(r"act (\d)-0", messages[1]["content"]).group(1))


def test_stages_reward_retries_and_truncation():
    s1 = {"criteria": [crit(f"task {i}") for i in range(16)]}  # one over the S1 limit
    # rollout 0 first scores two of three criteria (re-asked), then passes a, b and fails c; rollout 1 fails a
    scores = {
        0: [[("a", 1), ("b", 1)], [("a", 1), ("b", 1), ("c", -1)]],
        1: [[("a", -1), ("b", 1), ("c", 0)]],
    }
    judge = ScriptedJudge(
        {
            "TaskCriteria": [s1],
            "RolloutCriteria": lambda m, v: {"criteria": [crit("extra")]},
            "MergedCriteria": [{"criteria": [crit("a"), crit("b"), crit("c")]}],
            "Scores": lambda m, v: {"scores": [crit_score(t, x) for t, x in scores[rollout_index(m)].pop(0)]},
        }
    )
    pipe = RubricPipeline(judge)
    (res,) = pipe.score_groups([group()])
    assert len(res.task_criteria) == 15 and [c.title for c in res.merged] == ["a", "b", "c"]
    assert res.verdicts == [[1, 1, -1], [-1, 1, 0]]
    assert res.surviving == [0, 2]  # b is passed by everyone: dropped (Eq. 1)
    assert res.rewards == [0.0, -1.0]  # (1 - 1)/2 and (0 - 1)/1
    (retry,) = [m for name, m, _ in judge.seen if name == "Scores" and len(m) > 2]
    assert "expected 3 scores" in retry[-1]["content"] and retry[-2]["role"] == "assistant"  # the re-ask
    m = pipe.metrics()
    assert m["draco/judge_retries/scoring"] == 1 and m["draco/judge_truncations"] == 1
    assert (
        m["draco/judge_calls/task"] == 1 and m["draco/judge_calls/rollout"] == 2 and m["draco/judge_calls/merge"] == 1
    )


def test_task_rubric_cache_d9_and_fallbacks():
    answers = {
        "TaskCriteria": [None, {"criteria": [crit("s1 a")]}],  # the first S1 call fails: not cached
        "RolloutCriteria": lambda m, v: {"criteria": [crit("s2 b")]} if rollout_index(m) == 0 else None,
        "MergedCriteria": lambda m, v: None,  # union fails -> deterministic merge
        "Scores": lambda m, v: None if rollout_index(m) == 1 else {"scores": [crit_score(t, -1) for t in ("s2 b",)]},
    }
    judge = ScriptedJudge(answers)
    pipe = RubricPipeline(judge, stage_retries=0)
    (first,) = pipe.score_groups([group()])
    assert first.task_criteria == [] and [c.title for c in first.merged] == ["s2 b"]
    assert first.verdicts[1] is None and first.rewards[1] is None  # scoring failed: unscorable
    (second,) = pipe.score_groups([group()])
    third, fourth = pipe.score_groups([group(), group()])
    assert [c.title for c in second.merged] == ["s1 a", "s2 b"] and third.task_criteria == second.task_criteria
    assert judge.count("TaskCriteria") == 2  # the failure was asked again; then one call serves every visit
    pipe.judge_id = "another judge"
    judge.answers["TaskCriteria"] = lambda m, v: {"criteria": [crit("s1 c")]}
    fifth, sixth = pipe.score_groups([group(), group()])
    assert judge.count("TaskCriteria") == 3  # the judge identity is part of the key; one call for both groups
    assert fifth.task_criteria[0].title == sixth.task_criteria[0].title == "s1 c"


def test_a_judge_that_always_fails_makes_the_group_unscorable_not_zero():
    """Every call fails (a refused connection, a 401): no criteria because nothing answered, so every rollout is
    unscorable (reward None) and the unscorable rate says 1.0; a judge that answers with no criteria gives R = 0."""
    failing = {name: lambda m, v: None for name in ("TaskCriteria", "RolloutCriteria", "MergedCriteria", "Scores")}
    (res,) = RubricPipeline(ScriptedJudge(failing), stage_retries=0).score_groups([group()])
    assert res.verdicts == [None, None] and res.rewards == [None, None]
    assert group_metrics([res])["draco/unscorable_rate"] == 1.0
    empty = {"TaskCriteria": lambda m, v: {"criteria": []}, "RolloutCriteria": lambda m, v: {"criteria": []}}
    (res,) = RubricPipeline(ScriptedJudge(empty), stage_retries=0).score_groups([group()])
    assert res.rewards == [0.0, 0.0] and group_metrics([res])["draco/unscorable_rate"] == 0.0


def crit_score(title: str, score: int) -> dict:
    return {"rubric_title": title, "score": score}


@pytest.mark.parametrize(
    ("samples", "expected"),
    [((1, 1, 1), 1), ((1, 1, -1), -1), ((1, 0, 1), 0), ((0, 0, 0), 0), ((1, None, 1), 0), ((-1, None, 1), -1)],
)
def test_self_judge_votes_eq10_c10(samples, expected):
    def scores(messages, vote_index):
        s = samples[vote_index]
        return None if s is None else {"scores": [crit_score("a", s), crit_score("b", 1)]}

    pipe = RubricPipeline(ScriptedJudge({"Scores": scores}, votes=3))
    result = asyncio.run(pipe.score("task", "steps", criteria("a", "b")))
    assert result[0] == [expected, 1 if None not in samples else 0]


def test_no_surviving_criterion_gives_zero_reward_and_deadline_cancels():
    judge = ScriptedJudge(
        {
            "TaskCriteria": [{"criteria": [crit("a")]}],
            "RolloutCriteria": lambda m, v: {"criteria": []},
            "MergedCriteria": [{"criteria": [crit("a")]}],
            "Scores": lambda m, v: {"scores": [crit_score("a", 1)]},
        }
    )
    (res,) = RubricPipeline(judge).score_groups([group()])
    assert res.surviving == [] and res.rewards == [0.0, 0.0]  # §7 item 16

    class Sleepy(ScriptedJudge):
        async def score(self, messages, schema, **kw):
            await asyncio.sleep(5)

    pipe = RubricPipeline(Sleepy({}), step_deadline_s=0.3)
    start = time.monotonic()
    (res,) = pipe.score_groups([group()])
    assert time.monotonic() - start < 3 and res.merged == []
    assert res.rewards == [None, None]  # every call was cancelled: nothing was judged, the rollouts are unscorable
    assert pipe.metrics()["draco/judge_deadline/task"] == 1  # cancelled at the step deadline, then fallbacks


def test_draco_reward_groups_rows_and_never_shows_hidden_fields():
    # §7 item 23: hidden task fields, rewards and env info never reach a judge prompt
    tasks = ShopEnv.make_tasks("train", 2, seed=3)
    for t in tasks:
        t["hidden_eval"] = "SENTINEL-9f2c"
    seen: list[str] = []

    class Recording(OracleJudge):
        async def score(self, messages, schema, **kw):
            seen.append(json.dumps(messages))
            return await super().score(messages, schema, **kw)

    reward = DracoReward(RubricPipeline(Recording(tasks)), group_size=2)
    prompts, transcripts, ids = [], [], []
    for t in tasks:
        for policy in ("expert", "noisy"):
            transcripts.append(play_shop(t, 0.0 if policy == "expert" else 1.0, seed=1))
            prompts.append(ShopEnv().reset(t))
            ids.append(t["task_id"])
    for tr in transcripts:
        for turn in tr:
            turn["reward"], turn["info"] = 987.125, "SENTINEL-9f2c"
    rewards = reward(prompts, ["x"] * 4, transcript=transcripts, task_id=ids, log_metric=None)
    assert rewards[0] > rewards[1] and rewards[2] > rewards[3]  # the expert beats the noisy policy in each group
    assert seen and not any("SENTINEL" in s or "987.125" in s or "catalogue_seed" in s for s in seen)
    assert [r.task_key for r in reward.last] == ids == [tasks[0]["task_id"]] * 2 + [tasks[1]["task_id"]] * 2
    assert reward.last_metrics["draco/criteria_merged"] > 0


# ---------------------------------------------------------------------------------------------------------------------
# Layer 2: the oracle judge on the built-in environments


def play_shop(task: dict, noise: float, seed: int) -> list[dict]:
    return noisy_expert_episode(ShopEnv(task["difficulty"]), task, noise, random.Random(seed))[1]


def verdicts_by_title(checks) -> dict[str, int]:
    return {c.title: c.verdict for c in checks}


def test_oracle_shop_checks_good_and_bad_transcripts():
    task = ShopEnv.make_tasks("train", 1, seed=5)[0]
    t = task["target"]
    env = ShopEnv()
    env.reset(task)
    expert = []
    while env.page != "done":
        expert.append(env.expert_action())
        env.step(expert[-1])
    good = shop_checks(task, expert)  # search, click, choose, buy
    assert all(c.verdict == 1 for c in good), verdicts_by_title(good)
    size = next(c for c in good if c.title == f"Size {t['size']} was chosen")
    assert size.steps == [3, 4]  # the choose step and the buy step
    wrong_size = next(s for s in ("xs", "s", "m", "l", "xl") if s != t["size"])
    bad = shop_checks(task, [expert[0], expert[1], "hello", f"choose[{wrong_size}]", "buy"])
    v = verdicts_by_title(bad)
    assert v[f"Size {t['size']} was chosen"] in (-1,)  # a wrong (or unavailable) size: violated
    assert v[f"The bought item is a {t['type']}"] == 1
    valid = next(c for c in bad if c.process)
    assert valid.verdict == -1 and 3 in valid.steps  # the invalid action at step 3 is blamed
    never = shop_checks(task, [expert[0], "click[NOPE]"])
    assert all(c.verdict == -1 and c.steps == [2] for c in never if "bought" in c.title.lower())  # omission: last step


def test_oracle_terminal_and_search_checks():
    task = TerminalEnv.make_tasks("train", 1, seed=1)[0]
    good = terminal_checks(task, [*task["solution"], "submit"])
    assert all(c.verdict == 1 for c in good), verdicts_by_title(good)
    early = terminal_checks(task, ["submit"])
    assert any(c.verdict == -1 for c in early if not c.process)  # the verifier's assertions fail
    assert next(c for c in early if c.title == "The episode ends with submit").verdict == 1
    errors = terminal_checks(task, ["cat /missing.txt", "frobnicate"])
    assert next(c for c in errors if c.process).verdict == -1
    qa = SearchEnv.make_tasks("train", 1, seed=2)[0]
    right = search_checks(qa, [f"search[{qa['hops'][0]}]", f"answer[{qa['answer']}]"])
    assert all(c.verdict == 1 for c in right), verdicts_by_title(right)
    wrong = verdicts_by_title(search_checks(qa, ["oops", "answer[nobody]"]))
    assert wrong["The final answer is correct"] == -1 and wrong["Every turn has a valid action"] == -1


def test_oracle_answers_every_stage_through_the_prompts():
    tasks = ShopEnv.make_tasks("train", 1, seed=8)
    judge = OracleJudge(tasks)
    pipe = RubricPipeline(judge)
    prompt = ShopEnv().reset(tasks[0])
    transcripts = [play_shop(tasks[0], noise, seed) for noise, seed in ((0.0, 0), (1.0, 1), (1.0, 2), (0.0, 3))]
    (res,) = pipe.score_groups([GroupInput(tasks[0]["task_id"], render_task(prompt), transcripts)])
    assert res.rewards[0] == 1.0 and res.rewards[3] == 1.0 and min(res.rewards) < 1.0
    crits = [res.merged[c] for c in res.surviving]
    results = pipe.credit_many(
        [
            (
                render_task(prompt),
                transcripts[i],
                crits,
                [res.verdicts[i][c] for c in res.surviving],
                [""] * len(crits),
            )
            for i in range(4)
        ]
    )
    for tr, cr in zip(transcripts, results, strict=True):
        assert all(1 <= j <= len(tr) for steps in cr.steps for j in steps)
        assert all(steps for v, steps in zip(cr.verdicts, cr.steps, strict=True) if v != 0)  # PASS/FAIL cite
    m = judge.metrics()
    assert m["judge/calls"] == 1 + 4 + 1 + 4 + 4 and m["judge/unscorable"] == 0 and m["judge/tokens_in"] > 0
    assert judge.score_sync([{"role": "user", "content": "<task>\n[USER]\nunknown task\n</task>"}], Scores) is None


# ---------------------------------------------------------------------------------------------------------------------
# Layer 3: DRACOTrainer smoke runs


def test_trainer_smoke_oracle_scripted_policy(tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(agent_loop, "hf_generate", scripted_policy(p_expert=0.6))

    class FlakyOracle(OracleJudge):  # every third credit call fails -> `judge_failure` fallback rows
        n = 0

        async def score(self, messages, schema, **kw):
            if schema is Attributions:
                self.n += 1
                if self.n % 3 == 0:
                    return None
            return await super().score(messages, schema, **kw)

    trainer = Probe(
        model=tiny_model_folder, args=config(tmp_path), train_dataset=DATA, processing_class=tiny_tokenizer,
        env_factory=lambda row: ShopEnv(), judge=FlakyOracle(SHOP_TASKS),
    )  # fmt: skip
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    check_batches(trainer)
    reasons = [r for _, _, c in trainer.seen for r in c.reasons]
    assert "judge_failure" in reasons and None in reasons  # both credited and fallback rows were checked
    nonzero = sum(int((b.advantages != 0).sum()) for b, _, _ in trainer.seen)
    assert sum(h["draco/judge_calls/credit"] for h in logs) == nonzero  # one credit call per row with A != 0 (D10)
    assert logs[0]["credit/conservation_residual_max"] < 1e-9 and logs[0]["credit/sign_flip_token_frac"] == 0
    assert all(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters() if p.requires_grad)


def test_trainer_smoke_random_model_and_config_errors(tiny_model_folder, tiny_tokenizer, tmp_path):
    # the real sampling path: a random model's garbage fails every criterion alike -> zero-variance groups,
    # A = 0 everywhere, no credit call (§7 item 15), finite loss
    args = config(tmp_path, max_turn_tokens=4, max_turns=2, max_completion_length=64, max_steps=1)
    trainer = Probe(
        model=tiny_model_folder, args=args, train_dataset=DATA, processing_class=tiny_tokenizer,
        env_factory=lambda row: ShopEnv(),
    )  # fmt: skip
    assert isinstance(trainer.pipeline.judge, OracleJudge)  # built from the config fields
    trainer.train()
    (log,) = [h for h in trainer.state.log_history if "loss" in h]
    assert math.isfinite(log["loss"]) and log.get("draco/judge_calls/credit", 0) == 0
    assert all((b.advantages == 0).all() for b, _, _ in trainer.seen)
    check_batches(trainer)
    assert config(tmp_path, loss_type="grpo").loss_type == "grpo"  # conventions.md C22
    with pytest.raises(ValueError, match="loss_type"):
        config(tmp_path, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="draco_step_quality"):
        config(tmp_path, draco_step_quality="hard")
    with pytest.raises(ValueError, match="judge_backend"):
        config(tmp_path, judge_backend="gpt")
    with pytest.raises(ValueError, match="judge_model"):
        config(tmp_path, judge_backend="openai")
    assert config(tmp_path, judge_backend="self").judge_votes == 3 and config(tmp_path).judge_votes == 1
    assert (
        config(tmp_path, judge_backend="self").judge_temperature == 0.6 and config(tmp_path).judge_temperature == 0.1
    )
    with pytest.raises(ValueError, match="task"):
        build_judge(config(tmp_path), [Dataset.from_list([{"prompt": "hi"}])])
    # the self-judge (§4.5) is the policy itself, with k = 3 votes and S1 regenerated every step (D9)
    selfish = DRACOTrainer(
        model=tiny_model_folder, args=config(tmp_path, judge_backend="self"), train_dataset=DATA,
        processing_class=tiny_tokenizer, env_factory=lambda row: ShopEnv(),
    )  # fmt: skip
    judge = selfish.pipeline.judge
    assert isinstance(judge, LocalModelJudge) and judge.model is selfish.model and judge.votes == 3
    assert selfish.draco_reward.per_step_identity


SCHEMAS = {s.__name__: s for s in (TaskCriteria, RolloutCriteria, MergedCriteria, Scores, Attributions)}


def oracle_server_reply(oracle: OracleJudge):
    """A server responder that answers DRACO requests like a sound judge would (the oracle reads the prompts)."""

    def reply(body):
        messages = body["messages"]
        schema = json.loads(messages[0]["content"].split("JSON schema, and nothing else:\n", 1)[1])
        answer = oracle.answer("\n".join(m["content"] for m in messages), SCHEMAS[schema["title"]])
        return ok(json.dumps(answer))

    return reply


def test_trainer_smoke_http_judge_with_faults(tiny_model_folder, tiny_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr(agent_loop, "hf_generate", scripted_policy(p_expert=0.6, seed=1))
    monkeypatch.setenv("DRACO_TEST_KEY", "sk-test")
    healthy = oracle_server_reply(OracleJudge(SHOP_TASKS))
    with JudgeServer(default=healthy) as server:
        # step 1: a few transport and format faults among valid answers; step 2: the endpoint is down
        server.script(error(500), ok("I cannot answer in JSON, sorry."), hang(2.0), truncated('{"criteria": []}'))

        class Outage(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                server.default = lambda body: error(503)

        args = config(
            tmp_path, judge_backend="openai", judge_model="judge-test", judge_base_url=server.base_url,
            judge_api_key_env="DRACO_TEST_KEY", judge_timeout=0.5, judge_concurrency=8,
        )  # fmt: skip
        trainer = Probe(
            model=tiny_model_folder, args=args, train_dataset=DATA, processing_class=tiny_tokenizer,
            env_factory=lambda row: ShopEnv(), callbacks=[Outage()],
        )  # fmt: skip
        assert isinstance(trainer.pipeline.judge, Judge)
        trainer.pipeline.judge.config.backoff_base = 0.01  # keep the retries fast
        trainer.train()
        assert server.requests[0].headers["authorization"] == "Bearer sk-test"
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    check_batches(trainer)
    first, second = logs
    assert first["draco/judge_retries"] >= 2 and first["draco/judge_parse_failures"] >= 1  # faults were met
    assert first["draco/judge_calls/credit"] > 0  # ... and credit still ran on the healthy answers
    assert second["draco/judge_unscorable"] > 0 and all((b.advantages == 0).all() for b, _, _ in trainer.seen[1:])


def test_the_oracle_judge_and_the_analyzer_take_shopping_lists():
    from rewards.analyzer import OracleAnalyzer

    lists = ShopEnv.make_tasks("train", 2, seed=0, difficulty=1)  # checks: tests/test_oracle_shop_lists.py
    assert len(OracleJudge(lists).tasks) == 2
    assert len(OracleJudge(ShopEnv.make_tasks("train", 2, seed=0, difficulty=3)).tasks) == 2
    assert len(OracleAnalyzer(lists).tasks) == 2  # TASPO's oracle replays the expert: any level
