"""The application's settings: one pydantic model, filled from (lowest to highest priority)
its defaults, ``MINI_INFER_<FIELD>`` environment variables, and ``serve run`` arguments or a
Serve config file's ``args``."""
from __future__ import annotations

import os
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field

from engine.config import CacheConfig, EngineConfig, SchedulerConfig

ENV_PREFIX = "MINI_INFER_"


class AppConfig(BaseModel):
    """Settings of the OpenAI-compatible service (``serve run app:build_app key=value``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field("smollm2-135m-instruct", description="Model spec: a name, a .gguf path, "
                       "a transformers directory or dummy:<shape> (see engine.loader).")
    served_model_name: Optional[str] = Field(None, description="The name clients pass as "
                                             "`model`; defaults to `model`.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights and KV cache dtype; auto = bf16 on CUDA and bf16-capable CPUs.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the engine runs.")
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        "auto", description="Paged attention kernels: Triton on CUDA, the C++ kernel on CPU.")
    seed: int = Field(0, description="Seed of the engine's shared generator (unseeded requests).")
    block_size: int = Field(16, description="Tokens per KV block.")
    kv_cache_memory_gb: float = Field(2.0, gt=0, description="CPU: GiB for the KV cache.")
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1, description="CUDA: fraction of "
                                          "device memory for weights, activations and KV cache.")
    num_gpu_blocks: Optional[int] = Field(None, ge=1, description="Exact KV block count "
                                          "(overrides the memory settings).")
    max_num_seqs: int = Field(256, ge=1, description="Most sequences decoding in one step.")
    max_num_batched_tokens: int = Field(2048, ge=1, description="Token budget of one step.")
    max_model_len: Optional[int] = Field(None, ge=1, description="Longest prompt + output; "
                                         "defaults to the model's maximum.")
    max_waiting_requests: int = Field(512, ge=0, description="Requests an engine replica may "
                                      "queue before new ones get 503 with Retry-After.")
    num_engine_replicas: int = Field(1, ge=1, description="Engine replicas (each holds a model).")
    num_ingress_replicas: int = Field(1, ge=1, description="OpenAI front-end replicas.")
    engine_num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per engine replica "
                                   "on CPU-only nodes.")
    api_key: Optional[str] = Field(None, description="If set, requests need "
                                   "`Authorization: Bearer <api_key>`.")

    @classmethod
    def load(cls, args: Optional[dict[str, Any]] = None) -> "AppConfig":
        """Defaults, overridden by ``MINI_INFER_*`` environment variables, overridden by
        ``args``.

        Raises:
            pydantic.ValidationError: naming the field, for a bad value or an unknown name.
        """
        values = {name: os.environ[ENV_PREFIX + name.upper()] for name in cls.model_fields
                  if ENV_PREFIX + name.upper() in os.environ}
        values.update(args or {})
        return cls.model_validate(values)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def max_ongoing_requests(self) -> int:
        """Serve's per-replica concurrency limit for the engine: room for a full batch and the
        engine's own queue, so the engine (not Serve's default of 5) decides admission."""
        return self.max_num_seqs + self.max_waiting_requests + 16

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model, dtype=self.dtype, device=self.device,
            attention_backend=self.attention_backend, seed=self.seed,
            cache=CacheConfig(block_size=self.block_size, kv_cache_memory_gb=self.kv_cache_memory_gb,
                              gpu_memory_utilization=self.gpu_memory_utilization,
                              num_gpu_blocks=self.num_gpu_blocks),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                      max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=self.max_model_len))
