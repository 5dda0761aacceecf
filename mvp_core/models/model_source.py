"""Where a run's model comes from: a bundled name, a path, or a file of a Hugging Face
repo, with the hub's own naming rules checked before anything is fetched."""

from __future__ import annotations

import re

from pydantic import Field, field_validator

from mvp_core.models._base import _Model

# A Hugging Face model source (docs/models.md): owner/name (the hub's own rule: letters,
# digits, '-', '_', '.', no '--' or '..', at most 96 characters); a file path of segments
# of such characters ending in .gguf; a revision that is a branch, tag or commit.
HUB_REPO_MAX = 96
HUB_FILE_MAX = 255
HUB_REVISION_MAX = 128
_HUB_NAME = r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?"
_HUB_REPO = re.compile(rf"{_HUB_NAME}/{_HUB_NAME}")
_HUB_FILE_SEGMENT = re.compile(r"[A-Za-z0-9_+][A-Za-z0-9_.+-]*")
_HUB_REVISION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.+/-]*")


def hub_repo_problem(repo: str) -> str | None:
    """Why ``repo`` is not a Hugging Face model repo id (``owner/name``), or None."""
    if not repo or len(repo) > HUB_REPO_MAX:
        return f"must be a Hugging Face repo id, owner/name, of 1 to {HUB_REPO_MAX} characters"
    if not _HUB_REPO.fullmatch(repo):
        return (
            "must be a Hugging Face repo id, owner/name (letters, digits, '-', '_', '.'; "
            "each part starting and ending with a letter, digit or '_')"
        )
    if "--" in repo or ".." in repo or repo.endswith(".git"):
        return "must be a Hugging Face repo id: '--', '..' and a '.git' ending are not allowed"
    return None


def hub_file_problem(file: str) -> str | None:
    """Why ``file`` is not a GGUF file path inside a repo, or None."""
    if not file or len(file) > HUB_FILE_MAX:
        return f"must be the path of a .gguf file in the repo, 1 to {HUB_FILE_MAX} characters"
    if file.startswith("/") or "\\" in file:
        return "must be a relative path inside the repo, with '/' between folders"
    segments = file.split("/")
    if any(s in ("", ".", "..") for s in segments):
        return "must be a relative path inside the repo: no empty, '.' or '..' parts"
    if not all(_HUB_FILE_SEGMENT.fullmatch(s) for s in segments):
        return (
            "must be a path of letters, digits, '-', '_', '.', '+' (no spaces or other characters)"
        )
    if not file.lower().endswith(".gguf"):
        return "must name a GGUF file (ending in .gguf)"
    return None


def hub_revision_problem(revision: str) -> str | None:
    """Why ``revision`` is not a branch, tag or commit name, or None."""
    if not revision or len(revision) > HUB_REVISION_MAX:
        return f"must be a branch, tag or commit of 1 to {HUB_REVISION_MAX} characters"
    if (
        not _HUB_REVISION.fullmatch(revision)
        or ".." in revision
        or "//" in revision
        or revision.endswith(("/", ".", ".lock"))
    ):
        return (
            "must be a branch, tag or commit: letters, digits, '-', '_', '.', '+', '/' "
            "(no '..', '//', or a '/', '.' or '.lock' ending)"
        )
    return None


class HubModel(_Model):
    """A GGUF file of a Hugging Face model repo (process spec [model] gguf_repo, gguf_file,
    gguf_revision). The token, when the repo needs one, is ``HF_TOKEN`` in the environment
    of the orchestrator worker that fetches it, never part of a run."""

    repo: str = Field(
        description="Repo id, owner/name, e.g. 'HuggingFaceTB/SmolLM2-135M-Instruct-GGUF'"
    )
    file: str = Field(
        description="Path of the GGUF in the repo, e.g. 'smollm2-135m-instruct-q8_0.gguf'"
    )
    revision: str = Field(default="main", description="Branch, tag or commit (default main)")

    @field_validator("repo")
    @classmethod
    def _repo(cls, value: str) -> str:
        return _checked(value, hub_repo_problem(value))

    @field_validator("file")
    @classmethod
    def _file(cls, value: str) -> str:
        return _checked(value, hub_file_problem(value))

    @field_validator("revision")
    @classmethod
    def _revision(cls, value: str) -> str:
        return _checked(value, hub_revision_problem(value))

    def describe(self) -> str:
        """``owner/name/file@revision``: how messages name it."""
        return f"{self.repo}/{self.file}@{self.revision}"


def _checked(value: str, problem: str | None) -> str:
    if problem is not None:
        raise ValueError(problem)
    return value


class ModelSource(_Model):
    """Where the GGUF comes from: a bundled default by name, a local path, or a file of a
    Hugging Face repo; exactly one of them (``validate_request``)."""

    bundled: str | None = Field(
        default=None, description="Name of a bundled model, e.g. 'SmolLM2-135M-Instruct.Q4_1'"
    )
    path: str | None = Field(default=None, description="Path of a GGUF file on the provider host")
    hf: HubModel | None = Field(
        default=None,
        description=(
            "A GGUF of a Hugging Face repo, downloaded once into the model cache of the "
            "provider host (HF_ENDPOINT and HF_TOKEN from that worker's environment)"
        ),
    )

    def display_name(self) -> str | None:
        """How summaries name the model before a plan exists: the bundled name, or the
        file name of the path or of the hub file; None when no source is given."""
        if self.bundled:
            return self.bundled
        if self.path:
            return self.path.replace("\\", "/").rsplit("/", 1)[-1]
        if self.hf is not None:
            return self.hf.file.rsplit("/", 1)[-1]
        return None
