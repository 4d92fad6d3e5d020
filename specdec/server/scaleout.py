"""Scale-out on Ray Serve: `specdec serve --replicas N` (or a `[replicas]` table in the config)
runs N engine replicas as one Ray Serve deployment behind Ray's HTTP proxy. Each replica is the
single-process server's app over its own model, batch and scheduler thread, so the routes, their
speculative policies, streaming, errors and limits are the same; Ray's router spreads requests
over the replicas, replaces one that dies or fails its health check, and (with autoscaling
bounds) adds and removes replicas on its target of ongoing requests per replica.

Metrics: per-replica scraping, not Ray's metrics export. specdec's metrics are prometheus_client
metrics in a registry of each replica's own; exporting them through Ray would mean declaring each
again as a `ray.util.metrics` metric and running Ray's metrics agent. Instead each replica also
serves an operations port of its own (GET `/metrics`, `/health`, `/dashboard`, `/dashboard/data`)
and registers its address in a small directory actor. `GET /replicas` on the front answers with
every live replica's operations address in Prometheus's HTTP service-discovery format, for
`http_sd_configs`; `specdec doctor --url` and the dashboard take one replica's address. (Through
the front, `/metrics`, `/health` and `/dashboard` answer for whichever replica Ray picks.)

Ray is an optional dependency (`pip install specdec[ray]`): nothing here imports it at module level.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import signal
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.types import Receive, Scope, Send

from specdec.errors import ConfigError
from specdec.server.app import ServerState, create_app
from specdec.server.config import ReplicaConfig, ServerConfig
from specdec.server.runtime import build_state

log = logging.getLogger(__name__)

APP_NAME = "specdec"
NAMESPACE = "specdec"
DIRECTORY = "specdec-replica-directory"
OPS_PATHS = ("/metrics", "/health", "/health/live", "/dashboard")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _ray() -> Any:
    try:
        import ray
        from ray import serve  # noqa: F401  (the serve extra)
    except ImportError:
        raise ConfigError("--replicas runs on Ray Serve: pip install 'specdec[ray]' (ray[serve]==2.58.0)") from None
    return ray


class ReplicaDirectory:
    """A Ray actor: each replica's operations address, by replica id."""

    def __init__(self) -> None:
        self.replicas: dict[str, str] = {}

    def add(self, replica: str, address: str) -> None:
        self.replicas[replica] = address

    def remove(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    def all(self) -> dict[str, str]:
        return dict(self.replicas)


class OpsOnly:
    """The app restricted to its read-only operations paths (a replica's operations port)."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] == "http" and not any(path == p or path.startswith(p + "/") for p in OPS_PATHS):
            await JSONResponse({"error": {"message": f"{path} is served on the front, not on a replica's "
                                                     "operations port", "type": "invalid_request_error"}},
                               status_code=404)(scope, receive, send)
            return
        await self.app(scope, receive, send)


async def _reachable(address: str, timeout: float = 1.0) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


class SpecdecReplica:
    """One replica of the deployment: the server's state and app (built by Serve through
    `__serve_build_asgi_app__`, its lifespan run by Serve) and its operations port."""

    def __init__(self, config: ServerConfig, model: str | None, device: str, backend: str, dtype: str,
                 ops_host: str) -> None:
        import ray
        from ray import serve

        replicas = config.replicas or ReplicaConfig()
        if config.threads is None:  # one torch thread per Ray CPU the replica holds
            config = dataclasses.replace(config, threads=max(1, math.ceil(replicas.cpus_per_replica)))
        self.replica = serve.get_replica_context().replica_id.unique_id
        self.state: ServerState = build_state(config, model, device=device, backend=backend, dtype=dtype)
        self.state.replica = self.replica
        host = ops_host or ray.util.get_node_ip_address()
        ops = uvicorn.Config(OpsOnly(create_app(self.state)), host=host, port=0, lifespan="off", log_level="warning")
        self.ops = uvicorn.Server(ops)
        thread = threading.Thread(target=self.ops.run, name="specdec-ops", daemon=True)
        thread.start()
        while not self.ops.started:
            if not thread.is_alive():
                raise RuntimeError(f"replica {self.replica}: its operations port on {host} did not start")
            time.sleep(0.02)
        port = self.ops.servers[0].sockets[0].getsockname()[1]
        self.address = f"{host}:{port}"
        self.directory = ray.get_actor(DIRECTORY, namespace=NAMESPACE)
        ray.get(self.directory.add.remote(self.replica, self.address))
        log.info("replica %s: operations port %s", self.replica, self.address)

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = create_app(self.state)
        app.add_api_route("/replicas", self.replicas, methods=["GET"])
        return app

    async def replicas(self) -> JSONResponse:
        """Every live replica's operations address, as Prometheus HTTP service discovery wants it."""
        known: dict[str, str] = await self.directory.all.remote()
        alive = await asyncio.gather(*(_reachable(address) for address in known.values()))
        targets = []
        for (replica, address), up in zip(known.items(), alive):
            if up:
                targets.append({"targets": [address], "labels": {"replica": replica}})
            else:  # its process is gone (killed, or scaled down): forget it
                self.directory.remove.remote(replica)
        return JSONResponse(targets)

    async def check_health(self) -> None:
        """Serve's health check: a replica whose scheduler thread died is replaced."""
        if not self.state.scheduler.alive and not self.state.shutting_down:
            raise RuntimeError(f"replica {self.replica}: the scheduler thread is not running")


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise ConfigError(f"cannot serve on {host}:{port}: {exc.strerror}") from None


def serve_replicas(config: ServerConfig, model: str | None, *, device: str, backend: str, dtype: str, host: str,
                   port: int, ray_address: str | None = None, on_ready: Any = None) -> None:
    """Run the deployment until SIGINT or SIGTERM; then shut it down (replicas get the
    config's graceful_shutdown_s for requests in flight)."""
    ray = _ray()
    from ray import serve

    replicas = config.replicas or ReplicaConfig()
    if device != "cpu" and not replicas.gpus_per_replica:
        raise ConfigError(f"--device {device} with replicas: set gpus_per_replica in [replicas] (Ray reserves them)")
    local = ray_address is None
    if local:
        _check_port_free(host, port)
        # The replicas read this machine's files: check the model and config here first, with the
        # single-process server's errors, rather than as a replica's failure after Ray's start.
        build_state(config, model, device=device, backend=backend, dtype=dtype)
        ray.init(namespace=NAMESPACE, include_dashboard=False, logging_level=logging.WARNING)
    else:
        ray.init(address=ray_address, namespace=NAMESPACE, logging_level=logging.WARNING)
    directory = ray.remote(ReplicaDirectory).options(name=DIRECTORY, namespace=NAMESPACE, num_cpus=0,
                                                     get_if_exists=True).remote()
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        serve.start(http_options={"host": host, "port": port}, proxy_location="HeadOnly")
        options = replicas.deployment_options(config.max_num_seqs, config.graceful_shutdown_s)
        deployment = serve.deployment(serve.ingress()(SpecdecReplica), name=APP_NAME,
                                      # a replica that cannot load its model fails again: say so soon
                                      max_constructor_retry_count=2, **options)
        ops_host = "127.0.0.1" if host in LOOPBACK else ""
        try:
            serve.run(deployment.bind(config, model, device, backend, dtype, ops_host), name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # Serve's "deploying failed"; the replicas' errors are logged above
            raise ConfigError(f"the replicas did not start: {exc}") from None
        if on_ready is not None:
            on_ready(ray.get(directory.all.remote()))
        while not stop.wait(1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        log.info("shutting down the replicas")
        try:
            if local:
                serve.shutdown()
            else:
                serve.delete(APP_NAME)
            ray.kill(directory)
        finally:
            ray.shutdown()
