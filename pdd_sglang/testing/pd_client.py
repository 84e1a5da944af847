"""Send one request through a plain PD pair the way SGLang's PD router does.

The same ``/generate`` body, carrying the prefill's bootstrap address and a fresh room, goes to
the prefill and the decode server at once; the decode server's answer is the client's. (The PDD
router replaces this for three roles.)
"""

from __future__ import annotations

import random
import threading

from pdd_sglang.testing.cluster import SGLangServer

_rooms = random.Random()


def new_room() -> int:
    return _rooms.randrange(1, 2**62)


def generate_pd(
    prefill: SGLangServer,
    decode: SGLangServer,
    body: dict,
    bootstrap_port: int,
    room: int | None = None,
    timeout_s: float = 300.0,
) -> dict:
    room = new_room() if room is None else room
    body = {
        **body,
        "bootstrap_host": prefill.host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }
    results: dict = {}

    def call(server: SGLangServer) -> None:
        try:
            results[server.name] = server.post_json("/generate", body, timeout_s)
        except Exception as err:  # surfaced below, with which side failed
            results[server.name] = err

    threads = [threading.Thread(target=call, args=(s,)) for s in (prefill, decode)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    for server in (prefill, decode):
        outcome = results.get(server.name)
        if outcome is None or isinstance(outcome, Exception):
            raise RuntimeError(f"PD request room={room} failed on {server.name}: {outcome!r}")
    answer = dict(results[decode.name])
    answer["bootstrap_room"] = room
    return answer
