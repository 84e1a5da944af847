"""The router's notices about a room's relay, which only the router sees (it splices the streams):

- ``POST /pdd/cache_only``: the relay answered alone, so main's copy of the room only warms
  main's cache and goes behind every copy a request waits for
  (:mod:`~pdd_sglang.prefill.wan_lines`);
- ``POST /pdd/relay_lost``: the relay died while it answered, so main's copy is the request's
  only way on: it stops being relay-covered and goes on with the window that fills the line
  (:func:`~pdd_sglang.prefill.wan_engine.background_window`). The prefill sees a relay fail only
  while it still sends it KV.

Why here: the router reaches the prefill only over HTTP, and only the router knows when a relay
has finished a request alone (it splices the streams). The prefill's HTTP process and its
scheduler processes are apart, so:

1. In each of the prefill's scheduler processes (every TP rank runs its own fan-out and its own
   WAN copies), thread ``pdd-cache-only`` (:class:`CacheOnlyIntake`, owned by
   :class:`~pdd_sglang.prefill.wan_path.WanPath`) binds a ZMQ PULL socket at
   :func:`intake_address` (named after the launcher's PID and the rank) and posts each room it
   reads to the fan-out's owner as :class:`~pdd_sglang.prefill.events.CacheOnly` or
   :class:`~pdd_sglang.prefill.events.RelayLost`, as the notice's ``kind`` says.
2. The launcher's HTTP process serves the routes (patch 0018's route hook): it checks the body,
   pushes it with its kind to every rank's socket without waiting, and answers 202 with how many
   ranks took it.
   A room the fan-out does not know (already concluded, never PDD's) is ignored there.

Best effort by design: a lost cache-only notice only leaves a copy needed-now, as before the
route; a lost relay-lost notice leaves a copy in the background window, which lands later.
"""

import glob
import json
import logging
import os
import tempfile
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)

ROUTE = "/pdd/cache_only"
RELAY_LOST_ROUTE = "/pdd/relay_lost"
CACHE_ONLY, RELAY_LOST = "cache_only", "relay_lost"  # a notice's kind on the intake's socket
KIND_OF_ROUTE = {ROUTE: CACHE_ONLY, RELAY_LOST_ROUTE: RELAY_LOST}
MAX_ROOMS = 4096  # per notice: the router sends one room per finished request


def _prefix(launcher_pid: int) -> str:
    return os.path.join(tempfile.gettempdir(), f"pdd-sglang-cache-only-{launcher_pid}-")


def intake_address(launcher_pid: int, tp_rank: int) -> str:
    return f"ipc://{_prefix(launcher_pid)}{tp_rank}.sock"


def parse_rooms(body: Any) -> list[int]:
    """``{"rooms": [int, ...]}``, or a ValueError naming what is wrong."""
    rooms = body.get("rooms") if isinstance(body, dict) else None
    if not isinstance(rooms, list) or not rooms:
        raise ValueError('the body must be {"rooms": [bootstrap_room, ...]}, a non-empty list')
    if len(rooms) > MAX_ROOMS:
        raise ValueError(f"at most {MAX_ROOMS} rooms per notice, got {len(rooms)}")
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in rooms):
        raise ValueError("every room must be a non-negative integer (SGLang's bootstrap_room)")
    return rooms


class CacheOnlyIntake:
    """Thread ``pdd-cache-only`` of one scheduler process: notices in, CacheOnly and RelayLost
    events out."""

    def __init__(self, post: Any, launcher_pid: int, tp_rank: int):
        import zmq

        self.post = post
        self.path = f"{_prefix(launcher_pid)}{tp_rank}.sock"
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(intake_address(launcher_pid, tp_rank))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdd-cache-only", daemon=True)

    def start(self) -> "CacheOnlyIntake":
        self._thread.start()
        return self

    def _run(self) -> None:
        from pdd_sglang.lifecycle import name_os_thread
        from pdd_sglang.prefill.events import CacheOnly, RelayLost

        name_os_thread("pdd-cache-only")
        event_of = {CACHE_ONLY: CacheOnly, RELAY_LOST: RelayLost}
        while not self._stop.is_set():
            if not self._socket.poll(250):
                continue
            try:
                notice = json.loads(self._socket.recv())
                event = event_of[notice.get("kind", CACHE_ONLY)]
                for room in parse_rooms(notice):
                    self.post(event(room))
            except Exception:  # a bad notice must never take the prefill down
                logger.exception("PDD: a notice about a room's relay could not be read")

    def close(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._socket.close(0)
        try:
            os.unlink(self.path)
        except OSError:
            pass


def start_intake(kv_mgr: Any, post: Any) -> Optional[CacheOnlyIntake]:
    rank = int(getattr(kv_mgr, "attn_tp_rank", 0) or 0)
    try:
        return CacheOnlyIntake(post, os.getppid(), rank).start()
    except Exception:  # the prefill serves without it: every copy stays needed-now
        logger.exception("PDD: the cache-only intake could not start")
        return None


def push_notice(rooms: list[int], launcher_pid: Optional[int] = None,
                kind: str = CACHE_ONLY) -> int:
    """HTTP process: the notice to every rank of this launcher's prefill; how many took it."""
    import zmq

    pid = os.getpid() if launcher_pid is None else launcher_pid
    payload = json.dumps({"rooms": rooms, "kind": kind}).encode()
    context = zmq.Context.instance()
    taken = 0
    for path in sorted(glob.glob(f"{_prefix(pid)}*.sock")):
        socket = context.socket(zmq.PUSH)
        socket.setsockopt(zmq.LINGER, 1000)
        socket.setsockopt(zmq.SNDHWM, 1000)
        try:
            socket.connect(f"ipc://{path}")
            socket.send(payload, zmq.NOBLOCK)
            taken += 1
        except zmq.ZMQError as err:
            logger.warning("PDD: a %s notice to %s was not taken: %s", kind, path, err)
        finally:
            socket.close()
    return taken


def add_route(app: Any) -> None:
    """Serve ``POST /pdd/cache_only`` and ``POST /pdd/relay_lost`` on SGLang's FastAPI app (the
    launcher's HTTP process). (No ``from __future__ import annotations`` in this module: FastAPI
    reads the handler's annotation to pass it the request.)"""
    for route, kind in KIND_OF_ROUTE.items():
        app.add_api_route(route, _handler(kind), methods=["POST"], include_in_schema=False)


def _handler(kind: str) -> Any:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    async def pdd_relay_notice(request: Request) -> JSONResponse:
        try:
            rooms = parse_rooms(await request.json())
        except ValueError as err:
            return JSONResponse({"error": str(err)}, status_code=400)
        taken = push_notice(rooms, kind=kind)
        if not taken:
            what = kind.replace("_", "-")
            return JSONResponse({"error": f"no prefill scheduler takes {what} notices (not "
                                          "started yet, or not a PDD prefill)"},
                                status_code=503)
        return JSONResponse({"rooms": len(rooms), "ranks": taken}, status_code=202)

    return pdd_relay_notice
