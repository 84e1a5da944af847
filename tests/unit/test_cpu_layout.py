"""The demo's pinned CPU layout (pdd_sglang.dev.cpu_budget): which cores each cluster gets, and a
real cpuset group that holds its process on every core until limit() and on its own after."""

import os
import subprocess

import pytest

from pdd_sglang.dev import cpu_budget


def test_cluster_a_gets_the_first_half_of_the_cores_and_b_the_rest():
    assert cpu_budget.pinned_layout([1, 0]) == {"a": (0,), "b": (1,)}
    assert cpu_budget.pinned_layout([4, 5, 6, 7, 8]) == {"a": (4, 5), "b": (6, 7, 8)}


def test_one_core_cannot_be_pinned_apart():
    with pytest.raises(ValueError, match="2 cores or more"):
        cpu_budget.pinned_layout([3])


def test_process_cpu_of_a_gone_process_is_none():
    proc = subprocess.Popen(["true"])
    proc.wait()
    assert cpu_budget.process_cpu_s(proc.pid) is None
    assert cpu_budget.process_cpu_s(os.getpid()) > 0


def _allowed(pid: int) -> str:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("Cpus_allowed_list:"):
            return line.split()[1]
    raise AssertionError("no Cpus_allowed_list")


@pytest.mark.skipif(os.geteuid() != 0 or len(os.sched_getaffinity(0)) < 2,
                    reason="needs root (cgroups) and 2 cores")
def test_a_pinned_group_runs_on_every_core_until_limited_then_on_its_own():
    try:
        cpu_budget.check_cpu_controller()
        cpu_budget.check_cpuset_controller()
    except (OSError, FileNotFoundError) as err:
        pytest.skip(str(err))
    cores = sorted(os.sched_getaffinity(0))
    group = cpu_budget.CpuGroup(f"pdd-test-layout-{os.getpid()}", 0.5, cpus=(cores[-1],))
    proc = None
    try:
        group.create()
        proc = subprocess.Popen([*group.exec_prefix(), "sleep", "30"])
        deadline = 50
        while proc.pid not in cpu_budget._pids(group.cpuset_dir) and deadline:
            subprocess.run(["sleep", "0.1"])
            deadline -= 1
        everywhere = _allowed(proc.pid)
        group.limit()
        pinned = _allowed(proc.pid)
        usage = group.usage_between(group.snapshot(), group.snapshot())
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        group.remove()
    assert everywhere == (open("/sys/fs/cgroup/cpuset/cpuset.cpus").read().strip())
    assert pinned == str(cores[-1])
    assert usage["cpus"] == [cores[-1]]
    assert not group.exists()


def test_each_layout_places_every_server_the_same_way_in_every_setup():
    from pdd_sglang.dev import cpu_budget

    cluster_of = {"prefill": "a", "main-a": "a", "relay": "a", "main-b": "b"}
    assert cpu_budget.server_cores("shared", cluster_of, [0, 1]) is None
    assert cpu_budget.server_cores("pinned", cluster_of, [0, 1]) == {
        "prefill": (0,), "main-a": (0,), "relay": (0,), "main-b": (1,)}
    # The prefill alone: no decode server's work (the relay's eager decode) takes its cycles.
    assert cpu_budget.server_cores("prefill-apart", cluster_of, [0, 1]) == {
        "prefill": (0,), "main-a": (1,), "relay": (1,), "main-b": (1,)}
    with pytest.raises(ValueError, match="unknown CPU layout"):
        cpu_budget.server_cores("packed", cluster_of, [0, 1])
