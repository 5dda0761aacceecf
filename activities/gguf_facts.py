"""Read the planner's model facts from GGUF metadata (no tensor data is touched)."""

from __future__ import annotations

import mmap
import os
from typing import Any

from mvp_core.gguf_header import GGUFHeader, parse_header
from mvp_core.models import ModelFacts
from mvp_core.planner import PlanningError


def _read_header(path: str) -> GGUFHeader:
    """Map the file and decode its header; only the header's pages are read."""
    with open(path, "rb") as fh:
        if os.fstat(fh.fileno()).st_size == 0:
            return parse_header(b"", path)
        with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return parse_header(buf, path)


def read_model_facts(path: str) -> ModelFacts:
    try:
        meta = _read_header(path).metadata
    except (OSError, ValueError) as err:  # GGUFError is a ValueError; so is mmap on a FIFO
        raise PlanningError(f"cannot read GGUF metadata of {path}: {err}") from None
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise PlanningError(f"GGUF {path} has no general.architecture")

    def need(key: str) -> int:
        value: Any = meta.get(f"{arch}.{key}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise PlanningError(f"GGUF {path} is missing {arch}.{key}")
        return value

    name = meta.get("general.name")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelFacts(
        architecture=arch,
        name=name if isinstance(name, str) else arch,
        block_count=need("block_count"),
        embedding_length=need("embedding_length"),
        context_length=need("context_length"),
        eos_token_id=eos if isinstance(eos, int) and not isinstance(eos, bool) else None,
    )
