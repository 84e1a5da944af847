"""A KV pool's pages as tensors, for coding them (issue 36): read at the prefill, written at main.

SGLang's PD describes a pool by its registered buffers (``kv_args.kv_data_ptrs``, one per layer
and K/V) and each buffer's bytes per page (``kv_item_lens``). :class:`PoolPages` views those
buffers in place (host memory through ctypes, device memory through ``__cuda_array_interface__``;
the device path is not exercised here), gathers the pages of a slice into one tensor in a frame's
layout ``[buffers, pages, rows, row]`` and scatters a decoded one back. Stateless beyond the
views: the caller's thread owns the pages it touches (a prefill sender reads pages SGLang holds
for its room; main's landing thread writes a room's pages until the room has landed,
:mod:`pdd_sglang.decode.wan_staging`).
"""

from __future__ import annotations

import ctypes
from typing import Any, Optional, Sequence

import numpy as np
import torch

# kv_cache_dtype strings SGLang resolves to a dtype a frame can carry (kv_codec.DTYPES).
CODABLE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16, "half": torch.float16}


class _CudaBuffer:
    """Device memory SGLang owns, as torch.as_tensor reads it (no copy)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3}


def buffer_view(ptr: int, nbytes: int, device: str = "cpu") -> torch.Tensor:
    """A uint8 tensor over ``nbytes`` at ``ptr``, in place."""
    if device.startswith("cuda"):
        return torch.as_tensor(_CudaBuffer(ptr, nbytes), device=device)
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
    return torch.from_numpy(array)


class PoolPages:
    """The pages of one pool's buffers, each ``item_len`` bytes a page."""

    def __init__(self, ptrs: Sequence[int], lens: Sequence[int], item_lens: Sequence[int],
                 dtype: torch.dtype, row: int, device: str = "cpu"):
        if len(set(item_lens)) != 1:
            raise ValueError(f"coded copies need one page size across buffers, got {item_lens}")
        self.item_len = int(item_lens[0])
        self.dtype, self.device = dtype, device
        size = torch.empty((), dtype=dtype).element_size()
        if self.item_len % size or (self.item_len // size) % row:
            raise ValueError(f"a {self.item_len}-byte page is no whole number of {row}-value "
                             f"rows of {dtype}")
        self.row = int(row)
        self.views = [buffer_view(p, n - n % self.item_len, device).view(-1, self.item_len)
                      for p, n in zip(ptrs, lens)]

    @property
    def page_bytes(self) -> int:
        """Bytes one page holds across every buffer (what a page costs on the wire raw)."""
        return self.item_len * len(self.views)

    def gather(self, pages: np.ndarray, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The pages' KV on the CPU as ``[buffers, pages, rows, row]`` of the pool's dtype; into
        ``out`` (``[buffers, pages, item_len]`` bytes: a sender's registered memory) when given,
        one copy per buffer (torch's, outside the GIL) and no bytes object in between; a device
        pool's pages are gathered on the device, then copied to the host once."""
        index = torch.as_tensor(np.asarray(pages, dtype=np.int64), device=self.device)
        if out is None:
            out = torch.empty((len(self.views), len(index), self.item_len), dtype=torch.uint8)
        for view, part in zip(self.views, out):
            if self.device == "cpu":
                torch.index_select(view, 0, index, out=part)
            else:
                part.copy_(view.index_select(0, index))
        return out.view(self.dtype).reshape(len(self.views), len(index), -1, self.row)

    def empty_for(self, pages: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A CPU tensor a frame of ``pages`` pages decodes into."""
        return torch.empty((len(self.views), pages, self.item_len), dtype=torch.uint8).view(
            dtype or self.dtype)

    def scatter(self, pages: np.ndarray, data: torch.Tensor, stream: Any = None) -> None:
        """Write a decoded ``[buffers, pages, ...]`` tensor into the pages; on a GPU pool, on
        ``stream`` (the caller's own, synchronized before it returns)."""
        raw = data.contiguous().view(torch.uint8).reshape(len(self.views), len(pages), -1)
        if raw.shape[2] != self.item_len:
            raise ValueError(f"{raw.shape[2]} bytes a page given, the pool's pages hold "
                             f"{self.item_len}")
        if stream is None:
            _scatter(self.views, pages, raw, self.device)
            return
        with torch.cuda.stream(stream):
            _scatter(self.views, pages, raw, self.device)
        stream.synchronize()


def _scatter(views: list, pages: np.ndarray, raw: torch.Tensor, device: str) -> None:
    index = np.asarray(pages, dtype=np.int64)
    if device == "cpu":  # numpy's assignment: a tenth of index_copy_'s CPU on a record's rows
        for view, part in zip(views, raw.numpy()):
            view.numpy()[index] = part
        return
    on_device = torch.as_tensor(index, device=device)
    data = raw.to(device, non_blocking=True)
    for view, part in zip(views, data):
        view.index_copy_(0, on_device, part)
