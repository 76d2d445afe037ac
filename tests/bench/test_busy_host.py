"""bench/busy_host.py: the busy process it starts, and its busy / quiet summary."""
import os
import time

from tests.bench import load_bench_module

busy_host = load_bench_module("busy_host")


def test_the_busy_process_pins_itself_to_one_core():
    process = busy_host.start_busy_process()
    try:
        deadline = time.monotonic() + 30
        while os.sched_getaffinity(process.pid) != {max(os.sched_getaffinity(0))}:
            assert time.monotonic() < deadline, os.sched_getaffinity(process.pid)
            time.sleep(0.05)
        assert process.poll() is None  # still spinning
    finally:
        process.kill()
        process.wait()


def test_summary_takes_medians_and_counts_a_failed_run_as_zero():
    runs = [{"variant": "engine", "condition": "quiet", "output_tokens_per_s": 100.0},
            {"variant": "engine", "condition": "quiet", "output_tokens_per_s": 120.0},
            {"variant": "engine", "condition": "busy", "output_tokens_per_s": 50.0},
            {"variant": "spin", "condition": "quiet", "output_tokens_per_s": 90.0},
            {"variant": "spin", "condition": "busy", "error": "did not finish within 900 s"}]
    assert busy_host.summarize(runs, ["engine", "spin"]) == {
        "engine": {"quiet": 110.0, "busy": 50.0, "busy_over_quiet": 0.455},
        "spin": {"quiet": 90.0, "busy": 0.0, "busy_over_quiet": 0.0}}
