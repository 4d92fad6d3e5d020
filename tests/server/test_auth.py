"""API keys and the Host check: a server with keys answers only requests that carry one (OpenAI's
Bearer header, as the official client sends it) but its liveness probe; a server bound to
loopback answers only to loopback names (a DNS-rebound page cannot reach it); the config and the
doctor take keys."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import httpx
import openai
import pytest

from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.server.config import RouteConfig, ServerConfig, config_from_dict
from specdec.server.doctor import fetch
from specdec.server.guard import allowed_hosts
from specdec.server.runtime import ServerThread, build_state

KEYS = ("sk-first-key-0001", "sk-second-key-0002")


@pytest.fixture(scope="module")
def keyed(tiny_model: LoadedModel) -> Iterator[ServerThread]:
    config = ServerConfig(routes=(RouteConfig("plain"),), max_model_len=128, max_num_seqs=2, api_keys=KEYS)
    running = ServerThread(build_state(config, loaded=tiny_model)).start()  # waits on /health/live: no key needed
    yield running
    running.stop()


def test_only_a_request_with_a_key_is_answered(keyed: ServerThread) -> None:
    for key in KEYS:  # either key, through the official client
        client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=key, max_retries=0)
        assert client.completions.create(model="plain", prompt="Hi", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="sk-wrong-key-0000", max_retries=0).models.list()
    for path in ("/v1/models", "/health", "/metrics", "/dashboard"):
        for headers in ({}, {"Authorization": "Bearer sk-wrong-key-0000"}, {"Authorization": f"Basic {KEYS[0]}"},
                        {"Authorization": f"Bearer {KEYS[0]}x"}):
            response = httpx.get(f"{keyed.url}{path}", headers=headers, timeout=10)
            assert response.status_code == 401, (path, headers)
            assert response.json()["error"]["code"] == "invalid_api_key"
            assert response.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{keyed.url}/health", headers={"Authorization": f"Bearer {KEYS[1]}"}).json()["status"] == "ok"
    # The liveness probe alone answers without a key, and says no more than that.
    assert httpx.get(f"{keyed.url}/health/live").json() == {"status": "ok"}


def test_a_request_to_another_host_name_is_refused(keyed: ServerThread) -> None:
    # Bound to 127.0.0.1: a browser on this machine whose page rebinds its own name to 127.0.0.1
    # sends that name as Host, and is refused; the loopback names are answered.
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    bad = httpx.get(f"{keyed.url}/health/live", headers={"Host": f"attacker.example:{keyed.port}"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_host"
    for host in (f"localhost:{keyed.port}", f"127.0.0.1:{keyed.port}", "localhost"):
        assert httpx.get(f"{keyed.url}/health", headers={"Host": host, **auth}).status_code == 200, host


def test_which_host_names_a_bind_address_answers() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert "localhost" in allowed_hosts(host) and host.strip("[]") in allowed_hosts(host)
    for host in ("0.0.0.0", "192.0.2.10", "::", "example.org"):
        assert allowed_hosts(host) is None  # reachable by other names on purpose: no allow-list
    assert allowed_hosts(None) is None


def test_keys_in_the_config() -> None:
    routes = {"routes": {"plain": {}}}
    assert config_from_dict(routes | {"api_keys": list(KEYS)}).api_keys == KEYS
    for bad in (["short"], ["has a space in it"], [7], "sk-not-a-list-0001"):
        with pytest.raises(ConfigError, match="api_keys"):
            config_from_dict(routes | {"api_keys": bad})


def test_the_doctor_sends_the_key(keyed: ServerThread) -> None:
    metrics, health = fetch(keyed.url, api_key=KEYS[0])
    assert "specdec_running_sequences" in metrics and health["status"] == "ok"
    with pytest.raises(ConfigError, match="--api-key"):
        fetch(keyed.url)


def test_a_server_without_keys_asks_for_none(tiny_server: ServerThread) -> None:
    assert httpx.get(f"{tiny_server.url}/v1/models").status_code == 200
    assert httpx.get(f"{tiny_server.url}/health/live").json() == {"status": "ok"}
    host, port = tiny_server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as raw:  # HTTP/1.0, no Host: no browser's
        raw.sendall(b"GET /health/live HTTP/1.0\r\n\r\n")
        assert raw.recv(64).startswith(b"HTTP/1.1 200")


def _raw(server: ServerThread, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(request)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return reply


def test_two_host_headers_are_refused_and_probes_answer_head(keyed: ServerThread) -> None:
    # RFC 9112 3.2: a request with more than one Host header is a 400, whatever the names.
    twice = _raw(keyed, b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert twice.startswith(b"HTTP/1.1 400") and b"invalid_host" in twice and b"more than one Host" in twice
    once = _raw(keyed, b"GET /health/live HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
    assert once.startswith(b"HTTP/1.1 200")
    # Load balancers' probes ask with HEAD: the same status as GET, and no body.
    head = httpx.head(f"{keyed.url}/health/live", timeout=10)
    assert head.status_code == 200 and head.content == b""
    auth = {"Authorization": f"Bearer {KEYS[0]}"}
    assert httpx.head(f"{keyed.url}/health", headers=auth, timeout=10).status_code == 200
    assert httpx.head(f"{keyed.url}/health", timeout=10).status_code == 401
