"""The AES-GCM payload codec: round trip, nonces, key errors, pass-through, failures."""

from __future__ import annotations

import base64
import secrets

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError

from activities.providers.base import SECRET_ENV_PASSTHROUGH
from mvp_core.models import Done, SubmitPrompt
from temporal import codec as codec_mod
from temporal.codec import (
    ENCODING,
    KEY_ENV,
    KEY_ID_META,
    EncryptionCodec,
    PayloadDecryptError,
    PayloadKeyError,
    codec_from_env,
    key_id,
    parse_key,
)
from temporal.connect import default_data_converter, encrypted_data_converter

pytestmark = pytest.mark.quick

PROMPT = "Quokka-Zanzibar-4471 my private question"


def _key() -> tuple[str, bytes]:
    raw = secrets.token_bytes(32)
    return base64.b64encode(raw).decode(), raw


def _plain(text: str = PROMPT) -> Payload:
    return pydantic_data_converter.payload_converter.to_payloads([text])[0]


async def test_round_trip_restores_the_payload_exactly():
    c = EncryptionCodec(_key()[1])
    original = _plain()
    [sealed] = await c.encode([original])
    assert sealed.metadata["encoding"] == ENCODING
    assert sealed.metadata[KEY_ID_META] == c.key_id.encode()
    assert PROMPT.encode() not in sealed.SerializeToString()
    assert b"json/plain" not in sealed.SerializeToString()  # the inner encoding is hidden
    [opened] = await c.decode([sealed])
    assert opened == original


async def test_data_converter_round_trips_pydantic_models():
    conv = encrypted_data_converter(EncryptionCodec(_key()[1]))
    values = [
        SubmitPrompt(request_id=3, prompt_text=PROMPT),
        Done(
            request_id=3, final_text="a reply", tokens_generated=2, elapsed_ms=5, stop_reason="eos"
        ),
    ]
    payloads = await conv.encode(values)
    assert all(PROMPT.encode() not in p.SerializeToString() for p in payloads)
    assert await conv.decode(payloads, [SubmitPrompt, Done]) == values


async def test_every_payload_gets_a_fresh_nonce():
    c = EncryptionCodec(_key()[1])
    sealed = await c.encode([_plain()] * 50)
    nonces = {p.data[: codec_mod.NONCE_BYTES] for p in sealed}
    assert len(nonces) == 50
    assert len({p.data for p in sealed}) == 50


async def test_wrong_key_names_both_key_ids_and_never_a_key():
    text_a, raw_a = _key()
    text_b, raw_b = _key()
    [sealed] = await EncryptionCodec(raw_a).encode([_plain()])
    with pytest.raises(PayloadDecryptError) as info:
        await EncryptionCodec(raw_b).decode([sealed])
    msg = str(info.value)
    assert (
        f"payload encrypted with key {key_id(raw_a)}, this process has key {key_id(raw_b)}" in msg
    )
    for secret in (text_a, text_b, raw_a.hex(), raw_b.hex()):
        assert secret not in msg
    assert PROMPT not in msg


async def test_tampered_or_relabelled_payload_fails_authentication():
    c = EncryptionCodec(_key()[1])
    [sealed] = await c.encode([_plain()])
    bad = Payload()
    bad.CopyFrom(sealed)
    bad.data = sealed.data[:-1] + bytes([sealed.data[-1] ^ 1])
    with pytest.raises(PayloadDecryptError, match="failed authentication"):
        c.decrypt(bad)
    relabelled = Payload()
    relabelled.CopyFrom(sealed)
    relabelled.metadata[KEY_ID_META] = b"<script>"
    with pytest.raises(PayloadDecryptError, match="key <malformed>, this process has key"):
        c.decrypt(relabelled)


@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_a_key_of_any_other_length_is_refused_without_echoing_it(length):
    text = base64.b64encode(secrets.token_bytes(length)).decode()
    with pytest.raises(PayloadKeyError) as info:
        codec_from_env({KEY_ENV: text}) if length else parse_key(text)
    msg = str(info.value)
    assert f"decodes to {length} bytes" in msg and "--new-key" in msg
    if text:
        assert text not in msg


def test_a_key_that_is_not_base64_is_refused_without_echoing_it():
    text = "not-base64!!" + secrets.token_hex(8)
    with pytest.raises(PayloadKeyError) as info:
        parse_key(text)
    assert text not in str(info.value) and "not valid base64" in str(info.value)
    with pytest.raises(PayloadKeyError):
        EncryptionCodec(b"short")


async def test_payloads_without_codec_metadata_pass_through_decode():
    c = EncryptionCodec(_key()[1])
    plain = [_plain(), Payload(metadata={"encoding": b"binary/null"}), Payload(data=b"raw")]
    assert await c.decode(plain) == plain
    mixed = [plain[0], *(await c.encode([_plain("other")]))]
    assert await c.decode(mixed) == [plain[0], _plain("other")]


async def test_failure_messages_are_encrypted_too():
    conv = encrypted_data_converter(EncryptionCodec(_key()[1]))
    failure = Failure()
    await conv.encode_failure(ApplicationError(f"bad input {PROMPT}", type="Rejected"), failure)
    assert PROMPT.encode() not in failure.SerializeToString()
    assert failure.message == "Encoded failure"
    assert failure.application_failure_info.type == "Rejected"  # the type stays in clear
    err = await conv.decode_failure(failure)
    assert isinstance(err, ApplicationError) and PROMPT in err.message


def test_the_env_chooses_the_converter_and_reaches_the_nodes():
    assert default_data_converter({}) is pydantic_data_converter
    assert default_data_converter({KEY_ENV: "  "}) is pydantic_data_converter
    text, raw = _key()
    conv = default_data_converter({KEY_ENV: text})
    assert isinstance(conv.payload_codec, EncryptionCodec)
    assert conv.payload_codec.key_id == key_id(raw)
    assert text not in repr(conv.payload_codec)
    assert KEY_ENV in SECRET_ENV_PASSTHROUGH


def test_new_key_cli_prints_a_usable_key(capsys, monkeypatch):
    assert codec_mod.main(["--new-key"]) == 0
    text = capsys.readouterr().out.strip()
    assert len(parse_key(text)) == 32
    monkeypatch.setenv(KEY_ENV, text)
    assert codec_mod.main(["--key-id"]) == 0
    assert capsys.readouterr().out.strip() == key_id(parse_key(text))


async def test_a_lenient_codec_passes_an_unopenable_payload_on_as_undecodable():
    """The workflow worker's codec: one forged or wrong-key payload becomes a placeholder
    that no converter decodes (the run's input checks then refuse it), instead of failing
    the decode of the whole activation, and so every workflow task of the run."""
    import base64 as b64
    import os as _os

    from temporalio.api.common.v1 import Payload as P
    from temporalio.contrib.pydantic import pydantic_data_converter

    from temporal.codec import UNDECRYPTABLE, EncryptionCodec

    theirs = EncryptionCodec(_os.urandom(32))
    ours = EncryptionCodec(_os.urandom(32), lenient=True)
    good = (await ours.encode([P(metadata={"encoding": b"json/plain"}, data=b'{"a":1}')]))[0]
    forged = P(metadata={"encoding": b"binary/encrypted"}, data=b64.b64decode("AAAA"))
    wrong = (await theirs.encode([P(metadata={"encoding": b"json/plain"}, data=b"{}")]))[0]
    out = await ours.decode([good, forged, wrong])
    assert out[0].data == b'{"a":1}'
    assert [p.metadata["encoding"] for p in out[1:]] == [UNDECRYPTABLE, UNDECRYPTABLE]
    import pytest as _pytest

    with _pytest.raises(KeyError):  # "unknown payload encoding"
        pydantic_data_converter.payload_converter.from_payload(out[1])
    strict = EncryptionCodec(_os.urandom(32))
    with _pytest.raises(ValueError):
        await strict.decode([wrong])
