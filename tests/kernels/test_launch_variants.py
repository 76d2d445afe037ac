"""How many Triton binaries serving compiles, counted without a GPU.

``kernels.triton_launches.LaunchRecorder`` keys every launch with Triton's own argument
binder for sm_90 (an H100/H200), so the number of distinct keys is the number of variants
Triton's JIT would compile there. A variant first met in serving stalls that step for the
compile (0.4-1.3 s each, measured per variant at head_dim 128 on this CPU).
"""
import numpy as np
import pytest
import torch

from bench.workloads import make_workload
from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.loader import load_model
from engine.model_runner import _default_dtype, build_host_batch
from engine.models import AttentionMetadata, build_model
from engine.request import Request
from engine.scheduler import Scheduler
from engine.scheduler_output import ModelRunnerOutput, SampledToken
from kernels import triton_paged_attention
from kernels.triton_launches import LaunchRecorder

ATTENTION, REDUCE, STORE = "_paged_attention_kernel", "_reduce_splits_kernel", "_store_kv_kernel"
NUM_SPLITS_ARG = 13  # _paged_attention_kernel's positional argument num_splits


@pytest.fixture(autouse=True)
def h200_core_count(monkeypatch):
    """Split counts as on an H200 (132 streaming multiprocessors)."""
    monkeypatch.setattr(triton_paged_attention, "_num_cores", lambda device: 132)


def replay(workload: dict, shape: str, dtype=torch.bfloat16, block_size: int = 16,
           num_blocks: int = 20_000, max_num_seqs: int = 256,
           max_num_batched_tokens: int = 2048) -> tuple[LaunchRecorder, list]:
    """Schedule ``workload`` step by step as the engine does (greedy, ``ignore_eos``) and
    run each step's forward through one decoder layer of ``dummy:<shape>`` on ``meta``
    tensors, recording the Triton launches. Returns the recorder and per step
    ``(num_decodes, num_seqs)``."""
    config = load_model(f"dummy:{shape}").config
    config.num_hidden_layers = 1  # every layer launches the same kernels
    max_model_len = config.max_position_embeddings
    with torch.device("meta"), _default_dtype(dtype):
        model = build_model(config, max_model_len)
    head_dim = config.hidden_size // config.num_attention_heads
    cache = torch.empty(num_blocks, block_size, config.num_key_value_heads, head_dim,
                        dtype=dtype, device="meta")
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                          max_num_batched_tokens=max_num_batched_tokens,
                                          max_model_len=max_model_len),
                          BlockManager(num_blocks, block_size))
    for r in workload["requests"]:
        scheduler.add_request(Request(request_id=r["id"], prompt=None,
                                      prompt_token_ids=r["prompt_token_ids"],
                                      sampling_params=SamplingParams(ignore_eos=True),
                                      eos_token_id=None, max_tokens=r["max_tokens"]))
    steps = []
    with LaunchRecorder(arch=90) as recorder:
        while scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            host = build_host_batch(output.scheduled, block_size)
            meta = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to("meta")  # noqa: E731
            attention = AttentionMetadata(meta(host.slot_mapping), meta(host.block_tables),
                                          meta(host.query_start_loc), meta(host.seq_lens),
                                          backend="triton", num_decodes=host.num_decodes)
            model(meta(host.input_ids), meta(host.positions), [(cache, cache)], attention)
            steps.append((host.num_decodes, len(output.scheduled)))
            scheduler.update(output, ModelRunnerOutput({s.seq_id: [SampledToken(7)]
                                                        for s in output.scheduled if s.do_sample}))
    return recorder, steps


def test_w1_mixed_compiles_three_variants_on_qwen2_5_7b():
    """The whole of w1_mixed (prefill-only, mixed and decode-only steps, decodes long
    enough to split) needs one decode, one prefill and one reduce variant, and one
    ``store_kv``."""
    recorder, steps = replay(make_workload("w1_mixed"), "qwen2.5-7b")
    assert any(0 < d < n for d, n in steps) and any(d == n for d, n in steps)
    assert any(d == 0 for d, n in steps)
    attention = recorder.variants(ATTENTION)
    assert len(attention) <= 3
    assert sorted(launch.kwargs["IS_DECODE"] for launch in attention.values()) == [False, True]
    splits = {launch.args[NUM_SPLITS_ARG] for launch in recorder.launches if launch.kernel == ATTENTION}
    assert 1 in splits and max(splits) > 1  # split and unsplit decodes share one variant
    assert len(recorder.variants(REDUCE)) == 1
    assert len(recorder.variants(STORE)) == 1


@pytest.mark.parametrize("shape", ["llama-3-8b", "smollm2-135m"])
def test_other_shapes_compile_three_variants(shape):
    workload = {"requests": make_workload("w1_mixed")["requests"][:24]}
    recorder, _ = replay(workload, shape)
    assert len(recorder.variants(ATTENTION)) == 2
    assert len(recorder.variants(REDUCE)) == 1


def test_warm_up_compiles_what_serving_launches():
    """Every variant a generate launches was already launched by ``ModelRunner.warm_up``
    (which the engine runs at start-up on CUDA, after the memory profile)."""
    llm = LLM(model="dummy:tiny-llama", dtype="bfloat16", attention_backend="triton",
              block_size=16, num_gpu_blocks=64, max_num_batched_tokens=64, max_num_seqs=8)
    with LaunchRecorder() as warm_up:
        llm.llm_engine.model_runner.warm_up()
    assert len(warm_up.variants(ATTENTION)) == 2 and len(warm_up.variants(REDUCE)) == 1
    prompts = [list(range(1, n)) for n in (5, 40, 90, 17, 3, 200)]
    with LaunchRecorder() as serving:
        llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert set(serving.variants()) <= set(warm_up.variants())
    assert len(serving.variants(ATTENTION)) == 2
