"""The router's accounting of the WAN line per main, and congestion-aware placement from it."""

from __future__ import annotations

import json

import pytest

from pdd_sglang import policy
from pdd_sglang.router.line_state import MIN_SAMPLE_BYTES, LineAccounting


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_bytes_ahead_count_copies_begun_and_not_landed():
    lines = LineAccounting(FakeClock())
    a = lines.begin("m1", 3_000_000)
    b = lines.begin("m1", 1_000_000)
    lines.begin("m2", 5)
    assert lines.bytes_ahead("m1") == 4_000_000
    lines.land(a)
    lines.drop(b)
    lines.land(b)  # closing twice changes nothing
    assert lines.bytes_ahead("m1") == 0 and lines.bytes_ahead("m2") == 5


def test_throughput_counts_the_time_any_copy_was_on_the_line_once():
    clock = FakeClock()
    lines = LineAccounting(clock)
    first = lines.begin("m", 2 * MIN_SAMPLE_BYTES)
    clock.now = 1.0
    second = lines.begin("m", 2 * MIN_SAMPLE_BYTES)
    clock.now = 2.0
    lines.land(first)
    clock.now = 4.0
    lines.land(second)
    # Both copies shared the line from 0 to 4 s: 4 x MIN_SAMPLE_BYTES over 4 s.
    assert lines.measured_bytes_per_s("m") == pytest.approx(MIN_SAMPLE_BYTES)
    small = lines.begin("m", 10)
    clock.now = 100.0
    lines.land(small)  # too small to say anything about the rate
    assert lines.measured_bytes_per_s("m") == pytest.approx(MIN_SAMPLE_BYTES)


def test_a_busy_line_sends_a_small_suffix_through_the_relay():
    lines = LineAccounting(FakeClock())
    rate, rtt, kv = 1.25e6, 0.04, 8192  # 10 Mbit/s, 8 KiB per token
    uncached = 40  # 0.33 MB: about 0.3 s on an idle line, under the 0.5 s threshold
    assert policy.choose_pipeline(uncached, 128, kv, rate, rtt,
                                  line=lines.state("m")) is policy.Pipeline.PREFILL_MAIN
    lines.begin("m", 8_000_000)  # a document's copy on its way: 6.4 s ahead
    assert policy.choose_pipeline(uncached, 128, kv, rate, rtt,
                                  line=lines.state("m")) is policy.Pipeline.PREFILL_RELAY_MAIN


def test_the_line_clock_starts_when_the_kv_exists():
    clock = FakeClock()
    lines = LineAccounting(clock)
    copy = lines.begin("m", 2 * MIN_SAMPLE_BYTES)
    clock.now = 3.0  # prefill's queue and forward: not line time
    lines.on_wire(copy)
    clock.now = 5.0
    lines.land(copy)
    lines.on_wire(copy)  # after landing: nothing changes
    assert lines.measured_bytes_per_s("m") == pytest.approx(MIN_SAMPLE_BYTES)


def test_a_fresh_prefill_report_counts_beside_the_routers_own_copies():
    clock = FakeClock()
    lines = LineAccounting(clock)
    lines.begin("m", 1_000_000)
    lines.report("m", 5_000_000, 2e6)  # prefill sees more: another router's copies
    assert lines.state("m") == policy.LineState(5_000_000, 2e6)
    lines.report("m", 0, None)  # the poll lags the router's own copy
    assert lines.state("m").bytes_ahead == 1_000_000
    lines.report("m", 9_000_000, 2e6)
    clock.now = 10.0  # the report is stale: the router's own accounting only
    assert lines.state("m") == policy.LineState(1_000_000, None)


def test_a_copy_that_landed_after_the_poll_is_not_counted_again_from_the_report():
    clock = FakeClock()
    lines = LineAccounting(clock)
    mine = lines.begin("m", 1_000_000)
    lines.report("m", 1_500_000, 2e6)  # prefill holds the router's copy and 0.5 MB of others'
    assert lines.state("m").bytes_ahead == 1_500_000
    lines.land(mine)  # before the next poll: only the others' bytes remain ahead
    assert lines.state("m").bytes_ahead == 500_000
    lines.begin("m", 2_000_000)  # placed since the poll: counted once
    assert lines.state("m").bytes_ahead == 2_500_000
    # A poll sent before that copy: the router's own bytes as they were then, not as they are.
    lines.report("m", 500_000, 2e6, own_bytes_at_poll=0)
    assert lines.state("m").bytes_ahead == 2_500_000


def test_the_poller_sums_prefills_per_main_by_mooncake_session():
    import asyncio

    from pdd_sglang.router.line_state import poll_prefill_lines
    from pdd_sglang.router.servers import Upstream

    prefills = [Upstream("prefill", "http://p1"), Upstream("prefill", "http://p2")]
    mains = [Upstream("main", "http://m", mooncake_session="10.0.0.2:7000")]
    infos = {"http://p1": {"10.0.0.2:7000": {"bytes_ahead": 3, "recent_bytes_per_s": 5.0}},
             "http://p2": {"10.0.0.2:7000": {"bytes_ahead": 4, "recent_bytes_per_s": 2.0},
                           "other:1": {"bytes_ahead": 100}}}

    asked = []

    class NotFound(Exception):
        status = 404

    async def get_json(upstream, path):
        asked.append((upstream.url, path))
        if upstream.url == "http://p1":  # a prefill of this build: its compact report
            assert path == "/pdd/line"
            return json.dumps({"version": "1", "wan_line": infos["http://p1"], "mains_out": []})
        if path == "/pdd/line":  # an older build
            raise NotFound()
        assert path == "/server_info"
        return {"internal_states": [{"pdd": {"wan_line": infos[upstream.url]}}]}

    async def rounds(count: int):
        lines = LineAccounting(FakeClock())
        task = asyncio.create_task(poll_prefill_lines(lines, prefills, mains, get_json, 0.01))
        while len(asked) < count:
            await asyncio.sleep(0.005)
        task.cancel()
        return lines.state("http://m")

    assert asyncio.run(rounds(6)) == policy.LineState(7, 2.0)
    # The older build is asked for /pdd/line once, then only for its /server_info.
    assert asked[:6] == [("http://p1", "/pdd/line"), ("http://p2", "/pdd/line"),
                         ("http://p2", "/server_info"), ("http://p1", "/pdd/line"),
                         ("http://p2", "/server_info"), ("http://p1", "/pdd/line")]


def test_a_copy_begun_while_the_poll_is_out_and_seen_by_the_prefill_counts_once():
    """The race of the 2-worker test (tests/router/test_workers.py): the router places a copy
    after its poll went out and the prefill sees it before answering. Deterministic: the copy
    is begun inside the poll's own request, before the answer that shows it."""
    import asyncio

    from pdd_sglang.router.line_state import poll_prefill_lines
    from pdd_sglang.router.servers import Upstream

    prefills = [Upstream("prefill", "http://p")]
    mains = [Upstream("main", "http://m", mooncake_session="10.0.0.2:7000")]
    lines = LineAccounting(FakeClock())
    lines.begin("http://m", 300)  # open when the poll is sent
    answered = asyncio.Event()

    async def get_json(upstream, path):
        if not answered.is_set():
            lines.begin("http://m", 200)  # placed while the poll is out ...
        answered.set()  # ... and the prefill's report holds both, and 50 of another router's
        return {"version": "1", "wan_line": {"10.0.0.2:7000": {"needed_now_bytes_ahead": 550}},
                "mains_out": []}

    async def one_poll():
        task = asyncio.create_task(poll_prefill_lines(lines, prefills, mains, get_json, 3600))
        await answered.wait()
        await asyncio.sleep(0)  # the report is applied before the poller sleeps
        task.cancel()
        return lines.state("http://m").bytes_ahead

    assert asyncio.run(one_poll()) == 550  # not 750: the 200 counted once


def test_a_main_a_prefill_lists_as_out_takes_no_placement_until_it_is_back():
    """#22 race 9: the prefill publishes the mains it took out after a failed WAN copy
    (``pdd.fanout.mains_out``); the router keeps off them until the prefill's WAN probe succeeds."""
    from pdd_sglang.router.line_state import mark_mains_out
    from pdd_sglang.router.servers import MAIN, NoHealthyServer, ServerPool

    pool = ServerPool([], [], ["http://m1", "http://m2"])
    m1, m2 = pool.by_role[MAIN]
    m1.mooncake_session, m2.mooncake_session = "10.0.0.1:1", "10.0.0.2:1"
    mark_mains_out([m1, m2], {"10.0.0.1:1"})
    assert pool.least_loaded(MAIN) is m2
    mark_mains_out([m1, m2], {"10.0.0.1:1", "10.0.0.2:1"})
    with pytest.raises(NoHealthyServer):
        pool.least_loaded(MAIN)
    mark_mains_out([m1, m2], set())
    assert pool.healthy(MAIN) == [m1, m2]


def test_with_no_relay_a_main_out_after_a_wan_failure_is_the_last_resort_not_a_503():
    """The soak's relay_dies struck while the prefill had main out (a copy past the WAN transfer
    timeout on a congested line): 235 clients got 503 'no healthy main server' for 16 s."""
    from types import SimpleNamespace

    from pdd_sglang import policy
    from pdd_sglang.router.placement import Placer
    from pdd_sglang.router.servers import MAIN, RELAY, NoHealthyServer, ServerPool

    pool = ServerPool([SimpleNamespace(url="http://p", bootstrap_port=1)], ["http://r"], ["http://m"])
    (main,), (relay,) = pool.by_role[MAIN], pool.by_role[RELAY]
    main.wan_out, relay.healthy = True, False
    placer = Placer.__new__(Placer)
    placer.pool = pool
    placement = placer.place([1, 2, 3], 8)
    assert placement.pipeline is policy.Pipeline.PREFILL_MAIN and placement.main is main
    main.healthy = False  # unreachable as well: nothing can answer
    with pytest.raises(NoHealthyServer):
        placer.place([1, 2, 3], 8)


def test_the_compact_read_parses_only_the_line_and_the_mains_out_of_a_large_server_info():
    import json

    from pdd_sglang.router.line_state import read_line_report

    rows = [{"room": i, "destination": "10.0.0.2:7000", "role": "decode", "bytes": 1 << 20}
            for i in range(8192)]
    wan_line = {"10.0.0.2:7000": {"bytes_ahead": 3, "recent_bytes_per_s": 5.0}}
    info = {"launch_command": 'x --wan_line "wan_line": 1', "internal_states": [
        {"pdd": {"transfers": {"by_request": rows}, "wan_line": wan_line,
                 "fanout": {"mains_out": ["10.0.0.3:1"], "open_rooms": 2}}},
        {"pdd": {"wan_line": {"other:1": {}}, "fanout": {"mains_out": ["x:1"]}}}]}
    for raw in (json.dumps(info).encode(), json.dumps(info, separators=(",", ":")).encode()):
        assert read_line_report(raw) == (wan_line, ["10.0.0.3:1"])  # the first rank's
    assert read_line_report(info) == (wan_line, ["10.0.0.3:1"])
    assert read_line_report(b'{"internal_states": [{"pdd": {}}]}') == ({}, [])  # an older build
    assert read_line_report(b'{"internal_states": [{"pdd": {"wan_line": null}}]}') == ({}, [])


def test_a_new_copy_waits_only_behind_first_token_bytes_when_the_prefill_reports_tiers():
    """#34: a new request's copy, placed P->MD, is first-token, so relay-covered copies (a
    relay answers their requests) and cache-only ones (their relay answered alone) are not
    ahead of it; a prefill that reports classes only counts its needed-now bytes, one without
    classes its whole line."""
    import asyncio

    from pdd_sglang.router.line_state import poll_prefill_lines
    from pdd_sglang.router.servers import Upstream

    prefills = [Upstream("prefill", "http://p1"), Upstream("prefill", "http://p2")]
    mains = [Upstream("main", "http://m", mooncake_session="10.0.0.2:7000")]
    by_tier = {"bytes_ahead": 12_000_000, "first_token_bytes_ahead": 1_000_000,
               "needed_now_bytes_ahead": 4_000_000, "cache_only_bytes_ahead": 8_000_000,
               "recent_bytes_per_s": 2e6}
    by_class = {"bytes_ahead": 900_000, "needed_now_bytes_ahead": 300_000,
                "cache_only_bytes_ahead": 600_000, "recent_bytes_per_s": 2e6}
    older = {"bytes_ahead": 200_000, "recent_bytes_per_s": 2e6}  # an older prefill: the sum
    prefills.append(Upstream("prefill", "http://p3"))
    reports = {"http://p1": by_tier, "http://p2": by_class, "http://p3": older}

    async def get_json(upstream, path):
        return json.dumps({"wan_line": {"10.0.0.2:7000": reports[upstream.url]},
                           "mains_out": []})

    async def polled(lines: LineAccounting) -> policy.LineState:
        task = asyncio.create_task(poll_prefill_lines(lines, prefills, mains, get_json, 0.01))
        await asyncio.sleep(0.05)
        task.cancel()
        return lines.state("http://m")

    lines = LineAccounting(FakeClock())
    assert asyncio.run(polled(lines)).bytes_ahead == 1_500_000
    mine = lines.begin("http://m", 2_000_000)  # the router's own P->MD copy, placed since
    assert lines.state("http://m").bytes_ahead == 3_500_000
    handoff = lines.begin("http://m", 5_000_000, relay_covered=True)  # main's leg of P->RLD->MD
    assert lines.state("http://m").bytes_ahead == 3_500_000
    lines.uncover(handoff)  # its relay was lost: its request waits for it now
    assert lines.state("http://m").bytes_ahead == 8_500_000
    lines.cache_only(mine)  # its relay answered alone: it waits behind every other tier
    lines.drop(handoff)
    assert lines.state("http://m").bytes_ahead == 1_500_000
    lines.land(mine)
    assert lines.state("http://m").bytes_ahead == 1_500_000


def test_a_relay_covered_copy_that_turns_cache_only_or_closes_changes_no_first_token_bytes():
    lines = LineAccounting(FakeClock())
    finished, failed = (lines.begin("m", 4_000, relay_covered=True) for _ in range(2))
    lines.begin("m", 700)
    lines.cache_only(finished)  # its relay answered alone
    lines.uncover(finished)  # a loss reported after that: it stays cache-only
    lines.land(finished)
    lines.drop(failed)
    assert lines.bytes_ahead("m") == 700


def test_a_coded_line_predicts_a_new_copy_in_wire_bytes():
    """Issue 36: the prefill reports its line's codec ratio (KV bytes per wire byte); the
    router predicts a new copy's time from its wire bytes while the report is fresh."""
    clock = FakeClock()
    lines = LineAccounting(clock)
    lines.report("m", 0, 1e6, wire_ratio=2.0)
    line = lines.state("m")
    assert line.wire_ratio == 2.0
    seconds = policy.predict_wan_seconds_on_line(10_000, 100.0, 1e6, 0.0, line)
    assert seconds == pytest.approx(0.5)  # 1 MB of KV, 0.5 MB on the wire
    clock.now = 10.0  # stale: the KV's own bytes again
    assert lines.state("m").wire_ratio == 1.0
    with pytest.raises(ValueError, match="wire_ratio"):
        policy.LineState(wire_ratio=0.0)
