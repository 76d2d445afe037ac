"""Engine checks that need a CUDA GPU (``bench/gpu_check.sh`` runs them)."""
import pytest
import torch

from engine import LLM, SamplingParams
from engine.scheduler_output import SchedulerOutput
from kernels.triton_launches import compiled_variant_counts
from tests.engine.test_model_runner_batch import STEP

pytestmark = pytest.mark.gpu  # skipped without CUDA (tests/conftest.py)


def test_two_engines_in_one_process_size_their_own_kv_caches():
    """The second engine is not charged for the first one's weights and KV cache (before,
    the process-wide peak made it fail with "no memory left")."""
    first = LLM(model="dummy:qwen2.5-0.5b", dtype="bfloat16", gpu_memory_utilization=0.2,
                max_model_len=4096).llm_engine.model_runner
    second = LLM(model="dummy:qwen2.5-0.5b", dtype="bfloat16", gpu_memory_utilization=0.2,
                 max_model_len=4096).llm_engine.model_runner
    budget = 0.2 * torch.cuda.mem_get_info()[1]
    assert first.num_blocks * first.kv_bytes_per_block() > 0.5 * budget
    # The second finds cuBLAS and the kernels already loaded: a little more room, never less.
    assert first.num_blocks <= second.num_blocks <= 1.05 * first.num_blocks


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_step_queues_without_waiting_for_the_gpu(backend):
    """Inputs and forward of a mixed step with CUDA's sync check set to raise: neither the
    reference (host-side lengths and slots) nor Triton waits for the device."""
    llm = LLM(model="dummy:tiny-llama", dtype="float32", attention_backend=backend,
              num_gpu_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
    runner = llm.llm_engine.model_runner
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = runner.prepare_inputs(SchedulerOutput(scheduled=STEP))
        with torch.inference_mode():
            runner.model(batch.input_ids, batch.positions, runner.kv_caches, batch.meta)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_auto_dtype_and_no_compile_after_start_up():
    """dtype auto is bf16 from sm_80 on (fp16 before); the start-up warm-up compiled every
    Triton variant the requests need."""
    # 256 blocks (the six requests need at most 71): sized from 10% of an H200's memory, this
    # tiny model's cache had ~3.5M blocks, which the suite's per-step check_invariants
    # (MINI_INFER_DEBUG_CHECKS) walks: the test took 173 s, past gpu_check.sh's 150 s for tests.
    llm = LLM(model="dummy:tiny-qwen2", max_num_batched_tokens=64, max_num_seqs=8,
              num_gpu_blocks=256)
    runner = llm.llm_engine.model_runner
    major, _ = torch.cuda.get_device_capability()
    assert runner.dtype == (torch.bfloat16 if major >= 8 else torch.float16)
    assert runner.backend == "triton"
    before = compiled_variant_counts()
    vocab_size = llm.llm_engine.model_config.vocab_size
    prompts = [[1 + i % (vocab_size - 1) for i in range(n)] for n in (5, 40, 90, 17, 3, 700)]
    llm.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True), use_tqdm=False)
    assert compiled_variant_counts() == before
