"""The NVSHMEM transport's put kernel (``csrc/nvshmem_puts.cu``): rows put by the
sender straight to their places at the receivers, picked from its tokens by
index or taken in order.

Built at first use with NVSHMEM's device library (``nvcc -rdc``, then ``nvlink``
with ``libnvshmem_device.a`` of the ``nvidia-nvshmem`` wheel torch installs) into
a cubin kept in torch's extensions folder (one per source digest), loaded
through the driver, and initialised in the NVSHMEM instance torch's symmetric
memory started (``nvshmemx_cumodule_init`` of torch's ``libnvshmem_host.so.3``).
Where any of that is missing, :func:`why_not` says why and the transport moves
its rows by torch's all-to-all instead (the same results).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess

import torch

from dispatch import build
from dispatch.cuda import csrc_dir, signatures

_SOURCE, _KERNEL, _BLOCKS, _THREADS = "nvshmem_puts.cu", "put_rows", 264, 256
# ranks the kernel's table of starts holds, as its source states it
MAX_WORLD = int(re.search(r"kMaxWorld = (\d+);", (csrc_dir() / _SOURCE).read_text())[1])
enabled = True  # False: torch's all-to-all moves the rows (the same results)
_C_TYPES = {"i": ctypes.c_int, "I": ctypes.c_uint, "q": ctypes.c_longlong, "Q": ctypes.c_uint64}
_loaded: dict = {}  # device index -> (the kernel's CUfunction, or None; why not)


def why_not(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None where it can)."""
    return _load(device)[1]


def usable(device: torch.device) -> bool:
    """Whether the kernel moves rows on ``device`` (a CUDA device where it builds and loads)."""
    return enabled and built(device)


def built(device: torch.device) -> bool:
    """Whether the kernel builds and loads on ``device`` (a CUDA device), ``enabled`` or not."""
    return device.type == "cuda" and _load(device)[0] is not None


def put_rows(recv: torch.Tensor, recv_stride: int, x: torch.Tensor, send_token: torch.Tensor | None,
             sends: torch.Tensor, at: torch.Tensor, most: int, stream: "torch.cuda.Stream | None" = None) -> None:
    """Put row ``send_token[i]`` of ``x`` (rows contiguous, [T, H]; row i where
    ``send_token`` is None) for every send row i, ``sends[d]`` of them to rank d
    in order, at row ``at[d] + i - first[d]`` (rows of ``recv_stride`` bytes) of
    rank d's symmetric ``recv``; at most ``most`` rows. On ``stream`` (None: the
    current one), between two NVSHMEM barriers of every process."""
    for name, tensor in (("send_token", send_token), ("sends", sends), ("at", at)):
        if tensor is not None and (tensor.dtype != torch.int64 or not tensor.is_contiguous()):
            raise ValueError(f"{name}: the put kernel reads it as contiguous int64, got {tensor.dtype} "
                             f"of strides {tensor.stride()}")
    function, why = _load(x.device)
    if function is None:
        raise RuntimeError(f"the NVSHMEM put kernel cannot run here: {why}")
    signature = signatures()[(_SOURCE, _KERNEL)]
    values = dict(recv=recv.data_ptr(), recv_stride=recv_stride, x=x.data_ptr(),
                  x_stride=x.stride(0) * x.element_size(),
                  send_token=0 if send_token is None else send_token.data_ptr(),
                  sends=sends.data_ptr(), at=at.data_ptr(), world=sends.numel(),
                  row_bytes=x.shape[1] * x.element_size(), most=most)
    # each argument by its name, in the C type the source declares (pointers as addresses)
    holders = [_C_TYPES[code](values[name]) for name, code in zip(signature.names, signature.codes)]
    params = (ctypes.c_void_p * len(holders))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in holders])
    stream = ctypes.c_void_p((stream if stream is not None else torch.cuda.current_stream(x.device)).cuda_stream)
    host = _host()
    host.nvshmemx_barrier_all_on_stream(stream)  # no receiver still reads its buffer
    status = _driver().cuLaunchKernel(function, _BLOCKS, 1, 1, _THREADS, 1, 1, 0, stream, params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernel of put_rows failed: CUDA error {status}")
    host.nvshmemx_barrier_all_on_stream(stream)  # every row landed


def _load(device: torch.device) -> tuple:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _loaded:
        _loaded[index] = _build_and_load(index)
    return _loaded[index]


def _build_and_load(index: int) -> tuple:
    try:
        from importlib.util import find_spec

        spec = find_spec("nvidia.nvshmem")
    except ImportError:
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, "no nvidia-nvshmem wheel (its device library and headers)"
    root = list(spec.submodule_search_locations)[0]
    library = os.path.join(root, "lib", "libnvshmem_device.a")
    tools = [shutil.which(t) for t in ("nvcc", "nvlink")]
    if not os.path.isfile(library) or None in tools:
        return None, "needs nvcc, nvlink and the wheel's libnvshmem_device.a"
    source = csrc_dir() / _SOURCE
    major, minor = torch.cuda.get_device_capability(index)
    name = f"dispatch_nvshmem_puts_{hashlib.sha256(source.read_bytes()).hexdigest()[:12]}_sm{major}{minor}"
    from torch.utils import cpp_extension

    folder = build.build_folder(cpp_extension.get_default_build_root(), name)
    cubin = os.path.join(folder, f"{name}.cubin")
    if not os.path.isfile(cubin):
        # each process builds its own files, then renames (ranks of one machine may build at once)
        arch, obj, part = f"-arch=sm_{major}{minor}", os.path.join(folder, f"puts-{os.getpid()}.o"), \
            f"{cubin}.{os.getpid()}.part"
        try:
            subprocess.run([tools[0], arch, "-rdc=true", "--cubin", "-I", os.path.join(root, "include"),
                            str(source), "-o", obj], check=True, capture_output=True)
            subprocess.run([tools[1], arch, obj, library, "-o", part], check=True, capture_output=True)
        except subprocess.CalledProcessError as error:
            return None, f"the build failed: {error.stderr.decode(errors='replace').strip()[-300:]}"
        os.replace(part, cubin)
    driver = _driver()
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    with torch.cuda.device(index):
        torch.cuda.init()
        if driver.cuModuleLoad(ctypes.byref(module), cubin.encode()) != 0:
            return None, f"cuModuleLoad of {cubin} failed"
        status = _host().nvshmemx_cumodule_init(module)
        if status != 0:
            return None, f"nvshmemx_cumodule_init failed ({status})"
        if driver.cuModuleGetFunction(ctypes.byref(function), module, _KERNEL.encode()) != 0:
            return None, f"no {_KERNEL} in {cubin}"
    return function, None


@functools.lru_cache(maxsize=1)
def _driver():
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=1)
def _host():
    return ctypes.CDLL("libnvshmem_host.so.3")  # the NVSHMEM instance torch loaded (by its soname)
