"""Hugging Face model sources as a run and the process host take them (issue 13): the
shape of a repo id, a file path and a revision, checked before anything is fetched, with
errors that name the field and never echo a secret."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from mvp_core.host_config import ConfigError, HubGguf, resolve_config, to_run_request
from mvp_core.models import HubModel, ModelSource, RunRequest
from mvp_core.validation import RunRejectedError, parse_request, validate_request
from tests.core.test_host_config import CWD, DEFAULT_TOML, MemoryFiles

REPO = "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF"
FILE = "smollm2-135m-instruct-q8_0.gguf"


@pytest.mark.parametrize(
    ("repo", "file", "revision"),
    [
        (REPO, FILE, "main"),
        ("bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q4_K_M.gguf", "v1.0"),
        ("a/b", "Q4_K_M/model-00001-of-00002.gguf", "refs/pr/12"),
        ("org_1/x.y", "M.GGUF", "0123456789abcdef0123456789abcdef01234567"),
    ],
)
def test_a_hub_source_of_good_shape_is_taken_as_it_is(repo, file, revision):
    hub = HubModel(repo=repo, file=file, revision=revision)
    assert (hub.repo, hub.file, hub.revision) == (repo, file, revision)
    validate_request(RunRequest(model=ModelSource(hf=hub)))


def test_the_revision_defaults_to_main():
    assert HubModel(repo=REPO, file=FILE).revision == "main"


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("repo", "SmolLM2", "owner/name"),
        ("repo", "a/b/c", "owner/name"),
        ("repo", "-a/b", "owner/name"),
        ("repo", "a/b-", "owner/name"),
        ("repo", "a--b/c", "'--', '..'"),
        ("repo", "a/b..c", "'--', '..'"),
        ("repo", "a/b.git", ".git"),
        ("repo", "a/" + "b" * 95, "1 to 96 characters"),
        ("repo", "", "1 to 96 characters"),
        ("file", "../x.gguf", "'..'"),
        ("file", "sub/../../x.gguf", "'..'"),
        ("file", "/etc/x.gguf", "relative path"),
        ("file", "a//b.gguf", "no empty"),
        ("file", "a\\b.gguf", "relative path"),
        ("file", "my model.gguf", "no spaces"),
        ("file", "model.safetensors", "ending in .gguf"),
        ("file", "", "a .gguf file"),
        ("revision", "", "1 to 128"),
        ("revision", "a..b", "no '..'"),
        ("revision", "-rf", "letters, digits"),
        ("revision", "main/", "no '..'"),
        ("revision", "x.lock", ".lock"),
        ("revision", "a b", "letters, digits"),
    ],
)
def test_a_hub_source_of_bad_shape_is_refused_naming_the_field(field, value, reason):
    fields = {"repo": REPO, "file": FILE, "revision": "main", field: value}
    with pytest.raises(ValidationError) as info:
        HubModel(**fields)
    assert reason in str(info.value)
    # A run request says which field, without echoing the value.
    raw = {"model": {"hf": fields}}
    with pytest.raises(RunRejectedError) as rejected:
        parse_request(raw)
    message = str(rejected.value)
    assert message.startswith(f"invalid run request: model.hf.{field}: ")
    assert reason in message
    if len(value) > 3:
        assert value not in message


@pytest.mark.parametrize(
    "model",
    [
        ModelSource(),
        ModelSource(bundled="SmolLM2-135M-Instruct.Q4_1", hf=HubModel(repo=REPO, file=FILE)),
        ModelSource(path="/m.gguf", hf=HubModel(repo=REPO, file=FILE)),
    ],
)
def test_a_run_names_exactly_one_model_source(model):
    with pytest.raises(RunRejectedError, match=r"^missing model source: set exactly one of "):
        validate_request(RunRequest(model=model))


def test_a_hub_tokenizer_is_a_source_like_the_model():
    hub = ModelSource(hf=HubModel(repo=REPO, file=FILE))
    validate_request(RunRequest(model=hub, tokenizer=hub))
    both = ModelSource(path="/t.gguf", hf=HubModel(repo=REPO, file=FILE))
    with pytest.raises(RunRejectedError, match="exactly one of bundled, path or hf"):
        validate_request(RunRequest(model=hub, tokenizer=both))


def test_an_unknown_key_of_a_hub_source_is_refused():
    # The token is never part of a run: there is no field for it, and none is accepted.
    with pytest.raises(RunRejectedError, match=r"model\.hf\.token: Extra inputs"):
        parse_request({"model": {"hf": {"repo": REPO, "file": FILE, "token": "hf_x"}}})


# --------------------------------------------------------------------------- the host


def host(toml: str, env: dict[str, str] | None = None):
    files = MemoryFiles({str(DEFAULT_TOML): toml})
    return resolve_config([], env or {}, CWD, files)


def test_the_host_runs_a_hub_model_of_its_model_table_without_its_token():
    secret = "hf_hostConfigSecret_51c0"
    cfg = host(f'[model]\ngguf_repo = "{REPO}"\ngguf_file = "{FILE}"\n', {"HF_TOKEN": secret})
    assert cfg.gguf_source == HubGguf(repo=REPO, file=FILE)
    assert cfg.hf_token is not None and cfg.hf_token.get_secret_value() == secret
    request = to_run_request(cfg)
    assert request.model == ModelSource(hf=HubModel(repo=REPO, file=FILE, revision="main"))
    assert secret not in request.model_dump_json()
    pinned = host(f'[model]\ngguf_repo = "{REPO}"\ngguf_file = "{FILE}"\ngguf_revision = "v2"\n')
    hf = to_run_request(pinned).model.hf
    assert hf is not None and hf.revision == "v2"


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            'gguf_repo = "just-a-name"\ngguf_file = "m.gguf"',
            'invalid model.gguf_repo="just-a-name": must be a Hugging Face repo id, owner/name',
        ),
        (
            'gguf_repo = "o/r"\ngguf_file = "../m.gguf"',
            'invalid model.gguf_file="../m.gguf": must be a relative path inside the repo',
        ),
        (
            'gguf_repo = "o/r"\ngguf_file = "m.bin"',
            'invalid model.gguf_file="m.bin": must name a GGUF file',
        ),
        (
            'gguf_repo = "o/r"\ngguf_file = "m.gguf"\ngguf_revision = "a..b"',
            'invalid model.gguf_revision="a..b": must be a branch, tag or commit',
        ),
    ],
)
def test_the_host_refuses_a_hub_source_of_bad_shape_before_it_starts(keys, message):
    with pytest.raises(ConfigError) as info:
        host(f"[model]\n{keys}\n")
    assert str(info.value).startswith(message)


def test_display_name_names_every_source_by_its_file():
    from mvp_core.models import ModelSource

    assert ModelSource(bundled="SmolLM2-135M-Instruct.Q4_1").display_name() == (
        "SmolLM2-135M-Instruct.Q4_1"
    )
    assert ModelSource(path="/models/x/y.Q8_0.gguf").display_name() == "y.Q8_0.gguf"
    hub = ModelSource.model_validate(
        {"hf": {"repo": "owner/name", "file": "sub/z.gguf", "revision": "v1"}}
    )
    assert hub.display_name() == "z.gguf"
    assert ModelSource().display_name() is None
