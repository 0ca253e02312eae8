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
when ``DispatchConfig.check_inputs`` is on (``MoEExchange(local_first=True)``
always has it: it reads the own rows' counts there too). On CUDA the part of the plan before
the split sizes is replayed as CUDA graphs (``dispatch.plan_graph``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch import checks, comm, plan
from dispatch.codec import Codec
from dispatch.dispatchers.base import CombineHandle, Pending, PlanOutputs, TokenDispatcher
from dispatch.kernels.gather_sum import gather_sum
from dispatch.plan_graph import PlanGraphCache, PlanKey, route_phase, send_phase
from dispatch.stats import make_stats, resolve_local_world_size, tier_split
from dispatch.timing import mark


@dataclass(frozen=True, kw_only=True)
class AllToAllHandle(CombineHandle):
    """Plan of one all-to-all exchange (see ``dispatch.plan`` for each tensor).

    Attributes:
        send_splits, recv_splits: host row counts per peer.
        split_matrix: host row counts of every rank to every rank
            (``split_matrix[rank] == send_splits``; a peer-copy transport reads it).
        send_token: [S] source token of each send row.
        home_index: [T, W] send rows of each token, ascending rank, -1 padded.
        slot_row: [T, K] send row carrying each slot, -1 for empty slots.
        slot_col: [T, K] column of each slot in its row's slot list.
        expand_src: [N] received row of each expanded row.
        presum_index: [R, J] expanded rows of each received row, -1 padded.
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    split_matrix: tuple[tuple[int, ...], ...]
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
        return self._plan_exchanges(x, topk_idx, topk_weights, (0, topk_idx.shape[0]), check_values)[0]

    def _plan_chunks(self, x, topk_idx, topk_weights, bounds, check_values, early=None):
        return self._plan_exchanges(x, topk_idx, topk_weights, bounds, check_values, early=early)

    def _plan_exchanges(self, x, topk_idx, topk_weights, bounds, check_values, beside=None, early=None):
        """The plan of an exchange in C chunks of home tokens (C = 1: ``dispatch``):
        one route, one counts all-gather ([C, W, 1 + E_local] counts per rank),
        one host synchronisation and one metadata all-to-all serve all chunks,
        and each chunk's handle is slices of the same tensors. On CUDA the part
        before the host synchronisation is replayed as CUDA graphs. ``beside()``,
        if given, is called once the values are checked, before the first
        collective, with this rank's ``plan.OwnKeys`` and its counts of each
        chunk on the host ([C, W, 1 + E_local], read in the same host
        synchronisation as the value checks): ``MoEExchange(local_first=True)``
        queues its own rows' work there. If the values are bad or ``beside``
        raises, this rank marks itself failed in the row it all-gathers and
        raises after the all-gather, where its peers raise too
        (``checks.check_peer_headers``): none is left waiting.
        ``early(splits, send_token)``, if given, is called once the split sizes
        are on the host, every rank's header is checked and the metadata
        all-to-all is issued, before the receive plan is made, with per chunk
        (send splits, receive splits, split matrix) and the send rows' tokens
        (``plan.SendPlan.send_token``, chunk-major): the pipelines start their
        first chunks' token all-to-alls there (``MoEExchange``'s ``ahead``), so
        that their bytes move while the receive plan is made (which waits for
        the metadata only). Every rank of
        the group must pass one (the collectives' order is the same on all)."""
        world, rank, num_experts = self.world_size, self.rank, self.config.num_experts
        num_tokens, topk = topk_idx.shape
        chunks = len(bounds) - 1
        weights = topk_weights.detach()
        check_values = check_values and num_tokens > 0
        header_row = self._header_row(x, topk_weights, topk)
        captured, failed = None, None
        if self._graphs is not None and topk_idx.is_cuda and num_tokens > 0:
            key = PlanKey(num_tokens, topk, topk_idx.dtype, weights.dtype, topk_idx.device, check_values,
                          tuple(bounds), beside is not None)
            captured = self._graphs.get(key, num_experts, world, rank)
        own_rank = None if beside is None else rank
        if captured is not None:
            flags, row, own = captured.run_route(topk_idx, weights, header_row)
        else:
            chunks_of_tokens = plan.token_chunks(bounds, topk_idx.device)
            flags, route, counts, row, own = route_phase(
                topk_idx, weights, header_row, num_experts, world, check_values, chunks_of_tokens, chunks, own_rank
            )
        if beside is None:
            if flags is not None:  # before the first exchange
                failed = checks.values_error(flags.cpu(), topk_idx, weights, num_experts)  # host sync: value checks
        else:
            width = chunks * world * (1 + self.num_local_experts)  # this rank's counts of each chunk
            host = torch.cat([row[:width]] + ([] if flags is None else [flags.long()])).cpu()  # host sync:
            if flags is not None:  # the counts ``beside`` takes, and the value checks if on
                failed = checks.values_error(host[width:].bool(), topk_idx, weights, num_experts)
            if failed is None:
                try:
                    beside(own, host[:width].view(chunks, world, -1))
                except Exception as exc:
                    failed = exc
        if failed is not None:  # the peers are about to wait in the all-gather: stop them there
            plan.mark_failed(row)
        gathered = comm.all_gather_rows(row, self.group, world, out=None if captured is None else captured.gathered)
        if failed is not None:
            raise failed  # its peers raise in check_peer_headers
        if captured is not None:
            planned = captured.run_send()
        else:
            planned = send_phase(route, counts, gathered, rank, topk_idx, weights, chunks_of_tokens)
        summary = planned.summary.cpu()  # host sync: split sizes of every chunk for NCCL, row counts, peers' headers
        per_chunk = 2 * world + self.num_local_experts
        headers_end = chunks * per_chunk + world * len(plan.HEADER)
        grads_any = checks.check_peer_headers(summary[chunks * per_chunk : headers_end].view(world, -1))
        matrices = summary[headers_end:].view(chunks, world, world).tolist()
        # what outlives a replayed graph is copied out of its buffers
        keep = (lambda t: t.clone()) if captured is not None else (lambda t: t)  # noqa: E731
        sent_plan = planned.send  # its meta is read at once, on the stream of the replays
        sp = plan.SendPlan(keep(sent_plan.send_token), sent_plan.meta, *(
            keep(t) for t in (sent_plan.home_index, sent_plan.slot_row, sent_plan.slot_col)))
        per_expert_dev = keep(planned.summary[: chunks * per_chunk]).view(chunks, per_chunk)[:, 2 * world :]
        host = summary[: chunks * per_chunk].view(chunks, per_chunk)
        send_rows, recv_rows, per_expert = host[:, :world], host[:, world : 2 * world], host[:, 2 * world :]
        splits = [(tuple(send_rows[c].tolist()), tuple(recv_rows[c].tolist()), tuple(map(tuple, matrices[c])))
                  for c in range(chunks)]  # per chunk: send splits, receive splits, split matrix
        recv_meta = comm.all_to_all_rows(
            sp.meta[: int(send_rows.sum())], tuple(send_rows.sum(0).tolist()), tuple(recv_rows.sum(0).tolist()),
            self.group,
        )
        if early is not None:
            early(splits, sp.send_token)
        table = plan.recv_table(recv_rows.tolist(), per_expert.sum(1).tolist())
        rp = plan.build_recv_plan(
            recv_meta, plan.to_device(torch.tensor(table, dtype=torch.int64), recv_meta.device),
            int(per_expert.sum()), plan.weight_wire_dtype(weights.dtype),
        )
        src_rank, src_token = rp.src_rank[rp.expand_all], rp.src_token[rp.expand_all]
        out = []
        sent = received = expanded = 0
        for c, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
            send_splits, recv_splits, matrix = splits[c]
            num_send, num_recv, num_rows = sum(send_splits), sum(recv_splits), int(per_expert[c].sum())
            rows = slice(expanded, expanded + num_rows)
            handle = AllToAllHandle(
                owner=self,
                num_tokens=b - a,
                num_rows=num_rows,
                topk=topk,
                x_grad_any=grads_any[0],
                weights_grad_any=grads_any[1],
                has_rows=tuple(any(column) for column in zip(*matrix)),
                send_splits=send_splits,
                recv_splits=recv_splits,
                split_matrix=matrix,
                send_token=sp.send_token[sent : sent + num_send],
                home_index=sp.home_index[a:b],
                slot_row=sp.slot_row[a:b],
                slot_col=sp.slot_col[a:b],
                expand_src=rp.expand_src[rows],
                presum_index=rp.presum_index[received : received + num_recv],
            )
            outputs = PlanOutputs(
                weights=rp.weights[rows],
                tokens_per_expert=per_expert_dev[c],
                tokens_per_expert_host=per_expert[c],
                src_rank=src_rank[rows],
                src_token=src_token[rows],
            )
            out.append((handle, outputs))
            sent, received, expanded = sent + num_send, received + num_recv, expanded + num_rows
        mark(self.phase_timer, "plan")
        return out

    def _header_row(self, x, topk_weights, topk) -> torch.Tensor:
        return plan.to_device(torch.tensor(plan.header(x, topk_weights, topk), dtype=torch.int64), x.device)

    def _to_experts(self, rows: torch.Tensor, handle: AllToAllHandle, codec: Codec) -> torch.Tensor:
        sent = codec.pack(rows, handle.send_token)
        received = self._rows(sent, handle, back=False)
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
        back = self._rows(partial, handle, back=True)
        mark(self.phase_timer, "exchange_back")
        at_least = None if weights is None else weights.dtype  # fp64 weights: fp64 sums
        out = gather_sum(back, handle.home_index, None, rows.dtype, at_least)  # [T, H]
        mark(self.phase_timer, "final_sum")
        return out

    def _weights_to_home(self, values: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        index = handle.presum_index  # [R, J]
        padded = torch.cat([values, values.new_zeros(1)])  # last entry: padding
        grid = padded[torch.where(index >= 0, index, values.shape[0])]
        back = self._rows(grid, handle, back=True)  # [S, J]
        return _slots_from_rows(back, handle, values)

    def _rows_start(self, rows: torch.Tensor, handle: AllToAllHandle, back: bool):
        """Start the all-to-all of ``rows`` to the experts (``back=False``: send
        rows in, received rows out) or home (``back=True``: the reverse);
        (out, work) as ``comm.all_to_all_rows_start``."""
        if back:
            return comm.all_to_all_rows_start(rows, handle.recv_splits, handle.send_splits, self.group)
        return comm.all_to_all_rows_start(rows, handle.send_splits, handle.recv_splits, self.group)

    def _rows(self, rows: torch.Tensor, handle: AllToAllHandle, back: bool) -> torch.Tensor:
        out, work = self._rows_start(rows, handle, back)
        if work is not None:
            work.wait()
        return out

    # -- chunked exchanges: collectives left in flight -------------------------

    def _to_experts_start(self, rows, handle, codec):
        return self._to_experts_started(self._rows_start(codec.pack(rows, handle.send_token), handle, back=False),
                                        codec, rows.dtype, rows.shape[1], handle.expand_src)

    def _to_experts_started(self, started, codec, dtype, hidden, expand):
        """The rest of ``_to_experts_start`` for an all-to-all already started
        (``started``: (received, work) of ``_rows_start``) from rows of
        ``dtype``, ``hidden`` wide: unpacked to the received rows ``expand``
        (``handle.expand_src``, or part of it)."""
        received, work = started
        return Pending(work, lambda: codec.unpack(received, dtype, hidden, expand))

    def _to_home_start(self, rows, handle, weights, wire):
        partial = gather_sum(rows, handle.presum_index, weights, wire)  # [R, H]
        back, work = self._rows_start(partial, handle, back=True)
        at_least = None if weights is None else weights.dtype
        return Pending(work, lambda: gather_sum(back, handle.home_index, None, rows.dtype, at_least))

    def _weights_to_home_start(self, values, handle):
        index = handle.presum_index  # [R, J]
        padded = torch.cat([values, values.new_zeros(1)])
        grid = padded[torch.where(index >= 0, index, values.shape[0])]
        back, work = self._rows_start(grid, handle, back=True)
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
