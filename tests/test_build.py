"""The compiled modules' builds (``dispatch.build``): the processes of one
machine take turns, and a build killed mid-way leaves nothing that a later
build or load waits on."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys

import pytest

from dispatch import build

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_lock_torch_left_is_removed_once_the_turn_is_held(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    with build.building(str(tmp_path)):
        assert not lock.exists()


def test_the_turn_is_one_process_s_and_freed_when_it_is_killed(tmp_path):
    """Another process holding the turn keeps this one out; killed (no chance to
    clean up), it leaves the turn free at once."""
    code = (f"import time\nfrom dispatch import build\nwith build.building({str(tmp_path)!r}):\n"
            "    print('held', flush=True)\n    time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": ROOT})
    try:
        assert child.stdout.readline().strip() == "held"
        with open(tmp_path / "dispatch.lock", "a") as probe:
            with pytest.raises(BlockingIOError):
                fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
            child.kill()
            child.wait()
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)  # free: no wait
    finally:
        child.kill()
        child.wait()


def test_a_load_after_a_build_killed_mid_way_does_not_wait_for_ever():
    """The compiled CPU plan, built here, with the lock a killed build of torch's
    leaves in its folder: a new process loads it (torch alone would wait on
    that lock for ever)."""
    from dispatch.kernels import plan_cpu

    if plan_cpu.module() is None:
        pytest.skip("the compiled CPU plan does not build here (no C++ compiler or ninja)")
    folder = build._where(plan_cpu._SOURCE, plan_cpu._PREFIX)[1]
    lock = os.path.join(folder, "lock")
    with build.building(folder):  # (in turn: no build under way here is handed a lock of ours)
        open(lock, "w").close()
    try:
        done = subprocess.run([sys.executable, "-c", "from dispatch.kernels import plan_cpu\n"
                               "assert plan_cpu.module() is not None"], env={**os.environ, "PYTHONPATH": ROOT},
                              timeout=120, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
    finally:
        with build.building(folder):  # (what the load left, if it failed)
            pass
