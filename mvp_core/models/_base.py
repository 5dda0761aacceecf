"""The base of every message model, and the bounds they share."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=False)


_DAY_S = 86_400.0
_U32 = 2**32 - 1
_U64 = 2**64 - 1
