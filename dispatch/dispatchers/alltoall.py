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
from dispatch.dispatchers.base import CombineHandle, Pending, PlanOutputs, TokenDispatcher
from dispatch.kernels.gather_sum import gather_sum
from dispatch.plan_graph import PlanGraphCache, PlanKey, plan_summary, route_phase, send_phase
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
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, check_values: bool
    ) -> tuple[AllToAllHandle, PlanOutputs]:
        world, rank, num_experts = self.world_size, self.rank, self.config.num_experts
        num_tokens, topk = topk_idx.shape
        weights = topk_weights.detach()
        check_values = check_values and num_tokens > 0
        header_row = self._header_row(x, topk_weights, topk)
        captured = None
        if self._graphs is not None and topk_idx.is_cuda and num_tokens > 0:
            key = PlanKey(num_tokens, topk, topk_idx.dtype, weights.dtype, topk_idx.device, check_values)
            captured = self._graphs.get(key, num_experts, world, rank)
        if captured is not None:
            flags, row = captured.run_route(topk_idx, weights, header_row)
        else:
            flags, route, row = route_phase(topk_idx, weights, header_row, num_experts, world, check_values)
        if flags is not None:  # before the first exchange
            checks.raise_for_values(flags.cpu(), topk_idx, weights, num_experts)  # host sync: value checks
        gathered = comm.all_gather_rows(row, self.group, world, out=None if captured is None else captured.gathered)
        planned = captured.run_send() if captured is not None else send_phase(route, gathered, rank, topk_idx, weights)
        summary = planned.summary.cpu()  # host sync: split sizes for NCCL, row counts, peers' headers
        experts_end = 2 * world + self.num_local_experts
        grads_any = checks.check_peer_headers(summary[experts_end:].view(world, -1))
        keep = (lambda t: t.clone()) if captured is not None else (lambda t: t)  # noqa: E731
        all_counts = plan.split_gathered(gathered, world)[0]
        host = summary[:experts_end]
        send_splits, recv_splits = _splits(host, world)
        recv_meta = comm.all_to_all_rows(planned.send.meta[: sum(send_splits)], send_splits, recv_splits, self.group)
        return self._complete_plan(
            planned.send, host, planned.summary[:experts_end], all_counts, recv_meta,
            topk_idx, weights.dtype, grads_any, keep,
        )

    def _plan_chunks(self, x, topk_idx, topk_weights, bounds, check_values):
        """All chunks from one route, one counts all-gather ([C, W, 1 + E_local]
        counts per rank), one host synchronisation and one metadata all-to-all
        (every chunk's slot lists, chunk after chunk for each peer). The plan
        runs eagerly (no CUDA graphs)."""
        world, rank, num_experts = self.world_size, self.rank, self.config.num_experts
        num_tokens, topk = topk_idx.shape
        chunks = len(bounds) - 1
        weights = topk_weights.detach()
        check_values = check_values and num_tokens > 0
        header_row = self._header_row(x, topk_weights, topk)
        flags, route, _ = route_phase(topk_idx, weights, header_row, num_experts, world, check_values)
        if flags is not None:  # before the first exchange
            checks.raise_for_values(flags.cpu(), topk_idx, weights, num_experts)  # host sync: value checks
        counts = plan.chunk_counts(route, topk_idx, bounds, num_experts)
        gathered = comm.all_gather_rows(torch.cat([counts.flatten(), header_row]), self.group, world)
        all_counts, headers = plan.split_gathered_chunks(gathered, world, chunks)
        sends, summaries = [], []
        for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            r = plan.Route(dest=route.dest[a:b], hit=route.hit[a:b], counts=counts[c])
            sends.append(plan.build_send_plan(r, all_counts[:, c], rank, topk_idx[a:b], weights[a:b]))
            summaries.append(plan_summary(r, all_counts[:, c], headers[:0], rank))
        # host sync: split sizes of every chunk for NCCL, row counts, peers' headers (once for all chunks)
        summary = torch.cat([*summaries, headers.flatten()]).cpu()
        per_chunk = 2 * world + self.num_local_experts
        grads_any = checks.check_peer_headers(summary[chunks * per_chunk :].view(world, -1))
        hosts = [summary[c * per_chunk : (c + 1) * per_chunk] for c in range(chunks)]
        recv_metas = self._exchange_chunk_meta(sends, [_splits(h, world) for h in hosts])
        return [
            self._complete_plan(
                sends[c], hosts[c], summaries[c], all_counts[:, c], recv_metas[c], topk_idx[a:b], weights.dtype,
                grads_any, lambda t: t,
            )
            for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))
        ]

    def _exchange_chunk_meta(self, sends, splits) -> list[torch.Tensor]:
        """One all-to-all of every chunk's slot lists: to each peer, chunk 0's rows
        for it, then chunk 1's, ...; from each peer the same. Returns the
        received metadata of each chunk, in source-rank order.

        Args:
            sends: per chunk, its :class:`plan.SendPlan` (``meta`` rows in
                destination-rank order).
            splits: per chunk, (send_splits, recv_splits) host row counts per peer.
        """
        world = self.world_size
        pieces = []
        for peer in range(world):
            for sp, (send, _) in zip(sends, splits):
                start = sum(send[:peer])
                pieces.append(sp.meta[start : start + send[peer]])
        send_total = tuple(sum(send[peer] for send, _ in splits) for peer in range(world))
        recv_total = tuple(sum(recv[peer] for _, recv in splits) for peer in range(world))
        received = comm.all_to_all_rows(torch.cat(pieces), send_total, recv_total, self.group)
        per_chunk = [[] for _ in splits]
        at = 0
        for peer in range(world):
            for c, (_, recv) in enumerate(splits):
                per_chunk[c].append(received[at : at + recv[peer]])
                at += recv[peer]
        return [torch.cat(rows) for rows in per_chunk]

    def _header_row(self, x, topk_weights, topk) -> torch.Tensor:
        header_row = torch.tensor(plan.header(x, topk_weights, topk), dtype=torch.int64)
        if x.is_cuda:  # from pinned memory, so the copy does not wait for the stream
            header_row = header_row.pin_memory().to(x.device, non_blocking=True)
        return header_row

    def _complete_plan(self, sp, summary, summary_dev, all_counts, recv_meta, topk_idx, weight_dtype, grads_any, keep):
        """Handle and outputs of one exchange, once its split sizes are on the host.

        Args:
            sp: the :class:`plan.SendPlan`.
            summary: [2 W + E_local] host int64: rows sent to / received from
                each rank, rows per local expert (``plan_summary`` without headers).
            summary_dev: the same on the device (at least 2 W + E_local entries).
            all_counts: [W_src, W_dst, 1 + E_local] all-gathered counts.
            recv_meta: the slot lists this rank received, in source-rank order.
            topk_idx: [T, K] of the exchange.
            grads_any: (x_grad_any, weights_grad_any) of the group.
            keep: applied to tensors that must outlive a replayed plan graph.
        """
        world, rank = self.world_size, self.rank
        num_tokens, topk = topk_idx.shape
        experts_end = 2 * world + self.num_local_experts
        send_splits, recv_splits = _splits(summary, world)
        per_expert_host = summary[2 * world : experts_end]
        num_send, num_rows = sum(send_splits), int(per_expert_host.sum())

        rp = plan.build_recv_plan(recv_meta, num_rows, plan.weight_wire_dtype(weight_dtype))
        recv_rank = torch.repeat_interleave(
            torch.arange(world, device=topk_idx.device), all_counts[:, rank, 0], output_size=sum(recv_splits)
        )
        handle = AllToAllHandle(
            owner=self,
            num_tokens=num_tokens,
            num_rows=num_rows,
            topk=topk,
            x_grad_any=grads_any[0],
            weights_grad_any=grads_any[1],
            send_splits=send_splits,
            recv_splits=recv_splits,
            send_token=keep(sp.send_token[:num_send]),
            home_index=keep(sp.home_index),
            slot_row=keep(sp.slot_row),
            slot_col=keep(sp.slot_col),
            expand_src=rp.expand_src,
            presum_index=rp.presum_index,
        )
        outputs = PlanOutputs(
            weights=rp.weights,
            tokens_per_expert=keep(summary_dev[2 * world : experts_end]),
            tokens_per_expert_host=per_expert_host,
            src_rank=recv_rank.index_select(0, rp.expand_src),
            src_token=rp.src_token.index_select(0, rp.expand_src),
        )
        mark(self.phase_timer, "plan")
        return handle, outputs

    def _to_experts(self, rows: torch.Tensor, handle: AllToAllHandle, codec: Codec) -> torch.Tensor:
        sent = codec.pack(rows, handle.send_token)
        received = comm.all_to_all_rows(sent, handle.send_splits, handle.recv_splits, self.group)
        mark(self.phase_timer, "exchange_out")
        expanded = codec.unpack(received, rows.dtype, rows.shape[1], handle.expand_src)
        mark(self.phase_timer, "expand")
        return expanded

    def _to_home(
        self,
        rows: torch.Tensor,
        handle: AllToAllHandle,
        weights: torch.Tensor | None,
        wire: torch.dtype,
    ) -> torch.Tensor:
        partial = gather_sum(rows, handle.presum_index, weights, wire)  # [R, H]
        mark(self.phase_timer, "presum")
        back = comm.all_to_all_rows(partial, handle.recv_splits, handle.send_splits, self.group)
        mark(self.phase_timer, "exchange_back")
        at_least = None if weights is None else weights.dtype  # fp64 weights: fp64 sums
        out = gather_sum(back, handle.home_index, None, rows.dtype, at_least)  # [T, H]
        mark(self.phase_timer, "final_sum")
        return out

    def _weights_to_home(self, values: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        index = handle.presum_index  # [R, J]
        padded = torch.cat([values, values.new_zeros(1)])  # last entry: padding
        grid = padded[torch.where(index >= 0, index, values.shape[0])]
        back = comm.all_to_all_rows(grid, handle.recv_splits, handle.send_splits, self.group)  # [S, J]
        return _slots_from_rows(back, handle, values)

    # -- chunked exchanges: collectives left in flight -------------------------

    def _to_experts_start(self, rows, handle, codec):
        sent = codec.pack(rows, handle.send_token)
        received, work = comm.all_to_all_rows_start(sent, handle.send_splits, handle.recv_splits, self.group)
        return Pending(work, lambda: codec.unpack(received, rows.dtype, rows.shape[1], handle.expand_src))

    def _to_home_start(self, rows, handle, weights, wire):
        partial = gather_sum(rows, handle.presum_index, weights, wire)  # [R, H]
        back, work = comm.all_to_all_rows_start(partial, handle.recv_splits, handle.send_splits, self.group)
        at_least = None if weights is None else weights.dtype
        return Pending(work, lambda: gather_sum(back, handle.home_index, None, rows.dtype, at_least))

    def _weights_to_home_start(self, values, handle):
        index = handle.presum_index  # [R, J]
        padded = torch.cat([values, values.new_zeros(1)])
        grid = padded[torch.where(index >= 0, index, values.shape[0])]
        back, work = comm.all_to_all_rows_start(grid, handle.recv_splits, handle.send_splits, self.group)
        return Pending(work, lambda: _slots_from_rows(back, handle, values))

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


def _splits(summary: torch.Tensor, world: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(send_splits, recv_splits) from a host plan summary [2 W + ...]."""
    return tuple(summary[:world].tolist()), tuple(summary[world : 2 * world].tolist())
