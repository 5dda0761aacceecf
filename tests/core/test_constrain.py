"""Constrained decoding's pure core (mvp_core.constrain, DECISIONS 89): the recognizer
accepts the JSON texts of its schema and no other, every text it lets end parses and
validates, its token masks equal a token-by-token check, and the compiler refuses what
it cannot honour, naming it."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mvp_core.constrain import (
    MAX_WS,
    Recognizer,
    SchemaError,
    TokenVocabulary,
    compile_format,
    compile_schema,
)
from mvp_core.constrain.recognizer import MAX_TRAILING_WS
from tests.helpers.json_formats import PERSON, brute_mask, random_text, states_along, validates

LIST = {"type": "array", "items": {"enum": [1, 12, "a"]}, "minItems": 1, "maxItems": 2}
SCHEMAS = {"person": PERSON, "list": LIST, "number": {"type": "number"}, "any": {}}


def recognizer(schema: Any) -> Recognizer:
    return Recognizer(compile_schema(schema))


# --------------------------------------------------------------------------- texts


@pytest.mark.parametrize(
    ("schema", "text"),
    [
        ("person", '{"name":"Ann","age":30,"address":{"street":"Rue 1"}}'),
        ("person", '{ "age" : -0, "name" : "A\\"n\\u00e9\\n",\n  "address": {"zip":"75001", "street":""},'
                   ' "city":"Zürich", "tags":["a","b"], "height": 1.5e-3, "spouse": null,'
                   ' "alive": false, "kind": 7 }'),
        ("person", '{"name":"é","age":1,"address":{"street":"x"},"spouse":"Bo","kind":null}\n'),
        ("list", "[12]"),
        ("list", '[1, "a"]'),
        ("number", "-12.5E+10"),
        ("number", "0"),
        ("any", '[{"a": [true, null, {}]}, "x", 3]'),
    ],
)  # fmt: skip
def test_the_recognizer_accepts_its_schemas_texts(schema: str, text: str) -> None:
    assert recognizer(SCHEMAS[schema]).accepts(text.encode())
    assert validates(json.loads(text), SCHEMAS[schema])


@pytest.mark.parametrize(
    ("schema", "text", "why"),
    [
        ("person", '{"name":"Ann","age":30}', "required address missing"),
        ("person", '{"name":"Ann","age":30.5,"address":{"street":""}}', "integer with a fraction"),
        ("person", '{"name":"Ann","age":1,"address":{"street":""},"x":1}', "an undeclared key"),
        ("person", '{"name":"Ann","name":"Bo","age":1,"address":{"street":""}}', "a key twice"),
        ("person", '{"name":"Ann","age":1,"address":{"street":""},"city":"Oslo"}', "not in enum"),
        ("person", '{"name":"A\x01","age":1,"address":{"street":""}}', "a control byte"),
        ("person", '{"name":"A\\x","age":1,"address":{"street":""}}', "a bad escape"),
        ("person", '{"name":"A","age":01,"address":{"street":""}}', "a leading zero"),
        ("person", '{"name":"A","age":1,"address":{"street":""},"tags":["a","b","c","d"]}',
         "maxItems"),
        ("person", '{"name":"A","age":1,"address":{"street":""}} x', "text after the value"),
        ("person", '{"name":"A","age":1,"address":{"street":""},}', "a trailing comma"),
        ("person", '{"name":"A",' + " " * (MAX_WS + 1) + '"age":1,"address":{"street":""}}',
         "a whitespace run past the bound"),
        ("person", '{"name":"A","age":12345678901234567,"address":{"street":""}}',
         "more than 16 digits"),
        ("list", "[]", "minItems"),
        ("list", "[1,1,1]", "maxItems"),
        ("list", "[2]", "not in enum"),
        ("number", "1.", "a fraction without digits"),
        ("number", "--1", "two signs"),
        ("any", '{"a" 1}', "a missing colon"),
        ("any", "[1,]", "a trailing comma"),
        ("person", b'{"name":"\xc3(","age":1,"address":{"street":""}}', "broken UTF-8"),
        ("person", b'{"name":"\xbf","age":1,"address":{"street":""}}', "a lone continuation"),
    ],
)  # fmt: skip
def test_the_recognizer_refuses_other_texts(schema: str, text: str | bytes, why: str) -> None:
    data = text.encode() if isinstance(text, str) else text
    assert not recognizer(SCHEMAS[schema]).accepts(data), why


def test_json_object_is_any_object_and_nothing_else() -> None:
    rec = Recognizer(compile_format({"type": "json_object"}))
    for good in ["{}", '{"a": [1, {"b": "c"}], "d": -1.0e5, "e": true}', '{"x":{}}']:
        assert rec.accepts(good.encode())
    for bad in ["[]", '"x"', "1", "null", '{"a"}', "{1: 2}"]:
        assert not rec.accepts(bad.encode())


def test_a_complete_value_takes_only_bounded_whitespace() -> None:
    rec = recognizer(PERSON)
    state = rec.feed(rec.start, b'{"name":"A","age":1,"address":{"street":""}}')
    assert rec.complete(state)
    allowed = {b for b in range(256) if rec.advance(state, b)}
    assert allowed == set(b" \t\n\r")
    state = rec.feed(state, b" " * MAX_TRAILING_WS)
    assert rec.complete(state) and not any(rec.advance(state, b) for b in range(256))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32))
def test_every_text_the_recognizer_lets_end_parses_and_validates(name: str, seed: int) -> None:
    rec = recognizer(SCHEMAS[name])
    text = random_text(rec, random.Random(seed))
    if text is None:
        return
    value = json.loads(text.decode("utf-8"))
    assert validates(value, SCHEMAS[name]), text


_person_values = st.fixed_dictionaries(
    {
        "name": st.text(max_size=8),
        "age": st.integers(-(10**15), 10**15),
        "address": st.fixed_dictionaries(
            {"street": st.text(max_size=5)}, optional={"zip": st.just("75001")}
        ),
    },
    optional={
        "height": st.floats(allow_nan=False, allow_infinity=False),
        "city": st.sampled_from(["Paris", "Rome", "Zürich"]),
        "tags": st.lists(st.text(max_size=3), max_size=3),
        "spouse": st.none() | st.text(max_size=3),
        "alive": st.booleans(),
        "kind": st.none() | st.integers(-5, 5),
    },
)


@settings(max_examples=150, deadline=None)
@given(value=_person_values, indent=st.sampled_from([None, 2]), ascii_only=st.booleans())
def test_every_valid_value_written_as_json_is_accepted(
    value: dict[str, Any], indent: int | None, ascii_only: bool
) -> None:
    if ascii_only and value.get("city") == "Zürich":
        del value["city"]  # an enum's value is written as compact JSON: "Zürich" only
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only)
    assert validates(json.loads(text), PERSON)
    assert recognizer(PERSON).accepts(text.encode())


# --------------------------------------------------------------------------- the compiler


@pytest.mark.parametrize(
    ("fmt", "message"),
    [
        ({"type": "json_schema", "schema": {"type": "string", "pattern": "a"}}, "'pattern' not supported"),
        ({"type": "json_schema", "schema": {"type": "integer", "minimum": 1}}, "'minimum' not supported"),
        ({"type": "json_schema", "schema": {"$ref": "#/x"}}, "'$ref' not supported"),
        ({"type": "json_schema", "schema": {"oneOf": [{}]}}, "'oneOf' not supported"),
        ({"type": "json_schema", "schema": {"type": "date"}}, "unknown type 'date'"),
        ({"type": "json_schema", "schema": {"type": "object", "required": ["a"]}},
         "schema.required: 'a' not among the properties"),
        ({"type": "json_schema", "schema": {"type": "object", "properties": {
            "a": {"type": "array", "items": {"type": "strin"}}}}},
         "schema.properties.a.items.type: unknown type 'strin'"),
        ({"type": "json_schema", "schema": {"enum": []}}, "schema.enum: no value is allowed"),
        ({"type": "json_schema", "schema": {"type": "array", "minItems": 3, "maxItems": 2}},
         "maxItems 2 below minItems 3"),
        ({"type": "json_schema", "schema": {"anyOf": []}}, "a non-empty list of schemas"),
        ({"type": "json_schema", "schema": 3}, "a schema is an object, got int"),
        ({"type": "json_schema", "schema": {"enum": ["x" * 17000]}}, "at most 16384"),
        ({"type": "json_schema", "schema": {"items": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}},
         "nests 34 deep; at most 32"),
        ({"type": "json_schema"}, "json_schema needs a schema"),
        ({"type": "yaml"}, "unknown format type 'yaml'"),
        ({"type": "json_object", "schema": {}}, "json_object takes no other field"),
    ],
)  # fmt: skip
def test_a_schema_the_compiler_refuses_gets_a_clear_error(
    fmt: dict[str, Any], message: str
) -> None:
    with pytest.raises(SchemaError, match=message.replace("$", r"\$")):
        compile_format(fmt)


def test_annotations_are_ignored_and_an_empty_schema_is_any_value() -> None:
    schema = {"type": "string", "title": "t", "description": "d", "format": "date", "default": "x"}
    assert recognizer(schema).accepts(b'"2024"')
    assert recognizer({}).accepts(b"[1]") and recognizer(True).accepts(b"null")


# --------------------------------------------------------------------------- masks


PIECES = [
    b"{", b"}", b'{"', b'"', b'",', b'":', b'": "', b'"}', b"}}", b"[", b"]", b"],", b",",
    b" ", b"  ", b"\n", b"\n  ", b" \"", b"name", b'"name', b'"name":', b"age", b"Paris",
    b'"Par', b"is", b"Rome", b"Z\xc3", b"\xbcrich", b"\xc3\xbc", b"\\", b'\\"', b"\\u00",
    b"e9", b"1", b"12", b"0", b"-", b".", b"e", b"E+", b"true", b"false", b"null", b"nul",
    b"street", b"address", b"\x01", b"\xff", b"a", b"b", b"tags", b"spouse", b"75001",
    b"zip", b'"zip":"75001"', b"height", b"alive", b"kind", b"city", b"x y", b"\t",
]  # fmt: skip


@pytest.mark.parametrize("name", ["person", "list", "any"])
def test_masks_equal_the_token_by_token_check(name: str) -> None:
    rnd = random.Random(7)
    vocab = TokenVocabulary([*PIECES, b"", b"<eos>"], eos_ids=[len(PIECES) + 1])
    masks = vocab.masks({"type": "json_schema", "schema": SCHEMAS[name]})
    rec = masks.rec
    texts = [t for t in (random_text(rec, rnd) for _ in range(20)) if t is not None]
    for state in states_along(rec, texts, rnd):
        assert masks.mask(state) == brute_mask(masks, state)
        assert masks.mask(state) == brute_mask(masks, state)  # cached: the same
