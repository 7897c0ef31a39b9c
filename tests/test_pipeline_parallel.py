"""Pipeline parallelism as real process groups (gloo), each under a hard deadline that kills its tree.

- Greedy output of (TP, PP) ∈ {(1, 2), (2, 2)} equals TP = 1, PP = 1 (the in-process engine) for
  every proposer — none (a per-request cap of 0), n-gram, suffix, a draft model, MTP heads and an
  EAGLE-3 head with the gate — with overlap on and off, on a batch of mixed lengths with chunked
  prefill, drafts rejected and accepted. One spawned driver per layout runs the proposers' groups
  one after another. The target has 3 layers (2 on the first stage, 1 on the last), so the EAGLE-3
  head's aux layers 0, 1 and 2 lie on both stages; its last stage observes the aux states of the
  whole model's forward (in one process, ``pipeline_harness``).
- Every stage holds only its layers' parameters and KV pools, and runs the positions and KV slots
  rank 0 derived from the verdicts: after a rejection the next step's positions on every stage
  start where the accepted tokens end (``--trace-steps``).
- The verdict message stays within R·(K+1) tokens + 2R counts (+ R·K drafts).
- Prompt logprobs are refused under PP, naming it.
- Structured outputs: rank 0 sends each constrained row's grammar mask to the last stage, so greedy
  output under a grammar equals TP = 1, PP = 1 for every proposer.
- Overlap by recorded event order; each head (MTP, EAGLE-3) × PP warns once with the gate and is
  refused without it; a killed rank brings every rank down with a non-zero exit, rank 0's /health
  answering 503 first; so does a failure on rank 0 between a step's launch and the reading of its
  verdicts, within 15 s; a taken rendezvous port fails at once.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from local_process import descendants, free_port, is_worker, kill_group, run_group, running, start_serve, wait_ready
from pydantic import ValidationError

from specdecode.runtime.config import (
    HEAD_METHODS,
    MTP_PIPELINE_WARNING,
    CacheConfig,
    EngineConfig,
    LoadConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from specdecode.runtime.engine.model_runner import ModelRunner, Span, build_attention_batch
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.models.loader import load_model

from conftest import write_sharp_draft

K = 3
PP2 = ("--pipeline-parallel-size", "2")
BUDGET = 24  # tokens per step: the longest prompt is prefilled in chunks
TEXTS = ["a b a b a b a b", "Hello", "one two three one two three one two three one two three four five six seven"]
MAX_TOKENS = [12, 7, 10]  # sequences finish at different steps while others run
SAMPLED = dict(temperature=0.8, presence_penalty=0.5)  # with seed 100 + i: target_match gives exactly the no-spec tokens
GRAMMAR = r"[a-z]{1,5}( [a-z]{1,5})*\."  # a regex the greedy "grammar" requests follow
# Rank 0 in a subprocess: per speculative config, a group; in it, every prompt with speculation
# capped to 0 (plain decoding) and with it on, overlap on and then off; prints JSON per config.
DRIVER = textwrap.dedent("""
    import json, sys
    from specdecode.runtime.config import EngineConfig
    from specdecode.runtime.engine.async_engine import AsyncEngine
    from specdecode.runtime.engine.grammar import StructuredKind, StructuredOutput
    from specdecode.runtime.engine.sequence import SamplingParams

    def run(engine, prompts, max_tokens, overlap):
        engine.overlap = overlap
        engine.events.clear()
        out, logprobs, finished, after_finish = {}, {}, set(), 0
        kinds = {"plain": dict(num_speculative_tokens=0),  # proposer "none"
                 "spec": dict(logprobs=2),  # speculating, with logprobs
                 "sampled": dict(temperature=0.8, presence_penalty=0.5),  # seeded: see SAMPLED
                 "grammar": dict(ignore_eos=False, structured=StructuredOutput(StructuredKind.REGEX, GRAMMAR))}
        for name, extra in kinds.items():
            for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
                params = SamplingParams(**{"max_tokens": n, "temperature": 0.0, "ignore_eos": True, "seed": 100 + i,
                                           **extra})
                engine.add_request(f"{name}/{i}", prompt, params)
                out[f"{name}/{i}"], logprobs[f"{name}/{i}"] = [], []
        while engine.has_unfinished():
            for o in engine.step():
                after_finish += o.request_id in finished
                out[o.request_id] += [t for d in o.deltas for t in d.token_ids]
                logprobs[o.request_id] += [(lp.token_id, len(lp.top)) for d in o.deltas for lp in d.logprobs]
                if o.finished:
                    finished.add(o.request_id)
        names = tuple(kinds)
        logprobs_ok = all(logprobs[r] == [(t, 2) for t in out[r]] for r in out if r.startswith("spec"))
        return {"outputs": {n: [out[f"{n}/{i}"] for i in range(len(prompts))] for n in names},
                "events": list(engine.events), "after_finish": after_finish, "logprobs_ok": logprobs_ok}

    def prompt_logprobs_refusal(engine, prompt):
        try:
            engine.add_request("prompt-logprobs", prompt, SamplingParams(max_tokens=1, prompt_logprobs=1))
        except ValueError as exc:
            return str(exc)
        return None

    GRAMMAR = {grammar!r}

    if __name__ == "__main__":
        configs, prompts, max_tokens = (json.loads(a) for a in sys.argv[1:4])
        for raw in configs:
            cfg = EngineConfig.model_validate_json(raw)
            async_engine = AsyncEngine.from_config(cfg)
            engine = async_engine.engine
            try:
                result = {"method": cfg.speculative.method.value,
                          "runs": {str(o): run(engine, prompts, max_tokens, o) for o in (True, False)},
                          "drafts": engine.spec.num_draft_tokens, "accepted": engine.spec.num_accepted_tokens,
                          "prompt_logprobs_refusal": prompt_logprobs_refusal(engine, prompts[0]),
                          "stats": vars(engine.execution.stats) if hasattr(engine.execution, "stats") else None}
            finally:
                async_engine.shutdown()
            print("RESULT " + json.dumps(result), flush=True)
""").replace("{grammar!r}", repr(GRAMMAR))


def _specs(draft_dir: str, mtp_dir: str, eagle3_dir: str) -> list[dict]:
    base = {"num_speculative_tokens": K, "verify": "greedy"}
    return [
        {**base, "method": "ngram"},
        {**base, "method": "suffix", "verify": "target_match"},
        {**base, "method": "draft", "draft_model": draft_dir, "verify": "rejection"},
        {**base, "method": "mtp", "mtp_path": mtp_dir, "gates": ["mtp-pipeline-parallel"]},
        {**base, "method": "eagle3", "eagle3_path": eagle3_dir, "gates": ["mtp-pipeline-parallel"]},
    ]


def _config(model: Path, spec: dict, tp: int, pp: int, trace: Path | None = None) -> EngineConfig:
    return EngineConfig(
        load=LoadConfig(model=str(model), weight_cache_dir=None, device="cpu", dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=8),
        scheduler=SchedulerConfig(max_num_batched_tokens=BUDGET),
        speculative=SpeculativeConfig(**spec),
        parallel=ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, rendezvous_timeout_s=60,
                                collective_timeout_s=60, trace_dir=trace),
    )


@pytest.fixture(scope="module")
def target_dir(sharp3_target_dir) -> Path:
    return sharp3_target_dir


@pytest.fixture(scope="module")
def target(target_dir):
    loaded = load_model(LoadConfig(model=str(target_dir), weight_cache_dir=None))
    return loaded.model, loaded.tokenizer


@pytest.fixture(scope="module")
def draft_dir(target_dir, tmp_path_factory) -> str:
    return write_sharp_draft(target_dir, tmp_path_factory.mktemp("sharp3-draft"))


@pytest.fixture(scope="module")
def mtp_dir(target, write_random_mtp_head, tmp_path_factory) -> str:
    return write_random_mtp_head(target[0], tmp_path_factory.mktemp("sharp3-mtp"))


@pytest.fixture(scope="module")
def eagle3_dir(sharp3_eagle3_dir) -> str:
    return sharp3_eagle3_dir


@pytest.fixture(scope="module")
def prompts(target, full_forward) -> list[list[int]]:
    """Mixed lengths (the last one prefilled in chunks); the first ends in the model's own greedy
    continuation, which n-gram and suffix drafts follow."""
    model, tok = target
    out = [tok.encode(t) for t in TEXTS]
    for _ in range(6):
        out[0].append(int(full_forward(model, out[0])[-1].argmax()))
    return out


@pytest.fixture(scope="module")
def expected(target, prompts, make_engine) -> list[list[int]]:
    """TP = 1, PP = 1, no speculation, in this process."""
    return _generate(make_engine(*target, budget=BUDGET), prompts)


@pytest.fixture(scope="module")
def expected_sampled(target, prompts, make_engine) -> list[list[int]]:
    """TP = 1, PP = 1, no speculation, seeded sampling with a presence penalty."""
    return _generate(make_engine(*target, budget=BUDGET), prompts, **SAMPLED)


def _generate(engine, prompts: list[list[int]], **sampling) -> list[list[int]]:
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS)):
        params = SamplingParams(**{"max_tokens": n, "temperature": 0.0, "ignore_eos": True, "seed": 100 + i, **sampling})
        engine.add_request(str(i), prompt, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += [t for d in o.deltas for t in d.token_ids]
    return [out[str(i)] for i in range(len(prompts))]


def _run_layout(tp: int, pp: int, model: Path, specs: list[dict], prompts, tmp: Path, deadline_s: float) -> dict:
    configs = [_config(model, spec, tp, pp, tmp / f"trace-{spec['method']}").model_dump_json() for spec in specs]
    done = run_group([sys.executable, "-P", "-c", DRIVER, json.dumps(configs), json.dumps(prompts),
                      json.dumps(MAX_TOKENS)], deadline_s, tmp)
    assert done.returncode == 0, done.stderr[-6000:]
    results = [json.loads(line.removeprefix("RESULT ")) for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    return {"results": {r["method"]: r for r in results}, "stderr": done.stderr}


@pytest.fixture(scope="module")
def layouts(target_dir, draft_dir, mtp_dir, eagle3_dir, prompts, tmp_path_factory) -> dict[tuple[int, int], dict]:
    """(TP, PP) → the driver's results and stderr; traces under ``tmp/trace-<method>``."""
    out = {}
    for tp, pp in ((1, 2), (2, 2)):
        tmp = tmp_path_factory.mktemp(f"tp{tp}pp{pp}")
        specs = _specs(draft_dir, mtp_dir, eagle3_dir)
        out[(tp, pp)] = {**_run_layout(tp, pp, target_dir, specs, prompts, tmp, 240), "dir": tmp}
    return out


# -- greedy equivalence -------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [(1, 2), (2, 2)], ids=["TP1xPP2", "TP2xPP2"])
def test_greedy_output_equals_tp1_pp1_for_every_proposer_with_overlap_on_and_off(
    layout, layouts, target, prompts, expected, assert_greedy_match
):
    results = layouts[layout]["results"]
    assert sorted(results) == ["draft", "eagle3", "mtp", "ngram", "suffix"]
    for method, result in results.items():
        for overlap, run in result["runs"].items():
            for name in ("plain", "spec"):  # plain = proposer "none" (cap 0)
                for prompt, want, got in zip(prompts, expected, run["outputs"][name]):
                    assert_greedy_match(target[0], prompt, want, got)
            assert run["after_finish"] == 0, (method, overlap)  # nothing emitted for a finished request
            assert run["logprobs_ok"], (method, overlap)  # one per emitted token, with its top-2, over the link
        assert result["drafts"] > 0, method
    accepted = {m: r["accepted"] / r["drafts"] for m, r in results.items()}
    assert any(0 < a < 1 for a in accepted.values()), accepted  # drafts both accepted and rejected


@pytest.mark.parametrize("layout", [(1, 2), (2, 2)], ids=["TP1xPP2", "TP2xPP2"])
def test_seeded_sampling_with_target_match_equals_tp1_pp1_no_spec_exactly(layout, layouts, expected_sampled):
    """The verifier's mirrors carry each request's seed, positions and output tokens (the presence
    penalty reads them): seeded target_match (what ``greedy`` means for sampled requests) emits
    exactly the no-spec tokens (rejection sampling, the draft group, is lossless in distribution only)."""
    for method in ("ngram", "suffix", "mtp", "eagle3"):
        for overlap, run in layouts[layout]["results"][method]["runs"].items():
            assert run["outputs"]["sampled"] == expected_sampled, (method, overlap)


@pytest.fixture(scope="module")
def expected_grammar(target, prompts, make_engine) -> list[list[int]]:
    """TP = 1, PP = 1, no speculation, greedy under ``GRAMMAR``."""
    from specdecode.runtime.engine.grammar import StructuredKind, StructuredOutput

    return _generate(make_engine(*target, budget=BUDGET), prompts, ignore_eos=False,
                     structured=StructuredOutput(StructuredKind.REGEX, GRAMMAR))


@pytest.mark.parametrize("layout", [(1, 2), (2, 2)], ids=["TP1xPP2", "TP2xPP2"])
def test_greedy_output_under_a_grammar_equals_tp1_pp1(layout, layouts, expected, expected_grammar):
    """The last stage verifies with the masks rank 0 computed from its grammar states (its own mirrors
    of the grammars only guide the draft model's and the heads' drafts)."""
    assert all(want != free for want, free in zip(expected_grammar, expected))  # the grammar changes every output
    for method, result in layouts[layout]["results"].items():
        for overlap, run in result["runs"].items():
            assert run["outputs"]["grammar"] == expected_grammar, (method, overlap)


@pytest.mark.parametrize("layout", [(1, 2), (2, 2)], ids=["TP1xPP2", "TP2xPP2"])
def test_prompt_logprobs_are_refused_naming_pipeline_parallelism(layout, layouts):
    """A request for prompt logprobs (echo with logprobs) is refused with a message naming pipeline
    parallelism, never answered without them."""
    for method, result in layouts[layout]["results"].items():
        assert result["prompt_logprobs_refusal"] == "prompt logprobs are not available with pipeline parallelism", method


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_tp1_pp1_reference_matches_with_overlap_on_and_off(proposer, target, prompts, expected, make_engine,
                                                           assert_greedy_match):
    """The (1, 1) corner of the matrix, in process (draft, MTP and EAGLE-3 at PP = 1: test_draft_proposer,
    test_mtp, test_eagle3_proposer)."""
    for overlap in (True, False):
        engine = make_engine(*target, budget=BUDGET, overlap=overlap,
                             spec={"method": proposer, "num_speculative_tokens": K, "verify": "greedy"})
        for prompt, want, got in zip(prompts, expected, _generate(engine, prompts)):
            assert_greedy_match(target[0], prompt, want, got)
        assert 0 < engine.spec.num_accepted_tokens < engine.spec.num_draft_tokens


# -- what each stage holds and runs -------------------------------------------------------------


def _trace(directory: Path) -> dict[int, list[dict]]:
    return {int(f.stem.removeprefix("rank")): [json.loads(line) for line in f.read_text().splitlines()]
            for f in sorted(directory.glob("rank*.jsonl"))}


@pytest.mark.parametrize("layout", [(1, 2), (2, 2)], ids=["TP1xPP2", "TP2xPP2"])
def test_each_rank_holds_only_its_stage_weights_and_kv(layout, layouts):
    tp, pp = layout
    for method in ("ngram", "mtp", "eagle3"):
        trace = _trace(layouts[layout]["dir"] / f"trace-{method}")
        assert sorted(trace) == list(range(tp * pp))
        for rank, records in trace.items():
            holds = records[0]
            assert holds["kind"] == "holds" and holds["stage"] == rank // tp
            params = set(holds["params"])
            layers = [[0, 1], [2]][rank // tp]  # 3 layers over 2 stages
            assert holds["kv_layers"] == len(layers) and holds["layers"] == layers
            local = {p.split(".")[2] for p in params if p.startswith("model.layers.")}
            assert local == {str(i) for i in range(len(layers))}  # local numbering
            first, last = rank // tp == 0, rank // tp == pp - 1
            heads = method in ("mtp", "eagle3")  # they embed their inputs on the last stage
            assert ("model.embed_tokens.weight" in params) == (first or (last and heads)), (rank, method)
            assert ("lm_head.weight" in params) == last and ("model.norm.weight" in params) == last


@pytest.mark.parametrize("layout", [(1, 2), (2, 2)], ids=["TP1xPP2", "TP2xPP2"])
def test_after_a_rejection_every_stage_runs_the_positions_and_slots_the_verdict_implies(layout, layouts):
    trace = _trace(layouts[layout]["dir"] / "trace-ngram")
    steps = {rank: [r for r in records if r["kind"] == "step"] for rank, records in trace.items()}
    counts = {len(s) for s in steps.values()}
    assert len(counts) == 1, counts  # every rank ran every step
    for i in range(counts.pop()):
        ran = {(tuple(s[i]["positions"]), tuple(s[i]["slots"])) for s in steps.values()}
        assert len(ran) == 1, f"stages disagree on step {i + 1}"
    rank0 = steps[0]
    rejections = 0
    for step, following in zip(rank0, rank0[1:]):
        items = {seq: (start, num, drafts) for seq, start, num, drafts in step["items"]}
        rows, offset = {}, 0
        for seq, start, num, _ in following["items"]:
            rows[seq] = (start, following["positions"][offset : offset + num])
            offset += num
        for seq, accepted, emitted in step["verdicts"]:
            start, num, drafts = items[seq]
            if accepted < drafts and seq in rows:  # drafts rejected on this step, the sequence runs the next
                rejections += 1
                next_start, positions = rows[seq]
                assert next_start == start + num - drafts + accepted  # its last emitted token is the next input
                assert positions == list(range(next_start, next_start + len(positions)))
    assert rejections > 0


@pytest.mark.parametrize("layout", [(1, 2), (2, 2)], ids=["TP1xPP2", "TP2xPP2"])
def test_the_verdict_message_stays_within_its_byte_budget(layout, layouts):
    for method, result in layouts[layout]["results"].items():
        stats = result["stats"]
        assert 0 < stats["verdict_bytes"] <= stats["verdict_budget_bytes"], (method, stats)
        assert stats["steps"] > 0 and stats["waiting_s"] > 0


def test_the_last_stage_observes_the_aux_states_of_the_whole_models_forward(target_dir, target, eagle3_dir, prompts):
    """Two stages in one process (``pipeline_harness``): stage 0 runs layers 0 and 1 and hands the
    streams entering them on with its hidden states, stage 1 appends the one entering layer 2; the
    EAGLE-3 head on stage 1 observes, for a prompt's prefill, exactly the whole model's aux states."""
    from pipeline_harness import in_process_pipeline_engine

    spec = {"method": "eagle3", "eagle3_path": eagle3_dir, "num_speculative_tokens": K,
            "gates": ["mtp-pipeline-parallel"]}
    engine, transport = in_process_pipeline_engine(_config(target_dir, spec, 1, 2))
    proposer = transport.workers[-1].tail.proposer
    observed, observe = [], proposer.observe
    proposer.observe = lambda scheduled, states: (observed.append(states.clone()), observe(scheduled, states))
    engine.add_request("0", prompts[2], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    whole = ModelRunner(target[0], num_blocks=4, block_size=8, device=torch.device("cpu"), dtype=torch.float32)
    whole.aux_layers = proposer.aux_layer_ids
    first = observed[0].shape[0]  # the first chunk of the prompt (the step budget is BUDGET tokens)
    batch = build_attention_batch([Span([0, 1, 2, 3], 0, first)], 8, 4, torch.device("cpu"))
    with torch.inference_mode():
        expected = whole.forward_aux(torch.tensor(prompts[2][:first]), batch)[1]  # [T, 3·hidden]
    assert proposer.aux_layer_ids == (0, 1, 2) and first == BUDGET
    torch.testing.assert_close(observed[0], expected, rtol=0, atol=0)


# -- overlap ------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", [(1, 2), (2, 2)], ids=["TP1xPP2", "TP2xPP2"])
def test_overlap_builds_the_next_inputs_before_reading_the_verdicts_and_no_overlap_after(layout, layouts):
    for method, result in layouts[layout]["results"].items():
        _check_event_order(result["runs"]["True"]["events"], overlap=True)
        _check_event_order(result["runs"]["False"]["events"], overlap=False)


def test_overlap_event_order_in_process(target, prompts, make_engine):
    for overlap in (True, False):
        engine = make_engine(*target, budget=BUDGET, overlap=overlap, spec={"method": "ngram", "num_speculative_tokens": K})
        _generate(engine, prompts)
        _check_event_order([list(e) for e in engine.events], overlap)


def _check_event_order(events: list[list], overlap: bool) -> None:
    position = {}
    for i, (what, step) in enumerate(events):
        position.setdefault((what, step), i)
    launched = sorted(step for what, step in position if what == "launched")
    assert len(launched) > 3
    for n in launched[:-1]:
        read = position[("verdicts read", n)]
        if overlap:
            ahead = position[("inputs built ahead", n + 1)]
            assert ahead < read, f"step {n + 1}'s inputs were not built before step {n}'s verdicts were read"
        else:
            assert ("inputs built ahead", n + 1) not in position
            assert position[("inputs built", n + 1)] > read
    if overlap:  # requests finish at different steps: their reserved rows were discarded, not run
        assert any(what.startswith("discarded seq") for what, _ in position)


# -- the gate -----------------------------------------------------------------------------------


def test_each_head_under_pipeline_parallelism_warns_once_with_the_gate(layouts):
    """One warning per group of a head method (MTP's, then EAGLE-3's), none for the other proposers."""
    assert layouts[(1, 2)]["stderr"].count(MTP_PIPELINE_WARNING) == len(HEAD_METHODS)


@pytest.mark.parametrize("method, path", [("mtp", "mtp_path"), ("eagle3", "eagle3_path")])
def test_a_head_under_pipeline_parallelism_is_refused_without_the_gate_and_allowed_with_it(method, path, target_dir,
                                                                                          mtp_dir, eagle3_dir):
    head = {"mtp_path": mtp_dir, "eagle3_path": eagle3_dir}[path]
    with pytest.raises(ValidationError, match=f"method '{method}' .* gate 'mtp-pipeline-parallel'"):
        _config(target_dir, {"method": method, path: head}, 1, 2)
    assert _config(target_dir, {"method": method, path: head, "gates": ["mtp-pipeline-parallel"]}, 1, 2)


# -- faults -------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
def test_killing_a_stage_mid_generation_brings_every_rank_down_non_zero_after_health_503(tiny_hf_model_dir, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = start_serve(tiny_hf_model_dir, port, log, *PP2, "--collective-timeout", "5")
    try:
        wait_ready(proc, url, log, timeout=60)
        (worker,) = [pid for pid in descendants(proc.pid) if is_worker(pid)]  # rank 1: the last stage
        body = {"prompt": "Hello world", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        streamed = threading.Event()

        def generate() -> None:
            try:
                with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as answer:
                    for _ in answer.iter_lines():
                        streamed.set()
            except httpx.HTTPError:
                pass

        client = threading.Thread(target=generate, daemon=True)
        client.start()
        assert streamed.wait(30), "no token streamed"
        os.kill(worker, signal.SIGKILL)  # mid-generation
        statuses = _health_until(url, lambda: proc.poll() is not None)
        assert 503 in statuses, statuses[-5:]
        assert proc.returncode != 0, log.read_text()[-4000:]
        assert not running(worker)
    finally:
        kill_group(proc)


def _health_until(url: str, done) -> list[int]:
    """/health's status codes, asked every 0.1 s until ``done()`` (no answer: nothing recorded)."""
    statuses = []
    while not done():
        try:
            statuses.append(httpx.get(url + "/health", timeout=2).status_code)
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    return statuses


# ``specdecode serve`` whose rank 0 raises in ``LLMEngine._plan_ahead`` once a sequence has 3 tokens
# (past the warm-up's 2): while the step it plans after runs on the stages, before its verdicts are read
FAULTY_PLAN_AHEAD = """
import sys
import time
from pathlib import Path

from specdecode.runtime.cli import main
from specdecode.runtime.engine.llm_engine import LLMEngine

plan_ahead = LLMEngine._plan_ahead


def failing_plan_ahead(self, plan):
    if any(item.seq.num_output_tokens >= 3 for item in plan.scheduled):
        Path({fault!r}).write_text(str(time.time()))
        raise RuntimeError("injected: planning ahead failed")
    return plan_ahead(self, plan)


if __name__ == "__main__":
    LLMEngine._plan_ahead = failing_plan_ahead
    sys.exit(main())
"""


@pytest.mark.timeout(90)
def test_a_fault_before_the_verdicts_are_read_brings_every_rank_down_non_zero_after_health_503(
        tiny_hf_model_dir, tmp_path):
    fault = tmp_path / "fault"
    launcher = tmp_path / "serve_with_fault.py"
    launcher.write_text(FAULTY_PLAN_AHEAD.format(fault=str(fault)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "serve.log"
    proc = start_serve(tiny_hf_model_dir, port, log, *PP2, launcher=launcher)  # overlap is on under PP
    try:
        wait_ready(proc, url, log, timeout=60)
        (worker,) = [pid for pid in descendants(proc.pid) if is_worker(pid)]  # rank 1: the last stage
        body = {"prompt": "Hello world", "max_tokens": 50, "temperature": 0, "ignore_eos": True, "stream": True}
        answer = httpx.post(url + "/v1/completions", json=body, timeout=30)  # the stream ends with the failed step
        assert fault.exists(), answer.text
        deadline = float(fault.read_text()) + 15  # every rank gone by then
        statuses = _health_until(url, lambda: (proc.poll() is not None and not running(worker))
                                 or time.time() >= deadline)
        assert 503 in statuses, statuses[-5:]
        assert proc.poll() is not None and proc.returncode != 0, log.read_text()[-4000:]
        assert not running(worker), "the last stage outlived rank 0"
    finally:
        kill_group(proc)


@pytest.mark.timeout(60)
def test_a_taken_rendezvous_port_fails_at_once_naming_it(tiny_hf_model_dir, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {"NNODES": "2", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        log = tmp_path / "serve.log"
        proc = start_serve(tiny_hf_model_dir, free_port(), log, *PP2, env=env)
        try:
            assert proc.wait(timeout=45) != 0
        finally:
            kill_group(proc)
    assert str(port) in log.read_text()
