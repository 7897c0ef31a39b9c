"""Fused model kernels (RMSNorm + residual, RoPE, SiLU·up): Triton under TRITON_INTERPRET=1 (set in
conftest.py) against the torch references, and the decoder block on the CPU unchanged bit for bit by
moving its inline code into those references. The ``gpu`` tests at the end check the compiled kernels
and the dispatch on CUDA (``scripts/gpu_check.sh run tests/test_kernels_fused.py``).

Tolerances, |got - want| <= tol * (|want| + 1) (outputs are O(1)): each kernel rounds to the output dtype
at the points torch does (see each module), so differences come from fp32 results that differ in their
last bits (the order of the sum of squares, rsqrt, exp): 1e-5 for fp32 (tens of ulps). After rounding to
fp16, such a difference flips at most one unit of each of the (at most two) roundings that follow: 2 eps.
bf16 gets 4 eps: the interpreter truncates fp32 to bf16 (``cast_impl`` in triton/runtime/interpreter.py
ignores the rounding mode; compiled kernels round to nearest even), so each rounding may also be one
unit off toward zero. Where both paths are single correctly rounded ops (the residual add, RoPE's
products and sums) fp32 and fp16 are compared exactly.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from specdecode.kernels import use_triton_for
from specdecode.kernels.activation import silu_and_mul, silu_and_mul_reference, silu_and_mul_triton
from specdecode.kernels.rmsnorm import fused_add_rms_norm, fused_add_rms_norm_reference, fused_add_rms_norm_triton
from specdecode.kernels.rope import apply_rope, apply_rope_reference, apply_rope_triton
from specdecode.runtime.models.decoder import DecoderLayer, RotaryEmbedding
from specdecode.runtime.models.model_config import ModelConfig
from specdecode.runtime.models.tensor_parallel import TensorParallel

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _close(got: torch.Tensor, want: torch.Tensor, rounded_to: torch.dtype | None = None) -> None:
    """Within the tolerance of the dtype the paths round to (module docstring): the output's, by default."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: 1e-5, torch.float16: 2 * 2.0**-10, torch.bfloat16: 4 * 2.0**-7}[rounded_to or want.dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def _exact(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal, but for the interpreter's bf16 truncation (module docstring)."""
    if want.dtype == torch.bfloat16:
        _close(got, want)
    else:
        assert got.dtype == want.dtype and torch.equal(got, want)


def _randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- fused_add_rms_norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H", [(1, 48), (5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_triton_equals_reference(dtype, T, H, with_residual):
    x = 3 * _randn(T, H, dtype=dtype, seed=T + H)
    residual = _randn(T, H, dtype=dtype, seed=1) if with_residual else None
    weight = (1 + 0.5 * _randn(H, dtype=torch.float32, seed=2)).to(dtype)
    (got, got_res), (want, want_res) = (
        fn(x, residual, weight, 1e-6) for fn in (fused_add_rms_norm_triton, fused_add_rms_norm_reference)
    )
    _close(got, want)
    _exact(got_res, want_res)
    if not with_residual:
        assert want_res is x


def test_add_rms_norm_on_strided_rows_and_a_wider_weight_dtype():
    """Rows of a wider tensor are read in place; an fp32 weight on bf16 rows gives fp32, as torch promotes
    (the normalised rows are rounded to bf16 first)."""
    wide = _randn(3, 80, dtype=torch.bfloat16, seed=3)
    x, residual = wide[:, :37], wide[:, 40:77]  # [3, 37] each, row stride 80
    weight = 1 + 0.5 * _randn(37, dtype=torch.float32, seed=4)
    (got, got_res), (want, want_res) = (
        fn(x, residual, weight, 1e-5) for fn in (fused_add_rms_norm_triton, fused_add_rms_norm_reference)
    )
    assert want.dtype == torch.float32
    _close(got, want, rounded_to=torch.bfloat16)
    _exact(got_res, want_res)


def test_add_rms_norm_refuses_mismatched_arguments():
    x = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="residual must be"):
        fused_add_rms_norm(x, torch.zeros(2, 8, dtype=torch.bfloat16), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight must be"):
        fused_add_rms_norm(x, None, torch.ones(7), 1e-6)


# ---------------------------------------------------------------- apply_rope


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,heads,head_dim", [(1, 3, 16), (7, 5, 12)])
def test_rope_triton_equals_reference_on_a_qkv_view(dtype, T, heads, head_dim):
    """x is q as the model slices it: a view into wider qkv rows; head_dim/2 = 6 is not a power of 2."""
    rope = RotaryEmbedding(head_dim, max_positions=64, theta=10000.0)
    qkv = _randn(T, (heads + 2) * head_dim, dtype=dtype, seed=T * heads)
    x = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    positions = torch.randint(0, 64, (T,), generator=torch.Generator().manual_seed(T))
    got = apply_rope_triton(x, positions, rope.cos, rope.sin)
    want = apply_rope_reference(x, positions, rope.cos, rope.sin)
    assert got.is_contiguous()
    _exact(got, want)


def test_rope_tiles_heads_across_programs(monkeypatch):
    """More heads than one program holds (MAX_BLOCK shrunk): the head tiles cover every head once."""
    from specdecode.kernels import rope as kr

    monkeypatch.setattr(kr, "MAX_BLOCK", 8)
    rope = RotaryEmbedding(8, max_positions=16, theta=10000.0)
    x, positions = _randn(2, 5, 8, dtype=torch.float32, seed=5), torch.tensor([3, 15], dtype=torch.int32)
    assert torch.equal(apply_rope_triton(x, positions, rope.cos, rope.sin),
                       apply_rope_reference(x, positions, rope.cos, rope.sin))


# ---------------------------------------------------------------- silu_and_mul


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 37), (6, 64)])
def test_silu_and_mul_triton_equals_reference(dtype, T, I):
    gate_up = 3 * _randn(T, 2 * I, dtype=dtype, seed=T + I)
    _close(silu_and_mul_triton(gate_up), silu_and_mul_reference(gate_up))


def test_silu_and_mul_splits_columns_into_programs(monkeypatch):
    from specdecode.kernels import activation as ka

    monkeypatch.setattr(ka, "MAX_BLOCK_I", 16)
    gate_up = _randn(2, 2 * 37, dtype=torch.float32, seed=6)  # 3 column blocks, the last partial
    _close(silu_and_mul_triton(gate_up), silu_and_mul_reference(gate_up))


# ---------------------------------------------------------------- the model on the CPU


def _layer(dtype: torch.dtype) -> DecoderLayer:
    cfg = ModelConfig(architecture="llama", vocab_size=32, hidden_size=24, intermediate_size=40, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False)
    torch.manual_seed(0)
    layer = DecoderLayer(cfg, TensorParallel())
    with torch.no_grad():
        for name, param in layer.named_parameters():
            noise = 0.3 * torch.randn_like(param)
            param.copy_(1 + noise if name.endswith("norm.weight") else noise)
    return layer.to(dtype)


def _block_before_fusion(layer: DecoderLayer, x: torch.Tensor, attention) -> torch.Tensor:
    """DecoderLayer.run as it read before the kernels existed: the inline torch ops, spelled out."""

    def norm(module, h):
        h32 = h.float()
        h32 = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + module.eps)
        return module.weight * h32.to(h.dtype)

    x = x + attention(norm(layer.input_layernorm, x))
    gate, up = layer.mlp.gate_up_proj(norm(layer.post_attention_layernorm, x)).split(layer.mlp.intermediate_size, -1)
    return x + layer.mlp.down_proj(F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_decoder_block_on_the_cpu_is_unchanged_bit_for_bit_with_gradients(dtype):
    """The CPU path runs the references (the model's former inline code); the MTP trainer's gradients
    flow through them as before."""
    layer = _layer(dtype)
    rope = RotaryEmbedding(12, max_positions=64, theta=10000.0)
    positions = torch.tensor([0, 5, 6, 63])

    def attention(h):  # a stand-in that runs RoPE on q and k: [T, hidden] → [T, hidden]
        q, k, v = layer.self_attn.project(h, rope, positions)  # q [T, 2, 12], k and v [T, 1, 12]
        return layer.self_attn.o_proj((q * k + v).flatten(1))

    x = _randn(4, 24, dtype=dtype, seed=7)
    outs, grads = [], []
    for run in (layer.run, lambda x_, a: _block_before_fusion(layer, x_, a)):
        layer.zero_grad()
        x_ = x.clone().requires_grad_()
        out = run(x_, attention)
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append([x_.grad] + [p.grad for p in layer.parameters()])
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


# ---------------------------------------------------------------- on CUDA (-m gpu, TRITON_INTERPRET=0)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 37])
@pytest.mark.parametrize("shape", ["smollm2", "qwen2.5-1.5b"])
def test_compiled_kernels_equal_references_on_cuda(dtype, T, shape):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.fail("TRITON_INTERPRET is on: run the gpu tier with TRITON_INTERPRET=0")
    shapes = {"smollm2": (576, 9, 3, 64, 1536), "qwen2.5-1.5b": (1536, 12, 2, 128, 8960)}
    H, heads, kv_heads, head_dim, I = shapes[shape]
    cuda = torch.device("cuda")
    x, residual = (_randn(T, H, dtype=dtype, seed=s).to(cuda) for s in (1, 2))
    weight = (1 + 0.3 * _randn(H, dtype=torch.float32, seed=3)).to(dtype).to(cuda)
    (got, got_res), (want, want_res) = (fn(x, residual, weight, 1e-6)
                                        for fn in (fused_add_rms_norm_triton, fused_add_rms_norm_reference))
    _close(got, want)
    assert torch.equal(got_res, want_res)
    rope = RotaryEmbedding(head_dim, max_positions=4096, theta=1e6).to(cuda)
    qkv = _randn(T, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=4).to(cuda)
    q = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    positions = torch.randint(0, 4096, (T,), device=cuda)
    _close(apply_rope_triton(q, positions, rope.cos, rope.sin), apply_rope_reference(q, positions, rope.cos, rope.sin))
    gate_up = (3 * _randn(T, 2 * I, dtype=dtype, seed=5)).to(cuda)
    _close(silu_and_mul_triton(gate_up), silu_and_mul_reference(gate_up))


@pytest.mark.gpu
@needs_cuda
def test_dispatch_on_cuda_runs_triton_unless_autograd_records():
    x = torch.randn(2, 8, device="cuda")
    weight = torch.ones(8, device="cuda", requires_grad=True)
    with torch.inference_mode():
        assert use_triton_for(None, x, None, weight)
    assert not use_triton_for(None, x, None, weight)  # the trainer's case: the reference, which has a backward
    normed, _ = fused_add_rms_norm(x, None, weight, 1e-6)
    assert normed.grad_fn is not None
    assert silu_and_mul(torch.randn(2, 8, device="cuda")).is_cuda
    assert apply_rope(torch.randn(2, 1, 8, device="cuda"), torch.tensor([0, 1], device="cuda"),
                      torch.ones(4, 8, device="cuda"), torch.zeros(4, 8, device="cuda")).is_cuda
