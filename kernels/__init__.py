"""Attention kernels behind one dispatch. Backends, all with ``kernels.reference``'s contract:

- ``"torch"``: the pure-torch reference (any device);
- ``"cpu"``: C++ kernels for decode and prefill reading the paged cache in place, per
  instruction set (``kernels.cpu_attention``);
- ``"triton"``: Triton kernels for CUDA (``kernels.triton_*``).

This module imports torch only when a function needs it, so that the torch-free engine
modules (scheduler, block manager, config) can use ``BACKENDS`` and ``cdiv``.
"""
from __future__ import annotations

BACKENDS = ("torch", "cpu", "triton")


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers, without floats."""
    return -(-a // b)


def resolve_backend(backend: str, device) -> str:
    """Map an engine's ``attention_backend`` setting to a concrete backend.

    Args:
        backend: ``"auto"`` or one of ``BACKENDS``.
        device: the device the KV cache lives on (``torch.device`` or its name).

    Returns:
        For ``auto``: ``"triton"`` on CUDA; on the CPU ``"cpu"`` where its C++ kernel builds,
        else ``"torch"``. Otherwise ``backend`` itself.

    Raises:
        ValueError: for an unknown name, or "cpu" off the CPU.
    """
    import torch

    device_type = torch.device(device).type
    if backend == "auto":
        if device_type == "cuda":
            return "triton"
        from kernels import cpu_attention

        return "cpu" if cpu_attention.is_available() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of 'auto', {', '.join(map(repr, BACKENDS))}; "
                         f"got {backend!r}")
    if backend == "cpu" and device_type != "cpu":
        raise ValueError(f"attention_backend 'cpu' needs the CPU device; got {device_type!r}")
    return backend


def store_kv(key, value, k_cache, v_cache, slot_mapping, backend: str = "torch") -> None:
    """Write new K/V into the paged cache. Arguments as ``kernels.reference.store_kv``."""
    if backend == "triton":
        from kernels.triton_store_kv import store_kv as impl
    elif backend == "cpu":
        from kernels.cpu_attention import store_kv as impl
    else:
        from kernels.reference import store_kv as impl
    impl(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                    backend: str = "torch", num_decodes: int = 0):
    """Paged causal attention. Arguments and result as ``kernels.reference.paged_attention``.

    ``num_decodes`` (host-side int): the first ``num_decodes`` sequences have query length 1;
    the Triton backend launches them with its decode tiling (see
    ``kernels.triton_paged_attention.paged_attention``); the other backends ignore it.
    """
    if backend == "triton":
        from kernels.triton_paged_attention import paged_attention as triton_impl

        return triton_impl(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
                           num_decodes=num_decodes)
    if backend == "cpu":
        from kernels.cpu_attention import paged_attention as impl
    else:
        from kernels.reference import paged_attention as impl
    return impl(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale)
