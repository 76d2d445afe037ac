"""The layers' glue through torch.compile on the CPU (``enforce_eager=False``, the default):
the same fp32 tokens as eager, compiled at start-up and never while serving, and an engine
that still serves eagerly where the compiler fails."""
from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
from torch._dynamo.utils import counters

from engine import LLM, SamplingParams, model_runner
from engine.models import llama
from tests.engine.conftest import assert_idle

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_the_default_cpu_engine_compiles_its_glue_and_eager_gives_the_same_fp32_tokens(llm, mixed_prompts):
    assert llm.llm_engine.model_runner.compiled_glue is True
    assert llm.llm_engine.model_runner.model.compiled_glue is not None
    eager = LLM(dtype="float32", enforce_eager=True)
    assert eager.llm_engine.model_runner.compiled_glue is False
    assert eager.llm_engine.model_runner.model.compiled_glue is None
    prompts = mixed_prompts[:6]
    assert _tokens(llm, prompts) == _tokens(eager, prompts)
    assert_idle(eager)


def test_a_second_engine_of_the_same_model_reuses_the_graphs(llm, mixed_prompts):
    graphs = counters["stats"]["unique_graphs"]
    again = LLM(dtype="float32", num_gpu_blocks=256)
    assert again.llm_engine.model_runner.compiled_glue is True
    assert _tokens(again, mixed_prompts[:2]) == _tokens(llm, mixed_prompts[:2])
    assert counters["stats"]["unique_graphs"] == graphs


def test_serving_any_batch_shape_compiles_nothing(llm, mixed_prompts):
    # Start-up compiled the one-token graph and the dynamic one: steps of 1, 2, 7 and 1,700
    # tokens (decodes, prompts, a chunk) reuse them.
    graphs = counters["stats"]["unique_graphs"]
    calls = counters["stats"]["calls_captured"]
    _tokens(llm, [mixed_prompts[0]])
    _tokens(llm, [mixed_prompts[1], mixed_prompts[0]])
    _tokens(llm, mixed_prompts)
    assert counters["stats"]["unique_graphs"] == graphs
    assert counters["stats"]["calls_captured"] == calls


def test_a_compiler_failure_leaves_a_working_eager_engine(monkeypatch, caplog, mixed_prompts):
    def broken_compile(fn, **kwargs):
        def fails(*args, **kw):
            raise RuntimeError("no C++ compiler found\nsecond line")
        return fails

    monkeypatch.setattr(llama.torch, "compile", broken_compile)
    monkeypatch.setattr(model_runner, "_GLUE_COMPILED", set())  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger="engine.model_runner"):
        llm = LLM(dtype="float32")
    assert "torch.compile of the layer glue failed, running eagerly: no C++ compiler found" in caplog.text
    assert "second line" not in caplog.text
    assert llm.llm_engine.model_runner.compiled_glue is False
    monkeypatch.setattr(llama.torch, "compile", torch.compile)
    eager = LLM(dtype="float32", enforce_eager=True)
    assert _tokens(llm, mixed_prompts[:3]) == _tokens(eager, mixed_prompts[:3])
    assert_idle(llm)


def test_the_glue_splits_over_threads_only_from_a_million_elements_a_thread(monkeypatch):
    # Each of the three glue functions is compiled with Inductor's cpp.min_chunk_size set, so
    # that a decode step's glue (64 x 1,536 elements at the widest) runs on one thread and a
    # 2,048-token prefill's MLP glue (2,048 x 1,536) still splits over two.
    calls, model = [], SimpleNamespace()
    monkeypatch.setattr(llama.torch, "compile", lambda fn, **kwargs: calls.append((fn.__name__, kwargs)) or fn)
    llama.LlamaForCausalLM.compile_glue(model)
    assert calls == [(name, {"dynamic": True, "options": {"cpp.min_chunk_size": 2**20}}) for name in (
        "layer_before_attention", "layer_between_attentions", "layer_after_attention")]
    assert model.compiled_glue == (llama.layer_before_attention, llama.layer_between_attentions,
                                   llama.layer_after_attention)
    assert 64 * 1536 < llama.GLUE_MIN_CHUNK_ELEMENTS <= 2048 * 1536 // 2
