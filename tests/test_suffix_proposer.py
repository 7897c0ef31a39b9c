"""Suffix proposer: exact drafts on hand-made sequences, the global cache and its bound,
incremental indexing, memory release, and greedy equivalence with the no-spec output."""
import random
from collections import Counter

import pytest

from specdecode.runtime.config import SpeculativeConfig
from specdecode.runtime.engine.sequence import SamplingParams, Sequence
from specdecode.runtime.proposers import build_proposer
from specdecode.runtime.proposers.suffix import SuffixProposer, SuffixTrie, _Tail


def make_seq(tokens: list[int], num_prompt: int | None = None, seq_id: int = 0) -> Sequence:
    num_prompt = len(tokens) if num_prompt is None else num_prompt
    return Sequence(seq_id, f"r{seq_id}", 0, list(tokens), num_prompt, SamplingParams(), 0.0)


def proposer(max_depth=24, max_cached=1000, min_prob=0.1) -> SuffixProposer:
    return SuffixProposer(max_depth, max_cached, min_prob)


def propose(p: SuffixProposer, tokens: list[int], k: int, seq_id: int = 0) -> list[int]:
    return p.propose([make_seq(tokens, seq_id=seq_id)], [k]).token_ids[0]


def dump(trie: SuffixTrie):
    """The trie as nested (count, cont, {token: child}), tails expanded: what it means, not how it is stored."""

    def tail(n, offset):
        token = n.next_token(offset)
        return (1, 0, {}) if token is None else (1, 1, {token: tail(n, offset + 1)})

    def node(n):
        return tail(n, 0) if isinstance(n, _Tail) else (n.count, n.cont, {t: node(c) for t, c in n.children.items()})

    return node(trie.root)


def num_expanded_nodes(d) -> int:
    return 1 + sum(num_expanded_nodes(c) for c in d[2].values())


def trie_of(texts: list[list[int]], max_depth: int = 24) -> SuffixTrie:
    trie = SuffixTrie(max_depth)
    for text in texts:
        trie.extend(trie.cursor(), text, 0)
    return trie


def test_repeated_phrase_proposes_its_continuation():
    assert propose(proposer(), [1, 2, 3, 4, 5, 9, 1, 2, 3], 4) == [4, 5, 9, 1]


def test_no_match_no_draft():
    assert propose(proposer(), [1, 2, 3, 4, 5], 4) == []


def test_draft_stops_at_low_probability_branch():
    # after [1, 2, 3] come 10, 11 and 12 once each: 1/3 each
    tokens = [5, 1, 2, 3, 10, 6, 1, 2, 3, 11, 4, 1, 2, 3, 12, 9, 1]
    assert propose(proposer(min_prob=0.5), tokens, 8) == [2, 3]
    assert propose(proposer(min_prob=0.3), tokens, 4) == [2, 3, 10, 6]  # ties: the first seen; 1/3 ≥ 0.3 after
    assert propose(proposer(min_prob=0.0), tokens, 8) == [2, 3, 10, 6, 1, 2, 3, 11]


def test_max_drafts_respected_per_sequence():
    p = proposer()
    rep = [7, 8, 9, 10, 11, 12] * 3
    seqs = [make_seq(rep, seq_id=0), make_seq(rep, seq_id=1), make_seq(rep, seq_id=2)]
    assert p.propose(seqs, [1, 3, 6]).token_ids == [[7], [7, 8, 9], [7, 8, 9, 10, 11, 12]]


def test_most_frequent_continuation_wins():
    tokens = [1, 2, 8, 5, 1, 2, 9, 6, 1, 2, 9, 7, 1]
    assert propose(proposer(min_prob=0.5), tokens, 4) == [2, 9]  # 9 follows [1, 2] twice, 8 once; then 6|7: 1/3


def test_longest_match_is_used():
    # [5, 1] continues with 3, the shorter [1] more often with 2: the longer context wins
    tokens = [5, 1, 3, 0, 1, 2, 0, 1, 2, 0, 5, 1]
    assert propose(proposer(), tokens, 1) == [3]


def test_depth_caps_the_match_so_drafts_fit():
    rep = list(range(10)) * 3
    assert propose(proposer(max_depth=6), rep, 4) == [0, 1, 2, 3]  # match ≤ 2 tokens, 4 drafts
    assert propose(proposer(max_depth=6), rep, 8) == [0, 1, 2, 3, 4]  # match 1 token: depth 6 holds 5 drafts


def test_global_cache_drafts_for_a_new_request_repeating_an_output():
    p = proposer()
    first = make_seq([100, 101, 1, 2, 3, 4, 5, 6, 7, 8], num_prompt=2, seq_id=0)
    assert p.propose([first], [4]).token_ids == [[]]
    p.finished(first)
    assert propose(p, [50, 51, 1, 2, 3], 4, seq_id=1) == [4, 5, 6, 7]
    assert propose(p, [50, 100, 101], 4, seq_id=2) == []  # prompts are not cached


def test_own_trie_wins_ties_and_longer_cache_match_wins():
    p = proposer()
    done = make_seq([100, 0, 1, 2, 3, 4, 5], num_prompt=1, seq_id=0)
    p.propose([done], [4])
    p.finished(done)
    assert propose(p, [1, 2, 3, 9, 7, 1, 2, 3], 2, seq_id=1) == [9, 7]  # both match [1, 2, 3]: own
    assert propose(p, [1, 2, 3, 9, 8, 0, 1, 2, 3], 2, seq_id=2) == [4, 5]  # cache matches [0, 1, 2, 3]


def test_cache_eviction_keeps_the_newest_outputs():
    p = proposer(max_cached=2)
    outputs = [[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]]
    for i, out in enumerate(outputs):
        p.finished(make_seq([99] + out, num_prompt=1, seq_id=i))
    assert list(p.cached_outputs) == outputs[1:]
    assert dump(p.cache) == dump(trie_of(outputs[1:]))
    assert propose(p, [5, 10, 11], 2, seq_id=7) == []  # evicted
    assert propose(p, [5, 30, 31], 2, seq_id=8) == [32, 33]


def test_cache_eviction_with_shared_substrings_restores_the_exact_trie():
    rng = random.Random(0)
    outputs = [[rng.randrange(4) for _ in range(rng.randrange(1, 60))] for _ in range(12)]
    p = proposer(max_depth=8, max_cached=3)
    for i, out in enumerate(outputs):
        p.finished(make_seq([0] + out, num_prompt=1, seq_id=i))
        kept = dump(trie_of(outputs[max(0, i - 2) : i + 1], max_depth=8))
        assert dump(p.cache) == kept
        assert p.cache.num_nodes <= num_expanded_nodes(kept)  # nothing evicted lingers


def brute_force(texts: list[list[int]], max_depth: int):
    """``dump`` of a trie of ``texts``, by counting every substring of at most ``max_depth`` tokens."""
    counts = Counter(
        tuple(x[i:j]) for x in texts for i in range(len(x)) for j in range(i + 1, min(i + max_depth, len(x)) + 1)
    )
    by_parent: dict[tuple, list[tuple]] = {}
    for sub in counts:
        by_parent.setdefault(sub[:-1], []).append(sub)

    def node(path):
        kids = by_parent.get(path, [])
        return counts.get(path, 0), sum(counts[k] for k in kids), {k[-1]: node(k) for k in kids}

    return node(())


def test_trie_counts_every_substring_after_inserts_and_removals():
    rng = random.Random(3)
    texts = [[rng.randrange(3) for _ in range(rng.randrange(1, 40))] for _ in range(6)]
    trie = trie_of(texts, max_depth=7)
    assert dump(trie) == brute_force(texts, 7)
    for gone in (texts[2], texts[0], texts[5]):
        trie.remove(gone)
    assert dump(trie) == brute_force([texts[1], texts[3], texts[4]], 7)


def test_removing_every_text_empties_the_trie():
    rng = random.Random(2)
    texts = [[rng.randrange(3) for _ in range(50)] for _ in range(5)]
    trie = trie_of(texts, max_depth=6)
    for text in texts[::2] + texts[1::2]:
        trie.remove(text)
    assert trie.num_nodes == 1 and trie.root.children == {} and trie.root.cont == 0


def test_text_seen_once_costs_a_few_objects_per_token():
    trie = trie_of([list(range(2000))])
    assert trie.num_nodes == 2001  # one tail per token, not max_depth nodes
    assert num_expanded_nodes(dump(trie)) == 1 + sum(min(24, 2000 - i) for i in range(2000))


def test_no_global_cache():
    p = proposer(max_cached=0)
    p.finished(make_seq([1, 2, 3, 4], num_prompt=1))
    assert p.cache.num_nodes == 1 and not p.cached_outputs
    assert propose(p, [9, 2, 3], 1, seq_id=1) == []


def test_incremental_indexing_equals_from_scratch():
    rng = random.Random(1)
    tokens = [rng.randrange(5) for _ in range(400)]
    p = proposer(max_depth=10, min_prob=0.0)
    seq = make_seq(tokens[:20])
    while len(seq) < len(tokens):
        drafts = p.propose([seq], [4]).token_ids[0]
        fresh = proposer(max_depth=10, min_prob=0.0).propose([make_seq(seq.token_ids)], [4]).token_ids[0]
        assert drafts == fresh
        seq.token_ids += tokens[len(seq) : len(seq) + rng.randrange(1, 6)]
    p.propose([seq], [4])
    assert dump(p.own[0].trie) == dump(trie_of([tokens], max_depth=10))
    assert p.own[0].text == tokens


def test_shorter_token_list_rebuilds_the_own_trie():
    p = proposer(max_depth=10)
    tokens = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2]
    p.propose([make_seq(tokens)], [2])
    assert p.propose([make_seq(tokens[:6])], [2]).token_ids == [[3, 4]]
    assert dump(p.own[0].trie) == dump(trie_of([tokens[:6]], max_depth=10))


def test_finished_releases_the_own_trie():
    p = proposer()
    seqs = [make_seq([1, 2, 3, 1, 2], seq_id=i) for i in range(3)]
    p.propose(seqs, [2, 2, 2])
    assert set(p.own) == {0, 1, 2}
    for s in seqs:
        p.finished(s)
    assert p.own == {}


def test_build_proposer_and_config_validation():
    cfg = SpeculativeConfig(method="suffix", suffix_max_depth=12, suffix_max_cached_requests=5, suffix_min_token_prob=0.2)
    p = build_proposer(cfg, None)
    assert isinstance(p, SuffixProposer)
    assert (p.max_depth, p.max_cached_requests, p.min_token_prob) == (12, 5, 0.2)
    with pytest.raises(ValueError, match="suffix_max_depth"):
        SpeculativeConfig(method="suffix", num_speculative_tokens=8, suffix_max_depth=8)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="suffix", suffix_min_token_prob=1.5)
    with pytest.raises(ValueError):
        SpeculativeConfig(method="suffix", suffix_max_cached_requests=-1)


# --- end to end: greedy equivalence with the no-spec output ---

@pytest.mark.parametrize("verify", ["greedy", "rejection"])
def test_suffix_greedy_equals_no_spec(smollm2, smol_rep, smol_nospec, make_engine, run_all, assert_greedy_match, verify, rep_greedy):
    spec = {"method": "suffix", "num_speculative_tokens": 4, "verify": verify}
    engine = make_engine(smollm2.model, smollm2.tokenizer, spec=spec)
    got = run_all(engine, smol_rep, rep_greedy)
    for prompt, expected, actual in zip(smol_rep, smol_nospec, got):
        assert_greedy_match(smollm2.model, prompt, expected, actual)
    stats = engine.stats()
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0  # speculation really ran
    assert engine.proposer.own == {}  # every finished sequence released its trie
    assert len(engine.proposer.cached_outputs) == len(smol_rep)
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_abort_releases_the_own_trie(sharp, make_engine):
    model, tok = sharp
    engine = make_engine(model, tok, spec={"method": "suffix", "num_speculative_tokens": 3})
    engine.add_request("a", tok.encode("hello hello hello hello"), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert set(engine.proposer.own) == {0}
    engine.abort_request("a")
    assert engine.proposer.own == {} and len(engine.proposer.cached_outputs) == 1
