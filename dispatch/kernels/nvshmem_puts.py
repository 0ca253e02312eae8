"""The NVSHMEM transport's kernels (``csrc/nvshmem_puts.cu``): rows put by the
sender straight to their places at the receivers, picked from its tokens by
index or taken in order (``put_rows``); and the exchange with the experts'
layout in one pass, each (token, rank) row over the link once: the rows to the
experts got from their sources and written to their expert-major places
(``get_expand``), the expert outputs of each received row summed and put home
(``presum_put``).

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
import threading

import torch

from dispatch import build
from dispatch.cuda import csrc_dir, parameter_block, signatures

_SOURCE, _KERNELS = "nvshmem_puts.cu", ("put_rows", "get_expand", "presum_put")
# blocks of a launch: put_rows's puts a fixed 264; the kernels that also read and write the experts' rows
# (a row a warp, bound by HBM more than by the link) 4 a multiprocessor
_BLOCKS, _BLOCKS_PER_SM = {"put_rows": 264}, 4
_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}  # the dtypes presum_put sums and sends
# ranks the kernel's table of starts holds, as its source states it
MAX_WORLD = int(re.search(r"kMaxWorld = (\d+);", (csrc_dir() / _SOURCE).read_text())[1])
_THREADS = int(re.search(r"kThreads = (\d+);", (csrc_dir() / _SOURCE).read_text())[1])  # a block's, as it states
MAX_WIDTH = 32  # places of a received row get_expand and presum_put take (one a lane of a warp)
enabled = True  # False: torch's all-to-all moves the rows (the same results)
# False: get_expand and presum_put reach every peer by NVSHMEM's get and put, as across hosts, even where
# NVSHMEM maps its memory here (the same results; how the tests run the cross-host path on one host)
mapped = True
# a block count for every launch of the kernels where set (None: theirs): a slower exchange, as over a slow link
# (the same results; how `dispatch-bench overlap --nvshmem-blocks` throttles them)
blocks = None
_loaded: dict = {}  # device index -> ({kernel: its CUfunction} or None, why not)


def why_not(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device`` (None where it can)."""
    return _load(device)[1]


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
    _int64(send_token=send_token, sends=sends, at=at)
    _launch("put_rows", x.device, stream, recv=recv.data_ptr(), recv_stride=recv_stride, x=x.data_ptr(),
            x_stride=x.stride(0) * x.element_size(), send_token=0 if send_token is None else send_token.data_ptr(),
            sends=sends.data_ptr(), at=at.data_ptr(), world=sends.numel(), row_bytes=x.shape[1] * x.element_size(),
            most=most)


EVERY = (0, 2**62)  # the span of places of a move in one piece


def get_expand(out: torch.Tensor, stage: torch.Tensor, recv: torch.Tensor, stride: int, row_bytes: int,
               places: torch.Tensor, receives: torch.Tensor, back_at: torch.Tensor, most: int,
               expand_src: torch.Tensor, zero_at: int, stream: "torch.cuda.Stream | None" = None,
               span: tuple[int, int] = EVERY) -> None:
    """The rows to the experts, expanded as they are got: for each row r this
    rank receives (``receives[s]`` from rank s, source-major; at most ``most``),
    row ``back_at[s] + r - first[s]`` of rank s's symmetric ``stage`` (its send
    rows in its send order, ``stride`` bytes apart; ``row_bytes`` each), written
    to rows ``places[r]`` (-1: none) of ``out`` [N, H] (contiguous, rows of
    ``row_bytes``); rows i of out with ``expand_src[i] == zero_at`` zeroed. A
    peer's rows are read where NVSHMEM maps them, else got into row r of the
    symmetric ``recv`` first. Between two NVSHMEM barriers: every rank's stage
    is written before it is called. ``span`` (lo, hi): one group of a move by
    groups, the rows whose first place is in it (to all their places) and the
    padding rows in it."""
    _int64(places=places, receives=receives, back_at=back_at, expand_src=expand_src)
    _at_most_max_width("places", places)
    _launch("get_expand", out.device, stream, out=out.data_ptr(), out_stride=row_bytes, stage=stage.data_ptr(),
            stage_stride=stride, recv=recv.data_ptr(), recv_stride=stride, places=places.data_ptr(),
            width=places.shape[1], receives=receives.data_ptr(), back_at=back_at.data_ptr(), world=receives.numel(),
            row_bytes=row_bytes, most=most, expand_src=expand_src.data_ptr(), num_rows=out.shape[0],
            zero_at=zero_at, mapped=int(mapped), lo=span[0], hi=span[1])


def presum_put(recv: torch.Tensor, send: torch.Tensor, stride: int, y: torch.Tensor, weights: torch.Tensor | None,
               places: torch.Tensor, receives: torch.Tensor, back_at: torch.Tensor, wire: torch.dtype, most: int,
               stream: "torch.cuda.Stream | None" = None, table: torch.Tensor | None = None,
               span: tuple[int, int] = EVERY) -> None:
    """Each received row's pre-sum put home: for row r this rank received in
    the dispatch (``receives[s]`` from rank s, source-major; at most ``most``),
    the sum of rows ``places[r]`` (-1: none) of ``y`` [N, H] (contiguous),
    each times ``weights`` of its row where given (fp32), in fp32, cast once to
    ``wire``: as :func:`dispatch.kernels.gather_sum.gather_sum`, bitwise; put
    at row ``back_at[s] + r - first[s]`` of rank s's symmetric ``recv`` (rows
    ``stride`` bytes apart); made in row r of the symmetric ``send`` first where
    NVSHMEM does not map rank s's memory here. Between two NVSHMEM barriers.
    By groups: ``table`` (:func:`group_table`) gives each group's rows (like
    ``y``, which only gives their dtype and width) and weights, and only the
    rows whose last place is in ``span`` go."""
    if not sums_here(y.dtype, None if weights is None else weights.dtype, wire):
        raise ValueError(f"presum_put sums {sorted(map(str, _CODES))} rows with fp32 weights or none, got "
                         f"{y.dtype} rows, weights {None if weights is None else weights.dtype}, wire {wire}")
    _int64(places=places, receives=receives, back_at=back_at)
    _at_most_max_width("places", places)
    _launch("presum_put", y.device, stream, recv=recv.data_ptr(), recv_stride=stride, send=send.data_ptr(),
            send_stride=stride, y=y.data_ptr(), y_stride=y.stride(0), y_code=_CODES[y.dtype],
            weights=0 if weights is None else weights.data_ptr(), places=places.data_ptr(), width=places.shape[1],
            receives=receives.data_ptr(), back_at=back_at.data_ptr(), world=receives.numel(), hidden=y.shape[1],
            out_code=_CODES[wire], most=most, mapped=int(mapped), table=0 if table is None else table.data_ptr(),
            groups=0 if table is None else (table.numel() - 2) // 3, lo=span[0], hi=span[1])


def group_table(bounds: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The table of a combine by G groups for :func:`presum_put`: [3 G + 2]
    int64 on ``device``, each group's rows and weights unset (:func:`store_group`),
    then the places each group starts at (``bounds``, G + 1), then whether the
    rows are weighted. Made by device work alone (a CUDA graph may hold it)."""
    groups = len(bounds) - 1
    table = torch.zeros(3 * groups + 2, dtype=torch.int64, device=device)
    for g, bound in enumerate(bounds):
        table[2 * groups + g].fill_(bound)
    return table


def store_group(table: torch.Tensor, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
    """Group g's rows (contiguous, like every group's) and weights (fp32, or
    None in every group alike) into ``table``, on the current stream (an empty
    group's addresses may be 0: whether the rows are weighted is its own entry)."""
    groups = (table.numel() - 2) // 3
    table[g].fill_(rows.data_ptr())
    table[groups + g].fill_(0 if weights is None else weights.data_ptr())
    table[3 * groups + 1].fill_(int(weights is not None))


def sums_here(dtype: torch.dtype, weights: torch.dtype | None, wire: torch.dtype) -> bool:
    """Whether :func:`presum_put` sums rows of ``dtype`` with weights of that
    dtype (None: none) onto ``wire`` (sums that accumulate in fp32)."""
    return dtype in _CODES and wire in _CODES and weights in (None, torch.float32)


def _int64(**tables) -> None:
    for name, tensor in tables.items():
        if tensor is not None and (tensor.dtype != torch.int64 or not tensor.is_contiguous()):
            raise ValueError(f"{name}: the NVSHMEM kernels read it as contiguous int64, got {tensor.dtype} "
                             f"of strides {tensor.stride()}")


def _at_most_max_width(name: str, table: torch.Tensor) -> None:
    if table.shape[1] > MAX_WIDTH:
        raise ValueError(f"{name}: at most {MAX_WIDTH} entries a row (one a lane of a warp), got {table.shape[1]}")


def _launch(kernel: str, device: torch.device, stream, **values) -> None:
    """Launch ``kernel`` with its arguments by name (each in the C type the
    source declares; pointers as addresses), between two NVSHMEM barriers."""
    functions, why = _load(device)
    if functions is None:
        raise RuntimeError(f"the NVSHMEM kernels cannot run here: {why}")
    names, packer, block, params = _parameters(kernel)
    packer.pack_into(block, 0, *[values[name] for name in names])  # the driver copies it at the launch
    stream = ctypes.c_void_p((stream if stream is not None else torch.cuda.current_stream(device)).cuda_stream)
    host = _host()
    host.nvshmemx_barrier_all_on_stream(stream)  # no receiver still reads its buffer; every stage written
    grid = blocks or _BLOCKS.get(kernel) or _BLOCKS_PER_SM * _multiprocessors(device)
    status = _driver().cuLaunchKernel(functions[kernel], grid, 1, 1, _THREADS, 1, 1, 0, stream, params, None)
    # every row landed; no peer reads a stage any more (queued also where the launch failed: the peers wait for it)
    host.nvshmemx_barrier_all_on_stream(stream)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernel of {kernel} failed: CUDA error {status}")


_THREAD = threading.local()  # each thread's parameter blocks (a launch writes its own, then the driver copies it)


def _parameters(kernel: str) -> tuple:
    """(parameter names, their packer, the block they are packed into, the
    launch's array of their addresses) of ``kernel``, made once a thread: each
    parameter at the place C lays it out, in the C type the source declares."""
    made = getattr(_THREAD, "blocks", None)
    if made is None:
        made = _THREAD.blocks = {}
    if kernel not in made:
        signature = signatures()[(_SOURCE, kernel)]
        packer, offsets = parameter_block(signature.codes)
        block = ctypes.create_string_buffer(max(packer.size, 1))
        base = ctypes.addressof(block)
        params = (ctypes.c_void_p * len(offsets))(*[base + offset for offset in offsets])
        made[kernel] = (signature.names, packer, block, params)
    return made[kernel]


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
    stat = os.stat(library)  # a new wheel's device library: built anew
    digest = hashlib.sha256(source.read_bytes() + (csrc_dir() / "engine.cuh").read_bytes()
                            + f"{stat.st_size} {stat.st_mtime_ns}".encode()).hexdigest()[:12]
    name = f"dispatch_nvshmem_puts_{digest}_sm{major}{minor}"
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
    module, functions = ctypes.c_void_p(), {}
    with torch.cuda.device(index):
        torch.cuda.init()
        if driver.cuModuleLoad(ctypes.byref(module), cubin.encode()) != 0:
            return None, f"cuModuleLoad of {cubin} failed"
        status = _host().nvshmemx_cumodule_init(module)
        if status != 0:
            return None, f"nvshmemx_cumodule_init failed ({status})"
        for kernel in _KERNELS:
            functions[kernel] = ctypes.c_void_p()
            if driver.cuModuleGetFunction(ctypes.byref(functions[kernel]), module, kernel.encode()) != 0:
                return None, f"no {kernel} in {cubin}"
    return functions, None


@functools.lru_cache(maxsize=16)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=1)
def _driver():
    return ctypes.CDLL("libcuda.so.1")


@functools.lru_cache(maxsize=1)
def _host():
    return ctypes.CDLL("libnvshmem_host.so.3")  # the NVSHMEM instance torch loaded (by its soname)
