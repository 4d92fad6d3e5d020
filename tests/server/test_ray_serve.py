"""`specdec serve --replicas 2` as a user runs it: a local Ray cluster with two replicas of the
default model (one torch thread each) behind Ray Serve's proxy. Requests spread over both and
each replica's metrics are scraped from its own port; `specdec doctor` given the front diagnoses
each replica; greedy outputs (plain, speculative, streamed chat) are those of the single-process
server; a client that leaves mid-stream frees its sequence; a replica killed mid-stream ends
that stream with an error at once, the other keeps serving, Ray replaces the dead one, and
later requests reach the new one. On SIGTERM the whole deployment shuts down and the command
exits 0. (Autoscaling, on a cluster started beforehand: test_ray_cluster.py.)

Two cores cannot show throughput scaling: the two replicas share them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from specdec.models import LoadedModel
from specdec.server.config import load_config
from specdec.server.metrics import sample_value, samples_by_name
from specdec.server.runtime import ServerThread, build_state

# `make test` runs Ray's tests after the others, alone: `ray stop` ends every Ray process of
# the machine, and replicas must not compete with another test worker for the two cores.
pytestmark = pytest.mark.ray

pytest.importorskip("ray.serve", reason="the Ray Serve tests need specdec[ray] (make setup installs it)")

from test_cli_serve import cli_env, free_port  # noqa: E402  (after the skip)

CONFIG = """
max_model_len = 512
max_num_seqs = 4
graceful_shutdown_s = 5

[routes.spec]
speculative = { method = "ngram", num_speculative_tokens = 3 }
load_schedule = false

[routes.plain]
"""

PROMPTS = [
    "Write a Python function that returns the factorial of n.",
    "List three facts about the Moon.",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "Explain what a hash table is in one paragraph.",
]


def wait_ready(url: str, process: subprocess.Popen[bytes], replicas: int, timeout: float) -> None:
    """Until the replicas are listed (Serve's proxy answers before its replicas are up)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"specdec serve --replicas exited: {process.stdout.read().decode()[-4000:]}")
        try:
            if len(httpx.get(f"{url}/replicas", timeout=5).json()) == replicas:
                return
        except (httpx.HTTPError, ValueError, TypeError):
            pass
        time.sleep(1)
    raise TimeoutError("the replicas did not come up")


@contextmanager
def serve_replicas(config_text: str, directory: Path, *args: str, ready: int = 2) -> Iterator[str]:
    """`specdec serve` with Ray replicas in a subprocess; on leaving, SIGTERM and a clean exit."""
    config = directory / "server.toml"
    config.write_text(config_text)
    port = free_port()
    env = cli_env(RAY_USAGE_STATS_ENABLED="0")
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen([sys.executable, "-m", "specdec.cli.main", "serve", *args,
                                "--config", str(config), "--port", str(port)],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, process, ready, timeout=300)
        yield url
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=120)
        assert process.returncode == 0, output.decode()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
            subprocess.run([str(Path(sys.executable).parent / "ray"), "stop", "--force"], capture_output=True,
                           check=False)


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serve_replicas(CONFIG, tmp_path_factory.mktemp("ray"), "--replicas", "2") as url:
        yield url


@pytest.fixture(scope="module")
def single_process(default_model: LoadedModel, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("single") / "server.toml"
    path.write_text(CONFIG)
    server = ServerThread(build_state(load_config(path), loaded=default_model)).start()
    yield server.url
    server.stop()


def listed(url: str) -> dict[str, str]:
    """replica id -> its operations address, from the front's service discovery."""
    return {t["labels"]["replica"]: t["targets"][0] for t in httpx.get(f"{url}/replicas", timeout=10).json()}


def complete(url: str, model: str, prompt: str, max_tokens: int = 24) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def _finished(address: str, route: str, reason: str | None = None) -> float:
    """Sequences of the route that replica finished (for that reason, or any)."""
    text = httpx.get(f"http://{address}/metrics", timeout=10).text
    samples = samples_by_name(text_string_to_metric_families(text))
    return sum(v for labels, v in samples.get("specdec_requests_total", [])
               if labels["route"] == route and reason in (None, labels["finish_reason"]))


def test_requests_spread_over_both_replicas_and_each_is_scraped(replicas: str) -> None:
    targets = listed(replicas)
    assert len(targets) == 2
    before = {replica: _finished(address, "spec") for replica, address in targets.items()}
    with ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda i: complete(replicas, "spec", PROMPTS[i % 4], 16), range(8)))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    served = [r.headers["x-specdec-replica"] for r in responses]
    assert set(served) == set(targets), served
    # Each replica's own /metrics counts exactly the requests that replica answered.
    for replica, address in targets.items():
        assert _finished(address, "spec") - before[replica] == served.count(replica)
        health = httpx.get(f"http://{address}/health", timeout=10).json()
        assert health["replica"] == replica and health["threads"] == 1 and health["status"] == "ok"
        assert httpx.get(f"http://{address}/v1/models", timeout=10).status_code == 404  # operations only
    metrics = httpx.get(f"http://{next(iter(targets.values()))}/metrics", timeout=10).text
    assert sample_value(samples_by_name(text_string_to_metric_families(metrics)), "specdec_max_concurrent_sequences",
                        with_draft="true") >= 1


def test_doctor_given_the_front_diagnoses_every_replica(replicas: str, tmp_path: Path) -> None:
    out = tmp_path / "doctor.json"
    done = subprocess.run([sys.executable, "-m", "specdec.cli.main", "doctor", "--url", replicas, "--json", str(out)],
                          capture_output=True, text=True, check=False, timeout=120,
                          env=cli_env())
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 replica(s) on Ray Serve" in done.stdout
    reports = json.loads(out.read_text())
    assert sorted((r["replica"], r["route"]) for r in reports) == sorted(
        (replica, route) for replica in listed(replicas) for route in ("spec", "plain"))


def test_greedy_outputs_are_those_of_the_single_process_server(replicas: str, single_process: str) -> None:
    for route in ("spec", "plain"):
        for prompt in PROMPTS:
            ours, reference = complete(replicas, route, prompt), complete(single_process, route, prompt)
            assert ours.status_code == reference.status_code == 200
            assert ours.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"], (route, prompt)

    def chat(url: str) -> str:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        stream = client.chat.completions.create(model="spec", messages=[{"role": "user", "content": PROMPTS[1]}],
                                                max_tokens=32, temperature=0, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    streamed = chat(replicas)
    assert streamed and streamed == chat(single_process)


def test_a_client_that_leaves_frees_its_sequence_on_the_replica(replicas: str) -> None:
    addresses = listed(replicas)
    body = {"model": "plain", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{replicas}/v1/completions", json=body, timeout=60) as response:
        address = addresses[response.headers["x-specdec-replica"]]
        aborted = _finished(address, "plain", "abort")
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: {")
            if chunks == 3:
                break  # and close the connection: Ray's proxy cancels the replica's handler
    deadline = time.monotonic() + 10
    while httpx.get(f"http://{address}/health", timeout=10).json()["running"] > 0:
        assert time.monotonic() < deadline, "the sequence kept running after its client left"
        time.sleep(0.2)
    assert _finished(address, "plain", "abort") == aborted + 1


def listening_pid(address: str) -> int:
    """The process listening on a replica's operations address (/health shows no pid)."""
    port = int(address.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections(kind="tcp")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid is not None)


def test_a_killed_replica_fails_its_stream_and_is_replaced(replicas: str) -> None:
    targets = listed(replicas)
    pids = {replica: listening_pid(address) for replica, address in targets.items()}
    body = {"model": "plain", "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True,
            "temperature": 0}
    chunks = 0
    with httpx.stream("POST", f"{replicas}/v1/completions", json=body, timeout=60) as response:
        victim = response.headers["x-specdec-replica"]
        with pytest.raises(httpx.RemoteProtocolError):  # cut off: an error, not a hang, not a clean end
            for line in response.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    os.kill(pids[victim], signal.SIGKILL)
                    killed = time.monotonic()
    assert time.monotonic() - killed < 30
    survivor = next(r for r in targets if r != victim)
    # The other replica keeps serving while Ray starts a new one.
    for prompt in PROMPTS:
        response = complete(replicas, "spec", prompt, 8)
        assert response.status_code == 200 and response.headers["x-specdec-replica"] == survivor
    deadline = time.monotonic() + 240
    while len(now := listed(replicas)) < 2:
        assert time.monotonic() < deadline, f"no replacement replica: {now}"
        time.sleep(1)
    (replacement,) = set(now) - {survivor}
    assert replacement != victim
    seen = set()
    for i in range(40):  # later requests succeed, on both the survivor and the replacement
        response = complete(replicas, "spec", PROMPTS[i % 4], 4)
        assert response.status_code == 200
        seen.add(response.headers["x-specdec-replica"])
        if seen == {survivor, replacement}:
            break
    assert seen == {survivor, replacement}

