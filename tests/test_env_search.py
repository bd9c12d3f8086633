"""Contract tests of `envs/search.py`: seeded tasks, disjoint splits, BM25 ranking, verifier, expert, state keys."""

import json
import random
import re

import pytest

from envs.base import split_of
from envs.search import ONE_HOP, TWO_HOP, SearchEnv, normalize_answer

LEVELS = [0, 1, 2]

# A hand-written two-hop task (the generator's format), so the verifier is tested on known strings.
HAND_TASK = {
    "task_id": "hand-0",
    "env": "search",
    "difficulty": 1,
    "instruction": "in which country is the town where Zorvak Telmi was born?",
    "answer": "Karesh",
    "hops": ["Zorvak Telmi", "Ostrava Vel"],
    "corpus": [
        "Dunei Pask was born in Tirin.",
        "Zorvak Telmi was born in Ostrava Vel.",
        "Tirin lies in Morvia.",
        "Ostrava Vel lies in Karesh.",
        "The Kiro lamp was invented by Dunei Pask.",
    ],
    "facts": [
        ["Dunei Pask", "born", "Tirin"],
        ["Zorvak Telmi", "born", "Ostrava Vel"],
        ["Tirin", "country", "Morvia"],
        ["Ostrava Vel", "country", "Karesh"],
        ["Kiro lamp", "invented_by", "Dunei Pask"],
    ],
    "support": [1, 3],
}


def run_expert(env: SearchEnv, task: dict) -> list[tuple[str, str, float, bool, dict]]:
    """(action, observation, reward, done, info) per turn of the expert's episode."""
    env.reset(task)
    turns = []
    for _ in range(env.max_turns):
        action = env.expert_action()
        obs, reward, done, info = env.step(action)
        turns.append((action, obs, reward, done, info))
        if done:
            break
    return turns


@pytest.fixture(scope="module")
def tasks() -> dict[tuple[str, int], list[dict]]:
    return {(s, d): SearchEnv.make_tasks(s, 100, seed=0, difficulty=d) for s in ("train", "eval") for d in LEVELS}


@pytest.mark.parametrize("difficulty", LEVELS)
def test_make_tasks_is_seeded(difficulty):
    a = SearchEnv.make_tasks("train", 20, seed=7, difficulty=difficulty)
    assert a == SearchEnv.make_tasks("train", 20, seed=7, difficulty=difficulty)
    other = SearchEnv.make_tasks("train", 20, seed=8, difficulty=difficulty)
    assert {t["instruction"] for t in a}.isdisjoint({t["instruction"] for t in other})
    # the same task replays to the same transcript in a fresh environment
    assert run_expert(SearchEnv(difficulty), a[3]) == run_expert(SearchEnv(difficulty), a[3])


@pytest.mark.parametrize("difficulty", LEVELS)
def test_splits_are_disjoint_and_well_formed(tasks, difficulty):
    train, eval_ = tasks["train", difficulty], tasks["eval", difficulty]
    assert len(train) == len(eval_) == 100
    for split, ts in (("train", train), ("eval", eval_)):
        assert len({t["instruction"] for t in ts}) == len({t["task_id"] for t in ts}) == 100
        assert all(split_of(t["instruction"]) == split for t in ts)
        assert all(t["env"] == "search" and t["difficulty"] == difficulty for t in ts)
        assert json.loads(json.dumps(ts)) == ts
        for t in ts:
            assert len(t["hops"]) == len(t["support"]) == (1 if difficulty == 0 else 2)
            assert t["corpus"][t["support"][-1]].endswith(t["answer"] + ".")  # the answer ends the last document
    assert {t["instruction"] for t in train}.isdisjoint({t["instruction"] for t in eval_})
    assert {t["task_id"] for t in train}.isdisjoint({t["task_id"] for t in eval_})


@pytest.mark.parametrize("difficulty", LEVELS)
def test_every_question_template_is_generated(tasks, difficulty):
    """The ranking check at generation must not silently drop a template (or most candidates)."""
    templates = ONE_HOP if difficulty == 0 else TWO_HOP
    patterns = [re.compile(re.escape(q).replace(r"\{", "{").replace(r"\}", "}").format(p=".+", t=".+", i=".+"))
                for q, _ in templates]  # fmt: skip
    counts = [sum(bool(p.fullmatch(t["instruction"])) for t in tasks["train", difficulty]) for p in patterns]
    assert sum(counts) == 100 and min(counts) >= 100 // len(templates) // 2, counts


@pytest.mark.parametrize("difficulty", LEVELS)
def test_expert_succeeds_on_every_task(tasks, difficulty):
    env = SearchEnv(difficulty)
    for task in tasks["train", difficulty] + tasks["eval", difficulty]:
        turns = run_expert(env, task)
        assert len(turns) == len(task["hops"]) + 1  # one search per hop, then the answer
        assert [r for _, _, r, _, _ in turns] == [0.0] * len(task["hops"]) + [1.0]
        assert [d for _, _, _, d, _ in turns] == [False] * len(task["hops"]) + [True]
        assert turns[-1][4] == {"success": True, "answer": task["answer"]}


@pytest.mark.parametrize("difficulty", LEVELS)
def test_bm25_shows_the_chain_document(tasks, difficulty):
    """Levels 0 and 1: the needed document is result (1). Level 2: in the top 3, and often not first."""
    env = SearchEnv(difficulty)
    not_first = 0
    for task in tasks["train", difficulty]:
        turns = run_expert(env, task)
        for (action, obs, *_), query, doc in zip(turns, task["hops"], task["support"], strict=False):
            assert action == f"search[{query}]"
            assert obs.startswith("results: (1) ") and obs.count("(") <= 3
            if difficulty < 2:
                assert obs.startswith(f"results: (1) {task['corpus'][doc]}")
            else:
                assert task["corpus"][doc] in obs
                not_first += not obs.startswith(f"results: (1) {task['corpus'][doc]}")
    if difficulty == 2:
        assert not_first >= 50  # of 200 hops: content matching is needed, position alone does not solve the level


def test_level0_answer_is_copied_from_the_end_of_result_one(tasks):
    env = SearchEnv(0)
    for task in tasks["eval", 0]:
        assert task["hops"][0] in task["instruction"]  # the query is copied from the question
        env.reset(task)
        obs, *_ = env.step(f"search[{task['hops'][0]}]")
        first = obs.removeprefix("results: (1) ").split(" (2) ")[0]
        assert first.removesuffix(".").endswith(" " + task["answer"])


def test_observations_are_short(tasks):
    env = SearchEnv(2)
    for task in tasks["train", 2]:
        for _, obs, *_ in run_expert(env, task):
            assert len(obs.split()) <= 40


def test_normalize_answer():
    assert normalize_answer("The  Ostrava Vel.") == "ostrava vel"
    assert normalize_answer("an Apple, a day!") == "apple day"
    assert normalize_answer("Theodor") == "theodor"  # articles only as whole words


@pytest.mark.parametrize(
    ("answer", "reward"),
    [("Karesh", 1.0), ("karesh", 1.0), ("The Karesh.", 1.0), ("  KARESH!  ", 1.0), ("Ostrava Vel", 0.0),
     ("Morvia", 0.0), ("Karesh Vel", 0.0), ("Kares", 0.0)],
)  # fmt: skip
def test_verifier(answer, reward):
    env = SearchEnv(1)
    env.reset(HAND_TASK)
    obs, r, done, info = env.step(f"answer[{answer}]")
    assert (r, done, info) == (reward, True, {"success": reward == 1.0, "answer": answer.strip()})


def test_verifier_accepts_normalised_multiword_answer():
    task = {**HAND_TASK, "answer": "Ostrava Vel", "hops": ["Zorvak Telmi"], "support": [1]}
    env = SearchEnv(0)
    env.reset(task)
    assert env.step("answer[The Ostrava Vel.]")[1] == 1.0
    env.reset(task)
    assert env.step("answer[Ostrava]")[1] == 0.0


def test_search_observation_format():
    env = SearchEnv(1)
    assert env.reset(HAND_TASK) == "Question: in which country is the town where Zorvak Telmi was born?"
    obs, r, done, info = env.step("search[Ostrava Vel]")
    # the short country document outranks the longer birth document; no zero-score documents are listed
    assert obs == "results: (1) Ostrava Vel lies in Karesh. (2) Zorvak Telmi was born in Ostrava Vel."
    assert (r, done, info) == (0.0, False, {})
    assert env.step("search[Quxly Nobody]")[0] == "results: none"


def test_action_may_follow_reasoning_and_the_last_one_counts():
    env = SearchEnv(1)
    env.reset(HAND_TASK)
    obs, *_ = env.step("I should look him up first. search[Zorvak Telmi]")
    assert obs == "results: (1) Zorvak Telmi was born in Ostrava Vel."
    obs, r, done, _ = env.step("Not answer[Tirin] but ANSWER[Karesh]")
    assert (r, done) == (1.0, True)


@pytest.mark.parametrize("action", ["Karesh", "search Zorvak Telmi", "lookup[Karesh]", "search[]", "answer[  ]", ""])
def test_invalid_action_is_an_error_observation(action):
    env = SearchEnv(1)
    env.reset(HAND_TASK)
    env.step("search[Zorvak Telmi]")
    key = env.state_key()
    obs, r, done, info = env.step(action)
    assert obs.startswith("error:") and "search[query]" in obs
    assert (r, done, info) == (0.0, False, {})
    assert env.state_key() == key
    assert env.expert_action() == "search[Ostrava Vel]"  # the episode goes on


def test_step_after_the_end():
    env = SearchEnv(1)
    env.reset(HAND_TASK)
    env.step("answer[Karesh]")
    assert env.step("answer[Morvia]") == ("error: the episode is over", 0.0, True, {"success": True})
    env.reset(HAND_TASK)
    assert env.step("answer[Morvia]")[1:3] == (0.0, True)
    assert env.step("answer[Karesh]") == ("error: the episode is over", 0.0, True, {"success": False})


def test_state_key():
    env = SearchEnv(1)
    env.reset(HAND_TASK)
    assert env.state_key() == "hop=0 last=-"
    env.step("search[Tirin]")  # a wrong entity: no chain document shown
    assert env.state_key() == "hop=0 last=tirin"
    env.step("search[the Zorvak  Telmi]")
    assert env.state_key() == "hop=1 last=zorvak telmi"
    wandered = env.state_key()
    env.step("search[Ostrava Vel]")
    assert env.state_key() == "hop=2 last=ostrava vel"
    env.step("answer[Morvia]")
    assert env.state_key() == "hop=2 last=ostrava vel end"
    # the same state reached by a direct path has the same key
    env.reset(HAND_TASK)
    env.step("search[Zorvak Telmi]")
    assert env.state_key() == wandered
    # the chain must be seen in order: the country document alone is not progress
    env.reset(HAND_TASK)
    env.step("search[Karesh]")
    assert env.state_key() == "hop=0 last=karesh"


def test_expert_resumes_from_any_state():
    env = SearchEnv(1)
    env.reset(HAND_TASK)
    assert env.expert_action() == "search[Zorvak Telmi]"
    env.step("search[Dunei Pask]")
    assert env.expert_action() == "search[Zorvak Telmi]"
    env.step("search[Ostrava Vel]")  # a lucky guess shows both chain documents
    assert env.expert_action() == "answer[Karesh]"


@pytest.mark.parametrize("difficulty", LEVELS)
def test_noisy_action_is_plausible_and_wrong(tasks, difficulty):
    env, rng = SearchEnv(difficulty), random.Random(0)
    kinds = set()
    for task in tasks["train", difficulty][:50]:
        env.reset(task)
        for step in range(len(task["hops"]) + 1):
            for _ in range(5):
                noisy = env.noisy_action(rng)
                assert noisy != env.expert_action()
                verb, arg = noisy[:-1].split("[", 1)
                assert verb in ("search", "answer") and arg
                if verb == "answer":
                    assert normalize_answer(arg) != normalize_answer(task["answer"])
                    kinds.add("answer bridge" if arg in task["hops"] else "answer distractor")
                else:
                    assert arg not in task["hops"]
                    kinds.add("search wrong")
            if step < len(task["hops"]):
                env.step(env.expert_action())
    assert kinds == ({"search wrong", "answer distractor"} | ({"answer bridge"} if difficulty > 0 else set()))
    # a noisy episode ends wrong when its answer is noisy
    env.reset(tasks["train", difficulty][0])
    noisy_answer = next(a for a in iter(lambda: env.noisy_action(rng), None) if a.startswith("answer["))
    obs, reward, done, info = env.step(noisy_answer)
    assert (reward, done, info["success"]) == (0.0, True, False)


def test_make_tasks_rejects_bad_arguments():
    with pytest.raises(ValueError):
        SearchEnv.make_tasks("test", 1)
    with pytest.raises(ValueError):
        SearchEnv.make_tasks("train", 1, difficulty=3)
