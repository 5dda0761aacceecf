"""Read the planner's model facts from GGUF metadata (no tensor data is touched)."""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader

from mvp_core.models import ModelFacts
from mvp_core.planner import PlanningError


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    if field is None:
        return None
    return field.contents()


def read_model_facts(path: str) -> ModelFacts:
    try:
        reader = GGUFReader(path, "r")
    except Exception as err:
        raise PlanningError(f"cannot read GGUF metadata of {path}: {err}") from None
    arch = _field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise PlanningError(f"GGUF {path} has no general.architecture")

    def need(key: str) -> int:
        value = _field(reader, f"{arch}.{key}")
        if not isinstance(value, int):
            raise PlanningError(f"GGUF {path} is missing {arch}.{key}")
        return value

    name = _field(reader, "general.name")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelFacts(
        architecture=arch,
        name=name if isinstance(name, str) else arch,
        block_count=need("block_count"),
        embedding_length=need("embedding_length"),
        context_length=need("context_length"),
        eos_token_id=eos if isinstance(eos, int) else None,
    )
