"""Engine, cache and scheduler settings: slotted dataclasses validated on construction.

Names follow vLLM's engine arguments (``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``max_model_len``, ``gpu_memory_utilization``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_memory_gb: CPU only: GiB given to the KV cache of all layers.
        gpu_memory_utilization: CUDA only: fraction of the device's total memory the engine
            may use (weights, activations and KV cache), as vLLM's setting of the same name.
        num_gpu_blocks: if set, exactly this many blocks, whatever the memory settings
            (vLLM's ``num_gpu_blocks_override``; used by tests to force preemption).
    """

    block_size: int = 16
    kv_cache_memory_gb: float = 2.0
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks: Optional[int] = None

    def __post_init__(self) -> None:
        _require(self.block_size in (8, 16, 32, 64, 128),
                 f"block_size must be one of 8, 16, 32, 64, 128; got {self.block_size}")
        _require(self.kv_cache_memory_gb > 0,
                 f"kv_cache_memory_gb must be > 0; got {self.kv_cache_memory_gb}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        _require(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
                 f"num_gpu_blocks must be >= 1; got {self.num_gpu_blocks}")


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous-batching limits.

    Attributes:
        max_num_seqs: most requests running in one step.
        max_num_batched_tokens: token budget of one step (prefill chunks plus decodes).
        max_model_len: longest sequence (prompt + output) served; ``None`` takes the model's
            ``max_position_embeddings`` when the engine is built.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: Optional[int] = None

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                 f"max_num_seqs ({self.max_num_seqs}) so that every running request can "
                 "decode each step")
        _require(self.max_model_len is None or self.max_model_len >= 1,
                 f"max_model_len must be >= 1; got {self.max_model_len}")


@dataclass(slots=True)
class EngineConfig:
    """Everything ``LLMEngine`` needs to start.

    Attributes:
        model: a model spec for ``engine.loader.load_model`` (name, ``.gguf`` path,
            transformers directory, or ``dummy:<shape>``).
        dtype: ``auto`` (bfloat16 on CUDA and on CPUs with native bf16 matrix units,
            float32 elsewhere), ``float32``, ``bfloat16`` or ``float16``.
        device: ``auto`` (CUDA if available), ``cpu`` or ``cuda``.
        attention_backend: ``auto`` (Triton on CUDA; on the CPU the C++ decode kernel where
            it builds, else the torch reference), ``torch``, ``cpu`` or ``triton``.
        seed: seeds the engine-wide generator of unseeded sampled requests.
        cache: KV cache settings.
        scheduler: batching limits.
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    attention_backend: str = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}; got {self.dtype!r}")
        _require(self.device in DEVICES, f"device must be one of {DEVICES}; got {self.device!r}")
        _require(self.attention_backend in ATTENTION_BACKENDS,
                 f"attention_backend must be one of {ATTENTION_BACKENDS}; "
                 f"got {self.attention_backend!r}")
