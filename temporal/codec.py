"""Optional payload encryption: prompts and completions are user data, so with
``MVP_PAYLOAD_KEY`` set every payload is AES-256-GCM encrypted before it reaches Temporal.

Every process connects through ``temporal.connect.connect()``, which installs this codec
when the key is set, so the orchestrator worker, node agents and clients all agree.
``python -m temporal.codec --new-key`` prints a fresh key; see docs/payload-codec.md.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import logging
import os
import secrets
import sys
from collections.abc import Mapping, Sequence

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from google.protobuf.message import DecodeError
from temporalio.api.common.v1 import Payload
from temporalio.converter import PayloadCodec

KEY_ENV = "MVP_PAYLOAD_KEY"
KEY_BYTES = 32
NONCE_BYTES = 12
ENCODING = b"binary/encrypted"
UNDECRYPTABLE = b"binary/undecryptable"  # no converter knows it: decoding it fails there
CIPHER = b"AES-256-GCM"
KEY_ID_META = "encryption-key-id"
CIPHER_META = "encryption-cipher"


log = logging.getLogger("mvp.codec")


class PayloadKeyError(ValueError):
    """The configured key is unusable (its text never appears in the message)."""


class PayloadDecryptError(ValueError):
    """An encrypted payload cannot be opened with this process's key."""


def parse_key(text: str) -> bytes:
    """The 32 key bytes from their base64 text; anything else is refused."""
    try:
        key = base64.b64decode(text.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise PayloadKeyError(
            f"{KEY_ENV} is not valid base64; generate one with `python -m temporal.codec --new-key`"
        ) from None
    if len(key) != KEY_BYTES:
        raise PayloadKeyError(
            f"{KEY_ENV} must be base64 of {KEY_BYTES} bytes, it decodes to {len(key)} bytes; "
            "generate one with `python -m temporal.codec --new-key`"
        )
    return key


def key_id(key: bytes) -> str:
    """First 8 hex chars of SHA-256 of the key: names a key in errors without revealing it
    (``base64 -d <<<"$MVP_PAYLOAD_KEY" | sha256sum | cut -c1-8`` gives the same)."""
    return hashlib.sha256(key).hexdigest()[:8]


def new_key() -> str:
    return base64.b64encode(secrets.token_bytes(KEY_BYTES)).decode("ascii")


def _shown_id(raw: bytes) -> str:
    """A key id read from a payload, safe to put in a message (it is untrusted input)."""
    text = raw.decode("ascii", errors="replace")
    if len(text) <= 16 and all(c in "0123456789abcdef" for c in text) and text:
        return text
    return "<malformed>"


class EncryptionCodec(PayloadCodec):
    """AES-256-GCM over the whole serialized payload (metadata and data), so the inner
    encoding is hidden too; a fresh random 12-byte nonce per payload."""

    def __init__(self, key: bytes, *, lenient: bool = False) -> None:
        """``lenient``: a payload this key cannot open decodes to an undecodable
        placeholder instead of failing the whole decode. The workflow worker needs it:
        the SDK decodes an activation before any workflow code runs, so one forged or
        wrong-key signal would otherwise fail every workflow task of the run; with the
        placeholder, the run's own input checks refuse that one payload."""
        self._lenient = lenient
        if len(key) != KEY_BYTES:
            raise PayloadKeyError(f"payload key must be {KEY_BYTES} bytes, got {len(key)}")
        self._aead = AESGCM(key)
        self.key_id = key_id(key)
        # The key id is bound as associated data, so a payload's metadata cannot be
        # relabelled without failing authentication.
        self._aad = ENCODING + b"|" + self.key_id.encode("ascii")

    def __repr__(self) -> str:
        return f"EncryptionCodec(key_id={self.key_id!r})"

    def encrypt(self, payload: Payload) -> Payload:
        nonce = secrets.token_bytes(NONCE_BYTES)
        sealed = self._aead.encrypt(nonce, payload.SerializeToString(), self._aad)
        return Payload(
            metadata={
                "encoding": ENCODING,
                CIPHER_META: CIPHER,
                KEY_ID_META: self.key_id.encode("ascii"),
            },
            data=nonce + sealed,
        )

    def decrypt(self, payload: Payload) -> Payload:
        """The original payload; one without our encoding passes through unchanged, so a
        history written before encryption was enabled still reads."""
        if payload.metadata.get("encoding") != ENCODING:
            return payload
        theirs = payload.metadata.get(KEY_ID_META)
        if theirs is None:
            raise PayloadDecryptError("encrypted payload carries no key id")
        if theirs != self.key_id.encode("ascii"):
            raise PayloadDecryptError(
                f"payload encrypted with key {_shown_id(theirs)}, "
                f"this process has key {self.key_id} (set {KEY_ENV} to the matching key)"
            )
        cipher = payload.metadata.get(CIPHER_META, CIPHER)
        if cipher != CIPHER:
            raise PayloadDecryptError("encrypted payload uses an unknown cipher")
        data = payload.data
        if len(data) < NONCE_BYTES + 16:
            raise PayloadDecryptError(f"encrypted payload (key {self.key_id}) is truncated")
        try:
            plain = self._aead.decrypt(data[:NONCE_BYTES], data[NONCE_BYTES:], self._aad)
        except InvalidTag:
            raise PayloadDecryptError(
                f"encrypted payload failed authentication with key {self.key_id} "
                "(altered in storage or transit)"
            ) from None
        out = Payload()
        try:
            out.ParseFromString(plain)
        except DecodeError:
            raise PayloadDecryptError("decrypted payload is not a valid payload") from None
        return out

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        if not self._lenient:
            return [self.decrypt(p) for p in payloads]
        out = []
        for p in payloads:
            try:
                out.append(self.decrypt(p))
            except PayloadDecryptError as err:
                log.warning("payload not decrypted, passed on as undecodable: %s", err)
                out.append(Payload(metadata={"encoding": UNDECRYPTABLE}))
        return out


def codec_from_env(
    environ: Mapping[str, str] | None = None, *, lenient: bool = False
) -> EncryptionCodec | None:
    """The codec for ``MVP_PAYLOAD_KEY``, or None when it is unset or empty."""
    text = (os.environ if environ is None else environ).get(KEY_ENV, "")
    if not text.strip():
        return None
    return EncryptionCodec(parse_key(text), lenient=lenient)


def required_codec_from_env(needed_by: str) -> EncryptionCodec:
    """The codec for ``MVP_PAYLOAD_KEY``; PayloadKeyError (naming ``needed_by``) where the
    key is unset or unusable. For the commands that cannot run without it."""
    codec = codec_from_env()
    if codec is None:
        raise PayloadKeyError(f"{KEY_ENV} is not set; {needed_by} needs the payload key")
    return codec


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m temporal.codec", description="Payload encryption keys."
    )
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--new-key", action="store_true", help=f"print a fresh {KEY_ENV} value")
    group.add_argument(
        "--key-id", action="store_true", help=f"print the key id of the {KEY_ENV} in use"
    )
    args = parser.parse_args(argv)
    if args.new_key:
        print(new_key())
        return 0
    try:
        codec = required_codec_from_env("--key-id")
    except PayloadKeyError as err:
        print(err, file=sys.stderr)
        return 2
    print(codec.key_id)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
