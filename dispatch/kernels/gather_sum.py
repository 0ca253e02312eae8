"""Gathered, optionally weighted row sums with wide accumulation.

    out[r] = cast( sum_{j < J, index[r, j] >= 0} weight[index[r, j]] * src[index[r, j]] )

summed in j order in fp32 (fp64 when ``src``, ``weight`` or the result is fp64), then cast
once to ``out_dtype``; on CUDA each weighted term is one fused multiply-add (the
reference multiplies and adds: the two agree to rounding, not bitwise). Both reductions of combine are this operation: the
expert-side pre-sum (index = the expanded rows of one received token, weights =
routing weights) and the home-side sum of partials (index = the token's rows in
ascending rank order, no weights). There are no atomics, so the result is
deterministic and independent of the launch configuration.

``gather_sum`` picks the Triton kernel for CUDA tensors when Triton is
importable, and the PyTorch reference otherwise; tests hold the two together.
"""

from __future__ import annotations

import torch

from dispatch.kernels import plan_cpu

try:  # Triton is optional: CPU-only installs run the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def accumulate_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp64 if any input is fp64, else fp32."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _acc_dtype(src, weight, out_dtype, at_least) -> torch.dtype:
    extra = [d for d in (None if weight is None else weight.dtype, at_least) if d is not None]
    return accumulate_dtype(src.dtype, out_dtype, *extra)


def gather_sum_reference(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    out_dtype: torch.dtype,
    at_least: torch.dtype | None = None,
) -> torch.Tensor:
    """PyTorch reference of :func:`gather_sum`.

    Args:
        src: [M, H] rows to gather.
        index: [R, J] int64 rows of ``src`` to sum for each output row; -1 = none.
            The valid entries of a row come first.
        weight: [M] per-source-row weight, or None for a plain sum.
        out_dtype: dtype of the result.
        at_least: accumulate in fp64 if this is fp64 (so that both sums of one
            combine accumulate alike).
    Returns:
        [R, H] tensor of ``out_dtype``.
    """
    acc_dtype = _acc_dtype(src, weight, out_dtype, at_least)
    acc = torch.zeros(index.shape[0], src.shape[1], dtype=acc_dtype, device=src.device)
    if src.shape[0] == 0:  # then every index is -1
        return acc.to(out_dtype)
    for j in range(index.shape[1]):
        col = index[:, j]
        valid = col >= 0
        safe = col.clamp(min=0)
        rows = src.index_select(0, safe).to(acc_dtype)
        if weight is not None:
            rows = rows * weight.index_select(0, safe).to(acc_dtype).unsqueeze(1)
        acc += torch.where(valid.unsqueeze(1), rows, 0)
    return acc.to(out_dtype)


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(
        src_ptr,
        index_ptr,
        weight_ptr,
        out_ptr,
        hidden,
        width,
        src_stride,
        out_stride,
        HAS_WEIGHT: tl.constexpr,
        ACC_F64: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        if ACC_F64:
            acc = tl.zeros([BLOCK], dtype=tl.float64)
        else:
            acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in range(width):
            src_row = tl.load(index_ptr + row * width + j)
            if src_row >= 0:
                vals = tl.load(src_ptr + src_row * src_stride + cols, mask=mask, other=0.0)
                vals = vals.to(acc.dtype)
                if HAS_WEIGHT:  # one rounding per term (fused multiply-add), as the NVLink engine's kernels
                    acc = tl.fma(vals, tl.load(weight_ptr + src_row).to(acc.dtype), acc)
                else:
                    acc += vals
        if ACC_F64 and out_ptr.dtype.element_ty != tl.float64:
            acc = acc.to(tl.float32)  # fp64 -> fp32 -> narrow, as torch converts
        tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gather_sum_triton(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    out_dtype: torch.dtype,
    at_least: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton version of :func:`gather_sum_reference` (same arguments and result;
    ``out``: where to write it, [R, H] of ``out_dtype`` with rows of stride 1)."""
    if triton is None:
        raise RuntimeError("gather_sum_triton needs triton; install the 'test' extra or use the reference")
    src = src.contiguous()
    index = index.contiguous()
    rows, width = index.shape
    hidden = src.shape[1]
    if out is None:
        out = torch.empty(rows, hidden, dtype=out_dtype, device=src.device)
    if rows == 0 or hidden == 0:
        return out
    acc_dtype = _acc_dtype(src, weight, out_dtype, at_least)
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (rows, triton.cdiv(hidden, block))
    _gather_sum_kernel[grid](
        src,
        index,
        weight.contiguous() if weight is not None else src,
        out,
        hidden,
        width,
        src.stride(0),
        out.stride(0),
        HAS_WEIGHT=weight is not None,
        ACC_F64=acc_dtype == torch.float64,
        BLOCK=block,
        num_warps=4,
    )
    return out


def gather_sum(
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    out_dtype: torch.dtype,
    at_least: torch.dtype | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weighted gathered row sum; the Triton kernel on CUDA, the compiled one on
    CPU (``dispatch.kernels.plan_cpu``), the reference elsewhere. ``out``: None,
    or where to write it ([R, H] of ``out_dtype``, rows of stride 1: e.g. an
    exchange's send buffer); the result is returned either way."""
    if out is not None and (out.shape != (index.shape[0], src.shape[1]) or out.dtype != out_dtype
                            or (out.shape[1] > 1 and out.stride(1) != 1)):
        raise ValueError(f"out must be [{index.shape[0]}, {src.shape[1]}] {out_dtype} with rows of stride 1, "
                         f"got {list(out.shape)} {out.dtype} strides {out.stride()}")
    if src.is_cuda and triton is not None:
        return gather_sum_triton(src, index, weight, out_dtype, at_least, out)
    compiled = plan_cpu.on_cpu(src)
    if compiled is not None:  # (it accumulates in fp64 where an input, the result or at_least is fp64)
        result = compiled.gather_sum(src, index, weight, out_dtype, at_least == torch.float64)
    else:
        result = gather_sum_reference(src, index, weight, out_dtype, at_least)
    return result if out is None else out.copy_(result)


_SAME_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits_of(values: torch.Tensor) -> torch.Tensor:
    """``values`` seen as signed integers of the same width (no copy)."""
    return values.view(_SAME_WIDTH[values.element_size()])


def gather_owned(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out[r, k] = src[index[r, j], k] for the one j whose entry is not zero
    (0 where none is): ``gather_sum`` without weights where each column has at
    most one nonzero term, exact in the bits (a -0.0 stays -0.0, which a float
    sum from zero turns into +0.0). ``src``: [M, K]; ``index``: [R, J], -1 =
    none. The bit patterns are summed as integers: one nonzero term, no carry."""
    bits = bits_of(src.contiguous())
    padded = torch.cat([bits, bits.new_zeros(1, src.shape[1])])  # last row: the -1 entries' zeros
    picked = padded[torch.where(index >= 0, index, src.shape[0])]  # [R, J, K]
    return picked.sum(1, dtype=bits.dtype).view(src.dtype)


# -- the expert-side pre-sum, group by group ------------------------------------
#
# With the rows of an exchange delivered and computed by groups of local
# experts (contiguous ranges of the canonical order), the pre-sum of one
# received row runs over its slots in the same order as ``gather_sum``'s, but
# its terms arrive group after group: a running sum in the accumulation dtype
# (``acc``, one row per received row) carries the terms of the earlier groups,
# and the row is cast and written out for the way home once its last group is
# in. The same terms in the same order from the same zero: bitwise
# ``gather_sum``'s result, whatever the number of groups.


def accumulate_group_reference(
    acc: torch.Tensor,
    out: torch.Tensor,
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    lo: int,
    hi: int,
    place: torch.Tensor,
) -> None:
    """PyTorch reference of :func:`accumulate_group` (same arguments; ``acc``
    must start zeroed here). Every received row is computed, those without a
    slot in the group left as they were: no host read of which rows those are."""
    if index.shape[0] == 0:
        return
    total = acc.clone()
    for j in range(index.shape[1]):
        col = index[:, j]
        take = (col >= lo) & (col < hi)
        safe = torch.where(take, col - lo, 0)
        if src.shape[0] == 0:  # then no slot is in the group
            break
        terms = src.index_select(0, safe).to(acc.dtype)
        if weight is not None:
            terms = terms * weight.index_select(0, safe).to(acc.dtype).unsqueeze(1)
        total += torch.where(take.unsqueeze(1), terms, 0)
    touched = ((index >= lo) & (index < hi)).any(1)
    done = touched & ~(index >= hi).any(1)  # no slot in a later group: the sum is whole
    acc.copy_(torch.where((touched & ~done).unsqueeze(1), total, acc))
    whole = total
    if acc.dtype == torch.float64 and out.dtype != torch.float64:
        whole = whole.to(torch.float32)  # fp64 -> fp32 -> narrow, as gather_sum
    before = out.index_select(0, place)
    out.index_copy_(0, place, torch.where(done.unsqueeze(1), whole.to(out.dtype), before))


if triton is not None:

    @triton.jit
    def _accumulate_group_kernel(
        src_ptr,
        index_ptr,
        weight_ptr,
        expand_src_ptr,
        expand_col_ptr,
        place_ptr,
        acc_ptr,
        out_ptr,
        lo,
        hi,
        hidden,
        width,
        src_stride,
        acc_stride,
        out_stride,
        HAS_WEIGHT: tl.constexpr,
        ACC_F64: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # one program per (expanded row of the group, column block); the program
        # of the row's first slot in the group sums the row's slots in the group
        n = lo + tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < hidden
        row = tl.load(expand_src_ptr + n)
        k = tl.load(expand_col_ptr + n)
        before = tl.load(index_ptr + row * width + k - 1, mask=k > 0, other=-1)
        if before < lo:  # no earlier slot of this row in this group
            if ACC_F64:
                acc = tl.zeros([BLOCK], dtype=tl.float64)
            else:
                acc = tl.zeros([BLOCK], dtype=tl.float32)
            if k > 0:  # the earlier groups' terms
                acc = tl.load(acc_ptr + row * acc_stride + cols, mask=mask, other=0.0).to(acc.dtype)
            later = 0
            for j in range(width):
                slot = tl.load(index_ptr + row * width + j)
                if (slot >= lo) & (slot < hi):
                    vals = tl.load(src_ptr + (slot - lo) * src_stride + cols, mask=mask, other=0.0).to(acc.dtype)
                    if HAS_WEIGHT:  # one rounding per term, as gather_sum
                        acc = tl.fma(vals, tl.load(weight_ptr + slot - lo).to(acc.dtype), acc)
                    else:
                        acc += vals
                later = later | (slot >= hi).to(tl.int32)
            if later != 0:
                tl.store(acc_ptr + row * acc_stride + cols, acc, mask=mask)
            else:
                at = tl.load(place_ptr + row)
                if ACC_F64 and out_ptr.dtype.element_ty != tl.float64:  # fp64 -> fp32 -> narrow, as gather_sum
                    tl.store(out_ptr + at * out_stride + cols, acc.to(tl.float32).to(out_ptr.dtype.element_ty),
                             mask=mask)
                else:
                    tl.store(out_ptr + at * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def accumulate_group(
    acc: torch.Tensor,
    out: torch.Tensor,
    src: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor | None,
    lo: int,
    hi: int,
    place: torch.Tensor,
    expand_src: torch.Tensor | None = None,
    expand_col: torch.Tensor | None = None,
) -> None:
    """Add group [lo, hi)'s weighted rows into the running pre-sums, and write
    out the pre-sums that this group completes.

    Args:
        acc: [R, H] running sums (fp32, fp64 where ``gather_sum`` would sum in
            fp64), one per received row; the Triton path reads a row only where
            an earlier group added to it, the reference wants it zeroed.
        out: [R, H] the pre-sums going home, in their wire dtype; row
            ``place[r]`` is written once received row r's last slot is in.
        src: [hi - lo, H] the group's rows (expanded rows lo..hi-1).
        index: [R, J] int64 expanded rows of each received row, ascending, -1 padded.
        weight: [hi - lo] the weights of the group's rows, or None.
        lo, hi: the group's range of expanded rows.
        place: [R] int64, where each received row's pre-sum goes in ``out``.
        expand_src, expand_col: [N] int64, the received row of each expanded
            row and its column in ``index`` (the Triton path's grid).
    """
    if src.is_cuda and triton is not None and expand_src is not None:
        accumulate_group_triton(acc, out, src, index, weight, lo, hi, place, expand_src, expand_col)
    else:
        accumulate_group_reference(acc, out, src, index, weight, lo, hi, place)


def accumulate_group_triton(acc, out, src, index, weight, lo, hi, place, expand_src, expand_col) -> None:
    """Triton version of :func:`accumulate_group_reference` (the arguments of
    :func:`accumulate_group`; ``acc`` need not start zeroed)."""
    if triton is None:
        raise RuntimeError("accumulate_group_triton needs triton; install the 'test' extra or use the reference")
    hidden = src.shape[1]
    if hi == lo or hidden == 0:
        return
    src = src.contiguous()
    block = min(1024, triton.next_power_of_2(hidden))
    grid = (hi - lo, triton.cdiv(hidden, block))
    _accumulate_group_kernel[grid](
        src, index, src if weight is None else weight.contiguous(), expand_src, expand_col, place, acc, out,
        lo, hi, hidden, index.shape[1], src.stride(0), acc.stride(0), out.stride(0),
        HAS_WEIGHT=weight is not None, ACC_F64=acc.dtype == torch.float64, BLOCK=block, num_warps=4,
    )
