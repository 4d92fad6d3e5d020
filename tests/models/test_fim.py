"""Fill in the middle: an `Infill` (prefix, suffix) is encoded with the model's FIM tokens in
prefix-suffix-middle order, its output ends at the model's FIM control tokens, it is exact under
speculation, and a model without FIM tokens refuses it by name: in the library, the CLI and the
server (`/v1/completions` with `suffix`). The tiny model with four FIM tokens added stands in for
a code model (the pair's real FIM is in test_pair_real.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from specdec import LLM, Infill, SamplingParams, SpeculativeConfig
from specdec.cli.main import app
from specdec.errors import PromptError
from specdec.models import LoadedModel, load_model
from specdec.models.prompts import PromptEncoder, fim_tokens
from specdec.server.config import RouteConfig, ServerConfig
from specdec.server.runtime import ServerThread, build_state
from tests.conftest import _tiny_llama, tiny_tokenizer

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>"]
# Text that repeats between the prefix and the suffix, so that lookup drafting finds matches.
PREFIX = "def total(values):\n    result = 0\n    for value in values:\n"
SUFFIX = "\n    return result\n\n\ndef total(values):\n    result = 0\n    for value in values:\n"


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LoadedModel]:
    """The tiny model's tokenizer with Qwen2.5-Coder's FIM tokens added, and a random model over it."""
    path = tmp_path_factory.mktemp("tiny-fim")
    tokenizer = tiny_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": FIM})
    _tiny_llama(len(tokenizer), seed=99, eos=tokenizer.eos_token_id).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, load_model(str(path), backend="native")


def test_an_infill_is_prefix_suffix_middle(fim_model: tuple[Path, LoadedModel], tiny_model: LoadedModel) -> None:
    _, model = fim_model
    tokenizer = model.tokenizer
    fim = fim_tokens(tokenizer)
    assert fim is not None
    assert [fim.prefix, fim.suffix, fim.middle] == tokenizer.convert_tokens_to_ids(FIM[:3])
    # The middle ends at every FIM control token present (and the text end), not at text.
    assert set(fim.stops) == set(tokenizer.convert_tokens_to_ids(FIM)) | {tokenizer.convert_tokens_to_ids("<|endoftext|>")}
    ids = PromptEncoder(model).encode(Infill("a = 1\n", "b = 2\n"))
    text = lambda s: tokenizer(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert ids == [fim.prefix, *text("a = 1\n"), fim.suffix, *text("b = 2\n"), fim.middle]
    # An empty side is allowed (the cursor at a file's start or end); both empty is not.
    assert PromptEncoder(model).encode(Infill("", "x = 1")) == [fim.prefix, fim.suffix, *text("x = 1"), fim.middle]
    with pytest.raises(PromptError, match="both empty"):
        PromptEncoder(model).encode(Infill(" ", ""))
    # A model without FIM tokens refuses an infill instead of guessing a format.
    assert fim_tokens(tiny_model.tokenizer) is None
    with pytest.raises(PromptError, match="no fill-in-the-middle tokens"):
        LLM(loaded=tiny_model).generate(Infill("a", "b"), SamplingParams(max_tokens=4))


def test_a_middle_ends_at_a_fim_control_token(fim_model: tuple[Path, LoadedModel]) -> None:
    _, model = fim_model
    llm = LLM(loaded=model)
    pad = model.tokenizer.convert_tokens_to_ids("<|fim_pad|>")
    # The bias makes <|fim_pad|> the first token: it ends an infill at once, not a plain prompt.
    params = SamplingParams(max_tokens=6, logit_bias={pad: 100.0}, ignore_eos=True)
    infill = llm.generate(Infill(PREFIX, SUFFIX), params)[0]
    assert infill.token_ids == [] and infill.finish_reason == "stop"
    plain = llm.generate(PREFIX, params)[0]
    assert plain.token_ids == [pad] * 6 and plain.finish_reason == "length"
    # Each prompt of a batch gets its own ends.
    both = llm.generate([Infill(PREFIX, SUFFIX), PREFIX], params)
    assert [o.token_ids for o in both] == [[], [pad] * 6]


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_an_infill_is_exact_under_speculation(fim_model: tuple[Path, LoadedModel], method: str) -> None:
    _, model = fim_model
    llm = LLM(loaded=model, speculative_config=SpeculativeConfig(method, 4))
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = llm.generate(Infill(PREFIX, SUFFIX), params, speculate=False)[0]
    spec = llm.generate(Infill(PREFIX, SUFFIX), params)[0]
    assert spec.token_ids == plain.token_ids and spec.text == plain.text
    seeded = SamplingParams(max_tokens=48, temperature=0.8, seed=7, drafter_invariant=True, ignore_eos=True)
    assert llm.generate(Infill(PREFIX, SUFFIX), seeded)[0].token_ids == \
        llm.generate(Infill(PREFIX, SUFFIX), seeded, speculate=False)[0].token_ids


@pytest.fixture(scope="module")
def fim_server(fim_model: tuple[Path, LoadedModel]) -> Iterator[ServerThread]:
    config = ServerConfig((RouteConfig("spec", SpeculativeConfig("ngram", 4)), RouteConfig("plain")), max_model_len=256)
    server = ServerThread(build_state(config, loaded=fim_model[1])).start()
    yield server
    server.stop()


def test_the_server_fills_in_the_middle(fim_model: tuple[Path, LoadedModel], fim_server: ServerThread,
                                        tiny_model: LoadedModel) -> None:
    _, model = fim_model
    params = SamplingParams(max_tokens=24)
    expected = LLM(loaded=model).generate(Infill(PREFIX, SUFFIX), params, speculate=False)[0]
    for route in ("spec", "plain"):
        reply = httpx.post(f"{fim_server.url}/v1/completions", timeout=60,
                           json={"model": route, "prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 24, "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["text"] == expected.text
        assert reply.json()["usage"]["prompt_tokens"] == len(PromptEncoder(model).encode(Infill(PREFIX, SUFFIX)))
    without = ServerThread(build_state(ServerConfig((RouteConfig("plain"),), max_model_len=256), loaded=tiny_model)).start()
    refused = [
        (fim_server, {"prompt": [[1, 2, 3]], "suffix": "x"}, "token ids"),
        (fim_server, {"prompt": " ", "suffix": ""}, "both empty"),
        (without, {"prompt": PREFIX, "suffix": SUFFIX}, "no fill-in-the-middle tokens"),
    ]
    try:
        for server, body, message in refused:
            reply = httpx.post(f"{server.url}/v1/completions", timeout=60, json={"model": "plain", "max_tokens": 4} | body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert message in error["message"] and error["param"] == "suffix"
    finally:
        without.stop()


def test_the_cli_fills_in_the_middle(fim_model: tuple[Path, LoadedModel]) -> None:
    path, model = fim_model
    expected = LLM(loaded=model).generate(Infill(PREFIX, SUFFIX), SamplingParams(max_tokens=12))[0]
    result = CliRunner().invoke(app, ["generate", PREFIX, "--suffix", SUFFIX, "--model", str(path), "--max-tokens", "12",
                                      "--no-stream", "--backend", "native"])
    assert result.exit_code == 0, result.output
    assert expected.text.strip() and expected.text in result.output
