"""``python -m pdd_sglang.router --prefill URL [PORT] --relay URL --main URL [--host --port]``.

SIGINT (Ctrl-C) and SIGTERM stop it the same way, without a traceback: the listener closes, every
request still open is cancelled (``handler_cancellation``: each aborts itself on the servers
holding it), background streams get their drain time, and the process exits 0. With
``--workers N`` the process started supervises N such routers on the port (router/workers.py).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import shutil
import signal
import ssl
import sys
import tempfile
from typing import Callable, Optional, Sequence

from aiohttp import web

from pdd_sglang.router.app import build_app, service_of
from pdd_sglang.router.config import parse_args
from pdd_sglang.router.front_door import listener_tls
from pdd_sglang.router.metrics import MULTIPROC_ENV
from pdd_sglang.router.service import RouterService
from pdd_sglang.router.shared_state import PeerBus
from pdd_sglang.router.workers import run_workers

logger = logging.getLogger("pdd_sglang.router")
LISTEN_BACKLOG = 4096


async def serve(app: web.Application, host: str, port: int, reuse_port: bool = False,
                listening: Optional[Callable[[], None]] = None,
                ssl_context: Optional[ssl.SSLContext] = None) -> None:
    """Serve ``app`` until a signal; ``listening`` is told once it listens (else it logs so).
    It listens at once and learns its servers meanwhile (its /ready says when it serves); a
    start-up that fails ends the process with its reason (SystemExit)."""
    # handler_cancellation: a client that goes away cancels its handler, which aborts the
    # request on every server holding it.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await runner.setup()
    failure = None
    try:
        # A backlog for a thousand clients connecting at once (aiohttp's default is 128).
        await web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG, ssl_context=ssl_context,
                          reuse_port=reuse_port or None).start()
        scheme = "https" if ssl_context is not None else "http"
        if listening is None:
            logger.info("PDD router listening on %s://%s:%s", scheme, host, port)
        else:
            listening()
        logger.info("PDD router starting: waiting for its servers")
        starting = service_of(app).starting
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done() and not starting.cancelled() and starting.exception() is not None:
            failure = starting.exception()
        elif starting.done():
            gc.freeze()  # what start-up loaded (the tokenizer, the modules) is never collected
            await stopped
        logger.info("PDD router stopping: closing the listener and aborting open requests")
    finally:
        await _cleanup(runner)
    if failure is not None:
        raise SystemExit(f"PDD router: {failure}")


async def _cleanup(runner: web.AppRunner) -> None:
    try:
        await runner.cleanup()
    except (asyncio.TimeoutError, asyncio.CancelledError):
        logger.warning("PDD router: background streams did not drain in time; exiting anyway")
    except RuntimeError:  # cleaned up before setup finished: nothing was started
        pass


# The cyclic garbage collector, tuned for a server that allocates a few hundred short-lived
# objects per chunk relayed: with Python's default (a young collection every 700 allocations) the
# collector was about 40 % of the relay path's CPU at saturation (2.3 ms per request, 1.3 ms with
# these thresholds, bench fakes, 256 streams). What start-up loaded is frozen out of the old
# generation once the router is ready (serve).
GC_THRESHOLDS = (50_000, 20, 100)


def run_event_loop(main_coroutine) -> None:
    """``main_coroutine`` on uvloop where it is installed (its loop and transports cost a
    fraction of asyncio's per chunk relayed), else on asyncio's own loop."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main_coroutine)
        return
    uvloop.run(main_coroutine)


def main(argv: Optional[Sequence[str]] = None) -> None:
    config = parse_args(argv)
    gc.set_threshold(*GC_THRESHOLDS)
    worker_tag = " [%(process)d]" if config.workers > 1 else ""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"[%(asctime)s]{worker_tag} %(name)s %(levelname)s %(message)s")
    if config.workers > 1:
        def serve_worker(index: int, sockets: list, ready_fd: int) -> None:
            service = RouterService(config, index, PeerBus(index, sockets))
            run_event_loop(serve(build_app(service), config.host, config.port, reuse_port=True,
                                 listening=lambda: _listening(index, ready_fd),
                                 ssl_context=listener_tls(config)))

        metrics_dir = _metrics_dir()
        try:
            scheme = "https" if config.ssl_certfile else "http"
            status = run_workers(config.workers, serve_worker, f"PDD router listening on "
                                 f"{scheme}://{config.host}:{config.port} ({config.workers} "
                                 "workers)")
        finally:
            if metrics_dir is not None:
                shutil.rmtree(metrics_dir, ignore_errors=True)
        logger.info("PDD router stopped")
        sys.exit(status)
    app = build_app(RouterService(config))
    run_event_loop(serve(app, config.host, config.port, ssl_context=listener_tls(config)))
    logger.info("PDD router stopped")


def _metrics_dir() -> Optional[str]:
    """Where the workers keep their metrics (router/metrics.py): the operator's
    PROMETHEUS_MULTIPROC_DIR, emptied (prometheus_client's rule: no files of an earlier run), or
    a directory of this run's, returned to be removed at exit."""
    given = os.environ.get(MULTIPROC_ENV)
    if given:
        os.makedirs(given, exist_ok=True)
        for name in os.listdir(given):
            if name.endswith(".db"):
                os.remove(os.path.join(given, name))
        return None
    os.environ[MULTIPROC_ENV] = made = tempfile.mkdtemp(prefix="pdd-router-metrics-")
    return made


def _listening(index: int, ready_fd: int) -> None:
    logger.info("PDD router worker %d listens", index)
    os.write(ready_fd, b".")


if __name__ == "__main__":
    main()
