"""GGUF loading: every quantization type round-trips, names/shapes/config map to HF, and logits
equal transformers' on tiny random llama (Q/K rows permuted by the writer) and qwen2 files."""
import gguf
import numpy as np
import pytest
import torch

from specdecode.runtime.config import LoadConfig
from specdecode.runtime.models.gguf_loader import open_gguf
from specdecode.runtime.models.loader import load_model

WRITABLE = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "TQ1_0", "TQ2_0", "MXFP4")
K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
ALL_TYPES = WRITABLE + K_QUANTS  # one per 2-D weight of the tiny untied model (16)
# llama: K-quants land on the embedding and layer 0's q/k, whose rows the file stores permuted.
TYPES_BY_ARCH = {"llama": tuple(reversed(ALL_TYPES)), "qwen2": ALL_TYPES}


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def tiny_file(request, tmp_path_factory, write_tiny_gguf):
    arch = request.param
    path = tmp_path_factory.mktemp(f"gguf-{arch}") / f"tiny-{arch}.gguf"
    cfg, expected = write_tiny_gguf(path, arch, TYPES_BY_ARCH[arch])
    return arch, path, cfg, expected


def test_writer_covers_every_type_gguf_can_quantize():
    x = np.random.default_rng(0).standard_normal((2, 256), dtype=np.float32)
    quantizable = set()
    for qtype in gguf.GGMLQuantizationType:
        try:
            gguf.quants.quantize(x, qtype)
        except (NotImplementedError, gguf.quants.QuantError):
            continue
        quantizable.add(qtype.name)
    assert quantizable <= set(WRITABLE)


def test_every_type_dequantizes_like_numpy(tiny_file):
    arch, path, cfg, expected = tiny_file
    ckpt = open_gguf(path)
    types = {t.tensor_type.name for t in ckpt.reader.tensors}
    assert set(ALL_TYPES) <= types
    got = dict(ckpt.weights(torch.float32))
    assert got.keys() == expected.keys()
    for name, want in expected.items():
        assert got[name].dtype == torch.float32 and got[name].shape == want.shape, name
        assert torch.equal(got[name], want), f"{name} differs ({arch})"


def test_weights_convert_to_requested_dtype(tiny_file):
    _, path, _, expected = tiny_file
    for name, tensor in open_gguf(path).weights(torch.bfloat16):
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, expected[name].to(torch.bfloat16)), name


def test_config_from_metadata(tiny_file):
    arch, path, cfg, _ = tiny_file
    hf = open_gguf(path).hf_config
    assert hf["model_type"] == arch
    assert (hf["vocab_size"], hf["hidden_size"], hf["intermediate_size"]) == (
        cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size)
    assert (hf["num_hidden_layers"], hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]) == (
        cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert hf["max_position_embeddings"] == 512 and hf["rope_theta"] == 10000.0
    assert hf["rms_norm_eps"] == pytest.approx(1e-5)
    assert hf["tie_word_embeddings"] is False
    assert hf["attention_bias"] is (arch == "qwen2")


def test_tied_embeddings_when_no_output_tensor(tmp_path, write_tiny_gguf):
    path = tmp_path / "tied.gguf"
    write_tiny_gguf(path, "qwen2", ("Q8_0",), tied=True)
    ckpt = open_gguf(path)
    assert ckpt.hf_config["tie_word_embeddings"] is True
    assert "output.weight" not in {t.name for t in ckpt.reader.tensors}
    loaded = load_model(LoadConfig(model=str(path), weight_cache_dir=None))
    assert loaded.model.lm_head is None


def test_logits_match_transformers_gguf_loader(tiny_file, full_forward, fast_transformers_gguf):
    """transformers dequantizes and un-permutes the same file its own way: logits must agree."""
    from transformers import AutoModelForCausalLM

    arch, path, _, _ = tiny_file
    ours = load_model(LoadConfig(model=str(path), weight_cache_dir=None, device="cpu", dtype="float32"))
    theirs = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = ours.tokenizer.encode("def add(a, b):\n    return a + b  # the quick brown fox")
    assert len(ids) > 10
    with torch.inference_mode():
        want = theirs(torch.tensor([ids])).logits[0].float()
    got = full_forward(ours.model, ids)
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
    assert rel < 1e-5, f"{arch}: max relative error {rel:.2e}"


def test_unpermuted_llama_equals_original_weights(tmp_path, write_tiny_gguf, full_forward):
    """An F32 llama file (Q/K permuted as llama.cpp writes them) gives the original model's logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path / "f32.gguf"
    cfg, expected = write_tiny_gguf(path, "llama", ("F32",), hidden=64, intermediate=128)
    reference = LlamaForCausalLM(LlamaConfig(**cfg.to_hf())).eval()
    reference.load_state_dict(expected)  # F32: exactly the random HF-layout weights
    ours = load_model(LoadConfig(model=str(path), weight_cache_dir=None))
    ids = list(range(3, 40))
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    got = full_forward(ours.model, ids)
    assert ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item() < 1e-5


def test_bad_files_raise_clear_errors(tmp_path, write_tiny_gguf):
    with pytest.raises(FileNotFoundError):
        open_gguf(tmp_path / "missing.gguf")
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="GGUF"):
        open_gguf(junk)
    other = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(other), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        open_gguf(other)
