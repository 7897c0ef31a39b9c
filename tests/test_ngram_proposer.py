"""The n-gram proposer drafts on the device from each step's verdicts, before they are read, and its
drafts come back in the verdicts' read (runtime/proposers/ngram.py): those drafts equal a fresh
match over the sequence's tokens every time, whatever the batch, acceptance, sampling, stops and
overlap (that a verify step then reads the device once in all: tests/test_step_transfers.py)."""
import pytest
import torch

from specdecode.kernels.ngram import ngram_propose_reference
from specdecode.runtime.engine.sequence import SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def fresh_match(tokens: list[int], k: int, max_n: int) -> list[int]:
    drafts, counts = ngram_propose_reference(torch.tensor([tokens]), torch.tensor([len(tokens)]), 1, max_n, k)
    return drafts[0, : int(counts[0])].tolist()


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_drafts_made_ahead_equal_a_fresh_match_of_the_sequence_tokens(sharp_target, make_engine, overlap):
    model, tokenizer = sharp_target
    engine = make_engine(model, tokenizer, overlap=overlap, spec=NGRAM, num_blocks=64, max_seqs=4)
    gen = torch.Generator().manual_seed(0)
    for i in range(7):  # more than 4 seats: some wait, some finish early (stop token), some are sampled
        prompt = torch.randint(3, 300, (2 + i % 3,), generator=gen).tolist() * 8
        params = SamplingParams(max_tokens=30 + 5 * i, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True,
                                stop_token_ids=[prompt[1]] if i == 3 else [])
        engine.add_request(str(i), prompt, params)
    proposer, checked, cold = engine.proposer, [], []
    propose, match = proposer.propose, proposer._match

    def checking_propose(seqs, max_drafts, guides=None):
        proposal = propose(seqs, max_drafts, guides)
        for seq, cap, drafts in zip(seqs, max_drafts, proposal.token_ids):
            assert drafts == fresh_match(seq.token_ids, proposer.k, proposer.max_n)[:cap], f"seq {seq.seq_id}"
        checked.extend(seqs)
        return proposal

    proposer.propose = checking_propose
    proposer._match = lambda seqs, forced: cold.extend(seqs) or match(seqs, forced)
    while engine.has_unfinished():
        engine.step()
    assert len(checked) > 30 and not cold  # every sequence's drafts were made ahead, from its last verdicts
    assert engine.stats().spec_decode_num_accepted_tokens > 0
    assert not proposer.contexts.row_of  # finished sequences gave their rows back
