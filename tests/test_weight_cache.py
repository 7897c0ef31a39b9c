"""Weight cache: the first GGUF load writes an entry, the next is served from it (no GGUF parse,
no dequantization) with identical weights; cache off writes nothing; too little disk skips it."""
import logging
import shutil
from collections import namedtuple

import pytest
import torch
from safetensors import safe_open

from specdecode.runtime.config import LoadConfig
from specdecode.runtime.models import gguf_loader, weight_cache
from specdecode.runtime.models.loader import load_model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, write_tiny_gguf):
    path = tmp_path_factory.mktemp("cache-src") / "tiny.gguf"
    write_tiny_gguf(path, "llama", ("Q4_K", "Q8_0", "Q6_K"), hidden=256, intermediate=256)
    return path


def forbid_gguf_reading(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("the GGUF was read although the cache should have served it")

    monkeypatch.setattr(gguf_loader, "dequantize_tensor", boom)
    monkeypatch.setattr(gguf_loader, "GGUFReader", boom)


def state(loaded):
    return {k: v.clone() for k, v in loaded.model.state_dict().items()}


def test_second_load_hits_cache(tiny_gguf, tmp_path, monkeypatch):
    cfg = LoadConfig(model=str(tiny_gguf), weight_cache_dir=tmp_path / "cache")
    first = load_model(cfg)
    entries = list((tmp_path / "cache").iterdir())
    assert len(entries) == 1 and entries[0] == weight_cache.entry_path(tmp_path / "cache", tiny_gguf, torch.float32)
    with safe_open(entries[0] / "model.safetensors", framework="pt") as f:
        assert "model.layers.0.self_attn.q_proj.weight" in f.keys()

    forbid_gguf_reading(monkeypatch)
    second = load_model(cfg)
    a, b = state(first), state(second)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert second.config == first.config and second.name == first.name == "tiny"
    text = "<|im_start|>user\nhello world<|im_end|>"
    assert second.tokenizer.encode(text) == first.tokenizer.encode(text)
    assert second.tokenizer.eos_token_ids == first.tokenizer.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    assert second.tokenizer.apply_chat_template(messages) == first.tokenizer.apply_chat_template(messages)


def test_cache_is_keyed_by_dtype_and_file_identity(tiny_gguf, tmp_path):
    cache = tmp_path / "cache"
    load_model(LoadConfig(model=str(tiny_gguf), weight_cache_dir=cache, dtype="bfloat16"))
    bf16 = weight_cache.lookup(cache, tiny_gguf, torch.bfloat16)
    assert bf16 is not None and weight_cache.lookup(cache, tiny_gguf, torch.float32) is None
    with safe_open(bf16 / "model.safetensors", framework="pt") as f:
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    copy = tmp_path / "copy.gguf"
    shutil.copy(tiny_gguf, copy)  # same bytes, another file: its own entry
    assert weight_cache.lookup(cache, copy, torch.bfloat16) is None


def test_cache_off_writes_nothing(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    before = sorted(p.name for p in tmp_path.iterdir())
    load_model(LoadConfig(model=str(tiny_gguf), weight_cache_dir=None))
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert not list(tiny_gguf.parent.glob("*.safetensors"))


def test_insufficient_space_skips_caching(tiny_gguf, tmp_path, monkeypatch, caplog, full_forward):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 << 20, 10 << 20, 1 << 20))
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING):
        loaded = load_model(LoadConfig(model=str(tiny_gguf), weight_cache_dir=cache))
    assert "not caching" in caplog.text
    assert not cache.exists() or not any(cache.iterdir())
    uncached = load_model(LoadConfig(model=str(tiny_gguf), weight_cache_dir=None))
    ids = list(range(3, 30))
    assert torch.equal(full_forward(loaded.model, ids), full_forward(uncached.model, ids))


def test_failed_load_leaves_no_partial_entry(tiny_gguf, tmp_path, monkeypatch):
    real = gguf_loader.dequantize_tensor
    calls = []

    def fail_midway(tensor):
        calls.append(tensor.name)
        if len(calls) == 5:
            raise RuntimeError("simulated crash while dequantizing")
        return real(tensor)

    monkeypatch.setattr(gguf_loader, "dequantize_tensor", fail_midway)
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="simulated crash"):
        load_model(LoadConfig(model=str(tiny_gguf), weight_cache_dir=cache))
    assert list(cache.iterdir()) == []


def test_write_error_midway_keeps_loading(tiny_gguf, tmp_path, monkeypatch, caplog):
    """A disk that fills up during the write: the model still loads, no entry is left behind."""
    original = weight_cache._SafetensorsStream.write
    count = []

    def full_disk(self, name, tensor):
        count.append(name)
        if len(count) == 3:
            raise OSError(28, "No space left on device")
        return original(self, name, tensor)

    monkeypatch.setattr(weight_cache._SafetensorsStream, "write", full_disk)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.WARNING):
        loaded = load_model(LoadConfig(model=str(tiny_gguf), weight_cache_dir=cache))
    assert loaded.model is not None and "No space left" in caplog.text
    assert list(cache.iterdir()) == []
