"""``bench/kernel_ab.py`` without compiling a build: where each build's sources come from, the
library renaming that lets builds share a process, the source digest, refused arguments, and
the timed comparison over stand-in modules (the project's own build and the reference)."""
import subprocess
from pathlib import Path

import pytest
import torch

from tests.bench import load_bench_module

_ROOT = Path(__file__).resolve().parents[2]
load_bench_module("kernel_bench")
load_bench_module("kernel_bench_cpu")  # kernel_ab imports both
ab = load_bench_module("kernel_ab")


def test_worktree_build_is_the_checkouts_csrc_files():
    sources = ab.build_sources("worktree")
    csrc = _ROOT / "kernels" / "csrc"
    assert sorted(sources) == sorted(p.name for p in csrc.iterdir() if p.is_file())
    assert sources["attention_tile.h"] == (csrc / "attention_tile.h").read_bytes()


def test_a_revisions_build_is_its_committed_files():
    sources = ab.build_sources("HEAD")
    listed = subprocess.run(["git", "-C", str(_ROOT), "ls-tree", "--name-only", "HEAD:kernels/csrc"],
                            capture_output=True, text=True, check=True).stdout.split()
    assert sorted(sources) == sorted(listed)
    committed = subprocess.run(["git", "-C", str(_ROOT), "show", "HEAD:kernels/csrc/attention_kernel.h"],
                               capture_output=True, check=True).stdout
    assert sources["attention_kernel.h"] == committed


def test_a_folder_build_is_its_files(tmp_path):
    (tmp_path / "cpu_attention.cpp").write_text("// a")
    (tmp_path / "attention_kernels.cpp").write_text("// b")
    assert ab.build_sources(str(tmp_path)) == {"attention_kernels.cpp": b"// b", "cpu_attention.cpp": b"// a"}


def test_an_unknown_build_is_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"--builds: 'no-such-revision-1f2e' is not 'worktree', a folder, or a git"):
        ab.build_sources("no-such-revision-1f2e")


def test_each_build_registers_its_own_library():
    sources = ab.build_sources("worktree")
    renamed = ab.rename_library(sources, "mini_infer_ab_1")
    text = renamed["cpu_attention.cpp"].decode()
    assert "TORCH_LIBRARY_FRAGMENT(mini_infer_ab_1, m)" in text
    assert "TORCH_LIBRARY_IMPL(mini_infer_ab_1, CPU, m)" in text
    assert "(mini_infer," not in text
    assert {k: v for k, v in renamed.items() if k != "cpu_attention.cpp"} == {
        k: v for k, v in sources.items() if k != "cpu_attention.cpp"}
    with pytest.raises(ValueError, match="no cpu_attention.cpp among"):
        ab.rename_library({"attention_tile.h": b""}, "x")


def test_the_digest_follows_every_file():
    sources = {"a.h": b"1", "b.cpp": b"2"}
    digest = ab.source_digest(sources)
    assert len(digest) == 12 and digest == ab.source_digest(dict(reversed(sources.items())))
    assert ab.source_digest({**sources, "b.cpp": b"3"}) != digest
    assert ab.source_digest({"a.h": b"1", "c.cpp": b"2"}) != digest


def test_one_build_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        ab.main(["--builds", "HEAD"])
    assert exit_info.value.code == 2
    assert "--builds needs at least two builds to compare; got 'HEAD'" in capsys.readouterr().err


def test_compare_times_every_build_in_turns_against_the_first():
    from kernels import cpu_attention, reference

    if not cpu_attention.is_available():
        pytest.skip("the C++ CPU kernel must build")

    class Reference:  # a stand-in build: the reference itself, whatever the kernel arguments
        @staticmethod
        def paged_attention(*args):
            return reference.paged_attention(*args[:7])

    lines = []
    result = ab.compare(["HEAD", "reference"], [cpu_attention.load(), Reference], "smollm2-135m",
                        ["float32"], [2], [32], rounds=1, repeats=2, log=lines.append)
    assert result["builds"] == ["HEAD", "reference"] and result["threads"] == torch.get_num_threads()
    assert [(r["dtype"], r["batch"], r["context"], r["repeat"]) for r in result["rows"]] == [
        ("float32", 2, 32, 0), ("float32", 2, 32, 1)]
    num_bytes = 2 * 2 * 32 * 3 * 64 * 4 + 2 * 2 * 9 * 64 * 4  # K and V, then the query in and the output out
    for row in result["rows"]:
        first, second = row["builds"]
        assert first["speed_vs_first"] == 1.0
        # within the roundings: speed_vs_first to 3 decimals, each ms to 4 (a few microseconds here,
        # so several percent: CI runs found 0.026 for 0.02569 and 0.07 for 0.0729)
        ratio = first["ms"] / second["ms"]
        rounding = ratio * (5e-5 / first["ms"] + 5e-5 / second["ms"]) + 5e-4
        assert second["speed_vs_first"] == pytest.approx(ratio, rel=0.01, abs=rounding)
        # gbps is rounded to 2 decimals (0.005 apart: 1.5% at 0.33, which a CI run found) and the ms it is
        # checked against to 4
        assert first["gbps"] == pytest.approx(num_bytes / first["ms"] / 1e6, rel=0.01 + 5e-5 / first["ms"],
                                              abs=0.0052)
        assert second["max_abs_diff"] == 0.0 and 0.0 <= first["max_abs_diff"] < 1e-5
    assert len(lines) == 2 and lines[0].startswith(" float32 b2    ctx32    copy")


def table_recorder(seen: list):
    """A stand-in build that answers with the reference and keeps the block tables it was given."""
    from kernels import reference

    class Recorder:
        @staticmethod
        def paged_attention(*args):
            seen.append(args[3].clone())
            return reference.paged_attention(*args[:7])

    return Recorder


def test_one_block_tables_read_block_zero_only():
    from kernels import cpu_attention

    if not cpu_attention.is_available():
        pytest.skip("the C++ CPU kernel must build")
    seen = []
    result = ab.compare(["HEAD", "recorder"], [cpu_attention.load(), table_recorder(seen)], "smollm2-135m", ["float32"],
                        [2], [40], rounds=1, repeats=1, log=lambda line: None, tables="one-block")
    assert result["tables"] == "one-block"
    assert seen and all(t.shape == (2, 3) and not t.any() for t in seen)  # 40 tokens: 3 blocks of 16
    assert result["rows"][0]["builds"][1]["max_abs_diff"] == 0.0


def test_in_order_tables_give_each_sequence_consecutive_blocks():
    seen = []
    recorder = table_recorder(seen)
    ab.compare(["a", "b"], [recorder, recorder], "smollm2-135m", ["float32"], [2], [40], rounds=1, repeats=1,
               log=lambda line: None, tables="in-order")
    assert seen and all(t.tolist() == [[0, 1, 2], [3, 4, 5]] for t in seen)


def test_unknown_tables_are_refused_naming_the_option():
    with pytest.raises(ValueError, match=r"--tables must be one of \['shuffled', 'in-order', 'one-block'\]; got 'l1'"):
        ab.compare(["a", "b"], [None, None], "smollm2-135m", ["float32"], [1], [16], rounds=1, repeats=1,
                   tables="l1")


def test_a_prefetch_suffix_is_the_builds_prefetch_l2_argument():
    assert ab.split_prefetch("worktree@l2") == ("worktree", {"prefetch_l2": True})
    assert ab.split_prefetch("HEAD@l1") == ("HEAD", {"prefetch_l2": False})
    assert ab.split_prefetch("8371f47") == ("8371f47", {})
    seen = []

    class Recorder:  # the keyword arguments each call passes
        @staticmethod
        def paged_attention(*args, **kwargs):
            from kernels import reference

            seen.append(kwargs)
            return reference.paged_attention(*args[:7])

    ab.compare(["HEAD", "worktree@l1", "worktree@l2"], [Recorder] * 3, "smollm2-135m", ["float32"], [1], [16],
               rounds=1, repeats=1, log=lambda line: None)
    assert {} in seen and {"prefetch_l2": False} in seen and {"prefetch_l2": True} in seen
    assert all(k in ({}, {"prefetch_l2": False}, {"prefetch_l2": True}) for k in seen)
