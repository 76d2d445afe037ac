"""Device, KV cache tensors, the step's batch tensors, one forward, sampling.

The runner reads the ``SchedulerOutput`` and never changes scheduler state.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
import mmap
import sys
import time
from dataclasses import dataclass

import numpy as np
import psutil
import torch

import kernels
from engine.config import EngineConfig
from engine.cuda_memory import CudaMemory, kv_cache_bytes
from engine.device import cpu_has_bf16_matmul, resolve_device, resolve_dtype
from engine.loader import LoadedModel, init_dummy_weights
from engine.models import AttentionMetadata, build_model, can_prepack_weights, head_dim_of
from engine.models.llama import glue_parallel_from_tokens
from engine.sampler import Sampler, logprob_tokens
from engine.sampling_params import SamplingParams
from engine.scheduler_output import ModelRunnerOutput, SampledToken, SamplingRow, ScheduledRequest, SchedulerOutput
from engine.threads import FreeCpuThreads, configure_cpu_threads, huge_pages_requested

logger = logging.getLogger(__name__)

def keep_freed_memory_in_heap() -> None:
    """Stop glibc from returning large freed buffers to the OS.

    By default glibc serves allocations over 128 KiB-32 MiB with fresh ``mmap`` pages and
    unmaps them on free, so every step page-faults its activations and gathered K/V back in
    (measured here: a 34 MB gather took 12 ms, 1.6 ms into a reused buffer). Raising
    ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD`` keeps them in the heap for reuse, the
    effect PyTorch's CPU tuning guide gets from jemalloc or tcmalloc. A no-op off glibc.

    Memory kept this way is reused, never returned: the process stays at its peak. What one
    request can allocate before it is refused is bounded (``LLMEngine.process_prompt`` and
    ``chat_prompt`` check sizes before tokenizing; the service bounds body size), so hostile
    inputs cannot raise that peak much (tests/app/test_hostile_input.py: within 10%).
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
    row_starts: np.ndarray         # [num_scheduled] int64: each scheduled sequence's first row




class ModelRunner:
    """Owns the model weights, the KV cache and the sampler on one device.

    Args:
        config: the engine config; ``scheduler.max_model_len`` must be resolved.
        loaded: the model from ``engine.loader.load_model``.
        offline: nothing else in this process runs while a step does (``LLMEngine``'s
            ``offline``): the compiled glue splits over the threads from fewer tokens.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel, offline: bool = False) -> None:
        self.config = config
        self.offline = offline
        self.device = resolve_device(config.device)
        # intra-op CPU threads: the CPUs this process is given (engine.threads)
        self.num_threads = configure_cpu_threads() if self.device.type == "cpu" else None
        # fewer of them while other processes use those CPUs (see FreeCpuThreads)
        self.free_cpu_threads = FreeCpuThreads(self.num_threads) if self.num_threads else None
        if self.device.type == "cpu":
            keep_freed_memory_in_heap()
        # Before this engine allocates anything: what is on the device is not its own.
        cuda_start = CudaMemory.now(self.device) if self.device.type == "cuda" else None
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.backend = kernels.resolve_backend(config.attention_backend, self.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype, self.backend)
        # Half-precision weights on a CPU without half-precision matrix units: fp32 matmuls.
        self.upcast_matmul = (self.device.type == "cpu" and self.dtype != torch.float32
                              and not cpu_has_bf16_matmul())
        # bf16 matmuls on the CPU's own bf16 units: weights reordered once for oneDNN, not per call.
        self.prepacked_weights = (self.device.type == "cpu" and self.dtype == torch.bfloat16
                                  and not self.upcast_matmul and can_prepack_weights())
        self.block_size = config.cache.block_size
        hf = loaded.config
        self.num_layers = hf.num_hidden_layers
        self.num_kv_heads = hf.num_key_value_heads
        self.head_dim = head_dim_of(hf)
        argmax_rows = None  # the sampler's: torch.argmax, or the CPU backend's C++ one
        # the CPU backend's kernels: {"isa": ..., "prefill": "sdpa" or "tiles", "decode_prefetch":
        # "l1" or "l2"}; None otherwise
        self.cpu_attention: dict[str, str] | None = None
        if self.backend == "cpu":  # which kernels run; a $MINI_INFER_CPU_ISA this CPU lacks, or a
            # $MINI_INFER_CPU_PREFILL or $MINI_INFER_CPU_PREFETCH that is no choice, fails here
            from kernels import cpu_attention

            self.cpu_attention = {"isa": cpu_attention.selected_isa(self.head_dim),
                                  "prefill": cpu_attention.prefill_path(self.dtype),
                                  "decode_prefetch": "l2" if cpu_attention.decode_prefetch_l2_default() else "l1"}
            logger.info("CPU attention: the %s kernels; prefill chunks of 128 tokens or more: %s; decode "
                        "prefetches into %s", self.cpu_attention["isa"],
                        "torch's SDPA" if self.cpu_attention["prefill"] == "sdpa" else "the same kernels",
                        self.cpu_attention["decode_prefetch"].upper())
            argmax_rows = cpu_attention.argmax_rows
        self.vocab_size = hf.vocab_size
        # bf16 models on the CPU backend: the MLP's activation in the extension's C++ kernel
        # (kernels.cpu_attention.silu_and_mul); fp32 keeps torch's, bit for bit transformers'.
        self.silu_and_mul_kernel = self.backend == "cpu" and self.dtype == torch.bfloat16
        self.model = self._build_model(loaded)
        self.sampler = Sampler(self.device, config.seed, argmax_rows)
        self._grammar_bitmask = None  # GrammarBitmask, from the first constrained step on
        self.num_blocks = self._num_kv_blocks(cuda_start)
        if self.device.type == "cpu":
            self._check_cpu_kv_cache_fits()
        self.kv_cache = self._allocate_kv_cache(self.num_blocks)
        self.kv_caches = _per_layer(self.kv_cache)
        if self.backend == "triton" and self.device.type == "cuda":
            self.warm_up()
        self.compiled_glue = False
        if self.device.type == "cpu" and not config.enforce_eager:
            self.compiled_glue = self._compile_glue()

    @property
    def num_cpu_threads(self) -> int | None:
        """The intra-op threads a CPU step runs with now (``FreeCpuThreads``); None on a GPU."""
        return self.free_cpu_threads.threads if self.free_cpu_threads is not None else None

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
        if self.prepacked_weights:
            model.prepack_weights()
            logger.info("bf16 weights prepacked for oneDNN")
        if self.silu_and_mul_kernel:
            from kernels import cpu_attention

            # Its rows split over the threads where the compiled glue's kernels do.
            model.set_silu_and_mul(functools.partial(cpu_attention.silu_and_mul, isa=self.cpu_attention["isa"],
                                                     parallel_from_rows=glue_parallel_from_tokens(self.offline)))
        return model.eval()

    def kv_bytes_per_block(self) -> int:
        element = self.kv_cache_dtype.itemsize
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element

    def _num_kv_blocks(self, cuda_start: CudaMemory | None) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        if self.device.type == "cuda":
            kv_bytes = self._profile_kv_cache_bytes(cuda_start)
        else:
            kv_bytes = cache.kv_cache_memory_gb * 2**30
        num_blocks = int(kv_bytes // self.kv_bytes_per_block())
        if num_blocks < 1:
            raise ValueError(f"no memory left for the KV cache ({kv_bytes / 2**30:.2f} GiB); "
                             "raise kv_cache_memory_gb or gpu_memory_utilization")
        return num_blocks

    def populate_kv_cache(self) -> bool:
        """Back the whole CPU KV cache with memory now (``populate``), contents kept: for
        benchmarks, so that a timed run does not pay the first touch of the blocks it writes
        (0.6-1.1 ms a 2 MiB page on a quiet 2-core VM, up to ~10 ms on a cold one). Returns whether
        the kernel did it; True on CUDA, whose cache is allocated whole."""
        return self.device.type != "cpu" or populate(self.kv_cache)

    def _check_cpu_kv_cache_fits(self) -> None:
        """The CPU KV cache is committed block by block as steps write it (``lazily_zeroed_cpu``),
        so a cache larger than the memory the machine has free would start and fail later,
        under load: refuse it at start instead.

        Raises:
            ValueError: naming ``kv_cache_memory_gb`` (or ``num_gpu_blocks``) and the limit.
        """
        need = self.num_blocks * self.kv_bytes_per_block()
        available = psutil.virtual_memory().available
        if need > available:
            setting = ("num_gpu_blocks" if self.config.cache.num_gpu_blocks is not None
                       else "kv_cache_memory_gb")
            raise ValueError(f"{setting}: the KV cache's {need / 2**30:.2f} GiB are more than this "
                             f"machine's available memory ({available / 2**30:.2f} GiB); lower {setting}")

    def _profile_kv_cache_bytes(self, start: CudaMemory) -> int:
        """Bytes this engine may give its KV cache, after a forward at the full token budget
        (``engine.cuda_memory.kv_cache_bytes``: only memory the engine itself allocated
        counts against ``gpu_memory_utilization``)."""
        after_weights = CudaMemory.now(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        sched = self.config.scheduler
        lens = self._full_budget_lens()
        blocks_per_seq = kernels.cdiv(lens[0], self.block_size)
        caches = _per_layer(self._allocate_kv_cache(len(lens) * blocks_per_seq))
        self._dummy_forward(caches, [(n, 0, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)))
                                     for i, n in enumerate(lens)], num_logits=sched.max_num_seqs)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        del caches
        torch.cuda.empty_cache()
        return kv_cache_bytes(self.config.cache.gpu_memory_utilization, start, after_weights, peak,
                              CudaMemory.now(self.device))

    def _full_budget_lens(self) -> list[int]:
        """Prompt lengths that fill one step's token budget (``max_num_batched_tokens``), none
        longer than ``max_model_len``: the largest forward serving will run."""
        sched = self.config.scheduler
        num_tokens = sched.max_num_batched_tokens
        seq_len = min(num_tokens, sched.max_model_len)
        return [min(seq_len, num_tokens - first) for first in range(0, num_tokens, seq_len)]

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile every Triton variant serving will launch now, not during the first requests.

        One forward over a decode whose block table is as wide as ``max_model_len`` allows
        (so it takes the most key-range splits: the split path and its reduce kernel) next to
        a two-token prefill covers the decode, prefill and reduce kernels, whose other
        arguments do not change the compiled variant (``kernels.triton_paged_attention``).
        It writes K/V into blocks 0 and 1 and zeroes them after. Call after the memory
        profile, whose forward at the full token budget compiles only the prefill variant.
        """
        start = time.perf_counter()
        width = kernels.cdiv(self.config.scheduler.max_model_len, self.block_size)
        last = min(1, self.num_blocks - 1)
        self._dummy_forward(self.kv_caches, [(1, 1, [0] * width), (2, 0, [last])], num_logits=2)
        self.kv_cache[:, :, :last + 1].zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("attention kernels warmed up in %.1f s", time.perf_counter() - start)

    def _compile_glue(self) -> bool:
        """Compile the layers' glue (``LlamaForCausalLM.compile_glue``) and both of its
        graphs now (a one-token step for the decode-sized graph, the full token budget for the
        prefill-sized one), so that no request waits for the compiler. The dummy tokens all
        read and write block 0, which is zeroed after. Returns False, with the model left
        eager, where compiling fails (no C++ compiler, an unsupported op): the engine still
        serves, more slowly."""
        start = time.perf_counter()
        # The compiled graphs belong to the process: an engine of a model of the same config,
        # dtype and matmul mode built in it before (tests build many) reuses them; the SiLU
        # kernel's split (offline or not) is a constant of the graphs that call it.
        signature = (self.model.config.to_json_string(), self.dtype, self.upcast_matmul, self.prepacked_weights,
                     glue_parallel_from_tokens(self.offline) if self.silu_and_mul_kernel else None)
        self.model.compile_glue(key=signature, offline=self.offline)
        budget = self.config.scheduler.max_num_batched_tokens
        if all(glue.compiled_up_to(budget) for glue in self.model.compiled_glue):
            return True
        lens = self._full_budget_lens()
        seqs = [(n, 0, [0] * kernels.cdiv(lens[0], self.block_size)) for n in lens]
        try:
            with torch.inference_mode():
                self._dummy_forward(self.kv_caches, [(1, 1, [0])], num_logits=1)
                self._dummy_forward(self.kv_caches, seqs, num_logits=1)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: serve eagerly instead
            logger.warning("compiling the layer glue failed, running eagerly: %s",
                           str(exc).splitlines()[0] if str(exc) else type(exc).__name__)
            self.model.compiled_glue = None
            return False
        finally:
            self.kv_cache[:, :, 0].zero_()
        logger.info("layer glue compiled (Inductor) in %.1f s", time.perf_counter() - start)
        return True

    @torch.inference_mode()
    def _dummy_forward(self, caches, seqs: list[tuple[int, int, list[int]]], num_logits: int) -> None:
        """A forward over token id 0 through the serving path (``prepare_inputs``).

        Args:
            caches: per-layer ``(k_cache, v_cache)``.
            seqs: per sequence ``(query_len, num_computed_tokens, block_table)``.
            num_logits: rows of logits to compute (the sampler's largest batch).
        """
        row = SamplingRow(SamplingParams(), prompt_token_ids=[], output_token_ids=[])
        output = SchedulerOutput(scheduled=[
            ScheduledRequest(seq_id=str(i), token_ids=[0] * query_len, num_computed_tokens=computed,
                             block_table=table, do_sample=False, num_samples=0, sampling_row=row)
            for i, (query_len, computed, table) in enumerate(seqs)])
        batch = self.prepare_inputs(output)
        hidden = self.model(batch.input_ids, batch.positions, caches, batch.meta)
        self.model.compute_logits(hidden[:num_logits])

    def _allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]``, zeroed
        so that unused slots never hold NaN; on the CPU lazily (``lazily_zeroed_cpu``)."""
        shape = (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)
        if self.device.type == "cpu":
            return lazily_zeroed_cpu(shape, self.kv_cache_dtype)
        return torch.zeros(shape, dtype=self.kv_cache_dtype, device=self.device)

    # ---- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Copy shared blocks, run one forward over the scheduled tokens, and sample the
        sequences that finish a prompt or decode."""
        if self.free_cpu_threads is not None:
            self.free_cpu_threads.update()
        self._copy_blocks(scheduler_output.blocks_to_copy)
        batch = self.prepare_inputs(scheduler_output)
        hidden = self.model(batch.input_ids, batch.positions, self.kv_caches, batch.meta)
        prompt_logprobs = self._prompt_logprobs(scheduler_output, batch.row_starts, hidden)
        if not batch.sample_rows:
            return ModelRunnerOutput(prompt_logprobs=prompt_logprobs)
        scheduled = [scheduler_output.scheduled[i] for i in batch.sample_rows]
        # A forking sequence's logits row is drawn from once per sequence of its request.
        repeats = [s.num_samples for s in scheduled]
        rows = [s.sampling_row if j == 0 else
                dataclasses.replace(s.sampling_row, seq_index=s.sampling_row.seq_index + j)
                for s in scheduled for j in range(s.num_samples)]
        # Host work while a GPU still runs the forward (its kernels are queued, not done).
        grammar_bitmask = self._fill_grammar_bitmask(rows)
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        if len(rows) > len(scheduled):  # a copy of every row (6 MB for 64 bf16 rows of SmolLM2) only then
            logits = logits.repeat_interleave(torch.tensor(repeats, device=self.device), dim=0)
        tokens = iter(self.sampler(logits, rows, grammar_bitmask))
        return ModelRunnerOutput({s.seq_id: [next(tokens) for _ in range(s.num_samples)]
                                  for s in scheduled}, prompt_logprobs)

    def _prompt_logprobs(self, scheduler_output: SchedulerOutput, row_starts: np.ndarray,
                         hidden: torch.Tensor) -> dict[str, tuple[int, list[SampledToken]]]:
        """``ModelRunnerOutput.prompt_logprobs``: for each scheduled prompt chunk of a request
        with ``prompt_logprobs``, the log-softmax of the raw logits at each of its positions
        (in fp32) taken at the prompt's next token, with its rank and the top alternatives;
        ``PROMPT_LOGPROB_ROWS`` rows of logits at a time (a [rows, vocab] fp32 block)."""
        found = {}
        for i, scheduled in enumerate(scheduler_output.scheduled):
            row = scheduled.sampling_row
            if row.params.prompt_logprobs is None:
                continue
            start = scheduled.num_computed_tokens  # the chunk's first position
            count = min(start + len(scheduled.token_ids), len(row.prompt_token_ids) - 1) - start
            if count <= 0:
                continue  # past the prompt (a decode), or a one-token prompt
            targets = torch.tensor(row.prompt_token_ids[start + 1:start + 1 + count], device=self.device)
            first_row, tokens = int(row_starts[i]), []
            for offset in range(0, count, PROMPT_LOGPROB_ROWS):
                size = min(PROMPT_LOGPROB_ROWS, count - offset)
                logits = self.model.compute_logits(hidden[first_row + offset:first_row + offset + size])
                tokens += logprob_tokens(torch.log_softmax(logits.float(), dim=-1),
                                         targets[offset:offset + size], row.params.prompt_logprobs)
            found[scheduled.seq_id] = (start + 1, tokens)
        return found

    def _fill_grammar_bitmask(self, rows: list[SamplingRow]):
        """The structured-outputs bitmasks of the constrained rows (``None`` if none is)."""
        if self._grammar_bitmask is None:
            if all(row.grammar is None for row in rows):
                return None
            from engine.structured_outputs import GrammarBitmask  # xgrammar: only once needed

            self._grammar_bitmask = GrammarBitmask(self.vocab_size, self.device)
        return self._grammar_bitmask.fill(rows)

    def _copy_blocks(self, blocks_to_copy: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks ``src -> dst`` in every layer (copy-on-write of forks)."""
        if blocks_to_copy:
            src, dst = (torch.tensor(x, device=self.device) for x in zip(*blocks_to_copy, strict=True))
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def prepare_inputs(self, scheduler_output: SchedulerOutput) -> BatchInputs:
        """Build the flattened batch tensors of DESIGN.md from a ``SchedulerOutput``."""
        host = build_host_batch(scheduler_output.scheduled, self.block_size)
        to = self._to_device
        # The torch reference reads query_start_loc, seq_lens and slot_mapping on the host:
        # from host memory that is free, from the device a sync in every layer.
        host_to = torch.from_numpy if self.backend == "torch" else to
        meta = AttentionMetadata(slot_mapping=host_to(host.slot_mapping),
                                 block_tables=to(host.block_tables),
                                 query_start_loc=host_to(host.query_start_loc),
                                 seq_lens=host_to(host.seq_lens), backend=self.backend,
                                 num_decodes=host.num_decodes)
        return BatchInputs(input_ids=to(host.input_ids), positions=to(host.positions), meta=meta,
                           logits_indices=to(host.logits_indices), sample_rows=host.sample_rows,
                           row_starts=host.row_starts)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(self.device, non_blocking=True)


@dataclass(slots=True)
class HostBatch:
    """A step's batch as host arrays, sequences reordered decodes first.

    Sequences with a query of one token (decodes) come first, the others (prefill chunks)
    after, each kind in scheduling order, so that the attention kernels can launch each kind
    with its own tiling (``kernels.triton_paged_attention``).
    """

    input_ids: np.ndarray        # [num_tokens] int64
    positions: np.ndarray        # [num_tokens] int64
    slot_mapping: np.ndarray     # [num_tokens] int64
    block_tables: np.ndarray     # [num_seqs, max_blocks] int32, zero-padded
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray         # [num_seqs] int32
    num_decodes: int             # leading sequences whose query is one token
    logits_indices: np.ndarray   # [len(sample_rows)] int64: last token of each sampling row
    sample_rows: list[int]       # indices into SchedulerOutput.scheduled, in its order
    row_starts: np.ndarray       # [len(scheduled)] int64: scheduled i's first row (of input_ids)


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype, backend: str) -> torch.dtype:
    """The KV cache's element type for the ``kv_cache_dtype`` setting.

    Args:
        kv_cache_dtype: ``"auto"`` (``dtype``), ``"fp8"`` or ``"fp8_e4m3"``
            (``torch.float8_e4m3fn``, saturating at +-448), or ``"fp8_e5m2"``
            (``torch.float8_e5m2``): the new K/V rounded to it as they are stored
            (``kernels.reference.store_kv``), widened exactly as attention reads them.
        dtype: the model's dtype.
        backend: the attention backend (``kernels.resolve_backend``'s answer).

    Raises:
        ValueError: naming ``kv_cache_dtype`` where the backend cannot read fp8 caches
            (the Triton kernels).
    """
    if kv_cache_dtype == "auto":
        return dtype
    if backend == "triton":
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} needs attention_backend 'cpu' or 'torch'; "
                         "the Triton kernels read caches of the model's dtype only")
    return torch.float8_e5m2 if kv_cache_dtype == "fp8_e5m2" else torch.float8_e4m3fn


def build_host_batch(scheduled: list[ScheduledRequest], block_size: int) -> HostBatch:
    """The flattened batch of DESIGN.md ("One step") for ``scheduled``, decodes first."""
    is_prefill = np.array([len(s.token_ids) != 1 for s in scheduled])
    order = np.argsort(is_prefill, kind="stable")
    batch = [scheduled[i] for i in order]
    query_lens = np.array([len(s.token_ids) for s in batch], dtype=np.int64)
    query_start_loc = np.zeros(len(batch) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    seq_lens = np.array([s.num_computed_tokens for s in batch], dtype=np.int64) + query_lens
    block_tables = np.zeros((len(batch), max(len(s.block_table) for s in batch)), dtype=np.int32)
    for i, s in enumerate(batch):
        block_tables[i, : len(s.block_table)] = s.block_table
    # positions: each sequence's [num_computed_tokens, seq_len)
    seq_index = np.repeat(np.arange(len(batch)), query_lens)
    positions = np.arange(int(query_start_loc[-1])) - query_start_loc[seq_index] \
        + (seq_lens - query_lens)[seq_index]
    slot_mapping = (block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)
    input_ids = np.fromiter((t for s in batch for t in s.token_ids), dtype=np.int64,
                            count=int(query_start_loc[-1]))
    sample_rows = [i for i, s in enumerate(scheduled) if s.do_sample]
    batch_row = np.empty(len(order), dtype=np.int64)
    batch_row[order] = np.arange(len(order))  # scheduled index -> row in the batch
    return HostBatch(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                     block_tables=block_tables, query_start_loc=query_start_loc.astype(np.int32),
                     seq_lens=seq_lens.astype(np.int32), num_decodes=int((~is_prefill).sum()),
                     logits_indices=query_start_loc[1:][batch_row[sample_rows]] - 1,
                     sample_rows=sample_rows, row_starts=query_start_loc[:-1][batch_row])


# Prompt positions whose logits are taken at once for prompt_logprobs: a [512, vocab] fp32
# block is 100 MB for SmolLM2's 49,152 tokens.
PROMPT_LOGPROB_ROWS = 512
HUGE_PAGE_BYTES = 2 << 20  # x86-64's transparent huge page
MADV_POPULATE_WRITE = 23  # Linux >= 5.14, include/uapi/asm-generic/mman-common.h
POPULATE_CHUNK_BYTES = 64 << 20


def populate(tensor: torch.Tensor) -> bool:
    """Back every page of a contiguous CPU tensor now, keeping its contents
    (``madvise(MADV_POPULATE_WRITE)``, in 64 MiB steps, the GIL released): what
    ``torch.zeros`` did at start for a ``lazily_zeroed_cpu`` tensor, for benchmarks whose timed
    runs should measure steps rather than the first touch of memory.

    Returns:
        False off Linux, or where the kernel lacks ``MADV_POPULATE_WRITE`` (before 5.14) or
        refuses it: the pages are then backed as they are first written, as without this call.
    """
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first = start - start % page
    end = start + nbytes
    for offset in range(first, end, POPULATE_CHUNK_BYTES):
        length = min(POPULATE_CHUNK_BYTES, end - offset)
        if libc.madvise(ctypes.c_void_p(offset), ctypes.c_size_t(length), MADV_POPULATE_WRITE) != 0:
            return False
    return True


def lazily_zeroed_cpu(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in fresh anonymous memory that nothing writes up front.

    ``torch.zeros`` writes every byte at once: for a 2 GiB KV cache that is the kernel backing
    and zeroing each page, then torch zeroing it again; measured 0.6-1.1 s on a quiet 2-core
    AMD EPYC VM and 3-25 s (all of it kernel time) where the VM's memory was cold, on every
    engine start. A private anonymous ``mmap`` reads as zeros by POSIX's definition, and the kernel
    backs a page the first time a step writes a block in it, so a start touches nothing and
    an engine commits only the blocks it uses, as vLLM's CPU backend (``torch.empty``) does
    without the zero guarantee. The start is aligned to ``HUGE_PAGE_BYTES`` and, where
    ``THP_MEM_ALLOC_ENABLE`` is on, advised onto transparent huge pages as torch's allocator
    does for its own buffers (``engine.threads``). The memory lives as long as the tensor
    (``torch.frombuffer`` keeps the mapping referenced).

    Args:
        shape: the tensor's shape.
        dtype: any torch dtype.

    Returns:
        A contiguous tensor of ``shape`` and ``dtype``, every element zero.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge_pages_requested() and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel built without THP: 4 KiB pages, as before
            mapping.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE_BYTES
    return raw[start:start + nbytes].view(dtype).view(shape)


def _per_layer(kv_cache: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer ``(k_cache, v_cache)`` views, each ``[num_blocks, block_size, num_kv_heads,
    head_dim]``."""
    return [(kv_cache[i, 0], kv_cache[i, 1]) for i in range(kv_cache.shape[0])]
