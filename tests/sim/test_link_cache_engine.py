"""Building blocks: the fair-share and in-order lines, the prefix cache and event ordering, by
hand."""

import pytest

from pdd_sglang.sim.cache import BlockPrefixCache
from pdd_sglang.sim.engine import Callback, Simulator
from pdd_sglang.sim.link import FairShareLink, InOrderLink, make_link
from pdd_sglang.sim.profiles import LinkProfile

GB = 1e9


def line(sim, rtt=0.0):
    return FairShareLink(sim, LinkProfile("test", "test", 1 * GB, rtt, 0.0, 0.0))


def test_two_flows_share_the_line_fairly():
    sim = Simulator()
    link = line(sim, rtt=0.02)
    done = {}
    link.start_flow(1 * GB, lambda: done.setdefault("small", sim.now))
    link.start_flow(3 * GB, lambda: done.setdefault("large", sim.now))
    sim.run()
    # both at 0.5 GB/s until the small one ends at 2 s; the large one then has 2 GB left alone
    assert done["small"] == pytest.approx(2.0 + 0.01)
    assert done["large"] == pytest.approx(4.0 + 0.01)
    assert link.bytes_sent == link.bytes_received == pytest.approx(4 * GB)


def test_small_flow_slips_past_a_large_one():
    sim = Simulator()
    link = line(sim)
    done = {}
    link.start_flow(10 * GB, lambda: done.setdefault("large", sim.now))
    sim.schedule(1.0, Callback(lambda: link.start_flow(0.01 * GB, lambda: done.setdefault("small", sim.now))))
    sim.run()
    assert done["small"] == pytest.approx(1.02)
    assert done["large"] == pytest.approx(10.01)


def in_order_line(sim):
    return make_link(sim, LinkProfile("test", "test", 1 * GB, 0.0, 0.0, 0.0,
                                      copy_order="in_order"))


def test_in_order_a_small_flow_waits_for_the_large_one_ahead():
    sim = Simulator()
    link = in_order_line(sim)
    assert isinstance(link, InOrderLink)
    done, left = {}, []
    large = link.start_flow(10 * GB, lambda: done.setdefault("large", sim.now))

    def small():
        link.start_flow(0.01 * GB, lambda: done.setdefault("small", sim.now))
        left.append(link.remaining_bytes(large))
    sim.schedule(1.0, Callback(small))
    sim.run()
    assert done["large"] == pytest.approx(10.0)              # the full rate, unshared
    assert done["small"] == pytest.approx(10.01)             # after every byte ahead of it
    assert left == [pytest.approx(9 * GB)]
    assert link.bytes_sent == link.bytes_received == pytest.approx(10.01 * GB)


def test_in_order_cancelling_the_flow_ahead_moves_the_next_one_up():
    sim = Simulator()
    link = in_order_line(sim)
    done = {}
    first = link.start_flow(4 * GB, lambda: pytest.fail("cancelled flow delivered"))
    link.start_flow(1 * GB, lambda: done.setdefault("second", sim.now))
    pushed = []
    sim.schedule(1.5, Callback(lambda: pushed.append(link.cancel_flow(first))))
    sim.run()
    assert pushed == [pytest.approx(1.5 * GB)]
    assert done["second"] == pytest.approx(2.5)              # it starts at 1.5 s, at full rate
    assert link.bytes_sent == link.bytes_received == pytest.approx(2.5 * GB)
    # the line is idle again: a new flow starts at once
    sim2 = Simulator()
    link2 = in_order_line(sim2)
    ends = []
    link2.start_flow(1 * GB, lambda: ends.append(sim2.now))
    sim2.schedule(5.0, Callback(lambda: link2.start_flow(1 * GB, lambda: ends.append(sim2.now))))
    sim2.run()
    assert ends == [pytest.approx(1.0), pytest.approx(6.0)]


def test_cancel_counts_only_the_pushed_bytes():
    sim = Simulator()
    link = line(sim)
    flow = link.start_flow(4 * GB, lambda: pytest.fail("cancelled flow delivered"))
    pushed = []
    sim.schedule(1.5, Callback(lambda: pushed.append(link.cancel_flow(flow))))
    sim.run()
    assert pushed == [pytest.approx(1.5 * GB)]
    assert link.bytes_sent == link.bytes_received == pytest.approx(1.5 * GB)
    assert link.active_flows == 0


def test_prefix_cache_matches_leading_blocks_and_evicts_lru():
    cache = BlockPrefixCache(capacity_tokens=3 * 512)
    cache.insert([1, 2, 3])
    assert cache.cached_tokens([1, 2, 3, 4], 2000) == 3 * 512
    assert cache.cached_tokens([1, 9, 3], 2000) == 512
    assert cache.cached_tokens([1, 2, 3], 1500) == 1499        # one token always left to compute
    cache.cached_tokens([1], 600, touch=True)                   # 1 becomes most recent
    cache.insert([7])                                           # evicts 2, the least recent
    assert cache.cached_tokens([1, 2, 3], 2000) == 512
    assert len(cache) == 3


def test_events_at_the_same_time_fire_in_scheduling_order():
    sim = Simulator()
    order = []
    for name in "abc":
        sim.schedule(1.0, Callback(order.append, name))
    sim.schedule(0.5, Callback(order.append, "first"))
    sim.run()
    assert order == ["first", "a", "b", "c"]
    with pytest.raises(ValueError):
        sim.schedule(-1, Callback(order.append, "x"))


def test_one_flow_is_capped_at_window_over_rtt_and_pays_the_fixed_cost_once():
    sim = Simulator()
    # 1 GB/s line, 20 ms RTT, 4 MB window: one flow moves at most 200 MB/s
    link = FairShareLink(sim, LinkProfile("capped", "test", 1 * GB, 0.02, 0.0, 0.0,
                                          window_bytes=4e6, per_transfer_fixed_s=0.15))
    done = {}
    link.start_flow(0.4 * GB, lambda: done.setdefault("a", sim.now))
    sim.run()
    assert done["a"] == pytest.approx(0.4 / 0.2 + 0.01 + 0.15)
    # eight flows together: 8 x 200 MB/s > 1 GB/s, so the line's fair share (125 MB/s) binds
    sim = Simulator()
    link = FairShareLink(sim, LinkProfile("capped", "test", 1 * GB, 0.02, 0.0, 0.0,
                                          window_bytes=4e6, per_transfer_fixed_s=0.15))
    ends = []
    for _ in range(8):
        link.start_flow(0.125 * GB, lambda: ends.append(sim.now))
    sim.run()
    assert ends == [pytest.approx(1.0 + 0.01 + 0.15)] * 8


def test_a_link_profile_rejects_nonsense():
    with pytest.raises(ValueError, match="copy_order"):
        LinkProfile("x", "test", 1 * GB, 0.0, 0.0, 0.0, copy_order="random")
    with pytest.raises(ValueError, match="window"):
        LinkProfile("x", "test", 1 * GB, 0.0, 0.0, 0.0, window_bytes=1e6)
    with pytest.raises(ValueError, match="per_transfer_fixed_s"):
        LinkProfile("x", "test", 1 * GB, 0.02, 0.0, 0.0, per_transfer_fixed_s=-1)
