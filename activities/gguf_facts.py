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
        header = _read_header(path)
        meta = header.metadata
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

    blocks = need("block_count")
    layer_work, output_work = _work(header, blocks)
    name = meta.get("general.name")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelFacts(
        architecture=arch,
        name=name if isinstance(name, str) else arch,
        block_count=blocks,
        embedding_length=need("embedding_length"),
        context_length=need("context_length"),
        eos_token_id=eos if isinstance(eos, int) and not isinstance(eos, bool) else None,
        layer_work=layer_work,
        output_work=output_work,
    )


def _work(header: GGUFHeader, blocks: int) -> tuple[list[int] | None, int | None]:
    """Multiply-accumulates per token: each layer's matrices (``blk.<i>.*``, 2 or more
    dimensions; norms and biases are noise), and the output head's (``output.weight``, or
    the tied ``token_embd.weight``). None where the table does not say (no such tensors)."""
    if not 0 < blocks <= len(header.tensors):  # each layer has tensors: else no figures
        return None, None
    layers = [0] * blocks
    for name, info in header.tensors.items():
        parts = name.split(".")
        if parts[0] == "blk" and len(parts) > 2 and parts[1].isdigit() and len(info.shape) > 1:
            i = int(parts[1])
            if i < blocks:
                layers[i] += info.n_elements
    head = header.tensors.get("output.weight") or header.tensors.get("token_embd.weight")
    if not all(layers) or head is None:
        return None, None
    return layers, head.n_elements
