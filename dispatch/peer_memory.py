"""Memory a group's ranks read from each other: the buffers of ``dispatch.peer_copy``.

One :class:`PeerBuffers` per (process group, device), shared by every
dispatcher of the group (as a communicator is), so that every exchange of the
group runs in call order on one stream and a buffer is never freed while a peer
may still read it. Each rank's buffer holds two halves of ``capacity`` bytes
(the staged send rows of alternate exchanges). The interface:

* ``ordered(*tensors)``: a context in which the exchange's work is queued
  (CUDA: on the buffers' side stream, after the caller's stream; the tensors
  stay alive until the side stream is done with them); its ``work`` is then
  None (CPU: done) or an object whose ``wait()`` makes the current stream wait.
* ``halves(need) -> [W] of [2, capacity] uint8``: every rank's halves (this
  rank's own memory at its rank, its peers' mapped at theirs), grown first to
  hold ``need`` bytes per half; every rank must ask for the same ``need`` at the
  same exchange (growing is a collective).
* ``next_half() -> 0 | 1``: the half the next exchange stages in.
* ``barrier()``: every rank has reached this point of its exchange.

CUDA: ``torch.distributed._symmetric_memory``. CPU: one shared-memory file per
rank, mapped by every rank, so gloo worlds run the same protocol.
"""

from __future__ import annotations

import os
import secrets
import socket
import weakref

import torch
import torch.distributed as dist

BARRIER_TIMEOUT_MS = 300_000  # barrier kernels: a peer that never arrives is a CUDA error after 5 minutes
_MIN_CAPACITY = 1 << 20  # bytes per half
_SHM = "/dev/shm"

# group -> {device: its buffers}; weak, so that a destroyed process group goes
# (the buffers hold it weakly too)
_BUFFERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def buffers_of(group: dist.ProcessGroup | None, device: torch.device) -> "PeerBuffers":
    """The buffers of ``group`` (None: the default group) on ``device``."""
    key = group if group is not None else dist.group.WORLD
    per_device = _BUFFERS.setdefault(key, {})
    if device not in per_device:
        kind = CudaBuffers if device.type == "cuda" else HostBuffers
        per_device[device] = kind(weakref.ref(key), device)
    return per_device[device]


def capacity_for(need: int) -> int:
    """Bytes per half for ``need`` bytes: a power of two, at least 1 MiB (so that
    a few growths serve a whole run)."""
    return max(_MIN_CAPACITY, 1 << max(need - 1, 0).bit_length())


class PeerBuffers:
    """What both kinds share: the group (held weakly), the rank, the halves."""

    def __init__(self, group_ref, device: torch.device) -> None:
        self._group_ref, self.device = group_ref, device
        self.rank, self.world_size = dist.get_rank(self.group), dist.get_world_size(self.group)
        self._views: list[torch.Tensor] = []
        self._capacity = 0
        self._parity = 0

    @property
    def group(self) -> dist.ProcessGroup:
        group = self._group_ref()
        if group is None:
            raise RuntimeError("transport='peer_copy': the dispatcher's process group was destroyed")
        return group

    def halves(self, need: int) -> list[torch.Tensor]:
        """[W] of [2, capacity] uint8, capacity >= ``need`` (the first call always allocates)."""
        if need > self._capacity or not self._views:
            self._grow(capacity_for(need))
        return self._views

    def next_half(self) -> int:
        half, self._parity = self._parity, self._parity ^ 1
        return half

    def _grow(self, capacity: int) -> None:
        raise NotImplementedError


# -- CUDA ---------------------------------------------------------------------


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


class CudaBuffers(PeerBuffers):
    """Symmetric memory of the group; everything runs on one high-priority side stream.

    The barrier of an exchange takes no SM where the driver has stream memory
    operations (every rank checks at the first allocation, and all use them
    only if all can): rank r raises word r of every peer's flags to the
    exchange's count (``cuStreamWriteValue32``, which fences this rank's earlier
    writes first), then its stream waits until each of its own flags reached
    that count (``cuStreamWaitValue32``). Otherwise the symmetric-memory barrier
    kernel (one block) does it. A barrier kernel competes for SMs: beside a
    persistent GEMM that holds every SM, it starts only when the GEMM ends. With
    stream memory operations a peer that never arrives leaves this rank's stream
    waiting, as an NCCL collective would.

    Not for CUDA graph capture: the count of an exchange is fixed on the host.
    """

    def __init__(self, group_ref, device: torch.device) -> None:
        super().__init__(group_ref, device)
        self.stream = torch.cuda.Stream(device, priority=-1)
        self._handle = None
        self._buffer = None
        self._wait_value = _stream_wait_value32()
        self._flags: list[torch.Tensor] = []  # per rank: [W] uint32, word s raised by rank s
        self._count = 0

    def ordered(self, *tensors) -> "_OnStream":
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("transport='peer_copy' cannot run inside a CUDA graph capture")
        return _OnStream(self.stream, tensors)

    def _grow(self, capacity: int) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        if self._handle is not None:  # every peer is done reading the old buffer before it goes
            self._handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            self.stream.synchronize()  # host sync: the old buffer is freed only once no peer reads it
        world = self.world_size
        self._handle = self._views = self._buffer = None
        buffer = symm_mem.empty(2 * capacity + 4 * world, dtype=torch.uint8, device=self.device)  # halves, flags
        buffer[2 * capacity :].zero_()
        self._handle = symm_mem.rendezvous(buffer, self.group)  # host sync: a collective through the store
        self._views = [self._handle.get_buffer(r, (2, capacity), torch.uint8) for r in range(world)]
        self._flags = [self._handle.get_buffer(r, (world,), torch.uint32, 2 * capacity // 4) for r in range(world)]
        if self._wait_value is not None:  # every rank waits without SMs, or none does
            usable = self._wait_value(self.stream.cuda_stream, self._flags[self.rank].data_ptr(), 0, 0) == 0
            agreed = torch.tensor([int(usable)], dtype=torch.int32, device=self.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.group)
            if not agreed.item():  # host sync: the same barrier on every rank
                self._wait_value = None
        self._handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)  # every rank's flags are zero
        self._buffer, self._capacity, self._count = buffer, capacity, 0

    def barrier(self) -> None:
        if self._wait_value is None:
            self._handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
            return
        from torch._C._distributed_c10d import _SymmetricMemory

        self._count += 1
        peers = [p for p in range(self.world_size) if p != self.rank]
        for p in peers:
            _SymmetricMemory.stream_write_value32(self._flags[p], self.rank, self._count)
        own = self._flags[self.rank].data_ptr()
        for p in peers:  # checked usable at allocation
            self._wait_value(self.stream.cuda_stream, own + 4 * p, self._count, 0)  # 0: until >= count


class _CudaWork:
    """Makes the current stream wait for an exchange (like NCCL's ``work.wait()``)."""

    def __init__(self, event: torch.cuda.Event, device: torch.device) -> None:
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)


class _OnStream:
    """Queues the body on ``stream`` after the current stream's work; the
    caller's tensors stay alive until the stream is done with them (also when
    the body raised after queuing some of its work)."""

    def __init__(self, stream, tensors) -> None:
        self.stream, self.tensors, self.work = stream, tensors, None

    def __enter__(self):
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        self._context = torch.cuda.stream(self.stream)
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        self._context.__exit__(*exc)
        for t in self.tensors:
            t.record_stream(self.stream)
        if exc[0] is None:
            event = torch.cuda.Event()
            event.record(self.stream)
            self.work = _CudaWork(event, self.stream.device)
        return False


# -- CPU ----------------------------------------------------------------------


class HostBuffers(PeerBuffers):
    """Shared-memory files in /dev/shm, one per rank, mapped by every rank (CPU)."""

    def __init__(self, group_ref, device: torch.device) -> None:
        super().__init__(group_ref, device)
        self._generation = 0
        name = [secrets.token_hex(8)]
        dist.broadcast_object_list(name, src=dist.get_global_rank(self.group, 0), group=self.group)  # host sync
        self._name = name[0]

    def ordered(self, *tensors) -> "_Done":
        return _Done()

    def _path(self, rank: int) -> str:
        return os.path.join(_SHM, f"moe-dispatch-{self._name}-{self._generation}-{rank}")

    def _grow(self, capacity: int) -> None:
        self._generation += 1
        size = 2 * capacity
        mine, problem = self._path(self.rank), None
        try:  # the whole file, allocated now: a full /dev/shm is an error here, not a SIGBUS later
            fd = os.open(mine, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.posix_fallocate(fd, 0, size)
            finally:
                os.close(fd)
        except OSError as exc:
            problem = f"rank {self.rank} could not make {size} bytes in {_SHM}: {exc}"
        self._agree(problem)  # every file is there, or every rank raises
        paths = [self._path(r) for r in range(self.world_size)]
        hosts: list = [None] * self.world_size
        dist.all_gather_object(hosts, _host_id(), group=self.group)  # host sync: where the ranks run
        if len(set(hosts)) > 1 or not all(os.path.exists(p) and os.path.getsize(p) == size for p in paths):
            problem = "transport='peer_copy' needs every rank of the group on one host (it maps its peers' memory)"
        self._agree(problem)
        views = [torch.from_file(p, shared=True, size=size, dtype=torch.uint8) for p in paths]
        dist.barrier(group=self.group)  # host sync: every rank has mapped every file
        os.unlink(mine)  # the mappings stay
        self._views = [v.view(2, capacity) for v in views]
        self._capacity = capacity

    def _agree(self, problem: str | None) -> None:
        """Raise on every rank if ``problem`` is set on any (this rank's file removed)."""
        failed = torch.tensor([problem is not None], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=self.group)
        if failed.item():  # host sync: the same decision on every rank
            if os.path.exists(self._path(self.rank)):
                os.unlink(self._path(self.rank))
            raise RuntimeError(problem or "transport='peer_copy': a peer could not map its buffer (see its error)")

    def barrier(self) -> None:
        dist.barrier(group=self.group)  # host sync: CPU copies are synchronous


class _Done:
    """CPU: the copies are done when they return; nothing to wait for."""

    work = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _host_id() -> str:
    """This machine: host name and boot id (a shared /dev/shm means one kernel)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}:{boot}"
