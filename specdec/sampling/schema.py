"""What a JSON schema may ask for: the keywords the grammar enforces, checked before it compiles.

xgrammar compiles a schema's keywords into its grammar but passes over some without a word (an
output could then break them): `not`, `if`/`then`/`else`, `contains`, `uniqueItems`, the
dependency keywords, `allOf` of several schemas, `oneOf` whose branches overlap (it allows any
one, not exactly one), formats it does not know, constraints beside a `$ref`, and constraints
beside an `enum` or `const` (the values are taken as they are). :func:`check_schema` refuses
each of these with a ConfigError naming the keyword and where it is, refuses a schema nested
deeper than :data:`MAX_DEPTH` and one without any instance, and returns the schema to compile:
the same one, except that `enum` and `const` values of another type than the node's `type` are
dropped (they could never validate). Keywords that only annotate (`title`, `description`,
`default`, `examples`, ...) and ones a validator ignores are left alone.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from specdec.errors import ConfigError

MAX_DEPTH = 64  # nested schemas; a client's deeper one is a 400, never a RecursionError

UNENFORCED = {
    "not": "`not`", "if": "`if`/`then`/`else`", "then": "`if`/`then`/`else`", "else": "`if`/`then`/`else`",
    "contains": "`contains`", "minContains": "`minContains`", "maxContains": "`maxContains`",
    "dependentRequired": "`dependentRequired`", "dependentSchemas": "`dependentSchemas`",
    "dependencies": "`dependencies`", "$dynamicRef": "`$dynamicRef`", "$recursiveRef": "`$recursiveRef`",
}
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords that say something about an instance without constraining it.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly", "writeOnly",
                         "$schema", "$id", "$anchor", "contentEncoding", "contentMediaType", "contentSchema"})
# Where a keyword holds one subschema, a list of them, or a name -> subschema map.
ONE = ("additionalProperties", "items", "additionalItems", "unevaluatedItems", "unevaluatedProperties", "propertyNames",
       "not", "if", "then", "else", "contains")
MANY = ("prefixItems", "allOf", "anyOf", "oneOf")
NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
         "array": (list,), "object": (dict,)}


def check_schema(schema: Any) -> Any:
    """The schema to compile (see the module's docstring); ConfigError for one the grammar would
    not enforce, nested deeper than MAX_DEPTH, with a `$ref` outside it, or with no instance."""
    _check_depth(schema)
    schema = copy.deepcopy(schema)
    for node, where in _nodes(schema):
        _check_node(schema, node, where)
    _check_finite(schema)
    return schema


def _check_depth(schema: Any) -> None:
    """Containers nested deeper than 2 * MAX_DEPTH (a subschema sits inside a keyword's object or
    list), walked without recursion."""
    stack = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > 2 * MAX_DEPTH:
            raise ConfigError(f"the JSON schema is nested deeper than {MAX_DEPTH} levels, the most the server takes")
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))


def _nodes(schema: Any, where: str = "#") -> list[tuple[dict, str]]:
    """Every subschema that is an object, with its JSON pointer."""
    out = []
    stack = [(schema, where)]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        out.append((node, path))
        for key in ONE:
            if key in node:
                stack.append((node[key], f"{path}/{key}"))
        for key in MANY:
            if isinstance(node.get(key), list):
                stack.extend((child, f"{path}/{key}/{i}") for i, child in enumerate(node[key]))
        for key in NAMED:
            if isinstance(node.get(key), dict):
                stack.extend((child, f"{path}/{key}/{name}") for name, child in node[key].items())
    return out


def _refuse(where: str, what: str) -> ConfigError:
    return ConfigError(f"the JSON schema's {what} at {where} is not enforced by the grammar: the output could break it, "
                       "so the schema is refused (see docs/server.md, structured outputs)")


def _check_node(root: dict, node: dict, where: str) -> None:
    for key, label in UNENFORCED.items():
        if key in node:
            raise _refuse(where, label)
    if node.get("uniqueItems") is True:
        raise _refuse(where, "`uniqueItems`")
    fmt = node.get("format")
    if fmt is not None and fmt not in FORMATS:
        raise _refuse(where, f"format {fmt!r} (known: {', '.join(sorted(FORMATS))})")
    # A string's format, pattern and lengths: xgrammar enforces one of them, the first it finds.
    string_rules = [key for key in ("format", "pattern", "minLength", "maxLength") if key in node]
    if len([key for key in string_rules if key not in ("minLength", "maxLength")]) + any(
            key in ("minLength", "maxLength") for key in string_rules) > 1:
        raise _refuse(where, f"{', '.join(f'`{key}`' for key in string_rules)} together (one of format, pattern or "
                             "lengths is enforced)")
    if "multipleOf" in node:  # enforced alone, on an integer; beside a range only the range is
        bounds = [f"`{key}`" for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if key in node]
        if node.get("type") != "integer" or bounds:
            raise _refuse(where, "`multipleOf` " + (f"beside {', '.join(bounds)}" if bounds else "on a non-integer"))
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        raise ConfigError(f"the JSON schema's $ref {ref!r} points outside the schema: only local references (#/...) are "
                          "enforced")
    for key in ("$ref", "allOf"):
        if key in node and (extra := _constraints(node, {key, "$defs", "definitions"})):
            raise _refuse(where, f"{', '.join(extra)} beside `{key}`")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise _refuse(where, "`allOf` of several schemas (merge them into one)")
    if isinstance(node.get("oneOf"), list) and not _disjoint(root, node["oneOf"]):
        raise _refuse(where, "`oneOf` whose branches may overlap (exactly one must match; use `anyOf`, or branches of "
                             "different types or with a different `const` for a required property)")
    _declare_required(node, where)
    if "enum" in node or "const" in node:
        extra = _constraints(node, {"enum", "const", "type"})
        if extra:
            raise _refuse(where, f"{', '.join(extra)} beside `enum`/`const`")
        _keep_typed_values(node, where)


def _declare_required(node: dict, where: str) -> None:
    """A required name that `properties` does not list: xgrammar would not require it, so it is
    listed, with the schema any other property has (`additionalProperties`)."""
    required = node.get("required")
    if not isinstance(required, list):
        return
    properties = node.setdefault("properties", {}) if isinstance(node.get("properties", {}), dict) else None
    missing = [name for name in required if properties is None or name not in properties]
    if not missing:
        return
    if properties is None or "patternProperties" in node:
        raise _refuse(where, f"`required` {missing} beside `patternProperties` or without `properties`")
    others = node.get("additionalProperties", True)
    if others is False:
        raise ConfigError(f"the JSON schema has no instance: {missing} at {where} are required but not allowed "
                          "(additionalProperties is false)")
    for name in missing:
        properties[name] = {} if others is True else copy.deepcopy(others)


def _constraints(node: dict, allowed: set[str]) -> list[str]:
    return sorted(f"`{key}`" for key in node if key not in allowed and key not in ANNOTATIONS)


def _of_type(value: Any, types: list[str]) -> bool:
    def one(name: str) -> bool:
        if name in ("integer", "number") and isinstance(value, bool):
            return False
        if name == "integer" and isinstance(value, float):
            return value.is_integer()
        return isinstance(value, TYPES.get(name, ()))

    return any(one(name) for name in types)


def _keep_typed_values(node: dict, where: str) -> None:
    """Drop the enum values (or the const) that are not of the node's type: the grammar would
    allow them, and no validator would. None left: no instance."""
    types = node.get("type")
    if types is None:
        return
    types = [types] if isinstance(types, str) else list(types)
    if "const" in node and not _of_type(node["const"], types):
        raise ConfigError(f"the JSON schema has no instance: the const at {where} is not of its type {types}")
    if isinstance(node.get("enum"), list):
        node["enum"] = [value for value in node["enum"] if _of_type(value, types)]
        if not node["enum"]:
            raise ConfigError(f"the JSON schema has no instance: no enum value at {where} is of its type {types}")


def _resolve(root: dict, node: Any) -> Any:
    seen = 0
    while isinstance(node, dict) and isinstance(node.get("$ref"), str) and seen < MAX_DEPTH:
        node, seen = _pointer(root, node["$ref"]), seen + 1
    return node


def _kinds(node: Any) -> set[str] | None:
    """The JSON types a branch's instances can have, where the branch says (None: any)."""
    if not isinstance(node, dict):
        return None
    if "const" in node:
        values = [node["const"]]
    elif isinstance(node.get("enum"), list):
        values = node["enum"]
    elif "type" in node:
        types = node["type"]
        kinds = {types} if isinstance(types, str) else set(types)
        return kinds | {"number"} if "integer" in kinds else kinds | ({"integer"} if "number" in kinds else set())
    else:
        return None
    return {name for value in values for name in TYPES if _of_type(value, [name])}


def _tags(node: Any) -> dict[str, set[str]]:
    """A branch's required properties held to constant values: name -> the values, as JSON text."""
    if not isinstance(node, dict) or not isinstance(node.get("properties"), dict):
        return {}
    required = node.get("required") if isinstance(node.get("required"), list) else []
    out = {}
    for name in required:
        prop = node["properties"].get(name)
        if isinstance(prop, dict) and "const" in prop:
            out[name] = {json.dumps(prop["const"], sort_keys=True)}
        elif isinstance(prop, dict) and isinstance(prop.get("enum"), list):
            out[name] = {json.dumps(value, sort_keys=True) for value in prop["enum"]}
    return out


def _disjoint(root: dict, branches: list) -> bool:
    """Whether no instance can match two of the branches: their types differ, or both hold a
    required property to constants that differ (a tagged union, as pydantic writes them)."""
    resolved = [_resolve(root, branch) for branch in branches]
    for i, first in enumerate(resolved):
        for second in resolved[i + 1:]:
            a, b = _kinds(first), _kinds(second)
            if a is not None and b is not None and not a & b:
                continue
            tags_a, tags_b = _tags(first), _tags(second)
            if any(not tags_a[name] & tags_b[name] for name in tags_a.keys() & tags_b.keys()):
                continue
            return False
    return True


def _pointer(schema: Any, ref: str) -> Any:
    """The node a local `$ref` ("#/$defs/name") names, or None."""
    node = schema
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _check_finite(schema: Any) -> None:
    """Refuse a schema with no finite instance: a required `$ref` recursion that never ends (the
    output could never be complete)."""
    refs = {node["$ref"] for node, _ in _nodes(schema) if isinstance(node.get("$ref"), str)}
    # Which references have a finite instance: the least fixpoint, from none, of "a node has one
    # when what it requires has one" (required properties, a non-empty array's items, one branch
    # of anyOf/oneOf, every one of allOf, the target of its $ref).
    targets = {ref: _pointer(schema, ref) for ref in refs}
    finite = {ref for ref, target in targets.items() if target is None}  # a missing target: xgrammar says so

    def has_instance(node: Any) -> bool:  # recursion bounded by MAX_DEPTH (checked first)
        if not isinstance(node, dict):
            return node is not False
        ref = node.get("$ref")
        if isinstance(ref, str) and ref not in finite:
            return False
        if any(not has_instance(b) for b in node.get("allOf", []) if isinstance(node.get("allOf"), list)):
            return False
        for key in ("anyOf", "oneOf"):
            branches = node.get(key)
            if isinstance(branches, list) and branches and not any(has_instance(b) for b in branches):
                return False
        properties = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        required = node.get("required") if isinstance(node.get("required"), list) else []
        if any(name in properties and not has_instance(properties[name]) for name in required):
            return False
        items, least = node.get("items"), node.get("minItems", 0)
        return not (isinstance(least, int) and least > 0 and items is not None and not has_instance(items))

    changed = True
    while changed:
        changed = False
        for ref in refs - finite:
            if has_instance(targets[ref]):
                finite.add(ref)
                changed = True
    if not has_instance(schema):
        raise ConfigError("the JSON schema has no finite instance: a required $ref recursion never ends")
