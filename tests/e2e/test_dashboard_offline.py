"""The dashboard of an offline run: ``python -m engine generate --workload FILE
--dashboard-port PORT`` serves the page and ``/stats?blocks=1`` while it generates; the
block counts it reports are the engine's exact ones. Traffic to 127.0.0.1 only."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import pytest
import requests

from app.dashboard import OfflineDashboard, page
from engine import LLM, SamplingParams
from tests.serve_process import ROOT

pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_offline_dashboard_reports_the_exact_blocks_of_a_running_generate():
    llm = LLM(dtype="float32", num_gpu_blocks=32, block_size=16)
    dashboard = OfflineDashboard(llm, 0)
    base = f"http://127.0.0.1:{dashboard.port}"
    try:
        assert requests.get(base + "/dashboard", timeout=10).content == page()
        idle = requests.get(base + "/stats?blocks=1", timeout=10).json()["replicas"][0]
        assert idle["blocks"]["ref_counts"] == [0] * 32 and idle["replica_id"] == "offline"
        assert idle["latency"] is None
        missing = requests.get(base + "/nope", timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
        # two requests of 40 and 20 prompt tokens: 3 + 2 blocks once prefilled, 4 + 2 at the end
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
        thread = threading.Thread(target=llm.generate, args=([list(range(100, 140)), list(range(300, 320))],
                                                             params), kwargs={"use_tqdm": False})
        thread.start()
        seen = []
        while thread.is_alive():
            replica = requests.get(base + "/stats?blocks=1", timeout=10).json()["replicas"][0]
            if replica["running"]:
                seen.append(replica)
        thread.join()
        assert seen, "never saw the requests running"
        for replica in seen:
            in_use = sum(1 for r in replica["blocks"]["ref_counts"] if r)
            assert in_use == replica["num_total_blocks"] - replica["num_free_blocks"]
            assert in_use == sum(len(s["block_table"]) for s in replica["running"])
            for seq in replica["running"]:
                assert len(seq["block_table"]) == -(-(seq["num_computed_tokens"]) // 16)
        plain = requests.get(base + "/stats", timeout=10).json()["replicas"][0]
        assert plain["num_free_blocks"] == 32 and plain["num_generation_tokens"] == 48
    finally:
        dashboard.close()


def test_cli_serves_the_dashboard_while_a_workload_runs(tmp_path):
    workload = {"requests": [{"id": f"r{i}", "prompt_token_ids": list(range(100 + i, 164 + i)), "max_tokens": 48}
                             for i in range(2)]}
    path = tmp_path / "w.json"
    path.write_text(json.dumps(workload))
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "engine", "generate", "--workload", str(path),
                                "--dashboard-port", str(port), "--num-gpu-blocks", "64", "--enforce-eager"],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url, running = None, []
        deadline = time.monotonic() + 240
        while process.poll() is None and time.monotonic() < deadline and not running:
            try:
                body = requests.get(f"http://127.0.0.1:{port}/stats?blocks=1", timeout=10).json()
            except requests.ConnectionError:
                time.sleep(0.2)
                continue
            running = body["replicas"][0]["running"]
            url = f"http://127.0.0.1:{port}/dashboard"
        assert running, "the workload's requests were never seen running"
        assert [s["request_id"] for s in running] == ["0", "1"]
        assert requests.get(url, timeout=10).content == page()
        stdout, stderr = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr
    assert f"dashboard: http://127.0.0.1:{port}/dashboard" in stderr
    assert "requests: 2  output tokens: 96" in stdout


def test_cli_refuses_a_port_out_of_range():
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--prompt", "x", "--dashboard-port", "70000"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "--dashboard-port: 70000 is not a TCP port (0 to 65535)" in out.stderr
