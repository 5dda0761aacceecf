"""The project's search attributes on a namespace: checked when a worker starts.

A workflow that upserts a search attribute its namespace does not define fails every
workflow task (``BadSearchAttributes``), retried without end: a prompt's update then
waits forever, and the only sign is a WARN line in the worker's log. So the orchestrator
worker checks the namespace first and refuses to start, naming each missing attribute
and the command that creates it. The dev server this project starts
(temporal.devserver, temporal/dev-server) registers them itself.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.client import Client
from temporalio.service import RPCError, RPCStatusCode

from temporal.connect import TemporalConnectError
from temporal.devserver import SEARCH_ATTRIBUTES

log = logging.getLogger(__name__)

# The CLI's type names (``--type``) and the server's indexed value types.
_TYPES = {
    "Text": IndexedValueType.INDEXED_VALUE_TYPE_TEXT,
    "Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
    "Int": IndexedValueType.INDEXED_VALUE_TYPE_INT,
    "Double": IndexedValueType.INDEXED_VALUE_TYPE_DOUBLE,
    "Bool": IndexedValueType.INDEXED_VALUE_TYPE_BOOL,
    "Datetime": IndexedValueType.INDEXED_VALUE_TYPE_DATETIME,
    "KeywordList": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST,
}
_NAMES = {value: name for name, value in _TYPES.items()}


class SearchAttributesMissing(TemporalConnectError):
    """The namespace lacks (or mistypes) a search attribute the workflows set."""


def problems(defined: Mapping[str, int], address: str, namespace: str) -> str | None:
    """One line naming each required attribute that ``defined`` (name -> indexed value
    type, as the server lists them) lacks or types otherwise, with the command that
    creates the missing ones; None when all are there."""
    missing = sorted(name for name in SEARCH_ATTRIBUTES if name not in defined)
    mistyped = sorted(
        f"{name} is {_NAMES.get(IndexedValueType.ValueType(defined[name]), str(defined[name]))}, "
        f"not {SEARCH_ATTRIBUTES[name]}"
        for name in SEARCH_ATTRIBUTES
        if name in defined and defined[name] != _TYPES[SEARCH_ATTRIBUTES[name]]
    )
    if not missing and not mistyped:
        return None
    parts = []
    if missing:
        listed = ", ".join(f"{name} ({SEARCH_ATTRIBUTES[name]})" for name in missing)
        commands = []
        for kind in sorted({SEARCH_ATTRIBUTES[name] for name in missing}):
            flags = " ".join(f"--name {n}" for n in missing if SEARCH_ATTRIBUTES[n] == kind)
            commands.append(
                f"temporal operator search-attribute create --address {address} "
                f"--namespace {namespace} {flags} --type {kind}"
            )
        parts.append(
            f"namespace {namespace} at {address} has no search attribute {listed}; "
            f"create it with: {' && '.join(commands)}"
        )
    if mistyped:
        parts.append(
            f"namespace {namespace} at {address}: search attribute {'; '.join(mistyped)} "
            "(remove it and create it again with that type)"
        )
    return (
        "; ".join(parts) + " (without them every run's and prompt's workflow task fails "
        "and prompts wait forever)"
    )


async def check_search_attributes(client: Client, address: str) -> None:
    """Raise SearchAttributesMissing (one line) unless the client's namespace defines
    every search attribute the workflows set. A server that does not let this identity
    list them (a cloud API key without that permission) is not refused: a warning says
    what could not be checked."""
    try:
        resp = await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace)
        )
    except RPCError as err:
        if err.status in (
            RPCStatusCode.PERMISSION_DENIED,
            RPCStatusCode.UNIMPLEMENTED,
            RPCStatusCode.UNAUTHENTICATED,
        ):
            log.warning(
                "could not list the search attributes of namespace %s (%s); make sure it "
                "defines %s",
                client.namespace,
                err.status.name,
                ", ".join(f"{n} ({k})" for n, k in SEARCH_ATTRIBUTES.items()),
            )
            return
        raise
    defined: dict[str, int] = {**resp.system_attributes, **resp.custom_attributes}
    problem = problems(defined, address, client.namespace)
    if problem is not None:
        raise SearchAttributesMissing(problem)
