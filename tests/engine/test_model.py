"""Model pieces: the upcasting linear matches a native half-precision matmul."""
import torch

from engine.models.llama import Linear


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
