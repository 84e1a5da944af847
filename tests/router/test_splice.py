"""The splicer against scripted relay and main streams: no gap, no duplicate, no reordering."""

from __future__ import annotations

import pytest

from pdd_sglang.router.splice import SpliceError, StreamSplicer, UpstreamChunk
from pdd_sglang.router.stop_strings import StopStrings


def decode(ids):
    return " ".join(f"t{i}" for i in ids)


def chunk(ids, finished=False, text=None, **meta):
    meta.setdefault("prompt_tokens", 10)
    meta.setdefault("cached_tokens", 0)
    meta["finish_reason"] = meta.get("finish_reason", {"type": "length"} if finished else None)
    return UpstreamChunk(list(ids), decode(ids) if text is None else text, meta, finished)


def run(splicer, relay_chunks, main_chunks):
    updates = []
    for c in relay_chunks:
        if splicer.finished:
            break
        updates.append(splicer.relay_chunk(c))
    if not splicer.finished and splicer.phase == "main":
        for c in main_chunks:
            updates.append(splicer.main_chunk(c))
    return [u for u in updates if u is not None]


def test_handoff_joins_relay_then_main_without_gap_or_duplicate():
    s = StreamSplicer(with_relay=True, decode=decode)
    relay = [chunk([1]), chunk([1, 2]), chunk([1, 2, 3], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 3})]
    # Main's ids start at position 3; cumulative form, as SGLang streams by default.
    main = [chunk([4], cached_tokens=8),
            chunk([4, 5], cached_tokens=8),
            chunk([4, 5, 6], True, cached_tokens=8)]
    updates = run(s, relay, main)
    sent = [i for u in updates for i in u.new_ids]
    assert sent == [1, 2, 3, 4, 5, 6]
    final = updates[-1]
    assert final.finished and final.output_ids == [1, 2, 3, 4, 5, 6]
    assert final.text == decode([1, 2, 3, 4, 5, 6])
    assert final.meta["completion_tokens"] == 6  # relay's 3 + main's 3
    assert final.meta["cached_tokens"] == 8  # main's hit, not the relay's
    assert final.meta["prompt_tokens"] == 10
    assert final.meta["finish_reason"] == {"type": "length"}  # main's, not the relay's handoff
    assert [u.first_after_handoff for u in updates] == [False, False, False, True, False, False]
    assert s.outcome == "handoff" and s.handed_tokens == 3
    # Every update's text is the previous one extended: nothing already shown changes.
    for before, after in zip(updates, updates[1:]):
        assert after.text.startswith(before.text)


def test_relay_finishing_itself_is_the_whole_answer_and_main_is_ignored():
    s = StreamSplicer(with_relay=True, decode=decode)
    updates = run(s, [chunk([7]), chunk([7, 8], True, finish_reason={"type": "stop", "matched": 2})],
                  [chunk([9, 9, 9], True)])
    assert s.finished and s.outcome == "relay_finished"
    assert updates[-1].output_ids == [7, 8]
    assert updates[-1].meta["finish_reason"] == {"type": "stop", "matched": 2}
    with pytest.raises(SpliceError):
        s.main_chunk(chunk([9], True))


@pytest.mark.parametrize("handed", [-1, 3, "2", None])
def test_handoff_count_beyond_what_relay_streamed_is_refused(handed):
    s = StreamSplicer(with_relay=True, decode=decode)
    with pytest.raises(SpliceError):
        s.relay_chunk(chunk([1, 2], True, finish_reason={"type": "pdd_handoff", "handed_tokens": handed}))


def test_handoff_at_zero_tokens_means_main_makes_everything():
    s = StreamSplicer(with_relay=True, decode=decode)
    assert s.relay_chunk(chunk([], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 0})) is None
    update = s.main_chunk(chunk([1, 2], True))
    assert update.output_ids == [1, 2] and update.finished


def test_main_alone_passes_server_text_through():
    s = StreamSplicer(with_relay=False, decode=decode)
    first = s.main_chunk(chunk([1], text=" a"))
    last = s.main_chunk(chunk([1, 2], True, text=" a b"))
    assert first.text == " a" and last.text == " a b" and last.output_ids == [1, 2]
    assert s.outcome == "main"


def test_matched_stop_string_is_trimmed_from_spliced_text():
    s = StreamSplicer(with_relay=True, decode=decode)
    s.relay_chunk(chunk([1], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 1}))
    final = s.main_chunk(chunk([2, 3], True,
                               finish_reason={"type": "stop", "matched": " t3"}))
    assert final.text == "t1 t2"


def test_chunks_without_new_tokens_emit_nothing_until_the_end():
    s = StreamSplicer(with_relay=False, decode=decode)
    assert s.main_chunk(chunk([1])) is not None
    assert s.main_chunk(chunk([1])) is None
    assert s.main_chunk(chunk([1], True)).finished


def test_a_lost_relay_hands_the_stream_to_main_from_the_next_unseen_position():
    s = StreamSplicer(with_relay=True, decode=decode)
    assert s.relay_chunk(chunk([1])).new_ids == [1]
    assert s.relay_chunk(chunk([1, 2])).new_ids == [2]
    s.relay_lost()  # the relay died after streaming two tokens
    assert s.phase == "main" and s.relay_lost_at == 2
    # Main decodes from the first token: positions 0-1 are skipped, the client goes on at 2.
    assert s.main_chunk(chunk([1], completion_tokens=1)) is None
    update = s.main_chunk(chunk([1, 2, 3], completion_tokens=3))
    assert update.new_ids == [3] and update.output_ids == [1, 2, 3]
    final = s.main_chunk(chunk([1, 2, 3, 4], True, completion_tokens=4))
    assert final.finished and final.output_ids == [1, 2, 3, 4] and final.text == "t1 t2 t3 t4"
    assert s.outcome == "relay_lost" and not s.diverged


def test_a_lost_relay_with_a_sampled_prefix_that_main_drew_differently_is_marked_diverged():
    s = StreamSplicer(with_relay=True, decode=decode)
    s.relay_chunk(chunk([1, 2]))
    s.relay_lost()
    update = s.main_chunk(chunk([1, 9, 5], True))  # main drew 9 where the client saw 2
    assert update.new_ids == [5] and update.output_ids == [1, 2, 5] and s.diverged


def test_main_that_went_on_alone_after_the_relay_handed_off_is_placed_from_its_real_start():
    # The relay handed 3 tokens, but main's wait had timed out and it decoded from token 0:
    # SGLang's completion_tokens (3 for 3 streamed ids) gives it away.
    s = StreamSplicer(with_relay=True, decode=decode)
    s.relay_chunk(chunk([1, 2, 3], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 3}))
    update = s.main_chunk(chunk([1, 2, 3, 4], True, completion_tokens=4))
    assert update.new_ids == [4] and update.output_ids == [1, 2, 3, 4] and not s.diverged
    # A real handoff: main streams from position 3 and counts the handed tokens.
    s = StreamSplicer(with_relay=True, decode=decode)
    s.relay_chunk(chunk([1, 2, 3], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 3}))
    with pytest.raises(SpliceError, match="disagree"):
        s.main_chunk(chunk([7, 4], True, completion_tokens=4))  # claims positions 2-3


def test_a_relay_cannot_be_lost_after_the_handoff():
    s = StreamSplicer(with_relay=True, decode=decode)
    s.relay_chunk(chunk([1], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 1}))
    with pytest.raises(SpliceError):
        s.relay_lost()
    with pytest.raises(SpliceError):
        StreamSplicer(with_relay=False, decode=decode).relay_lost()


def test_incremental_chunks_share_one_growing_list_without_seeing_later_ids():
    """upstream.py appends an incremental stream's ids in place; each chunk is a view of its own
    prefix, so a chunk queued before later ids arrived still splices as it was."""
    from pdd_sglang.router.splice import IdsPrefix
    ids: list = []
    chunks = []
    for token, finished in ((4, False), (5, False), (6, True)):
        ids.append(token)
        reason = {"type": "length"} if finished else None
        chunks.append(UpstreamChunk(IdsPrefix(ids, len(ids)), None,
                                    {"finish_reason": reason, "completion_tokens": 3 + len(ids)},
                                    finished))
    s = StreamSplicer(with_relay=True, decode=decode)
    s.relay_chunk(chunk([1, 2, 3], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 3}))
    updates = [s.main_chunk(c) for c in chunks]  # all three queued before the first is read
    assert [u.new_ids for u in updates] == [[4], [5], [6]]
    assert updates[-1].output_ids == [1, 2, 3, 4, 5, 6] and updates[-1].text == decode([1, 2, 3, 4, 5, 6])


# ---- stop strings: nothing sent is taken back (stop_strings.py) ---------------------------------
def test_the_start_of_a_stop_string_waits_until_the_text_shows_what_it_is():
    stops = StopStrings(("t3 t4",))
    s = StreamSplicer(with_relay=True, decode=decode, stops=stops)
    s.relay_chunk(chunk([1, 2], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 2}))
    assert s.main_chunk(chunk([3], completion_tokens=3)).text == "t1 t2 "  # t3 may start it
    assert s.main_chunk(chunk([3, 5], completion_tokens=4)).text == "t1 t2 t3 t5"  # it did not
    s = StreamSplicer(with_relay=True, decode=decode, stops=stops)
    s.relay_chunk(chunk([1, 2], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 2}))
    held = s.main_chunk(chunk([3], completion_tokens=3))
    assert held.held_text == "t3"
    final = s.main_chunk(chunk([3, 4], True, completion_tokens=4,
                               finish_reason={"type": "stop", "matched": "t3 t4"}))
    assert final.text == "t1 t2 " and final.held_text == ""


def test_a_stop_string_the_relays_handoff_chunk_starts_is_held_back_from_it():
    s = StreamSplicer(with_relay=True, decode=decode, stops=StopStrings(("t3 t4",)))
    relay = s.relay_chunk(chunk([1, 2, 3], True,
                                finish_reason={"type": "pdd_handoff", "handed_tokens": 3}))
    assert relay.text == "t1 t2 " and relay.output_ids == [1, 2, 3]  # ids are never held
    final = s.main_chunk(chunk([4], True, completion_tokens=4,
                               finish_reason={"type": "stop", "matched": "t3 t4"}))
    assert final.text == "t1 t2 " and final.new_ids == [4]


def test_no_stop_trim_keeps_the_stop_string_and_cuts_what_follows_it_in_its_token():
    stops = StopStrings(("t3 t",), no_stop_trim=True)  # ends inside token 4 ("t4")
    s = StreamSplicer(with_relay=True, decode=decode, stops=stops)
    s.relay_chunk(chunk([1, 2], True, finish_reason={"type": "pdd_handoff", "handed_tokens": 2}))
    final = s.main_chunk(chunk([3, 4], True, completion_tokens=4,
                               finish_reason={"type": "stop", "matched": "t3 t"}))
    assert final.text == "t1 t2 t3 t"  # SGLang's cut: the text up to the stop string's end


def test_a_servers_own_text_is_passed_through_as_sglang_cut_it():
    s = StreamSplicer(with_relay=False, decode=decode, stops=StopStrings(("b c",)))
    assert s.main_chunk(chunk([1], text="a b")).text == "a "  # a server that did not hold back
    final = s.main_chunk(chunk([1, 2], True, text="a ",
                               finish_reason={"type": "stop", "matched": "b c"}))
    assert final.text == "a "


@pytest.mark.parametrize("text,sent,end", [
    ("ab st", 0, 3),  # "st" may start "stop"
    ("ab stop", 0, 3),  # a whole stop string the server has not finished on yet
    ("ab sx", 0, 5),
    ("ab s\ufffd", 0, 3),  # an incomplete character, then a stop string's start
    ("ab st", 4, 5),  # what the client has is not held again: "t" starts no stop string
])
def test_sendable_end(text, sent, end):
    assert StopStrings(("stop",)).sendable_end(text, sent) == end


@pytest.mark.parametrize("text,sent,reason,no_trim,end", [
    ("ab stop", 3, {"type": "stop", "matched": "stop"}, False, 3),
    ("ab stop", 3, {"type": "stop", "matched": "stop"}, True, 7),
    ("ab stopx", 3, {"type": "stop", "matched": "stop"}, True, 7),
    ("ab st", 5, {"type": "stop", "matched": "stop"}, False, 5),  # no stop found: all of it
    ("ab stop", 5, {"type": "stop", "matched": "stop"}, False, 5),  # part sent: only the rest
    ("ab stop", 3, {"type": "length"}, False, 7),
    ("ab stop", 3, {"type": "stop", "matched": 2}, False, 7),  # a stop token: ids, not text
])
def test_final_end(text, sent, reason, no_trim, end):
    assert StopStrings(("stop",), no_trim).final_end(text, sent, reason) == end


def test_stop_strings_come_from_sglangs_sampling_params():
    assert StopStrings.of({"stop": "x"}) == StopStrings(("x",))
    assert StopStrings.of({"stop": ["x", ""], "no_stop_trim": True}) == StopStrings(("x",), True)
    assert StopStrings.of({}) == StopStrings()


def test_the_openai_stream_sends_each_character_once_and_refuses_text_that_shrank():
    from pdd_sglang.router.openai_format import OpenAIStream
    from pdd_sglang.router.splice import SplicedUpdate
    stream = OpenAIStream(chat=False, model="m")

    def update(text):
        return SplicedUpdate([1], [1], text, {"finish_reason": None}, False, "main")

    assert [c["choices"][0]["text"] for c in stream.chunks(update("ab"))] == ["ab"]
    assert [c["choices"][0]["text"] for c in stream.chunks(update("abc"))] == ["c"]
    with pytest.raises(SpliceError, match="shrank"):  # never the whole answer a second time
        stream.chunks(update("a"))
