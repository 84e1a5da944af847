"""The router's estimate of one main server's radix cache: a token-level radix tree with LRU eviction.

SGLang exposes no "how much of this prompt do you hold" endpoint, so the router mirrors what it
sent: every prompt plus its output (the KV a main server keeps after a request finishes) goes into
the main's mirror. It is an *estimate*, and knows it:
  - main may evict earlier (its KV pool is shared with running requests) or later than the mirror;
  - requests that reached main without the router are invisible.
Two things keep it honest: the mirror's budget defaults to main's KV pool size, and each answer's
``cached_tokens`` (main's real prefix hit) corrects it: a shorter hit than predicted means main
evicted below that depth, so the mirror drops that branch too (``observe_hit``).
"""

from __future__ import annotations

import heapq
import itertools
from typing import Optional, Sequence

EVICT_TO_FRACTION = 0.9


class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: tuple, parent: Optional["_Node"], stamp: int):
        self.key = key  # the tokens on the edge from parent to this node
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = stamp


def _common_length(a: Sequence[int], b: Sequence[int], start: int) -> int:
    """Length of the common prefix of a and b[start:]."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


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
    def match_length(self, tokens: Sequence[int], touch: bool = False) -> int:
        """How many leading tokens of ``tokens`` the mirror holds."""
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
    def insert(self, tokens: Sequence[int]) -> None:
        """Record that main now holds KV for ``tokens`` (and so for each of its prefixes)."""
        tokens = tuple(tokens)
        stamp = next(self._clock)
        node, depth = self._root, 0
        while depth < len(tokens):
            child = node.children.get(tokens[depth])
            if child is None:
                leaf = _Node(tokens[depth:], node, stamp)
                node.children[tokens[depth]] = leaf
                self.total_tokens += len(leaf.key)
                break
            common = _common_length(child.key, tokens, depth)
            if common < len(child.key):
                child = self._split(child, common)
            child.last_access = stamp
            node, depth = child, depth + common
        if self.total_tokens > self.max_tokens:
            # Evict a little below the budget: each eviction scans the leaves, so do it rarely.
            self._evict(self.total_tokens - int(self.max_tokens * EVICT_TO_FRACTION))

    def observe_hit(self, prompt: Sequence[int], cached_tokens: int) -> None:
        """Correct the mirror with main's real prefix hit for ``prompt``.

        SGLang's radix cache evicts leaves first, so a hit shorter than the mirror's match means
        the whole subtree below that depth is gone from main: drop it here too.
        """
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
            removed += len(current.key)
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
            freed += len(leaf.key)
            self.total_tokens -= len(leaf.key)
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
