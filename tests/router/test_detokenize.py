"""Incremental detokenization after a handoff: exact against a whole decode, O(new tokens) a chunk.

Two real tokenizers whose decode is not prefix-stable: the tiny model's word-level one (a token's
text depends on whether a token precedes it: ``decode([b])`` is "b", its share of
``decode([a, b])`` is " b"), and a byte-level BPE trained here on multi-byte text, whose
characters are split across tokens (a lone token decodes to U+FFFD).
"""

from __future__ import annotations

import random

import pytest

from pdd_sglang.router.detokenize import REPLACEMENT_CHAR, IncrementalDetokenizer
from pdd_sglang.router.splice import StreamSplicer, UpstreamChunk

CORPUS = ["日本語のテキスト、こんにちは世界。", "Ünïcödé façade naïve café 🙂🚀✨",
          "한국어 문장입니다 그리고 中文句子", "emoji 🙂 mixed with ascii text 🚀 and more ✨"]


@pytest.fixture(scope="module")
def tiny_tokenizer():
    """Its tokenizer.json through the tokenizers library (what AutoTokenizer wraps)."""
    from tokenizers import Tokenizer

    from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model
    return Tokenizer.from_file(str(ensure_tiny_model() / "tokenizer.json"))


@pytest.fixture(scope="module")
def byte_bpe():
    """A byte-level BPE with few merges: most non-ASCII characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    return tok


class Counting:
    """A decode that counts the tokens it was given (the cost the router pays)."""

    def __init__(self, decode):
        self.inner, self.tokens = decode, 0

    def __call__(self, ids):
        self.tokens += len(ids)
        return self.inner(list(ids))


def chunk(ids, finished=False, text=None, **meta):
    meta["finish_reason"] = meta.get("finish_reason", {"type": "length"} if finished else None)
    return UpstreamChunk(list(ids), text, meta, finished)


def splice_one_token_a_chunk(decode, ids, handed):
    """Relay streams ids[:handed] (with the text a server would show), hands off; main streams
    the rest a token at a time. Returns the splicer's updates."""
    s = StreamSplicer(with_relay=True, decode=decode)
    updates = []
    for n in range(1, handed + 1):
        text = decode(ids[:n])
        if text.endswith(REPLACEMENT_CHAR):  # SGLang holds an incomplete character back
            text = text.rstrip(REPLACEMENT_CHAR)
        updates.append(s.relay_chunk(chunk(ids[:n], text=text)))
    s.relay_chunk(chunk(ids[:handed], True, text=None,
                        finish_reason={"type": "pdd_handoff", "handed_tokens": handed}))
    main = ids[handed:]
    for n in range(1, len(main) + 1):
        updates.append(s.main_chunk(chunk(main[:n], n == len(main), completion_tokens=handed + n)))
    return [u for u in updates if u is not None]


def test_byte_bpe_splits_characters_across_tokens(byte_bpe):
    ids = byte_bpe.encode(CORPUS[0]).ids
    assert any(byte_bpe.decode([i]).endswith(REPLACEMENT_CHAR) for i in ids)  # the hard case


@pytest.mark.parametrize("text", CORPUS)
def test_incremental_text_equals_the_whole_decode_for_split_characters(byte_bpe, text):
    ids = byte_bpe.encode(text).ids
    detok = IncrementalDetokenizer(byte_bpe.decode)
    pieces = [detok.step(ids[:n], final=n == len(ids)) for n in range(1, len(ids) + 1)]
    assert "".join(pieces) == byte_bpe.decode(ids) == text
    for n in range(1, len(ids)):  # nothing shown mid-way is a half character
        assert REPLACEMENT_CHAR not in "".join(pieces[:n])


@pytest.mark.parametrize("handed_at", range(1, 12))
def test_handoff_inside_a_character_stays_exact(byte_bpe, handed_at):
    ids = byte_bpe.encode(CORPUS[1] + CORPUS[0]).ids
    decode = byte_bpe.decode
    updates = splice_one_token_a_chunk(decode, ids, handed_at)
    final = updates[-1]
    assert final.finished and final.output_ids == ids
    assert final.text == decode(ids)
    for before, after in zip(updates, updates[1:]):  # the client's text only ever grows
        assert after.text.startswith(before.text)
        assert REPLACEMENT_CHAR not in before.text


def test_word_level_tokenizer_of_the_tiny_model_is_exact_at_every_chunk(tiny_tokenizer):
    rng = random.Random(7)
    ids = [rng.randrange(4, 1000) for _ in range(300)]
    decode = lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    updates = splice_one_token_a_chunk(decode, ids, 40)
    assert updates[-1].text == decode(ids)
    for update in updates:
        assert update.text == decode(update.output_ids)


def test_cost_per_chunk_does_not_grow_with_the_answer(tiny_tokenizer):
    """Tokens decoded over a whole answer stay linear in its length (was quadratic)."""
    rng = random.Random(3)
    for length in (500, 4000):
        ids = [rng.randrange(4, 1000) for _ in range(length)]
        decode = Counting(lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=True))
        s = StreamSplicer(with_relay=True, decode=decode)
        s.relay_chunk(chunk(ids[:10], text=tiny_tokenizer.decode(ids[:10])))
        s.relay_chunk(chunk(ids[:10], True,
                            finish_reason={"type": "pdd_handoff", "handed_tokens": 10}))
        start_cost = decode.tokens
        main = ids[10:]
        for n in range(1, len(main) + 1):
            update = s.main_chunk(chunk(main[:n], n == len(main), completion_tokens=10 + n))
        assert update.text == tiny_tokenizer.decode(ids)
        per_token = (decode.tokens - start_cost) / len(main)
        assert per_token < 16, (length, per_token)  # a window of a few tokens, twice a step


def test_a_stop_string_is_trimmed_from_incremental_text(tiny_tokenizer):
    ids = tiny_tokenizer.encode("w1 w2 w3 w4", add_special_tokens=False).ids
    decode = lambda ids: tiny_tokenizer.decode(ids)  # noqa: E731
    s = StreamSplicer(with_relay=True, decode=decode)
    s.relay_chunk(chunk(ids[:2], text="w1 w2"))
    s.relay_chunk(chunk(ids[:2], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 2}))
    final = s.main_chunk(chunk(ids[2:], True, completion_tokens=4,
                               finish_reason={"type": "stop", "matched": " w4"}))
    assert final.text == "w1 w2 w3"


# ---- the same on tokenizers' DecodeStream (what the router uses with a tokenizers tokenizer) --
def _stream_start(tokenizer):
    from pdd_sglang.router.detokenize import StreamDetokenizer
    return lambda decode, ids: StreamDetokenizer.start(tokenizer, True, decode, ids)


def splice_with(start, decode, ids, handed):
    s = StreamSplicer(with_relay=True, decode=decode, start_detokenizer=start)
    updates = []
    for n in range(1, handed + 1):
        text = decode(ids[:n]).rstrip(REPLACEMENT_CHAR)
        updates.append(s.relay_chunk(chunk(ids[:n], text=text)))
    s.relay_chunk(chunk(ids[:handed], True, finish_reason={"type": "pdd_handoff",
                                                           "handed_tokens": handed}))
    main = ids[handed:]
    for n in range(1, len(main) + 1):
        updates.append(s.main_chunk(chunk(main[:n], n == len(main), completion_tokens=handed + n)))
    return [u for u in updates if u is not None]


@pytest.mark.parametrize("handed_at", range(1, 12))
def test_the_stream_detokenizer_stays_exact_across_a_handoff_inside_a_character(byte_bpe,
                                                                                 handed_at):
    ids = byte_bpe.encode(CORPUS[1] + CORPUS[0]).ids
    updates = splice_with(_stream_start(byte_bpe), byte_bpe.decode, ids, handed_at)
    assert updates[-1].finished and updates[-1].text == byte_bpe.decode(ids)
    for before, after in zip(updates, updates[1:]):
        assert after.text.startswith(before.text) and REPLACEMENT_CHAR not in before.text


def test_the_stream_detokenizer_is_exact_at_every_chunk_of_the_tiny_model(tiny_tokenizer):
    rng = random.Random(11)
    ids = [rng.randrange(4, 1000) for _ in range(300)]
    decode = lambda ids: tiny_tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
    updates = splice_with(_stream_start(tiny_tokenizer), decode, ids, 40)
    for update in updates:
        assert update.text == decode(list(update.output_ids))


def test_an_answer_ending_inside_a_character_shows_it_as_a_whole_decode_does(byte_bpe):
    from pdd_sglang.router.detokenize import StreamDetokenizer
    ids = byte_bpe.encode(CORPUS[0]).ids
    cut = next(n for n in range(2, len(ids)) if byte_bpe.decode(ids[:n]).endswith(REPLACEMENT_CHAR))
    detok, text = StreamDetokenizer.start(byte_bpe, True, byte_bpe.decode, ids[:1])
    assert text + detok.step(ids[:cut], final=True) == byte_bpe.decode(ids[:cut])


def test_the_router_decodes_with_the_stream_where_the_tokenizer_allows():
    from transformers import AutoTokenizer

    from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model
    from pdd_sglang.router.detokenize import detokenizer_for
    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model()))
    assert detokenizer_for(tokenizer, True) is not None
    tokenizer.clean_up_tokenization_spaces = True  # a Python clean-up the stream would skip
    assert detokenizer_for(tokenizer, True) is None
    assert detokenizer_for(object(), True) is None
