"""Grammar-aware drafting (``SpeculativeConfig.grammar_drafts``) on a tiny real model with real
llguidance grammars: a constrained sequence drafts the tokens its grammar forces next, then the
proposer's own drafts after them; a draft model or MTP head draws under the grammar's mask, so it
never proposes a token the grammar forbids; no forbidden draft is ever scored; greedy and seeded
target_match outputs equal no-spec ones, with the setting on and off, for every proposer (``none``:
forced tokens alone)."""
import json

import pytest

from specdecode.runtime.engine.grammar import StructuredKind, StructuredOutput
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.proposers import Proposal, Proposer

# long keys and an enum: most of the output is forced; compact, so a random model cannot pad with spaces
SCHEMA = {
    "type": "object",
    "properties": {"kenrantce": {"type": "integer", "minimum": 0, "maximum": 999},
                   "ranaro": {"enum": ["kenran", "tce"]}},
    "required": ["kenrantce", "ranaro"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
JSON = StructuredOutput(StructuredKind.JSON, json.dumps(SCHEMA))
WORDS = StructuredOutput(StructuredKind.REGEX, r"kenran( [a-z]{2,6}){1,3}\.")
REQUESTS = [SamplingParams(max_tokens=40, temperature=0.0, structured=JSON),
            SamplingParams(max_tokens=40, temperature=0.0, structured=WORDS),
            SamplingParams(max_tokens=40, temperature=0.8, seed=3, n=2, structured=JSON),
            SamplingParams(max_tokens=12, temperature=0.0)]
PROPOSERS = ["none", "ngram", "suffix", "draft", "mtp"]


@pytest.fixture(scope="module")
def prompt(sharp) -> list[int]:
    return sharp[1].encode('{"kenrantce":446,"ranaro":"tce"} {"kenrantce":44,"ranaro":"kenran"} ken ran tce')


class Watch:
    """What the engine drafted and scored: per constrained row, its drafts, the forced ones among
    them, its masks and the verdict; and the drafts a proposer gave that the grammar forbids."""

    def __init__(self, engine):
        self.forced: dict[int, list[int]] = {}  # seq_id → this step's forced tokens
        self.scored: list[tuple[list[int], list[int], list[set[int]], int]] = []  # drafts, forced, allowed, accepted
        self.proposed_forbidden = 0
        launch, guides, cut = engine.execution.launch, engine._guides, engine._grammar_drafts

        def watched_guides(asked):
            found = guides(asked)
            for item, guide in zip(asked, found.per_seq if found else []):
                self.forced[item.seq.seq_id] = guide.forced if guide else []
            return found

        def watched_cut(seq, tokens, drawn):
            kept = cut(seq, tokens, drawn)
            if seq.grammar is not None:
                self.proposed_forbidden += seq.grammar.valid_prefix(tokens) < len(tokens)
            return kept

        def launched(scheduled, step, rows):
            pending = launch(scheduled, step, rows)
            deciding = [item for item in scheduled if item.samples]

            def read():
                result = pending()
                for item, row, verdict in zip(deciding, rows, result.verdicts):
                    if row.allowed is not None and row.draft_token_ids:
                        allowed = [_allowed(words) for words in row.allowed]
                        forced = self.forced.get(item.seq.seq_id, [])[: len(row.draft_token_ids)]
                        self.scored.append((row.draft_token_ids, forced, allowed, verdict.num_accepted))
                return result

            return read

        engine.execution.launch, engine._guides, engine._grammar_drafts = launched, watched_guides, watched_cut


def _allowed(words) -> set[int]:
    return {32 * w + b for w, word in enumerate(words.tolist()) for b in range(32) if word >> b & 1}


def run(engine, prompt, params):
    for i, p in enumerate(params):
        engine.add_request(str(i), prompt, p)
    out = {str(i): [[] for _ in range(p.n)] for i, p in enumerate(params)}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                out[o.request_id][d.index] += d.token_ids
    return [out[str(i)] for i in range(len(params))]


@pytest.fixture(scope="module")
def no_spec(sharp, make_engine, prompt):
    model, tok = sharp
    tokens = run(make_engine(model, tok), prompt, REQUESTS)
    for (out,) in (tokens[0], tokens[1]):
        assert tok.decode(out).startswith(("{", "kenran"))
    return tokens


@pytest.fixture(scope="module")
def mtp_head(sharp, write_random_mtp_head, tmp_path_factory) -> str:
    return write_random_mtp_head(sharp[0], tmp_path_factory.mktemp("grammar-drafts-head"))


@pytest.mark.parametrize("grammar_drafts", [True, False], ids=["forced", "off"])
@pytest.mark.parametrize("verify", ["greedy", "target_match", "rejection"])
@pytest.mark.parametrize("proposer", PROPOSERS)
def test_grammar_drafts_keep_outputs_and_score_no_forbidden_draft(sharp, make_engine, prompt, no_spec, tiny_draft_dir,
                                                                  mtp_head, proposer, verify, grammar_drafts):
    """Greedy outputs equal no-spec ones (seeded ones too under greedy and target_match, ``n`` = 2
    included). With the setting on: forced drafts were scored; a forced draft whose row's mask
    admits only it is accepted whenever the drafts before it were; no scored draft is one its
    grammar forbids; and a draft model or MTP head never proposed one."""
    model, tok = sharp
    spec = {"method": proposer, "num_speculative_tokens": 4, "verify": verify, "grammar_drafts": grammar_drafts,
            "max_grammar_drafts": 4, "draft_model": tiny_draft_dir if proposer == "draft" else None,
            "mtp_path": mtp_head if proposer == "mtp" else None}
    if proposer == "none" and not grammar_drafts:
        pytest.skip("no drafts at all: the reference itself")
    engine = make_engine(model, tok, spec=spec)
    watch = Watch(engine)
    tokens = run(engine, prompt, REQUESTS)
    greedy = [0, 1, 3] if verify == "rejection" else [0, 1, 2, 3]
    assert [tokens[i] for i in greedy] == [no_spec[i] for i in greedy]
    if not grammar_drafts:
        return
    forced_scored = [(drafts, forced, allowed, accepted) for drafts, forced, allowed, accepted in watch.scored if forced]
    assert forced_scored, "no forced draft was scored"
    for drafts, forced, allowed, accepted in forced_scored:
        assert drafts[: len(forced)] == forced
        for j in range(len(forced)):
            if accepted >= j and allowed[j] == {forced[j]}:
                assert accepted > j, f"the forced draft {forced[j]} at {j} of {drafts} was the only token allowed"
    assert not [d for d, _, allowed, _ in watch.scored if any(t not in allowed[j] for j, t in enumerate(d))]
    if proposer in ("draft", "mtp", "none"):
        assert watch.proposed_forbidden == 0


def test_forced_tokens_alone_cut_the_target_steps(sharp, make_engine, prompt, no_spec):
    """``method: none`` with the setting on: the JSON request takes fewer target steps than without
    (its keys and punctuation are forced), and the unconstrained request gets no drafts."""
    model, tok = sharp
    params = [REQUESTS[0], REQUESTS[3]]

    def steps(spec):
        engine = make_engine(model, tok, spec=spec)
        outputs, count = [], 0
        for i, p in enumerate(params):
            engine.add_request(str(i), prompt, p)
        while engine.has_unfinished():
            outputs += engine.step()
            count += 1
        return count, {o.request_id: o.spec for o in outputs if o.finished}

    plain, _ = steps(None)
    forced, spec = steps({"method": "none", "grammar_drafts": True, "max_grammar_drafts": 8})
    assert forced < plain
    assert spec["0"].num_accepted_tokens > 0 and spec["1"].num_draft_tokens == 0


class DraftedElsewhere(Proposer):
    """Drafts made without the grammar (as a pipeline's last stage relays a draft model's): the
    token ``z`` each time, which the compact JSON grammar never allows outside a string."""

    follows_guides = False

    def __init__(self, token: int):
        self.token = token

    def propose(self, seqs, max_drafts, guides=None):
        return Proposal([[self.token] * k for k in max_drafts])


def test_drafts_made_without_the_grammar_are_cut_only_where_that_keeps_the_output(sharp, make_engine, prompt):
    """A proposer that ignores guides may have drawn dense drafts, whose q this process does not
    hold: under rejection a sampled request scores them (cutting a forbidden one would draw the
    bonus from p where the residual is due, a bias); a greedy request has them cut."""
    model, tok = sharp
    engine = make_engine(model, tok, spec={"method": "ngram", "num_speculative_tokens": 2, "verify": "rejection"})
    (z,) = tok.encode("z")
    engine.proposer = DraftedElsewhere(z)
    scored = {True: 0, False: 0}  # greedy? → forbidden drafts scored
    launch = engine.execution.launch

    def launched(scheduled, step, rows):
        for row in rows:
            if row.allowed is not None:
                scored[row.params.greedy] += sum(z not in _allowed(words) for words in row.allowed[: len(row.draft_token_ids)])
        return launch(scheduled, step, rows)

    engine.execution.launch = launched
    run(engine, prompt, [REQUESTS[0], SamplingParams(max_tokens=20, temperature=0.8, seed=1, structured=JSON)])
    assert scored[False] > 0 and scored[True] == 0


@pytest.mark.parametrize("proposer", ["draft", "mtp"])
def test_a_pipelines_last_stage_drafts_under_mirrors_of_the_grammars(sharp_target_dir, sharp_target, sharp_draft_dir,
                                                                     sharp_mtp_dir, make_engine, prompt, proposer):
    """Two stages in one process (``pipeline_harness``): the draft model or MTP head on the last stage
    drafts each constrained sequence's forced tokens first and then draws under a mirror of its
    grammar, so none of its drafts is one the grammar forbids; the forced drafts reach rank 0 and
    are accepted (a random MTP head's own drafts hardly ever are); greedy outputs equal no-spec ones."""
    from pipeline_harness import in_process_pipeline_engine

    from specdecode.runtime.config import (CacheConfig, EngineConfig, LoadConfig, ParallelConfig, SchedulerConfig,
                                           SpeculativeConfig)

    model, tok = sharp_target
    requests = [REQUESTS[0], REQUESTS[1], REQUESTS[3]]  # greedy: JSON, words, unconstrained
    expected = run(make_engine(model, tok), prompt, requests)
    spec = SpeculativeConfig(method=proposer, num_speculative_tokens=4, max_grammar_drafts=4,
                             draft_model=sharp_draft_dir if proposer == "draft" else None,
                             mtp_path=sharp_mtp_dir if proposer == "mtp" else None,
                             gates=["mtp-pipeline-parallel"] if proposer == "mtp" else [])
    cfg = EngineConfig(load=LoadConfig(model=str(sharp_target_dir), weight_cache_dir=None, device="cpu", dtype="float32"),
                       cache=CacheConfig(block_size=16, num_blocks=512), scheduler=SchedulerConfig(max_num_batched_tokens=512),
                       speculative=spec, parallel=ParallelConfig(pipeline_parallel_size=2))
    engine, transport = in_process_pipeline_engine(cfg)
    tail = transport.workers[-1].tail
    proposed = []  # per constrained sequence and step: (forced, drafts, how many of them its grammar allows)
    propose = tail.proposer.propose

    def watched(seqs, caps, guides=None):
        grammars = [None if seq.grammar is None else seq.grammar.copy() for seq in seqs]
        proposal = propose(seqs, caps, guides)
        for i, (grammar, drafts) in enumerate(zip(grammars, proposal.token_ids)):
            if grammar is not None:
                proposed.append((guides.forced(i), drafts, grammar.valid_prefix(drafts)))
        return proposal

    tail.proposer.propose = watched
    try:
        for i, p in enumerate(requests):
            engine.add_request(str(i), prompt, p)
        out, accepted = {str(i): [] for i in range(len(requests))}, {}
        while engine.has_unfinished():
            for o in engine.step():
                out[o.request_id] += [t for d in o.deltas for t in d.token_ids]
                if o.finished:
                    accepted[o.request_id] = o.spec.num_accepted_tokens
    finally:
        engine.shutdown()
    assert [[out[str(i)]] for i in range(len(requests))] == expected
    assert any(forced for forced, _, _ in proposed), "no forced token was drafted on the last stage"
    for forced, drafts, valid in proposed:
        assert drafts[: len(forced)] == forced and valid == len(drafts), (forced, drafts)
    assert accepted["0"] > 0 and accepted["1"] > 0
