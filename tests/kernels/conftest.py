"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before triton is first imported; pytest imports this
conftest before any test module of this directory, and nothing above it imports triton.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The shared builders (paged_cases.py) and the repository's packages must import under any
# pytest import mode and launcher (`pytest` as well as `python -m pytest`).
_HERE = os.path.dirname(os.path.abspath(__file__))
for _path in (_HERE, os.path.dirname(os.path.dirname(_HERE))):
    if _path not in sys.path:
        sys.path.insert(0, _path)
