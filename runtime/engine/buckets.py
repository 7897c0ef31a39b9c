"""Batch buckets: a decode/verify step padded to a few fixed shapes, so its forward can be compiled
or captured once per shape (``cuda_graphs.py``) instead of traced anew for every batch.

A *bucketed step* holds B sequences padded to the bucket's ``B_pad`` (1, 2, 4, 8, then every 16,
as vLLM and nano-vllm capture), each with exactly Q = 1 + K_max rows: its pending token, its drafts,
then *padding rows* up to the step's most drafts. Padding rows and padding sequences write their
K/V into the null block (``attention.py``) and are never sampled, so the real rows compute exactly
what the unpadded step computes; the verifier sees only the real rows (``sample_rows``).

Every sequence's attention metadata keeps the invariant the kernels rely on — rows at consecutive
positions ending at ``seq_lens[b] − 1`` — so a real sequence's ``seq_lens`` counts its padding
rows, whose keys are read through table entries that are the null block or not yet written; only
padding rows see them. A padding sequence has positions ``0 … Q − 1`` over an all-null table.
"""
from __future__ import annotations

from dataclasses import dataclass

from specdecode.runtime.engine.scheduler import ScheduledSeq

SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16  # buckets above the small ones


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 16, up to the first bucket holding ``max_num_seqs``."""
    buckets = [0]
    while buckets[-1] < max_num_seqs:
        last = buckets[-1]
        buckets.append(next((b for b in SMALL_BUCKETS if b > last), (last // BUCKET_STEP + 1) * BUCKET_STEP))
    return buckets[1:]


def bucket_for(num_seqs: int, buckets: list[int]) -> int:
    """The smallest bucket holding ``num_seqs`` sequences."""
    for bucket in buckets:
        if bucket >= num_seqs:
            return bucket
    raise ValueError(f"{num_seqs} sequences exceed the largest batch bucket ({buckets[-1]})")


def bucketable(scheduled: list[ScheduledSeq], buckets: list[int]) -> bool:
    """A step that pads to a bucket: decode or verify rows only (no prompt chunk, no prompt logprobs),
    no more sequences than the largest bucket."""
    return bool(scheduled) and len(scheduled) <= buckets[-1] and all(
        item.decoding and not item.prompt_logprob_positions for item in scheduled)


@dataclass
class BucketedLists:
    """A bucketed step's inputs as host lists (``ModelRunner.prepare`` makes them ``StepLists``)."""

    tokens: list[int]  # [B_pad · Q]
    sample_rows: list[int]  # [Σ (num_draft + 1)]: the real rows, in scheduled order
    positions: list[int]  # [B_pad · Q]
    slots: list[int]  # [B_pad · Q]
    tables: list[int]  # [B_pad · width], null-padded
    seq_lens: list[int]  # [B_pad]
    starts: list[int]  # [B_pad + 1]
    num_seqs: int  # B_pad
    query_len: int  # Q
    width: int  # blocks per table


def bucketed_lists(scheduled: list[ScheduledSeq], buckets: list[int], block_size: int, null_block: int,
                   max_position: int, min_width: int = 0) -> BucketedLists:
    """The step padded to its bucket (module docstring). ``max_position``: positions are clamped below
    it (a padding row past the model's last position); ``min_width``: the least table width (a
    captured graph's, which every step of its bucket shares)."""
    q_len = 1 + max(item.num_draft for item in scheduled)
    num_seqs = bucket_for(len(scheduled), buckets)
    width = max([min_width] + [max(len(item.seq.block_table), -(-(item.start + q_len) // block_size))
                                for item in scheduled])
    null_slot = null_block * block_size
    out = BucketedLists([], [], [], [], [], [], [0], num_seqs, q_len, width)
    for b, item in enumerate(scheduled):
        seq, real = item.seq, 1 + item.num_draft
        out.tokens += [seq.token_ids[item.start]] + item.draft_token_ids + [0] * (q_len - real)
        out.sample_rows += range(b * q_len, b * q_len + real)
        positions = [min(item.start + j, max_position - 1) for j in range(q_len)]
        out.positions += positions
        out.slots += [seq.block_table[p // block_size] * block_size + p % block_size for p in positions[:real]]
        out.slots += [null_slot] * (q_len - real)
        out.tables += seq.block_table + [null_block] * (width - len(seq.block_table))
        out.seq_lens.append(item.start + q_len)
    for _ in range(num_seqs - len(scheduled)):
        out.tokens += [0] * q_len
        out.positions += range(q_len)
        out.slots += [null_slot] * q_len
        out.tables += [null_block] * width
        out.seq_lens.append(q_len)
    out.starts = [b * q_len for b in range(num_seqs + 1)]
    return out
