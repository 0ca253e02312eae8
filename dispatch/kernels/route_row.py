"""The route and the counts row of one dispatch in one kernel.

Same result as ``dispatch.plan_graph.route_phase`` for one group (the
reference, torch operations): each program takes ``BLOCK_T`` tokens and

* marks the slots that move (an id in ``[0, E)`` that no earlier slot of the
  token holds), their destination rank (``W`` for the others), and the ranks
  each token goes to (``hit``);
* adds its tokens' rows to each rank and slots to each expert into the counts
  at the head of the row that every rank all-gathers (integer atomics: the sums
  do not depend on the order they land in);
* with the value checks, raises the row's ``failed`` entry where a slot holds an
  id outside ``[-1, E)`` or an id an earlier slot holds, or a weight is not
  finite (``checks.fold_flags`` of ``checks.value_flags``).

One launch where the torch operations are some fifty small kernels, which were
most of the plan's time on the GPU before its host read.
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs run the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

_ELEMENTS = 8192  # elements of a program's [tokens, slots, ranks] tile, at most


if triton is not None:

    @triton.jit
    def _route_row_kernel(
        idx_ptr,
        weights_ptr,
        dest_ptr,
        hit_ptr,
        row_ptr,
        num_tokens,
        topk,
        num_experts,
        experts_per_rank,
        world,
        failed_at,
        CHECK: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ks = tl.arange(0, BLOCK_K)
        ranks = tl.arange(0, BLOCK_W)
        live = tokens < num_tokens
        slot = live[:, None] & (ks[None, :] < topk)  # [T, K]
        at = tokens[:, None].to(tl.int64) * topk + ks[None, :]
        idx = tl.load(idx_ptr + at, mask=slot, other=-1).to(tl.int64)
        # a slot whose id an earlier slot of the token holds (k' < k)
        earlier = ks[None, None, :] < ks[None, :, None]
        same = (idx[:, :, None] == idx[:, None, :]) & earlier & slot[:, None, :]
        repeat = tl.sum(same.to(tl.int32), axis=2) > 0
        moves = slot & (idx >= 0) & (idx < num_experts) & ~repeat
        dest = tl.where(moves, idx // experts_per_rank, world)
        tl.store(dest_ptr + at, dest, mask=slot)
        # the ranks each token goes to
        goes = (dest[:, :, None] == ranks[None, None, :]) & moves[:, :, None]
        hit = tl.sum(goes.to(tl.int32), axis=1) > 0  # [T, W]
        tl.store(hit_ptr + tokens[:, None].to(tl.int64) * world + ranks[None, :], hit.to(tl.int8),
                 mask=live[:, None] & (ranks[None, :] < world))
        # rank r's counts at r (1 + E_local): its rows, then its experts' slots
        stride = 1 + experts_per_rank
        tl.atomic_add(row_ptr + ranks * stride, tl.sum(hit.to(tl.int64), axis=0), mask=ranks < world)
        ones = tl.full([BLOCK_T, BLOCK_K], 1, tl.int64)
        tl.atomic_add(row_ptr + dest * stride + 1 + idx % experts_per_rank, ones, mask=moves)
        if CHECK:
            weights = tl.load(weights_ptr + at, mask=slot, other=0.0).to(tl.float64)  # exact for every float
            bad = slot & ((idx < -1) | (idx >= num_experts) | (repeat & (idx >= 0)) | (weights != weights)
                          | (weights == float("inf")) | (weights == float("-inf")))
            tl.atomic_max(row_ptr + failed_at, tl.max(tl.max(bad.to(tl.int64), axis=1), axis=0))


def route_row_triton(topk_idx: torch.Tensor, topk_weights: torch.Tensor, header_row: torch.Tensor, num_experts: int,
                     world_size: int, check_values: bool, width: int, header_at: int, failed_at: int):
    """(dest [T, K] int64, hit [T, W] bool, row [width] int64): ``route_phase``'s
    Route fields and row for one group (its tail: zeros, then G = 1), the
    header ``header_row`` at ``header_at`` with its ``failed`` entry (at
    ``failed_at`` in the row) raised by bad values where ``check_values``."""
    if triton is None:
        raise RuntimeError("route_row_triton needs triton; install the 'test' extra or use the reference")
    topk_idx = topk_idx.contiguous()
    topk_weights = topk_weights.contiguous()
    num_tokens, topk = topk_idx.shape
    device = topk_idx.device
    row = torch.zeros(width, dtype=torch.int64, device=device)
    row[header_at : header_at + header_row.numel()] = header_row
    row[-1:].fill_(1)  # G (a fill: no host copy, which a CUDA graph's capture refuses)
    dest = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)
    hit = torch.empty(num_tokens, world_size, dtype=torch.int8, device=device)
    if num_tokens:
        block_k, block_w = triton.next_power_of_2(topk), triton.next_power_of_2(world_size)
        fit = max(1, min(64, _ELEMENTS // (block_k * max(block_k, block_w))))
        block_t = 1 << (fit.bit_length() - 1)  # a power of two
        _route_row_kernel[(triton.cdiv(num_tokens, block_t),)](
            topk_idx, topk_weights, dest, hit, row, num_tokens, topk, num_experts, num_experts // world_size,
            world_size, failed_at, CHECK=check_values, BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=block_w,
        )
    return dest, hit.view(torch.bool), row
