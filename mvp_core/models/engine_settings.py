"""How a stage computes: precision, device, threads, and the activations' wire type."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field

from mvp_core.models._base import _Model


class ActivationDtype(StrEnum):
    """How the hidden state crosses a pipeline edge (CONTRACTS "Data-plane records",
    DECISIONS 53): float32 as the stage computed it, so N stages compute the 1-stage
    logits bit for bit; float16 at half the bytes, for thin links, at a measured cost
    in fidelity (docs/models.md)."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire (the edge's alignment)."""
        return 4 if self is ActivationDtype.FLOAT32 else 2


class EnginePrecision(StrEnum):
    """How a stage computes (docs/models.md "Precision", DECISIONS 42-44)."""

    # The engine's own kernel: llama.cpp's arithmetic in llama.cpp's float order, so its
    # logits are llama.cpp's (torch's int4 kernel where the host cannot build the kernel).
    DEFAULT = "default"
    # torch's int4 kernel with decode products exact in float32: nearer to the float
    # reference than torch's fast path, further from llama.cpp than the default.
    EXACT = "exact"
    # Every weight dequantized to float32: the reference path.
    FLOAT32 = "float32"


class EngineDevice(StrEnum):
    AUTO = "auto"  # CUDA when torch sees a device, else the CPU
    CPU = "cpu"
    CUDA = "cuda"


class EngineSettings(_Model):
    precision: EnginePrecision = Field(
        default=EnginePrecision.DEFAULT,
        description=(
            "default: the engine's kernel, llama.cpp's logits bit for bit on the CPU, "
            "fastest; exact: torch's int4 kernel with decode products exact in float32 "
            "(~0.45x of torch's one-call path, further from llama.cpp's text than default); "
            "float32: everything dequantized (the reference path)"
        ),
    )
    threads: int | None = Field(default=None, ge=1)
    device: EngineDevice = EngineDevice.AUTO
    fp16_split_points: list[int] = Field(
        default_factory=list,
        description="Round activations to float16 after these layers (emulates a pipeline split)",
    )
    compute_cpus: Literal["auto", "off"] | list[Annotated[int, Field(ge=0)]] = Field(
        default="auto",
        description=(
            "Cores for each node's token path: 'auto' = all of the node's cores but the "
            "first (left to the control plane), 'off' = no pinning, or a list of core ids"
        ),
    )
    token_path_nice: int | None = Field(
        default=-5,
        ge=-20,
        le=19,
        description=(
            "Nice value of each node's token-path threads (applied where the node may raise "
            "priority: root or CAP_SYS_NICE); null leaves the default"
        ),
    )
    address_layout: Literal["auto", "fixed", "randomized"] = Field(
        default="auto",
        description=(
            "'fixed': node processes run with address-space randomization off, so nodes that "
            "share a host map the same code at the same addresses and keep the core's front "
            "end (branch predictors) warm across the per-token switch between them. 'auto' = fixed when a "
            "local provider puts two or more nodes on one host, else 'randomized'"
        ),
    )
