"""Fingerprints of a request's prompt KV: the WAN integrity check and a debug view.

``--pdd-enable-kv-digest`` (relay and main): the relay hashes each P->RLD->MD request's prompt KV
as it lands (8 bytes per token, kept for a bounded number of rooms); main hashes the pages it
received across the WAN and sends :func:`range_digest` of them with ``HandoffReady``, on the
control channel. The relay compares it with the digest of its own copy over the same positions;
the two copies left prefill as the same bytes, so any difference is damage on the way. Hashing
reads every received row once, where the KV lives (:func:`token_hash_tensor`: vectorized
integer passes, on the GPU's stream or, on the CPU, a worker thread), and the scheduler only
starts it (:class:`PendingHashes`): main says HandoffReady once its hashes are done, the relay
answers once its own are.

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
from dataclasses import dataclass
from typing import Any

MAX_DIGESTS = 4096
_digests: OrderedDict[int, dict] = OrderedDict()
_lock = threading.Lock()


def enabled() -> bool:
    from sglang.srt.runtime_context import get_server_args

    return bool(getattr(get_server_args(), "pdd_debug_kv_digest", False))


def _slots(scheduler: Any, req: Any, start: int) -> Any:
    tokens = len(req.origin_input_ids)
    return scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:tokens].long()


def _token_rows(scheduler: Any, req: Any, start: int = 0) -> Any:
    """The prompt KV of positions [start, prompt end) as one row per token on the host: every
    layer's K then V, in the logical order of the tokens (debug view only)."""
    import torch

    slots = _slots(scheduler, req, start)
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    rows = [buffer[slots].detach().to("cpu").reshape(len(slots), -1)
            for buffer in _buffers(pool)]
    return torch.cat(rows, dim=1).contiguous()


TOKEN_HASH_BYTES = 8
# Tokens hashed per pass of one buffer: bounds the temporaries (tokens x row words x 8 bytes).
_TOKENS_PER_PASS_BYTES = 64 << 20
_MIX = -49064778989728563  # 0xff51afd7ed558ccd as a signed int64 (MurmurHash3's fmix64)
_LAYER_PRIME = 1099511628211  # FNV-64's prime: folds one buffer's hashes into the token's
_coefficients: dict = {}


def _buffers(pool: Any) -> list:
    """Every layer's K then V buffer, in layer order."""
    out = []
    for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
        out += [pool.get_key_buffer(layer), pool.get_value_buffer(layer)]
    return out


@dataclass(frozen=True)
class RankHeads:
    """Which of the model's KV heads this TP rank's pool holds, to hash them as parts of the
    whole: ``first`` of ``total`` heads, ``counted`` False on a rank whose heads another rank
    also holds and counts (KV heads fewer than ranks: SGLang gives rank r head r // (TP //
    heads), ``compute_head_slice_params``'s rule too). TP 1: the whole, counted."""

    first: int = 0
    total: int = 0  # 0: the whole row is this rank's (TP 1, or heads unknown)
    counted: bool = True


def rank_heads(scheduler: Any) -> RankHeads:
    """This scheduler's share of the KV heads (its attention TP rank and size, the model's KV
    heads); the whole at TP 1 or where no SGLang runtime is published (unit tests)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        size, rank = int(parallel.attn_tp_size or 1), int(parallel.attn_tp_rank or 0)
    except Exception:
        return RankHeads()
    if size == 1:
        return RankHeads()
    total = int(scheduler.model_config.get_total_num_kv_heads())
    if total >= size:
        return RankHeads(first=rank * (total // size), total=total)
    replicas = size // total
    return RankHeads(first=rank // replicas, total=total, counted=rank % replicas == 0)


def _row_coefficients(words: int, device: Any) -> Any:
    """Odd 64-bit multipliers, one per 32-bit word of a token's whole row (every KV head): the
    same on every server (drawn on the host from a fixed seed, whatever the device)."""
    import torch

    key = (words, str(device))
    if key not in _coefficients:
        draw = torch.randint(-(1 << 62), 1 << 62, (words,), dtype=torch.int64,
                             generator=torch.Generator().manual_seed(0x5EED))
        _coefficients[key] = (draw | 1).to(device)
    return _coefficients[key]


def _own_coefficients(buffer: Any, words: int, heads: RankHeads, device: Any) -> Any:
    """The multipliers of this rank's words: its heads' place in the whole row (a buffer is
    ``[slots, heads, head_dim]``, its heads this rank's)."""
    if heads.total == 0:
        return _row_coefficients(words, device)
    per_head = words // int(buffer.shape[1])
    first = heads.first * per_head
    return _row_coefficients(heads.total * per_head, device)[first:first + words]


def token_hash_tensor(pool: Any, slots: Any) -> Any:
    """One int64 hash per token of its KV in every layer (:func:`token_partial_tensor` of the
    whole, finalized): the hash a TP 1 server gives, and :func:`combine` of every rank's parts."""
    return _finalize(token_partial_tensor(pool, slots))


def token_partial_tensor(pool: Any, slots: Any, heads: RankHeads = RankHeads()) -> Any:
    """This rank's part of each token's hash, on the pool's device, in a few vectorized integer
    passes per buffer and no host copy (asynchronous on a GPU).

    Each 32-bit word of a token's row is multiplied by the odd constant of its place in the
    whole row (every KV head; this rank's heads are a part of it) and xor-shifted (both
    one-to-one on 64-bit integers, so any one changed word changes the token's sum), the words
    summed (wrapping), and the buffers folded in layer order: all of it linear in the words'
    terms, so the ranks' parts add up (wrapping) to the whole's, at any TP split of the heads.
    :func:`_finalize` then mixes the sum (MurmurHash3's mix). Integer arithmetic only: the same
    bits give the same hash on any device and page layout, whatever the dtype (bf16, fp8 and
    float32 rows are read as raw words)."""
    import torch

    buffers = _buffers(pool)
    device = buffers[0].device
    slots = slots.to(device)
    total = torch.zeros(len(slots), dtype=torch.int64, device=device)
    if not heads.counted:  # another rank holds and counts these heads
        return total
    for buffer in buffers:
        row_bytes = buffer[0].numel() * buffer.element_size()
        words = row_bytes // 4
        coefficients = _own_coefficients(buffer, words, heads, device)
        per_pass = max(1, _TOKENS_PER_PASS_BYTES // (8 * words))
        for first in range(0, len(slots), per_pass):
            chunk = slots[first:first + per_pass]
            rows = buffer[chunk].reshape(len(chunk), -1)
            # Sign extension of each 32-bit word is one-to-one, as are the odd multiply and the
            # xor-shift: any one changed word changes that word's term.
            x = rows.view(torch.int32).to(torch.int64)
            x.mul_(coefficients)
            x.bitwise_xor_(x >> 29)
            part = total[first:first + per_pass]
            part.mul_(_LAYER_PRIME).add_(x.sum(dim=1))
    return total


def _finalize(total: Any) -> Any:
    total = total.clone()
    total ^= total >> 33
    total *= _MIX
    total ^= total >> 33
    return total


def combine(parts: list) -> bytes:
    """The token hashes of the whole KV from every TP rank's part (:meth:`PendingHashes.part`,
    in any order): equal to a TP 1 server's hashes of the same KV."""
    import numpy as np
    import torch

    total = np.zeros(len(parts[0]) // TOKEN_HASH_BYTES, dtype="<u8")
    for part in parts:
        total += np.frombuffer(part, dtype="<u8")  # wraps, as the int64 sums did
    hashes = _finalize(torch.from_numpy(total.view("<i8").copy()))
    return hashes.numpy().astype("<i8").tobytes()


def token_hashes(scheduler: Any, req: Any, start: int = 0) -> bytes:
    """An 8-byte hash of each prompt token's KV from ``start`` on, concatenated in token order;
    two servers' hashes of a token are equal only if its KV is bit-identical on both (with
    overwhelming probability). Synchronous: see :class:`PendingHashes` for the serving path."""
    return PendingHashes.start(scheduler, req, start).result()


class PendingHashes:
    """:func:`token_hashes` without stalling the scheduler thread.

    On a GPU the hashing kernels are queued on the current stream behind the work that wrote
    the KV and an event marks their end; the scheduler polls :meth:`ready` each step and reads
    the 8 bytes per token only once they are done. On the CPU the hashing runs on one worker
    thread (torch releases the GIL) over the request's slots, which the request holds until the
    hashes are read. Either way the scheduler step pays O(1) to start it.

    At TP > 1 each rank hashes its own KV heads as their part of the whole (:class:`RankHeads`):
    :meth:`part` is what a rank contributes, and :func:`combine` of every rank's parts is the
    whole KV's hashes, equal at any TP size (``decode.tp_sync.RankInputs.whole_kv_hashes``)."""

    _executor = None

    def __init__(self, future: Any = None, tensor: Any = None, event: Any = None):
        self._future, self._tensor, self._event = future, tensor, event

    @classmethod
    def start(cls, scheduler: Any, req: Any, start: int = 0,
              background: bool = False) -> "PendingHashes":
        if start >= len(req.origin_input_ids):  # main had the whole prompt: nothing crossed
            return cls(tensor=None)
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
        slots = _slots(scheduler, req, start).clone()
        device = _buffers(pool)[0].device
        heads = rank_heads(scheduler)
        if device.type == "cuda":
            import torch

            tensor = token_partial_tensor(pool, slots, heads)
            event = torch.cuda.Event()
            event.record()
            return cls(tensor=tensor, event=event)
        if background:
            return cls(future=cls._worker().submit(token_partial_tensor, pool, slots, heads))
        return cls(tensor=token_partial_tensor(pool, slots, heads))

    @classmethod
    def _worker(cls):
        if cls._executor is None:
            from concurrent.futures import ThreadPoolExecutor

            cls._executor = ThreadPoolExecutor(1, thread_name_prefix="pdd-kv-digest")
        return cls._executor

    @classmethod
    def shutdown(cls) -> None:
        """Stop the CPU worker thread (server shutdown); a later hash starts a new one."""
        if cls._executor is not None:
            cls._executor.shutdown(wait=True, cancel_futures=True)
            cls._executor = None

    def ready(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._event is None or self._event.query()

    def result(self) -> bytes:
        """The hashes of this rank's KV (at TP 1 the whole), waiting if they are not ready."""
        part = self.part()
        return combine([part]) if part else b""

    def part(self) -> bytes:
        """This rank's part of the whole KV's hashes (:func:`combine`), waiting if not ready."""
        tensor = self._future.result() if self._future is not None else self._tensor
        if tensor is None:
            return b""
        return tensor.cpu().numpy().astype("<i8").tobytes()


def range_digest(hashes: bytes, skip_tokens: int = 0) -> bytes:
    """The digest that crosses the control channel: one hash over the tokens' hashes past
    ``skip_tokens`` (main's cached prefix, which did not cross the WAN)."""
    from pdd_sglang.protocol.messages import KV_DIGEST_BYTES

    return hashlib.blake2b(hashes[skip_tokens * TOKEN_HASH_BYTES:],
                           digest_size=KV_DIGEST_BYTES).digest()


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
