"""A rank's free device memory, as the budgets of its dispatches read it: how
many rows it holds (:func:`row_budgets`, carried in each dispatch's header and
checked on every rank by ``checks.check_row_budgets``), read cheaply
(:data:`FREE_MEMORY`) or exactly (:func:`free_bytes`)."""

from __future__ import annotations

import torch


def free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation on ``device`` can take: the device's free memory
    and what torch's caching allocator holds unused; None off CUDA (no budget)."""
    if device.type != "cuda":
        return None
    index = torch.cuda.current_device() if device.index is None else device.index
    free, _ = torch.cuda.mem_get_info(index)
    # one read of the allocator's statistics, left nested (memory_reserved and
    # memory_allocated would flatten them each, on every dispatch)
    stats = torch.cuda.memory_stats_as_nested_dict(index)
    reserved, allocated = (stats.get(name, {}).get("all", {}).get("current", 0)
                           for name in ("reserved_bytes", "allocated_bytes"))
    return free + reserved - allocated


def device_free_bytes(device: torch.device) -> int | None:
    """A lower bound of :func:`free_bytes`, cheaper to read: the device's free
    memory alone (what torch's caching allocator holds unused not counted), as
    :data:`FREE_MEMORY` reads it (a bound but for what was allocated outside
    torch's allocator in the last ``FREE_MEMORY_AGE`` seconds); None off CUDA."""
    if device.type != "cuda":
        return None
    return FREE_MEMORY(torch.cuda.current_device() if device.index is None else device.index)


def memory_rows(x: torch.Tensor, row_bytes, free_bytes) -> int:
    """Rows of a dispatch of ``x`` (``row_bytes(x)`` bytes each) that
    ``free_bytes(x.device)`` holds (-1: no budget)."""
    free = free_bytes(x.device)
    return -1 if free is None else min(free // row_bytes(x), 2**31 - 1)


def row_budgets(x: torch.Tensor, row_bytes, max_rows: int | None, groups: int) -> tuple[int, int]:
    """A dispatch of ``x``'s (max_rows, rows its free device memory holds), -1 for none:
    the budgets its header carries (``plan.header``), checked on every rank
    before any token moves (``checks.check_row_budgets``). The memory's is the
    device's free memory alone (a lower bound, cheap to read); with max_rows,
    the exact one where that bound falls short of the outputs' rows (this rank
    decides alone); without, every rank's exact one where some rank falls short
    of its bound (``Request.exact_memory_rows``)."""
    rows = memory_rows(x, row_bytes, device_free_bytes)
    if max_rows is None:
        return -1, rows
    if 0 <= rows < max_rows + groups:  # the outputs have G * ceil(max_rows / G) rows
        rows = memory_rows(x, row_bytes, free_bytes)
    return max_rows, rows


FREE_MEMORY_AGE = 0.1  # seconds a reading of the driver's free memory serves FreeMemory


class FreeMemory:
    """A device's free memory, as every dispatch's budget reads it.

    The driver's reading (``cudaMemGetInfo``: 10-20 us in a busy dispatch) is
    kept for ``FREE_MEMORY_AGE`` seconds, less what torch's caching allocator
    has reserved from the device since (or plus what it gave back): exact for
    every allocation made through torch in this process, and read again where
    the reading is older, or where this package allocated device memory
    outside torch's allocator (:meth:`forget`: the NVLink engine's and the
    NVSHMEM transport's symmetric buffers). The compiled host path keeps the
    reading (``compiled``: ``csrc/host.cpp``'s ``free_bytes``, which the
    engine's compiled dispatch reads too), given only where torch's own
    caching allocator serves (``dispatch.host``: not under
    ``PYTORCH_NO_CUDA_MEMORY_CACHING`` or another backend); without it, or for
    a device that is not the current one, the driver is read every time.
    """

    def __init__(self) -> None:
        self.compiled = None  # the compiled host path's module, keeping the reading

    def __call__(self, index: int) -> int:
        compiled = self.compiled
        if compiled is not None:
            free = compiled.free_bytes(index, FREE_MEMORY_AGE, compiled.reserved_bytes(index))
            if free != -2:  # (-2: not the current device)
                return free
        return torch.cuda.mem_get_info(index)[0]

    def forget(self) -> None:
        """Read the driver again next time (device memory was allocated outside torch's allocator)."""
        if self.compiled is not None:
            self.compiled.forget_free_bytes()


FREE_MEMORY = FreeMemory()
