"""The embedded default agent: `model_name_or_path: tiny:<env>` or `tiny-moe:<env>`, built offline in seconds.

What `tiny_model("tiny:shop")` does, once per distinct setting (then it is read from the cache folder):

1. plays the environment's expert, with per-turn noise, on training tasks to get demonstrations;
2. trains a byte-level BPE tokenizer on their text with the Qwen2 pipeline (so `AutoTokenizer` reloads it with
   identical ids), adds the chat and tool tokens, and a short Qwen2.5-style chat template with `{% generation %}`
   marks so SFT trains assistant turns only;
3. builds a tiny Qwen2 (dense) or Qwen3-MoE model (`tiny-moe:`: 8 experts, top-2) from its config;
4. warm-starts it with TRL's `SFTTrainer` on the noisy demonstrations, so that it succeeds on some tasks but not most;
5. saves model and tokenizer into one folder, keyed by a hash of every setting above, and returns its path.

The cache lives in `$AGENT_TRL_CACHE` (default `~/.cache/agent-trl`). The repository ships the builds of
`SHIPPED_BUILDS` in `envs/shipped/`, each under its cache name: the quickstart's default (`tiny:shop`, every setting at
its default), the guidance-reading builds of the terminal's and the shop's level 2 (the teacher recipes') and the
level-2 defaults of the shop and of search. An empty cache is filled from such a copy instead of building (a first
quickstart skips 300 SFT steps). A recipe change changes the key, so a stale copy is never used;
`tests/test_tiny_shipped.py` checks that every copy matches its current key and, slow-marked, that a rebuild
reproduces the default (byte for byte, or, where SFT's float reductions differ between CPUs, in held-out success).
Building a level-0 default takes 2-5 minutes on two CPU cores; a long level's (2000 SFT steps,
`Env.tiny_level_sft_steps`) 30-90 minutes, by the CPU (search level 2: 71 and 85 minutes alone on two threads, two
machines; bench/results/level_mix/, search_level2/), and one that reads guidance longer (shop level 2: 134 minutes,
bench/results/shop_level2_guided/).
Demonstrations are noisy on purpose: with probability `noise` (0.3; a level may set its own, `Env.tiny_level_noise`)
a turn takes the environment's `noisy_action` (a plausible mistake) instead of the expert's, so SFT alone imitates
the mistakes in its sampling distribution and RL has something to remove (see the project's notes on measuring RL
gains honestly).

Your own environment (`environment: package.module:Class` with `model_name_or_path: tiny`; in the library
`tiny_model("tiny:package.module:Class", env_kwargs=...)`) is built the same way, from the class's own expert
(`expert_action` and `noisy_action`, as `envs.base.Env` defines them), played on environments built as the run
builds them (`envs.sources.load_environment`, with `environment_kwargs`) on the class's `make_tasks("train", ...)`
tasks, or on the dataset's rows when the run gives its tasks by dataset. Its key adds a hash of the file that defines
the class (an edited class rebuilds) and `environment_kwargs`; a dataset's tasks add a hash of them to the folder's
name. A class without an expert stops before the build with what it needs. Every folder records the environment it
was built for in `tiny_spec.json` (`env`, `env_kwargs`), which `built_for` reads back.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import random
import re
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from envs.base import Env, noisy_expert_episode, skill_card

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    '{{- \'\\n</tools>\\nCall a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\\n\' }}'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{% generation %}"
    "{{- message.content if message.content else '' }}"
    "{%- if message.tool_calls %}{%- for tc in message.tool_calls %}"
    "{{- '<tool_call>\\n' + ({'name': tc.function.name, 'arguments': tc.function.arguments} | tojson)"
    " + '\\n</tool_call>' }}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{% endgeneration %}"
    "{{- '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"]


@dataclass(frozen=True)
class TinySpec:
    """Every setting that changes the built folder; its hash names the cache entry."""

    env: str
    moe: bool = False
    difficulty: int = 0
    hidden_size: int = 128  # 64 did not learn to copy an item id in 300 SFT steps (held-out greedy success 0)
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 256
    num_experts: int = 8
    experts_per_token: int = 2
    max_positions: int = 1024
    vocab_size: int = 1024
    num_demos: int = 2000
    noise: float = 0.3
    sft_steps: int = 300
    sft_batch_size: int = 32
    sft_lr: float = 3e-3
    seed: int = 0
    version: int = 2  # bump when the build recipe or an environment's text changes
    #: share of demonstrations whose first user message also holds the task's privileged text (`Env.privileged`,
    #: after a blank line) and whose actions follow it without noise: a model that can read a teacher's context
    #: (docs/methods/beta-opsd.md §4). Left out of the cache key while 0, so earlier builds keep their keys.
    privileged_frac: float = 0.0
    #: share of demonstrations played without noise under a system message that guides them (`guidance_block`: the
    #: expert's plan, the environment's skill card, or rules as TASPO's oracle analyzer writes them): a model whose
    #: teacher pass, with that block in the system message, prefers the expert's actions (docs/methods/taspo.md,
    #: alignopsd.md). Left out of the cache key while 0, so earlier builds keep their keys.
    guidance_frac: float = 0.0

    #: the environment's settings (environment_kwargs) as sorted JSON, for an ecosystem environment whose tasks they
    #: define (`envs/adapters/`); left out of the cache key while empty, so earlier builds keep their keys
    env_kwargs: str = ""
    #: split `[` from the word after it in the tokenizer's pre-tokenizer (`build_tokenizer`), so that a word typed
    #: inside an action's brackets (`checkout[fig]`) is the token it is where an observation shows it (`[fig]`,
    #: after a space); left out of the cache key while False, so earlier builds keep their keys
    split_brackets: bool = False

    @classmethod
    def parse(cls, name: str, **overrides) -> TinySpec:
        kind, _, env = name.partition(":")
        if kind not in ("tiny", "tiny-moe") or not env:
            raise ValueError(f"model_name_or_path {name!r}: expected 'tiny:<env>' or 'tiny-moe:<env>'")
        env_cls = cls(env=env, **overrides).env_class()
        # an environment may need a longer warm start (`tiny_sft_steps`), and a level its own steps, share under
        # guidance or noise (`tiny_level_*`); an explicit value wins
        level = overrides.get("difficulty", 0)
        for field, attr, default in (("sft_steps", "tiny_level_sft_steps", getattr(env_cls, "tiny_sft_steps", None)),
                                     ("guidance_frac", "tiny_level_guidance_frac", None),
                                     ("noise", "tiny_level_noise", None)):  # fmt: skip
            value = getattr(env_cls, attr, {}).get(level, default)
            if value is not None:
                overrides.setdefault(field, value)
        transport = getattr(env_cls, "transport_settings", ())  # how episodes run (e.g. over a server), not what
        if overrides.get("env_kwargs") and transport:  # they are: one build for both, its demonstrations in-process
            settings = {k: v for k, v in json.loads(overrides["env_kwargs"]).items() if k not in transport}
            overrides["env_kwargs"] = json.dumps(settings, sort_keys=True) if settings else ""
        return cls(env=env, moe=kind == "tiny-moe", **overrides)

    def env_class(self) -> type | None:
        """The environment the demonstrations come from: a built-in or ecosystem `Env` class, or the class an import
        path names, as written (None: not a known environment)."""
        from envs import environment_class
        from envs.sources import import_object

        if is_import_path(self.env):
            return import_object(self.env, "environment")
        return environment_class(self.env, json.loads(self.env_kwargs) if self.env_kwargs else None)

    def key(self) -> str:
        """Hash of the settings, of the environment's `demo_version` (its `level_demo_versions` entry for the level
        when it has one; left out while 0, so keys made before it existed stay valid) and, for a class named by import
        path, of the file that defines it."""
        settings = asdict(self)
        for optional in ("privileged_frac", "guidance_frac", "env_kwargs", "split_brackets"):
            if not settings[optional]:
                del settings[optional]
        env_cls = self.env_class()
        demo_version = getattr(env_cls, "demo_version", 0)
        demo_version = getattr(env_cls, "level_demo_versions", {}).get(self.difficulty, demo_version)
        if demo_version:
            settings["demo_version"] = demo_version
        if is_import_path(self.env):  # an edited class (its text, its expert) rebuilds
            settings["source"] = hashlib.sha256(Path(inspect.getfile(env_cls)).read_bytes()).hexdigest()[:16]
        return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def is_tiny(name: str | None) -> bool:
    return bool(name) and name.split(":", 1)[0] in ("tiny", "tiny-moe")


def is_import_path(env: str | None) -> bool:
    """Whether an environment name is an import path (`package.module:Class`), not a built-in or ecosystem name."""
    from envs import ENVIRONMENTS
    from envs.adapters import is_adapter_spec

    return bool(env) and env not in ENVIRONMENTS and not is_adapter_spec(env) and ("." in env or ":" in env)


def environment_id(env: str | None) -> str | None:
    """The name of an environment as a tiny default records it: an import path as `package.module:Class` (the
    `package.module.Class` spelling names the same class), any other name as given; None for no environment."""
    if env is None or not is_import_path(env) or ":" in env:
        return env
    module, _, attr = env.rpartition(".")
    return f"{module}:{attr}"


def built_for(folder: str) -> str | None:
    """The environment a model folder's tiny default was built for (its `tiny_spec.json`; `dataset` for
    `tiny_dataset_model`), or None when the folder is not one built here."""
    path = Path(os.path.expanduser(folder)) / "tiny_spec.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get("env")
    except (OSError, ValueError):
        return None


def cache_root() -> Path:
    return Path(os.environ.get("AGENT_TRL_CACHE", Path.home() / ".cache" / "agent-trl"))


def demonstrations(
    env_cls: type[Env],
    n: int,
    seed: int,
    difficulty: int,
    noise: float,
    privileged_frac: float = 0.0,
    guidance_frac: float = 0.0,
) -> list[list[dict]]:
    """`n` chat transcripts of the expert on training tasks; each turn is a `noisy_action` with probability `noise`.
    With `privileged_frac` > 0 that share of them (drawn with their own generator) shows the task's privileged text
    after the first observation and follows it without noise; with `guidance_frac` > 0 that share of the others
    follows the expert without noise under a system message of guidance (`guidance_block`)."""
    tasks = env_cls.make_tasks("train", n, seed=seed, difficulty=difficulty)
    return played_demonstrations(
        lambda task: env_cls(difficulty=difficulty), tasks, seed, noise, privileged_frac, guidance_frac
    )


#: the kinds of guidance a guidance demonstration shows, one drawn per demonstration (`guidance_block`)
GUIDANCE_FORMS = ("plan", "skill", "rules")


def guidance_block(env: Env, first: str, transcript: list[dict], rng: random.Random) -> str:
    """A system message for a demonstration of the expert that followed it, in one of the forms the teacher methods
    put in their teacher's context (drawn from those the environment has): `plan`, the expert's actions in order as
    `Env.privileged` writes them (β-OPSD, docs/methods/beta-opsd.md D8); `skill`, the environment's skill card as
    AlignOPSD shows it (alignopsd.md D6); `rules`, TASPO's block as its oracle analyzer and `compose` write it
    (taspo.md Eq. 6, D15), of a random part of the episode's turns (each kept with probability 3/4, at least one), as
    TASPO's match keeps the items whose conditions a rollout's path shows. "" when the environment has none."""
    from rewards.analyzer import compose, expert_items

    turns = [(t["action"], t["observation"]) for t in transcript]
    forms = [f for f in GUIDANCE_FORMS if f != "skill" or env.skill.strip()]
    form = rng.choice(forms)
    if form == "plan":
        return "Plan: " + " | ".join(action.strip() for action, _ in turns)
    if form == "skill":
        return skill_card(env.skill)
    items = expert_items(first, turns)
    kept = [e for e in items if rng.random() < 0.75] or [rng.choice(items)]
    return compose(kept, lambda text: 0)  # at most 12 short lines: no token cap (the tokenizer is not built yet)


def played_demonstrations(
    make_env: Callable[[dict], Env],
    tasks: list[dict],
    seed: int,
    noise: float,
    privileged_frac: float = 0.0,
    guidance_frac: float = 0.0,
) -> list[list[dict]]:
    """`demonstrations` on given tasks, each played on `make_env(task)` (e.g. `EnvironmentSource.factory`)."""
    rng, picks, guides = random.Random(seed), random.Random(seed + 1), random.Random(seed + 2)
    demos = []
    for task in tasks:
        env = make_env(task)
        block = env.privileged(task) if privileged_frac and picks.random() < privileged_frac else None
        guided = not block and bool(guidance_frac) and guides.random() < guidance_frac
        first, transcript, done = noisy_expert_episode(env, task, 0.0 if block or guided else noise, rng)
        system = guidance_block(env, first, transcript, guides) if guided and done and transcript else ""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": f"{first}\n\n{block}" if block else first})
        for k, turn in enumerate(transcript):
            messages.append({"role": "assistant", "content": turn["action"]})
            if not (done and k == len(transcript) - 1):
                messages.append({"role": env.observation_role, "content": turn["observation"]})
        demos.append(messages)
    return demos


#: environment sources whose games come from another package: a user cannot add an expert to them
ECOSYSTEM_SOURCES = ("textarena", "reasoning_gym", "gymnasium", "verifiers")


def check_expert(env_cls: type[Env], name: str, difficulty: int, n: int = 20) -> None:
    """Stop before a build whose demonstrations would teach nothing: the environment has no expert, or its expert
    (without noise) succeeds on none of `n` training tasks within the turn budget."""
    tasks = env_cls.make_tasks("train", n, seed=0, difficulty=difficulty)
    check_played_expert(lambda task: env_cls(difficulty=difficulty), tasks, name)


def check_played_expert(make_env: Callable[[dict], Env], tasks: list[dict], name: str) -> None:
    """`check_expert` on given tasks, each played on `make_env(task)`; the expert must also have its plausible
    mistake (`noisy_action`), which the noisy demonstrations play."""
    wins = 0
    for i, task in enumerate(tasks):
        env = make_env(task)
        env.reset(task)
        for turn in range(env.max_turns):
            try:
                if i == turn == 0:  # one probe: the noisy demonstrations take it on a share of the turns
                    env.noisy_action(random.Random(0))
                action = env.expert_action()
            except NotImplementedError as e:
                yours = str(getattr(env, "name", "")).partition(":")[0] not in ECOSYSTEM_SOURCES  # a user class
                fix = (
                    "give your class an expert, as envs.base.Env defines it: expert_action(self) -> str (the right "
                    "next action in the current state) and noisy_action(self, rng) -> str (a plausible mistake); or "
                    if yours
                    else ""
                )
                raise SystemExit(
                    f"error: model_name_or_path {name!r}: the tiny default learns from an expert's demonstrations, "
                    f"and {env.name} has none{f' ({e})' if str(e) else ''}. To train on it, {fix}use a real model: "
                    "--model_name_or_path smollm2 (SmolLM2-135M-Instruct, installed by `make setup`, with "
                    "--use_peft true and a --system_prompt that states the action format; configs/"
                    "smollm2_guess_the_number.yaml is such a recipe), a model folder, or a Hub id"
                ) from e
            _, _, done, info = env.step(action)
            if done:
                wins += bool(info.get("success"))
                break
    if wins == 0:
        raise SystemExit(
            f"error: model_name_or_path {name!r}: {env.name}'s expert succeeded on none of {len(tasks)} training "
            f"tasks within {env.max_turns} turns, so its demonstrations would teach nothing; name a model folder "
            "or a Hub id, or raise the environment's turn budget"
        )


def build_tokenizer(texts: list[str], vocab_size: int = 1024, split_brackets: bool = False):
    """Byte-level BPE with the Qwen2 normaliser and pre-tokeniser, wrapped as a fast tokenizer with a chat template.
    The Qwen2 pre-tokeniser joins one non-letter to the letters after it (`checkout[fig]` -> `checkout`, `[fig`, `]`);
    `split_brackets` first cuts `[` off on its own (`checkout`, `[`, `fig`, `]`)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    splits = [pre_tokenizers.Split(Regex(r"\["), behavior="isolated", invert=False)] if split_brackets else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        splits
        + [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        truncation_side="left",
        chat_template=CHAT_TEMPLATE,
    )
    fast.add_tokens(TOOL_TOKENS)  # non-special, as in Qwen: they survive decode(skip_special_tokens=False)
    return fast


def demonstration_tokenizer(demos: list[list[dict]], spec: TinySpec):
    """The tokenizer of a tiny build, trained on its demonstrations' text and the chat template."""
    # the role words are repeated so that each becomes one token (short sequences are fast sequences)
    texts = [CHAT_TEMPLATE] + ["user\nassistant\nsystem\ntool\n"] * 200 + [m["content"] for d in demos for m in d]
    return build_tokenizer(texts, spec.vocab_size, spec.split_brackets)


def build_model(spec: TinySpec, tokenizer):
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config, Qwen3MoeConfig

    common = dict(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=max(1, spec.num_heads // 2),
        max_position_embeddings=spec.max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    if spec.moe:
        config = Qwen3MoeConfig(
            **common,
            head_dim=spec.hidden_size // spec.num_heads,
            intermediate_size=spec.intermediate_size,
            moe_intermediate_size=spec.intermediate_size // 2,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.experts_per_token,
            norm_topk_prob=True,
        )
    else:
        config = Qwen2Config(**common, intermediate_size=spec.intermediate_size)
    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True, max_new_tokens=32
    )
    return model


def sft(model, tokenizer, demos: list, spec: TinySpec, output_dir: str, **config):
    """Warm start with TRL's SFTTrainer on assistant turns only. `demos` are chat transcripts (message lists), or
    dataset rows (`{"messages": ...}` or `{"prompt": text, "completion": text}`, the loss on the completion only).
    `config`: `SFTConfig` fields that replace the recipe's (e.g. `save_strategy="steps"` to keep checkpoints)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    recipe = dict(
        output_dir=output_dir,
        max_steps=spec.sft_steps,
        per_device_train_batch_size=spec.sft_batch_size,
        learning_rate=spec.sft_lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=10,
        assistant_only_loss=not (demos and isinstance(demos[0], dict) and "completion" in demos[0]),
        max_length=spec.max_positions,
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        seed=spec.seed,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        activation_checkpointing=False,
        disable_tqdm=False,
    )
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**{**recipe, **config}),
        train_dataset=Dataset.from_list([d if isinstance(d, dict) else {"messages": d} for d in demos]),
        processing_class=tokenizer,
    )
    trainer.train()
    return trainer.model


def build_and_save(spec: TinySpec, tokenizer, demos: list, folder: Path) -> None:
    """Build the model of `spec`, SFT it on `demos` (none: the random initialisation is saved) and move the saved
    folder into place atomically (a crash never leaves a half-written cache entry; a concurrent builder that finished
    first wins)."""
    model = build_model(spec, tokenizer)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        if demos:
            print(
                f"building the tiny default once: {spec.sft_steps} SFT steps on {len(demos)} demonstrations (the bar "
                f"below), then cached in {folder}",
                flush=True,
            )
            try:
                model = sft(model, tokenizer, demos, spec, output_dir=os.path.join(tmp, "sft"))
            except KeyboardInterrupt:
                raise SystemExit(
                    "interrupted while building the tiny default: nothing was cached (a build is moved into the "
                    "cache only when it is complete); run the same command again to build it"
                ) from None
        staging = Path(tmp) / "model"
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2))
        try:
            os.replace(staging, folder)
        except OSError:
            if not (folder / "model.safetensors").exists():
                raise


#: builds the repository ships, each in a folder named as its cache entry
SHIPPED = Path(__file__).resolve().parent / "shipped"
#: what is in SHIPPED, as (name, settings) of `TinySpec.parse`: the quickstart's default; the build of the
#: terminal's long checklists (level 2, 2000 SFT steps) that reads guidance, which `taspo_terminal.yaml` and
#: `alignopsd_terminal.yaml` train from; the same for the shop's level 2 (`tiny_guidance_frac: 0.5`, the shop's teacher
#: recipes at `difficulty: 2`; 2000 SFT steps, 134 minutes on two CPU cores shared part of the time with a training
#: run, bench/results/shop_level2_guided); and the level-2 defaults of the shop and of search, which the runs of
#: bench/results/shop_level2 and search_level2 start from. Each long-level copy saves its users a build of an hour or
#: more on two CPU cores
SHIPPED_BUILDS = (
    ("tiny:shop", {}),
    ("tiny:terminal", {"difficulty": 2, "guidance_frac": 0.5}),
    ("tiny:shop", {"difficulty": 2}),
    ("tiny:shop", {"difficulty": 2, "guidance_frac": 0.5}),
    ("tiny:search", {"difficulty": 2}),
)


def shipped_build(name: str = "tiny:shop", **settings) -> Path:
    """The repository's copy of the build `name` with `settings` (an entry of SHIPPED_BUILDS; default: the
    quickstart's), as `tiny_model` names its cache folder."""
    return SHIPPED / folder_name(name, TinySpec.parse(name, **settings))


def folder_name(name: str, spec: TinySpec) -> str:
    """The cache folder's name of `name`'s build with `spec` (a dataset's tasks add their hash to it)."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '-', name)}-{spec.key()}"


def install_shipped(folder: Path) -> None:
    """Copy the shipped build named like `folder` into the cache, atomically (as `build_and_save` moves a build)."""
    import shutil

    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder.parent) as tmp:
        staging = Path(tmp) / "model"
        shutil.copytree(SHIPPED / folder.name, staging)
        try:
            os.replace(staging, folder)
        except OSError:
            if not (folder / "model.safetensors").exists():
                raise


def tiny_model(name: str, difficulty: int = 0, seed: int = 0, tasks: list[dict] | None = None, **overrides) -> str:
    """Folder of the tiny default for `name` ("tiny:shop", "tiny-moe:search", "tiny:package.module:Class", ...),
    built if not cached. `tasks`: the training tasks to play the expert on when the environment has no `make_tasks`
    (a run's dataset rows; cycled up to `num_demos`), a hash of them in the folder's name."""
    from envs import ENVIRONMENTS
    from envs.sources import load_environment

    spec = TinySpec.parse(name, difficulty=difficulty, seed=seed, **overrides)
    if spec.env_class() is None:
        raise ValueError(
            f"model_name_or_path {name!r}: unknown environment {spec.env!r}; known: {sorted(ENVIRONMENTS)}, the "
            "ecosystem's (tiny:reasoning_gym:<task>, tiny:textarena:<game>, tiny:gymnasium:<env id>, ...) and "
            "import paths (tiny:package.module:Class)"
        )
    # the environments are built as a run builds them (a built-in or ecosystem one exactly as `spec.env_class()`)
    source = load_environment(spec.env, json.loads(spec.env_kwargs) if spec.env_kwargs else None, spec.difficulty)
    name_of_folder = folder_name(name, spec)
    if tasks is not None:
        tasks = [tasks[i % len(tasks)] for i in range(spec.num_demos)]
        name_of_folder += (
            "-" + hashlib.sha256(json.dumps(tasks, sort_keys=True, default=str).encode()).hexdigest()[:16]
        )
    elif source.make_tasks is None:
        raise ValueError(
            f"model_name_or_path {name!r}: {spec.env} has no make_tasks; pass its training tasks (a dataset's rows)"
        )
    folder = cache_root() / "tiny" / name_of_folder
    if (folder / "model.safetensors").exists():
        return str(folder)
    if (SHIPPED / folder.name / "model.safetensors").exists():  # the repository's copy of this exact build
        install_shipped(folder)
        return str(folder)
    if tasks is None:
        check = source.make_tasks("train", 20, seed=0, difficulty=spec.difficulty)
        tasks = source.make_tasks("train", spec.num_demos, seed=spec.seed, difficulty=spec.difficulty)
    else:
        check = tasks[:20]
    check_played_expert(source.factory, check, name)
    demos = played_demonstrations(
        source.factory, tasks, spec.seed, spec.noise, spec.privileged_frac, spec.guidance_frac
    )
    build_and_save(spec, demonstration_tokenizer(demos, spec), demos, folder)
    return str(folder)


#: dataset columns a tiny default for a dataset is warm-started on, the first present wins
REFERENCE_COLUMNS = ("completion", "answer", "solution")
#: bump when `tiny_dataset_model`'s recipe changes: it is part of the cache key, with the settings and the rows
DATASET_RECIPE_VERSION = 1


def _text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


def tiny_dataset_model(rows: list[dict], seed: int = 0, **overrides) -> str:
    """`model_name_or_path: tiny` with a dataset: a tokenizer trained on the rows' text, a tiny Qwen2, warm-started by
    SFT on the rows' reference (`REFERENCE_COLUMNS`; without one, or with `sft_steps=0`, left at its random
    initialisation), cached like `tiny_model` under a key of the settings and the rows. Pass training rows only: what
    SFT sees is not held out.

    Like the environments' demonstrations, the references are noisy: with probability `noise` (0.3) a row is trained
    on another row's answer. A conversational prompt is trained as a chat (assistant turn only); a text prompt as
    prompt and completion (an end of sequence appended), matching how TRL renders each kind for generation.
    """
    # a row trains one or two answer tokens, an environment demonstration about 30: batches 8x larger than the
    # environments' (32) give SFT comparable signal per step (on data/arith.jsonl, 1500 steps of 32 rows left the
    # model near chance; README, the dataset quickstart)
    overrides.setdefault("sft_steps", 300)
    overrides.setdefault("sft_batch_size", 256)
    spec = TinySpec(env="dataset", seed=seed, **overrides)
    column = next((c for c in REFERENCE_COLUMNS if c in rows[0]), None)
    rows = rows[: spec.num_demos]
    data = {"recipe": DATASET_RECIPE_VERSION, "rows": [[r["prompt"], r.get(column)] for r in rows]}
    data_key = hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]
    folder = cache_root() / "tiny" / f"tiny-dataset-{spec.key()}-{data_key}"
    if (folder / "model.safetensors").exists():
        return str(folder)
    demos = []
    if column is not None and spec.sft_steps > 0:
        rng = random.Random(spec.seed)
        references = [str(r[column]) for r in rows]
        for r in rows:
            # as the environments' noisy experts: with probability `noise` another row's answer, a plausible mistake
            # that SFT imitates in its sampling distribution and RL can remove
            answer = rng.choice(references) if rng.random() < spec.noise else str(r[column])
            if isinstance(r["prompt"], str):
                demos.append({"prompt": r["prompt"], "completion": answer})
            else:
                demos.append({"messages": [*r["prompt"], {"role": "assistant", "content": answer}]})
    texts = [CHAT_TEMPLATE] + ["user\nassistant\nsystem\ntool\n"] * 200
    texts += [_text(r["prompt"]) for r in rows] + ([str(r[column]) for r in rows] if column else [])
    tokenizer = build_tokenizer(texts, spec.vocab_size, spec.split_brackets)
    build_and_save(spec, tokenizer, demos, folder)
    return str(folder)
