"""Start the real Serve application in a subprocess and wait until it answers; stop it and
every process it started (Ray's too) afterwards. Traffic goes to 127.0.0.1 only."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
BASE_URL = "http://127.0.0.1:8000"

class ServeProcess:
    """``with ServeProcess(["make", "run"]) as app: requests.get(app.url + "/health")``.

    Args:
        command: the command line, run in the repository root.
        env: extra environment variables.
        timeout: seconds to wait for ``/ready`` before failing.
        num_engine_replicas: engine replicas ``/stats`` must list before the app counts as up.
        api_key: the app's API key, sent to ``/ready`` and ``/stats``.
    """

    def __init__(self, command: list[str], env: dict | None = None, timeout: float = 300,
                 num_engine_replicas: int = 1, api_key: str | None = None) -> None:
        self.command = command
        self.num_engine_replicas = num_engine_replicas
        # a stop waits this long at most for requests a test left running (scripts/serve_run.py)
        self.env = {**os.environ, "MINI_INFER_SHUTDOWN_TIMEOUT_S": "5", **(env or {})}
        self.timeout = timeout
        self.url = BASE_URL
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.process: subprocess.Popen | None = None
        self.log_path = ROOT / ".pytest_cache" / f"serve-{int(time.time())}.log"

    @classmethod
    def serve_run(cls, args: list[str], **kwargs) -> "ServeProcess":
        """``serve run <args>`` through make run's wrapper (``scripts/serve_run.py``), which
        starts it in a session of its own and passes it one SIGINT: __exit__'s SIGINT to the
        process group then reaches the driver only, which stops Serve and Ray in order (sent
        to a bare ``serve run``'s group it also reached Ray's processes, and the driver hung in
        its shutdown until __exit__ gave up, 30 s). The wrapper's HAProxy front is kept; Serve's
        Python proxy (HAProxy's fallback while no ingress replica is up) calls the ingress with
        Ray's actor calls, its default, not gRPC. ``kwargs`` as the constructor's."""
        env = {"RAY_SERVE_PROXY_USE_GRPC": "0", **kwargs.pop("env", {})}
        command = [str(ROOT / ".venv" / "bin" / "python"), str(ROOT / "scripts" / "serve_run.py"), *args]
        return cls(command, env=env, **kwargs)

    def __enter__(self) -> "ServeProcess":
        _wait_port_free(timeout=60)
        self.log_path.parent.mkdir(exist_ok=True)
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(self.command, cwd=ROOT, env=self.env, stdout=self._log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.command} exited with {self.process.returncode}: "
                                   f"{self.log_tail()}")
            if _get_ok(self.url + "/ready", self.headers) and self.num_replicas_up() >= self.num_engine_replicas:
                return self
            time.sleep(1.0)
        self.__exit__(None, None, None)
        raise TimeoutError(f"{self.command} not ready after {self.timeout}s: {self.log_tail()}")

    def __exit__(self, *exc) -> None:
        if self.process is None:
            return
        family = _family(self.process.pid)
        try:
            os.killpg(self.process.pid, signal.SIGINT)  # serve run shuts Serve and Ray down
            self.process.wait(timeout=45)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        for proc in family:  # anything Ray left behind
            try:
                proc.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(family, timeout=10)
        self._log.close()

    def num_replicas_up(self) -> int:
        try:
            return len(self.stats())
        except (requests.RequestException, ValueError, KeyError):
            return 0

    def stats(self) -> list[dict]:
        """Every engine replica's ``/stats`` entry."""
        return requests.get(self.url + "/stats", headers=self.headers, timeout=30).json()["replicas"]

    def engine_replicas(self) -> list[psutil.Process]:
        """This app's engine replica processes, looked for in its own process tree only (other
        Serve apps on the machine have processes of the same name)."""
        found = []
        for proc in _family(self.process.pid):
            try:
                if "ServeReplica:default:EngineServer" in " ".join(proc.cmdline()):
                    found.append(proc)
            except psutil.Error:
                pass
        return found

    def session_dir(self) -> Path:
        """This app's Ray session directory (``/tmp/ray/session_latest`` may be another
        app's on a shared machine), from its GCS server's command line."""
        for proc in _family(self.process.pid):
            try:
                for arg in proc.cmdline():
                    if arg.startswith("--session-dir="):
                        return Path(arg.removeprefix("--session-dir="))
            except psutil.Error:
                pass
        raise RuntimeError("no Ray session directory found among the app's processes")

    def log_tail(self, num_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-num_chars:]
        except OSError:
            return ""


def _get_ok(url: str, headers: dict) -> bool:
    try:
        return requests.get(url, headers=headers, timeout=30).status_code == 200
    except requests.RequestException:
        return False


def _family(pid: int) -> list[psutil.Process]:
    try:
        root = psutil.Process(pid)
        return [root] + root.children(recursive=True)
    except psutil.Error:
        return []


def _wait_port_free(timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            requests.get(BASE_URL, timeout=1)
        except requests.ConnectionError:
            return
        except requests.RequestException:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{BASE_URL} is still in use by another server")
