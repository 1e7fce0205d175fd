"""The streaming detokenizer: whole characters per delta, stop strings never leak,
and the deltas add up to the engine's text."""

from __future__ import annotations

import pytest
from conftest import build_tokenizer

from kvrecover.entrypoints.server.detokenizer import IncrementalDetokenizer
from kvrecover.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder, 384)
    return Tokenizer(folder)


def stream(detokenizer: IncrementalDetokenizer, token_ids: list[int], final_text: str | None):
    deltas = [detokenizer.update(token_ids[:n]) for n in range(1, len(token_ids))]
    deltas.append(detokenizer.update(token_ids, final_text))
    return deltas


def test_multibyte_characters_are_never_split(tokenizer):
    text = "héllo wörld, 北京 and 🙂 then paris"
    token_ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([t]) for t in token_ids)  # some tokens are partial
    deltas = stream(IncrementalDetokenizer(tokenizer), token_ids, tokenizer.decode(token_ids))
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(token_ids)
    assert sum(1 for d in deltas if d) > 5  # it really streamed


def test_stop_string_truncates_and_no_part_of_it_is_sent_early(tokenizer):
    text = "the capital of france is paris and the capital of china is beijing"
    token_ids = tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(tokenizer, stop=["paris and", "zzz"])
    sent = ""
    for n in range(1, len(token_ids) + 1):
        sent += detokenizer.update(token_ids[:n])
        assert "paris" not in sent
        if detokenizer.stopped:
            break
    assert detokenizer.stopped
    assert sent == tokenizer.decode(token_ids)[:text.index("paris and")]
    assert detokenizer.update(token_ids) == ""  # nothing after the stop


def test_final_text_is_the_engines(tokenizer):
    token_ids = tokenizer.encode("hello, my name is kv.")
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = stream(detokenizer, token_ids, "hello, my name is kv.")
    assert "".join(deltas) == "hello, my name is kv."


@pytest.mark.parametrize("split", range(1, 12))
def test_resumed_text_continues_across_a_split_character(tokenizer, split):
    token_ids = tokenizer.encode("北京 🙂 paris ö")
    assert len(token_ids) > split
    full = tokenizer.decode(token_ids)
    first = IncrementalDetokenizer(tokenizer)
    sent = "".join(first.update(token_ids[:n]) for n in range(1, split + 1))
    second = IncrementalDetokenizer(tokenizer)
    second.resume(token_ids[:split], sent)
    rest = token_ids[split:]
    deltas = [second.update(rest[:n]) for n in range(1, len(rest))]
    deltas.append(second.update(rest, "engine text of the new tokens alone"))
    assert sent + "".join(deltas) == full
    assert not any("\ufffd" in d for d in [sent, *deltas])


def test_stop_strings_of_unusual_characters_match_the_decoded_text(tokenizer):
    """Lone combining marks, NULs, U+FFFD (a byte that is no UTF-8) and control
    characters, at every offset: the text up to the first occurrence, streamed."""
    nul = next(i for i in range(384) if tokenizer.decode([i]) == "\x00")  # not encodable
    token_ids = tokenizer.encode("e\u0301 \u0301x") + [nul] + \
        tokenizer.encode("y a\u0308\x12 \u0301") + [nul, nul] + tokenizer.encode("z") + \
        tokenizer.encode("\u00e9")[:1] + tokenizer.encode(" q\u0301 end")
    text = tokenizer.decode(token_ids)
    assert "\ufffd" in text and "\x00" in text and " \u0301" in text
    for length in range(1, 5):
        for start in range(len(text) - length + 1):
            stop = text[start:start + length]
            detokenizer = IncrementalDetokenizer(tokenizer, stop=[stop])
            sent = ""
            for n in range(1, len(token_ids) + 1):
                sent += detokenizer.update(token_ids[:n], text if n == len(token_ids) else None)
                if detokenizer.stopped:
                    break
            assert (sent, detokenizer.stopped) == (text[:text.find(stop)], True), repr(stop)
