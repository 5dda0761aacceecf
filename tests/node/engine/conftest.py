"""Shared fixtures: SmolLM2 loaded once per test session (skipped when the file is absent)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from workers.node.engine import EngineOptions, Stage, load_stage, native

SMOLLM = Path(
    os.environ.get(
        "MVP_SMOLLM_GGUF",
        str(Path.home() / ".cache/mvp-orchestrator/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
)
# "Once upon a time" in SmolLM2's vocabulary (no BOS: add_bos_token is false).
ONCE_UPON_A_TIME = [6403, 1980, 253, 655]
# Greedy continuation: ", the city of Nova Haven was a thriving metropolis, with towering
# skyscrapers and bustling streets. But as the years went by, the city began to lose its original"
ONCE_CONTINUATION = [
    28, 260, 2240, 282, 23324, 27108, 436, 253, 15114, 39228, 28, 351, 25854, 41658, 284,
    14055, 9018, 30, 1249, 347, 260, 929, 3514, 411, 28, 260, 2240, 2585, 288, 5946, 624, 2798,
]  # fmt: skip
THREADS = 1  # robust on a shared box: OpenMP barriers stall when cores are contended
# A test of llama.cpp's logits over 16 prompts x 32 steps: ~20 s on the AVX-512 kernel,
# 5-10 minutes in its plain C build (a CPU without AVX-512 VNNI, on a busy machine).
PLAIN_C_TIMEOUT_S = 1500


@contextlib.contextmanager
def native_kernel() -> Iterator[None]:
    """The engine's own kernel for what runs inside, on any x86-64 CPU: where there is no
    AVX-512 VNNI, its plain C build (MVP_ENGINE_KERNEL=native: the same bits, slower)
    instead of the default's torch kernels. llama.cpp's logits are the kernel's property,
    so they are checked on every CPU. The choice is process-wide: a stage loaded inside
    must be used and closed inside."""
    before, threads = os.environ.get(native.ENV_CHOICE), torch.get_num_threads()
    os.environ[native.ENV_CHOICE] = "native"
    native.forget()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(native.ENV_CHOICE, None)
        else:
            os.environ[native.ENV_CHOICE] = before
        native.forget()
        torch.set_num_threads(threads)


@contextlib.contextmanager
def native_stage(path: str, n_layers: int, threads: int = THREADS) -> Iterator[Stage]:
    """A whole-model stage on the default path with the engine's own kernel (see above)."""
    with native_kernel():
        stage = load_stage(path, 0, n_layers, EngineOptions(device="cpu", threads=threads))
        try:
            yield stage
        finally:
            stage.close()


@pytest.fixture(scope="session")
def smollm_path() -> str:
    if not SMOLLM.exists():
        pytest.skip(f"SmolLM2 GGUF not present at {SMOLLM}")
    return str(SMOLLM)


@pytest.fixture(scope="session")
def smollm_default(smollm_path: str) -> Iterator[Stage]:
    stage = load_stage(smollm_path, 0, 30, EngineOptions(device="cpu", threads=THREADS))
    yield stage
    stage.close()


@pytest.fixture(scope="session")
def smollm_exact(smollm_path: str) -> Iterator[Stage]:
    stage = load_stage(
        smollm_path, 0, 30, EngineOptions(device="cpu", precision="exact", threads=THREADS)
    )
    yield stage
    stage.close()


@pytest.fixture(scope="session")
def smollm_f32(smollm_path: str) -> Iterator[Stage]:
    stage = load_stage(
        smollm_path, 0, 30, EngineOptions(device="cpu", precision="float32", threads=THREADS)
    )
    yield stage
    stage.close()
