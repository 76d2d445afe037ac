"""Suite-wide set-up. Triton kernels run under the interpreter where there is no GPU:
``TRITON_INTERPRET`` must be set before triton is first imported, and pytest imports this
file before any test module."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    """Mark what ``make test-fast`` leaves out: everything under ``tests/e2e`` and every test
    that talks to the served application (the ``api`` fixture) is ``e2e``. ``gpu`` tests
    are skipped without CUDA."""
    import pytest

    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "/tests/e2e/" in str(item.path) or "api" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
