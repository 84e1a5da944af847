"""The two ends of the handoff microbenchmark: one process per side of an emulated WAN line.

``relay`` runs in cluster A (``line.exec_prefix("a")``), ``main`` in cluster B. The orchestrator,
:mod:`pdd_sglang.dev.wan_emulator.handoff_bench`, starts them and reads their one-line JSON reports.

Per trial, main (B) drives one handoff per mode and times it on its own clock:

- ``kv`` modes: main sends ``HandoffReady``; the relay writes the handed tokens' KV (N bytes) into
  main's registered buffer with a real Mooncake TransferEngine over TCP (``transfer_sync_write``),
  then sends ``HandoffTokens`` (the token IDs: main needs them anyway, and the message is the "KV
  written" notice). Main's time: ready sent -> tokens decoded; then main checks every byte of
  the buffer against the relay's pattern (outside the timing).
- ``token_ids``: the same messages without the KV write. If an SGLang server runs in B, main then
  hands the tokens to it as an EXTEND over a cached prefix (see :class:`Recompute`).

Both control messages are the real PDD messages over the real control channel
(:class:`~pdd_sglang.protocol.control_channel.ControlLoop`, CURVE-encrypted as across a real WAN).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pdd_sglang.protocol.control_channel import ControlLoop, CurveConfig
from pdd_sglang.protocol.messages import (HandoffReady, HandoffRefused, HandoffTokens, check_token_ids,
                                 encode, pack_tokens)
from pdd_sglang.dev.wan_emulator import netns
from pdd_sglang.dev.wan_emulator.forwarder import DEVICE

# The namespaces are fresh and hold only this benchmark, so a fixed port cannot collide.
RELAY_CONTROL_PORT = 17555
MODES_PER_TRIAL = 16  # room = trial * MODES_PER_TRIAL + mode index
FIRST_WORD_ID = 4  # the tiny model's special tokens come first (tiny_model.SPECIAL_TOKENS)
PATTERN_SEED = 20260707


def room_of(trial: int, mode: int) -> int:
    return trial * MODES_PER_TRIAL + mode


def handed_tokens(room: int, count: int, vocab_size: int) -> list[int]:
    """The token IDs "the relay generated" for ``room``: distinct per room, so every EXTEND on
    main recomputes new tokens instead of hitting its radix cache."""
    rng = random.Random(room)
    return [rng.randrange(FIRST_WORD_ID, vocab_size) for _ in range(count)]


def tokens_message(room: int, start: int, count: int, vocab_size: int) -> HandoffTokens:
    return HandoffTokens(room=room, seq=0, start=start,
                         token_ids=pack_tokens(handed_tokens(room, count, vocab_size)), is_last=True)


def message_bytes(count: int, vocab_size: int, start: int) -> int:
    """Encoded size of the token-ID handoff (the bytes on the control channel, before CURVE)."""
    return len(encode(tokens_message(room_of(0, 0), start, count, vocab_size)))


def kv_pattern(nbytes: int) -> bytes:
    return random.Random(PATTERN_SEED).randbytes(nbytes)


def _mooncake(host: str, nbytes: int):
    """A Mooncake TCP engine on ``host`` with one registered buffer of ``nbytes``."""
    from mooncake.engine import TransferEngine

    engine = TransferEngine()
    if engine.initialize(host, "P2PHANDSHAKE", "tcp", "") != 0:
        raise RuntimeError(f"Mooncake TCP engine failed to initialise on {host}")
    buffer = ctypes.create_string_buffer(max(nbytes, 1))
    ptr = ctypes.addressof(buffer)
    if engine.register_memory(ptr, len(buffer)) != 0:
        raise RuntimeError("Mooncake register_memory failed")
    return engine, buffer, ptr, f"{host}:{engine.get_rpc_port()}"


def _report(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _stdin_closed() -> threading.Event:
    closed = threading.Event()

    def watch():
        for _ in sys.stdin:
            pass
        closed.set()

    threading.Thread(target=watch, daemon=True).start()
    return closed


# ---- relay (cluster A) ------------------------------------------------------------------------
def run_relay(args) -> None:
    kv_bytes = args.kv_bytes
    engine, src, src_ptr, session = _mooncake(args.host, max(kv_bytes, default=1))
    pattern = kv_pattern(max(kv_bytes, default=1))
    ctypes.memmove(src_ptr, pattern, len(pattern))
    keys = Path(args.keys)
    loop = ControlLoop(relay_bind=f"tcp://{args.host}:{RELAY_CONTROL_PORT}",
                       curve=CurveConfig(keypair_file=keys / "relay.key_secret",
                                         authorized_mains_dir=keys / "mains"))
    _report({"ready": True, "session_id": session, "control_address": loop.address})
    stop = _stdin_closed()
    transfers: list[dict] = []
    while not stop.is_set():
        item = loop.wait_received(0.2)
        if item is None:
            continue
        peer, message = item
        if not isinstance(message, HandoffReady):
            continue
        trial, mode = divmod(message.room, MODES_PER_TRIAL)
        if mode < len(kv_bytes):
            t0 = time.perf_counter()
            ret = engine.transfer_sync_write(args.target_session, src_ptr, args.target_ptr,
                                             kv_bytes[mode])
            transfers.append({"trial": trial, "mode": mode, "ret": ret,
                              "ms": (time.perf_counter() - t0) * 1000})
            if ret != 0:
                loop.send(peer, HandoffRefused(room=message.room, reason="kv_write_failed"))
                continue
        loop.send(peer, tokens_message(message.room, args.start, args.tokens, args.vocab_size))
    loop.close()
    _report({"transfers": transfers, "refusals": dict(loop.refusals)})
    del src


# ---- main (cluster B) -------------------------------------------------------------------------
class Recompute:
    """Main's recompute, measured on a real SGLang server in cluster B (on B's loopback).

    ``extend``: POST ``/generate`` with ``input_ids`` = the cached prefix + the handed tokens and
    ``max_new_tokens=1``: one EXTEND of len(tokens) new tokens whose output is the next token, as
    main does on a handoff. The time is SGLang's own: the increase of
    ``sglang:per_stage_req_latency_seconds_sum{stage="prefill_forward"}`` (the scheduler's
    forward-entry -> prefill-finished span of that one request: batch preparation, forward,
    sampling, result processing). The same input again is a 1-token extend (all but the last
    token cached). ``decode_step``: SGLang's ``inter_token_latency_seconds`` over streamed
    requests on the same prefix.
    """

    def __init__(self, url: str, prefix: list[int], vocab_size: int):
        self.url, self.prefix, self.vocab_size = url, prefix, vocab_size

    def _post(self, body: dict):
        request = urllib.request.Request(self.url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(request, timeout=300)

    def generate(self, ids: list[int], max_new_tokens: int = 1) -> dict:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens,
                                                      "temperature": 0.0, "ignore_eos": True}}
        with self._post(body) as resp:
            return json.loads(resp.read())["meta_info"]

    def metrics(self) -> dict:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as resp:
            text = resp.read().decode()
        found = {"prefill_sum": 0.0, "prefill_count": 0.0, "itl_sum": 0.0, "itl_count": 0.0}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name.startswith("sglang:per_stage_req_latency_seconds_") and \
                    'stage="prefill_forward"' in name:
                key = "prefill_sum" if "_seconds_sum{" in name else (
                    "prefill_count" if "_seconds_count{" in name else None)
            elif name.startswith("sglang:inter_token_latency_seconds_sum{"):
                key = "itl_sum"
            elif name.startswith("sglang:inter_token_latency_seconds_count{"):
                key = "itl_count"
            else:
                key = None
            if key:
                found[key] += float(value)
        return found

    def _timed_extend(self, ids: list[int]) -> dict:
        before = self.metrics()
        t0 = time.perf_counter()
        meta = self.generate(ids)
        request_ms = (time.perf_counter() - t0) * 1000
        after = self.metrics()
        if after["prefill_count"] - before["prefill_count"] != 1:
            raise RuntimeError(f"expected one prefill_forward sample, got {before} -> {after}")
        return {"ms": (after["prefill_sum"] - before["prefill_sum"]) * 1000,
                "request_ms": request_ms, "cached_tokens": meta.get("cached_tokens")}

    def warm(self) -> int:
        self.generate(self.prefix)
        return self.generate(self.prefix).get("cached_tokens", 0)

    def extend(self, tokens: list[int]) -> dict:
        full = self._timed_extend(self.prefix + tokens)
        one = self._timed_extend(self.prefix + tokens)
        return {"recompute_ms": full["ms"], "extend_request_ms": full["request_ms"],
                "cached_tokens": full["cached_tokens"], "extend_1_token_ms": one["ms"],
                "extend_1_token_cached_tokens": one["cached_tokens"]}

    def decode_step(self, requests: int, new_tokens: int, seed: int) -> dict:
        before = self.metrics()
        rng = random.Random(seed)
        for _ in range(requests):
            suffix = [rng.randrange(FIRST_WORD_ID, self.vocab_size) for _ in range(8)]
            body = {"input_ids": self.prefix + suffix, "stream": True,
                    "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0.0,
                                        "ignore_eos": True}}
            with self._post(body) as resp:
                for _ in resp:  # drain the server-sent events
                    pass
        after = self.metrics()
        count = after["itl_count"] - before["itl_count"]
        return {"mean_ms": (after["itl_sum"] - before["itl_sum"]) / count * 1000 if count else None,
                "tokens": int(count), "requests": requests}


def _answer(loop: ControlLoop, room: int, deadline: float) -> HandoffTokens:
    """The relay's answer for ``room``; the loop's connection notes (not wire messages) pass."""
    while (left := deadline - time.perf_counter()) > 0:
        item = loop.wait_received(left)
        if item is None:
            break
        message = item[1]
        if isinstance(message, (HandoffTokens, HandoffRefused)) and message.room == room:
            if isinstance(message, HandoffRefused):
                raise RuntimeError(f"the relay refused room {room}: {message.reason}")
            return message
    raise RuntimeError(f"no answer from the relay for room {room}")


def run_main(args) -> None:
    kv_bytes = args.kv_bytes
    engine, dst, dst_ptr, session = _mooncake(args.host, max(kv_bytes, default=1))
    _report({"ready": True, "session_id": session, "buffer_ptr": dst_ptr})
    if sys.stdin.readline().strip() != "go":
        return
    pattern = kv_pattern(max(kv_bytes, default=1))
    keys = Path(args.keys)
    loop = ControlLoop(curve=CurveConfig(keypair_file=keys / "mains" / "main.key_secret",
                                         relay_public_key_file=keys / "relay.key"))
    recompute = None
    out: dict = {"trials": []}
    if args.server_url:
        rng = random.Random(1)
        prefix = [rng.randrange(FIRST_WORD_ID, args.vocab_size) for _ in range(args.start)]
        recompute = Recompute(args.server_url, prefix, args.vocab_size)
        out["prefix_cached_tokens"] = recompute.warm()
    modes = [("kv", n) for n in kv_bytes] + [("token_ids", 0)]
    for trial in range(args.warmup + args.trials):
        for mode, (kind, nbytes) in enumerate(modes):
            room = room_of(trial, mode)
            if nbytes:
                ctypes.memset(dst_ptr, 0, nbytes)
            before = netns.link_counters(args.netns, DEVICE)
            t0 = time.perf_counter()
            loop.send(args.relay_address, HandoffReady(room=room))
            message = _answer(loop, room, t0 + args.timeout_s)
            tokens = message.tokens
            ms = (time.perf_counter() - t0) * 1000
            after = netns.link_counters(args.netns, DEVICE)
            check_token_ids(tokens, args.vocab_size)
            if tokens != handed_tokens(room, args.tokens, args.vocab_size):
                raise RuntimeError(f"room {room}: token IDs differ from what the relay sent")
            record = {"trial": trial, "warmup": trial < args.warmup, "mode": kind,
                      "mode_index": mode, "kv_bytes": nbytes, "ms": ms,
                      "wire_rx_bytes": after["rx_bytes"] - before["rx_bytes"],
                      "wire_tx_bytes": after["tx_bytes"] - before["tx_bytes"]}
            if nbytes:
                record["kv_verified"] = ctypes.string_at(dst_ptr, nbytes) == pattern[:nbytes]
                if not record["kv_verified"]:
                    raise RuntimeError(f"room {room}: the KV in main's buffer is not the relay's")
            elif recompute is not None:
                record.update(recompute.extend(tokens))
            out["trials"].append(record)
        if args.progress:
            print(f"trial {trial + 1}/{args.warmup + args.trials}", file=sys.stderr, flush=True)
    if recompute is not None:
        out["decode_step"] = recompute.decode_step(args.decode_requests, args.decode_tokens, 2)
    loop.close()
    out["refusals"] = dict(loop.refusals)
    _report(out)
    del dst


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="One end of the handoff microbenchmark.")
    parser.add_argument("role", choices=("relay", "main"))
    parser.add_argument("--host", required=True, help="this side's line address")
    parser.add_argument("--keys", required=True, help="CURVE key directory")
    parser.add_argument("--kv-bytes", type=int, action="append", default=[])
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--start", type=int, default=2048, help="position of the first handed "
                        "token = the cached prefix length")
    parser.add_argument("--vocab-size", type=int, required=True)
    # relay
    parser.add_argument("--target-session")
    parser.add_argument("--target-ptr", type=int)
    # main
    parser.add_argument("--relay-address")
    parser.add_argument("--netns", help="main's namespace (for the line's counters)")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--server-url")
    parser.add_argument("--decode-requests", type=int, default=4)
    parser.add_argument("--decode-tokens", type=int, default=33)
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("--progress", action="store_true")
    args = parser.parse_args(argv)
    (run_relay if args.role == "relay" else run_main)(args)


if __name__ == "__main__":
    main()
