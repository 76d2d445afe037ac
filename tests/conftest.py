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
        # The marker itself: item.keywords also holds the names of the test's parents, such
        # as the checkout's directory (a checkout in .../gpu would skip every test).
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_gpu)
