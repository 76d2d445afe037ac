"""``kv_cache_dtype`` "fp8_e4m3" ("fp8") and "fp8_e5m2": a KV cache of 8-bit floats. The same
memory holds exactly twice a bf16 cache's blocks (four times an fp32 one's), the new K/V are
stored rounded as the reference rounds them, both CPU backends read them, other settings are
refused with the field's name, and the Triton backend, which cannot read them, refuses them
at start."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_runner import resolve_kv_cache_dtype
from kernels import cpu_attention, reference
from tests.engine.conftest import assert_idle

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU engines")

# SmolLM2-135M: 30 layers x K and V x 16 tokens x 3 KV heads x 64 = 184,320 elements a block.
ELEMENTS_PER_BLOCK = 2 * 30 * 16 * 3 * 64
MEMORY_GB = 0.01  # 10,737,418 bytes


@pytest.mark.parametrize(("dtype", "kv_cache_dtype", "cache_dtype", "num_blocks"), [
    ("float32", "auto", torch.float32, 14),  # 10,737,418 // (4 * 184,320)
    ("bfloat16", "auto", torch.bfloat16, 29),  # // (2 * 184,320)
    ("bfloat16", "fp8_e5m2", torch.float8_e5m2, 58),  # // 184,320
    ("float32", "fp8_e5m2", torch.float8_e5m2, 58),
    ("bfloat16", "fp8_e4m3", torch.float8_e4m3fn, 58),
    ("bfloat16", "fp8", torch.float8_e4m3fn, 58),  # vLLM's "fp8" is E4M3
])
def test_the_same_memory_holds_blocks_by_the_cache_element_size(dtype, kv_cache_dtype, cache_dtype, num_blocks):
    llm = LLM(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory_gb=MEMORY_GB, enforce_eager=True)
    runner = llm.llm_engine.model_runner
    assert runner.kv_bytes_per_block() == ELEMENTS_PER_BLOCK * cache_dtype.itemsize
    assert runner.kv_cache.dtype == cache_dtype and runner.kv_cache.shape == (30, 2, num_blocks, 16, 3, 64)
    assert runner.model.embed_tokens.weight.dtype == getattr(torch, dtype)  # the model's own dtype is kept
    assert llm.llm_engine.stats()["num_total_blocks"] == num_blocks


def test_other_cache_dtypes_and_the_triton_backend_are_refused_by_name():
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'\); "
                                         r"got 'fp8_e4m3fnuz'"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8_e4m3fnuz")
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' needs attention_backend 'cpu' or 'torch'"):
        resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16, "triton")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, "triton") == torch.bfloat16
    assert resolve_kv_cache_dtype("fp8_e5m2", torch.float32, "cpu") == torch.float8_e5m2
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16, "torch") == torch.float8_e4m3fn


@pytest.fixture(scope="module", params=["fp8_e4m3", "fp8_e5m2"])
def fp8_engines(request):
    """fp32 engines over fp8 caches of one format, one per CPU backend."""
    backends = ["torch"] + (["cpu"] if cpu_attention.is_available() else [])
    return {b: LLM(dtype="float32", kv_cache_dtype=request.param, attention_backend=b, num_gpu_blocks=96)
            for b in backends}


def test_the_cache_holds_the_models_keys_rounded_to_fp8(fp8_engines, mixed_prompts):
    """After a prompt, its blocks of the last layer hold exactly the reference store's rounding
    of that layer's K and V (recomputed by the torch backend's engine, whose store is
    ``Tensor.to``)."""
    if "cpu" not in fp8_engines:
        pytest.skip("the C++ CPU kernels do not build here")
    llm = fp8_engines["cpu"]
    runner = llm.llm_engine.model_runner
    captured = {}
    attention = runner.model.layers[-1].self_attn
    original = attention.attend

    def spy(q, k, v, kv_cache, meta):
        captured.update(k=k.clone(), v=v.clone(), slots=meta.slot_mapping.clone())
        return original(q, k, v, kv_cache, meta)

    attention.attend = spy
    try:
        llm.generate([{"prompt_token_ids": mixed_prompts[6]}],  # 31 tokens: a block and a part
                     SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    finally:
        del attention.attend
    k_cache, v_cache = runner.kv_caches[-1]
    assert k_cache.dtype == runner.kv_cache_dtype
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    reference.store_kv(captured["k"], captured["v"], want_k, want_v, captured["slots"])
    slots = captured["slots"]
    flat = lambda c: c.view(-1, 3, 64)[slots].view(torch.uint8)  # noqa: E731
    assert len(slots) == 31
    assert torch.equal(flat(k_cache), flat(want_k)) and torch.equal(flat(v_cache), flat(want_v))
    assert flat(k_cache).count_nonzero() > 0.9 * flat(k_cache).numel()


def test_both_cpu_backends_read_an_fp8_cache_alike(fp8_engines, mixed_prompts):
    """The C++ kernels and the torch reference over the same fp8 cache: the first greedy token
    of each of 12 prompts (1-97 tokens) agrees, its logprob to 0.5, and every block is free
    again after. Not closer, and not later tokens: the two backends' outputs differ by ~1e-6
    a layer (summation order), and where a key or value lies that close to an fp8 rounding
    boundary the difference becomes a whole fp8 step (12.5-25% of that element) in the next
    layer's cache; over 30 layers the first token's logprob moved by up to 0.21 here."""
    if "cpu" not in fp8_engines:
        pytest.skip("the C++ CPU kernels do not build here")
    prompts = [{"prompt_token_ids": p} for p in mixed_prompts[:12]]
    params = SamplingParams(temperature=0, max_tokens=4, logprobs=0, ignore_eos=True)
    firsts = {}
    for backend, llm in fp8_engines.items():
        outputs = llm.generate(prompts, params, use_tqdm=False)
        firsts[backend] = [(o.outputs[0].token_ids[0], o.outputs[0].logprobs[0][o.outputs[0].token_ids[0]].logprob)
                           for o in outputs]
        assert all(len(o.outputs[0].token_ids) == 4 for o in outputs)
        assert_idle(llm)
    assert [t for t, _ in firsts["cpu"]] == [t for t, _ in firsts["torch"]]
    for (_, ours), (_, theirs) in zip(firsts["cpu"], firsts["torch"], strict=True):
        assert abs(ours - theirs) < 0.5


def test_a_prompt_sent_twice_reads_its_fp8_blocks_from_the_prefix_cache(fp8_engines, mixed_prompts):
    """A 32-token prompt (two full blocks) again: 31 tokens come from the cache, its last block
    is copied (a full hit never writes a cached block in place), the first greedy token is the
    same, and every block is free after."""
    if "cpu" not in fp8_engines:
        pytest.skip("the C++ CPU kernels do not build here")
    llm = fp8_engines["cpu"]
    llm.reset_prefix_cache()
    prompt = {"prompt_token_ids": mixed_prompts[7]}
    assert len(mixed_prompts[7]) == 32
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    (first,) = llm.generate([prompt], params, use_tqdm=False)
    (second,) = llm.generate([prompt], params, use_tqdm=False)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 31
    assert first.outputs[0].token_ids[0] == second.outputs[0].token_ids[0]
    assert_idle(llm)
