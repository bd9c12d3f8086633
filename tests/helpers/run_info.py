"""A stand-in for a run's sources: used by test_run_info and test_tiny_split_brackets."""

from types import SimpleNamespace


def sources(environment=None, train=(), environment_kwargs=None) -> SimpleNamespace:
    return SimpleNamespace(environment=environment, train=list(train), environment_kwargs=environment_kwargs)
