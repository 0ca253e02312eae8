"""Disjoint SM partitions for the overlap studies (CUDA green contexts, through
the driver): a few SMs split off for the exchange's kernels, the rest for the
experts' GEMMs, so neither's blocks ever land on the other's SMs.

``split(layer, device, exchange_sms)`` runs a MoEMicroBatches call that way:
its exchange, plans and NVSHMEM data kernels on streams of the small partition,
the caller's work (the experts) on a stream of the large one."""

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


@functools.lru_cache(maxsize=1)
def _library():
    return ctypes.CDLL("libcuda.so.1")


def driver(name: str, *args) -> None:
    """Call the driver's ``name``; a status other than success raises, naming it."""
    status = getattr(_library(), name)(*args)
    if status != 0:
        raise RuntimeError(f"{name} failed: CUDA error {status}")


def _sm_count(resource) -> int:
    return int.from_bytes(bytes(resource)[_SM_COUNT_AT:_SM_COUNT_AT + 4], "little")


@functools.lru_cache(maxsize=None)
def green_contexts(device_index: int, exchange_sms: int) -> tuple[int, int, tuple[int, int, int]]:
    """Two green contexts of the device over disjoint SMs: ``exchange_sms`` split off
    (rounded up as the device requires: a multiple of 8 on compute capability 9.0)
    and the rest. Returns both (the exchange's, the rest's) and the SM counts
    (the device's, the exchange's, the rest's); made once a process."""
    torch.cuda.init()
    dev = ctypes.c_int()
    driver("cuDeviceGet", ctypes.byref(dev), device_index)
    whole = (ctypes.c_ubyte * _RESOURCE_BYTES)()
    driver("cuDeviceGetDevResource", dev, whole, _SM)
    part, rest = (ctypes.c_ubyte * _RESOURCE_BYTES)(), (ctypes.c_ubyte * _RESOURCE_BYTES)()
    groups = ctypes.c_uint(1)
    driver("cuDevSmResourceSplitByCount", part, ctypes.byref(groups), whole, rest, 0, exchange_sms)
    contexts = []
    for resource in (part, rest):
        desc, ctx = ctypes.c_void_p(), ctypes.c_void_p()
        driver("cuDevResourceGenerateDesc", ctypes.byref(desc), resource, 1)
        driver("cuGreenCtxCreate", ctypes.byref(ctx), desc, dev, _DEFAULT_STREAM)
        contexts.append(ctx.value)
    return contexts[0], contexts[1], (_sm_count(whole), _sm_count(part), _sm_count(rest))


@functools.lru_cache(maxsize=None)
def green_stream(ctx: int, role: str, priority: int = 0) -> int:
    """A stream of the green context ``ctx`` (one a ``role`` and priority, made once
    a process), as its handle."""
    stream = ctypes.c_void_p()
    driver("cuGreenCtxStreamCreate", ctypes.byref(stream), ctypes.c_void_p(ctx), _NON_BLOCKING, priority)
    return stream.value


@contextlib.contextmanager
def exchange_streams(layer, comm, plans, data):
    """Inside: ``layer``'s (a MoEMicroBatches) exchanges on ``comm`` (a function of
    device and priority to a stream), its plans on ``plans``, the NVSHMEM
    transport's data kernels (where it has them) on ``data``."""
    streams, exchange = layer.dispatcher._streams, getattr(layer.dispatcher.transport, "exchange", None)
    saved = (streams.__dict__.get("stream"), layer._plans, getattr(exchange, "_stream", None))
    streams.stream, layer._plans = comm, plans
    if saved[2] is not None:
        exchange._stream = data
    try:
        yield
    finally:
        if saved[0] is None:
            del streams.stream  # (the class's method again)
        else:
            streams.stream = saved[0]
        layer._plans = saved[1]
        if saved[2] is not None:
            exchange._stream = saved[2]


@contextlib.contextmanager
def split(layer, device: torch.device, exchange_sms: int):
    """Inside, on CUDA: ``layer``'s exchange (its streams, plans and data kernels)
    on a green context of ``exchange_sms`` SMs, and the caller's work on a stream
    of one over the rest, ordered after the caller's stream on entry and before it
    on exit."""
    x_ctx, g_ctx, _ = green_contexts(device.index, exchange_sms)
    ext = functools.partial(torch.cuda.ExternalStream, device=device)
    comms = {}

    def comm(device, priority):
        if priority not in comms:
            comms[priority] = ext(green_stream(x_ctx, "comm", priority))
        return comms[priority]

    caller, gemms = torch.cuda.current_stream(device), ext(green_stream(g_ctx, "gemms"))
    gemms.wait_stream(caller)
    with exchange_streams(layer, comm, ext(green_stream(x_ctx, "plans")), ext(green_stream(x_ctx, "data"))):
        with torch.cuda.stream(gemms):
            yield
    caller.wait_stream(gemms)
