"""The reaper's rule: destroy what belongs to an absent or closed run, or to another
execution of a running one; keep a running execution's resources and every doubt."""

from __future__ import annotations

from mvp_core.models import ProviderKind, ProviderResource
from mvp_core.reaper import Liveness, RunLiveness, decide, decide_one, run_ids_of


def res(run: int, nonce8: str = "aaaaaaaa", name: str | None = None) -> ProviderResource:
    return ProviderResource(
        provider=ProviderKind.PROCESS,
        kind="process",
        name=name or f"mvp-{run}-1-{nonce8}",
        run_workflow_id=f"mvp-run-{run}",
        nonce8=nonce8,
        host="h",
    )


def live(state: Liveness, nonce8: str | None = None, detail: str = "") -> RunLiveness:
    return RunLiveness(state=state, nonce8=nonce8, detail=detail)


def test_absent_run_is_destroyed():
    destroy, why = decide_one(res(1), live(Liveness.ABSENT))
    assert destroy and why == "run mvp-run-1 does not exist"


def test_closed_run_is_destroyed_naming_how_it_closed():
    destroy, why = decide_one(res(1), live(Liveness.CLOSED, detail="terminated"))
    assert destroy and why == "run mvp-run-1 is closed (terminated)"


def test_running_execution_keeps_its_resources():
    destroy, why = decide_one(res(1, "aaaaaaaa"), live(Liveness.RUNNING, "aaaaaaaa"))
    assert not destroy and "running this execution" in why


def test_live_nonce_is_compared_on_its_first_8_characters():
    destroy, _ = decide_one(res(1, "aaaaaaaa"), live(Liveness.RUNNING, "aaaaaaaa" + "f" * 24))
    assert not destroy


def test_another_execution_of_a_running_run_is_destroyed():
    destroy, why = decide_one(res(1, "aaaaaaaa"), live(Liveness.RUNNING, "bbbbbbbb"))
    assert destroy
    assert (
        why == "run mvp-run-1 is running another execution (bbbbbbbb, the resource's is aaaaaaaa)"
    )


def test_doubt_keeps():
    assert decide_one(res(1), None) == (False, "liveness of mvp-run-1 was not checked")
    destroy, why = decide_one(res(1), live(Liveness.UNKNOWN, detail="snapshot query failed: x"))
    assert not destroy and why == "liveness of mvp-run-1 unknown: snapshot query failed: x"
    # running, but the execution cannot be told apart: no nonce on either side
    assert not decide_one(res(1), live(Liveness.RUNNING, None))[0]
    assert not decide_one(res(1, nonce8=""), live(Liveness.RUNNING, "aaaaaaaa"))[0]


def test_decide_splits_every_resource_once_with_reasons():
    resources = [
        res(1, name="mvp-1-1-aaaaaaaa"),
        res(1, name="mvp-1-2-aaaaaaaa"),
        res(2, "cccccccc"),
        res(3),
        res(4),
        res(5),
    ]
    liveness = {
        "mvp-run-1": live(Liveness.RUNNING, "aaaaaaaa"),
        "mvp-run-2": live(Liveness.RUNNING, "dddddddd"),
        "mvp-run-3": live(Liveness.CLOSED, detail="completed"),
        "mvp-run-4": live(Liveness.UNKNOWN, detail="timed out"),
        # mvp-run-5 missing from the map: not checked, kept
    }
    plan = decide(resources, liveness)
    assert [d.resource.name for d in plan.destroy] == ["mvp-2-1-cccccccc", "mvp-3-1-aaaaaaaa"]
    assert [d.resource.name for d in plan.keep] == [
        "mvp-1-1-aaaaaaaa",
        "mvp-1-2-aaaaaaaa",
        "mvp-4-1-aaaaaaaa",
        "mvp-5-1-aaaaaaaa",
    ]
    assert all(d.reason for d in plan.destroy + plan.keep)


def test_run_ids_are_asked_once_each_in_order():
    assert run_ids_of([res(2), res(1), res(2, "bbbbbbbb")]) == ["mvp-run-1", "mvp-run-2"]
    assert run_ids_of([]) == []


def test_nothing_listed_nothing_destroyed():
    plan = decide([], {})
    assert plan.destroy == [] and plan.keep == []
