"""Reading a prefill's main-bound copies by mode (``pdd_sglang.dev.testing.wan_copies``)."""

from __future__ import annotations

import pytest

from pdd_sglang.dev.testing.wan_copies import copies_by_mode, copy_mode


class FakePrefill:
    def __init__(self, codec: dict, rows: list):
        self.state = {"wan_codec": codec, "transfers": {"by_request": rows}}

    def pdd_state(self) -> dict:
        return self.state


def row(room: int, role: str, pages: int = 4) -> dict:
    return {"room": room, "destination": f"s{role}", "role": role, "pages": pages, "bytes": 1}


def test_unstaged_rooms_count_as_one_sided():
    rows = [row(1, "relay"), row(1, "main"), row(2, "main"), row(3, "main"), row(4, "main", 0),
            row(5, "main")]
    codec = {"coded_copies": 1, "packed_raw_copies": 1, "raw_copies": 1}
    # rooms 1-3 and 5 sent main pages; one coded, one packed, two one-sided (one of them staged)
    assert copies_by_mode(FakePrefill(codec, rows)) == {"packed": 1, "coded": 1, "one_sided": 2}
    assert copies_by_mode(FakePrefill({}, rows[:2])) == {"packed": 0, "coded": 0,
                                                         "one_sided": 1}


def test_copy_mode_names_the_one_copy_between_readings():
    before = {"packed": 2, "coded": 0, "one_sided": 1}
    assert copy_mode(before, {**before, "packed": 3}) == "packed"
    assert copy_mode(before, {**before, "one_sided": 2}) == "one_sided"
    with pytest.raises(ValueError):
        copy_mode(before, before)
    with pytest.raises(ValueError):
        copy_mode(before, {"packed": 3, "coded": 1, "one_sided": 1})
