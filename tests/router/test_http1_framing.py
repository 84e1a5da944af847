"""The router's HTTP/1.1 framing (router/http1.py, httptools) against h11 as the reference: the
same byte streams, split anywhere, give the same status and body, or fail alike; malformed ones
(conflicting or duplicate lengths, truncated or damaged chunks, bytes past the answer, bodies
over the cap) fail with a clear BadResponse. No sockets."""

from __future__ import annotations

import asyncio

import h11
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdd_sglang.router.http1 import BadResponse, Connection, Pool

from test_http1 import FakeTransport

OK, INCOMPLETE, FAILED = "ok", "incomplete", "failed"


def ours(pieces: list[bytes], eof: bool, max_body_bytes: int = 0):
    """What the router's client makes of the bytes: (OK, status, body), INCOMPLETE or (FAILED,
    the error)."""
    async def run():
        pool = Pool(connect_timeout_s=1.0, keepalive_s=1.0)
        if max_body_bytes:
            pool.max_body_bytes = max_body_bytes
        conn = Connection(pool, ("h", 1, False))
        conn.connection_made(FakeTransport())
        for piece in pieces:
            if conn.error is None:
                conn.data_received(piece)
        if eof:
            conn.eof_received()
            conn.connection_lost(None)
        if conn.error is not None:
            return FAILED, conn.error
        if not conn.body_done:
            return (INCOMPLETE,)
        return OK, conn.status, await conn.read(1.0)
    return asyncio.run(run())


def reference(pieces: list[bytes], eof: bool):
    """h11's reading of the same bytes, as a client that sent one GET."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("Host", "h")]))
    conn.send(h11.EndOfMessage())
    status, body = None, b""
    try:
        for piece in pieces + ([b""] if eof else []):
            conn.receive_data(piece)
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    break
                if isinstance(event, h11.Response):
                    status = event.status_code
                elif isinstance(event, h11.Data):
                    body += bytes(event.data)
                elif isinstance(event, h11.EndOfMessage):
                    return OK, status, body
                elif event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                    break
    except h11.RemoteProtocolError as err:
        return FAILED, err
    return (INCOMPLETE,)


def same(a, b) -> bool:
    """The same outcome (errors compared by kind, not message)."""
    return a[0] == b[0] and (a[0] != OK or a[1:] == b[1:])


@st.composite
def responses(draw):
    """A well-formed answer: status, a few headers, a body framed by Content-Length, chunks or
    the connection's end; and whether the connection then ends."""
    status = draw(st.sampled_from([200, 201, 400, 404, 500, 503]))
    body = draw(st.binary(max_size=300))
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    headers = [b"content-type: application/json"] + [
        b"x-h%d: %s" % (i, value.encode()) for i, value in enumerate(draw(st.lists(
            st.text("abcdefghijklmnopqrstuvwxyz0123456789-", min_size=1, max_size=12),
            max_size=3)))]
    if framing == "length":
        headers.append(b"content-length: %d" % len(body))
        payload = body
    elif framing == "chunked":
        headers.append(b"transfer-encoding: chunked")
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=5)))
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)]) if b > a]
        payload = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    else:
        headers.append(b"connection: close")
        payload = body
    raw = b"HTTP/1.1 %d X\r\n%s\r\n\r\n%s" % (status, b"\r\n".join(headers), payload)
    eof = framing == "close" or draw(st.booleans())
    return raw, eof


@st.composite
def split(draw, raw: bytes) -> list[bytes]:
    cuts = sorted(set(draw(st.lists(st.integers(1, max(len(raw) - 1, 1)), max_size=8))))
    return [raw[a:b] for a, b in zip([0, *cuts], [*cuts, len(raw)]) if b > a]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_well_formed_answers_read_as_h11_reads_them_wherever_they_split(data):
    raw, eof = data.draw(responses())
    pieces = data.draw(split(raw))
    got, expected = ours(pieces, eof), reference(pieces, eof)
    assert expected[0] == OK
    assert same(got, expected), (got, expected, raw)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_damaged_answers_fail_where_h11_fails(data):
    """Cut short by the connection's end, a chunk size or chunk end damaged, a second
    Content-Length that disagrees, bytes after the answer: where h11 refuses or waits, so does
    the router's client (never an answer h11 does not read)."""
    raw, _ = data.draw(responses())
    damage = data.draw(st.sampled_from(["truncate", "chunk_size", "chunk_end", "two_lengths",
                                        "trailing"]))
    head_end = raw.index(b"\r\n\r\n")
    if damage == "truncate":
        raw = raw[:data.draw(st.integers(0, max(len(raw) - 1, 0)))]
    elif damage == "chunk_size" and b"transfer-encoding" in raw:
        raw = raw[:head_end + 4] + b"zz" + raw[head_end + 4:]
    elif damage == "chunk_end" and b"transfer-encoding" in raw and raw.endswith(b"\r\n0\r\n\r\n") \
            and len(raw) > head_end + 12:
        raw = raw[:-7] + b"XY" + raw[-5:]
    elif damage == "two_lengths" and b"content-length" in raw:
        raw = raw[:head_end] + b"\r\ncontent-length: 999999" + raw[head_end:]
    elif damage == "trailing" and b"connection: close" not in raw:
        raw = raw + b"HTTP/1.1 200 X\r\ncontent-length: 0\r\n\r\n"
    else:
        return  # this damage does not apply to this framing
    pieces = data.draw(split(raw)) if raw else []
    got, expected = ours(pieces, True), reference(pieces, True)
    if damage == "trailing":
        # h11 reads the first answer and leaves the rest for the next request; the router's
        # client asked for one answer and refuses a second it did not ask for.
        assert expected[0] == OK and got[0] == FAILED
        assert "after the end of the answer" in str(got[1])
        return
    if expected[0] == OK:  # a truncation that h11 still reads whole (an answer up to EOF)
        assert same(got, expected), (got, expected, raw)
    else:
        assert got[0] == FAILED, (got, expected, raw)


def test_a_length_beside_chunked_framing_is_refused_where_h11_lets_chunks_win():
    """RFC 9112 6.1: a message with both may be an attempt at request smuggling; llhttp refuses
    it (h11 reads the chunks); the router asked for neither and drops the connection."""
    raw = (b"HTTP/1.1 200 X\r\ncontent-length: 3\r\ntransfer-encoding: chunked\r\n\r\n"
           b"3\r\nabc\r\n0\r\n\r\n")
    assert reference([raw], False)[0] == OK
    got = ours([raw], False)
    assert got[0] == FAILED and isinstance(got[1], BadResponse)
    assert "Content-Length" in str(got[1])


@pytest.mark.parametrize("raw, reason", [
    (b"HTTP/1.1 200 X\r\ncontent-length: 3\r\ncontent-length: 4\r\n\r\nabcd", "Content-Length"),
    (b"HTTP/1.1 200 X\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabcde\r\n", "chunk"),
    (b"HTTP/2 200 X\r\n\r\n", ""),
    (b"garbage\r\n\r\n", ""),
])
def test_malformed_answers_fail_with_llhttp_s_reason(raw, reason):
    got = ours([raw], False)
    assert got[0] == FAILED and isinstance(got[1], BadResponse) and reason in str(got[1])
    assert reference([raw], False)[0] == FAILED


def test_a_truncated_chunked_answer_fails_as_a_server_that_went_away():
    raw = b"HTTP/1.1 200 X\r\ntransfer-encoding: chunked\r\n\r\n5\r\nab"
    got = ours([raw], True)
    assert got[0] == FAILED and isinstance(got[1], ConnectionResetError)
    assert reference([raw], True)[0] == FAILED


@pytest.mark.parametrize("framing", [b"content-length: 5000", b"transfer-encoding: chunked"])
def test_an_answer_over_the_body_cap_is_dropped(framing):
    body = b"x" * 5000
    payload = body if framing.startswith(b"content") else b"%x\r\n%s\r\n0\r\n\r\n" % (
        len(body), body)
    raw = b"HTTP/1.1 200 X\r\n%s\r\n\r\n%s" % (framing, payload)
    got = ours([raw[:2000], raw[2000:]], False, max_body_bytes=1000)
    assert got[0] == FAILED and isinstance(got[1], BadResponse) and "over 1000 bytes" in str(got[1])
    assert ours([raw], False, max_body_bytes=10000)[0] == OK
