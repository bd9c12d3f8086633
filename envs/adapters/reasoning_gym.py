"""reasoning-gym's procedural tasks as an environment: `environment: reasoning_gym:<task>`.

A task is one item of the package's generator (`reasoning_gym.create_dataset(<task>, seed=..., **config)[index]`): its
`question` is the first observation and the package's own `score_answer(answer, entry)` is the reward. The agent's
answer is the text inside its last `<answer>...</answer>` tags (reasoning-gym's `extract_answer`), or its whole turn
when it wrote no tags. Success is a score of 1 (the package's score for a correct answer; some tasks give partial
credit below it).

* Single turn (default): one answer, scored, the episode ends.
* Multi-turn with feedback (`attempts: N`): a wrong answer is told its score and may be answered again, up to N
  answers; the episode's reward is the score of its last answer.

`difficulty` is the level of the task's reasoning-gym curriculum (`reasoning_gym.coaching`: 0 is its easiest
setting); a task without a curriculum has only level 0, its config's defaults. `environment_kwargs` set fields of
the task's config dataclass (they win over the curriculum's), plus `attempts` and `system_prompt` (a key of
`reasoning_gym.utils.SYSTEM_PROMPTS`, sent as a system message; default none). Train and eval tasks are told apart by
a hash of the question (`envs.base.split_of`), so the splits never share a question. The expert answers with the
item's `answer` (for the tiny default's demonstrations); its plausible mistake is another item's answer.
"""

from __future__ import annotations

import dataclasses
import json
import random
import threading

import reasoning_gym
from reasoning_gym.factory import CURRICULA, DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS, extract_answer

from envs.adapters import check_kwargs, unknown_name
from envs.base import Env, check_split, split_of

#: the generator's virtual size: items are drawn by index, so this only bounds the index
VIRTUAL_SIZE = 10**7
_DATASETS: dict = {}  # (class, seed, difficulty) -> the package's generator (items are drawn by index)
_LOCK = threading.Lock()
ADAPTER_SETTINGS = {
    "attempts": "answers per episode (default 1; more makes it multi-turn, with the score as feedback)",
    "system_prompt": f"one of {sorted(SYSTEM_PROMPTS)} sent as a system message (default: none)",
}


class ReasoningGymEnv(Env):
    """One reasoning-gym task; the subclass made by `environment_class` sets `task_name`, `settings`, `attempts`."""

    name = "reasoning_gym"
    verifier = "reasoning_gym"
    action_names = ("answer",)
    task_name: str = ""
    settings: dict = {}  # fields of the task's config dataclass given in environment_kwargs
    attempts: int = 1
    system_prompt: str | None = None

    def __init__(self, difficulty: int = 0):
        super().__init__(difficulty)
        self.max_turns = self.attempts
        self.entry: dict | None = None
        self.dataset = None
        self.answers: list[str] = []
        self.done = False

    @classmethod
    def config(cls, difficulty: int) -> dict:
        """The config fields of `difficulty`: the curriculum's level, then `settings` on top."""
        fields = {}
        if cls.task_name in CURRICULA:
            curriculum = CURRICULA[cls.task_name]()
            levels = max(len(a.levels) for a in curriculum.attributes.values()) if curriculum.attributes else 1
            if not 0 <= difficulty < levels:
                raise ValueError(
                    f"difficulty {difficulty}: reasoning-gym's curriculum of {cls.task_name!r} has levels 0 to "
                    f"{levels - 1}"
                )
            curriculum.set_global_level(difficulty)
            fields = dataclasses.asdict(curriculum.generate_configuration({}))
            fields = {k: v for k, v in fields.items() if k not in ("seed", "size")}
        elif difficulty != 0:
            raise ValueError(f"difficulty {difficulty}: reasoning-gym's {cls.task_name!r} has no curriculum, only 0")
        return {**fields, **cls.settings}

    @classmethod
    def dataset_of(cls, seed: int, difficulty: int):
        """The package's generator of this task at `difficulty` (one per seed and level, made once)."""
        with _LOCK:
            key = (cls, seed, difficulty)
            if key not in _DATASETS:
                _DATASETS[key] = reasoning_gym.create_dataset(
                    cls.task_name, seed=seed, size=VIRTUAL_SIZE, **cls.config(difficulty)
                )
            return _DATASETS[key]

    @classmethod
    def make_tasks(cls, split: str, n: int, seed: int = 0, difficulty: int = 0) -> list[dict]:
        """`n` items of `split`, in generator order; an item's question decides its split."""
        check_split(split)
        dataset, tasks, index = cls.dataset_of(seed, difficulty), [], 0
        limit = 50 * n + 1000  # a task whose questions all hash to one split must not loop forever
        while len(tasks) < n and index < limit:
            if split_of(dataset[index]["question"]) == split:
                tasks.append({"task_id": f"{split}-{len(tasks)}", "seed": seed, "index": index})
            index += 1
        if len(tasks) < n:
            raise ValueError(f"reasoning_gym:{cls.task_name} gave only {len(tasks)} {split} tasks in {limit} items")
        return tasks

    def reset(self, task: dict) -> str | list[dict]:
        self.dataset = self.dataset_of(int(task.get("seed", 0)), self.difficulty)
        self.entry = self.dataset[int(task["index"])]
        self.answers, self.done = [], False
        if self.system_prompt is None:
            return self.entry["question"]
        return [{"role": "system", "content": SYSTEM_PROMPTS[self.system_prompt]},
                {"role": "user", "content": self.entry["question"]}]  # fmt: skip

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.entry is None or self.done:
            raise RuntimeError("reset(task) must start an episode before step")
        answer = extract_answer(action)
        answer = (action if answer is None else answer).strip()
        self.answers.append(answer)
        last = len(self.answers) >= self.attempts
        if not answer:
            self.done = last
            return ("error: no answer found; write the answer, or put it in <answer>...</answer>", 0.0, last,
                    {"success": False, "invalid": True, "score": 0.0})  # fmt: skip
        try:
            score = float(self.dataset.score_answer(answer, self.entry))
        except Exception as e:  # a scorer that chokes on odd text scores it 0, as a wrong answer
            score, error = 0.0, f"{type(e).__name__}: {e}"
        else:
            error = None
        success = score >= 1.0
        self.done = success or last
        info = {"success": success, "score": score, **({"score_error": error} if error else {})}
        if self.done:
            return ("correct" if success else f"wrong (score {score:.2f})"), score, True, info
        return f"wrong (score {score:.2f}); try again", 0.0, False, info

    def state_key(self) -> str:
        return json.dumps(self.answers)

    def expert_action(self) -> str:
        return str(self.entry["answer"])

    def noisy_action(self, rng: random.Random) -> str:
        """Another item's answer: the right kind of answer to the wrong question."""
        return str(self.dataset[rng.randrange(VIRTUAL_SIZE)]["answer"])


def environment_class(name: str, kwargs: dict) -> type[ReasoningGymEnv]:
    """The environment class of reasoning-gym task `name` with `kwargs`; a wrong name or field stops here."""
    spec = f"reasoning_gym:{name}"
    if name not in DATASETS:
        listed = f"{len(DATASETS)} tasks: python -c 'import reasoning_gym.factory as f; print(sorted(f.DATASETS))'"
        raise unknown_name(spec, "reasoning-gym has no task", name, DATASETS, listed)
    config_cls = DATASETS[name][1]
    fields = {f.name: f"{config_cls.__name__}.{f.name}" for f in dataclasses.fields(config_cls)}
    fields.pop("seed", None), fields.pop("size", None)  # the adapter draws tasks by seed and index
    check_kwargs(spec, kwargs, {**fields, **ADAPTER_SETTINGS})
    attempts = kwargs.pop("attempts", 1)
    system_prompt = kwargs.pop("system_prompt", None)
    if not isinstance(attempts, int) or attempts < 1:
        raise SystemExit(f"error: environment_kwargs attempts must be a positive integer, got {attempts!r}")
    if system_prompt is not None and system_prompt not in SYSTEM_PROMPTS:
        raise SystemExit(f"error: environment_kwargs system_prompt {system_prompt!r}: one of {sorted(SYSTEM_PROMPTS)}")
    try:  # the package's own validation of the config, at start-up
        config_cls(**kwargs).validate() if hasattr(config_cls, "validate") else config_cls(**kwargs)
    except (AssertionError, TypeError, ValueError) as e:
        raise SystemExit(f"error: environment_kwargs {kwargs} are not a valid {config_cls.__name__}: {e}") from e
    return type(
        f"ReasoningGym_{name}",
        (ReasoningGymEnv,),
        {"name": spec, "task_name": name, "settings": kwargs, "attempts": attempts, "system_prompt": system_prompt},
    )
