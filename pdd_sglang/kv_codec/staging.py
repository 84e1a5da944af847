"""An allocator of byte ranges of a region (issues 36, 50): the prefill's send pool's places.

Pure bookkeeping, no memory of its own: :class:`StagingAllocator` hands out ranges of a region of
``size`` bytes (first fit, aligned), takes them back, and says what is in use. The prefill's send
pool (:mod:`pdd_sglang.prefill.send_pool`) owns one under its lock: a place is reserved for a
record and freed once Mooncake has ended the block written from it, so nothing leaks on a cancel
or a failure (``tests/unit/test_wan_staging``).
"""

from __future__ import annotations

import bisect
from typing import Optional

ALIGN = 64


class StagingAllocator:
    """First-fit ranges of ``[0, size)``, each ``ALIGN``-aligned; ``reserve`` returns None when no
    free range fits (the caller waits for one to be freed)."""

    def __init__(self, size: int):
        if size < 0:
            raise ValueError(f"a staging region of {size} bytes")
        self.size = int(size)
        self._free: list[tuple[int, int]] = [(0, self.size)] if self.size else []  # sorted
        self._used: dict[int, int] = {}  # offset -> length

    def reserve(self, nbytes: int) -> Optional[int]:
        length = -(-int(nbytes) // ALIGN) * ALIGN
        if length <= 0:
            raise ValueError(f"a staging range of {nbytes} bytes")
        for index, (start, free) in enumerate(self._free):
            if free >= length:
                if free == length:
                    del self._free[index]
                else:
                    self._free[index] = (start + length, free - length)
                self._used[start] = length
                return start
        return None

    def free(self, offset: int) -> None:
        length = self._used.pop(offset)  # KeyError: a range freed twice, or never reserved
        index = bisect.bisect(self._free, (offset, 0))
        self._free.insert(index, (offset, length))
        # merge with the neighbours
        if index + 1 < len(self._free) and offset + length == self._free[index + 1][0]:
            length += self._free.pop(index + 1)[1]
            self._free[index] = (offset, length)
        if index > 0 and sum(self._free[index - 1]) == offset:
            start, before = self._free.pop(index - 1)
            self._free[index - 1] = (start, before + length)

    @property
    def in_use(self) -> int:
        return sum(self._used.values())

    @property
    def ranges(self) -> int:
        return len(self._used)

    def largest_free(self) -> int:
        return max((length for _, length in self._free), default=0)
