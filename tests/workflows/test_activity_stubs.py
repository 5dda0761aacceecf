"""The workflows call every activity through a typed stub bound by name
(workflows/activity_stubs.py): each stub must name an activity a worker registers, with
the same argument and result types, or a call would be checked against a signature the
worker does not have."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable
from typing import Any

import pytest
from temporalio import activity

from activities import datastream, membership, planning, provisioning, reaper
from workers.node.activities import NodeActivities
from workflows import activity_stubs


def _defined(candidates: list[Any]) -> dict[str, Callable[..., Any]]:
    """Every activity definition among ``candidates`` (functions and classes' methods)."""
    found: dict[str, Callable[..., Any]] = {}
    for item in candidates:
        members = inspect.getmembers(item) if inspect.isclass(item) else [("", item)]
        for _, fn in members:
            defn = activity._Definition.from_callable(fn) if callable(fn) else None
            if defn is not None and defn.name is not None:
                found[defn.name] = fn
    return found


def _implementations() -> dict[str, Callable[..., Any]]:
    candidates: list[Any] = [NodeActivities]
    for module in (datastream, membership, planning, provisioning, reaper):
        candidates += [v for _, v in inspect.getmembers(module) if callable(v)]
    return _defined(candidates)


def _signature(fn: Callable[..., Any]) -> tuple[list[Any], Any]:
    hints = typing.get_type_hints(fn)
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    return [hints.get(p.name) for p in params], hints.get("return")


STUBS = _defined([v for _, v in inspect.getmembers(activity_stubs) if callable(v)])


def test_every_stub_is_bound_to_a_registered_activity():
    real = _implementations()
    assert STUBS, "no activity stubs found"
    missing = sorted(set(STUBS) - set(real))
    assert missing == [], f"stubs without an activity of that name: {missing}"


@pytest.mark.parametrize("name", sorted(STUBS))
def test_a_stub_has_its_activitys_argument_and_result_types(name: str):
    real = _implementations()[name]
    assert _signature(STUBS[name]) == _signature(real), name
