"""bf16 on a CPU with bf16 instructions: the engine prepacks its weights for oneDNN once
(``LlamaForCausalLM.prepack_weights``) and generates the tokens it generated without."""
from __future__ import annotations

import logging

import pytest

from engine import LLM, SamplingParams, model_runner
from engine.device import cpu_has_bf16_matmul
from engine.models import can_prepack_weights
from engine.models.llama import Linear
from tests.engine.conftest import assert_idle

pytestmark = pytest.mark.skipif(not (cpu_has_bf16_matmul() and can_prepack_weights()),
                                reason="needs a CPU with bf16 instructions (AVX512-BF16 or AMX)")

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
# Eager: the compiled glue rounds differently with and without the packed op (Inductor folds
# the residual add into an ``addmm`` of the plain weight: one bf16 rounding instead of two),
# and bf16 greedy tokens part after a few steps; the matmuls themselves give the same bits.
KWARGS = dict(dtype="bfloat16", num_gpu_blocks=256, enforce_eager=True)


def _tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_bf16_engine_prepacks_every_projection_and_generates_the_same_tokens_as_without(
        monkeypatch, caplog, mixed_prompts):
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        packed = LLM(**KWARGS)
    runner = packed.llm_engine.model_runner
    assert runner.prepacked_weights is True
    assert "bf16 weights prepacked for oneDNN" in caplog.text
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    assert len(linears) == 4 * runner.num_layers  # qkv, o, gate_up, down
    assert all(m.weight is None and m.packed_weight.is_mkldnn for m in linears)
    assert runner.model.lm_head_packed.is_mkldnn  # SmolLM2 ties it to the embedding, kept plain
    assert runner.model.embed_tokens.weight.shape == (runner.vocab_size, runner.model.config.hidden_size)

    monkeypatch.setattr(model_runner, "can_prepack_weights", lambda: False)
    plain = LLM(**KWARGS)
    assert plain.llm_engine.model_runner.prepacked_weights is False
    assert all(m.packed_weight is None for m in plain.llm_engine.model_runner.model.modules()
               if isinstance(m, Linear))
    # the weights counted once either way: 134.5M bf16 parameters of SmolLM2-135M
    assert runner.model.weight_bytes() == plain.llm_engine.model_runner.model.weight_bytes() == 2 * 134_515_008
    prompts = mixed_prompts[:6]
    assert _tokens(packed, prompts) == _tokens(plain, prompts)
    assert_idle(packed)
    assert_idle(plain)


def test_fp32_and_upcast_engines_keep_plain_weights(monkeypatch):
    assert LLM(dtype="float32", num_gpu_blocks=64).llm_engine.model_runner.prepacked_weights is False
    # bf16 weights on a CPU without bf16 units run fp32 matmuls (Linear.set_upcast), unpacked
    monkeypatch.setattr(model_runner, "cpu_has_bf16_matmul", lambda: False)
    upcast = LLM(dtype="bfloat16", num_gpu_blocks=64, enforce_eager=True).llm_engine.model_runner
    assert upcast.upcast_matmul is True and upcast.prepacked_weights is False
