"""``--workers 2`` under load, through the real router process (#35 item 4): a conversation keeps
its main whichever worker takes each turn, every worker sees the line's bytes ahead once each
and at once, each server's health and role are checked once per worker per interval at
most, and /metrics counts every worker's requests whichever worker answers. Fake servers in this process (tests/router/test_router_app.py's kind); seconds."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter, defaultdict

import aiohttp
import orjson
import pytest
from aiohttp import web

from pdd_sglang.dev.testing.cluster import free_port
from pdd_sglang.dev.testing.tiny_model import ensure_tiny_model
from pdd_sglang.dev.testing.wan_cluster import RouterProcess

KV_BYTES_PER_TOKEN = 1000
NAME = web.AppKey("name", str)
HEALTH_INTERVAL_S = 0.5
ANSWER = [10, 11, 12, 13]


class Backends:
    """A prefill and two mains. Each main holds a request's first token ``hold_s`` (its copy
    is on the line until then); the prefill's /pdd/line reports, by main, the bytes of every
    request it has whose main has not started streaming (all needed-now). Like a real main,
    each keeps what it answered (prompt and answer but its last token) and copies only what it
    lacks: its copy's bytes and its ``cached_tokens`` are the prompt less its longest cached
    prefix, which is what the router's mirror predicts (a copy sized otherwise differs from the
    router's own count, and a report taken while it is out adds the difference as somebody
    else's bytes for a poll interval: 1,006,000 bytes ahead of a probe, once in a CI run)."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.ports = {name: free_port() for name in ("prefill", "m1", "m2")}
        self.polls: Counter = Counter()  # (server, path) -> GETs of /health and /server_info
        self.pending: dict[str, tuple[str, int]] = {}  # rid -> (main, bytes) not yet streamed
        self.held: dict[str, list[list[int]]] = {"m1": [], "m2": []}  # main -> token lists kept
        self.hold_s = 0.0
        self.runners: list[web.AppRunner] = []

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def session(self, main: str) -> str:
        return f"127.0.0.1:{self.ports[main] + 1}"

    async def start(self) -> None:
        for name in self.ports:
            app = web.Application(client_max_size=64 << 20)
            app.router.add_get("/health", self._counted(name, "/health", self._ok))
            app.router.add_get("/server_info", self._counted(name, "/server_info", self._info))
            app.router.add_get("/model_info", self._model_info)
            app.router.add_get("/pdd/line", self._line)
            app.router.add_post("/generate", self._generate)
            app.router.add_post("/abort_request", self._ok)
            app[NAME] = name
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", self.ports[name]).start()
            self.runners.append(runner)

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()

    def _counted(self, name: str, path: str, handler):
        async def counted(request):
            self.polls[(name, path)] += 1
            return await handler(request)
        return counted

    async def _ok(self, request):
        return web.Response(text="ok")

    async def _info(self, request):
        name = request.app[NAME]
        role = "prefill" if name == "prefill" else "main"
        pdd = {} if role == "prefill" else {"mooncake_session": self.session(name)}
        return web.json_response({"pdd_role": role, "max_running_requests": 64,
                                  "context_length": 65536, "dtype": "float32",
                                  "internal_states": [{"max_total_num_tokens": 10**7,
                                                       "pdd": pdd}]})

    async def _model_info(self, request):
        return web.json_response({"model_path": self.model_path,
                                  "served_model_name": self.model_path})

    async def _line(self, request):
        ahead: Counter = Counter()
        for main, kv_bytes in self.pending.values():
            ahead[main] += kv_bytes
        wan_line = {self.session(m): {"bytes_ahead": ahead[m], "needed_now_bytes_ahead": ahead[m],
                                      "cache_only_bytes_ahead": 0, "recent_bytes_per_s": None}
                    for m in ("m1", "m2")}
        return web.json_response({"version": "1", "wan_line": wan_line, "mains_out": []})

    async def _generate(self, request):
        body = orjson.loads(await request.read())
        name = request.app[NAME]
        prompt = len(body["input_ids"])
        if name == "prefill":
            return web.json_response({"text": "", "output_ids": [], "meta_info": {}})
        ids = body["input_ids"]
        cached = max((common_prefix(ids, kept) for kept in self.held[name]), default=0)
        self.pending[body["rid"]] = (name, (prompt - cached) * KV_BYTES_PER_TOKEN)
        response = web.StreamResponse()
        await response.prepare(request)
        await asyncio.sleep(self.hold_s)
        self.pending.pop(body["rid"], None)  # main has the KV: the copy landed
        for k, token in enumerate(ANSWER):
            last = k == len(ANSWER) - 1
            meta = {"prompt_tokens": prompt, "completion_tokens": k + 1, "cached_tokens": cached,
                    "finish_reason": {"type": "length", "length": 4} if last else None}
            out = {"text": f"w{token - 4}", "output_ids": [token], "meta_info": meta}
            await response.write(b"data: " + orjson.dumps(out) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        self.held[name].append(ids + ANSWER[:-1])
        return response


def common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


async def generate(url: str, input_ids: list) -> dict:
    """One request on a connection of its own (SO_REUSEPORT spreads connections, not
    requests); its last chunk's meta_info."""
    body = {"input_ids": input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": len(ANSWER)}}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.post(url + "/generate", json=body) as resp:
            assert resp.status == 200
            events = [orjson.loads(line[5:]) for line in (await resp.read()).split(b"\n\n")
                      if line.startswith(b"data: {")]
    return events[-1]["meta_info"]


async def conversation(url: str, seed: int, turns: int) -> list[dict]:
    rng = random.Random(seed)
    prompt, metas = [rng.randrange(4, 1000) for _ in range(1000)], []
    for _ in range(turns):
        meta = await generate(url, prompt)
        metas.append(dict(meta["pdd"], main_cached_tokens=meta.get("cached_tokens")))
        prompt = prompt + ANSWER + [rng.randrange(4, 1000) for _ in range(50)]
    return metas


@pytest.fixture
def two_workers(tmp_path):
    backends = Backends(str(ensure_tiny_model()))
    loop = asyncio.new_event_loop()
    loop.run_until_complete(backends.start())
    router = RouterProcess(tmp_path / "router.log", [
        "--workers", "2", "--prefill", backends.url("prefill"), "--main", backends.url("m1"),
        backends.url("m2"), "--health-interval-s", str(HEALTH_INTERVAL_S),
        "--kv-bytes-per-token", str(KV_BYTES_PER_TOKEN), "--hide-wan-below-s", "1000",
        "--main-load-penalty-tokens", "64"], api_key=None)  # its clients send no key
    # The router's start-up polls run while this loop is not: serve the backends meanwhile.
    starting = loop.run_in_executor(None, router.start, 120.0)
    try:
        loop.run_until_complete(starting)
        yield loop, backends, router
    finally:
        router.stop()
        loop.run_until_complete(backends.stop())
        loop.close()


def test_two_workers_share_affinity_and_the_line_and_poll_each_server_once_per_worker(
        two_workers):
    loop, backends, router = two_workers
    polls_before, started = Counter(backends.polls), time.monotonic()

    # Load: 24 conversations of 3 turns at once, each turn on a connection of its own.
    async def load():
        return await asyncio.gather(*(conversation(router.url, seed, 3) for seed in range(24)))

    conversations = loop.run_until_complete(load())
    workers = Counter(turn["router_worker"] for conv in conversations for turn in conv)
    assert set(workers) == {0, 1}, workers
    across = [conv for conv in conversations if len({t["router_worker"] for t in conv}) > 1]
    assert across  # some conversation had its turns answered by both workers
    for conv in conversations:
        assert len({turn["main"] for turn in conv}) == 1, conv  # its main, whoever placed it
        assert all(turn["predicted_main_cached_tokens"] >= 1000 for turn in conv[1:]), conv
        # the router's count of each copy is main's: the line's reports add nothing to it
        assert all(turn["predicted_main_cached_tokens"] == turn["main_cached_tokens"]
                   for turn in conv), conv

    # The line: each probe's copy stays on the line (main holds its first token); the next
    # probe, whichever worker places it, has every earlier probe's bytes to that main ahead.
    # The kernel spreads connections over the workers at random: 16 probes all land on one with
    # odds of 2 in 65,536 (8 did in about 1 run of 128). Main holds each past the last probe.
    backends.hold_s = 6.0

    # A probe opens with a token no conversation holds (they draw from 4..999), so main's
    # landed conversations give it no cached prefix (a shared first token did: 1 run in 3).
    async def probes(count: int) -> list[dict]:
        placed = []
        for seed in range(count):
            rng = random.Random(1000 + seed)
            prompt = [1000 + seed % 4] + [rng.randrange(4, 1000) for _ in range(199)]
            placed.append(asyncio.create_task(generate(router.url, prompt)))
            await asyncio.sleep(0.25)
        return [meta["pdd"] for meta in await asyncio.gather(*placed)]

    placed = loop.run_until_complete(probes(16))
    assert {p["router_worker"] for p in placed} == {0, 1}, placed
    ahead = defaultdict(int)
    for probe in placed:
        assert probe["line_bytes_ahead"] == ahead[probe["main"]], (probe, placed)
        ahead[probe["main"]] += 200 * KV_BYTES_PER_TOKEN

    # Health and roles: once per worker per interval at most (and the start-up's few).
    elapsed = time.monotonic() - started
    for server in ("prefill", "m1", "m2"):
        for path in ("/health", "/server_info"):
            polls = backends.polls[(server, path)] - polls_before[(server, path)]
            assert 1 <= polls <= 2 * (elapsed / HEALTH_INTERVAL_S + 2), (server, path, polls)

    # /metrics: whichever worker answers, every worker's counts, each once.
    for _ in range(6):  # a connection each: both workers answer some
        text = loop.run_until_complete(scrape(router.url))
        assert metric_sum(text, "pdd_router_requests_total") == 24 * 3 + 16, text
        assert metric_sum(text, "pdd_router_inter_token_latency_seconds_count") == \
            (24 * 3 + 16) * (len(ANSWER) - 1)
        servers = [line for line in text.splitlines()
                   if line.startswith("pdd_router_server_healthy{")]
        assert len(servers) == 3 and all(line.endswith(" 1.0") for line in servers), servers


async def scrape(url: str) -> str:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        async with s.get(url + "/metrics") as resp:
            assert resp.status == 200
            return await resp.text()


def metric_sum(text: str, name: str) -> float:
    """The sum of every series of ``name`` in an exposition text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))
