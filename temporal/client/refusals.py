"""A client whose server calls give up within a second: what a prompt's admission uses
where its caller must answer a refusal at once (the gateway: a 429 within a second,
issue 37), not after the SDK's own retries of it.

A Temporal server refuses an Update past its limit on a workflow's Updates in flight
(``history.maxInFlightUpdates``, 10 by default) with RESOURCE_EXHAUSTED, which the SDK
retries like any transient error: with its default retry configuration for about 10-15 s
(``RetryConfig``: up to 10 tries, 10 s in all). Several gateways over one run can meet
that limit together (each keeps 8 admissions in flight, ``ADMISSIONS_AT_ONCE``). This
client is the same connection's configuration with retries bounded to ``QUICK_RETRY``:
an admission the server keeps refusing fails within ``QUICK_RETRY_S``, and a transient
blip (UNAVAILABLE) is retried as long, no longer. An Update is idempotent by its id, so
a retry never admits twice."""

from __future__ import annotations

import dataclasses
import weakref

from temporalio.client import Client
from temporalio.service import RetryConfig, ServiceClient

QUICK_RETRY_S = 0.8
QUICK_RETRY = RetryConfig(
    initial_interval_millis=100,
    randomization_factor=0.2,
    multiplier=1.5,
    max_interval_millis=300,
    max_elapsed_time_millis=int(QUICK_RETRY_S * 1000),
    max_retries=4,
)

_quick: weakref.WeakKeyDictionary[Client, Client] = weakref.WeakKeyDictionary()


async def quick_client(client: Client) -> Client:
    """``client``'s connection, its retries bounded to ``QUICK_RETRY`` (one per client
    and process, made on first use; the same namespace, data converter and interceptors)."""
    found = _quick.get(client)
    if found is not None:
        return found
    config = dataclasses.replace(client.service_client.config, retry_config=QUICK_RETRY)
    service = await ServiceClient.connect(config)
    c = client.config()
    made = Client(
        service,
        namespace=c["namespace"],
        data_converter=c["data_converter"],
        plugins=c["plugins"],
        interceptors=c["interceptors"],
        default_workflow_query_reject_condition=c["default_workflow_query_reject_condition"],
        header_codec_behavior=c["header_codec_behavior"],
    )
    # Two first calls at once each connect; the first kept is everyone's (no lock: a
    # lock made here would belong to one event loop).
    return _quick.setdefault(client, made)
