"""What watching the dashboard costs the service: ``bench/serving.py``'s HTTP run of one
workload, alternately without and with a watcher that does what an open ``/dashboard`` tab
does (``GET /dashboard`` once, then ``GET /stats?blocks=1`` every ``--poll-interval-s``).

    make run &   # the service on 127.0.0.1:8000
    python bench/dashboard_ab.py --workload ../shared/workloads/w2_short.json --repeats 3

Runs alternate ABBA (off, on, on, off, ...) so that drift on a shared machine falls on both;
it reports each run's output tokens/s, the medians, the ratio watched / unwatched of each
adjacent pair and their median (the figure to read: it cancels slow drift), and the polls'
latency and size. The watcher runs in this process, not in a browser: the
browser's own CPU is the viewer's machine's, not the server's.
"""
from __future__ import annotations

import asyncio
import statistics
import time
from pathlib import Path

import aiohttp
from common import load_workload, machine_info, percentiles, write_result
from serving import bench_http, server_parser


class Watcher:
    """Polls like the page: ``GET /dashboard``, then ``GET /stats?blocks=1`` every
    ``interval_s`` seconds, each poll sent ``interval_s`` after the previous one ended (as the
    page's ``setTimeout`` loop does)."""

    def __init__(self, url: str, interval_s: float) -> None:
        self.url = url
        self.interval_s = interval_s
        self.latencies: list[float] = []
        self.sizes: list[int] = []
        self.failures = 0

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            async with session.get(self.url + "/dashboard") as response:
                response.raise_for_status()
                await response.read()
            while True:
                start = time.perf_counter()
                try:
                    async with session.get(self.url + "/stats", params={"blocks": "1"}) as response:
                        body = await response.read()
                        if response.status != 200:
                            self.failures += 1
                except aiohttp.ClientError:
                    self.failures += 1
                else:
                    self.latencies.append(time.perf_counter() - start)
                    self.sizes.append(len(body))
                await asyncio.sleep(self.interval_s)


async def one_run(args, requests: list[dict], watched: bool) -> dict:
    watcher = Watcher(args.url, args.poll_interval_s) if watched else None
    task = asyncio.create_task(watcher.run()) if watcher else None
    try:
        result = await bench_http(args.url, args.model, requests, [args.request_rate], args.seed,
                                  (float("inf"), float("inf")))
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    run = result[str(args.request_rate)]
    summary = {"watched": watched, "output_tokens_per_s": run["output_tokens_per_s"], "seconds": run["seconds"],
               "failed": run["failed"], "ttft_p50_s": run["ttft_s"].get("p50")}
    if watcher is not None:
        summary.update(polls=len(watcher.latencies), poll_failures=watcher.failures,
                       poll_latency_s=percentiles(watcher.latencies),
                       poll_bytes=max(watcher.sizes, default=0))
    return summary


def main() -> None:
    parser = server_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s; inf: all at once")
    parser.add_argument("--repeats", type=int, default=3, help="pairs of runs (one unwatched, one watched)")
    parser.add_argument("--poll-interval-s", type=float, default=1.0, help="the page's period")
    parser.add_argument("--quick", action="store_true", help="8 requests, short prompts and outputs (CI)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    workload = load_workload(args.workload, quick=args.quick)
    requests = workload["requests"][: args.num_requests]
    runs = []
    for index in range(args.repeats):
        for watched in ((False, True) if index % 2 == 0 else (True, False)):
            runs.append(asyncio.run(one_run(args, requests, watched)))
            print(f"{'watched  ' if watched else 'unwatched'} {runs[-1]['output_tokens_per_s']:8.1f} tok/s"
                  + (f"  ({runs[-1]['polls']} polls)" if watched else ""), flush=True)
    medians = {key: statistics.median(r["output_tokens_per_s"] for r in runs if r["watched"] == watched)
               for key, watched in (("unwatched", False), ("watched", True))}
    ratio = round(medians["watched"] / medians["unwatched"], 4)
    pairs = [(runs[i], runs[i + 1]) for i in range(0, len(runs), 2)]
    pair_ratios = [round((a if a["watched"] else b)["output_tokens_per_s"]
                         / (b if a["watched"] else a)["output_tokens_per_s"], 4) for a, b in pairs]
    result = {"workload": workload["name"], "num_requests": len(requests), "request_rate": str(args.request_rate),
              "poll_interval_s": args.poll_interval_s, "machine": machine_info(), "runs": runs,
              "median_output_tokens_per_s": medians, "watched_over_unwatched": ratio,
              "pair_ratios": pair_ratios, "median_pair_ratio": statistics.median(pair_ratios)}
    path = write_result(f"dashboard-ab-{workload['name']}", result, args.out)
    print(f"median tok/s: unwatched {medians['unwatched']:.1f}, watched {medians['watched']:.1f}, "
          f"ratio {ratio:.3f}; pair ratios {pair_ratios}, median {statistics.median(pair_ratios):.3f}; "
          f"wrote {path}")


if __name__ == "__main__":
    main()
