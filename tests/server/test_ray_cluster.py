"""`specdec serve --ray-address` on a Ray cluster started beforehand (`ray start --head`), with
autoscaling bounds from the config's [replicas] table: one replica idle, a second under load,
back to one when idle; on SIGTERM only specdec's application leaves the cluster."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# `make test` runs Ray's tests after the others, alone: `ray stop` ends every Ray process of
# the machine, and replicas must not compete with another test worker for the two cores.
pytestmark = pytest.mark.ray

pytest.importorskip("ray.serve", reason="the Ray Serve tests need specdec[ray] (make setup installs it)")

from test_cli_serve import free_port  # noqa: E402  (after the skip)
from test_ray_serve import complete, listed, serve_replicas  # noqa: E402

RAY = str(Path(sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A one-node Ray cluster of 2 CPUs; stopped (every Ray process of this machine) afterwards."""
    port = free_port()
    started = subprocess.run([RAY, "start", "--head", f"--port={port}", "--num-cpus=2", "--disable-usage-stats",
                              "--include-dashboard=false"], capture_output=True, text=True, check=False, timeout=120)
    assert started.returncode == 0, started.stdout + started.stderr
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([RAY, "stop", "--force"], capture_output=True, check=False, timeout=120)


AUTOSCALING = """
max_model_len = 512
max_num_seqs = 4

[routes.plain]

[replicas]
min_replicas = 1
max_replicas = 2
target_ongoing_requests = 1
upscale_delay_s = 2
downscale_delay_s = 5
"""


def test_autoscaling_bounds_from_the_config_add_and_remove_a_replica(cluster: str, tmp_path: Path) -> None:
    with serve_replicas(AUTOSCALING, tmp_path, "--ray-address", cluster, ready=1) as url:
        assert len(listed(url)) == 1
        stop = threading.Event()
        statuses: list[int] = []

        def load() -> None:  # four requests at a time against a target of one per replica
            while not stop.is_set():
                statuses.append(complete(url, "plain", "Once upon a time", 64).status_code)

        clients = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for client in clients:
            client.start()
        try:
            deadline = time.monotonic() + 180
            while len(listed(url)) < 2:
                assert time.monotonic() < deadline, "no second replica under load"
                time.sleep(1)
        finally:
            stop.set()
            for client in clients:
                client.join(120)
        assert statuses and set(statuses) == {200}
        deadline = time.monotonic() + 180
        while len(listed(url)) > 1:
            assert time.monotonic() < deadline, "the idle deployment kept its second replica"
            time.sleep(1)
    # SIGTERM removed specdec's application, not the cluster.
    status = subprocess.run([RAY, "status", f"--address={cluster}"], capture_output=True, text=True, check=False)
    assert status.returncode == 0, status.stdout + status.stderr
