"""Fingerprints of a request's prompt KV: the WAN integrity check and a debug view.

``--pdd-enable-kv-digest`` (relay and main): the relay hashes each P->RLD->MD request's prompt KV
as it lands (8 bytes per token, kept for a bounded number of rooms); main hashes the pages it
received across the WAN and sends :func:`range_digest` of them with ``HandoffReady``, on the
control channel. The relay compares it with the digest of its own copy over the same positions;
the two copies left prefill as the same bytes, so any difference is damage on the way. Hashing
reads every received row once on the CPU (about a WAN copy's worth of memory traffic).

With ``--pdd-debug-kv-digest``, the prefill fingerprints a request's prompt KV when it sends the
last chunk, and each decode server fingerprints its own rows for the same prompt once the transfer
is committed: for a main, that is the prefix its radix cache held plus the suffix it received.
Per token there are two fingerprints of all layers' K and V rows: a hash (equal only for
bit-identical tensors) and a float64 sum (to compare within a tolerance the positions whose KV a
server computed itself, such as a previous turn's output tokens that main decoded while prefill
recomputed them in one extend). They appear in ``/server_info``
(``internal_states[i]["pdd"]["kv_digests"]``), keyed by bootstrap room. Reading every layer's
rows is slow: this is for tests and debugging, not for serving.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from typing import Any

MAX_DIGESTS = 4096
_digests: OrderedDict[int, dict] = OrderedDict()
_lock = threading.Lock()


def enabled() -> bool:
    from sglang.srt.runtime_context import get_server_args

    return bool(getattr(get_server_args(), "pdd_debug_kv_digest", False))


def _token_rows(scheduler: Any, req: Any, start: int = 0) -> Any:
    """The prompt KV of positions [start, prompt end) as one row of bytes per token: every layer's
    K then V, in the logical order of the tokens (so the page size does not matter)."""
    import torch

    tokens = len(req.origin_input_ids)
    slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:tokens].long()
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    rows = []
    for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
        for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            rows.append(buffer[slots].detach().to("cpu").reshape(tokens - start, -1))
    return torch.cat(rows, dim=1).contiguous()


TOKEN_HASH_BYTES = 8


def token_hashes(scheduler: Any, req: Any, start: int = 0) -> bytes:
    """An 8-byte hash of each prompt token's KV from ``start`` on, concatenated in token order;
    two servers' hashes of a token are equal only if its KV is bit-identical on both."""
    import torch

    if start >= len(req.origin_input_ids):  # main had the whole prompt: nothing crossed
        return b""
    raw = _token_rows(scheduler, req, start).view(torch.uint8).numpy()  # any dtype, bf16 too
    return b"".join(hashlib.blake2b(row.tobytes(), digest_size=TOKEN_HASH_BYTES).digest()
                    for row in raw)


def range_digest(hashes: bytes, skip_tokens: int = 0) -> bytes:
    """The digest that crosses the control channel: one hash over the tokens' hashes past
    ``skip_tokens`` (main's cached prefix, which did not cross the WAN)."""
    from pdd_sglang.protocol.messages import KV_DIGEST_BYTES

    return hashlib.blake2b(hashes[skip_tokens * TOKEN_HASH_BYTES:],
                           digest_size=KV_DIGEST_BYTES).digest()


def corrupt_one_value(scheduler: Any, req: Any, position: int) -> None:
    """Debug: change the first K value of one prompt position in place (a flipped WAN byte)."""
    slot = int(scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, position])
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    pool.get_key_buffer(pool.start_layer)[slot].view(-1)[0] += 1.0


def prompt_kv_fingerprints(scheduler: Any, req: Any) -> dict:
    blob = token_hashes(scheduler, req)
    return {
        "hashes": [blob[i:i + TOKEN_HASH_BYTES].hex()
                   for i in range(0, len(blob), TOKEN_HASH_BYTES)],
        "sums": _token_rows(scheduler, req).double().sum(dim=1).tolist(),
    }


def record(scheduler: Any, req: Any) -> None:
    if req.bootstrap_room is None or not enabled():
        return
    value = prompt_kv_fingerprints(scheduler, req)
    with _lock:
        _digests[int(req.bootstrap_room)] = value
        while len(_digests) > MAX_DIGESTS:
            _digests.popitem(last=False)


def snapshot() -> dict:
    with _lock:
        return {str(room): value for room, value in _digests.items()}
