"""Suite-wide set-up. Triton kernels run under the interpreter where there is no GPU:
``TRITON_INTERPRET`` must be set before triton is first imported, and pytest imports this
file before any test module (so also before ``engine.block_manager`` reads
``MINI_INFER_DEBUG_CHECKS``)."""
import os
import subprocess
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Every scheduler step checks the block manager's invariants (engine.block_manager), here
# and in the services and subprocesses the tests start.
os.environ.setdefault("MINI_INFER_DEBUG_CHECKS", "1")
# A fixed intra-op thread count (engine.threads.FreeCpuThreads off): bf16 greedy output on a
# CPU with bf16 units changes with the thread count (fp32 does not), and tests compare runs
# token for token; a neighbour's load on the test host must not change them mid-test.
# tests/engine/test_threads.py turns the fitting back on where it tests it.
os.environ.setdefault("MINI_INFER_FIT_THREADS", "0")


def pytest_collection_modifyitems(config, items):
    """Mark what ``make test-fast`` leaves out: everything under ``tests/e2e`` and every test
    that talks to the served application (the ``api`` fixture) is ``e2e``. ``gpu`` tests
    are skipped without CUDA."""
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "/tests/e2e/" in str(item.path) or "api" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.e2e)
        # The marker itself: item.keywords also holds the names of the test's parents, such
        # as the checkout's directory (a checkout in .../gpu would skip every test).
        if item.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
            item.add_marker(no_gpu)


_STATUS_AT_START = pytest.StashKey[str | None]()


def _git_status() -> str | None:
    """``git status --porcelain`` of the checkout, ``None`` outside a git checkout."""
    try:
        out = subprocess.run(["git", "status", "--porcelain"], cwd=Path(__file__).resolve().parents[1],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def pytest_sessionstart(session):
    session.config.stash[_STATUS_AT_START] = _git_status()


def pytest_sessionfinish(session, exitstatus):
    """No test may write into the checkout: a run that starts clean must end clean (results
    belong in tmp_path or a git-ignored folder)."""
    if session.config.stash.get(_STATUS_AT_START, None) != "":
        return  # not a git checkout, or already changed by the developer
    after = _git_status()
    if after:
        session.config.get_terminal_writer().line(
            f"the test run changed the checkout (git status --porcelain):\n{after}", red=True)
        session.exitstatus = 1
