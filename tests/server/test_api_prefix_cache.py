"""The server's prefix cache: a conversation's later turn prefills only what follows its earlier
turns, with the same answers as a server started without it (`--no-prefix-cache`), counted in
usage (`prompt_tokens_details.cached_tokens`, as OpenAI's), /metrics, /health and the dashboard,
the same with speculation on and off; its memory is planned beside the sequences'."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from specdec.config import SpeculativeConfig
from specdec.errors import ConfigError
from specdec.models import LoadedModel
from specdec.server.config import RouteConfig, ServerConfig, config_from_dict
from specdec.server.memory import plan_memory
from specdec.server.metrics import samples_by_name
from specdec.server.runtime import ServerThread, build_state

pytestmark = pytest.mark.real

ROUTES = (RouteConfig("spec", SpeculativeConfig("ngram", 4)), RouteConfig("plain"))
FIRST = ("Here are my notes on the history of printing. " * 20 + "Summarise the notes above in one sentence.")


@pytest.fixture(scope="module")
def servers(default_model: LoadedModel) -> Iterator[list[ServerThread]]:
    """The same routes on two servers with the prefix cache (its default size), one for each
    route's traffic, and on one without it."""
    started = [ServerThread(build_state(ServerConfig(ROUTES, max_model_len=640, max_num_seqs=2, prefix_cache_bytes=size,
                                                     graceful_shutdown_s=2), loaded=default_model)).start()
               for size in (None, None, 0)]
    yield started
    for server in started:
        server.stop()


def _client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


def _conversation(server: ServerThread, route: str) -> list[tuple[str, int, int]]:
    """Three turns, each resending the earlier ones: (answer, prompt tokens, cached tokens) per turn."""
    messages, turns = [{"role": "user", "content": FIRST}], []
    for follow_up in ("Now name the inventor.", "And the year?", None):
        reply = _client(server).chat.completions.create(model=route, messages=messages, max_tokens=24, temperature=0)
        usage = reply.usage
        turns.append((reply.choices[0].message.content, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
        if follow_up is None:
            break
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": follow_up}]
    return turns


def _metric(server: ServerThread, name: str, route: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.url}/metrics").text
    return sum(v for labels, v in samples_by_name(text_string_to_metric_families(text)).get(name, [])
               if labels.get("route") == route)


def test_later_turns_reuse_earlier_ones_with_the_same_answers(servers: list[ServerThread]) -> None:
    uncached = servers[2]
    turns, cache_of = {}, {"spec": servers[0], "plain": servers[1]}
    for route, cached in cache_of.items():
        turns[route], without = _conversation(cached, route), _conversation(uncached, route)
        assert [t[0] for t in turns[route]] == [t[0] for t in without]
        assert [t[1] for t in turns[route]] == [t[1] for t in without]
        assert all(t[2] == 0 for t in without)
        for _, prompt, hit in turns[route][1:]:
            assert prompt - 48 < hit < prompt  # all but the new turn and the block it cuts
    # The same traffic hits alike with speculation on and off: only committed tokens are stored.
    assert [t[2] for t in turns["spec"]] == [t[2] for t in turns["plain"]]
    assert turns["spec"][0][2] == 0
    for route, cached in cache_of.items():
        assert _metric(cached, "specdec_prefix_cache_hit_tokens_total", route) == sum(t[2] for t in turns[route])
        assert _metric(cached, "specdec_prompt_tokens_total", route) == sum(t[1] for t in turns[route])
        assert _metric(uncached, "specdec_prefix_cache_hit_tokens_total", route) == 0
        health = httpx.get(f"{cached.url}/health").json()
        assert health["prefix_cache"]["hit_tokens"] == sum(t[2] for t in turns[route])
        assert health["prefix_cache"]["blocks"] > 0
    assert httpx.get(f"{uncached.url}/health").json()["prefix_cache"] is None
    # One cache for the target: another route's request finds what this one stored.
    again = _client(servers[0]).chat.completions.create(model="plain", messages=[{"role": "user", "content": FIRST}],
                                                        max_tokens=24, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // 16 * 16 > 0
    snapshot = httpx.get(f"{servers[0].url}/dashboard/data").json()
    assert 0 < snapshot["routes"]["spec"]["prefix_cache_hit_rate"] < 1
    assert snapshot["memory"]["prefix_cache_held_bytes"] > 0


def test_the_prefix_cache_is_planned_from_the_budget(default_model: LoadedModel) -> None:
    per_token = default_model.backend.kv_bytes_per_token()
    plain = plan_memory(default_model, [], 1000, 100 * 1000 * per_token)
    reserved = plan_memory(default_model, [], 1000, 100 * 1000 * per_token, prefix_cache_bytes=30 * 1000 * per_token)
    assert (plain.max_sequences, reserved.max_sequences) == (100, 70)
    assert reserved.left_after(70) == 0 and plain.left_after(16) == 84 * 1000 * per_token
    assert "prefix cache" in reserved.describe()
    config = config_from_dict({"prefix_cache_mb": 64, "routes": {"a": {}}})
    assert config.prefix_cache_bytes == 64 << 20
    assert config_from_dict({"routes": {"a": {}}}).prefix_cache_bytes is None
    for bad in (-1, True, "big"):
        with pytest.raises(ConfigError, match="prefix_cache_mb"):
            config_from_dict({"prefix_cache_mb": bad, "routes": {"a": {}}})
