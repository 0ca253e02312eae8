import collections
import os
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
