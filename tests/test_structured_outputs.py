"""Structured outputs in the engine: every verified row is masked by its sequence's grammar
advanced through the drafts before it, so greedy output with every proposer × lossless strategy
equals no-spec greedy output under the same grammar, token for token; a draft the grammar forbids
is never accepted, by any strategy, even where the unmasked target would take it; every output
that finishes with "stop" belongs to the language (JSON: parses and validates)."""
import json
import re

import jsonschema
import pytest
import torch

from specdecode.runtime.config import VerifyStrategy
from specdecode.runtime.engine.grammar import GrammarCompiler, StructuredKind, StructuredOutput
from specdecode.runtime.engine.sampler import SamplerRow
from specdecode.runtime.engine.sequence import FinishReason, SamplingParams
from specdecode.runtime.engine.verifier import Verifier
from specdecode.runtime.proposers import Proposal, Proposer

PROPOSERS = ["ngram", "suffix", "draft", "mtp"]
LOSSLESS = ["greedy", "target_match", "rejection"]
# compact JSON (no free whitespace: a random model would otherwise emit it until max_tokens)
SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999}, "b": {"enum": ["x", "yy", "zzz"]}},
    "required": ["a", "b"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
REGEX = r"[a-z]{2,6}( [a-z]{2,6}){1,3}\."
JSON = StructuredOutput(StructuredKind.JSON, json.dumps(SCHEMA))
WORDS = StructuredOutput(StructuredKind.REGEX, REGEX)


def check_valid(structured: StructuredOutput, text: str) -> None:
    if structured.kind is StructuredKind.JSON:
        jsonschema.validate(json.loads(text), json.loads(structured.text))
    else:
        assert re.fullmatch(structured.text, text), text


@pytest.fixture(scope="module")
def prompt(sharp) -> list[int]:
    """Text with the outputs' shapes in it, so n-gram and suffix drafts often fit the grammars."""
    return sharp[1].encode('{"a":446,"b":"x"} {"a":44,"b":"yy"} ken ran tce ranaro. ken ran tce')


def run(engine, prompt: list[int], params: list[SamplingParams]):
    """Run requests together: per request, each choice's tokens and finish reason, and its SpecCounts."""
    for i, sp in enumerate(params):
        engine.add_request(str(i), prompt, sp)
    tokens = {str(i): [[] for _ in range(sp.n)] for i, sp in enumerate(params)}
    finish = {str(i): [None] * sp.n for i, sp in enumerate(params)}
    spec = {}
    while engine.has_unfinished():
        for o in engine.step():
            spec[o.request_id] = o.spec
            for d in o.deltas:
                tokens[o.request_id][d.index] += d.token_ids
                finish[o.request_id][d.index] = d.finish_reason or finish[o.request_id][d.index]
    return tuple([out[str(i)] for i in range(len(params))] for out in (tokens, finish, spec))


# greedy and seeded sampled (lossless per seed under target_match: the same tokens as without
# speculation) constrained requests, and an unconstrained one; greedy ones score only the drafts
# their grammar allows, sampled ones every draft
REQUESTS = [SamplingParams(max_tokens=30, temperature=0.0, structured=JSON),
            SamplingParams(max_tokens=30, temperature=0.0, structured=WORDS),
            SamplingParams(max_tokens=30, temperature=0.8, seed=5, structured=JSON),
            SamplingParams(max_tokens=30, temperature=0.8, seed=6, structured=WORDS),
            SamplingParams(max_tokens=12, temperature=0.0)]
GREEDY = [0, 1]


@pytest.fixture(scope="module")
def no_spec(sharp, make_engine, prompt):
    """The no-spec outputs: every constrained one finishes with "stop" and is valid."""
    model, tok = sharp
    tokens, finish, _ = run(make_engine(model, tok), prompt, REQUESTS)
    for params, (out,), (reason,) in zip(REQUESTS[:4], tokens, finish):
        assert reason is FinishReason.STOP
        check_valid(params.structured, tok.decode(out))
    return tokens


@pytest.fixture(scope="module")
def mtp_head(sharp, write_random_mtp_head, tmp_path_factory) -> str:
    return write_random_mtp_head(sharp[0], tmp_path_factory.mktemp("grammar-head"))


@pytest.mark.parametrize("verify", LOSSLESS)
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_greedy_with_a_grammar_equals_no_spec(sharp, make_engine, prompt, no_spec, tiny_draft_dir, mtp_head,
                                              proposer, verify):
    """JSON-schema and regex requests, greedy and seeded, and an unconstrained one in one batch:
    greedy ones equal their no-spec output under every lossless strategy, seeded ones too under
    target_match (``greedy`` as a strategy means it for sampled requests); under rejection the
    seeded ones are valid. Drafts were scored for the constrained requests, and n-gram and suffix
    drafts were accepted for the greedy JSON one."""
    model, tok = sharp
    spec = {"method": proposer, "num_speculative_tokens": 3, "verify": verify,
            "draft_model": tiny_draft_dir if proposer == "draft" else None,
            "mtp_path": mtp_head if proposer == "mtp" else None}
    tokens, finish, counts = run(make_engine(model, tok, spec=spec), prompt, REQUESTS)
    if verify == "rejection":
        assert [tokens[i] for i in GREEDY + [4]] == [no_spec[i] for i in GREEDY + [4]]
        for params, (out,), (reason,) in zip(REQUESTS[2:4], tokens[2:4], finish[2:4]):
            if reason is FinishReason.STOP:
                check_valid(params.structured, tok.decode(out))
    else:
        assert tokens == no_spec
    assert sum(c.num_draft_tokens for c in counts[:4]) > 0
    if proposer in ("ngram", "suffix"):
        assert counts[0].num_accepted_tokens > 0


@pytest.mark.parametrize("verify", ["target_match", "rejection", "topp"])
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_sampled_outputs_that_stop_are_valid(sharp, make_engine, prompt, tiny_draft_dir, proposer, verify):
    """Seeded sampled requests, n = 4 each (one grammar state per choice): every choice that stops
    belongs to its language, and most stop."""
    model, tok = sharp
    spec = {"method": proposer, "num_speculative_tokens": 3, "verify": verify,
            "draft_model": tiny_draft_dir if proposer == "draft" else None}
    params = [SamplingParams(max_tokens=30, temperature=1.0, seed=s, n=4, structured=c)
              for s, c in enumerate([JSON, WORDS])]
    engine = make_engine(model, tok, spec=spec)
    tokens, finish, _ = run(engine, prompt, params)
    stopped = 0
    for sp, outs, reasons in zip(params, tokens, finish):
        for out, reason in zip(outs, reasons):
            if reason is FinishReason.STOP:
                check_valid(sp.structured, tok.decode(out))
                stopped += 1
    assert stopped >= 6, finish
    assert engine.stats().spec_decode_num_draft_tokens > 0


class UnmaskedArgmax(Proposer):
    """Drafts the target's *unconstrained* greedy continuation: where the grammar forbids that
    token, the unmasked target would accept it; the masked verifier must not."""

    def __init__(self, model, full_forward, k: int):
        self.model, self.full_forward, self.k = model, full_forward, k
        self.forbidden_drafted = 0  # sampled sequences given a draft their grammar forbids (the engine cuts it)

    def propose(self, seqs, max_drafts, guides=None):
        out = []
        for seq, cap in zip(seqs, max_drafts):
            ids = list(seq.token_ids)
            drafts = []
            for _ in range(min(cap, self.k)):
                drafts.append(int(self.full_forward(self.model, ids)[-1].argmax()))
                ids.append(drafts[-1])
            if not seq.params.greedy and seq.grammar.valid_prefix(drafts) < len(drafts):
                self.forbidden_drafted += 1
            out.append(drafts)
        return Proposal(out)


@pytest.mark.parametrize("verify", ["greedy", "target_match", "rejection"])
def test_drafts_the_grammar_forbids_are_never_accepted_in_the_engine(sharp, make_engine, full_forward, prompt,
                                                                      no_spec, verify):
    """Greedy and seeded sampled constrained requests with drafts = the unmasked argmax chain (one-hot,
    so the engine cuts them at the first forbidden one for every strategy): outputs equal the no-spec
    ones (greedy; seeded target_match) and stay valid; under rejection the seeded outputs are those
    the uncut drafts give (a rejected one-hot draft's recovered token is the bonus token)."""
    model, tok = sharp
    seeded = [SamplingParams(max_tokens=30, temperature=0.7, seed=7, structured=c) for c in (JSON, WORDS)]
    expected, _, _ = run(make_engine(model, tok), prompt, seeded)
    stub = UnmaskedArgmax(model, full_forward, 3)
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 3, "verify": verify})
    engine.proposer = stub
    greedy = [REQUESTS[i] for i in GREEDY]
    tokens, finish, _ = run(engine, prompt, greedy + seeded)
    assert stub.forbidden_drafted > 0
    assert tokens[:2] == [no_spec[i] for i in GREEDY]
    if verify != "rejection":
        assert tokens[2:] == expected
    else:  # not the no-spec tokens, but the very tokens the forbidden drafts would have given, scored
        uncut = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 3, "verify": verify})
        uncut.proposer, uncut._grammar_drafts = UnmaskedArgmax(model, full_forward, 3), lambda seq, t, drawn: t
        assert run(uncut, prompt, greedy + seeded)[0] == tokens
    for sp, (out,), (reason,) in zip(greedy + seeded, tokens, finish):
        if reason is FinishReason.STOP:
            check_valid(sp.structured, tok.decode(out))


@pytest.mark.parametrize("strategy", list(VerifyStrategy))
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_verifier_never_accepts_a_forbidden_draft(sharp, strategy, temperature):
    """The unmasked target's best token (by far) is the draft, and the grammar forbids it: no
    strategy accepts it (topp at verify_top_p = 1 included), with one-hot and dense draft
    distributions, and the emitted token is one the grammar allows."""
    tok = sharp[1]
    vocab = sharp[0].config.vocab_size
    compiler = GrammarCompiler(tok, vocab)
    grammar = compiler.grammar(StructuredOutput(StructuredKind.CHOICE, '["yes", "no"]'))
    forbidden = tok.encode(" the")[0]
    masks = compiler.fill_masks([(grammar, 0, [forbidden])], 2)  # [2, ceil(V/32)]
    allowed = [t for t in range(vocab) if masks[0, t // 32] >> (t % 32) & 1]
    assert 0 < len(allowed) < 10 and forbidden not in allowed
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, forbidden] = 50.0  # [2, V]: row 0 scores the draft, row 1 the bonus
    verifier = Verifier(strategy, verify_top_p=1.0)
    dense = torch.full((1, vocab), 0.5 / (vocab - 1))  # [1, V]: half the draft's mass on the forbidden token
    dense[0, forbidden] = 0.5
    for draft_probs in (None, dense):
        row = SamplerRow(SamplingParams(max_tokens=4, temperature=temperature, seed=3), 3, 10, [], [forbidden],
                         draft_probs, allowed=masks)
        (verdict,) = verifier(logits.clone(), [row])
        assert verdict.num_accepted == 0
        assert verdict.token_ids[0] in allowed


def test_preempted_constrained_sequences_keep_their_grammar_state(sharp, make_engine, prompt, no_spec):
    """A KV pool too small for the batch preempts constrained sequences mid-output, after drafts
    were verified for them; recomputed, their grammar states still match their tokens (they advance
    on emitted tokens only): the outputs equal the unpreempted ones."""
    model, tok = sharp
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 3, "verify": "target_match"},
                         budget=24, num_blocks=16, block_size=8)
    preempted = []  # (constrained, output tokens, drafts scored) of each preempted sequence
    forget = engine.proposer.preempted
    engine.proposer.preempted = lambda seq: (preempted.append((seq.grammar is not None, seq.num_output_tokens,
                                                               seq.spec.num_draft_tokens)), forget(seq))
    tokens, _, _ = run(engine, prompt, REQUESTS[::-1])  # the latest admitted are preempted first: constrained ones
    assert tokens == no_spec[::-1]
    assert any(constrained and out > 0 and drafts > 0 for constrained, out, drafts in preempted), preempted
