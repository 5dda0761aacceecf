"""A node's resource name (``mvp-<run_id>-<node_id>-<nonce8>``) is read back from untrusted
places (container labels, Vast.ai instance labels, the process table): every provider and
the reaper recognise one by the same rule."""

from __future__ import annotations

import pytest

from mvp_core.names import node_resource_name, parse_resource_name


def test_a_resource_name_reads_back_as_its_run_node_and_nonce():
    name = node_resource_name(18446744073709551615, 3, "abcdef0123456789")
    assert parse_resource_name(name) == (18446744073709551615, 3, "abcdef01")


@pytest.mark.parametrize(
    "name",
    [
        "mvp-7-1-ABABABAB",  # the nonce is lower-case hex
        "mvp-7-1-abababa",  # ... of 8 characters
        "mvp-7-1-abababab-x",
        "mvp-\u0667-1-abababab",  # ASCII digits only (this is ARABIC-INDIC DIGIT SEVEN)
        "mvp-123456789012345678901-1-abababab",  # more digits than a u64 has
        "mvp-orchestrator-7-1-abababab",  # a container's name, not a resource's
        "vast-standin",
    ],
)
def test_a_name_of_another_shape_is_not_ours(name: str):
    assert parse_resource_name(name) is None
