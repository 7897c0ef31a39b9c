"""Paged attention kernels: Triton (under TRITON_INTERPRET=1, set in conftest.py) equals the torch
reference, the reference equals gather + masked SDPA (what runtime/models/attention.py does today), and
no path reads a slot it must not: the null block, padding table entries, blocks no table reaches,
stale slots past a sequence's length and hidden keys may hold NaN/inf without changing anything."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from specdecode.kernels import paged_attention as pa

NULL_BLOCK = 0  # the reserved block that padding table entries point at


# ---------------------------------------------------------------- batches


@dataclass(frozen=True)
class Batch:
    """One step's attention inputs; ``args()`` are the positional arguments every path takes."""

    q: torch.Tensor  # [T, num_heads, head_dim], a view of a wider qkv row (as the model slices it)
    k_pool: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    v_pool: torch.Tensor  # [num_blocks, block_size, kv_heads, head_dim]
    block_tables: torch.Tensor  # [B, max_blocks], padded with NULL_BLOCK
    seq_lens: torch.Tensor  # [B]
    query_start: torch.Tensor  # [B+1]
    hidden_keys: torch.Tensor | None  # [B, H] int64, -1 padded
    max_query_len: int
    scale: float

    def args(self) -> tuple:
        return (self.q, self.k_pool, self.v_pool, self.block_tables, self.seq_lens, self.query_start, self.hidden_keys)

    def kwargs(self) -> dict:
        return {"scale": self.scale, "max_query_len": self.max_query_len}


def make_batch(
    seed: int,
    seqs: list[tuple[int, int]],  # (seq_len, query rows) per sequence
    *,
    block_size: int = 16,
    num_heads: int = 6,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    shared_prefix_blocks: int = 0,  # sequences 0 and 1 share their first blocks (a cached common prefix)
    num_hidden: int = 0,  # up to this many hidden keys per sequence (one inside its query chain if it can)
    spare_blocks: int = 3,  # pool blocks no table reaches
    index_dtype: torch.dtype = torch.int32,
    device: str | torch.device = "cpu",
) -> Batch:
    """Random finite pool and queries; each sequence's blocks are scattered through the pool."""
    gen = torch.Generator().manual_seed(seed)
    own = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]  # [B] blocks per sequence
    if shared_prefix_blocks:
        assert shared_prefix_blocks * block_size <= min(seqs[0][0], seqs[1][0]), "shared blocks must be full"
        own[1] -= shared_prefix_blocks
    num_blocks = 1 + sum(own) + spare_blocks
    ids = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()  # NULL_BLOCK is never handed out
    tables = []
    for b, n in enumerate(own):
        tables.append(([] if b != 1 or not shared_prefix_blocks else tables[0][:shared_prefix_blocks]) + ids[:n])
        ids = ids[n:]
    width = max(len(t) for t in tables) + 1  # every row has padding
    block_tables = torch.tensor([t + [NULL_BLOCK] * (width - len(t)) for t in tables], dtype=index_dtype)

    rows = [n for _, n in seqs]
    T = sum(rows)
    qkv = torch.randn(T, num_heads + 2 * kv_heads, head_dim, generator=gen)  # q is its first heads: strided rows
    # stored KV-head-major and viewed [blocks, block_size, kv_heads, head_dim], as kv_pool stores it
    pool = torch.randn(2, kv_heads, num_blocks, block_size, head_dim, generator=gen).permute(0, 2, 3, 1, 4)
    hidden_keys = None
    if num_hidden:
        hidden = []
        for seq_len, n in seqs:
            count = int(torch.randint(0, num_hidden + 1, (), generator=gen))
            chain = [max(1, seq_len - n) + int(torch.randint(0, n, (), generator=gen))] if seq_len > 1 else []
            anywhere = (1 + torch.randint(0, max(seq_len - 1, 1), (num_hidden,), generator=gen)).tolist()
            keys = [k for k in chain + anywhere if k < seq_len][:count]  # never position 0: every row sees a key
            hidden.append(keys + [-1] * (num_hidden - len(keys)))
        hidden_keys = torch.tensor(hidden, dtype=torch.long, device=device)
    return Batch(
        q=qkv.to(device, dtype)[:, :num_heads],
        k_pool=pool[0].to(device, dtype),
        v_pool=pool[1].to(device, dtype),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor([s for s, _ in seqs], dtype=index_dtype, device=device),
        query_start=torch.tensor([0] + rows, dtype=index_dtype, device=device).cumsum(0).to(index_dtype),
        hidden_keys=hidden_keys,
        max_query_len=max(rows),
        scale=head_dim**-0.5,
    )


def poisoned(batch: Batch) -> Batch:
    """The batch with NaN/inf in every slot no sequence may read (the null block, blocks no table
    reaches, stale slots past seq_len, hidden keys) and garbage block ids in the tables' padding."""
    block_size = batch.k_pool.shape[1]
    readable = torch.zeros(batch.k_pool.shape[:2], dtype=torch.bool, device=batch.k_pool.device)
    tables = batch.block_tables.clone()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        keys = torch.arange(seq_len, device=readable.device)
        if batch.hidden_keys is not None:
            keys = keys[~torch.isin(keys, batch.hidden_keys[b])]
        readable[batch.block_tables[b].long()[keys // block_size], keys % block_size] = True
        used = math.ceil(seq_len / block_size)
        tables[b, used:] = torch.tensor([NULL_BLOCK, 10**9, -7], dtype=tables.dtype)[b % 3]
    garbage = torch.tensor([float("nan"), float("inf"), float("-inf")], device=readable.device)
    garbage = garbage[torch.arange(batch.k_pool[..., 0].numel(), device=readable.device) % 3]
    # [num_blocks, block_size, kv_heads, 1]
    garbage = garbage.view(batch.k_pool.shape[:3])[..., None].to(batch.k_pool.dtype)
    unread = ~readable[..., None, None]
    assert not readable[NULL_BLOCK].any()
    return replace(
        batch,
        k_pool=torch.where(unread, garbage, batch.k_pool),
        v_pool=torch.where(unread, garbage.flip(0), batch.v_pool),
        block_tables=tables,
    )


def _close(out: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    tol = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[expected.dtype]
    assert out.dtype == expected.dtype and out.shape == expected.shape, what
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _kernels(batch: Batch) -> dict[str, torch.Tensor]:
    """Every Triton path that accepts the batch, with default and small tiles."""
    args, kwargs = batch.args(), batch.kwargs()
    outs = {
        "prefill": pa.paged_prefill_attention_triton(*args, **kwargs),
        "prefill block_m=16 block_n=16": pa.paged_prefill_attention_triton(*args, **kwargs, block_m=16, block_n=16),
    }
    if batch.max_query_len <= pa.MAX_DECODE_QUERY_LEN:
        outs["decode"] = pa.paged_decode_attention_triton(*args, **kwargs)
        outs["decode block_n=16"] = pa.paged_decode_attention_triton(*args, **kwargs, block_n=16)
    return outs


def _dense_sdpa(batch: Batch) -> torch.Tensor:  # [T, num_heads, head_dim] fp32
    """Today's attention (runtime/models/attention.py): gather every sequence's whole block table,
    pad the queries, one SDPA call with an explicit boolean mask."""
    B, max_blocks = batch.block_tables.shape
    _, block_size, kv_heads, head_dim = batch.k_pool.shape
    num_heads = batch.q.shape[1]
    starts, lens = batch.query_start.tolist(), batch.seq_lens.tolist()
    Q = batch.max_query_len
    qd = batch.q.new_zeros(B, Q, num_heads, head_dim, dtype=torch.float32)
    positions = torch.zeros(B, Q, dtype=torch.long)  # padded rows: position 0, they see key 0
    for b in range(B):
        n = starts[b + 1] - starts[b]
        qd[b, :n] = batch.q[starts[b] : starts[b + 1]].float()
        positions[b, :n] = torch.arange(lens[b] - n, lens[b])
    blocks = batch.block_tables.long().view(-1)
    kd = batch.k_pool.index_select(0, blocks).view(B, -1, kv_heads, head_dim).transpose(1, 2).float()  # [B, kv, L, hd]
    vd = batch.v_pool.index_select(0, blocks).view(B, -1, kv_heads, head_dim).transpose(1, 2).float()
    keys = torch.arange(max_blocks * block_size)  # [L]
    mask = keys[None, None, :] <= positions[:, :, None]  # [B, Q, L]
    if batch.hidden_keys is not None:
        mask &= ~(keys[None, :, None] == batch.hidden_keys[:, None, :]).any(-1)[:, None, :]
    out = F.scaled_dot_product_attention(
        qd.transpose(1, 2), kd, vd, attn_mask=mask[:, None], scale=batch.scale, enable_gqa=num_heads != kv_heads
    ).transpose(1, 2)  # [B, Q, num_heads, head_dim]
    return torch.cat([out[b, : starts[b + 1] - starts[b]] for b in range(B)])


# ---------------------------------------------------------------- the reference equals gather + SDPA


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reference_equals_dense_sdpa(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    for heads, kv_heads, block_size in ((6, 2, 16), (4, 4, 8), (8, 1, 32)):
        B = int(torch.randint(2, 7, (), generator=gen))
        rows = torch.randint(1, 20, (B,), generator=gen).tolist()
        prefix = torch.randint(0, 60, (B,), generator=gen).tolist()
        seqs = [(p + n, n) for p, n in zip(prefix, rows)]
        seqs[0] = seqs[1] = (70, seqs[1][1])  # long enough to share two full blocks
        batch = make_batch(
            seed, seqs, block_size=block_size, num_heads=heads, kv_heads=kv_heads,
            shared_prefix_blocks=2, num_hidden=3 if seed else 0, index_dtype=torch.int64,
        )
        _close(pa.paged_attention_reference(*batch.args(), **batch.kwargs()), _dense_sdpa(batch), f"{heads}/{kv_heads}")


# ---------------------------------------------------------------- Triton == reference

MHA = dict(num_heads=4, kv_heads=4)
DECODE_BATCHES = {  # make_batch arguments (default: 6 heads / 2 kv heads, head_dim 16, block_size 16)
    # K+1 = 4 verify chains mixed with decode rows; sequences 0 and 1 share two blocks; partial last blocks
    "gqa 6/2 bs16 shared prefix": dict(seqs=[(37, 4), (41, 1), (64, 4), (18, 1), (1, 1), (16, 2)],
                                       shared_prefix_blocks=2),
    "mha 4/4 bs8 hidden": dict(seqs=[(29, 4), (9, 1), (3, 3), (40, 4)], block_size=8, **MHA, num_hidden=3),
    "gqa 6/2 bs32 hidden int64": dict(seqs=[(70, 4), (33, 1), (31, 2)], block_size=32, num_hidden=2,
                                      index_dtype=torch.int64),
    "mqa 4/1 head_dim 24 chain 16": dict(seqs=[(50, 16), (17, 1), (16, 5)], num_heads=4, kv_heads=1, head_dim=24,
                                         num_hidden=2),
}

PREFILL_BATCHES = {
    # a 48-row chunk over a 40-token cached prefix, with decode rows, a verify chain and a whole prompt
    "gqa 6/2 bs16 chunk over prefix": dict(seqs=[(88, 48), (3, 1), (20, 4), (17, 17)]),
    "mha 4/4 bs8 hidden chunks": dict(seqs=[(60, 35), (9, 1), (30, 30)], block_size=8, **MHA, num_hidden=3),
    "gqa 6/2 bs32 shared prefix int64": dict(seqs=[(90, 50), (70, 20), (5, 2)], block_size=32, shared_prefix_blocks=2,
                                             num_hidden=2, index_dtype=torch.int64),
}


@pytest.mark.parametrize("name", list(DECODE_BATCHES) + list(PREFILL_BATCHES))
def test_kernels_equal_reference(name):
    batch = make_batch(7, **{**DECODE_BATCHES, **PREFILL_BATCHES}[name])
    expected = pa.paged_attention_reference(*batch.args(), **batch.kwargs())
    for path, out in _kernels(batch).items():
        _close(out, expected, path)


def test_fp16_kernels_equal_reference():
    """bf16 runs on the GPU only (tests/test_cuda.py): the interpreter's tl.dot multiplies bf16 bit
    patterns (triton-lang/triton#11584)."""
    batch = make_batch(3, [(40, 4), (7, 1), (21, 3)], dtype=torch.float16, num_hidden=2)
    expected = pa.paged_attention_reference(*batch.args(), **batch.kwargs())
    for path, out in _kernels(batch).items():
        _close(out, expected, path)


@pytest.mark.parametrize("name", ["gqa 6/2 bs16 shared prefix", "mha 4/4 bs8 hidden", "gqa 6/2 bs16 chunk over prefix"])
def test_unreadable_slots_change_nothing(name):
    """NaN/inf in the null block, unreached blocks, stale slots and hidden slots, garbage ids in the
    table padding: every path's output is bit-identical to the clean batch's, and finite."""
    batch = make_batch(11, **{**DECODE_BATCHES, **PREFILL_BATCHES}[name])
    bad = poisoned(batch)
    assert not bad.k_pool.isfinite().all() and not bad.v_pool[NULL_BLOCK].isfinite().any()
    clean, dirty = _kernels(batch), _kernels(bad)
    clean["reference"] = pa.paged_attention_reference(*batch.args(), **batch.kwargs())
    dirty["reference"] = pa.paged_attention_reference(*bad.args(), **bad.kwargs())
    for path in clean:
        assert dirty[path].isfinite().all(), path
        assert torch.equal(dirty[path], clean[path]), path


def test_row_that_sees_no_key_is_zero():
    batch = make_batch(5, [(3, 3), (20, 2)])
    batch = replace(batch, hidden_keys=torch.tensor([[0, -1], [4, 19]]))  # row 0 of sequence 0 sees nothing
    expected = pa.paged_attention_reference(*batch.args(), **batch.kwargs())
    assert (expected[0] == 0).all() and (expected[1:].abs().sum((1, 2)) > 0).all()
    for path, out in _kernels(batch).items():
        _close(out, expected, path)


# ---------------------------------------------------------------- dispatch and validation


def test_dispatch():
    batch = make_batch(2, [(20, 2), (9, 1)])
    reference = pa.paged_attention_reference(*batch.args(), **batch.kwargs())
    for fn in (pa.paged_decode_attention, pa.paged_prefill_attention):
        assert torch.equal(fn(*batch.args(), **batch.kwargs()), reference)  # CPU tensors: the reference
    decode = pa.paged_decode_attention_triton(*batch.args(), **batch.kwargs())
    prefill = pa.paged_prefill_attention_triton(*batch.args(), **batch.kwargs())
    assert torch.equal(pa.paged_decode_attention(*batch.args(), **batch.kwargs(), use_triton=True), decode)
    assert torch.equal(pa.paged_prefill_attention(*batch.args(), **batch.kwargs(), use_triton=True), prefill)


def test_validation_errors():
    batch = make_batch(0, [(20, 2), (9, 1)], num_hidden=1)
    kwargs = batch.kwargs()
    bad = {
        "q must be": replace(batch, q=batch.q.double()),
        "k_pool must be": replace(batch, k_pool=batch.k_pool.half()),
        "v_pool must be": replace(batch, v_pool=batch.v_pool[:, :8]),
        "num_heads=6 must be a multiple of kv_heads=4": replace(
            batch, k_pool=batch.k_pool.repeat(1, 1, 2, 1), v_pool=batch.v_pool.repeat(1, 1, 2, 1)),
        "block_tables must be": replace(batch, block_tables=batch.block_tables.float()),
        "seq_lens must be": replace(batch, seq_lens=batch.seq_lens[:1]),
        "query_start must be": replace(batch, query_start=batch.query_start.float()),
        "hidden_keys must be": replace(batch, hidden_keys=batch.hidden_keys.int()),
    }
    for message, case in bad.items():
        for fn in (pa.paged_decode_attention, pa.paged_prefill_attention):
            for use_triton in (False, True):
                with pytest.raises(ValueError, match=message):
                    fn(*case.args(), **kwargs, use_triton=use_triton)
    with pytest.raises(ValueError, match="max_query_len <= 16"):
        pa.paged_decode_attention(*batch.args(), scale=1.0, max_query_len=17)
    with pytest.raises(ValueError, match="more query rows than max_query_len=1"):
        pa.paged_attention_reference(*batch.args(), scale=1.0, max_query_len=1)
