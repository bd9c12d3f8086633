"""Environments: the `Env` protocol, the TRL tool-environment adapter, and the built-in environments."""

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

__all__ = ["ENVIRONMENTS", "Env", "MixedEnv", "SearchEnv", "ShopEnv", "TerminalEnv", "ToolEnv"]
