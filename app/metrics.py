"""Prometheus metrics through ``ray.util.metrics``: shown in the Ray dashboard and exported at
each Ray node's metrics endpoint. Names follow vLLM's (``mini_infer:`` instead of ``vllm:``)."""
from __future__ import annotations

from ray.util.metrics import Counter, Gauge, Histogram

# Seconds; Prometheus buckets chosen to cover CPU (slow) and GPU (fast) serving alike.
_LATENCY_BUCKETS = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0]


class EngineMetrics:
    """One engine replica's metrics, tagged with the model and replica.

    Args:
        model_name: the served model name.
        replica_id: this replica's id.
    """

    def __init__(self, model_name: str, replica_id: str) -> None:
        keys = ("model_name", "replica")
        self.tags = {"model_name": model_name, "replica": replica_id}
        self.num_running = Gauge("mini_infer_num_requests_running",
                                 "Sequences in the running batch.", tag_keys=keys)
        self.num_waiting = Gauge("mini_infer_num_requests_waiting",
                                 "Sequences waiting for admission.", tag_keys=keys)
        self.kv_cache_usage = Gauge("mini_infer_kv_cache_usage_perc",
                                    "Fraction of KV cache blocks in use (0 to 1).", tag_keys=keys)
        self.preemptions = Counter("mini_infer_num_preemptions_total",
                                   "Sequences preempted (to be recomputed).", tag_keys=keys)
        self.prompt_tokens = Counter("mini_infer_prompt_tokens_total",
                                     "Prompt tokens of accepted requests.", tag_keys=keys)
        self.generation_tokens = Counter("mini_infer_generation_tokens_total",
                                         "Generated tokens.", tag_keys=keys)
        self.finished = Counter("mini_infer_request_success_total",
                                "Finished requests by finish reason.",
                                tag_keys=keys + ("finished_reason",))
        self.ttft = self._histogram("mini_infer_time_to_first_token_seconds",
                                    "Time to first token (TTFT).", keys)
        self.tpot = self._histogram("mini_infer_time_per_output_token_seconds",
                                    "Mean time per output token after the first (TPOT).", keys)
        self.itl = self._histogram("mini_infer_inter_token_latency_seconds",
                                   "Time between consecutive outputs of a request (ITL).", keys)
        self.e2e = self._histogram("mini_infer_e2e_request_latency_seconds",
                                   "Request latency, arrival to last token.", keys)
        self._last_preemptions = 0

    @staticmethod
    def _histogram(name: str, description: str, keys) -> Histogram:
        return Histogram(name, description, boundaries=_LATENCY_BUCKETS, tag_keys=keys)

    def record_stats(self, stats: dict) -> None:
        """Gauges from ``LLMEngine.stats()``; the preemption counter grows by the difference."""
        self.num_running.set(stats["num_running"], tags=self.tags)
        self.num_waiting.set(stats["num_waiting"], tags=self.tags)
        self.kv_cache_usage.set(stats["kv_cache_usage"], tags=self.tags)
        new = stats["num_preemptions"] - self._last_preemptions
        if new > 0:
            self.preemptions.inc(new, tags=self.tags)
        self._last_preemptions = stats["num_preemptions"]

    def record_request(self, num_prompt_tokens: int, num_output_tokens: int, ttft: float,
                       e2e: float, finish_reasons: list[str]) -> None:
        if num_prompt_tokens:
            self.prompt_tokens.inc(num_prompt_tokens, tags=self.tags)
        if num_output_tokens:
            self.generation_tokens.inc(num_output_tokens, tags=self.tags)
            self.ttft.observe(ttft, tags=self.tags)
            self.e2e.observe(e2e, tags=self.tags)
        if num_output_tokens > 1:
            self.tpot.observe((e2e - ttft) / (num_output_tokens - 1), tags=self.tags)
        for reason in finish_reasons:
            self.finished.inc(tags={**self.tags, "finished_reason": reason or "unknown"})


class HttpMetrics:
    """The ingress's error responses by status code."""

    def __init__(self) -> None:
        self.errors = Counter("mini_infer_http_errors_total", "Error responses by HTTP status.",
                              tag_keys=("status_code",))

    def record_error(self, status_code: int) -> None:
        self.errors.inc(tags={"status_code": str(status_code)})
