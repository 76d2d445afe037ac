"""Which binaries Triton compiles for a run, found without a GPU; and those binaries, compiled
ahead of time. For tests, the CUDA compile check and ``bench/gpu_check``; the engine does not
import this module.

Triton compiles a kernel once per *variant*: per distinct constexpr values, argument dtypes,
launch options (``num_warps``) and specialisation of the other arguments (an integer equal
to 1 becomes a constant, multiples of 16 and 16-byte-aligned pointers get divisibility
hints, unless the kernel lists the argument in ``do_not_specialize``). ``LaunchRecorder``
replaces the project's Triton kernels by recorders that key every launch with Triton's own
argument binder for a CUDA target, so that replaying a workload on ``meta`` tensors counts
the variants a GPU would compile, and launches nothing. ``compile_launch`` compiles one
recorded launch through PTX to a cubin with the installed Triton's ``ptxas``.

The binder (``triton.runtime.jit.create_function_from_signature``) and ``ASTSource`` are
Triton internals; this module was checked against Triton 3.4, 3.6 and 3.9.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from kernels import triton_paged_attention, triton_store_kv

# (module, attribute) of every kernel the project launches.
KERNELS = ((triton_paged_attention, "_paged_attention_kernel"),
           (triton_paged_attention, "_reduce_splits_kernel"),
           (triton_store_kv, "_store_kv_kernel"))


@dataclass(frozen=True)
class Launch:
    """One recorded launch: the kernel, its variant key, and what it was called with."""

    kernel: str
    key: tuple  # equal keys: the same compiled binary
    grid: tuple
    args: tuple
    kwargs: dict


def as_jit_function(kernel) -> JITFunction:
    """The ``JITFunction`` of a kernel, also where ``TRITON_INTERPRET=1`` made it an
    interpreted one (same Python function and ``triton.jit`` arguments)."""
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)


class _Recording:
    """Stands in for one kernel: ``kernel[grid](*args, **kwargs)`` records a ``Launch``."""

    def __init__(self, name: str, kernel, recorder: "LaunchRecorder") -> None:
        self.name = name
        self.fn = as_jit_function(kernel)
        self.binder = create_function_from_signature(self.fn.signature, self.fn.params,
                                                     recorder.backend)
        self.recorder = recorder

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _, specialization, options = self.binder(*args, **kwargs)
            key = (self.name, tuple(specialization), tuple(sorted(options.items())))
            self.recorder.launches.append(Launch(self.name, key, tuple(grid), args, kwargs))
        return launch


class LaunchRecorder:
    """Context manager: while active, the project's Triton kernels record their launches
    (``launches``) instead of running.

    Args:
        arch: the CUDA compute capability to key variants for (90: H100/H200).
    """

    def __init__(self, arch: int = 90) -> None:
        self.target = GPUTarget("cuda", arch, 32)
        self.backend = make_backend(self.target)
        self.launches: list[Launch] = []
        self._saved: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "LaunchRecorder":
        for module, name in KERNELS:
            kernel = getattr(module, name)
            self._saved.append((module, name, kernel))
            setattr(module, name, _Recording(name, kernel, self))
        return self

    def __exit__(self, *exc) -> None:
        for module, name, kernel in reversed(self._saved):
            setattr(module, name, kernel)
        self._saved.clear()

    def variants(self, kernel: str | None = None) -> dict[tuple, Launch]:
        """Distinct variant keys (of one kernel, or all), each with its first launch."""
        found: dict[tuple, Launch] = {}
        for launch in self.launches:
            if kernel is None or launch.kernel == kernel:
                found.setdefault(launch.key, launch)
        return found


def compile_launch(launch: Launch, arch: int) -> Any:
    """Compile a recorded launch's variant for ``sm_<arch>`` (PTX, then a cubin through the
    installed Triton's ``ptxas``); returns Triton's compiled kernel (``.metadata``,
    ``.asm``). Kernels must not be interpreted (no ``TRITON_INTERPRET=1`` at import).

    Raises:
        Whatever Triton's compiler raises for code it rejects.
    """
    module, name = next((m, n) for m, n in KERNELS if n == launch.kernel)
    fn = as_jit_function(getattr(module, name))
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, _ = binder(*launch.args, **launch.kwargs)
    names = [p.name for p in fn.params]
    signature = {n: spec[0] for n, spec in zip(names, specialization, strict=True)}
    constexprs = {(i,): value for i, (value, spec) in enumerate(zip(bound_args.values(), specialization, strict=True))
                  if spec[0] == "constexpr"}
    attrs = {(i,): backend.parse_attr(spec[1]) for i, spec in enumerate(specialization)
             if spec[0] != "constexpr" and isinstance(spec[1], str)}
    options = backend.parse_options(launch.kwargs)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


def compiled_variant_counts() -> dict[str, int]:
    """How many variants of each project kernel this process has compiled (or loaded from
    Triton's disk cache) so far, on any device; reads ``JITFunction.device_caches``.
    Empty under the interpreter, which compiles nothing."""
    counts = {}
    for module, name in KERNELS:
        kernel = getattr(module, name)
        caches = getattr(kernel, "device_caches", None)
        if isinstance(kernel, JITFunction) and caches is not None:
            counts[name] = sum(len(entry[0]) for entry in caches.values())
    return counts
