"""Test and benchmark aids, plugged into serving code through :mod:`pdd_sglang.seam` only.

What a server gets, and how: the debug patch series (``patches/debug/``, which the test profile
applies and a production install does not) registers the ``--pdd-debug-*`` flags
(:func:`server_arg_namespaces`, :mod:`.flags`) and, in every scheduler process, installs the aids
those flags ask for (:func:`install_for`). Without that series the flags do not exist, and a
request's test controls (:mod:`.controls`) are an action type no server reads.

- ``--pdd-debug-handoff-hold`` (relay): a request's ``handoff_after_tokens`` / ``handoff_mode``
  controls force where and how it is handed off (:mod:`.handoff_hold`);
- ``--pdd-debug-corrupt-wan-kv`` (main): a request's ``corrupt_wan_kv`` control damages its WAN
  copy before main's KV digest is taken;
- ``--pdd-debug-wan-delay-ms`` (prefill): every chunk to a main waits that long before it is sent;
- ``--pdd-debug-wan-blocking-wait`` (prefill): the WAN engine waits inside Mooncake's synchronous
  (spinning) call, for ``scripts/bench_wan_cpu.py``;
- ``--pdd-debug-kv-digest`` is not an aid of the seam: ``patches/debug/0001`` calls
  :func:`pdd_sglang.hooks.on_prompt_kv_complete`, which reads it.

A test that drives a role in-process installs aids itself (:func:`installed`). This package is
imported by SGLang's ``server_args`` module under the debug series: it loads nothing else until
asked.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)


def server_arg_namespaces() -> list:
    """The ``--pdd-debug-*`` flags' namespace, appended to SGLang's by ``patches/debug/0002``."""
    from pdd_sglang.dev.debug_aids.flags import PddDebugArgs

    return [PddDebugArgs]


def install_for(server_args: Any) -> Optional[Any]:
    """A scheduler process starts (``patches/debug/0002``): install the aids its flags ask for,
    if any (a server without them keeps the seam's no-op aids); the aids installed, or None."""
    from pdd_sglang import seam
    from pdd_sglang.dev.debug_aids.aids import DebugAids

    if getattr(server_args, "pdd_role", None) is None:
        return None
    aids = DebugAids.from_args(server_args)
    if aids is None:
        return None
    seam.install(aids)
    logger.warning("PDD: test aids installed in this process (%s); not for serving", aids)
    return aids


@contextlib.contextmanager
def installed(aids: Any) -> Iterator[Any]:
    """In-process tests: ``aids`` at every seam point for the block, the previous ones after."""
    from pdd_sglang import seam

    previous = seam.install(aids)
    try:
        yield aids
    finally:
        seam.install(previous)
