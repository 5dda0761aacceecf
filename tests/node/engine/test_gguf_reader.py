"""The lazy GGUF reader against gguf-py's reader."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from tests.node.engine.tiny_models import TinyModel, TinySpec
from workers.node.engine import read_model_facts
from workers.node.engine.gguf_reader import GGUFFile, LazyArray, read_metadata


def test_metadata_and_tensors_match_gguf_py(tmp_path: Path) -> None:
    model = TinyModel(TinySpec(arch="qwen2", qtype=QT.Q4_K), tmp_path / "m.gguf")
    ours = GGUFFile(model.path)
    ref = gguf.GGUFReader(model.path)
    assert ours.architecture == "qwen2"
    assert ours.metadata["qwen2.block_count"] == 3
    assert {t.name for t in ref.tensors} == set(ours.tensors)
    for t in ref.tensors:
        info = ours.tensors[t.name]
        assert info.ggml_type == int(t.tensor_type)
        assert info.n_bytes == t.n_bytes
        assert np.array_equal(ours.raw(t.name), np.asarray(t.data).view(np.uint8).reshape(-1))
    assert ours.materialized == {t.name for t in ref.tensors}
    ours.close()


def test_large_arrays_are_skipped_lazily(tmp_path: Path) -> None:
    path = str(tmp_path / "v.gguf")
    w = gguf.GGUFWriter(path, "llama")
    tokens = [f"tok{i}" for i in range(5000)]
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_uint32("llama.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = GGUFFile(path, map_tensors=False)
    ref = f.metadata["tokenizer.ggml.tokens"]
    assert isinstance(ref, LazyArray) and ref.count == 5000
    assert read_metadata(path, "tokenizer.") == {"tokenizer.ggml.tokens": tokens}
    assert read_model_facts(path).vocab_size == 5000
