"""The Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral, SmolLM2) over a paged KV cache.

The forward takes the step's flattened token batch (no padding, no batch dimension):
``input_ids [num_tokens]`` and ``positions [num_tokens]``, plus an ``AttentionMetadata``
passed down explicitly. Numerics follow transformers' ``LlamaForCausalLM`` op for op (RMSNorm
in fp32, RoPE tables in fp32), so that fp32 greedy output matches it token for token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import kernels
from engine.models.compiled_glue import CompiledGlue

# The compiled glue (``compile_glue``) has two graphs per function. Steps of fewer than
# ``GLUE_PARALLEL_FROM_TOKENS`` tokens (decodes) run one whose kernels stay on the calling
# thread: Inductor's ``cpp.min_chunk_size`` (the fewest elements of a kernel each intra-op
# thread takes) is ``GLUE_MIN_CHUNK_ELEMENTS`` there, so no parallel region wakes the threads
# that the engine's short OpenMP spin (engine.threads) has let sleep. Larger steps run one
# whose kernels split over the threads (Inductor's default chunk, 512). Measured on an Intel
# Xeon with AMX-BF16, 2 vCPUs, bf16, 2026-12-03: w1_mixed in turns 465.6-491.8 output tok/s
# with the split from 128 tokens against 454.7-472.6 with no split at all. A split from 16
# tokens is faster per call from 16 tokens up (0.579 against 0.620 ms at 64, warm loop) and
# took an offline (``LLM``) 63-sequence decode step from 69.9-70.7 to 66.7-66.9 ms, but it
# cost ``AsyncLLM``, whose event loop thread shares the cores with the step's threads, 10-12%
# (w1, 32 and 64 requests at once, in process: 214.9-228.0 against 236.5-252.2 and 287.0-289.3
# against 325.5-347.5 tok/s; from 48 tokens 316.7-321.0), so it stays at 128 where a step loop
# shares its process with an event loop; docs/PERFORMANCE.md, "Decode steps: bf16 logits, ...".
# The offline ``LLM``, whose process runs nothing else while it steps, splits from
# ``GLUE_PARALLEL_FROM_TOKENS_OFFLINE`` tokens.
GLUE_MIN_CHUNK_ELEMENTS = 2**20
GLUE_PARALLEL_FROM_TOKENS = 128
GLUE_PARALLEL_FROM_TOKENS_OFFLINE = 16


def glue_parallel_from_tokens(offline: bool) -> int:
    """The fewest tokens of a step whose glue kernels split over the intra-op threads (above)."""
    return GLUE_PARALLEL_FROM_TOKENS_OFFLINE if offline else GLUE_PARALLEL_FROM_TOKENS


@dataclass(slots=True)
class AttentionMetadata:
    """Where each token of the step reads and writes the paged KV cache.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64, flat cache slot of each new token's K/V; in
            host memory for the ``"torch"`` backend (which reads it on the host), else on
            the device.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32, on the device.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths; placed as
            ``slot_mapping``.
        seq_lens: ``[num_seqs]`` int32, tokens per sequence including this step's; placed
            as ``slot_mapping``.
        backend: ``"torch"``, ``"cpu"`` or ``"triton"``, see ``kernels``.
        num_decodes: the first ``num_decodes`` sequences have a one-token query (host int).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    backend: str
    num_decodes: int = 0


def can_prepack_weights() -> bool:
    """Whether this torch build and CPU run oneDNN's bf16 matmul on prepacked weights
    (``Linear.prepack``): oneDNN is built in and the CPU has bf16 instructions."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _packed_linear_impl(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                       out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


# Registered through torch.library's low-level API rather than ``torch.library.custom_op``,
# whose Python wrapper checks its arguments and outputs on every call: 33 us of self time a
# call in a profiled decode step, which makes 121 of them (SmolLM2, 30 layers and the LM
# head). Intel Xeon with AMX-BF16, 2 vCPUs, bf16, 2026-12-02, alternating runs: a w1_mixed
# decode step of 58 sequences 90.0-91.9 -> 86.3 ms, the whole of w1_mixed 367.5-371.5 ->
# 376.7-384.3 output tok/s.
_LIBRARY = torch.library.Library("mini_infer", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, SymInt out_features) -> Tensor")
_LIBRARY.impl("packed_linear", _packed_linear_impl, "CompositeExplicitAutograd")


@torch.library.register_fake("mini_infer::packed_linear")
def _packed_linear_fake(x, packed_weight, bias, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a weight ``Linear.prepack`` reordered
    (``torch.ops.mini_infer.packed_linear``).

    Args:
        x: ``[num_tokens, in_features]``, bf16.
        packed_weight: the weight in oneDNN's blocked layout (``torch._mkldnn`` layout).
        bias: ``[out_features]`` or None.
        out_features: the weight's rows (the blocked tensor's shape is not traced).

    Returns:
        ``[num_tokens, out_features]`` in ``x``'s dtype.

    An opaque op to ``torch.compile``: Inductor's own lowering of ``mkldnn._linear_pointwise``
    takes the weight only as a constant of a frozen graph, and the compiled glue takes each
    layer's weights as inputs (one graph serves every layer).
    """
    return torch.ops.mini_infer.packed_linear(x, packed_weight, bias, out_features)


class Linear(nn.Linear):
    """``nn.Linear`` with two CPU modes: a bf16 matmul on a prepacked weight (``prepack``) and
    a matmul in fp32 while storing bf16 or fp16 (``upcast``).

    **Prepacked** (CPUs with bf16 instructions): torch's bf16 ``F.linear`` hands oneDNN the
    weight in its plain ``[out, in]`` layout, and oneDNN reorders it into its blocked
    layout on every call. ``prepack`` reorders it once at load time (what Inductor's
    freezing pass does for constant weights, ``torch._inductor.fx_passes.mkldnn_fusion``).
    Measured on an AMD EPYC with AVX512-BF16, SmolLM2-135M's shapes, 30 layers: 1.16-1.49x
    faster at 64 tokens, 1.36-1.52x at 16, 1.03-1.05x at 2,048, bit-identical outputs. The
    plain weight is released (``weight`` becomes None): the blocked copy is the only one.

    On CPUs without half-precision matrix instructions, torch's bf16 GEMM is an emulation 4x
    slower than fp32 (57 vs 233 GFLOP/s, 2048-square, measured on this project's CI CPU).
    Products of bf16 values are exact in fp32, so converting the operands and accumulating in
    fp32 gives what a native bf16 GEMM gives (bf16 inputs, fp32 accumulation), rounded back to
    the input dtype. The fp32 copy of the weight is either kept (``cache_fp32``: three times
    the bf16 weight memory in all, no conversion per call) or made per call.
    """

    upcast = False
    weight_fp32: torch.Tensor | None = None
    bias_fp32: torch.Tensor | None = None
    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, self.bias, self.out_features)
        if not self.upcast:
            return super().forward(x)
        weight = self.weight.float() if self.weight_fp32 is None else self.weight_fp32
        bias = self.bias_fp32
        if bias is None and self.bias is not None:
            bias = self.bias.float()
        return F.linear(x.float(), weight, bias).to(x.dtype)

    def prepack(self) -> None:
        """Reorder the bf16 weight into oneDNN's blocked layout (``packed_weight``) and release
        the plain one (``weight`` is None after; load weights before).

        Raises:
            RuntimeError: where ``can_prepack_weights()`` is False or the weight is not bf16.
        """
        if self.weight.dtype != torch.bfloat16 or not can_prepack_weights():
            raise RuntimeError(f"prepacked weights need bf16 weights and oneDNN's bf16 support; "
                               f"weight is {self.weight.dtype}, support {can_prepack_weights()}")
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.weight = None

    def set_upcast(self, upcast: bool, cache_fp32: bool) -> None:
        self.upcast = upcast
        keep = upcast and cache_fp32
        self.weight_fp32 = self.weight.detach().float() if keep else None
        self.bias_fp32 = self.bias.detach().float() if keep and self.bias is not None else None


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32 (Zhang & Sennrich 2019; transformers' order)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies ``[head_dim // 2]`` fp32 and the cos/sin scaling factor.

    The default is Su et al. 2021, ``1 / theta ** (2i / head_dim)``; scaled variants
    (``llama3``, ``linear``, ``yarn``, ...) come from transformers' ``ROPE_INIT_FUNCTIONS``.
    """
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = head_dim_of(config)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


def head_dim_of(config) -> int:
    """A transformers config's ``head_dim``, or ``hidden_size // num_attention_heads`` where it
    has none (the Llama convention)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables ``[max_position, head_dim]``, fp32, indexed by position."""

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        inv_freq, scaling = rope_inv_freq(config)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns cos, sin: ``[num_tokens, 1, head_dim]`` in ``dtype``."""
        return self.cos[positions].to(dtype)[:, None], self.sin[positions].to(dtype)[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x: [num_tokens, num_heads, head_dim]`` (the rotate-half convention):
    ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``, written per half
    so that no rotated copy of ``x`` is made: each element is the same two products and one
    add or subtract (``a + (-b) * c`` is exactly ``a - b * c``), so the results are bitwise
    those of the rotate-half form. Compiled, it is one kernel writing both halves; the
    rotate-half form had Inductor write the rotated copy and read it back (~0.66 ms of a
    2,048-token step's glue per layer on an Intel Xeon with AMX-BF16)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos[..., :half] - x2 * sin[..., :half],
                      x2 * cos[..., half:] + x1 * sin[..., half:]), dim=-1)


class Attention(nn.Module):
    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim ** -0.5
        self.layer_idx = layer_idx
        bias = has_qkv_bias(config)
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.qkv_proj = Linear(config.hidden_size, qkv_size, bias=bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size,
                                bias=getattr(config, "attention_bias", False) and not is_qwen2(config))

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """``x [num_tokens, hidden_size]`` -> q ``[num_tokens, num_heads, head_dim]``, k and v
        ``[num_tokens, num_kv_heads, head_dim]``, RoPE applied to q and k."""
        num_tokens = x.shape[0]
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(x).split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        return q, k, v.view(num_tokens, self.num_kv_heads, self.head_dim)

    def attend(self, q, k, v, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        """Store this step's K/V, then paged attention: ``[num_tokens, num_heads, head_dim]``."""
        k_cache, v_cache = kv_cache
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping, backend=meta.backend)
        return kernels.paged_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                       meta.seq_lens, self.scale, backend=meta.backend,
                                       num_decodes=meta.num_decodes)


class MLP(nn.Module):
    """SwiGLU feed-forward with one fused gate/up projection.

    Attributes:
        silu_and_mul: None (``F.silu(gate) * up`` in torch), or a function of the projection's
            output ``[num_tokens, 2 * intermediate_size]`` returning ``silu(gate) * up``
            ``[num_tokens, intermediate_size]`` (``LlamaForCausalLM.set_silu_and_mul``).
    """

    silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def __init__(self, config) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.silu_and_mul is not None:
            return self.down_proj(self.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """One decoder layer's modules. ``LlamaForCausalLM.forward`` runs it as
    ``layer_before_attention``, ``Attention.attend``, ``layer_after_attention`` (glue compiled
    or not; between two layers' attention the after and before glue are one function,
    ``layer_between_attentions``)."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)


def layer_before_attention(layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """A decoder layer's glue up to the attention kernels: input RMSNorm, q/k/v
    projection, RoPE. Returns ``(q, k, v)`` as ``Attention.project_qkv``."""
    return layer.self_attn.project_qkv(layer.input_layernorm(x), cos, sin)


def layer_after_attention(layer: DecoderLayer, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """A decoder layer's glue after the attention kernels: output projection,
    residual add, RMSNorm, SwiGLU MLP, residual add. ``o [num_tokens, num_heads, head_dim]``,
    ``x`` the layer's input; returns the layer's output ``[num_tokens, hidden_size]``."""
    x = x + layer.self_attn.o_proj(o.flatten(1))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def layer_between_attentions(layer: DecoderLayer, next_layer: DecoderLayer, x: torch.Tensor, o: torch.Tensor,
                             cos: torch.Tensor, sin: torch.Tensor):
    """``layer_after_attention`` of ``layer`` then ``layer_before_attention`` of the next one,
    as one function: one compiled call between two layers' attention instead of two (see
    ``LlamaForCausalLM.compile_glue``). Returns ``(x, q, k, v)``: the next layer's input and
    its projections."""
    x = layer_after_attention(layer, x, o)
    return (x, *layer_before_attention(next_layer, x, cos, sin))


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over the project's paged attention.

    Args:
        config: a transformers config of the Llama family (``LlamaConfig``, ``Qwen2Config``,
            ``MistralConfig``).
        max_position: length of the RoPE tables (the engine's ``max_model_len``).
    """

    def __init__(self, config, max_position: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, max_position)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.upcast_matmul = False
        self.lm_head_fp32: torch.Tensor | None = None
        self.lm_head_packed: torch.Tensor | None = None  # see prepack_weights
        self.compiled_glue = None  # (before, between, after) attention: see compile_glue
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over the step's tokens.

        Args:
            input_ids: ``[num_tokens]`` int64.
            positions: ``[num_tokens]`` int64, each token's position in its sequence.
            kv_caches: per layer ``(k_cache, v_cache)``, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]``.
            meta: the step's attention metadata.

        Returns:
            Final hidden states ``[num_tokens, hidden_size]`` in the model's dtype.
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions, x.dtype)
        before, between, after = self.compiled_glue or (layer_before_attention, layer_between_attentions,
                                                        layer_after_attention)
        layers = tuple(self.layers)  # slicing or indexing the ModuleList costs ~40-60 us a step
        q, k, v = before(layers[0], x, cos, sin)
        for layer, next_layer, kv_cache in zip(layers[:-1], layers[1:], kv_caches[:-1], strict=True):
            o = layer.self_attn.attend(q, k, v, kv_cache, meta)
            x, q, k, v = between(layer, next_layer, x, o, cos, sin)
        x = after(layers[-1], x, layers[-1].self_attn.attend(q, k, v, kv_caches[-1], meta))
        return self.norm(x)

    def compile_glue(self, key: tuple | None = None, offline: bool = False) -> None:
        """Run the layers' glue through Inductor (``engine.models.compiled_glue``): RMSNorm,
        RoPE, SiLU x mul and the residual adds become a few fused kernels instead of ~40 small
        ops a layer, each a parallel region that wakes the intra-op threads (SiLU x mul stays
        an opaque call where ``set_silu_and_mul`` gave the MLPs a kernel). The glue between
        two layers' attention is one function (``layer_between_attentions``), so a step makes
        one compiled call per layer (31 for 30 layers: the first layer's
        ``layer_before_attention`` and the last one's ``layer_after_attention`` too) rather
        than two. Each graph takes the layers' tensors as inputs, so one serves every layer,
        and a symbolic token count, so one serves every step; the calls go to the compiled
        graphs directly, without Dynamo (~0.15 ms a call saved, see ``CompiledGlue``). The
        attention kernels stay outside. Each graph is compiled at its first call
        (``ModelRunner`` makes it at start-up); Inductor caches the result on disk for later
        processes, and engines of one process share graphs under the same ``key``.

        Steps of fewer than ``GLUE_PARALLEL_FROM_TOKENS`` tokens (``offline``:
        ``GLUE_PARALLEL_FROM_TOKENS_OFFLINE``) run graphs whose kernels stay on the calling
        thread, larger ones graphs whose kernels split over the threads.

        Args:
            key: what the graphs may be shared under between engines of this process (the
                model's config, dtype and matmul mode); ``None``: not shared.
            offline: nothing else in this process runs while a step does (the offline
                ``LLM``; not ``AsyncLLM``, whose event loop does). The graphs are the same (a
                function ``set_silu_and_mul`` gave may hold the split itself)."""
        parallel_from = glue_parallel_from_tokens(offline)
        options = {"cpp.min_chunk_size": GLUE_MIN_CHUNK_ELEMENTS}
        self.compiled_glue = (
            CompiledGlue(layer_before_attention, 1, key, options, parallel_from),
            CompiledGlue(layer_between_attentions, 2, key, options, parallel_from),
            CompiledGlue(layer_after_attention, 1, key, options, parallel_from))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> logits ``[n, vocab_size]`` in the model's dtype (fp32 where
        matmuls are upcast); the sampler takes them to fp32 where it processes them (as vLLM's
        sampler does), and a plain greedy batch takes its argmax as they are."""
        if self.lm_head_packed is not None:
            return packed_linear(hidden, self.lm_head_packed, None, self.config.vocab_size)
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        if self.upcast_matmul:
            weight = weight.float() if self.lm_head_fp32 is None else self.lm_head_fp32
            return F.linear(hidden.float(), weight)
        return F.linear(hidden, weight)

    def set_silu_and_mul(self, silu_and_mul: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        """Every MLP's activation through ``silu_and_mul`` (e.g. the CPU backend's C++ kernel,
        ``kernels.cpu_attention.silu_and_mul``), or torch's ``F.silu(gate) * up`` where None.
        Set before ``compile_glue``: the graphs are traced with it."""
        for module in self.modules():
            if isinstance(module, MLP):
                module.silu_and_mul = silu_and_mul

    def prepack_weights(self) -> None:
        """Every projection and the LM head on prepacked bf16 weights (``Linear.prepack``);
        call after ``load_weights``. A tied LM head keeps the embedding's plain weight (the
        lookup needs it) and gets a blocked copy.

        Raises:
            RuntimeError: as ``Linear.prepack``.
        """
        for module in self.modules():
            if isinstance(module, Linear):
                module.prepack()
        self.lm_head_packed = (torch.ops.mkldnn._reorder_linear_weight(self.embed_tokens.weight.detach(), None)
                               if self.tie_word_embeddings else self.lm_head.packed_weight)

    def weight_bytes(self) -> int:
        """Bytes of the model's weights, each counted once: the parameters, and each prepacked
        projection's blocked copy in place of the plain weight it replaced (``prepack_weights``;
        a tied LM head's blocked copy of the embedding is not counted again)."""
        packed = [m.packed_weight for m in self.modules() if isinstance(m, Linear) and m.packed_weight is not None]
        return sum(t.numel() * t.element_size() for t in [*self.parameters(), *packed])

    def set_upcast_matmul(self, upcast: bool, cache_fp32: bool = False) -> None:
        """Run every matmul in fp32 over the stored dtype (see ``Linear``), keeping fp32
        copies of the weights when ``cache_fp32`` (call after the weights are loaded)."""
        self.upcast_matmul = upcast
        for module in self.modules():
            if isinstance(module, Linear):
                module.set_upcast(upcast, cache_fp32)
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        self.lm_head_fp32 = weight.detach().float() if upcast and cache_fp32 else None

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load transformers-named weights, fusing q/k/v and gate/up projections.

        Raises:
            KeyError: naming any weight the model needs that ``state_dict`` lacks.
        """
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in _fused_weights(state_dict, self.tie_word_embeddings).items():
            if name not in params:
                continue
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise KeyError(f"weights missing from the checkpoint: {missing[:5]}"
                           f"{' ...' if len(missing) > 5 else ''}")


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _fused_weights(state_dict: dict[str, torch.Tensor], tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Map transformers' names (``model.layers.0.self_attn.q_proj.weight``) to ours, fusing
    q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (concatenated on dim 0)."""
    weights = {name.removeprefix("model."): tensor for name, tensor in state_dict.items()}
    if tie_word_embeddings:
        weights.pop("lm_head.weight", None)
    for fused, members in _FUSED.items():
        first = f".{members[0]}."
        for name in [n for n in weights if first in n]:
            parts = [weights.pop(name.replace(first, f".{m}.")) for m in members]
            weights[name.replace(first, f".{fused}.")] = torch.cat(parts, dim=0)
    return weights


def is_qwen2(config) -> bool:
    return getattr(config, "model_type", "") == "qwen2"


def has_qkv_bias(config) -> bool:
    """Qwen2 always has q/k/v biases; Llama has them when ``attention_bias`` is set."""
    return is_qwen2(config) or bool(getattr(config, "attention_bias", False))
