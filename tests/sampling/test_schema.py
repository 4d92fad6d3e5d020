"""A JSON schema is enforced or refused: every keyword xgrammar passes over is a ConfigError that
names it and where it is, a schema nested past the limit is refused without a RecursionError, and
what is accepted is enforced. The last is checked against xgrammar itself: for each accepted
keyword, a text that breaks it is not a sentence of the compiled grammar (so a later xgrammar that
drops a keyword fails here, and the keyword moves to the refused list)."""

from __future__ import annotations

import json

import pytest

from specdec.errors import ConfigError
from specdec.sampling.schema import MAX_DEPTH, check_schema

xgrammar = pytest.importorskip("xgrammar")
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
REFUSED = [
    ({"not": {"type": "object"}}, "`not`", "#"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "`allOf` of several", "#"),
    (OBJ | {"if": {"required": ["a"]}, "then": {"required": ["b"]}}, "`if`/`then`/`else`", "#"),
    ({"type": "array", "contains": {"type": "integer"}}, "`contains`", "#"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "`uniqueItems`", "#"),
    (OBJ | {"dependentRequired": {"a": ["b"]}}, "`dependentRequired`", "#"),
    (OBJ | {"dependentSchemas": {"a": {"required": ["b"]}}}, "`dependentSchemas`", "#"),
    (OBJ | {"dependencies": {"a": ["b"]}}, "`dependencies`", "#"),
    ({"type": "object", "properties": {"x": {"type": "string", "format": "bogus"}}}, "format 'bogus'", "#/properties/x"),
    ({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 2}, "`maxLength` beside `$ref`", "#"),
    ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "`oneOf` whose branches may overlap", "#"),
    ({"type": "integer", "minimum": 3, "const": 1}, "`minimum` beside `enum`/`const`", "#"),
    ({"type": "array", "items": {"anyOf": [{"type": "null"}, {"not": {}}]}}, "`not`", "#/items/anyOf/1"),
    ({"type": "string", "format": "date", "maxLength": 0}, "`format`, `maxLength` together", "#"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "`pattern`, `maxLength` together", "#"),
    ({"type": "integer", "maximum": 0, "multipleOf": 2}, "`multipleOf` beside `maximum`", "#"),
    ({"type": "number", "multipleOf": 2}, "`multipleOf` on a non-integer", "#"),
    ({"type": "object", "patternProperties": {"^a": {}}, "required": ["b"]}, "`required` ['b'] beside", "#"),
]


@pytest.mark.parametrize(("schema", "what", "where"), REFUSED, ids=[w for _, w, _ in REFUSED])
def test_an_unenforced_keyword_is_refused_by_name(schema: dict, what: str, where: str) -> None:
    with pytest.raises(ConfigError) as info:
        check_schema(schema)
    assert what in str(info.value) and f"at {where} " in str(info.value)


def nested(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth - 1):
        schema = {"type": "object", "properties": {"x": schema}, "required": ["x"]}
    return schema


def test_depth_is_limited_without_recursion() -> None:
    check_schema(nested(MAX_DEPTH))
    for depth in (MAX_DEPTH + 1, 400, 5000):  # 5000 is past Python's recursion limit
        with pytest.raises(ConfigError, match=f"deeper than {MAX_DEPTH} levels"):
            check_schema(nested(depth))


def test_values_of_another_type_are_dropped_and_none_left_is_refused() -> None:
    assert check_schema({"type": "integer", "enum": ["a", 1, 2.0, True, 2.5]})["enum"] == [1, 2.0]
    with pytest.raises(ConfigError, match="no instance"):
        check_schema({"type": "integer", "enum": ["a"]})
    with pytest.raises(ConfigError, match="no instance"):
        check_schema({"type": "string", "const": 1})
    with pytest.raises(ConfigError, match="no finite instance"):
        check_schema({"$defs": {"t": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/t"}}}, "$ref": "#/$defs/t"})


def test_a_required_name_is_declared() -> None:
    """`required` names `properties` does not list are required by xgrammar only once listed."""
    assert check_schema({"type": "object", "required": ["a"]})["properties"] == {"a": {}}
    typed = check_schema({"type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}})
    assert typed["properties"] == {"a": {"type": "integer"}}
    with pytest.raises(ConfigError, match="no instance"):
        check_schema({"type": "object", "properties": {}, "required": ["a"], "additionalProperties": False})


def test_disjoint_one_of_is_taken() -> None:
    by_type = {"oneOf": [{"type": "string"}, {"type": "integer"}, {"type": "null"}]}
    cat = {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}}, "required": ["kind"]}
    dog = {"type": "object", "properties": {"kind": {"const": "dog"}, "bark": {"type": "string"}}, "required": ["kind"]}
    tagged = {"$defs": {"cat": cat, "dog": dog}, "oneOf": [{"$ref": "#/$defs/cat"}, {"$ref": "#/$defs/dog"}]}
    for schema in (by_type, tagged):
        assert check_schema(schema) == schema
    untagged = {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}, {"type": "object"}]}
    with pytest.raises(ConfigError, match="oneOf"):
        check_schema(untagged)
    # Annotations beside a $ref are not constraints.
    check_schema({"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "description": "a name", "title": "Name"})


# Accepted keywords and a text that breaks each (xgrammar's compact separators: ", " and ": ").
ENFORCED = [
    ({"type": "integer", "minimum": 3}, 1), ({"type": "integer", "exclusiveMaximum": 3}, 3),
    ({"type": "integer", "multipleOf": 3}, 4), ({"type": "string", "minLength": 3}, "a"),
    ({"type": "string", "maxLength": 3}, "abcd"), ({"type": "string", "pattern": "^a+$"}, "b"),
    ({"type": "string", "format": "date"}, "x"), ({"type": "string", "format": "email"}, "x"),
    ({"type": "string", "format": "uuid"}, "x"), ({"type": "string", "enum": ["a"]}, "b"), ({"const": "a"}, "b"),
    ({"type": "integer", "enum": ["a", 1]}, "a"),
    ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1]),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": 2}, [1, 2, 3]),
    ({"type": "array", "prefixItems": [{"type": "integer"}], "items": False}, [1, 2]),
    ({"type": "object", "maxProperties": 1}, {"a": 1, "b": 2}),
    (OBJ | {"additionalProperties": False}, {"c": 1}), (OBJ | {"required": ["a"]}, {}),
    ({"type": "object", "propertyNames": {"pattern": "^a"}}, {"b": 1}),
    ({"type": "object", "patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False}, {"a": "x"}),
    (OBJ | {"unevaluatedProperties": False}, {"c": 1}),
    ({"oneOf": [{"type": "string"}, {"type": "integer"}]}, True),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, True), ({"type": ["string", "integer"]}, True),
    ({"allOf": [{"type": "string"}]}, 1), ({"type": "string", "format": "date-time"}, "2020"),
    ({"type": "integer", "multipleOf": 2}, 3), ({"type": "object", "required": ["a"]}, {}),
]


@pytest.mark.parametrize(("schema", "breaking"), ENFORCED, ids=[json.dumps(s)[:48] for s, _ in ENFORCED])
def test_what_is_taken_is_enforced(schema: dict, breaking: object) -> None:
    checked = check_schema(schema)
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(checked), any_whitespace=False, strict_mode=True)
    assert not _is_grammar_accept_string(grammar, json.dumps(breaking))
