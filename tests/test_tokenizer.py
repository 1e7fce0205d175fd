"""Our Tokenizer encodes and decodes exactly like transformers.AutoTokenizer."""

from __future__ import annotations

import pytest

from kvrecover.tokenizer import Tokenizer

TEXTS = [
    "Hello, world!",
    "the quick brown fox jumps over the lazy dog.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "unicode: café, naïve, 東京, Привет, emoji 🦊🚀",
    "numbers 12345 and 3.14159, symbols <>{}[]|\\~`",
    "",
    " ",
]


def check_against_hf(model_dir) -> Tokenizer:
    from transformers import AutoTokenizer

    ours = Tokenizer(model_dir)
    reference = AutoTokenizer.from_pretrained(str(model_dir))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference.encode(text), text
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    assert ours.eos_token_id == reference.eos_token_id
    return ours


def test_tiny_tokenizer_matches_transformers(tiny_llama):
    tokenizer = check_against_hf(tiny_llama)
    # tokenizer.json has no post-processor: no BOS, whatever tokenizer_config.json's
    # add_bos_token says (transformers 5 ignores it when tokenizer.json exists).
    assert tokenizer.encode("hello")[0] != 0
    assert tokenizer.decode(tokenizer.encode("hello paris")) == "hello paris"
    assert tokenizer.eos_token_id == 1


def test_post_processor_bos_is_added_and_skipped_on_decode(tiny_llama, tmp_path):
    from tokenizers import Tokenizer as FastTokenizer
    from tokenizers import processors

    fast = FastTokenizer.from_file(str(tiny_llama / "tokenizer.json"))
    fast.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)]
    )
    fast.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_bytes(
        (tiny_llama / "tokenizer_config.json").read_bytes()
    )
    tokenizer = check_against_hf(tmp_path)
    ids = tokenizer.encode("hello paris")
    assert ids[0] == 0 and 0 not in ids[1:]
    assert tokenizer.encode("") == [0]
    assert tokenizer.decode(ids) == "hello paris"


@pytest.mark.slow
def test_default_model_tokenizer_matches_transformers():
    from kvrecover.default_model import default_model_path

    tokenizer = check_against_hf(default_model_path())
    # SmolLM2 adds no BOS; its EOS is <|im_end|>.
    assert tokenizer.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tokenizer.eos_token_id == 2
    text = "unicode: café, naïve, 東京, Привет, emoji 🦊🚀"
    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.parametrize("text, message", [
    ("abc \ud800 def", r"^text: a lone surrogate \(U\+D800\) at character 4"),
    ("\udc80", r"^text: a lone surrogate \(U\+DC80\) at character 0"),
    ("a\x00b", r"^text: a NUL character \(U\+0000\) at character 1"),
])
def test_bad_strings_are_a_value_error_naming_the_field(tiny_llama, text, message):
    with pytest.raises(ValueError, match=message):
        Tokenizer(tiny_llama).encode(text)
    with pytest.raises(ValueError, match=message.replace("text", "messages\\[0\\].content")):
        Tokenizer(tiny_llama).encode(text, field="messages[0].content")
