"""The ``allgather`` variant: every rank sees every token, takes its experts' rows.

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, N, J); T_max = the largest
T of the group (blocks are padded to it), R = tokens of the group with at least
one expert on this rank.

Dispatch: the routing rows ([T_max, 2 + 2K]: ``counts.ROUTING``) and the packed token
rows ([T_max] rows of the codec) are all-gathered; each rank expands the slots
of its local experts in canonical order. No per-destination split is needed,
which is what makes it cheap when K is large against W (a token reaches most
ranks anyway) and for small T (one collective, no metadata all-to-all).

Combine: the expert side pre-sums the slots of a token (one row per (token,
rank)), then

* fp32 wire: a reduce-scatter of a dense [W * T_max, H] fp32 buffer (zero rows
  for tokens not routed here). The backend sums in its own order, so results
  are within fp32 rounding of the reference's ascending-rank order, and not
  bitwise reproducible across backends or world layouts (they are from run to
  run on one setup);
* any other wire (bf16, fp16, fp64): an all-to-all of the [R, H] partials to
  their home ranks and a local fp32 (fp64) sum in ascending source rank: no
  reduction ever accumulates in a narrow dtype, and fp64 stays exact.

Exchanges per round trip: the counts all-gather (with one host sync), the
routing all-gather, the token all-gather, then the reduce-scatter or all-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatch import comm, counts
from dispatch.codec import Codec
from dispatch.handle import CombineHandle
from dispatch.streams import Done, Pending, PendingGroups
from dispatch.transports.base import Request, Transport, by_groups, handle_fields, shape_fields
from dispatch.kernels import plan_cpu
from dispatch.kernels.gather_sum import accumulate_dtype, bits_of, gather_sum
from dispatch.stats import make_stats, tier_split

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True, kw_only=True)
class AllGatherHandle(CombineHandle):
    """Plan of one all-gather exchange.

    Attributes:
        block: T_max, rows each rank contributes to the all-gathers.
        slots: [N] int64, gathered slot (``(src_rank * T_max + token) * K + k``)
            behind each expanded row, canonical order.
        expand_src: [N] int64, its gathered row (``slots // K``).
        recv_rows: [R] int64, gathered token rows with a slot here, ascending.
        presum_index: [R, J] int64, expanded rows of each of them, -1 padded.
        send_splits: host, rows of this rank's tokens each rank pre-sums (partials back).
        recv_splits: host, partials this rank sends to each home rank (R by source).
        home_index: [T, W] int64, rows of each token among the returned partials,
            ascending rank, -1 padded.
    """

    block: int
    slots: torch.Tensor
    expand_src: torch.Tensor
    recv_rows: torch.Tensor
    presum_index: torch.Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    home_index: torch.Tensor


class AllGatherTransport(Transport):
    """All-gather transport (``variant="allgather"``, over the process group's collectives)."""

    variant = "allgather"

    def plan(self, request: Request):
        x, topk_idx, topk_weights, ticket = request.x, request.topk_idx, request.topk_weights, request.ticket
        check_values = request.check_values
        world, rank = self.world_size, self.rank
        num_tokens, topk = topk_idx.shape
        gc = counts.exchange(
            x, topk_idx, topk_weights, self.config.num_experts, self.local_world_size, self.group, world, rank,
            check_values, self.arrivals, ticket, self.row_bytes(x), request.exact_memory_rows, request.groups, True,
        )
        block = int(gc.tokens.max())
        mine = gc.counts[:, rank]  # [W_src, 1 + E_local] host
        per_expert_host = mine[:, 1:].sum(0)
        num_rows = gc.rows_per_rank[rank]
        send_splits = tuple(gc.counts[rank, :, 0].tolist())
        recv_splits = tuple(mine[:, 0].tolist())

        home_index = counts.send_order(gc.route.hit, send_splits)[1]
        routing = gc.routing
        if gc.route.hit.device != x.device:  # routed on the host (counts.HOST_PLAN_ITEMS)
            routing, home_index = plan_cpu.upload((routing, home_index), x.device)
        # every rank's routing rows (counts.ROUTING), each rank's padded to the block (no ids)
        if block > num_tokens:  # block is the same on every rank
            routing = torch.cat([routing, routing.new_full((block - num_tokens, routing.shape[1]), -1)])
        if block > 0:
            routing = comm.all_gather_rows(routing.flatten(), self.group, world).view(world * block, -1)
        ex = counts.expand(routing, topk, block, self.config.num_experts, world, rank, num_rows,
                           min(topk, self.num_local_experts), sum(recv_splits))
        handle = AllGatherHandle(
            **handle_fields(request, self, num_rows, (gc.x_grad_any, gc.weights_grad_any), gc.has_rows),
            block=block,
            slots=ex.slots,
            expand_src=ex.expand_src,
            recv_rows=ex.here,
            presum_index=ex.presum_index,
            send_splits=send_splits,
            recv_splits=recv_splits,
            home_index=home_index,
            **shape_fields(request, self.num_local_experts, per_expert_host.tolist(), num_rows),
        )
        if self.phase_timer is not None:
            self.phase_timer.mark("plan")
        return handle, ex.outputs(per_expert_host, x.device)

    def to_experts(self, rows: torch.Tensor, handle: AllGatherHandle, codec: Codec,
                   own: bool = False) -> PendingGroups:
        packed = codec.pack(rows)
        pad = handle.block - packed.shape[0]
        if pad:
            packed = torch.cat([packed, packed.new_zeros(pad, *packed.shape[1:])])
        tail = packed.shape[1:]
        flat = packed.contiguous().view(-1).view(torch.uint8)
        if flat.shape[0] == 0:  # no rank has a token (every rank knows it from the counts)
            gathered = flat
        else:
            gathered = comm.all_gather_rows(flat, self.group, self.world_size)
        wire_rows = gathered.view(packed.dtype).view(self.world_size * handle.block, *tail)
        if self.phase_timer is not None:
            self.phase_timer.mark("exchange_out")
        expanded = codec.unpack(wire_rows, rows.dtype, rows.shape[1], handle.expand_src)
        if self.phase_timer is not None:
            self.phase_timer.mark("expand")
        return by_groups(Done(expanded), handle)

    def to_home(self, rows, handle: AllGatherHandle, weights, wire) -> Pending:
        hidden = rows.shape[1]
        acc = accumulate_dtype(rows.dtype, wire, *([] if weights is None else [weights.dtype]))
        if wire == torch.float32 and acc == torch.float32:  # fp64 data or weights: fp64 sums below
            partial = gather_sum(rows, handle.presum_index, weights, torch.float32)  # [R, H]
            dense = partial.new_zeros(self.world_size * handle.block, hidden)
            dense.index_copy_(0, handle.recv_rows, partial)
            if self.phase_timer is not None:
                self.phase_timer.mark("presum")
            if self.world_size == 1 or handle.block == 0:
                summed = dense
            else:
                summed = dense.new_empty(handle.block, hidden)
                _reduce_scatter(summed, dense, group=self.group)
            if self.phase_timer is not None:
                self.phase_timer.mark("exchange_back")
            out = summed[: handle.num_tokens].to(rows.dtype)
        else:
            partial = gather_sum(rows, handle.presum_index, weights, wire)  # [R, H]
            if self.phase_timer is not None:
                self.phase_timer.mark("presum")
            back = comm.all_to_all_rows(partial, handle.recv_splits, handle.send_splits, self.group)
            if self.phase_timer is not None:
                self.phase_timer.mark("exchange_back")
            out = gather_sum(back, handle.home_index, None, rows.dtype, acc)  # [T, H]
        if self.phase_timer is not None:
            self.phase_timer.mark("final_sum")
        return Done(out)

    def slots_home(self, values: torch.Tensor, handle: AllGatherHandle) -> Pending:
        world, block, topk = self.world_size, handle.block, handle.topk
        # each slot lives on one rank, the others send zeros for it: their bits summed as
        # integers give its own (a float sum from zero would turn -0.0 into +0.0)
        grid = values.new_zeros(world * block * topk)
        grid.index_copy_(0, handle.slots, values)
        grid = grid.view(world * block, topk)
        back = grid if block == 0 else comm.all_to_all_rows(grid, (block,) * world, (block,) * world, self.group)
        bits = bits_of(back).view(world, block, topk)
        return Done(bits.sum(0, dtype=bits.dtype).view(values.dtype)[: handle.num_tokens])

    def stats(self, handle: AllGatherHandle, dispatch_row_bytes, combine_wire, hidden):
        local, rank = self.local_world_size, self.rank
        blocks = tier_split((handle.block,) * self.world_size, rank, local)
        if combine_wire == torch.float32:
            back, back_bytes = blocks, 4 * hidden
        else:
            back, back_bytes = tier_split(handle.recv_splits, rank, local), hidden * combine_wire.itemsize
        return make_stats(local, blocks, dispatch_row_bytes, back, back_bytes)
