"""Run the Locust users headless for a fixed time and write a summary JSON and a PNG plot.

    python -m loadtest --users 4 --spawn-rate 4 --duration 20 --host http://127.0.0.1:8000

The users are ``loadtest.locustfile``'s (completions and multi-turn chats, 3:1). The summary
has requests/s, output tokens/s, TTFT, TPOT, ITL and end-to-end latency percentiles
(p50/p90/p99, milliseconds), the failure count, and prompt tokens with the share the prefix
cache served; Locust's own CSV files
(``<out>/locust_stats.csv``, ``_stats_history.csv``, ``_failures.csv``) sit beside it.
"""
from gevent import monkey

monkey.patch_all()  # before anything imports ssl or sockets, as locust's own CLI does

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Callable  # noqa: E402

import gevent  # noqa: E402
from locust.env import Environment  # noqa: E402
from locust.stats import CSV_STATS_INTERVAL_SEC, PERCENTILES_TO_REPORT, StatsCSVFileWriter, stats_history  # noqa: E402

from loadtest import DEFAULT_OUT  # noqa: E402
from loadtest.locustfile import ChatConversationUser, OpenAIStreamingUser  # noqa: E402

USERS = [OpenAIStreamingUser, ChatConversationUser]
REQUESTS = ["/v1/completions (stream)", "/v1/chat/completions (multi-turn stream)"]
METRICS = {"ttft_ms": ("METRIC", "TTFT"), "tpot_ms": ("METRIC", "TPOT"),
           "itl_ms": ("METRIC", "ITL"), "e2e_ms": ("TOKENS", "output_tokens")}


def run(host: str, users: int, spawn_rate: float, duration: float, out: Path) -> dict:
    """Run the load; return the summary (also written to ``out/summary.json``)."""
    out.mkdir(parents=True, exist_ok=True)
    env = Environment(user_classes=USERS, host=host)
    finished: list[tuple[float, int]] = []  # (seconds since start, output tokens) per request

    def on_request(request_type, response_length, **_):
        if request_type == "TOKENS":
            finished.append((time.monotonic() - start, response_length))

    env.events.request.add_listener(on_request)
    runner = env.create_local_runner()
    writer = StatsCSVFileWriter(env, PERCENTILES_TO_REPORT, str(out / "locust"), full_history=True)
    greenlets = [gevent.spawn(writer), gevent.spawn(stats_history, runner)]
    start = time.monotonic()
    runner.start(users, spawn_rate=spawn_rate)
    gevent.spawn_later(duration, runner.quit)
    runner.greenlet.join()
    elapsed = time.monotonic() - start
    gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)  # the CSV writer's last rows
    gevent.killall(greenlets)
    writer.close_files()
    summary = summarize(env, elapsed, host, users, spawn_rate)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(finished, summary, out / "summary.png")
    return summary


def summarize(env, elapsed: float, host: str, users: int, spawn_rate: float) -> dict:
    requests = [env.stats.get(name, "POST") for name in REQUESTS]
    tokens = env.stats.get("output_tokens", "TOKENS")
    prompt = env.stats.get("prompt_tokens", "USAGE").total_content_length
    cached = env.stats.get("cached_prompt_tokens", "USAGE").total_content_length
    summary = {"host": host, "users": users, "spawn_rate": spawn_rate, "duration_s": round(elapsed, 2),
               "num_requests": sum(r.num_requests for r in requests),
               "num_failures": sum(r.num_failures for r in requests),
               "num_requests_by_name": {r.name: r.num_requests for r in requests},
               "requests_per_s": round(tokens.num_requests / elapsed, 3),
               "output_tokens": tokens.total_content_length,
               "output_tokens_per_s": round(tokens.total_content_length / elapsed, 2),
               "prompt_tokens": prompt, "cached_prompt_tokens": cached,
               "cached_prompt_fraction": round(cached / prompt, 4) if prompt else None}
    for key, (kind, name) in METRICS.items():
        entry = env.stats.get(name, kind)
        summary[key] = {f"p{p}": entry.get_response_time_percentile(p / 100) if entry.num_requests else None
                        for p in (50, 90, 99)}
        summary[key]["mean"] = round(entry.avg_response_time, 2) if entry.num_requests else None
    summary["failures"] = [{"name": f.name, "error": str(f.error), "occurrences": f.occurrences}
                           for f in env.stats.errors.values()]
    return summary


def plot(finished: list[tuple[float, int]], summary: dict, path: Path) -> None:
    """Latency percentiles per metric, and completed requests and output tokens per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    names = list(METRICS)
    for offset, p in enumerate(("p50", "p90", "p99")):
        values = [summary[n][p] or 0 for n in names]
        left.bar([i + 0.27 * (offset - 1) for i in range(len(names))], values, width=0.27, label=p)
    left.set_xticks(range(len(names)), [n.removesuffix("_ms").upper() for n in names])
    left.set_yscale("log")
    left.set_ylabel("milliseconds")
    left.legend(fontsize=8)
    left.set_title(f"{summary['users']} users, {summary['duration_s']:.0f} s: "
                   f"{summary['output_tokens_per_s']:.0f} output tok/s", fontsize=9)
    seconds = range(int(summary["duration_s"]) + 1)
    tokens = [sum(n for t, n in finished if int(t) == s) for s in seconds]
    requests = [sum(1 for t, _ in finished if int(t) == s) for s in seconds]
    right.bar(seconds, tokens, color="tab:green", label="output tokens/s")
    right.set_xlabel("seconds")
    right.set_ylabel("output tokens/s")
    twin = right.twinx()
    twin.plot(seconds, requests, "k.-", label="requests/s")
    twin.set_ylabel("requests completed/s")
    right.set_title(f"{summary['num_requests']} requests, {summary['num_failures']} failures", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positive(kind: type) -> Callable[[str], float]:
    """An argparse type: a number of ``kind`` above 0 (Locust ran ``--users -3`` for no
    request and exited 0)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0; got {text}")
        return value
    return parse


def main() -> int:
    """Returns the exit status: 1 where any request failed (as Locust's own), with the
    failures on stderr, else 0."""
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="http://127.0.0.1:8000")
    parser.add_argument("--users", type=_positive(int), default=4)
    parser.add_argument("--spawn-rate", type=_positive(float), default=4.0, help="users started per second")
    parser.add_argument("--duration", type=_positive(float), default=60.0, help="seconds")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"results folder (default {DEFAULT_OUT})")
    args = parser.parse_args()
    summary = run(args.host, args.users, args.spawn_rate, args.duration, args.out)
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}, indent=2))
    print(f"wrote {args.out / 'summary.json'}, {args.out / 'summary.png'} and Locust's CSV files")
    if not summary["num_requests"]:
        print("no request was made: nothing measured (a longer --duration?)", file=sys.stderr)
        return 1
    if not summary["num_failures"]:
        return 0
    for failure in summary["failures"][:5]:
        print(f"failed {failure['occurrences']} times: {failure['name']}: {failure['error']}", file=sys.stderr)
    if any("HTTP 401" in failure["error"] for failure in summary["failures"]):
        print("HTTP 401: the service has an api_key; set MINI_INFER_LOAD_API_KEY to send it", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
