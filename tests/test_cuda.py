"""On a CUDA device (``-m gpu``; skipped without one): the Triton kernels compiled for the GPU
equal their torch references, the lossless strategies keep the target distribution there, and
the engine on CUDA gives the no-spec greedy output with every proposer and lossless strategy (MTP
and EAGLE-3 heads with and without batch buckets too).

Run with ``TRITON_INTERPRET=0`` (scripts/gpu_check.sh does): conftest.py turns the interpreter on
by default, and these tests are about what the compiler makes of the kernels.

Kernel equality is exact: probabilities are multiples of 2**-20 (``dyadic``), so every partial
sum is exact in fp32 whatever order a kernel adds in, and the sampling rule cannot round
differently on the two paths.
"""
import itertools
import json
import os

import pytest
import torch
from safetensors.torch import save_file

from specdecode.kernels import PLACEHOLDER_TOKEN_ID
from specdecode.kernels import ngram as kn
from specdecode.kernels import sampling as ks
from specdecode.kernels import verify as kv
from specdecode.bench.kernels import dyadic
from specdecode.runtime.config import Device, DType, LoadConfig
from specdecode.runtime.engine.sequence import SamplingParams
from specdecode.runtime.models.loader import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

P = PLACEHOLDER_TOKEN_ID
CUDA = torch.device("cuda")
LOSSLESS = ["greedy", "target_match", "rejection"]


@pytest.fixture(scope="module", autouse=True)
def _compiled_triton():
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.fail("TRITON_INTERPRET is on: run the gpu tier with TRITON_INTERPRET=0")


# ---------------------------------------------------------------- kernels


def _verify_case(seed: int, B: int, K: int, V: int):
    """Peaked dyadic p [B, K+1, V] and q [B, K, V], uniforms, drafts drawn from q (often accepted)
    or the argmax of p (for greedy), num_draft_tokens covering 0..K, all on CUDA."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    p = dyadic((3 * torch.randn(B, K + 1, V, generator=gen, device=CUDA)).softmax(-1))
    q = dyadic((3 * torch.randn(B, K, V, generator=gen, device=CUDA)).softmax(-1))
    sample_u = torch.rand(B, K + 1, generator=gen, device=CUDA)
    accept_u = torch.rand(B, K, generator=gen, device=CUDA)
    num = torch.randint(0, K + 1, (B,), generator=gen, device=CUDA)
    num[0], num[-1] = 0, K
    padding = torch.arange(K, device=CUDA)[None, :] >= num[:, None]
    from_q = ks.inverse_cdf_sample_reference(q.reshape(-1, V), torch.rand(B * K, generator=gen, device=CUDA))
    drafts = from_q.view(B, K).masked_fill(padding, P)
    argmax_drafts = p[:, :K].argmax(-1).masked_fill(padding, P)
    flip = torch.rand(B, K, generator=gen, device=CUDA) < 0.2  # some greedy drafts wrong
    argmax_drafts = torch.where(flip & ~padding, (argmax_drafts + 1) % V, argmax_drafts)
    top_p = torch.rand(B, generator=gen, device=CUDA)
    return drafts, argmax_drafts, num, p, q, accept_u, sample_u, top_p


def _same(name: str, triton_out: torch.Tensor, reference_out: torch.Tensor) -> None:
    assert triton_out.is_cuda
    assert torch.equal(triton_out, reference_out), f"{name}:\ntriton {triton_out}\nreference {reference_out}"


@pytest.mark.parametrize(
    "B,K,V", [(4, 4, 48), (16, 1, 1000), (33, 7, 5000), (8, 4, 32_000), (3, 4, 151_936), (5, 0, 100), (64, 16, 64)]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_verify_kernels_equal_reference(seed, B, K, V):
    drafts, argmax_drafts, num, p, q, accept_u, sample_u, top_p = _verify_case(seed, B, K, V)
    cases = {
        "greedy": ("greedy_verify", (argmax_drafts, num, p.argmax(-1))),
        "target_match": ("target_match_verify", (drafts, num, p, sample_u)),
        "rejection": ("rejection_verify", (drafts, num, p, q, accept_u, sample_u)),
        "rejection_one_hot": ("rejection_verify", (drafts, num, p, None, accept_u, sample_u)),
        "topp": ("topp_verify", (drafts, num, p, top_p, sample_u)),
    }
    accepted = 0
    for name, (fn, args) in cases.items():
        reference = getattr(kv, f"{fn}_reference")(*args)
        _same(name, getattr(kv, fn)(*args), reference)  # the dispatcher picks Triton for CUDA tensors
        if V <= 5000 and fn != "greedy_verify":
            _same(f"{name} block_v=16", getattr(kv, f"{fn}_triton")(*args, block_v=16), reference)
        accepted += int((reference != P).sum() - B)
    assert K == 0 or accepted > 0  # the cases exercise acceptance, not only rejection


@pytest.mark.parametrize("N,V", [(1, 1), (7, 3), (1000, 257), (64, 151_936)])
def test_inverse_cdf_sample_equals_reference(N, V):
    gen = torch.Generator(device=CUDA).manual_seed(N)
    weights = torch.rand(N, V, generator=gen, device=CUDA).pow(3)
    probs = dyadic(weights / weights.sum(-1, keepdim=True))  # rows summing to ~1: every partial sum exact
    probs[0, : V // 2] = 0.0  # a zero-weight prefix
    if N > 1:
        probs[1] = 0.0  # an all-zero row samples token 0
    uniforms = torch.rand(N, generator=gen, device=CUDA)
    uniforms[-1] = 1.0 - 2.0**-24  # u near 1 never picks a zero-weight token past the end
    _same("inverse_cdf_sample", ks.inverse_cdf_sample(probs, uniforms), ks.inverse_cdf_sample_reference(probs, uniforms))


def test_ngram_kernel_edge_cases_on_cuda():
    from test_kernels_ngram import EDGE_CASES, _batch

    for name, row, min_n, max_n, k, expected in EDGE_CASES:
        tokens, lengths = _batch([row], pad=5)
        drafts, num = kn.ngram_propose(tokens.to(CUDA), lengths.to(CUDA), min_n, max_n, k)
        assert drafts.is_cuda and num.tolist() == [len(expected)], name
        assert drafts.tolist() == [expected + [P] * (k - len(expected))], name


@pytest.mark.parametrize("seed,B,L,vocab", [(0, 8, 40, 4), (1, 32, 700, 50), (2, 4, 4096, 8), (3, 64, 257, 3)])
def test_ngram_kernel_equals_reference(seed, B, L, vocab):
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    tokens = torch.randint(0, vocab, (B, L), generator=gen, device=CUDA)
    lengths = torch.randint(0, L + 1, (B,), generator=gen, device=CUDA)
    lengths[0] = L
    tokens[torch.arange(L, device=CUDA)[None, :] >= lengths[:, None]] = P
    for min_n, max_n, k in ((1, 4, 3), (2, 5, 8), (3, 3, 1)):
        reference = kn.ngram_propose_reference(tokens, lengths, min_n, max_n, k)
        for block_l in (16, 128):
            drafts, num = kn.ngram_propose_triton(tokens, lengths, min_n, max_n, k, block_l=block_l)
            _same(f"drafts n={min_n}..{max_n} k={k}", drafts, reference[0])
            _same(f"num n={min_n}..{max_n} k={k}", num, reference[1])


@pytest.mark.parametrize("strategy", ["target_match", "rejection", "rejection_dense", "topp"])
def test_first_token_distribution_on_cuda(strategy, chi_square_p_value):
    """200k independent rows in one launch: the first emitted token follows p for lossless
    strategies (drafts: the runner-up, often rejected; or samples of a dense q); topp does not."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    n, K, V = 200_000, 2, 8
    p_row = (1.5 * torch.randn(K + 1, V, generator=gen, device=CUDA)).softmax(-1)  # [K+1, V]
    q_row = (1.5 * torch.randn(K, V, generator=gen, device=CUDA)).softmax(-1)  # [K, V]
    p, q = p_row.expand(n, K + 1, V).contiguous(), q_row.expand(n, K, V).contiguous()
    runner_up = int(p_row[0].topk(2).indices[1])
    drafts = torch.tensor([runner_up, 3], device=CUDA).expand(n, K).contiguous()
    if strategy == "rejection_dense":
        drafts = torch.multinomial(q_row, n, replacement=True, generator=gen).T.contiguous()  # [n, K] ~ q
    num = torch.full((n,), K, dtype=torch.long, device=CUDA)
    sample_u = torch.rand(n, K + 1, generator=gen, device=CUDA)
    accept_u = torch.rand(n, K, generator=gen, device=CUDA)
    if strategy == "target_match":
        out = kv.target_match_verify(drafts, num, p, sample_u)
    elif strategy == "topp":
        out = kv.topp_verify(drafts, num, p, torch.full((n,), 0.9, device=CUDA), sample_u)
    else:
        out = kv.rejection_verify(drafts, num, p, q if strategy == "rejection_dense" else None, accept_u, sample_u)
    counts = torch.bincount(out[:, 0], minlength=V).float().cpu()
    p_value = chi_square_p_value(counts, p_row[0].cpu())
    if strategy == "topp":
        assert p_value < 1e-6  # lossy, as documented
    else:
        assert p_value > 1e-3


# ---------------------------------------------------------------- the engine on CUDA


def _hf_folder(src, dst, weights: dict[str, torch.Tensor]) -> str:
    dst.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (dst / name).write_bytes((src / name).read_bytes())
    save_file(weights, str(dst / "model.safetensors"))
    return str(dst)


@pytest.fixture(scope="module")
def sharp_dirs(tiny_hf_model_dir, tmp_path_factory):
    """(target, draft) HF folders: the tiny fixture's tokenizer with large random weights (logits far
    from ties, so bf16 rounding cannot flip an argmax), and the same weights plus noise as draft."""
    from conftest import random_hf_weights

    from specdecode.runtime.models.model_config import ModelConfig

    config = json.loads((tiny_hf_model_dir / "config.json").read_text())
    cfg = ModelConfig.from_hf(config)
    weights = random_hf_weights(cfg, seed=3, std=0.4)
    gen = torch.Generator().manual_seed(4)
    noisy = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    root = tmp_path_factory.mktemp("sharp-cuda")
    return _hf_folder(tiny_hf_model_dir, root / "target", weights), _hf_folder(tiny_hf_model_dir, root / "draft", noisy)


def _load(path: str, dtype: DType):
    return load_model(LoadConfig(model=path, device=Device.CUDA, dtype=dtype, weight_cache_dir=None))


TEXTS = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "Once upon a time",
    "hello hello hello hello",
    "Q: What is 2+2?\nA: 4\nQ: What is 3+3?\nA:",
    "a b a b a b a b",
    "The capital of France is Paris. The capital of Italy is",
]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.BFLOAT16])
def test_engine_greedy_on_cuda_equals_no_spec(sharp_dirs, dtype, make_engine, run_all, assert_greedy_match):
    target_dir, draft_dir = sharp_dirs
    loaded = _load(target_dir, dtype)
    weight = next(loaded.model.parameters())
    assert weight.is_cuda
    torch_dtype = weight.dtype
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    expected = run_all(make_engine(loaded.model, loaded.tokenizer, device=CUDA, dtype=torch_dtype), prompts, GREEDY)
    methods = {
        "ngram": {"method": "ngram", "prompt_lookup_max": 3},
        "suffix": {"method": "suffix"},
        "draft": {"method": "draft", "draft_model": draft_dir},
    }
    for method, spec in methods.items():
        for verify in LOSSLESS:
            engine = make_engine(loaded.model, loaded.tokenizer, device=CUDA, dtype=torch_dtype, budget=48,
                                 spec={**spec, "num_speculative_tokens": 4, "verify": verify})
            got = run_all(engine, prompts, GREEDY)  # budget 48: prompts prefilled in chunks
            for prompt, want, have in zip(prompts, expected, got):
                assert_greedy_match(loaded.model, prompt, want, have)
            stats = engine.stats()
            assert stats.spec_decode_num_draft_tokens > 0, f"{method}/{verify} drafted nothing"
            if method == "draft":
                assert stats.spec_decode_num_accepted_tokens > 0
            assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.BFLOAT16])
def test_heads_on_cuda_equal_no_spec_with_and_without_buckets(sharp3_target_dir, sharp3_eagle3_dir,
                                                              write_random_mtp_head, tmp_path, dtype, make_engine,
                                                              run_all, assert_greedy_match):
    """MTP and EAGLE-3 heads (random: drafts accepted and rejected) on CUDA, every lossless strategy,
    prompts in chunks: the no-spec greedy output, with their drafting steps padded to the batch
    buckets too (the paged kernels over padding sequences of the null block)."""
    cpu_target = load_model(LoadConfig(model=str(sharp3_target_dir), weight_cache_dir=None)).model
    heads = {"mtp": {"method": "mtp", "mtp_path": write_random_mtp_head(cpu_target, tmp_path / "mtp")},
             "eagle3": {"method": "eagle3", "eagle3_path": sharp3_eagle3_dir}}
    loaded = _load(str(sharp3_target_dir), dtype)
    torch_dtype = next(loaded.model.parameters()).dtype
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    expected = run_all(make_engine(loaded.model, loaded.tokenizer, device=CUDA, dtype=torch_dtype), prompts, GREEDY)
    for (method, spec), verify, buckets in itertools.product(heads.items(), LOSSLESS, (False, True)):
        engine = make_engine(loaded.model, loaded.tokenizer, device=CUDA, dtype=torch_dtype, budget=48, buckets=buckets,
                             spec={**spec, "num_speculative_tokens": 3, "verify": verify})
        for prompt, want, have in zip(prompts, expected, run_all(engine, prompts, GREEDY)):
            assert_greedy_match(loaded.model, prompt, want, have)
        assert engine.stats().spec_decode_num_draft_tokens > 0, f"{method}/{verify} drafted nothing"
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_seeded_sampling_and_logprobs_on_cuda(sharp_dirs, make_engine, run_all):
    """target_match with a seed gives exactly the seeded no-spec tokens; logprobs under speculation
    equal the no-spec ones (fp32)."""
    loaded = _load(sharp_dirs[0], DType.FLOAT32)
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS[:4]]
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "verify": "target_match"}
    engine = make_engine(loaded.model, loaded.tokenizer, device=CUDA, spec=spec)
    assert run_all(engine, prompts, seeded) == run_all(make_engine(loaded.model, loaded.tokenizer, device=CUDA), prompts, seeded)
    assert engine.stats().spec_decode_num_draft_tokens > 0

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    logprobs = {}
    for name, spec in (("plain", None), ("ngram", {"method": "ngram", "num_speculative_tokens": 4})):
        engine = make_engine(loaded.model, loaded.tokenizer, device=CUDA, spec=spec)
        engine.add_request("r", prompts[0], params)
        logprobs[name] = []
        while engine.has_unfinished():
            for o in engine.step():
                for d in o.deltas:
                    logprobs[name] += d.logprobs
    assert len(logprobs["plain"]) == len(logprobs["ngram"]) == 16
    for a, b in zip(logprobs["plain"], logprobs["ngram"]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("dtype", [DType.FLOAT32, DType.BFLOAT16])
def test_cuda_graph_replay_equals_eager(sharp_dirs, dtype, make_engine, run_all, assert_greedy_match):
    """``cuda_graphs``: every bucketed decode/verify step replays its shape's graph (a draft model's
    single-token steps their own); the tokens equal the eager bucketed engine's bit for bit (the same
    kernels on the same shapes), and the unpadded engine's up to a proven near-tie; seeded sampling
    equal too."""
    loaded = _load(sharp_dirs[0], dtype)
    torch_dtype = next(loaded.model.parameters()).dtype
    prompts = [loaded.tokenizer.encode(t) for t in TEXTS]
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=7, ignore_eos=True)
    for spec in (None, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3},
                 {"method": "draft", "draft_model": sharp_dirs[1], "num_speculative_tokens": 3}):
        def engine(**graphs):
            return make_engine(loaded.model, loaded.tokenizer, device=CUDA, dtype=torch_dtype, spec=spec, budget=48,
                               **graphs)

        for params in (GREEDY, seeded):
            graphed = engine(cuda_graphs=True)
            got = run_all(graphed, prompts, params)
            assert got == run_all(engine(buckets=True), prompts, params)
            graphs = graphed.runner.graphs
            assert graphs.num_replays > len(graphs.captured) > 0  # graphs replayed again and again
            assert any(q > 1 for _, q in graphs.captured) == (spec is not None)
            if spec is not None and spec["method"] == "draft":  # the draft's single-token steps: graphs of its own
                assert graphed.proposer.runner.graphs.num_replays > 0
            if params is GREEDY:
                for prompt, want, have in zip(prompts, run_all(engine(), prompts, params), got):
                    assert_greedy_match(loaded.model, prompt, want, have)


# ---------------------------------------------------------------- paged attention kernels

# SmolLM2-135M's attention: 9 query heads over 3 kv heads, head_dim 64, the pool's 16-slot blocks
SMOLLM_ATTENTION = dict(block_size=16, num_heads=9, kv_heads=3, head_dim=64)


def _attention_paths_equal_reference(batch, decode: bool) -> torch.Tensor:
    """Every compiled path that takes the batch against the reference; the same outputs, bit for bit,
    when every slot no sequence may read holds NaN/inf. Returns the dispatcher's output."""
    from specdecode.kernels import paged_attention as pa
    from test_kernels_attention import _close, poisoned

    args, kwargs = batch.args(), batch.kwargs()
    reference = pa.paged_attention_reference(*args, **kwargs)
    dispatch = pa.paged_decode_attention if decode else pa.paged_prefill_attention
    paths = {
        "dispatcher": lambda b: dispatch(*b.args(), **kwargs),  # picks Triton for CUDA tensors
        "prefill block_m=128 block_n=128": lambda b: pa.paged_prefill_attention_triton(
            *b.args(), **kwargs, block_m=128, block_n=128),
        "prefill block_m=16 block_n=16": lambda b: pa.paged_prefill_attention_triton(
            *b.args(), **kwargs, block_m=16, block_n=16),
    }
    if decode:
        paths["prefill"] = lambda b: pa.paged_prefill_attention_triton(*b.args(), **kwargs)  # short rows mixed in
        paths["decode block_n=16"] = lambda b: pa.paged_decode_attention_triton(*b.args(), **kwargs, block_n=16)
    bad = poisoned(batch)
    for name, path in paths.items():
        out = path(batch)
        assert out.is_cuda, name
        _close(out, reference, name)
        dirty = path(bad)
        assert dirty.isfinite().all() and torch.equal(dirty, out), f"{name}: an unreadable slot changed the output"
    return paths["dispatcher"](batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_equals_reference(dtype):
    """32 sequences with 1k-token contexts: decode rows mixed with K+1 = 4 verify chains, sequences 0
    and 1 sharing a 960-token prefix, up to 2 hidden keys per sequence, partial last blocks."""
    from test_kernels_attention import make_batch

    gen = torch.Generator().manual_seed(0)
    lens = (1000 + torch.randint(0, 100, (32,), generator=gen)).tolist()
    seqs = [(n, 4 if b % 3 == 0 else 1) for b, n in enumerate(lens)]
    batch = make_batch(0, seqs, **SMOLLM_ATTENTION, dtype=dtype, shared_prefix_blocks=60, num_hidden=2, device=CUDA)
    assert batch.hidden_keys is not None and (batch.hidden_keys >= 0).any()
    _attention_paths_equal_reference(batch, decode=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [0, 2], ids=["no_hidden", "hidden"])
def test_paged_prefill_attention_equals_reference(dtype, hidden):
    """A 512-row chunk over a 1k cached prefix, a 300-row chunk sharing that prefix's first 1k tokens,
    a whole 37-token prompt, a verify chain and a decode row in one launch."""
    from test_kernels_attention import make_batch

    seqs = [(1024 + 512, 512), (1024 + 300, 300), (37, 37), (1100, 4), (1, 1)]
    batch = make_batch(1, seqs, **SMOLLM_ATTENTION, dtype=dtype, shared_prefix_blocks=64, num_hidden=hidden,
                       device=CUDA)
    _attention_paths_equal_reference(batch, decode=False)
