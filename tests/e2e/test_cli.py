"""The command line, as a user runs it."""
import json
import subprocess
import sys


def run(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "engine", *args], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


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
    out = run("generate", "--workload", str(path), "--json-out", str(summary_path))
    assert out.returncode == 0, out.stderr
    assert "requests: 5  output tokens: 30" in out.stdout and "output tokens/s:" in out.stdout
    summary = json.loads(summary_path.read_text())
    assert summary["requests"] == 5 and summary["output_tokens"] == 30
    assert summary["output_tokens_per_s"] > 0


def test_bad_arguments_fail_with_a_clear_message():
    out = run("generate", "--prompt", "x", "--max-tokens", "0")
    assert out.returncode != 0
    assert "max_tokens must be >= 1; got 0" in out.stderr
