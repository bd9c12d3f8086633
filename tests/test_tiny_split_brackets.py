"""`TinySpec.split_brackets` (`tiny_split_brackets`): the tiny default's tokenizer cuts `[` off the word after it, so
a word typed inside an action's brackets is the token an observation shows it as."""

from __future__ import annotations

from agent_trl.arguments import RunArguments
from agent_trl.run_info import resolve_model
from envs.tiny import SHIPPED, TinySpec, build_tokenizer
from tests.helpers.run_info import sources

# the shop's level-2 coupon: shown in the instruction after a space, typed in the checkout action's brackets
CORPUS = ["user assistant system", "pay with coupon [fig]", "checkout[fig]", "click[owl] search[fig tree]"] * 30


def tokens(split_brackets: bool, text: str) -> list[str]:
    return build_tokenizer(CORPUS, vocab_size=300, split_brackets=split_brackets).tokenize(text)


def test_the_word_in_brackets_is_the_word_shown():
    shown, typed = tokens(True, "pay with coupon [fig]"), tokens(True, "checkout[fig]")
    assert typed[-3:] == ["[", "fig", "]"]  # the bracket, the word, the bracket: three pieces, each its own token
    assert shown[-3:] == typed[-3:]  # ... the same three the instruction shows


def test_without_the_split_the_bracket_joins_the_word():
    typed = tokens(False, "checkout[fig]")
    assert "[fig" in typed and "fig" not in typed  # the Qwen2 pre-tokeniser: one non-letter joins the letters after it
    assert "fig" in tokens(False, "pay with coupon [fig]")  # while the instruction shows `Ġ[`, `fig`


def test_both_tokenizers_decode_to_the_text():
    tok = build_tokenizer(CORPUS, vocab_size=300, split_brackets=True)
    for text in ["checkout[fig]", "search[fig tree] [owl]", "answer[Zofal to Krorkri]"]:
        assert tok.decode(tok(text)["input_ids"]) == text


def test_off_leaves_the_key_as_before_and_on_changes_it():
    plain = TinySpec.parse("tiny:shop")
    # the shipped build was made before the setting existed; its folder is named by the key it had then
    assert (SHIPPED / f"tiny-shop-{plain.key()}").is_dir()
    assert TinySpec.parse("tiny:shop", split_brackets=True).key() != plain.key()


def test_the_setting_reaches_the_build_only_when_on(builds):  # noqa: F811
    resolve_model("tiny:shop", RunArguments(environment="shop", tiny_split_brackets=True), sources(environment=1))
    resolve_model("tiny:shop", RunArguments(environment="shop"), sources(environment=1))
    assert builds == [
        ("tiny_model", ("tiny:shop",), {"difficulty": 0, "seed": 0, "split_brackets": True}),
        ("tiny_model", ("tiny:shop",), {"difficulty": 0, "seed": 0}),
    ]
