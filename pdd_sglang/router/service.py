"""The router's parts wired together, and its start-up: find the servers, learn the model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Optional

from pdd_sglang.router.config import RouterConfig
from pdd_sglang.router.dispatch import Dispatcher
from pdd_sglang.router.metrics import RouterMetrics, share_between_workers
from pdd_sglang.router.model import ModelInfo, load_model_info
from pdd_sglang.router.landing import LandingCopies
from pdd_sglang.router.line_state import LineAccounting, poll_prefill_lines
from pdd_sglang.router.placement import Placer
from pdd_sglang.router.prefix_mirror import PrefixMirror
from pdd_sglang.router.front_door import server_names, upstream_keys, upstream_tls
from pdd_sglang.router.servers import (MAIN, PREFILL, RELAY, HealthMonitor, ServerPool,
                                       Upstream, role_mismatch)
from pdd_sglang.router.shared_state import PeerBus, SharedState
from pdd_sglang.router.upstream import UpstreamClient

logger = logging.getLogger("pdd_sglang.router")

# What a server's /server_info holds that even the router's admin is not shown: its keys, and
# the command line that names them.
SERVER_SECRETS = frozenset({"api_key", "admin_api_key", "launch_command"})
DEFAULT_MIRROR_TOKENS = 1_000_000  # when main does not report its KV pool size
METRICS_REFRESH_S = 1.0  # with --workers: how stale another worker's gauges may be


class RouterService:
    """One router process: with ``--workers`` N, one of N (``worker``), whose shared tables go
    to and come from the others over ``bus`` (router/shared_state.py)."""

    def __init__(self, config: RouterConfig, worker: int = 0, bus: Optional[PeerBus] = None):
        self.config = config
        self.worker, self.bus = worker, bus
        self.pool = ServerPool(config.prefills, config.relays, config.mains)
        self.client = UpstreamClient(config.connect_timeout_s, config.read_timeout_s,
                                     config.upstream_keepalive_s, upstream_keys(config),
                                     upstream_tls(config))
        # One of several workers: every worker's metrics in the supervisor's files (metrics.py).
        self.metrics = RouterMetrics(shared=bus is not None and share_between_workers())
        self.health = HealthMonitor(self.pool, self.client, config.health_interval_s,
                                    config.health_failures_to_remove)
        self.model: Optional[ModelInfo] = None
        self.mirrors: dict[str, PrefixMirror] = {}
        self.dispatcher: Optional[Dispatcher] = None
        self._line_poll: Optional[asyncio.Task] = None
        self._metrics_refresh: Optional[asyncio.Task] = None
        # The router listens from its start; it serves once start() is done (``started``), and
        # start()'s failure is the operator's to read (``start_error``, the router's /ready).
        self.starting: Optional[asyncio.Task] = None
        self.started = False
        self.start_error: Optional[str] = None

    def begin(self) -> asyncio.Task:
        """start() in the background: the router answers /health and /ready meanwhile."""
        self.starting = asyncio.create_task(self.start())
        self.starting.add_done_callback(self._start_done)
        return self.starting

    def _start_done(self, task: asyncio.Task) -> None:
        if task.cancelled():
            return
        err = task.exception()
        if err is None:
            self.started = True
        else:
            self.start_error = str(err) or repr(err)

    async def start(self) -> None:
        await self.client.start()
        try:
            await self._wait_for_servers()
        except BaseException:  # a refusal: close the session (no "Unclosed client session")
            await self.client.close()
            raise
        main = next(u for u in self.pool.by_role[MAIN] if u.healthy)
        model_info = await self.client.get_json(main, "/model_info")
        server_info = await self.client.get_json(main, "/server_info")
        # Loading a tokenizer takes seconds: keep the event loop free meanwhile.
        self.model = await asyncio.get_running_loop().run_in_executor(
            None, load_model_info, model_info, server_info, self.config.tokenizer_path,
            self.config.link.kv_bytes_per_token, self.config.trust_remote_code, main.url)
        for upstream in self.pool.by_role[MAIN]:
            budget = (self.config.mirror_max_tokens or upstream.kv_pool_tokens
                      or DEFAULT_MIRROR_TOKENS)
            self.mirrors[upstream.url] = PrefixMirror(budget)
        landing = LandingCopies()
        lines = LineAccounting()
        placer = Placer(self.pool, self.mirrors, self.config, self.model.kv_bytes_per_token,
                        landing, lines)
        shared = SharedState(self.mirrors, landing, lines, self.worker, self.bus)
        self.dispatcher = Dispatcher(self.pool, placer, self.mirrors, self.client, self.health,
                                     self.metrics, self.model, self.config, landing, shared)
        if self.bus is not None:
            await self.bus.start(shared)
        self.health.on_recovered = self._recovered
        self.health.check_role = self._check_role
        self.health.start()
        if self.config.placement == "congestion-aware":
            self._line_poll = asyncio.create_task(poll_prefill_lines(
                lines, self.pool.by_role[PREFILL], self.pool.by_role[MAIN], self.client.get_bytes))
        if self.metrics.shared:
            self._metrics_refresh = asyncio.create_task(self._refresh_metrics())
        logger.info("PDD router ready: model %s, context %d, %.0f KV bytes/token, %s",
                    self.model.served_model_name, self.model.context_length,
                    self.model.kv_bytes_per_token,
                    {role: [u.url for u in group] for role, group in self.pool.by_role.items()})

    async def _wait_for_servers(self) -> None:
        """Learn every server's capacity; those still down at the deadline start out of rotation
        (the health monitor brings them back). At least one prefill and one main must answer."""
        deadline = time.monotonic() + self.config.startup_timeout_s
        pending = set(self.pool.all())
        while pending and time.monotonic() < deadline:
            results = await asyncio.gather(*(self._learn(u) for u in pending))
            pending = {u for u, ok in zip(list(pending), results) if not ok}
            if pending:
                await asyncio.sleep(1.0)
        self.pool.settle_tp_size()  # from the prefills that answered; then everyone against it
        for upstream in self.pool.all():
            if upstream not in pending and upstream.role_error is None:
                upstream.role_error = self.pool.tp_mismatch(upstream)
        wrong = [u.role_error for u in self.pool.all() if u.role_error is not None]
        if wrong:
            raise RuntimeError("refusing to start: " + "; ".join(wrong))
        for upstream in pending:
            upstream.healthy = False
            logger.warning("%s %s did not answer during start-up: out of rotation",
                           upstream.role, upstream.url)
        for role in (PREFILL, MAIN):
            if not self.pool.healthy(role):
                raise RuntimeError(f"no {role} server answered within "
                                   f"{self.config.startup_timeout_s:.0f} s")

    async def _learn(self, upstream: Upstream) -> bool:
        if not await self.client.healthy(upstream):
            return False
        try:
            info = await self.client.get_json(upstream, "/server_info")
            upstream.learn(info)
        except Exception as err:  # a server mid-start answers /health before /server_info
            logger.debug("server_info of %s: %r", upstream.url, err)
            return False
        # The TP size too, once the start settled it (a server that was down at start).
        upstream.role_error = role_mismatch(upstream, info) or self.pool.tp_mismatch(upstream)
        return True

    async def _recovered(self, upstream: Upstream) -> bool:
        return await self._learn(upstream) and upstream.role_error is None

    async def _check_role(self, upstream: Upstream):
        """Each health poll: re-read the server's /server_info (its role, its TP size, what it
        advertises)."""
        try:
            info = await self.client.get_json(upstream, "/server_info", timeout_s=10.0)
        except Exception as err:  # busy past the timeout: its role is what it was
            logger.debug("server_info of %s: %r", upstream.url, err)
            return upstream.role_error
        upstream.learn(info)
        return role_mismatch(upstream, info) or self.pool.tp_mismatch(upstream)

    async def _refresh_metrics(self) -> None:
        """With --workers: this worker's gauges, for whichever worker answers /metrics."""
        while True:
            self.metrics.refresh(self.pool)
            await asyncio.sleep(METRICS_REFRESH_S)

    async def stop(self) -> None:
        if self.starting is not None and not self.starting.done():
            self.starting.cancel()
            with contextlib.suppress(BaseException):
                await self.starting
        await self.health.stop()
        for task in (self._line_poll, self._metrics_refresh):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self.dispatcher is not None:
            await asyncio.wait_for(self.dispatcher.drain(), timeout=15)
        if self.bus is not None:
            self.bus.close()
        await self.client.close()

    async def servers_info(self) -> dict:
        """/server_info of every server, grouped like SGLang's PD router ("decode" = mains)."""
        async def info(upstream: Upstream):
            try:
                info = await self.client.get_json(upstream, "/server_info")
                return {"url": upstream.url, **{key: value for key, value in info.items()
                                                if key not in SERVER_SECRETS}}
            except Exception as err:
                return {"url": upstream.url, "error": repr(err)}

        groups = {"prefill": PREFILL, "relay": "relay", "decode": MAIN}
        out = {}
        for key, role in groups.items():
            upstreams = self.pool.by_role[role]
            out[key] = list(await asyncio.gather(*(info(u) for u in upstreams)))
        return out

    def servers_summary(self) -> dict:
        """/server_info without internal detail: each server by its name, its health, TP size
        and request slots, grouped as servers_info groups them."""
        names = server_names(self.pool)
        return {key: [{"name": names[u.url], "healthy": u.healthy, "tp_size": u.tp_size,
                       "max_running_requests": u.max_running_requests}
                      for u in self.pool.by_role[role]]
                for key, role in (("prefill", PREFILL), ("relay", RELAY), ("decode", MAIN))}

    async def flush_cache(self) -> bool:
        results = await asyncio.gather(*(self.client.post_ok(u, "/flush_cache", admin=True)
                                         for u in self.pool.all()))
        self.dispatcher.shared.mirrors_cleared()
        return all(results)
