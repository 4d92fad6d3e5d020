"""A structured output the grammar cannot hold is the client's 4xx, never the server's 5xx: a schema
nested past the limit, a spec with no instance (refused before generation, or, past a dead end
the compiler cannot see, ended there as a 400 on both the plain and the speculative route), a
schema keyword that would not be enforced. The error counter never moves for them, and other
requests in the same batch are not disturbed. A fuzz test over generated schemas (hypothesis)
holds the rule: every response is a 4xx or output that validates against its schema."""

from __future__ import annotations

import json
import threading

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.server.runtime import ServerThread
from tests.server.test_api import metrics

pytest.importorskip("xgrammar")


def _post(server: ServerThread, route: str, structured: dict, stream: bool = False, max_tokens: int = 24) -> httpx.Response:
    body = {"model": route, "prompt": "Answer:", "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "structured_outputs": structured}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)


def errors(server: ServerThread) -> float:
    return sum(v for (name, labels), v in metrics(server).items()
               if name == "specdec_requests_total" and ("finish_reason", "error") in labels)


def deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


@pytest.mark.parametrize(("structured", "message"), [
    ({"json": deep(400)}, "nested deeper than"),
    ({"regex": "[^\\s\\S]"}, "has no instance"),
    ({"grammar": 'root ::= a\na ::= a "x"'}, "has no instance"),
    ({"json": {"not": {"type": "object"}}}, "`not`"),
    ({"json": {"allOf": [{"type": "string"}, {"type": "integer"}]}}, "`allOf` of several"),
], ids=["depth-400", "empty-regex", "endless-grammar", "not", "allOf"])
def test_a_spec_the_grammar_cannot_hold_is_a_400(tiny_server: ServerThread, structured: dict, message: str) -> None:
    before = errors(tiny_server)
    for route in ("plain", "spec"):
        reply = _post(tiny_server, route, structured)
        assert reply.status_code == 400, reply.text
        assert message in reply.json()["error"]["message"]
        assert reply.json()["error"]["param"].startswith("structured_outputs")
    assert errors(tiny_server) == before


def test_a_dead_end_past_the_start_ends_as_the_clients_error(tiny_server: ServerThread) -> None:
    """`a[^\\s\\S]` allows its "a", then nothing: the request ends there as a 400 (an error event
    when streamed), the same on both routes, and a request beside it is answered as usual."""
    before = errors(tiny_server)
    beside: dict = {}
    thread = threading.Thread(target=lambda: beside.setdefault("reply", _post(tiny_server, "spec", {"regex": "[a-z]{20}"})))
    thread.start()
    for route in ("plain", "spec"):
        reply = _post(tiny_server, route, {"regex": "ab[^\\s\\S]"})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["code"] == "no_instance" and "no text can complete it" in reply.json()["error"]["message"]
        streamed = _post(tiny_server, route, {"regex": "ab[^\\s\\S]"}, stream=True)
        assert streamed.status_code == 200
        events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "no_instance" and events[-1]["error"]["type"] == "invalid_request_error"
    thread.join()
    assert beside["reply"].status_code == 200 and len(beside["reply"].json()["choices"][0]["text"]) == 20
    assert errors(tiny_server) == before


# Schemas over the keywords a client may send, enforced or not, nested a few levels.
_leaf = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["string", "integer", "number", "boolean", "null"])}),
    st.fixed_dictionaries({"type": st.just("string")}, optional={
        "maxLength": st.integers(0, 6), "minLength": st.integers(0, 3), "pattern": st.sampled_from(["^[a-c]+$", "^x"]),
        "format": st.sampled_from(["date", "email", "bogus"])}),
    st.fixed_dictionaries({"type": st.just("integer")}, optional={
        "minimum": st.integers(-5, 5), "maximum": st.integers(-5, 5), "multipleOf": st.integers(1, 4)}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(st.integers(-3, 3), st.sampled_from(["a", "b"])), min_size=1, max_size=3)},
                          optional={"type": st.sampled_from(["string", "integer"])}),
    st.fixed_dictionaries({"const": st.sampled_from([1, "c", None])}),
)


def _node(children: st.SearchStrategy) -> st.SearchStrategy:
    names = st.sampled_from(["a", "b", "c"])
    return st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(names, children, max_size=2)},
                              optional={"required": st.lists(names, max_size=2, unique=True),
                                        "additionalProperties": st.just(False), "maxProperties": st.integers(0, 2)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": children},
                              optional={"maxItems": st.integers(0, 3), "minItems": st.integers(0, 2),
                                        "uniqueItems": st.booleans(), "contains": children}),
        st.fixed_dictionaries({"anyOf": st.lists(children, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"oneOf": st.lists(children, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"allOf": st.lists(children, min_size=1, max_size=2)}),
        st.fixed_dictionaries({"not": children}),
    )


SCHEMAS = st.recursive(_leaf, _node, max_leaves=5)


def test_generated_schemas_get_a_4xx_or_valid_output(tiny_server: ServerThread) -> None:
    seen = {"finished": 0, "refused": 0}

    @settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(schema=SCHEMAS)
    def one(schema: dict) -> None:
        reply = _post(tiny_server, "spec", {"json": schema}, max_tokens=48)
        assert reply.status_code < 500, reply.text
        if reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(reply.json()["choices"][0]["text"]), schema)
            seen["finished"] += 1
        elif reply.status_code >= 400:
            seen["refused"] += 1

    one()
    # Both outcomes seen, or the fuzz checked nothing (cut outputs cannot be validated).
    assert seen["finished"] >= 5 and seen["refused"] >= 5, seen
