"""``serve run`` that stops the same clean way on SIGTERM as on Ctrl-C (``make run`` uses it).

    python scripts/serve_run.py app:deployment [serve run arguments...]

Ray's driver (the ``serve run`` process) answers SIGTERM with a C++ stack dump and dies
without shutting Serve down; only SIGINT takes ``serve run``'s own path (``serve.shutdown()``,
then Ray's). This runs ``serve run`` in a session of its own and turns every SIGTERM or SIGINT
it receives (and SIGHUP, a closed terminal or SSH session, unless ``nohup`` ignores it) into
one SIGINT for ``serve run``;
so a terminal's Ctrl-C also reaches only the driver, not Ray's processes, which the driver
stops in order. Should this wrapper die without doing so (SIGKILL, to it or to its process
group), ``serve run`` gets that SIGINT from the kernel (``PR_SET_PDEATHSIG``) rather than
serving on unowned. For ``app:deployment``
(``make run``) the first signal first drains (``drain``): the service takes no new requests
and the ones in flight finish, for up to ``MINI_INFER_SHUTDOWN_TIMEOUT_S`` seconds (0: at
once), then end with 503 ``shutting_down``; a second signal stops at once. Exits with ``serve run``'s
status, or 2 where ``check_settings`` finds a ``MINI_INFER_*`` setting invalid or port 8000
is taken (``check_http_port``). Standard library
only: it starts in a blink and imports neither Ray nor torch.

It also sets ``RAY_SERVE_PROXY_USE_GRPC=1`` unless the environment sets it: Serve's HTTP proxy
then passes requests and their streamed responses to the ingress over Serve's interdeployment
gRPC transport instead of Ray actor calls, as the ingress calls the engine replicas
(``AppConfig.engine_transport``): less CPU per streamed token (docs/DEPLOYMENT.md, "How
requests cross between Serve's processes"). Ray's processes inherit it where ``serve run``
starts Ray itself; a cluster started with ``ray start`` needs it in ``ray start``'s
environment.

And Serve's two one-loop settings, unless the environment sets them:
``RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD=0`` (a replica runs the deployment's code on its
own event loop, not on a second loop in another thread) and
``RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0`` (a handle routes on its caller's loop): two
hand-offs between threads fewer for every streamed record, in the proxy, the ingress and the
engine replica. They are two of the settings of Serve's own ``RAY_SERVE_THROUGHPUT_OPTIMIZED``
mode. Measured: docs/PERFORMANCE.md, "A lone engine replica on every core, and Serve's
one-loop settings".

And Serve's HAProxy mode, unless the environment sets it: ``RAY_SERVE_ENABLE_HA_PROXY=1``
(HAProxy in place of Serve's Python proxy, handing each connection straight to the ingress
replica's own HTTP server: one process fewer for every streamed token; it binds every
interface) with ``RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=2`` (a stopping ingress
replica keeps accepting that long, for HAProxy on the same node to drop it, instead of 30 s:
Ctrl-C then takes ~10 s, not ~40) and ``RAY_SERVE_HAPROXY_NBTHREAD=1`` (HAProxy on one thread,
not Serve's four: with four, a client that closed its connection before the response's first
byte went unheard for 8 of 72 such requests, which ran to their end; with one, 2 of 276:
docs/DEPLOYMENT.md, "How requests cross between Serve's processes").
And ``RAY_SERVE_HAPROXY_TUNE_BUFSIZE`` (``haproxy_bufsize_env``): HAProxy's buffer holds the
largest request body the app accepts, not Serve's 16 KiB; with a body larger than its buffer
HAProxy often did not pass on a client's disconnect, and the request ran to its end.
``RAY_SERVE_ENABLE_HA_PROXY=0`` keeps the Python proxy.
HAProxy's files (its config, state and admin socket) go to a private directory of the run's
own, removed when it ends (``HAPROXY_FILES``); where its stats page's, its Prometheus
exporter's or its fallback proxy's port is taken, another one is (``HAPROXY_PORTS``).
Measured: docs/PERFORMANCE.md, "HAProxy in front"; docs/DEPLOYMENT.md, "How requests cross
between Serve's processes".
"""
from __future__ import annotations

import ctypes
import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable

# AppConfig.load() in a Python of its own, app/config.py loaded without the app package (which
# imports Ray): each invalid setting one line on stderr naming its variable, exit status 2.
_CHECK_SETTINGS = r"""
import importlib.util, sys
spec = importlib.util.spec_from_file_location("_mini_infer_app_config", "app/config.py")
config = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = config
spec.loader.exec_module(config)
import pydantic
try:
    config.AppConfig.load()
except pydantic.ValidationError as exc:
    for error in exc.errors():
        if error["type"] == "unknown_setting":  # the variable as written (its value may be a secret)
            where = error["loc"][0]
        elif error["loc"]:
            where = f"{config.ENV_PREFIX}{str(error['loc'][0]).upper()}={error['input']!r}"
        else:
            where = "settings"
        print(f"{where}: {error['msg'].removeprefix('Value error, ')}", file=sys.stderr)
    sys.exit(2)
"""


# Serve's settings for make run, each unless the environment sets it (the module docstring).
SERVE_DEFAULTS = {"RAY_SERVE_PROXY_USE_GRPC": "1", "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
                  "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0", "RAY_SERVE_ENABLE_HA_PROXY": "1",
                  "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2", "RAY_SERVE_HAPROXY_NBTHREAD": "1"}

# Where HAProxy's files go (Serve's defaults: /tmp/haproxy-serve/<node id>/, kept after the
# run, its admin socket mode 666 at admin level in a directory anyone may enter): a directory of
# this run's own, mode 0700, removed when serve run exits. Each unless the environment sets it.
HAPROXY_FILES = {"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": "haproxy.cfg", "RAY_SERVE_HAPROXY_SOCKET_PATH": "admin.sock",
                 "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": "", "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": "server-state",
                 "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": "metrics.sock"}


# The other ports that HAProxy mode binds on every interface besides 8000 (Serve's defaults): one
# already in use would keep HAProxy, or its fallback proxy, and so the service from starting.
HAPROXY_PORTS = {"RAY_SERVE_HAPROXY_STATS_PORT": 8404, "RAY_SERVE_HAPROXY_METRICS_PORT": 9101,
                 "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": 8500}


def free_ports_env(env: dict[str, str], ports: dict[str, int] = HAPROXY_PORTS) -> dict[str, str]:
    """For each of ``ports`` that ``env`` does not set and that something on this host already
    listens on: a free port instead, said in one line on stderr."""
    chosen = {}
    for name, port in ports.items():
        if name in env or _can_listen(port):
            continue
        with socket.socket() as probe:
            probe.bind(("", 0))
            chosen[name] = str(probe.getsockname()[1])
        print(f"serve_run: port {port} is in use; {name}={chosen[name]}", file=sys.stderr)
    return chosen


def _can_listen(port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is no obstacle
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


# Where ``serve run`` serves an import path such as app:deployment (Serve's DEFAULT_HTTP_PORT; a
# config file names its own).
SERVE_HTTP_PORT = 8000


_port_lock: int | None = None  # held while this process runs (released by the kernel at exit)


def check_http_port(argv: list[str], port: int = SERVE_HTTP_PORT, lock_dir: str | None = None) -> bool:
    """For ``serve run app:deployment``: whether ``port`` is free and no other ``make run`` for
    it is starting, checked before Ray starts; this process then holds a lock on
    ``<lock_dir>/mini-infer-port-<port>.lock`` (the temporary directory by default) until it
    exits, since Serve binds the port only some seconds into a run, and writes its pid and
    directory there. Where another server holds either, one line says so (and which run holds
    the lock); inside ``serve run`` that was a second Ray instance and ~170 lines
    of tracebacks ~20 s later ("cannot bind socket ... [0.0.0.0:8000]"). True for other
    targets (a config file names its own port)."""
    global _port_lock
    if not argv or argv[0] != "app:deployment":
        return True
    path = os.path.join(lock_dir or tempfile.gettempdir(), f"mini-infer-port-{port}.lock")
    lock, writable = None, True
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # another user's lock file: read it only
        try:
            lock = os.open(path, flags, 0o644)
            break
        except OSError:  # not ours to create or read: the port's own check below still holds
            writable = False
    if lock is not None:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(lock, 4096, 0).decode(errors="replace").strip().split(" ", 1)
            os.close(lock)
            where = f" (pid {holder[0]}, in {holder[1]}; `kill {holder[0]}` stops it)" if len(holder) == 2 else ""
            print(f"serve_run: another `make run` for port {port}{where} is starting or running; stop it first",
                  file=sys.stderr)
            return False
        if writable:  # who holds it, for the refusal above
            os.ftruncate(lock, 0)
            os.pwrite(lock, f"{os.getpid()} {os.getcwd()}\n".encode(), 0)
    if _can_listen(port):
        _port_lock = lock
        return True
    if lock is not None:
        os.close(lock)
    print(f"serve_run: port {port} is in use (another server? `make run` is already running?); "
          "stop that server first", file=sys.stderr)
    return False


# The app's default request-body limit (app/config.py, AppConfig.max_body_bytes): bytes per
# token of max_model_len, plus this; and the longest max_model_len of the models that
# engine/loader.py serves (SmolLM2's is 8,192).
BODY_BYTES_PER_TOKEN, BODY_BYTES_OVERHEAD, LARGEST_MAX_MODEL_LEN = 64, 1 << 20, 131072
# Room in HAProxy's buffer for the request line and headers besides the body.
HEADER_BYTES = 64 << 10


def haproxy_bufsize_env(env: dict[str, str]) -> dict[str, str]:
    """``RAY_SERVE_HAPROXY_TUNE_BUFSIZE`` where ``env`` does not set it: room for the largest
    request body the app accepts (``MINI_INFER_MAX_REQUEST_BODY_BYTES``, else its default for
    ``MINI_INFER_MAX_MODEL_LEN``, else for the longest context of the models it serves, 131,072
    tokens: 9 MiB) and ``HEADER_BYTES`` more. With Serve's 16 KiB, 8 to 16 requests with 40 KB
    bodies sent at once and closed 0.05-3 s later: 30 of 60 ran on after their client left (16
    to their end); with 1 MiB or 9 MiB, 0 of 136 (docs/DEPLOYMENT.md, "How requests cross
    between Serve's processes"). HAProxy takes a buffer's memory as it fills, not its size:
    22.1 MB resident with 32 such requests open, 12.7 MB idle."""
    if "RAY_SERVE_HAPROXY_TUNE_BUFSIZE" in env:
        return {}
    body = _env_int(env, "MINI_INFER_MAX_REQUEST_BODY_BYTES") or (
        BODY_BYTES_PER_TOKEN * (_env_int(env, "MINI_INFER_MAX_MODEL_LEN") or LARGEST_MAX_MODEL_LEN)
        + BODY_BYTES_OVERHEAD)
    return {"RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(body + HEADER_BYTES)}


def _env_int(env: dict[str, str], name: str) -> int:
    """``env``'s integer ``name``; 0 where unset or not an integer (``check_settings`` refuses
    that before this runs)."""
    try:
        return int(env.get(name) or 0)
    except ValueError:
        return 0


def haproxy_files_env(env: dict[str, str], folder: str) -> dict[str, str]:
    """``HAPROXY_FILES`` under ``folder`` for the variables that ``env`` does not set."""
    return {name: os.path.join(folder, file) for name, file in HAPROXY_FILES.items() if name not in env}


def check_settings(argv: list[str]) -> bool:
    """For ``serve run app:deployment`` (settings from ``MINI_INFER_*`` variables, in the
    current directory's ``app``): whether they are valid, checked before Ray starts. An invalid
    one is printed as one line naming its variable and value (``MINI_INFER_KV_CACHE_DTYPE='x':
    Input should be 'auto', ...``); inside ``serve run`` it would be ~40 lines of traceback
    from Ray's import of the application. True for other targets, or where the check itself
    cannot run (``serve run`` then reports what it finds)."""
    if not argv or argv[0] != "app:deployment" or not os.path.isfile(os.path.join("app", "config.py")):
        return True
    try:
        return subprocess.run([sys.executable, "-c", _CHECK_SETTINGS], timeout=120).returncode != 2
    except (OSError, subprocess.TimeoutExpired):
        return True


# Seconds a stop waits for the requests in flight to finish (Ray Serve's own
# graceful_shutdown_timeout_s default); 0: stop at once.
DEFAULT_SHUTDOWN_TIMEOUT_S = 20.0


# Signals this close after the first of a stop are the same stop: `kill -TERM -- -<pgid>` (or
# systemd's stop, which signals the whole group) reaches this wrapper twice, directly and
# through GNU make, which passes a SIGTERM on to its children, a few milliseconds apart.
SAME_STOP_S = 1.0


def stops_asked(arrivals: list[float]) -> int:
    """How many stops the signals that arrived at ``arrivals`` (``time.monotonic()`` seconds,
    in any order) ask for: a signal within ``SAME_STOP_S`` of the first signal of the stop
    before it is that same stop."""
    count, start = 0, 0.0
    for at in sorted(arrivals):
        if count == 0 or at - start >= SAME_STOP_S:
            count, start = count + 1, at
    return count


def in_flight(url: str, api_key: str | None) -> int | None:
    """Sequences running or waiting in the engine replicas (a request's each of ``n`` choices,
    a batch's each prompt), from ``GET <url>/stats``; ``None`` where the service does not
    answer (not started, or gone)."""
    request = urllib.request.Request(url + "/stats", headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(request, timeout=2) as response:
            replicas = json.load(response)["replicas"]
        return sum(r["num_running"] + r["num_waiting"] for r in replicas)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def drain(url: str, api_key: str | None, drain_file: str, timeout_s: float,
          stop_now: Callable[[], bool]) -> None:
    """Stop taking requests and wait, up to ``timeout_s``, for those in flight to finish.

    Creates ``drain_file``: the ingress then refuses new generation requests (503
    ``shutting_down``) and ``/ready`` answers 503, while the requests in flight run to their
    end. Returns once none is left (and half a second for their last bytes), after
    ``timeout_s``, when ``stop_now()`` (a second signal), or at once where the service does
    not answer.
    """
    with open(drain_file, "w"):
        pass
    deadline, waited = time.monotonic() + timeout_s, False
    while not stop_now():
        count = in_flight(url, api_key)
        if not count:
            break
        if not waited and timeout_s > 0:
            print(f"serve_run: stopping: waiting up to {timeout_s:g} s for {count} sequences in flight to finish "
                  "(each choice of n and each prompt of a batch counts; MINI_INFER_SHUTDOWN_TIMEOUT_S); signal "
                  f"again to stop now: Ctrl-C, or SIGTERM to the process group or to serve_run (pid {os.getpid()}), "
                  "not to make alone, which holds a second signal until its child ends", file=sys.stderr)
            waited = True
        if time.monotonic() >= deadline:
            print(f"serve_run: stopping: the requests of {count} sequences still in flight end with 503 "
                  "shutting_down", file=sys.stderr)
            stop_in_flight(url, api_key, drain_file, stop_now)
            return
        time.sleep(0.2)
    if waited and not stop_now():
        time.sleep(0.5)  # for their last events to reach the clients


# What the drain file holds once the wait is over: app.http_guard.STOP_NOW (this script does
# not import the app, which imports Ray; tests/test_serve_run_wrapper.py keeps them equal).
STOP_NOW = "stop"


# How long a second signal waits for the requests in flight to end with their 503 (the engine
# replicas poll for it every 0.25 s) before it stops Serve.
SECOND_STOP_WAIT_S = 1.5


def stop_in_flight(url: str, api_key: str | None, drain_file: str, stop_now: Callable[[], bool],
                   wait_s: float = 5.0) -> None:
    """End the requests still in flight with 503 ``shutting_down`` (an SSE error event and
    ``[DONE]`` for a stream) rather than a cut connection: writes ``STOP_NOW`` into
    ``drain_file``, which the engine replicas poll (``app.http_guard.stopping_now``), and
    waits, up to ``wait_s``, until none is left."""
    with open(drain_file, "w", encoding="utf-8") as flag:
        flag.write(STOP_NOW)
    deadline = time.monotonic() + wait_s
    while not stop_now() and time.monotonic() < deadline and in_flight(url, api_key):
        time.sleep(0.2)
    if not stop_now():
        time.sleep(0.5)  # for their last events to reach the clients


def shutdown_timeout_s(env: dict[str, str]) -> float | None:
    """``MINI_INFER_SHUTDOWN_TIMEOUT_S`` (seconds >= 0, ``DEFAULT_SHUTDOWN_TIMEOUT_S`` where
    unset); ``None``, with one line on stderr, where it is not such a number."""
    value = env.get("MINI_INFER_SHUTDOWN_TIMEOUT_S")
    if value is None:
        return DEFAULT_SHUTDOWN_TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        print(f"MINI_INFER_SHUTDOWN_TIMEOUT_S={value!r}: must be a number of seconds >= 0", file=sys.stderr)
        return None
    return seconds


def interrupted_with_parent(parent_pid: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` for which the child gets SIGINT when ``parent_pid`` (the calling
    thread, this wrapper's only one) dies: Linux's ``prctl(PR_SET_PDEATHSIG)``; ``None``
    elsewhere. A trial: SIGKILL to ``make run``'s process group (a process manager after its
    stop timeout) left ``serve run``, in a session of its own, and every Ray process serving
    on port 8000, which the next ``make run`` then found taken."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork
    pr_set_pdeathsig = 1  # <linux/prctl.h>

    def set_death_signal() -> None:
        prctl(pr_set_pdeathsig, signal.SIGINT)
        if os.getppid() != parent_pid:  # died before the prctl: nothing will send it
            os.kill(os.getpid(), signal.SIGINT)

    return set_death_signal


def main(argv: list[str]) -> int:
    timeout_s = shutdown_timeout_s(os.environ)
    if timeout_s is None or not check_settings(argv) or not check_http_port(argv):
        return 2
    serve = os.path.join(os.path.dirname(sys.executable), "serve")
    # A process started in the background by a non-interactive shell (`make run &`) inherits
    # SIGINT ignored, and Python keeps an ignored SIGINT ignored: ``serve run`` would then
    # never see the SIGINT sent below. The child inherits SIG_DFL instead, so its Python
    # installs the KeyboardInterrupt handler that ``serve run``'s shutdown path needs.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    env = {**SERVE_DEFAULTS, **os.environ}
    haproxy_folder = None
    if env["RAY_SERVE_ENABLE_HA_PROXY"] == "1":
        # mode 0700; in /tmp as Serve's default, since a socket's path must stay under 108 bytes
        haproxy_folder = tempfile.mkdtemp(prefix="mini-infer-ha-", dir="/tmp" if os.path.isdir("/tmp") else None)
        env.update(haproxy_files_env(env, haproxy_folder))
        env.update(free_ports_env(env))
        env.update(haproxy_bufsize_env(env))
    run_folder = tempfile.mkdtemp(prefix="mini-infer-run-")  # mode 0700: the drain flag's
    env.setdefault("MINI_INFER_DRAIN_FILE", os.path.join(run_folder, "draining"))
    # The handler only records when each signal came; this loop acts on them. A handler that
    # acted itself could be run again, by the same stop's second signal, between two of its own
    # statements, and take that signal for a second stop (1 run in ~20 of the test that signals
    # the process group).
    arrivals: list[float] = []
    try:
        child = subprocess.Popen([serve, "run", *argv], env=env, start_new_session=True,
                                 preexec_fn=interrupted_with_parent(os.getpid()))
        # SIGHUP stops it too, unless it was ignored from the start (`nohup make run`: not on logout)
        hup = [signal.SIGHUP] if signal.getsignal(signal.SIGHUP) != signal.SIG_IGN else []
        for signum in (signal.SIGTERM, signal.SIGINT, *hup):
            signal.signal(signum, lambda signum, frame: arrivals.append(time.monotonic()))
        drains = argv and argv[0] == "app:deployment"
        url, api_key = f"http://127.0.0.1:{SERVE_HTTP_PORT}", env.get("MINI_INFER_API_KEY")
        acted = 0  # stops acted on: the first drains (for the app this wrapper serves), a second stops at once
        interrupted = False  # serve run has its SIGINT: Serve and Ray are shutting down
        while True:
            try:
                return child.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                pass
            asked = stops_asked(arrivals)
            if asked == acted:
                continue
            acted += 1
            if acted == 1 and drains:
                drain(url, api_key, env["MINI_INFER_DRAIN_FILE"], timeout_s,
                      stop_now=lambda: stops_asked(arrivals) > 1)
                if stops_asked(arrivals) > 1:
                    continue  # the second stop, next
            elif interrupted:  # a further SIGINT would cut their shutdown short (a trial: a traceback
                # in Ray's atexit shutdown, and two of Ray's agents left for a minute)
                print("serve_run: Serve and Ray are already shutting down (a few seconds); this signal is not "
                      "passed on, since another SIGINT would cut their shutdown short", file=sys.stderr)
                continue
            elif acted == 2 and drains:  # at once, but the requests in flight still get their 503
                print("serve_run: stopping now (a second signal): the requests still in flight end with 503 "
                      "shutting_down", file=sys.stderr)
                stop_in_flight(url, api_key, env["MINI_INFER_DRAIN_FILE"], stop_now=lambda: stops_asked(arrivals) > 2,
                               wait_s=SECOND_STOP_WAIT_S)
            if child.poll() is None:
                child.send_signal(signal.SIGINT)
                interrupted = True
    finally:
        shutil.rmtree(run_folder, ignore_errors=True)
        if haproxy_folder is not None:
            shutil.rmtree(haproxy_folder, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
