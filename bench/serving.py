"""Serving benchmark in the style of vLLM's: Poisson arrivals against the running HTTP
endpoint, then the same schedule straight into an in-process ``AsyncLLM``.

    make run &   # the service on 127.0.0.1:8000
    python bench/serving.py --workload ../shared/workloads/w1_mixed.json --num-requests 32 \\
        --request-rates 0.5,1,inf

For each request rate (requests/s; ``inf`` sends everything at once) it reports throughput,
TTFT, TPOT, ITL and end-to-end percentiles, and goodput: requests/s that met the SLO
(``--slo-ttft-s`` and ``--slo-tpot-s``). The ``AsyncLLM`` run uses the same engine settings
as a server started from this environment (defaults, then ``MINI_INFER_*`` variables), so
``http / direct`` ratios show what HTTP, Serve and Ray cost. ``--repeats N`` runs N rounds of
one HTTP and one direct run back to back and reports the median of the rounds' ratios: on a
VM whose speed drifts, single runs swing by 10%. Every run sends its requests with a
``cache_salt`` of its own (this invocation's id, the round and the rate), so that no run finds
another's prompts in the prefix cache, an earlier invocation's against the same service
included.

``--client-sched idle`` runs the HTTP runs' client in a process of its own at Linux's
``SCHED_IDLE`` priority, so that on a small host the load generator's own CPU (aiohttp, one
JSON parse per streamed chunk) is spent where the service leaves a CPU idle instead of
preempting it; the direct run is unchanged (its consumer is the engine's own process). On
the 2-core AMD EPYC (AVX2) of docs/PERFORMANCE.md, HTTP alone on fresh servers in turns:
median 88.0 output tok/s (6 servers, 71.9-94.6) with the client at SCHED_IDLE, 80.4 (8
servers, 71.8-89.1) without (``bench/results/serving-w1-http-only-priorities-*``).

With ``--replicas N`` it serves the app itself instead (a local Ray, Serve on 127.0.0.1:8000,
N engine replicas) once per request router of ``--router`` (``AppConfig.request_router``), in
alternating order over ``--repeats``, and adds the cluster's prefix-cache hit rate (``/stats``)
and each replica's share of the requests:

    python bench/serving.py --workload ../shared/workloads/w3_shared_prefix.json \
        --num-requests 96 --request-rates inf --replicas 2 --router prefix,pow2 --kv-cache-memory-gb 0.5
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import math
import multiprocessing
import os
import random
import statistics
import sys
import time
import uuid
from pathlib import Path

import aiohttp
from cli_types import positive_list
from common import ROOT, load_workload, machine_info, percentiles, write_result

from engine.sampling_params import RequestOutputKind, SamplingParams


def arrival_offsets(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request is sent: a Poisson process of ``rate``
    (exponential gaps), or all at 0 for ``inf``."""
    if math.isinf(rate):
        return [0.0] * num_requests
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(t)
        t += rng.expovariate(rate)
    return out


class Record:
    """One request's token arrival times."""

    def __init__(self, sent: float) -> None:
        self.sent = sent
        self.token_times: list[float] = []
        self.num_tokens = 0
        self.error = None
        self.replica: str | None = None  # the engine replica that served it (HTTP)

    def metrics(self) -> dict:
        times = self.token_times
        return {"ttft": times[0] - self.sent, "e2e": times[-1] - self.sent,
                "tpot": (times[-1] - times[0]) / (self.num_tokens - 1) if self.num_tokens > 1 else None,
                "itl": [b - a for a, b in zip(times, times[1:], strict=False)]}


async def _http_request(session, url: str, model: str, request: dict, record: Record,
                        cache_salt: str | None = None) -> None:
    body = {"model": model, "prompt": request["prompt_token_ids"], "max_tokens": request["max_tokens"],
            "temperature": 0.0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    try:
        async with session.post(url + "/v1/completions", json=body) as response:
            if response.status != 200:
                record.error = f"HTTP {response.status}"
                return
            record.replica = response.headers.get("x-mini-infer-replica")
            async for line in response.content:
                if not line.startswith(b"data: {"):
                    continue
                data = json.loads(line[6:])
                if data.get("choices"):
                    record.token_times.append(time.perf_counter())
                if data.get("usage"):
                    record.num_tokens = data["usage"]["completion_tokens"]
    except aiohttp.ClientError as exc:
        record.error = repr(exc)


async def _direct_request(llm, request: dict, record: Record, cache_salt: str | None = None) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA, cache_salt=cache_salt)
    async for output in llm.generate(request["prompt_token_ids"], params):
        record.token_times.append(time.perf_counter())
        record.num_tokens += len(output.outputs[0].token_ids)


async def run_schedule(send, requests: list[dict], offsets: list[float]) -> tuple[list[Record], float]:
    """Send request i at ``offsets[i]`` through ``send(request, record)``; wait for all."""
    start = time.perf_counter()
    records = []

    async def one(request, offset):
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        record = Record(time.perf_counter())
        records.append(record)
        await send(request, record)

    await asyncio.gather(*(one(r, o) for r, o in zip(requests, offsets, strict=True)))
    return records, time.perf_counter() - start


def summarize(records: list[Record], seconds: float, slo_ttft: float, slo_tpot: float) -> dict:
    ok = [r for r in records if r.error is None and r.token_times]
    metrics = [r.metrics() for r in ok]
    good = [m for m in metrics if m["ttft"] <= slo_ttft and (m["tpot"] is None or m["tpot"] <= slo_tpot)]
    output_tokens = sum(r.num_tokens for r in ok)
    return {"seconds": round(seconds, 3), "completed": len(ok), "failed": len(records) - len(ok),
            "requests_per_s": round(len(ok) / seconds, 3),
            "output_tokens_per_s": round(output_tokens / seconds, 2),
            "goodput_requests_per_s": round(len(good) / seconds, 3),
            "ttft_s": percentiles([m["ttft"] for m in metrics]),
            "tpot_s": percentiles([m["tpot"] for m in metrics if m["tpot"] is not None]),
            "itl_s": percentiles([x for m in metrics for x in m["itl"]]),
            "e2e_s": percentiles([m["e2e"] for m in metrics])}


def rate_salt(cache_salt: str | None, rate: float) -> str:
    """The ``cache_salt`` of one rate's run: each rate's requests find none of an earlier
    rate's prompts in the prefix cache (the same requests are sent at every rate)."""
    return f"rate-{rate}" if cache_salt is None else f"{cache_salt}-rate-{rate}"


async def bench_http(url: str, model: str, requests, rates, seed, slo, cache_salt: str | None = None) -> dict:
    results = {}
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        for rate in rates:
            salt = rate_salt(cache_salt, rate)
            send = lambda r, rec, salt=salt: _http_request(session, url, model, r, rec, salt)  # noqa: E731
            records, seconds = await run_schedule(send, requests, arrival_offsets(len(requests), rate, seed))
            results[str(rate)] = summarize(records, seconds, *slo)
            replicas = [r.replica for r in records if r.replica is not None]
            results[str(rate)]["replica_shares"] = sorted(
                (round(replicas.count(r) / len(replicas), 3) for r in set(replicas)), reverse=True)
    return results


def _bench_http_sync(*args) -> dict:
    return asyncio.run(bench_http(*args))


def _sched_idle() -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # threads started later inherit it


def http_client(sched: str) -> concurrent.futures.ProcessPoolExecutor | None:
    """Where the HTTP runs' client runs (``--client-sched``): ``None`` for this process
    (``normal``); for ``idle``, a spawned process at ``SCHED_IDLE``, already started (its
    start-up is not measured).

    Raises:
        SystemExit: ``idle`` where the OS has no ``SCHED_IDLE`` (not Linux).
    """
    if sched == "normal":
        return None
    if not hasattr(os, "SCHED_IDLE"):
        raise SystemExit("--client-sched idle needs Linux's SCHED_IDLE scheduling policy")
    client = concurrent.futures.ProcessPoolExecutor(
        max_workers=1, mp_context=multiprocessing.get_context("spawn"), initializer=_sched_idle)
    client.submit(os.getpid).result()
    return client


def http_run(client: concurrent.futures.ProcessPoolExecutor | None, *args) -> dict:
    """``bench_http(*args)`` in ``client`` (``http_client``), or here where it is ``None``."""
    return _bench_http_sync(*args) if client is None else client.submit(_bench_http_sync, *args).result()


def bench_routers(args, requests, rates, slo) -> dict:
    """``bench_http`` against the app served here with ``args.replicas`` engine replicas, once
    per router and repeat (the order alternates); each run on fresh replicas (empty caches),
    with the cluster's prefix-cache hit rate from ``/stats`` after it."""
    import ray
    import requests as http
    from ray import serve

    from app import build_app

    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    routers = args.router.split(",")
    runs = {router: [] for router in routers}
    client = http_client(args.client_sched)  # before Ray: refused here, nothing to shut down
    ray.init(include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8000})
        for repeat in range(args.repeats):
            for router in routers if repeat % 2 == 0 else routers[::-1]:
                settings = {"num_engine_replicas": args.replicas, "request_router": router, "model": args.model}
                if args.kv_cache_memory_gb:
                    settings["kv_cache_memory_gb"] = args.kv_cache_memory_gb
                serve.run(build_app(settings), name="default", route_prefix="/")
                _wait_ready(http, args.url, args.replicas)
                run = http_run(client, args.url, args.model, requests, rates, args.seed, slo)
                stats = http.get(args.url + "/stats", timeout=30).json()["replicas"]
                queries = sum(s["prefix_cache_queries"] for s in stats)
                for summary in run.values():
                    summary["prefix_cache_hit_rate"] = round(
                        sum(s["prefix_cache_hits"] for s in stats) / queries if queries else 0.0, 4)
                runs[router].append(run)
                print(f"{router} (repeat {repeat}): " + ", ".join(
                    f"rate {rate}: {r['output_tokens_per_s']:.1f} tok/s, hit rate {r['prefix_cache_hit_rate']:.3f}, "
                    f"shares {r['replica_shares']}" for rate, r in run.items()), flush=True)
                serve.delete("default")
    finally:
        if client is not None:
            client.shutdown()
        serve.shutdown()
        ray.shutdown()
    return runs


def _wait_ready(http, url: str, num_replicas: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if (http.get(url + "/ready", timeout=30).status_code == 200
                    and len(http.get(url + "/stats", timeout=30).json()["replicas"]) == num_replicas):
                return
        except (http.RequestException, ValueError, KeyError):
            pass
        time.sleep(1.0)
    raise TimeoutError(f"the app did not answer /ready with {num_replicas} engine replicas in {timeout}s")


def router_ratios(runs: dict) -> dict:
    """The first router over each other one, per rate, from the medians over repeats: output
    tok/s, TTFT p50 and prefix-cache hit rate."""
    def median(router, rate, get):
        return statistics.median(get(run[rate]) for run in runs[router])

    first, *others = runs
    ratios = {}
    for other in others:
        for rate in runs[first][0]:
            ratios[f"{first}/{other} @ {rate}"] = {
                name: round(median(first, rate, get) / median(other, rate, get), 3)
                for name, get in (("output_tokens_per_s", lambda r: r["output_tokens_per_s"]),
                                  ("ttft_p50", lambda r: r["ttft_s"]["p50"]),
                                  ("prefix_cache_hit_rate", lambda r: r["prefix_cache_hit_rate"]))
                if median(other, rate, get)}
    return ratios


def direct_engine(model: str):
    """An in-process ``AsyncLLM`` with the server's engine settings: defaults, then
    ``MINI_INFER_*`` (e.g. ``MINI_INFER_STREAM_INTERVAL``)."""
    from app.config import AppConfig
    from engine.async_llm import AsyncLLM

    return AsyncLLM(config=AppConfig.load({"model": model}).engine_config())


async def bench_direct(llm, requests, rates, seed, slo, cache_salt: str | None = None) -> dict:
    results = {}
    for rate in rates:
        salt = rate_salt(cache_salt, rate)
        send = lambda r, rec, salt=salt: _direct_request(llm, r, rec, salt)  # noqa: E731
        records, seconds = await run_schedule(send, requests, arrival_offsets(len(requests), rate, seed))
        results[str(rate)] = summarize(records, seconds, *slo)
    return results


def http_over_direct(repeats: list[dict]) -> dict:
    """Per rate: the median over repeats of each repeat's HTTP/direct ratio of output tok/s
    and of TTFT p50 (the two runs of a repeat are back to back, so the machine's drift
    cancels), with every repeat's ratio."""
    ratios = {}
    for rate in repeats[0]["http"]:
        pairs = [(r["http"][rate], r["direct"][rate]) for r in repeats
                 if rate in r["direct"] and r["http"][rate]["completed"] and r["direct"][rate]["completed"]]
        if not pairs:
            continue
        tok = [h["output_tokens_per_s"] / d["output_tokens_per_s"] for h, d in pairs]
        ttft = [h["ttft_s"]["p50"] / d["ttft_s"]["p50"] for h, d in pairs]
        ratios[rate] = {"output_tokens_per_s": round(statistics.median(tok), 3),
                        "ttft_p50": round(statistics.median(ttft), 3),
                        "output_tokens_per_s_each": [round(x, 3) for x in tok]}
    return ratios


def server_parser(description: str) -> argparse.ArgumentParser:
    """The options of a benchmark against the running service: ``--workload``, ``--url``,
    ``--model``, ``--num-requests``, ``--seed``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _report_failures(runs: list[dict]) -> int:
    """1, with a line on stderr, where any run had failed requests (a run against no service
    wrote a result of 0 tok/s and exited 0), else 0."""
    failed = sum(run["failed"] for run in runs)
    if not failed:
        return 0
    print(f"{failed} requests failed (of {sum(run['failed'] + run['completed'] for run in runs)}): the "
          "figures above count only the completed ones", file=sys.stderr)
    return 1


def main() -> int:
    """Returns the exit status: 1 where any request failed."""
    parser = server_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--request-rates", type=positive_list(float, "numbers"), default="0.5,1,inf",
                        help="requests per second, comma-separated; inf: all at once")
    parser.add_argument("--slo-ttft-s", type=float, default=5.0)
    parser.add_argument("--slo-tpot-s", type=float, default=0.5)
    parser.add_argument("--skip-direct", action="store_true")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--replicas", type=int, help="serve the app here with this many engine "
                        "replicas, once per --router, instead of benchmarking the service at --url")
    parser.add_argument("--router", default="prefix,pow2", help="with --replicas: request routers "
                        "to compare (AppConfig.request_router), comma-separated; ratios are the first "
                        "over each other")
    parser.add_argument("--repeats", type=int, default=1, help="runs per router (with --replicas), or "
                        "HTTP and direct runs, alternating (every run with a cache_salt of its own, so "
                        "that none finds another's prefixes in the cache)")
    parser.add_argument("--kv-cache-memory-gb", type=float, help="with --replicas: each engine "
                        "replica's KV cache (default: the engine's)")
    parser.add_argument("--client-sched", choices=("normal", "idle"), default="normal",
                        help="the HTTP client's CPU priority: idle runs it in a process of its own "
                        "at SCHED_IDLE (Linux), so that it does not preempt the service on a small host")
    args = parser.parse_args()

    workload = load_workload(args.workload)
    requests = workload["requests"][: args.num_requests]
    rates = args.request_rates
    slo = (args.slo_ttft_s, args.slo_tpot_s)
    if args.replicas:
        runs = bench_routers(args, requests, rates, slo)
        result = {"workload": workload["name"], "num_requests": len(requests), "model": args.model,
                  "replicas": args.replicas, "client_sched": args.client_sched, "machine": machine_info(),
                  "routers": runs,
                  "ratios": router_ratios(runs)}
        path = write_result(f"serving-routers-{workload['name']}", result, args.out)
        for name, ratio in result["ratios"].items():
            print(f"{name}: {ratio}")
        print(f"wrote {path}")
        return _report_failures([summary for router_runs in runs.values() for run in router_runs
                                 for summary in run.values()])
    repeats = run_repeats(args, requests, rates, slo)
    http, direct = repeats[0]["http"], repeats[0]["direct"]
    result = {"workload": workload["name"], "num_requests": len(requests), "model": args.model,
              "slo": {"ttft_s": slo[0], "tpot_s": slo[1]}, "client_sched": args.client_sched,
              "machine": machine_info(),
              "http": http, "direct": direct, "http_over_direct": http_over_direct(repeats)}
    if args.repeats > 1:
        result["repeats"] = repeats
    path = write_result(f"serving-{workload['name']}", result, args.out)
    _plot(result, path.with_suffix(".png"))
    for rate in http:
        h, d = http[rate], direct.get(rate)
        line = (f"rate {rate:>5}: http {h['output_tokens_per_s']:7.1f} tok/s, "
                f"TTFT p50 {h['ttft_s'].get('p50', 0):.2f} s, "
                f"goodput {h['goodput_requests_per_s']:.2f} req/s, failed {h['failed']}")
        if d:
            line += f" | direct {d['output_tokens_per_s']:7.1f} tok/s, TTFT p50 {d['ttft_s'].get('p50', 0):.2f} s"
        print(line)
    for rate, ratio in result["http_over_direct"].items():
        print(f"rate {rate:>5}: http/direct {ratio['output_tokens_per_s']} (each repeat: "
              f"{ratio['output_tokens_per_s_each']})")
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return _report_failures([summary for repeat in repeats for mode in ("http", "direct")
                             for summary in (repeat.get(mode) or {}).values()])


def run_repeats(args, requests, rates, slo) -> list[dict]:
    """``args.repeats`` rounds of one HTTP and one direct run (the order alternates), round
    ``i`` with ``cache_salt`` ``"<id>-repeat-i"`` (``id`` this call's; ``rate_salt`` adds the
    rate). The direct engine
    is built once, before the first round (its start-up is not measured)."""
    client = http_client(args.client_sched)  # before the engine: refused here, nothing to shut down
    llm = None if args.skip_direct else direct_engine(args.model)
    run_id = uuid.uuid4().hex[:8]  # a second run against the same service finds nothing of this one's cached
    repeats = []
    try:
        for i in range(args.repeats):
            salt = f"{run_id}-repeat-{i}"
            run = {}
            for mode in ("http", "direct") if i % 2 == 0 else ("direct", "http"):
                if mode == "http":
                    run["http"] = http_run(client, args.url, args.model, requests, rates, args.seed, slo, salt)
                else:
                    run["direct"] = {} if llm is None else asyncio.run(
                        bench_direct(llm, requests, rates, args.seed, slo, salt))
            if args.repeats > 1:
                print(f"repeat {i}: " + ", ".join(
                    f"rate {rate}: http {run['http'][rate]['output_tokens_per_s']:.1f}"
                    + (f" / direct {run['direct'][rate]['output_tokens_per_s']:.1f}" if run["direct"] else "")
                    + " tok/s" for rate in run["http"]), flush=True)
            repeats.append(run)
    finally:
        if client is not None:
            client.shutdown()
        if llm is not None:
            llm.shutdown()
    return repeats


def _plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for mode, style in (("http", "o-"), ("direct", "s--")):
        runs = result[mode]
        if not runs:
            continue
        rates = list(runs)
        xs = range(len(rates))
        axes[0].plot(xs, [runs[r]["output_tokens_per_s"] for r in rates], style, label=mode)
        axes[1].plot(xs, [runs[r]["ttft_s"].get("p50", 0) for r in rates], style, label=f"{mode} p50")
        axes[1].plot(xs, [runs[r]["ttft_s"].get("p99", 0) for r in rates], style, alpha=0.5, label=f"{mode} p99")
        axes[2].plot(xs, [1000 * runs[r]["tpot_s"].get("p50", 0) for r in rates], style, label=f"{mode} p50")
        for ax in axes:
            ax.set_xticks(list(xs), rates)
            ax.set_xlabel("request rate (req/s)")
    axes[0].set_ylabel("output tokens/s")
    axes[1].set_ylabel("TTFT (s)")
    axes[2].set_ylabel("TPOT (ms)")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"{result['workload']}, {result['num_requests']} requests", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
