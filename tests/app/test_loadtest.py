"""The Locust load test against the real app: 20 s, 4 users (3 completions, 1 multi-turn
chat), zero failures, every field."""
import json
import subprocess
import sys

import pytest

from tests.serve_process import ROOT


def test_locust_run_has_no_failures_and_a_complete_summary(api, tmp_path):
    env = {"MINI_INFER_LOAD_MIX": "50:16-64,35:100-200,15:300-400", "MINI_INFER_LOAD_OUTPUT": "8-32",
           "MINI_INFER_LOAD_CHAT_OUTPUT": "8-16"}
    command = [sys.executable, "-m", "loadtest", "--users", "4", "--spawn-rate", "4", "--duration", "20",
               "--host", api.url, "--out", str(tmp_path)]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=180,
                         env={**__import__("os").environ, **env})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_failures"] == 0 and summary["failures"] == [], summary["failures"]
    assert summary["num_requests"] >= 4
    # the chat user's later turns resend its conversation: the prefix cache serves it
    assert summary["num_requests_by_name"]["/v1/chat/completions (multi-turn stream)"] >= 2
    assert 0 < summary["cached_prompt_tokens"] < summary["prompt_tokens"]
    assert summary["requests_per_s"] > 0 and summary["output_tokens_per_s"] > 0
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(summary[metric]) == {"p50", "p90", "p99", "mean"}
        assert 0 < summary[metric]["p50"] <= summary[metric]["p90"] <= summary[metric]["p99"], metric
    assert (tmp_path / "summary.png").stat().st_size > 10_000
    stats_csv = (tmp_path / "locust_stats.csv").read_text()
    assert "TTFT" in stats_csv and "ITL" in stats_csv and "TPOT" in stats_csv


# (in a process of its own: importing locust monkey-patches the standard library with gevent)
_HEADERS = """
from locust.env import Environment
from loadtest import locustfile
for user_class in (locustfile.OpenAIStreamingUser, locustfile.ChatConversationUser):
    user_class.host = "http://127.0.0.1:9"  # (nothing is sent)
    user = user_class(Environment(user_classes=[user_class]))
    user.on_start()
    print(user.client.headers.get("Authorization"))
"""


def test_the_users_send_the_api_key_when_one_is_set():
    """A trial's run against `MINI_INFER_API_KEY=secret make run`: 65 of 65 requests 401,
    with no way to send the key."""
    import os

    for key, header in ((None, "None"), ("secret", "Bearer secret")):
        env = {k: v for k, v in os.environ.items() if k != "MINI_INFER_LOAD_API_KEY"}
        env.update({"MINI_INFER_LOAD_API_KEY": key} if key else {})
        out = subprocess.run([sys.executable, "-c", _HEADERS], cwd=ROOT, capture_output=True, text=True,
                             timeout=120, env=env)
        assert out.stdout.splitlines() == [header] * 2, out.stderr[-2000:]


def test_a_run_with_failures_exits_1_and_names_the_key_on_401s(tmp_path):
    """A sixth trial's run against a keyed service without the key: 68 of 68 failed, exit 0
    and no word of why. A stand-in service that answers every request 401."""
    from tests.stand_in import stand_in_service

    refusal = b'{"error": {"message": "invalid api key", "code": "invalid_api_key"}}'
    with stand_in_service(lambda request: (401, refusal)) as url:
        command = [sys.executable, "-m", "loadtest", "--users", "1", "--spawn-rate", "1", "--duration", "3",
                   "--host", url, "--out", str(tmp_path)]
        out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert out.returncode == 1 and summary["num_requests"] == summary["num_failures"] > 0, out.stderr[-2000:]
    assert "HTTP 401: the service has an api_key; set MINI_INFER_LOAD_API_KEY to send it" in out.stderr


@pytest.mark.parametrize("flag, value, message", [("--users", "-3", "must be above 0; got -3"),
                                                  ("--spawn-rate", "0", "must be above 0; got 0"),
                                                  ("--duration", "abc", "not a number: 'abc'")])
def test_nonsense_arguments_are_refused(flag, value, message):
    # a trial: --users -3 and --duration -5 ran for no request and exited 0
    out = subprocess.run([sys.executable, "-m", "loadtest", flag, value], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().endswith(f"argument {flag}: {message}"), out.stderr
