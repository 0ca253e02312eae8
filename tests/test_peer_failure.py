"""A peer that dies or stops calling (stalled, or its code failed before its
exchange): the others raise a RuntimeError naming it within
DispatchConfig.timeout, on every verb and in each backward, and exit. Fresh processes per case (gloo on CPU), since
the group is not usable afterwards."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist

TIMEOUT = 2.0


def _rank(rank: int, world: int, store_file: str, behaviour: str, variant: str, where: str, queue,
          compiled: bool = False) -> None:
    import dispatch
    from dispatch import board, host

    module = host.built() if compiled else None
    board.compiled_agreement = lambda: module  # the board's compiled agreement, or the one in Python

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    config = dispatch.DispatchConfig(num_experts=2 * world, variant=variant, transport="nccl", timeout=TIMEOUT)
    if where == "create":  # the ranks' first exchange: their agreement on the config
        _call(rank, world, behaviour, lambda: dispatch.create(config), queue)
    d = dispatch.create(config)
    x = torch.randn(6, 8, requires_grad=where.startswith("backward"))
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]]) % (2 * world)
    w = torch.full((6, 2), 0.5)
    out = d.dispatch(x, idx, w)  # one good round trip first
    d.combine(out.tokens, out.handle)
    calls = {
        "dispatch": lambda: d.dispatch(x, idx, w),
        "combine": lambda: d.combine(out.tokens, out.handle),
        "combine_rows": lambda: d.combine_rows(out.tokens.detach(), out.handle),
        "dispatch_rows": lambda: d.dispatch_rows(x.detach(), out.handle),
        "combine_slots": lambda: d.combine_slots(out.weights.detach(), out.handle),
        "backward of dispatch": lambda: out.tokens.sum().backward(),
        "backward of combine": lambda: d.combine(out.tokens * 2, out.handle).sum().backward(),
    }
    _call(rank, world, behaviour, calls[where], queue)


def _call(rank: int, world: int, behaviour: str, call, queue) -> None:
    """The last rank dies or stops calling; the others make ``call`` and report
    what it raised (or that it returned), then leave."""
    if rank == world - 1:
        if behaviour == "dies":
            os._exit(3)
        time.sleep(60)  # stops calling: alive (its connections open), but makes no more calls
    start = time.monotonic()
    try:
        call()
        queue.put((rank, "returned", "", time.monotonic() - start))
    except RuntimeError as exc:
        queue.put((rank, "RuntimeError", str(exc), time.monotonic() - start))
    queue.close()
    queue.join_thread()  # the report is out before the process goes
    os._exit(0)  # the group cannot be used any more: leave without tearing it down


CASES = [(behaviour, variant, "dispatch", "board") for behaviour in ("dies", "stops calling")
         for variant in ("alltoall", "allgather")]
CASES += [("stops calling", "alltoall", where, "board") for where in ("create", "combine", "combine_rows",
                                                                      "dispatch_rows", "combine_slots",
                                                                      "backward of dispatch", "backward of combine")]
CASES += [("dies", "alltoall", "combine", "compiled board"), ("stops calling", "alltoall", "dispatch", "compiled board"),
          ("stops calling", "alltoall", "backward of combine", "compiled board")]


@pytest.mark.parametrize("behaviour, variant, where, board", CASES)
def test_peer_failure_is_named_within_the_timeout(behaviour, variant, where, board):
    """On the board in Python, and on the compiled board (``csrc/host.cpp``'s
    ``board_agree``, the same words: as a process with CUDA agrees)."""
    if board == "compiled board":
        from dispatch import host

        if host.built() is None:
            pytest.skip("the compiled host path does not build here (no C++ compiler, ninja or cuda.h)")
    world = 3
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        compiled = board == "compiled board"
        procs = [ctx.Process(target=_rank, args=(r, world, store, behaviour, variant, where, queue, compiled))
                 for r in range(world)]
        for p in procs:
            p.start()
        reports = {}
        deadline = time.monotonic() + 60
        while len(reports) < world - 1 and time.monotonic() < deadline:
            try:
                rank, kind, message, elapsed = queue.get(timeout=1)
                reports[rank] = (kind, message, elapsed)
            except Exception:
                pass
        for p in procs[: world - 1]:
            p.join(timeout=20)
        alive = [r for r, p in enumerate(procs[: world - 1]) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    for rank in range(world - 1):
        kind, message, elapsed = reports[rank]
        assert kind == "RuntimeError", (rank, kind, message)
        assert f"[{world - 1}]" in message and "did not reach" in message, message
        assert elapsed < TIMEOUT + 5, elapsed
    assert not alive, f"ranks {alive} did not exit"
