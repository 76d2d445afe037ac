"""mini-infer's engine: paged KV cache, continuous batching, offline and async generation.

>>> from engine import LLM, SamplingParams
>>> llm = LLM()  # the embedded SmolLM2-135M-Instruct
>>> llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))

Names are imported lazily so that the torch-free modules (``engine.block_manager``,
``engine.scheduler``) can be used without importing torch.
"""
import importlib

from engine.threads import set_huge_pages_env, set_wait_policy_env

# Before anything here imports torch: its OpenMP threads sleep when idle, and its large CPU
# buffers sit on huge pages (engine.threads).
set_wait_policy_env()
set_huge_pages_env()

_EXPORTS = {
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "AsyncLLM": "engine.async_llm",
    "SamplingParams": "engine.sampling_params",
    "RequestOutputKind": "engine.sampling_params",
    "RequestOutput": "engine.outputs",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "EngineConfig": "engine.config",
    "CacheConfig": "engine.config",
    "SchedulerConfig": "engine.config",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
