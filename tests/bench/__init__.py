import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def load_bench_module(name: str):
    """``bench/<name>.py`` as the module ``name`` (bench/ is scripts, not a package).

    bench/ goes on ``sys.path`` first, as it is for ``python bench/<name>.py``: the scripts import their
    siblings (``common``, ``cli_types``), so a test file run alone must not depend on an earlier one
    having put it there.
    """
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module
