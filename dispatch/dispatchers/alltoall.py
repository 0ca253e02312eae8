"""The ``alltoall`` variant: one variable-split all-to-all per direction.

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, S, R, N, J).

Dispatch: a token crosses to a rank once, however many of its experts live there;
its slot list (which local experts, with their weights) rides along in a small
metadata all-to-all, and the receiver expands to one row per (token, local
expert) in canonical order. Combine: the expert side pre-sums the slots of a
token that live on it (one row per (token, rank) goes back), and the home rank
sums the partials in ascending rank order, in fp32, casting once.

Exchanges per round trip: one counts all-to-all (fixed size), one metadata
all-to-all, one token all-to-all each way. One host synchronisation, for the
split sizes NCCL needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dispatch import comm, plan
from dispatch.dispatchers.base import CombineHandle, PlanOutputs, TokenDispatcher
from dispatch.kernels.gather_sum import gather_sum
from dispatch.timing import mark


@dataclass(frozen=True)
class AllToAllHandle(CombineHandle):
    """Plan of one all-to-all exchange (see ``dispatch.plan`` for each tensor).

    Attributes:
        send_splits, recv_splits: host row counts per peer.
        send_token: [S] source token of each send row.
        home_index: [T, W] send rows of each token, ascending rank, -1 padded.
        slot_row: [T, K] send row carrying each slot, -1 for empty slots.
        expand_src: [N] received row of each expanded row.
        expand_slot: [N] ``j * K + k`` of each expanded row.
        presum_index: [R, J] expanded rows of each received row, -1 padded.
    """

    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    send_token: torch.Tensor
    home_index: torch.Tensor
    slot_row: torch.Tensor
    expand_src: torch.Tensor
    expand_slot: torch.Tensor
    presum_index: torch.Tensor


class AllToAllDispatcher(TokenDispatcher):
    """Deduplicated all-to-all dispatcher (``variant="alltoall"``)."""

    def _plan(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> tuple[AllToAllHandle, PlanOutputs]:
        world, experts_per_rank = self.world_size, self.num_local_experts
        num_tokens, topk = topk_idx.shape
        route = plan.route(topk_idx, self.config.num_experts, world)
        recv_counts = comm.exchange_counts(route.counts, self.group)  # [W, 1 + E_local]
        per_expert = recv_counts[:, 1:].sum(0)
        summary = torch.cat([route.counts[:, 0], recv_counts[:, 0], per_expert])
        summary = summary.cpu()  # host sync: split sizes for NCCL and the expanded row counts
        send_splits = tuple(summary[:world].tolist())
        recv_splits = tuple(summary[world : 2 * world].tolist())
        per_expert_host = summary[2 * world :]
        num_rows = int(per_expert_host.sum())

        sp = plan.build_send_plan(route, send_splits)
        # Slot list of each send row: local expert id on the destination (-1 if
        # the slot lives elsewhere), the source token, and the slot weights.
        dest_rank = sp.send_rank.unsqueeze(1)
        sent_idx = topk_idx.long().index_select(0, sp.send_token)
        here = route.dest.index_select(0, sp.send_token) == dest_rank
        local = torch.where(here, sent_idx - dest_rank * experts_per_rank, -1)
        ints = torch.cat([local, sp.send_token.unsqueeze(1)], dim=1).to(torch.int32)
        floats = topk_weights.index_select(0, sp.send_token)
        meta = torch.cat([ints.view(torch.uint8), floats.contiguous().view(torch.uint8)], dim=1)
        recv_meta = comm.all_to_all_rows(meta, send_splits, recv_splits, self.group)

        int_bytes = 4 * (topk + 1)
        recv_ints = _columns_as(recv_meta, 0, int_bytes, torch.int32)
        recv_weights = _columns_as(recv_meta, int_bytes, recv_meta.shape[1], topk_weights.dtype)
        rp = plan.build_recv_plan(recv_ints[:, :topk], num_rows, experts_per_rank)

        device = topk_idx.device
        num_recv = sum(recv_splits)
        recv_rank = torch.repeat_interleave(
            torch.arange(world, device=device), recv_counts[:, 0], output_size=num_recv
        )
        handle = AllToAllHandle(
            owner=id(self),
            num_tokens=num_tokens,
            num_rows=num_rows,
            topk=topk,
            send_splits=send_splits,
            recv_splits=recv_splits,
            send_token=sp.send_token,
            home_index=sp.home_index,
            slot_row=sp.slot_row,
            expand_src=rp.expand_src,
            expand_slot=rp.expand_slot,
            presum_index=rp.presum_index,
        )
        outputs = PlanOutputs(
            weights=recv_weights.flatten().index_select(0, rp.expand_slot),
            tokens_per_expert=per_expert,
            tokens_per_expert_host=per_expert_host,
            src_rank=recv_rank.index_select(0, rp.expand_src),
            src_token=recv_ints[:, topk].long().index_select(0, rp.expand_src),
        )
        mark(self.phase_timer, "plan")
        return handle, outputs

    def _to_experts(self, rows: torch.Tensor, handle: AllToAllHandle, wire: torch.dtype) -> torch.Tensor:
        sent = rows.index_select(0, handle.send_token).to(wire)
        received = comm.all_to_all_rows(sent, handle.send_splits, handle.recv_splits, self.group)
        received = received.to(rows.dtype)
        mark(self.phase_timer, "exchange_out")
        expanded = received.index_select(0, handle.expand_src)
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
        out = gather_sum(back, handle.home_index, None, rows.dtype)  # [T, H]
        mark(self.phase_timer, "final_sum")
        return out

    def _weights_to_home(self, values: torch.Tensor, handle: AllToAllHandle) -> torch.Tensor:
        topk = handle.topk
        num_recv = sum(handle.recv_splits)
        grid = values.new_zeros(num_recv * topk)
        grid[handle.expand_slot] = values
        back = comm.all_to_all_rows(
            grid.view(num_recv, topk), handle.recv_splits, handle.send_splits, self.group
        )
        back = torch.cat([back.flatten(), values.new_zeros(1)])  # last entry: empty slots
        slots = torch.arange(topk, device=values.device)
        at = torch.where(handle.slot_row >= 0, handle.slot_row * topk + slots, back.numel() - 1)
        return back[at]


def _columns_as(rows: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Byte columns ``[start, stop)`` of uint8 ``rows``, reinterpreted as ``dtype``."""
    out = torch.empty(rows.shape[0], stop - start, dtype=torch.uint8, device=rows.device)
    return out.copy_(rows[:, start:stop]).view(dtype)
