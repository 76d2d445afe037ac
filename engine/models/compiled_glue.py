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
same in every layer of a model), the step inputs' dtypes are checked on every call, and
only the token count (dim 0 of every step input) is symbolic: every other size is a
constant of the graph, which Inductor's own code checks on every call with the strides. One
limit: torch assumes a symbolic size is at least 2 while tracing, so a branch of ``fn`` on
``num_tokens > 1`` would take the many-token side silently; the model's glue has no such
branch, and the tests compare one-token steps with eager.

Inductor decides at compile time, from the token count of the trace, how a kernel's loops
split over the intra-op threads. So each function has two graphs: one traced at a decode's
token count whose kernels stay on the calling thread, and one traced at a prefill's whose
kernels split (``CompiledGlue``).
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

# The token counts the two graphs are traced at: Inductor decides from them how a kernel's
# loops split over the intra-op threads (``cpp.min_chunk_size`` elements a thread at least).
# Not 0 or 1, which torch specialises.
SERIAL_TRACE_TOKENS = 37
PARALLEL_TRACE_TOKENS = 1999


@dataclass(frozen=True, slots=True)
class _Spec:
    """What a graph was traced for: the layers' tensors (names, then each one's dtype and
    shape), the step inputs' dtypes and trailing sizes, and whether ``fn`` returns one tensor."""

    names: tuple[str, ...]
    weights: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    inputs: tuple[tuple[torch.dtype, tuple[int, ...]], ...]
    single_output: bool


# Compiled graphs of this process with their specs, by (caller's key, function name,
# parallel): engines of the same model, dtype and matmul mode (tests build many in one
# process) share them, as they shared torch.compile's.
_GRAPHS: dict[tuple, tuple[Callable, _Spec]] = {}
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


class CompiledGlue:
    """One glue function ``fn(*modules, *inputs)`` (``inputs``: contiguous tensors whose dim 0
    is the step's token count), compiled at its first call and then called without Dynamo.

    Two graphs of it: steps of fewer than ``parallel_from`` tokens (decodes) run one whose
    kernels stay on the calling thread (traced at ``SERIAL_TRACE_TOKENS``, with ``options``),
    larger steps one whose kernels split over the intra-op threads (traced at
    ``PARALLEL_TRACE_TOKENS``, Inductor's default chunk size). Each is compiled the first time
    a step of its kind calls it.

    A layer's tensors are read once, at its first call: a weight replaced by another tensor
    object afterwards is not seen (copying into it, as loading weights does, is).

    Args:
        fn: the eager function, e.g. ``llama.layer_between_attentions``.
        num_modules: how many leading arguments are modules (their tensors become inputs).
        key: what the compiled graphs may be shared under in this process besides ``fn``'s
            name (the model's config, dtype and matmul mode); ``None``: not shared.
        options: Inductor config of the serial graph (``torch._inductor.config.patch``).
        parallel_from: the fewest tokens that take the parallel graph; ``None``: never.

    Calls return what ``fn`` returns: one tensor, or a tuple of them.

    Raises (from a call):
        ValueError: a layer whose tensors differ in name, dtype or shape from those of the
            first layer, or of the graph shared under ``key``; step inputs of other dtypes or
            trailing sizes than the first call's.
        RuntimeError: the trace fixed the token count (a graph would serve one size only).
        AssertionError: from Inductor's graph, inputs whose strides differ from the trace's
            (a non-contiguous one).
    """

    def __init__(self, fn: Callable, num_modules: int, key: tuple | None = None,
                 options: dict | None = None, parallel_from: int | None = None) -> None:
        self.fn = fn
        self.num_modules = num_modules
        self.key = None if key is None else (*key, fn.__name__)
        self.options = dict(options or {})
        self.parallel_from = parallel_from
        self.graphs: list[Callable | None] = [None, None]  # serial, parallel
        self.spec: _Spec | None = None  # from the first call
        self._input_dtypes: tuple[torch.dtype, ...] = ()
        self._weights: dict[tuple[nn.Module, ...], tuple[torch.Tensor, ...]] = {}

    def compiled_up_to(self, max_tokens: int) -> bool:
        """Whether the graphs that steps of 1 to ``max_tokens`` tokens take are compiled in
        this process under ``key`` (so no such step waits for a compile)."""
        serial = self.parallel_from is None or self.parallel_from > 1
        parallel = self.parallel_from is not None and max_tokens >= self.parallel_from
        kinds = [kind for kind, used in ((False, serial), (True, parallel)) if used]
        return self.key is not None and all((*self.key, kind) in _GRAPHS for kind in kinds)

    def __call__(self, *args):
        modules, inputs = args[:self.num_modules], args[self.num_modules:]
        weights = self._weights.get(modules)
        if weights is None:
            weights = self._layer_weights(modules, inputs)
        if tuple(t.dtype for t in inputs) != self._input_dtypes:
            self._refuse_inputs(inputs)
        parallel = self.parallel_from is not None and inputs[0].shape[0] >= self.parallel_from
        graph = self.graphs[parallel]
        if graph is None:
            graph = self._graph(parallel, modules, inputs)
        out = graph(*weights, *inputs)
        return out[0] if self.spec.single_output else tuple(out)

    def _layer_weights(self, modules: tuple[nn.Module, ...], inputs) -> tuple[torch.Tensor, ...]:
        tensors = module_tensors(modules)
        names = tuple(tensors)
        signature = tuple((t.dtype, tuple(t.shape)) for t in tensors.values())
        if self.spec is None:
            with torch.no_grad():
                single = not isinstance(self.fn(*modules, *inputs), tuple)
            self.spec = _Spec(names, signature, tuple((t.dtype, tuple(t.shape[1:])) for t in inputs), single)
            self._input_dtypes = tuple(t.dtype for t in inputs)
        elif (names, signature) != (self.spec.names, self.spec.weights):
            raise ValueError(f"{self.fn.__name__}: these layers' tensors differ from those it was "
                             f"compiled for: {sorted(set(names) ^ set(self.spec.names))} or their "
                             "dtypes and shapes")
        weights = tuple(tensors.values())
        self._weights[modules] = weights
        return weights

    def _refuse_inputs(self, inputs) -> None:
        got = tuple((t.dtype, tuple(t.shape[1:])) for t in inputs)
        raise ValueError(f"{self.fn.__name__}: step inputs of dtypes and trailing sizes {got}; it "
                         f"was compiled for {self.spec.inputs}")

    def _graph(self, parallel: bool, modules, inputs) -> Callable:
        if tuple((t.dtype, tuple(t.shape[1:])) for t in inputs) != self.spec.inputs:
            self._refuse_inputs(inputs)
        key = None if self.key is None else (*self.key, parallel)
        with _GRAPHS_LOCK:
            graph, spec = _GRAPHS.get(key, (None, None)) if key is not None else (None, None)
            if graph is None:
                graph, spec = self._trace_and_compile(parallel, modules, inputs), self.spec
                if key is not None:
                    _GRAPHS[key] = graph, spec
        if spec != self.spec:
            raise ValueError(f"{self.fn.__name__}: these layers' tensors or inputs differ from those "
                             f"the graph shared under its key was compiled for")
        self.graphs[parallel] = graph
        return graph

    def _trace_and_compile(self, parallel: bool, modules, inputs) -> Callable:
        root = _Modules(self.fn, modules)
        names, weights = self.spec.names, self._weights[modules]  # read at this layer's first call
        tokens = PARALLEL_TRACE_TOKENS if parallel else SERIAL_TRACE_TOKENS
        examples = [torch.zeros((tokens, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in inputs]

        def flat(*args):
            return torch.func.functional_call(root, dict(zip(names, args[:len(names)], strict=True)),
                                              args[len(names):], strict=False)

        # Only the token count (dim 0 of each step input; duck sizing makes them one symbol)
        # is symbolic; every other size is a constant of the graph.
        fake_mode = FakeTensorMode(shape_env=ShapeEnv())

        def fake(t: torch.Tensor, token_dim: bool) -> torch.Tensor:
            sizes = [DimDynamic.DYNAMIC if token_dim and d == 0 else DimDynamic.STATIC for d in range(t.dim())]
            return fake_mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

        args = [*weights, *examples]
        fakes = [fake(t, i >= len(names)) for i, t in enumerate(args)]
        with torch.no_grad():
            gm = make_fx(flat, tracing_mode="symbolic")(*fakes)
        for node in [n for n in gm.graph.nodes if n.op == "placeholder"][len(names):]:
            if node.meta["val"].shape[0].node.maybe_as_int() is not None:  # a guard fixed it
                raise RuntimeError(f"{self.fn.__name__}: tracing fixed the token count at {tokens}")
        options = {} if parallel else self.options
        with torch.no_grad(), torch._inductor.config.patch(options):
            return torch._inductor.standalone_compile(gm, fakes, dynamic_shapes="from_example_inputs",
                                                      fake_mode=fake_mode)
