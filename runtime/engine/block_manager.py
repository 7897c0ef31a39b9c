"""Paged KV block pool with automatic prefix caching.

Terms:
- *block*: ``block_size`` consecutive token slots of the per-layer KV pools.
- *full block*: all its slots hold computed K/V of final tokens; it gets a *key*: SHA-256 over
  its parent block's key and its own token ids, so the key covers every token before it and
  equal keys mean equal prefixes. A collision-resistant digest, not Python's ``hash()``: with a
  chained non-cryptographic hash one request can craft a prompt whose blocks collide with
  another's and be served its cached K/V (vLLM's CVE-2025-25183).
- *cached block*: a full block whose key is registered; a new sequence whose prompt starts
  with the same tokens reuses it (reference count + 1) instead of recomputing.

Freed blocks keep their key and stay reusable until the pool hands them out again, least
recently freed first (an ordered free list), so the cache costs no capacity.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict

from specdecode.runtime.engine.sequence import Sequence

ROOT_KEY = bytes(32)  # the parent key of a sequence's first block


def chain_hash(parent: bytes | None, tokens: tuple[int, ...]) -> bytes:
    """The 32-byte key of a full block: SHA-256(parent key or ROOT_KEY ‖ token ids as int64 little-endian)."""
    ids = array("q", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return hashlib.sha256((parent or ROOT_KEY) + ids.tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # key → block id
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached full-block prefix, leaving ≥1 token to compute."""
        if not self.enable_prefix_caching:
            return []
        matched: list[int] = []
        parent = None
        usable = (len(token_ids) - 1) // self.block_size
        for i in range(usable):
            tokens = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            block = self.cached.get(h)
            if block is None or self.block_tokens[block] != tokens:
                break
            matched.append(block)
            parent = h
        return matched

    def admit(self, seq: Sequence, prefix_blocks: list[int], num_new_tokens: int) -> bool:
        """Give a waiting sequence its cached prefix plus room for ``num_new_tokens`` more."""
        num_cached = len(prefix_blocks) * self.block_size
        needed = self.blocks_for(num_cached + num_new_tokens) - len(prefix_blocks)
        reusable_free = sum(1 for b in prefix_blocks if self.ref_counts[b] == 0)
        if needed > len(self.free) - reusable_free:
            return False
        for block in prefix_blocks:
            self._take(block)
        seq.block_table = list(prefix_blocks)
        seq.num_computed_tokens = num_cached
        seq.num_cached_prefix_tokens = num_cached
        return self.grow(seq, num_cached + num_new_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make the block table cover ``num_tokens`` slots; False (and no change) if the pool is short."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed > len(self.free):
            return False
        for _ in range(needed):
            block = next(iter(self.free))
            self._forget_hash(block)
            self._take(block)
            seq.block_table.append(block)
        return True

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Key every block of ``seq`` that became full of computed tokens (prefix-cache them)."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        for i in range(num_full):
            block = seq.block_table[i]
            if self.block_hash[block] is not None:
                continue
            parent = self.block_hash[seq.block_table[i - 1]] if i else None
            tokens = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            h = chain_hash(parent, tokens)
            self.block_hash[block] = h
            self.block_tokens[block] = tokens
            self.cached.setdefault(h, block)

    def release(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; blocks nobody holds go to the free list, key kept."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free[block] = None
        seq.block_table = []
        seq.num_computed_tokens = 0

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def _forget_hash(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None and self.cached.get(h) == block:
            del self.cached[h]
        self.block_hash[block] = None
        self.block_tokens[block] = None
