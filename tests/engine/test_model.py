"""Model pieces: the upcasting linear matches a native half-precision matmul; the prepacked
one gives torch's bf16 linear bit for bit, eager and compiled; RoPE without its rotated copy
gives the rotate-half form's bits."""
import pytest
import torch
import torch.nn.functional as F

from engine.models import llama
from engine.models.llama import Linear, can_prepack_weights


def test_upcast_linear_computes_what_a_bf16_matmul_computes():
    torch.manual_seed(0)
    layer = Linear(256, 128, bias=True).to(torch.bfloat16)
    x = torch.randn(32, 256).to(torch.bfloat16)
    native = torch.nn.functional.linear(x, layer.weight, layer.bias)
    layer.set_upcast(True, cache_fp32=False)
    upcast = layer(x)
    layer.set_upcast(True, cache_fp32=True)  # the kept fp32 copy gives the same bits
    assert layer.weight_fp32.dtype == torch.float32 and layer.bias_fp32.dtype == torch.float32
    assert torch.equal(layer(x), upcast)
    assert upcast.dtype == torch.bfloat16 and layer.weight.dtype == torch.bfloat16
    # both accumulate in fp32 and round once to bf16: at most one bf16 ulp apart
    torch.testing.assert_close(upcast, native, atol=0, rtol=2 ** -7)
    exact = (x.double() @ layer.weight.double().T + layer.bias.double())
    assert (upcast.double() - exact).abs().max() <= (native.double() - exact).abs().max() + 2 ** -6


@pytest.mark.skipif(not can_prepack_weights(), reason="no oneDNN bf16 support on this CPU")
@pytest.mark.parametrize("bias", [False, True])
def test_prepacked_linear_gives_the_bits_of_torchs_bf16_linear(bias):
    torch.manual_seed(0)
    layer = Linear(576, 960, bias=bias).to(torch.bfloat16)
    weight = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    layer.prepack()
    assert layer.weight is None and layer.packed_weight.is_mkldnn
    compiled = torch.compile(lambda module, x: module(x) * 2, dynamic=True)
    with torch.inference_mode():
        for num_tokens in (1, 7, 64, 300):
            x = torch.randn(num_tokens, 576).to(torch.bfloat16)
            expected = F.linear(x, weight, b)
            assert torch.equal(layer(x), expected)
            assert torch.equal(compiled(layer, x), expected * 2)


def test_prepack_refuses_a_weight_that_is_not_bf16():
    layer = Linear(64, 32, bias=False)
    with pytest.raises(RuntimeError, match="need bf16 weights.*weight is torch.float32"):
        layer.prepack()
    assert layer.packed_weight is None and layer.weight.shape == (32, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_gives_the_bits_of_the_rotate_half_form(dtype):
    """apply_rope computes per half what transformers' ``x * cos + rotate_half(x) * sin``
    computes, without the rotated copy: the same bits, eager and compiled."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 64, generator=gen).to(dtype)
    angles = torch.randn(7, 1, 32, generator=gen) * 10
    cos = torch.cat((angles.cos(), angles.cos()), dim=-1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), dim=-1).to(dtype)
    rotated = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    expected = x * cos + rotated * sin
    assert torch.equal(llama.apply_rope(x, cos, sin), expected)
    if dtype == torch.float32:  # compiled: one fused kernel; fp32 has no rounding between steps to differ
        compiled = torch.compile(llama.apply_rope, dynamic=True)
        assert torch.equal(compiled(x, cos, sin), torch.compile(
            lambda x, c, s: x * c + torch.cat((-x[..., 32:], x[..., :32]), dim=-1) * s, dynamic=True)(x, cos, sin))
