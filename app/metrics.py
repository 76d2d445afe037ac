"""Prometheus metrics, recorded twice: through ``ray.util.metrics`` (the Ray dashboard and each
Ray node's metrics port, named ``ray_<name>``) and into a prometheus_client registry per
replica, which ``GET /metrics`` on the service's own HTTP port gathers from every replica
(named ``<name>``). Names follow vLLM's (``mini_infer_`` instead of ``vllm:``).

Every series is there from the start: gauges, counters and histograms of each replica at 0,
labelled counters at 0 for every label value they can take (finish reasons, the error
statuses the service returns). Ray's exporter shows a series only once it has been recorded.
"""
from __future__ import annotations

from typing import Iterable

import prometheus_client
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from ray.util import metrics as ray_metrics

prometheus_client.disable_created_metrics()  # no `_created` series: vLLM's endpoint has none

# Seconds; Prometheus buckets chosen to cover CPU (slow) and GPU (fast) serving alike.
_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0]
FINISH_REASONS = ("stop", "length", "abort")
ERROR_STATUSES = (400, 401, 404, 405, 408, 413, 499, 500, 503)  # every status app.errors returns

_RAY = {"counter": ray_metrics.Counter, "gauge": ray_metrics.Gauge, "histogram": ray_metrics.Histogram}
_PROMETHEUS = {"counter": prometheus_client.Counter, "gauge": prometheus_client.Gauge,
               "histogram": prometheus_client.Histogram}

# A registry's content as plain data, to cross Ray: (name, type, help, [(sample, labels, value)]).
Families = list[tuple[str, str, str, list[tuple[str, dict[str, str], float]]]]


class _Series:
    """One metric in both systems; ``record`` takes Ray's method name and its arguments."""

    def __init__(self, registry: CollectorRegistry, kind: str, name: str, description: str,
                 tag_keys: tuple[str, ...]) -> None:
        buckets = {"boundaries": _LATENCY_BUCKETS} if kind == "histogram" else {}
        self.ray = _RAY[kind](name, description, tag_keys=tag_keys, **buckets)
        prom_buckets = {"buckets": _LATENCY_BUCKETS} if kind == "histogram" else {}
        self.prometheus = _PROMETHEUS[kind](name, description, labelnames=tag_keys, registry=registry,
                                            **prom_buckets)

    def touch(self, tags: dict[str, str]) -> None:
        """Create the series at 0 (prometheus_client only: Ray's counters cannot add 0)."""
        self.prometheus.labels(**tags)

    def inc(self, value: float, tags: dict[str, str]) -> None:
        self.ray.inc(value, tags=tags)
        self.prometheus.labels(**tags).inc(value)

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.ray.set(value, tags=tags)
        self.prometheus.labels(**tags).set(value)

    def observe(self, value: float, tags: dict[str, str]) -> None:
        self.ray.observe(value, tags=tags)
        self.prometheus.labels(**tags).observe(value)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def _series(self, kind: str, name: str, description: str, tag_keys: tuple[str, ...]) -> _Series:
        return _Series(self.registry, kind, name, description, tag_keys)

    def families(self) -> Families:
        """This replica's series as plain data (for ``render``)."""
        return [(m.name, m.type, m.documentation, [(s.name, s.labels, s.value) for s in m.samples])
                for m in self.registry.collect()]


# (attribute of EngineMetrics, kind, name, description), each tagged with model and replica.
_ENGINE_SERIES = [
    ("num_running", "gauge", "mini_infer_num_requests_running", "Sequences in the running batch."),
    ("num_waiting", "gauge", "mini_infer_num_requests_waiting", "Sequences waiting for admission."),
    ("kv_cache_usage", "gauge", "mini_infer_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1)."),
    ("preemptions", "counter", "mini_infer_num_preemptions_total", "Sequences preempted (to be recomputed)."),
    ("prefix_cache_queries", "counter", "mini_infer_prefix_cache_queries_total",
     "Prefix cache: tokens of requests looked up at admission."),
    ("prefix_cache_hits", "counter", "mini_infer_prefix_cache_hits_total",
     "Prefix cache: tokens found in the cache (hit rate = hits / queries)."),
    ("prompt_tokens", "counter", "mini_infer_prompt_tokens_total", "Prompt tokens of accepted requests."),
    ("generation_tokens", "counter", "mini_infer_generation_tokens_total",
     "Tokens sampled by the engine's steps (vLLM's count), a departed client's last ones included."),
    ("ttft", "histogram", "mini_infer_time_to_first_token_seconds", "Time to first token (TTFT)."),
    ("tpot", "histogram", "mini_infer_time_per_output_token_seconds",
     "Mean time per output token after the first (TPOT)."),
    ("itl", "histogram", "mini_infer_inter_token_latency_seconds",
     "Time between consecutive outputs of a request (ITL)."),
    ("e2e", "histogram", "mini_infer_e2e_request_latency_seconds", "Request latency, arrival to last token."),
]


class EngineMetrics(_Metrics):
    """One engine replica's metrics (``_ENGINE_SERIES`` and finished requests by reason),
    tagged with the model and replica.

    Args:
        model_name: the served model name.
        replica_id: this replica's id.
    """

    def __init__(self, model_name: str, replica_id: str) -> None:
        super().__init__()
        keys = ("model_name", "replica")
        self.tags = {"model_name": model_name, "replica": replica_id}
        for attribute, kind, name, description in _ENGINE_SERIES:
            series = self._series(kind, name, description, keys)
            series.touch(self.tags)
            setattr(self, attribute, series)
        self.finished = self._series("counter", "mini_infer_request_success_total",
                                     "Finished requests by finish reason.", keys + ("finished_reason",))
        for reason in FINISH_REASONS:
            self.finished.touch({**self.tags, "finished_reason": reason})
        # stats() key -> the counter that grows with it
        self._totals = {"num_preemptions": self.preemptions, "prefix_cache_queries": self.prefix_cache_queries,
                        "prefix_cache_hits": self.prefix_cache_hits, "num_generation_tokens": self.generation_tokens}
        self._last = dict.fromkeys(self._totals, 0)

    def record_stats(self, stats: dict) -> None:
        """Gauges from ``LLMEngine.stats()``; the counters of its running totals
        (preemptions, prefix cache queries and hits, sampled tokens) grow by the difference.
        The sampled tokens were counted per request as its outputs came, which missed each
        aborted choice's last token: a trial found /metrics 33 tokens below /stats after 33
        aborts."""
        self.num_running.set(stats["num_running"], self.tags)
        self.num_waiting.set(stats["num_waiting"], self.tags)
        self.kv_cache_usage.set(stats["kv_cache_usage"], self.tags)
        for key, counter in self._totals.items():
            new = stats[key] - self._last[key]
            if new > 0:
                counter.inc(new, self.tags)
            self._last[key] = stats[key]

    def record_request(self, num_prompt_tokens: int, num_output_tokens: int, ttft: float,
                       e2e: float, finish_reasons: list[str]) -> None:
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens, self.tags)
        if num_output_tokens:
            self.ttft.observe(ttft, self.tags)
            self.e2e.observe(e2e, self.tags)
        if num_output_tokens > 1:
            self.tpot.observe((e2e - ttft) / (num_output_tokens - 1), self.tags)
        for reason in finish_reasons:
            self.finished.inc(1, {**self.tags, "finished_reason": reason or "unknown"})

    def record_itl(self, seconds: float) -> None:
        self.itl.observe(seconds, self.tags)


class HttpMetrics(_Metrics):
    """The ingress's error responses by status code."""

    def __init__(self) -> None:
        super().__init__()
        self.errors = self._series("counter", "mini_infer_http_errors_total",
                                   "Error responses by HTTP status.", ("status_code",))
        for status in ERROR_STATUSES:
            self.errors.touch({"status_code": str(status)})

    def record_error(self, status_code: int) -> None:
        self.errors.inc(1, {"status_code": str(status_code)})


class _Gathered:
    """A prometheus_client collector over families gathered from several replicas."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def render(replica_families: Iterable[Families]) -> bytes:
    """Prometheus text of every replica's series: one family per name, samples of equal
    name and labels (the same counter in two ingress replicas) summed.

    Returns:
        The text exposition format (``prometheus_client.CONTENT_TYPE_LATEST``).
    """
    merged: dict[str, tuple[str, str, dict]] = {}
    for families in replica_families:
        for name, kind, documentation, samples in families:
            _, _, values = merged.setdefault(name, (kind, documentation, {}))
            for sample, labels, value in samples:
                key = (sample, tuple(sorted(labels.items())))
                values[key] = value + (values.get(key, 0.0) if kind != "gauge" else 0.0)
    metrics = []
    for name, (kind, documentation, values) in merged.items():
        metric = Metric(name, documentation, kind)
        for (sample, labels), value in values.items():
            metric.add_sample(sample, dict(labels), value)
        metrics.append(metric)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Gathered(metrics))
    return generate_latest(registry)
