"""Route config, the load-aware schedule, drift detection and the memory plan: pure logic,
plus the scheduler applying the schedule as the batch fills and empties."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import torch

from specdec.config import SamplingParams, SpeculativeConfig
from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.server.config import DEFAULT_LOAD_SCHEDULE, DriftConfig, LoadSchedule, default_config, load_config
from specdec.server.memory import plan_memory
from specdec.server.metrics import AcceptanceDrift, ServerMetrics
from specdec.server.runtime import build_state
from specdec.server.scaleout import serve_replicas
from specdec.server.scheduler import ServerRequest, fork_drafter

CONFIG = """
max_model_len = 128
max_num_seqs = 3
cache_budget_mb = 64

[drift]
window = 8
baseline = 16
threshold = 0.3

[routes.interactive]
speculative = { method = "ngram", num_speculative_tokens = 4 }
max_num_speculative_tokens = 6
load_schedule = { 1 = 4, 2 = 2, 3 = 0 }

[routes.fixed]
speculative = { method = "ngram", num_speculative_tokens = 3 }
load_schedule = false

[routes.batch]
"""


def test_load_schedule_picks_the_last_threshold_reached() -> None:
    schedule = LoadSchedule.from_mapping({1: 4, 2: 4, 4: 2, 8: 0})
    assert [schedule.k_for(n) for n in (1, 2, 3, 4, 7, 8, 64)] == [4, 4, 4, 2, 2, 0, 0]
    default = LoadSchedule.from_mapping(DEFAULT_LOAD_SCHEDULE)
    assert [default.k_for(n) for n in (1, 2, 16)] == [4, 0, 0]
    assert LoadSchedule.from_mapping({"2": 3}).k_for(1) == 3
    with pytest.raises(ConfigError):
        LoadSchedule.from_mapping({0: 4})
    with pytest.raises(ConfigError):
        LoadSchedule.from_mapping({1: -1})


def test_toml_config(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(CONFIG)
    config = load_config(path, max_num_seqs=None)
    assert [r.name for r in config.routes] == ["interactive", "fixed", "batch"]
    interactive, fixed, batch = config.routes
    assert interactive.k == 4 and interactive.k_cap == 6 and interactive.load_schedule.k_for(2) == 2
    assert fixed.load_schedule is None and fixed.k_cap == 3
    assert batch.speculative is None and batch.k_cap == 0
    assert config.cache_budget_bytes == 64 << 20 and config.drift.window == 8
    assert load_config(path, max_num_seqs=5).max_num_seqs == 5
    assert config.threads is None and load_config(path, threads=2).threads == 2
    path.write_text("threads = 1\n" + CONFIG)
    assert load_config(path).threads == 1
    path.write_text("threads = 0\n" + CONFIG)
    with pytest.raises(ConfigError, match="threads"):
        load_config(path)
    assert config.backend == "auto" and config.dtype == "auto"
    path.write_text('backend = "hf"\ndtype = "float32"\n' + CONFIG)
    assert (load_config(path).backend, load_config(path).dtype) == ("hf", "float32")
    path.write_text('dtype = "int3"\n' + CONFIG)
    with pytest.raises(ConfigError, match="dtype must be one of"):
        load_config(path)
    path.write_text(CONFIG + "\n[routes.bad]\nspeculative = { method = 'magic' }\n")
    with pytest.raises(ConfigError, match="unknown speculative method"):
        load_config(path)
    path.write_text(CONFIG + "\n[routes.adaptive]\nspeculative = { method = 'ngram', adaptive = true }\n")
    assert load_config(path).route("adaptive").speculative.adaptive
    assert config.max_request_bytes == 4 << 20 and config.graceful_shutdown_s == 30
    path.write_text("max_request_bytes = 1024\ngraceful_shutdown_s = 0.5\n" + CONFIG)
    assert load_config(path).max_request_bytes == 1024 and load_config(path).graceful_shutdown_s == 0.5
    for bad in ("max_request_bytes = 0", "max_request_bytes = 1.5", "graceful_shutdown_s = -1", "graceful_shutdown_s = 'x'"):
        path.write_text(bad + "\n" + CONFIG)
        with pytest.raises(ConfigError, match=bad.split()[0]):
            load_config(path)
    path.write_text("max_model_len = 128\n")
    with pytest.raises(ConfigError, match="routes"):
        load_config(path)
    assert default_config().route("specdec").load_schedule.k_for(8) == 0


def test_replicas_table_maps_to_ray_serve_options(tmp_path: Path) -> None:
    path = tmp_path / "server.toml"
    path.write_text(CONFIG)
    assert load_config(path).replicas is None  # the single-process server is the default
    path.write_text(CONFIG + "\n[replicas]\nmin_replicas = 1\nmax_replicas = 4\ntarget_ongoing_requests = 3\n"
                    "downscale_delay_s = 10\ncpus_per_replica = 2\n")
    replicas = load_config(path).replicas
    assert replicas.autoscaling
    assert replicas.deployment_options(max_num_seqs=3, graceful_shutdown_s=7.0) == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 3,
                               "downscale_delay_s": 10},
        "max_ongoing_requests": 3, "ray_actor_options": {"num_cpus": 2, "num_gpus": 0.0}, "graceful_shutdown_timeout_s": 7.0}
    path.write_text(CONFIG + "\n[replicas]\nnum_replicas = 2\nmax_ongoing_requests = 5\n")
    options = load_config(path).replicas.deployment_options(max_num_seqs=3, graceful_shutdown_s=30)
    assert options["num_replicas"] == 2 and options["max_ongoing_requests"] == 5 and "autoscaling_config" not in options
    # `--replicas N` keeps the table's other settings and drops its autoscaling.
    fixed = replicas.with_count(3)
    assert not fixed.autoscaling and fixed.num_replicas == 3 and fixed.cpus_per_replica == 2
    for bad, message in (("num_replicas = 2\nmax_replicas = 3", "not both"), ("min_replicas = 1", "both min_replicas"),
                         ("min_replicas = 3\nmax_replicas = 2", "exceeds"), ("num_replicas = 0", "num_replicas"),
                         ("target_ongoing_requests = 2", "need\\(s\\) autoscaling"),
                         ("min_replicas = 1\nmax_replicas = 2\ndownscale_delay_s = -1", "downscale_delay_s"),
                         ("cpus_per_replica = 0", "cpus_per_replica"), ("replica_count = 2", "takes")):
        path.write_text(CONFIG + "\n[replicas]\n" + bad + "\n")
        with pytest.raises(ConfigError, match=message):
            load_config(path)


def test_drift_warns_when_acceptance_drops_and_recovers(caplog: pytest.LogCaptureFixture) -> None:
    drift = AcceptanceDrift(DriftConfig(window=8, baseline=16, threshold=0.4))
    changes = [drift.record(4, 3) for _ in range(6)]  # 24 tokens at 0.75: baseline and window full
    assert not drift.drifting and set(changes) == {None}
    assert [drift.record(4, 0) for _ in range(2)] == [None, True]  # the window drops to 0
    assert drift.window_rate == 0.0 and drift.baseline_rate == 0.75
    metrics = ServerMetrics(DriftConfig(window=8, baseline=16, threshold=0.4))
    metrics.add_route("r")
    with caplog.at_level(logging.WARNING):
        for accepted in [3] * 6 + [0] * 2:
            metrics.record_step("r", 4, accepted)
    assert "acceptance drift" in caplog.text
    assert metrics.drift.labels("r")._value.get() == 1
    for _ in range(8):  # the baseline catches up with the new level: no longer drift
        drift.record(4, 0)
    assert not drift.drifting


def test_tokens_per_second_is_the_last_ten_seconds() -> None:
    metrics = ServerMetrics(DriftConfig(window=8, baseline=16, threshold=0.4))
    metrics.add_route("a")
    metrics.add_route("b")
    gauge = metrics.tokens_per_second
    metrics.record_tokens("a", 30, now=100.0)
    metrics.record_tokens("a", 20, now=105.0)
    metrics.record_tokens("b", 7, now=105.0)
    assert (gauge.labels("a")._value.get(), gauge.labels("b")._value.get()) == (5.0, 0.7)
    metrics.record_tokens("a", 10, now=111.0)  # the first 30 left the window
    assert gauge.labels("a")._value.get() == 3.0
    metrics.refresh_rates(now=116.0)  # quiet routes decay on a refresh
    assert (gauge.labels("a")._value.get(), gauge.labels("b")._value.get()) == (1.0, 0.0)


def test_memory_plan_takes_the_draft_from_the_budget(tiny_model: LoadedModel, small_model_factory) -> None:
    from specdec.drafters.draft_model import DraftModelDrafter
    from specdec.drafters.ngram import NgramDrafter

    draft = small_model_factory(seed=3, vocab_size=16)
    per_token = 2 * 2 * 2 * 16 * 4  # keys and values, 2 layers, 2 kv heads, head_dim 16, fp32
    budget = 10 << 20
    separate = DraftModelDrafter(draft, added_memory_bytes=draft.weight_bytes())
    plan = plan_memory(tiny_model, [separate, separate, NgramDrafter(1, 3)], max_model_len=100, cache_budget_bytes=budget)
    assert plan.target_kv_bytes_per_token == per_token
    assert plan.draft_weight_bytes == draft.weight_bytes() > 0 and plan.draft_kv_bytes_per_token > 0  # counted once
    assert plan.max_sequences == (budget - plan.draft_weight_bytes) // (100 * (per_token + plan.draft_kv_bytes_per_token))
    assert plan.sequences_lost_to_draft == budget // (100 * per_token) - plan.max_sequences > 0
    itself = plan_memory(tiny_model, [DraftModelDrafter(tiny_model)], max_model_len=100, cache_budget_bytes=budget)
    assert itself.draft_weight_bytes == 0 and itself.draft_kv_bytes_per_token == per_token
    # layer_skip: no weights of its own, KV for the layers it runs only.
    half = plan_memory(tiny_model, [DraftModelDrafter(tiny_model, layers=[1])], max_model_len=100, cache_budget_bytes=budget)
    assert half.draft_weight_bytes == 0 and half.draft_kv_bytes_per_token == per_token // 2
    assert plan_memory(tiny_model, [NgramDrafter(1, 3)], 100, budget).sequences_lost_to_draft == 0


def test_fork_drafter_shares_weights_not_state(tiny_model: LoadedModel) -> None:
    from specdec.methods import build_drafter

    prototype = build_drafter(SpeculativeConfig("draft_model", 2, model=str(tiny_model.source)), tiny_model)
    fork = fork_drafter(prototype)
    assert fork is not prototype and fork.runner.backend is prototype.runner.backend
    fork.begin([1, 2, 3], 16)
    assert fork.cache is not None and prototype.cache is None


def test_scheduler_shortens_k_as_the_batch_fills_and_restores_it(tmp_path: Path, tiny_model: LoadedModel) -> None:
    path = tmp_path / "server.toml"
    path.write_text(CONFIG)
    state = build_state(load_config(path), loaded=tiny_model)  # the scheduler thread is not started
    scheduler = state.scheduler
    route = state.config.route("interactive")
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    requests = [ServerRequest(route, [1, 5, 9, 5, 9], params, route.k, lambda event: None, index=i) for i in range(3)]
    assert state.max_num_seqs == 3

    def step_with(active: list[ServerRequest]) -> list[int]:
        scheduler._drain(block=False)
        scheduler._drop_cancelled()
        scheduler._admit()
        scheduler._step()
        return [r.sequence.k for r in active]

    scheduler.submit(requests[0])
    assert step_with(requests[:1]) == [4]
    for request in requests[1:]:
        scheduler.submit(request)
    assert step_with(requests) == [0, 0, 0]  # 3 running: speculation off
    scheduler.cancel(requests[2])
    assert step_with(requests[:2]) == [2, 2]
    scheduler.cancel(requests[1])
    assert step_with(requests[:1]) == [4]  # load fell: speculation is back
    assert scheduler.running == 1 and state.metrics.current_k.labels("interactive")._value.get() == 4


def test_a_failing_step_fails_its_requests_and_the_scheduler_goes_on(tmp_path: Path, tiny_model: LoadedModel,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "server.toml"
    path.write_text(CONFIG)
    state = build_state(load_config(path), loaded=tiny_model)
    scheduler = state.scheduler
    route = state.config.route("batch")
    events = []
    request = ServerRequest(route, [1, 5, 9], SamplingParams(max_tokens=20, ignore_eos=True), 0, events.append)
    scheduler.submit(request)
    scheduler._drain(block=False)
    scheduler._admit()

    def broken_step() -> list:
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(scheduler.engine, "step", broken_step)
    scheduler._step()
    assert events[-1].kind == "error" and scheduler.running == 0 and scheduler.engine.cache.rows == 0
    monkeypatch.undo()
    again = ServerRequest(route, [1, 5, 9], SamplingParams(max_tokens=3, ignore_eos=True), 0, events.append)
    scheduler.submit(again)
    scheduler.start()
    deadline = time.monotonic() + 30
    while not (events[-1].kind == "done" and events[-1].finish_reason == "length") and time.monotonic() < deadline:
        time.sleep(0.02)
    scheduler.stop()
    assert events[-1].kind == "done" and events[-1].stats.generated_tokens == 3


def test_the_scheduler_thread_runs_with_the_configured_torch_threads(tmp_path: Path, tiny_model: LoadedModel) -> None:
    path = tmp_path / "server.toml"
    path.write_text("threads = 1\n" + CONFIG)
    state = build_state(load_config(path), loaded=tiny_model)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # what torch picks by itself on a two-core machine
    try:
        state.scheduler.start()
        deadline = time.monotonic() + 30
        while state.scheduler.torch_threads is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert state.scheduler.torch_threads == 1
    finally:
        state.scheduler.stop()
        torch.set_num_threads(before)


def test_auto_threads_leave_a_core_free_for_one_sequence_on_pytorch_and_use_all_on_the_kernels(
        tmp_path: Path, tiny_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "server.toml"
    path.write_text(CONFIG)
    scheduler = build_state(load_config(path), loaded=tiny_model).scheduler
    scheduler._all_threads = 4  # as on a four-core machine
    monkeypatch.setattr(scheduler.engine.target.backend, "kernel_path", "pytorch")
    assert [scheduler.threads_for(n) for n in (0, 1, 2, 8)] == [3, 3, 4, 4]
    monkeypatch.setattr(scheduler.engine.target.backend, "kernel_path", "avx2")
    assert [scheduler.threads_for(n) for n in (0, 1, 2, 8)] == [4, 4, 4, 4]
    scheduler._all_threads = 1
    assert scheduler.threads_for(1) == 1
    path.write_text("threads = 2\n" + CONFIG)
    fixed = build_state(load_config(path), loaded=tiny_model).scheduler
    assert [fixed.threads_for(n) for n in (1, 8)] == [2, 2]


def test_replicas_without_ray_installed_say_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed: importing it raises ImportError
    with pytest.raises(ConfigError, match=r"specdec\[ray\]"):
        serve_replicas(default_config(), None, device="cpu", backend="auto", dtype="auto",
                                host="127.0.0.1", port=8000)
