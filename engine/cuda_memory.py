"""How much device memory an engine may give its KV cache, counting only what it owns.

``gpu_memory_utilization`` is, as in vLLM, the share of the device's total memory this
engine may use for its weights, activations and KV cache. Memory held before the engine
starts (another engine in the same process, another process, the CUDA context) is not the
engine's: it is left out of the engine's usage, and it must leave room for the engine's
share (else a clear error, not a KV cache that runs the device out of memory later).

The engine's usage is measured as differences between snapshots taken by the engine itself:

- weights: bytes allocated through torch between the start of the engine and the profile;
- activations: the peak allocated during a forward at the full token budget, above what was
  allocated after the weights (this includes the profile's own small KV cache, 2048 tokens'
  worth by default: a slight overestimate, on the safe side);
- outside torch: growth of the memory in use but not reserved by torch's allocator (cuBLAS
  workspaces, NCCL, the CUDA context if this engine created it).
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class CudaMemory(NamedTuple):
    """One device's memory at one moment, in bytes."""

    free: int  # cudaMemGetInfo's free bytes
    total: int  # the device's memory
    allocated: int  # held by live torch tensors
    reserved: int  # held by torch's caching allocator (allocated plus its cache)

    @property
    def outside_torch(self) -> int:
        """In use on the device but not through torch's allocator (this and other processes)."""
        return self.total - self.free - self.reserved

    @classmethod
    def now(cls, device: torch.device) -> "CudaMemory":
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_allocated(device),
                   torch.cuda.memory_reserved(device))


def kv_cache_bytes(utilization: float, start: CudaMemory, after_weights: CudaMemory,
                   profile_peak_allocated: int, after_profile: CudaMemory) -> int:
    """Bytes the engine may give its KV cache.

    ``total * utilization - weights - peak activations - growth outside torch``, each
    measured from the engine's own snapshots (module docstring).

    Args:
        utilization: ``gpu_memory_utilization``, in (0, 1].
        start: taken before the engine allocated anything (before the weights).
        after_weights: taken once the weights are on the device, before the profile.
        profile_peak_allocated: ``torch.cuda.max_memory_allocated`` over the profile (peak
            stats reset at ``after_weights``).
        after_profile: taken after the profile's tensors were freed and torch's cache
            emptied.

    Raises:
        ValueError: naming ``gpu_memory_utilization``, if memory in use before the engine
            started leaves less free than the engine's share, or if the weights and
            activations alone exceed the share.
    """
    gib = 2**30
    budget = start.total * utilization
    if start.free < budget:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {budget / gib:.2f} GiB of the "
            f"device's {start.total / gib:.2f} GiB, but only {start.free / gib:.2f} GiB are free "
            f"before this engine starts ({(start.total - start.free) / gib:.2f} GiB held by other "
            "engines, processes or the CUDA context); lower gpu_memory_utilization or set "
            "num_gpu_blocks")
    weights = after_weights.allocated - start.allocated
    activations = max(0, profile_peak_allocated - after_weights.allocated)
    outside_torch = max(0, after_profile.outside_torch - start.outside_torch)
    kv_bytes = int(budget - weights - activations - outside_torch)
    if kv_bytes <= 0:
        raise ValueError(
            f"no memory left for the KV cache: gpu_memory_utilization={utilization} gives "
            f"{budget / gib:.2f} GiB, and the engine uses {weights / gib:.2f} GiB of weights, "
            f"{activations / gib:.2f} GiB of activations and {outside_torch / gib:.2f} GiB "
            "outside torch; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return kv_bytes
