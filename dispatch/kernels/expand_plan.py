"""The expansion of items to canonical order (``counts.expand``) in two kernels
around one sort.

Same result as ``counts.expand_reference`` (the reference, torch operations):

* the first kernel takes ``BLOCK_I`` items a program and finds the slots of
  this rank's local experts as ``plan.route`` routes them (an id in ``[0, E)``
  that no earlier slot of the item holds, on this rank), the sort key of each
  (its local expert, then the item's order key; empty: the largest int64), its
  column among the item's rows (its local experts below it), and whether the
  item has a row here;
* the keys are sorted (the canonical order: expert-major, ascending order key
  within an expert; the keys here are unique, so the order is);
* the second kernel takes the N first places of the sorted order and writes
  each to its item's pre-sum column.

Some five launches and the sort where the torch operations are some thirty
small kernels (the all-gather and hierarchical variants' plans on CUDA).
"""

from __future__ import annotations

import torch

try:  # Triton is optional: CPU-only installs run the reference.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None

_ELEMENTS = 8192  # elements of a program's [items, slots, slots] tile, at most
_PLACES = 1024  # sorted places a program of the second kernel writes


if triton is not None:

    @triton.jit
    def _keys_kernel(
        ids_ptr,
        ids_stride,
        order_key_ptr,
        keys_ptr,
        col_ptr,
        here_ptr,
        items,
        topk,
        num_experts,
        experts_per_rank,
        rank,
        key_span,
        width,
        BLOCK_I: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        item = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
        ks = tl.arange(0, BLOCK_K)
        live = item < items
        slot = live[:, None] & (ks[None, :] < topk)  # [I, K]
        ids = tl.load(ids_ptr + item[:, None].to(tl.int64) * ids_stride + ks[None, :], mask=slot, other=-1)
        ids = ids.to(tl.int64)
        earlier = ks[None, None, :] < ks[None, :, None]  # [1, k, k'] k' < k
        same = (ids[:, :, None] == ids[:, None, :]) & earlier & slot[:, None, :]
        repeat = tl.sum(same.to(tl.int32), axis=2) > 0
        local = ids - rank * experts_per_rank
        mine = slot & (ids >= 0) & (ids < num_experts) & ~repeat & (local >= 0) & (local < experts_per_rank)
        order_key = tl.load(order_key_ptr + item, mask=live, other=0).to(tl.int64)
        key = tl.where(mine, local * key_span + order_key[:, None], 9223372036854775807)
        at = item[:, None].to(tl.int64) * topk + ks[None, :]
        tl.store(keys_ptr + at, key, mask=slot)
        # the item's rows here below this one: its local experts below this one's (none here: J, no column)
        below = (local[:, None, :] < local[:, :, None]) & mine[:, None, :]  # [I, k, k']
        tl.store(col_ptr + at, tl.where(mine, tl.sum(below.to(tl.int32), axis=2), width), mask=slot)
        tl.store(here_ptr + item, tl.max(mine.to(tl.int64), axis=1), mask=live)

    @triton.jit
    def _places_kernel(order_ptr, col_ptr, presum_ptr, num_rows, topk, width, BLOCK: tl.constexpr):
        place = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = place < num_rows
        flat = tl.load(order_ptr + place, mask=live, other=0)
        col = tl.load(col_ptr + flat, mask=live, other=0).to(tl.int64)
        # (a place past the slots here, were N more than them, writes nothing)
        tl.store(presum_ptr + (flat // topk) * width + col, place.to(tl.int64), mask=live & (col < width))


def expand_triton(ids: torch.Tensor, order_key: torch.Tensor, key_span: int, num_experts: int, world_size: int,
                  rank: int, num_rows: int, width: int):
    """(slots [N] int64, presum_index [I, J] int64, hit_here [I] int64 (0/1)):
    ``counts.expand_reference``'s slots and pre-sum index, and whether each item
    has a row here (the caller lists them)."""
    if triton is None:
        raise RuntimeError("expand_triton needs triton; install the 'test' extra or use the reference")
    items, topk = ids.shape
    device = ids.device
    if ids.stride(1) != 1:
        ids = ids.contiguous()
    order_key = order_key.contiguous()
    keys = torch.empty(items * topk, dtype=torch.int64, device=device)
    col = torch.empty(items * topk, dtype=torch.int32, device=device)
    hit_here = torch.empty(items, dtype=torch.int64, device=device)
    presum = torch.full((items, width), -1, dtype=torch.int64, device=device)
    if items == 0:
        return keys[:0], presum, hit_here
    block_k = triton.next_power_of_2(topk)
    fit = max(1, min(64, _ELEMENTS // (block_k * block_k)))
    block_i = 1 << (fit.bit_length() - 1)  # a power of two
    _keys_kernel[(triton.cdiv(items, block_i),)](
        ids, ids.stride(0), order_key, keys, col, hit_here, items, topk, num_experts, num_experts // world_size, rank,
        key_span, width, BLOCK_I=block_i, BLOCK_K=block_k,
    )
    order = torch.sort(keys).indices
    if num_rows:
        _places_kernel[(triton.cdiv(num_rows, _PLACES),)](order, col, presum, num_rows, topk, width, BLOCK=_PLACES)
    return order[:num_rows], presum, hit_here
