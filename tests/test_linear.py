"""The CPU few-row product (operand order swapped, rows padded) equals ``F.linear``."""
import pytest
import torch
import torch.nn.functional as F

from specdecode.runtime.models.linear import ROW_MULTIPLE, SMALL_BATCH_ROWS, Linear, linear


@pytest.mark.parametrize("rows", [1, 2, 7, ROW_MULTIPLE, 9, 15, 16, 31, 33, SMALL_BATCH_ROWS - 1, SMALL_BATCH_ROWS, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear_at_every_row_count(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g)
    weight = torch.randn(40, 48, generator=g)
    bias = torch.randn(40, generator=g) if with_bias else None
    out = linear(x, weight, bias)
    assert out.shape == (rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_padding_rows_do_not_reach_the_output_or_the_input():
    """A ragged batch's real rows come out as they would alone; x itself is left as it was."""
    x = torch.randn(ROW_MULTIPLE + 1, 16)
    before = x.clone()
    weight = torch.randn(8, 16)
    out = linear(x, weight)
    torch.testing.assert_close(out[:1], linear(x[:1], weight), rtol=1e-5, atol=1e-5)
    assert torch.equal(x, before)


def test_linear_module_keeps_nn_linear_parameters():
    layer = Linear(12, 6)
    assert set(dict(layer.named_parameters())) == {"weight", "bias"}
    x = torch.randn(10, 12)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)
