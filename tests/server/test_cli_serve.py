"""`specdec serve` as a user runs it: a subprocess that answers /health once ready, serves a
streaming request, and on SIGTERM finishes the request in flight and exits cleanly; past the
grace, every request still in flight ends with finish_reason "abort", and it still exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from specdec.server.runtime import wait_healthy
from tests.conftest import _tiny_llama, tiny_tokenizer

CONFIG = """
max_model_len = 256
max_num_seqs = 2
graceful_shutdown_s = 20

[routes.tiny]
speculative = { method = "ngram", num_speculative_tokens = 3 }
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cli_env(**extra: str) -> dict[str, str]:
    """The environment of a `python -m specdec.cli.main` subprocess: this checkout importable."""
    return os.environ | {"PYTHONPATH": str(Path(__file__).resolve().parents[2])} | extra


def _serve(model_dir: Path, tmp_path: Path, config_text: str, **env_extra: str) -> tuple[subprocess.Popen[bytes], str]:
    config = tmp_path / "server.toml"
    config.write_text(config_text)
    port = free_port()
    env = cli_env(OMP_NUM_THREADS="1", **env_extra)
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli.main", "serve", "--model", str(model_dir), "--config", str(config),
         "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model made wide (hidden 768, 4 layers: ~100 MB of float32 weights), so that a
    request takes a few seconds: the tiny tokenizer, random weights."""
    path = tmp_path_factory.mktemp("wide-llama")
    tokenizer = tiny_tokenizer()
    _tiny_llama(len(tokenizer), seed=5, hidden=768, layers=4, eos=tokenizer.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_serve_then_sigterm_finishes_the_request_in_flight(wide_model_dir: Path, tmp_path: Path) -> None:
    # The process takes its API key from SPECDEC_API_KEY (as `specdec serve --api-key` would).
    process, url = _serve(wide_model_dir, tmp_path, CONFIG, SPECDEC_API_KEY="sk-serve-test-key")
    auth = {"Authorization": "Bearer sk-serve-test-key"}
    try:
        wait_healthy(url, timeout=120)  # the liveness probe: no key
        assert httpx.get(f"{url}/v1/models").status_code == 401
        assert httpx.get(f"{url}/v1/models", headers=auth).json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "one two three", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: {")
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finish = json.loads(rest[-2][len("data: "):])["choices"][0]
        assert finish["finish_reason"] == "length" and finish["speculation"]["generated_tokens"] == 120
        output, _ = process.communicate(timeout=60)
        assert process.returncode == 0, output.decode()
        assert b"Application shutdown complete" in output and b"Traceback" not in output
        assert b"memory: target weights" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


SHORT_GRACE = """
max_model_len = 512
max_num_seqs = 1
graceful_shutdown_s = 0.3

[routes.tiny]
"""


def test_sigterm_past_the_grace_aborts_every_request_cleanly(wide_model_dir: Path, tmp_path: Path) -> None:
    process, url = _serve(wide_model_dir, tmp_path, SHORT_GRACE)
    # One row: the first request runs (seconds for 480 tokens), the others wait; all outlast the grace.
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 480, "ignore_eos": True}
    streamed: list[list[str]] = []
    whole: list[httpx.Response] = []

    def stream() -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, timeout=60) as response:
            streamed.append([line for line in response.iter_lines() if line])

    def post() -> None:
        chat = {key: value for key, value in body.items() if key != "prompt"} | {"messages": [{"role": "user", "content": "hi"}]}
        whole.append(httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60))

    try:
        wait_healthy(url, timeout=120)
        clients = [threading.Thread(target=stream), threading.Thread(target=post), threading.Thread(target=stream)]
        for client in clients:
            client.start()
            time.sleep(0.2)
        deadline = time.monotonic() + 20  # a loaded machine may take a while to take the requests in
        while (health := httpx.get(f"{url}/health").json())["waiting"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health["running"] == 1 and health["waiting"] == 2, health
        process.send_signal(signal.SIGTERM)
        for client in clients:
            client.join(30)
        output, _ = process.communicate(timeout=30)
        text = output.decode()
        assert process.returncode == 0, text
        assert "Traceback" not in text and "Application shutdown complete" in text
        assert len(streamed) == 2 and len(whole) == 1
        for lines in streamed:
            assert lines[-1] == "data: [DONE]", lines[-3:]
            last = json.loads(lines[-2][len("data: "):])["choices"][0]
            assert last["finish_reason"] == "abort", last
        assert whole[0].status_code == 200, whole[0].text
        choice = whole[0].json()["choices"][0]
        assert choice["finish_reason"] == "abort" and whole[0].json()["usage"]["completion_tokens"] == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
