"""Workload files (``shared/workloads/*.json``): ``{"name": ..., "requests": [{"prompt_token_ids":
[...], "max_tokens": n, ...}, ...]}``, read and checked for ``python -m engine generate`` and the
benchmarks."""
from __future__ import annotations

import json
import numbers
from pathlib import Path


class WorkloadError(ValueError):
    """A workload file that cannot be read or does not hold a workload; the message names the
    file and what is wrong."""


def read_workload(path: Path | str) -> dict:
    """The workload in ``path``, its ``name`` defaulting to the file's stem.

    Raises:
        WorkloadError: no such file, not JSON, or no non-empty ``requests`` list whose every
            item has ``prompt_token_ids`` (a non-empty list of token ids) and ``max_tokens``
            (an integer >= 1).
    """
    path = Path(path)
    try:
        workload = json.loads(path.read_text())
    except FileNotFoundError:
        raise WorkloadError(f"no such file: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise WorkloadError(f"cannot read {path}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise WorkloadError(f"{path} is not JSON ({exc.msg} at line {exc.lineno})") from None
    requests = workload.get("requests") if isinstance(workload, dict) else None
    if not isinstance(requests, list) or not requests:
        raise WorkloadError(f"{path}: a workload is an object with a non-empty 'requests' list")
    for index, request in enumerate(requests):
        ids = request.get("prompt_token_ids") if isinstance(request, dict) else None
        if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
            raise WorkloadError(f"{path}: requests[{index}] needs 'prompt_token_ids', a non-empty list of token ids")
        if not (_is_int(request.get("max_tokens")) and request["max_tokens"] >= 1):
            raise WorkloadError(f"{path}: requests[{index}] needs 'max_tokens', an integer >= 1")
    return {"name": path.stem, **workload}


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
