"""Stage engine: run a contiguous layer range of a GGUF model (see DECISIONS 19-24)."""

from .config import ModelFacts, read_model_facts
from .generate import generate
from .sampling import Sampler, SamplingParams
from .session import ContextOverflow, StageSession
from .stage import EngineOptions, Stage, load_stage

__all__ = [
    "ContextOverflow",
    "EngineOptions",
    "ModelFacts",
    "Sampler",
    "SamplingParams",
    "Stage",
    "StageSession",
    "generate",
    "load_stage",
    "read_model_facts",
]
