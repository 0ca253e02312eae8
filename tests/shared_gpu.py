"""Ranks that share one GPU, for the engine's tests of two or more ranks where a
machine lends one GPU (``DISPATCH_TEST_SHARED_GPU=1``).

The ranks are processes on device 0 in a gloo group for CPU and CUDA tensors
(``cpu:gloo,cuda:gloo``: NCCL refuses two ranks on one GPU). Torch's symmetric
memory refuses ranks on one device too, so the engine's buffers come from :class:`IpcSymmetricMemory`: device memory of each
rank opened by its peers through CUDA IPC, which the engine's kernels reach
by the same peer pointers. The GPU runs the ranks' kernels by time slices, so a
kernel that waits for a peer's flag waits until the peer's kernel gets its
slice: correct, slow, and no measure of speed.

What this leaves untested: NVLink itself, peer access between two GPUs, torch's
rendezvous and its device barrier (a host barrier stands in), and the engine's
own ``unusable`` (which refuses a gloo group and ranks on one GPU; it is
replaced by the checks that do not depend on them).
"""

from __future__ import annotations

import datetime
import os
import types

import torch
import torch.distributed as dist

ENV = "DISPATCH_TEST_SHARED_GPU"
BACKEND = "gloo+shared-gpu"  # a world's backend name: gloo, every rank on device 0


def wanted() -> bool:
    """Worlds of more ranks than GPUs run on one shared GPU (the variable is set
    and there is a GPU and CuPy)."""
    if os.environ.get(ENV) != "1" or not torch.cuda.is_available():
        return False
    from dispatch import cuda

    return cuda.available()


def engine_ranks(size: int) -> bool:
    """The engine's tests of ``size`` ranks can run here: a GPU per rank, or one
    shared GPU."""
    from dispatch import cuda

    return cuda.available() and (torch.cuda.device_count() >= size or wanted())


class _Handle:
    """The peers' pointers of one buffer (as torch's handle's ``buffer_ptrs``)."""

    def __init__(self, pointers: list[int], opened: list[bytes], group) -> None:
        self.buffer_ptrs = pointers
        self._opened, self._group = opened, group

    def barrier(self, channel: int = 0) -> None:
        """Every rank's work queued so far is done (the host's barrier, stronger
        than torch's device barrier it stands for)."""
        torch.cuda.current_stream().synchronize()
        dist.barrier(group=self._group)

    def __del__(self) -> None:
        for key in self._opened:
            _release(key)


# The peers' allocations this process has open: handle bytes -> [pointer, handles holding it].
# CUDA maps an allocation once per process (cudaErrorAlreadyMapped at a second open), and a
# handle no longer referenced may not be collected yet when its allocation is opened again.
_OPEN: dict[bytes, list] = {}


def _open(handle: bytes) -> int:
    """A pointer to a peer's allocation, opened once per process and shared by the
    handles that hold it (:func:`_release`)."""
    import gc

    import cupy

    if handle not in _OPEN:
        try:
            pointer = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        except cupy.cuda.runtime.CUDARuntimeError as error:
            if "AlreadyMapped" not in str(error):
                raise
            gc.collect()  # a handle no longer referenced (not yet collected) closes its mappings
            pointer = cupy.cuda.runtime.ipcOpenMemHandle(handle)
        _OPEN[handle] = [pointer, 0]
    _OPEN[handle][1] += 1
    return _OPEN[handle][0]


def _release(handle: bytes) -> None:
    """One holder of :func:`_open`'s mapping is done; the last closes it."""
    import cupy

    entry = _OPEN.get(handle)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _OPEN[handle]
        try:
            cupy.cuda.runtime.ipcCloseMemHandle(entry[0])
        except Exception:  # (at interpreter exit the driver may be gone)
            pass


class IpcSymmetricMemory(types.ModuleType):
    """Stands in for ``torch.distributed._symmetric_memory`` on ranks of one GPU:
    ``empty`` takes device memory of its own (cudaMalloc, which CUDA IPC can
    share), ``rendezvous`` opens every peer's. NVSHMEM is not there."""

    def __init__(self, real) -> None:
        super().__init__("torch.distributed._symmetric_memory")
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def is_nvshmem_available() -> bool:
        return False

    @staticmethod
    def get_backend(device) -> str:
        return "CUDA"

    @staticmethod
    def empty(*size, dtype, device) -> torch.Tensor:
        import cupy

        shape = tuple(size[0]) if len(size) == 1 and isinstance(size[0], (tuple, list)) else size
        count = 1
        for extent in shape:
            count *= extent
        nbytes = max(count * torch.empty((), dtype=dtype).element_size(), 1)
        with cupy.cuda.Device(torch.device(device).index or 0):
            memory = cupy.cuda.Memory(nbytes)  # cudaMalloc: its own allocation, which IPC shares whole
        array = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0))
        return torch.as_tensor(array, device=device).view(dtype).view(shape)

    @staticmethod
    def rendezvous(tensor: torch.Tensor, group) -> _Handle:
        import cupy

        group = _group(group)
        handle = cupy.cuda.runtime.ipcGetMemHandle(tensor.data_ptr())
        every: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, handle, group=group)  # host sync: a collective
        rank = dist.get_rank(group)
        pointers, opened = [], []
        try:
            for r, peer in enumerate(every):
                if r == rank:
                    pointers.append(tensor.data_ptr())
                else:
                    pointers.append(_open(peer))
                    opened.append(peer)
        except Exception:
            for peer in opened:
                _release(peer)
            raise
        return _Handle(pointers, opened, group)


def _group(group):
    if group is None or not isinstance(group, str):
        return group
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(group)


def init_rank(rank: int, size: int, init_method: str) -> torch.device:
    """Join a fresh world of ``size`` ranks on the shared GPU (gloo) with the
    engine's stand-ins installed; the device."""
    torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:gloo", init_method=init_method, rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=60))
    install()
    return torch.device("cuda", 0)


def install() -> None:
    """Make this process's engine run on a GPU its peers share (call once, in a
    world's rank, before any dispatcher)."""
    import dispatch.transports as transports
    import dispatch.transports.nvlink as nvlink
    import torch.distributed as distributed
    from dispatch.nvlink_layout import most_experts

    real = getattr(distributed, "_symmetric_memory", None)
    if real is None:
        import torch.distributed._symmetric_memory as real
    stand_in = IpcSymmetricMemory(real)
    distributed._symmetric_memory = stand_in
    import sys

    sys.modules["torch.distributed._symmetric_memory"] = stand_in

    def unusable(group, num_experts: int) -> str | None:
        world = dist.get_world_size(group)
        if num_experts > most_experts(world):
            return f"takes at most {most_experts(world)} experts on {world} ranks, got num_experts={num_experts}"
        if world == 1:
            return "needs peers: the group has one rank"
        return None

    nvlink.unusable = transports.unusable = unusable
