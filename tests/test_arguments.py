"""`agent_trl.arguments.RunArguments`: every run field documents itself (its `help` is all `--help` and the README
point to), and the help strings list what can be chosen."""

from dataclasses import fields

from agent_trl.arguments import RunArguments
from envs import ENVIRONMENTS
from rewards.loading import REWARD_NAMES
from trainers import TRAINERS


def test_every_field_has_help():
    assert [f.name for f in fields(RunArguments) if not f.metadata.get("help", "").strip()] == []


def test_help_lists_the_choices():
    helps = {f.name: f.metadata["help"] for f in fields(RunArguments)}
    assert str(sorted(TRAINERS)) in helps["trainer"]
    assert ", ".join(sorted(ENVIRONMENTS)) in helps["environment"]
    assert ", ".join(sorted(REWARD_NAMES)) in helps["reward_funcs"]


def test_defaults():
    """An unset environment stays None here; `load_sources` resolves it (shop, or none with a dataset)."""
    run = RunArguments()
    assert (run.trainer, run.environment, run.dataset_name, run.reward_funcs) == ("grpo", None, None, None)
    assert (run.num_train_tasks, run.num_eval_tasks, run.eval_samples, run.skip_eval) == (None, 200, 1, False)
