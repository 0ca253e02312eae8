"""The ``alltoall`` variant: one variable-split all-to-all per direction.

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, S, R, N, J).

Dispatch: a token crosses to a rank once, however many of its experts live there;
its slot list (which local experts, with their weights) rides along in a small
metadata all-to-all, and the receiver expands to one row per (token, local
expert) in canonical order. Combine: the expert side pre-sums the slots of a
token that live on it (one row per (token, rank) goes back), and the home rank
sums the partials in ascending rank order, in fp32, casting once.

Exchanges per round trip: one all-gather of the counts (fixed size), one
metadata all-to-all, one token all-to-all each way. One host synchronisation for
the split sizes NCCL needs, and one before any exchange for the value checks
when ``DispatchConfig.check_inputs`` is on. On CUDA the part of the plan before
the split sizes is replayed as CUDA graphs (``dispatch.plan_graph``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch import checks, comm, plan
from dispatch.codec import Codec
from dispatch.dispatchers.base import CombineHandle, PlanOutputs, TokenDispatcher
from dispatch.dispatchers.streams import Pending
from dispatch.kernels.gather_sum import gather_sum
from dispatch.plan_graph import PlanGraphCache, PlanKey, route_phase, send_phase
from dispatch.stats import make_stats, resolve_local_world_size, tier_split
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
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    send_token: torch.Tensor
    home_index: torch.Tensor
    slot_row: torch.Tensor
    slot_col: torch.Tensor
    expand_src: torch.Tensor
    presum_index: torch.Tensor


class AllToAllDispatcher(TokenDispatcher):
    """Deduplicated all-to-all dispatcher (``variant="alltoall"``)."""

    def __init__(self, config, group=None) -> None:
        super().__init__(config, group)
        self._graphs = PlanGraphCache() if config.plan_graphs else None
        self.local_world_size = resolve_local_world_size(config.local_world_size, self.world_size)

    def _plan(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, check_values: bool,
        budgets: tuple[int, int],
    ) -> tuple[AllToAllHandle, PlanOutputs]:
        """One route, one counts all-gather, one host synchronisation and one
        metadata all-to-all. On CUDA the part before the host synchronisation
        is replayed as CUDA graphs. If the values are bad, this rank marks
        itself failed in the row it all-gathers and raises after the
        all-gather, where its peers raise too (``checks.check_peer_headers``):
        none is left waiting."""
        world, rank, num_experts = self.world_size, self.rank, self.config.num_experts
        num_tokens, topk = topk_idx.shape
        weights = topk_weights.detach()
        check_values = check_values and num_tokens > 0
        header_row = plan.to_device(torch.tensor(plan.header(x, topk_weights, topk, budgets), dtype=torch.int64),
                                    x.device)
        captured, failed = None, None
        if self._graphs is not None and topk_idx.is_cuda and num_tokens > 0:
            key = PlanKey(num_tokens, topk, topk_idx.dtype, weights.dtype, topk_idx.device, check_values)
            captured = self._graphs.get(key, num_experts, world, rank)
        if captured is not None:
            flags, row = captured.run_route(topk_idx, weights, header_row)
        else:
            flags, route, row = route_phase(topk_idx, weights, header_row, num_experts, world, check_values)
        if flags is not None:  # before the first exchange
            failed = checks.values_error(flags.cpu(), topk_idx, weights, num_experts)  # host sync: value checks
        if failed is not None:  # the peers are about to wait in the all-gather: stop them there
            plan.mark_failed(row)
        gathered = comm.all_gather_rows(row, self.group, world, out=None if captured is None else captured.gathered,
                                        arrivals=self._arrivals)
        if failed is not None:
            raise failed  # its peers raise in check_peer_headers
        if captured is not None:
            planned = captured.run_send()
        else:
            planned = send_phase(route, gathered, rank, topk_idx, weights)
        summary = planned.summary.cpu()  # host sync: split sizes for NCCL, row counts, peers' headers
        counts_end = 2 * world + self.num_local_experts  # rows sent, rows received, rows per local expert
        headers_end = counts_end + world * len(plan.HEADER)
        headers = summary[counts_end:headers_end].view(world, -1)
        grads_any = checks.check_peer_headers(headers)
        matrix = summary[headers_end : headers_end + world * world].view(world, world)  # rows rank to rank
        checks.check_row_budgets(headers, summary[headers_end + world * world :].tolist(), self.row_bytes(x))
        # what outlives a replayed graph is copied out of its buffers
        keep = (lambda t: t.clone()) if captured is not None else (lambda t: t)  # noqa: E731
        sp = planned.send  # its meta is read at once, on the stream of the replays
        send_splits = tuple(summary[:world].tolist())
        recv_splits = tuple(summary[world : 2 * world].tolist())
        per_expert = summary[2 * world : counts_end]
        num_rows = int(per_expert.sum())
        recv_meta = comm.all_to_all_rows(sp.meta[: sum(send_splits)], send_splits, recv_splits, self.group)
        table = plan.recv_table([list(recv_splits)], [num_rows])
        rp = plan.build_recv_plan(
            recv_meta, plan.to_device(torch.tensor(table, dtype=torch.int64), recv_meta.device),
            num_rows, plan.weight_wire_dtype(weights.dtype),
        )
        handle = AllToAllHandle(
            owner=self,
            num_tokens=num_tokens,
            num_rows=num_rows,
            topk=topk,
            x_grad_any=grads_any[0],
            weights_grad_any=grads_any[1],
            has_rows=tuple(bool(n) for n in matrix.sum(0).tolist()),
            send_splits=send_splits,
            recv_splits=recv_splits,
            send_token=keep(sp.send_token[: sum(send_splits)]),
            home_index=keep(sp.home_index),
            slot_row=keep(sp.slot_row),
            slot_col=keep(sp.slot_col),
            expand_src=rp.expand_src,
            presum_index=rp.presum_index,
        )
        outputs = PlanOutputs(
            weights=rp.weights,
            tokens_per_expert=keep(planned.summary[2 * world : counts_end]),
            tokens_per_expert_host=per_expert,
            src_rank=rp.src_rank[rp.expand_all],
            src_token=rp.src_token[rp.expand_all],
        )
        mark(self.phase_timer, "plan")
        return handle, outputs

    def _to_experts(self, rows: torch.Tensor, handle: AllToAllHandle, codec: Codec) -> torch.Tensor:
        return self._to_experts_start(rows, handle, codec).finish()

    def _to_home(self, rows, handle: AllToAllHandle, weights, wire) -> torch.Tensor:
        return self._to_home_start(rows, handle, weights, wire).finish()

    def _weights_to_home(self, values: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        return self._weights_to_home_start(values, handle).finish()

    def _to_experts_start(self, rows: torch.Tensor, handle: AllToAllHandle, codec: Codec) -> Pending:
        sent = codec.pack(rows, handle.send_token)
        received, work = self._rows_start(sent, handle, back=False)

        def then():
            mark(self.phase_timer, "exchange_out")
            expanded = codec.unpack(received, rows.dtype, rows.shape[1], handle.expand_src)
            mark(self.phase_timer, "expand")
            return expanded

        return Pending(work, then)

    def _to_home_start(self, rows, handle: AllToAllHandle, weights, wire) -> Pending:
        partial = gather_sum(rows, handle.presum_index, weights, wire)  # [R, H]
        mark(self.phase_timer, "presum")
        back, work = self._rows_start(partial, handle, back=True)
        at_least = None if weights is None else weights.dtype  # fp64 weights: fp64 sums

        def then():
            mark(self.phase_timer, "exchange_back")
            out = gather_sum(back, handle.home_index, None, rows.dtype, at_least)  # [T, H]
            mark(self.phase_timer, "final_sum")
            return out

        return Pending(work, then)

    def _weights_to_home_start(self, values: torch.Tensor, handle: AllToAllHandle) -> Pending:
        index = handle.presum_index  # [R, J]
        padded = torch.cat([values, values.new_zeros(1)])  # last entry: padding
        grid = padded[torch.where(index >= 0, index, values.shape[0])]
        back, work = self._rows_start(grid, handle, back=True)  # [S, J]
        return Pending(work, lambda: _slots_from_rows(back, handle, values))

    def _rows_start(self, rows: torch.Tensor, handle: AllToAllHandle, back: bool):
        """Start the all-to-all of ``rows`` to the experts (``back=False``: send
        rows in, received rows out) or home (``back=True``: the reverse);
        (out, work) as ``comm.all_to_all_rows_start``."""
        if back:
            return comm.all_to_all_rows_start(rows, handle.recv_splits, handle.send_splits, self.group)
        return comm.all_to_all_rows_start(rows, handle.send_splits, handle.recv_splits, self.group)

    def _stats(self, handle: AllToAllHandle, dispatch_row_bytes, combine_wire, hidden):
        local = self.local_world_size
        return make_stats(
            local,
            tier_split(handle.send_splits, self.rank, local),
            dispatch_row_bytes,
            tier_split(handle.recv_splits, self.rank, local),  # partials go back the way rows came
            hidden * combine_wire.itemsize,
        )


def _slots_from_rows(back: torch.Tensor, handle: AllToAllHandle, values: torch.Tensor) -> torch.Tensor:
    """[S, J] per-row values come home -> [T, K] per-slot values (0 for empty slots)."""
    flat = torch.cat([back.flatten(), values.new_zeros(1)])
    at = torch.where(
        handle.slot_row >= 0, handle.slot_row * handle.presum_index.shape[1] + handle.slot_col, flat.numel() - 1
    )
    return flat[at]
