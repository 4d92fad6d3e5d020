"""Real servers (uvicorn on 127.0.0.1, a free port, in a thread of the test process) and the
official openai client pointed at them: `server` runs the default model (its outputs repeat,
so n-gram drafts get accepted), `tiny_server` the tiny random model (fast, for bad input)."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from specdec.config import SpeculativeConfig
from specdec.models import LoadedModel
from specdec.server.config import DriftConfig, LoadSchedule, RouteConfig, ServerConfig
from specdec.server.runtime import ServerThread, build_state

ROUTES = (
    RouteConfig("spec", SpeculativeConfig("ngram", 4), LoadSchedule.from_mapping({1: 4, 2: 4, 4: 2, 8: 0}), 6),
    RouteConfig("fixed", SpeculativeConfig("ngram", 3), None, 3),
    RouteConfig("adaptive", SpeculativeConfig("ngram", 4, adaptive=True), None, 4),
    RouteConfig("plain"),
)


def _serve(loaded: LoadedModel, max_num_seqs: int) -> ServerThread:
    config = ServerConfig(routes=ROUTES, max_model_len=256, max_num_seqs=max_num_seqs, graceful_shutdown_s=2,
                          drift=DriftConfig(window=16, baseline=32, threshold=0.2))
    return ServerThread(build_state(config, loaded=loaded)).start()


@pytest.fixture(scope="session")
def server(default_model: LoadedModel) -> Iterator[ServerThread]:
    running = _serve(default_model, max_num_seqs=8)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def tiny_server(tiny_model: LoadedModel) -> Iterator[ServerThread]:
    running = _serve(tiny_model, max_num_seqs=4)
    yield running
    running.stop()


@pytest.fixture(scope="session")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
