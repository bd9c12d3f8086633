"""Contract tests of `envs/search.py`: seeded tasks, disjoint splits, BM25 ranking, verifier, expert, state keys."""

import hashlib
import json
import random
import re

import pytest

from envs.base import split_of
from envs.search import NAME_POOL, ONE_HOP, TWO_HOP, SearchEnv, normalize_answer

LEVELS = [0, 1, 2, 3, 4]
SHORT = [0, 3, 4]  # one hop (0), two hops (3), two hops with distractors (4)
LONG = [1, 2]  # road chains of 4-5 and 7-9 hops

# A hand-written two-hop task (the generator's format), so the verifier is tested on known strings.
HAND_TASK = {
    "task_id": "hand-0",
    "env": "search",
    "difficulty": 3,
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
            hops = {0: [1], 1: [4, 5], 2: [7, 8, 9], 3: [2], 4: [2]}[difficulty]  # searches of the expert
            assert len(t["hops"]) == len(t["support"]) in hops
            if difficulty in SHORT:
                assert t["corpus"][t["support"][-1]].endswith(t["answer"] + ".")  # the answer ends the last document
            else:  # the first town (result (1) of the first search) and the last (where the road ends)
                assert t["corpus"][t["support"][0]].endswith(f" was born in {t['hops'][1]}.")
                assert t["corpus"][t["support"][-1]] == f"{t['hops'][-1]}: the road from {t['hops'][-1]} ends here."
                assert t["answer"] == f"{t['hops'][1]} to {t['hops'][-1]}"
    assert {t["instruction"] for t in train}.isdisjoint({t["instruction"] for t in eval_})
    assert {t["task_id"] for t in train}.isdisjoint({t["task_id"] for t in eval_})


@pytest.mark.parametrize("difficulty", SHORT)
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
    """Levels 0 to 3: the needed document is result (1). Level 4: in the top 3, and often not first."""
    env = SearchEnv(difficulty)
    not_first = 0
    for task in tasks["train", difficulty]:
        turns = run_expert(env, task)
        for (action, obs, *_), query, doc in zip(turns, task["hops"], task["support"], strict=False):
            assert action == f"search[{query}]"
            assert obs.startswith("results: (1) ") and obs.count("(") <= 3
            if difficulty != 4:
                assert obs.startswith(f"results: (1) {task['corpus'][doc]}")
            else:
                assert task["corpus"][doc] in obs
                not_first += not obs.startswith(f"results: (1) {task['corpus'][doc]}")
    if difficulty == 4:
        assert not_first >= 50  # of 200 hops: content matching is needed, position alone does not solve the level


def test_level0_answer_is_copied_from_the_end_of_result_one(tasks):
    env = SearchEnv(0)
    for task in tasks["eval", 0]:
        assert task["hops"][0] in task["instruction"]  # the query is copied from the question
        env.reset(task)
        obs, *_ = env.step(f"search[{task['hops'][0]}]")
        first = obs.removeprefix("results: (1) ").split(" (2) ")[0]
        assert first.removesuffix(".").endswith(" " + task["answer"])


@pytest.mark.parametrize("difficulty", [2, 4])
def test_observations_are_short(tasks, difficulty):
    env = SearchEnv(difficulty)
    for task in tasks["train", difficulty]:
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
    env = SearchEnv(3)
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
    env = SearchEnv(3)
    assert env.reset(HAND_TASK) == "Question: in which country is the town where Zorvak Telmi was born?"
    obs, r, done, info = env.step("search[Ostrava Vel]")
    # the short country document outranks the longer birth document; no zero-score documents are listed
    assert obs == "results: (1) Ostrava Vel lies in Karesh. (2) Zorvak Telmi was born in Ostrava Vel."
    assert (r, done, info) == (0.0, False, {})
    assert env.step("search[Quxly Nobody]")[0] == "results: none"


def test_action_may_follow_reasoning_and_the_last_one_counts():
    env = SearchEnv(3)
    env.reset(HAND_TASK)
    obs, *_ = env.step("I should look him up first. search[Zorvak Telmi]")
    assert obs == "results: (1) Zorvak Telmi was born in Ostrava Vel."
    obs, r, done, _ = env.step("Not answer[Tirin] but ANSWER[Karesh]")
    assert (r, done) == (1.0, True)


@pytest.mark.parametrize("action", ["Karesh", "search Zorvak Telmi", "lookup[Karesh]", "search[]", "answer[  ]", ""])
def test_invalid_action_is_an_error_observation(action):
    env = SearchEnv(3)
    env.reset(HAND_TASK)
    env.step("search[Zorvak Telmi]")
    key = env.state_key()
    obs, r, done, info = env.step(action)
    assert obs.startswith("error:") and "search[query]" in obs
    assert (r, done, info) == (0.0, False, {})
    assert env.state_key() == key
    assert env.expert_action() == "search[Ostrava Vel]"  # the episode goes on


def test_step_after_the_end():
    env = SearchEnv(3)
    env.reset(HAND_TASK)
    env.step("answer[Karesh]")
    assert env.step("answer[Morvia]") == ("error: the episode is over", 0.0, True, {"success": True})
    env.reset(HAND_TASK)
    assert env.step("answer[Morvia]")[1:3] == (0.0, True)
    assert env.step("answer[Karesh]") == ("error: the episode is over", 0.0, True, {"success": False})


def test_state_key():
    env = SearchEnv(3)
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
    env = SearchEnv(3)
    env.reset(HAND_TASK)
    assert env.expert_action() == "search[Zorvak Telmi]"
    env.step("search[Dunei Pask]")
    assert env.expert_action() == "search[Zorvak Telmi]"
    env.step("search[Ostrava Vel]")  # a lucky guess shows both chain documents
    assert env.expert_action() == "answer[Karesh]"


@pytest.mark.parametrize("difficulty", SHORT)
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
        SearchEnv.make_tasks("train", 1, difficulty=5)


# ---------------------------------------------------------------------------------------------------------------------
# Levels 0, 3 and 4 are what levels 0, 1 and 2 were before the long-horizon levels (1, 2) were added


def _digest(tasks: list[dict], drop: tuple[str, ...] = ()) -> str:
    kept = [{k: v for k, v in t.items() if k not in drop} for t in tasks]
    return hashlib.sha256(json.dumps(kept).encode()).hexdigest()


@pytest.mark.parametrize(
    ("difficulty", "split", "digest"),
    # sha256 prefixes of the tasks that envs/search.py made before the renumbering (commit c749cd9), 40 per split,
    # seed 0: level 0 whole, old levels 1 and 2 without the fields that name the level (task_id, difficulty)
    [(0, "train", "e914ec68febb0cfb"), (0, "eval", "3738929866698db4"), (3, "train", "689582e83ad26a99"),
     (3, "eval", "efccba2bee0f9ef6"), (4, "train", "b5721ddadb0e01df"), (4, "eval", "10a61cf2170399bf")],
)  # fmt: skip
def test_short_levels_keep_their_tasks(difficulty, split, digest):
    tasks = SearchEnv.make_tasks(split, 40, seed=0, difficulty=difficulty)
    drop = () if difficulty == 0 else ("task_id", "difficulty")
    assert _digest(tasks, drop)[:16] == digest
    assert all(t["difficulty"] == difficulty and t["task_id"].startswith(f"search-d{difficulty}-") for t in tasks)


def test_level_budgets_and_skills():
    assert [SearchEnv(d).max_turns for d in LEVELS] == [6, 10, 18, 6, 6]
    assert SearchEnv.max_turns == 6  # the class keeps level 0's budget (the mixed pool reads it before a reset)
    assert SearchEnv(0).skill == SearchEnv(3).skill == SearchEnv.skill
    assert SearchEnv(1).skill == SearchEnv(2).skill != SearchEnv.skill
    assert "answer[<the birth town> to <the town where the road ends>]" in SearchEnv(1).skill


# ---------------------------------------------------------------------------------------------------------------------
# Long-horizon levels: a road chain from the person's birth town; the answer joins the first town and the last

# A hand-written level-1 task: 3 towns (Kesta -> Mirol -> Sorin), a side road from Vanto into Mirol, Kesta's country
# and an off-chain person and road.
HAND_LONG = {
    "task_id": "hand-long-1",
    "env": "search",
    "difficulty": 1,
    "instruction": "from the town where Zorvak Telmi was born, follow the roads until one ends; answer with the first "
    "and the last town, as <first> to <last>",
    "answer": "Kesta to Sorin",
    "hops": ["Zorvak Telmi", "Kesta", "Mirol", "Sorin"],
    "corpus": [
        "Dunei Pask was born in Tirin.",
        "Kesta: the road from Kesta leads to Mirol.",
        "Zorvak Telmi was born in Kesta.",
        "Sorin: the road from Sorin ends here.",
        "Kesta lies in Karesh.",
        "Mirol: the road from Mirol leads to Sorin.",
        "Vanto: the road from Vanto leads to Mirol.",
        "Tirin: the road from Tirin leads to Belo.",
    ],
    "facts": [
        ["Dunei Pask", "born", "Tirin"],
        ["Kesta", "road", "Mirol"],
        ["Zorvak Telmi", "born", "Kesta"],
        ["Sorin", "end", ""],
        ["Kesta", "country", "Karesh"],
        ["Mirol", "road", "Sorin"],
        ["Vanto", "road", "Mirol"],
        ["Tirin", "road", "Belo"],
    ],
    "support": [2, 1, 5, 3],
}
# BM25 (Lucene: k1 = 1.5, b = 0.75; one query word, so its idf is common to all documents and only
# tf * 2.5 / (tf + 1.5 * (0.25 + 0.75 * len / avg_len)) orders them). Word counts: 6 8 6 7 4 8 8 8, average 6.875.
# "Kesta": road out (tf 2, 8 words) 5 / 3.684 = 1.357 > country (tf 1, 4 words) 2.5 / 2.030 = 1.232 > birth
# (tf 1, 6 words) 2.5 / 2.357 = 1.061. "Mirol": the road out of Mirol (tf 2) first, then the two roads into it (tf 1,
# 8 words each: equal scores, corpus order). "Sorin": the end (tf 2, 7 words), then the road into it.
HAND_LONG_OBSERVATIONS = [
    "results: (1) Zorvak Telmi was born in Kesta.",
    "results: (1) Kesta: the road from Kesta leads to Mirol. (2) Kesta lies in Karesh. (3) Zorvak Telmi was born in "
    "Kesta.",
    "results: (1) Mirol: the road from Mirol leads to Sorin. (2) Kesta: the road from Kesta leads to Mirol. (3) "
    "Vanto: the road from Vanto leads to Mirol.",
    "results: (1) Sorin: the road from Sorin ends here. (2) Mirol: the road from Mirol leads to Sorin.",
]

# A hand-written level-2 task: 6 towns (Kesta Mirol Sorin Talvo Brena Fusk), someone else born in Sorin, Brena's
# country. Word counts: 8 6 6 8 8 7 8 8 4, average 7.
HAND_LONG_2 = {
    "task_id": "hand-long-2",
    "env": "search",
    "difficulty": 2,
    "instruction": "from the town where Zorvak Telmi was born, follow the roads until one ends; answer with the first "
    "and the last town, as <first> to <last>",
    "answer": "Kesta to Fusk",
    "hops": ["Zorvak Telmi", "Kesta", "Mirol", "Sorin", "Talvo", "Brena", "Fusk"],
    "corpus": [
        "Talvo: the road from Talvo leads to Brena.",
        "Zorvak Telmi was born in Kesta.",
        "Dunei Pask was born in Sorin.",
        "Brena: the road from Brena leads to Fusk.",
        "Kesta: the road from Kesta leads to Mirol.",
        "Fusk: the road from Fusk ends here.",
        "Sorin: the road from Sorin leads to Talvo.",
        "Mirol: the road from Mirol leads to Sorin.",
        "Brena lies in Karesh.",
    ],
    "facts": [
        ["Talvo", "road", "Brena"],
        ["Zorvak Telmi", "born", "Kesta"],
        ["Dunei Pask", "born", "Sorin"],
        ["Brena", "road", "Fusk"],
        ["Kesta", "road", "Mirol"],
        ["Fusk", "end", ""],
        ["Sorin", "road", "Talvo"],
        ["Mirol", "road", "Sorin"],
        ["Brena", "country", "Karesh"],
    ],
    "support": [1, 4, 7, 6, 0, 3, 5],
}
# "Sorin": road out (tf 2, 8 words) 5 / 3.661 = 1.366 > the other birth (tf 1, 6 words) 2.5 / 2.339 = 1.069 > road in
# (tf 1, 8 words) 2.5 / 2.661 = 0.939. "Brena": road out 1.366 > country (4 words) 2.5 / 2.018 = 1.239 > road in 0.939.
HAND_LONG_2_OBSERVATIONS = [
    "results: (1) Zorvak Telmi was born in Kesta.",
    "results: (1) Kesta: the road from Kesta leads to Mirol. (2) Zorvak Telmi was born in Kesta.",
    "results: (1) Mirol: the road from Mirol leads to Sorin. (2) Kesta: the road from Kesta leads to Mirol.",
    "results: (1) Sorin: the road from Sorin leads to Talvo. (2) Dunei Pask was born in Sorin. (3) Mirol: the road "
    "from Mirol leads to Sorin.",
    "results: (1) Talvo: the road from Talvo leads to Brena. (2) Sorin: the road from Sorin leads to Talvo.",
    "results: (1) Brena: the road from Brena leads to Fusk. (2) Brena lies in Karesh. (3) Talvo: the road from Talvo "
    "leads to Brena.",
    "results: (1) Fusk: the road from Fusk ends here. (2) Brena: the road from Brena leads to Fusk.",
]


@pytest.mark.parametrize(
    ("task", "observations"), [(HAND_LONG, HAND_LONG_OBSERVATIONS), (HAND_LONG_2, HAND_LONG_2_OBSERVATIONS)]
)
def test_hand_written_long_episode(task, observations):
    env = SearchEnv(task["difficulty"])
    assert env.reset(task) == "Question: " + task["instruction"]
    turns = run_expert(env, task)
    assert [a for a, *_ in turns] == [f"search[{h}]" for h in task["hops"]] + [f"answer[{task['answer']}]"]
    assert [o for _, o, *_ in turns] == observations + [""]
    assert [(r, d) for _, _, r, d, _ in turns] == [(0.0, False)] * len(task["hops"]) + [(1.0, True)]
    keys = []
    env.reset(task)
    for action, *_ in turns:
        env.step(action)
        keys.append(env.state_key())
    towns = [h.lower() for h in task["hops"]]
    assert keys == [f"hop={h} last={q}" for h, q in enumerate(towns, 1)] + [f"hop={len(towns)} last={towns[-1]} end"]
    plan = " | ".join([f"search[{h}]" for h in task["hops"]] + [f"answer[{task['answer']}]"])
    assert env.privileged(task) == "Plan: " + plan


@pytest.mark.parametrize(
    "answer", ["Sorin", "Mirol to Sorin", "Zorvak Telmi to Sorin", "Kesta to Mirol", "Kesta", "Sorin to Kesta"]
)
def test_long_answer_needs_the_first_town_and_the_last(answer):
    env = SearchEnv(1)
    env.reset(HAND_LONG)
    assert env.step(f"answer[{answer}]")[1:3] == (0.0, True)
    env.reset(HAND_LONG)
    assert env.step("answer[the Kesta to  Sorin.]")[1:3] == (1.0, True)


def test_long_state_key_and_recovery_by_hand():
    env = SearchEnv(1)
    env.reset(HAND_LONG)
    env.step("search[Zorvak Telmi]")
    env.step("search[Kesta]")
    assert env.state_key() == "hop=2 last=kesta" and env.expert_action() == "search[Mirol]"
    env.step("search[Karesh]")  # off the chain: the country shows only "Kesta lies in Karesh."
    assert env.state_key() == "hop=2 last=karesh" and env.expert_action() == "search[Mirol]"
    env.step("search[Vanto]")  # a dead end whose road leads into the chain: Mirol's own road is not shown
    assert env.state_key() == "hop=2 last=vanto" and env.expert_action() == "search[Mirol]"
    env.step("search[Kesta]")  # the same state as after the direct path
    assert env.state_key() == "hop=2 last=kesta"
    env.step("search[Mirol]")
    env.step("search[Sorin]")
    assert env.state_key() == "hop=4 last=sorin" and env.expert_action() == "answer[Kesta to Sorin]"
    env.step("search[Sorin]")  # searching past the end changes nothing
    assert env.state_key() == "hop=4 last=sorin" and env.expert_action() == "answer[Kesta to Sorin]"


@pytest.mark.parametrize(
    ("task", "searched", "expected"),
    [
        (HAND_LONG, 0, {"search[Dunei Pask]"}),
        (HAND_LONG, 2, {"search[Dunei Pask]", "search[Kesta]", "search[Karesh]", "search[Zorvak Telmi]"}),
        (HAND_LONG, 3, {"search[Dunei Pask]", "search[Mirol]", "search[Vanto]", "search[Kesta]",
                        "answer[Kesta to Mirol]"}),
        (HAND_LONG, 4, {"answer[Sorin]", "answer[Tirin to Sorin]", "search[Sorin]"}),
        (HAND_LONG_2, 7, {"answer[Fusk]", "search[Fusk]"}),  # its one other birthplace, Sorin, is on the chain
    ],
)  # fmt: skip
def test_long_noisy_actions_by_hand(task, searched, expected):
    """After the expert's first `searched` searches: re-search the current town, go back a town, leave the chain by a
    distractor that mentions the current town, search another person, answer before the end; at the end, an answer
    without the first town or with the birthplace of someone off the chain (never a town of the chain or the person),
    or the last town searched again."""
    env, rng = SearchEnv(task["difficulty"]), random.Random(0)
    env.reset(task)
    for hop in task["hops"][:searched]:
        env.step(f"search[{hop}]")
    assert {env.noisy_action(rng) for _ in range(300)} == expected


@pytest.mark.parametrize(("difficulty", "share"), [(1, 1 / 5), (2, 1 / 4 * 1 / 5)])
def test_long_noisy_early_answer_share(difficulty, share):
    """After four searches of HAND_LONG_2 (current town Sorin) the other mistakes are four draws: the other person,
    Sorin again, the distractor that mentions Sorin (Dunei Pask, again) and Mirol, the town before. At level 1 the
    early answer is a fifth draw; at level 2 it is among them a quarter of the time, so 1/4 * 1/5."""
    env, rng = SearchEnv(difficulty), random.Random(0)
    env.reset(HAND_LONG_2)
    for hop in HAND_LONG_2["hops"][:4]:
        env.step(f"search[{hop}]")
    draws = [env.noisy_action(rng) for _ in range(20_000)]
    assert set(draws) == {"search[Dunei Pask]", "search[Sorin]", "search[Mirol]", "answer[Kesta to Sorin]"}
    # within 2 sigma at level 1, 4 at level 2 (the draws are seeded)
    assert draws.count("answer[Kesta to Sorin]") / len(draws) == pytest.approx(share, abs=0.006)


@pytest.mark.parametrize("difficulty", LONG)
def test_long_expert_turns_and_names(tasks, difficulty):
    turns = {1: {5, 6}, 2: {8, 9, 10}}[difficulty]  # searches (1 + 3-4 or 1 + 6-8 towns) and the answer
    env = SearchEnv(difficulty)
    seen = set()
    for task in tasks["train", difficulty][:50] + tasks["eval", difficulty][:50]:
        episode = run_expert(env, task)
        seen.add(len(episode))
        assert episode[-1][4] == {"success": True, "answer": task["answer"]}
        assert len(episode) + 4 <= env.max_turns  # slack for mistakes
        words = [w for s, _, o in task["facts"] for w in (s + " " + o).split() if w not in ("lamp",)]
        assert set(words) <= set(NAME_POOL)  # single tokens of the tiny tokenizer, as at level 0
        people = {s for s, rel, _ in task["facts"] if rel == "born"}
        named = {w for s, _, o in task["facts"] for w in {s, o} - people - {""}} | people
        assert len({w for n in named for w in n.split()}) == sum(len(n.split()) for n in named)  # no word twice
        assert all(len(t.split()) == 1 for t in task["hops"][1:])  # towns are one word
    assert seen == turns


@pytest.mark.parametrize("difficulty", LONG)
def test_long_answer_needs_the_first_observation(tasks, difficulty):
    """The first town is result (1)'s last word after the first search and the title of result (1) after the second;
    the third search may show it once more (the road out of it is the road into the second town, unless three
    documents that mention the second town rank above it), then never again: the answer copies it from 2 to 8
    observations back."""
    env = SearchEnv(difficulty)
    gaps = set()
    for task in tasks["eval", difficulty]:
        turns = run_expert(env, task)
        observations = [o for _, o, *_ in turns[:-1]]
        first, last = task["answer"].split(" to ")
        assert observations[0].split(" (2) ")[0].removesuffix(".").endswith(" " + first)
        shown = [j for j, o in enumerate(observations) if re.search(rf"\b{first}\b", o)]
        assert shown in ([0, 1], [0, 1, 2])
        assert turns[-2][0] == f"search[{last}]" and observations[-1].startswith(f"results: (1) {last}: ")
        gaps.add(len(observations) - 1 - shown[-1])
    # level 1: 4-5 observations, the last showing the first town the 2nd or 3rd; level 2: 7-9 observations
    assert gaps == ({1, 2, 3} if difficulty == 1 else {4, 5, 6, 7})


@pytest.mark.parametrize("difficulty", LONG)
def test_long_results_show_distractors(tasks, difficulty):
    """Results (2) and (3) show the chain document into the town (the person's birth, or the road from the town before)
    and distractors that mention the town: side roads, countries and, at level 2, other people born on the chain
    (among the towns after the first, so a wrong first town to answer)."""
    env = SearchEnv(difficulty)
    kinds = {"chain in": 0, "side road": 0, "country": 0, "other birth": 0}
    for task in tasks["train", difficulty]:
        support = {task["corpus"][j] for j in task["support"]}
        for hop, (_, obs, *_) in zip(task["hops"][1:], run_expert(env, task)[1:], strict=False):
            docs = re.split(r" \(\d\) ", obs.removeprefix("results: (1) "))
            assert 2 <= len(docs) <= 3
            for doc in docs[1:]:
                if doc in support:
                    kinds["chain in"] += doc.endswith(f" {hop}.")
                elif ": the road from" in doc:
                    kinds["side road"] += doc.endswith(f" to {hop}.")
                elif " lies in " in doc:
                    kinds["country"] += doc.startswith(f"{hop} lies in ")
                else:
                    assert " was born in " in doc and difficulty == 2 and doc.endswith(f" {hop}.")
                    assert hop != task["hops"][1]
                    kinds["other birth"] += 1
    assert kinds["chain in"] >= 100 and kinds["side road"] >= 50 and kinds["country"] >= 50
    assert (kinds["other birth"] >= 50) == (difficulty == 2)


@pytest.mark.parametrize("difficulty", LONG)
def test_long_expert_recovers_from_noisy_states(tasks, difficulty):
    """One noisy action at each point of the expert's path: a search costs exactly one turn; an answer ends the
    episode as a failure. Then three noisy searches in a row at a random point: the expert still succeeds."""
    env, rng = SearchEnv(difficulty), random.Random(1)
    kinds = set()
    for task in tasks["train", difficulty][:50]:
        n = len(task["hops"]) + 1
        for k in range(n):
            env.reset(task)
            for _ in range(k):
                env.step(env.expert_action())
            noisy = env.noisy_action(rng)
            assert noisy != env.expert_action()
            _, reward, done, info = env.step(noisy)
            if noisy.startswith("answer["):
                kinds.add("answer")
                assert (reward, done, info["success"]) == (0.0, True, False)
                continue
            kinds.add("search")
            turns = 1
            while not done:
                _, reward, done, info = env.step(env.expert_action())
                turns += 1
            assert info["success"] and turns == n - k + 1
        env.reset(task)
        wrong, turns, done = 0, 0, False
        start = rng.randrange(n)
        while not done:
            if turns >= start and wrong < 3:
                action = next(a for a in iter(lambda: env.noisy_action(rng), None) if a.startswith("search["))
                wrong += 1
            else:
                action = env.expert_action()
            _, reward, done, info = env.step(action)
            turns += 1
        assert info["success"] and turns == n + 3 <= env.max_turns
    assert kinds == {"answer", "search"}
