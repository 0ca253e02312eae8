"""Rows from a device-held index on zeroed: ``rows[first:] = 0`` where ``first``
lives on the device, so that nothing is read on the host (the rows past the N
that a dispatch with ``max_rows`` received, whose N only the device knows).

The kernel writes only the rows it zeroes (one program per block of rows, each
reading ``first`` itself); the reference reads ``first`` on the host.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs run the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

_ROWS = 16  # rows per program


if triton is not None:

    @triton.jit
    def _zero_rows_kernel(rows_ptr, first_ptr, num_rows, width, stride, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        first = tl.load(first_ptr).to(tl.int64)
        live = (row >= first) & (row < num_rows)
        mask = live[:, None] & (cols[None, :] < width)
        zeros = tl.zeros((ROWS, BLOCK), dtype=rows_ptr.dtype.element_ty)
        tl.store(rows_ptr + row[:, None] * stride + cols[None, :], zeros, mask=mask)


def zero_rows_reference(rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``rows[first:] = 0`` (``first``: one integer, read on the host); returns ``rows``."""
    rows[int(first.reshape(-1)[0]) :] = 0  # host sync: the reference's index
    return rows


def zero_rows_triton(rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`zero_rows_reference` (rows with unit column stride); no host read."""
    if triton is None:
        raise RuntimeError("zero_rows_triton needs triton; install the 'test' extra or use the reference")
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError("rows must be 2-D with unit column stride")
    num_rows, width = rows.shape
    if num_rows and width:
        block = min(1024, triton.next_power_of_2(width))
        grid = (triton.cdiv(num_rows, _ROWS), triton.cdiv(width, block))
        _zero_rows_kernel[grid](rows, first.reshape(-1), num_rows, width, rows.stride(0), ROWS=_ROWS, BLOCK=block,
                                num_warps=4)
    return rows


def zero_rows(rows: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """``rows[first:] = 0`` in place; the Triton kernel on CUDA (no host read), the reference elsewhere."""
    if rows.is_cuda and triton is not None:
        return zero_rows_triton(rows, first)
    return zero_rows_reference(rows, first)
