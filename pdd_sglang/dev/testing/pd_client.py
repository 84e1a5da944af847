"""Send one request through a plain PD pair the way SGLang's PD router does.

The same ``/generate`` body, carrying the prefill's bootstrap address and a fresh room, goes to
the prefill and the decode server at once; the decode server's answer is the client's. (The PDD
router replaces this for three roles.)
"""

from __future__ import annotations

import random
import threading
import uuid

from pdd_sglang.protocol.messages import HANDOFF_FINISH_TYPE
from pdd_sglang.dev.debug_aids.controls import request_kv_hints
from pdd_sglang.dev.testing.cluster import SGLangServer

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
    route: dict | None = None,
) -> dict:
    """One request to a prefill and its decode servers at once; every decode server's answer.

    With ``pipeline`` set, the request carries PDD's route in ``kv_hints`` (what the router does),
    with the extra ``route`` fields (the relay's control address) and, prefixed ``debug_``, test
    controls (:mod:`pdd_sglang.dev.debug_aids.controls`: forced handoff points, a damaged copy).
    """
    room = new_room() if room is None else room
    body = {
        **body,
        "bootstrap_host": prefill.host,
        "bootstrap_port": bootstrap_port,
        "bootstrap_room": room,
    }
    if pipeline is not None:
        body["kv_hints"] = request_kv_hints(pipeline, **(route or {}))
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


def relay_control_address(relay: SGLangServer) -> str:
    return relay.pdd_state()["handoff"]["control_address"]


def generate_pdd(
    prefill: SGLangServer,
    relay: SGLangServer,
    main: SGLangServer,
    body: dict,
    bootstrap_port: int,
    timeout_s: float = 300.0,
    keep_main_copy: bool = False,
    **route,
) -> dict:
    """One P->RLD->MD request, spliced the way the router does it (non-streaming).

    Returns ``output_ids`` (the client's answer), ``handed_tokens`` (None when the relay finished
    the request alone, and then main's and prefill's copies are aborted, as the router does for
    singular traffic; ``keep_main_copy``: left to finish, as it does for the rest), the relay's
    and main's raw answers (main's may be an exception), the room and the rid.
    """
    route.setdefault("relay_control", relay_control_address(relay))
    room, rid = new_room(), f"pdd-test-{uuid.uuid4().hex}"
    body = {**body, "rid": rid, "bootstrap_host": prefill.host, "bootstrap_port": bootstrap_port,
            "bootstrap_room": room, "kv_hints": request_kv_hints("prefill_relay_main", **route)}
    results: dict = {}

    def call(server: SGLangServer) -> None:
        try:
            results[server.name] = server.post_json("/generate", body, timeout_s)
        except Exception as err:  # main's copy is aborted by design when the relay answers
            results[server.name] = err

    threads = {s.name: threading.Thread(target=call, args=(s,)) for s in (prefill, relay, main)}
    for thread in threads.values():
        thread.start()
    threads[relay.name].join(timeout_s + 10)
    relay_answer = results.get(relay.name, TimeoutError("relay did not answer"))
    finished_alone = not isinstance(relay_answer, Exception) and (
        relay_answer["meta_info"]["finish_reason"].get("type") != HANDOFF_FINISH_TYPE)
    if finished_alone and not keep_main_copy:
        for server in (main, prefill):
            try:
                server.post_json("/abort_request", {"rid": rid}, 30)
            except Exception:
                pass  # already finished there
    for thread in threads.values():
        thread.join(timeout_s + 10)
    main_answer = results.get(main.name, TimeoutError("main did not answer"))
    common = {"relay": relay_answer, "main": main_answer, "room": room, "rid": rid}
    if isinstance(relay_answer, Exception):
        raise RuntimeError(f"relay failed: {relay_answer!r}")
    if finished_alone:
        return {"output_ids": relay_answer["output_ids"], "handed_tokens": None, **common}
    if isinstance(main_answer, Exception):
        raise RuntimeError(f"the relay handed off but main failed: {main_answer!r}")
    handed = relay_answer["meta_info"]["finish_reason"]["handed_tokens"]
    return {"output_ids": relay_answer["output_ids"][:handed] + main_answer["output_ids"],
            "handed_tokens": handed,
            "mode": relay_answer["meta_info"]["finish_reason"].get("mode"), **common}
