"""Building or loading the stand-in never waits forever ([Note: the build lock] in
``memsched/devices/sim_backend.py``): torch's build lock left behind by a killed process is taken over, a lock
held by a live process is waited for up to a bound, and the error then names the lock file, its holder and
what to do. Waits are bounded by ``MEMSCHED_SIM_BUILD_WAIT`` (or a deadline), set short here; nothing below
measures time."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from memsched.devices import sim_backend

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir() and shutil.which("lsof") is None,
                                reason="no /proc and no lsof: this system cannot tell a lock's holder")

_HOLD = "import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); " \
        "time.sleep(600)"


def _hold(lock: Path) -> subprocess.Popen:
    """A process that creates ``lock`` as torch's builder does (and keeps it open) and then sleeps."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _killed_holder(lock: Path) -> None:
    """Leave ``lock`` behind as a process killed mid-build does."""
    holder = _hold(lock)
    holder.kill()
    holder.wait()
    assert lock.exists()


def test_the_holders_of_a_lock_are_found(tmp_path):
    lock = tmp_path / "lock"
    holder = _hold(lock)
    try:
        assert sim_backend.lock_holders(lock) == [holder.pid]
    finally:
        holder.kill()
        holder.wait()
    assert sim_backend.lock_holders(lock) == []  # left behind, held by no one
    lock.unlink()
    assert sim_backend.lock_holders(lock) == []


def test_a_stale_lock_is_taken_over(tmp_path):
    lock = tmp_path / "lock"
    _killed_holder(lock)
    baton = sim_backend._bounded_baton(time.monotonic() + 60)(str(lock))
    assert baton.try_acquire()
    assert sim_backend.lock_holders(lock) == [os.getpid()]
    baton.release()
    assert not lock.exists()


def test_a_live_holders_lock_is_not_taken_over_and_the_wait_ends_with_the_explanation(tmp_path):
    lock = tmp_path / "lock"
    holder = _hold(lock)
    try:
        baton = sim_backend._bounded_baton(time.monotonic() + 0.5)(str(lock))
        assert not baton.try_acquire()
        with pytest.raises(sim_backend.SimBackendBuildError) as e:
            baton.wait()
        message = str(e.value)
        assert str(lock) in message and f"process {holder.pid}" in message
        assert "if no build is running, delete" in message and "MEMSCHED_SIM_BUILD_WAIT" in message
        assert lock.exists()  # still the holder's
    finally:
        holder.kill()
        holder.wait()


def test_a_wait_whose_holder_dies_ends_so_that_the_load_takes_over(tmp_path):
    lock = tmp_path / "lock"
    holder = _hold(lock)
    baton = sim_backend._bounded_baton(time.monotonic() + 300)(str(lock))
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            baton.wait()
            outcome.append(None)
        except BaseException as e:
            outcome.append(e)

    waiter = threading.Thread(target=wait)
    waiter.start()
    holder.kill()
    holder.wait()
    waiter.join()
    assert len(outcome) == 1 and isinstance(outcome[0], sim_backend._StaleLock)


@pytest.mark.parametrize("raw", ["abc", "0", "-3", "inf", "nan"])
def test_a_bad_wait_bound_is_refused_with_what_is_allowed(monkeypatch, raw):
    monkeypatch.setenv("MEMSCHED_SIM_BUILD_WAIT", raw)
    with pytest.raises(ValueError, match=rf"MEMSCHED_SIM_BUILD_WAIT='{raw}': expected a positive, finite"):
        sim_backend.build_wait_seconds()
    monkeypatch.setenv("MEMSCHED_SIM_BUILD_WAIT", "2.5")
    assert sim_backend.build_wait_seconds() == 2.5


# ---- the whole load, in processes of their own, on a copy of this process's build directory ----------------
_LOAD = """
from memsched.devices import sim_backend
sim_backend.load()
import torch
assert torch.ones(2, device="sim").sum().item() == 2
print("loaded")
"""


@pytest.fixture
def build_copy(tmp_path):
    """A copy of the stand-in's build directory (so the load need not rebuild) under a TORCH_EXTENSIONS_DIR of
    the test's own: the shared cache's lock is never touched."""
    from torch.utils import cpp_extension

    src = Path(cpp_extension._get_build_directory("memsched_sim", verbose=False))
    root = tmp_path / "ext"
    left_out = shutil.ignore_patterns("lock", "memsched_takeover.lock")
    shutil.copytree(src, root / "memsched_sim", ignore=left_out)
    return root


def _load_in_a_process(root: Path, wait_s: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(root), MEMSCHED_SIM_BUILD_WAIT=wait_s)
    return subprocess.run([sys.executable, "-c", _LOAD], capture_output=True, text=True, env=env,
                          cwd=Path(__file__).resolve().parent.parent, timeout=900)


def test_a_load_after_a_build_was_killed_takes_the_lock_over(build_copy):
    lock = build_copy / "memsched_sim" / "lock"
    _killed_holder(lock)
    done = _load_in_a_process(build_copy, "600")
    assert done.returncode == 0, done.stderr[-4000:]
    assert "loaded" in done.stdout and not lock.exists()


def test_a_load_behind_a_stuck_build_fails_with_the_explanation(build_copy):
    lock = build_copy / "memsched_sim" / "lock"
    holder = _hold(lock)
    try:
        done = _load_in_a_process(build_copy, "1")
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode != 0
    assert "SimBackendBuildError" in done.stderr and str(lock) in done.stderr
    assert f"process {holder.pid}" in done.stderr and "MEMSCHED_SIM_BUILD_WAIT" in done.stderr
