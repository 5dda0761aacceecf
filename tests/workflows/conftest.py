"""One time-skipping test server for the whole session (tests/helpers/fake_cluster.py),
and a task queue of its own for each test: a run sends its orchestrator activities and
its prompt workflows to the queue it runs on, so a test's workers poll only its own
queues and never pick up another test's tasks, even one whose workers did not stop
cleanly. Time skipping is the server's: each test ends (or terminates) what it started,
so nothing of it holds the clock for the next one."""

from __future__ import annotations

from collections.abc import AsyncIterator
from uuid import uuid4

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.testing import WorkflowEnvironment

from mvp_core import names
from temporal.connect import default_data_converter
from tests.helpers.fake_cluster import test_server_binary


@pytest.fixture(scope="session")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with await WorkflowEnvironment.start_time_skipping(
        data_converter=default_data_converter({}),
        test_server_existing_path=test_server_binary(),
    ) as environment:
        await environment.client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=environment.client.namespace,
                search_attributes={
                    names.SEARCH_ATTRIBUTE_PHASE: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
                    names.SEARCH_ATTRIBUTE_PROMPT: IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
                },
            )
        )
        yield environment


@pytest.fixture
def task_queue() -> str:
    """The test's own task queue: its workflows run there, its workers poll it."""
    return f"test-{uuid4().hex[:8]}"
