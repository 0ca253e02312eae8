"""The exchange on SMs of its own: disjoint SM partitions (CUDA green contexts).

Beside the experts' GEMMs, an exchange's kernels land on whatever SMs are free
when they start, and a GEMM launched while they run can take twice its time
(over NVSHMEM at 8 blocks on H200, the activations' gradient GEMM 3.4-3.8 ms
against 1.8 alone, carveout or not). With the exchange's kernels on a few SMs
split off and the GEMMs on the rest, that GEMM takes 1.95 ms.

An :class:`SMPartition` is such a split of one device (two green contexts,
made once a process through the driver) with streams on each side. Work queued
on its compute stream runs on the compute SMs; an exchange issued from any of
its streams takes the partition's exchange streams (:func:`beside`), which run
on the exchange SMs. ``MoEMicroBatches(sm_partition=N)`` runs its call so.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch

_RESOURCE_BYTES = 144  # sizeof(CUdevResource), CUDA 12.4 to 13: its type, 92 bytes, a 48-byte union
_SM_COUNT_AT = 96  # CUdevResource.sm.smCount
_SM = 1  # CU_DEV_RESOURCE_TYPE_SM
_DEFAULT_STREAM = 1  # CU_GREEN_CTX_DEFAULT_STREAM (required)
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING (required of a green context's streams)

_BY_STREAM: dict[int, "SMPartition"] = {}  # a partition's streams (their handles) -> it


@functools.lru_cache(maxsize=1)
def _library():
    return ctypes.CDLL("libcuda.so.1")


def driver(name: str, *args) -> None:
    """Call the CUDA driver's ``name``; a status other than success raises, naming it."""
    try:
        function = getattr(_library(), name)
    except (OSError, AttributeError) as error:
        raise RuntimeError(f"the CUDA driver has no {name} (green contexts need CUDA 12.4 or later): "
                           f"{error}") from None
    status = function(*args)
    if status != 0:
        raise RuntimeError(f"{name} failed: CUDA error {status}")


def _sm_count(resource) -> int:
    return int.from_bytes(bytes(resource)[_SM_COUNT_AT:_SM_COUNT_AT + 4], "little")


class SMPartition:
    """One device's SMs in two disjoint sets: ``exchange_sms`` for the exchange's
    kernels, ``compute_sms`` (the rest) for the work on :meth:`compute_stream`."""

    def __init__(self, device_index: int, exchange_sms: int) -> None:
        torch.cuda.init()
        dev = ctypes.c_int()
        driver("cuDeviceGet", ctypes.byref(dev), device_index)
        whole = (ctypes.c_ubyte * _RESOURCE_BYTES)()
        driver("cuDeviceGetDevResource", dev, whole, _SM)
        if exchange_sms >= _sm_count(whole):
            raise ValueError(f"sm_partition must leave SMs to the rest: {exchange_sms} of cuda:{device_index}'s "
                             f"{_sm_count(whole)}")
        part, rest = (ctypes.c_ubyte * _RESOURCE_BYTES)(), (ctypes.c_ubyte * _RESOURCE_BYTES)()
        groups = ctypes.c_uint(1)  # one group of at least exchange_sms (rounded as the device requires), and the rest
        driver("cuDevSmResourceSplitByCount", part, ctypes.byref(groups), whole, rest, 0, exchange_sms)
        self._contexts = []
        for resource in (part, rest):
            desc, ctx = ctypes.c_void_p(), ctypes.c_void_p()
            driver("cuDevResourceGenerateDesc", ctypes.byref(desc), resource, 1)
            driver("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, _DEFAULT_STREAM)
            self._contexts.append(ctx.value)
        self.device = torch.device("cuda", device_index)
        self.exchange_sms, self.compute_sms = _sm_count(part), _sm_count(rest)
        self._streams: dict[tuple[str, int], torch.cuda.Stream] = {}

    @staticmethod
    @functools.lru_cache(maxsize=None)
    def of(device_index: int, exchange_sms: int) -> "SMPartition":
        """The partition of CUDA device ``device_index`` with ``exchange_sms`` split
        off for the exchange (made on first use, then the same one)."""
        return SMPartition(device_index, exchange_sms)

    def _stream(self, side: int, role: str, priority: int) -> "torch.cuda.Stream":
        key = (role, priority)
        if key not in self._streams:
            handle = ctypes.c_void_p()
            driver("cuGreenCtxStreamCreate", ctypes.byref(handle), ctypes.c_void_p(self._contexts[side]),
                   _NON_BLOCKING, priority)
            stream = torch.cuda.ExternalStream(handle.value, device=self.device)
            self._streams[key] = stream
            _BY_STREAM[stream.cuda_stream] = self
        return self._streams[key]

    def exchange_stream(self, role: str, priority: int = 0) -> "torch.cuda.Stream":
        """The exchange's stream for ``role`` at CUDA ``priority``, on the exchange SMs."""
        return self._stream(0, role, priority)

    def compute_stream(self) -> "torch.cuda.Stream":
        """The stream whose work runs on the compute SMs."""
        return self._stream(1, "compute", 0)

    @contextlib.contextmanager
    def computing(self):
        """Inside: the current stream is :meth:`compute_stream`, after the work
        queued on the caller's so far; on exit the caller's waits for it."""
        caller, compute = torch.cuda.current_stream(self.device), self.compute_stream()
        compute.wait_stream(caller)
        try:
            with torch.cuda.stream(compute):
                yield
        finally:
            caller.wait_stream(compute)


def synchronize(device_index: int) -> None:
    """Wait for the work queued on every SM partition's stream of CUDA device
    ``device_index`` (a device's synchronize need not cover a green context's)."""
    for handle, split in list(_BY_STREAM.items()):
        if split.device.index == device_index:
            driver("cuStreamSynchronize", ctypes.c_void_p(handle))


def beside(caller: "torch.cuda.Stream", plain: "torch.cuda.Stream", role: str,
           priority: int = 0) -> "torch.cuda.Stream":
    """The stream an exchange's work for ``role`` takes beside the ``caller``'s:
    ``plain``, or where ``caller`` is a stream of an :class:`SMPartition`, that
    partition's exchange stream for ``role`` at ``priority``."""
    partition = _BY_STREAM.get(caller.cuda_stream)
    return plain if partition is None else partition.exchange_stream(role, priority)


def handed_over(last: "torch.cuda.Stream | None", taken: "torch.cuda.Stream") -> "torch.cuda.Stream":
    """``taken``, after ``last`` (the stream a role took before; None: none): where
    they differ, ``taken`` waits for the work queued on ``last``, so that a role's
    work stays in the order it was issued whichever streams it moves between."""
    if last is not None and last is not taken:
        taken.wait_stream(last)
    return taken
