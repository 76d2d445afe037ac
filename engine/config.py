"""Engine, cache and scheduler settings: slotted dataclasses validated on construction.

These dataclasses are the only place an engine setting is written. ``LLM(**kwargs)``
(through ``EngineConfig.from_kwargs``), the command line (``engine.__main__``) and the
service's ``AppConfig`` are generated from their fields: the name, type, default, help text
(``metadata["help"]``) and allowed values (``metadata["choices"]``). Names follow vLLM's
engine arguments (``block_size``, ``max_num_seqs``, ``max_num_batched_tokens``,
``max_model_len``, ``gpu_memory_utilization``).
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from kernels import BACKENDS

DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", *BACKENDS)
BLOCK_SIZES = (8, 16, 32, 64, 128)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def setting(default: Any, help: str, choices: tuple | None = None) -> Any:  # noqa: A002
    """A settings field: its default, its help text and (optionally) its allowed values."""
    return field(default=default, metadata={"help": help, "choices": choices})


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_choice(config: Any, name: str) -> None:
    choices = next(f.metadata["choices"] for f in dataclasses.fields(config) if f.name == name)
    value = getattr(config, name)
    _require(value in choices, f"{name} must be one of {choices}; got {value!r}")


@dataclass(slots=True)
class CacheConfig:
    """Paged KV cache settings (see each field's help)."""

    block_size: int = setting(16, "Tokens per KV block.", BLOCK_SIZES)
    kv_cache_memory_gb: float = setting(
        2.0, "CPU only: GiB given to the KV cache of all layers; memory is committed as steps "
        "write blocks, and a start refuses more than the machine's available memory.")
    gpu_memory_utilization: float = setting(
        0.9, "CUDA only: fraction of the device's memory the engine may use (weights, "
        "activations and KV cache), as vLLM's setting of the same name.")
    num_gpu_blocks: int | None = setting(
        None, "Exactly this many KV blocks, whatever the memory settings (vLLM's "
        "num_gpu_blocks_override; tests use it to force preemption).")
    enable_prefix_caching: bool = setting(
        True, "Reuse the KV blocks of earlier requests whose prompts start with the same "
        "tokens (automatic prefix caching, as vLLM's setting of the same name).")
    kv_cache_dtype: str = setting(
        "auto", "KV cache element type, as vLLM's setting of the same name: auto = the model's "
        "dtype; fp8 = fp8_e4m3 = 8-bit floats with 4 exponent and 3 mantissa bits (values "
        "saturate at +-448); fp8_e5m2 = 5 exponent and 2 mantissa bits (coarser). Rounded to "
        "nearest on store, widened exactly on read: half a bf16 cache's memory, so twice the "
        "blocks, at the cost of precision. CPU and torch attention backends only.", KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        _check_choice(self, "block_size")
        _check_choice(self, "kv_cache_dtype")
        _require(self.kv_cache_memory_gb > 0,
                 f"kv_cache_memory_gb must be > 0; got {self.kv_cache_memory_gb}")
        _require(0 < self.gpu_memory_utilization <= 1,
                 f"gpu_memory_utilization must be in (0, 1]; got {self.gpu_memory_utilization}")
        _require(self.num_gpu_blocks is None or self.num_gpu_blocks >= 1,
                 f"num_gpu_blocks must be >= 1; got {self.num_gpu_blocks}")


@dataclass(slots=True)
class SchedulerConfig:
    """Continuous-batching limits (see each field's help)."""

    max_num_seqs: int = setting(256, "Most sequences running in one step.")
    max_num_batched_tokens: int = setting(
        2048, "Token budget of one step (prefill chunks plus decodes).")
    max_model_len: int | None = setting(
        None, "Longest sequence (prompt + output) served; defaults to the model's "
        "max_position_embeddings.")
    stream_interval: int = setting(
        1, "Streamed requests get their first token at once, then a record every this many "
        "tokens (and the last one when they finish), as vLLM's setting of the same name: "
        "larger values cost clients smoothness and save per-record work on the host.")

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1; got {self.max_num_seqs}")
        _require(self.max_num_batched_tokens >= self.max_num_seqs,
                 f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                 f"max_num_seqs ({self.max_num_seqs}) so that every running request can "
                 "decode each step")
        _require(self.max_model_len is None or self.max_model_len >= 1,
                 f"max_model_len must be >= 1; got {self.max_model_len}")
        _require(self.stream_interval >= 1, f"stream_interval must be >= 1; got {self.stream_interval}")


@dataclass(slots=True)
class EngineConfig:
    """Everything ``LLMEngine`` needs to start: its own fields, plus ``cache`` and
    ``scheduler`` (see each field's help).

    Raises:
        ValueError: naming the setting and its allowed values, on construction.
    """

    model: str = setting(DEFAULT_MODEL, "Model spec: a name, a .gguf path, a transformers "
                         "directory or dummy:<shape> (see engine.loader).")
    dtype: str = setting("auto", "Weights' and activations' dtype (and the KV cache's with kv_cache_dtype "
                         "auto); auto = bfloat16 on CUDA from Ampere "
                         "(compute capability 8.0) on and on CPUs with native bf16 matrix units, "
                         "float16 on older GPUs, float32 elsewhere.", DTYPES)
    device: str = setting("auto", "Where the engine runs; auto = CUDA if available.", DEVICES)
    attention_backend: str = setting(
        "auto", "Paged attention kernels; auto = Triton on CUDA, on the CPU the C++ kernel "
        "where it builds, else the torch reference.", ATTENTION_BACKENDS)
    seed: int = setting(0, "Seeds the engine-wide generator of unseeded sampled requests.")
    enforce_eager: bool = setting(
        False, "Run the model eagerly (vLLM's setting of the same name). Otherwise, on the CPU, "
        "the glue between matmuls and attention (RMSNorm, RoPE, SiLU x mul, residual adds) runs "
        "through torch.compile, compiled at start-up and cached on disk; CUDA runs eagerly.")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        for name in ("dtype", "device", "attention_backend"):
            _check_choice(self, name)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat engine arguments (``block_size=32, max_num_seqs=8, ...``), each
        routed to the sub-config that has a field of its name.

        Raises:
            TypeError: for a name that no config has.
            ValueError: as the configs' validation.
        """
        parts: dict[type, dict[str, Any]] = {owner: {} for owner in _SECTIONS.values()}
        for name, value in kwargs.items():
            owner = _OWNERS.get(name)
            if owner is None:
                raise TypeError(f"unknown engine argument {name!r}; known: {sorted(_OWNERS)}")
            parts[owner][name] = value
        sections = {attr: owner(**parts[owner]) for attr, owner in _SECTIONS.items() if owner is not cls}
        return cls(**parts[cls], **sections)

    def to_kwargs(self) -> dict[str, Any]:
        """The flat engine arguments of this config (the inverse of ``from_kwargs``)."""
        return {f.name: getattr(getattr(self, _ATTRS[owner]) if _ATTRS[owner] else self, f.name)
                for owner, f in _flat_fields()}


# attribute of EngineConfig -> its dataclass; "" is EngineConfig itself.
_SECTIONS: dict[str, type] = {"": EngineConfig, "cache": CacheConfig, "scheduler": SchedulerConfig}
_ATTRS = {owner: attr for attr, owner in _SECTIONS.items()}


def _flat_fields() -> list[tuple[type, dataclasses.Field]]:
    return [(owner, f) for owner in _SECTIONS.values() for f in dataclasses.fields(owner)
            if f.name not in _SECTIONS]


_OWNERS: dict[str, type] = {f.name: owner for owner, f in _flat_fields()}


@dataclass(frozen=True, slots=True)
class EngineArg:
    """One flat engine argument, as the CLI and ``AppConfig`` present it.

    Attributes:
        name: the field's name (``max_num_seqs``).
        type: its Python type, with ``| None`` for optional ones (``int | None``).
        default: its default value.
        help: one or two sentences for users.
        choices: the allowed values, or ``None`` where any value of the type may be valid.
    """

    name: str
    type: Any
    default: Any
    help: str
    choices: tuple | None


def engine_args() -> list[EngineArg]:
    """Every flat engine argument, in declaration order (engine, cache, scheduler)."""
    hints = {owner: typing.get_type_hints(owner) for owner in _SECTIONS.values()}
    return [EngineArg(f.name, hints[owner][f.name], f.default, f.metadata["help"],
                      f.metadata["choices"]) for owner, f in _flat_fields()]
