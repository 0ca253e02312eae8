"""A world of W processes that stays alive and runs functions on request.

Starting a process group costs seconds, so a test keeps one world per size and
feeds it many examples: ``world.run(fn, args_per_rank)`` calls ``fn(*args)`` on
every rank at once and returns the per-rank results. Backend: NCCL when W GPUs
are visible (one per rank), gloo otherwise; ``DISPATCH_TEST_BACKEND`` forces one.
With ``DISPATCH_TEST_SHARED_GPU=1`` on a machine of fewer GPUs than ranks, the
ranks share device 0 on gloo and the engine runs there (:mod:`shared_gpu`).

If a rank raises, ``run`` raises :class:`RankError` with that rank's traceback.
If a rank does not answer in time (a hang), the world is torn down and rebuilt,
and ``run`` raises ``TimeoutError``: a test fails, it never hangs.

Objects travel between processes through ``torch.save`` (no shared-memory file
descriptors pile up over thousands of examples).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import sys
import tempfile
import traceback

import torch
import torch.distributed as dist

_DEVICE: torch.device | None = None


def bench_world_of(size: int):
    """A skip mark for a test of a bench run on a world of ``size``: the bench runs
    on the local GPUs where there are any (else on CPU processes), so a machine
    with fewer GPUs than that cannot make the world."""
    import pytest

    return pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < size,
                              reason=f"the bench's world of {size} runs on {size} GPUs where the machine has fewer")


def current_device() -> torch.device:
    """The device a function running on a world rank should put its tensors on."""
    return _DEVICE if _DEVICE is not None else torch.device("cpu")


def default_backend(size: int) -> str:
    forced = os.environ.get("DISPATCH_TEST_BACKEND")
    if forced:
        return forced
    if torch.cuda.is_available() and torch.cuda.device_count() >= size:
        return "nccl"
    import shared_gpu

    return shared_gpu.BACKEND if shared_gpu.wanted() else "gloo"


class RankError(RuntimeError):
    """A function raised on one or more ranks."""


def _dumps(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _loads(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=False)


def _worker(rank: int, size: int, backend: str, store_file: str, conn, sys_path: list[str]) -> None:
    global _DEVICE
    sys.path[:] = sys_path
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    import shared_gpu

    if backend == shared_gpu.BACKEND:
        _DEVICE = shared_gpu.init_rank(rank, size, f"file://{store_file}")
    else:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            _DEVICE = torch.device("cuda", rank)
        dist.init_process_group(
            backend,
            init_method=f"file://{store_file}",
            rank=rank,
            world_size=size,
            timeout=datetime.timedelta(seconds=60),
        )
    while True:
        try:
            message = conn.recv_bytes()
        except EOFError:
            break
        if not message:
            break
        try:
            fn, args = _loads(message)
            reply = ("ok", fn(*args))
        except BaseException:  # report everything, including assertion errors
            reply = ("error", traceback.format_exc())
        try:
            conn.send_bytes(_dumps(reply))
        except BaseException:
            conn.send_bytes(_dumps(("error", traceback.format_exc())))
    dist.destroy_process_group()


def _store_file() -> str:
    """A fresh path for the world's rendezvous file: nothing to race for, unlike a
    free TCP port that another process may take before rank 0 binds it."""
    handle, path = tempfile.mkstemp(prefix="dispatch-world-")
    os.close(handle)
    os.unlink(path)  # the store creates it
    return path


class World:
    """W long-lived ranks. Use as a context manager or call :meth:`close`."""

    def __init__(self, size: int, backend: str | None = None, timeout: float = 120.0) -> None:
        self.size = size
        self.backend = backend or default_backend(size)
        self.timeout = timeout
        self._procs: list = []
        self._conns: list = []
        self._start()

    @property
    def on_gpu(self) -> bool:
        """The ranks' tensors are on CUDA (NCCL, or ranks sharing one GPU: ``shared_gpu``),
        where the GPU kernels fuse a slot's multiply into its add."""
        return self.backend != "gloo"

    def _start(self) -> None:
        ctx = mp.get_context("spawn")
        store_file = _store_file()
        for rank in range(self.size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                args=(rank, self.size, self.backend, store_file, child, list(sys.path)),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def run(self, fn, args_per_rank: list[tuple] | None = None) -> list:
        """Call ``fn(*args_per_rank[r])`` on every rank r; return the results by rank.

        ``fn`` must be importable by name (a module-level function).
        """
        if args_per_rank is None:
            args_per_rank = [()] * self.size
        if len(args_per_rank) != self.size:
            raise ValueError(f"args_per_rank has {len(args_per_rank)} entries for a world of {self.size}")
        for conn, args in zip(self._conns, args_per_rank):
            conn.send_bytes(_dumps((fn, tuple(args))))
        replies: list = [None] * self.size
        errors: list[str] = []
        for rank, conn in enumerate(self._conns):
            # once a rank failed, peers stuck in a collective get a short grace period
            wait = self.timeout if not errors else 10.0
            if not conn.poll(wait):
                errors.append(f"rank {rank}: no answer within {wait:.0f} s (hang?)")
                self._restart()
                raise TimeoutError("\n".join(errors))
            status, value = _loads(conn.recv_bytes())
            if status == "ok":
                replies[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise RankError(f"{fn.__name__} failed on a world of {self.size}:\n" + "\n".join(errors))
        return replies

    def _restart(self) -> None:
        self.close()
        self._procs, self._conns = [], []
        self._start()

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send_bytes(b"")
            except (BrokenPipeError, OSError):
                pass
        for proc in self._procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self._conns:
            conn.close()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
