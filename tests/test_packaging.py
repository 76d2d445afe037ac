"""The package as pip builds it: a non-editable install must carry the C++ kernel's source
(else it silently falls back to the torch backend) and the dashboard's page, and no wheel is committed."""
import shutil
import subprocess
import sys
import zipfile

from tests.serve_process import ROOT


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_wheel_contains_the_cpp_kernel_source(tmp_path):
    source = tmp_path / "src"
    for name in _tracked_files():  # what a clean clone holds, nothing built
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("mini_infer-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    cpp_sources = {name for name in _tracked_files() if name.startswith("kernels/csrc/")}
    assert cpp_sources and cpp_sources <= set(names)
    assert {"engine/config.py", "app/config.py", "kernels/reference.py", "app/static/dashboard.html"} <= set(names)


def test_no_wheel_is_committed():
    assert [name for name in _tracked_files() if name.endswith(".whl")] == []
