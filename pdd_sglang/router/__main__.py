"""``python -m pdd_sglang.router --prefill URL [PORT] --relay URL --main URL [--host --port]``.

SIGINT (Ctrl-C) and SIGTERM stop it the same way, without a traceback: the listener closes, every
request still open is cancelled (``handler_cancellation``: each aborts itself on the servers
holding it), background streams get their drain time, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from typing import Optional, Sequence

from aiohttp import web

from pdd_sglang.router.app import build_app
from pdd_sglang.router.config import parse_args
from pdd_sglang.router.service import RouterService

logger = logging.getLogger("pdd_sglang.router")


async def serve(app: web.Application, host: str, port: int) -> None:
    # handler_cancellation: a client that goes away cancels its handler, which aborts the
    # request on every server holding it.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    logger.info("PDD router starting: waiting for its servers")
    # Start-up waits for the servers; a signal meanwhile stops it as well.
    setup = asyncio.ensure_future(runner.setup())
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({setup, stopped}, return_when=asyncio.FIRST_COMPLETED)
    if not setup.done():
        setup.cancel()
        await asyncio.gather(setup, return_exceptions=True)
        logger.info("PDD router stopping before its servers were ready")
        await _cleanup(runner)
        return
    stopped.cancel()
    setup.result()  # a start-up failure is the operator's to see
    try:
        await web.TCPSite(runner, host, port).start()
        logger.info("PDD router listening on http://%s:%s", host, port)
        await stop.wait()
        logger.info("PDD router stopping: closing the listener and aborting open requests")
    finally:
        await _cleanup(runner)


async def _cleanup(runner: web.AppRunner) -> None:
    try:
        await runner.cleanup()
    except (asyncio.TimeoutError, asyncio.CancelledError):
        logger.warning("PDD router: background streams did not drain in time; exiting anyway")
    except RuntimeError:  # cleaned up before setup finished: nothing was started
        pass


def main(argv: Optional[Sequence[str]] = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[%(asctime)s] %(name)s %(levelname)s %(message)s")
    app = build_app(RouterService(config))
    asyncio.run(serve(app, config.host, config.port))
    logger.info("PDD router stopped")


if __name__ == "__main__":
    main()
