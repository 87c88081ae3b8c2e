"""Incremental detokenization equals whole-text decoding, however the ids are split into deltas."""

import random

import pytest

from mtpserve.server.detokenizer import IncrementalDetokenizer, TokenTextCache

TEXTS = [
    "def main():\n    return 42  # answer\n",
    "héllo wörld ünïcödé 日本語のテキスト 🙂🚀 ✓ and more emoji 🧪🧬",
    "import os\nprint(os.path.join('a', 'b'))",
]


def _split(ids, rng):
    out, i = [], 0
    while i < len(ids):
        step = rng.randint(1, 4)  # MTP: up to k+1 tokens per step
        out.append(ids[i:i + step])
        i += step
    return out


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("seed", range(5))
def test_deltas_concatenate_to_full_decode(text_model, text, seed):
    ids = text_model.encode(text)
    detok = IncrementalDetokenizer(text_model)
    pieces = [detok.push(chunk) for chunk in _split(ids, random.Random(seed))]
    pieces.append(detok.flush())
    assert "".join(pieces) == text_model.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


def test_partial_utf8_is_held_until_complete(text_model):
    ids = text_model.encode("🧬")  # not a merge in this vocabulary: several byte tokens
    assert len(ids) > 1
    detok = IncrementalDetokenizer(text_model)
    assert [detok.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.push(ids[-1:]) == "🧬"


def test_flush_emits_dangling_bytes(text_model):
    ids = text_model.encode("🧬")
    detok = IncrementalDetokenizer(text_model)
    assert detok.push(ids[:1]) == ""
    assert detok.flush() == "\ufffd"


def test_special_tokens_are_skipped(text_model):
    eos = text_model.token_to_id("<|endoftext|>")
    ids = text_model.encode("abc") + [eos]
    detok = IncrementalDetokenizer(text_model)
    assert detok.push(ids) + detok.flush() == "abc"


def test_mark_rewind_replays_identically(text_model):
    ids = text_model.encode(TEXTS[1])
    detok = IncrementalDetokenizer(text_model)
    detok.push(ids[:3])
    mark = detok.mark()
    batch = detok.push(ids[3:9])
    detok.rewind(mark)
    assert "".join(detok.push_each(ids[3:9])) == batch


def test_token_text_cache_matches_single_decodes(text_model):
    ids = text_model.encode(TEXTS[0])
    cache = TokenTextCache(text_model)
    assert cache.texts(ids) == [text_model.tokenizer.inner.decode([i], skip_special_tokens=False) for i in ids]
    assert cache.texts(ids[:2]) == cache.texts(ids)[:2]
