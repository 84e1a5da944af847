"""One destination's view of a KV chunk: only the pages past the prefix it already holds.

Prefill sends a room's KV from the smallest prefix among its destinations (``room_send_start``);
a destination that holds more (main, whose radix cache matched more of the prompt) gets each chunk
with the pages it has cut off and the rest renumbered from its own start.
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


def pages_past_prefix(chunk: Any, skip_tokens: int, page_size: int) -> int:
    """How many of ``chunk``'s pages a destination holding ``skip_tokens`` more receives."""
    try:
        return len(skip_prefix_pages(chunk, skip_tokens, page_size).prefill_kv_indices)
    except ValueError:  # a bad prefix claim fails the room where the chunk is sent
        return 0


def bytes_past_prefixes(kv_mgr: Any, chunk: Any, sessions: list) -> list[tuple[str, int]]:
    """``(session, KV bytes)`` that each of ``sessions`` will receive of ``chunk``: its pages
    past that destination's own prefix, at the KV manager's bytes per page (every layer)."""
    infos = dict(kv_mgr.transfer_infos.get(chunk.room, {}))
    if not infos:
        return []
    start = min(info.decode_prefix_len or 0 for info in infos.values())
    page_bytes = sum(kv_mgr.kv_args.kv_item_lens)
    page_size = kv_mgr.kv_args.page_size
    return [(s, page_bytes * pages_past_prefix(chunk, (infos[s].decode_prefix_len or 0) - start,
                                               page_size))
            for s in sessions if s in infos]


def uncounted_copy(chunk: Any) -> Any:
    """A copy the WAN worker counts afresh: SGLang's per-room in-flight count sees both paths."""
    return dataclasses.replace(chunk, staging_counted=False)
