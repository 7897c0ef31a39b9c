"""Suffix proposer (SuffixDecoding / ArcticInference style): frequency-scored, variable-length
drafts from depth-capped suffix tries over the sequence's own tokens and recent outputs.

Terms, used with these meanings below:

- *suffix trie*: a trie of every substring of at most ``max_depth`` tokens of the texts it
  indexes. A node's ``count`` is how often its path occurs; its ``cont`` is how many of those
  occurrences are followed by another token (the sum of its children's counts).
- *empirical probability* of a child: ``child.count / node.cont``, the share of the node's
  continuations that take this child.
- *own trie*: one per live sequence, over its prompt + generated tokens, extended as tokens are
  appended (keyed by ``seq_id``; rebuilt if the token list is ever shorter than what was indexed).
- *cache trie*: one for the server, over the generated tokens of the last ``max_cached_requests``
  finished sequences; the oldest output is removed first.
- *match*: the longest suffix of the sequence's tokens, at most ``max_depth - k`` tokens so that
  ``k`` drafts fit under the depth cap, whose node has a continuation (``cont > 0``).
- *draft*: from the match, repeatedly take the most frequent child (ties: the one seen first)
  while the running product of empirical probabilities stays ≥ ``min_token_prob``, at most ``k``.

Which trie wins: the one with the longer match; on a tie the sequence's own trie, whose text is
the better predictor of itself. The loser is not consulted even if the winner drafts nothing.

Memory: a substring seen once is not a chain of nodes but a *tail*, a reference into its text
(path compression, as a suffix tree's leaves), so text that does not repeat costs a few objects
per token instead of ``max_depth``; never more than ``max_depth`` per token. Own tries are
dropped in ``finished``; the cache trie holds at most ``max_cached_requests`` outputs.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from specdecode.runtime.engine.sequence import Sequence
from specdecode.runtime.proposers import Proposal, Proposer
from specdecode.runtime.proposers.drafting import Guides


class _Node:
    """A substring seen more than once (or once, after an eviction): counts kept explicitly."""

    __slots__ = ("children", "count", "cont")

    def __init__(self, count: int = 0) -> None:
        self.children: dict[int, _Node | _Tail] = {}
        self.count = count
        self.cont = 0


class _Tail:
    """A substring seen once, with the chain below it kept as a reference into its text: the
    chain goes on with ``text[start:]`` for at most ``room`` tokens, count 1 all the way."""

    __slots__ = ("text", "start", "room")
    count = 1

    def __init__(self, text: list[int], start: int, room: int) -> None:
        self.text, self.start, self.room = text, start, room

    def next_token(self, offset: int) -> int | None:
        """The token after ``offset`` tokens of the chain, or None where it ends."""
        i = self.start + offset
        return self.text[i] if offset < self.room and i < len(self.text) else None


Position = tuple[_Node | _Tail, int]  # a node, and how far down a tail's chain (0 for a node)


class SuffixTrie:
    """Every substring of at most ``max_depth`` tokens of the indexed texts, with counts.

    A *cursor* lists the explicit nodes of the current text's suffixes by length (0 = the root):
    appending a token moves each one step down. Longer suffixes occur only at the end of the
    text, inside tails, and need no work. The indexed texts must not change (they may grow).
    """

    def __init__(self, max_depth: int):
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 1  # nodes and tails

    def cursor(self) -> list[_Node]:
        return [self.root]

    def extend(self, cursor: list[_Node], text: list[int], start: int) -> list[_Node]:
        """Index ``text[start:]``, appended to ``text[:start]`` whose cursor is ``cursor``; the new cursor."""
        keep = self.max_depth - 1  # a node this deep has no room for a child under the cap
        for j in range(start, len(text)):
            t = text[j]
            moved = [self.root]
            for depth, node in enumerate(cursor):
                node.cont += 1
                child = node.children.get(t)
                if child is None:  # first occurrence: a tail that follows this text
                    node.children[t] = _Tail(text, j + 1, keep - depth)
                    self.num_nodes += 1
                    continue
                if type(child) is _Tail:  # second occurrence: make it explicit
                    child = node.children[t] = self._split(child)
                child.count += 1
                if depth < keep:
                    moved.append(child)
            cursor = moved
        return cursor

    def _split(self, tail: _Tail) -> _Node:
        node = _Node(count=1)
        token = tail.next_token(0)
        if token is not None:
            node.cont = 1
            node.children[token] = _Tail(tail.text, tail.start + 1, tail.room - 1)
            self.num_nodes += 1
        return node

    def remove(self, text: list[int]) -> None:
        """Un-index a text indexed by ``extend(cursor(), text, 0)``; what only it held goes.

        A node whose count drops to 0 is unlinked but keeps its children, so the walk continues
        through it and unlinks (and counts) its subtree, all of which occurred only in this text.
        """
        keep = self.max_depth - 1
        cursor = [self.root]
        for t in text:
            moved = [self.root]
            for depth, node in enumerate(cursor):
                node.cont -= 1
                child = node.children[t]
                if type(child) is _Tail:  # count 1: this text's own occurrence
                    del node.children[t]
                    self.num_nodes -= 1
                    continue
                child.count -= 1
                if child.count == 0:
                    del node.children[t]
                    self.num_nodes -= 1
                if depth < keep:
                    moved.append(child)
            cursor = moved

    def match(self, tokens: list[int], max_len: int) -> tuple[int, Position | None]:
        """The longest suffix of ``tokens`` (1..max_len long) with a continuation, and where it ends.

        Binary search: the trie holds every substring of what it holds, so if a suffix has a
        continuation, each shorter suffix has the same one.
        """
        lo, hi, best = 1, min(max_len, len(tokens), self.max_depth - 1), None
        while lo <= hi:
            mid = (lo + hi) // 2
            pos = self._find(tokens[len(tokens) - mid :])
            if pos is not None and _continues(pos):
                lo, best = mid + 1, (mid, pos)
            else:
                hi = mid - 1
        return best or (0, None)

    def _find(self, path: list[int]) -> Position | None:
        node, offset = self.root, 0
        for t in path:
            if type(node) is _Tail:
                if node.next_token(offset) != t:
                    return None
                offset += 1
            else:
                node = node.children.get(t)
                if node is None:
                    return None
        return node, offset


def _continues(pos: Position) -> bool:
    node, offset = pos
    return node.next_token(offset) is not None if type(node) is _Tail else node.cont > 0


def draft(pos: Position, k: int, min_prob: float) -> list[int]:
    """Most frequent continuation from ``pos`` while the product of empirical probabilities ≥ ``min_prob``."""
    tokens: list[int] = []
    prob = 1.0
    node, offset = pos
    while len(tokens) < k:
        if type(node) is _Tail:  # one continuation, probability 1
            token = node.next_token(offset)
            if token is None:
                break
            offset += 1
        else:
            if node.cont == 0:
                break
            token, child = max(node.children.items(), key=lambda item: item[1].count)
            prob *= child.count / node.cont
            if prob < min_prob:
                break
            node = child
        tokens.append(token)
    return tokens


@dataclass
class _OwnIndex:
    trie: SuffixTrie
    cursor: list[_Node]
    text: list[int] = field(default_factory=list)  # the tokens indexed so far (tails point into it)


class SuffixProposer(Proposer):
    def __init__(self, max_depth: int, max_cached_requests: int, min_token_prob: float):
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.min_token_prob = min_token_prob
        self.cache = SuffixTrie(max_depth)
        self.cached_outputs: deque[list[int]] = deque()  # oldest first
        self.own: dict[int, _OwnIndex] = {}  # by seq_id

    def propose(self, seqs: list[Sequence], max_drafts: list[int], guides: Guides | None = None) -> Proposal:
        return Proposal([self._propose_one(seq, k, guides.forced(i) if guides is not None else [])
                         for i, (seq, k) in enumerate(zip(seqs, max_drafts))])

    def finished(self, seq: Sequence) -> None:
        """Drop the sequence's own trie; its generated tokens join the cache trie."""
        self.own.pop(seq.seq_id, None)
        output = seq.output_token_ids
        if self.max_cached_requests == 0 or not output:
            return
        self.cache.extend(self.cache.cursor(), output, 0)
        self.cached_outputs.append(output)
        while len(self.cached_outputs) > self.max_cached_requests:
            self.cache.remove(self.cached_outputs.popleft())

    def _propose_one(self, seq: Sequence, k: int, forced: list[int]) -> list[int]:
        """``forced`` first, then what followed the longest match of the sequence's tokens followed
        by them (the forced tokens are matched, never indexed: they may yet be rejected)."""
        k_own = k - len(forced)
        if k_own <= 0:
            return forced[:k]
        own = self._index(seq)
        max_len = max(1, self.max_depth - k_own)
        context = seq.token_ids + forced
        own_len, own_pos = own.trie.match(context, max_len) if forced else self._own_match(own, max_len)
        cache_len, cache_pos = self.cache.match(context, max_len)
        pos = own_pos if own_len >= cache_len else cache_pos
        return forced + ([] if pos is None else draft(pos, k_own, self.min_token_prob))

    def _index(self, seq: Sequence) -> _OwnIndex:
        """The sequence's own trie, extended by the tokens appended since the last call."""
        own = self.own.get(seq.seq_id)
        if own is None or len(seq) < len(own.text):  # new, or its tokens shrank: start over
            trie = SuffixTrie(self.max_depth)
            own = self.own[seq.seq_id] = _OwnIndex(trie, trie.cursor())
        start = len(own.text)
        own.text += seq.token_ids[start:]
        own.cursor = own.trie.extend(own.cursor, own.text, start)
        return own

    @staticmethod
    def _own_match(own: _OwnIndex, max_len: int) -> tuple[int, Position | None]:
        """Longest suffix with a continuation: the cursor holds every suffix that occurred before."""
        for length in range(min(max_len, len(own.cursor) - 1), 0, -1):
            if own.cursor[length].cont > 0:
                return length, (own.cursor[length], 0)
        return 0, None
