"""The time-skipping test server, one per test (tests/helpers/fake_cluster.py): the
workflows poll fixed task queues, so a test whose workers did not stop cleanly must not
leave them polling beside the next test's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest
from temporalio.testing import WorkflowEnvironment

from temporal.connect import default_data_converter
from tests.helpers.fake_cluster import test_server_binary


@pytest.fixture
async def env() -> AsyncIterator[WorkflowEnvironment]:
    async with await WorkflowEnvironment.start_time_skipping(
        data_converter=default_data_converter({}),
        test_server_existing_path=test_server_binary(),
    ) as environment:
        await environment.client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(
                namespace=environment.client.namespace,
                search_attributes={
                    "MvpRunPhase": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
                    "MvpPromptStatus": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
                },
            )
        )
        yield environment
