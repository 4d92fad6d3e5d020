"""`specdec doctor`: is speculation paying on a running server, route by route, and if not, why.

It reads what any monitoring would: the server's `/metrics` (Prometheus exposition) and
`/health` (routes, load, memory plan); under Ray Serve, those of every replica the front's
`/replicas` lists, one by one (each replica batches on its own). Per route it estimates what
a drafting step gains and names the causes the seeds give for speculation not paying:

- **batches full**: several sequences share each target pass, so compute is no longer idle and
  a verification over rows x (k + 1) tokens costs more than the rows' plain step;
- **acceptance low**: too few drafted tokens pass for any k to pay;
- **acceptance drifting**: the drift window's acceptance fell below its baseline;
- **draft memory costing sequences**: the drafter's weights and KV take cache room from
  sequences while requests wait;
- **k too long**: the acceptance at later positions does not pay for the longer pass; a
  shorter k (the one the estimate recommends) would.

The estimate: a step that drafts at least one token commits E = 1 + sum_i u_i tokens, where u_i
is the fraction of drafting steps whose position i was accepted (from the per-position
counters), and costs the verification pass over 1 + k tokens (the cost curve of `specdec
costs`, relative to a plain step; a default curve measured on a 2-core CPU with int4 weights
otherwise). Drafting itself is taken as free (right for ngram, suffix and lookahead; a model
drafter costs more, so a verdict of "not paying" stands and one of "paying" is an upper bound).
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from specdec.errors import ConfigError
from specdec.server.metrics import Samples, sample_value, samples_by_name

# `specdec costs` on the default model, native q4 (LM head q8) on specdec's kernels, 2 cores,
# 256 cached tokens: a pass over n tokens relative to a plain step.
DEFAULT_VERIFY_COSTS = {1: 1.0, 2: 1.14, 3: 1.25, 4: 1.41, 5: 1.56, 6: 1.72, 7: 2.06, 8: 2.20, 9: 2.40}
PAYS = 1.05  # an estimated speedup below this is "not paying"
BETTER = 1.03  # a shorter k must beat the current one by this to be recommended


def verify_cost(costs: dict[int, float], tokens: int) -> float:
    """The pass over `tokens` tokens relative to a plain step; beyond the curve, extended linearly
    from its last point (passes grow at least that fast)."""
    if tokens in costs:
        return costs[tokens]
    top = max(costs)
    slope = (costs[top] - costs[1]) / max(top - 1, 1)
    return costs[top] + slope * (tokens - top)


def load_costs(path: str | Path, curve: str | None = None) -> dict[int, float]:
    """The cost curve of a `specdec costs --json` file (its only curve, or the one named)."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read costs {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc.msg}") from None
    curves = data.get("curves") if isinstance(data, dict) else None
    if not curves:
        raise ConfigError(f"{path} is not the JSON of `specdec costs` (no 'curves')")
    if curve is None and len(curves) > 1:
        raise ConfigError(f"{path} has several curves; name one with --curve: {', '.join(curves)}")
    name = curve or next(iter(curves))
    if name not in curves:
        raise ConfigError(f"{path} has no curve {name!r}; it has: {', '.join(curves)}")
    return {int(n): float(c) for n, c in curves[name]["cost_over_plain_step"].items()}


@dataclass
class Finding:
    cause: str  # batches_full, acceptance_low, acceptance_drifting, draft_memory, k_too_long, load_schedule_off
    text: str


@dataclass
class RouteReport:
    route: str
    method: str | None
    k: int | None  # the route's configured k
    current_k: int | None  # what its load schedule gives now
    running: int
    drafting_steps: int
    acceptance_rate: float | None
    per_position: list[float]  # u_i: fraction of drafting steps whose position i was accepted
    estimated_speedup: float | None  # of a drafting step at the current k, one row
    recommended_k: int | None
    paying: bool | None  # None: nothing to judge (plain route, or no drafting yet)
    findings: list[Finding] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _by_position(samples: Samples, name: str, route: str) -> dict[int, float]:
    return {int(labels["position"]): value for labels, value in samples.get(name, []) if labels.get("route") == route}


def best_k(per_position: list[float], costs: dict[int, float]) -> tuple[int, list[float]]:
    """The k (1 .. len(per_position)) with the best estimated speedup, and each k's estimate."""
    speedups = [(1 + sum(per_position[:k])) / verify_cost(costs, 1 + k) for k in range(1, len(per_position) + 1)]
    return 1 + max(range(len(speedups)), key=lambda i: speedups[i]), speedups


def diagnose(metrics_text: str, health: dict[str, Any], costs: dict[int, float] | None = None) -> list[RouteReport]:
    """Each route's report from one scrape of `/metrics` and `/health`."""
    costs = costs or DEFAULT_VERIFY_COSTS
    samples = samples_by_name(text_string_to_metric_families(metrics_text))
    running = int(health.get("running", 0))
    waiting = int(health.get("waiting", 0))
    memory = health.get("memory") or {}
    reports = []
    for route in health.get("routes", []):
        name = route["name"]
        spec = route.get("speculative")
        report = RouteReport(name, spec and spec["method"], spec and spec["num_speculative_tokens"], None,
                             int(sample_value(samples, "specdec_route_running_sequences", route=name)), 0, None, [], None, None, None)
        reports.append(report)
        if spec is None:
            continue
        report.current_k = int(sample_value(samples, "specdec_speculative_tokens", default=spec["num_speculative_tokens"], route=name))
        drafted_at = _by_position(samples, "specdec_drafted_at_position_total", name)
        accepted_at = _by_position(samples, "specdec_accepted_at_position_total", name)
        report.drafting_steps = int(drafted_at.get(0, 0))  # positions are 0-based
        drafted = sample_value(samples, "specdec_drafted_tokens_total", route=name)
        if drafted:
            report.acceptance_rate = sample_value(samples, "specdec_accepted_tokens_total", route=name) / drafted
        rows = max(running, report.running)
        k_now = report.current_k
        if k_now == 0 and rows >= 2:
            report.findings.append(Finding("load_schedule_off", f"the load schedule gives k = 0 at {rows} running "
                                                                 "sequences: speculation is off, as it should be in full batches"))
        if report.drafting_steps == 0:
            continue
        steps = report.drafting_steps
        report.per_position = [accepted_at.get(i, 0.0) / steps for i in range(max(drafted_at) + 1)]
        k_est = k_now if k_now > 0 else report.k  # a drafting step at the k in force, else the route's
        along = report.per_position[:k_est]
        report.estimated_speedup = (1 + sum(along)) / verify_cost(costs, 1 + len(along))
        report.recommended_k, speedups = best_k(report.per_position[: report.k], costs)
        report.paying = report.estimated_speedup >= PAYS
        positions = ", ".join(f"{i + 1}: {u:.2f}" for i, u in enumerate(report.per_position))

        # 1. Batches full: R rows verify R x (1 + k) tokens in one pass, against R tokens plain.
        if rows >= 2 and k_now > 0:
            batched = (1 + sum(along)) * verify_cost(costs, rows) / verify_cost(costs, rows * (1 + len(along)))
            if batched < PAYS:
                report.findings.append(Finding("batches_full", (
                    f"batches full: {rows} sequences share each target pass, so compute is no longer idle; a pass over "
                    f"{rows} x {1 + len(along)} tokens costs {verify_cost(costs, rows * (1 + len(along))) / verify_cost(costs, rows):.1f} "
                    f"times the rows' plain step for {1 + sum(along):.2f} tokens a row (estimated {batched:.2f}x): "
                    f"switch speculation off from {rows} sequences (a load schedule with k = 0 there)")))
        # 2. Acceptance low: no k pays, even one row alone.
        if max(speedups) < PAYS:
            report.findings.append(Finding("acceptance_low", (
                f"acceptance low: {report.acceptance_rate:.2f} of drafted tokens pass (per position {positions}); "
                f"no k pays (best k = {report.recommended_k}: {max(speedups):.2f}x); use another drafter or plain decoding")))
        # 3. Drifting: the drift window's acceptance fell below its baseline.
        if sample_value(samples, "specdec_acceptance_drift", route=name) >= 1:
            window = sample_value(samples, "specdec_window_acceptance_rate", route=name)
            baseline = sample_value(samples, "specdec_baseline_acceptance_rate", route=name)
            low = sorted(range(len(report.per_position)), key=lambda i: report.per_position[i])[:2]
            report.findings.append(Finding("acceptance_drifting", (
                f"acceptance drifting: {window:.2f} over the recent window against {baseline:.2f} before it; the "
                f"traffic changed (lowest positions since start: {', '.join(str(i + 1) for i in sorted(low))}; per position {positions})")))
        # 4. Draft memory costing sequences while requests wait.
        lost = int(memory.get("sequences_lost_to_draft", 0) or 0)
        if lost > 0 and waiting > 0:
            report.findings.append(Finding("draft_memory", (
                f"draft memory costs sequences: the draft's weights and KV take the room of {lost} sequences "
                f"({memory.get('max_sequences')} fit instead of {memory.get('max_sequences_without_draft')}) while "
                f"{waiting} requests wait")))
        # 5. k too long for the acceptance.
        current = speedups[min(k_est, len(speedups)) - 1]
        if report.recommended_k < k_est and speedups[report.recommended_k - 1] > current * BETTER:
            report.findings.append(Finding("k_too_long", (
                f"k too long: at k = {k_est} a step is estimated at {current:.2f}x, at k = {report.recommended_k} "
                f"{speedups[report.recommended_k - 1]:.2f}x (acceptance per position {positions}; "
                f"`specdec estimate --per-position {','.join(f'{u:.2f}' for u in report.per_position[:report.recommended_k])} "
                f"--verify-cost {verify_cost(costs, 1 + report.recommended_k):.2f}`)")))
    return reports


def _request(url: str, api_key: str | None) -> urllib.request.Request:
    return urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})


def fetch(url: str, timeout: float = 10.0, api_key: str | None = None) -> tuple[str, dict[str, Any]]:
    """`/metrics` text and `/health` JSON of the server at `url` (sending `api_key` where given)."""
    base = url.rstrip("/")

    def get(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(_request(f"{base}{path}", api_key), timeout=timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:  # /health answers 503 while not ready: still JSON
            return exc.code, exc.read()
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise ConfigError(f"cannot reach the server at {url}: {getattr(exc, 'reason', exc)}") from None

    status, metrics = get("/metrics")
    if status == 401:
        raise ConfigError(f"{base} asks for an API key: pass --api-key (or set SPECDEC_API_KEY)")
    if status != 200:
        raise ConfigError(f"{base}/metrics answered {status}")
    status, health = get("/health")
    try:
        return metrics.decode("utf-8"), json.loads(health)
    except ValueError:
        raise ConfigError(f"{base}/health did not answer JSON (status {status})") from None


def replicas(url: str, timeout: float = 10.0, api_key: str | None = None) -> dict[str, str] | None:
    """Under Ray Serve (`specdec serve --replicas`), each replica's id and operations URL, from
    the front's `/replicas`; None for a single-process server (it has no such path)."""
    try:
        with urllib.request.urlopen(_request(f"{url.rstrip('/')}/replicas", api_key), timeout=timeout) as response:
            listed = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError):
        return None
    if not isinstance(listed, list):
        return None
    return {t["labels"]["replica"]: f"http://{t['targets'][0]}" for t in listed}


def summary(report: RouteReport) -> str:
    """One line: the verdict."""
    if report.method is None:
        return "plain decoding"
    if report.paying is None:
        return "no drafting yet" if not report.findings else "not drafting"
    verdict = "paying" if report.paying and not any(f.cause in ("batches_full",) for f in report.findings) else "not paying"
    return f"{verdict}: ~{report.estimated_speedup:.2f}x a drafting step alone (k = {report.current_k})"
