"""Route ownership verdicts (DescribeTaskQueue pollers of a node's queue)."""

from activities.membership import judge_route


def test_the_reported_identity_alone_owns_the_route():
    v = judge_route("q@h:1", {"q@h:1"})
    assert v is not None and v.owned


def test_no_poller_yet_asks_again():
    assert judge_route("q@h:1", set()) is None


def test_a_foreign_poller_is_a_mismatch():
    v = judge_route("q@h:1", {"q@h:2"})
    assert v is not None and not v.owned and "expected poller 'q@h:1'" in v.reason


def test_two_pollers_on_a_node_queue_is_a_route_ownership_failure():
    v = judge_route("q@h:1", {"q@h:1", "q@h:2"})
    assert v is not None and not v.owned and "2 workers poll" in v.reason
