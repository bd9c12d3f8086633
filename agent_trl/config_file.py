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
