"""ray_configs/grafana_mini_infer_dashboard.json: valid JSON, and every panel's query names
series the running service exports (``ray_<name>`` in Ray's exporter, ``<name>`` in the
service's ``GET /metrics``), grouped by labels those series carry."""
from __future__ import annotations

import json
import re

from prometheus_client.parser import text_string_to_metric_families

from tests.serve_process import ROOT

DASHBOARD = ROOT / "ray_configs" / "grafana_mini_infer_dashboard.json"
SERIES = re.compile(r"\bray_(mini_infer_[a-z0-9_]+)")
BY = re.compile(r"\bby \(([^)]*)\)")
# the panels: throughput, TTFT/TPOT/ITL percentiles, running/waiting, KV usage,
# preemptions, prefix-cache hit rate, HTTP errors by status
REQUIRED = {"mini_infer_generation_tokens_total", "mini_infer_time_to_first_token_seconds_bucket",
            "mini_infer_time_per_output_token_seconds_bucket", "mini_infer_inter_token_latency_seconds_bucket",
            "mini_infer_num_requests_running", "mini_infer_num_requests_waiting", "mini_infer_kv_cache_usage_perc",
            "mini_infer_num_preemptions_total", "mini_infer_prefix_cache_hits_total",
            "mini_infer_prefix_cache_queries_total", "mini_infer_http_errors_total"}


def test_every_panel_queries_series_the_service_exports(api):
    dashboard = json.loads(DASHBOARD.read_text())
    labels: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(api.metrics_at_start):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels) and dashboard["uid"]
    used = set()
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = SERIES.findall(target["expr"])
            assert names, (panel["title"], target["expr"])
            for name in names:
                assert name in labels, f"{panel['title']}: {name} is not in /metrics"
            known = set().union(*(labels[n] for n in names)) | {"le"}
            for group in BY.findall(target["expr"]):
                assert {g.strip() for g in group.split(",")} <= known, (panel["title"], group, known)
            used.update(names)
    assert REQUIRED <= used, REQUIRED - used
