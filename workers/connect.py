"""Connecting to Temporal: one place for the address, namespace and data converter."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from collections.abc import Mapping

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes

from workers.codec import EncryptionCodec, codec_from_env

DEFAULT_ADDRESS = "localhost:7233"
STARTUP_GRACE_S = 30.0


def temporal_address() -> str:
    return os.environ.get("TEMPORAL_ADDRESS", DEFAULT_ADDRESS)


def temporal_namespace() -> str:
    return os.environ.get("TEMPORAL_NAMESPACE", "default")


def encrypted_data_converter(codec: EncryptionCodec) -> DataConverter:
    """Pydantic on the wire, every payload encrypted, and failure messages and stack
    traces moved into an encrypted payload too: they can quote user input (a pydantic
    validation error echoes the value it rejected)."""
    return dataclasses.replace(
        pydantic_data_converter,
        payload_codec=codec,
        failure_converter_class=DefaultFailureConverterWithEncodedAttributes,
    )


def default_data_converter(
    environ: Mapping[str, str] | None = None, *, lenient: bool = False
) -> DataConverter:
    """Encrypted when ``MVP_PAYLOAD_KEY`` is set (a bad key fails here, at startup).
    ``lenient``: for workflow workers, a payload the key cannot open reaches the
    workflow as undecodable instead of failing its every task (workers/codec.py)."""
    codec = codec_from_env(environ, lenient=lenient)
    return pydantic_data_converter if codec is None else encrypted_data_converter(codec)


async def connect(
    address: str | None = None,
    namespace: str | None = None,
    identity: str | None = None,
    *,
    data_converter: DataConverter | None = None,
) -> Client:
    """A client that speaks pydantic models on the wire, encrypted when a key is set."""
    kwargs = {"identity": identity} if identity else {}
    converter = data_converter or default_data_converter()
    deadline = time.monotonic() + STARTUP_GRACE_S
    while True:
        try:
            return await Client.connect(
                address or temporal_address(),
                namespace=namespace or temporal_namespace(),
                data_converter=converter,
                **kwargs,  # type: ignore[arg-type]
            )
        except RuntimeError as err:
            # A server that has just started accepts connections before it is healthy.
            if "not healthy" not in str(err) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
