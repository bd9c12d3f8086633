"""Checks of the command line and the `--config` file, made before TrlParser reads them: the file exists, is YAML, is
a mapping and sets no key twice; a negative number in scientific notation after a field (`--field -1e-3`) reads as
that field's value."""

from __future__ import annotations

import os

import yaml


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML loader that refuses a key given twice in one mapping (PyYAML would keep the last value silently)."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise SystemExit(
                    f"error: config {self.name}: {key!r} is set twice (lines {seen[key]} and "
                    f"{key_node.start_mark.line + 1}); keep one"
                )
            seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep)


def check_config_file(argv: list[str]) -> None:
    """The `--config` file exists, is YAML, is a mapping and sets no key twice, checked before TrlParser reads it."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            path = argv[i + 1]
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            continue
        if os.path.isdir(path):
            shown = sorted(f for f in os.listdir(path) if f.endswith((".yaml", ".yml")))[:3]
            example = f" (e.g. {os.path.join(path, shown[0])})" if shown else ""
            raise SystemExit(f"error: config {path!r} is a folder; give one YAML file in it{example}")
        if not os.path.isfile(path):
            raise SystemExit(f"error: config {path!r} does not exist")
        with open(path) as f:
            loader = _UniqueKeyLoader(f)
            loader.name = path
            try:
                data = loader.get_single_data()
            except yaml.YAMLError as e:
                raise SystemExit(f"error: config {path!r} is not valid YAML: {e}") from e
            finally:
                loader.dispose()
        if data is not None and not isinstance(data, dict):
            raise SystemExit(
                f"error: config {path!r} must be a YAML mapping (field: value lines), got a {type(data).__name__}"
            )


def join_negative_numbers(argv: list[str]) -> list[str]:
    """`--field -1e-3` as `--field=-1e-3`: argparse reads a value such as -1e-3 (not a plain -1 or -0.5) as an option
    and reports the field as missing its value."""
    out: list[str] = []
    for arg in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and arg.startswith("-") and _is_number(arg):
            out[-1] = f"{out[-1]}={arg}"
        else:
            out.append(arg)
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def unknown_fields(argv: list[str], dataclasses_: tuple[type, ...]) -> list[str]:
    """The config keys and command-line flags of `argv` that no field of `dataclasses_` takes, each with the closest
    field names (`did you mean learning_rate?`). A prefix of a field is not taken as the field (argparse's
    abbreviations are off in train.py), so `--learning_rat` is reported here too."""
    import dataclasses
    import difflib

    known = {"config", "help"}
    for cls in dataclasses_:
        for f in dataclasses.fields(cls):
            known.add(f.name)
            if f.default is True:
                known.add(f"no_{f.name}")  # HfArgumentParser's negation of a bool field that defaults to True
    given: list[tuple[str, str]] = []
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            given.append((arg[2:].split("=", 1)[0], "flag --"))
        if arg == "--config" and i + 1 < len(argv) or arg.startswith("--config="):
            path = argv[i + 1] if arg == "--config" else arg.split("=", 1)[1]
            with open(path) as f:
                data = yaml.safe_load(f) or {}
            given += [(str(key), "config key ") for key in data]
    problems = []
    for name, kind in given:
        if name in known:
            continue
        candidates = sorted(k for k in known if k.startswith("no_") == name.startswith("no_"))
        close = difflib.get_close_matches(name, candidates, n=3, cutoff=0.75)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; `python train.py --help` lists every field"
        problems.append(f"{kind}{name} is not a field of this trainer{hint}")
    return problems
