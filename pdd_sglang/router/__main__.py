"""``python -m pdd_sglang.router --prefill URL [PORT] --relay URL --main URL [--host --port]``."""

from __future__ import annotations

import logging
import sys
from typing import Optional, Sequence

from aiohttp import web

from pdd_sglang.router.app import build_app
from pdd_sglang.router.config import parse_args
from pdd_sglang.router.service import RouterService


def main(argv: Optional[Sequence[str]] = None) -> None:
    config = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[%(asctime)s] %(name)s %(levelname)s %(message)s")
    app = build_app(RouterService(config))
    # handler_cancellation: a client that goes away cancels its handler, which aborts the
    # request on every server holding it.
    web.run_app(app, host=config.host, port=config.port, handler_cancellation=True,
                access_log=None, print=lambda msg: logging.getLogger("pdd_sglang.router").info(msg))


if __name__ == "__main__":
    main()
