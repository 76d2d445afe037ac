"""The runner's host-side batch: decodes first with ``num_decodes``, logits rows mapped back
to scheduling order, metadata placed where each attention backend reads it; the device
and dtype choices that depend on the GPU; and the CPU kernels it starts with (attention, and
the MLP's activation for bf16 models)."""
import logging

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.device import resolve_dtype
from engine.llm_engine import LLMEngine
from engine.model_runner import build_host_batch
from engine.models.llama import GLUE_PARALLEL_FROM_TOKENS, GLUE_PARALLEL_FROM_TOKENS_OFFLINE, MLP
from engine.scheduler_output import SamplingRow, ScheduledRequest, SchedulerOutput


def _scheduled(seq_id, token_ids, num_computed, block_table, do_sample=True):
    return ScheduledRequest(seq_id=seq_id, token_ids=token_ids, num_computed_tokens=num_computed,
                            block_table=block_table, do_sample=do_sample, num_samples=int(do_sample),
                            sampling_row=SamplingRow(SamplingParams(), [], []))


# Scheduling order: a prefill chunk, a decode, a mid-prompt chunk (no sample), a decode.
STEP = [_scheduled("a", [11, 12, 13], 0, [4]), _scheduled("b", [21], 17, [0, 1]),
        _scheduled("c", [31, 32], 4, [2], do_sample=False), _scheduled("d", [41], 3, [3])]


def test_decodes_come_first_and_logits_map_back():
    batch = build_host_batch(STEP, block_size=16)
    assert batch.num_decodes == 2
    # batch order: b, d (decodes), then a, c (prefill chunks) in scheduling order
    assert batch.input_ids.tolist() == [21, 41, 11, 12, 13, 31, 32]
    assert batch.query_start_loc.tolist() == [0, 1, 2, 5, 7]
    assert batch.seq_lens.tolist() == [18, 4, 3, 6]
    assert batch.positions.tolist() == [17, 3, 0, 1, 2, 4, 5]
    assert batch.slot_mapping.tolist() == [1 * 16 + 1, 3 * 16 + 3, 64, 65, 66, 36, 37]
    assert batch.block_tables.tolist() == [[0, 1], [3, 0], [4, 0], [2, 0]]
    # sample rows stay in scheduling order (a, b, d); each points at its last token
    assert batch.sample_rows == [0, 1, 3]
    assert batch.logits_indices.tolist() == [4, 0, 1]
    assert batch.query_start_loc.dtype == np.int32 and batch.seq_lens.dtype == np.int32


@pytest.mark.parametrize("backend,host_side", [("torch", True), ("triton", False), ("cpu", False)])
def test_metadata_placement_per_backend(backend, host_side):
    """The torch reference reads query_start_loc, seq_lens and slot_mapping on the host; they
    stay in host memory for it (reading them from a GPU would sync every layer). ``to_device``
    is redirected to the data-less ``meta`` device to tell the two apart on a CPU."""
    if backend == "cpu":
        pytest.importorskip("kernels.cpu_attention")
    llm = LLM(model="dummy:tiny-llama", dtype="float32", attention_backend=backend,
              num_gpu_blocks=8, max_num_batched_tokens=32, max_num_seqs=4)
    runner = llm.llm_engine.model_runner
    runner._to_device = lambda array: torch.from_numpy(array).to("meta")
    inputs = runner.prepare_inputs(SchedulerOutput(scheduled=STEP))
    meta = inputs.meta
    assert meta.num_decodes == 2 and meta.block_tables.device.type == "meta"
    assert inputs.input_ids.device.type == "meta" and inputs.logits_indices.device.type == "meta"
    placed = {t.device.type for t in (meta.query_start_loc, meta.seq_lens, meta.slot_mapping)}
    assert placed == ({"cpu"} if host_side else {"meta"})


def test_greedy_tokens_do_not_depend_on_batch_order():
    """Decodes reordered ahead of prefill chunks: each request's greedy tokens equal those
    it gets alone."""
    llm = LLM(model="dummy:tiny-llama", dtype="float32", attention_backend="torch",
              num_gpu_blocks=64, max_num_batched_tokens=24, max_num_seqs=4)
    prompts = [list(range(5, 45)), [3], list(range(50, 60)), list(range(70, 100))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    assert together == alone


@pytest.mark.parametrize("capability,expected", [((7, 0), torch.float16), ((7, 5), torch.float16),
                                                 ((8, 0), torch.bfloat16), ((9, 0), torch.bfloat16)])
def test_auto_dtype_by_compute_capability(monkeypatch, capability, expected):
    """fp16 before Ampere, where bf16 is only emulated even though
    ``torch.cuda.is_bf16_supported()`` says yes; bf16 from sm_80 on."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", torch.device("cuda", 0)) == expected
    assert resolve_dtype("float32", torch.device("cuda", 0)) == torch.float32


def test_cpu_backend_logs_its_kernels_and_refuses_ones_this_cpu_lacks(monkeypatch, caplog):
    """``$MINI_INFER_CPU_ISA`` picks the CPU attention kernels, ``$MINI_INFER_CPU_PREFILL``
    how long bf16 prefill chunks run and ``$MINI_INFER_CPU_PREFETCH`` where decode prefetches;
    a name this CPU cannot run, or a setting that is no choice, fails when the engine starts,
    not at its first step."""
    cpu_attention = pytest.importorskip("kernels.cpu_attention")
    if not cpu_attention.is_available():
        pytest.skip("the C++ CPU kernel did not build")
    kwargs = dict(model="dummy:tiny-llama", dtype="float32", device="cpu", attention_backend="cpu",
                  num_gpu_blocks=8, max_num_batched_tokens=32, max_num_seqs=4)
    monkeypatch.setenv(cpu_attention.ISA_ENV, "scalar")
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        LLM(**kwargs)
    assert "CPU attention: the scalar kernels; prefill chunks of 128 tokens or more: the same kernels" in caplog.text
    caplog.clear()
    monkeypatch.setenv(cpu_attention.PREFILL_ENV, "sdpa")  # bf16 only: fp32 chunks stay on the kernels
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        LLM(**{**kwargs, "dtype": "bfloat16"})
    assert "prefill chunks of 128 tokens or more: torch's SDPA" in caplog.text
    monkeypatch.setenv(cpu_attention.PREFILL_ENV, "flash")
    with pytest.raises(ValueError, match=r"MINI_INFER_CPU_PREFILL must be one of auto, sdpa, tiles; got 'flash'"):
        LLM(**kwargs)
    monkeypatch.delenv(cpu_attention.PREFILL_ENV)
    monkeypatch.setenv(cpu_attention.PREFETCH_ENV, "l2")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="engine.model_runner"):
        assert LLM(**kwargs).llm_engine.model_runner.cpu_attention["decode_prefetch"] == "l2"
    assert "the same kernels; decode prefetches into L2" in caplog.text
    monkeypatch.setenv(cpu_attention.PREFETCH_ENV, "l3")
    with pytest.raises(ValueError, match=r"MINI_INFER_CPU_PREFETCH must be one of auto, l1, l2; got 'l3'"):
        LLM(**kwargs)
    monkeypatch.delenv(cpu_attention.PREFETCH_ENV)
    monkeypatch.setenv(cpu_attention.ISA_ENV, "sse9")
    with pytest.raises(RuntimeError, match=r"unknown isa 'sse9' \(the isa argument or \$MINI_INFER_CPU_ISA\)"):
        LLM(**kwargs)


def test_bf16_models_on_the_cpu_backend_take_the_mlp_activation_from_its_kernel():
    """bf16 models on the CPU backend run SwiGLU's ``silu(gate) * up`` in the
    extension (``kernels.cpu_attention.silu_and_mul``; compiled, the glue calls it as an opaque
    op: the default bf16 engines of tests/e2e and tests/app run that); fp32 models, and the
    torch backend, keep torch's (fp32 stays bit for bit transformers')."""
    cpu_attention = pytest.importorskip("kernels.cpu_attention")
    if not cpu_attention.is_available():
        pytest.skip("the C++ CPU kernel did not build")
    kwargs = dict(model="dummy:tiny-llama", device="cpu", num_gpu_blocks=16, max_num_batched_tokens=32,
                  max_num_seqs=4)

    def mlps(llm):
        runner = llm.llm_engine.model_runner
        return runner, [m for m in runner.model.modules() if isinstance(m, MLP)]

    runner, layers = mlps(LLM(dtype="bfloat16", attention_backend="cpu", enforce_eager=True, **kwargs))
    assert runner.silu_and_mul_kernel is True and layers and all(m.silu_and_mul is not None for m in layers)
    # its rows split over the threads where the compiled glue's do: the offline LLM's split,
    # and an engine that serves (AsyncLLM's) its own
    assert layers[0].silu_and_mul.keywords["parallel_from_rows"] == GLUE_PARALLEL_FROM_TOKENS_OFFLINE == 16
    served = LLMEngine(EngineConfig.from_kwargs(dtype="bfloat16", attention_backend="cpu", enforce_eager=True,
                                                **kwargs))
    assert {m.silu_and_mul.keywords["parallel_from_rows"] for m in served.model_runner.model.modules()
            if isinstance(m, MLP)} == {GLUE_PARALLEL_FROM_TOKENS} == {128}
    x = torch.randn(5, runner.model.config.hidden_size, generator=torch.Generator().manual_seed(0)).bfloat16()
    with torch.inference_mode():
        kernel = layers[0](x)
        layers[0].silu_and_mul = None
        plain = layers[0](x)
    torch.testing.assert_close(kernel, plain, rtol=2**-7, atol=1e-3)
    for dtype, backend in (("float32", "cpu"), ("float16", "cpu"), ("bfloat16", "torch")):
        runner, layers = mlps(LLM(dtype=dtype, attention_backend=backend, enforce_eager=True, **kwargs))
        assert runner.silu_and_mul_kernel is False and all(m.silu_and_mul is None for m in layers)
