"""Prometheus metrics of the server, and acceptance drift per route.

Every metric carries a `route` label (the served model name) unless it describes the whole
machine. Definitions (the same names and meanings as :mod:`specdec.engine.stats`):

- `specdec_drafted_tokens_total`: tokens drafted and verified by the target.
- `specdec_accepted_tokens_total`: drafted tokens that passed verification.
- `specdec_committed_tokens_total`: tokens committed by target steps (accepted + the one the
  target adds each step), before truncation at stop conditions.
- `specdec_target_steps_total`: target verification steps (prefill excluded).
- `specdec_generated_tokens_total`: output tokens returned to clients.
- `specdec_acceptance_rate`: accepted / drafted since start (0 before any draft).
- `specdec_mean_accepted_length`: committed tokens / target steps since start, counting the
  token the target adds each step (plain decoding is 1.0).
- `specdec_drafted_at_position_total`, `specdec_accepted_at_position_total`,
  `specdec_position_acceptance`: per draft position i (0-based), steps that drafted a token
  there, steps in which it was accepted, and their ratio.
- `specdec_tokens_per_second`: output tokens per second over the last 10 s.
- `specdec_time_to_first_token_seconds`: from the request's arrival to its first token.
- `specdec_inter_token_latency_seconds`: for each emission after the first, the time since the
  previous emission divided by the tokens it carries, observed once per token.
- `specdec_prompt_tokens_total`, `specdec_prefix_cache_hit_tokens_total`,
  `specdec_prefix_cache_hit_rate`: prompt tokens of admitted sequences, those of them whose keys
  and values the prefix cache held (not computed again), and their ratio since start; machine-wide
  `specdec_prefix_cache_bytes` and `specdec_prefix_cache_blocks` (what it holds now).
- `specdec_speculative_tokens`: the k the route's load schedule gives at the current load.
- `specdec_window_acceptance_rate`, `specdec_baseline_acceptance_rate`,
  `specdec_acceptance_drift`: drift (see :class:`AcceptanceDrift`); the last is 1 while drifting.
- `specdec_requests_total{route, finish_reason}`: finished sequences (one per choice of each
  prompt) by reason: stop, length, abort (client gone, or cut by shutdown), error (failed
  while generating). A request refused before any of its sequences was queued counts once,
  as `rejected` (a 4xx: bad input, body too large, queue full) or `error` (a 5xx); its route
  is the one it named, or "" when it named none that is served (or could not be read).
- machine-wide: `specdec_queue_length` (requests waiting for a row), `specdec_running_sequences`
  (rows in the batch; also per route as `specdec_route_running_sequences`), and the memory plan
  gauges `specdec_memory_bytes{part}` and `specdec_max_concurrent_sequences{with_draft}`; a
  `suffix` route's cache of earlier outputs as `specdec_suffix_cache_bytes` and
  `specdec_suffix_cache_requests`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from specdec.server.config import DriftConfig

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# {sample name: [(labels, value)]}: what the dashboard and `specdec doctor` read.
Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples_by_name(families: Iterable[Metric]) -> Samples:
    """Every sample of these metric families (a registry's `collect()`, or a parsed exposition)."""
    found: Samples = {}
    for family in families:
        for sample in family.samples:
            found.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return found


def sample_value(samples: Samples, name: str, default: float = 0.0, **labels: str) -> float:
    """The value of the first sample named `name` whose labels include these."""
    for have, value in samples.get(name, []):
        if all(have.get(k) == v for k, v in labels.items()):
            return value
    return default


class AcceptanceDrift:
    """Acceptance of a route's most recent drafted tokens against its own recent past.

    The last `window` drafted tokens (whole steps) form the window; the `baseline` drafted
    tokens before them, the baseline. Drifting: both are full and window acceptance is below
    baseline acceptance by more than `threshold`. The baseline moves with time, so a lasting
    change stops being drift once it has filled the baseline too.
    """

    def __init__(self, config: DriftConfig) -> None:
        self.config = config
        self._window: deque[tuple[int, int]] = deque()  # (drafted, accepted) per step
        self._baseline: deque[tuple[int, int]] = deque()
        self._sums = {"window": [0, 0], "baseline": [0, 0]}
        self.drifting = False

    def _push(self, name: str, queue: deque[tuple[int, int]], item: tuple[int, int]) -> None:
        queue.append(item)
        self._sums[name][0] += item[0]
        self._sums[name][1] += item[1]

    def _pop(self, name: str, queue: deque[tuple[int, int]]) -> tuple[int, int]:
        item = queue.popleft()
        self._sums[name][0] -= item[0]
        self._sums[name][1] -= item[1]
        return item

    def record(self, drafted: int, accepted: int) -> bool | None:
        """Add one step. Returns True when drift starts, False when it ends, None otherwise."""
        if drafted <= 0:
            return None
        self._push("window", self._window, (drafted, accepted))
        while self._sums["window"][0] - self._window[0][0] >= self.config.window:
            self._push("baseline", self._baseline, self._pop("window", self._window))
        while self._baseline and self._sums["baseline"][0] - self._baseline[0][0] >= self.config.baseline:
            self._pop("baseline", self._baseline)
        was = self.drifting
        full = self._sums["window"][0] >= self.config.window and self._sums["baseline"][0] >= self.config.baseline
        self.drifting = full and self.baseline_rate - self.window_rate > self.config.threshold
        return self.drifting if self.drifting != was else None

    @property
    def window_rate(self) -> float:
        drafted, accepted = self._sums["window"]
        return accepted / drafted if drafted else 0.0

    @property
    def baseline_rate(self) -> float:
        drafted, accepted = self._sums["baseline"]
        return accepted / drafted if drafted else 0.0


class ServerMetrics:
    """All server metrics, in a registry of their own (no process-wide globals)."""

    def __init__(self, drift: DriftConfig) -> None:
        self.registry = CollectorRegistry()
        r, route = self.registry, ["route"]
        self.drafted = Counter("specdec_drafted_tokens", "Tokens drafted and verified by the target", route, registry=r)
        self.accepted = Counter("specdec_accepted_tokens", "Drafted tokens that passed verification", route, registry=r)
        self.committed = Counter("specdec_committed_tokens", "Tokens committed by target steps (accepted + 1 per step)", route, registry=r)
        self.steps = Counter("specdec_target_steps", "Target verification steps (prefill excluded)", route, registry=r)
        self.generated = Counter("specdec_generated_tokens", "Output tokens returned to clients", route, registry=r)
        self.drafted_at = Counter("specdec_drafted_at_position", "Steps that drafted a token at this position", ["route", "position"], registry=r)
        self.accepted_at = Counter("specdec_accepted_at_position", "Steps whose token at this position was accepted", ["route", "position"], registry=r)
        self.requests = Counter("specdec_requests", "Finished sequences by finish reason; refused requests as rejected (4xx) or error (5xx)",
                                ["route", "finish_reason"], registry=r)
        self.acceptance_rate = Gauge("specdec_acceptance_rate", "Accepted / drafted tokens since start", route, registry=r)
        self.mean_accepted_length = Gauge("specdec_mean_accepted_length", "Committed tokens per target step since start, the target's own token counted", route, registry=r)
        self.position_acceptance = Gauge("specdec_position_acceptance", "Accepted / drafted at each draft position since start", ["route", "position"], registry=r)
        self.tokens_per_second = Gauge("specdec_tokens_per_second", "Output tokens per second over the last 10 s", route, registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "Request arrival to first token", route, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specdec_inter_token_latency_seconds", "Time between emissions per token carried", route, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("specdec_prompt_tokens", "Prompt tokens of admitted sequences", route, registry=r)
        self.prefix_hits = Counter("specdec_prefix_cache_hit_tokens", "Prompt tokens whose keys and values the prefix cache held",
                                   route, registry=r)
        self.prefix_hit_rate = Gauge("specdec_prefix_cache_hit_rate", "Prefix cache hit tokens / prompt tokens since start", route, registry=r)
        self.prefix_bytes = Gauge("specdec_prefix_cache_bytes", "Bytes of keys and values the prefix cache holds", registry=r)
        self.prefix_blocks = Gauge("specdec_prefix_cache_blocks", "Blocks of tokens the prefix cache holds", registry=r)
        self.current_k = Gauge("specdec_speculative_tokens", "k the route's load schedule gives at the current load", route, registry=r)
        self.window_rate = Gauge("specdec_window_acceptance_rate", "Acceptance over the drift window", route, registry=r)
        self.baseline_rate = Gauge("specdec_baseline_acceptance_rate", "Acceptance over the drift baseline", route, registry=r)
        self.drift = Gauge("specdec_acceptance_drift", "1 while window acceptance is below baseline by more than the threshold", route, registry=r)
        self.route_running = Gauge("specdec_route_running_sequences", "Sequences of this route in the batch", route, registry=r)
        self.queue_length = Gauge("specdec_queue_length", "Requests waiting for a row in the batch", registry=r)
        self.running = Gauge("specdec_running_sequences", "Sequences in the batch", registry=r)
        self.memory = Gauge("specdec_memory_bytes", "Memory plan: weights, KV per token, budget", ["part"], registry=r)
        self.suffix_cache = Gauge("specdec_suffix_cache_bytes", "Estimated memory of a suffix route's cache of earlier outputs", route, registry=r)
        self.suffix_cache_requests = Gauge("specdec_suffix_cache_requests", "Requests whose outputs a suffix route's cache holds", route, registry=r)
        self.max_sequences = Gauge("specdec_max_concurrent_sequences", "Sequences that fit the cache budget at max_model_len", ["with_draft"], registry=r)
        self._drift_config = drift
        self._drift: dict[str, AcceptanceDrift] = {}
        self._totals: dict[str, list[int]] = {}  # route -> [drafted, accepted, committed, steps]
        self._prompts: dict[str, list[int]] = {}  # route -> [prompt tokens, prefix cache hits]
        self._position: dict[str, list[list[int]]] = {}  # route -> [[drafted, accepted] per position]
        self._recent: dict[str, deque[tuple[float, int]]] = {}  # route -> (time, tokens)
        self._recent_total: dict[str, int] = {}  # route -> the tokens in its _recent
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}  # (metric, labels) -> its series

    def add_route(self, route: str) -> None:
        """Create a route's series at zero, so they exist before the first request."""
        self._drift[route] = AcceptanceDrift(self._drift_config)
        self._totals[route] = [0, 0, 0, 0]
        self._prompts[route] = [0, 0]
        self._position[route] = []
        self._recent[route] = deque()
        self._recent_total[route] = 0
        for metric in (self.drafted, self.accepted, self.committed, self.steps, self.generated, self.prompt_tokens,
                       self.prefix_hits):
            metric.labels(route)
        for gauge in (self.prefix_hit_rate, self.acceptance_rate, self.mean_accepted_length, self.tokens_per_second, self.current_k,
                      self.window_rate, self.baseline_rate, self.drift, self.route_running):
            gauge.labels(route).set(0)
        self.ttft.labels(route)
        self.itl.labels(route)

    def _at(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), kept: prometheus-client's lookup takes a lock and builds a tuple
        each call, and a step's bookkeeping makes a dozen a row."""
        key = (id(metric), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def record_prompt(self, route: str, tokens: int, cached: int) -> None:
        """A sequence admitted: its prompt's `tokens`, `cached` of them from the prefix cache."""
        totals = self._prompts[route]
        totals[0] += tokens
        totals[1] += cached
        self._at(self.prompt_tokens, route).inc(tokens)
        self._at(self.prefix_hits, route).inc(cached)
        self._at(self.prefix_hit_rate, route).set(totals[1] / totals[0] if totals[0] else 0.0)

    def record_step(self, route: str, drafted: int, accepted: int) -> None:
        """One sequence's target step: `drafted` tokens verified, `accepted` of them kept."""
        totals = self._totals[route]
        totals[0] += drafted
        totals[1] += accepted
        totals[2] += accepted + 1
        totals[3] += 1
        self._at(self.drafted, route).inc(drafted)
        self._at(self.accepted, route).inc(accepted)
        self._at(self.committed, route).inc(accepted + 1)
        self._at(self.steps, route).inc()
        self._at(self.acceptance_rate, route).set(totals[1] / totals[0] if totals[0] else 0.0)
        self._at(self.mean_accepted_length, route).set(totals[2] / totals[3])
        positions = self._position[route]
        while len(positions) < drafted:
            positions.append([0, 0])
        for i in range(drafted):
            positions[i][0] += 1
            positions[i][1] += i < accepted
            self._at(self.drafted_at, route, str(i)).inc()
            if i < accepted:
                self._at(self.accepted_at, route, str(i)).inc()
            self._at(self.position_acceptance, route, str(i)).set(positions[i][1] / positions[i][0])
        drift = self._drift[route]
        change = drift.record(drafted, accepted)
        self._at(self.window_rate, route).set(drift.window_rate)
        self._at(self.baseline_rate, route).set(drift.baseline_rate)
        self._at(self.drift, route).set(1 if drift.drifting else 0)
        if change is True:
            log.warning("route %s: acceptance drift: %.3f over the last %d drafted tokens vs baseline %.3f (threshold %.2f)",
                        route, drift.window_rate, self._drift_config.window, drift.baseline_rate, self._drift_config.threshold)
        elif change is False:
            log.info("route %s: acceptance back to %.3f (baseline %.3f)", route, drift.window_rate, drift.baseline_rate)

    def record_tokens(self, route: str, tokens: int, now: float | None = None) -> None:
        """Output tokens returned to a client; updates the 10 s tokens/s gauge."""
        now = time.monotonic() if now is None else now
        self._at(self.generated, route).inc(tokens)
        self._recent[route].append((now, tokens))
        self._recent_total[route] += tokens
        self._refresh(route, now)

    def refresh_rates(self, now: float | None = None) -> None:
        """Every route's tokens/s gauge over the last 10 s (a route that went quiet decays)."""
        now = time.monotonic() if now is None else now
        for route in self._recent:
            self._refresh(route, now)

    def _refresh(self, route: str, now: float) -> None:
        # A running total: a step of many rows records once a row, and summing 10 s of entries
        # each time grew with the traffic.
        recent = self._recent[route]
        while recent and recent[0][0] < now - 10.0:
            self._recent_total[route] -= recent.popleft()[1]
        self._at(self.tokens_per_second, route).set(self._recent_total[route] / 10.0)
