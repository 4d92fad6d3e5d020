"""Chunked prefill: while a stream runs, a long new prompt is prefilled a chunk at a time between
the stream's steps (into the prefix cache, ahead of its admission), and its output is the same as
a whole prefill's, greedy and seeded, on the plain and the speculative route."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from specdec import LLM, SamplingParams
from specdec.config import SpeculativeConfig
from specdec.models import LoadedModel, load_model
from specdec.server.config import RouteConfig, ServerConfig
from specdec.server.runtime import ServerThread, build_state

LONG = " ".join(f"item {i} costs {i * 7 % 50} coins;" for i in range(40))


@pytest.fixture(scope="module")
def exact(tiny_model_dir) -> LoadedModel:
    loaded = load_model(str(tiny_model_dir), backend="native", dtype="int8")
    if not loaded.backend.exact_blocks:
        pytest.skip("specdec's kernels are not built here: no prefix cache, no chunked prefill")
    return loaded


@pytest.fixture(scope="module")
def server(exact: LoadedModel) -> Iterator[ServerThread]:
    routes = (RouteConfig("plain"), RouteConfig("spec", SpeculativeConfig("ngram", 3)))
    running = ServerThread(build_state(ServerConfig(routes, max_model_len=512, max_num_seqs=2, prefill_chunk_s=0.002), loaded=exact)).start()
    yield running
    running.stop()


def _complete(server: ServerThread, route: str, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"model": route, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True} | extra
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("route", ["plain", "spec"])
# Seeded with the drafter-invariant rule: the same tokens with or without speculation, under any load.
@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.9, "seed": 5, "speculative": {"drafter_invariant": True}}],
                         ids=["greedy", "seeded"])
def test_a_long_prompt_beside_a_stream_is_chunked_and_exact(exact: LoadedModel, server: ServerThread, route: str,
                                                            sampling: dict) -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=sampling.get("temperature", 0.0),
                            seed=sampling.get("seed"), drafter_invariant="speculative" in sampling)
    whole = LLM(loaded=exact, prefix_cache_mb=0).generate(LONG, params, speculate=False)[0]
    assert len(LLM(loaded=exact, prefix_cache_mb=0).encode(LONG)) > 4 * 64  # several chunks long
    scheduler = server.state.scheduler
    before = scheduler.prefill_chunks
    # A distinct running stream (its own tokens: nothing of LONG in the prefix cache yet).
    beside = threading.Thread(target=_complete, args=(server, "plain", f"Count {route} {sampling}:", 400))
    beside.start()
    while scheduler.running == 0:
        pass
    out = _complete(server, route, LONG, 16, **sampling)
    beside.join()
    assert scheduler.prefill_chunks - before >= 2  # prefilled in chunks between the stream's steps
    assert out["choices"][0]["text"] == whole.text
    # Its prompt came back from the prefix cache as chunks, all but the last.
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
