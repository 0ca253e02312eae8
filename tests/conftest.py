import collections
import ctypes
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

# Triton kernels run under the interpreter where there is no GPU; this must be
# set before triton.jit sees the kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))

from world import World  # noqa: E402


@pytest.fixture(scope="session")
def worlds():
    """``worlds(W)``: a live world of W ranks, shared by the whole session."""
    alive: dict[int, World] = {}
    from dispatch.kernels import plan_cpu

    plan_cpu.module()  # the compiled CPU plan built here once, not by the ranks of a world at their first dispatch

    def get(size: int) -> World:
        if size not in alive:
            alive[size] = World(size)
        return alive[size]

    yield get
    for world in alive.values():
        world.close()


def _nvshmem_ready() -> bool:
    if torch.cuda.device_count() < 2:
        return False
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return False
    return symm_mem.is_nvshmem_available()


@pytest.fixture(scope="module")
def nvshmem_world():
    """A world of two ranks on the real NVSHMEM (two GPUs, a torch built with it): a
    world of its own, since torch fixes one symmetric-memory backend per process."""
    if not _nvshmem_ready():
        pytest.skip("needs 2 CUDA devices and a torch built with NVSHMEM")
    from world import World

    world = World(2, backend="nccl")
    yield world
    world.close()


@pytest.fixture(scope="session")
def compiled():
    """The engine's compiled host module (``dispatch.host``), where it builds."""
    from dispatch import host

    module = host.built()
    if module is None:
        pytest.skip("the compiled host path does not build here (no C++ compiler, ninja or cuda.h)")
    return module


@pytest.fixture(scope="session")
def fake_libcuda(compiled, tmp_path_factory):
    """The stand-in driver (tests/fake_cuda/libcuda.c) loaded as libcuda.so.1, once
    a session (the compiled module finds its entry points once a process), so
    that both paths' launches reach the hook it is given; only where no real
    driver is loaded (a CPU machine) and a C compiler is."""
    if torch.cuda.is_available():
        pytest.skip("a real CUDA driver serves this process")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in driver")
    path = tmp_path_factory.mktemp("fake_cuda") / "libcuda.so.1"
    source = pathlib.Path(__file__).parent / "fake_cuda" / "libcuda.c"
    subprocess.run([cc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(path), str(source)], check=True)
    return ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)  # dlopen("libcuda.so.1") finds it by its soname


@pytest.fixture
def fake_driver(fake_libcuda):
    """The stand-in driver for one test: the hook it gives (``fake_set_hook``) is
    taken back after it, since the test's hook goes with the test."""
    yield fake_libcuda
    fake_libcuda.fake_set_hook(None)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_sessionfinish(session):
    """After pytest's own summary, whose stats line it follows as the last line: one
    line that accounts for the skipped tests by reason (CUDA devices, CuPy,
    megatron-core): what a CPU machine cannot run."""
    result = yield
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or reporter.no_summary:
        return result
    reasons = collections.Counter()
    for report in reporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        told = "; ".join(f"{count} {reason}" for reason, count in reasons.most_common())
        reporter.write_line(f"skipped by reason: {told}")
    return result
