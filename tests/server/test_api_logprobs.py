"""Logprobs, penalties and logit_bias through the server with the official openai client: the
speculative route gives the plain route's tokens and logprobs (bitwise: the default backend's
batched rows are row-invariant), streamed or not, and the library's values; completions echo a
prompt with its logprobs, and max_tokens 0 scores it."""

from __future__ import annotations

import openai
import pytest

from specdec import LLM, SamplingParams
from specdec.models import LoadedModel

MESSAGES = [{"role": "user", "content": "List the days of the week, one per line, with a short note on each."}]
# 198 is "\n": the unadjusted output has some, the ban leaves none.
ADJUST = dict(frequency_penalty=0.6, presence_penalty=0.3, logit_bias={"11": 2.0, "198": -100.0})


def chat(client: openai.OpenAI, route: str, **kwargs):
    return client.chat.completions.create(model=route, messages=MESSAGES, max_tokens=24, temperature=0, logprobs=True,
                                          top_logprobs=3, extra_body={"ignore_eos": True, "repetition_penalty": 1.1},
                                          **ADJUST | kwargs)


def values(content) -> list[tuple]:
    return [(c.token, c.logprob, tuple(c.bytes), tuple((t.token, t.logprob) for t in c.top_logprobs)) for c in content]


def test_chat_logprobs_are_the_plain_routes_and_the_librarys(client: openai.OpenAI, default_model: LoadedModel) -> None:
    spec, plain = chat(client, "spec"), chat(client, "plain")
    assert spec.model_extra["speculation"]["drafted_tokens"] > 0
    assert spec.choices[0].message.content == plain.choices[0].message.content
    assert values(spec.choices[0].logprobs.content) == values(plain.choices[0].logprobs.content)
    content = spec.choices[0].logprobs.content
    assert len(content) == spec.usage.completion_tokens == 24
    assert "".join(c.token for c in content) == spec.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    # The library with the same settings: the same tokens and values.
    params = SamplingParams(max_tokens=24, ignore_eos=True, frequency_penalty=0.6, presence_penalty=0.3,
                            repetition_penalty=1.1, logit_bias={11: 2.0, 198: -100.0}, logprobs=3)
    library = LLM(loaded=default_model).generate([MESSAGES], params, speculate=False)[0]
    assert [c.logprob for c in content] == [t.logprob for t in library.logprobs]
    assert library.text == plain.choices[0].message.content
    unbiased = LLM(loaded=default_model).generate([MESSAGES], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert 198 in unbiased.token_ids and 198 not in library.token_ids


def test_streamed_chat_logprobs_are_the_whole_ones(client: openai.OpenAI) -> None:
    whole = chat(client, "spec")
    content, text = [], ""
    for chunk in chat(client, "spec", stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            content += chunk.choices[0].logprobs.content
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert text == whole.choices[0].message.content
    assert values(content) == values(whole.choices[0].logprobs.content)


@pytest.mark.parametrize("route", ["spec", "plain"])
def test_completions_echo_scores_the_prompt(client: openai.OpenAI, default_model: LoadedModel, route: str) -> None:
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = LLM(loaded=default_model).encode(prompt)
    scored = LLM(loaded=default_model).generate(prompt, SamplingParams(max_tokens=1, logprobs=2, prompt_logprobs=True))[0]
    # max_tokens 0: the prompt back with its logprobs, nothing generated.
    only = client.completions.create(model=route, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    choice = only.choices[0]
    assert choice.text == prompt and only.usage.completion_tokens == 0
    assert len(choice.logprobs.tokens) == len(ids) and choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == [t.logprob for t in scored.prompt_logprobs[1:]]
    assert "".join(choice.logprobs.tokens) == prompt and choice.logprobs.text_offset[:2] == [0, len(choice.logprobs.tokens[0])]
    # With output: the prompt's entries, then the output's, offsets running on.
    both = client.completions.create(model=route, prompt=prompt, max_tokens=6, echo=True, logprobs=1, temperature=0,
                                     extra_body={"ignore_eos": True})
    lp = both.choices[0].logprobs
    assert both.choices[0].text.startswith(prompt) and len(lp.tokens) == len(ids) + 6
    assert lp.token_logprobs[: len(ids)] == choice.logprobs.token_logprobs
    assert lp.text_offset[len(ids)] == len(prompt) and "".join(lp.tokens) == both.choices[0].text
    # Streamed: the echo first, then the output, the same entries.
    tokens, text = [], ""
    for chunk in client.completions.create(model=route, prompt=prompt, max_tokens=6, echo=True, logprobs=1, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True}):
        if chunk.choices and chunk.choices[0].logprobs:
            tokens += chunk.choices[0].logprobs.token_logprobs
        text += chunk.choices[0].text if chunk.choices else ""
    assert text == both.choices[0].text and tokens == lp.token_logprobs
