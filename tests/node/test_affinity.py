"""The token path's compute core set (workers.node.affinity)."""

from __future__ import annotations

import os
import threading

import pytest

from mvp_core.models import EngineSettings
from workers.node.affinity import Placement, compute_set, cpu_quota
from workers.node.runtime import default_threads


def test_auto_leaves_the_first_core_to_the_control_plane() -> None:
    assert compute_set("auto", [0, 1]) == {1}
    assert compute_set("auto", [3, 1, 2]) == {2, 3}
    assert compute_set("auto", [5]) == frozenset()  # one core: nothing to gain, no pinning


def test_auto_pins_nothing_for_a_run_that_generates_several_prompts_at_once() -> None:
    # its stages work at the same time: one shared core set would make them take turns
    assert compute_set("auto", [0, 1], many=True) == frozenset()
    assert compute_set([1], [0, 1], many=True) == {1}  # an explicit set is kept


@pytest.mark.parametrize(
    ("files", "quota"),
    [
        ({"cpu.max": "100000 100000\n"}, 1.0),
        ({"cpu.max": "50000 100000\n"}, 0.5),
        ({"cpu.max": "max 100000\n"}, None),
        ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
        ({"cpu.max": "garbage"}, None),
        ({}, None),
    ],
)
def test_cpu_quota_from_cgroup_v2_or_v1(tmp_path, files, quota) -> None:
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cpu_quota(tmp_path) == quota


def test_a_node_with_a_quota_runs_its_whole_cpus_and_others_share_the_host() -> None:
    assert default_threads(2, 2) == 1 and default_threads(8, 1) == 7
    assert default_threads(8, 4, quota=2.0) == 2  # its own --cpus 2, whatever else runs
    assert default_threads(8, 1, quota=0.5) == 1
    assert default_threads(2, 1, quota=4.0) == 2  # never more than the host's cores


def test_the_engines_own_kernel_takes_every_core_torchs_leaves_one() -> None:
    """DECISIONS 20: torch's OpenMP threads stall behind the control plane, so they leave
    it a core; the engine's kernel never waits on a preempted thread, so it takes them all
    (shared among the host's nodes; a quota still caps it)."""
    assert default_threads(2, 1) == 1 and default_threads(2, 1, native_kernel=True) == 2
    assert default_threads(8, 2, native_kernel=True) == 4 and default_threads(8, 2) == 3
    assert default_threads(2, 2, native_kernel=True) == 1
    assert default_threads(8, 1, quota=2.0, native_kernel=True) == 2


def test_off_and_explicit_lists() -> None:
    assert compute_set("off", [0, 1, 2]) == frozenset()
    assert compute_set([2, 7], [0, 1, 2, 3]) == {2}  # cores the node cannot use are dropped
    assert compute_set([9], [0, 1]) == frozenset()
    with pytest.raises(ValueError, match="compute_cpus"):
        compute_set("fast", [0, 1])


def test_engine_settings_accept_auto_off_or_core_ids() -> None:
    assert EngineSettings().compute_cpus == "auto"
    assert EngineSettings.model_validate({"compute_cpus": [1, 2]}).compute_cpus == [1, 2]
    for bad in ("fast", [-1]):
        with pytest.raises(ValueError):
            EngineSettings.model_validate({"compute_cpus": bad})


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_pinning_is_per_thread_and_restored() -> None:
    whole = os.sched_getaffinity(0)
    cpus = compute_set("auto")
    seen: dict[str, set[int]] = {}

    def worker() -> None:
        with Placement(cpus).applied():
            seen["inside"] = os.sched_getaffinity(0)
            child = threading.Thread(target=lambda: seen.update(child=os.sched_getaffinity(0)))
            child.start()
            child.join()
            seen["main_meanwhile"] = os.sched_getaffinity(main_tid)
        seen["after"] = os.sched_getaffinity(0)

    main_tid = threading.get_native_id()
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen["inside"] == cpus and seen["child"] == cpus  # threads it starts inherit
    assert seen["main_meanwhile"] == whole  # other threads of the process are untouched
    assert seen["after"] == whole

    def dedicated() -> None:
        Placement(cpus).adopt()
        seen["dedicated"] = os.sched_getaffinity(0)

    d = threading.Thread(target=dedicated)
    d.start()
    d.join()
    assert seen["dedicated"] == cpus
    assert os.sched_getaffinity(0) == whole


def test_token_path_nice_is_per_thread_restored_or_warned(caplog: pytest.LogCaptureFixture) -> None:
    main_nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: dict[str, int] = {}

    def worker() -> None:
        tid = threading.get_native_id()
        with Placement(nice=main_nice - 5).applied():
            seen["inside"] = os.getpriority(os.PRIO_PROCESS, tid)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == main_nice
    if seen["inside"] == main_nice:  # not allowed to raise priority here: said, not raised
        assert "CAP_SYS_NICE" in caplog.text
    else:
        assert seen["inside"] == main_nice - 5
        assert seen["after"] == main_nice


_CONFINE_CHILD = """
import os, threading
from workers.node.affinity import Placement, compute_set
ready = threading.Event(); done = threading.Event()
t = threading.Thread(target=lambda: (ready.set(), done.wait()))
t.start(); ready.wait()
p = Placement(compute_set("auto"))
p.confine_others()
seen = {}
def token_path():
    p.adopt()
    seen["token"] = os.sched_getaffinity(0)
tp = threading.Thread(target=token_path); tp.start(); tp.join()
late = threading.Thread(target=lambda: seen.update(late=os.sched_getaffinity(0)))
late.start(); late.join()
print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(t.native_id)),
      sorted(seen["token"]), sorted(seen["late"]))
done.set()
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_confine_others_moves_the_rest_of_the_process_off_the_compute_cores() -> None:
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    out = subprocess.run(
        [sys.executable, "-c", _CONFINE_CHILD], capture_output=True, text=True, check=True
    ).stdout.strip()
    rest, compute = str(cores[:1]), str(cores[1:])
    # main thread, an existing thread, a token-path thread, a thread started later by main
    assert out == f"{rest} {rest} {compute} {rest}", out
