"""SM partitions: one device's SMs in two disjoint sets (CUDA green contexts),
a small one for an exchange's kernels and the rest for the work beside them, so
that neither's blocks land on the other's SMs.

Work queued on a partition's :meth:`SMPartition.compute_stream` runs on the
compute SMs. The exchange's side streams follow the caller's stream: where the
caller's current stream is one of a partition's, each side stream (a
dispatcher's communication stream, a layer's plans stream, the NVSHMEM
exchange's own) is replaced by the partition's stand-in for it (:func:`beside`),
which runs on the exchange SMs; elsewhere nothing changes. This is the current
stream's own rule carried one step further, and why the partitions are known
process-wide (by their streams). ``MoEMicroBatches(sm_partition=N)`` runs its
calls on a partition's compute stream.

Green contexts are made through the CUDA driver (12.4 or later). Memory the work
allocates on the partition's streams comes from their own pools in torch's
caching allocator, not the caller's stream's.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import threading

import torch


class _SmResource(ctypes.Structure):
    _fields_ = [("smCount", ctypes.c_uint), ("minSmPartitionSize", ctypes.c_uint),
                ("smCoscheduledAlignment", ctypes.c_uint), ("_rest", ctypes.c_ubyte * 36)]


class _DevResource(ctypes.Structure):
    """``CUdevResource`` (CUDA 12.4 to 13): its type, 92 bytes of padding, a 48-byte union."""

    _fields_ = [("type", ctypes.c_int), ("_padding", ctypes.c_ubyte * 92), ("sm", _SmResource)]


assert ctypes.sizeof(_DevResource) == 144 and _DevResource.sm.offset == 96

_SM = 1  # CU_DEV_RESOURCE_TYPE_SM
_DEFAULT_STREAM = 1  # CU_GREEN_CTX_DEFAULT_STREAM (required)
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING (required of a green context's streams)
_PTR = ctypes.c_void_p
_SIGNATURES = {  # the driver calls made here: their arguments, each returns a CUresult
    "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
    "cuDeviceGetDevResource": (ctypes.c_int, ctypes.POINTER(_DevResource), ctypes.c_int),
    "cuDevSmResourceSplitByCount": (ctypes.POINTER(_DevResource), ctypes.POINTER(ctypes.c_uint),
                                    ctypes.POINTER(_DevResource), ctypes.POINTER(_DevResource), ctypes.c_uint,
                                    ctypes.c_uint),
    "cuDevResourceGenerateDesc": (ctypes.POINTER(_PTR), ctypes.POINTER(_DevResource), ctypes.c_uint),
    "cuGreenCtxCreate": (ctypes.POINTER(_PTR), _PTR, ctypes.c_int, ctypes.c_uint),
    "cuGreenCtxDestroy": (_PTR,),
    "cuGreenCtxStreamCreate": (ctypes.POINTER(_PTR), _PTR, ctypes.c_uint, ctypes.c_int),
    "cuStreamSynchronize": (_PTR,),
}

_LOCK = threading.Lock()  # the partitions and their streams are made once a process, under it
_PARTITIONS: dict[tuple[int, int], "SMPartition"] = {}  # (device, SMs asked for) -> the partition
_BY_STREAM: dict[int, "SMPartition"] = {}  # every partition stream (its handle) -> its partition


@functools.lru_cache(maxsize=1)
def _library():
    return ctypes.CDLL("libcuda.so.1")


def driver(name: str, *args) -> None:
    """Call the CUDA driver's ``name`` (one of ``_SIGNATURES``, typed so); a status
    other than success raises a RuntimeError naming it."""
    try:
        function = getattr(_library(), name)
    except (OSError, AttributeError) as error:
        raise RuntimeError(f"the CUDA driver has no {name} (green contexts need CUDA 12.4 or later)") from error
    function.argtypes, function.restype = _SIGNATURES[name], ctypes.c_int
    status = function(*args)
    if status != 0:
        raise RuntimeError(f"{name} failed: CUDA error {status}")


class SMPartition:
    """``exchange_sms`` SMs of a CUDA device for an exchange's kernels, the other
    ``compute_sms`` for the work on :meth:`compute_stream`. Made by :meth:`of`."""

    def __init__(self, device_index: int, sms: int) -> None:
        dev = ctypes.c_int()
        driver("cuDeviceGet", ctypes.byref(dev), device_index)
        whole, part, rest = _DevResource(), _DevResource(), _DevResource()
        driver("cuDeviceGetDevResource", dev, ctypes.byref(whole), _SM)
        groups = ctypes.c_uint(1)  # one group of at least `sms` (rounded up as the device requires), and the rest
        step = max(whole.sm.smCoscheduledAlignment, 1)
        fits = -(-max(sms, whole.sm.minSmPartitionSize) // step) * step < whole.sm.smCount
        if fits:
            driver("cuDevSmResourceSplitByCount", ctypes.byref(part), ctypes.byref(groups), ctypes.byref(whole),
                   ctypes.byref(rest), 0, sms)
        if not fits or groups.value != 1 or rest.sm.smCount == 0:
            raise ValueError(f"sm_partition={sms} leaves no SMs to the rest of cuda:{device_index} "
                             f"({whole.sm.smCount} SMs, taken in multiples of {whole.sm.smCoscheduledAlignment})")
        self._contexts: list[int] = []
        try:
            for resource in (part, rest):
                desc, ctx = _PTR(), _PTR()
                driver("cuDevResourceGenerateDesc", ctypes.byref(desc), ctypes.byref(resource), 1)
                driver("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, _DEFAULT_STREAM)
                self._contexts.append(ctx.value)
        except RuntimeError:
            for ctx in self._contexts:
                with contextlib.suppress(RuntimeError):  # (the error that stopped the making is the one raised)
                    driver("cuGreenCtxDestroy", _PTR(ctx))
            raise
        self.device = torch.device("cuda", device_index)
        self.exchange_sms, self.compute_sms = part.sm.smCount, rest.sm.smCount
        self._stand_ins: dict[int, torch.cuda.Stream] = {}  # a plain stream's handle -> its stand-in here
        self._compute: torch.cuda.Stream | None = None  # (made on first use)

    @staticmethod
    def of(device: torch.device, sms: int) -> "SMPartition":
        """The partition of CUDA ``device`` with ``sms`` SMs (rounded up as it
        requires: a multiple of 8 on compute capability 9.0) for the exchange:
        made on first use, then the same one. Where it cannot be made, a
        ValueError or RuntimeError that names ``sm_partition``."""
        if torch.cuda.is_available():
            torch.cuda.init()  # (the driver's calls need its context)
        index = torch.cuda.current_device() if device.index is None else device.index
        with _LOCK:
            if (index, sms) not in _PARTITIONS:
                try:
                    _PARTITIONS[index, sms] = SMPartition(index, sms)
                except RuntimeError as error:
                    raise RuntimeError(f"sm_partition={sms}: no SM partition of cuda:{index}: {error}") from error
            return _PARTITIONS[index, sms]

    def _stream(self, side: int, priority: int) -> "torch.cuda.Stream":
        handle = _PTR()
        driver("cuGreenCtxStreamCreate", ctypes.byref(handle), _PTR(self._contexts[side]), _NON_BLOCKING, priority)
        stream = torch.cuda.ExternalStream(handle.value, device=self.device)
        _BY_STREAM[stream.cuda_stream] = self
        return stream

    def stand_in(self, plain: "torch.cuda.Stream") -> "torch.cuda.Stream":
        """The stream on the exchange SMs that stands in for the side stream
        ``plain`` (at its priority), made on first use."""
        key = plain.cuda_stream
        if key not in self._stand_ins:
            with _LOCK:
                if key not in self._stand_ins:
                    self._stand_ins[key] = self._stream(0, plain.priority)
        return self._stand_ins[key]

    def compute_stream(self) -> "torch.cuda.Stream":
        """The stream whose work runs on the compute SMs (made on first use)."""
        if self._compute is None:
            with _LOCK:
                if self._compute is None:
                    self._compute = self._stream(1, 0)
        return self._compute

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


def check(sm_partition) -> None:
    """A layer's ``sm_partition`` argument: None or an int >= 1, else a ValueError naming it."""
    if sm_partition is not None and (isinstance(sm_partition, bool) or not isinstance(sm_partition, int)
                                     or sm_partition < 1):
        raise ValueError(f"sm_partition must be None or an int >= 1, got {sm_partition!r}")


def outside_capture(sm_partition: int | None) -> None:
    """Refuse by name a layer's call with an SM partition inside a CUDA-graph
    capture (every rank captures alike: each raises here, before any exchange)."""
    if sm_partition is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise ValueError("sm_partition: a call on an SM partition cannot be captured in a CUDA graph (its "
                         "streams are green contexts'); capture the layer without it")


def for_call(sm_partition: int | None, device: torch.device) -> "SMPartition | None":
    """The partition a layer's call with ``sm_partition`` SMs runs on (None: none),
    its compute stream made, refused by name before any communication where it
    cannot be: off CUDA, or where the device cannot be split so (outside a
    capture: :func:`outside_capture`)."""
    if sm_partition is None:
        return None
    if device.type != "cuda":
        raise ValueError(f"sm_partition splits a GPU's SMs: it needs the layer's tensors on CUDA, got {device}")
    made = SMPartition.of(device, sm_partition)
    made.compute_stream()
    return made


def run_on(partition: "SMPartition | None", fn, *args):
    """``fn(*args)`` on ``partition``'s compute stream (:meth:`SMPartition.computing`),
    its tensor results then marked as used on the caller's stream; where
    ``partition`` is None, as it is."""
    if partition is None:
        return fn(*args)
    caller = torch.cuda.current_stream(partition.device)
    with partition.computing():
        out = fn(*args)
    for tensor in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(tensor, torch.Tensor):
            tensor.record_stream(caller)
    return out


def beside(caller: "torch.cuda.Stream", plain: "torch.cuda.Stream") -> "torch.cuda.Stream":
    """The stream an exchange's side work takes beside the ``caller``'s: the side
    stream ``plain``, or where ``caller`` is a stream of an :class:`SMPartition`,
    that partition's stand-in for it."""
    partition = _BY_STREAM.get(caller.cuda_stream)
    return plain if partition is None else partition.stand_in(plain)


def handed_over(last: "torch.cuda.Stream | None", taken: "torch.cuda.Stream") -> "torch.cuda.Stream":
    """``taken``, after ``last`` (the stream a role took before; None: none): where
    they differ, ``taken`` waits for the work queued on ``last``, so that a role's
    work stays in the order it was issued whichever streams it moves between."""
    if last is not None and last is not taken:
        taken.wait_stream(last)
    return taken


def synchronize(device_index: int) -> None:
    """Wait for the work queued on every partition stream of CUDA device
    ``device_index`` (a device's synchronize need not cover a green context's)."""
    for handle, partition in list(_BY_STREAM.items()):
        if partition.device.index == device_index:
            driver("cuStreamSynchronize", _PTR(handle))
