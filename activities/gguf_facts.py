"""Read the planner's model facts from GGUF metadata (no tensor data is touched)."""

from __future__ import annotations

import re
from typing import Any

from mvp_core.engine_support import (
    unsupported_architecture,
    unsupported_rope,
    unsupported_types,
)
from mvp_core.gguf_header import GGUFHeader, TensorInfo
from mvp_core.models import ModelBytes, ModelFacts
from mvp_core.planner import PlanningError
from mvp_io.gguf_files import open_model


def read_model_facts(path: str) -> ModelFacts:
    return read_model(path)[0]


def read_model(path: str) -> tuple[ModelFacts, list[str], GGUFHeader]:
    """The planner's facts of the model at ``path``, every file of it (a split GGUF's
    parts, first first) and its (joined) header, from one reading of the headers."""
    try:
        with open_model(path) as files:  # a split model: its parts joined
            header, paths = files.header, list(files.paths)
        meta = header.metadata
    except (OSError, ValueError) as err:  # GGUFError is a ValueError; so is mmap on a FIFO
        raise PlanningError(f"cannot read GGUF metadata of {path}: {err}") from None
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise PlanningError(f"GGUF {path} has no general.architecture")
    # What the engine lacks is named here, before any node starts (issue 24).
    why = (
        unsupported_architecture(arch)
        or unsupported_types((t.name, t.ggml_type, t.type_name) for t in header.tensors.values())
        or unsupported_rope(arch, meta, header.tensors)
    )
    if why is not None:
        raise PlanningError(f"GGUF {path}: {why}")

    def need(key: str) -> int:
        value: Any = meta.get(f"{arch}.{key}")
        if not isinstance(value, int) or isinstance(value, bool):
            raise PlanningError(f"GGUF {path} is missing {arch}.{key}")
        return value

    blocks = need("block_count")
    layer_work, output_work = _work(header, blocks)
    name = meta.get("general.name")
    eos = meta.get("tokenizer.ggml.eos_token_id")
    facts = ModelFacts(
        architecture=arch,
        name=name if isinstance(name, str) else arch,
        block_count=blocks,
        embedding_length=need("embedding_length"),
        context_length=need("context_length"),
        eos_token_id=eos if isinstance(eos, int) and not isinstance(eos, bool) else None,
        layer_work=layer_work,
        output_work=output_work,
        sizes=_sizes(header, arch, blocks),
    )
    return facts, paths, header


_LAYER_TENSOR = re.compile(r"blk\.([0-9]{1,6})\..+", re.ASCII)
MAX_WORK = 1 << 62  # past this a tensor's shape is not a model's: no figures


def _elements(info: TensorInfo) -> int | None:
    """A matrix's elements (2 to 4 dimensions, each below 2**40); None for anything else
    (a vector, or a shape no model has: the file is untrusted)."""
    if not 2 <= len(info.shape) <= 4 or any(not 0 < d < 1 << 40 for d in info.shape):
        return None
    return info.n_elements


def _work(header: GGUFHeader, blocks: int) -> tuple[list[int] | None, int | None]:
    """Multiply-accumulates per token: each layer's matrices (``blk.<i>.*``, 2 to 4
    dimensions; norms and biases are noise), and the output head's (``output.weight``, or
    the tied ``token_embd.weight``). None where the table does not say (a layer without
    matrices, no head) or says what no model does."""
    if not 0 < blocks <= len(header.tensors):  # each layer has tensors: else no figures
        return None, None
    layers = [0] * blocks
    for name, info in header.tensors.items():
        m = _LAYER_TENSOR.fullmatch(name)
        if m is None or int(m.group(1)) >= blocks:
            continue
        n = _elements(info)
        if n is not None:
            layers[int(m.group(1))] += n
    head = header.tensors.get("output.weight") or header.tensors.get("token_embd.weight")
    head_work = None if head is None else _elements(head)
    if not all(layers) or head_work is None or max(*layers, head_work) > MAX_WORK:
        return None, None
    return layers, head_work


def _positive(meta: dict[str, Any], key: str, default: int | None = None) -> int | None:
    value = meta.get(key, default)
    ok = isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 32
    return value if ok else None


def _sizes(header: GGUFHeader, arch: str, blocks: int) -> ModelBytes | None:
    """Bytes per stage part (every tensor's GGUF bytes: a stage holds its tensors at
    about their file size) and the KV cache's width; None where the table or the metadata
    does not say (no figures rather than wrong ones: the file is untrusted)."""
    meta = header.metadata
    if not 0 < blocks <= len(header.tensors):
        return None
    layers = [0] * blocks
    embedding = output = 0
    try:
        for name, info in header.tensors.items():
            m = _LAYER_TENSOR.fullmatch(name)
            if m is not None and int(m.group(1)) < blocks:
                layers[int(m.group(1))] += info.n_bytes
            elif name == "token_embd.weight":
                embedding = info.n_bytes
            elif m is None:
                output += info.n_bytes
    except ValueError:  # a type without a size (planning refused those already)
        return None
    heads = _positive(meta, f"{arch}.attention.head_count")
    hidden = _positive(meta, f"{arch}.embedding_length")
    kv_heads = _positive(meta, f"{arch}.attention.head_count_kv", heads)
    per_head = hidden // heads if heads and hidden and hidden % heads == 0 else None
    key = _positive(meta, f"{arch}.attention.key_length", per_head)
    value = _positive(meta, f"{arch}.attention.value_length", key)
    if not all(layers) or not embedding or None in (kv_heads, key, value):
        return None
    if max(*layers, embedding, output) > MAX_WORK:
        return None
    assert kv_heads is not None and key is not None and value is not None
    return ModelBytes(
        layers=layers,
        embedding=embedding,
        output=output,
        tied_head="output.weight" not in header.tensors,
        kv_elements=kv_heads * (key + value),
    )
