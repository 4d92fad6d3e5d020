"""The live dashboard's data: one JSON snapshot of the server's metrics per route.

`/dashboard` is a static page (`static/dashboard.html`, charts by the vendored uPlot) that polls
`/dashboard/data` every 2 seconds and appends each snapshot to its charts. The snapshot is read
from the same Prometheus registry `/metrics` exposes, so the page and any scraper agree.
"""

from __future__ import annotations

import math
import time
from importlib import resources
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry

from specdec.server.metrics import sample_value, samples_by_name

STATIC = Path(str(resources.files("specdec.server") / "static"))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The q-quantile of a cumulative histogram [(upper bound, count)], interpolated linearly in
    its bucket as Prometheus' histogram_quantile does; None without observations. An answer in
    the +Inf bucket is the largest finite bound."""
    buckets = sorted(buckets)
    total = buckets[-1][1] if buckets else 0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return lower_bound


def snapshot(registry: CollectorRegistry, routes: list[str], running: int, waiting: int, memory: dict[str, Any]) -> dict[str, Any]:
    """{time, running, waiting, memory, routes: {name: {...}}} from the metrics registry."""
    samples = samples_by_name(registry.collect())

    def value(name: str, route: str) -> float:
        return sample_value(samples, name, route=route)

    def quantiles(name: str, route: str) -> dict[str, float | None]:
        buckets = [(float(labels["le"]), v) for labels, v in samples.get(f"{name}_bucket", []) if labels.get("route") == route]
        return {"p50": histogram_quantile(0.5, buckets), "p95": histogram_quantile(0.95, buckets)}

    data: dict[str, Any] = {}
    for route in routes:
        positions = sorted((int(labels["position"]), v) for labels, v in samples.get("specdec_position_acceptance", [])
                           if labels.get("route") == route)
        data[route] = {
            "tokens_per_second": value("specdec_tokens_per_second", route),
            "acceptance_rate": value("specdec_acceptance_rate", route),
            "mean_accepted_length": value("specdec_mean_accepted_length", route),
            "position_acceptance": [v for _, v in positions],
            "k": value("specdec_speculative_tokens", route),
            "running": value("specdec_route_running_sequences", route),
            "drift": {"window": value("specdec_window_acceptance_rate", route),
                      "baseline": value("specdec_baseline_acceptance_rate", route),
                      "drifting": value("specdec_acceptance_drift", route) >= 1},
            "ttft_seconds": quantiles("specdec_time_to_first_token_seconds", route),
            "itl_seconds": quantiles("specdec_inter_token_latency_seconds", route),
            "generated_tokens": value("specdec_generated_tokens_total", route),
            "prefix_cache_hit_rate": value("specdec_prefix_cache_hit_rate", route),
        }
    return {"time": time.time(), "running": running, "waiting": waiting, "memory": memory, "routes": data}
