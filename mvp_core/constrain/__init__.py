"""Constrained decoding of JSON: a response format compiled into a byte-level
recognizer (schema.py, recognizer.py), and the token masks it gives a vocabulary
(vocab.py). Pure Python: the head validates formats with it, the tail's sampler masks
the logits with it (workers.node.engine.sampling)."""

from mvp_core.constrain.recognizer import MAX_DIGITS, MAX_WS, Recognizer, State
from mvp_core.constrain.schema import (
    MAX_FORMAT_BYTES,
    MAX_SCHEMA_DEPTH,
    Schema,
    SchemaError,
    compile_format,
    compile_schema,
    format_text,
)
from mvp_core.constrain.vocab import Constraint, FormatCache, FormatMasks, TokenVocabulary

__all__ = [
    "MAX_DIGITS",
    "MAX_FORMAT_BYTES",
    "MAX_SCHEMA_DEPTH",
    "MAX_WS",
    "Constraint",
    "FormatCache",
    "FormatMasks",
    "Recognizer",
    "Schema",
    "SchemaError",
    "State",
    "TokenVocabulary",
    "compile_format",
    "compile_schema",
    "format_text",
]
