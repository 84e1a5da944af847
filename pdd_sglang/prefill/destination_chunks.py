"""One destination's view of a KV chunk: only the pages past the prefix it already holds.

Prefill sends a room's KV from the smallest prefix among its destinations (the fan-out's
``Room.send_start``); a destination that holds more (main, whose radix cache matched more of the
prompt) gets each chunk with the pages it has cut off and the rest renumbered from its own start.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def skip_prefix_pages(chunk: Any, skip_tokens: int, page_size: int) -> Any:
    """The part of ``chunk`` past the first ``skip_tokens`` of the room's sent range.

    ``chunk.index_slice`` counts pages from where the room's sending started; a destination that
    holds ``skip_tokens`` more than that gets only the pages after them, renumbered from its own
    start, which is how its ``dst_kv_indices`` are numbered.
    """
    if skip_tokens == 0:
        return chunk
    if skip_tokens < 0 or skip_tokens % page_size:
        raise ValueError(
            f"destination prefix offset {skip_tokens} is not a non-negative multiple of the "
            f"page size {page_size}"
        )
    skip_pages = skip_tokens // page_size
    start, stop = chunk.index_slice.start or 0, chunk.index_slice.stop
    drop = min(max(skip_pages - start, 0), len(chunk.prefill_kv_indices))
    tokens = chunk.num_kv_tokens
    return dataclasses.replace(
        chunk,
        prefill_kv_indices=chunk.prefill_kv_indices[drop:],
        index_slice=slice(max(start - skip_pages, 0), max(stop - skip_pages, 0)),
        num_kv_tokens=None if tokens is None else max(tokens - drop * page_size, 0),
    )
