"""The router's estimate of one main server's radix cache: a radix tree with LRU eviction, over
the prompts' keys (:attr:`pdd_sglang.router.prompt.Prompt.key`: a text prompt's characters, as
sglang-router's cache-aware tree keeps them, or a tuple of token ids).

SGLang exposes no "how much of this prompt do you hold" endpoint, so the router mirrors what it
sent: every prompt plus its output (the KV a main server keeps after a request finishes) goes into
the main's mirror. It is an *estimate*, and knows it:
  - main may evict earlier (its KV pool is shared with running requests) or later than the mirror;
  - requests that reached main without the router are invisible.
Two things keep it honest: the mirror's budget defaults to main's KV pool size, and each answer's
``cached_tokens`` (main's real prefix hit) corrects it: a shorter hit than predicted means main
evicted below that depth, so the mirror drops that branch too (``observe_hit``). Lengths are in
key units (characters or tokens); the budget counts a character as TOKENS_PER_CHAR of a token.

Owner: the router's event loop (one mirror per main; placement reads it, and every write goes
through router/shared_state.py's SharedState, so every ``--workers`` process holds the same).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional, Sequence

from pdd_sglang.router.prompt import as_key

EVICT_TO_FRACTION = 0.9
TOKENS_PER_CHAR = 0.25  # a character's share of the token budget (a typical text's)


def _cost(key) -> float:
    """Budget taken by an edge: a token each, or a character's share of one."""
    return len(key) * TOKENS_PER_CHAR if isinstance(key, str) else len(key)


class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: tuple, parent: Optional["_Node"], stamp: int):
        self.key = key  # the tokens on the edge from parent to this node
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = stamp


def _common_length(a, b, start: int) -> int:
    """Length of the common prefix of a and b[start:] (both str, or both tuples): one C-speed
    comparison when the whole edge matches, else a binary search over prefix comparisons."""
    n = min(len(a), len(b) - start)
    if b[start:start + n] == a[:n]:
        return n
    low, high = 0, n - 1  # a[:low] matches; a[:high + 1] does not
    while low < high:
        mid = (low + high + 1) // 2
        if b[start:start + mid] == a[:mid]:
            low = mid
        else:
            high = mid - 1
    return low


class PrefixMirror:
    """Radix tree of token sequences with a token budget; least recently used leaves go first."""

    def __init__(self, max_tokens: int):
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self._clock = itertools.count(1)
        self._root = _Node((), None, 0)
        self.total_tokens = 0

    # ---- queries ------------------------------------------------------------------------
    def match_length(self, tokens: Sequence, touch: bool = False) -> int:
        """How many leading units of ``tokens`` (a key) the mirror holds."""
        tokens = as_key(tokens)
        node, depth = self._root, 0
        stamp = next(self._clock) if touch else None
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                break
            common = _common_length(child.key, tokens, depth)
            depth += common
            if stamp is not None:
                child.last_access = stamp
            if common < len(child.key):
                break
            node = child
        return depth

    # ---- updates ------------------------------------------------------------------------
    def insert(self, tokens: Sequence) -> None:
        """Record that main now holds KV for ``tokens`` (and so for each of its prefixes)."""
        tokens = as_key(tokens)
        stamp = next(self._clock)
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(tokens[depth:], node, stamp)
                node.children[tokens[depth]] = leaf
                self.total_tokens += _cost(leaf.key)
                break
            common = _common_length(child.key, tokens, depth)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = stamp
            node, depth = child, depth + common
        if self.total_tokens > self.max_tokens:
            # Evict a little below the budget: each eviction scans the leaves, so do it rarely.
            self._evict(self.total_tokens - int(self.max_tokens * EVICT_TO_FRACTION))

    def observe_hit(self, prompt: Sequence, cached_tokens: int) -> None:
        """Correct the mirror with main's real prefix hit for ``prompt``.

        SGLang's radix cache evicts leaves first, so a hit shorter than the mirror's match means
        the whole subtree below that depth is gone from main: drop it here too.
        """
        prompt = as_key(prompt)
        if cached_tokens >= self.match_length(prompt):
            return
        node, depth = self._root, 0
        while depth < cached_tokens:
            child = node.children[prompt[depth]]
            if depth + len(child.key) > cached_tokens:
                child = self._split(child, cached_tokens - depth)
            node, depth = child, depth + len(child.key)
        nxt = node.children.get(prompt[cached_tokens]) if cached_tokens < len(prompt) else None
        if nxt is not None:
            self._remove_subtree(nxt)

    def clear(self) -> None:
        self._root = _Node((), None, 0)
        self.total_tokens = 0

    # ---- internals ----------------------------------------------------------------------
    def _split(self, child: _Node, at: int) -> _Node:
        """Split child's edge after ``at`` tokens; return the new upper node."""
        parent = child.parent
        upper = _Node(child.key[:at], parent, child.last_access)
        parent.children[upper.key[0]] = upper
        child.key = child.key[at:]
        child.parent = upper
        upper.children[child.key[0]] = child
        return upper

    def _remove_subtree(self, node: _Node) -> None:
        stack, removed = [node], 0
        while stack:
            current = stack.pop()
            removed += _cost(current.key)
            stack.extend(current.children.values())
        del node.parent.children[node.key[0]]
        self.total_tokens -= removed

    def _evict(self, tokens_to_free: int) -> None:
        leaves = [(n.last_access, id(n), n) for n in self._leaves()]
        heapq.heapify(leaves)
        freed = 0
        while freed < tokens_to_free and leaves:
            _, _, leaf = heapq.heappop(leaves)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed += _cost(leaf.key)
            self.total_tokens -= _cost(leaf.key)
            if parent is not self._root and not parent.children:
                heapq.heappush(leaves, (parent.last_access, id(parent), parent))

    def _leaves(self):
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            else:
                yield node
