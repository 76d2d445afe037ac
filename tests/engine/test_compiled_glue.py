"""The layers' glue compiled by Inductor and called without Dynamo on the CPU
(``enforce_eager=False``, the default): the same fp32 tokens as eager, compiled at start-up and
never while serving, one graph for every layer, and an engine that still serves eagerly where
the compiler fails."""
from __future__ import annotations

import logging

import pytest
import torch
from torch._dynamo.utils import counters

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.models import compiled_glue, llama
from engine.models.compiled_glue import CompiledGlue, module_tensors
from tests.engine.conftest import assert_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def _glue(llm) -> tuple[CompiledGlue, CompiledGlue, CompiledGlue]:
    return llm.llm_engine.model_runner.model.compiled_glue


def test_the_default_cpu_engine_compiles_its_glue_and_eager_gives_the_same_fp32_tokens(llm, mixed_prompts):
    assert llm.llm_engine.model_runner.compiled_glue is True
    glue = _glue(llm)
    assert [g.fn for g in glue] == [
        llama.layer_before_attention, llama.layer_between_attentions, llama.layer_after_attention]
    # the offline LLM's glue splits over the threads from fewer tokens than an AsyncLLM's
    assert [g.parallel_from for g in glue] == [llama.GLUE_PARALLEL_FROM_TOKENS_OFFLINE] * 3
    served = LLMEngine(EngineConfig.from_kwargs(dtype="float32"))
    assert [g.parallel_from for g in served.model_runner.model.compiled_glue] == [
        llama.GLUE_PARALLEL_FROM_TOKENS] * 3
    assert llama.GLUE_PARALLEL_FROM_TOKENS_OFFLINE < llama.GLUE_PARALLEL_FROM_TOKENS
    # Start-up (of this engine or an earlier one of the same model) compiled both graphs of
    # each: a one-token step and a full token budget.
    assert all((*g.key, parallel) in compiled_glue._GRAPHS for g in glue for parallel in (False, True))
    eager = LLM(dtype="float32", enforce_eager=True)
    assert eager.llm_engine.model_runner.compiled_glue is False
    assert eager.llm_engine.model_runner.model.compiled_glue is None
    prompts = mixed_prompts[:6]
    assert _tokens(llm, prompts) == _tokens(eager, prompts)
    assert_idle(eager)


def test_a_second_engine_of_the_same_model_compiles_nothing_and_reuses_the_graphs(llm, mixed_prompts, monkeypatch):
    def compiles(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(CompiledGlue, "_trace_and_compile", compiles)
    again = LLM(dtype="float32", num_gpu_blocks=256)
    assert again.llm_engine.model_runner.compiled_glue is True
    assert _tokens(again, mixed_prompts[:2]) == _tokens(llm, mixed_prompts[:2])
    for mine, theirs in zip(_glue(again), _glue(llm), strict=True):
        assert mine is not theirs and mine.key == theirs.key
        assert mine.graphs[0] is compiled_glue._GRAPHS[(*mine.key, False)][0]


def test_serving_any_batch_shape_compiles_nothing_and_never_enters_dynamo(llm, mixed_prompts, monkeypatch):
    # Steps of 1, 2, 7 and 1,700 tokens (decodes, prompts, a chunk) reuse the start-up's graphs.
    def compiles(*args, **kwargs):
        raise AssertionError("compiled while serving")

    monkeypatch.setattr(CompiledGlue, "_trace_and_compile", compiles)
    graphs = counters["stats"]["unique_graphs"]
    calls = counters["stats"]["calls_captured"]
    _tokens(llm, [mixed_prompts[0]])
    _tokens(llm, [mixed_prompts[1], mixed_prompts[0]])
    _tokens(llm, mixed_prompts)
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["stats"]["calls_captured"] == calls


def test_a_compiler_failure_leaves_a_working_eager_engine(monkeypatch, caplog, mixed_prompts):
    def broken_compile(*args, **kwargs):
        raise RuntimeError("no C++ compiler found\nsecond line")

    monkeypatch.setattr(compiled_glue.torch._inductor, "standalone_compile", broken_compile)
    monkeypatch.setattr(compiled_glue, "_GRAPHS", {})  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        llm = LLM(dtype="float32")
    assert "compiling the layer glue failed, running eagerly: no C++ compiler found" in caplog.text
    assert "second line" not in caplog.text
    assert llm.llm_engine.model_runner.compiled_glue is False
    assert llm.llm_engine.model_runner.model.compiled_glue is None
    monkeypatch.undo()
    eager = LLM(dtype="float32", enforce_eager=True)
    assert _tokens(llm, mixed_prompts[:3]) == _tokens(eager, mixed_prompts[:3])
    assert_idle(llm)


@pytest.fixture(scope="module")
def tiny():
    """A two-layer dummy Llama in fp32 with random weights (no compiled glue of its own)."""
    torch.manual_seed(0)
    return LLM(model="dummy:tiny-llama", dtype="float32", enforce_eager=True, num_gpu_blocks=64) \
        .llm_engine.model_runner.model


def _inputs(model, num_tokens: int):
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    generator = torch.Generator().manual_seed(num_tokens)  # the same inputs whichever tests ran first
    x = torch.randn(num_tokens, config.hidden_size, generator=generator)
    o = torch.randn(num_tokens, config.num_attention_heads, head_dim, generator=generator)
    cos, sin = model.rotary_emb(torch.arange(num_tokens) % 50, x.dtype)
    return x, o, cos, sin


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 6, 300])
def test_each_graph_computes_what_eager_does_for_the_layers_it_is_given(tiny, num_tokens):
    layers = list(tiny.layers)
    between = CompiledGlue(llama.layer_between_attentions, 2, parallel_from=6)
    after = CompiledGlue(llama.layer_after_attention, 1, parallel_from=6)
    x, o, cos, sin = _inputs(tiny, num_tokens)
    with torch.inference_mode():
        got = between(layers[0], layers[1], x, o, cos, sin)
        want = llama.layer_between_attentions(layers[0], layers[1], x, o, cos, sin)
        assert len(got) == 4
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
        # The same graph with other layers' tensors: the other layers' result.
        swapped = between(layers[1], layers[0], x, o, cos, sin)
        torch.testing.assert_close(swapped[0], llama.layer_between_attentions(layers[1], layers[0], x, o, cos, sin)[0],
                                   rtol=1e-5, atol=1e-5)
        assert not torch.allclose(swapped[0], got[0])
        single = after(layers[1], x, o)  # a function of one tensor returns one tensor
        torch.testing.assert_close(single, llama.layer_after_attention(layers[1], x, o), rtol=1e-5, atol=1e-5)
    used = num_tokens >= 6
    assert between.graphs[used] is not None and between.graphs[not used] is None


def test_a_layer_of_other_shapes_is_refused_by_name(tiny):
    layers = list(tiny.layers)
    before = CompiledGlue(llama.layer_before_attention, 1)
    x, _, cos, sin = _inputs(tiny, 3)
    with torch.inference_mode():
        before(layers[0], x, cos, sin)
        other = LLM(model="dummy:tiny-qwen2", dtype="float32", enforce_eager=True, num_gpu_blocks=64)
        stranger = other.llm_engine.model_runner.model.layers[0]
        with pytest.raises(ValueError, match="layer_before_attention: these layers' tensors differ"):
            before(stranger, x, cos, sin)


def test_a_trace_that_fixes_the_token_count_is_refused(tiny):
    def branches_on_the_token_count(layer, x):
        if x.shape[0] == compiled_glue.SERIAL_TRACE_TOKENS:
            return layer.input_layernorm(x) * 2
        return layer.input_layernorm(x)

    glue = CompiledGlue(branches_on_the_token_count, 1)
    with torch.inference_mode(), pytest.raises(RuntimeError, match="branches_on_the_token_count: tracing "
                                                                   "fixed the token count at 37"):
        glue(tiny.layers[0], torch.randn(5, tiny.config.hidden_size))


def test_inputs_of_another_dtype_or_width_are_refused(tiny):
    glue = CompiledGlue(llama.layer_after_attention, 1)
    x, o, _, _ = _inputs(tiny, 3)
    with torch.inference_mode():
        glue(tiny.layers[0], x, o)
        with pytest.raises(ValueError, match=r"layer_after_attention: step inputs of dtypes and trailing "
                                             r"sizes \(\(torch.bfloat16"):
            glue(tiny.layers[0], x.bfloat16(), o)
        # Sizes and strides: Inductor's graph checks them on every call.
        with pytest.raises(AssertionError, match="expected size"):
            glue(tiny.layers[0], x, o[:, :2].contiguous())
        with pytest.raises(AssertionError, match="stride"):
            glue(tiny.layers[0], x.t().contiguous().t(), o)


def test_a_graph_shared_under_a_key_is_not_used_for_other_tensors(tiny, monkeypatch):
    monkeypatch.setattr(compiled_glue, "_GRAPHS", {})
    x, o, cos, sin = _inputs(tiny, 3)
    with torch.inference_mode():
        CompiledGlue(llama.layer_before_attention, 1, key=("k",))(tiny.layers[0], x, cos, sin)
        other = LLM(model="dummy:tiny-qwen2", dtype="float32", enforce_eager=True, num_gpu_blocks=64)
        model = other.llm_engine.model_runner.model
        x2, _, cos2, sin2 = _inputs(model, 3)
        with pytest.raises(ValueError, match="layer_before_attention: these layers' tensors or inputs differ "
                                             "from those the graph shared under its key"):
            CompiledGlue(llama.layer_before_attention, 1, key=("k",))(model.layers[0], x2, cos2, sin2)


def test_module_tensors_names_parameters_buffers_and_plain_tensor_attributes(tiny):
    layer = tiny.layers[0]
    layer.mlp.down_proj.weight_fp32 = cached = torch.zeros(2)
    try:
        tensors = module_tensors((layer, tiny.layers[1]))
    finally:
        layer.mlp.down_proj.weight_fp32 = None
    assert tensors["0.mlp.down_proj.weight_fp32"] is cached
    assert tensors["1.self_attn.qkv_proj.weight"] is tiny.layers[1].self_attn.qkv_proj.weight
    assert list(tensors) == sorted(tensors)
    assert "0.mlp.down_proj.bias" not in tensors  # None: not an input
