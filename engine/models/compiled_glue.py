"""The decoder layers' glue compiled by Inductor and called without Dynamo.

``torch.compile`` puts Dynamo in front of every call of a compiled function: its frame hook,
the cache lookup and guard check, the bytecode that gathers the graph's ~15 inputs from the
two layers' attributes, and AOTAutograd's runtime wrappers. For the glue between two layers'
attention that is ~0.15 ms a call, 31 calls a step: 4-5 ms of a 25 ms one-sequence decode
step (bf16, Intel Xeon with AMX, 2 vCPUs; docs/PERFORMANCE.md). Here each glue function is
traced once (``make_fx``, symbolic token count) with the layers' tensors as explicit inputs,
compiled by Inductor (``torch._inductor.standalone_compile``), and called directly with the
inputs gathered once per layer: what vLLM does by calling its compiled graphs without
Dynamo's guards. Nothing checks guards at call time, so everything a guard would check is
fixed here instead: the graph takes tensors only, each layer must hold tensors of the same
names, dtypes and shapes as the layer it was traced with (checked once per layer), the
layers' plain attributes (``eps``, ``out_features``, flags) are constants of the graph (the
same in every layer of a model), and only the token count (dim 0 of every input) varies.

Inductor decides at compile time, from the token count of the trace, how a kernel's loops
split over the intra-op threads. So each function has two graphs: one traced at a decode's
token count whose kernels stay on the calling thread, and one traced at a prefill's whose
kernels split (``CompiledGlue``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

# The token counts the two graphs are traced at: Inductor decides from them how a kernel's
# loops split over the intra-op threads (``cpp.min_chunk_size`` elements a thread at least).
# Neither is 0 or 1 (torch specialises those) nor a size of any weight or head (a token count
# equal to one would be unified with it and specialised): ``_trace_tokens`` moves up from
# these past any such size.
SERIAL_TRACE_TOKENS = 37
PARALLEL_TRACE_TOKENS = 1999

# Compiled graphs of this process, by (caller's key, function name): engines of the same
# model, dtype and matmul mode (tests build many in one process) share them, as they shared
# torch.compile's.
_GRAPHS: dict[tuple, Callable] = {}
_GRAPHS_LOCK = threading.Lock()


def module_tensors(modules: tuple[nn.Module, ...]) -> dict[str, torch.Tensor]:
    """Every tensor the glue may read from ``modules``: parameters, buffers and plain tensor
    attributes (a prepacked weight, a cached fp32 copy), named ``"{i}.{path}"`` for module
    ``i``, sorted by name."""
    found = {}
    for i, root in enumerate(modules):
        for path, module in root.named_modules():
            prefix = f"{i}.{path}." if path else f"{i}."
            for name, value in module._parameters.items():
                if value is not None:
                    found[prefix + name] = value
            for name, value in module._buffers.items():
                if value is not None:
                    found[prefix + name] = value
            for name, value in vars(module).items():
                if isinstance(value, torch.Tensor):
                    found[prefix + name] = value
    return dict(sorted(found.items()))


class _Modules(nn.Module):
    """The modules a glue function takes, under one root for ``functional_call``."""

    def __init__(self, fn: Callable, modules: tuple[nn.Module, ...]) -> None:
        super().__init__()
        self.fn = fn
        for i, module in enumerate(modules):
            self.add_module(str(i), module)

    def forward(self, *inputs: torch.Tensor):
        out = self.fn(*self._modules.values(), *inputs)
        return out if isinstance(out, tuple) else (out,)


def _trace_tokens(start: int, shapes) -> int:
    taken = {size for shape in shapes for size in shape}
    tokens = start
    while tokens in taken:
        tokens += 1
    return tokens


class CompiledGlue:
    """One glue function ``fn(*modules, *inputs)`` (``inputs``: contiguous tensors whose dim 0
    is the step's token count), compiled at its first call and then called without Dynamo.

    Two graphs of it: steps of fewer than ``parallel_from`` tokens (decodes) run one whose
    kernels stay on the calling thread (traced at ``SERIAL_TRACE_TOKENS``, with ``options``),
    larger steps one whose kernels split over the intra-op threads (traced at
    ``PARALLEL_TRACE_TOKENS``, Inductor's default chunk size). Each is compiled the first time
    a step of its kind calls it.

    Args:
        fn: the eager function, e.g. ``llama.layer_between_attentions``.
        num_modules: how many leading arguments are modules (their tensors become inputs).
        key: what the compiled graphs may be shared under in this process besides ``fn``'s
            name (the model's config, dtype and matmul mode); ``None``: not shared.
        options: Inductor config of the serial graph (``torch._inductor.config.patch``).
        parallel_from: the fewest tokens that take the parallel graph; ``None``: never.

    Raises (at a graph's first call, or for a layer not seen before):
        ValueError: a layer whose tensors differ in name, dtype or shape from the first one's.
        RuntimeError: the trace specialised the token count (it would serve one size only).
    """

    def __init__(self, fn: Callable, num_modules: int, key: tuple | None = None,
                 options: dict | None = None, parallel_from: int | None = None) -> None:
        self.fn = fn
        self.num_modules = num_modules
        self.key = None if key is None else (*key, fn.__name__)
        self.options = dict(options or {})
        self.parallel_from = parallel_from
        # serial, parallel; those another engine of this process compiled under the same key
        self.graphs: list[Callable | None] = [None if self.key is None else _GRAPHS.get((*self.key, parallel))
                                              for parallel in (False, True)]
        self.single_output = False
        self.names: tuple[str, ...] | None = None
        self.signature: tuple | None = None  # each tensor's (dtype, shape), as traced
        self._weights: dict[tuple[nn.Module, ...], tuple[torch.Tensor, ...]] = {}

    def __call__(self, *args):
        modules, inputs = args[:self.num_modules], args[self.num_modules:]
        weights = self._weights.get(modules)
        if weights is None:
            weights = self._layer_weights(modules, inputs)
        parallel = self.parallel_from is not None and inputs[0].shape[0] >= self.parallel_from
        graph = self.graphs[parallel]
        if graph is None:
            graph = self._compile(parallel, modules, inputs)
        out = graph(*weights, *inputs)
        return out[0] if self.single_output else tuple(out)

    def _layer_weights(self, modules: tuple[nn.Module, ...], inputs) -> tuple[torch.Tensor, ...]:
        tensors = module_tensors(modules)
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors.values())
        if self.names is None:
            self.names, self.signature = tuple(tensors), signature
            with torch.no_grad():
                self.single_output = not isinstance(self.fn(*modules, *inputs), tuple)
        elif tuple(tensors) != self.names or signature != self.signature:
            raise ValueError(f"{self.fn.__name__}: these layers' tensors differ from those it was "
                             f"compiled for: {sorted(set(tensors) ^ set(self.names))} or their "
                             "dtypes and shapes")
        weights = tuple(tensors.values())
        self._weights[modules] = weights
        return weights

    def _compile(self, parallel: bool, modules, inputs) -> Callable:
        key = None if self.key is None else (*self.key, parallel)
        with _GRAPHS_LOCK:
            graph = None if key is None else _GRAPHS.get(key)
            if graph is None:
                graph = self._trace_and_compile(parallel, modules, inputs)
                if key is not None:
                    _GRAPHS[key] = graph
        self.graphs[parallel] = graph
        return graph

    def _trace_and_compile(self, parallel: bool, modules, inputs) -> Callable:
        root = _Modules(self.fn, modules)
        tensors = module_tensors(modules)
        names = list(tensors)
        tokens = _trace_tokens(PARALLEL_TRACE_TOKENS if parallel else SERIAL_TRACE_TOKENS,
                               [t.shape for t in tensors.values()] + [t.shape[1:] for t in inputs])
        examples = [torch.zeros((tokens, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in inputs]

        def flat(*args):
            return torch.func.functional_call(root, dict(zip(names, args[:len(names)], strict=True)),
                                              args[len(names):], strict=False)

        args = [*tensors.values(), *examples]
        with torch.no_grad():
            gm = make_fx(flat, tracing_mode="symbolic")(*args)
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"][len(names):]
        if not all(isinstance(n.meta["val"].shape[0], torch.SymInt) for n in placeholders):
            raise RuntimeError(f"{self.fn.__name__}: tracing fixed the token count at {tokens}")
        options = {} if parallel else self.options
        with torch.no_grad(), torch._inductor.config.patch(options):
            return torch._inductor.standalone_compile(gm, args, dynamic_shapes="from_graph")
