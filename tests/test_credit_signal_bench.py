"""bench/credit_signal.py's command line: `--set` overrides reach every recipe as train.py parses it, and a malformed
item stops before anything is built. (The measurement itself trains nothing here; its numbers are in bench/results.)"""

import pytest

import train
from bench import credit_signal


def test_set_items_become_train_fields():
    assert credit_signal.set_fields(["difficulty=2", "max_completion_length=960"], 0.5) == [
        "--difficulty", "2", "--max_completion_length", "960", "--tiny_guidance_frac", "0.5",
    ]  # fmt: skip
    assert credit_signal.set_fields([]) == []


@pytest.mark.parametrize("method", ["taspo", "alignopsd"])
def test_overrides_reach_the_parsed_recipe(method, tmp_path):
    """Search's recipes are level 0 with 256 tokens; the overrides make them level 2 with 960, the rest unchanged."""
    extra = credit_signal.set_fields(["difficulty=2", "max_completion_length=960"])
    run, config, model_args, _ = train.parse(credit_signal.recipe_argv(method, "search", 3, str(tmp_path), extra))
    assert (run.difficulty, config.max_completion_length, config.seed) == (2, 960, 3)
    assert model_args.model_name_or_path == "tiny:search"
    plain, plain_config, _, _ = train.parse(credit_signal.recipe_argv(method, "search", 3, str(tmp_path)))
    assert (plain.difficulty, plain_config.max_completion_length) == (0, 256)


@pytest.mark.parametrize("bad", ["difficulty", "=2"])
def test_a_malformed_set_item_stops_at_start(bad, monkeypatch, capsys):
    def never(*args, **kwargs):
        raise AssertionError("measured although --set was malformed")

    monkeypatch.setattr(credit_signal, "measure", never)
    with pytest.raises(SystemExit):
        credit_signal.main(["--set", bad])
    assert "FIELD=VALUE" in capsys.readouterr().err


@pytest.mark.parametrize("method", ["taspo", "alignopsd"])
def test_a_recipe_is_run_by_each_method(method, tmp_path):
    """`--recipe`: the real model's recipe with its trainer replaced; its environment, model and prompt kept."""
    recipe = credit_signal.ROOT / "configs" / "smollm2_guess_the_number.yaml"
    extra = credit_signal.set_fields(["per_device_train_batch_size=16"])
    argv = credit_signal.recipe_argv(method, "GuessTheNumber-v0", 1, str(tmp_path), extra, recipe)
    run, config, model_args, trainer_cls = train.parse(argv)
    assert run.trainer == method and trainer_cls.__name__.lower().startswith(method)
    assert (run.environment, model_args.model_name_or_path) == ("textarena:GuessTheNumber-v0", "smollm2")
    assert (config.per_device_train_batch_size, config.num_generations, config.seed) == (16, 4, 1)
    assert run.system_prompt.startswith("Play the game.")
    assert credit_signal.recipe_environment(recipe) == "GuessTheNumber-v0"
    with pytest.raises(SystemExit, match="names no environment"):
        credit_signal.recipe_environment(credit_signal.ROOT / "configs" / "smollm2_arith.yaml")


def test_a_recipe_run_writes_its_result(tmp_path, monkeypatch):
    """The recipe path is written into result.json as text (a Path there once failed the write after a long run)."""
    import json

    means = {f"{sign}_{kind}_mean": None for sign in ("winner", "loser") for kind in ("expert", "other", "first")}
    shares = {"pairs": 0.0, "ordering_share": None, "later_pairs": 0.0, "later_ordering_share": None}
    monkeypatch.setattr(credit_signal, "measure", lambda *a, **k: shares | means)
    recipe = credit_signal.ROOT / "configs" / "smollm2_guess_the_number.yaml"
    credit_signal.main(["--recipe", str(recipe), "--methods", "alignopsd", "--out", str(tmp_path)])
    record = json.loads((tmp_path / "result.json").read_text())
    assert record["settings"]["recipe"] == str(recipe) and "alignopsd/GuessTheNumber-v0" in record["measured"]
