"""A debug check of the KV each server holds for a prompt against prefill's, token by token.

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


def prompt_kv_fingerprints(scheduler: Any, req: Any) -> dict:
    import torch

    tokens = len(req.origin_input_ids)
    slots = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :tokens].long()
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    rows = []
    for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
        for buffer in (pool.get_key_buffer(layer), pool.get_value_buffer(layer)):
            rows.append(buffer[slots].detach().to("cpu").reshape(tokens, -1))
    per_token = torch.cat(rows, dim=1).contiguous()
    return {
        "hashes": [
            hashlib.blake2b(per_token[i].numpy().tobytes(), digest_size=8).hexdigest()
            for i in range(tokens)
        ],
        "sums": per_token.double().sum(dim=1).tolist(),
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
