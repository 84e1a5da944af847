"""The KV digest's arithmetic on a small fake KV pool (the real pool is exercised by the
three-role integration tests, which run with --pdd-enable-kv-digest)."""

from __future__ import annotations

from types import SimpleNamespace

import threading

import torch

from pdd_sglang.dev.debug_aids.aids import corrupt_one_value
from pdd_sglang.diagnostics import kv_digest
from pdd_sglang.protocol.messages import KV_DIGEST_BYTES

LAYERS, HEADS, DIM = 2, 2, 4


class Pool:
    def __init__(self, slots: int, dtype=torch.float32):
        self.start_layer, self.layer_num = 0, LAYERS
        self.k = [torch.zeros(slots, HEADS, DIM, dtype=dtype) for _ in range(LAYERS)]
        self.v = [torch.zeros(slots, HEADS, DIM, dtype=dtype) for _ in range(LAYERS)]

    def get_key_buffer(self, layer):
        return self.k[layer]

    def get_value_buffer(self, layer):
        return self.v[layer]


def server(prompt_kv: torch.Tensor, slots: list[int], dtype=torch.float32):
    """A scheduler whose one request's prompt KV (tokens x layers x 2 x heads x dim) sits in
    ``slots`` of its pool."""
    pool = Pool(max(slots) + 1, dtype)
    for token, slot in enumerate(slots):
        for layer in range(LAYERS):
            pool.k[layer][slot] = prompt_kv[token, layer, 0].to(dtype)
            pool.v[layer][slot] = prompt_kv[token, layer, 1].to(dtype)
    scheduler = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=torch.tensor([slots])),
        token_to_kv_pool_allocator=SimpleNamespace(get_kvcache=lambda: pool))
    req = SimpleNamespace(origin_input_ids=list(range(len(slots))),
                          kv=SimpleNamespace(req_pool_idx=0))
    return scheduler, req


def prompt(tokens: int = 10) -> torch.Tensor:
    return torch.randn(tokens, LAYERS, 2, HEADS, DIM, generator=torch.Generator().manual_seed(0))


def test_the_same_kv_in_other_slots_has_the_same_hashes():
    kv = prompt()
    relay = server(kv, list(range(10)))
    main = server(kv, [17, 3, 9, 12, 0, 5, 30, 8, 21, 2])  # another page layout
    assert kv_digest.token_hashes(*relay) == kv_digest.token_hashes(*main)
    assert len(kv_digest.token_hashes(*relay)) == 10 * kv_digest.TOKEN_HASH_BYTES


def test_main_digests_only_what_crossed_and_the_relay_digests_the_same_positions():
    kv = prompt()
    relay_hashes = kv_digest.token_hashes(*server(kv, list(range(10))))
    main_hashes = kv_digest.token_hashes(*server(kv, list(range(10))), start=6)
    digest = kv_digest.range_digest(main_hashes)
    assert len(digest) == KV_DIGEST_BYTES
    assert kv_digest.range_digest(relay_hashes, skip_tokens=6) == digest
    assert kv_digest.range_digest(relay_hashes, skip_tokens=5) != digest


def test_one_changed_value_changes_the_digest_in_any_dtype():
    for dtype in (torch.float32, torch.bfloat16):
        kv = prompt()
        scheduler, req = server(kv, list(range(10)), dtype)
        before = kv_digest.range_digest(kv_digest.token_hashes(scheduler, req, 4))
        corrupt_one_value(scheduler, req, 7)  # the test aid of --pdd-debug-corrupt-wan-kv
        after = kv_digest.range_digest(kv_digest.token_hashes(scheduler, req, 4))
        assert before != after, dtype


def test_a_prompt_main_had_whole_has_nothing_to_digest():
    scheduler, req = server(prompt(), list(range(10)))
    assert kv_digest.token_hashes(scheduler, req, start=10) == b""
    assert kv_digest.range_digest(b"") == kv_digest.range_digest(
        kv_digest.token_hashes(scheduler, req), skip_tokens=10)


def test_hashing_off_the_scheduler_thread_gives_the_same_hashes(monkeypatch):
    scheduler, req = server(prompt(40), list(range(40)))
    inline = kv_digest.token_hashes(scheduler, req, 3)
    pending = kv_digest.PendingHashes.start(scheduler, req, 3, background=True)
    assert pending.result() == inline and pending.ready()
    assert [t.name for t in threading.enumerate()
            if t.name.startswith("pdd-kv-digest")]
    kv_digest.PendingHashes.shutdown()
    assert not [t.name for t in threading.enumerate()
                if t.name.startswith("pdd-kv-digest")]
    # Hashed a few tokens per pass (a long prompt's bounded temporaries): the same hashes.
    monkeypatch.setattr(kv_digest, "_TOKENS_PER_PASS_BYTES", 8 * HEADS * DIM * 3)
    assert kv_digest.token_hashes(scheduler, req, 3) == inline


def test_every_token_and_every_layer_counts():
    kv = prompt()
    base = kv_digest.token_hashes(*server(kv, list(range(10))))
    for token, layer, kind in [(0, 0, 0), (9, 1, 1), (4, 1, 0)]:
        damaged = kv.clone()
        damaged[token, layer, kind, 1, 2] += 0.5
        hashes = kv_digest.token_hashes(*server(damaged, list(range(10))))
        size = kv_digest.TOKEN_HASH_BYTES
        changed = [i for i in range(10) if hashes[i * size:(i + 1) * size]
                   != base[i * size:(i + 1) * size]]
        assert changed == [token], (token, layer, kind)
    # Swapping two layers' values is damage too (the fold is ordered).
    swapped = kv.clone()
    swapped[:, [0, 1]] = kv[:, [1, 0]]
    assert kv_digest.token_hashes(*server(swapped, list(range(10)))) != base


# ---- at any TP (issue 37): each rank hashes its heads as parts of the whole ---------------------
def rank_server(kv: torch.Tensor, heads: slice, slots: list[int]):
    """A TP rank whose pool holds ``heads`` of every token's KV (SGLang's per-rank pool)."""
    scheduler, req = server(kv, slots)
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    pool.k = [k[:, heads].contiguous() for k in pool.k]
    pool.v = [v[:, heads].contiguous() for v in pool.v]
    return scheduler, req


def part(scheduler, req, heads: kv_digest.RankHeads, start: int = 0) -> bytes:
    pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    slots = kv_digest._slots(scheduler, req, start)
    return kv_digest.token_partial_tensor(pool, slots, heads).numpy().astype("<i8").tobytes()


def test_every_ranks_heads_combine_to_the_hashes_of_tp_1():
    kv = prompt()
    whole = kv_digest.token_hashes(*server(kv, list(range(10))))
    ranks = [rank_server(kv, slice(r, r + 1), [3 * t + r for t in range(10)]) for r in range(2)]
    parts = [part(*ranks[r], kv_digest.RankHeads(first=r, total=HEADS)) for r in range(2)]
    assert kv_digest.combine(parts) == whole == kv_digest.combine(parts[::-1])
    assert kv_digest.combine(parts[:1]) != whole  # one rank's heads are not the whole
    main_from_6 = kv_digest.combine([part(*ranks[r], kv_digest.RankHeads(first=r, total=HEADS),
                                          start=6) for r in range(2)])
    assert kv_digest.range_digest(main_from_6) == kv_digest.range_digest(whole, skip_tokens=6)


def test_replicated_heads_count_once_when_kv_heads_are_fewer_than_ranks():
    """2 KV heads over 4 ranks: ranks 0-1 hold head 0, ranks 2-3 head 1 (SGLang's rule); only
    the first rank of each pair counts, so the parts still add up to the whole."""
    kv = prompt()
    whole = kv_digest.token_hashes(*server(kv, list(range(10))))
    parts = []
    for rank in range(4):
        head = rank // 2
        heads = kv_digest.RankHeads(first=head, total=HEADS, counted=rank % 2 == 0)
        parts.append(part(*rank_server(kv, slice(head, head + 1), list(range(10))), heads))
    assert kv_digest.combine(parts) == whole


def test_one_changed_value_on_one_rank_changes_the_combined_digest():
    kv = prompt()
    ranks = [rank_server(kv, slice(r, r + 1), list(range(10))) for r in range(2)]
    heads = [kv_digest.RankHeads(first=r, total=HEADS) for r in range(2)]
    before = kv_digest.combine([part(*ranks[r], heads[r]) for r in range(2)])
    corrupt_one_value(*ranks[1], 7)
    after = kv_digest.combine([part(*ranks[r], heads[r]) for r in range(2)])
    assert before[:7 * 8] == after[:7 * 8] and before[7 * 8:8 * 8] != after[7 * 8:8 * 8]


def test_a_server_without_a_runtime_hashes_the_whole():
    assert kv_digest.rank_heads(SimpleNamespace()) == kv_digest.RankHeads()


def test_each_rank_knows_its_heads_by_sglangs_rule(monkeypatch):
    import sglang.srt.runtime_context as runtime

    model = SimpleNamespace(model_config=SimpleNamespace(get_total_num_kv_heads=lambda: 2))

    def at(rank, size):
        monkeypatch.setattr(runtime, "get_parallel",
                            lambda: SimpleNamespace(attn_tp_rank=rank, attn_tp_size=size))
        return kv_digest.rank_heads(model)

    assert at(0, 1) == kv_digest.RankHeads()
    assert [at(r, 2) for r in range(2)] == [kv_digest.RankHeads(first=r, total=2) for r in (0, 1)]
    assert [(h.first, h.counted) for h in (at(r, 4) for r in range(4))] == [
        (0, True), (0, False), (1, True), (1, False)]
