"""The OpenAI-compatible API, driven by the official openai client over real HTTP."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from specdec import kernels
from specdec.engine.stats import RequestStats
from specdec.server.memory import release_free_memory, resident_bytes
from specdec.server.runtime import ServerThread

STATS_KEYS = set(RequestStats().to_dict())
PROMPT = "one two three one two three one two three one two"


def metrics(server: ServerThread) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics, parsed by prometheus_client: (name, sorted labels) -> value."""
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_chat_completion_carries_usage_and_speculation(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model="spec", messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )
    choice = response.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert response.usage.completion_tokens == 12 and response.usage.prompt_tokens > 5
    speculation = response.model_extra["speculation"]
    assert set(speculation) == STATS_KEYS
    assert speculation["generated_tokens"] == 12 and speculation["drafted_tokens"] > 0
    # What the speed cost: every drafted token was processed by the target, rejected or not.
    assert speculation["target_tokens"] == speculation["target_forward_passes"] - 1 + speculation["drafted_tokens"]
    assert speculation["target_tokens_per_output_token"] >= 1.0 and speculation["cpu_s_per_output_token"] > 0


def test_streaming_matches_non_streaming(client: openai.OpenAI) -> None:
    kwargs = dict(model="fixed", prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    pieces, usage, finish = [], None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        else:
            usage = chunk.usage
    assert "".join(pieces) == whole.choices[0].text
    assert finish == "length" and usage.completion_tokens == whole.usage.completion_tokens == 20


def test_chat_stream_is_openai_sse_ending_with_done(server: ServerThread) -> None:
    body = {"model": "spec", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: ") for line in lines)
    assert '"role": "assistant"' in lines[0] and '"chat.completion.chunk"' in lines[0]


def test_n_choices_and_seeds_are_reproducible(client: openai.OpenAI) -> None:
    kwargs = dict(model="spec", prompt=PROMPT, max_tokens=10, temperature=1.0, top_p=0.9, seed=7, n=2,
                  extra_body={"top_k": 50, "ignore_eos": True})
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1]
    assert texts == [c.text for c in second.choices]
    assert texts[0] != texts[1]  # each choice has its own seed
    assert first.usage.completion_tokens == 20


def test_stop_string_ends_the_output(client: openai.OpenAI) -> None:
    kwargs = dict(model="plain", prompt=PROMPT, max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = client.completions.create(**kwargs).choices[0].text
    stop = text[10:13]
    assert stop.strip()
    stopped = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert stopped.finish_reason == "stop" and stopped.text == text[: text.index(stop)]


def test_models_lists_the_routes(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["spec", "fixed", "adaptive", "plain"]


def test_request_may_lower_or_turn_off_k_within_the_route_cap(client: openai.OpenAI) -> None:
    def drafted(**extra) -> int:
        r = client.completions.create(model="spec", prompt=PROMPT, max_tokens=16, temperature=0,
                                      extra_body={"ignore_eos": True, **extra})
        return r.model_extra["speculation"]["drafted_tokens"]

    assert drafted() > 0
    assert drafted(speculative=False) == 0
    assert drafted(speculative={"num_speculative_tokens": 0}) == 0
    with pytest.raises(openai.BadRequestError, match="exceeds route 'spec' limit of 6"):
        drafted(speculative={"num_speculative_tokens": 7})
    with pytest.raises(openai.BadRequestError, match="does not speculate"):
        client.completions.create(model="plain", prompt="x", max_tokens=2, extra_body={"speculative": {"num_speculative_tokens": 2}})


def test_metrics_count_what_requests_report(server: ServerThread, client: openai.OpenAI) -> None:
    before = metrics(server)
    r = client.completions.create(model="fixed", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    after = metrics(server)
    route = (("route", "fixed"),)
    spec = r.model_extra["speculation"]
    for name, key in (("specdec_drafted_tokens_total", "drafted_tokens"), ("specdec_accepted_tokens_total", "accepted_tokens"),
                      ("specdec_generated_tokens_total", "generated_tokens")):
        assert after[(name, route)] - before.get((name, route), 0) == spec[key], name
    assert after[("specdec_target_steps_total", route)] - before[("specdec_target_steps_total", route)] == spec["target_forward_passes"] - 1
    assert after[("specdec_time_to_first_token_seconds_count", route)] == before[("specdec_time_to_first_token_seconds_count", route)] + 1
    assert after[("specdec_running_sequences", ())] == 0 and after[("specdec_queue_length", ())] == 0
    assert after[("specdec_memory_bytes", (("part", "target_kv_per_token"),))] > 0
    assert ("specdec_position_acceptance", (("position", "0"), ("route", "fixed"))) in after
    assert 1 <= after[("specdec_mean_accepted_length", route)] <= 4


def test_health_reports_memory_plan(server: ServerThread) -> None:
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok" and health["max_num_seqs"] == 8
    memory = health["memory"]
    assert memory["target_format"] == "native q4 (LM head q8)"  # the default backend and the GGUF's own format
    assert health["kernel_path"] == (kernels.default_isa() if kernels.available() else "pytorch")  # the path this CPU runs the products on
    assert health["file_types"] == ["Q4_1", "Q8_0"]  # the default model's GGUF: Q4_1 layers, a Q8_0 LM head
    assert memory["bytes_per_sequence"] == 256 * memory["target_kv_bytes_per_token"]
    assert memory["max_sequences"] == memory["cache_budget_bytes"] // memory["bytes_per_sequence"]
    # The plan's sum, and what the process holds beside it (the test process: the server's own and more).
    assert memory["plan_bytes"] == sum(memory[key] for key in ("target_weight_bytes", "draft_weight_bytes",
                                                              "kv_allocated_bytes", "prefix_cache_budget_bytes"))
    assert memory["resident_bytes"] > memory["target_weight_bytes"]
    assert metrics(server)[("specdec_memory_bytes", (("part", "resident"),))] > memory["target_weight_bytes"]


def test_free_memory_goes_back_to_the_system() -> None:
    """The scheduler's trim: freed holes between live allocations leave the resident set."""
    torch.empty(5_000_000).fill_(0)  # an mmapped 20 MB freed: glibc now serves blocks this size from its heap
    held = [torch.empty(300_000).fill_(1.0) for _ in range(400)]  # 1.2 MB each, 480 MB
    del held[::2]  # holes, each between two live blocks
    before = resident_bytes()
    assert release_free_memory()
    assert resident_bytes() < before - 100 * (1 << 20)


PLAIN_ABORTS = ("specdec_requests_total", (("finish_reason", "abort"), ("route", "plain")))


def wait_for_abort(server: ServerThread, scheduler, count: float, seconds: float) -> bool:
    """True once the plain route's abort count reaches `count` and no sequence runs (the scheduler
    frees the sequence a moment before it counts the request, so both are polled), within `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if scheduler.running == 0 and metrics(server).get(PLAIN_ABORTS, 0) == count:
            return True
        time.sleep(0.05)
    return False


def test_client_disconnect_frees_its_sequence(server: ServerThread) -> None:
    scheduler = server.server.config.app.state.specdec.scheduler
    body = {"model": "plain", "prompt": PROMPT, "max_tokens": 200, "stream": True, "ignore_eos": True}
    aborted = metrics(server).get(PLAIN_ABORTS, 0)
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        next(lines)
        assert scheduler.running == 1
    assert wait_for_abort(server, scheduler, aborted + 1, seconds=10)


def test_non_streaming_client_that_gives_up_frees_its_sequence(server: ServerThread) -> None:
    scheduler = server.server.config.app.state.specdec.scheduler
    aborted = metrics(server).get(PLAIN_ABORTS, 0)
    body = {"model": "plain", "prompt": PROMPT, "max_tokens": 240, "ignore_eos": True}  # ~10 s of generation
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=0.5)
    # The handler checks for a disconnect every 0.5 s; on a busy machine the request may not even
    # have reached the scheduler when the client gives up, so wait for the count, not for `running`.
    assert wait_for_abort(server, scheduler, aborted + 1, seconds=5)


def test_fields_newer_clients_send_are_taken_and_change_nothing(client: openai.OpenAI) -> None:
    base = dict(model="spec", messages=[{"role": "user", "content": PROMPT}], max_tokens=10,
                extra_body={"ignore_eos": True})
    greedy = client.chat.completions.create(**base, temperature=0).choices[0].message.content
    # Set as newer SDKs and proxies forward them: no effect on what is generated.
    forwarded = client.chat.completions.create(
        **base | {"extra_body": {"ignore_eos": True, "prediction": None, "audio": None}}, temperature=0,
        metadata={"run": "7"}, store=False, service_tier="auto", reasoning_effort="low", modalities=["text"],
        response_format={"type": "text"}, parallel_tool_calls=False, seed=-1)
    assert forwarded.choices[0].message.content == greedy
    # top_p = 0 and min_p = 1 keep only the most likely token: sampling at temperature 1 is greedy
    # (speculation on: each verified position's distribution is the one-hot of plain decoding).
    for extra in ({"top_p": 0.0, "seed": 2**70}, {"seed": 3, "extra_body": {"ignore_eos": True, "min_p": 1.0}}):
        sampled = client.chat.completions.create(**base | extra, temperature=1.0)
        assert sampled.choices[0].message.content == greedy
