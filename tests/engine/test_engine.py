"""The engine's stop conditions, budget, streaming, prompt errors and statistics, each the
same in plain and speculative decoding."""

from __future__ import annotations

import pytest
import torch

from specdec import LLM, SamplingParams
from specdec.drafters import Drafter, Proposal
from specdec.drafters.draft_model import DraftModelDrafter
from specdec.drafters.ngram import NgramDrafter
from specdec.engine import Engine, RequestStats
from specdec.errors import ConfigError, PromptError
from specdec.models import LoadedModel

EOS_PROMPT = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
DAYS_PROMPT = [{"role": "user", "content": "List the days of the week, one per line, with a short note on each."}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SELF_DRAFT = {"method": "draft_model", "model": "default", "num_speculative_tokens": 4}
SPECULATIVE = [pytest.param(NGRAM, id="ngram"), pytest.param(SELF_DRAFT, id="self")]


@pytest.fixture(scope="module")
def plain_llm(default_model: LoadedModel) -> LLM:
    return LLM(loaded=default_model)


class ScriptedDrafter(Drafter):
    """Proposes a fixed continuation of the prompt (whatever the target would say)."""

    def __init__(self, script: list[int], extra: int = 0) -> None:
        self.script = script
        self.extra = extra  # propose this many tokens beyond k, to test that the engine trims
        self.prompt_len = 0

    def begin(self, prompt_ids: list[int], max_len: int) -> None:
        self.prompt_len = len(prompt_ids)

    def propose(self, context, k, params, generator) -> Proposal:
        done = len(context) - self.prompt_len
        return Proposal(self.script[done : done + k + self.extra])

    def commit(self, context, num_accepted) -> None:
        pass


# --- EOS --------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", SPECULATIVE)
def test_eos_stops_plain_and_speculative_alike(default_model: LoadedModel, plain_llm: LLM, config: dict) -> None:
    params = SamplingParams(max_tokens=40)
    plain = plain_llm.chat(EOS_PROMPT, params, speculate=False)
    assert plain.finish_reason == "stop"
    assert 0 < len(plain.token_ids) < 40
    assert not set(plain.token_ids) & default_model.eos_token_ids
    assert plain.text == "The capital of France is Paris."
    speculative = LLM(loaded=default_model, speculative_config=config).chat(EOS_PROMPT, params)
    assert (speculative.token_ids, speculative.text, speculative.finish_reason) == (
        plain.token_ids,
        plain.text,
        plain.finish_reason,
    )


def test_eos_inside_an_accepted_draft_cuts_there(default_model: LoadedModel, plain_llm: LLM) -> None:
    stopped = plain_llm.chat(EOS_PROMPT, SamplingParams(max_tokens=40), speculate=False)
    ignoring = plain_llm.chat(EOS_PROMPT, SamplingParams(max_tokens=20, ignore_eos=True), speculate=False)
    n = len(stopped.token_ids)
    # ignore_eos generates past the EOS: the same tokens, then EOS, then more.
    assert ignoring.token_ids[:n] == stopped.token_ids
    assert ignoring.token_ids[n] in default_model.eos_token_ids
    assert ignoring.finish_reason == "length" and len(ignoring.token_ids) == 20
    # A drafter proposing the whole continuation, EOS and beyond, in one go.
    engine = Engine(default_model, ScriptedDrafter(ignoring.token_ids), 16)
    result = engine.generate(plain_llm.encode(EOS_PROMPT), SamplingParams(max_tokens=40))
    assert result.token_ids == stopped.token_ids
    assert result.finish_reason == "stop"
    assert result.text == stopped.text
    assert result.stats.target_steps == 1
    # Counted before the cut: the accepted tokens past EOS are in committed_tokens.
    assert result.stats.committed_tokens == 16 + 1
    assert result.stats.generated_tokens == n


# --- the token budget -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_plain(tiny_model: LoadedModel) -> list[int]:
    return Engine(tiny_model).generate(list(range(100, 120)), SamplingParams(max_tokens=13, ignore_eos=True)).token_ids


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_max_tokens_is_exact(tiny_model: LoadedModel, tiny_plain: list[int], max_tokens: int, k: int) -> None:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    prompt = list(range(100, 120))
    for engine in (Engine(tiny_model), Engine(tiny_model, DraftModelDrafter(tiny_model), k)):
        result = engine.generate(prompt, params)
        assert result.token_ids == tiny_plain[:max_tokens]
        assert result.finish_reason == "length"
        stats = result.stats
        assert stats.generated_tokens == max_tokens
        # The engine never drafts past the budget: nothing committed is thrown away.
        assert stats.committed_tokens == max_tokens - 1
        assert stats.target_forward_passes == stats.target_steps + 1


def test_engine_trims_overlong_proposals(tiny_model: LoadedModel, tiny_plain: list[int]) -> None:
    engine = Engine(tiny_model, ScriptedDrafter(tiny_plain, extra=5), 2)
    result = engine.generate(list(range(100, 120)), SamplingParams(max_tokens=13, ignore_eos=True))
    assert result.token_ids == tiny_plain
    assert len(result.stats.per_position_acceptance) == 2
    assert result.stats.acceptance_rate == 1.0
    assert result.stats.target_steps == 4  # 1 + 3 + 3 + 3 + 3 tokens


def test_request_reaching_the_end_of_the_context_finishes_by_length(tiny_model: LoadedModel) -> None:
    # 500 prompt tokens in a 512-position model leave room for 12 more, whatever max_tokens says.
    prompt = [(7 * i) % 900 + 100 for i in range(500)]
    for engine in (Engine(tiny_model), Engine(tiny_model, NgramDrafter(1, 3), 3)):
        result = engine.generate(prompt, SamplingParams(max_tokens=100, ignore_eos=True))
        assert len(result.token_ids) == 12
        assert result.finish_reason == "length"


def test_request_filling_the_context_exactly(tiny_model: LoadedModel) -> None:
    # 500 + 12 = 512 tokens: exactly the context, nothing clamped.
    prompt = [(7 * i) % 900 + 100 for i in range(500)]
    result = Engine(tiny_model).generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    assert len(result.token_ids) == 12
    assert result.finish_reason == "length"


def test_one_engine_serving_many_requests_matches_fresh_engines(tiny_model: LoadedModel) -> None:
    # Repeated prompts, a prompt between them, a larger budget after a smaller one, sampled
    # and greedy, and a stream abandoned after its first chunk: each request must give what a
    # brand-new engine gives (whatever the engine or drafter keeps between requests).
    engine = Engine(tiny_model, DraftModelDrafter(tiny_model), 3)
    requests = [
        ([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)),
        ([5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)),
        ([5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True)),
        ([5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True)),
        ([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)),
        ([5, 6, 7], SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True)),
        ([9, 10], SamplingParams(temperature=1.0, max_tokens=12, seed=4, ignore_eos=True)),
    ]
    for i, (prompt, params) in enumerate(requests):
        if i == 3:
            abandoned = engine.stream(prompt, params)
            next(abandoned)
            abandoned.close()
        fresh = Engine(tiny_model, DraftModelDrafter(tiny_model), 3).generate(prompt, params)
        assert engine.generate(prompt, params).token_ids == fresh.token_ids, f"request {i}"


# --- stop strings -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def days_plain(plain_llm: LLM):
    output = plain_llm.chat(DAYS_PROMPT, SamplingParams(max_tokens=32), speculate=False)
    assert "Tuesday" in output.text and "Wednesday" in output.text
    return output


@pytest.mark.parametrize("stop", [("Wednesday",), ("Wednesday", "Tuesday:"), ("day:",)])
@pytest.mark.parametrize("config", [None, *SPECULATIVE])
def test_stop_strings(default_model: LoadedModel, plain_llm: LLM, days_plain, stop, config) -> None:
    llm = plain_llm if config is None else LLM(loaded=default_model, speculative_config=config)
    output = llm.chat(DAYS_PROMPT, SamplingParams(max_tokens=32, stop=stop))
    cut = min(days_plain.text.find(s) for s in stop if s in days_plain.text)
    assert output.finish_reason == "stop"
    assert output.text == days_plain.text[:cut]
    # The tokens run up to the one completing the stop string, and no further.
    assert output.token_ids == days_plain.token_ids[: len(output.token_ids)]
    decoded = default_model.tokenizer.decode(output.token_ids, skip_special_tokens=True)
    assert any(decoded.endswith(s) or s in decoded[cut:] for s in stop)
    shorter = default_model.tokenizer.decode(output.token_ids[:-1], skip_special_tokens=True)
    assert not any(s in shorter for s in stop)


def test_stop_string_given_as_str() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


# --- streaming --------------------------------------------------------------------------------


@pytest.mark.parametrize("stop", [(), ("Thursday",)])
@pytest.mark.parametrize("config", [None, NGRAM], ids=["plain", "ngram"])
def test_stream_concatenates_to_the_final_output(default_model: LoadedModel, stop, config) -> None:
    llm = LLM(loaded=default_model, speculative_config=config)
    params = SamplingParams(max_tokens=32, stop=stop)
    final = llm.chat(DAYS_PROMPT, params)
    chunks = list(llm.stream(DAYS_PROMPT, params))
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks) == final.text
    assert [t for c in chunks for t in c.token_ids] == final.token_ids


@pytest.mark.parametrize("seed", range(6))
def test_stream_of_random_bytes_concatenates(tiny_model: LoadedModel, seed: int) -> None:
    # A random model emits byte tokens that split UTF-8 characters; held-back text must
    # still come out, exactly once.
    engine = Engine(tiny_model, DraftModelDrafter(tiny_model), 3)
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=seed, ignore_eos=True)
    final = engine.generate([5, 6, 7], params)
    chunks = list(engine.stream([5, 6, 7], params))
    assert "".join(c.text for c in chunks) == final.text
    assert [t for c in chunks for t in c.token_ids] == final.token_ids
    assert final.text == tiny_model.tokenizer.decode(final.token_ids, skip_special_tokens=True)


# --- prompts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt", ["", "   \n"])
def test_empty_text_prompt_is_a_prompt_error(plain_llm: LLM, prompt: str) -> None:
    with pytest.raises(PromptError, match="empty"):
        plain_llm.generate(prompt)
    with pytest.raises(PromptError, match="empty"):
        plain_llm.generate(["fine", prompt], SamplingParams(max_tokens=1))


@pytest.mark.parametrize(
    "chat", [[], [{"role": "user", "content": "  "}], [{"role": "user"}], ["not a message"], [{"content": "hi"}]]
)
def test_empty_or_malformed_chat_is_a_prompt_error(plain_llm: LLM, chat: list) -> None:
    with pytest.raises(PromptError):
        plain_llm.chat(chat)


def test_engine_rejects_empty_prompt_ids(tiny_model: LoadedModel) -> None:
    with pytest.raises(PromptError, match="empty"):
        Engine(tiny_model).generate([], SamplingParams())


def test_prompt_longer_than_the_context_is_a_prompt_error(tiny_model: LoadedModel) -> None:
    with pytest.raises(PromptError, match="at most 511"):
        Engine(tiny_model).generate([100] * 512, SamplingParams(max_tokens=1))


def test_prompt_forms(plain_llm: LLM, default_model: LoadedModel) -> None:
    params = SamplingParams(max_tokens=3)
    assert len(plain_llm.generate("The quick brown fox", params)) == 1
    assert len(plain_llm.generate(["One", "Two"], params)) == 2
    assert len(plain_llm.generate(EOS_PROMPT, params)) == 1
    chat_ids = plain_llm.encode(EOS_PROMPT)
    assert chat_ids[-3:] == default_model.tokenizer("<|im_start|>assistant\n")["input_ids"][-3:]


def test_drafter_needs_k(tiny_model: LoadedModel) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens >= 1"):
        Engine(tiny_model, NgramDrafter(1, 2), 0)


def test_bad_speculative_config_type(default_model: LoadedModel) -> None:
    with pytest.raises(ConfigError, match="not int"):
        LLM(loaded=default_model, speculative_config=3)


def test_speculative_config_as_json(default_model: LoadedModel) -> None:
    llm = LLM(loaded=default_model, speculative_config='{"method": "ngram", "num_speculative_tokens": 2}')
    assert isinstance(llm.engine.drafter, NgramDrafter)
    assert llm.engine.k == 2
    assert llm.plain_engine.drafter is None


# --- statistics -------------------------------------------------------------------------------


def test_speculative_stats_follow_their_definitions(default_model: LoadedModel) -> None:
    llm = LLM(
        loaded=default_model,
        speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1},
    )
    output = llm.chat(DAYS_PROMPT, SamplingParams(max_tokens=32))
    stats = output.stats
    assert stats.prompt_tokens == len(llm.encode(DAYS_PROMPT))
    assert stats.generated_tokens == len(output.token_ids) == 32
    assert stats.committed_tokens == stats.accepted_tokens + stats.target_steps
    assert stats.committed_tokens == stats.generated_tokens - 1  # the prefill adds the first token
    assert stats.target_forward_passes == stats.target_steps + 1
    assert 0 < stats.accepted_tokens < stats.drafted_tokens
    assert stats.acceptance_rate == stats.accepted_tokens / stats.drafted_tokens
    assert stats.mean_accepted_length == stats.committed_tokens / stats.target_steps
    assert sum(stats.drafted_at) == stats.drafted_tokens
    assert sum(stats.accepted_at) == stats.accepted_tokens
    # Accepted tokens are a prefix of each draft, so acceptance counts never grow with position.
    assert all(a >= b for a, b in zip(stats.accepted_at, stats.accepted_at[1:]))
    assert all(a >= b for a, b in zip(stats.drafted_at, stats.drafted_at[1:]))
    assert stats.per_position_acceptance == [a / d for a, d in zip(stats.accepted_at, stats.drafted_at)]
    assert 0 < stats.prefill_time_s < stats.wall_time_s
    assert stats.tokens_per_s == pytest.approx(32 / stats.wall_time_s)
    as_dict = stats.to_dict()
    assert as_dict["acceptance_rate"] == round(stats.acceptance_rate, 4)
    assert as_dict["target_forward_passes"] == stats.target_forward_passes
    assert set(as_dict) == {
        "prompt_tokens",
        "cached_tokens",
        "generated_tokens",
        "drafted_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "mean_accepted_length",
        "per_position_acceptance",
        "target_forward_passes",
        "undrafted_steps",
        "rejected_steps",
        "tested_acceptance",
        "target_tokens",
        "target_tokens_per_output_token",
        "cpu_time_s",
        "cpu_s_per_output_token",
        "draft_time_s",
        "verify_time_s",
        "wall_time_s",
        "tokens_per_s",
    }
    assert stats.undrafted_steps == stats.target_steps - stats.drafted_at[0]  # steps that drafted nothing
    assert 0 < stats.rejected_steps <= stats.drafted_at[0]
    assert stats.tested_acceptance == stats.accepted_tokens / (stats.accepted_tokens + stats.rejected_steps)
    assert stats.tested_acceptance >= stats.acceptance_rate
    assert 0 < stats.draft_time_s < stats.verify_time_s < stats.wall_time_s
    # Every step feeds its last token and its whole draft: the rejected drafts are the extra work.
    assert stats.target_tokens == stats.target_steps + stats.drafted_tokens
    assert stats.target_tokens_per_output_token == stats.target_tokens / stats.committed_tokens > 1.0
    assert 0 < stats.cpu_time_s and stats.cpu_s_per_output_token == stats.cpu_time_s / 32


def test_record_step() -> None:
    stats = RequestStats()
    for drafted, accepted in ((3, 3), (3, 1), (2, 0), (0, 0), (4, 2)):
        stats.record_step(drafted, accepted)
    assert stats.target_steps == 5
    assert (stats.drafted_tokens, stats.accepted_tokens, stats.committed_tokens) == (12, 6, 11)
    assert stats.drafted_at == [4, 4, 3, 1]
    assert stats.accepted_at == [3, 2, 1, 0]
    assert stats.per_position_acceptance == [0.75, 0.5, 1 / 3, 0.0]
    assert stats.acceptance_rate == 0.5
    assert stats.mean_accepted_length == 11 / 5
    assert stats.target_forward_passes == 6
    empty = RequestStats()
    assert (empty.acceptance_rate, empty.mean_accepted_length, empty.tokens_per_s) == (0.0, 0.0, 0.0)


def test_unseeded_sampling_varies(tiny_model: LoadedModel) -> None:
    engine = Engine(tiny_model)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    outputs = {tuple(engine.generate([5, 6, 7], params).token_ids) for _ in range(4)}
    assert len(outputs) > 1


def test_unseeded_request_leaves_the_callers_random_stream_alone(tiny_model: LoadedModel) -> None:
    # A library call must not reseed torch's global generator with fresh entropy: code that
    # set torch.manual_seed must draw the same numbers after a request as before.
    engine = Engine(tiny_model)
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)

    def caller() -> torch.Tensor:
        torch.manual_seed(1234)
        engine.generate([5, 6, 7], params)
        return torch.rand(4)

    assert torch.equal(caller(), caller())


def test_a_bad_prompt_late_in_a_batch_fails_before_any_generation(default_model: LoadedModel, monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM(loaded=default_model)
    calls = []
    monkeypatch.setattr(llm.plain_engine, "generate", lambda *a, **k: calls.append(a))
    with pytest.raises(PromptError, match="prompt is empty"):
        llm.generate(["Hello there", "   "], speculate=False)
    assert calls == []
