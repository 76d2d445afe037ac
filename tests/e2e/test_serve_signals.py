"""``make run`` stops cleanly on SIGTERM (what a process manager sends) and on Ctrl-C (SIGINT
to the terminal's foreground process group): Serve shuts down, then Ray; no traceback, no C++
stack dump, nothing left running."""
import os
import signal

import psutil
import pytest

from tests.serve_process import ServeProcess

UNCLEAN = ("Traceback", "SIGTERM received", "logging.cc", "Task exception was never retrieved")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
def test_make_run_stops_cleanly(how):
    # The signals, not the engine: eager (tests/app's make run compiles the glue) and a small
    # KV cache (a VM's first touch of 2 GiB took 3-25 s here), ~20 s less to start
    with ServeProcess(["make", "run"], env={"MINI_INFER_ENFORCE_EAGER": "1",
                                            "MINI_INFER_KV_CACHE_MEMORY_GB": "0.25"}) as app:
        family = psutil.Process(app.process.pid).children(recursive=True)
        if how == "sigterm":
            os.kill(app.process.pid, signal.SIGTERM)
        else:
            os.killpg(app.process.pid, signal.SIGINT)
        app.process.wait(timeout=120)
        _, alive = psutil.wait_procs(family, timeout=30)
        log = app.log_path.read_text(errors="replace")
    assert "Got KeyboardInterrupt, shutting down" in log, log[-3000:]
    assert [mark for mark in UNCLEAN if mark in log] == [], log[-3000:]
    assert alive == [], [str(p) for p in alive]
