"""Device, KV cache tensors, the step's batch tensors, one forward, sampling.

The runner reads the ``SchedulerOutput`` and never changes scheduler state.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import psutil
import torch

import kernels
from engine.config import EngineConfig
from engine.device import cpu_has_bf16_matmul, resolve_device, resolve_dtype
from engine.loader import LoadedModel, init_dummy_weights
from engine.models import AttentionMetadata, build_model, head_dim_of
from engine.sampler import Sampler
from engine.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

def keep_freed_memory_in_heap() -> None:
    """Stop glibc from returning large freed buffers to the OS.

    By default glibc serves allocations over 128 KiB-32 MiB with fresh ``mmap`` pages and
    unmaps them on free, so every step page-faults its activations and gathered K/V back in
    (measured here: a 34 MB gather took 12 ms, 1.6 ms into a reused buffer). Raising
    ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` keeps them in the heap for reuse, the
    effect PyTorch's CPU tuning guide gets from jemalloc or tcmalloc. A no-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's <malloc.h>
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 31)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


@dataclass(slots=True)
class BatchInputs:
    """The step's flattened model inputs (DESIGN.md, "One step")."""

    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor   # [num_sampled] int64, last scheduled token of sampling rows
    sample_rows: list[int]         # indices into SchedulerOutput.scheduled


class ModelRunner:
    """Owns the model weights, the KV cache and the sampler on one device.

    Args:
        config: the engine config; ``scheduler.max_model_len`` must be resolved.
        loaded: the model from ``engine.loader.load_model``.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.backend = kernels.resolve_backend(config.attention_backend, self.device)
        # Half-precision weights on a CPU without half-precision matrix units: fp32 matmuls.
        self.upcast_matmul = (self.device.type == "cpu" and self.dtype != torch.float32
                              and not cpu_has_bf16_matmul())
        self.block_size = config.cache.block_size
        hf = loaded.config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = hf.num_key_value_heads
        self.head_dim = head_dim_of(hf)
        self.vocab_size = hf.vocab_size
        self.model = self._build_model(loaded)
        self.sampler = Sampler(self.device, config.seed)
        self.num_blocks = self._num_kv_blocks()
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)
        self.kv_caches = _per_layer(self.kv_cache)

    # ---- set-up --------------------------------------------------------------------------

    def _build_model(self, loaded: LoadedModel):
        with torch.device(self.device), _default_dtype(self.dtype):
            model = build_model(loaded.config, self.config.scheduler.max_model_len)
        if loaded.state_dict is None:
            init_dummy_weights(model, self.config.seed)
        else:
            model.load_weights(loaded.state_dict)
        # Keep fp32 copies of the weights where they are small next to the machine's memory
        # (a 135M model: +0.5 GiB); a 7B model on a CPU converts per call instead.
        fp32_bytes = 4 * sum(p.numel() for p in model.parameters())
        model.set_upcast_matmul(self.upcast_matmul, cache_fp32=fp32_bytes <= psutil.virtual_memory().total // 8)
        return model.eval()

    def kv_bytes_per_block(self) -> int:
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if self.device.type == "cuda":
            kv_bytes = self._profile_free_cuda_bytes()
        else:
            kv_bytes = cache.kv_cache_memory_gb * 2**30
        num_blocks = int(kv_bytes // self.kv_bytes_per_block())
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache ({kv_bytes / 2**30:.2f} GiB); "
                             "raise kv_cache_memory_gb or gpu_memory_utilization")
        return num_blocks

    def _profile_free_cuda_bytes(self) -> float:
        """Bytes left for the KV cache after a forward at the full token budget.

        ``total * gpu_memory_utilization - peak torch memory - memory held outside torch``,
        as vLLM's worker computes it.
        """
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        seq_len = min(num_tokens, sched.max_model_len)
        num_seqs = kernels.cdiv(num_tokens, seq_len)
        blocks_per_seq = kernels.cdiv(seq_len, self.block_size)
        caches = _per_layer(self._allocate_kv_cache(num_seqs * blocks_per_seq))
        torch.cuda.reset_peak_memory_stats()
        self._dummy_forward(caches, num_seqs, seq_len, blocks_per_seq, num_tokens)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        del caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        outside_torch = total - free - torch.cuda.memory_reserved()
        return total * self.config.cache.gpu_memory_utilization - peak - outside_torch

    @torch.inference_mode()
    def _dummy_forward(self, caches, num_seqs, seq_len, blocks_per_seq, num_tokens) -> None:
        lens = [min(seq_len, num_tokens - i * seq_len) for i in range(num_seqs)]
        tables = torch.arange(num_seqs * blocks_per_seq, dtype=torch.int32).view(num_seqs, -1)
        positions = torch.cat([torch.arange(n) for n in lens])
        slots = torch.cat([tables[i].long().repeat_interleave(self.block_size)[:n] * self.block_size
                           + torch.arange(n) % self.block_size for i, n in enumerate(lens)])
        meta = AttentionMetadata(
            slot_mapping=slots.to(self.device), block_tables=tables.to(self.device),
            query_start_loc=torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32,
                                         device=self.device),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=self.device), backend=self.backend)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.device)
        hidden = self.model(ids, positions.to(self.device), caches, meta)
        self.model.compute_logits(hidden[: self.config.scheduler.max_num_seqs])

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``, zeroed
        so that unused slots never hold NaN."""
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Copy shared blocks, run one forward over the scheduled tokens, and sample the
        sequences that finish a prompt or decode."""
        self._copy_blocks(scheduler_output.blocks_to_copy)
        batch = self.prepare_inputs(scheduler_output)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        if not batch.sample_rows:
            return ModelRunnerOutput()
        scheduled = [scheduler_output.scheduled[i] for i in batch.sample_rows]
        # A forking sequence's logits row is drawn from once per sequence of its request.
        repeats = [s.num_samples for s in scheduled]
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        logits = logits.repeat_interleave(torch.tensor(repeats, device=self.device), dim=0)
        rows = [s.sampling_row if j == 0 else
                dataclasses.replace(s.sampling_row, seq_index=s.sampling_row.seq_index + j)
                for s in scheduled for j in range(s.num_samples)]
        tokens = iter(self.sampler(logits, rows))
        return ModelRunnerOutput({s.seq_id: [next(tokens) for _ in range(s.num_samples)]
                                  for s in scheduled})

    def _copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-write of forks)."""
        if blocks_to_copy:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*blocks_to_copy, strict=True))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> BatchInputs:
        """Build the flattened batch tensors of DESIGN.md from a ``SchedulerOutput``."""
        scheduled = scheduler_output.scheduled
        bs = self.block_size
        query_lens = np.array([len(s.token_ids) for s in scheduled], dtype=np.int64)
        query_start_loc = np.zeros(len(scheduled) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        seq_lens = np.array([s.num_computed_tokens for s in scheduled], dtype=np.int64) + query_lens
        max_blocks = max(len(s.block_table) for s in scheduled)
        block_tables = np.zeros((len(scheduled), max_blocks), dtype=np.int32)
        for i, s in enumerate(scheduled):
            block_tables[i, : len(s.block_table)] = s.block_table
        # positions: each sequence's [num_computed_tokens, seq_len)
        seq_index = np.repeat(np.arange(len(scheduled)), query_lens)
        positions = np.arange(int(query_start_loc[-1])) - query_start_loc[seq_index] \
            + (seq_lens - query_lens)[seq_index]
        slot_mapping = block_tables[seq_index, positions // bs].astype(np.int64) * bs + positions % bs
        input_ids = np.fromiter((t for s in scheduled for t in s.token_ids), dtype=np.int64,
                                count=int(query_start_loc[-1]))
        sample_rows = [i for i, s in enumerate(scheduled) if s.do_sample]
        to = self._to_device
        meta = AttentionMetadata(slot_mapping=to(slot_mapping), block_tables=to(block_tables),
                                 query_start_loc=to(query_start_loc.astype(np.int32)),
                                 seq_lens=to(seq_lens.astype(np.int32)), backend=self.backend)
        return BatchInputs(input_ids=to(input_ids), positions=to(positions), meta=meta,
                           logits_indices=to(query_start_loc[1:][sample_rows] - 1),
                           sample_rows=sample_rows)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


def _per_layer(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_cache, v_cache)`` views, each ``[num_blocks, block_size, num_kv_heads,
    head_dim]``."""
    return [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
