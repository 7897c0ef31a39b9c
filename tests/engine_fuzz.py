"""The engine's differential fuzzer: seeded random workloads through a speculating engine, judged
against the same requests run one at a time without speculation or overlap.

A *workload* (``make_workload``) is an engine shape — KV block size, a pool small enough to
preempt, a chunked-prefill token budget, a seat limit, K — and requests: random prompts, some
sharing a prefix (prefix-cache hits) and some repeating themselves (drafts that get accepted),
arriving at random steps, some aborted a few steps later; greedy or seeded sampling (top-k, top-p,
a presence penalty, ``n`` = 2), ``max_tokens``, stop strings and stop token ids, EOS honoured or
not, regex constraints, per-request speculation caps, logprobs. ``Axes`` pick the proposer, the
verify strategy, overlap and the number of pipeline stages (in one process: pipeline_harness.py);
the shape turns grammar-aware drafting on (3 workloads in 4) or off, and in one process pads
decode/verify steps to batch buckets (1 in 2: ``runtime/engine/buckets.py``).

``FuzzBed.check`` runs a workload and asserts (``Judge``):
- greedy outputs equal the reference token for token, except at a proven near-tie (top-2 of the
  target's processed logits within 1e-4 relative; the comparison ends there); finish reasons equal;
- seeded sampled outputs equal the reference where the strategy is lossless per seed
  (``target_match``, and ``greedy``, which means target_match for sampled requests), except at a
  proven near-tie: the position's seeded draw within 1e-5 of the CDF boundary between the two tokens
  (the target's processed distribution recomputed; logits from other batch shapes round differently);
- for every strategy (``rejection`` and the lossy ``topp`` included): exactly one finished output
  per request not aborted and nothing after it, no token past ``max_tokens``, no token after a
  stop token or EOS, no stop string in the text, a constrained output that stops matches its
  regex and never ends in ``abort``; an aborted request's tokens are a prefix of the reference's
  where outputs are comparable;
- at the end every KV block is free (the target's pool and a draft model's), nothing runs or waits.

``Coverage`` counts what a run exercised (preemptions, those made by a look-ahead decode row,
aborts mid-decode, prefix hits, full and partial acceptance, chunked-prefill splits, overlap
rebuilds, drafts a grammar refused, bucketed steps with padding rows or sequences); tests/test_engine_fuzz.py asserts every count is above zero
over the CI seed set.
"""
from __future__ import annotations

import dataclasses
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.runtime.config import (
    CacheConfig,
    EngineConfig,
    GraphConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from specdecode.runtime.engine import rng
from specdecode.runtime.engine.grammar import StructuredKind, StructuredOutput
from specdecode.runtime.engine.llm_engine import LLMEngine, draft_cap
from specdecode.runtime.engine.sampler import sampling_probs
from specdecode.runtime.engine.sequence import FinishReason, SamplingParams

PROPOSERS = ("ngram", "suffix", "draft-same", "draft-noisy", "mtp", "eagle3")  # draft-same: the target as its own draft
HEAD_PROPOSERS = ("mtp", "eagle3")  # methods drafting with heads read from ``FuzzBed.head_dirs``
STRATEGIES = ("greedy", "target_match", "rejection", "topp")
LOSSLESS_PER_SEED = ("greedy", "target_match")  # sampled outputs equal no-spec seeded sampling exactly
SAMPLING_TIE = 1e-5  # a seeded draw this close to a CDF boundary may land on either side after fp rounding
REGEX = r"[a-z]{1,6}( [a-z]{1,6}){0,3}\."
MAX_STEPS = 2000  # a workload that needs more has stalled


@dataclass(frozen=True)
class Axes:
    proposer: str
    strategy: str
    overlap: bool
    stages: int  # pipeline stages, in one process (1: no pipeline)

    def __str__(self) -> str:
        return f"{self.proposer}-{self.strategy}-{'overlap' if self.overlap else 'serial'}-pp{self.stages}"


@dataclass(frozen=True)
class Shape:
    """The engine a workload runs on."""

    block_size: int
    num_blocks: int
    budget: int  # max_num_batched_tokens
    max_seqs: int
    k: int  # num_speculative_tokens
    grammar_drafts: bool = True  # constrained sequences draft their forced tokens, drafts drawn under the grammar
    buckets: bool = False  # decode/verify steps padded to batch buckets (one process only)


@dataclass(frozen=True)
class FuzzRequest:
    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival: int  # added before this engine step
    abort_at: int | None  # aborted before this engine step, if still unfinished
    abort_when_preempted: bool = False  # aborted right after a step that preempted it (a client gave up)


@dataclass(frozen=True)
class Workload:
    seed: int
    axes: Axes
    shape: Shape
    requests: tuple[FuzzRequest, ...]


def make_workload(seed: int, axes: Axes, vocab_size: int, decode: Callable[[list[int]], str]) -> Workload:
    """The workload of ``seed`` under ``axes``: the verify strategies share one (and so their
    references), the other axis combinations each draw their own."""
    rng = random.Random(f"{dataclasses.replace(axes, strategy='')}/{seed}")
    block_size = rng.choice([4, 4, 8, 16])
    k = rng.randint(1, 4)
    prefixes = [_tokens(rng, vocab_size, rng.randint(block_size, 3 * block_size)) for _ in range(2)]
    requests = []
    for i in range(rng.randint(3, 6)):
        prompt = (rng.choice(prefixes) if rng.random() < 0.4 else []) + _tail(rng, vocab_size)
        arrival = rng.randint(0, 8)
        abort_at = arrival + rng.randint(1, 8) if rng.random() < 0.2 else None
        requests.append(FuzzRequest(f"r{i}", tuple(prompt), _params(rng, prompt, k, decode), arrival, abort_at,
                                    rng.random() < 0.25))
    needed = max(-(-(len(r.prompt) + r.params.max_tokens) // block_size) for r in requests)
    num_blocks = max(2, needed + rng.randint(0, 4))  # CacheConfig's least (short prompts, few tokens: needed = 1)
    shape = Shape(block_size, num_blocks, rng.randint(6, 32), rng.randint(2, 6), k,
                  grammar_drafts=rng.random() < 0.75)
    shape = dataclasses.replace(shape, buckets=axes.stages == 1 and rng.random() < 0.5)  # drawn last: earlier draws keep
    return Workload(seed, axes, shape, tuple(requests))


def _tokens(rng: random.Random, vocab_size: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab_size) for _ in range(n)]  # ids 0–2 are the special tokens


def _tail(rng: random.Random, vocab_size: int) -> list[int]:
    """A prompt's own part: short, or longer and random, or long and a motif repeated (n-gram and
    suffix drafts follow it; a long prompt is prefilled in chunks while short ones overtake it)."""
    kind = rng.random()
    if kind < 0.4:
        return _tokens(rng, vocab_size, rng.randint(1, 5))
    if kind < 0.7:
        return _tokens(rng, vocab_size, rng.randint(6, 14))
    motif = _tokens(rng, vocab_size, rng.randint(2, 5))
    return (motif * 15)[: rng.randint(14, 30)]


def _params(rng: random.Random, prompt: list[int], k: int, decode: Callable[[list[int]], str]) -> SamplingParams:
    p: dict = {"max_tokens": rng.randint(1, 16), "temperature": 0.0}
    if rng.random() < 0.4:
        p |= {"temperature": rng.choice([0.6, 1.0]), "seed": rng.randrange(2**31), "top_k": rng.choice([0, 0, 8]),
              "top_p": rng.choice([1.0, 1.0, 0.8]), "n": rng.choice([1, 1, 2]),
              "presence_penalty": rng.choice([0.0, 0.0, 0.0, 0.5])}
    if rng.random() < 0.15:
        p["structured"] = StructuredOutput(StructuredKind.REGEX, REGEX)
    else:
        p["ignore_eos"] = rng.random() < 0.5
        if rng.random() < 0.2:
            p["stop_token_ids"] = (rng.choice(prompt),)
        stop = decode([rng.choice(prompt)]).strip()
        if stop and rng.random() < 0.2:
            p["stop"] = (stop,)
    if rng.random() < 0.25:
        p["num_speculative_tokens"] = rng.randint(0, k)
    if rng.random() < 0.1:
        p["logprobs"] = 1
    return SamplingParams(**p)


# -- running a workload ----------------------------------------------------------------------


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None


@dataclass
class Outcome:
    completions: list[Completion]
    finished_outputs: int = 0  # RequestOutputs with finished set (exactly one unless aborted)
    after_finish: int = 0  # outputs that came after the finished one
    aborted_mid_decode: bool = False
    aborted: bool = False


def outcomes_to_json(outcomes: dict[str, Outcome]) -> dict:
    return {request_id: dataclasses.asdict(outcome) for request_id, outcome in outcomes.items()}


def outcomes_from_json(data: dict) -> dict[str, Outcome]:
    def completion(c: dict) -> Completion:
        reason = c["finish_reason"]
        return Completion(c["tokens"], c["text"], None if reason is None else FinishReason(reason))

    return {request_id: Outcome(**{**o, "completions": [completion(c) for c in o["completions"]]})
            for request_id, o in data.items()}


class Coverage(Counter):
    """What a run exercised (see the module docstring); counts add up across runs."""


def run_workload(engine: LLMEngine, workload: Workload, coverage: Coverage | None = None) -> dict[str, Outcome]:
    """Run the workload's requests (arrivals and aborts by engine step) to the end. With ``coverage``
    the engine is watched (``_Spies``: once per engine, a fresh one) and what it exercised counted."""
    spies = None if coverage is None else _Spies(engine, coverage)
    coverage = Coverage() if coverage is None else coverage
    requests = {r.request_id: r for r in workload.requests}
    outcomes = {r.request_id: Outcome([Completion() for _ in range(r.params.n)]) for r in workload.requests}
    for step in range(MAX_STEPS):
        for r in workload.requests:
            if r.arrival == step:
                engine.add_request(r.request_id, list(r.prompt), r.params)
            if r.abort_at == step and r.request_id in engine.requests:
                _abort(engine, r, outcomes[r.request_id], coverage)
        if not engine.has_unfinished() and all(r.arrival <= step for r in workload.requests):
            break
        for out in engine.step():
            _record(outcomes[out.request_id], out)
        if spies is not None:
            spies.after_step()
        for seq in engine.scheduler.preempted:  # by the scheduling this step ended with (the look-ahead's, with overlap)
            r = requests[seq.request_id]
            if r.abort_when_preempted and r.request_id in engine.requests:
                coverage["aborts after a preemption"] += 1
                _abort(engine, r, outcomes[r.request_id], coverage)
    else:
        raise AssertionError(f"the workload did not finish within {MAX_STEPS} steps")
    coverage["prefix hits"] += engine.scheduler.prefix_cache_hit_tokens > 0
    coverage["preemptions"] += engine.scheduler.num_preemptions
    return outcomes


def _abort(engine: LLMEngine, request: FuzzRequest, outcome: Outcome, coverage: Coverage) -> None:
    outcome.aborted = True
    outcome.aborted_mid_decode = any(c.tokens for c in outcome.completions)
    coverage["aborts mid-decode"] += outcome.aborted_mid_decode
    engine.abort_request(request.request_id)


def _record(outcome: Outcome, out) -> None:
    outcome.after_finish += outcome.finished_outputs > 0
    outcome.finished_outputs += out.finished
    for delta in out.deltas:
        completion = outcome.completions[delta.index]
        completion.tokens += delta.token_ids
        completion.text += delta.text
        if delta.finish_reason is not None:
            completion.finish_reason = delta.finish_reason


class _Spies:
    """Counts what the engine did by watching its seams: each launched step's items and rows, each
    verdict's acceptance, the grammar's trims of greedy drafts, the recorded events; and checks the
    overlap look-ahead's reservation: never more than its deciding sequences may take in the next
    step (one token each plus the drafts the request and ``max_tokens`` allow), which would starve
    the prompt chunks and admissions built ahead."""

    def __init__(self, engine: LLMEngine, coverage: Coverage):
        self.engine, self.coverage = engine, coverage
        launch, observe, trim = engine.execution.launch, engine.load_control.observe, engine._grammar_drafts
        plan_ahead, schedule_ahead = engine._plan_ahead, engine.scheduler.schedule_ahead
        k = engine.load_control.k if engine.proposer is not None else 0
        may_take = []

        def planned_ahead(plan):
            may_take[:] = [sum(1 + draft_cap(item.seq, k, engine.max_model_len) for item in plan.deciding)]
            return plan_ahead(plan)

        def scheduled_ahead(reserved_tokens: int):
            assert reserved_tokens <= may_take[0], (
                f"the look-ahead reserved {reserved_tokens} tokens; its sequences may take {may_take[0]}")
            return schedule_ahead(reserved_tokens)

        def launched(scheduled, step, rows):
            coverage["chunked-prefill splits"] += sum(not item.samples for item in scheduled)
            coverage["grammar-refused drafts"] += sum(_refused(row) for row in rows)
            coverage["padded bucketed steps"] += step.bucket is not None and (len(scheduled) < step.bucket[0] or any(
                1 + item.num_draft < step.bucket[1] for item in scheduled))
            return launch(scheduled, step, rows)

        def verdict(num_draft: int, num_accepted: int) -> None:
            coverage["full acceptance"] += num_draft > 0 and num_accepted == num_draft
            coverage["partial acceptance"] += 0 < num_accepted < num_draft
            observe(num_draft, num_accepted)

        def trimmed(seq, tokens: list[int], drawn: bool) -> list[int]:
            kept = trim(seq, tokens, drawn)
            coverage["grammar-refused drafts"] += len(tokens) - len(kept)
            return kept

        engine.execution.launch, engine.load_control.observe, engine._grammar_drafts = launched, verdict, trimmed
        engine._plan_ahead, engine.scheduler.schedule_ahead = planned_ahead, scheduled_ahead

    def after_step(self) -> None:
        for what, _ in self.engine.events:
            self.coverage["overlap rebuilds"] += what.startswith("rebuilt")
            self.coverage["look-ahead preemptions"] += what == "preempted by a look-ahead decode row"
        self.engine.events.clear()


def _refused(row) -> int:
    """Drafts of a constrained (sampled) row its grammar mask forbids: the verifier must reject them."""
    if row.allowed is None:
        return 0
    return sum(not _allowed(row.allowed[j], token) for j, token in enumerate(row.draft_token_ids))


def _allowed(words: torch.Tensor, token: int) -> bool:
    return bool((int(words[token // 32]) >> (token % 32)) & 1)


# -- the bed: models, engines, references, the judge -------------------------------------------


class FuzzBed:
    """The target (a tiny random llama sharp enough that greedy continuations repeat and logits sit
    far from ties), its drafts and heads, the reference outputs, and ``check``. ``head_dirs``: a head
    folder per head method (``HEAD_PROPOSERS``) the target has."""

    def __init__(self, target_dir: Path, target, noisy_draft_dir: str | None, head_dirs: dict[str, str],
                 full_forward):
        self.target_dir = target_dir
        self.model, self.tokenizer = target
        self.draft_dirs = {"draft-same": str(target_dir), "draft-noisy": noisy_draft_dir}
        self.head_dirs = head_dirs
        self.full_forward = full_forward
        self._references: dict[tuple, list[Completion]] = {}
        self._reference_engines: dict[int, LLMEngine] = {}

    def workload(self, seed: int, axes: Axes) -> Workload:
        return make_workload(seed, axes, self.model.config.vocab_size, self.tokenizer.decode)

    def check(self, seed: int, axes: Axes) -> Coverage:
        """Run workload ``seed`` under ``axes``; AssertionError naming what broke."""
        workload = self.workload(seed, axes)
        coverage = Coverage()
        engine = self.engine(workload)
        try:
            outcomes = run_workload(engine, workload, coverage)
            self.judge(workload, outcomes)
            assert_all_released(engine)
        finally:
            engine.shutdown()
        return coverage

    def engine(self, workload: Workload) -> LLMEngine:
        cfg = engine_config(self.target_dir, workload, self.draft_dirs, self.head_dirs)
        if workload.axes.stages > 1:
            from pipeline_harness import in_process_pipeline_engine

            return in_process_pipeline_engine(cfg)[0]
        return LLMEngine(self.model, self.tokenizer, cfg, 2048, torch.device("cpu"), torch.float32)

    def reference(self, request: FuzzRequest, block_size: int) -> list[Completion]:
        """The request alone, no speculation, no overlap (cached: it depends on nothing else)."""
        key = (block_size, request.prompt, request.params)
        if key not in self._references:
            engine = self._reference_engines.get(block_size)
            if engine is None:
                cfg = EngineConfig(cache=CacheConfig(block_size=block_size, num_blocks=256),
                                   scheduler=SchedulerConfig(max_num_batched_tokens=512, overlap=False),
                                   speculative=SpeculativeConfig(grammar_drafts=False))  # no drafts at all
                engine = LLMEngine(self.model, self.tokenizer, cfg, 2048, torch.device("cpu"), torch.float32)
                self._reference_engines[block_size] = engine
            alone = FuzzRequest("reference", request.prompt, request.params, 0, None)
            try:
                self._references[key] = run_workload(engine, Workload(0, None, None, (alone,)))["reference"].completions
            except BaseException:
                del self._reference_engines[block_size]  # a failed run leaves its request behind
                raise
        return self._references[key]

    def judge(self, workload: Workload, outcomes: dict[str, Outcome]) -> None:
        for request in workload.requests:
            outcome = outcomes[request.request_id]
            reference = self.reference(request, workload.shape.block_size)
            try:
                Judge(self, request, workload.axes, reference).check(outcome)
            except AssertionError as exc:
                raise AssertionError(f"request {request.request_id} ({request}): {exc}") from None


def engine_config(target_dir: Path, workload: Workload, draft_dirs: dict[str, str], head_dirs: dict[str, str],
                  parallel: ParallelConfig | None = None) -> EngineConfig:
    """The workload's engine; ``parallel`` for real process groups (else the axes' in-process stages)."""
    axes, shape = workload.axes, workload.shape
    spec: dict = {"num_speculative_tokens": shape.k, "verify": axes.strategy, "grammar_drafts": shape.grammar_drafts}
    if axes.proposer.startswith("draft"):
        spec |= {"method": "draft", "draft_model": draft_dirs[axes.proposer]}
    elif axes.proposer in HEAD_PROPOSERS:
        spec |= {"method": axes.proposer, f"{axes.proposer}_path": head_dirs[axes.proposer],
                 "gates": ["mtp-pipeline-parallel"] if axes.stages > 1 else []}
    else:
        spec["method"] = axes.proposer
    return EngineConfig(
        load=LoadConfig(model=str(target_dir), weight_cache_dir=None, device="cpu", dtype="float32"),
        cache=CacheConfig(block_size=shape.block_size, num_blocks=shape.num_blocks, enable_prefix_caching=True),
        scheduler=SchedulerConfig(max_num_batched_tokens=shape.budget, max_num_seqs=shape.max_seqs,
                                  overlap=axes.overlap),
        speculative=SpeculativeConfig(**spec),
        parallel=parallel or ParallelConfig(pipeline_parallel_size=axes.stages),
        graphs=GraphConfig(batch_buckets=shape.buckets and (parallel is None or parallel.world_size == 1)),
    )


def assert_all_released(engine: LLMEngine) -> None:
    """Nothing runs or waits, and every KV block is free: the target's pool and a draft model's."""
    assert not engine.has_unfinished() and not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks, (
        f"{engine.blocks.num_blocks - engine.blocks.num_free_blocks} KV blocks still held")
    assert not any(engine.blocks.ref_counts), "a block is still referenced"
    draft_blocks = getattr(engine.proposer, "blocks", None)
    if draft_blocks is not None:
        assert draft_blocks.num_free_blocks == draft_blocks.num_blocks, "the draft model's KV blocks are still held"


class Judge:
    """One request's outcome against its reference (see the module docstring)."""

    def __init__(self, bed: FuzzBed, request: FuzzRequest, axes: Axes, reference: list[Completion]):
        self.bed, self.request, self.axes, self.reference = bed, request, axes, reference
        self.params = request.params

    def check(self, outcome: Outcome) -> None:
        assert outcome.after_finish == 0, "output after the finished one"
        if not outcome.aborted:
            assert outcome.finished_outputs == 1, f"{outcome.finished_outputs} finished outputs (request lost?)"
        for index, (got, expected) in enumerate(zip(outcome.completions, self.reference)):
            self._invariants(got, outcome.aborted)
            if self._comparable():
                self._compare(index, got, expected, outcome.aborted)

    def _comparable(self) -> bool:
        p = self.params
        return p.greedy or self.axes.strategy in LOSSLESS_PER_SEED or p.num_speculative_tokens == 0

    def _invariants(self, got: Completion, aborted: bool) -> None:
        p = self.params
        assert len(got.tokens) <= p.max_tokens, f"{len(got.tokens)} tokens > max_tokens {p.max_tokens}"
        if not aborted:
            assert got.finish_reason is not None, "a completion never finished"
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.bed.tokenizer.eos_token_ids))
        assert not stops & set(got.tokens[:-1]), f"tokens after a stop token: {got.tokens}"
        assert not any(s in got.text for s in p.stop), f"stop string in the text {got.text!r}"
        if got.finish_reason is FinishReason.LENGTH:
            assert len(got.tokens) == p.max_tokens, "length finish before max_tokens"
        if p.structured is not None and not aborted:
            assert got.finish_reason is not FinishReason.ABORT, "a constrained output ended in abort"
            if got.finish_reason is FinishReason.STOP:
                assert re.fullmatch(REGEX, got.text), f"constrained output {got.text!r} does not match {REGEX}"

    def _compare(self, index: int, got: Completion, expected: Completion, aborted: bool) -> None:
        n = len(got.tokens) if aborted else max(len(got.tokens), len(expected.tokens))
        for i in range(n):
            if i >= len(expected.tokens) or i >= len(got.tokens) or got.tokens[i] != expected.tokens[i]:
                self._near_tie(index, got.tokens, expected.tokens, i)
                return  # after a proven near-tie the two continuations may differ anywhere
        if not aborted:
            assert got.finish_reason == expected.finish_reason, (
                f"completion {index}: finish {got.finish_reason} vs the reference's {expected.finish_reason}")

    def _near_tie(self, index: int, got: list[int], expected: list[int], i: int) -> None:
        """Outputs first differ at ``i``: only a floating-point near-tie excuses it — for greedy, the
        top two processed logits; for seeded sampling, the draw on a CDF boundary between the two."""
        message = f"completion {index} differs from the reference at {i}: {got} vs {expected}"
        assert i < len(got) and i < len(expected), message
        logits = self._processed_logits(got[:i])
        if self.params.greedy:
            (top1, top2), ids = logits.topk(2)
            gap = float((top1 - top2) / top1.abs())
            assert {got[i], expected[i]} == set(ids.tolist()) and gap < 1e-4, f"{message} (no near-tie: gap {gap:.2e})"
            return
        probs = sampling_probs(logits[None], [self.params])[0].double()
        key = torch.tensor([self.params.seed + index]), torch.tensor([len(self.request.prompt) + i])
        threshold = rng.device_uniforms(*key, 1, rng.Stream.SAMPLE).item() * probs.sum()
        upper = probs.cumsum(0)
        lower = upper - probs
        drawn = ((lower - SAMPLING_TIE <= threshold) & (threshold < upper + SAMPLING_TIE) & (probs > 0)).nonzero()
        assert {got[i], expected[i]} <= set(drawn[:, 0].tolist()), (
            f"{message} (no near-tie: the draw {float(threshold):.8f} picks only {drawn[:, 0].tolist()})")

    def _processed_logits(self, emitted: list[int]) -> torch.Tensor:  # [V]
        """The target's last logits after ``emitted``, with the request's penalties, bias and grammar."""
        p = self.params
        logits = self.bed.full_forward(self.bed.model, list(self.request.prompt) + emitted)[-1].clone()
        if emitted:
            counts = torch.bincount(torch.tensor(emitted), minlength=logits.shape[0]).to(logits.dtype)
            logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        for token, bias in p.logit_bias:
            logits[token] += bias
        if p.structured is not None:
            logits = logits.masked_fill(~self._grammar_allows(emitted), float("-inf"))
        return logits

    def _grammar_allows(self, emitted: list[int]) -> torch.Tensor:  # [V] bool
        compiler = self.bed._reference_engines[next(iter(self.bed._reference_engines))].grammars
        grammar = compiler.grammar(self.params.structured)
        for token in emitted:
            assert grammar.advance(token)
        words = compiler.fill_masks([(grammar, 0, [])], 1)[0]
        vocab = self.bed.model.config.vocab_size
        return torch.tensor([_allowed(words, t) for t in range(vocab)])

