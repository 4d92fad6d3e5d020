"""`specdec doctor` against real servers put into each condition on purpose: a random draft model
(acceptance low), a long k over prompt lookup (k too long), a fixed k while several sequences run
(batches full) and a load schedule that switches speculation off, repetitive traffic then
free text (drifting), and a draft whose memory leaves requests waiting (draft memory)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import openai
import pytest
from typer.testing import CliRunner

from specdec.cli.main import app
from specdec.config import SpeculativeConfig
from specdec.methods import build_drafter
from specdec.models import LoadedModel
from specdec.server.config import DriftConfig, LoadSchedule, RouteConfig, ServerConfig
from specdec.server.doctor import DEFAULT_VERIFY_COSTS, RouteReport, best_k, diagnose, fetch, verify_cost
from specdec.server.memory import plan_memory
from specdec.server.runtime import ServerThread, build_state

pytestmark = pytest.mark.real

REPEAT = "Repeat this line ten times: the cat sat on the mat and the dog sat on the log."
FREE = ["Write a haiku about autumn leaves.", "Name three rivers in Africa.", "Why is the sky blue? One sentence.",
        "Invent a name for a new fruit.", "What is 17 times 3?", "Describe a sunrise in five words."]


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _chat(server: ServerThread, route: str, text: str, max_tokens: int, ignore_eos: bool = False) -> None:
    _client(server).chat.completions.create(model=route, messages=[{"role": "user", "content": text}],
                                            max_tokens=max_tokens, temperature=0,
                                            extra_body={"ignore_eos": True} if ignore_eos else None)


# The logic tests hold a curve of their own (a CPU's, measured with PyTorch's int4 kernels), so
# that a change of the shipped default, measured on newer kernels, does not move their premises.
STEEP_COSTS = {1: 1.0, 2: 1.09, 3: 1.22, 4: 1.35, 5: 1.81, 6: 1.91, 7: 2.01, 8: 2.15, 9: 2.66}


def _reports(server: ServerThread) -> dict[str, RouteReport]:
    return {r.route: r for r in diagnose(*fetch(server.url), STEEP_COSTS)}


def _causes(report: RouteReport) -> set[str]:
    return {f.cause for f in report.findings}


@pytest.fixture(scope="module")
def lookup_server(default_model: LoadedModel) -> Iterator[ServerThread]:
    routes = (
        RouteConfig("long-k", SpeculativeConfig("ngram", 8, prompt_lookup_min=1)),
        RouteConfig("fixed", SpeculativeConfig("ngram", 3)),
        RouteConfig("scheduled", SpeculativeConfig("ngram", 3), LoadSchedule.from_mapping({1: 3, 2: 0})),
        RouteConfig("drift", SpeculativeConfig("ngram", 3)),
        RouteConfig("plain"),
    )
    config = ServerConfig(routes=routes, max_model_len=320, max_num_seqs=4, graceful_shutdown_s=2,
                          drift=DriftConfig(window=24, baseline=48, threshold=0.2))
    server = ServerThread(build_state(config, loaded=default_model)).start()
    yield server
    server.stop()


def test_estimates_follow_the_cost_curve() -> None:
    # Beyond the curve a pass costs at least its last slope more per token.
    assert verify_cost(DEFAULT_VERIFY_COSTS, 4) == DEFAULT_VERIFY_COSTS[4]
    assert verify_cost(DEFAULT_VERIFY_COSTS, 12) > DEFAULT_VERIFY_COSTS[9]
    # Position 1 accepted half the time, later positions never: k = 1 is best.
    k, speedups = best_k([0.5, 0.0, 0.0], DEFAULT_VERIFY_COSTS)
    assert k == 1 and speedups[0] == pytest.approx(1.5 / DEFAULT_VERIFY_COSTS[2])


def test_a_fresh_server_has_nothing_to_say(lookup_server: ServerThread) -> None:
    reports = _reports(lookup_server)
    assert set(reports) == {"long-k", "fixed", "scheduled", "drift", "plain"}
    assert all(not r.findings and r.paying is None for r in reports.values())


def test_k_too_long_and_drifting(lookup_server: ServerThread) -> None:
    # Prompt lookup at k = 8 on a repeated line: late positions are seldom right, so a shorter k pays more.
    for text in (REPEAT, "List the days of the week, one per line.", "Count from one to twelve in words."):
        _chat(lookup_server, "long-k", text, 96)
    long_k = _reports(lookup_server)["long-k"]
    assert long_k.paying is not None and long_k.recommended_k < 8
    assert "k_too_long" in _causes(long_k), long_k
    assert "acceptance_low" not in _causes(long_k)

    # Drift: a baseline of repetitive traffic (enough requests to fill the baseline window: the
    # model repeats the line once and stops, a few steps each), then free text.
    for _ in range(12):
        _chat(lookup_server, "drift", REPEAT, 128)
    assert "acceptance_drifting" not in _causes(_reports(lookup_server)["drift"])
    # The drift window slides: once the baseline holds free text too, the drop is no drift any
    # more, so the doctor is asked after each request.
    drifting = []
    for text in FREE:
        _chat(lookup_server, "drift", text, 48)
        drift = _reports(lookup_server)["drift"]
        drifting.append("acceptance_drifting" in _causes(drift))
        if drifting[-1]:
            assert "lowest positions" in next(f.text for f in drift.findings if f.cause == "acceptance_drifting")
            break
    assert any(drifting), drift
    assert _reports(lookup_server)["plain"].findings == []


def test_batches_full_and_the_schedule_switching_off(lookup_server: ServerThread) -> None:
    # Past EOS, so that all four run their 240 tokens side by side: a short answer that ends
    # early left fewer than 3 running before the poll saw them (a fast CPU, CI).
    threads = [threading.Thread(target=_chat, args=(lookup_server, route, text, 240, True))
               for route, text in (("fixed", FREE[0]), ("fixed", FREE[1]), ("scheduled", FREE[2]), ("scheduled", FREE[3]))]
    for t in threads:
        t.start()
    seen: dict[str, RouteReport] = {}
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        metrics_text, health = fetch(lookup_server.url)
        if health["running"] >= 3:
            reports = {r.route: r for r in diagnose(metrics_text, health)}
            if reports["fixed"].drafting_steps and reports["scheduled"].current_k == 0:
                seen = reports
                break
        time.sleep(0.2)
    for t in threads:
        t.join()
    assert seen, "never saw 3 sequences running with both routes drafted"
    assert "batches_full" in _causes(seen["fixed"]), seen["fixed"]
    assert "batches_full" not in _causes(seen["scheduled"])  # k = 0 now: nothing is verified beyond the rows
    assert "load_schedule_off" in _causes(seen["scheduled"])
    # Alone again, the fixed route is judged on one row: no full batch.
    assert "batches_full" not in _causes(_reports(lookup_server)["fixed"])


@pytest.fixture(scope="module")
def draft_server(default_model: LoadedModel, tiny_draft_dir) -> Iterator[ServerThread]:
    """A random draft model (the tests' tiny Llama with the default model's vocabulary), and a
    cache budget in which its weights and KV cost half the sequences: 2 fit, 4 would without it."""
    spec = SpeculativeConfig("draft_model", 3, model=str(tiny_draft_dir))
    max_len = 192
    plan = plan_memory(default_model, [build_drafter(spec, default_model)], max_len, 1)
    per_target = max_len * plan.target_kv_bytes_per_token
    budget = plan.draft_weight_bytes + 2 * plan.bytes_per_sequence
    budget = max(budget, 4 * per_target)  # 4 without the draft
    routes = (RouteConfig("random-draft", spec),)
    config = ServerConfig(routes=routes, max_model_len=max_len, max_num_seqs=4, cache_budget_bytes=budget,
                          graceful_shutdown_s=2)
    server = ServerThread(build_state(config, loaded=default_model)).start()
    yield server
    server.stop()


def test_acceptance_low_and_draft_memory(draft_server: ServerThread) -> None:
    health = fetch(draft_server.url)[1]
    assert health["memory"]["sequences_lost_to_draft"] >= 1
    threads = [threading.Thread(target=_chat, args=(draft_server, "random-draft", text, 64)) for text in FREE[:4]]
    for t in threads:
        t.start()
    seen: RouteReport | None = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        metrics_text, health = fetch(draft_server.url)
        if health["waiting"] >= 1:
            report = diagnose(metrics_text, health)[0]
            if report.drafting_steps:
                seen = report
                break
        time.sleep(0.1)
    for t in threads:
        t.join()
    assert seen is not None, "never saw a request waiting after drafting began"
    assert "draft_memory" in _causes(seen), seen
    report = _reports(draft_server)["random-draft"]
    assert report.paying is False and "acceptance_low" in _causes(report), report
    assert "draft_memory" not in _causes(report)  # nothing waits any more


def test_cli(lookup_server: ServerThread, tmp_path) -> None:
    out = tmp_path / "doctor.json"
    result = CliRunner().invoke(app, ["doctor", "--url", lookup_server.url, "--json", str(out)])
    assert result.exit_code == 0, result.output
    assert "long-k" in result.output
    data = json.loads(out.read_text())
    assert {r["route"] for r in data} == {"long-k", "fixed", "scheduled", "drift", "plain"}
    bad = CliRunner().invoke(app, ["doctor", "--url", "http://127.0.0.1:9"])
    assert bad.exit_code != 0
