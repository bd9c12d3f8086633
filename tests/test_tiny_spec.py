"""The tiny default's cache key and per-environment settings (envs/tiny.py)."""

import hashlib
import json

import pytest

from envs.search import NAME_POOL, SearchEnv
from envs.tiny import TinySpec

#: the default build's settings, written out by hand (a change here rebuilds every cached tiny default)
DEFAULTS = dict(moe=False, hidden_size=128, num_layers=2, num_heads=4, intermediate_size=256, num_experts=8)
DEFAULTS.update(experts_per_token=2, max_positions=1024, vocab_size=1024, num_demos=2000, noise=0.3, sft_steps=300)
DEFAULTS.update(sft_batch_size=32, sft_lr=3e-3, seed=0, version=2)


def hand_key(**settings) -> str:
    """A cache key as it is defined: the first 16 hex digits of the SHA-256 of the settings as sorted JSON."""
    return hashlib.sha256(json.dumps(DEFAULTS | settings, sort_keys=True).encode()).hexdigest()[:16]


def test_cache_key_follows_settings_and_demo_version(monkeypatch):
    shop = TinySpec.parse("tiny:shop")
    # stable across processes and runs (it names a cache folder); shop has no demo_version
    assert shop.key() == hand_key(env="shop", difficulty=0)
    assert shop.key() != TinySpec.parse("tiny:shop", sft_steps=301).key()
    assert shop.key() != TinySpec.parse("tiny-moe:shop").key()
    before = TinySpec.parse("tiny:search").key()
    monkeypatch.setattr(SearchEnv, "demo_version", SearchEnv.demo_version + 1)
    assert TinySpec.parse("tiny:search").key() != before  # changed demonstrations never reuse an old build


def test_a_level_whose_tasks_changed_alone_has_its_own_key():
    # the long levels 1 and 2 carry a version of their own: a build of the former level 1 or 2 (keyed without it,
    # or with the class's version) is never taken for them; levels 0, 3 and 4 keep the class's
    for env, long_versions, version, sft_steps, long_sft_steps in (
        ("shop", {1: 2, 2: 2}, None, 300, 2000),  # 2: the noisy checkout types another coupon, never a cart id
        ("terminal", {1: 2, 2: 2}, None, 300, 2000),  # 2: the key file's line became `code: <code>`
        # 3: the noisy answer names no chain town and not the person; 4 (level 2): the early answer is rarer
        ("search", {1: 3, 2: 4}, 1, 900, 2000),
    ):
        for level in range(5):
            expected = long_versions.get(level, version)
            settings = dict(env=env, difficulty=level, sft_steps=long_sft_steps if level in (1, 2) else sft_steps)
            settings |= {"demo_version": expected} if expected else {}
            settings |= {"guidance_frac": 0.5} if (env, level) == ("search", 2) else {}  # search level 2's default
            settings |= {"noise": 0.1} if (env, level) == ("shop", 2) else {}  # shop level 2's default
            assert TinySpec.parse(f"tiny:{env}", difficulty=level).key() == hand_key(**settings), (env, level)
        former = dict(env=env, difficulty=1, sft_steps=long_sft_steps) | ({"demo_version": version} if version else {})
        assert TinySpec.parse(f"tiny:{env}", difficulty=1).key() != hand_key(**former)  # the former level 1's key


def test_environment_sets_its_sft_steps_unless_overridden():
    assert TinySpec.parse("tiny:shop").sft_steps == TinySpec.sft_steps == 300
    assert TinySpec.parse("tiny:search").sft_steps == SearchEnv.tiny_sft_steps == 900
    assert TinySpec.parse("tiny:search", sft_steps=20).sft_steps == 20
    # a level may need its own: the long levels 1 and 2 take 2000 steps, the others the environment's (search 900)
    for env, other in (("shop", 300), ("terminal", 300), ("search", 900)):
        steps = [TinySpec.parse(f"tiny:{env}", difficulty=level).sft_steps for level in range(5)]
        assert steps == [other, 2000, 2000, other, other], env
        assert TinySpec.parse(f"tiny:{env}", difficulty=2, sft_steps=20).sft_steps == 20  # an explicit value wins
    with pytest.raises(ValueError, match="expected 'tiny:<env>'"):
        TinySpec.parse("small:search")


def test_search_level_2_is_built_with_guidance_unless_overridden():
    # half its demonstrations under guidance, at level 2 of search alone; an explicit share (0 included) wins
    for env in ("shop", "search", "terminal"):
        shares = [TinySpec.parse(f"tiny:{env}", difficulty=level).guidance_frac for level in range(5)]
        assert shares == ([0.0, 0.0, 0.5, 0.0, 0.0] if env == "search" else [0.0] * 5), env
    assert TinySpec.parse("tiny:search", difficulty=2, guidance_frac=0.0).guidance_frac == 0.0
    assert TinySpec.parse("tiny:search", difficulty=2, guidance_frac=0.25).guidance_frac == 0.25
    # the build this default names is the one built with the share given explicitly
    assert (
        TinySpec.parse("tiny:search", difficulty=2).key()
        == TinySpec.parse("tiny:search", difficulty=2, guidance_frac=0.5).key()
    )


def test_shop_level_2_is_built_with_less_noise_unless_overridden():
    # noise 0.1 at level 2 of the shop alone, 0.3 elsewhere; an explicit noise wins
    for env in ("shop", "search", "terminal"):
        noises = [TinySpec.parse(f"tiny:{env}", difficulty=level).noise for level in range(5)]
        assert noises == ([0.3, 0.3, 0.1, 0.3, 0.3] if env == "shop" else [0.3] * 5), env
    assert TinySpec.parse("tiny:shop", difficulty=2, noise=0.3).noise == 0.3


def test_search_level_0_names_come_from_the_pool():
    assert len(set(NAME_POOL)) == len(NAME_POOL) == 160
    pool = set(NAME_POOL)
    for task in SearchEnv.make_tasks("train", 20, seed=3, difficulty=0):
        for subject, _, obj in task["facts"]:
            words = [w for w in f"{subject} {obj}".split() if w[0].isupper()]
            assert words and set(words) <= pool


def test_the_mixed_pool_versions_each_level_from_its_parts(monkeypatch):
    from envs.mixed import MixedEnv

    # shop 0 / search 1 / terminal 0 at levels 0, 3, 4; at 1 shop 2, search 3, terminal 2 and at 2 shop 2, search 4,
    # terminal 2 (their long levels)
    assert MixedEnv.demo_version == 0 * 10_000 + 1 * 100 + 0
    assert MixedEnv.level_demo_versions == {1: 20_302, 2: 20_402}
    now = TinySpec.parse("tiny:mixed", difficulty=1).key()
    monkeypatch.setattr(MixedEnv, "level_demo_versions", {})  # as keyed before the long levels
    assert TinySpec.parse("tiny:mixed", difficulty=1).key() != now
