"""Argument types the benchmarks share (argparse ``type=``), so that a bad value is one line."""
from __future__ import annotations

import argparse
from typing import Callable


def positive_list(kind: type, what: str) -> Callable[[str], list]:
    """An argparse type: comma-separated values of ``kind`` above 0 (``inf`` too, for
    ``float``), named ``what`` in the error ("integers", "numbers")."""
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"not comma-separated {what}: {text!r}") from None
        if not all(v > 0 for v in values):
            raise argparse.ArgumentTypeError(f"must be above 0; got {text}")
        return values
    return parse
