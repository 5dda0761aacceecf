"""The line the orchestrator worker exits with when its namespace lacks the project's
search attributes (temporal/search_attributes.py); the worker itself is tested on a
real dev server in tests/integration/test_search_attributes.py."""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType

from temporal.search_attributes import problems

KEYWORD = IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD
TEXT = IndexedValueType.INDEXED_VALUE_TYPE_TEXT


def test_a_namespace_with_both_attributes_passes() -> None:
    assert problems({"MvpRunPhase": KEYWORD, "MvpPromptStatus": KEYWORD}, "h:7233", "ns") is None


def test_both_missing_are_named_with_one_command_that_creates_them() -> None:
    line = problems({}, "h:7233", "ns")
    assert line is not None and "\n" not in line
    assert "no search attribute MvpPromptStatus (Keyword), MvpRunPhase (Keyword)" in line
    assert (
        "temporal operator search-attribute create --address h:7233 --namespace ns "
        "--name MvpPromptStatus --name MvpRunPhase --type Keyword"
    ) in line


def test_an_attribute_of_another_type_is_named_with_its_type() -> None:
    line = problems({"MvpRunPhase": TEXT, "MvpPromptStatus": KEYWORD}, "h:7233", "ns")
    assert line is not None
    assert "search attribute MvpRunPhase is Text, not Keyword" in line
    assert "create it with" not in line  # nothing is missing: no create command
