"""The ``hierarchical`` variant: across nodes once, then inside the node.

Notation as in ``dispatch.plan``; L ranks per node (``local_world_size``), M = W // L
nodes; group rank ``r`` is local index ``r % L`` of node ``r // L``. This rank is
(node a, index l).

Dispatch, two stages:

1. inter-node: each token goes once to every node n that holds one of its
   experts, to the rank (n, l) with this rank's local index (to itself for its
   own node), with its routing (source rank, token, expert ids, weights);
2. intra-node: that rank, the *holder*, forwards each token it received once to
   every rank of its node holding one of the token's experts, which expands it
   to canonical order.

Combine, in reverse: each rank pre-sums the slots of a token it holds (one row per
(token, rank), cast to the combine wire like the alltoall variant's), sends it
to the holder; the holder sums the rows of one token in ascending local index
(ascending rank) in fp32 (fp64) and sends one row per (token, node) across the
inter-node tier; the home rank sums them in ascending node order and casts once.
The partial of the home's own node never crosses a link and is kept in the
accumulation dtype. Sums are thus in ascending rank order, grouped by node:
with one node (1 x W) or one rank per node (W x 1) the result is bitwise the
alltoall variant's; otherwise within the rounding of the accumulation dtype
(and of a second wire cast per remote node) of it.

Process groups (created by the dispatcher from the EP group, once per EP group
and layout and shared by the dispatchers of that layout, since torch never
frees them): for every node n, an *intra* group of the group ranks
``[n L, ..., n L + L - 1]``; for every local index i, an *inter* group of the
ranks ``[i, i + L, ..., i + (M - 1) L]``. Every rank of the world calls
``dist.new_group`` for all of them in this order (so every rank must create its
hierarchical dispatchers in the same order, as for any ``new_group``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatch import comm, counts, plan
from dispatch.codec import Codec
from dispatch.handle import CombineHandle
from dispatch.streams import Done, Pending, PendingGroups
from dispatch.transports.base import Request, Transport, by_groups, handle_fields, shape_fields
from dispatch.kernels import plan_cpu
from dispatch.kernels.gather_sum import accumulate_dtype, gather_owned, gather_sum
from dispatch.stats import make_stats


@dataclass(frozen=True)
class TierGroups:
    """This rank's two tier groups (None where the tier has a single rank)."""

    intra: dist.ProcessGroup | None
    inter: dist.ProcessGroup | None


_TIER_GROUPS: dict[tuple, TierGroups] = {}  # process groups are never freed: one set per layout


def tier_groups(group: dist.ProcessGroup | None, local_world_size: int) -> TierGroups:
    """The intra-node and inter-node groups of this rank (see the module doc)."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    backend = str(dist.get_backend(group))
    key = (tuple(ranks), local_world_size, backend)
    if key in _TIER_GROUPS:
        return _TIER_GROUPS[key]
    me = dist.get_rank()
    nodes = len(ranks) // local_world_size
    intra = inter = None
    if local_world_size > 1:
        for n in range(nodes):
            members = ranks[n * local_world_size : (n + 1) * local_world_size]
            made = dist.new_group(members, backend=backend, use_local_synchronization=True)
            intra = made if me in members else intra
    if nodes > 1:
        for i in range(local_world_size):
            members = ranks[i::local_world_size]
            made = dist.new_group(members, backend=backend, use_local_synchronization=True)
            inter = made if me in members else inter
    _TIER_GROUPS[key] = TierGroups(intra, inter)
    return _TIER_GROUPS[key]


def tier_plan(gc: counts.GlobalCounts, rank: int, ranks_per_node: int) -> tuple:
    """This rank's host plan from the counts exchange (on CPU one compiled call,
    ``dispatch.kernels.plan_cpu``): ``(send1, recv1, send2, recv2, per_expert,
    send1_token, home_index, routing1, (self_send, self_recv, arrive, block))``: the rows of
    stage 1 to and from each node (lists of M), of stage 2 to and from each rank of
    this node (lists of L), [E_local] int64 host the slots of this rank's experts,
    stage 1's send order (``counts.send_order`` of ``gc.node_hit``) and its routing rows
    in that order, the offsets of this rank's own block in stage 1's send and held rows,
    the rows that arrive in stage 2 and the largest T (at least 1: ``counts.expand``'s block).
    """
    compiled = plan_cpu.on_cpu(gc.node_hit)
    if compiled is not None:
        return compiled.tier_plan(gc.counts, gc.node_hits, gc.tokens, gc.node_hit, gc.routing, rank, ranks_per_node)
    return tier_plan_reference(gc, rank, ranks_per_node)


def tier_plan_reference(gc: counts.GlobalCounts, rank: int, ranks_per_node: int) -> tuple:
    """:func:`tier_plan` in torch operations (the node hits on any device)."""
    nodes = gc.node_hits.shape[1]
    node, index = divmod(rank, ranks_per_node)
    hits = gc.counts[:, :, 0]  # [W_src, W_dst]
    holders = list(range(index, nodes * ranks_per_node, ranks_per_node))  # sources whose tokens this rank holds
    send1, recv1 = gc.node_hits[rank].tolist(), gc.node_hits[holders, node].tolist()
    send2 = hits[holders, node * ranks_per_node : (node + 1) * ranks_per_node].sum(0).tolist()
    recv2 = hits[:, rank].view(nodes, ranks_per_node).sum(0).tolist()
    send1_token, home_index = counts.send_order(gc.node_hit, tuple(send1))
    return (send1, recv1, send2, recv2, gc.counts[:, rank, 1:].sum(0), send1_token, home_index,
            gc.routing.index_select(0, send1_token),
            (sum(send1[:node]), sum(recv1[:node]), sum(recv2), max(int(gc.tokens.max()), 1)))


def forward_order(routing: torch.Tensor, topk: int, num_experts: int, world_size: int, first: int,
                  sizes: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``counts.send_order`` of the routing rows (``counts.ROUTING``) a holder forwards
    in stage 2 to the ranks ``first .. first + len(sizes) - 1`` of its node that hold
    one of their experts (routed as ``plan.route`` routes them; on CPU one compiled call,
    on a GPU as ``counts.expand`` chooses), then the rows in that order.
    """
    compiled = plan_cpu.on_cpu(routing)
    if compiled is not None:
        return tuple(compiled.forward_order(routing, topk, num_experts, world_size, first, list(sizes)))
    if routing.shape[0] <= counts.HOST_PLAN_ITEMS and plan_cpu.module() is not None:  # (as counts.expand)
        return tuple(plan_cpu.on_host("forward_order", routing, topk, num_experts, world_size, first, list(sizes)))
    return forward_order_reference(routing, topk, num_experts, world_size, first, sizes)


def forward_order_reference(routing, topk, num_experts, world_size, first, sizes):
    """:func:`forward_order` in torch operations (any device)."""
    hit = plan.route(routing[:, 2 : 2 + topk], num_experts, world_size).hit[:, first : first + len(sizes)]
    items_by_row, rows_by_item = counts.send_order(hit, sizes)
    return items_by_row, rows_by_item, routing.index_select(0, items_by_row)


@dataclass(frozen=True, kw_only=True)
class HierarchicalHandle(CombineHandle):
    """Plan of one two-stage exchange (S1/R1: rows sent/held in stage 1, S2/R2 in stage 2).

    Attributes:
        send1, recv1: host rows per node (inter group) of stage 1.
        send2, recv2: host rows per local index (intra group) of stage 2.
        send1_token: [S1] int64, token of each stage-1 row (node, token ascending).
        home_index: [T, M] int64, stage-1 rows of each token, ascending node, -1 padded.
        send2_row: [S2] int64, held row of each stage-2 row (local index, held row ascending).
        node_index: [R1, L] int64, stage-2 rows of each held row, ascending index, -1 padded.
        slots: [N] int64, ``arrived row * K + k`` behind each expanded row (canonical order).
        expand_src: [N] int64, its arrived row (``slots // K``).
        presum_index: [R2, J] int64, expanded rows of each arrived row, -1 padded.
        self_send, self_recv: offsets of this rank's own block in stage 1's send and
            held rows (``send1[a]`` rows, the same on both sides).
    """

    send1: tuple[int, ...]
    recv1: tuple[int, ...]
    send2: tuple[int, ...]
    recv2: tuple[int, ...]
    send1_token: torch.Tensor
    home_index: torch.Tensor
    send2_row: torch.Tensor
    node_index: torch.Tensor
    slots: torch.Tensor
    expand_src: torch.Tensor
    presum_index: torch.Tensor
    self_send: int
    self_recv: int


class HierarchicalTransport(Transport):
    """Two-tier transport (``variant="hierarchical"``, over the process group's collectives).

    Attributes:
        local_world_size: L; ``node``, ``local_rank``: this rank's (a, l).
        tiers: :class:`TierGroups`.
    """

    variant = "hierarchical"

    def __init__(self, config, group=None) -> None:
        super().__init__(config, group)
        self.num_nodes = self.world_size // self.local_world_size
        self.node, self.local_rank = divmod(self.rank, self.local_world_size)
        self.tiers = tier_groups(group, self.local_world_size)

    def plan(self, request: Request):
        x, topk_idx, topk_weights, ticket = request.x, request.topk_idx, request.topk_weights, request.ticket
        check_values = request.check_values
        world, rank, local, node = self.world_size, self.rank, self.local_world_size, self.node
        num_experts = self.config.num_experts
        topk = topk_idx.shape[1]
        gc = counts.exchange(x, topk_idx, topk_weights, num_experts, local, self.group, world, rank, check_values,
                             self.arrivals, ticket, self.row_bytes(x), request.exact_memory_rows, request.groups, True)
        (send1, recv1, send2, recv2, per_expert_host, send1_token, home_index, routing1,
         (self_send, self_recv, arrive, block)) = tier_plan(gc, rank, local)
        send1, recv1, send2, recv2 = tuple(send1), tuple(recv1), tuple(send2), tuple(recv2)
        if gc.node_hit.device != x.device:  # routed on the host (counts.HOST_PLAN_ITEMS)
            send1_token, home_index, routing1 = plan_cpu.upload((send1_token, home_index, routing1), x.device)
        num_rows = gc.rows_per_rank[rank]

        # stage 1: my tokens' routing rows (counts.ROUTING) to (node b, index l)
        held = comm.all_to_all_rows(routing1, send1, recv1, self.tiers.inter)
        # stage 2: held rows to the ranks of this node holding their experts
        send2_row, node_index, routing2 = forward_order(held, topk, num_experts, world, node * local, send2)
        arrived = comm.all_to_all_rows(routing2, send2, recv2, self.tiers.intra)
        # (every arrived row has a slot here: the items here are all of them, ascending)
        ex = counts.expand(arrived, topk, block, num_experts, world, rank, num_rows,
                           min(topk, self.num_local_experts), arrive)
        handle = HierarchicalHandle(
            **handle_fields(request, self, num_rows, (gc.x_grad_any, gc.weights_grad_any), gc.has_rows),
            send1=send1,
            recv1=recv1,
            send2=send2,
            recv2=recv2,
            send1_token=send1_token,
            home_index=home_index,
            send2_row=send2_row,
            node_index=node_index,
            slots=ex.slots,
            expand_src=ex.expand_src,
            presum_index=ex.presum_index,
            self_send=self_send,
            self_recv=self_recv,
            **shape_fields(request, self.num_local_experts, per_expert_host.tolist(), num_rows),
        )
        if self.phase_timer is not None:
            self.phase_timer.mark("plan")
        return handle, ex.outputs(per_expert_host, x.device)

    def to_experts(self, rows: torch.Tensor, handle: HierarchicalHandle, codec: Codec,
                   own: bool = False) -> PendingGroups:
        packed = codec.pack(rows, handle.send1_token)
        held = comm.all_to_all_rows(packed, handle.send1, handle.recv1, self.tiers.inter)
        forward = held.index_select(0, handle.send2_row)
        arrived = comm.all_to_all_rows(forward, handle.send2, handle.recv2, self.tiers.intra)
        if self.phase_timer is not None:
            self.phase_timer.mark("exchange_out")
        expanded = codec.unpack(arrived, rows.dtype, rows.shape[1], handle.expand_src)
        if self.phase_timer is not None:
            self.phase_timer.mark("expand")
        return by_groups(Done(expanded), handle)

    def to_home(self, rows, handle: HierarchicalHandle, weights, wire) -> Pending:
        acc = accumulate_dtype(rows.dtype, wire, *([] if weights is None else [weights.dtype]))
        partial = gather_sum(rows, handle.presum_index, weights, wire)  # [R2, H]
        if self.phase_timer is not None:
            self.phase_timer.mark("presum")
        back2 = comm.all_to_all_rows(partial, handle.recv2, handle.send2, self.tiers.intra)  # [S2, H]
        node_sum = gather_sum(back2, handle.node_index, None, acc)  # [R1, H]
        back1 = node_sum  # one node: every partial is this node's
        if self.num_nodes > 1:
            back1 = comm.all_to_all_rows(node_sum.to(wire), handle.recv1, handle.send1, self.tiers.inter)  # [S1, H]
            if wire != acc:  # this node's partial crossed no link: keep it unrounded
                own = handle.send1[self.node]
                back1 = back1.to(acc)
                back1[handle.self_send : handle.self_send + own] = node_sum[handle.self_recv : handle.self_recv + own]
        if self.phase_timer is not None:
            self.phase_timer.mark("exchange_back")
        out = gather_sum(back1, handle.home_index, None, rows.dtype, acc)  # [T, H]
        if self.phase_timer is not None:
            self.phase_timer.mark("final_sum")
        return Done(out)

    def slots_home(self, values: torch.Tensor, handle: HierarchicalHandle) -> Pending:
        # each slot lives on one rank, the others hold zeros for it: gathered, not summed (signed zeros kept)
        topk = handle.topk
        grid = values.new_zeros(sum(handle.recv2) * topk)
        grid.index_copy_(0, handle.slots, values)
        grid = grid.view(-1, topk)  # [R2, K]
        back2 = comm.all_to_all_rows(grid, handle.recv2, handle.send2, self.tiers.intra)
        node_held = gather_owned(back2, handle.node_index)  # [R1, K]
        back1 = comm.all_to_all_rows(node_held, handle.recv1, handle.send1, self.tiers.inter)
        return Done(gather_owned(back1, handle.home_index))  # [T, K]

    def stats(self, handle: HierarchicalHandle, dispatch_row_bytes, combine_wire, hidden):
        node, index = self.node, self.local_rank
        inter_out = sum(handle.send1) - handle.send1[node]
        intra_out = sum(handle.send2) - handle.send2[index]
        inter_back = sum(handle.recv1) - handle.recv1[node]
        intra_back = sum(handle.recv2) - handle.recv2[index]
        return make_stats(
            self.local_world_size,
            (intra_out, inter_out),
            dispatch_row_bytes,
            (intra_back, inter_back),
            hidden * combine_wire.itemsize,
        )
