"""Quantised weights kept quantised on a device (issue 35): on CUDA the default precision
holds each quantised matrix in its GGUF bytes and dequantises a bounded chunk of rows for
each product (kernels.QuantLinear), instead of a float16 copy of every matrix. No GPU
here: the same path runs on the CPU (loader.DEVICE_QUANT_ON_CPU, float32 products), and
must give the numpy reference's logits within the default path's tolerance, hold the
file's bytes of every quantised matrix, and keep the scratch within its chunk."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from tests.node.engine.tiny_models import TinyModel, TinySpec
from workers.node.engine import EngineOptions, load_stage, native
from workers.node.engine import loader as loader_module
from workers.node.engine.gguf_reader import GGUFFile
from workers.node.engine.kernels import DenseLinear, QuantLinear

IDS = [5, 17, 3, 99, 250, 7, 1, 42]
QUANTISED = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]


@pytest.fixture
def device_path(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The CUDA default path's weights on the CPU: torch's kernels (no native kernel, no
    int4 packing: those are the CPU's own paths), QuantLinear where the format allows."""
    monkeypatch.setenv(native.ENV_CHOICE, "torch")
    native.forget()
    monkeypatch.setattr(loader_module, "DEVICE_QUANT_ON_CPU", True)
    monkeypatch.setattr(loader_module, "int4_compatible", lambda *_a: False)
    monkeypatch.setattr(loader_module, "QUANT_CHUNK_ROWS", 24)  # several chunks per matrix
    yield
    monkeypatch.undo()
    native.forget()


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("qtype", QUANTISED, ids=lambda t: t.name)
def test_quantised_weights_stay_quantised_and_give_the_reference_logits(
    tmp_path: Path, device_path: None, arch: str, qtype: QT
) -> None:
    spec = TinySpec(arch=arch, qtype=qtype, embd_type=QT.Q8_0)
    model = TinyModel(spec, tmp_path / "m.gguf")
    ref = model.logits(IDS)
    stage = load_stage(model.path, 0, 3, EngineOptions(device="cpu", threads=1))
    try:
        layer = stage.model.layers[0]
        assert isinstance(layer.gate_up, QuantLinear) and isinstance(layer.qkv, QuantLinear)
        # Each matrix holds the file's bytes of its tensors, nothing more.
        f = GGUFFile(model.path)
        try:
            names = ["blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"]
            assert layer.gate_up.nbytes == sum(f.tensors[n].n_bytes for n in names)
        finally:
            f.close()
        out = stage.new_session(64).forward_tokens(IDS).numpy()
    finally:
        stage.close()
    # Float32 products of the dequantised weights: only attention's float16 rounding (the
    # default precision's, as llama.cpp's) separates them from the reference.
    assert np.linalg.norm(out - ref) <= 0.02 * np.linalg.norm(ref)


def test_float_formats_and_other_precisions_stay_dense(tmp_path: Path, device_path: None) -> None:
    model = TinyModel(TinySpec(arch="llama", qtype=QT.F16, embd_type=QT.Q8_0), tmp_path / "m.gguf")
    stage = load_stage(model.path, 0, 3, EngineOptions(device="cpu", threads=1))
    try:
        assert isinstance(stage.model.layers[0].gate_up, DenseLinear)
    finally:
        stage.close()
    quant = TinyModel(TinySpec(arch="llama", qtype=QT.Q4_0, embd_type=QT.Q8_0), tmp_path / "q.gguf")
    opts = EngineOptions(device="cpu", precision="float32", threads=1)
    stage = load_stage(quant.path, 0, 3, opts)
    try:
        assert isinstance(stage.model.layers[0].gate_up, DenseLinear)
    finally:
        stage.close()
