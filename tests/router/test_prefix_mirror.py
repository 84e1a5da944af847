"""The router's mirror of a main's radix cache: matching, splitting, LRU eviction, correction."""

from __future__ import annotations

import random

import pytest

from pdd_sglang.router.prefix_mirror import PrefixMirror


def test_match_follows_inserted_prefixes_and_splits_edges():
    m = PrefixMirror(1000)
    m.insert([1, 2, 3, 4, 5])
    assert m.match_length([1, 2, 3, 4, 5, 6]) == 5
    assert m.match_length([1, 2, 9]) == 2
    assert m.match_length([7]) == 0
    m.insert([1, 2, 9, 9])  # splits the edge after [1, 2]
    assert m.match_length([1, 2, 9, 9, 1]) == 4
    assert m.match_length([1, 2, 3, 4, 5]) == 5
    assert m.total_tokens == 7  # 1 2 | 3 4 5 | 9 9


def test_matches_a_brute_force_model_on_random_sequences():
    rng = random.Random(7)
    m = PrefixMirror(10**9)
    seqs = []
    for _ in range(300):
        base = rng.choice(seqs) if seqs and rng.random() < 0.7 else []
        seq = base[: rng.randint(0, len(base))] + [rng.randint(0, 3) for _ in range(rng.randint(1, 8))]
        m.insert(seq)
        seqs.append(seq)
    for _ in range(300):
        probe = [rng.randint(0, 3) for _ in range(rng.randint(1, 12))]
        best = max(next((i for i, (a, b) in enumerate(zip(s, probe)) if a != b), min(len(s), len(probe)))
                   for s in seqs)
        assert m.match_length(probe) == best, probe


def test_lru_eviction_keeps_the_recent_and_respects_the_budget():
    m = PrefixMirror(100)
    m.insert(list(range(0, 40)))          # conversation A
    m.insert(list(range(1000, 1040)))     # conversation B
    m.match_length(list(range(0, 40)), touch=True)  # A used again: B is now the oldest
    m.insert(list(range(2000, 2040)))     # over budget: B goes
    assert m.total_tokens <= 100
    assert m.match_length(list(range(0, 40))) == 40
    assert m.match_length(list(range(2000, 2040))) == 40
    assert m.match_length(list(range(1000, 1040))) == 0


def test_eviction_removes_leaves_before_their_shared_prefix():
    m = PrefixMirror(60)
    shared = list(range(30))
    m.insert(shared + [100] * 20)
    m.insert(shared + [200] * 20)  # 70 tokens > 60: the older branch goes, the shared part stays
    assert m.match_length(shared + [200] * 20) == 50
    assert m.match_length(shared + [100] * 20) == 30


def test_observe_hit_drops_what_main_no_longer_holds():
    m = PrefixMirror(1000)
    m.insert(list(range(50)))
    m.insert(list(range(30)) + [999, 998])
    # Main reports only 20 cached tokens: everything below depth 20 on this path is gone.
    m.observe_hit(list(range(50)), 20)
    assert m.match_length(list(range(50))) == 20
    assert m.match_length(list(range(30)) + [999]) == 20
    assert m.total_tokens == 20
    m.observe_hit(list(range(50)), 40)  # a longer hit than predicted changes nothing
    assert m.match_length(list(range(50))) == 20


def test_budget_must_be_positive():
    with pytest.raises(ValueError):
        PrefixMirror(0)


def test_text_keys_match_by_characters_beside_token_keys():
    mirror = PrefixMirror(10**6)
    mirror.insert("system: be brief\nuser: hello")
    mirror.insert([5, 6, 7])
    assert mirror.match_length("system: be brief\nuser: hello again") == 28
    assert mirror.match_length("system: be terse") == len("system: be ")  # inside an edge
    assert mirror.match_length("another") == 0
    assert mirror.match_length([5, 6, 9]) == 2  # a text never matches ids, nor the reverse
    mirror.observe_hit("system: be brief\nuser: hello", 10)  # main evicted below 10 characters
    assert mirror.match_length("system: be brief\nuser: hello") == 10


def test_a_character_takes_a_quarter_of_a_token_of_the_budget():
    mirror = PrefixMirror(100)
    mirror.insert("a" * 400)  # 100 tokens' worth
    assert mirror.match_length("a" * 400) == 400
    mirror.insert("b" * 40)  # past the budget: the least recently used leaf goes
    assert mirror.match_length("a" * 400) == 0 and mirror.match_length("b" * 40) == 40
