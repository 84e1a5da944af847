"""Send one request through a plain PD pair the way SGLang's PD router does.

The same ``/generate`` body, carrying the prefill's bootstrap address and a fresh room, goes to
the prefill and the decode server at once; the decode server's answer is the client's. (The PDD
router replaces this for three roles.)
"""

from __future__ import annotations

import random
import threading

from pdd_sglang.route import route_kv_hints
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
    """Plain SGLang PD: the decode server's answer, with the room used."""
    answers = generate_fanout(prefill, [decode], body, bootstrap_port, None, room, timeout_s)
    return answers[decode.name]


def generate_fanout(
    prefill: SGLangServer,
    decoders: list[SGLangServer],
    body: dict,
    bootstrap_port: int,
    pipeline: str | None,
    room: int | None = None,
    timeout_s: float = 300.0,
) -> dict:
    """One request to a prefill and its decode servers at once; every decode server's answer.

    With ``pipeline`` set, the request carries PDD's route in ``kv_hints`` (what the router does).
    """
    room = new_room() if room is None else room
    body = {
        **body,
        "bootstrap_host": prefill.host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }
    if pipeline is not None:
        body["kv_hints"] = route_kv_hints(pipeline)
    results: dict = {}

    def call(server: SGLangServer) -> None:
        try:
            results[server.name] = server.post_json("/generate", body, timeout_s)
        except Exception as err:  # surfaced below, with which side failed
            results[server.name] = err

    servers = [prefill, *decoders]
    threads = [threading.Thread(target=call, args=(s,)) for s in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 10)
    for server in servers:
        outcome = results.get(server.name)
        if outcome is None or isinstance(outcome, Exception):
            raise RuntimeError(f"PD request room={room} failed on {server.name}: {outcome!r}")
    return {s.name: {**results[s.name], "bootstrap_room": room} for s in decoders}
