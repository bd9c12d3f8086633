"""The tiny default's cache key and per-environment settings (envs/tiny.py)."""

import pytest

from envs.search import NAME_POOL, SearchEnv
from envs.tiny import TinySpec


def test_cache_key_follows_settings_and_demo_version(monkeypatch):
    shop = TinySpec.parse("tiny:shop")
    assert shop.key() == TinySpec.parse("tiny:shop").key()  # stable
    assert shop.key() != TinySpec.parse("tiny:shop", sft_steps=301).key()
    assert shop.key() != TinySpec.parse("tiny-moe:shop").key()
    before = TinySpec.parse("tiny:search").key()
    monkeypatch.setattr(SearchEnv, "demo_version", SearchEnv.demo_version + 1)
    assert TinySpec.parse("tiny:search").key() != before  # changed demonstrations never reuse an old build


def test_environment_sets_its_sft_steps_unless_overridden():
    assert TinySpec.parse("tiny:shop").sft_steps == TinySpec.sft_steps == 300
    assert TinySpec.parse("tiny:search").sft_steps == SearchEnv.tiny_sft_steps == 900
    assert TinySpec.parse("tiny:search", sft_steps=20).sft_steps == 20
    with pytest.raises(ValueError, match="expected 'tiny:<env>'"):
        TinySpec.parse("small:search")


def test_search_level_0_names_come_from_the_pool():
    assert len(set(NAME_POOL)) == len(NAME_POOL) == 160
    pool = set(NAME_POOL)
    for task in SearchEnv.make_tasks("train", 20, seed=3, difficulty=0):
        for subject, _, obj in task["facts"]:
            words = [w for w in f"{subject} {obj}".split() if w[0].isupper()]
            assert words and set(words) <= pool
