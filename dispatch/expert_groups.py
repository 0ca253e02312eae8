"""The exchange split by groups of local experts (``MoEExchange(split="experts")``).

Notation as in ``dispatch.plan``; G groups, group g = local experts
``[bounds[g], bounds[g + 1])`` of every rank (the same bounds on every rank).

One plain plan (``_plan`` of the alltoall variant) is made; this module orders
its rows by group:

* dispatch, chunk g: the send rows (token, destination) whose *first* slot on
  the destination is in group g. A row goes once, with the first group that
  needs it; group g's experts read rows of chunks 0..g, all arrived by then.
  The receiver holds the chunks one after the other (first-group order).
* experts, group g: the contiguous run of the canonical order that is group g's
  experts, read through the plain expansion remapped to first-group order.
* combine, chunk g: the received rows whose *last* slot is in group g, pre-summed
  over all their slots exactly as the plain combine does (every slot's group is
  at most g, so every slot's output exists). The home rank holds the chunks one
  after the other (last-group order) and sums each token's partials in
  ascending rank order, as the plain combine does.

So rows, pre-sums and final sums are those of the plain exchange, value for
value; only when they travel changes. Every chunk's split sizes come from one
host synchronisation after the plain plan's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch.plan import to_device


@dataclass(frozen=True)
class GroupChunk:
    """One chunk of the split exchange, in both directions.

    Attributes:
        send_rows: send rows of the chunk, to dispatch (first group g), as rows of the plain send order.
        dispatch_splits: (to each rank, from each rank) host row counts of the dispatch chunk.
        held_start: first row of the chunk among the received rows held in first-group order.
        expanded: (start, end) of the group's run of expanded rows.
        presum_index: [R_g, J] expanded rows of the combine chunk's received rows (last group g).
        combine_splits: (to each rank, from each rank) host row counts of the combine chunk.
        back_start: first row of the chunk among the partials held home in last-group order.
    """

    send_rows: torch.Tensor
    dispatch_splits: tuple[tuple[int, ...], tuple[int, ...]]
    held_start: int
    expanded: tuple[int, int]
    presum_index: torch.Tensor
    combine_splits: tuple[tuple[int, ...], tuple[int, ...]]
    back_start: int


@dataclass(frozen=True)
class GroupPlan:
    """The plain plan's rows ordered by group (see the module doc).

    Attributes:
        chunks: one :class:`GroupChunk` per group.
        expand_src: [N] received row (first-group order) behind each expanded row.
        home_index: [T, W] the plain ``home_index`` as rows of the last-group order.
        slot_row: [T, K] the plain ``slot_row`` as rows of the last-group order.
        num_held, num_back: R and S.
    """

    chunks: tuple[GroupChunk, ...]
    expand_src: torch.Tensor
    home_index: torch.Tensor
    slot_row: torch.Tensor
    num_held: int
    num_back: int


def group_bounds(num_local_experts: int, groups: int) -> tuple[int, ...]:
    """G + 1 bounds splitting E_local experts into G groups of near-equal size."""
    return tuple(g * num_local_experts // groups for g in range(groups + 1))


def build_group_plan(handle, outputs, topk_idx: torch.Tensor, bounds: tuple[int, ...], world: int) -> GroupPlan:
    """Order an alltoall plan's rows by group of local experts; one host synchronisation.

    Args:
        handle: the plain plan's ``AllToAllHandle``.
        outputs: its ``PlanOutputs`` (``tokens_per_expert`` on the device and host).
        topk_idx: [T, K] expert ids the plan was made from.
        bounds: G + 1 group bounds over the local experts (``group_bounds``).
        world: W.
    """
    device = topk_idx.device
    groups = len(bounds) - 1
    experts_per_rank = outputs.tokens_per_expert_host.shape[0]
    sizes = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])])
    group_of = to_device(torch.repeat_interleave(torch.arange(groups), sizes), device)  # [E_local]: each expert's group

    # Sender: first and last group of each (token, destination), over its valid slots.
    valid = handle.slot_row >= 0  # [T, K]
    idx = topk_idx.long().clamp(min=0)
    dest = torch.where(valid, idx // experts_per_rank, world)
    group = group_of[idx % experts_per_rank]
    num_tokens = topk_idx.shape[0]
    first = torch.full((num_tokens, world + 1), groups, dtype=torch.int64, device=device)
    first.scatter_reduce_(1, dest, torch.where(valid, group, groups), reduce="amin")
    last = torch.full((num_tokens, world + 1), -1, dtype=torch.int64, device=device)
    last.scatter_reduce_(1, dest, torch.where(valid, group, -1), reduce="amax")
    send_dest = _peer_of_rows(handle.send_splits, device)
    send_token = handle.send_token
    send_first, send_last = first[send_token, send_dest], last[send_token, send_dest]

    # Receiver: a received row's slots, ascending in canonical order, give its groups.
    ends = torch.cumsum(outputs.tokens_per_expert, 0)  # [E_local]
    presum = handle.presum_index  # [R, J]
    slots = (presum >= 0).sum(1)
    recv_src = _peer_of_rows(handle.recv_splits, device)

    def group_at(positions):
        return group_of[torch.searchsorted(ends, positions, right=True).clamp(max=experts_per_rank - 1)]

    recv_first = group_at(presum[:, 0].clamp(min=0))
    recv_last = group_at(presum.gather(1, (slots - 1).clamp(min=0).unsqueeze(1)).squeeze(1).clamp(min=0))

    def per_group(group_of_row, peer_of_row):  # (a bincount would read its size on the host)
        key = group_of_row * world + peer_of_row
        return torch.zeros(groups * world, dtype=torch.int64, device=device).scatter_add_(
            0, key, torch.ones_like(key)).view(groups, world)

    # host sync: every chunk's split sizes, both directions
    counts = torch.stack([
        per_group(send_first, send_dest), per_group(send_last, send_dest),
        per_group(recv_first, recv_src), per_group(recv_last, recv_src),
    ]).cpu()
    by_send_first, by_send_last = _order(send_first), _order(send_last)
    by_recv_first, by_recv_last = _order(recv_first), _order(recv_last)
    held_of = _inverse(by_recv_first)
    back_of = torch.cat([_inverse(by_send_last), by_send_last.new_full((1,), -1)])  # [-1] -> -1 (padding)
    expand_src = held_of[handle.expand_src]
    home_index, slot_row = back_of[handle.home_index], back_of[handle.slot_row]

    per_expert = outputs.tokens_per_expert_host.tolist()
    chunks, sent, held, back, recv_done = [], 0, 0, 0, 0
    for g in range(groups):
        to_first, to_last = tuple(counts[0, g].tolist()), tuple(counts[1, g].tolist())
        from_first, from_last = tuple(counts[2, g].tolist()), tuple(counts[3, g].tolist())
        start = sum(per_expert[: bounds[g]])
        chunks.append(GroupChunk(
            send_rows=by_send_first[sent : sent + sum(to_first)],
            dispatch_splits=(to_first, from_first),
            held_start=held,
            expanded=(start, start + sum(per_expert[bounds[g] : bounds[g + 1]])),
            presum_index=presum[by_recv_last[recv_done : recv_done + sum(from_last)]],
            combine_splits=(from_last, to_last),
            back_start=back,
        ))
        sent, held = sent + sum(to_first), held + sum(from_first)
        back, recv_done = back + sum(to_last), recv_done + sum(from_last)
    return GroupPlan(tuple(chunks), expand_src, home_index, slot_row, held, back)


def _peer_of_rows(splits: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """[sum(splits)] the peer of each row of an exchange ordered by peer (host splits)."""
    sizes = to_device(torch.tensor(splits, dtype=torch.int64), device)
    return torch.repeat_interleave(torch.arange(len(splits), device=device), sizes, output_size=sum(splits))


def _order(keys: torch.Tensor) -> torch.Tensor:
    """Rows sorted by key, keeping their order within a key."""
    return torch.sort(keys, stable=True).indices


def _inverse(order: torch.Tensor) -> torch.Tensor:
    """Position of each row in ``order``."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return inverse
