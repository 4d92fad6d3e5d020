"""A structured output compiles once, in a child process, off every thread that serves others:
one that compiles longer than `grammar_timeout_s` or to more than `max_grammar_bytes` is a clear
400 (the child killed at the deadline), and meanwhile other requests are answered. (Before: an
enum of 100,000 strings compiled on the scheduler thread, twice, and froze every request.)"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from specdec.models import LoadedModel
from specdec.sampling import grammar
from specdec.server.config import ServerConfig
from specdec.server.runtime import ServerThread, build_state
from tests.server.conftest import ROUTES
from tests.server.test_schema_limits import errors

pytest.importorskip("xgrammar")

TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def limited(tiny_model: LoadedModel) -> Iterator[ServerThread]:
    config = ServerConfig(routes=ROUTES, max_model_len=256, grammar_timeout_s=TIMEOUT_S, max_grammar_bytes=512 << 10)
    running = ServerThread(build_state(config, loaded=tiny_model)).start()
    yield running
    running.stop()


def _enum(n: int) -> dict:
    # On the tiny model's vocabulary: 1,000 strings compile in 0.02 s to 145 KB, 5,000 in 0.09 s
    # to 0.9 MB, 50,000 in 10 s to 250 MB (on the real model's, 20,000 take 14 s).
    return {"type": "string", "enum": [f"value number {i}" for i in range(n)]}


@pytest.fixture(autouse=True)
def ready(limited: ServerThread) -> None:
    """Each test starts with the compiler's child started: its start-up counts in a request's
    limit, which is short here."""
    assert limited.state.grammars.wait_ready(60)


def _ask(server: ServerThread, schema: dict | None = None, timeout: float = 60) -> httpx.Response:
    body = {"model": "plain", "messages": [{"role": "user", "content": "pick one"}], "max_tokens": 6}
    if schema is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=timeout)


def test_a_slow_compile_is_cut_at_the_deadline_and_stalls_nobody(limited: ServerThread) -> None:
    answered: dict = {}

    def slow() -> None:
        reply = _ask(limited, _enum(50_000))
        answered["slow"] = (time.monotonic(), reply.status_code, reply.json()["error"]["message"])

    start = time.monotonic()
    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.3)  # the compile has started
    assert _ask(limited).status_code == 200  # a plain request, while it compiles
    plain_done = time.monotonic()
    thread.join()
    slow_done, status, message = answered["slow"]
    assert status == 400 and "took longer than 1 s to compile" in message
    assert TIMEOUT_S <= slow_done - start < TIMEOUT_S + 10
    assert plain_done < slow_done  # answered before the compile's deadline, not behind it
    # The child was killed; a new one compiles the next spec.
    assert limited.state.grammars.wait_ready(60) and _ask(limited, _enum(100)).status_code == 200


def test_a_grammar_too_large_is_refused_and_its_child_killed(limited: ServerThread) -> None:
    assert _ask(limited, _enum(10)).status_code == 200
    before = limited.state.grammars.pid
    reply = _ask(limited, _enum(5_000))
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert "compiles to" in error["message"] and "max_grammar_mb" in error["message"]
    assert error["param"] == "response_format.json_schema.schema"
    # The child that held the oversized grammar is gone (its memory with it); a new one serves on.
    assert not os.path.exists(f"/proc/{before}") and limited.state.grammars.pid != before
    assert limited.state.grammars.wait_ready(60) and _ask(limited, _enum(1_000)).status_code == 200


def test_the_child_starts_with_the_server_and_its_death_is_named(limited: ServerThread,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    assert limited.state.grammars.pid is not None  # started with the server, before any structured request
    before = errors(limited)
    frame, receive = grammar.grammar_worker.frame, grammar.IsolatedCompiler._receive
    stopped: list[int] = []

    def held(message):  # the spec goes to a child that cannot answer it: no race with a fast compile
        if "spec" in message:
            stopped.append(limited.state.grammars.pid)
            os.kill(stopped[-1], signal.SIGSTOP)
        return frame(message)

    def dies_while_compiling(child, timeout_s: float):  # the spec is with the child: kill it
        if child.pid in stopped:
            os.kill(child.pid, signal.SIGKILL)
        return receive(child, timeout_s)

    monkeypatch.setattr(grammar.grammar_worker, "frame", held)
    monkeypatch.setattr(grammar.IsolatedCompiler, "_receive", staticmethod(dies_while_compiling))
    reply = _ask(limited, {"type": "string", "enum": [f"death {i}" for i in range(30)]})  # compiled by no one yet
    monkeypatch.undo()
    assert reply.status_code == 503 and reply.json()["error"]["code"] == "grammar_compiler_failed", reply.text
    assert "stopped (signal 9) while" in reply.json()["error"]["message"]
    deadline = time.monotonic() + 5  # the guard counts it once the response is out
    while errors(limited) != before + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert errors(limited) == before + 1  # the server's failure, counted as one
    assert limited.state.grammars.wait_ready(60)  # a new child was started
    assert _ask(limited, _enum(20)).status_code == 200


def test_the_engine_compiles_nothing(limited: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every compile in this process fails: the request still succeeds, its grammar compiled once,
    # by the child, and handed to the engine with the request.
    def refuse(*args, **kwargs):
        raise AssertionError("compiled in the server's process")

    monkeypatch.setattr(grammar.grammar_worker, "compile_spec", refuse)
    reply = _ask(limited, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert reply.status_code == 200, reply.text
