"""Load tests of the OpenAI endpoint with Locust (``python -m loadtest --help``)."""
from pathlib import Path

# Where a run writes by default: git-ignored (bench/results/loadtest/ holds the committed
# reference run; --out bench/results/loadtest updates it).
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results" / "loadtest"
