"""The engine's compiled host path (``csrc/host.cpp``), built at first use.

It issues the engine's per-call host work from C++: each launch of a kernel
keeps its parameter block packed (``dispatch.cuda.Launch``) and writes only its
free values; a dispatch's counts exchange with its host read (and, where the
dispatch moves at once, its pull), its pull otherwise, and a combine's push and
home sum are one call each (``dispatch.nvlink``, ``dispatch.nvlink_moves``). The
kernels and their arguments are the same as from Python, so the results are the
same bits; only the host time differs. It also reads torch's caching allocator
for the memory budgets of ``dispatch.free_memory`` (``FreeMemory``), where the engine runs,
and it holds the board's agreement (``dispatch.board``).

It is built once per machine and source (``dispatch.build``: a C++ compiler,
ninja and CUDA's ``cuda.h``; about half a minute, then cached). Where it cannot
be built the engine issues its host work from Python, and says so once.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from dispatch import build, checks, cuda, free_memory, plan
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
    return build.load("host.cpp", "dispatch_host", (include,))


def _caching_allocator() -> bool:
    """Whether torch's own CUDA caching allocator serves this process (its reserved
    bytes then count every allocation made through torch): not with caching off
    (``PYTORCH_NO_CUDA_MEMORY_CACHING``) or another backend (``cudaMallocAsync``)."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"):
        return False
    try:
        return torch.cuda.get_allocator_backend() == "native"
    except (AttributeError, RuntimeError):  # a torch without CUDA, or older
        return False


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
    if compiled is not None and _caching_allocator():  # the engine's budgets read the allocator's bytes
        free_memory.FREE_MEMORY.compiled = compiled
    if compiled is None:  # said once: the engine runs, its host side slower
        warnings.warn(f"the NVLink engine's compiled host path (csrc/host.cpp) did not build ({why_not()}); its "
                      "host side runs in Python, the same results, more host time a call (pip install ninja and a "
                      "C++ compiler to build it)", stacklevel=2)
    return compiled


enabled = True  # False: engines and launches made from then on issue from Python (the same bits)


def counts_launchers(compiled, engine, tokens: int, topk: int, layout, counts, sizes) -> tuple | None:
    """(shape, layout launcher, counts launcher) of ``counts_plan`` for a dispatch
    of T = ``tokens`` and K = ``topk`` on ``engine`` (its world, rank and columns;
    ``layout``, ``counts``: its bound launches of that shape, their free values
    in the order ``counts_plan`` passes them), from ``compiled`` (the module);
    None where those launches issue from Python."""
    device = engine.device.index
    layout_c = None if layout is None else layout.launch.compiled(device, LAYOUT_FREE)
    counts_c = counts.launch.compiled(device, COUNTS_FREE)
    if counts_c is None or (layout is not None and layout_c is None):  # launches made with the path off
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


def exchange_counts(compiled, launchers: tuple, at, topk_idx, weights, header, rows, wire, row_at: int,
                    check_values: bool, stream: int, host_words: torch.Tensor, planned: tuple,
                    pull: tuple | None = None, record: int = 0) -> "Counts | tuple[int, int, int]":
    """A dispatch's counts exchange with its host read, compiled (``counts_plan``
    of ``compiled``, with ``launchers`` from :func:`counts_launchers`, ``at``
    the ``WordsAt`` of the dispatch's words): ``rows``
    the dispatch's [T, H] rows, ``wire`` those staged beside the layout (None:
    none), ``row_at`` the address of the layout's zeroed words, ``host_words``
    the pinned words the matrix is read into, ``planned`` (J, the places'
    weights' dtype; J = 0: no handle tensors), ``pull`` (the compiled launcher
    of the dispatch's own pull, its grid's cap, floor and rows a block) to pull
    the rows in the usual case where every rank staged them (``Planned.tokens``),
    or None; ``record``: the engine's eager event, which the call records on
    ``stream`` as it returns or raises (``dispatch.nvlink_order``), or 0.
    Returns the Counts (with ``Counts.planned`` where the usual case holds), or
    the status words (code, peer, where) of a failure the kernels recorded."""
    shape, layout, counts = launchers
    puller, cap, least, per_block = pull or (None, 0, 0, 1)
    said_sync()
    # host sync: the counts matrix read back, in counts_plan
    got = compiled.counts_plan(
        shape, layout, counts, topk_idx, weights, 0 if wire is None else wire.data_ptr(),
        0 if wire is None else wire.stride(0) * wire.element_size(), row_at, check_values, header, stream, host_words,
        *planned, puller, rows, cap, least, per_block, record)
    if len(got) == 3:
        return got
    words, per_expert, tokens_at, headers, sends, rows_of, mine, bound, received, staged, planned_out = got
    return Counts(words, at, HostCounts(headers, sends, rows_of, mine), received, bound, per_expert, tokens_at,
                  staged, None, None if planned_out is None else Planned(*planned_out))


def said_sync() -> None:
    """What ``torch.cuda.set_sync_debug_mode`` asks of a synchronising operation,
    for the compiled host read (which synchronises through the driver, where
    torch does not see it): a warning ("warn"), an error ("error"), or nothing."""
    mode = cuda.sync_debug_mode()
    if mode:
        what = "called a synchronizing CUDA operation (the NVLink engine's host read of a dispatch's counts)"
        if mode == 2:
            raise RuntimeError(what)
        warnings.warn(what, stacklevel=3)
