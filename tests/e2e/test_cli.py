"""The command line, as a user runs it."""
import json
import subprocess
import sys

import torch

from engine.model_runner import HUGE_PAGE_BYTES, lazily_zeroed_cpu, populate
from kernels import cpu_attention


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def run_eager(*args):
    """``run`` with ``--enforce-eager``: for tests of the command line itself, which would
    otherwise spend ~10 s of each run compiling the layers' glue (the first test here runs
    the default, compiled)."""
    return run(*args, "--enforce-eager")


def test_generate_a_prompt_through_the_chat_template():
    out = run("generate", "--prompt", "What is the capital of France?", "--max-tokens", "16",
              "--dtype", "float32")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
    assert "finish_reason=stop" in out.stderr


def test_generate_a_workload_file(tmp_path):
    workload = {"requests": [{"id": f"r{i}", "prompt_token_ids": list(range(100, 100 + 5 * i + 3)),
                              "max_tokens": 4 + i} for i in range(5)]}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(workload))
    summary_path = tmp_path / "summary.json"
    out = run_eager("generate", "--workload", str(path), "--json-out", str(summary_path))
    assert out.returncode == 0, out.stderr
    assert "requests: 5  output tokens: 30" in out.stdout and "output tokens/s:" in out.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["requests"] == 5 and summary["output_tokens"] == 30
    assert summary["output_tokens_per_s"] > 0
    # the KV cache is backed before the timed run, where this kernel can (the same call here)
    probe = lazily_zeroed_cpu((HUGE_PAGE_BYTES,), torch.uint8)
    assert summary["kv_cache_populated"] is populate(probe)
    assert ("was backed with memory before the timed run" in out.stdout) is summary["kv_cache_populated"]
    # which CPU kernels ran: this CPU's best (SmolLM2's head_dim 64); SDPA for long prefill
    # chunks only in bf16 and where it is the default here (a CPU with AMX); decode prefetches
    # into L2 where that is the default here (a Zen 4)
    if summary["attention_backend"] == "cpu":
        sdpa = summary["dtype"] == "bfloat16" and cpu_attention.sdpa_prefill_default()
        assert summary["cpu_attention"] == {"isa": cpu_attention.selected_isa(64),
                                            "prefill": "sdpa" if sdpa else "tiles",
                                            "decode_prefetch": "l2" if cpu_attention.is_zen4() else "l1"}
    else:
        assert summary["cpu_attention"] is None


def test_a_shared_prefix_workload_with_prefix_caching_on_and_off(tmp_path):
    # w3_shared_prefix's schema: extra fields (prefix_id) are ignored
    prefix = list(range(1000, 1048))
    workload = {"name": "w3-like", "requests": [
        {"id": f"r{i}", "prefix_id": 0, "prompt_token_ids": prefix + [2000 + i] * (i + 1), "max_tokens": 3}
        for i in range(3)]}
    path = tmp_path / "w3.json"
    path.write_text(json.dumps(workload))
    summaries = {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        out = run_eager("generate", "--workload", str(path), "--json-out", str(tmp_path / "s.json"), flag,
                        "--no-populate-kv-cache")
        assert out.returncode == 0, out.stderr
        summaries[flag] = json.loads((tmp_path / "s.json").read_text())
    on, off = summaries["--enable-prefix-caching"], summaries["--no-enable-prefix-caching"]
    assert not on["kv_cache_populated"] and on["kv_cache_populate_s"] is None  # --no-populate-kv-cache
    assert on["enable_prefix_caching"] and not off["enable_prefix_caching"]
    # the 2nd and 3rd requests wait one step for the 1st to compute the shared 3 blocks
    assert (on["num_cached_tokens"], off["num_cached_tokens"]) == (2 * 48, 0)
    assert on["output_tokens"] == off["output_tokens"] == 9


def test_bad_arguments_fail_with_one_line_naming_the_flag(tmp_path):
    # a trial: these were tracebacks (InvalidRequestError, KeyError, JSONDecodeError)
    not_json, no_ids = tmp_path / "a.txt", tmp_path / "no_ids.json"
    not_json.write_text("not json")
    no_ids.write_text(json.dumps({"requests": [{"max_tokens": 3}]}))
    cases = [(["--prompt", "x", "--max-tokens", "0"], "--max-tokens: max_tokens must be >= 1; got 0"),
             (["--prompt", "x", "--temperature", "-1"],
              "--temperature: temperature must be a finite number >= 0; got -1.0"),
             (["--workload", str(not_json)], f"--workload: {not_json} is not JSON (Expecting value at line 1)"),
             (["--workload", str(no_ids)],
              f"--workload: {no_ids}: requests[0] needs 'prompt_token_ids', a non-empty list of token ids"),
             (["--workload", str(tmp_path / "none.json")], f"--workload: no such file: {tmp_path / 'none.json'}")]
    for args, message in cases:
        out = run("generate", *args)
        assert (out.returncode, out.stderr.strip()) == (1, message), args
