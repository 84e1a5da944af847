"""The servers behind the router: their roles, live load as the router sees it, and health.

Each server's actual PDD role (``pdd_role`` in its ``/server_info``) is checked against the list it
was given in (``--prefill``, ``--relay``, ``--main``) at start and on every health poll
(:func:`role_mismatch`): a prefill started without ``--pdd-role`` falls back to SGLang's one-prefix
rule and would send wrong pages, so such a server never serves.

Their TP sizes (``tp_size`` in ``/server_info``) may differ between roles, as SGLang's PD allows
(issue 37: a prefill rank writes each decode rank its own KV heads), where one size divides the
other; sizes SGLang cannot pair are checked the same way (:meth:`ServerPool.tp_mismatch`): the
router refuses to start beside a relay or main whose size a prefill's does not divide or is not a
divisor of, and a server whose size changed later to one that does not pair leaves rotation as a
wrong role does. Each server's TP size is in the router's ``/ready`` body and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from functools import cached_property
from typing import Callable, Iterator, Optional
from urllib.parse import urlparse

logger = logging.getLogger("pdd_sglang.router")

PREFILL, RELAY, MAIN = "prefill", "relay", "main"
# What a health poll found (UpstreamClient.health).
HEALTH_OK, HEALTH_STALLED, HEALTH_UNREACHABLE = "ok", "stalled", "unreachable"


@dataclass(eq=False)
class Upstream:
    """One SGLang server. ``outstanding`` counts the router's requests it holds right now."""

    role: str
    url: str
    bootstrap_port: Optional[int] = None  # prefill only
    outstanding: int = 0
    healthy: bool = True
    consecutive_failures: int = 0
    max_running_requests: int = 1
    kv_pool_tokens: Optional[int] = None
    incremental_streaming_output: bool = False
    control_address: Optional[str] = None  # relay only: its handoff control channel
    mooncake_session: Optional[str] = None  # a main's: the key of prefill's wan_line entry for it
    # A main that a prefill took out after a failed WAN copy (``pdd.fanout.mains_out``), until
    # that prefill's WAN probe reaches it again: healthy over HTTP, but no KV can reach it.
    wan_out: bool = False
    # Its --pdd-advertise-host (from /server_info): a prefill's is where mains register.
    advertise_host: Optional[str] = None
    # Why it is refused (its actual role is not the one it was given, or its TP size is not the
    # prefill's); None when it matches.
    role_error: Optional[str] = None
    tp_size: Optional[int] = None  # its --tp-size (from /server_info); None when not reported

    @cached_property  # the URL is the server's identity: parsed once, not per request
    def host(self) -> str:
        return urlparse(self.url).hostname or "127.0.0.1"

    @property
    def bootstrap_host(self) -> str:
        """Where a main (in the other datacenter) reaches this prefill's bootstrap server: its
        --pdd-advertise-host, else the host of the URL the router was given for it."""
        return self.advertise_host or self.host

    def learn(self, server_info: dict) -> None:
        """Take capacity and stream format from the server's /server_info."""
        states = server_info.get("internal_states") or [{}]
        # The server argument is None unless set; the scheduler's effective limit is in its state.
        capacity = (server_info.get("max_running_requests")
                    or states[0].get("effective_max_running_requests_per_dp"))
        self.max_running_requests = max(1, int(capacity or 1))
        self.incremental_streaming_output = bool(server_info.get("incremental_streaming_output"))
        pool = states[0].get("max_total_num_tokens") or server_info.get("max_total_tokens")
        self.kv_pool_tokens = int(pool) if pool else None
        pdd = states[0].get("pdd") or {}
        handoff = pdd.get("handoff") or {}
        self.control_address = handoff.get("control_address") or self.control_address
        self.mooncake_session = pdd.get("mooncake_session") or self.mooncake_session
        self.advertise_host = server_info.get("pdd_advertise_host") or None
        tp_size = server_info.get("tp_size")
        self.tp_size = int(tp_size) if tp_size else None


ROLE_FLAGS = {PREFILL: "--prefill", RELAY: "--relay", MAIN: "--main"}


def role_mismatch(upstream: Upstream, server_info: dict) -> Optional[str]:
    """None when the server runs the role it was given to the router as; else why not."""
    actual = server_info.get("pdd_role")
    if actual == upstream.role:
        return None
    has = (f"runs --pdd-role {actual}" if actual else
           "runs without --pdd-role (a plain SGLang server: a prefill would send wrong pages "
           "when relay and main hold different prefixes)")
    return (f"{upstream.url} {has}, but it was given to the router as a {upstream.role} "
            f"({ROLE_FLAGS[upstream.role]}); restart it with --pdd-role {upstream.role} or list "
            "it under " + (ROLE_FLAGS.get(actual, "the flag of its role")))


TP_WHY = ("SGLang's PD pairs prefill and decode ranks by whole ratios, so one TP size must divide "
          "the other")


def tp_sizes_pair(prefill_tp: int, decode_tp: int) -> bool:
    """Whether SGLang's PD pairs the ranks of a prefill and a decode at these TP sizes (as the
    prefill's fan-out decides: ``pdd_sglang.protocol.messages.tp_refusal``)."""
    small, large = sorted((prefill_tp, decode_tp))
    return small >= 1 and large % small == 0


class NoHealthyServer(RuntimeError):
    def __init__(self, role: str):
        super().__init__(f"no healthy {role} server")
        self.role = role


class ServerPool:
    """Every upstream by role; picks by load among the healthy ones."""

    def __init__(self, prefills, relays, mains):
        self.by_role: dict[str, list[Upstream]] = {
            PREFILL: [Upstream(PREFILL, p.url, p.bootstrap_port) for p in prefills],
            RELAY: [Upstream(RELAY, url) for url in relays],
            MAIN: [Upstream(MAIN, url) for url in mains],
        }
        # Each prefill's TP size at start (settle_tp_size; None until then): the sizes relays
        # and mains must pair with; a prefill is checked against them only once it runs another.
        self.prefill_tp: Optional[dict[str, int]] = None

    def all(self) -> list[Upstream]:
        return [u for group in self.by_role.values() for u in group]

    def settle_tp_size(self) -> None:
        """Take the TP size of every prefill that reported one (and has its role) at start."""
        self.prefill_tp = {u.url: u.tp_size for u in self.by_role[PREFILL]
                           if u.tp_size is not None and u.role_error is None}

    def tp_mismatch(self, upstream: Upstream) -> Optional[str]:
        """None when SGLang's PD pairs ``upstream``'s TP size with every server of the other
        side (a relay or main with each prefill; a prefill that changed its size since the
        start with each relay and main); else why it is refused, naming both servers and both
        sizes. Unknown sizes are not checked."""
        size = upstream.tp_size
        if size is None or self.prefill_tp is None:  # unknown, or not settled yet
            return None
        if upstream.role != PREFILL:
            others = list(self.prefill_tp.items())
        elif self.prefill_tp.get(upstream.url) == size:
            return None  # a size the decodes are checked against
        else:  # down at start, or restarted at another size
            others = [(u.url, u.tp_size) for role in (RELAY, MAIN) for u in self.by_role[role]
                      if u.tp_size is not None and u.role_error is None]
        for url, other in others:
            if not tp_sizes_pair(size, other):
                other_role = PREFILL if upstream.role != PREFILL else self._role_of(url)
                return (f"{upstream.url} ({upstream.role}) runs --tp-size {size}, but the "
                        f"{other_role} {url} runs --tp-size {other}: {TP_WHY}; restart it with a "
                        f"--tp-size that divides {other} or that {other} divides")
        return None

    def _role_of(self, url: str) -> str:
        return next(u.role for u in self.all() if u.url == url)

    def health_view(self) -> list[dict]:
        """Each server as the router sees it (the router's ``/ready`` body)."""
        return [{"role": u.role, "url": u.url, "healthy": u.healthy, "wan_out": u.wan_out,
                 "tp_size": u.tp_size, "refused": u.role_error} for u in self.all()]

    def healthy(self, role: str) -> list[Upstream]:
        return [u for u in self.by_role[role] if u.healthy and not u.wan_out]

    def least_loaded(self, role: str, usable=None) -> Upstream:
        """Fewest outstanding requests relative to capacity; ties to the first listed."""
        candidates = [u for u in self.healthy(role) if usable is None or usable(u)]
        if not candidates:
            raise NoHealthyServer(role)
        return min(candidates, key=lambda u: u.outstanding / u.max_running_requests)

    @contextlib.contextmanager
    def holding(self, upstreams: list[Upstream]) -> Iterator[None]:
        for upstream in upstreams:
            upstream.outstanding += 1
        try:
            yield
        finally:
            for upstream in upstreams:
                upstream.outstanding -= 1


class HealthMonitor:
    """Polls /health; a server leaves after N failures in a row and returns on one success.

    Each server is polled on its own cadence: SGLang answers /health with a one-token generation
    (a second at least, up to the poll's timeout on a busy server), and one poll round waiting
    for the slowest server once left a dead relay in rotation for that long on top of the
    interval.

    A refused connection (nothing listens: the process is gone) takes a server out at once,
    whatever N says; a stall (the server answers unhealthy or late) never takes out the last
    healthy prefill, which nothing can replace.

    Request-path failures count too (``report_failure``, ``report_unreachable``, ``probe``), so
    a dead server stops receiving traffic before the next poll.
    """

    def __init__(self, pool: ServerPool, http, interval_s: float, failures_to_remove: int):
        self.pool = pool
        self.http = http
        self.interval_s = interval_s
        self.failures_to_remove = max(1, failures_to_remove)
        self._tasks: list[asyncio.Task] = []
        self._probes: dict[Upstream, asyncio.Task] = {}
        # Called (and awaited) when a server returns, to re-read its capacity.
        self.on_recovered = None
        # Called with each server the moment it leaves rotation.
        self.on_removed: list[Callable[[Upstream], None]] = []
        # Called (and awaited) after each healthy poll: why the server is refused (its role or
        # its TP size), or None.
        self.check_role = None

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._watch(u)) for u in self.pool.all()]

    async def stop(self) -> None:
        tasks = self._tasks + list(self._probes.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks, self._probes = [], {}

    async def check_all(self) -> None:
        await asyncio.gather(*(self._check(u) for u in self.pool.all()))

    async def _watch(self, upstream: Upstream) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self._check(upstream)

    def probe(self, upstream: Upstream) -> None:
        """Check ``upstream`` now, not at its next poll: its stream just broke, and a dead
        server answers a connection with a refusal within a round trip."""
        if upstream in self._probes:
            return
        task = asyncio.create_task(self._check(upstream))
        self._probes[upstream] = task
        task.add_done_callback(lambda _: self._probes.pop(upstream, None))

    async def _check(self, upstream: Upstream) -> None:
        status = await self.http.health(upstream)
        if status == HEALTH_OK and self.check_role is not None:
            if not self.refuse_if_wrong_role(upstream, await self.check_role(upstream)):
                return
        if status == HEALTH_OK:
            if not upstream.healthy and self.on_recovered is not None:
                if not await self.on_recovered(upstream):
                    return
            self.report_success(upstream)
        elif status == HEALTH_UNREACHABLE:
            self.report_unreachable(upstream)
        elif self._last_prefill(upstream):
            # The process is there but busy past SGLang's own health deadline (e.g. a long
            # prefill behind its WAN copies). Without a prefill nothing can be served: taking the
            # only one out of rotation turns every queued and new request into a 503 and cures
            # nothing. Requests in flight keep their own timeouts; a dead process refuses
            # connections, which does count. (A stalled main or relay still leaves: the other
            # decode server answers instead, e.g. the relay alone while the line is cut.)
            upstream.consecutive_failures += 1
            logger.warning("prefill %s stalled (health check %d in a row) but is the only one: "
                           "kept in rotation", upstream.url, upstream.consecutive_failures)
        else:
            self.report_failure(upstream)

    def refuse_if_wrong_role(self, upstream: Upstream, mismatch: Optional[str]) -> bool:
        """Take a server whose role is not the one it was given, or whose TP size does not
        pair with the other side's, out of rotation (it stays out until a poll finds both
        right). True when both are right."""
        if mismatch is None:
            if upstream.role_error is not None:
                logger.warning("%s %s now runs --pdd-role %s at a TP size that pairs",
                               upstream.role, upstream.url, upstream.role)
            upstream.role_error = None
            return True
        if mismatch != upstream.role_error:
            logger.error("refused: %s", mismatch)
        upstream.role_error = mismatch
        self._remove(upstream, "has the wrong PDD role or TP size")
        return False

    def _last_prefill(self, upstream: Upstream) -> bool:
        return upstream.role == PREFILL and self.pool.healthy(PREFILL) == [upstream]

    def report_success(self, upstream: Upstream) -> None:
        if not upstream.healthy:
            logger.warning("%s %s is healthy again: back in rotation", upstream.role, upstream.url)
        upstream.healthy, upstream.consecutive_failures = True, 0

    def report_failure(self, upstream: Upstream) -> None:
        upstream.consecutive_failures += 1
        if upstream.consecutive_failures >= self.failures_to_remove:
            self._remove(upstream, f"failed {upstream.consecutive_failures} times in a row "
                                   "(health checks and requests)")

    def report_unreachable(self, upstream: Upstream) -> None:
        """Nothing accepted a connection: out of rotation now, not after N failures (waiting
        for N polls only sent more requests to a closed port)."""
        upstream.consecutive_failures = max(upstream.consecutive_failures + 1,
                                            self.failures_to_remove)
        self._remove(upstream, "refused a connection")

    def _remove(self, upstream: Upstream, why: str) -> None:
        if not upstream.healthy:
            return
        upstream.healthy = False
        logger.warning("%s %s %s: out of rotation", upstream.role, upstream.url, why)
        for callback in self.on_removed:
            callback(upstream)
