"""The CPU attention's ``MINI_INFER_CPU_*`` settings and their choices, without torch: so that
``make run`` can check them (``app.config``) before Ray starts and before the extension is
built, in a Python that may not have torch. ``kernels.cpu_attention`` reads them.
"""
from __future__ import annotations

import os

ISA_ENV = "MINI_INFER_CPU_ISA"  # the kernels a call that names none runs: "auto" or a name
ISA_CHOICES = ("auto", "avx512_bf16", "avx512", "avx2", "scalar")  # the extension's kernel tables' names
PREFILL_ENV = "MINI_INFER_CPU_PREFILL"  # how long bf16 prefill chunks run: "auto", "sdpa" or "tiles"
PREFILL_CHOICES = ("auto", "sdpa", "tiles")
PREFETCH_ENV = "MINI_INFER_CPU_PREFETCH"  # where decode prefetches K/V rows: "auto", "l1" or "l2"
PREFETCH_CHOICES = ("auto", "l1", "l2")


def choice(value: str | None, name: str, env: str, choices: tuple[str, ...]) -> str:
    """``value``, or where None ``$env``, else ``"auto"``, checked against ``choices``.

    Raises:
        ValueError: naming ``name``, or ``env`` where the value came from there.
    """
    source = name
    if value is None:
        value, source = os.environ.get(env) or "auto", env
    if value not in choices:
        raise ValueError(f"{source} must be one of {', '.join(choices)}; got {value!r}")
    return value


def check_environment() -> None:
    """The ``MINI_INFER_CPU_*`` variables, checked against their choices. Whether this CPU runs
    the kernels ``$MINI_INFER_CPU_ISA`` names is known only once the extension loads.

    Raises:
        ValueError: naming the first variable whose value is not one of its choices.
    """
    for env, choices in ((ISA_ENV, ISA_CHOICES), (PREFILL_ENV, PREFILL_CHOICES), (PREFETCH_ENV, PREFETCH_CHOICES)):
        choice(None, env, env, choices)
