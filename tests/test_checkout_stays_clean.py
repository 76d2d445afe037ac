"""No command writes into tracked files: results go to folders git ignores unless the user
names another (``--out``). The suite itself is checked by ``tests/conftest.py``: a run that
starts on a clean checkout must leave it clean."""
import importlib.util
import re
import subprocess
import sys

from tests.serve_process import ROOT


def _ignored(path) -> bool:
    return subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=ROOT).returncode == 0


def _bench_common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "bench" / "common.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_default_result_folders_are_ignored_by_git():
    from loadtest import DEFAULT_OUT

    gpu_check = (ROOT / "bench" / "gpu_check.sh").read_text()
    gpu_default = re.search(r"else out_dir=(\S+); fi", gpu_check).group(1)
    paths = [_bench_common().RESULTS / "offline-w1_mixed-2026-01-01.json", DEFAULT_OUT / "summary.json",
             ROOT / gpu_default / "gpu_check-2026-01-01.json"]
    assert [p for p in paths if not _ignored(p)] == []
    assert not _ignored(ROOT / "bench" / "results" / "loadtest" / "summary.json")  # the references


def test_the_readme_commands_write_only_where_git_ignores():
    readme = (ROOT / "README.md").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", readme, re.S))
    outputs = re.findall(r"--(?:json-)?out\s+(\S+)", blocks)
    assert outputs, "the README names an output file"
    assert [o for o in outputs if not _ignored(ROOT / o)] == []
