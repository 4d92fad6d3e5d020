"""Start-up and running: load the model and drafters, plan memory, build the batch engine and
the scheduler, and run uvicorn (in the foreground, or in a thread for tests and benchmarks)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import signal
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator

import torch
import uvicorn

from specdec.methods import build_drafter
from specdec.drafters.base import Drafter
from specdec.engine.batch import BatchEngine
from specdec.errors import ConfigError
from specdec.models.loader import LoadedModel, load_model
from specdec.models.prefix_cache import PrefixCache
from specdec.sampling.grammar import IsolatedCompiler, compiler_for, xgrammar_installed
from specdec.models.prompts import PromptEncoder
from specdec.server.app import ServerState, create_app
from specdec.server.config import ServerConfig
from specdec.server.connections import protocol_class
from specdec.server.memory import plan_memory
from specdec.server.metrics import ServerMetrics
from specdec.server.scheduler import Scheduler

log = logging.getLogger(__name__)


def build_state(config: ServerConfig, model: str | None = None, *, loaded: LoadedModel | None = None,
                device: str | torch.device = "cpu", backend: str = "auto", dtype: str = "auto") -> ServerState:
    """Everything the app needs, ready to serve (the scheduler thread starts with the app)."""
    target = loaded if loaded is not None else load_model(model, device=device, backend=backend, dtype=dtype)
    if config.max_model_len > target.max_positions:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds {target.name}'s context of {target.max_positions}")
    # One prototype drafter per route: builds (and checks) its draft model once; sequences fork it.
    drafters: dict[str, Drafter | None] = {
        r.name: build_drafter(r.speculative, target) if r.speculative is not None else None for r in config.routes
    }
    memory = plan_memory(target, [d for d in drafters.values() if d is not None], config.max_model_len,
                         config.cache_budget_bytes, config.prefix_cache_bytes or 0)
    log.info("memory: %s", memory.describe())
    if memory.max_sequences < 1:
        raise ConfigError(f"the cache budget holds no sequence of {config.max_model_len} tokens: {memory.describe()}")
    rows = min(config.max_num_seqs, memory.max_sequences)
    if rows < config.max_num_seqs:
        log.warning("max_num_seqs %d lowered to %d to fit the cache budget", config.max_num_seqs, rows)
    prefix_budget = memory.left_after(rows) if config.prefix_cache_bytes is None else config.prefix_cache_bytes
    prefix = PrefixCache.for_backend(target.backend, prefix_budget)
    if prefix is not None:
        log.info("prefix cache: %.0f MiB", prefix_budget / (1 << 20))
    elif config.prefix_cache_bytes != 0:
        log.info("prefix cache off: %s", "the cache budget leaves no room for it" if target.backend.exact_blocks else
                 f"{target.describe()} does not compute a position's keys bitwise alike in every pass")
    engine = BatchEngine(target, max_rows=rows, max_model_len=config.max_model_len, max_draft=max(config.max_draft, 1),
                         prefix_cache=prefix)
    metrics = ServerMetrics(config.drift)
    for route in config.routes:
        metrics.add_route(route.name)
    for part, value in (("target_weights", memory.target_weight_bytes), ("draft_weights", memory.draft_weight_bytes),
                        ("target_kv_per_token", memory.target_kv_bytes_per_token),
                        ("draft_kv_per_token", memory.draft_kv_bytes_per_token),
                        ("cache_budget", memory.cache_budget_bytes), ("per_sequence", memory.bytes_per_sequence)):
        metrics.memory.labels(part).set(value)
    metrics.memory.labels("kv_allocated").set(engine.cache.nbytes)
    metrics.memory.labels("prefix_cache_budget").set(prefix.budget_bytes if prefix is not None else 0)
    log.info("KV cache allocated: %.1f MiB for %d sequences of up to %d tokens (plus %d slots of slack each)",
             engine.cache.nbytes / (1 << 20), rows, config.max_model_len, engine.cache.capacity - config.max_model_len)
    metrics.max_sequences.labels("true").set(memory.max_sequences)
    metrics.max_sequences.labels("false").set(memory.max_sequences_without_draft)
    # The HTTP side encodes prompts with its own tokenizer copy: a fast tokenizer must not be
    # used from two threads at once, and the scheduler thread decodes with the original.
    encoder = PromptEncoder(dataclasses.replace(target, tokenizer=copy.deepcopy(target.tokenizer)))
    scheduler = Scheduler(engine, drafters, metrics, max_waiting=config.max_waiting, threads=config.threads,
                          prefill_chunk_s=config.prefill_chunk_s)
    # Built here, before the scheduler thread uses the tokenizer: the compiler the engine reads
    # grammars from, filled by the child process that compiles each request's.
    grammars = None
    if xgrammar_installed():
        compiler = compiler_for(target.tokenizer, target.vocab_size, target.eos_token_ids)
        grammars = IsolatedCompiler(compiler, config.grammar_timeout_s, config.max_grammar_bytes)
    return ServerState(config, encoder, scheduler, metrics, memory, target.name, config.max_model_len, rows,
                       grammars=grammars)


# After the grace, how long aborted requests get to send their last chunk or body before
# uvicorn cancels what is left (only a client that stopped reading needs it).
ABORT_MARGIN_S = 5.0


class SpecdecServer(uvicorn.Server):
    """uvicorn with specdec's shutdown. On SIGTERM or SIGINT (or `should_exit`) it stops
    accepting connections, lets requests in flight finish for up to graceful_shutdown_s, then
    aborts every request still waiting or running: each ends as usual, with finish_reason
    "abort" (a streamed one with its last chunk and `data: [DONE]`, another with its JSON
    body), before the connections close. The process then exits 0: uvicorn's own shutdown
    cancels handlers mid-response at its timeout and re-raises the signal (exit 143)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.shutting_down = True
        timer = asyncio.get_running_loop().call_later(self.state.config.graceful_shutdown_s, self._abort)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort(self) -> None:
        running, waiting = self.state.scheduler.running, self.state.scheduler.waiting
        if running or waiting:
            log.warning("graceful shutdown: %.3g s passed; aborting %d running and %d waiting sequences",
                        self.state.config.graceful_shutdown_s, running, waiting)
        self.state.scheduler.abort_all()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # As uvicorn's, without re-raising the signal afterwards: the shutdown was orderly.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def uvicorn_server(state: ServerState, host: str, port: int, log_level: str = "info") -> SpecdecServer:
    """A uvicorn server for the app, with the shutdown of SpecdecServer."""
    config = uvicorn.Config(create_app(state, host), host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=state.config.graceful_shutdown_s + ABORT_MARGIN_S, lifespan="on",
                            limit_concurrency=state.config.max_connections,
                            http=protocol_class(state.config.request_head_timeout_s))
    return SpecdecServer(config, state)


class ServerThread:
    """Runs the server in a background thread of this process (tests, benchmarks)."""

    def __init__(self, state: ServerState, host: str = "127.0.0.1", port: int = 0) -> None:
        self.state = state
        self.server = uvicorn_server(state, host, port, log_level="warning")
        self.thread = threading.Thread(target=self.server.run, name="specdec-uvicorn", daemon=True)
        self.host = host

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the server did not start")
            time.sleep(0.02)
        wait_healthy(self.url, timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)


def wait_healthy(url: str, timeout: float = 60.0) -> None:
    """Poll the liveness probe (GET /health/live, which asks for no API key) until it answers 200."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health/live", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url}/health/live did not answer within {timeout} s")
        time.sleep(0.1)
