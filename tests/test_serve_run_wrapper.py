"""``scripts/serve_run.py`` (``make run``'s command) turns SIGTERM into one SIGINT for ``serve
run``, also when it was started with SIGINT ignored (in the background of a non-interactive
shell). A stand-in ``serve`` beside the Python that runs the wrapper records what it gets, so
no Ray is started. And an invalid ``MINI_INFER_*`` setting stops it before ``serve run``, with
one line naming the variable."""
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WRAPPER = ROOT / "scripts" / "serve_run.py"

FAKE_SERVE = textwrap.dedent(f"""\
    #!{sys.executable}
    import os, sys, time
    try:
        socket = os.environ.get("RAY_SERVE_HAPROXY_SOCKET_PATH")
        files = ["none"]
        if socket is not None:  # the folder, its mode, and every HAProxy file's path in it
            folder = os.path.dirname(socket)
            files = [folder, oct(os.stat(folder).st_mode & 0o777), *(
                os.path.relpath(os.environ[name], folder) for name in (
                    "RAY_SERVE_HAPROXY_CONFIG_FILE_LOC", "RAY_SERVE_HAPROXY_SOCKET_PATH",
                    "RAY_SERVE_HAPROXY_SERVER_STATE_BASE", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE",
                    "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH"))]
        # one write, which the test's SIGTERM cannot cut in two
        print(os.getpid(), "args", sys.argv[1:], *(os.environ.get(name) for name in (
            "RAY_SERVE_PROXY_USE_GRPC", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD",
            "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP", "RAY_SERVE_ENABLE_HA_PROXY",
            "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "RAY_SERVE_HAPROXY_NBTHREAD")),
            "\\nhaproxy files:", *files, flush=True)
        while True:
            time.sleep(0.05)
    except KeyboardInterrupt:
        print("KeyboardInterrupt: shutting down", flush=True)
    # a further SIGINT in this time is a line of its own
    deadline = time.monotonic() + float(os.environ.get("STAND_IN_SHUTDOWN_S", "0.5"))
    while time.monotonic() < deadline:
        try:
            time.sleep(0.01)
        except KeyboardInterrupt:
            print("KeyboardInterrupt again", flush=True)
    sys.exit(3)
""")


def _start(tmp_path: Path, ignore_sigint: bool, env: dict | None = None, stderr=None,
           target: str = "stand_in:app", ignore_sighup: bool = False) -> subprocess.Popen:
    """The wrapper on the stand-in ``serve``; ``app:deployment`` as ``target`` adds the checks
    of the settings and of port 8000 before it."""
    (tmp_path / "python").symlink_to(sys.executable)
    serve = tmp_path / "serve"
    serve.write_text(FAKE_SERVE)
    serve.chmod(0o755)

    def before_exec() -> None:
        if ignore_sigint:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if ignore_sighup:  # as nohup starts it
            signal.signal(signal.SIGHUP, signal.SIG_IGN)

    return subprocess.Popen([str(tmp_path / "python"), str(WRAPPER), target, "--port", "8123"],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, preexec_fn=before_exec, env=env,
                            cwd=ROOT)


def _end(wrapper: subprocess.Popen, stand_in_pid: int) -> None:
    """SIGKILL to the wrapper and the stand-in (in a session of its own) where still running:
    a failed test leaves neither behind."""
    for process in (stand_in_pid, wrapper.pid):
        try:
            os.kill(process, signal.SIGKILL)
        except ProcessLookupError:
            pass
    wrapper.wait()


def _stop_with_sigterm(wrapper: subprocess.Popen, times: int = 1,
                       signum: signal.Signals = signal.SIGTERM) -> tuple[int, list[str]]:
    """SIGTERM (or ``signum``) to the wrapper, ``times`` times one right after the other, once
    the stand-in runs; returns the wrapper's exit status and the stand-in's lines (its pid left
    out), once both have ended."""
    lines, _ = _signal_in_turn(wrapper, [signum] * times, pause_s=0.0, sent=[])
    return wrapper.returncode, lines


def test_sigterm_reaches_serve_run_as_one_sigint(tmp_path):
    returncode, lines = _stop_with_sigterm(_start(tmp_path, ignore_sigint=False))
    # the proxy's gRPC transport on, Serve's separate user-code thread and router loop off,
    # HAProxy on with a 2 s drain and one thread, unless the environment says otherwise (next test)
    assert lines[0] == "args ['run', 'stand_in:app', '--port', '8123'] 1 0 0 1 2 1"
    # HAProxy's files in a folder of this run's own that only its user may enter, removed after
    _, _, folder, mode, *files = lines[1].split(" ")
    assert lines[1].startswith("haproxy files: /tmp/mini-infer-ha-") and mode == "0o700"
    assert files == ["haproxy.cfg", "admin.sock", ".", "server-state", "metrics.sock"]
    assert not os.path.exists(folder)
    assert lines[2:] == ["KeyboardInterrupt: shutting down"]
    assert returncode == 3  # serve run's own status


def test_sighup_reaches_serve_run_as_one_sigint(tmp_path):
    """A closed terminal or SSH session (SIGHUP to the group) killed the wrapper, which left
    ``serve run``, in a session of its own, serving (a trial)."""
    returncode, lines = _stop_with_sigterm(_start(tmp_path, ignore_sigint=False), signum=signal.SIGHUP)
    assert lines[2:] == ["KeyboardInterrupt: shutting down"] and returncode == 3


def _signal_in_turn(wrapper: subprocess.Popen, signals: list[signal.Signals], pause_s: float,
                    sent: list[signal.Signals]) -> tuple[list[str], str]:
    """Once the stand-in runs, each of ``signals`` to the wrapper, ``pause_s`` apart, while it
    runs (each one sent is added to ``sent``); returns the stand-in's lines (its pid left out)
    and the wrapper's stderr (where piped), once both have ended (or are ended, on a failure).
    Its first two lines are read here, line by line: communicate() reads the pipe itself, past
    what readline() holds in its buffer."""
    pid, first = wrapper.stdout.readline().split(" ", 1)
    files = wrapper.stdout.readline()  # the same write as the first line
    try:
        for index, signum in enumerate(signals):
            time.sleep(pause_s if index else 0.0)
            if wrapper.poll() is None:
                wrapper.send_signal(signum)
                sent.append(signum)
        rest, err = wrapper.communicate(timeout=20)  # to the pipe's end: the stand-in holds it too
    except subprocess.TimeoutExpired:
        raise AssertionError(f"serve_run.py's {signals[-1].name} did not stop serve run in 20 s") from None
    finally:
        _end(wrapper, int(pid))
    return [first.strip(), files.strip(), *rest.splitlines()], err or ""


def test_sighup_is_left_ignored_under_nohup(tmp_path):
    wrapper = _start(tmp_path, ignore_sigint=False, ignore_sighup=True)
    # the wrapper and the stand-in still run 1.2 s after the SIGHUP: the SIGTERM then stops them
    # (a SIGHUP taken for a stop would have ended both within 0.5 s: no SIGTERM is sent then)
    sent = []
    lines, _ = _signal_in_turn(wrapper, [signal.SIGHUP, signal.SIGTERM], pause_s=1.2, sent=sent)
    assert sent == [signal.SIGHUP, signal.SIGTERM]
    assert lines[2:] == ["KeyboardInterrupt: shutting down"] and wrapper.returncode == 3


def test_stops_while_serve_run_shuts_down_are_not_passed_on(tmp_path):
    """Each further SIGINT cut ``serve run``'s shutdown short; the third (three stops a second
    apart) landed in Ray's own, a trial found: a traceback, and two of Ray's agents left for a
    minute."""
    env = {**os.environ, "STAND_IN_SHUTDOWN_S": "4"}
    wrapper = _start(tmp_path, ignore_sigint=False, env=env, stderr=subprocess.PIPE)
    sent = []
    lines, err = _signal_in_turn(wrapper, [signal.SIGTERM] * 3, pause_s=1.2, sent=sent)
    assert len(sent) == 3 and lines[2:] == ["KeyboardInterrupt: shutting down"] and wrapper.returncode == 3
    assert err.count("serve_run: Serve and Ray are already shutting down") == 2, err


def test_a_killed_wrapper_still_stops_serve_run(tmp_path):
    """SIGKILL to the wrapper (a process manager's, to ``make run``'s group, after its stop
    timeout): the kernel sends ``serve run`` its SIGINT (a trial found ``serve run`` and Ray
    serving on, port 8000 taken for the next start)."""
    returncode, lines = _stop_with_sigterm(_start(tmp_path, ignore_sigint=False), signum=signal.SIGKILL)
    assert lines[2:] == ["KeyboardInterrupt: shutting down"] and returncode == -signal.SIGKILL


def test_signals_less_than_a_second_apart_are_one_stop(tmp_path):
    """`kill -TERM -- -<pgid>` reaches the wrapper twice (directly, and through make) a few
    milliseconds apart: one stop, one SIGINT for serve run. The wrapper took the second for a
    second stop, which ends the requests in flight at once, in 1 of ~20 runs of
    tests/e2e/test_serve_signals.py's group stop: its handler was run again between two of
    its own statements."""
    wrapper = _wrapper_module()
    assert wrapper.SAME_STOP_S == 1.0
    assert [wrapper.stops_asked(times) for times in ([], [5.0], [5.0, 5.003], [5.003, 5.0], [5.0, 5.5, 5.9])] == [
        0, 1, 1, 1, 1]
    assert wrapper.stops_asked([5.0, 5.5, 6.0]) == 2  # a second from the first signal of the stop
    assert wrapper.stops_asked([5.0, 6.5, 6.6, 8.0, 7.4]) == 3
    returncode, lines = _stop_with_sigterm(_start(tmp_path, ignore_sigint=False), times=2)
    assert lines[2:] == ["KeyboardInterrupt: shutting down"] and returncode == 3


def test_the_environment_decides_serves_settings(tmp_path):
    env = {**os.environ, "RAY_SERVE_PROXY_USE_GRPC": "0", "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "1",
           "RAY_SERVE_ENABLE_HA_PROXY": "0", "RAY_SERVE_HAPROXY_NBTHREAD": "4"}
    returncode, lines = _stop_with_sigterm(_start(tmp_path, ignore_sigint=False, env=env))
    assert lines[0] == "args ['run', 'stand_in:app', '--port', '8123'] 0 0 1 0 2 4" and returncode == 3
    assert lines[1] == "haproxy files: none"  # no HAProxy, no folder for it


def test_sigterm_stops_serve_run_when_started_with_sigint_ignored(tmp_path):
    returncode, lines = _stop_with_sigterm(_start(tmp_path, ignore_sigint=True))
    assert lines[-1] == "KeyboardInterrupt: shutting down" and returncode == 3


def _refused(folder: Path, settings: dict) -> list[str]:
    """The wrapper's stderr lines where it refused ``settings`` (exit 2, the stand-in serve never
    started). Should the check pass instead, the wrapper and the stand-in are stopped (SIGTERM,
    by pid) before the test fails, so that nothing is left running."""
    folder.mkdir()
    wrapper = _start(folder, ignore_sigint=False, env={**os.environ, **settings}, stderr=subprocess.PIPE,
                     target="app:deployment")
    try:
        out, err = wrapper.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        wrapper.send_signal(signal.SIGTERM)  # one SIGINT for the stand-in, which then exits
        wrapper.communicate(timeout=20)
        raise AssertionError(f"the wrapper started serve run with {settings}") from None
    assert wrapper.returncode == 2 and out == "", (wrapper.returncode, out)  # the stand-in never ran
    return err.splitlines()


def test_an_invalid_setting_is_one_line_naming_its_variable_and_no_serve_run(tmp_path):
    bad_values = {"MINI_INFER_KV_CACHE_DTYPE": "fp8_e4m3fnuz", "MINI_INFER_MAX_NUM_SEQS": "many"}
    assert _refused(tmp_path / "a", bad_values) == [
        "MINI_INFER_KV_CACHE_DTYPE='fp8_e4m3fnuz': Input should be 'auto', 'fp8', 'fp8_e4m3' or 'fp8_e5m2'",
        "MINI_INFER_MAX_NUM_SEQS='many': Input should be a valid integer, unable to parse string as an integer"]
    # A value the engine's own checks refuse (the model validator's ValueError)
    lines = _refused(tmp_path / "b", {"MINI_INFER_MAX_NUM_SEQS": "64", "MINI_INFER_MAX_NUM_BATCHED_TOKENS": "32"})
    assert lines[0].startswith("settings: max_num_batched_tokens (32) must be >= max_num_seqs (64)")
    # A misspelt variable (its value, perhaps a secret, is not printed)
    assert _refused(tmp_path / "c", {"MINI_INFER_API_KEYS": "secret-value", "MINI_INFER_api_key": "secret-value"}) == [
        "MINI_INFER_API_KEYS: not a mini-infer setting; did you mean MINI_INFER_API_KEY?",
        "MINI_INFER_api_key: not a mini-infer setting; did you mean MINI_INFER_API_KEY?"]
    # A variable read outside AppConfig, with a value its reader refuses (it failed the deployment)
    assert _refused(tmp_path / "d", {"MINI_INFER_CPU_ISA": "bogus"}) == [
        "settings: MINI_INFER_CPU_ISA must be one of auto, avx512_bf16, avx512, avx2, scalar; got 'bogus'"]


def _wrapper_module():
    spec = importlib.util.spec_from_file_location("serve_run_under_test", WRAPPER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_haproxy_port_in_use_is_replaced_by_a_free_one(capsys):
    wrapper = _wrapper_module()
    with socket.socket() as busy, socket.socket() as spare:
        busy.bind(("", 0))
        busy.listen()
        spare.bind(("", 0))  # bound, not listening: free to take once closed
        busy_port, free_port = busy.getsockname()[1], spare.getsockname()[1]
        spare.close()
        chosen = wrapper.free_ports_env({}, {"STATS": busy_port, "METRICS": free_port})
        assert list(chosen) == ["STATS"] and int(chosen["STATS"]) not in (busy_port, 0)
        assert capsys.readouterr().err == f"serve_run: port {busy_port} is in use; STATS={chosen['STATS']}\n"
        # a port the environment sets is the user's choice, taken or not
        assert wrapper.free_ports_env({"STATS": str(busy_port)}, {"STATS": busy_port}) == {}


def test_the_haproxy_ports_and_files_are_serves_settings():
    # the names and defaults are Serve's own (this test's environment sets none of them)
    from ray.serve._private import constants

    wrapper = _wrapper_module()
    assert {name: getattr(constants, name) for name in wrapper.HAPROXY_PORTS} == wrapper.HAPROXY_PORTS
    assert all(hasattr(constants, name) for name in wrapper.HAPROXY_FILES)
    assert constants.RAY_SERVE_HAPROXY_NBTHREAD == 4 and wrapper.SERVE_DEFAULTS["RAY_SERVE_HAPROXY_NBTHREAD"] == "1"


def test_a_taken_http_port_stops_the_run_before_ray_starts_with_one_line(capsys, tmp_path):
    """A second `make run` beside a running one: one line, exit status 2, no Ray started (it
    was a second Ray instance and ~170 lines of tracebacks from HAProxy's failed bind)."""
    wrapper = _wrapper_module()
    assert wrapper.SERVE_HTTP_PORT == 8000
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))  # where Serve's Python proxy binds: 0.0.0.0 is taken too
        busy.listen()
        port = busy.getsockname()[1]
        assert not wrapper.check_http_port(["app:deployment"], port, str(tmp_path / "a"))
        assert capsys.readouterr().err == (
            f"serve_run: port {port} is in use (another server? `make run` is already running?); "
            "stop that server first\n")
        assert wrapper.check_http_port(["ray_configs/serve_local.yaml"], port)  # a config names its own port
        assert wrapper.check_http_port(["other:app"], port)  # not ours to know
    (tmp_path / "b").mkdir()
    assert wrapper.check_http_port(["app:deployment"], port, str(tmp_path / "b"))  # closed: free again
    assert capsys.readouterr().err == ""
    # and a second run for the port while the first starts, before Serve binds it
    assert not wrapper.check_http_port(["app:deployment"], port, str(tmp_path / "b"))
    assert capsys.readouterr().err == (
        f"serve_run: another `make run` for port {port} (pid {os.getpid()}, in {os.getcwd()}; `kill {os.getpid()}` "
        "stops it) is starting or running; stop it first\n")


def test_haproxys_buffer_holds_the_largest_request_body_the_app_accepts():
    """Behind HAProxy with Serve's 16 KiB buffer, 30 of 60 requests with 40 KB bodies ran on
    after their clients left; with the whole body in one buffer, 0 of 136."""
    from app import config
    from engine.loader import DUMMY_SHAPES

    wrapper = _wrapper_module()
    assert (wrapper.BODY_BYTES_PER_TOKEN, wrapper.BODY_BYTES_OVERHEAD) == (
        config.BODY_BYTES_PER_TOKEN, config.BODY_BYTES_OVERHEAD)
    assert wrapper.LARGEST_MAX_MODEL_LEN == max(s["max_position_embeddings"] for s in DUMMY_SHAPES.values())
    bufsize = lambda env: int(wrapper.haproxy_bufsize_env(env)["RAY_SERVE_HAPROXY_TUNE_BUFSIZE"])  # noqa: E731
    assert bufsize({}) == 64 * 131072 + 2**20 + 2**16
    assert bufsize({"MINI_INFER_MAX_MODEL_LEN": "4096"}) == 64 * 4096 + 2**20 + 2**16
    assert bufsize({"MINI_INFER_MAX_REQUEST_BODY_BYTES": "100000", "MINI_INFER_MAX_MODEL_LEN": "4096"}) == (
        100000 + 2**16)
    assert wrapper.haproxy_bufsize_env({"RAY_SERVE_HAPROXY_TUNE_BUFSIZE": "16384"}) == {}  # the user's own


def test_a_stop_waits_for_the_requests_in_flight_then_goes_on(tmp_path, capsys):
    """The first SIGTERM or Ctrl-C creates the drain flag and waits while /stats counts
    requests running or waiting, up to the timeout; a second signal, or a service that does
    not answer, ends the wait at once."""
    import json
    import time

    from app import http_guard
    from tests.stand_in import stand_in_service

    wrapper = _wrapper_module()
    counts = [2, 1, 0]
    seen_keys = []
    flag = tmp_path / "draining"

    def stats(request) -> tuple[int, bytes]:
        seen_keys.append(request.headers.get("Authorization"))
        count = counts.pop(0) if len(counts) > 1 else counts[0]
        if flag.exists() and flag.read_text() == "stop":  # the engine replicas end them (a 503 each)
            count = 0
        return 200, json.dumps({"replicas": [{"num_running": count, "num_waiting": 0}]}).encode()

    with stand_in_service(stats) as url:
        start = time.monotonic()
        wrapper.drain(url, "k", str(flag), timeout_s=20, stop_now=lambda: False)
        assert flag.exists() and 0.9 < time.monotonic() - start < 5  # 2 polls 0.2 s apart, then 0.5 s
        assert seen_keys == ["Bearer k"] * 3
        assert capsys.readouterr().err == ("serve_run: stopping: waiting up to 20 s for 2 sequences in flight to "
                                           "finish (each choice of n and each prompt of a batch counts; "
                                           "MINI_INFER_SHUTDOWN_TIMEOUT_S); signal again to stop now: Ctrl-C, or "
                                           "SIGTERM to the process group or to serve_run (pid "
                                           f"{os.getpid()}), not to make alone, which holds a second signal "
                                           "until its child ends\n")
        counts[:] = [5]  # never done: the timeout ends the wait, and the flag says to end them
        start = time.monotonic()
        wrapper.drain(url, None, str(flag), timeout_s=0.5, stop_now=lambda: False)
        assert 0.4 < time.monotonic() - start < 3
        assert flag.read_text() == wrapper.STOP_NOW == http_guard.STOP_NOW
        assert capsys.readouterr().err.endswith("serve_run: stopping: the requests of 5 sequences still in flight "
                                                "end with 503 shutting_down\n")
        flag.unlink()
        start = time.monotonic()
        wrapper.drain(url, None, str(flag), timeout_s=20, stop_now=lambda: True)  # a second signal
        assert time.monotonic() - start < 0.5
    start = time.monotonic()
    wrapper.drain(url, None, str(flag), timeout_s=20, stop_now=lambda: False)  # nothing answers
    assert time.monotonic() - start < 3
    assert wrapper.shutdown_timeout_s({}) == 20
    assert wrapper.shutdown_timeout_s({"MINI_INFER_SHUTDOWN_TIMEOUT_S": "0"}) == 0
    assert wrapper.shutdown_timeout_s({"MINI_INFER_SHUTDOWN_TIMEOUT_S": "soon"}) is None
    assert capsys.readouterr().err.endswith("MINI_INFER_SHUTDOWN_TIMEOUT_S='soon': must be a number of seconds >= 0\n")
