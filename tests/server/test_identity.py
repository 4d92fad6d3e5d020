"""Greedy outputs through the server are identical to the library's (`LLM.generate`, temperature
0) on Spec-Bench prompts, with and without speculation, one request at a time and 8 at once.

The server's batched steps use different matrix shapes from the library's single-sequence
steps, so logits can differ in the last bits of float32; this test shows that on the default
model the greedy tokens do not (see docs/server.md)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.bench.data import load_records, select
from specdec.models import LoadedModel

SPEC_BENCH = Path("/work/shared/data/norm/spec_bench.jsonl")
MAX_TOKENS = 24
ALONE = 2  # prompts also sent one at a time


@pytest.fixture(scope="module")
def prompts() -> list[list[dict[str, str]]]:
    if not SPEC_BENCH.exists():
        pytest.skip(f"{SPEC_BENCH} not found")
    records = select(load_records(SPEC_BENCH), per_category=1)[:8]
    return [[{"role": "user", "content": r.turns[0]}] for r in records]


@pytest.mark.real
# Whether the route drafts: fixed always, plain never; adaptive k may switch speculation off
# when its timing says it does not pay (timings on a loaded machine vary), so either.
@pytest.mark.parametrize(("route", "speculative"), [("fixed", True), ("adaptive", None), ("plain", False)])
def test_server_greedy_matches_library(default_model: LoadedModel, client: openai.OpenAI, prompts, route: str,
                                       speculative: bool | None) -> None:
    llm = LLM(loaded=default_model, speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    expected = [o.text for o in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), speculate=speculative is not False)]

    def ask(messages: list[dict[str, str]]) -> str:
        response = client.chat.completions.create(model=route, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
        drafted = response.model_extra["speculation"]["drafted_tokens"]
        assert speculative is None or (drafted > 0) == speculative or response.usage.completion_tokens < 3
        return response.choices[0].message.content

    alone = [ask(m) for m in prompts[:ALONE]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        batched = list(pool.map(ask, prompts))
    assert alone == expected[:ALONE]
    assert batched == expected


@pytest.mark.parametrize("route", ["spec", "fixed", "plain"])
def test_drafter_invariant_requests_give_the_plain_tokens(client: openai.OpenAI, route: str) -> None:
    # Sampled at temperature 1 with a seed: the same text on every route, speculating or not, and
    # whatever else runs in the batch (the rule is asked for per request).
    messages = [{"role": "user", "content": "Tell me a story about a robot who learns to paint."}]

    def ask(seed: int) -> str:
        response = client.chat.completions.create(
            model=route, messages=messages, max_tokens=24, temperature=1.0, seed=seed,
            extra_body={"speculative": {"drafter_invariant": True}})
        return response.choices[0].message.content

    reference = [client.chat.completions.create(
        model="plain", messages=messages, max_tokens=24, temperature=1.0, seed=seed,
        extra_body={"speculative": {"drafter_invariant": True}}).choices[0].message.content for seed in (1, 2)]
    with ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(ask, [1, 2, 1, 2]))
    assert texts == reference * 2
    assert reference[0] != reference[1]
