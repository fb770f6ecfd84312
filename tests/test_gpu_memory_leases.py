"""The GPU memory leases that let pytest-xdist workers share one GPU (tests/gpu_memory.py), on the CPU."""

import json
import os
import subprocess
import sys

import pytest
from gpu_memory import Leases, budget_gib


@pytest.fixture
def pids():
    """Two live processes besides this one, and the pid of one that has exited."""
    live = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)]
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    yield [p.pid for p in live], dead.pid
    for p in live:
        p.kill()
        p.wait()


def test_leases_keep_the_tests_at_once_within_the_budget(tmp_path, pids):
    (a, b), _ = pids
    leases = Leases(tmp_path / "leases.json", budget=20.0)
    assert leases.try_acquire(12, pid=a)
    assert not leases.try_acquire(12, pid=b)  # 24 > 20: waits
    assert leases.try_acquire(4, pid=b)  # 16 <= 20
    assert leases.held() == {str(a): 12, str(b): 4}
    leases.release(pid=a)
    assert leases.try_acquire(12)  # this process, beside b's 4
    assert leases.held() == {str(b): 4, str(os.getpid()): 12}


def test_a_test_larger_than_the_budget_runs_alone(tmp_path, pids):
    (a, b), _ = pids
    leases = Leases(tmp_path / "leases.json", budget=20.0)
    assert leases.try_acquire(4, pid=a)
    assert not leases.try_acquire(30, pid=b)
    leases.release(pid=a)
    assert leases.try_acquire(30, pid=b)
    assert not leases.try_acquire(1, pid=a)


def test_the_lease_of_a_dead_worker_is_dropped(tmp_path, pids):
    (a, _), dead = pids
    leases = Leases(tmp_path / "leases.json", budget=20.0)
    assert leases.try_acquire(18, pid=dead)
    assert leases.try_acquire(18, pid=a)  # the dead worker's 18 no longer counts
    assert leases.held() == {str(a): 18}


def test_budget_counts_a_context_per_worker():
    assert budget_gib(80 * 2**30, 8) == pytest.approx(0.85 * 80 - 8)
    assert budget_gib(2**30, 8) == 1.0


def test_a_workers_own_lease_never_blocks_it(tmp_path):
    leases = Leases(tmp_path / "leases.json", budget=20.0)
    assert leases.try_acquire(4)
    assert leases.try_acquire(30)  # a lease it still holds (a teardown that failed) is replaced, not waited for
    assert leases.held() == {str(os.getpid()): 30}


def test_a_corrupt_lease_file_counts_as_no_leases(tmp_path):
    path = tmp_path / "leases.json"
    path.write_text('{"12')  # a worker killed mid-write by an older writer
    leases = Leases(path, budget=20.0)
    assert leases.held() == {}
    path.write_text('{"1": 12, "x": [1, ""]}')  # entries of another form
    assert leases.held() == {}
    assert leases.try_acquire(12) and json.loads(path.read_text())[str(os.getpid())][0] == 12
    assert not list(tmp_path.glob("*.tmp"))


def test_a_reused_pid_does_not_keep_a_dead_workers_lease(tmp_path, pids):
    (a, _), _ = pids
    path = tmp_path / "leases.json"
    path.write_text(json.dumps({str(a): [18, "1"]}))  # pid a, but a process that started at another time
    assert Leases(path, budget=20.0).held() == {}
