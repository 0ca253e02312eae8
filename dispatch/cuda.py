"""The one place that talks to CuPy: compiles ``csrc/*.cu`` with NVRTC at first
use, caches the kernels, and launches them on torch's current stream.

Importing this module never needs CuPy; :func:`available` says whether the
kernels can run here (CUDA, and CuPy importable).

    k = kernel("layout.cu", "route_layout", "long long", "float")
    k(grid, topk_idx=idx, weights=w, tokens=T, ..., shared=0)

A launch names every parameter of the kernel's signature, read from its
source (:func:`signature`): a missing or unknown name raises, and each value
travels with the exact C type of its parameter (a pointer takes a tensor, its
data pointer, an address as an int, or None for 0; a scalar the number). The
values are packed into one parameter block (each at its C alignment,
:func:`parameter_block`) whose address array goes to the driver's
``cuLaunchKernelEx``. On compute capability
9.0 and later it allows programmatic dependent launch: the next kernel of the
stream may be launched while this one runs, and waits on the device for it
(``engine::follow_previous``, the first thing every kernel does).
"""

from __future__ import annotations

import ctypes
import functools
import pathlib
import re
import struct
import threading
from dataclasses import dataclass

import torch

from dispatch import partition

_CSRC_NAMES = ("engine.cuh", "layout.cu", "intranode_dispatch.cu", "intranode_combine.cu")

# torch dtype -> the C type the kernels name it by
C_TYPES = {
    torch.float16: "__half",
    torch.bfloat16: "__nv_bfloat16",
    torch.float32: "float",
    torch.float64: "double",
    torch.uint8: "unsigned char",
    torch.int32: "int",
    torch.int64: "long long",
}


def csrc_dir() -> pathlib.Path:
    """Where the kernel sources are: ``csrc/`` beside the package in a source
    checkout, else the copy installed as ``dispatch/csrc``."""
    here = pathlib.Path(__file__).resolve().parent
    for candidate in (here.parent / "csrc", here / "csrc"):
        if all((candidate / name).is_file() for name in _CSRC_NAMES):
            return candidate
    raise RuntimeError(f"the NVLink engine's kernel sources ({', '.join(_CSRC_NAMES)}) were not found beside {here}")


@functools.lru_cache(maxsize=1)
def _cupy():
    try:
        import cupy
    except ImportError:
        return None
    return cupy


@functools.lru_cache(maxsize=1)
def _capture_info():
    """The driver's ``cuStreamGetCaptureInfo`` (None where it cannot be loaded). The
    first three parameters (stream, capture status out, capture id out) are the same
    in every version of this entry point; the outputs after them, where a version has
    them, may be null, so it is called with four null ones whatever the version."""
    try:
        fn = _driver().cuStreamGetCaptureInfo
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)] + [ctypes.c_void_p] * 4
    fn.restype = ctypes.c_int
    return fn


def capture_id(device: torch.device) -> int | None:
    """The id of the CUDA graph capture that torch's current stream on ``device`` is
    in; None when it is not capturing (0 for every capture where the driver cannot
    say which)."""
    if not capturing():
        return None
    fn = _capture_info()
    status, ident = ctypes.c_int(), ctypes.c_uint64()
    if fn is None or fn(torch.cuda.current_stream(device).cuda_stream, ctypes.byref(status), ctypes.byref(ident),
                        None, None, None, None) != 0:
        return 0
    return int(ident.value)


def available() -> bool:
    """True where the engine's kernels can run: a CUDA device and CuPy."""
    return torch.cuda.is_available() and _cupy() is not None


_KERNEL = re.compile(  # a kernel's declaration in csrc/ (after its __attributes__(...)): template, name, parameters
    r"(?:template\s*<(?P<template>[^>]*)>\s*)?__global__\s+void\s+(?:__\w+__\([^)]*\)\s+)*"
    r"(?P<name>\w+)\s*\((?P<params>[^)]*)\)"
)
_BY_VALUE = {  # C type of a parameter passed by value -> its struct format code
    "int": "i",
    "unsigned": "I",
    "unsigned int": "I",
    "long long": "q",
    "unsigned long long": "Q",
    "float": "f",
    "double": "d",
}


@dataclass(frozen=True)
class Signature:
    """A kernel's parameters as its source declares them.

    Attributes:
        template: how many template arguments it takes.
        names: its parameters' names, in order.
        codes: the struct format code each travels as ("Q" for a pointer: its address).
        pointers: the places of its pointer parameters.
    """

    template: int
    names: tuple[str, ...]
    codes: str
    pointers: tuple[int, ...]


@functools.lru_cache(maxsize=1)
def signatures() -> dict[tuple[str, str], Signature]:
    """(file, kernel) -> :class:`Signature`, for every kernel of ``csrc/*.cu``."""
    return {(path.name, name): found for path in sorted(csrc_dir().glob("*.cu"))
            for name, found in signatures_in(path.read_text()).items()}


def signatures_in(source: str) -> dict[str, Signature]:
    """kernel -> :class:`Signature`, for every kernel ``source`` (CUDA text) declares."""
    out = {}
    for m in _KERNEL.finditer(source):
        names, codes, pointers = [], [], []
        for param in m["params"].split(","):
            words = " ".join(param.replace("*", " * ").split()).split()
            if "*" in words:
                pointers.append(len(names))
                codes.append("Q")
            else:
                codes.append(_BY_VALUE[" ".join(w for w in words[:-1] if w != "const")])
            names.append(words[-1])
        template = 0 if m["template"] is None else len(m["template"].split(","))
        out[m["name"]] = Signature(template, tuple(names), "".join(codes), tuple(pointers))
    return out


def signature(source: str, name: str) -> Signature:
    """The :class:`Signature` of kernel ``name`` in ``csrc/source``."""
    try:
        return signatures()[(source, name)]
    except KeyError:
        raise ValueError(f"csrc/{source} declares no kernel {name!r}") from None


@functools.lru_cache(maxsize=256)
def parameter_block(codes: str) -> tuple[struct.Struct, tuple[int, ...]]:
    """(packer, offset of each parameter) of a kernel whose parameters have the
    struct format ``codes``: each at the next multiple of its size, as C lays out
    scalars and pointers (native alignment, no padding after the last)."""
    layout = struct.Struct("@" + codes)
    offsets, at = [], 0
    for code in codes:
        size = struct.calcsize(code)
        at = -(-at // size) * size
        offsets.append(at)
        at += size
    return layout, tuple(offsets)


class Kernel:
    """One compiled kernel; calling it launches on torch's current stream, every
    parameter named (``kernel(blocks, shared=0, **args)``). :meth:`bind` makes a
    :class:`Launch` with some arguments fixed once."""

    def __init__(self, function, threads: int, signature: Signature) -> None:
        self._function, self.threads, self.signature = function, threads, signature
        self._handles: dict[int, int] = {}  # CUDA device -> the kernel's CUfunction there
        self._unbound: Launch | None = None

    def __call__(self, blocks: int, shared: int = 0, **args) -> None:
        launch = self._unbound or self.bind()
        launch(blocks, shared, **args)

    def bind(self, **bound) -> "Launch":
        """A :class:`Launch` of this kernel with ``bound`` (parameters by name, as
        a launch names them) packed once; no argument given: every one named at
        each launch."""
        launch = Launch(self, bound)
        if not bound:
            self._unbound = launch
        return launch

    def handle(self, device: int) -> int:
        """The kernel's CUfunction on CUDA device ``device`` (loaded on first use)."""
        handle = self._handles.get(device)
        if handle is None:
            with _cupy().cuda.Device(device):
                handle = self._handles[device] = self._function.kernel.ptr  # the module loaded on that device
        return handle


class Launch:
    """Launches of one kernel whose ``bound`` arguments were packed once (values
    that hold for many launches: an engine's buffers and constants, a shape's
    sizes); each call names the rest (``launch(blocks, shared=0, **free)``),
    every one of them, and only those: a missing or unknown name (or one
    bound) raises TypeError naming it. One parameter block per thread, its
    bound values written when it is made and the free ones at each launch
    (the driver copies the block at the call)."""

    def __init__(self, kernel: Kernel, bound: dict) -> None:
        signature = kernel.signature
        unknown = sorted(set(bound) - set(signature.names))
        if unknown:
            raise TypeError(f"a launch binds parameters of the kernel only: unknown {unknown}")
        self.kernel = kernel
        self.free = tuple(n for n in signature.names if n not in bound)
        # the bound values as they travel, by place (a pointer's address), None where free
        values = arguments(signature, {**dict.fromkeys(self.free, 0), **bound})
        self._bound = tuple(None if n in self.free else v for n, v in zip(signature.names, values))
        self._block = parameter_block(signature.codes)[0].pack(*values)  # the free values 0
        self._pack = _packer(signature, self.free)
        self._local = threading.local()
        self._compiled: dict = {}  # (device, order of the free values) -> host.Launcher, or None

    def __call__(self, blocks: int, shared: int = 0, **free) -> None:
        device = current_device()  # the CUDA runtime's current device, which the launch uses
        compiled = self._compiled.get((device, None), False)
        if compiled is False:
            compiled = self.compiled(device)
        if compiled is not None:
            try:
                values = _gatherer(self.kernel.signature, self.free)(free)
            except KeyError:
                self._refuse(free)
            compiled.launch(max(int(blocks), 1), shared, raw_stream(device), values)
            return
        handle = self.kernel.handle(device)
        made = getattr(self._local, "made", None) or self._make()
        pack_into, block, config, config_at, params_at = made
        try:
            self._pack(pack_into, block, free, self._bound)
        except KeyError:
            self._refuse(free)
        config.gridDimX, config.sharedMemBytes = max(int(blocks), 1), shared
        config.hStream = raw_stream(device)
        config.numAttrs = 1 if _dependent_launch(device) else 0
        _check(_launch()(config_at, handle, params_at, None), "cuLaunchKernelEx")

    def _refuse(self, free: dict):
        """Raise the TypeError of a launch whose names are not its free parameters."""
        missing, unknown = [n for n in self.free if n not in free], sorted(set(free) - set(self.free))
        raise TypeError(f"a launch must name every parameter of the kernel once: missing {missing}, "
                        f"unknown {unknown}") from None

    def compiled(self, device: int, order: tuple[str, ...] | None = None):
        """This launch on CUDA device ``device`` through the compiled host path
        (``dispatch.host``): a ``Launcher`` whose ``launch(blocks, shared, stream,
        values)`` takes the free values in ``order`` (their names; None: the
        signature's order), each as it travels; None where the path is not built
        here."""
        key = (device, order)
        if key in self._compiled:
            return self._compiled[key]
        from dispatch import host

        module = host.module()
        launcher = None
        if module is not None:
            signature = self.kernel.signature
            names = self.free if order is None else order
            if sorted(names) != sorted(self.free):
                raise TypeError(f"a compiled launch takes its free parameters {sorted(self.free)}, got {list(names)}")
            _, offsets = parameter_block(signature.codes)
            launcher = module.Launcher(self.kernel.handle(device), self.kernel.threads, _dependent_launch(device),
                                       self._block, signature.codes, list(offsets),
                                       [signature.names.index(n) for n in names])
        self._compiled[key] = launcher
        return launcher

    def _make(self) -> tuple:
        """This thread's (packer, parameter block, launch configuration and the
        addresses of both that the driver takes), kept for its later launches.
        The configuration allows programmatic dependent launch (its attribute,
        kept alive by the pointer in it); grid, shared memory and stream are set
        at each launch."""
        layout, offsets = parameter_block(self.kernel.signature.codes)
        block = ctypes.create_string_buffer(max(layout.size, 1))
        base = ctypes.addressof(block)
        params = (ctypes.c_void_p * max(len(offsets), 1))(*[base + o for o in offsets])
        attribute = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION)
        attribute.value[0] = 1  # programmaticStreamSerializationAllowed
        config = LaunchConfig(gridDimY=1, gridDimZ=1, blockDimX=self.kernel.threads, blockDimY=1, blockDimZ=1,
                              attrs=ctypes.pointer(attribute))
        made = self._local.made = (layout.pack_into, block, config, ctypes.addressof(config),
                                   ctypes.addressof(params))
        self._local.keep = params  # the addresses' array lives as long as the thread's block
        return made


@functools.lru_cache(maxsize=None)
def _packer(signature: Signature, free: tuple[str, ...]):
    """``pack(pack_into, block, args, bound)``: a launch's values packed into
    ``block`` in the order of ``signature``: the ``free`` parameters from
    ``args`` (:func:`_given`), every one and nothing else (KeyError otherwise),
    the others from ``bound`` (by place, as they travel). One function made per
    (signature, free names): no loop over the parameters at each launch."""
    values = [_given(signature, name) if name in free else f"c[{i}]" for i, name in enumerate(signature.names)]
    return _made("pack(pack_into, block, a, c)", len(free), f"pack_into(block, 0, {', '.join(values)})")


@functools.lru_cache(maxsize=None)
def _gatherer(signature: Signature, free: tuple[str, ...]):
    """``values(args)``: a launch's ``free`` values from ``args`` in that order
    (:func:`_given`), every one and nothing else (KeyError otherwise): the
    compiled path's counterpart of :func:`_packer`."""
    return _made("values(a)", len(free), f"return ({''.join(_given(signature, n) + ', ' for n in free)})")


def _given(signature: Signature, name: str) -> str:
    """The expression of parameter ``name``'s value as it travels, from the launch's
    arguments ``a``: a pointer's tensor as its data pointer, an address as a plain
    int, None as 0; a scalar as given."""
    if signature.names.index(name) in signature.pointers:
        return f"(0 if (v := a[{name!r}]) is None else v if v.__class__ is int else v.data_ptr())"
    return f"a[{name!r}]"


def _made(head: str, count: int, body: str):
    """The function ``def {head}: {body}`` that raises KeyError unless its ``a``
    holds ``count`` names (its names and places come from csrc/'s declarations,
    nothing else)."""
    scope: dict = {}
    exec(f"def {head}:\n    if len(a) != {count}:\n        raise KeyError\n    {body}\n", scope)
    return scope[head.split("(")[0]]


def arguments(signature: Signature, args: dict) -> list:
    """The values of a launch's named ``args`` in the order of ``signature``, each
    as it travels (a pointer parameter's tensor as its data pointer, None as 0).
    Raises TypeError naming the parameters missing or unknown."""
    names = signature.names
    try:
        values = [args[n] for n in names]
        if len(args) != len(names):
            raise KeyError
    except KeyError:
        missing, unknown = [n for n in names if n not in args], sorted(set(args) - set(names))
        raise TypeError(f"a launch must name every parameter of the kernel once: missing {missing}, "
                        f"unknown {unknown}") from None
    for i in signature.pointers:
        v = values[i]
        if v is None:
            values[i] = 0
        elif not isinstance(v, int):
            values[i] = v.data_ptr()
    return values


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID: programmatic dependent launch allowed


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, padding to 8 bytes, a 64-byte value (a union,
    8-byte aligned; a flag is its first int, the low half of the first word here)."""
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int64 * 8)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig``, as ``cuLaunchKernelEx`` reads it."""
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


@functools.lru_cache(maxsize=1)
def _driver():
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=1)
def _launch():
    """The driver's ``cuLaunchKernelEx`` (config, function, kernel parameters, extra)."""
    fn = _driver().cuLaunchKernelEx
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def _check(result: int, call: str) -> None:
    """Raise the driver's error of a call that did not return CUDA_SUCCESS."""
    if result != 0:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        _driver().cuGetErrorName(result, ctypes.byref(name))
        _driver().cuGetErrorString(result, ctypes.byref(text))
        raise RuntimeError(f"{call} failed: {(name.value or b'?').decode()} ({result}): {(text.value or b'').decode()}")


@functools.lru_cache(maxsize=None)
def _dependent_launch(device: int) -> bool:
    """Whether launches on CUDA device ``device`` allow programmatic dependent
    launch (compute capability 9.0 and later; the kernels wait for it there)."""
    return torch.cuda.get_device_capability(device) >= (9, 0)


def synchronize(device: int) -> None:
    """Wait for every stream's work on CUDA device ``device`` (an index), an SM
    partition's streams too."""
    torch.cuda.synchronize(device)
    partition.synchronize(device)


def current_stream(device: int) -> "torch.cuda.Stream":
    """torch's current stream on CUDA device ``device`` (an index), as
    ``torch.cuda.current_stream`` gives it, without its device guard: the
    engine asks for it several times per operation."""
    return _stream_object(*torch._C._cuda_getCurrentStream(device))


@functools.lru_cache(maxsize=64)
def _stream_object(stream_id: int, device_index: int, device_type: int) -> "torch.cuda.Stream":
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)


_CURRENT_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)

def _binding(name: str):
    """torch's CUDA binding ``name``, None where this build has none (a CPU build
    names some of them by a placeholder class)."""
    found = getattr(torch._C, name, None)
    return None if found is None or isinstance(found, type) else found


_GET_DEVICE = _binding("_cuda_getDevice")
_SYNC_DEBUG = _binding("_cuda_get_sync_debug_mode")
_CAPTURING = _binding("_cuda_isCurrentStreamCapturing")


def current_device() -> int:
    """``torch.cuda.current_device()`` without its initialisation check: for the
    engine's operations, which run on an initialised device (each launch asks)."""
    return _GET_DEVICE() if _GET_DEVICE is not None else torch.cuda.current_device()


def sync_debug_mode() -> int:
    """``torch.cuda.get_sync_debug_mode()`` (0 off, 1 warn, 2 error) without its
    initialisation check; 0 where this build has no CUDA."""
    return _SYNC_DEBUG() if _SYNC_DEBUG is not None else 0


def capturing() -> bool:
    """``torch.cuda.is_current_stream_capturing()``, one call (the engine asks at
    every operation)."""
    return _CAPTURING() if _CAPTURING is not None else torch.cuda.is_current_stream_capturing()


def raw_stream(device: int) -> int:
    """The handle of torch's current stream on CUDA device ``device`` (an index),
    as a launch from C++ takes it (``dispatch.host``)."""
    if _CURRENT_RAW_STREAM is not None:
        return _CURRENT_RAW_STREAM(device)
    return torch.cuda.current_stream(device).cuda_stream


_OPTIONS = ("-std=c++17",)  # NVRTC options (with the include path of csrc/)


@functools.lru_cache(maxsize=None)
def _module(source: str, names: tuple[str, ...]):
    cupy = _cupy()
    if cupy is None:
        raise RuntimeError("the NVLink engine needs CuPy: pip install 'moe-dispatch[cuda13]' (or [cuda12])")
    folder = csrc_dir()
    return cupy.RawModule(code=(folder / source).read_text(), options=(*_OPTIONS, f"-I{folder}"),
                          name_expressions=names)


def tuning() -> dict[str, int]:
    """The integer constants of ``engine::Tuning`` (``csrc/engine.cuh``) by name:
    the one table of the kernels' tuned values, which the host side reads here."""
    text = (csrc_dir() / "engine.cuh").read_text()
    start = text.index("struct Tuning {")
    table = text[start : text.index("};", start)]
    found = re.findall(r"static constexpr (?:int|unsigned) (k\w+) = (\d+)(?: \* (\d+))?;", table)
    return {name: int(a) * int(b or 1) for name, a, b in found}


_TUNING = tuning()
THREADS = _TUNING["kThreads"]  # threads of a block, every kernel
SCAN_TILES = _TUNING["kScanTiles"]  # tiles of 32 slots a warp of the routing layout's scan holds
SCAN_SHARED = _TUNING["kScanShared"]  # bytes of the scan's per-warp counts, at most
SUM_ROWS = _TUNING["kSumRows"]  # rows a lane of a pre-sum loads together where an item has more than 2
FLAG_WORDS = _TUNING["kFlagWords"]  # words of the engine's flags region per rank (engine.cuh's wait_peers)


@functools.lru_cache(maxsize=None)
def kernel(source: str, name: str, *template_args: str) -> Kernel:
    """The kernel ``name<template_args...>`` of ``csrc/source``, compiled on first use
    (one NVRTC compile per instantiation) and cached for the process."""
    declared = signature(source, name)
    if len(template_args) != declared.template:
        raise ValueError(f"{name}<{', '.join(template_args)}>: the kernel takes {declared.template} template "
                         "arguments")
    expression = f"{name}<{', '.join(template_args)}>" if template_args else name
    module = _module(source, (expression,))
    return Kernel(module.get_function(expression), THREADS, declared)


def c_type(dtype: torch.dtype) -> str:
    """The C type of ``dtype`` in the kernels."""
    try:
        return C_TYPES[dtype]
    except KeyError:
        raise TypeError(f"the NVLink engine does not move {dtype}") from None


def num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count
