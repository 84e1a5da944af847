"""The two shared clusters of real SGLang servers on the tiny model (CPU profile), one at a time.

Every integration test that can share servers uses one of two PDD clusters (prefill, relay,
main, and at page size 1 a second main), each beside the session's one greedy reference: a plain
single server of the pristine sglang wheel (``plain``; no patch, no disaggregation), started with
the first cluster and kept for the session. The clusters differ in the KV page size, so each
check runs where its layout matters:

- ``page1``: page size 1. Behind it runs the PDD router (``router_cluster``); the plain PD pair
  (``pd_pair``), the two-main affinity test and the slow-relay tests (a fake relay paces
  ``main2``, whose handoff timeout is short) use its prefill and mains.
- ``page16``: page size 16 with chunked prefill of 64 tokens, so a prompt's KV reaches each
  destination in several chunks that do not fall on its prefix.

Only one cluster serves at a time (``SharedClusters``: a CPU server holds about 2 GB, and both
clusters with their old plain servers and the fault suite once ran this 24 GiB machine out of
memory; the next one's servers may start ahead, beside the live one's last tests), and the
collection order below runs every page-1 test, then every page-16 test, so each starts once. The
clusters' servers fork their scheduler and detokenizer from the launcher
(``pdd_sglang/dev/testing/fork_launch.py``): about 15 CPU-seconds and 1.3 GB each, against 35-50
and 2.2 GB with SGLang's spawn, where each of the three processes imports torch, transformers
and sglang (the fault suite's background run and the simulator's profile run fork theirs too).
The reference, the no-role pair and the two-datacenter test's servers keep spawn, so the suite
still starts servers exactly as SGLang does. One reference for both page sizes, and for the
no-role test, saves two server starts; greedy tokens do not depend on the page size (float32,
torch-native attention).

Per-request test controls travel beside the route (forced handoff points, a damaged WAN copy:
``pdd_sglang.dev.debug_aids.controls``); what is a server flag here is test-only (the debug patch
series registers the flags) and inert unless a request's controls ask for it, except the WAN
delay on prefill's path to main (every chunk waits ``WAN_DELAY_MS``, so a relay runs ahead as
behind a real WAN). Servers stop on every exit path; their logs stay in pytest's temporary
directory, and a failing start prints the log tail. The demo and the fault suite start their own
servers, in network namespaces behind the emulated line.
"""

from __future__ import annotations


import pytest

from pdd_sglang.dev.testing.cluster import RELAY_CPU_ARGS, Cluster, SGLangServer, free_port
from pdd_sglang.dev.testing.mixed_tp import (TpSizes, mixed_tp_cluster, pdd_servers,
                                             start_router, tp_args, tp_env)
from pdd_sglang.dev.testing.pristine import pristine_env, pristine_sglang
from pdd_sglang.dev.testing.agentic_model import ensure_agentic_model
from pdd_sglang.dev.testing.tiny_model import KV_8B_MODEL, TinyModelSpec, ensure_tiny_model

KV_CODEC_BY_PAGE_SIZE = {1: "auto", 16: "lossless"}
# Every KV chunk to main waits this long (a test-only WAN delay), so the relay runs ahead.
WAN_DELAY_MS = 300
CATCH_UP_CHUNK = 64
# The second main gives up on a silent relay quickly, for the slow-relay tests (its other user,
# the two-main affinity test, places every request P->MD: no handoff to time out).
MAIN2_HANDOFF_TIMEOUT_S = 2.0

# ---- PDD router ------------------------------------------------------------------------------
# Over each cluster: the link puts the P->MD / P->RLD->MD boundary at 100 uncached tokens of the
# tiny model (pdd_sglang.dev.testing.mixed_tp: ROUTER_WAN_GBPS, start_router).


@pytest.fixture(scope="session")
def tiny_model():
    spec = TinyModelSpec()
    return spec, ensure_tiny_model(spec)


def _pdd_cluster(page_size: int, model_path, log_dir, second_main: bool | None = None,
                 **server) -> Cluster:
    """Prefill, relay, main and (by default at page 1) a second main (short handoff timeout);
    mains check their WAN copy against the relay's (``--pdd-enable-kv-digest``) and damage one
    when its route asks. ``server``: more SGLangServer fields for each (a KV pool's size)."""
    bootstrap_port = free_port()
    common = ("--disaggregation-transfer-backend", "mooncake_tcp", "--page-size", str(page_size),
              "--pdd-debug-kv-digest")
    chunking = ("--chunked-prefill-size", "64") if page_size > 1 else ()
    # Issue 36: page 16 forces the lossless WAN codec (its handoff, dual-path and digest tests
    # run on coded copies, decoded at main); page 1 keeps auto, raw on the declared 10 Gb/s.
    codec = KV_CODEC_BY_PAGE_SIZE[page_size]
    forked = dict(fork_children=True, **server)  # forked: see the module docstring
    main_args = ("--pdd-role", "main", "--enable-metrics", "--pdd-enable-kv-digest",
                 "--pdd-debug-corrupt-wan-kv", *common)
    servers = [
        SGLangServer("prefill", model_path, log_dir, extra_args=(
            "--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            "--enable-metrics",
            "--pdd-debug-wan-delay-ms", str(WAN_DELAY_MS), "--pdd-wan-kv-codec", codec, *common,
            *chunking), **forked),
        SGLangServer("relay", model_path, log_dir, extra_args=(
            "--pdd-role", "relay", "--pdd-control-port", "0",  # two clusters may overlap
            "--pdd-debug-handoff-hold", "--pdd-catch-up-chunk",
            str(CATCH_UP_CHUNK), "--enable-metrics", "--pdd-enable-kv-digest", *common,
            *RELAY_CPU_ARGS), **forked),
        SGLangServer("main", model_path, log_dir, extra_args=main_args, **forked),
    ]
    if second_main is None:  # its users (two mains, the slow relay) need no other page size
        second_main = page_size == 1
    if second_main:
        servers.append(SGLangServer("main2", model_path, log_dir, extra_args=(
            *main_args, "--pdd-handoff-timeout", repr(MAIN2_HANDOFF_TIMEOUT_S)), **forked))
    cluster = Cluster(servers)
    cluster.bootstrap_port = bootstrap_port
    cluster.log_dir = log_dir
    cluster.page_size = page_size
    cluster.kv_codec = codec
    cluster.main2_handoff_timeout_s = MAIN2_HANDOFF_TIMEOUT_S
    cluster.model_path = model_path
    return cluster


def _no_role_pair(model_path, log_dir) -> Cluster:
    """A plain PD pair of the patched venv, without ``--pdd-role`` (``test_no_role.py``)."""
    bootstrap_port = free_port()
    transport = ("--disaggregation-transfer-backend", "mooncake_tcp")
    cluster = Cluster([
        SGLangServer("prefill", model_path, log_dir, extra_args=(
            "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
            str(bootstrap_port), *transport)),
        SGLangServer("decode", model_path, log_dir, extra_args=(
            "--disaggregation-mode", "decode", *transport, *RELAY_CPU_ARGS)),
    ])
    cluster.bootstrap_port = bootstrap_port
    return cluster


# test_tp.py's combination of TP sizes (issue 37): prefill and relay at TP 1, main at TP 2 (a
# prefill rank feeds two main ranks their own heads; relay and main hand off across TP sizes).
# scripts/tp_matrix.py runs every other combination of TP 1 and 2.
MAKE_TEST_TP = TpSizes(prefill=1, relay=1, main=2)


def _tp(model_path, log_dir) -> Cluster:
    """``test_tp.py``'s one TP cluster: a plain SGLang server of the patched venv at --tp-size 2
    (no role; the reference), and PDD prefill, relay and main at ``MAKE_TEST_TP`` (page size 1,
    the WAN delay on prefill's path to main, the relay's test-only handoff hold, the KV digest:
    ``pdd_sglang.dev.testing.mixed_tp``). Each server's schedulers and detokenizer forked
    (measured for the plain one: ready in about a minute, 2.4 GB RSS in all beside the
    launcher; the same greedy tokens as spawned)."""
    plain = SGLangServer("plain_tp2", model_path, log_dir, extra_args=tp_args(2), env=tp_env(2),
                         fork_children=True)
    return mixed_tp_cluster(MAKE_TEST_TP, model_path, log_dir, extra=(plain,))


# The grammar cluster's relay hands a Catch-Up off in chunks this long, so a JSON answer of a few
# dozen tokens crosses in several.
GRAMMAR_CATCH_UP_CHUNK = 8


def _agentic_grammar(_tiny_model_path, log_dir) -> Cluster:
    """``test_agentic_grammar.py``'s servers, of the agentic test model (``agentic_model``):
    PDD prefill, relay (the handoff hold) and main, and a plain server of the patched venv
    without a role (SGLang's own behaviour there: ``test_no_role.py``); compact JSON
    (``--constrained-json-disable-any-whitespace``), so the random model's constrained answers
    end; small KV pools."""
    model_path = ensure_agentic_model()
    bootstrap_port = free_port()
    common = ("--disaggregation-transfer-backend", "mooncake_tcp",
              "--constrained-json-disable-any-whitespace")
    forked = dict(fork_children=True, max_total_tokens=4000)
    cluster = Cluster([
        SGLangServer("prefill", model_path, log_dir, extra_args=(
            "--pdd-role", "prefill", "--disaggregation-bootstrap-port", str(bootstrap_port),
            *common), **forked),
        SGLangServer("relay", model_path, log_dir, extra_args=(
            "--pdd-role", "relay", "--pdd-control-port", "0", "--pdd-debug-handoff-hold",
            "--pdd-catch-up-chunk", str(GRAMMAR_CATCH_UP_CHUNK), *common, *RELAY_CPU_ARGS),
            **forked),
        SGLangServer("main", model_path, log_dir, extra_args=("--pdd-role", "main", *common),
                     **forked),
        SGLangServer("plain", model_path, log_dir,
                     extra_args=("--constrained-json-disable-any-whitespace",), **forked),
    ])
    cluster.bootstrap_port = bootstrap_port
    return cluster


# The KV-realistic cluster's pools: 1,024 tokens of 256 KiB (KV_8B_MODEL in float32) each.
KV_8B_POOL_TOKENS = 1024


def _kv_8b(_tiny_model_path, log_dir) -> Cluster:
    """``test_kv_realistic.py``'s cluster on the KV-realistic model (``KV_8B_MODEL``: Llama-3-8B's
    32 layers x 8 KV heads x head dim 128): PDD prefill, relay and main as the page-1 cluster's
    (no second main), and its own greedy reference, a plain server of the patched venv (no
    ``--pdd-role``), every one forked with a pool of ``KV_8B_POOL_TOKENS``."""
    model_path = ensure_tiny_model(KV_8B_MODEL)
    pool = dict(max_total_tokens=KV_8B_POOL_TOKENS)
    cluster = _pdd_cluster(1, model_path, log_dir, second_main=False, **pool)
    cluster.servers["plain"] = SGLangServer("plain", model_path, log_dir, fork_children=True,
                                            **pool)
    return cluster


# The agentic model's servers and the router's over them: SGLang's Qwen parsers (the model's
# tool-call markup and thinking tags), and the tiny model's KV bytes per token for the router, so
# ROUTER_WAN_GBPS puts the P->MD / P->RLD->MD boundary at 100 uncached tokens here too.
AGENTIC_PARSERS = ("--tool-call-parser", "qwen25", "--reasoning-parser", "qwen3")
AGENTIC_ROUTER_ARGS = (*AGENTIC_PARSERS, "--kv-bytes-per-token", "512")


def _agentic(model_path, log_dir) -> Cluster:
    """``test_router_agentic.py``'s servers: PDD prefill, relay and main (page size 1, as
    ``pdd_sglang.dev.testing.mixed_tp`` starts them) and a plain reference, all on the agentic
    test model (a byte-level BPE that spells JSON and Qwen's tool-call markup; not the tiny
    model of ``model_path``) with SGLang's Qwen parsers."""
    from dataclasses import replace

    from pdd_sglang.dev.testing.agentic_model import ensure_agentic_model

    agentic = ensure_agentic_model()
    bootstrap_port = free_port()
    servers = [replace(server, extra_args=(*server.extra_args, *AGENTIC_PARSERS))
               for server in pdd_servers(TpSizes(1, 1, 1), agentic, log_dir, bootstrap_port)]
    plain = SGLangServer("plain", agentic, log_dir, extra_args=AGENTIC_PARSERS,
                         fork_children=True)
    cluster = Cluster([*servers, plain])
    cluster.bootstrap_port, cluster.log_dir, cluster.router = bootstrap_port, log_dir, None
    cluster.model_path = agentic
    return cluster


# name -> how to build it: servers a single test owns, started early by ``start_beside``
BESIDE = {"no_role": _no_role_pair, "tp": _tp, "kv_8b": _kv_8b, "agentic": _agentic,
          "agentic_grammar": _agentic_grammar}


class SharedClusters:
    """At most one shared cluster serving at a time, started when a test first asks for it, and the
    session's greedy reference (``plain``) beside whichever is alive.

    A CPU SGLang server holds 1.3 GB forked, 2.2-2.7 GB spawned (launcher, scheduler,
    detokenizer), so the two clusters' nine servers beside the fault suite's and the demo's would
    not fit in this machine's 24 GiB together: asking for the other
    page size stops the live cluster (and the router over it) first, never the reference. The
    collection order below runs every page-1 test before the page-16 ones, so each cluster
    starts once.
    """

    def __init__(self, model_path, tmp_path_factory, reference_env: dict):
        self._model_path = model_path
        self._tmp = tmp_path_factory
        self._reference_env = reference_env
        self.page_size: int | None = None
        self.cluster: Cluster | None = None
        self.reference: SGLangServer | None = None
        self.ahead: Cluster | None = None  # started, not yet waited for
        self.beside: dict[str, Cluster] = {}  # started for one test, not yet taken by it

    def start_ahead(self, page_size: int) -> None:
        """Start the servers of the next page size now, beside the live cluster, so that their
        start-up (CPU-bound) overlaps the live cluster's last tests (which mostly wait); ``get``
        then only waits for them."""
        if self.ahead is None and self.page_size != page_size:
            cluster = _pdd_cluster(page_size, self._model_path,
                                   self._tmp.mktemp(f"page{page_size}-logs"))
            cluster.start()
            self.ahead = cluster

    def get(self, page_size: int) -> Cluster:
        if self.page_size != page_size:
            self.close()
            if self.ahead is not None and self.ahead.page_size == page_size:
                cluster, self.ahead = self.ahead, None
            else:
                self._stop_ahead()
                cluster = _pdd_cluster(page_size, self._model_path,
                                       self._tmp.mktemp(f"page{page_size}-logs"))
                cluster.start()
            first = self.reference is None
            if first:  # starts beside the first cluster's servers
                self.reference = SGLangServer("plain", self._model_path, cluster.log_dir,
                                              env=self._reference_env)
                self.reference.start()
            try:
                cluster.wait_ready()  # stops the cluster itself if it fails
                if first:
                    self.reference.wait_ready_moving_port()
            except BaseException:
                # Nothing half-started stays: the next test starts both again, not a dead one.
                cluster.stop()
                if first:
                    self.reference.stop()
                    self.reference = None
                raise
            cluster.servers["plain"] = self.reference
            cluster.router = None
            self.cluster, self.page_size = cluster, page_size
        return self.cluster

    def start_beside(self, name: str) -> None:
        """Start the servers of the one test ``name`` (see ``BESIDE``) now, beside whatever
        serves, so that their start-up overlaps other tests that mostly wait."""
        if name not in self.beside:
            cluster = BESIDE[name](self._model_path, self._tmp.mktemp(f"{name}-logs"))
            cluster.start()
            self.beside[name] = cluster

    def take_beside(self, name: str) -> Cluster:
        """The test's own servers, started early or now, once ready; the test stops them
        (``stop()`` in a ``finally``: ``with`` would start them again), and a failed start has
        stopped them already."""
        self.start_beside(name)
        return self.beside.pop(name).wait_ready()

    def _stop_ahead(self) -> None:
        ahead, self.ahead = self.ahead, None
        if ahead is not None:
            ahead.stop()

    def with_router(self) -> Cluster:
        """The page-1 cluster's P, RLD and MD behind the PDD router."""
        cluster = self.get(1)
        if cluster.router is None:
            start_router(cluster)
        return cluster

    def close(self) -> None:
        """Stop the live cluster and its router; the reference stays."""
        cluster, self.cluster, self.page_size = self.cluster, None, None
        if cluster is None:
            return
        cluster.servers.pop("plain", None)
        try:
            if getattr(cluster, "router", None) is not None:
                cluster.router.stop()
        finally:
            cluster.stop()

    def close_all(self) -> None:
        try:
            self._stop_ahead()
            while self.beside:  # a session that ended before their test
                self.beside.popitem()[1].stop()
            self.close()
        finally:
            if self.reference is not None:
                self.reference.stop()


@pytest.fixture(scope="session")
def shared_clusters(tiny_model, tmp_path_factory):
    _, model_path = tiny_model
    with pristine_sglang() as scratch:
        clusters = SharedClusters(model_path, tmp_path_factory, pristine_env(scratch))
        try:
            yield clusters
        finally:
            clusters.close_all()


# Function-scoped: each test gets the cluster that is live for it, never a stopped one.
@pytest.fixture
def page1_cluster(shared_clusters):
    return shared_clusters.get(1)


@pytest.fixture
def page16_cluster(shared_clusters):
    return shared_clusters.get(16)


@pytest.fixture(params=[1, 16], ids=lambda p: f"page{p}")
def three_roles(request, shared_clusters):
    """PDD prefill, relay and main (and the reference, ``plain``) at page size 1 or 16."""
    return shared_clusters.get(request.param)


@pytest.fixture
def pd_pair(page1_cluster):
    """A PDD prefill and a PDD main, over Mooncake TCP, with main's decode radix cache."""
    return page1_cluster


@pytest.fixture(scope="module")
def tp_cluster(shared_clusters):
    """``test_tp.py``'s TP cluster (``_tp``), started beside the page-16 tests, with P, RLD and
    MD behind the PDD router; stopped when the module ends (its last test stops its PDD servers
    itself, checking their shutdown)."""
    yield from _behind_router(shared_clusters.take_beside("tp"))


def _behind_router(cluster: Cluster, router_args: tuple = ()):
    """``cluster`` with the PDD router over it, until the fixture ends; then both stopped."""
    try:
        start_router(cluster, router_args)
        yield cluster
    finally:
        try:
            if cluster.router is not None:
                cluster.router.stop()
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def kv_8b_cluster(shared_clusters):
    """``test_kv_realistic.py``'s cluster (``_kv_8b``), started beside the TP tests; stopped
    when the module ends."""
    cluster = shared_clusters.take_beside("kv_8b")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def agentic_cluster(shared_clusters):
    """``_agentic``'s servers behind the PDD router (with the same parsers), for one module;
    stopped when it ends."""
    yield from _behind_router(shared_clusters.take_beside("agentic"), AGENTIC_ROUTER_ARGS)


@pytest.fixture
def router_cluster(shared_clusters):
    """P, RLD and MD of the page-1 cluster behind the PDD router (the plain server beside)."""
    return shared_clusters.with_router()


# ---- the order ------------------------------------------------------------------------------
# Pure-logic tests first, beside the quick demo (started at collection: tests/conftest.py); the
# demo's Ctrl-C and refusal runs; the tests that start servers of their own (the WAN line's); the
# quick demo's result; then every page-1 test, the fault suite's result, the page-16 tests with the
# no-role pair (two servers of its own) and the shutdown test; last the results of the demo's crash
# run and of the GPU lock's resolution. The machine never serves from two shared clusters at once,
# and each starts once. Where the other runs start (all measured on fresh clones, CPU per 5 s):
# - The fault suite starts in the background when the foreground reaches the quick demo's result:
#   from there on the machine has CPU to spare (the demo waits on its line and its quotas, the
#   page-1 tests on their WAN delays and timeouts: CPU 30-50 % busy there), and its three servers
#   fit in memory beside the demo's four or the page-1 cluster's five. After its quick faults the
#   chaos soak runs on the same three servers; its reference check then starts one plain server
#   of its own, once those three have stopped.
# - Once it has ended, the page-16 servers start ahead, beside the page-1 cluster's last tests
#   (eight servers: they fit where the fault suite's three were), and the GPU lock's resolution
#   (pip, no server) with them.
# - The no-role pair and the demo's crash run (two servers each) start beside the page-16 tests
#   (from the second on), which mostly wait on their WAN delay: the CPU was 47-62 % busy there,
#   against 100 % over the first minutes, where the crash run and the lock used to start.
# - ``test_tp.py``'s TP cluster (four servers of a launcher, one or two schedulers and a
#   detokenizer each) starts beside the shutdown test, which stops the page-16 servers; the TP
#   tests run after it, before the tail.
# - ``test_kv_realistic.py``'s cluster on the KV-realistic model (four servers with pools of 256
#   MiB) starts beside the TP tests, and its test runs after them.
# - ``test_agentic_grammar.py``'s four servers (the agentic test model) start beside the router's
#   agentic test and serve after it.
# - The foreground reaches the quick demo's result minutes before the demo ends (the demo's pace
#   is its line and its CPU quotas), so the Ctrl-C run (four servers cut short in start-up) and
#   the fault suite's start sit there at no cost to the session.
CRASH_TEST = "test_server_crash_mid_run_still_cleans_up"  # its run: tests/conftest.py
GPU_LOCK_TEST = "test_the_lock_resolves_against_the_index_with_hashes_required"  # its run too
TAIL = {CRASH_TEST: (6, 1), GPU_LOCK_TEST: (6, 2)}  # after LAST
QUICK_DEMO_TEST = "test_quick_demo_runs_both_points_and_pdd_hands_off"  # its run: tests/conftest.py
DEMO_TESTS = ("test_demo.py",)
FAULT_SUITE = ("test_fault_suite.py",)
NO_ROLE = ("test_no_role.py",)
TP_TESTS = ("test_tp.py",)  # after the shutdown test, beside which its TP cluster starts
TP_ORDER = (5, 1)
KV_8B_TESTS = ("test_kv_realistic.py",)  # after the TP tests, beside which its cluster starts
AGENTIC_TESTS = ("test_router_agentic.py",)  # after the KV-realistic test, beside which its cluster starts
KV_8B_ORDER = (5, 2)
GRAMMAR_TESTS = ("test_agentic_grammar.py",)  # after the router's agentic test, beside it
GRAMMAR_ORDER = (5, 4)
LAST = ("test_shutdown.py",)  # stops the live cluster's servers
LAST_ORDER = (5,)
FAULT_SUITE_STARTS_AT = (1,)  # the quick demo's result
PAGE1_GROUP = (4, 1)
PAGE16_TESTS = (4, 16, 0)  # the no-role pair starts beside them


def _page_size(item) -> int:
    callspec = getattr(item, "callspec", None)
    if callspec is not None and "three_roles" in callspec.params:
        return callspec.params["three_roles"]
    return 16 if "page16_cluster" in item.fixturenames else 1


def _order(item) -> tuple:
    name, folder = item.path.name, item.path.parent.name
    if item.originalname in TAIL:
        return TAIL[item.originalname]
    if name in DEMO_TESTS:  # the demo's Ctrl-C and refusal runs; then the quick one's result
        return (1,) if item.originalname == QUICK_DEMO_TEST else (0, 3)
    if name in FAULT_SUITE:
        return (*PAGE1_GROUP, 1)
    if name in NO_ROLE:
        return (4, 16, 1)
    if name in TP_TESTS:
        return TP_ORDER
    if name in KV_8B_TESTS:
        return KV_8B_ORDER
    if name in AGENTIC_TESTS:
        return (5, 3)
    if name in GRAMMAR_TESTS:
        return GRAMMAR_ORDER
    if name in LAST:
        return LAST_ORDER
    if folder == "integration":
        return (4, _page_size(item), 0)
    if folder == "dev_wan_emulator" or item.get_closest_marker("integration") is not None:
        return (0, 4)
    return (0, 0)


def _collected(session, names: tuple) -> bool:
    return any(item.path.name in names for item in session.items)


def _named(session, test: str) -> bool:
    return any(item.originalname == test for item in session.items)


@pytest.fixture(autouse=True)
def _background_and_ahead(request, start_background, still_running):
    order = _order(request.node)
    if order >= FAULT_SUITE_STARTS_AT and _collected(request.session, FAULT_SUITE):
        start_background("fault_suite")  # once; later calls find it running
    if order[:2] == PAGE1_GROUP and not still_running("fault_suite"):
        if _named(request.session, GPU_LOCK_TEST):
            start_background(GPU_LOCK_TEST)
        if any(_order(item)[:2] == (4, 16) for item in request.session.items):
            clusters = request.getfixturevalue("shared_clusters")
            if clusters.page_size == 1:
                clusters.start_ahead(16)
    if order == LAST_ORDER and _collected(request.session, TP_TESTS):
        # The TP cluster's four servers (six ranks) fit once the page-16 cluster's servers stop.
        request.getfixturevalue("shared_clusters").start_beside("tp")
    if order == TP_ORDER and _collected(request.session, KV_8B_TESTS):
        request.getfixturevalue("shared_clusters").start_beside("kv_8b")
    if order == KV_8B_ORDER and _collected(request.session, AGENTIC_TESTS):
        # The KV-realistic test mostly waits on its handoffs; the agentic servers start beside it.
        request.getfixturevalue("shared_clusters").start_beside("agentic")
    if order == (5, 3) and _collected(request.session, GRAMMAR_TESTS):
        request.getfixturevalue("shared_clusters").start_beside("agentic_grammar")
    if order == PAGE16_TESTS:
        clusters = request.getfixturevalue("shared_clusters")
        if clusters.page_size == 16:  # from the second page-16 test on: its servers are up
            if _collected(request.session, NO_ROLE):
                clusters.start_beside("no_role")
            if _named(request.session, CRASH_TEST):
                start_background(CRASH_TEST)


@pytest.hookimpl(trylast=True)  # after pytest's own reordering by fixture
def pytest_collection_modifyitems(config, items):
    items.sort(key=_order)  # stable: within each group the order pytest chose stays
