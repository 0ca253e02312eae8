"""Gradients of weighted expert rows, in one pass.

The combine weighs each expert row before it sums: out[t] += w[r] * y[r]. Its
backward, from the gradient of each weighted row g[r] (the output gradient
dispatched back to the experts), is

    grad_y[r] = cast(g[r] * w[r])              (the experts' output gradient, y's dtype)
    grad_w[r] = cast(sum_h g[r, h] * y[r, h])  (the routing weight's, w's dtype)

computed in fp32 (fp64 when any input is fp64). The reference (PyTorch) widens
whole [N, H] tensors to fp32 and multiplies and reduces them in separate
kernels; the Triton kernel reads each row once and writes grad_y once (what
that saves: bench/results/README.md). grad_y is bitwise the reference's (one
product, one rounding);
grad_w sums in its own fixed order (per row, blocks of columns in order, then
one reduction of the block), deterministic and independent of N, and agrees
with the reference to fp32 rounding. fp64 inputs take the reference.
"""

from __future__ import annotations

import torch

from dispatch.kernels.gather_sum import accumulate_dtype

try:  # Triton is optional: CPU-only installs run the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

_BLOCK = 1024  # columns a program handles per step (a row's columns in steps, in order)


def weighted_row_grads_reference(grad_rows: torch.Tensor, weights: torch.Tensor, y: torch.Tensor,
                                 want_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(grad_y [N, H] in y's dtype, grad_w [N] in weights' dtype or None).

    Args:
        grad_rows: [N, H] gradient of the weighted rows.
        weights: [N] the rows' routing weights.
        y: [N, H] the experts' output rows (read only with ``want_weights``).
        want_weights: compute grad_w.
    """
    acc = accumulate_dtype(grad_rows.dtype, weights.dtype)
    wide = grad_rows.to(acc)
    grad_y = (wide * weights.to(acc).unsqueeze(1)).to(y.dtype)
    grad_w = (wide * y.detach().to(acc)).sum(1).to(weights.dtype) if want_weights else None
    return grad_y, grad_w


if triton is not None:

    @triton.jit
    def _row_grads_kernel(g_ptr, w_ptr, y_ptr, gy_ptr, gw_ptr, width, g_stride, y_stride, gy_stride,
                          WANT_W: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        w = tl.load(w_ptr + row).to(tl.float32)
        dot = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            mask = cols < width
            g = tl.load(g_ptr + row * g_stride + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(gy_ptr + row * gy_stride + cols, (g * w).to(gy_ptr.dtype.element_ty), mask=mask)
            if WANT_W:
                y = tl.load(y_ptr + row * y_stride + cols, mask=mask, other=0.0).to(tl.float32)
                dot += g * y
        if WANT_W:
            tl.store(gw_ptr + row, tl.sum(dot, axis=0).to(gw_ptr.dtype.element_ty))


def weighted_row_grads_triton(grad_rows: torch.Tensor, weights: torch.Tensor, y: torch.Tensor,
                              want_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton version of :func:`weighted_row_grads_reference` (no fp64; rows with unit column stride)."""
    if triton is None:
        raise RuntimeError("weighted_row_grads_triton needs triton; use the reference")
    if torch.float64 in (grad_rows.dtype, weights.dtype, y.dtype):
        raise ValueError("weighted_row_grads_triton: fp64 takes the reference")
    grad_rows, y, weights = grad_rows.contiguous(), y.detach().contiguous(), weights.contiguous()
    rows, width = grad_rows.shape
    grad_y = torch.empty(rows, width, dtype=y.dtype, device=y.device)
    grad_w = torch.empty(rows, dtype=weights.dtype, device=y.device) if want_weights else None
    if rows and width:
        _row_grads_kernel[(rows,)](grad_rows, weights, y, grad_y, grad_w if want_weights else grad_y, width,
                                   grad_rows.stride(0), y.stride(0), grad_y.stride(0), WANT_W=want_weights,
                                   BLOCK=min(_BLOCK, triton.next_power_of_2(width)), num_warps=4)
    elif want_weights:
        grad_w.zero_()
    return grad_y, grad_w


def weighted_row_grads(grad_rows: torch.Tensor, weights: torch.Tensor, y: torch.Tensor,
                       want_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """See the module: the Triton kernel for CUDA rows without fp64, the reference elsewhere."""
    fp64 = torch.float64 in (grad_rows.dtype, weights.dtype, y.dtype)
    if grad_rows.is_cuda and triton is not None and not fp64:
        return weighted_row_grads_triton(grad_rows, weights, y, want_weights)
    return weighted_row_grads_reference(grad_rows, weights, y, want_weights)
