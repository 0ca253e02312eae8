"""The send plan of one group in two kernels.

Same result as ``dispatch.plan.build_send_plan`` with one group (the
reference, torch operations), on the rows the exchange reads: ``send_token``
and ``meta`` up to the S rows sent (the rows past them, and the reference's
row for the slots that do not move, are not read). The tokens go by blocks of
``BLOCK_T``:

1. each block counts its tokens' rows to each rank and slots to each expert;
   the counts of the blocks before each (an exclusive cumulative sum over the
   blocks, torch) plus where each rank's rows start in the send order and
   where each expert's slots from this rank start on its rank give every block
   its bases;
2. each block places its tokens from its bases: a (token, rank) row at its
   rank's base plus the block's earlier tokens that go there; a slot at its
   expert's base plus the block's earlier slots of that expert; then writes
   the send order's tokens, each token's rows home in ascending rank, each
   slot's row and column, and the slot lists (positions, token, weights).

Every output element is written by one program, once (the counts of step 1 by
integer atomics): the result does not depend on the launch. Where the torch
operations are some sixty small kernels, most of the plan's time on the GPU.
The blocks' counts per expert grow as T x E: plans past ``MAX_COUNTS`` of them
run the torch operations (:func:`fits`).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs run the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

_SLOTS = 64  # slots of a block (BLOCK_T * BLOCK_K), at most: its [slots, slots] comparison
MAX_COUNTS = 1 << 20  # entries of the blocks' counts per expert, at most (8 MB, and as much for their sums)


def _block_tokens(topk: int) -> int:
    """Tokens of a block: ``_SLOTS`` slots of K rounded up to a power of two."""
    return max(1, _SLOTS // (1 << (topk - 1).bit_length()))


def fits(num_tokens: int, topk: int, num_experts: int) -> bool:
    """Whether the blocks' counts per expert of a plan of this shape stay within
    ``MAX_COUNTS`` (a larger plan runs the torch operations: the counts grow as
    T x E, where the plan itself grows as T x K)."""
    return -(-num_tokens // _block_tokens(topk)) * num_experts <= MAX_COUNTS


if triton is not None:

    @triton.jit
    def _block_counts_kernel(hit_ptr, dest_ptr, idx_ptr, ranks_out, experts_out, num_tokens, topk, world, num_experts,
                             blocks, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr):
        # counts by (rank, block) and (expert, block): the blocks run along the contiguous
        # dimension, so that their prefix sums scan it (a scan down the outer dimension of a
        # [blocks, E] tensor is E-way parallel only, and slow)
        block = tl.program_id(0)
        tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
        ranks = tl.arange(0, BLOCK_W)
        ks = tl.arange(0, BLOCK_K)
        live = tokens < num_tokens
        hit = tl.load(hit_ptr + tokens[:, None].to(tl.int64) * world + ranks[None, :],
                      mask=live[:, None] & (ranks[None, :] < world), other=0).to(tl.int64)
        tl.store(ranks_out + ranks.to(tl.int64) * blocks + block, tl.sum(hit, axis=0), mask=ranks < world)
        slot = live[:, None] & (ks[None, :] < topk)
        at = tokens[:, None].to(tl.int64) * topk + ks[None, :]
        moves = slot & (tl.load(dest_ptr + at, mask=slot, other=world) < world)
        idx = tl.load(idx_ptr + at, mask=moves, other=0).to(tl.int64)
        ones = tl.full([BLOCK_T, BLOCK_K], 1, tl.int64)
        tl.atomic_add(experts_out + idx * blocks + block, ones, mask=moves)

    @triton.jit
    def _place_kernel(hit_ptr, dest_ptr, idx_ptr, weights_ptr, rank_base_ptr, expert_base_ptr, send_token_ptr,
                      home_ptr, slot_row_ptr, slot_col_ptr, meta_ptr, num_tokens, topk, world, num_experts, blocks,
                      meta_stride, width, WIDE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_W: tl.constexpr):
        block = tl.program_id(0)
        tokens = block * BLOCK_T + tl.arange(0, BLOCK_T)
        ranks = tl.arange(0, BLOCK_W)
        ks = tl.arange(0, BLOCK_K)
        live = tokens < num_tokens
        in_world = live[:, None] & (ranks[None, :] < world)
        # rows: each (token, rank) at its rank's base plus the block's earlier tokens going there
        hit = tl.load(hit_ptr + tokens[:, None].to(tl.int64) * world + ranks[None, :], mask=in_world,
                      other=0).to(tl.int64)
        goes = hit > 0
        base = tl.load(rank_base_ptr + ranks.to(tl.int64) * blocks + block, mask=ranks < world, other=0)
        row = base[None, :] + tl.cumsum(hit, axis=0) - hit  # [T, W]
        token_of = tokens[:, None].to(tl.int64) + tl.zeros([BLOCK_T, BLOCK_W], tl.int64)
        tl.store(send_token_ptr + row, token_of, mask=goes)
        tl.store(meta_ptr + row * meta_stride + width, token_of.to(tl.int32), mask=goes)
        # each token's rows in ascending rank, then -1: the j-th rank it goes to at j, the others after
        misses = (in_world & ~goes).to(tl.int64)
        place = tl.where(goes, tl.cumsum(hit, axis=1) - hit,
                         tl.sum(hit, axis=1)[:, None] + tl.cumsum(misses, axis=1) - misses)
        tl.store(home_ptr + tokens[:, None].to(tl.int64) * world + place, tl.where(goes, row, -1), mask=in_world)
        # slots
        slot = live[:, None] & (ks[None, :] < topk)
        at = tokens[:, None].to(tl.int64) * topk + ks[None, :]
        dest = tl.load(dest_ptr + at, mask=slot, other=world)
        moves = slot & (dest < world)
        idx = tl.load(idx_ptr + at, mask=moves, other=-1).to(tl.int64)
        on = dest[:, :, None] == ranks[None, None, :]  # [T, K, W]
        slot_row = tl.sum(tl.where(on, row[:, None, :], 0), axis=2)
        tl.store(slot_row_ptr + at, tl.where(moves, slot_row, -1), mask=slot)
        # its column: the token's slots on the same rank with a smaller id
        before = (dest[:, None, :] == dest[:, :, None]) & (idx[:, None, :] < idx[:, :, None]) & moves[:, None, :]
        col = tl.sum(before.to(tl.int32), axis=2).to(tl.int64)
        tl.store(slot_col_ptr + at, tl.where(moves, col, -1), mask=slot)
        # its place on the rank: its expert's base plus the block's earlier tokens' slots of that expert
        key = tl.reshape(tl.where(moves, idx, -1), [BLOCK_T * BLOCK_K])
        owner = tl.reshape(tokens[:, None] + tl.zeros([BLOCK_T, BLOCK_K], tl.int32), [BLOCK_T * BLOCK_K])
        same = (key[None, :] == key[:, None]) & (owner[None, :] < owner[:, None]) & (key[None, :] >= 0)
        earlier = tl.reshape(tl.sum(same.to(tl.int32), axis=1), [BLOCK_T, BLOCK_K]).to(tl.int64)
        expert_base = tl.load(expert_base_ptr + idx * blocks + block, mask=moves, other=0)
        cell = meta_ptr + slot_row * meta_stride
        tl.store(cell + col, (expert_base + earlier).to(tl.int32), mask=moves)
        weights = tl.load(weights_ptr + at, mask=moves, other=0.0)
        if WIDE:  # fp64: two words, low then high
            bits = weights.to(tl.float64).to(tl.int64, bitcast=True)
            tl.store(cell + width + 1 + 2 * col, (bits & 0xFFFFFFFF).to(tl.int32), mask=moves)
            tl.store(cell + width + 2 + 2 * col, (bits >> 32).to(tl.int32), mask=moves)
        else:
            tl.store(cell + width + 1 + col, weights.to(tl.float32).to(tl.int32, bitcast=True), mask=moves)


def send_plan_triton(hit: torch.Tensor, dest: torch.Tensor, rank_counts: torch.Tensor, all_counts: torch.Tensor,
                     rank: int, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
    """(send_token, meta, home_index, slot_row, slot_col): ``build_send_plan``'s
    fields for one group, from the route (``hit`` [T, W] bool, ``dest`` [T, K],
    ``rank_counts`` [W]: this rank's rows to each rank) and the all-gathered
    counts ``all_counts`` [W_src, W_dst, 1 + E_local]."""
    if triton is None:
        raise RuntimeError("send_plan_triton needs triton; install the 'test' extra or use the reference")
    num_tokens, world = hit.shape
    topk = dest.shape[1]
    local = all_counts.shape[2] - 1
    num_experts, width = world * local, min(topk, local)
    device = hit.device
    wide = topk_weights.dtype == torch.float64
    capacity = num_tokens * min(topk, world)
    block_k, block_w = triton.next_power_of_2(topk), triton.next_power_of_2(world)
    block_t = _block_tokens(topk)
    blocks = triton.cdiv(num_tokens, block_t)
    hit, dest, topk_idx, topk_weights = (t.contiguous() for t in (hit, dest, topk_idx, topk_weights))
    hit_bytes = hit.view(torch.int8)
    send_token = torch.empty(capacity + 1, dtype=torch.int64, device=device)
    meta = torch.full((capacity + 1, width + 1 + width * (2 if wide else 1)), -1, dtype=torch.int32, device=device)
    home_index = torch.empty(num_tokens, world, dtype=torch.int64, device=device)
    slot_row = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)
    slot_col = torch.empty(num_tokens, topk, dtype=torch.int64, device=device)
    if num_tokens:
        block_ranks = torch.empty(world, blocks, dtype=torch.int64, device=device)
        block_experts = torch.zeros(num_experts, blocks, dtype=torch.int64, device=device)
        sizes = (num_tokens, topk, world, num_experts, blocks)
        _block_counts_kernel[(blocks,)](hit_bytes, dest, topk_idx, block_ranks, block_experts, *sizes,
                                        BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=block_w)
        # where each rank's rows start in the send order, each expert's slots from this rank on its rank
        rank_start = torch.cumsum(rank_counts, 0) - rank_counts
        per_source = all_counts[:, :, 1:]
        totals = per_source.sum(0)
        expert_start = (torch.cumsum(totals, 1) - totals + per_source[:rank].sum(0)).flatten()
        rank_base = torch.cumsum(block_ranks, 1) - block_ranks + rank_start[:, None]
        expert_base = torch.cumsum(block_experts, 1) - block_experts + expert_start[:, None]
        _place_kernel[(blocks,)](hit_bytes, dest, topk_idx, topk_weights, rank_base, expert_base, send_token,
                                 home_index, slot_row, slot_col, meta, *sizes, meta.stride(0), width, WIDE=wide,
                                 BLOCK_T=block_t, BLOCK_K=block_k, BLOCK_W=block_w)
    return send_token[:capacity], meta, home_index, slot_row, slot_col
