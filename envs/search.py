"""Multi-hop question answering over a small generated corpus, with a BM25 search action and an answer action.

Corpus. Every task generates its own corpus of one-sentence documents about fictional entities whose names are
random pseudo-words (so held-out tasks test a skill, not a memorised catalogue). A document states one fact, and the
fact's object is always the document's last words:

    Zorvak Telmi was born in Ostrava Vel.          (person born in town)
    Zorvak Telmi lives in Kesta.                   (person lives in town; a distractor relation, never asked)
    The Tarbo lamp was invented by Zorvak Telmi.   (invention invented by person)
    Ostrava Vel lies in Karesh.                    (town lies in country)
    Ostrava Vel lies on the Munda.                 (town lies on river)

The task dict stores the corpus (`corpus`), the facts it renders (`facts`, `[subject, relation, object]` aligned with
`corpus`), the indices of the documents on the reasoning chain (`support`) and the expert's queries (`hops`).

Actions, one per assistant turn, plain text (the last `verb[...]` in the turn counts, so reasoning before it is fine):

    search[<query>]   BM25 over the task's corpus (`bm25s`); observation "results: (1) <doc> (2) <doc> (3) <doc>",
                      the top 3 documents with a positive score, best first (ties: corpus order)
    answer[<text>]    ends the episode

Reward. 0 on every turn except `answer`, which earns 1.0 when the answer equals the gold answer after normalisation
(lowercase, punctuation and the articles a/an/the removed, whitespace collapsed; `normalize_answer`), else 0.0.
`info["success"]` and `info["answer"]` are set on the final step. A turn without a valid action, an empty query or an
empty answer gets an error observation (reward 0, not done). The agent loop cuts an episode after `max_turns` turns.

Levels (`difficulty`):

0. One hop ("where was Zorvak Telmi born?"). Learnable by the tiny default by positional copying: names are drawn
   from one fixed pool of 160 pseudo-words (`NAME_POOL`, single tokens for the tiny tokenizer), no word twice in a
   task, so the expert's query (the entity copied from the question) has exactly one matching document, it comes
   first, and the answer is its last words.
1. Two hops ("in which country is the town where Zorvak Telmi was born?"): search the person, copy the town from the
   end of result (1), search the town, answer with the end of result (1). Documents are phrased so that the document
   needed at each hop is the shortest full match, hence ranked first (checked at generation time).
2. Two hops with distractors that share words: the chain entities have other facts (the person also lives somewhere
   and invented something, the town has both a country and a river) and near-namesakes share a first or last word
   ("Zorvak Dunei", "Ostrava Mir"). The needed document is somewhere in the top 3 but often not first, so the agent
   must match the question's relation to the document's content: a level for real models, not the tiny default.

`state_key()` is `"hop=<h> last=<normalised last query>"` (plus `" end"` once answered), where `h` counts the chain
documents shown so far (in order): states with the same evidence and the same last search share a key.
"""

from __future__ import annotations

import random
import re
import string

import bm25s
import numpy as np

from envs.base import Env, check_split, split_of

# Relation -> document template; the object ({o}) always ends the sentence.
RELATIONS = {
    "born": "{s} was born in {o}.",
    "lives": "{s} lives in {o}.",
    "invented_by": "The {s} was invented by {o}.",
    "country": "{s} lies in {o}.",
    "river": "{s} lies on the {o}.",
}
# Relation -> (subject kind, object kind).
KINDS = {
    "born": ("person", "town"),
    "lives": ("person", "town"),
    "invented_by": ("invention", "person"),
    "country": ("town", "country"),
    "river": ("town", "river"),
}
# (question, chain of (subject key, relation, object key)); keys name the task's chain entities p, t, c, r, i.
ONE_HOP = [
    ("where was {p} born?", [("p", "born", "t")]),
    ("who invented the {i}?", [("i", "invented_by", "p")]),
    ("in which country is {t}?", [("t", "country", "c")]),
    ("on which river is {t}?", [("t", "river", "r")]),
]
TWO_HOP = [
    ("in which country is the town where {p} was born?", [("p", "born", "t"), ("t", "country", "c")]),
    ("on which river is the town where {p} was born?", [("p", "born", "t"), ("t", "river", "r")]),
    ("where was the inventor of the {i} born?", [("i", "invented_by", "p"), ("p", "born", "t")]),
]
DEVICES = ["lamp", "engine", "loom", "compass", "clock", "pump", "press", "kiln", "bell", "telescope"]
_ONSETS = ["b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "dr", "kr", "st", "th", "tr"]
_VOWELS = ["a", "e", "i", "o", "u"]
_CODAS = ["", "", "", "l", "n", "r", "s", "k"]
_NUM_DISTRACTORS = {0: 7, 1: 8, 2: 4}  # fresh-entity distractor documents per level (level 2 adds namesakes too)
_ACTION = re.compile(r"\b(search|answer)\[([^\[\]]*)\]", re.IGNORECASE)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans("", "", string.punctuation)
_TOKEN = re.compile(r"[a-z0-9]+")
_RESERVED = {w for doc in RELATIONS.values() for w in _TOKEN.findall(doc.lower())}  # never a name word


def normalize_answer(text: str) -> str:
    """Lowercase, drop punctuation and the articles a/an/the, collapse whitespace (SQuAD-style).

    >>> normalize_answer("The  Ostrava Vel.")
    'ostrava vel'
    """
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def _tokenize(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


class _Index:
    """BM25 (`bm25s`, Lucene variant) over one task's documents; `rank` returns doc indices with a positive score."""

    def __init__(self, corpus: list[str]):
        self.bm25 = bm25s.BM25()
        self.bm25.index([_tokenize(doc) for doc in corpus], show_progress=False)

    def rank(self, query: str, k: int = 3) -> list[int]:
        tokens = _tokenize(query)
        if not tokens:
            return []
        scores = self.bm25.get_scores(tokens)  # (num_docs,)
        order = np.argsort(-scores, kind="stable")  # ties keep corpus order
        return [int(i) for i in order[:k] if scores[i] > 0]


class _Names:
    """Random pseudo-word names; every word handed out is new within one task unless it is reused on purpose. With a
    `pool`, words are drawn from it (level 0) instead of being made up."""

    def __init__(self, rng: random.Random, pool: tuple[str, ...] | None = None):
        self.rng = rng
        self.pool = pool
        self.used: set[str] = set()

    def word(self) -> str:
        if self.pool and len(self.used) >= len(self.pool):
            raise RuntimeError(f"a task needs more than the {len(self.pool)} words of its name pool")
        while self.pool:
            w = self.rng.choice(self.pool)
            if w not in self.used:
                self.used.add(w)
                return w
        while True:
            syllables = 2 if self.rng.random() < 0.9 else 3
            r = self.rng
            w = "".join(r.choice(_ONSETS) + r.choice(_VOWELS) + r.choice(_CODAS) for _ in range(syllables))
            if w not in self.used and w not in _RESERVED:
                self.used.add(w)
                return w.capitalize()

    def entity(self, kind: str, two_word_towns: bool = False) -> str:
        if kind == "person":
            return f"{self.word()} {self.word()}"
        if kind == "town":
            return f"{self.word()} {self.word()}" if two_word_towns or self.rng.random() < 0.5 else self.word()
        if kind == "invention":
            return f"{self.word()} {self.rng.choice(DEVICES)}"
        return self.word()  # country, river

    def namesake(self, name: str) -> str:
        """A new name sharing one word with `name`: "Zorvak Telmi" -> "Zorvak Dunei", "Tarbo lamp" -> "Tarbo loom"."""
        words = name.split()
        keep = self.rng.randrange(len(words))
        if words[-1] in DEVICES and keep == 0:
            return f"{words[0]} {self.rng.choice([d for d in DEVICES if d != words[-1]])}"
        return " ".join(w if j == keep else self.word() for j, w in enumerate(words))


# Level-0 name words: one fixed pool of pseudo-words, so the tiny default's tokenizer (trained on demonstrations)
# makes each a single token and copying a name is copying tokens. With names made up per task the tiny default did not
# learn to copy them (held-out success 0.0 sampled and greedy after 300 SFT steps). Tasks combine pool words at
# random, so held-out questions still test copying, not recall.
_POOL_MAKER = _Names(random.Random("search-level-0-names"))
NAME_POOL = tuple(_POOL_MAKER.word() for _ in range(160))


def _generate(rng: random.Random, difficulty: int, split: str) -> dict | None:
    """One task from `rng`, or None when its question belongs to the other split or a ranking check fails."""
    names = _Names(rng, NAME_POOL if difficulty == 0 else None)
    two_word = difficulty == 2
    question, chain = rng.choice(ONE_HOP if difficulty == 0 else TWO_HOP)
    ent = {
        "p": names.entity("person"),
        "t": names.entity("town", two_word),
        "c": names.entity("country"),
        "r": names.entity("river"),
        "i": names.entity("invention"),
    }
    question = question.format(**ent)
    if split_of(question) != split:
        return None
    support = [(ent[s], rel, ent[o]) for s, rel, o in chain]
    countries = [ent["c"]] + [names.entity("country") for _ in range(2)]
    rivers = [ent["r"]] + [names.entity("river") for _ in range(2)]

    def fresh_fact(rel: str, subject: str | None = None) -> tuple[str, str, str]:
        s_kind, o_kind = KINDS[rel]
        obj = {"country": rng.choice(countries), "river": rng.choice(rivers)}.get(o_kind) or names.entity(o_kind)
        return (subject or names.entity(s_kind, two_word), rel, obj)

    facts = [fresh_fact(rng.choice(list(RELATIONS))) for _ in range(_NUM_DISTRACTORS[difficulty])]
    if difficulty == 2:
        p, t, i = ent["p"], ent["t"], ent["i"]
        near_towns = [names.namesake(t) for _ in range(2)]
        facts += [
            (p, "lives", near_towns[0]),  # the person's other town, and a near-namesake of the answer town
            (t, "country", ent["c"]),  # the town has both a country and a river: only one is asked
            (t, "river", ent["r"]),
            (names.namesake(p), "born", near_towns[1]),
            (names.namesake(p), "born", names.entity("town", True)),
            (names.namesake(i), "invented_by", names.namesake(p)),
            fresh_fact(rng.choice(["country", "river"]), near_towns[0]),
            fresh_fact(rng.choice(["country", "river"]), near_towns[1]),
        ]
        if chain[0][0] == "p":  # the person also invented something else
            facts.append((names.entity("invention"), "invented_by", p))
        facts = [f for f in facts if f not in support]
    facts += support
    rng.shuffle(facts)
    corpus = [RELATIONS[rel].format(s=s, o=o) for s, rel, o in facts]
    support_ids = [facts.index(f) for f in support]
    hops = [s for s, _, _ in support]

    # The expert's query at hop k must show the chain document: first at levels 0 and 1, in the top 3 at level 2.
    index = _Index(corpus)
    for query, doc in zip(hops, support_ids, strict=True):
        ranked = index.rank(query)
        if doc not in (ranked[:1] if difficulty < 2 else ranked):
            return None
    return {
        "env": "search",
        "difficulty": difficulty,
        "instruction": question,
        "answer": support[-1][2],
        "hops": hops,
        "corpus": corpus,
        "facts": [list(f) for f in facts],
        "support": support_ids,
    }


class SearchEnv(Env):
    """Multi-hop QA with `search[query]` (BM25 top 3) and `answer[text]` (exact match after normalisation)."""

    name = "search"
    action_names = ("search", "answer")
    state_keys = ("query", "documents")
    verifier = "exact_match"
    skill = (
        "Search the entity the question names; the first result states the next fact and ends with the entity to "
        "look up next; search that entity for each further hop; when a result ends with what the question asks, "
        "reply answer[<those last words>]."
    )
    max_turns = 6
    demo_version = 1  # 1: level-0 names from NAME_POOL
    # after 300 SFT steps the tiny default copied no name (held-out success 0.0 sampled and greedy); after 900:
    # 0.09 sampled, 0.48 greedy on 100 eval tasks
    tiny_sft_steps = 900

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        """`n` tasks of `split`; the question's hash (`split_of`) decides its split, so the splits never share one."""
        check_split(split)
        if difficulty not in (0, 1, 2):
            raise ValueError(f"difficulty must be 0, 1 or 2, got {difficulty!r}")
        tasks: list[dict] = []
        seen: set[str] = set()
        candidate = 0
        while len(tasks) < n:
            if candidate > 20 * n + 200:  # 1 in 5 candidates is an eval task; few fail the ranking check
                raise RuntimeError(f"only {len(tasks)} of {n} {split} tasks after {candidate} candidates")
            rng = random.Random(f"search/d{difficulty}/s{seed}/{candidate}")
            task = _generate(rng, difficulty, split)
            if task is not None and task["instruction"] not in seen:
                seen.add(task["instruction"])
                tasks.append({"task_id": f"search-d{difficulty}-s{seed}-{candidate}", **task})
            candidate += 1
        return tasks

    def reset(self, task: dict) -> str:
        self.task = task
        self.index = _Index(task["corpus"])
        self.shown: set[int] = set()
        self.last_query = ""
        self.done = self.success = False
        return f"Question: {task['instruction']}"

    @property
    def _progress(self) -> int:
        """How many chain documents, in order, have been shown so far."""
        k = 0
        while k < len(self.task["support"]) and self.task["support"][k] in self.shown:
            k += 1
        return k

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.done:
            return "error: the episode is over", 0.0, True, {"success": self.success}
        matches = _ACTION.findall(action)
        if not matches:
            return "error: no action; reply with search[query] or answer[text]", 0.0, False, {}
        verb, arg = matches[-1][0].lower(), matches[-1][1].strip()
        if not arg:
            return f"error: empty {verb}; reply with search[query] or answer[text]", 0.0, False, {}
        if verb == "answer":
            self.done = True
            self.success = normalize_answer(arg) == normalize_answer(self.task["answer"])
            return "", float(self.success), True, {"success": self.success, "answer": arg}
        self.last_query = arg
        ranked = self.index.rank(arg)
        self.shown.update(ranked)
        if not ranked:
            return "results: none", 0.0, False, {}
        corpus = self.task["corpus"]
        return "results: " + " ".join(f"({j}) {corpus[i]}" for j, i in enumerate(ranked, 1)), 0.0, False, {}

    def state_key(self) -> str:
        key = f"hop={self._progress} last={normalize_answer(self.last_query) or '-'}"
        return key + " end" if self.done else key

    def expert_action(self) -> str:
        k = self._progress
        return f"search[{self.task['hops'][k]}]" if k < len(self.task["hops"]) else f"answer[{self.task['answer']}]"

    def noisy_action(self, rng: random.Random) -> str:
        """A plausible mistake: search a wrong entity, answer a distractor's attribute, or answer the bridge entity."""
        task = self.task
        gold = normalize_answer(task["answer"])
        hops = {normalize_answer(h) for h in task["hops"]}
        others = [f for j, f in enumerate(task["facts"]) if j not in task["support"]]
        options = [f"search[{s}]" for s, _, _ in others if normalize_answer(s) not in hops]
        options += [f"answer[{o}]" for _, _, o in others if normalize_answer(o) != gold]
        if len(task["hops"]) == 2 and self._progress < 2:  # answer before the second hop: the bridge entity
            options += [f"answer[{task['hops'][1]}]"] * max(1, len(options) // 4)
        return rng.choice(options)
