"""`specdec serve` as a user runs it: a subprocess that answers /health once ready, serves a
streaming request, and on SIGTERM finishes the request in flight and exits cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx

from specdec.server.runtime import wait_healthy

CONFIG = """
max_model_len = 256
max_num_seqs = 2
graceful_shutdown_s = 20

[routes.tiny]
speculative = { method = "ngram", num_speculative_tokens = 3 }
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_then_sigterm_finishes_the_request_in_flight(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = tmp_path / "server.toml"
    config.write_text(CONFIG)
    port = _free_port()
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    process = subprocess.Popen(
        [sys.executable, "-m", "specdec.cli.main", "serve", "--model", str(tiny_model_dir), "--config", str(config),
         "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=120)
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["id"] == "tiny"
        body = {"model": "tiny", "prompt": "one two three", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line)
            assert first.startswith("data: {")
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        finish = json.loads(rest[-2][len("data: "):])["choices"][0]
        assert finish["finish_reason"] == "length" and finish["speculation"]["generated_tokens"] == 120
        output, _ = process.communicate(timeout=60)
        # uvicorn shuts down in order, then re-raises SIGTERM so the exit status says why it stopped.
        assert process.returncode in (0, -signal.SIGTERM), output.decode()
        assert b"Application shutdown complete" in output and b"Traceback" not in output
        assert b"memory: target weights" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
