"""Per-destination page offsets, at every page size and across chunk boundaries."""

import dataclasses

import numpy as np
import pytest

from pdd_sglang.prefill.destination_chunks import skip_prefix_pages


@dataclasses.dataclass
class Chunk:  # the fields of SGLang's TransferKVChunk that the offset touches
    room: int
    prefill_kv_indices: np.ndarray
    index_slice: slice
    num_kv_tokens: int | None = None
    is_last_chunk: bool = False


def chunks_of(total_pages: int, chunk_pages: int):
    """SGLang numbers a room's chunks from where sending started (the smallest prefix)."""
    pages = np.arange(1000, 1000 + total_pages, dtype=np.int32)  # source page ids
    for start in range(0, total_pages, chunk_pages):
        stop = min(start + chunk_pages, total_pages)
        yield Chunk(1, pages[start:stop], slice(start, stop))


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("skip_pages", [0, 1, 3, 7, 12])
@pytest.mark.parametrize("chunk_pages", [1, 2, 5, 64])
def test_destination_gets_exactly_the_pages_past_its_prefix(page_size, skip_pages, chunk_pages):
    total = 12
    sent_src, sent_dst = [], []
    for chunk in chunks_of(total, chunk_pages):
        view = skip_prefix_pages(chunk, skip_pages * page_size, page_size)
        assert len(view.prefill_kv_indices) == view.index_slice.stop - view.index_slice.start
        sent_src.extend(view.prefill_kv_indices.tolist())
        sent_dst.extend(range(view.index_slice.start, view.index_slice.stop))
    # Source pages: the room's pages from skip_pages on; destination slots: 0.. in its own numbering.
    assert sent_src == list(range(1000 + skip_pages, 1000 + total))
    assert sent_dst == list(range(0, total - skip_pages))


def test_zero_offset_returns_the_chunk_itself():
    chunk = next(chunks_of(4, 4))
    assert skip_prefix_pages(chunk, 0, 16) is chunk


@pytest.mark.parametrize("skip_tokens", [-16, 5])
def test_misaligned_or_negative_offset_is_refused(skip_tokens):
    with pytest.raises(ValueError, match="page size"):
        skip_prefix_pages(next(chunks_of(4, 4)), skip_tokens, 16)
