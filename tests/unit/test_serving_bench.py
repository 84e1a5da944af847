"""The serving rows of ``scripts/bench_wan_line.py --serving``: their schema and the arithmetic
that turns samples into a row (``pdd_sglang.dev.wan_emulator.serving_bench``)."""

from __future__ import annotations

import pytest

from pdd_sglang.dev.wan_emulator.serving_bench import (FIELDS, NULL_REASONS, Sampler, Streamed,
                                                       check_row, itl_ratio)


def full_row(**changes) -> dict:
    row = {"layers": 32, "tokens": 256, "copy_bytes": 256 << 18, "mode": "packed",
           "rate_mbit": 100.0, "rtt_ms": 40.0, "utilization": 0.91,
           "reference_utilization": 0.95, "main_itl_ratio": 1.04,
           "landed_after_last_record_s": 0.08, "last_record_decode_s": None,
           "peak_staging_bytes": 1 << 20, "staging_bytes": 64 << 20, "cpu_s_per_gb": 0.2}
    return {**row, **changes}


def test_the_fields_are_the_issues():
    assert FIELDS == ("layers", "tokens", "copy_bytes", "mode", "rate_mbit", "rtt_ms",
                      "utilization", "reference_utilization", "main_itl_ratio",
                      "landed_after_last_record_s", "last_record_decode_s",
                      "peak_staging_bytes", "staging_bytes", "cpu_s_per_gb")
    assert set(NULL_REASONS) <= set(FIELDS)


def test_a_complete_row_passes_and_a_broken_one_does_not():
    assert check_row(full_row()) == full_row()
    for mode in ("packed", "coded", "one_sided"):
        check_row(full_row(mode=mode))
    row = full_row()
    del row["cpu_s_per_gb"]
    with pytest.raises(ValueError, match="lacks"):
        check_row(row)
    with pytest.raises(ValueError, match="mode"):
        check_row(full_row(mode="raw"))
    with pytest.raises(ValueError, match="number"):
        check_row(full_row(utilization="0.9"))
    with pytest.raises(ValueError, match="number"):
        check_row(full_row(staging_bytes=True))


def test_none_only_with_a_reason():
    with pytest.raises(ValueError, match="main_itl_ratio is None"):
        check_row(full_row(main_itl_ratio=None))
    check_row(full_row(main_itl_ratio=None,
                       null_reasons={"main_itl_ratio": "the background request ended first"}))


def test_gaps_by_position_and_the_itl_ratio():
    alone = Streamed([(0.0, 1), (0.1, 2), (0.2, 3), (0.3, 4), (0.4, 5)])
    # the same positions, 4 and 5 slowed down while a copy landed in [0.35, 0.8]
    beside = Streamed([(0.0, 1), (0.1, 2), (0.2, 3), (0.4, 4), (0.8, 6)])
    assert {k: gap for k, (gap, _) in beside.gaps().items()} == pytest.approx(
        {2: 0.1, 3: 0.1, 4: 0.2, 5: 0.2, 6: 0.2})
    assert beside.gaps()[5][1] == 0.8  # it came with position 6, in one event
    mean, peak, positions = itl_ratio(alone, beside, 0.35, 0.8)
    assert positions == 2  # 4 and 5: position 6 has no gap alone to compare with
    assert mean == pytest.approx(2.0) and peak == pytest.approx(2.0)
    # a window that holds only position 4
    assert itl_ratio(alone, beside, 0.35, 0.5) == (pytest.approx(2.0), pytest.approx(2.0), 1)
    assert itl_ratio(alone, beside, 5.0, 6.0) == (None, None, 0)


def test_the_copys_time_on_the_line():
    sampler = Sampler(line=None, main=None)
    # 100 Mbit/s = 12.5 MB/s; samples every 0.1 s; busy from 0.2 to 0.6
    sampler.bytes = [(0.0, 0), (0.1, 1000), (0.2, 2000), (0.3, 1_252_000), (0.4, 2_502_000),
                     (0.5, 3_752_000), (0.6, 5_002_000), (0.7, 5_003_000)]
    assert sampler.on_line(100.0) == (0.2, 0.6)
    sampler.bytes = sampler.bytes[:2]
    with pytest.raises(RuntimeError):
        sampler.on_line(100.0)
