"""Block pool and prefix cache: reference counts, hashing (SHA-256 chained keys), reuse after free, eviction."""
import hashlib

from specdecode.runtime.engine.block_manager import BlockManager
from specdecode.runtime.engine.sequence import SamplingParams, Sequence


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, str(seq_id), 0, list(tokens), len(tokens), SamplingParams(), 0.0)


def compute_all(bm: BlockManager, seq: Sequence) -> None:
    assert bm.grow(seq, len(seq))
    seq.num_computed_tokens = len(seq)
    bm.commit_full_blocks(seq)


def test_admit_grow_release_counts_blocks():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    seq = make_seq(list(range(10)))
    assert bm.admit(seq, [], 10)
    assert len(seq.block_table) == 3 and bm.num_free_blocks == 5
    assert bm.grow(seq, 13) and len(seq.block_table) == 4
    assert not bm.grow(seq, 100) and len(seq.block_table) == 4  # refused without side effects
    bm.release(seq)
    assert bm.num_free_blocks == 8 and seq.block_table == []


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    first = make_seq(list(range(12)))
    assert bm.admit(first, [], 12)
    compute_all(bm, first)
    second = make_seq(list(range(12)) + [99], seq_id=1)
    prefix = bm.match_prefix(second.token_ids)
    assert prefix == first.block_table  # all three full blocks match
    assert bm.admit(second, prefix, 1)
    assert second.num_computed_tokens == 12 and second.num_cached_prefix_tokens == 12
    assert all(bm.ref_counts[b] == 2 for b in prefix)
    # A prompt equal to a cached prefix must still compute its last token.
    assert len(bm.match_prefix(list(range(12)))) == 2


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    seq = make_seq([1, 2, 3, 4, 5])
    assert bm.admit(seq, [], 5)
    compute_all(bm, seq)
    bm.release(seq)
    assert bm.num_free_blocks == 4
    assert len(bm.match_prefix([1, 2, 3, 4, 7])) == 2  # still cached after release
    other = make_seq([9, 9, 9, 9, 9, 9, 9, 9], seq_id=1)
    assert bm.admit(other, [], 8)  # takes every block, evicting the cached ones
    assert bm.match_prefix([1, 2, 3, 4, 7]) == []


def test_different_prefix_same_block_tokens_do_not_match():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    seq = make_seq([1, 2, 3, 4, 5])
    assert bm.admit(seq, [], 5)
    compute_all(bm, seq)
    assert bm.match_prefix([7, 7, 3, 4, 5]) == []  # block [3, 4] hashes with its parent


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    seq = make_seq([1, 2, 3, 4, 5])
    assert bm.admit(seq, [], 5)
    compute_all(bm, seq)
    assert bm.match_prefix([1, 2, 3, 4, 5]) == []


def token_bytes(tokens: list[int]) -> bytes:
    return b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)


def test_block_key_is_sha256_of_the_parent_digest_and_the_token_ids():
    """A cached block's key is a collision-resistant digest chained over every token before it
    (not Python's hash(), whose collisions poison another request's prefix: CVE-2025-25183)."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = [5, 70000, 3, 2**31 + 1, 9, 8, 7, 6, 1]
    seq = make_seq(tokens)
    assert bm.admit(seq, [], len(tokens))
    compute_all(bm, seq)
    first, second = (bm.block_hash[b] for b in seq.block_table[:2])
    assert first == hashlib.sha256(bytes(32) + token_bytes(tokens[:4])).digest()
    assert second == hashlib.sha256(first + token_bytes(tokens[4:8])).digest()
    assert bm.block_hash[seq.block_table[2]] is None  # not full
    assert set(bm.cached) == {first, second}


def test_a_block_under_another_parent_chain_is_only_a_miss():
    """Prefix A + X cached; B + X (A ≠ B, one block each) matches nothing, not even X's block, and
    caching B + X gives its X block a key of its own."""
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    a_x = make_seq([1, 2, 3, 4, 9])
    assert bm.admit(a_x, [], 5)
    compute_all(bm, a_x)
    assert bm.match_prefix([5, 6, 3, 4, 9]) == []
    assert bm.match_prefix([1, 2, 3, 4, 9]) == a_x.block_table[:2]
    b_x = make_seq([5, 6, 3, 4, 9], seq_id=1)
    assert bm.admit(b_x, [], 5)
    compute_all(bm, b_x)
    assert bm.block_hash[b_x.block_table[1]] != bm.block_hash[a_x.block_table[1]]
    assert bm.match_prefix([5, 6, 3, 4, 9]) == b_x.block_table[:2]
    assert bm.match_prefix([1, 2, 3, 4, 9]) == a_x.block_table[:2]
