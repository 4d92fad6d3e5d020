"""Suffix routes on the server: each route has its own cache of earlier outputs, shared by its
requests (the `n` samples of one request draft from each other), never by another route;
greedy output stays the plain output; the caches' memory is in /health and /metrics."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.models import LoadedModel
from specdec.server.config import RouteConfig, ServerConfig
from specdec.server.runtime import ServerThread, build_state

PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def suffix_server(default_model: LoadedModel) -> Iterator[ServerThread]:
    # min_token_prob 0: any continuation seen before is proposed, so what a cache holds shows.
    suffix = SpeculativeConfig.from_dict({"method": "suffix", "num_speculative_tokens": 6,
                                          "suffix_decoding_min_token_prob": 0.0})
    routes = (RouteConfig("tenant-a", suffix, None, 6), RouteConfig("tenant-b", suffix, None, 6))
    running = ServerThread(build_state(ServerConfig(routes=routes, max_model_len=256, max_num_seqs=8,
                                                    graceful_shutdown_s=2), loaded=default_model)).start()
    yield running
    running.stop()


def test_suffix_routes_share_outputs_within_a_route_only(default_model: LoadedModel, suffix_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{suffix_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    expected = LLM(loaded=default_model).generate([PROMPT], SamplingParams(max_tokens=40))[0].text

    def ask(route: str) -> tuple[str, dict]:
        r = client.chat.completions.create(model=route, messages=PROMPT, max_tokens=40, temperature=0)
        return r.choices[0].message.content, r.model_extra["speculation"]

    first_a, stats_a1 = ask("tenant-a")
    second_a, stats_a2 = ask("tenant-a")  # route a has seen this answer
    first_b, stats_b = ask("tenant-b")  # route b has not: its cache is its own
    assert first_a == second_a == first_b == expected
    assert stats_a2["accepted_tokens"] > stats_a1["accepted_tokens"] + 20
    assert stats_b["accepted_tokens"] == stats_a1["accepted_tokens"]

    health = httpx.get(f"{suffix_server.url}/health").json()
    cached = health["memory"]["suffix_cache_bytes"]
    assert cached["tenant-a"] > cached["tenant-b"] > 0
    metrics = httpx.get(f"{suffix_server.url}/metrics").text
    assert 'specdec_suffix_cache_requests{route="tenant-a"} 2.0' in metrics
    assert 'specdec_suffix_cache_requests{route="tenant-b"} 1.0' in metrics


def test_n_samples_draft_from_each_other(suffix_server: ServerThread) -> None:
    client = openai.OpenAI(base_url=f"{suffix_server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model="tenant-b", messages=[{"role": "user", "content": "Count to twenty."}],
                                       max_tokens=48, temperature=0.7, n=4, seed=1)
    assert len(r.choices) == 4 and all(c.message.content for c in r.choices)
    stats = r.model_extra["speculation"]
    assert stats["drafted_tokens"] > 0 and stats["accepted_tokens"] > 0
