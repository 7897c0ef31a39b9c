"""The runtime's CPU attention (``attend_on_cpu``: decode rows and verify chains streamed block
span by block span, prefill chunks gathered for one masked SDPA) equals the kernels' plain-torch
reference, on the kernel tests' batches (blocks scattered through a pool stored KV-head-major, as
``kv_pool`` stores it) and on tables of consecutive blocks (a token-major pool); slots it may not
read change nothing, in the model too."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_kernels_attention import DECODE_BATCHES, PREFILL_BATCHES, Batch, make_batch, poisoned

from specdecode.kernels.paged_attention import paged_attention_reference
from specdecode.runtime.models import attention
from specdecode.runtime.models.attention import AttentionBatch, attend_on_cpu

BATCHES = {**DECODE_BATCHES, **PREFILL_BATCHES}


def cpu_attention(batch: Batch) -> torch.Tensor:
    metadata = AttentionBatch(
        positions=torch.empty(0, dtype=torch.long), slot_mapping=torch.empty(0, dtype=torch.long),
        block_tables=batch.block_tables.long(), seq_lens=batch.seq_lens.long(), query_start=batch.query_start.long(),
        block_size=batch.k_pool.shape[1], max_query_len=batch.max_query_len, hidden_keys=batch.hidden_keys)
    return attend_on_cpu(batch.q, batch.k_pool, batch.v_pool, metadata, batch.scale)


def contiguous(batch: Batch) -> Batch:
    """The batch with each sequence's blocks consecutive in the pool (one run each)."""
    tables, order = batch.block_tables.clone(), []
    for b, length in enumerate(batch.seq_lens.tolist()):
        used = -(-length // batch.k_pool.shape[1])
        order += batch.block_tables[b, :used].tolist()
    remap = {old: new for new, old in enumerate(dict.fromkeys(order), start=1)}
    spare = [b for b in range(batch.k_pool.shape[0]) if b not in remap]
    permutation = torch.tensor([0] + [old for old in remap] + spare[1:])  # new block i holds old block permutation[i]
    for b, length in enumerate(batch.seq_lens.tolist()):
        used = -(-length // batch.k_pool.shape[1])
        tables[b, :used] = torch.tensor([remap[x] for x in batch.block_tables[b, :used].tolist()], dtype=tables.dtype)
    return replace(batch, k_pool=batch.k_pool[permutation], v_pool=batch.v_pool[permutation], block_tables=tables)


@pytest.mark.parametrize("stream_blocks", [2, 16], ids=["streamed", "gathered"])
@pytest.mark.parametrize("name", list(BATCHES))
def test_cpu_attention_equals_the_reference(name: str, stream_blocks: int, monkeypatch) -> None:
    """Decode rows and verify chains streamed in spans of two blocks (or, with spans of 16, each
    group gathered whole), prefill chunks gathered."""
    monkeypatch.setattr(attention, "STREAM_BLOCKS", stream_blocks)
    for batch in (make_batch(7, **BATCHES[name]), contiguous(make_batch(7, **BATCHES[name]))):
        expected = paged_attention_reference(*batch.args(), **batch.kwargs())
        torch.testing.assert_close(cpu_attention(batch), expected, rtol=1e-5, atol=1e-5)


def test_slots_it_may_not_read_change_nothing(monkeypatch) -> None:
    """Garbage in the null block, unreached blocks, stale and hidden slots: the same output, bit for
    bit. Finite garbage: the CPU path gathers whole blocks and masks what it must not see, and what
    a model writes is finite (the kernels load none of it: NaN there too, test_kernels_attention)."""
    monkeypatch.setattr(attention, "STREAM_BLOCKS", 2)  # the decode rows streamed
    batch = make_batch(11, **BATCHES["gqa 6/2 bs16 chunk over prefix"])
    bad = poisoned(batch)
    finite = [torch.where(pool.isfinite(), pool, torch.full_like(pool, 3e4)) for pool in (bad.k_pool, bad.v_pool)]
    bad = replace(bad, k_pool=finite[0], v_pool=finite[1],
                  block_tables=bad.block_tables.clamp(0, batch.k_pool.shape[0] - 1))  # the runtime pads with a real id
    assert torch.equal(cpu_attention(bad), cpu_attention(batch))


@pytest.mark.parametrize("stream_blocks", [3, 16], ids=["streamed", "gathered"])
def test_a_decoding_sequences_table_with_a_verify_chain_and_hidden_keys(stream_blocks: int, monkeypatch) -> None:
    """A decoding sequence's table: its prompt's blocks consecutive, then blocks it took one at a
    time; beside a shorter table; a verify chain and hidden keys across both parts."""
    monkeypatch.setattr(attention, "STREAM_BLOCKS", stream_blocks)
    batch = make_batch(5, [(150, 4), (100, 1)], num_hidden=2)
    tables = torch.tensor([[2, 3, 4, 5, 6, 7, 8, 9, 20, 30], [10, 11, 12, 13, 14, 15, 25, 0, 0, 0]],
                          dtype=batch.block_tables.dtype)
    gen = torch.Generator().manual_seed(3)
    pools = torch.randn(2, 32, *batch.k_pool.shape[1:], generator=gen)
    batch = replace(batch, block_tables=tables, k_pool=pools[0], v_pool=pools[1])
    expected = paged_attention_reference(*batch.args(), **batch.kwargs())
    torch.testing.assert_close(cpu_attention(batch), expected, rtol=1e-5, atol=1e-5)


def test_a_row_that_sees_no_key_is_zero_when_streamed(monkeypatch) -> None:
    monkeypatch.setattr(attention, "STREAM_BLOCKS", 1)
    batch = make_batch(5, [(3, 3), (20, 2)])
    batch = replace(batch, hidden_keys=torch.tensor([[0, -1], [4, 19]]))  # row 0 of sequence 0 sees nothing
    out = cpu_attention(batch)
    assert (out[0] == 0).all() and out.isfinite().all()
    torch.testing.assert_close(out, paged_attention_reference(*batch.args(), **batch.kwargs()), rtol=1e-5, atol=1e-5)


def test_the_model_never_reads_the_null_block_or_blocks_outside_its_tables(tiny) -> None:
    """A step of two sequences over the tiny model, one with a shorter table (padded with the null
    block): garbage in the null block and in every block outside the tables changes no hidden
    state, bit for bit."""
    from specdecode.runtime.engine.model_runner import Span, build_attention_batch
    from specdecode.runtime.models.attention import kv_pool

    model, _ = tiny
    c, num_blocks = model.config, 12
    spans = [Span([3, 4, 9], 0, 40), Span([7], 0, 9)]  # a prompt over three blocks; one over the first block of one
    batch = build_attention_batch(spans, 16, num_blocks, torch.device("cpu"))
    assert batch.block_tables[1].tolist() == [7, num_blocks, num_blocks]
    ids = torch.randint(0, c.vocab_size, (49,), generator=torch.Generator().manual_seed(0))

    def hidden(poison: bool) -> torch.Tensor:
        pools = [kv_pool(num_blocks, 16, c.num_kv_heads, c.head_dim, dtype=torch.float32, device=torch.device("cpu"))
                 for _ in range(c.num_layers)]
        if poison:
            for k, v in pools:
                for block in set(range(num_blocks + 1)) - {3, 4, 9, 7}:
                    k[block], v[block] = 3e4, -3e4
        with torch.inference_mode():
            return model(ids, pools, batch)

    clean, poisoned_run = hidden(False), hidden(True)
    assert poisoned_run.isfinite().all() and torch.equal(poisoned_run, clean)
