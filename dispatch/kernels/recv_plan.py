"""The receiver's expansion plan in one kernel.

Same result as ``dispatch.plan.build_recv_plan_reference``: each received row
(a program handles ``BLOCK_R`` of them) finds its arrival block (source rank,
group) in the host-made table by binary search, and writes its slot list,
source token and rank at its held place, and for each valid slot its held row,
its weight and its source token and rank at the slot's expanded position. Every output element is written
by exactly one row, so nothing is atomic and the result does not depend on the
launch. On the deepseek-v3 shape
this replaces some thirty small operations, whose launches and framework
overhead were the cost, by one launch.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs run the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

BLOCK_R = 64


if triton is not None:

    @triton.jit
    def _recv_plan_kernel(
        meta_ptr,
        table_ptr,
        expand_src_ptr,
        weight_words_ptr,
        presum_ptr,
        src_token_ptr,
        src_rank_ptr,
        expanded_token_ptr,
        expanded_rank_ptr,
        num_recv,
        num_blocks,
        meta_stride,
        WIDTH: tl.constexpr,
        WORDS: tl.constexpr,
        STEPS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = rows < num_recv
        # the last block starting at or before the row (block 0 starts at 0):
        # binary search in [low, high), STEPS = ceil(log2(number of blocks))
        low = tl.zeros([BLOCK], dtype=tl.int64)
        high = tl.zeros([BLOCK], dtype=tl.int64) + num_blocks
        for _ in tl.static_range(STEPS):
            mid = (low + high) // 2
            go = (high - low > 1) & (tl.load(table_ptr + mid, mask=live, other=0) <= rows)
            stay = (high - low > 1) & ~go
            low = tl.where(go, mid, low)
            high = tl.where(stay, mid, high)
        block = tl.where(live, low, 0)
        offset = rows - tl.load(table_ptr + block)
        held = tl.load(table_ptr + num_blocks + block) + offset
        src = tl.load(table_ptr + 2 * num_blocks + block)
        base = meta_ptr + rows.to(tl.int64) * meta_stride
        token = tl.load(base + WIDTH, mask=live, other=0)
        tl.store(src_token_ptr + held, token.to(tl.int64), mask=live)
        tl.store(src_rank_ptr + held, src, mask=live)
        for k in tl.static_range(WIDTH):
            slot = tl.load(base + k, mask=live, other=-1).to(tl.int64)
            tl.store(presum_ptr + held * WIDTH + k, slot, mask=live)
            valid = live & (slot >= 0)
            tl.store(expand_src_ptr + slot, held, mask=valid)
            tl.store(expanded_token_ptr + slot, token.to(tl.int64), mask=valid)
            tl.store(expanded_rank_ptr + slot, src, mask=valid)
            for w in tl.static_range(WORDS):
                word = tl.load(base + WIDTH + 1 + k * WORDS + w, mask=valid, other=0)
                tl.store(weight_words_ptr + slot * WORDS + w, word, mask=valid)


def recv_plan_triton(meta: torch.Tensor, table: torch.Tensor, num_rows: int, weight_dtype: torch.dtype):
    """Triton version of ``dispatch.plan.build_recv_plan_reference``; returns the
    fields of ``dispatch.plan.RecvPlan`` in order."""
    if triton is None:
        raise RuntimeError("recv_plan_triton needs triton; install the 'test' extra or use the reference")
    meta = meta.contiguous()
    table = table.contiguous()
    num_recv = meta.shape[0]
    words = torch.finfo(weight_dtype).bits // 32
    width = (meta.shape[1] - 1) // (1 + words)
    device = meta.device
    # the int64 outputs of one length in one allocation each (every allocation costs the host),
    # each starting 16-byte aligned (an even stride), as separate allocations would
    expand_src, expanded_token, expanded_rank = _rows(3, num_rows, device)
    src_token, src_rank = _rows(2, num_recv, device)
    weights = torch.empty(num_rows, dtype=weight_dtype, device=device)
    presum_index = torch.empty(num_recv, width, dtype=torch.int64, device=device)
    if num_recv:
        num_blocks = table.shape[1]
        _recv_plan_kernel[(triton.cdiv(num_recv, BLOCK_R),)](
            meta, table, expand_src, weights.view(torch.int32), presum_index, src_token, src_rank, expanded_token,
            expanded_rank, num_recv, num_blocks, meta.stride(0),
            WIDTH=width, WORDS=words, STEPS=max(1, (num_blocks - 1).bit_length()), BLOCK=BLOCK_R,
        )
    return expand_src, presum_index, weights, src_token, src_rank, expanded_token, expanded_rank


def _rows(count: int, length: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``count`` int64 vectors of ``length`` in one allocation, each at a 16-byte
    aligned start (Triton specialises its kernels on their pointers' alignment)."""
    stride = length + (length & 1)
    return torch.empty(count, stride, dtype=torch.int64, device=device)[:, :length].unbind()
