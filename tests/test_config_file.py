"""`agent_trl.config_file`: the checks of the command line and the `--config` file made before TrlParser reads them."""

import re

import pytest

from agent_trl.config_file import check_config_file, join_negative_numbers


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--learning_rate", "-1e-3"], ["--learning_rate=-1e-3"]),  # the case argparse reads as an option
        (["--beta", "-1", "--seed", "0"], ["--beta=-1", "--seed", "0"]),  # any number after a field is joined
        (["--x", "-inf"], ["--x=-inf"]),  # float() reads it
        (["--x", "-abc"], ["--x", "-abc"]),  # not a number: left for argparse to judge
        (["--x=1", "-2"], ["--x=1", "-2"]),  # the field already has its value
        (["-h", "-1"], ["-h", "-1"]),  # a short option is not a field
        (["--x", "-1", "-2"], ["--x=-1", "-2"]),  # only the first value: `--x=-1` already holds `=`
        (["--reward_weights", "1", "-0.5"], ["--reward_weights", "1", "-0.5"]),  # "-0.5" follows a value, not a field
        ([], []),
    ],
)
def test_join_negative_numbers(argv, expected):
    assert join_negative_numbers(argv) == expected


def write(tmp_path, text: str) -> str:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return str(path)


def test_without_config_nothing_is_read(tmp_path):
    assert check_config_file(["--learning_rate", "0.1", "--config"]) is None  # `--config` without a value: argparse's


@pytest.mark.parametrize("text", ["learning_rate: 0.1\nseed: 0\n", "", "a:\n  x: 1\nb:\n  x: 2\n"])
def test_a_good_config_passes(tmp_path, text):
    """A mapping, an empty file (TrlParser reads no field), and the same key in two different mappings."""
    path = write(tmp_path, text)
    assert check_config_file(["--config", path]) is None
    assert check_config_file([f"--config={path}"]) is None


def test_a_missing_config_is_named(tmp_path):
    path = str(tmp_path / "nowhere.yaml")
    with pytest.raises(SystemExit, match=f"^error: config '{re.escape(path)}' does not exist$"):
        check_config_file(["--config", path])


def test_invalid_yaml_is_named(tmp_path):
    path = write(tmp_path, "learning_rate: [0.1, 0.2\n")
    with pytest.raises(SystemExit, match=f"^error: config '{re.escape(path)}' is not valid YAML: "):
        check_config_file(["--config", path])


def test_a_list_is_not_a_config(tmp_path):
    path = write(tmp_path, "- learning_rate\n- seed\n")
    expected = f"error: config '{path}' must be a YAML mapping (field: value lines), got a list"
    with pytest.raises(SystemExit) as err:
        check_config_file(["--config", path])
    assert err.value.code == expected


@pytest.mark.parametrize("form", ["separate", "joined"])
def test_a_key_set_twice_names_both_lines(tmp_path, form):
    path = write(tmp_path, "learning_rate: 0.1\nseed: 0\nlearning_rate: 0.2\n")  # lines 1 and 3
    argv = ["--seed", "1", "--config", path] if form == "separate" else [f"--config={path}"]
    with pytest.raises(SystemExit) as err:
        check_config_file(argv)
    assert err.value.code == f"error: config {path}: 'learning_rate' is set twice (lines 1 and 3); keep one"


def test_a_key_set_twice_inside_a_nested_mapping_is_found(tmp_path):
    path = write(tmp_path, "environment_kwargs:\n  size: 3\n  size: 4\n")  # lines 2 and 3
    with pytest.raises(SystemExit, match=r"'size' is set twice \(lines 2 and 3\)"):
        check_config_file(["--config", path])
