"""Incremental detokenization and stop strings, with the default model's real tokenizer."""

import pytest
import transformers

from jaxllm.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return transformers.AutoTokenizer.from_pretrained(tiny_model_dir)


def feed(tok, text, **kw):
    prompt = tok.encode("Say something:")
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    seen, stop = [], None
    for t in ids:
        stop = detok.add_token(t)
        seen.append(detok.text)
        if stop:
            break
    return ids, detok, seen, stop


def test_multibyte_text_is_never_split(tokenizer):
    text = " Grüße 🌍🚀 日本語のテキスト, naïve café — done."
    ids, detok, seen, _ = feed(tokenizer, text)
    assert any(len(tokenizer.decode([t])) == 0 or "\ufffd" in tokenizer.decode([t]) for t in ids), (
        "the test text should contain characters split over several tokens"
    )
    assert detok.text == tokenizer.decode(ids)
    assert all("\ufffd" not in s for s in seen)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))  # text only ever grows


def test_stop_string_across_token_boundary(tokenizer):
    text = " The quick brown fox jumps over the lazy dog"
    ids = tokenizer.encode(text, add_special_tokens=False)
    boundary = len(tokenizer.decode(ids[:3]))
    stop = text[boundary - 2 : boundary + 3]  # tail of token 3 + head of token 4
    assert tokenizer.decode(ids[:3]).endswith(stop[:2])
    _, detok, _, got = feed(tokenizer, text, stop=[stop])
    assert got == stop and detok.text == text[: boundary - 2]
    _, detok, _, got = feed(tokenizer, text, stop=[stop], include_stop_str_in_output=True)
    assert got == stop and detok.text == text[: boundary + 3]


def test_streaming_holds_back_possible_stop_prefix(tokenizer):
    _, detok, _, _ = feed(tokenizer, " one two three", stop=["three!"])
    assert detok.streamable_len(finished=False) == len(detok.text) - len("three!") + 1
    assert detok.streamable_len(finished=True) == len(detok.text)
