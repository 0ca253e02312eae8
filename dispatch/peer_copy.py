"""Transports: how the rows of one variable-split all-to-all move.

Notation: W ranks; ``matrix[s][d]`` rows go from rank s to rank d in one
exchange; a rank's send rows are in destination order, its received rows in
source order (what ``torch.distributed.all_to_all_single`` does).

* :class:`Collective`: ``all_to_all_single`` of the process group (NCCL on
  GPUs, gloo on CPU). NCCL moves the bytes with SM kernels, and over NVLink
  those kernels and the experts' GEMMs slow each other down when they overlap
  (``bench/results/README.md``: an all-to-all of 0.43 ms alone took 2.06 ms
  beside a GEMM, and the GEMM 2.59 ms instead of 1.50).
* :class:`PeerCopy`: every rank stages its send rows in a buffer its peers can
  read, and pulls its own blocks out of its peers' buffers with plain copies.
  On CUDA the buffer is ``torch.distributed._symmetric_memory`` and a copy is a
  ``cudaMemcpyAsync`` from peer memory, which the copy engines carry without
  taking an SM; on CPU it is a shared-memory file per rank (so gloo worlds run
  the same code). Every rank of the group must be on one host.

One peer-copy exchange, on the transport's own stream, in call order on every
rank (like a collective):

1. copy the rows for the peers into half ``k % 2`` of this rank's buffer;
2. barrier: every rank has staged;
3. for each source s (this rank's own block comes from ``rows`` directly):
   copy ``matrix[s][me]`` rows at row ``sum(matrix[s][:me])`` of s's half
   into row ``sum(matrix[:s][me])`` of the output.

A rank writes half ``k % 2`` again at exchange ``k + 2``, after barrier
``k + 1``, which its peers pass only after their pulls of exchange ``k``: two
halves need one barrier per exchange. The buffer grows (a collective) when an
exchange needs more than it holds; every rank knows the whole matrix, so every
rank grows at the same exchange.
"""

from __future__ import annotations

import math
import os
import secrets
import tempfile
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatch import comm

BARRIER_TIMEOUT_MS = 300_000  # barrier kernels: a peer that never arrives is a CUDA error after 5 minutes
_MIN_CAPACITY = 1 << 20  # bytes per half


@dataclass(frozen=True)
class Block:
    """One received block: ``rows`` rows of rank ``source``, at row ``src_row``
    of its send rows, land at row ``dst_row`` of the output."""

    source: int
    src_row: int
    dst_row: int
    rows: int


def pull_blocks(matrix: tuple[tuple[int, ...], ...], rank: int) -> tuple[Block, ...]:
    """The blocks ``rank`` receives, the nearest following source first (every
    rank starts with a different source, so no buffer serves everyone at once);
    empty blocks left out."""
    world = len(matrix)
    blocks = []
    for step in range(1, world + 1):
        source = (rank + step) % world
        rows = matrix[source][rank]
        if rows:
            src_row = sum(matrix[source][:rank])
            dst_row = sum(matrix[q][rank] for q in range(source))
            blocks.append(Block(source, src_row, dst_row, rows))
    return tuple(blocks)


def transposed(matrix: tuple[tuple[int, ...], ...]) -> tuple[tuple[int, ...], ...]:
    """The matrix of the way back (rows return where they came from)."""
    return tuple(zip(*matrix))


class Collective:
    """All-to-all by the process group's own collective."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group = group

    def start(self, rows, send_splits, recv_splits, matrix):
        """``comm.all_to_all_rows_start``; ``matrix`` is not needed."""
        return comm.all_to_all_rows_start(rows, send_splits, recv_splits, self.group)


class PeerCopy:
    """All-to-all by copies out of peers' memory (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup | None, rank: int, world_size: int) -> None:
        self.group, self.rank, self.world_size = group, rank, world_size

    def start(self, rows, send_splits, recv_splits, matrix):
        """Start one exchange.

        Args:
            rows: [S, ...] send rows in destination order, any dtype.
            send_splits, recv_splits: this rank's row of ``matrix`` and its column.
            matrix: [W][W] host row counts of every rank to every rank.
        Returns:
            (out, work): [sum(recv_splits), ...] rows in source order, and an
            object whose ``wait()`` makes the current stream wait for them (None
            on CPU, where they are there on return; and for a group of one).
        """
        if self.world_size == 1:
            return rows, None
        if len(matrix) != self.world_size or tuple(matrix[self.rank]) != tuple(send_splits) or tuple(
            row[self.rank] for row in matrix
        ) != tuple(recv_splits) or rows.shape[0] != sum(send_splits):
            raise RuntimeError("peer copy: the split matrix does not match the rows and splits of this rank")
        tail = rows.shape[1:]
        row_bytes = math.prod(tail) * rows.element_size()
        as_bytes = rows.contiguous().view(rows.shape[0], math.prod(tail)).view(torch.uint8)
        need = max(sum(row) for row in matrix) * row_bytes
        peers = _peers_of(self.group, rows.device)
        out = torch.empty(sum(recv_splits), row_bytes, dtype=torch.uint8, device=rows.device)
        with peers.ordered(as_bytes, out) as done:
            halves = peers.halves(need)  # [W] of [2, capacity] uint8
            half = peers.next_half()
            own = halves[self.rank][half]
            first = sum(send_splits[: self.rank])
            last = first + send_splits[self.rank]
            for a, b in ((0, first), (last, rows.shape[0])):  # the rows for the peers
                if b > a:
                    own[a * row_bytes : b * row_bytes].view(b - a, row_bytes).copy_(as_bytes[a:b])
            peers.barrier()
            for block in pull_blocks(matrix, self.rank):
                if block.source == self.rank:
                    src = as_bytes[block.src_row : block.src_row + block.rows]
                else:
                    start = block.src_row * row_bytes
                    src = halves[block.source][half][start : start + block.rows * row_bytes].view(-1, row_bytes)
                out[block.dst_row : block.dst_row + block.rows].copy_(src)
        return out.view(rows.dtype).view(out.shape[0], *tail), done.work


# group -> {device: its buffers}, shared by every PeerCopy of the group; weak, so
# that a destroyed process group goes (the buffers hold it weakly too)
_PEERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _peers_of(group, device: torch.device):
    """The buffers of ``group`` on ``device``: one per group, as a communicator is,
    so that every exchange of the group runs in call order on one stream and a
    buffer is never freed while a peer may still read it."""
    key = group if group is not None else dist.group.WORLD
    per_device = _PEERS.setdefault(key, {})
    if device not in per_device:
        per_device[device] = _CudaPeers(weakref.ref(key), device) if device.type == "cuda" else _HostPeers(
            weakref.ref(key))
    return per_device[device]


class _Halves:
    """Which half of the buffer the next exchange stages in, and the group."""

    _parity = 0
    _group_ref = None

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group_ref()
        if group is None:
            raise RuntimeError("transport='peer_copy': the dispatcher's process group was destroyed")
        return group

    def next_half(self) -> int:
        half, self._parity = self._parity, self._parity ^ 1
        return half


class _Done:
    """CPU: the copies are done when they return; nothing to wait for."""

    work = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _CudaWork:
    """Makes the current stream wait for an exchange (like NCCL's ``work.wait()``)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


def _stream_wait_value32():
    """The driver's ``cuStreamWaitValue32`` (the stream waits until a 32-bit word
    in device memory is >= a value; no SM involved), or None where the driver
    does not export it."""
    import ctypes
    import ctypes.util

    try:
        driver = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
    except OSError:
        return None
    for symbol in ("cuStreamWaitValue32_v2", "cuStreamWaitValue32"):
        fn = getattr(driver, symbol, None)
        if fn is not None:
            fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
            fn.restype = ctypes.c_int
            return fn
    return None


class _CudaPeers(_Halves):
    """Symmetric memory of the group on CUDA; everything runs on one side stream.

    The barrier of an exchange takes no SM where the driver has stream memory
    operations: rank r raises word r of every peer's flags to the exchange's
    count (``cuStreamWriteValue32``, which fences this rank's earlier writes
    first), then its stream waits until each of its own flags reached that count
    (``cuStreamWaitValue32``). Otherwise the symmetric-memory barrier kernel (one
    block) does it. A barrier kernel competes for SMs: beside a persistent GEMM
    that holds every SM, it starts only when the GEMM ends. With stream memory
    operations a peer that never arrives leaves this rank's stream waiting, as
    an NCCL collective would."""

    def __init__(self, group_ref, device: torch.device) -> None:
        self._group_ref, self.device = group_ref, device
        self.stream = torch.cuda.Stream(device, priority=-1)
        self._handle = None
        self._views: list[torch.Tensor] = []
        self._capacity = 0
        self._wait_value = _stream_wait_value32()
        self._flags: list[torch.Tensor] = []  # per rank: [W] uint32, word s raised by rank s
        self._count = 0

    def ordered(self, *tensors):
        return _OnStream(self.stream, tensors)

    def halves(self, need: int) -> list[torch.Tensor]:
        if need > self._capacity:
            self._grow(need)
        return self._views

    def _grow(self, need: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if self._handle is not None:  # every peer is done reading the old buffer before it goes
            self._handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            self.stream.synchronize()  # host sync: the old buffer is freed only once no peer reads it
        capacity = max(_MIN_CAPACITY, 1 << (need - 1).bit_length())
        self._handle = self._views = None
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        buffer = symm_mem.empty(2 * capacity + 4 * world, dtype=torch.uint8, device=self.device)  # halves, flags
        buffer[2 * capacity :].zero_()
        self._handle = symm_mem.rendezvous(buffer, self.group)
        self._views = [self._handle.get_buffer(r, (2, capacity), torch.uint8) for r in range(world)]
        self._flags = [self._handle.get_buffer(r, (world,), torch.uint32, 2 * capacity // 4) for r in range(world)]
        self._handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)  # every rank's flags are zero
        self._buffer, self._capacity, self._count, self._rank = buffer, capacity, 0, rank

    def barrier(self) -> None:
        if self._wait_value is None:
            self._handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            return
        from torch._C._distributed_c10d import _SymmetricMemory

        self._count += 1
        peers = [p for p in range(len(self._flags)) if p != self._rank]
        for p in peers:
            _SymmetricMemory.stream_write_value32(self._flags[p], self._rank, self._count)
        own = self._flags[self._rank].data_ptr()
        for p in peers:
            rc = self._wait_value(self.stream.cuda_stream, own + 4 * p, self._count, 0)  # 0: until >= count
            if rc != 0:
                raise RuntimeError(f"transport='peer_copy': cuStreamWaitValue32 failed with CUDA error {rc}")


class _OnStream:
    """Runs the body on ``stream`` after the current stream's work; the caller's
    tensors stay alive until the stream is done with them."""

    def __init__(self, stream, tensors) -> None:
        self.stream, self.tensors, self.work = stream, tensors, None

    def __enter__(self):
        caller = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(caller)
        self._context = torch.cuda.stream(self.stream)
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        self._context.__exit__(*exc)
        if exc[0] is None:
            for t in self.tensors:
                t.record_stream(self.stream)
            event = torch.cuda.Event()
            event.record(self.stream)
            self.work = _CudaWork(event, self.stream.device)
        return False


class _HostPeers(_Halves):
    """Shared-memory files, one per rank, mapped by every rank of the group (CPU)."""

    def __init__(self, group_ref) -> None:
        self._group_ref = group_ref
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._views: list[torch.Tensor] = []
        self._capacity = 0
        self._generation = 0
        name = [secrets.token_hex(8)]
        dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0), group=self.group)
        self._name = name[0]

    def ordered(self, *tensors):
        return _Done()

    def halves(self, need: int) -> list[torch.Tensor]:
        if need > self._capacity:
            self._grow(need)
        return self._views

    def _path(self, rank: int) -> str:
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
        return os.path.join(folder, f"moe-dispatch-{self._name}-{self._generation}-{rank}")

    def _grow(self, need: int) -> None:
        capacity = max(_MIN_CAPACITY, 1 << (need - 1).bit_length())
        self._generation += 1
        mine = self._path(self.rank)
        own = torch.from_file(mine, shared=True, size=2 * capacity, dtype=torch.uint8)
        dist.barrier(group=self.group)  # every file exists
        paths = [self._path(r) for r in range(self.world_size)]
        seen = torch.tensor([all(os.path.exists(p) for p in paths)], dtype=torch.int32)
        dist.all_reduce(seen, op=dist.ReduceOp.MIN, group=self.group)
        if not seen.item():
            os.unlink(mine)
            raise RuntimeError(
                "transport='peer_copy' needs every rank of the group on one host (it maps its peers' memory)"
            )
        views = [own if r == self.rank else torch.from_file(p, shared=True, size=2 * capacity, dtype=torch.uint8)
                 for r, p in enumerate(paths)]
        dist.barrier(group=self.group)  # every rank has mapped every file
        os.unlink(mine)  # the mappings stay
        self._views = [v.view(2, capacity) for v in views]
        self._capacity = capacity

    def barrier(self) -> None:
        dist.barrier(group=self.group)


TRANSPORTS = {"collective": Collective, "peer_copy": PeerCopy}
