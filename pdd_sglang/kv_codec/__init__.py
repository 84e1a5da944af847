"""What main-bound KV becomes on the WAN and back (issue 36): codecs behind one small interface.

Below the roles: the prefill encodes, main decodes, the bench and the simulator measure and declare;
none of them owns a codec's state (a codec is stateless, its frames self-describing), so nothing
here is a shared table.

The interface (:class:`KvCodec`): ``encode(kv)`` turns a CPU tensor of KV (any shape whose last
dimension is one head's row, e.g. ``[tokens, heads, head_dim]``) into one *frame*; ``decode(frame,
into)`` writes the KV back into ``into`` (same shape and dtype: a pool page's view), and raises
:class:`CorruptFrame` before writing anything when the frame is damaged or does not match ``into``.
A frame is a fixed header (magic, frame version, codec, dtype, row length, raw size, CRC-32 of the
payload) and the payload: a damaged frame is detected on main, never half-written into pages.

Codecs (:data:`CODECS`):
- ``raw``: the pool's bytes as they are.
- ``lossless``: the bytes split into planes (byte i of every element together, so a float's sign
  and exponent bytes, which vary little, sit apart from its noisy mantissa bytes), then zstd.
  Bit-exact, so token-exact and KV-digest-exact.
- ``fp8``: e4m3 with one float32 scale per row (per token and head: its absolute maximum maps
  to e4m3's largest finite value, 448). Not token-exact: opt-in only, and never with the KV digest.
"""

from __future__ import annotations

import struct
import zlib
from typing import Protocol

import numpy as np
import torch
import zstandard

__all__ = ["CODECS", "CorruptFrame", "KvCodec", "Fp8Codec", "LosslessCodec", "RawCodec",
           "codec_named", "frame_codec_name", "frame_header"]

MAGIC = b"PDKV"
FRAME_VERSION = 1
# magic, frame version, codec id, dtype id, spare, row length, raw bytes, payload CRC-32
HEADER = struct.Struct("<4sBBBBIQI")
# The pool dtypes a frame may carry; ids are wire values, never reorder.
DTYPES = {1: torch.float32, 2: torch.bfloat16, 3: torch.float16}
DTYPE_IDS = {dtype: i for i, dtype in DTYPES.items()}
FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
# zstd level 1: on KV (mostly noisy mantissa bytes) higher levels cost CPU for little ratio.
ZSTD_LEVEL = 1


class CorruptFrame(ValueError):
    """A frame that cannot be decoded into the pages given: damaged, truncated, or for other
    pages."""


class KvCodec(Protocol):
    name: str
    codec_id: int
    lossless: bool

    def encode(self, kv: torch.Tensor) -> bytes: ...

    def decode(self, frame: bytes | memoryview, into: torch.Tensor) -> None: ...


def _as_bytes(kv: torch.Tensor) -> np.ndarray:
    """The tensor's bytes as a numpy uint8 view, one row per element (torch views bfloat16 as
    bytes; numpy has no bfloat16)."""
    if kv.device.type != "cpu":
        raise ValueError(f"KV codecs run on CPU tensors, got one on {kv.device}")
    if kv.dtype not in DTYPE_IDS:
        raise ValueError(f"no KV codec for dtype {kv.dtype}; known: {sorted(map(str, DTYPE_IDS))}")
    flat = kv.contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().reshape(-1, flat.element_size())


def _frame(codec_id: int, kv: torch.Tensor, payload: bytes) -> bytes:
    return frame_header(codec_id, kv, zlib.crc32(payload)) + payload


def frame_header(codec_id: int, kv: torch.Tensor, payload_crc: int) -> bytes:
    """A frame's header for ``kv`` whose payload has CRC-32 ``payload_crc``: a raw frame whose
    payload was gathered in place (the sender's registered memory) needs only this written."""
    return HEADER.pack(MAGIC, FRAME_VERSION, codec_id, DTYPE_IDS[kv.dtype], 0,
                       kv.shape[-1] if kv.dim() else 1, kv.numel() * kv.element_size(),
                       payload_crc)


def _open(frame: bytes | memoryview, codec_id: int, into: torch.Tensor) -> tuple[int, memoryview]:
    """Check the frame against ``into``; returns (row length, payload)."""
    view = memoryview(frame)
    if len(view) < HEADER.size:
        raise CorruptFrame(f"KV frame of {len(view)} bytes is shorter than its header")
    magic, version, got_codec, dtype_id, _, row, raw_bytes, crc = HEADER.unpack_from(view)
    if magic != MAGIC or version != FRAME_VERSION:
        raise CorruptFrame(f"not a KV frame of version {FRAME_VERSION} (magic {magic!r}, "
                           f"version {version})")
    if got_codec != codec_id:
        raise CorruptFrame(f"KV frame of codec {got_codec} given to codec {codec_id}")
    if DTYPES.get(dtype_id) != into.dtype or raw_bytes != into.numel() * into.element_size():
        raise CorruptFrame(f"KV frame of {raw_bytes} bytes of {DTYPES.get(dtype_id)} does not fit "
                           f"{into.numel() * into.element_size()} bytes of {into.dtype}")
    payload = view[HEADER.size:]
    if zlib.crc32(payload) != crc:
        raise CorruptFrame("KV frame's payload fails its CRC-32: damaged in transit")
    return row, payload


def _write_bytes(into: torch.Tensor, planes_or_bytes: np.ndarray) -> None:
    if not into.is_contiguous():
        raise ValueError("decode writes into a contiguous view of the pages")
    _as_bytes(into)[...] = planes_or_bytes


class RawCodec:
    name, codec_id, lossless = "raw", 0, True

    def encode(self, kv: torch.Tensor) -> bytes:
        return _frame(self.codec_id, kv, _as_bytes(kv).tobytes())

    def decode(self, frame: bytes | memoryview, into: torch.Tensor) -> None:
        _write_bytes(into, self.payload(frame, into).reshape(-1, into.element_size()))

    def payload(self, frame: bytes | memoryview, like: torch.Tensor) -> np.ndarray:
        """The frame's payload in place, checked (header and CRC) against ``like``'s shape and
        dtype (nothing written): main scatters a raw record straight from its staging slot."""
        _, payload = _open(frame, self.codec_id, like)
        return np.frombuffer(payload, np.uint8)


class LosslessCodec:
    name, codec_id, lossless = "lossless", 1, True

    def __init__(self, level: int = ZSTD_LEVEL):
        self.level = level

    def encode(self, kv: torch.Tensor) -> bytes:
        planes = np.ascontiguousarray(_as_bytes(kv).T)
        # zstd writes the content size into its frame: decode checks it against the pages'.
        payload = zstandard.ZstdCompressor(level=self.level).compress(planes)
        return _frame(self.codec_id, kv, payload)

    def decode(self, frame: bytes | memoryview, into: torch.Tensor) -> None:
        _, payload = _open(frame, self.codec_id, into)
        size = into.numel() * into.element_size()
        try:
            planes = zstandard.ZstdDecompressor().decompress(payload, max_output_size=size)
        except zstandard.ZstdError as error:
            raise CorruptFrame(f"KV frame's zstd payload does not decode: {error}") from None
        if len(planes) != size:
            raise CorruptFrame(f"KV frame decodes to {len(planes)} bytes, the pages hold {size}")
        _write_bytes(into, np.frombuffer(planes, np.uint8).reshape(into.element_size(), -1).T)


class Fp8Codec:
    name, codec_id, lossless = "fp8", 2, False

    def encode(self, kv: torch.Tensor) -> bytes:
        _as_bytes(kv)  # validates device and dtype
        rows = kv.contiguous().reshape(-1, kv.shape[-1]).to(torch.float32)
        # One scale per row (a token's head): its largest magnitude maps to e4m3's largest value.
        scales = rows.abs().amax(dim=1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)
        scales = scales / FP8_MAX
        quantized = (rows / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        payload = scales.numpy().tobytes() + quantized.view(torch.uint8).numpy().tobytes()
        return _frame(self.codec_id, kv, payload)

    def decode(self, frame: bytes | memoryview, into: torch.Tensor) -> None:
        row, payload = _open(frame, self.codec_id, into)
        count = into.numel()
        if row < 1 or count % row or len(payload) != 4 * (count // row) + count:
            raise CorruptFrame(f"fp8 KV frame's payload of {len(payload)} bytes does not hold "
                               f"{count} values in rows of {row}")
        scales = torch.frombuffer(bytearray(payload[:4 * (count // row)]), dtype=torch.float32)
        quantized = torch.frombuffer(bytearray(payload[4 * (count // row):]), dtype=torch.uint8)
        values = quantized.view(FP8).to(torch.float32).reshape(-1, row) * scales.reshape(-1, 1)
        into.copy_(values.reshape(into.shape).to(into.dtype))


CODECS: dict[str, KvCodec] = {c.name: c for c in (RawCodec(), LosslessCodec(), Fp8Codec())}
_BY_ID = {c.codec_id: c for c in CODECS.values()}


def codec_named(name: str) -> KvCodec:
    try:
        return CODECS[name]
    except KeyError:
        raise ValueError(f"no KV codec {name!r}; known: {sorted(CODECS)}") from None


def frame_codec_name(frame: bytes | memoryview) -> str:
    """The codec a frame was written by (main decodes whatever the prefill chose per copy)."""
    view = memoryview(frame)
    if len(view) < HEADER.size or bytes(view[:4]) != MAGIC:
        raise CorruptFrame("not a KV frame")
    codec = _BY_ID.get(HEADER.unpack_from(view)[2])
    if codec is None:
        raise CorruptFrame(f"KV frame of unknown codec {HEADER.unpack_from(view)[2]}")
    return codec.name
