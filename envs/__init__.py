"""Environments: the `Env` protocol, the TRL tool-environment adapter, the built-in environments, and the ecosystem's
environments through `envs/adapters/` (`<source>:<name>`)."""

from envs.base import Env, ToolEnv
from envs.mixed import MixedEnv
from envs.search import SearchEnv
from envs.shop import ShopEnv
from envs.terminal import TerminalEnv

ENVIRONMENTS: dict[str, type[Env]] = {
    "shop": ShopEnv,
    "terminal": TerminalEnv,
    "search": SearchEnv,
    "mixed": MixedEnv,
}


def environment_class(name: str, kwargs: dict | None = None) -> type[Env] | None:
    """The class of a built-in environment (`shop`, ...) or of an ecosystem one (`reasoning_gym:<task>`, ...; its
    settings `kwargs` are part of the class); None for any other name. An ecosystem name that is wrong, or whose
    package is missing, stops with a message naming the field."""
    from envs.adapters import adapter_class, is_adapter_spec

    if name in ENVIRONMENTS:
        return ENVIRONMENTS[name]
    return adapter_class(name, kwargs) if is_adapter_spec(name) else None


__all__ = ["ENVIRONMENTS", "Env", "MixedEnv", "SearchEnv", "ShopEnv", "TerminalEnv", "ToolEnv", "environment_class"]
