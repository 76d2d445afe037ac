"""Model pieces: the upcasting linear matches a native half-precision matmul; the prepacked
one gives torch's bf16 linear bit for bit, eager and compiled."""
import pytest
import torch
import torch.nn.functional as F

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
