"""The counts exchange of the all-gather, hierarchical and auto variants, and
the expansion of received rows to canonical order.

One all-gather per exchange gives every rank every rank's routing counts,
header, token count and node counts, and one host copy puts them where the
split sizes are needed. It reuses ``dispatch.plan``'s route, header and send
order (``plan.send_positions``, ``plan.rows_by_item``, ``plan.items_by_row``), so the
checks are those of the alltoall variant: values before the first exchange
(a rank with bad values marks itself failed in it and raises right after it),
peers' headers and groups right after it (every rank raises).

Notation as in ``dispatch.plan``; M = W // L nodes of L ranks; G groups of local experts.

Gathered row of one rank: ``[counts W * (1 + E_local) | header | T | node hits M | G]``.

A token's routing row (``ROUTING``), which the all-gather and hierarchical variants
move to the ranks that expand it: ``[rank, token, ids K, weights' fp64 bits K]`` int64.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dispatch import checks, comm, plan
from dispatch.cost_model import RoutingStats
from dispatch.handle import PlanOutputs
from dispatch.kernels import plan_cpu

# Larger than any row position, used to push padding to the end of a sort.
PAD = torch.iinfo(torch.int64).max
_FAILED = plan.HEADER.index("failed")
ROUTING = ("rank", "token", "ids", "weight bits")  # a routing row's entries (ids and weight bits: K each)
# Rows a GPU rank plans on the host at most, in the compiled CPU plan: its tokens' route (``exchange``),
# the routing rows it expands (and, in the hierarchical variant, forwards); more on the device in torch
# operations (measured: bench/host_plan_probe.py, bench/results/nvidia-h200/host-calls-cuda.txt).
HOST_PLAN_ITEMS = 1024


@dataclass(frozen=True)
class GlobalCounts:
    """What every rank knows after the counts exchange.

    Attributes:
        route: this rank's :class:`dispatch.plan.Route` (on the host where a GPU rank routed
            there, ``HOST_PLAN_ITEMS``; else on the device).
        node_hit: [T, M] bool (as ``route``), token t has an expert on node n.
        counts: [W_src, W_dst, 1 + E_local] int64 host, ``plan.Route.counts`` of every rank.
        tokens: [W] int64 host, T of every rank.
        node_hits: [W, M] int64 host, tokens of rank s with an expert on node n.
        x_grad_any, weights_grad_any: some rank needs that gradient.
        rows_per_rank: [W] host, the expanded rows each rank's experts get; has_rows: per
            rank, whether they get any (``CombineHandle.has_rows``).
        routing: [T, 2 + 2K] int64 (as ``route``), this rank's routing rows (``ROUTING``; where asked for).
    """

    route: plan.Route
    node_hit: torch.Tensor
    counts: torch.Tensor
    tokens: torch.Tensor
    node_hits: torch.Tensor
    x_grad_any: bool
    weights_grad_any: bool
    rows_per_rank: list[int]
    has_rows: tuple[bool, ...]
    routing: torch.Tensor | None = None

    def routing_stats(self) -> RoutingStats:
        return RoutingStats(tokens=self.tokens, rank_hits=self.counts[:, :, 0], node_hits=self.node_hits)


def exchange(
    x: torch.Tensor,
    topk_idx: torch.Tensor,
    topk_weights: torch.Tensor,
    num_experts: int,
    local_world_size: int,
    group,
    world_size: int,
    rank: int,
    check_values: bool,
    arrivals: comm.Arrivals | None = None,
    ticket: plan.Ticket = plan.Ticket(),
    row_bytes: int = 0,
    exact_memory_rows=None,
    groups: int = 1,
    with_routing: bool = False,
) -> GlobalCounts:
    """Route, check values, all-gather the counts, check peers; one host sync.
    Bad values on this rank mark it failed in the row it all-gathers, on the
    device (``checks.fold_flags``), and it raises once it reads the rows back,
    where its peers raise too (``checks.raise_own_values``).

    Args:
        x: [T, H]; topk_idx: [T, K] int32/int64; topk_weights: [T, K] floating.
        local_world_size: L (ranks per node).
        ticket, row_bytes: this call's :class:`dispatch.plan.Ticket` (``plan.header``) and the
            bytes a received row takes (``checks.check_row_budgets``).
        groups: G of the dispatch (``dispatch(groups=G)``): every rank's must be
            the same (``checks.check_peer_groups``): a rank of other groups hands
            out other rows by group, and sends its sums home at another add.
        with_routing: also this rank's routing rows (``GlobalCounts.routing``).
    """
    num_tokens, topk = topk_idx.shape
    head = plan.header(x, topk_weights, topk, ticket) + [num_tokens, groups]
    layout = counts_row(world_size, num_experts // world_size, local_world_size)
    idx, weights = topk_idx, topk_weights.detach()
    on_host = not idx.is_cpu and num_tokens <= HOST_PLAN_ITEMS and plan_cpu.module() is not None
    if on_host:  # host sync: a GPU rank's few rows route on the host (HOST_PLAN_ITEMS)
        idx, weights = idx.cpu(), weights.cpu()
    route, node_hit, row, routing = route_and_row(idx, weights, head, num_experts, world_size, local_world_size,
                                                  check_values, x.device, rank, with_routing)
    if on_host:
        row = plan.to_device(row, x.device)
    gathered = comm.all_gather_rows(row, group, world_size, arrivals=arrivals).cpu()  # host sync: split sizes
    all_counts, headers, tails = layout.split(gathered)
    if headers[rank, _FAILED]:  # this rank's own bad values: its error (its peers raise in check_peer_headers)
        checks.raise_own_values(headers[rank].tolist(), ticket, topk_idx, topk_weights, num_experts)
    x_grad_any, weights_grad_any = checks.check_peer_headers(headers)
    rows_per_rank = all_counts[:, :, 1:].sum((0, 2)).tolist()
    checks.check_row_budgets(headers, rows_per_rank, row_bytes, exact_memory_rows)
    checks.check_peer_groups(tails[:, -1].tolist())
    return GlobalCounts(route, node_hit, all_counts, tails[:, 0], tails[:, 1:-1], x_grad_any, weights_grad_any,
                        rows_per_rank, tuple(map(bool, rows_per_rank)), routing)


def route_and_row(topk_idx: torch.Tensor, topk_weights: torch.Tensor, head: list[int], num_experts: int,
                  world_size: int, local_world_size: int, check_values: bool, device: torch.device, rank: int = 0,
                  with_routing: bool = False):
    """(``plan.Route``, node_hit [T, M] bool, the row :func:`exchange` all-gathers,
    the routing rows or None) of this rank's routing; ``head``: its header
    entries, then T and G. With ``check_values``, a bad value raises the row's
    failed entry. ``with_routing``: [T, 2 + 2K] routing rows (``ROUTING``) of
    ``rank``. On CPU one compiled call (``dispatch.kernels.plan_cpu``)."""
    num_tokens = topk_idx.shape[0]
    layout = counts_row(world_size, num_experts // world_size, local_world_size)
    compiled = plan_cpu.on_cpu(topk_idx)
    if compiled is not None:
        dest, hit, node_hit, row, routing = compiled.counts_row(topk_idx, topk_weights, check_values, head,
                                                                num_experts, world_size, local_world_size, _FAILED,
                                                                rank, with_routing)
        return (plan.Route(dest, hit, row[: layout.header_at].view(world_size, -1)), node_hit, row,
                routing if with_routing else None)
    route = plan.route(topk_idx, num_experts, world_size)  # bad ids are empty slots there
    node_hit = route.hit.view(num_tokens, world_size // local_world_size, local_world_size).any(2)
    header_row = plan.to_device(torch.tensor(head), device)
    if check_values and num_tokens > 0:  # a bad value marks this rank failed in its row, on the device
        header_row = checks.fold_flags(header_row, checks.value_flags(topk_idx, topk_weights, num_experts))
    tail = torch.cat([header_row[-2:-1], node_hit.sum(0, dtype=torch.int64), header_row[-1:]])  # T, node hits, G
    routing = None
    if with_routing:
        routing = torch.cat([
            torch.full((num_tokens, 1), rank, dtype=torch.int64, device=device),
            torch.arange(num_tokens, device=device).unsqueeze(1),
            topk_idx.long(),
            topk_weights.double().view(torch.int64),
        ], dim=1)
    return route, node_hit, layout.row(route.counts, header_row[:-2], tail), routing


@functools.lru_cache(maxsize=64)
def counts_row(world_size: int, local_experts: int, local_world_size: int) -> plan.CountsRow:
    """The row :func:`exchange` all-gathers: counts, header, then T, the node hits and G."""
    return plan.CountsRow(world_size, local_experts, 2 + world_size // local_world_size)


@dataclass(frozen=True)
class Expansion:
    """How the routing rows that reached this rank (items) expand to canonical order.

    Attributes:
        slots: [N] int64, ``item * K + k`` behind each expanded row, canonical order.
        here: [R] int64, the items with a slot here, ascending.
        presum_index: [R, J] int64, the expanded rows of each item here in ascending
            local expert, -1 padded (the expert-side pre-sum of combine).
        expand_src: [N] int64, the item behind each expanded row (``slots // K``).
        weights: [N] fp64, its routing weight; src_rank, src_token: [N] int64, its token's
            rank and place there.
    """

    slots: torch.Tensor
    here: torch.Tensor
    presum_index: torch.Tensor
    expand_src: torch.Tensor
    weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor

    def outputs(self, per_expert_host: torch.Tensor, device: torch.device) -> PlanOutputs:
        """The plan's outputs of a dispatch with this expansion (``per_expert_host``: its rows per local expert)."""
        return PlanOutputs(self.weights, plan.to_device(per_expert_host, device), per_expert_host, self.src_rank,
                           self.src_token)


def expand(routing: torch.Tensor, topk: int, block: int, num_experts: int, world_size: int, rank: int,
           num_rows: int, width: int, items_here: int) -> Expansion:
    """Canonical order of the slots of this rank's local experts: on CPU one
    compiled call (``dispatch.kernels.plan_cpu``); on a GPU the same on the host
    where the items are at most ``HOST_PLAN_ITEMS`` (``plan_cpu.on_host``), else
    torch operations there; the same bits every way.

    Args:
        routing: [I, 2 + 2K] int64 routing rows (``ROUTING``) of the items; an item's
            order key, ``src_rank * block + src_token``, is unique among those with a
            slot here and in [0, W * block); ids are routed as ``plan.route`` routes
            them (empty slots, ids out of range and repeats are on no rank).
        num_rows: N, the slots on this rank (host, from the counts).
        width: J = min(K, E_local).
        items_here: R, the items with a slot here (host, from the counts).
    """
    args = (topk, block, num_experts, world_size, rank, num_rows, width, items_here)
    compiled = plan_cpu.on_cpu(routing)
    if compiled is not None:
        return Expansion(*compiled.expand(routing, *args))
    if routing.shape[0] <= HOST_PLAN_ITEMS and plan_cpu.module() is not None:
        return Expansion(*plan_cpu.on_host("expand", routing, *args))
    return expand_reference(routing, *args)


def expand_reference(routing, topk, block, num_experts, world_size, rank, num_rows, width, items_here) -> Expansion:
    """:func:`expand` in torch operations (any device)."""
    local_expert = local_experts(routing[:, 2 : 2 + topk], num_experts, world_size, rank)
    items = local_expert.shape[0]
    device = local_expert.device
    key_span = world_size * block
    mine = local_expert >= 0
    order_key = routing[:, 0] * block + routing[:, 1]
    keys = torch.where(mine, local_expert * key_span + order_key.unsqueeze(1), PAD).flatten()
    order = torch.sort(keys).indices  # unique keys: one slot per (item, expert)
    slots = order[:num_rows]
    row_of_slot = torch.empty(items * topk, dtype=torch.int64, device=device)
    row_of_slot[order] = torch.arange(items * topk, device=device)
    smaller = mine.unsqueeze(1) & (local_expert.unsqueeze(1) < local_expert.unsqueeze(2))  # [I, K, K]
    col = torch.where(mine, smaller.sum(2), 0)
    presum = torch.full((items + 1, max(width, 1)), -1, dtype=torch.int64, device=device)
    item = torch.arange(items, device=device).unsqueeze(1).expand(items, topk)
    presum.index_put_((torch.where(mine, item, items), col), row_of_slot.view(items, topk))
    # the items here, placed by their rank among them: no host read
    hit_here = mine.any(1)
    here = torch.empty(items_here + 1, dtype=torch.int64, device=device)
    here.scatter_(0, torch.where(hit_here, torch.cumsum(hit_here, 0) - 1, items_here),
                  torch.arange(items, device=device))
    here = here[:items_here]
    expand_src = torch.div(slots, topk, rounding_mode="floor")
    return Expansion(
        slots=slots,
        here=here,
        presum_index=presum[:items, :width].index_select(0, here),
        expand_src=expand_src,
        weights=routing[:, 2 + topk :].contiguous().view(torch.float64).flatten().index_select(0, slots),
        src_rank=routing[:, 0].index_select(0, expand_src),
        src_token=routing[:, 1].index_select(0, expand_src),
    )


def local_experts(topk_idx: torch.Tensor, num_experts: int, world_size: int, rank: int) -> torch.Tensor:
    """[I, K] int64 local expert of each slot whose expert lives on ``rank``, else -1.

    Empty slots, ids out of range and repeats of an earlier slot's expert are
    not on any rank (as in ``plan.route``).
    """
    dest = plan.route(topk_idx, num_experts, world_size).dest
    per_rank = num_experts // world_size
    return torch.where(dest == rank, topk_idx.long() - rank * per_rank, -1)


def send_order(hit: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(``plan.items_by_row``, ``plan.rows_by_item``) of items going out
    destination-major (``plan.send_positions``): the item of each of the
    sum(``sizes``) send rows, and [I, D] each item's rows ascending, -1
    padded; on CPU one compiled call (``dispatch.kernels.plan_cpu``).

    Args:
        hit: [I, D] bool, item i goes to destination d.
        sizes: host rows per destination (``hit.sum(0)``).
    """
    compiled = plan_cpu.on_cpu(hit)
    if compiled is not None:
        return tuple(compiled.send_order(hit, list(sizes)))
    position = plan.send_positions(hit, sizes)
    return plan.items_by_row(hit, position, sum(sizes)), plan.rows_by_item(hit, position)
