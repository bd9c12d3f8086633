"""Layer 4: `AgentGRPOTrainer` is a drop-in for `trl.GRPOTrainer`. It takes TRL's parameters in TRL's order, a plain
`GRPOConfig` or none, TRL's reward sources with TRL's errors, and refuses a second rollout source next to
`env_factory`. Expected values come from TRL itself (its signature, its error, its default config), never from ours."""

import copy
import inspect
import math
from dataclasses import MISSING, dataclass, fields
from pathlib import Path

import pytest
import transformers.training_args
from conftest import CPU_ARGS, EchoEnv
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from rewards.verifiers import binary_success_reward
from trainers.base import AgentGRPOConfig, AgentGRPOTrainer, env_reward

PROMPTS = Dataset.from_list([{"prompt": f"say {w}"} for w in ["apple", "river", "stone", "cloud"]])


def distinct_chars(completions, **kwargs):
    return [len(set(c)) / (1 + len(c)) for c in completions]


def _grpo_config(tmp_path, **kw) -> GRPOConfig:
    """A plain TRL config with non-default values, including the derived batch pair (steps_per_generation=2 makes
    GRPOConfig.__post_init__ set generation_batch_size = 4 * 1 process * 2 = 8)."""
    settings = dict(per_device_train_batch_size=4, num_generations=2, max_completion_length=6, learning_rate=1e-3)
    settings |= dict(max_steps=1, disable_dropout=True, steps_per_generation=2, scale_rewards="none", beta=0.0)
    return GRPOConfig(output_dir=str(tmp_path), **CPU_ARGS, **(settings | kw))


def test_signature_is_trls_plus_keyword_only_env_factory():
    trl_params = list(inspect.signature(GRPOTrainer.__init__).parameters.values())
    ours = list(inspect.signature(AgentGRPOTrainer.__init__).parameters.values())
    assert [(p.name, p.kind, p.default) for p in ours[: len(trl_params)]] == [
        (p.name, p.kind, p.default) for p in trl_params
    ]
    assert [(p.name, p.kind, p.default) for p in ours[len(trl_params) :]] == [
        ("env_factory", inspect.Parameter.KEYWORD_ONLY, None)
    ]


def test_plain_grpo_config_is_converted(tiny_model_folder, tmp_path):
    plain = _grpo_config(tmp_path)
    assert plain.generation_batch_size == 8  # derived by TRL, see `_grpo_config`
    trainer = AgentGRPOTrainer(tiny_model_folder, [distinct_chars], plain, PROMPTS)
    assert type(trainer.args) is AgentGRPOConfig
    for f in fields(GRPOConfig):  # every TRL field keeps its value, derived ones included
        assert getattr(trainer.args, f.name) == getattr(plain, f.name), f.name
    for f in fields(AgentGRPOConfig):  # the agent fields a plain config lacks take their defaults
        if f.name not in GRPOConfig.__dataclass_fields__:
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            assert getattr(trainer.args, f.name) == default, f.name


def test_as_config_follows_the_subclass_config_class(tiny_model_folder, tmp_path):
    @dataclass
    class WiderConfig(AgentGRPOConfig):
        width: int = 3

    class WiderTrainer(AgentGRPOTrainer):
        config_class = WiderConfig

    agent = AgentGRPOConfig(output_dir=str(tmp_path), **CPU_ARGS, max_turn_tokens=7, num_generations=4)
    wider = WiderTrainer.as_config(agent, tiny_model_folder)
    assert type(wider) is WiderConfig and wider.width == 3
    assert (wider.max_turn_tokens, wider.num_generations, wider.generation_batch_size) == (7, 4, 8)  # 8 = TRL default
    assert WiderTrainer.as_config(wider, tiny_model_folder) is wider  # already the right class: used as is

    @dataclass
    class DeeperConfig(AgentGRPOConfig):
        depth: int = 1

    deeper = DeeperConfig(output_dir=str(tmp_path), **CPU_ARGS)
    with pytest.raises(TypeError, match="args must be a WiderConfig, a GRPOConfig it extends, or None; got Deeper"):
        WiderTrainer.as_config(deeper, tiny_model_folder)  # a sibling class: converting would drop `depth`


def test_args_none_builds_trls_default(tiny_model_folder, tmp_path, monkeypatch):
    # TRL's default config asks for bf16, which a CPU-only machine refuses; report support so it can be built
    monkeypatch.setattr(transformers.training_args, "is_torch_bf16_gpu_available", lambda: True)
    monkeypatch.chdir(tmp_path)
    stock = GRPOTrainer(tiny_model_folder, [distinct_chars], None, PROMPTS)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_folder)  # named by its config, not a string
    for source in (tiny_model_folder, model):
        ours = AgentGRPOTrainer(source, [distinct_chars], None, PROMPTS)
        assert type(ours.args) is AgentGRPOConfig
        assert ours.args.output_dir == Path(tiny_model_folder).name + "-GRPO"  # TRL's naming: "<model>-GRPO"
        for f in fields(GRPOConfig):
            assert getattr(ours.args, f.name) == getattr(stock.args, f.name), f.name


def test_no_reward_source_raises_trls_error(tiny_model_folder, tmp_path):
    errors = []
    for cls in (GRPOTrainer, AgentGRPOTrainer):
        with pytest.raises(ValueError, match="No reward source provided") as info:
            cls(tiny_model_folder, None, _grpo_config(tmp_path), PROMPTS)
        errors.append(str(info.value))
    assert errors[0] == errors[1]


class Counter:
    """A TRL-style tool environment that owns its reward: `get_reward` is 0.25 per `add` call plus a base of 0.5."""

    def reset(self, **kwargs) -> None:
        self.calls = 0

    def add(self, n: int) -> str:
        """Add a number.

        Args:
            n: The number.
        """
        self.calls += 1
        return str(n)

    def get_reward(self) -> float:
        return 0.5 + 0.25 * self.calls


def test_environment_factory_owning_its_reward_trains(tiny_tokenizer, tiny_model_folder, tmp_path):
    from trl.chat_template_utils import qwen3_template

    tok = copy.deepcopy(tiny_tokenizer)
    tok.response_template = copy.deepcopy(qwen3_template)  # TRL's tool loop parses the response with it
    trainer = AgentGRPOTrainer(
        tiny_model_folder,
        args=_grpo_config(tmp_path, max_tool_calling_iterations=1),
        train_dataset=Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in PROMPTS["prompt"]]),
        processing_class=tok,
        environment_factory=Counter,
    )
    assert trainer.reward_func_names == ["Counter"]  # TRL's reward column for the environment's `get_reward`
    trainer.train()
    logs = trainer.state.log_history[0]
    assert math.isfinite(logs["loss"])
    calls = logs["tools/call_frequency"]  # mean tool calls per rollout (a random model rarely calls one)
    assert logs["rewards/Counter/mean"] == pytest.approx(0.5 + 0.25 * calls)  # Counter.get_reward, averaged


def test_env_factory_default_reward_follows_config(tiny_model_folder, tmp_path):
    cases = [(_grpo_config(tmp_path), env_reward)]  # a plain config: AgentGRPOConfig's default, reward="env"
    cases.append((AgentGRPOConfig(output_dir=str(tmp_path), **CPU_ARGS, reward="binary"), binary_success_reward))
    for args, expected in cases:
        trainer = AgentGRPOTrainer(
            tiny_model_folder, args=args, train_dataset=PROMPTS, env_factory=lambda row: EchoEnv()
        )
        assert trainer.reward_funcs == [expected]
        assert trainer.rollout_func == trainer._rollout_func  # the agent loop plays the rollouts


@pytest.mark.parametrize(
    "other",
    [
        {"rollout_func": lambda prompts, trainer: {}},
        {"environment_factory": Counter},
        {"tools": [Counter().add]},
    ],
    ids=lambda other: next(iter(other)),
)
def test_env_factory_refuses_a_second_rollout_source(tiny_model_folder, tmp_path, other):
    name = next(iter(other))
    with pytest.raises(ValueError, match=f"env_factory and {name} are two rollout sources"):
        AgentGRPOTrainer(
            tiny_model_folder,
            args=_grpo_config(tmp_path),
            train_dataset=PROMPTS,
            env_factory=lambda row: EchoEnv(),
            **other,
        )
