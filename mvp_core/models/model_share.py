"""A hub model pinned at planning, and the share of it one node fetches (DECISIONS 72).

Planning reads only the GGUF headers of a Hugging Face model (HTTP range requests at the
commit the revision named); each node's host then fetches, from the hub itself, the
header and the byte ranges of its own stage's tensors into its host's model cache."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from mvp_core.models._base import _Model
from mvp_core.models.model_source import hub_file_problem, hub_repo_problem

_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_FILE_BYTES = 1 << 44  # 16 TiB: past any GGUF part
MAX_PARTS = 256
MAX_RANGES = 4096


class ByteRange(_Model):
    """Bytes ``[start, end)`` of the model's file number ``part`` (0: the first or only)."""

    part: int = Field(ge=0, lt=MAX_PARTS)
    start: int = Field(ge=0, le=MAX_FILE_BYTES)
    end: int = Field(gt=0, le=MAX_FILE_BYTES)

    @model_validator(mode="after")
    def _ordered(self) -> ByteRange:
        if self.end <= self.start:
            raise ValueError(f"byte range [{self.start}, {self.end}) is empty")
        return self

    @property
    def size(self) -> int:
        return self.end - self.start


class HubPart(_Model):
    """One file of a pinned hub model, as the hub and its header said at planning."""

    file: str
    size: int = Field(gt=0, le=MAX_FILE_BYTES)
    etag: str = Field(min_length=1, max_length=128)
    sha256: str | None = Field(
        default=None, description="The file's sha256 (an LFS file's), checked on a whole fetch"
    )
    header_bytes: int = Field(gt=0, le=MAX_FILE_BYTES, description="Bytes before tensor data")
    header_sha256: str = Field(description="sha256 of those bytes: checked on every fetch")

    @field_validator("file")
    @classmethod
    def _file(cls, v: str) -> str:
        why = hub_file_problem(v)
        if why is not None:
            raise ValueError(f"file {why}")
        return v

    @field_validator("sha256", "header_sha256")
    @classmethod
    def _digest(cls, v: str | None) -> str | None:
        if v is not None and not _SHA256.fullmatch(v):
            raise ValueError("must be a sha256 in lowercase hex")
        return v

    @model_validator(mode="after")
    def _header_inside(self) -> HubPart:
        if self.header_bytes > self.size:
            raise ValueError(f"header of {self.header_bytes} bytes in a file of {self.size}")
        return self


class HubPin(_Model):
    """A hub model at one commit: where it is and what each of its files must be."""

    endpoint: str = Field(max_length=512, description="The hub's URL (HF_ENDPOINT)")
    repo: str
    commit: str
    parts: list[HubPart] = Field(min_length=1, max_length=MAX_PARTS)
    needs_token: bool = Field(
        default=False,
        description="The hub refused the files without a token at planning: a node's host "
        "fetches with its worker's HF_TOKEN (a rented instance gets it for its fetch alone); "
        "else no token goes anywhere",
    )

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str) -> str:
        if not re.fullmatch(r"https?://[^\s/@]+(/[^\s@]*)?", v):
            raise ValueError("must be an http(s) URL without credentials")
        return v.rstrip("/")

    @field_validator("repo")
    @classmethod
    def _repo(cls, v: str) -> str:
        why = hub_repo_problem(v)
        if why is not None:
            raise ValueError(f"repo {why}")
        return v

    @field_validator("commit")
    @classmethod
    def _commit(cls, v: str) -> str:
        if not _COMMIT.fullmatch(v):
            raise ValueError("must be a 40-hex commit id")
        return v

    def describe(self) -> str:
        files = self.parts[0].file if len(self.parts) == 1 else f"{len(self.parts)} parts"
        return f"{self.repo} {files} at {self.commit[:12]}"


class ModelShare(_Model):
    """What one node's host fetches: the ranges of its stage (each part's header too),
    written at ``paths`` (one per part: where the node reads the model)."""

    pin: HubPin
    paths: list[str] = Field(min_length=1, max_length=MAX_PARTS)
    ranges: list[ByteRange] = Field(min_length=1, max_length=MAX_RANGES)

    @model_validator(mode="after")
    def _consistent(self) -> ModelShare:
        parts = self.pin.parts
        if len(self.paths) != len(parts):
            raise ValueError(f"{len(self.paths)} paths for {len(parts)} parts")
        for path, part in zip(self.paths, parts, strict=True):
            # The fetcher creates, sizes and may remove these files: only the cache's own.
            if not path.startswith("/") or "/../" in path or "/./" in path:
                raise ValueError(f"path {path!r} is not an absolute, normalised path")
            if not path.endswith(f"/{part.file}"):
                raise ValueError(f"path {path!r} is not the place of {part.file!r}")
        if len(set(self.paths)) != len(self.paths):
            raise ValueError("two parts at one path")
        for r in self.ranges:
            if r.part >= len(parts) or r.end > parts[r.part].size:
                raise ValueError(f"byte range {r.part}:[{r.start}, {r.end}) is outside the model")
        for i, part in enumerate(parts):  # every file's header: the node checks it
            if not any(
                r.part == i and r.start == 0 and r.end >= part.header_bytes for r in self.ranges
            ):
                raise ValueError(f"the share lacks the header of {part.file!r}")
        return self

    @property
    def size(self) -> int:
        return sum(r.size for r in self.ranges)
