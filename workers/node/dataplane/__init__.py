"""Data plane of a pipeline run: edge records (CONTRACTS.md) and authenticated TCP edges.

Pure stdlib + numpy: nothing here imports torch, so edge threads stay light.
"""

from . import edge, records
from .edge import *  # noqa: F403  (the public names: edge.__all__)
from .records import *  # noqa: F403  (the public names: records.__all__)

__all__ = sorted({*edge.__all__, *records.__all__})
