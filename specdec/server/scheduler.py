"""The scheduler: one background thread owns the batched engine and all torch work.

HTTP handlers submit requests from the event loop; the thread admits them into the batch
between steps (continuous batching), sets each sequence's k from its route's load schedule,
runs one engine step, and hands every sequence's new text back through a thread-safe callback.
Cancelled requests (client gone, shutdown) leave the batch before the next step.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any
from dataclasses import dataclass, field

import torch

from specdec.config import SamplingParams
from specdec.drafters.base import Drafter
from specdec.engine.adaptive import AdaptiveStates, SpeculationPolicy
from specdec.engine.batch import BatchEngine, Sequence, SequenceOutput, target_layers
from specdec.engine.stats import RequestStats
from specdec.errors import SpecDecError
from specdec.sampling.logprobs import TokenLogprob
from specdec.server.config import RouteConfig
from specdec.server.memory import release_free_memory
from specdec.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


FIRST_CHUNK = 64  # chunked prefill's tokens before any rate is measured (see ServerConfig.prefill_chunk_s)
TRIM_EVERY_S = 1.0  # at most this often, the allocator's free pages go back once requests finished


@dataclass(frozen=True)
class Event:
    """What the scheduler tells a request's handler.

    kind: "prompt" (the prompt's logprobs, first, when asked for), "token" (new text and tokens,
    with their logprobs when asked for), "done" (finish_reason and stats; the last event), or
    "error" (message; also the last event; `client`: the request's own fault, a 4xx, such as
    a structured output that no text can complete).
    """

    kind: str
    index: int
    text: str = ""
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob | None, ...] = ()
    finish_reason: str | None = None
    stats: RequestStats | None = None
    message: str = ""
    client: bool = False


@dataclass(eq=False)
class ServerRequest:
    """One sequence to generate: a prompt on a route, with its k (0 = no speculation) and a
    callback that delivers events to the handler (called from the scheduler thread).

    k: the route's, or the request's own (`own_k`); once admitted, where the request set none, the
    k admission gave its sequence (a predicted output's: :meth:`BatchEngine.admit`). Each step's k
    is at most it (`k_at`).
    """

    route: RouteConfig
    prompt_ids: list[int]
    params: SamplingParams
    k: int
    sink: Callable[[Event], None]
    index: int = 0
    own_k: bool = False
    arrival: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    sequence: Sequence | None = None
    last_emit: float | None = None
    grammar: Any = None  # params.structured compiled (the engine compiles nothing on this thread)
    warmed: int = 0  # prompt tokens prefilled into the prefix cache ahead of admission (chunked prefill)

    def k_at(self, running: int) -> int:
        """k for the next step when `running` sequences share the batch."""
        if self.route.load_schedule is None:
            return self.k
        return min(self.k, self.route.load_schedule.k_for(running))


def fork_drafter(prototype: Drafter) -> Drafter:
    """A fresh drafter configured like `prototype`, sharing its weights, for one request."""
    return prototype.fork()


class QueueFullError(SpecDecError):
    """Too many requests are waiting for a row."""


class StoppedError(SpecDecError):
    """The scheduler is stopping (the server is shutting down) and takes no new requests."""


class Scheduler:
    """Runs the batched engine in a background thread; see the module docstring."""

    def __init__(self, engine: BatchEngine, drafters: dict[str, Drafter | None], metrics: ServerMetrics,
                 max_waiting: int = 256, threads: int | None = None, prefill_chunk_s: float = 0.25) -> None:
        self.engine = engine
        self.prefill_chunk_s = prefill_chunk_s  # chunked prefill's time between two steps
        self.drafters = drafters  # route name -> prototype drafter (never run), or None
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.threads = threads  # torch intra-op threads of the model work; None: auto (threads_for)
        self.torch_threads: int | None = None  # what the thread runs with now, once started
        self._all_threads = torch.get_num_threads()  # torch's default in the scheduler thread
        self._inbox: queue.Queue[ServerRequest] = queue.Queue()
        self._waiting: deque[ServerRequest] = deque()
        self._running: dict[int, ServerRequest] = {}  # sequence id -> request
        # What adaptive k has learned on each adaptive route, shared by its sequences.
        self._adaptive = AdaptiveStates()  # per route
        self._stopping = threading.Event()
        self._finished_since_trim, self._trimmed_at = 0, 0.0
        self._prefill_rate: float | None = None  # prompt tokens a second, from chunks measured
        self.prefill_chunks = 0  # chunks prefilled ahead of admission, since start
        self._thread = threading.Thread(target=self._loop, name="specdec-scheduler", daemon=True)
        self.steps = 0

    # --- called from the event loop ----------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: ServerRequest) -> None:
        self.submit_all([request])

    def submit_all(self, requests: list[ServerRequest]) -> None:
        """Queue all of `requests` (the choices and prompts of one HTTP request), or none: a
        request refused for a full queue must not leave some of its sequences behind, which
        would then be cancelled and counted as aborted."""
        if self._stopping.is_set():
            raise StoppedError("the server is shutting down")
        # Called only from the event loop, so no other submit runs between the check and the puts.
        if self.waiting + len(requests) > self.max_waiting:
            raise QueueFullError(f"{self.waiting} requests are waiting; {len(requests)} more would exceed the "
                                 f"limit of {self.max_waiting}")
        for request in requests:
            self._inbox.put(request)

    def cancel(self, request: ServerRequest) -> None:
        """Mark a request cancelled; its sequence leaves the batch before the next step."""
        request.cancelled = True

    @property
    def waiting(self) -> int:
        return self._inbox.qsize() + len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def abort_all(self) -> None:
        """Stop taking requests and end every one still waiting or running with finish_reason
        "abort" (after the step in progress); returns at once. The thread then exits."""
        self._stopping.set()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still waiting or running end with finish_reason "abort"."""
        self.abort_all()
        self._thread.join(timeout)

    # --- the scheduler thread ----------------------------------------------------------------

    def _loop(self) -> None:
        # Set here, in the thread that runs the model: OpenMP keeps a thread count per thread.
        self._all_threads = torch.get_num_threads()
        self._set_threads(self.threads_for(0))
        while not self._stopping.is_set():
            self._drain(block=not self._running and not self._waiting)
            self._drop_cancelled()
            self._admit()
            if self._running:
                self._step()
            self._update_gauges()
            if self._finished_since_trim and time.monotonic() - self._trimmed_at >= TRIM_EVERY_S:
                release_free_memory()  # a few ms: what finished requests freed goes back to the system
                self._finished_since_trim, self._trimmed_at = 0, time.monotonic()
        for request in list(self._running.values()) + list(self._waiting) + self._drain_all():
            self._finish(request, "abort")
        self._update_gauges()

    def _drain(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        self._waiting.append(item)
        self._waiting.extend(self._drain_all())

    def _drain_all(self) -> list[ServerRequest]:
        items = []
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                return items

    def _drop_cancelled(self) -> None:
        for request in [r for r in self._running.values() if r.cancelled]:
            self._finish(request, "abort")
        if any(r.cancelled for r in self._waiting):
            kept = deque()
            for request in self._waiting:
                if request.cancelled:
                    self._finish(request, "abort")
                else:
                    kept.append(request)
            self._waiting = kept

    def _chunk(self) -> int:
        """Prompt tokens to prefill between two steps: prefill_chunk_s at the rate measured, whole blocks."""
        block = self.engine.prefix_cache.block
        size = FIRST_CHUNK if self._prefill_rate is None else int(self.prefill_chunk_s * self._prefill_rate)
        return max(block, size // block * block)

    def _prefill_chunk(self, request: ServerRequest) -> bool:
        """Prefill the next chunk of a waiting prompt into the prefix cache, when sequences run
        that a whole prefill would stall; False when it should be admitted now instead."""
        cache = self.engine.prefix_cache
        if cache is None or not self._running or request.params.prompt_logprobs:
            return False
        upto = request.warmed + self._chunk()
        if len(request.prompt_ids) - upto < cache.block:  # what is left fits one chunk: admit
            return False
        prototype = self.drafters.get(request.route.name)
        layers = target_layers(prototype) if prototype is not None and request.k > 0 else ()
        start = time.perf_counter()
        try:
            computed = self.engine.warm(request.prompt_ids[:upto], layers)
        except Exception:  # noqa: BLE001  admission prefills it whole, and reports any error
            log.exception("chunked prefill failed; prefilling the prompt whole")
            return False
        seconds = time.perf_counter() - start
        if computed >= cache.block and seconds > 0:
            # The latest chunk's rate: a chunk slows as the prompt it extends grows (attention, the
            # copy of what the cache held), and the next one is at least as long.
            self._prefill_rate = computed / seconds
        if computed > upto - request.warmed + cache.block:  # the cache did not keep the chunks before
            upto = len(request.prompt_ids)  # (too small a budget): the rest is prefilled at admission
        request.warmed = upto
        self.prefill_chunks += 1
        return True

    def _admit(self) -> None:
        while self._waiting and self.engine.running < self.engine.max_rows:
            if self._prefill_chunk(self._waiting[0]):
                return  # a step for the running sequences before the next chunk
            request = self._waiting.popleft()
            prototype = self.drafters.get(request.route.name)
            drafter = fork_drafter(prototype) if prototype is not None and request.k > 0 else None
            try:
                out = self.engine.admit(request.prompt_ids, request.params, drafter, request.k,
                                        self._policy(request, drafter), grammar=request.grammar)
            except (SpecDecError, ValueError) as exc:  # the handler checks prompts; this is a backstop
                request.sink(Event("error", request.index, message=str(exc)))
                self._finish(request, "error", notify=False)
                continue
            except Exception:  # noqa: BLE001  a failed prefill fails its request, not the thread
                log.exception("prefill failed")
                request.sink(Event("error", request.index, message="internal error during prefill"))
                self._finish(request, "error", notify=False)
                continue
            seq = request.sequence = out.sequence
            if not request.own_k:
                request.k = seq.k
            self._running[seq.id] = request
            self.metrics.route_running.labels(request.route.name).inc()
            self._deliver(request, out, prefill=True)

    def _policy(self, request: ServerRequest, drafter: Drafter | None) -> SpeculationPolicy | None:
        """Adaptive k for a sequence on an adaptive route (within the cap the load schedule sets
        each step); None elsewhere: the sequence drafts the cap. A predicted output drafts under
        none (admission drops it), so its request leaves what the route learned alone."""
        spec = request.route.speculative
        if drafter is None or spec is None or not spec.adaptive or request.params.prediction:
            return None
        return self._adaptive.policy(request.k, True, request.route.name)

    def threads_for(self, running: int) -> int:
        """torch threads for a step with `running` sequences: the configured count, or auto (see
        `ServerConfig.threads`)."""
        if self.threads is not None:
            return self.threads
        if running <= 1 and self.engine.target.kernel_path == "pytorch":
            return max(1, self._all_threads - 1)
        return self._all_threads

    def _set_threads(self, threads: int) -> None:
        if threads != self.torch_threads:
            torch.set_num_threads(threads)
            self.torch_threads = threads

    def _step(self) -> None:
        running = self.engine.running
        self._set_threads(self.threads_for(running))
        for seq in self.engine.sequences:
            seq.k = self._running[seq.id].k_at(running)
        for route, schedule in {r.route.name: r.route for r in self._running.values()}.items():
            self.metrics.current_k.labels(route).set(schedule.load_schedule.k_for(running) if schedule.load_schedule else schedule.k)
        try:
            outputs = self.engine.step()
        except Exception:  # noqa: BLE001  a failed step must not kill the thread; fail its requests instead
            log.exception("engine step failed; failing the %d running requests", running)
            self.engine.cache.clear()
            self.engine.sequences.clear()
            for request in list(self._running.values()):
                request.sink(Event("error", request.index, message="internal error while generating"))
                self._finish(request, "error", notify=False)
            return
        self.steps += 1
        for out in outputs:
            self._deliver(self._running[out.sequence.id], out, prefill=False)

    def _deliver(self, request: ServerRequest, out: SequenceOutput, prefill: bool) -> None:
        route = request.route.name
        if prefill:
            stats = out.sequence.result.stats
            self.metrics.record_prompt(route, stats.prompt_tokens, stats.cached_tokens)
        else:
            self.metrics.record_step(route, out.drafted, out.accepted)
        now = time.monotonic()
        tokens = len(out.chunk.token_ids)
        if tokens:
            self.metrics.record_tokens(route, tokens, now)
            if request.last_emit is None:
                self.metrics.ttft.labels(route).observe(now - request.arrival)
            else:
                per_token = (now - request.last_emit) / tokens
                for _ in range(tokens):
                    self.metrics.itl.labels(route).observe(per_token)
            request.last_emit = now
        if prefill and request.params.prompt_logprobs:
            request.sink(Event("prompt", request.index, logprobs=tuple(out.sequence.result.prompt_logprobs)))
        if tokens or out.chunk.text:
            request.sink(Event("token", request.index, out.chunk.text, tuple(out.chunk.token_ids), out.chunk.logprobs))
        if out.finished:
            error = out.sequence.result.error
            if error is not None:  # the client's spec failed, not the engine: a 4xx
                request.sink(Event("error", request.index, message=error, client=True))
                self._finish(request, "rejected", notify=False)
                return
            self._finish(request, out.sequence.result.finish_reason or "stop")

    def _finish(self, request: ServerRequest, reason: str, notify: bool = True) -> None:
        self._finished_since_trim += 1
        seq = request.sequence
        if seq is not None and self._running.pop(seq.id, None) is not None:
            self.engine.remove(seq)
            self.metrics.route_running.labels(request.route.name).dec()
        self.metrics.requests.labels(request.route.name, reason).inc()
        if notify:
            stats = None
            if seq is not None:  # a copy: the sequence's own object is not touched again
                own = seq.result.stats
                stats = dataclasses.replace(own, drafted_at=list(own.drafted_at), accepted_at=list(own.accepted_at))
            request.sink(Event("done", request.index, finish_reason=reason, stats=stats))

    def _update_gauges(self) -> None:
        self.metrics.queue_length.set(self.waiting)
        self.metrics.running.set(self.engine.running)
        if (prefix := self.engine.prefix_cache) is not None:
            self.metrics.prefix_bytes.set(prefix.nbytes)
            self.metrics.prefix_blocks.set(len(prefix))
