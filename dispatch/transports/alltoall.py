"""The ``alltoall`` variant: one variable-split all-to-all per direction.

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, S, R, N, J).

Dispatch: a token crosses to a rank once, however many of its experts live there;
its slot list (which local experts, with their weights) rides along in a small
metadata all-to-all, and the receiver expands to one row per (token, local
expert) in canonical order. Combine: the expert side pre-sums the slots of a
token that live on it (one row per (token, rank) goes back), and the home rank
sums the partials in ascending rank order, in fp32, casting once.

Exchanges per round trip: one all-gather of the counts (fixed size), one
metadata all-to-all, one token all-to-all each way. One host synchronisation, for
the split sizes NCCL needs: the value checks (``Tuning.check_inputs``) mark a
rank with bad values failed in the row it all-gathers, on the device, and it
raises once the split sizes are read (its peers too). On CUDA the part of the
plan before the split sizes is replayed as CUDA graphs (``dispatch.plan_graph``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch import checks, comm, plan
from dispatch.codec import Codec, sum_wire_dtype
from dispatch.handle import CombineHandle, PlanOutputs
from dispatch.streams import Pending, PendingGroups
from dispatch.transports.base import GroupSumsIssuer, Request, Transport, handle_fields, shape_fields
from dispatch.kernels import gather_sum as gather_sum_module
from dispatch.kernels.gather_sum import accumulate_dtype, accumulate_group, gather_sum
from dispatch.plan_graph import HostSummary, Kept, PlanGraphCache, PlanKey, route_phase, send_phase
from dispatch.stats import make_stats, tier_split
from dispatch.timing import mark


@dataclass(frozen=True, kw_only=True)
class AllToAllHandle(CombineHandle):
    """Plan of one all-to-all exchange (see ``dispatch.plan`` for each tensor).

    Attributes:
        send_splits, recv_splits: host row counts per peer.
        send_token: [S] source token of each send row.
        home_index: [T, W] send rows of each token, ascending rank, -1 padded.
        slot_row: [T, K] send row carrying each slot, -1 for empty slots.
        slot_col: [T, K] column of each slot in its row's slot list.
        expand_src: [N] received row of each expanded row.
        presum_index: [R, J] expanded rows of each received row, -1 padded.
        by_group: for a dispatch by groups of local experts, its splits by group
            (:class:`GroupSplits`); None for one group.
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    send_token: torch.Tensor
    home_index: torch.Tensor
    slot_row: torch.Tensor
    slot_col: torch.Tensor
    expand_src: torch.Tensor
    presum_index: torch.Tensor
    by_group: "GroupSplits | None" = None


@dataclass(frozen=True)
class GroupSplits:
    """How an exchange by G groups of local experts moves, piece by piece.

    Rows leave group after group (``send_token`` is in that order: first
    group, then destination, then token), each group's piece one all-to-all;
    they are received (and held, ``presum_index``) group after group, each
    group's by (source rank, token). A row crosses with the first group of the
    destination that needs it. Pre-sums go home by the group that completes
    them (last group, then source rank, then token), and the slot lists and
    the per-slot values of ``combine_slots`` in one all-to-all in the order the
    slot lists arrived.

    Attributes:
        send, recv: [G][W] host rows of each group's piece to / from each rank.
        back_send, back_recv: [G][W] host pre-sums each group completes, sent
            to each home rank / received from each expert rank.
        expand_col: [N] int64, the column of each expanded row in its received
            row's slot list (``presum_index``).
        back_place: [R] int64, each received row's place among the pre-sums
            going home.
        held_of_arrival: [R] int64, the held row of each row in the order the
            slot lists arrived.
    """

    send: tuple[tuple[int, ...], ...]
    recv: tuple[tuple[int, ...], ...]
    back_send: tuple[tuple[int, ...], ...]
    back_recv: tuple[tuple[int, ...], ...]
    expand_col: torch.Tensor
    back_place: torch.Tensor
    held_of_arrival: torch.Tensor


class AllToAllTransport(Transport):
    """Deduplicated all-to-all over the process group's collectives
    (``variant="alltoall"``, ``transport="nccl"``; gloo on CPU)."""

    variant = "alltoall"
    # every rank's counts row, where not ``comm.all_gather_rows`` (looked up at each call):
    # (row, group, W, out=, arrivals=) -> [W, width]
    _gather_rows = None

    def __init__(self, config, group=None) -> None:
        super().__init__(config, group)
        self._graphs = PlanGraphCache() if config.tuning.plan_graphs else None

    def plan(self, request: Request) -> tuple[AllToAllHandle, PlanOutputs]:
        """One route, one counts all-gather, one host synchronisation and one
        metadata all-to-all; by groups, one piece per group
        (:class:`GroupSplits`). On CUDA the part before the host
        synchronisation is replayed as CUDA graphs. If the values are bad, this
        rank marks itself failed in the row it all-gathers, on the device, and
        raises once it reads the split sizes, where its peers raise too
        (``checks.check_peer_headers``): none is left waiting."""
        x, groups = request.x, request.groups
        weights = request.topk_weights.detach()
        planned, captured = self._counts_and_send_plan(request, plan.header(x, request.topk_weights,
                                                                            request.topk_idx.shape[1], request.ticket))
        world = self.world_size
        local = self.num_local_experts
        # host sync: split sizes for NCCL, row counts, peers' headers
        summary = HostSummary.read(planned.summary, world, local)
        headers = summary.headers
        self._raise_own_values(request, headers[self.rank])
        grads_any = checks.check_peer_headers(headers)
        checks.check_row_budgets(headers, summary.received, self.row_bytes(x), request.exact_memory_rows)
        checks.check_peer_groups(summary.groups)
        # what outlives a replayed graph is copied out of its buffers
        kept = captured.kept() if captured is not None else Kept.of(planned, world, local)
        sp = planned.send  # its meta is read at once, on the stream of the replays
        send_splits, recv_splits = summary.send, summary.recv
        per_expert_list = summary.per_expert
        num_rows = sum(per_expert_list)
        recv_meta = comm.all_to_all_rows(sp.meta[: sum(send_splits)], send_splits, recv_splits, self.group)
        # the slot lists arrive by source rank, each source's group after group; held group after group
        if groups == 1:  # made on the device with the plan (overwritten by the next replay: read at once)
            table = planned.table
        else:
            by_group = summary.by_group_tensor(world, local)
            group_recv = by_group[1, :, 0, :groups].t().tolist()
            table = plan.to_device(torch.tensor(plan.recv_table(group_recv), dtype=torch.int64), recv_meta.device)
        rp = plan.build_recv_plan(recv_meta, table, num_rows, plan.weight_wire_dtype(weights.dtype))
        splits = None
        if groups > 1:
            splits = _group_splits(by_group, groups, rp, table, kept.per_expert)
        if captured is not None:  # the replayed buffers read: the next call's replays may come
            captured.release()
        handle = AllToAllHandle(
            **handle_fields(request, self, num_rows, grads_any, summary.has_rows),
            send_splits=send_splits,
            recv_splits=recv_splits,
            send_token=kept.send_token[: sum(send_splits)],
            home_index=kept.home_index,
            slot_row=kept.slot_row,
            slot_col=kept.slot_col,
            expand_src=rp.expand_src,
            presum_index=rp.presum_index,
            by_group=splits,
            **shape_fields(request, local, per_expert_list, num_rows),
        )
        outputs = PlanOutputs(
            weights=rp.weights,
            tokens_per_expert=kept.per_expert,
            tokens_per_expert_host=summary.per_expert_host(),
            src_rank=rp.expanded_rank,
            src_token=rp.expanded_token,
        )
        if self.phase_timer is not None:
            self.phase_timer.mark("plan")
        return handle, outputs

    def _counts_and_send_plan(self, request: Request, header: "list[int] | torch.Tensor", bounded: bool = False,
                              grouped_sends: bool = True):
        """The plan up to the host read: route, counts all-gather, send plan (on
        CUDA replayed as CUDA graphs once a shape repeats). Returns (``Planned``,
        the captured plan or None: what outlives a replay is copied out of its
        buffers). Bad values raise the failed entry of this rank's row on the
        device (``checks.fold_flags``), for every rank to see in the summary it
        reads (no host read of their own: :meth:`_raise_own_values` after it).
        ``header``: this rank's ``plan.header`` (a tensor: its row on the device
        already, read at each replay of a capture that holds this plan).
        ``bounded``: nothing is read on the host, and the all-gather is not polled.
        ``grouped_sends``: by groups, the sends in the grouped orders
        (``plan.group_orders``); else in one order whatever G (G still
        travels in the row, for the ranks to agree on)."""
        x, topk_idx, groups = request.x, request.topk_idx, request.groups
        world, rank, num_experts = self.world_size, self.rank, self.config.num_experts
        num_tokens, topk = topk_idx.shape
        weights = request.topk_weights.detach()
        check_values = request.check_values and num_tokens > 0
        captured = None
        if (self._graphs is not None and topk_idx.is_cuda and num_tokens > 0 and (grouped_sends or groups == 1)
                and not torch.cuda.is_current_stream_capturing()):
            key = PlanKey(num_tokens, topk, topk_idx.dtype, weights.dtype, topk_idx.device, check_values, groups)
            captured = self._graphs.get(key, num_experts, world, rank)
        if captured is not None:
            row = captured.run_route(topk_idx, weights, torch.tensor(header, dtype=torch.int64))
        else:
            header_row = header if isinstance(header, torch.Tensor) else self._header_row(header, x.device)
            route, grouped, row = route_phase(topk_idx, weights, header_row, num_experts, world, check_values, groups)
        gather = self._gather_rows or comm.all_gather_rows
        gathered = gather(row, self.group, world, out=None if captured is None else captured.gathered,
                          arrivals=None if bounded else self.arrivals)
        if captured is not None:
            return captured.run_send(), captured
        return send_phase(route, grouped if grouped_sends else None, gathered, rank, topk_idx, weights, groups), None

    def _header_row(self, header: list[int], device: torch.device) -> torch.Tensor:
        """This rank's header entries on ``device`` (``plan.to_device``)."""
        return plan.to_device(torch.tensor(header, dtype=torch.int64), device)

    def to_experts(self, rows: torch.Tensor, handle: AllToAllHandle, codec: Codec,
                   own: bool = False) -> PendingGroups:
        if handle.by_group is not None:
            return self._to_experts_by_group(rows, handle, codec)
        sent = codec.pack(rows, handle.send_token)
        received, work = comm.all_to_all_rows_start(sent, handle.send_splits, handle.recv_splits, self.group)
        timer = self.phase_timer  # (marked where there is one: every dispatch's host path)

        def then():
            if timer is not None:
                timer.mark("exchange_out")
            expanded = codec.unpack(received, rows.dtype, rows.shape[1], handle.expand_src)
            if timer is not None:
                timer.mark("expand")
            return expanded

        return Pending(work, then)  # one group (by_group is None)

    def _to_experts_by_group(self, rows, handle: AllToAllHandle, codec: Codec) -> PendingGroups:
        splits = handle.by_group
        sent = codec.pack(rows, handle.send_token)  # group after group
        received = sent.new_empty(handle.presum_index.shape[0], *sent.shape[1:])
        works, thens, at_send, at_recv = [], [], 0, 0
        for g, (send, recv) in enumerate(zip(splits.send, splits.recv)):
            piece = received[at_recv : at_recv + sum(recv)]
            works.append(comm.all_to_all_rows_start(sent[at_send : at_send + sum(send)], send, recv, self.group,
                                                    out=piece)[1])
            at_send, at_recv = at_send + sum(send), at_recv + sum(recv)
            lo, hi = handle.row_range(g)
            # group g's rows come from the splits of groups up to g, all arrived by then
            thens.append(lambda lo=lo, hi=hi: codec.unpack(received, rows.dtype, rows.shape[1],
                                                           handle.expand_src[lo:hi]))
        mark(self.phase_timer, "exchange_out")
        return PendingGroups(works, thens)

    def group_sums(self, handle: AllToAllHandle, wire: str, dtype):
        if handle.by_group is None:
            return super().group_sums(handle, wire, dtype)
        return _GroupedPresums(self, handle, wire)

    def to_home(self, rows, handle: AllToAllHandle, weights, wire) -> Pending:
        if handle.by_group is not None:
            sums = _GroupedPresums(self, handle, wire)
            for g in range(handle.groups):
                part = slice(*handle.row_range(g))
                sums.add(g, rows[part], None if weights is None else weights[part])
            return sums.finish()
        timer = self.phase_timer  # (marked where there is one: every combine's host path)
        partial = gather_sum(rows, handle.presum_index, weights, wire)  # [R, H]
        if timer is not None:
            timer.mark("presum")
        back, work = comm.all_to_all_rows_start(partial, handle.recv_splits, handle.send_splits, self.group)
        at_least = None if weights is None else weights.dtype  # fp64 weights: fp64 sums

        def then():
            if timer is not None:
                timer.mark("exchange_back")
            out = gather_sum(back, handle.home_index, None, rows.dtype, at_least)  # [T, H]
            if timer is not None:
                timer.mark("final_sum")
            return out

        return Pending(work, then)

    def slots_home(self, values: torch.Tensor, handle: AllToAllHandle) -> Pending:
        index = handle.presum_index  # [R, J]
        padded = torch.cat([values, values.new_zeros(1)])  # last entry: padding
        grid = padded[torch.where(index >= 0, index, values.shape[0])]
        if handle.by_group is not None:  # back in the order the slot lists came
            grid = grid.index_select(0, handle.by_group.held_of_arrival)
        back, work = comm.all_to_all_rows_start(grid, handle.recv_splits, handle.send_splits, self.group)  # [S, J]
        return Pending(work, lambda: _slots_from_rows(back, handle, values))

    def stats(self, handle: AllToAllHandle, dispatch_row_bytes, combine_wire, hidden):
        local = self.local_world_size
        return make_stats(
            local,
            tier_split(handle.send_splits, self.rank, local),
            dispatch_row_bytes,
            tier_split(handle.recv_splits, self.rank, local),  # partials go back the way rows came
            hidden * combine_wire.itemsize,
        )


class _GroupedPresums(GroupSumsIssuer):
    """The expert side's pre-sums of an exchange by groups: each group's rows
    are added into running sums (``accumulate_group``), the pre-sums a group
    completes go home as that group's all-to-all, and the home rank sums them
    in ascending rank order once all are in: bitwise ``to_home``'s."""

    def __init__(self, dispatcher: AllToAllTransport, handle: AllToAllHandle, wire) -> None:
        """``wire``: the pre-sums' wire dtype, or the name of their wire format."""
        self._dispatcher, self._handle, self._wire = dispatcher, handle, wire
        self._works: list = []
        self._acc = self._out = self._home = None
        self._dtype = self._weights_dtype = None
        self._at_send = self._at_recv = 0

    def add(self, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
        handle, splits = self._handle, self._handle.by_group
        if self._acc is None:
            if isinstance(self._wire, str):
                self._wire = sum_wire_dtype(self._wire, rows.dtype)
            held, hidden = handle.presum_index.shape[0], rows.shape[1]
            self._weights_dtype = None if weights is None else weights.dtype
            extra = () if weights is None else (weights.dtype,)
            acc_dtype = accumulate_dtype(rows.dtype, self._wire, *extra)
            zeroed = not (rows.is_cuda and gather_sum_module.triton is not None)  # the reference adds to zeros
            make = torch.zeros if zeroed else torch.empty
            self._acc = make(held, hidden, dtype=acc_dtype, device=rows.device)
            self._out = torch.empty(held, hidden, dtype=self._wire, device=rows.device)
            home_rows = sum(sum(recv) for recv in splits.back_recv)
            self._home = torch.empty(home_rows, hidden, dtype=self._wire, device=rows.device)
            self._dtype = rows.dtype
        lo, hi = handle.row_range(g)
        accumulate_group(self._acc, self._out, rows, handle.presum_index, weights, lo, hi, splits.back_place,
                         handle.expand_src, splits.expand_col)
        send, recv = splits.back_send[g], splits.back_recv[g]
        piece = self._out[self._at_send : self._at_send + sum(send)]
        home = self._home[self._at_recv : self._at_recv + sum(recv)]
        self._works.append(comm.all_to_all_rows_start(piece, send, recv, self._dispatcher.group,
                                                      out=home)[1])
        self._at_send, self._at_recv = self._at_send + sum(send), self._at_recv + sum(recv)
        if g + 1 == handle.groups:
            self._acc = None  # the running sums are spent

    def finish(self) -> Pending:
        at_least = self._weights_dtype  # fp64 weights: fp64 sums
        works, home, dtype, handle = self._works, self._home, self._dtype, self._handle

        def then():
            for work in works:
                if work is not None:
                    work.wait()
            mark(self._dispatcher.phase_timer, "exchange_back")
            return gather_sum(home, handle.home_index, None, dtype, at_least)

        return Pending(None, then)


def _group_splits(by_group: torch.Tensor, groups: int, rp: plan.RecvPlan, table: torch.Tensor,
            per_expert: torch.Tensor) -> GroupSplits:
    """The :class:`GroupSplits` of a plan by ``groups`` groups, from the
    summary's rows by group (``by_group`` [2, W, 2, E_local] on the host: this
    rank's to each rank, then each rank's to this one; by first, then last
    group), the receive plan, its table and the rows per local expert on the
    device (nothing here is copied to the device or read back)."""
    index = rp.presum_index
    device = index.device
    world = by_group.shape[1]
    counts = by_group[..., :groups].tolist()  # [2][W][2][G]
    send, recv, back_send, back_recv = (
        tuple(tuple(counts[side][r][which][g] for r in range(world)) for g in range(groups))
        for side, which in ((0, 0), (1, 0), (1, 1), (0, 1)))
    num_rows, held = rp.expand_src.shape[0], index.shape[0]
    width = index.shape[1]
    # the column of each expanded row in its received row's slot list
    column = torch.arange(width, device=device).expand(held, width)
    at = torch.where(index >= 0, index, num_rows).flatten()
    expand_col = torch.empty(num_rows + 1, dtype=torch.int64, device=device).scatter_(0, at, column.flatten())
    # pre-sums go home by the group of their last slot (the group of its local
    # expert, as plan.group_route), then source rank, then token
    local = per_expert.shape[0]
    expert = torch.searchsorted(torch.cumsum(per_expert, 0), index.max(1).values, right=True)
    last = ((expert + 1) * groups - 1) // local
    key = ((last * world + rp.src_rank) << 32) + rp.src_token
    order = torch.sort(key).indices
    back_place = torch.empty_like(order)
    back_place[order] = torch.arange(held, device=device)
    arrival_start, held_start = table[0], table[1]
    arrival = torch.arange(held, device=device)
    block = torch.searchsorted(arrival_start, arrival, right=True) - 1
    held_of_arrival = held_start[block] + arrival - arrival_start[block]
    return GroupSplits(send, recv, back_send, back_recv, expand_col[:num_rows], back_place, held_of_arrival)


def _slots_from_rows(back: torch.Tensor, handle: AllToAllHandle, values: torch.Tensor) -> torch.Tensor:
    """[S, J] per-row values come home -> [T, K] per-slot values (0 for empty slots)."""
    flat = torch.cat([back.flatten(), values.new_zeros(1)])
    at = torch.where(
        handle.slot_row >= 0, handle.slot_row * handle.presum_index.shape[1] + handle.slot_col, flat.numel() - 1
    )
    return flat[at]
