"""docs/configuration.md is generated from the config dataclasses (`python -m agent_trl.config_docs`): the committed
page is the current output, and every field it documents has a help text (its only documentation)."""

from agent_trl.arguments import RunArguments
from agent_trl.config_docs import PAGE, declared_fields, render
from trainers import TRAINERS
from trainers.base import AgentGRPOConfig


def test_committed_page_is_current():
    assert PAGE.read_text() == render(), "docs/configuration.md is stale: run `python -m agent_trl.config_docs`"


def test_every_documented_field_has_help():
    configs = [RunArguments, AgentGRPOConfig, *(config for _, config in TRAINERS.values())]
    missing = [
        f"{config.__name__}.{f.name}"
        for config in configs
        for f in declared_fields(config)
        if not f.metadata.get("help", "").strip()
    ]
    assert missing == []


def test_declared_fields_are_the_class_bodys_own():
    """A method's table holds its new fields and the inherited ones it redeclares (PPO's num_generations), not its
    parent's; the base's holds none of TRL's it leaves alone."""
    ppo = [f.name for f in declared_fields(TRAINERS["ppo"][1])]
    assert "num_generations" in ppo and "max_turns" not in ppo
    assert "learning_rate" not in [f.name for f in declared_fields(AgentGRPOConfig)]
    assert "| `max_turns` |" in render()


def test_the_page_does_not_change_once_the_parser_has_read_the_classes():
    """TRL's parser rewrites `Field.type` of the classes it parses (`int | None` -> `int`); the page shows the
    types as declared, whatever ran before it (train.py's parser, in the same process)."""
    import train

    before = render()
    train.parse(["--environment", "shop", "--model_name_or_path", "tiny:shop", "--output_dir", "/tmp/unused"])
    assert render() == before
    assert "| `environment` | str \\| None |" in before
