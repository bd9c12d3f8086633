"""The first generation batch of each trainer that gathers across processes, for tests/test_distributed_trainers.py
(not a test itself):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 tests/distributed_trainers_run.py FOLDER OUT NAME...

Every process writes OUT/<name>/rank<r>.json: for each of its rows, keyed by the row's index in the global batch, the
advantages `compute_advantages` gave its model tokens. The global batch is 3 tasks x G = 4 in dataset order (rank 0
holds rows 0-5 with 2 processes: the second task's group straddles the two), so one process and two see the same
rows.

The episodes must not depend on how the batch is split, so nothing here samples from a global random state: every
environment writes its row's global index into its observations (so the contexts of a group's rows part after the
first turn), and the policy picks each turn from a hash of its context (the expert's action or a mistake). AlignOPSD's
free teacher generation is replaced the same way (the expert's word after its context). The trained model is the tiny
random one, whose forwards give the log-probs every method reads.
"""

import hashlib
import json
import os
import random
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path[:0] = [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.path.dirname(__file__)]

import torch  # noqa: E402
from conftest import WORDS, EchoEnv  # noqa: E402
from datasets import Dataset  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from envs.shop import ShopEnv  # noqa: E402
from tests.helpers.analyzer import Scripted  # noqa: E402
from tests.helpers.draco import shadow_shop  # noqa: E402
from trainers import TRAINERS, agent_loop, generation  # noqa: E402
from trainers.funnel_state import Entry, State, render_state  # noqa: E402

G = 4
GLOBAL_BATCH = 3 * G  # 3 tasks: with 2 processes the second task's group straddles them
P_EXPERT = 0.6


def context_rng(ids) -> random.Random:
    return random.Random(hashlib.sha256(json.dumps(list(map(int, ids))).encode()).hexdigest())


class RowEcho(EchoEnv):
    """EchoEnv whose observations carry the row's global index (`row 5: say apple`)."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def step(self, action):
        observation, reward, done, info = super().step(action)
        return (f"row {self.index}: {observation}" if observation else observation), reward, done, info


class RowShop(ShopEnv):
    """ShopEnv whose observations carry the row's global index."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def step(self, action):
        observation, reward, done, info = super().step(action)
        return f"[row {self.index}] {observation}", reward, done, info


def echo_policy(model, tokenizer, **kwargs):
    """The word the context's last observation asks for with probability P_EXPERT, else another, by the context."""

    def generate(contexts, max_new_tokens):
        out = []
        for ctx in contexts:
            asked = tokenizer.decode(ctx).rsplit("say ", 1)[-1].split("<|im_end|>")[0].strip()
            rng = context_rng(ctx)
            word = asked if rng.random() < P_EXPERT else rng.choice([w for w in WORDS if w != asked])
            ids = tokenizer(word, add_special_tokens=False)["input_ids"][: max_new_tokens - 1] + [
                tokenizer.eos_token_id
            ]
            out.append((ids, [-1.0] * len(ids)))
        return out

    return generate


def shop_policy(tasks):
    """The shop's expert action after the context's actions (replayed in a shadow shop) with probability P_EXPERT,
    else a plausible mistake, by the context."""
    by_instruction = {t["instruction"]: t for t in tasks}

    def factory(model, tokenizer, **kwargs):
        def generate(contexts, max_new_tokens):
            out = []
            for ctx in contexts:
                env = shadow_shop(tokenizer.decode(ctx), by_instruction)
                rng = context_rng(ctx)
                action = env.expert_action() if rng.random() < P_EXPERT else env.noisy_action(rng)
                ids = tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                out.append((ids, [-1.0] * len(ids)))
            return out

        return generate

    return factory


def teacher_words(model, contexts, max_new_tokens, eos, *args, **kwargs):
    """AlignOPSD's free teacher generation, by the context: one token id drawn from a hash of the context, then the
    end."""
    return [[context_rng(c).randrange(5, 60), eos[0]][:max_new_tokens] for c in contexts]


def echo_data():
    tasks = EchoEnv.make_tasks("train", 3)
    return [
        {"prompt": EchoEnv().reset(t), "task": json.dumps(t), "task_id": t["task_id"],
         "hint": f"Say {', then '.join(t['words'])}, one word per turn."}
        for t in tasks
    ]  # fmt: skip


def shop_data():
    tasks = ShopEnv.make_tasks("train", 3, seed=0)
    return [{"prompt": ShopEnv().reset(t), "task": json.dumps(t), "task_id": t["task_id"]} for t in tasks], tasks


def run(name: str, folder: str, out_dir: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer_cls, config_cls = TRAINERS[name]
    fields = dict(
        output_dir=out_dir, per_device_train_batch_size=GLOBAL_BATCH // world, num_generations=G,
        max_completion_length=60, max_turn_tokens=4, learning_rate=1e-2, report_to="none", seed=0, bf16=False,
        use_cpu=True, activation_checkpointing=False, save_strategy="no", logging_steps=1, max_steps=1,
        disable_dropout=True, shuffle_dataset=False, disable_tqdm=True,
    )  # fmt: skip
    kwargs, env_cls = {}, RowEcho
    rows, policy = echo_data(), echo_policy
    if name == "draco":
        rows, tasks = shop_data()
        fields.update(max_completion_length=400, max_turn_tokens=64, max_turns=6)
        env_cls, policy = RowShop, shop_policy(tasks)
    elif name == "taspo":
        kwargs["analyzer"] = Scripted()
    elif name == "alignopsd":
        fields.update(alignopsd_pi="column:hint", alignopsd_match_on="action", alignopsd_teacher_max_tokens=4)
    agent_loop.hf_generate = policy
    generation.sample_continuations = teacher_words
    import trainers.alignopsd

    trainers.alignopsd.sample_continuations = teacher_words
    indices: list[int] = []
    real_rollouts = agent_loop.trainer_rollouts

    def rollouts(prompts, trainer, batch_rows):  # each row's environment learns the row's global index
        start = trainer.accelerator.process_index * len(batch_rows)
        indices[:] = range(start + len(batch_rows) - 1, start - 1, -1)
        return real_rollouts(prompts, trainer, batch_rows)

    agent_loop.trainer_rollouts = rollouts
    tokenizer = AutoTokenizer.from_pretrained(folder, padding_side="left")
    trainer = trainer_cls(
        model=folder, args=config_cls(**fields), train_dataset=Dataset.from_list(rows), processing_class=tokenizer,
        env_factory=lambda row: env_cls(indices.pop()) if indices else env_cls(-1), **kwargs,
    )  # fmt: skip
    if name == "funnel":  # the consolidation trainer as its loop hands it over
        state = State([Entry("E1", "Repeat the word you are asked for, exactly.")], 3)
        trainer.selection = {row["task_id"]: 1.0 for row in rows}
        trainer.state_block = lambda row: render_state(state)
    first: dict[str, list[float]] = {}
    compute = trainer.compute_advantages

    def capture(batch):
        advantages = compute(batch)
        if not first:
            B = advantages.shape[0]
            mask = batch.mask.bool()
            for b in range(B):
                first[str(trainer.accelerator.process_index * B + b)] = advantages[b][mask[b]].tolist()
        return advantages

    trainer.compute_advantages = capture
    torch.manual_seed(0)
    trainer.train()
    rank = trainer.accelerator.process_index
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"world": trainer.accelerator.num_processes, "advantages": first}, f)
    agent_loop.trainer_rollouts = real_rollouts


def main(folder: str, out: str, names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names:
        run(name, folder, os.path.join(out, name))


if __name__ == "__main__":
    from agent_trl.resume import close_process_group

    main(sys.argv[1], sys.argv[2], sys.argv[3:])
    close_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # the results are written: skip interpreter shutdown, where C++ thread teardown can still abort
