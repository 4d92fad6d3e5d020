"""The server against clients that misbehave at the connection: a body that never completes (a
short Content-Length, a chunked body without its end, a trickle) gets a 408 after
`request_body_timeout_s` and its connection closes; a client that leaves mid-body is counted as
an abort; one that leaves a non-streaming request is an abort without a traceback in the log; a
4 MiB prompt is refused for length before it is tokenized; connections past `max_connections`
get a 503, but for the health probes; a request head sent by halves or trickled gets a 408 after
`request_head_timeout_s` (slowloris)."""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from specdec.models import LoadedModel
from specdec.server.config import ServerConfig
from specdec.server.runtime import ServerThread, build_state
from tests.server.conftest import ROUTES
from tests.server.test_api import metrics

TIMEOUT_S = 1.5
BODY = json.dumps({"model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def guarded(tiny_model: LoadedModel) -> Iterator[ServerThread]:
    config = ServerConfig(routes=ROUTES, max_model_len=256, request_body_timeout_s=TIMEOUT_S, max_connections=4)
    running = ServerThread(build_state(config, loaded=tiny_model)).start()
    yield running
    running.stop()


def connect(server: ServerThread) -> socket.socket:
    host, port = server.url.split("//")[1].split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def answer(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(65536):  # until the server closes the connection
        data += chunk
    return data


def trickle(sock: socket.socket) -> None:
    """The body a byte every 0.3 s, until the server closes the connection."""
    sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY))
    try:
        for i in range(len(BODY)):
            sock.sendall(BODY[i : i + 1])
            time.sleep(0.3)
    except OSError:  # closed on us: what the test expects
        pass


@pytest.mark.parametrize("send", [
    lambda s: s.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % (len(BODY) + 10) + BODY),
    lambda s: s.sendall(HEAD + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(BODY) + BODY + b"\r\n"),
    trickle,
], ids=["short-content-length", "chunked-without-end", "trickle"])
def test_an_unfinished_body_gets_a_408_and_the_connection_closes(guarded: ServerThread, send) -> None:
    with connect(guarded) as sock:
        start = time.monotonic()
        send(sock)
        reply = answer(sock)
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    assert TIMEOUT_S - 0.1 <= time.monotonic() - start < TIMEOUT_S + 5


def test_a_client_that_leaves_mid_body_is_an_abort(guarded: ServerThread) -> None:
    def count(reason: str) -> float:
        return sum(v for (name, labels), v in metrics(guarded).items()
                   if name == "specdec_requests_total" and ("finish_reason", reason) in labels)

    aborts, rejected = count("abort"), count("rejected")
    with connect(guarded) as sock:
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(BODY) + BODY[:10])
        time.sleep(0.3)
    time.sleep(0.5)
    assert count("abort") == aborts + 1 and count("rejected") == rejected


def test_a_client_that_leaves_a_request_logs_no_traceback(guarded: ServerThread, caplog: pytest.LogCaptureFixture) -> None:
    body = json.dumps({"model": "plain", "prompt": "one two three", "max_tokens": 200, "ignore_eos": True}).encode()
    with caplog.at_level(logging.ERROR):
        with connect(guarded) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            time.sleep(0.3)
        time.sleep(1.5)  # the handler notices within 0.5 s
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def test_a_huge_prompt_is_refused_before_tokenizing(guarded: ServerThread) -> None:
    body = json.dumps({"model": "plain", "prompt": "word " * 800_000})  # 4 MB: 800k tokens if tokenized
    before, start = resident_mb(), time.monotonic()
    response = httpx.post(f"{guarded.url}/v1/completions", timeout=60, content=body,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in response.json()["error"]["message"] and time.monotonic() - start < 5
    assert resident_mb() - before < 100  # the server and this client share the process


def test_connections_past_the_limit_get_a_503_but_the_probes(guarded: ServerThread) -> None:
    idle = [connect(guarded) for _ in range(4)]
    try:
        time.sleep(0.2)
        assert httpx.get(f"{guarded.url}/v1/models", timeout=10).status_code == 503
        for probe in ("/health/live", "/health"):  # an orchestrator still sees the process serve
            assert httpx.get(f"{guarded.url}{probe}", timeout=10).status_code == 200, probe
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    assert httpx.get(f"{guarded.url}/v1/models", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def slow_heads(tiny_model: LoadedModel) -> Iterator[ServerThread]:
    config = ServerConfig(routes=ROUTES, max_model_len=256, request_head_timeout_s=1.0, max_connections=6)
    running = ServerThread(build_state(config, loaded=tiny_model)).start()
    yield running
    running.stop()


def read_all(sock: socket.socket) -> bytes:
    try:
        return answer(sock)
    except OSError:  # reset after the 408: what was read before it is lost, so say so
        return b"reset"


def test_half_sent_headers_are_cut_and_never_lock_out_the_probes(slow_heads: ServerThread) -> None:
    # Slowloris: more half-sent heads than connection slots. The probes are still answered, the
    # heads get a 408 within their timeout, and the slots are free again.
    socks = [connect(slow_heads) for _ in range(8)]
    for sock in socks:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    time.sleep(0.3)
    assert httpx.get(f"{slow_heads.url}/health/live", timeout=10).status_code == 200
    assert httpx.get(f"{slow_heads.url}/v1/models", timeout=10).status_code == 503
    start = time.monotonic()
    for sock in socks:
        assert read_all(sock).startswith(b"HTTP/1.1 408")
        sock.close()
    assert time.monotonic() - start < 3
    assert httpx.get(f"{slow_heads.url}/v1/models", timeout=10).status_code == 200


def test_a_trickled_head_is_cut(slow_heads: ServerThread) -> None:
    sock = connect(slow_heads)
    start = time.monotonic()
    head = b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 200
    try:
        for i in range(len(head)):  # a byte every 0.1 s: 25 s for the whole head
            sock.sendall(head[i : i + 1])
            time.sleep(0.1)
            if time.monotonic() - start > 5:
                break
    except OSError:  # closed on us: what the test expects
        pass
    assert time.monotonic() - start < 3
    got = read_all(sock)
    assert got == b"reset" or got.startswith(b"HTTP/1.1 408"), got
    sock.close()
    # A head that arrives in time, even in pieces, is served.
    with connect(slow_heads) as sock:
        for part in (b"GET /health/live HTTP/1.1\r\n", b"Host: 127.0.0.1\r\n", b"Connection: close\r\n\r\n"):
            sock.sendall(part)
            time.sleep(0.2)
        assert answer(sock).startswith(b"HTTP/1.1 200")
