"""Server configuration: routes (served model names) with their speculative policy, the
load-aware schedule, and limits. Frozen and validated; read from TOML (stdlib `tomllib`).

Example (`specdec serve --config server.toml`)::

    max_model_len = 2048          # longest prompt + output per sequence
    max_num_seqs = 16             # most sequences in the batch (also bounded by the cache budget)
    cache_budget_mb = 2048        # KV cache budget; a draft model's weights are taken from it
    prefix_cache_mb = 256         # kept prompts' KV, taken from the budget first (default: what the
                                  # sequences leave of it; 0 turns prefix caching off)
    threads = 2                   # torch intra-op threads of the model work (default: auto, see ServerConfig)
    max_request_bytes = 4194304   # largest request body; a larger one gets a 413 (default 4 MiB)
    request_body_timeout_s = 30   # a body not all there by then gets a 408 and its connection closes
    request_head_timeout_s = 10   # a request line and headers not all there by then: 408, closed
    max_connections = 256         # open connections at most; past it a request gets a 503
    grammar_timeout_s = 10        # a structured output's compile longer than this gets a 400
    prefill_chunk_s = 0.25        # while streams run, a new prompt is prefilled this long at a time
    max_grammar_mb = 64           # and one that compiles to more memory than this
    graceful_shutdown_s = 30      # on SIGTERM, time for requests in flight to finish; then they abort
    api_keys = ["sk-..."]         # clients send one as "Authorization: Bearer KEY" (default: none asked)
    backend = "auto"              # the target's backend: auto (native where it runs the model), native, hf
    dtype = "auto"                # its weight format: auto (a GGUF's own), float32, bfloat16, int8, int4, r8

    [drift]                       # acceptance drift warning, per route
    window = 256                  # drafted tokens in the rolling window
    baseline = 1024               # drafted tokens before the window that form its baseline
    threshold = 0.15              # warn when window acceptance < baseline acceptance - threshold

    [routes.interactive]          # a route: requests name it as "model"
    speculative = { method = "ngram", num_speculative_tokens = 4 }
    max_num_speculative_tokens = 8                 # cap for a request's own k (0 forbids overrides)
    load_schedule = { 1 = 4, 2 = 4, 4 = 2, 8 = 0 } # running sequences -> k; false = fixed k

    [routes.batch]                # no `speculative`: plain decoding

    [replicas]                    # scale-out on Ray Serve (`specdec serve --replicas N` sets a fixed count)
    min_replicas = 1              # autoscaling bounds; or `num_replicas = N` for a fixed count
    max_replicas = 4
    target_ongoing_requests = 4   # Ray adds replicas while the requests per replica stay above this
    downscale_delay_s = 60        # how long below it before Ray removes one (also upscale_delay_s)
    max_ongoing_requests = 16     # most requests a replica takes at once (default: max_num_seqs)
    cpus_per_replica = 1          # Ray CPUs reserved by a replica; also its torch threads
    gpus_per_replica = 0          # Ray GPUs reserved by a replica (needed with --device cuda)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib

from specdec.config import SpeculativeConfig
from specdec.methods import DEFAULT_METHOD
from specdec.engine.batch import draft_room
from specdec.errors import ConfigError
from specdec.models.backend import BACKENDS, DTYPES

# Load-aware schedule: running sequences -> k (0 = speculation off). Measured on the 2-core CPU
# with benchmarks/serve_load.py (ngram k = 4 against plain, greedy): speculation wins alone
# (22.4 against 21.4 tok/s) and loses from two running sequences on (2: 29.8 against 31.8,
# 4: 41.7 against 51.9, 8: 50.0 against 61.4), so it runs only for a sequence alone. A machine
# with spare compute per step (a GPU) keeps it on longer: measure and set it in the config file.
DEFAULT_LOAD_SCHEDULE: dict[int, int] = {1: 4, 2: 0}
DEFAULT_ROUTE = "specdec"
DEFAULT_PLAIN_ROUTE = "specdec-plain"


@dataclass(frozen=True)
class LoadSchedule:
    """Maps the number of running sequences to k. `steps` are (from_running, k) pairs sorted by
    from_running; the last pair whose from_running <= running applies; below the first, its k."""

    steps: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if not self.steps:
            raise ConfigError("load_schedule needs at least one entry")
        for running, k in self.steps:
            if isinstance(running, bool) or not isinstance(running, int) or running < 1:
                raise ConfigError(f"load_schedule keys are running-sequence counts >= 1, got {running!r}")
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= 64:
                raise ConfigError(f"load_schedule values are k in 0..64, got {k!r}")
        if list(self.steps) != sorted(self.steps) or len({r for r, _ in self.steps}) != len(self.steps):
            raise ConfigError("load_schedule entries must have distinct counts, in increasing order")

    @classmethod
    def from_mapping(cls, mapping: dict[Any, Any]) -> LoadSchedule:
        try:
            steps = sorted((int(key), value) for key, value in mapping.items())
        except (TypeError, ValueError):
            raise ConfigError(f"load_schedule keys must be integers, got {sorted(map(str, mapping))}") from None
        return cls(tuple(steps))

    def k_for(self, running: int) -> int:
        k = self.steps[0][1]
        for threshold, value in self.steps:
            if running >= threshold:
                k = value
        return k

    def to_dict(self) -> dict[str, int]:
        return {str(running): k for running, k in self.steps}


@dataclass(frozen=True)
class RouteConfig:
    """One served model name and how it speculates.

    speculative: None for plain decoding.
    load_schedule: None for a fixed k; else k follows the number of running sequences.
    max_num_speculative_tokens: the largest k a request may ask for (extra body field
        `speculative`); 0 forbids raising it. Turning speculation off is always allowed.
    """

    name: str
    speculative: SpeculativeConfig | None = None
    load_schedule: LoadSchedule | None = None
    max_num_speculative_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise ConfigError("a route needs a non-empty name")
        cap = self.max_num_speculative_tokens
        if isinstance(cap, bool) or not isinstance(cap, int) or not 0 <= cap <= 64:
            raise ConfigError(f"route {self.name!r}: max_num_speculative_tokens must be in 0..64, got {cap!r}")
        if self.speculative is None and self.load_schedule is not None:
            raise ConfigError(f"route {self.name!r}: a load_schedule needs a speculative config")

    @property
    def k(self) -> int:
        """The route's own k (0 without speculation)."""
        return 0 if self.speculative is None else int(self.speculative.num_speculative_tokens or 0)

    @property
    def k_cap(self) -> int:
        """The most a request on this route may draft per step."""
        return max(self.k, self.max_num_speculative_tokens) if self.speculative is not None else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "speculative": None if self.speculative is None else self.speculative.to_dict(),
            "load_schedule": None if self.load_schedule is None else self.load_schedule.to_dict(),
            "max_num_speculative_tokens": self.k_cap,
        }


@dataclass(frozen=True)
class DriftConfig:
    """Acceptance drift: the acceptance of the last `window` drafted tokens is compared with that
    of the `baseline` drafted tokens before them; a drop by more than `threshold` warns."""

    window: int = 256
    baseline: int = 1024
    threshold: float = 0.15

    def __post_init__(self) -> None:
        if self.window < 1 or self.baseline < 1:
            raise ConfigError("drift window and baseline must be >= 1")
        if not 0 < self.threshold < 1:
            raise ConfigError(f"drift threshold must be in (0, 1), got {self.threshold!r}")


def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise ConfigError(f"{name} must be a number > 0, got {value!r}")


@dataclass(frozen=True)
class ReplicaConfig:
    """Scale-out on Ray Serve: a fixed `num_replicas`, or autoscaling between `min_replicas` and
    `max_replicas` on Ray's target of ongoing requests per replica. Without either, one replica."""

    num_replicas: int | None = None
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    # How long the load must call for more (fewer) replicas before Ray adds (removes) one;
    # None: Ray's defaults (30 s and 600 s in Ray 2.58).
    upscale_delay_s: float | None = None
    downscale_delay_s: float | None = None
    # Requests one replica takes at once; Ray's router holds the rest (None: max_num_seqs, so a
    # replica is not sent more than its batch holds while another has room).
    max_ongoing_requests: int | None = None
    cpus_per_replica: float = 1.0
    # GPUs reserved by a replica (`specdec serve --device cuda` needs at least a share of one).
    gpus_per_replica: float = 0.0

    def __post_init__(self) -> None:
        bounds = (self.min_replicas, self.max_replicas)
        if self.num_replicas is not None:
            _positive_int("num_replicas", self.num_replicas)
            if bounds != (None, None) or any(v is not None for v in self._scaling().values()):
                raise ConfigError("[replicas] takes num_replicas (a fixed count) or min_replicas/max_replicas "
                                  "(autoscaling), not both")
        elif bounds != (None, None):
            if None in bounds:
                raise ConfigError("autoscaling needs both min_replicas and max_replicas")
            _positive_int("min_replicas", self.min_replicas, minimum=0)
            _positive_int("max_replicas", self.max_replicas)
            if self.min_replicas > self.max_replicas:
                raise ConfigError(f"min_replicas {self.min_replicas} exceeds max_replicas {self.max_replicas}")
        elif self._scaling():
            given = ", ".join(self._scaling())
            raise ConfigError(f"{given} need(s) autoscaling bounds (min_replicas and max_replicas)")
        for name, value in self._scaling().items():
            _positive_number(name, value)
        if self.max_ongoing_requests is not None:
            _positive_int("max_ongoing_requests", self.max_ongoing_requests)
        _positive_number("cpus_per_replica", self.cpus_per_replica)
        if self.gpus_per_replica:
            _positive_number("gpus_per_replica", self.gpus_per_replica)

    def _scaling(self) -> dict[str, float]:
        """The autoscaling settings given besides the bounds."""
        values = {"target_ongoing_requests": self.target_ongoing_requests, "upscale_delay_s": self.upscale_delay_s,
                  "downscale_delay_s": self.downscale_delay_s}
        return {name: value for name, value in values.items() if value is not None}

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None

    def with_count(self, num_replicas: int) -> ReplicaConfig:
        """These settings with a fixed count instead of any autoscaling (`--replicas N`)."""
        return dataclasses.replace(self, num_replicas=num_replicas, min_replicas=None, max_replicas=None,
                                   target_ongoing_requests=None, upscale_delay_s=None, downscale_delay_s=None)

    def deployment_options(self, max_num_seqs: int, graceful_shutdown_s: float) -> dict[str, Any]:
        """Ray Serve's own deployment options for these settings."""
        options: dict[str, Any] = {
            "max_ongoing_requests": self.max_ongoing_requests or max_num_seqs,
            "ray_actor_options": {"num_cpus": self.cpus_per_replica, "num_gpus": self.gpus_per_replica},
            # A replica scaled down or shut down lets its requests finish, as the server's SIGTERM does.
            "graceful_shutdown_timeout_s": graceful_shutdown_s,
        }
        if self.autoscaling:
            options["autoscaling_config"] = {"min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                                             **self._scaling()}
        else:
            options["num_replicas"] = self.num_replicas or 1
        return options


@dataclass(frozen=True)
class ServerConfig:
    """Everything the server needs besides the model: routes, limits, memory budget, drift."""

    routes: tuple[RouteConfig, ...]
    max_model_len: int = 2048
    max_num_seqs: int = 16
    cache_budget_bytes: int = 2 << 30
    # Committed tokens' keys and values kept across requests (:mod:`specdec.models.prefix_cache`),
    # taken from the cache budget before the sequences; None: what max_num_seqs sequences leave
    # of the budget; 0: off (`specdec serve --no-prefix-cache`).
    prefix_cache_bytes: int | None = None
    max_waiting: int = 256
    # On SIGTERM, requests in flight get this long to finish; then every one still running or
    # waiting ends with finish_reason "abort" (a final chunk and [DONE] when streamed).
    graceful_shutdown_s: float = 30.0
    # The largest request body; a larger one is refused with 413 before it is parsed. 4 MiB
    # holds a prompt far longer than any context (about 1M tokens of English).
    max_request_bytes: int = 4 << 20
    # A request whose body has not all arrived this long after it started (a missing chunk end, a
    # short Content-Length, a trickle) gets a 408 and its connection is closed.
    request_body_timeout_s: float = 30.0
    # A request whose head (request line and headers) has not all arrived this long after its
    # first byte, or after the connection opened, gets a 408 and its connection is closed: half-sent
    # headers (slowloris) no longer hold connection slots for as long as the client likes.
    request_head_timeout_s: float = 10.0
    # Open connections (and requests in them) at most; uvicorn answers past it with a 503.
    max_connections: int = 256
    # A structured output compiles in a child process, one at a time: past this deadline the
    # child is killed and the request gets a 400, as does a grammar compiling to more than
    # max_grammar_bytes (an enum of 20,000 strings takes 14 s and 100 MB to compile).
    grammar_timeout_s: float = 10.0
    max_grammar_bytes: int = 64 << 20
    # Chunked prefill: while sequences run, a new prompt is prefilled about this long at a time
    # between their steps (into the prefix cache, at the rate measured), so no running stream
    # waits for a whole long prefill. Needs the prefix cache.
    prefill_chunk_s: float = 0.25
    drift: DriftConfig = field(default_factory=DriftConfig)
    # torch intra-op threads of the scheduler thread, which does all the model work (specdec's
    # kernels use as many). None is auto: torch's default (one per core), except for one
    # sequence on PyTorch's products (the hf backend, or no kernels), which runs on one core
    # fewer, so that the HTTP event loop (and, on a small machine, the client) does not preempt
    # a spinning OpenMP worker at every step. The kernels' own pool waits for no preempted
    # thread, so there every core pays (docs/server.md has the measurements).
    threads: int | None = None
    # The target's backend and weight format (`specdec serve --backend/--dtype` override them).
    backend: str = "auto"
    dtype: str = "auto"
    # Ray Serve replicas (`specdec serve --replicas N`); None: the single-process server.
    replicas: ReplicaConfig | None = None
    # Keys a client must send as OpenAI's `Authorization: Bearer KEY` on every endpoint but the
    # liveness probe `/health/live`; empty: no key asked (`specdec serve --api-key` sets them).
    api_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.routes:
            raise ConfigError("the server needs at least one route")
        names = [r.name for r in self.routes]
        if len(set(names)) != len(names):
            raise ConfigError(f"route names must be distinct, got {names}")
        for name in ("max_model_len", "max_num_seqs", "cache_budget_bytes", "max_waiting", "max_request_bytes",
                     "max_connections", "max_grammar_bytes"):
            _positive_int(name, getattr(self, name))
        grace = self.graceful_shutdown_s
        if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not 0 <= grace < float("inf"):
            raise ConfigError(f"graceful_shutdown_s must be a number >= 0, got {grace!r}")
        prefix = self.prefix_cache_bytes
        if prefix is not None and (isinstance(prefix, bool) or not isinstance(prefix, int) or prefix < 0):
            raise ConfigError(f"prefix_cache_bytes must be an integer >= 0 or None, got {prefix!r}")
        for name in ("request_body_timeout_s", "request_head_timeout_s", "grammar_timeout_s", "prefill_chunk_s"):
            wait = getattr(self, name)
            if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 < wait < float("inf"):
                raise ConfigError(f"{name} must be a number > 0, got {wait!r}")
        if self.backend not in ("auto", *BACKENDS):
            raise ConfigError(f"backend must be one of auto, {', '.join(BACKENDS)}; got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        threads = self.threads
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ConfigError(f"threads must be an integer >= 1, got {threads!r}")
        if not isinstance(self.api_keys, tuple) or not all(
                isinstance(k, str) and 8 <= len(k) <= 256 and k.isprintable() and not any(c.isspace() for c in k)
                for k in self.api_keys):
            raise ConfigError("api_keys must be a list of keys of 8 to 256 printable characters without spaces")

    def route(self, name: str) -> RouteConfig | None:
        return next((r for r in self.routes if r.name == name), None)

    @property
    def max_draft(self) -> int:
        """The most tokens a row drafts in a step: a route's k cap, its tree's size, or a
        predicted output's draft (a request's prediction drafts on any route: `draft_room`)."""
        def size(route: RouteConfig) -> int:
            spec = route.speculative
            return spec.options.proposal_tokens(route.k_cap) if spec is not None else route.k_cap

        return draft_room(*(size(r) for r in self.routes))


def default_config(**overrides: Any) -> ServerConfig:
    """Two routes on the served model: `specdec` (ngram, k = 4, load-aware with the default
    schedule) and `specdec-plain` (no speculation)."""
    routes = (
        RouteConfig(DEFAULT_ROUTE, SpeculativeConfig(DEFAULT_METHOD), LoadSchedule.from_mapping(DEFAULT_LOAD_SCHEDULE), 8),
        RouteConfig(DEFAULT_PLAIN_ROUTE),
    )
    return ServerConfig(routes=routes, **overrides)


_SCALAR_KEYS = ("max_model_len", "max_num_seqs", "max_waiting", "graceful_shutdown_s", "threads", "max_request_bytes",
                "request_body_timeout_s", "request_head_timeout_s", "max_connections", "backend", "dtype", "api_keys",
                "grammar_timeout_s", "prefill_chunk_s")
_TOP_KEYS = {*_SCALAR_KEYS, "cache_budget_mb", "prefix_cache_mb", "max_grammar_mb", "drift", "routes", "replicas"}
_REPLICA_KEYS = set(ReplicaConfig.__dataclass_fields__)
_ROUTE_KEYS = {"speculative", "load_schedule", "max_num_speculative_tokens"}


def _route_from_table(name: str, table: Any) -> RouteConfig:
    if not isinstance(table, dict):
        raise ConfigError(f"route {name!r} must be a table")
    unknown = sorted(set(table) - _ROUTE_KEYS)
    if unknown:
        raise ConfigError(f"route {name!r}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(_ROUTE_KEYS))}")
    spec = SpeculativeConfig.from_dict(table["speculative"]) if "speculative" in table else None
    schedule_value = table.get("load_schedule", spec is not None)
    if schedule_value is True:
        schedule = LoadSchedule.from_mapping(DEFAULT_LOAD_SCHEDULE)
    elif schedule_value is False:
        schedule = None
    elif isinstance(schedule_value, dict):
        schedule = LoadSchedule.from_mapping(schedule_value)
    else:
        raise ConfigError(f"route {name!r}: load_schedule must be a table, true or false")
    return RouteConfig(name, spec, schedule, table.get("max_num_speculative_tokens", 0))


def config_from_dict(data: dict[str, Any], **overrides: Any) -> ServerConfig:
    """Build a ServerConfig from parsed TOML (see the module docstring for the keys)."""
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"unknown server config key(s): {', '.join(unknown)}; known: {', '.join(sorted(_TOP_KEYS))}")
    routes_table = data.get("routes")
    if not isinstance(routes_table, dict) or not routes_table:
        raise ConfigError("the server config needs a [routes.NAME] table for each served model name")
    kwargs: dict[str, Any] = {k: data[k] for k in _SCALAR_KEYS if k in data}
    if isinstance(kwargs.get("api_keys"), list):  # TOML's arrays are lists
        kwargs["api_keys"] = tuple(kwargs["api_keys"])
    if "cache_budget_mb" in data:
        budget = data["cache_budget_mb"]
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0:
            raise ConfigError(f"cache_budget_mb must be a number > 0, got {budget!r}")
        kwargs["cache_budget_bytes"] = int(budget * (1 << 20))
    if "max_grammar_mb" in data:
        size = data["max_grammar_mb"]
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not size > 0:
            raise ConfigError(f"max_grammar_mb must be a number > 0, got {size!r}")
        kwargs["max_grammar_bytes"] = int(size * (1 << 20))
    if "prefix_cache_mb" in data:
        prefix = data["prefix_cache_mb"]
        if isinstance(prefix, bool) or not isinstance(prefix, (int, float)) or not prefix >= 0:
            raise ConfigError(f"prefix_cache_mb must be a number >= 0 (0: off), got {prefix!r}")
        kwargs["prefix_cache_bytes"] = int(prefix * (1 << 20))
    if "drift" in data:
        drift = data["drift"]
        if not isinstance(drift, dict) or set(drift) - {"window", "baseline", "threshold"}:
            raise ConfigError("[drift] takes window, baseline and threshold")
        kwargs["drift"] = DriftConfig(**drift)
    if "replicas" in data:
        replicas = data["replicas"]
        if not isinstance(replicas, dict) or set(replicas) - _REPLICA_KEYS:
            raise ConfigError(f"[replicas] takes {', '.join(sorted(_REPLICA_KEYS))}")
        kwargs["replicas"] = ReplicaConfig(**replicas)
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return ServerConfig(routes=tuple(_route_from_table(name, table) for name, table in routes_table.items()), **kwargs)


def load_config(path: str | Path, **overrides: Any) -> ServerConfig:
    """Read a TOML server config; `overrides` (not None) replace its top-level values."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(f"cannot read server config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"server config {path} is not valid TOML: {exc}") from None
    return config_from_dict(data, **overrides)
