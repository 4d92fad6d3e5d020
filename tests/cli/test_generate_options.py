"""`specdec generate`'s and `verify`'s request options, in process: the flags reach the request
(its text is the library's with the same settings, and differs from the text without them), bad
values are one-line errors, and `verify` checks a structured output's greedy identity."""

from __future__ import annotations

import json
import re

import pytest

from specdec import LLM, SamplingParams, StructuredOutput
from specdec.models import LoadedModel

PROMPT = "List the days of the week, one per line."


def library(model: LoadedModel, **params):
    messages = [{"role": "user", "content": PROMPT}]
    return LLM(loaded=model).generate([messages], SamplingParams(max_tokens=20, **params), speculate=False)[0]


def test_bias_and_penalties_reach_the_request(run_cli, default_model: LoadedModel) -> None:
    banned = library(default_model).token_ids[2]  # a token the answer has without the bias
    code, out, err = run_cli("generate", PROMPT, "--max-tokens", "20", "--no-stream", "--frequency-penalty", "0.8",
                             "--presence-penalty", "0.2", "--repetition-penalty", "1.1", "--logit-bias", f"{banned}=-100")
    assert code == 0, err
    want = library(default_model, frequency_penalty=0.8, presence_penalty=0.2, repetition_penalty=1.1,
                   logit_bias={banned: -100.0})
    assert out == want.text + "\n"
    assert banned not in want.token_ids  # banned, and it was there


@pytest.mark.parametrize(("args", "message"), [
    (["--logit-bias", "198"], "--logit-bias takes TOKEN_ID=BIAS"),
    (["--logit-bias", "x=1"], "--logit-bias takes TOKEN_ID=BIAS"),
    (["--logit-bias", "5=101"], "logit_bias values must be in [-100, 100]"),
    (["--frequency-penalty", "3"], "frequency_penalty must be in [-2, 2]"),
    (["--repetition-penalty", "0"], "repetition_penalty must be a finite number > 0"),
    (["--json-object", "--regex", "a"], "give one of --json-object, --regex, not several"),
    (["--json-schema", "{not json"], "the JSON schema is not JSON"),
    (["--regex", "(a"], "regular expression does not compile"),
])
def test_bad_values_are_one_line_errors(run_cli, args: list[str], message: str) -> None:
    code, out, err = run_cli("generate", "hi", *args)
    assert code != 0 and message in err and len(err.strip().splitlines()) == 1


def test_structured_flags_reach_the_request(run_cli, default_model: LoadedModel, tmp_path) -> None:
    pattern = r"(Mon|Tues|Wednes)day(, (Mon|Tues|Wednes)day){0,2}\."
    code, out, err = run_cli("generate", PROMPT, "--max-tokens", "20", "--no-stream", "--regex", pattern)
    assert code == 0, err
    want = library(default_model, structured=StructuredOutput("regex", pattern))
    assert out == want.text + "\n" and re.fullmatch(pattern, want.text)
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"first": {"type": "string", "maxLength": 12}},
                                  "required": ["first"], "additionalProperties": False}))
    code, out, err = run_cli("generate", PROMPT, "--max-tokens", "20", "--no-stream", "--json-schema", str(schema))
    assert code == 0, err
    assert list(json.loads(out)) == ["first"]


def test_verify_checks_a_structured_output(run_cli, tmp_path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text(json.dumps({"id": "a", "category": "x", "turns": ["Give the days of the week as JSON."]}) + "\n")
    code, out, err = run_cli("verify", "--data", str(data), "--max-tokens", "24", "--json-object")
    assert code == 0, err
    assert "1/1 prompts token-identical" in out
