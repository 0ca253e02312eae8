"""The routing plan: everything derived from ``topk_idx`` for one exchange.

Notation (used throughout the package):

    W        ranks in the EP group          E        experts in total
    E_local  experts per rank (E // W)      K        expert slots per token
    T        tokens on this rank            H        hidden size
    S        rows this rank sends           (one per (token, destination rank))
    R        rows this rank receives        (one per (source token, this rank))
    N        expanded rows on this rank     (one per (source token, local expert))
    J        min(K, E_local): most slots one token can have on one rank

Everything here runs on the tensors' device with vectorised torch ops and never
synchronises with the host: the caller brings the host-side split sizes it got
from its single counts exchange.

Orders (the contract of DESIGN.md):

* send order: destination rank ascending, then token index ascending. A token is
  sent to a rank once, however many of its experts live there.
* receive order: the concatenation of the send orders of the source ranks, so
  (source rank, source token) ascending.
* canonical (expanded) order: local expert ascending, then (source rank, source
  token) ascending. This is what the experts see.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Larger than any row position, used to push padding to the end of a sort.
_PAD = torch.iinfo(torch.int64).max


@dataclass(frozen=True)
class Route:
    """Send-side routing of one rank, computed before any communication.

    Attributes:
        dest: [T, K] int64, destination rank of each slot; ``W`` for an empty slot.
        hit: [T, W] bool, whether token t has at least one expert on rank r.
        counts: [W, 1 + E_local] int64; row r is ``[rows sent to r, slots for each
            of r's local experts]``. This is what the counts exchange moves.
    """

    dest: torch.Tensor
    hit: torch.Tensor
    counts: torch.Tensor


def route(topk_idx: torch.Tensor, num_experts: int, world_size: int) -> Route:
    """Destination ranks and per-destination counts of one rank's routing.

    Args:
        topk_idx: [T, K] int32/int64 global expert ids, ``-1`` = empty slot. Values
            must already be valid (in ``[-1, E)``, no repeats within a row).
        num_experts: E.
        world_size: W.
    """
    num_tokens = topk_idx.shape[0]
    experts_per_rank = num_experts // world_size
    idx = topk_idx.long()
    valid = idx >= 0
    dest = torch.where(valid, idx // experts_per_rank, world_size)

    hit = torch.zeros(num_tokens, world_size + 1, dtype=torch.bool, device=idx.device)
    hit.scatter_(1, dest, True)
    hit = hit[:, :world_size]

    expert_slots = torch.zeros(num_experts + 1, dtype=torch.int64, device=idx.device)
    flat = torch.where(valid, idx, num_experts).flatten()
    expert_slots.scatter_add_(0, flat, torch.ones_like(flat))
    per_expert = expert_slots[:num_experts].view(world_size, experts_per_rank)
    counts = torch.cat([hit.sum(0, dtype=torch.int64).unsqueeze(1), per_expert], dim=1)
    return Route(dest=dest, hit=hit, counts=counts)


@dataclass(frozen=True)
class SendPlan:
    """Where each of this rank's tokens goes, and where its partial sums come back.

    Attributes:
        send_token: [S] int64, source token of each send row, in send order.
        send_rank: [S] int64, destination rank of each send row.
        home_index: [T, W] int64; row t lists the send rows of token t in
            ascending destination rank (so its partial sums come back in rank
            order), padded with -1.
        slot_row: [T, K] int64, the send row that carries slot k of token t
            (-1 for an empty slot).
    """

    send_token: torch.Tensor
    send_rank: torch.Tensor
    home_index: torch.Tensor
    slot_row: torch.Tensor


def build_send_plan(r: Route, send_splits: tuple[int, ...]) -> SendPlan:
    """Send order from a :class:`Route` and the host copy of its per-rank counts."""
    hit = r.hit
    num_tokens, world_size = hit.shape
    device = hit.device
    total = sum(send_splits)
    splits = torch.tensor(send_splits, dtype=torch.int64, device=device)
    offsets = torch.cumsum(splits, 0) - splits
    position = torch.cumsum(hit, 0, dtype=torch.int64) - 1 + offsets  # [T, W]

    scatter_at = torch.where(hit, position, total).flatten()
    token_ids = torch.arange(num_tokens, device=device).repeat_interleave(world_size)
    send_token = torch.empty(total + 1, dtype=torch.int64, device=device)
    send_token.scatter_(0, scatter_at, token_ids)  # slot `total` collects the misses
    send_rank = torch.repeat_interleave(
        torch.arange(world_size, device=device), splits, output_size=total
    )

    home_index = _pack_left(torch.where(hit, position, _PAD))
    dest = r.dest.clamp(max=world_size - 1)
    slot_row = torch.where(r.dest < world_size, position.gather(1, dest), -1)
    return SendPlan(send_token[:total], send_rank, home_index, slot_row)


@dataclass(frozen=True)
class RecvPlan:
    """How received rows expand to one row per (token, local expert), and back.

    Attributes:
        expand_src: [N] int64, received row behind each expanded row (canonical order).
        expand_slot: [N] int64, ``j * K + k``: received row j, slot k of its token.
        presum_index: [R, J] int64; row j lists the expanded rows of received row j
            in ascending local expert, padded with -1. Summing along it is the
            expert-side pre-sum of combine.
    """

    expand_src: torch.Tensor
    expand_slot: torch.Tensor
    presum_index: torch.Tensor


def build_recv_plan(local_expert: torch.Tensor, num_rows: int, experts_per_rank: int) -> RecvPlan:
    """Canonical expansion of the received rows.

    Args:
        local_expert: [R, K] int, local expert id of each slot of each received
            token, ``-1`` where the slot lives on another rank (or is empty).
        num_rows: N, number of (token, local expert) pairs, known on the host
            from the counts exchange.
        experts_per_rank: E_local.
    """
    num_recv, topk = local_expert.shape
    device = local_expert.device
    key = torch.where(local_expert >= 0, local_expert.long(), experts_per_rank).flatten()
    # Stable sort by local expert keeps (source rank, source token) ascending
    # inside each expert: the canonical order.
    order = torch.sort(key, stable=True).indices[:num_rows]
    expand_src = torch.div(order, topk, rounding_mode="floor")

    inverse = torch.full((num_recv * topk,), _PAD, dtype=torch.int64, device=device)
    inverse[order] = torch.arange(num_rows, device=device)
    width = min(topk, experts_per_rank)
    presum_index = _pack_left(inverse.view(num_recv, topk))[:, :width]
    return RecvPlan(expand_src, order, presum_index.contiguous())


def _pack_left(values: torch.Tensor) -> torch.Tensor:
    """Sort each row ascending and turn the ``_PAD`` entries (now last) into -1."""
    packed = torch.sort(values, dim=1).values
    return torch.where(packed == _PAD, -1, packed)
