"""Connecting to Temporal: one place for the address, namespace and data converter."""

from __future__ import annotations

import asyncio
import os
import time

from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter

DEFAULT_ADDRESS = "localhost:7233"
STARTUP_GRACE_S = 30.0


def temporal_address() -> str:
    return os.environ.get("TEMPORAL_ADDRESS", DEFAULT_ADDRESS)


def temporal_namespace() -> str:
    return os.environ.get("TEMPORAL_NAMESPACE", "default")


async def connect(
    address: str | None = None, namespace: str | None = None, identity: str | None = None
) -> Client:
    """A client that speaks pydantic models on the wire."""
    kwargs = {"identity": identity} if identity else {}
    deadline = time.monotonic() + STARTUP_GRACE_S
    while True:
        try:
            return await Client.connect(
                address or temporal_address(),
                namespace=namespace or temporal_namespace(),
                data_converter=pydantic_data_converter,
                **kwargs,  # type: ignore[arg-type]
            )
        except RuntimeError as err:
            # A server that has just started accepts connections before it is healthy.
            if "not healthy" not in str(err) or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
