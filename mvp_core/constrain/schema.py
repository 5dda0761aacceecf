"""A response format compiled into the recognizer's nodes: a JSON Schema of the subset
the recognizer can honour, or any JSON object (``json_object``).

Supported: ``type`` object (``properties``, ``required``, ``additionalProperties``),
array (``items``, ``minItems``, ``maxItems``), string, integer, number, boolean, null, a
list of those types; ``enum``, ``const``, ``anyOf``; ``{}`` or ``true`` (any value).
Annotations (title, description, examples, default, format, $schema, $comment, strict)
are ignored. A keyword that constrains what the recognizer cannot (pattern, minLength,
minimum, $ref, oneOf, ...) is refused with a :class:`SchemaError` naming it: the output
would not be sure to validate otherwise.

Generation is a subset of the schema, never more: an object with ``properties`` writes
only those (``additionalProperties`` true or absent included); an integer has no
fraction nor exponent; an ``enum``'s values are written as compact JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__all__ = [
    "MAX_FORMAT_BYTES",
    "MAX_SCHEMA_DEPTH",
    "Node",
    "NodeKind",
    "Schema",
    "SchemaError",
    "compile_format",
    "compile_schema",
    "format_text",
]

MAX_FORMAT_BYTES = 16 * 1024
"""A format's JSON (compact) at most: it travels on the pipeline's begin record."""
MAX_SCHEMA_DEPTH = 32
"""Nesting of the schema's JSON (objects and arrays) at most."""
MAX_LITERAL_BYTES = 1024  # an enum or const value's compact JSON

_ANNOTATIONS = frozenset(
    {
        "title",
        "description",
        "examples",
        "default",
        "format",
        "$schema",
        "$id",
        "$comment",
        "strict",
        "deprecated",
        "readOnly",
        "writeOnly",
        "name",
    }
)
_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems"}
    | {"enum", "const", "anyOf"}
)
_TYPES = ("object", "array", "string", "integer", "number", "boolean", "null")


class SchemaError(ValueError):
    """A format the recognizer cannot honour; the message says where and why."""


class NodeKind(Enum):
    OBJECT = "object"
    ARRAY = "array"
    STRING = "string"
    NUMBER = "number"
    INTEGER = "integer"
    LITERAL = "literal"  # enum, const, boolean, null: one of a few compact JSON texts
    ANY_OF = "anyOf"


@dataclass(frozen=True)
class Node:
    """One compiled schema. ``props``: an object's declared properties (name, node id),
    ``keys``: each one's JSON text (the key as written), ``extra``: the node of any
    other key's value where the object takes free keys (no declared properties),
    ``items``: an array's item node, ``literals``: the compact JSON texts a literal may
    be, ``alts``: anyOf's nodes."""

    kind: NodeKind
    props: tuple[tuple[str, int], ...] = ()
    keys: tuple[bytes, ...] = ()
    required: frozenset[int] = frozenset()  # indexes into props
    extra: int | None = None
    items: int = -1
    min_items: int = 0
    max_items: int | None = None
    literals: frozenset[bytes] = frozenset()
    alts: tuple[int, ...] = ()


@dataclass
class Schema:
    """The compiled nodes, ``root`` the value's."""

    nodes: list[Node] = field(default_factory=list)
    root: int = -1

    def add(self, node: Node) -> int:
        self.nodes.append(node)
        return len(self.nodes) - 1


def format_text(fmt: dict[str, Any]) -> str:
    """A format's canonical JSON (sorted keys, compact): what travels and is cached."""
    return json.dumps(fmt, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def compile_format(fmt: dict[str, Any]) -> Schema:
    """``{"type": "json_object"}`` or ``{"type": "json_schema", "schema": {...}}``."""
    kind = fmt.get("type")
    if kind == "json_object":
        extra = set(fmt) - {"type"}
        if extra:
            raise SchemaError(f"json_object takes no other field (got {sorted(extra)})")
        compiler = _Compiler()
        compiler.schema.root = compiler.any_object()
        return compiler.schema
    if kind == "json_schema":
        extra = set(fmt) - {"type", "schema"}
        if extra:
            raise SchemaError(f"json_schema takes only its schema (got {sorted(extra)})")
        if "schema" not in fmt:
            raise SchemaError("json_schema needs a schema")
        return compile_schema(fmt["schema"])
    raise SchemaError(f"unknown format type {kind!r}: json_object or json_schema")


def compile_schema(schema: Any) -> Schema:
    """The nodes of a JSON Schema (the supported subset); SchemaError otherwise."""
    size = len(format_text({"schema": schema}).encode())
    if size > MAX_FORMAT_BYTES:
        raise SchemaError(f"the schema's JSON is {size} bytes; at most {MAX_FORMAT_BYTES}")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise SchemaError(f"the schema nests {depth} deep; at most {MAX_SCHEMA_DEPTH}")
    compiler = _Compiler()
    compiler.schema.root = compiler.node(schema, "schema")
    return compiler.schema


def _depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


class _Compiler:
    def __init__(self) -> None:
        self.schema = Schema()
        self._any: int | None = None

    def literal(self, values: list[Any], where: str) -> int:
        texts = set()
        for v in values:
            text = json.dumps(v, separators=(",", ":"), ensure_ascii=False).encode()
            if len(text) > MAX_LITERAL_BYTES:
                raise SchemaError(
                    f"{where}: a value of {len(text)} bytes (at most {MAX_LITERAL_BYTES})"
                )
            texts.add(text)
        if not texts:
            raise SchemaError(f"{where}: no value is allowed")
        return self.schema.add(Node(NodeKind.LITERAL, literals=frozenset(texts)))

    def any_value(self) -> int:
        """Any JSON value (objects of free keys, arrays, strings, numbers, literals)."""
        if self._any is None:
            alts = self.schema.add(Node(NodeKind.ANY_OF))  # filled below: it is recursive
            self._any = alts
            obj = self.schema.add(Node(NodeKind.OBJECT, extra=alts))
            arr = self.schema.add(Node(NodeKind.ARRAY, items=alts))
            string = self.schema.add(Node(NodeKind.STRING))
            number = self.schema.add(Node(NodeKind.NUMBER))
            lit = self.literal([True, False, None], "any value")
            self.schema.nodes[alts] = Node(NodeKind.ANY_OF, alts=(obj, arr, string, number, lit))
        return self._any

    def any_object(self) -> int:
        return self.schema.add(Node(NodeKind.OBJECT, extra=self.any_value()))

    def node(self, s: Any, where: str) -> int:
        if s is True or s == {}:
            return self.any_value()
        if not isinstance(s, dict):
            raise SchemaError(f"{where}: a schema is an object, got {type(s).__name__}")
        unknown = sorted(k for k in s if k not in _KEYWORDS and k not in _ANNOTATIONS)
        if unknown:
            raise SchemaError(
                f"{where}: {', '.join(map(repr, unknown))} not supported (supported: "
                "type, properties, required, additionalProperties, items, minItems, "
                "maxItems, enum, const, anyOf)"
            )
        if "const" in s:
            return self.literal([s["const"]], f"{where}.const")
        if "enum" in s:
            if not isinstance(s["enum"], list):
                raise SchemaError(f"{where}.enum: a list of values")
            return self.literal(s["enum"], f"{where}.enum")
        if "anyOf" in s:
            alts = s["anyOf"]
            if not isinstance(alts, list) or not alts:
                raise SchemaError(f"{where}.anyOf: a non-empty list of schemas")
            rest = {k: v for k, v in s.items() if k != "anyOf" and k not in _ANNOTATIONS}
            if rest:
                raise SchemaError(f"{where}: anyOf beside {sorted(rest)} is not supported")
            ids = tuple(self.node(a, f"{where}.anyOf[{i}]") for i, a in enumerate(alts))
            return self.schema.add(Node(NodeKind.ANY_OF, alts=ids))
        kind = s.get("type")
        if kind is None:
            if set(s) - _ANNOTATIONS:
                raise SchemaError(f"{where}: needs a type (or enum, const, anyOf)")
            return self.any_value()
        if isinstance(kind, list):
            if not kind or len(set(map(str, kind))) != len(kind):
                raise SchemaError(f"{where}.type: a non-empty list of distinct types")
            ids = tuple(self.typed(s, t, f"{where}.type") for t in kind)
            return ids[0] if len(ids) == 1 else self.schema.add(Node(NodeKind.ANY_OF, alts=ids))
        return self.typed(s, kind, f"{where}.type")

    def typed(self, s: dict[str, Any], kind: Any, where: str) -> int:
        if kind not in _TYPES:
            raise SchemaError(f"{where}: unknown type {kind!r} (one of {', '.join(_TYPES)})")
        if kind == "object":
            return self.object(s, where.removesuffix(".type"))
        if kind == "array":
            return self.array(s, where.removesuffix(".type"))
        if kind == "boolean":
            return self.literal([True, False], where)
        if kind == "null":
            return self.literal([None], where)
        return self.schema.add(Node(NodeKind(kind)))

    def object(self, s: dict[str, Any], where: str) -> int:
        props = s.get("properties", {})
        if not isinstance(props, dict):
            raise SchemaError(f"{where}.properties: an object of schemas")
        required = s.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}.required: a list of property names")
        missing = [r for r in required if r not in props]
        if missing:
            raise SchemaError(
                f"{where}.required: {', '.join(map(repr, missing))} not among the properties"
            )
        extra_schema = s.get("additionalProperties", True)
        if not isinstance(extra_schema, bool | dict):
            raise SchemaError(f"{where}.additionalProperties: a boolean or a schema")
        index = self.schema.add(Node(NodeKind.OBJECT))  # its children come after it
        names = list(props)
        ids = tuple(self.node(props[n], f"{where}.properties.{n}") for n in names)
        extra = None
        if not props and extra_schema is not False:
            extra = (
                self.any_value()
                if extra_schema is True
                else self.node(extra_schema, f"{where}.additionalProperties")
            )
        self.schema.nodes[index] = Node(
            NodeKind.OBJECT,
            props=tuple(zip(names, ids, strict=True)),
            keys=tuple(json.dumps(n, ensure_ascii=False).encode() for n in names),
            required=frozenset(names.index(r) for r in required),
            extra=extra,
        )
        return index

    def array(self, s: dict[str, Any], where: str) -> int:
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        for name, v in (("minItems", lo), ("maxItems", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise SchemaError(f"{where}.{name}: a non-negative integer")
            if v is not None and v > 1024:
                raise SchemaError(f"{where}.{name}: at most 1024")
        if hi is not None and hi < lo:
            raise SchemaError(f"{where}: maxItems {hi} below minItems {lo}")
        index = self.schema.add(Node(NodeKind.ARRAY))
        items = self.node(s.get("items", True), f"{where}.items")
        self.schema.nodes[index] = Node(NodeKind.ARRAY, items=items, min_items=lo, max_items=hi)
        return index
