"""A virtualenv holding only the GPU machine's Python stack, built in seconds from this one.

The GPU check runs on a machine whose own ``python3`` has torch, Triton, transformers,
tokenizers, safetensors, numpy, psutil and pytest (and what they require), and not Ray,
FastAPI, pydantic or gguf. ``build`` makes a venv (no pip) whose site-packages links only
those distributions of the running interpreter's environment, so that an import of
anything else fails there as it would on that machine.
"""
from __future__ import annotations

import importlib.metadata as metadata
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

GPU_STACK = ("torch", "triton", "transformers", "tokenizers", "safetensors", "numpy", "psutil", "pytest")
ABSENT = ("ray", "fastapi", "pydantic", "gguf")  # not there, even where a requirement names them


def distributions(roots=GPU_STACK, absent=ABSENT) -> dict[str, metadata.Distribution]:
    """``roots`` and their requirements (extras and markers not met left out), recursively,
    skipping ``absent``."""
    found: dict[str, metadata.Distribution] = {}
    skip = {canonicalize_name(name) for name in absent}
    todo = list(roots)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found or name in skip:
            continue
        dist = metadata.distribution(name)
        found[name] = dist
        for spec in dist.requires or []:
            requirement = Requirement(spec)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def build(target: Path) -> Path:
    """Create the venv at ``target``; returns its python."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(target)], check=True)
    python = target / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    site = Path(purelib)
    for dist in distributions().values():
        source = Path(dist.locate_file(""))
        tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
        for top in tops:
            link = site / top
            if not link.exists() and (source / top).exists():
                link.symlink_to(source / top)
    return python
