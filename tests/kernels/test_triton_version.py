"""The Triton floor: declared once in pyproject.toml, enforced at import with a clear error.
(``scripts/check_triton_versions.sh`` runs the kernel tests under older Triton releases.)"""
import re
import subprocess
import sys
import tomllib

import triton

from kernels.triton_paged_attention import TRITON_MIN_VERSION
from tests.serve_process import ROOT


def test_pyproject_declares_the_floor_the_kernels_check():
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in dependencies if d.startswith("triton")]
    assert re.fullmatch(r"triton>=(\d+)\.(\d+)", spec.strip())
    assert tuple(map(int, spec.split(">=")[1].split("."))) == TRITON_MIN_VERSION
    assert tuple(map(int, triton.__version__.split(".")[:2])) >= TRITON_MIN_VERSION


def test_an_older_triton_fails_at_import_with_the_floor():
    """A Triton without ``triton.knobs`` (before 3.4) is refused by name, not by an
    AttributeError deep in the module."""
    code = "import triton, triton.language; del triton.knobs; import kernels.triton_paged_attention"
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1
    assert f"need triton>=3.4 (triton.knobs); this is triton {triton.__version__}" in result.stderr
