"""Stage engine: run a contiguous layer range of a GGUF model (see DECISIONS 19-24)."""

from .batch_generate import BatchGenerator
from .config import EngineModelFacts, read_model_facts
from .generate import generate
from .native import usable_cores
from .sampling import Sampler, SamplingParams
from .session import BatchSession, ContextOverflow, NoFreeSlot, StageSession
from .stage import EngineOptions, LoadObserver, Stage, load_stage, uses_native_kernel

__all__ = [
    "BatchGenerator",
    "BatchSession",
    "ContextOverflow",
    "EngineModelFacts",
    "EngineOptions",
    "LoadObserver",
    "NoFreeSlot",
    "Sampler",
    "SamplingParams",
    "Stage",
    "StageSession",
    "generate",
    "load_stage",
    "read_model_facts",
    "usable_cores",
    "uses_native_kernel",
]
