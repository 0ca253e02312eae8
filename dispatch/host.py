"""The engine's compiled host path (``csrc/host.cpp``), built at first use.

It issues the engine's per-call host work from C++: each launch of a kernel
keeps its parameter block packed (``dispatch.cuda.Launch``) and writes only its
free values; a dispatch's counts exchange with its host read, its pull, and a
combine's push and home sum are one call each (``dispatch.nvlink``,
``dispatch.nvlink_moves``). The kernels and their arguments are the same as
from Python, so the results are the same bits; only the host time differs.

It is built once per machine by ``torch.utils.cpp_extension`` (a C++ compiler,
ninja and CUDA's ``cuda.h``; about half a minute, then cached in torch's
extensions folder). Where it cannot be built the engine issues its host work
from Python, and says so once.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import warnings

import torch

from dispatch import checks, cuda, plan
from dispatch.nvlink_layout import SENDS_COL, STAGED_COL, TOKENS_COL, Counts, HostCounts, Planned

# the free values of the routing layout's and the counts exchange's launches, in the order
# csrc/host.cpp's counts_plan passes them
LAYOUT_FREE = ("topk_idx", "weights", "route", "counts", "sends", "lists", "scan_state", "scan_sums", "hit", "bad",
               "stage_src", "src_stride")
COUNTS_FREE = ("row", *plan.HEADER, "out", "tokens_per_expert", "src_start", "num_rows", "group_end")
# and of the pull's, the push's and the home sum's, in the order pull and to_home pass them
PULL_FREE = ("matrix", "tokens_at", "presum", "tstride", "src_start", "num_rows", "out", "max_rows", "slot_k",
             "out_weights", "out_src_rank", "out_src_token", "row_lo", "row_hi", "tail_to")
PUSH_FREE = ("y", "weights", "y_parts", "w_parts", "bounds", "parts", "row_lo", "row_hi", "matrix", "tokens_at",
             "presum", "tstride", "signal")
HOME_FREE = ("hit", "tokens", "out")


def built():
    """The compiled module, or None where it cannot be built here (no C++
    compiler, ninja or ``cuda.h``: :func:`why_not` says which)."""
    return _build()[0]


def why_not() -> str | None:
    """Why :func:`built` is None (None where it built)."""
    return _build()[1]


@functools.lru_cache(maxsize=1)
def _build() -> tuple:
    """(the compiled module or None, why not or None), once a process."""
    from torch.utils import cpp_extension

    include = _cuda_include(cpp_extension.CUDA_HOME)
    if include is None:
        return None, "CUDA's cuda.h was not found (set CUDA_HOME)"
    folder = _build_folder(cpp_extension.get_default_build_root())
    try:
        return cpp_extension.load("dispatch_host", [str(cuda.csrc_dir() / "host.cpp")], extra_include_paths=[include],
                                  extra_cflags=["-O2"], build_directory=folder, verbose=False), None
    except Exception as error:  # no compiler or ninja: the host side runs in Python
        return None, f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"


STALE_LOCK = 600  # seconds after which a build's lock is taken for one left by a build that died


def _build_folder(default_root: str) -> str:
    """Where the module is built and kept: one folder per Python and torch (under
    $TORCH_EXTENSIONS_DIR, else torch's default), made if need be. A lock left
    there by a build that died (killed mid-build) would make every later build
    wait for ever: one older than ``STALE_LOCK`` seconds is removed (a build
    takes under a minute)."""
    version = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}"
    folder = os.path.join(os.environ.get("TORCH_EXTENSIONS_DIR") or default_root, f"dispatch_host-{version}")
    os.makedirs(folder, exist_ok=True)
    lock = os.path.join(folder, "lock")
    try:
        if time.time() - os.path.getmtime(lock) > STALE_LOCK:
            os.remove(lock)
    except OSError:  # no lock (the usual case), or another process removed it first
        pass
    return folder


def _cuda_include(cuda_home: str | None) -> str | None:
    """The folder of CUDA's ``cuda.h`` (torch's CUDA_HOME, else $CUDA_HOME or
    /usr/local/cuda: the header alone is needed, so a build of torch without
    CUDA finds it too), or None."""
    for home in (cuda_home, os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and os.path.isfile(os.path.join(home, "include", "cuda.h")):
            return os.path.join(home, "include")
    return None


def module():
    """:func:`built` where the engine's kernels run (a CUDA device), else None.
    An engine, and a launch, take it (or None) once, when made."""
    return _here() if enabled else None


@functools.lru_cache(maxsize=1)
def _here():
    if not torch.cuda.is_available():
        return None
    compiled = built()
    if compiled is None:  # said once: the engine runs, its host side slower
        warnings.warn(f"the NVLink engine's compiled host path (csrc/host.cpp) did not build ({why_not()}); its "
                      "host side runs in Python, the same results, more host time a call (pip install ninja and a "
                      "C++ compiler to build it)", stacklevel=2)
    return compiled


enabled = True  # False: engines and launches made from then on issue from Python (the same bits)


def counts_launchers(engine, tokens: int, topk: int, layout, counts, sizes) -> tuple | None:
    """(shape, layout launcher, counts launcher) of ``counts_plan`` for an engine's
    dispatch of T = ``tokens`` and K = ``topk`` (``layout``, ``counts``: its bound
    launches, ``Engine._counts_launches``; their free values in the order
    ``counts_plan`` passes them), or None where the engine has no compiled path."""
    compiled = engine._host
    if compiled is None:
        return None
    device = engine.device.index
    layout_c = None if layout is None else layout.launch.compiled(device, LAYOUT_FREE)
    counts_c = counts.launch.compiled(device, COUNTS_FREE)
    if counts_c is None or (layout is not None and layout_c is None):
        return None
    column = plan.HEADER.index
    shape = compiled.CountsShape(
        tokens=tokens, topk=topk, world=engine.world, rank=engine.rank, row_len=engine.row_len,
        counts_col=engine.counts_col, experts_per_rank=engine.experts_per_rank, tokens_col=TOKENS_COL,
        staged_col=STAGED_COL, sends_col=SENDS_COL, header_len=len(plan.HEADER), failed_col=column("failed"),
        sizes=list(sizes), layout_blocks=0 if layout is None else layout.blocks,
        layout_shared=0 if layout is None else layout.shared, counts_shared=counts.shared,
        agreed=checks.AGREED, x_grad_col=column("x_grad"), weights_grad_col=column("weights_grad"),
        max_rows_col=column("max_rows"), memory_rows_col=column("memory_rows"))
    return shape, layout_c, counts_c


def exchange_counts(engine, compiled, topk_idx, weights, header, rows, codec, check_values: bool, fits: bool,
                    words: int, planned: tuple) -> Counts:
    """``Engine._exchange_counts`` with its host read, compiled (``counts_plan``,
    with ``compiled`` from :func:`counts_launchers`): the same launches, the same
    Counts; and where the usual case holds, the handle's tensors (``Counts.planned``)."""
    shape, layout, counts = compiled
    wire = codec.pack(rows) if fits and topk_idx.shape[0] else None
    said_sync()
    # host sync: the counts matrix read back, in counts_plan
    got = engine._host.counts_plan(
        shape, layout, counts, topk_idx, weights, 0 if wire is None else wire.data_ptr(),
        0 if wire is None else wire.stride(0) * wire.element_size(), engine._zeroed(words).data_ptr(), check_values,
        header, cuda._raw_stream(engine.device.index), engine._host_words, *planned)
    if len(got) == 3:  # the status words: a failure the kernels recorded
        engine._raise(*got)
    route, lists, hit, matrix, src_start, num_rows, per_expert, tokens_at, headers, sends, rows_of, mine, bound, \
        received, staged, planned_out = got
    return Counts(matrix, HostCounts(headers, sends, rows_of, mine), received, bound, per_expert,
                  src_start, num_rows, route, lists, tokens_at, hit, staged, None,
                  None if planned_out is None else Planned(*planned_out))


_SYNC_DEBUG = cuda._binding("_cuda_get_sync_debug_mode")


def said_sync() -> None:
    """What ``torch.cuda.set_sync_debug_mode`` asks of a synchronising operation,
    for the compiled host read (which synchronises through the driver, where
    torch does not see it): a warning ("warn"), an error ("error"), or nothing."""
    mode = _SYNC_DEBUG() if _SYNC_DEBUG is not None else 0
    if mode:
        what = "called a synchronizing CUDA operation (the NVLink engine's host read of a dispatch's counts)"
        if mode == 2:
            raise RuntimeError(what)
        warnings.warn(what, stacklevel=3)
