"""Emulated WAN line between PDD's two clusters, on one machine.

Topology (one line = one forwarder process, pid N)::

    namespace pddA-N (cluster A)                       namespace pddB-N (cluster B)
    P, RLD, router, clients                            MD
    lo   127.0.0.1  (P<->RLD stays here, local)        lo   127.0.0.1
    wan0 10.77.0.1/30 (TUN) --fd--> forwarder --fd--> wan0 10.77.0.2/30 (TUN)
                              (rate, RTT/2 +- jitter/2, FIFO; see forwarder.py)

How every byte of MD's traffic is forced across the line, without knowing any port:

1. MD runs inside namespace pddB-N (start it with ``line.exec_prefix("b")``). That namespace
   has exactly two interfaces: its own loopback and wan0. There is no veth, no bridge, no
   default route, no link to the host. A packet MD sends to any non-loopback address
   either leaves through wan0 or fails with "network unreachable"; nothing can go around.
2. wan0 is a TUN device: the kernel does not move its packets anywhere. Its only other end
   is a file descriptor held by the forwarder, which reads each IP packet, holds it for the
   emulated transmission and propagation time, then writes it into the other namespace's
   wan0. So Mooncake's TCP transfers on ephemeral ports, ZMQ control traffic and HTTP all
   pay the same rate limit, delay and jitter: the line works on IP packets, below ports.
3. Cluster A runs inside namespace pddA-N (``line.exec_prefix("a")``); P and RLD reach
   each other over its loopback, which never touches wan0 and so stays local. A reaches MD
   only at ``line.address("b")``, which is routed only via wan0.
4. IPv6 is disabled on wan0 and neither namespace forwards packets, so the line carries
   only our IPv4 traffic and nothing can leave this machine through it.

Both sides live in their own namespaces (rather than host = A) so that parallel lines can
reuse the same addresses without touching the host's routes, and so that processes on the
host can reach neither side by accident. The namespaces are named after the forwarder's pid
(it owns them). Cleanup happens on every exit path: the forwarder deletes both namespaces
and everything still running in them on SIGTERM/SIGINT/SIGHUP, or when its lifeline pipe
(stdin) hits EOF because the starting process died, even by SIGKILL; ``WanLine.stop()``
(context exit, atexit, SIGTERM/SIGHUP handlers) repeats the deletion in case the forwarder
itself was killed; :func:`cleanup_stale` removes leftovers whose forwarder is gone.

Usage::

    with WanLine(rate_mbit=100, rtt_ms=40, jitter_ms=4) as line:
        md = line.popen("b", ["python3", "-m", "...md...", "--host", line.address("b")])
        p = line.popen("a", ["python3", "-m", "...prefill...", "--host", line.address("a")])

CLI: ``python -m pdd_sglang.dev.wan_emulator up|down|list|cleanup|check``. Stdlib only; needs root,
/dev/net/tun and iproute2's ``ip``.
"""

from pdd_sglang.dev.wan_emulator import measure
from pdd_sglang.dev.wan_emulator.line import WanLine, check_prerequisites, stop_all
from pdd_sglang.dev.wan_emulator.netns import cleanup_stale

__all__ = ["WanLine", "check_prerequisites", "cleanup_stale", "measure", "stop_all"]
