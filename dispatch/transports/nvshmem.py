"""The ``alltoall`` variant over NVSHMEM (``transport="nvshmem"``): the rows move
by PyTorch's NVSHMEM all-to-all, whose split sizes stay on the device
(``torch.ops.symm_mem.all_to_all_vdev``), so that a dispatch with ``max_rows``
and the round trip after it read nothing on the host, over any link NVSHMEM
reaches (NVLink and PCIe inside a host; InfiniBand or RoCE between hosts).

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, S, R, N, J).

The plan is the NCCL transport's (``transports.alltoall``): the same route,
counts all-gather (an NCCL collective of device tensors), send plan and
receive plan, so the results are bitwise those of ``transport="nccl"``. What
changes is how the rows move (the slot lists and the rows to the experts, the
pre-sums and the per-slot values home): through :class:`SymmetricExchange`,
with the split sizes taken on the device from the all-gathered counts.

With ``max_rows`` nothing is read on the host. The buffers have fixed bounds
(S <= T min(K, W) and R <= W T rows, sized once for the group's largest T, K
and rows: ``reserve``); the rows past the real ones are masked; the checks the
NCCL transport makes on the host (the ranks agree, no rank over a bound, no
bad value) are made on the device (``checks.peers_fail``), every rank alike
from the same all-gathered rows: a dispatch that fails them moves no row on any
rank, its outputs are padding and its sums zeros, and its error is raised on
every rank at the next dispatch that some rank has seen it by (each dispatch's
agreement over the host carries that), or by ``check()``. On CUDA, such a plan
of a signature seen before is one CUDA graph, replayed (:class:`_Replayed`): a
few host calls where op by op it makes some hundred. Without ``max_rows`` the
plan reads its summary on the host as the NCCL transport does (its outputs have
N rows).

Every exchange is moved by kernels of ours (``dispatch.kernels.nvshmem_puts``,
where they build), the places taken on the device from the all-gathered counts.
The rows to the experts that travel as they are are got by their receivers
from the sources' staged send rows and written straight to their expert-major
places, and each received row's pre-sum is made where it is put home: the
experts' layout in the exchange's pass, each (token, rank) row over the link
once (``SymmetricExchange.get_expand``, ``presum_put``). The others (fp8 rows,
slot lists, pre-sums of fp64 sums, per-slot values home) are put from rows made
in send order. Where the kernels cannot run, the rows are packed, and the
pre-sums summed, straight into a send buffer that torch's kernel reads with at
most 64 blocks on one host (16 across hosts), or ``TORCH_SYMMMEM_NBLOCKS`` where
set before the first exchange; the results are the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatch import checks, comm, plan
from dispatch.codec import Codec, sum_wire_dtype, to_experts_codec
from dispatch.handle import PlanOutputs
from dispatch.plan_graph import HostSummary, Summary, counts_row
from dispatch.streams import Done, Pending, PendingGroups
from dispatch.timing import mark
from dispatch.transports.alltoall import AllToAllHandle, AllToAllTransport, _slots_from_rows
from dispatch.transports.base import Request, WholeSums, by_groups, grads_of, handle_fields, shape_fields
from dispatch.kernels import bounded_plan, nvshmem_puts
from dispatch.kernels.gather_sum import gather_sum
from dispatch.transports.nvshmem_groups import GroupPuts, pieces
from dispatch.transports.symmetric import Packed, exchange_for


@dataclass(frozen=True, kw_only=True)
class NVSHMEMHandle(AllToAllHandle):
    """Plan of one exchange over NVSHMEM (``AllToAllHandle``'s fields; with
    ``max_rows``, ``send_splits`` and ``recv_splits`` are None: not read).

    Attributes:
        sends, receives: [W] int64 on the device, rows this rank sends to /
            receives from each rank (zeros where the dispatch failed).
        send_rows, recv_rows: the rows every rank's send / receive buffers hold
            (the same on every rank: symmetric memory is allocated alike);
            row ``recv_rows`` of a received buffer is zeros (padding reads it).
        put_at, back_at: [W] int64 on the device, where this rank's rows start
            in each rank's receive rows, to the experts and back home (what rows
            put straight there need).
    """

    sends: torch.Tensor
    receives: torch.Tensor
    send_rows: int
    recv_rows: int
    put_at: torch.Tensor | None = None
    back_at: torch.Tensor | None = None


# the handle's tensors (:meth:`NVSHMEMTransport._plan_tensors` makes them and the outputs')
_HANDLE_TENSORS = ("send_token", "home_index", "slot_row", "slot_col", "expand_src", "presum_index", "sends",
                   "receives", "put_at", "back_at")
_REPLAYS = 8  # signatures whose plan with max_rows is kept captured


class NVSHMEMTransport(AllToAllTransport):
    """Deduplicated all-to-all with its split sizes on the device
    (``variant="alltoall"``, ``transport="nvshmem"``; see the module doc).

    Its exchanges cannot time out (NVSHMEM's barriers wait for ever), so no
    rank may leave a dispatch that its peers go on with: every dispatch is
    agreed over the host first (``agrees_dispatch``: a refused argument, ranks
    that mix ``max_rows`` with none, and a failure some rank has seen raise on
    every rank there), and a rank that finds its own dispatch over the
    buffers' bounds takes part with nothing, recording the failure, instead of
    raising alone.

    Args:
        exchange: what moves the rows (the group's :class:`SymmetricExchange`
            by default; anything with its ``capturable``, ``generation``, ``exchange``, ``gather``,
            ``get_expand``, ``presum_put``, ``group_table``, ``presum_put_group``, ``operations``,
            ``in_order``, ``can_put``, ``ensure`` and ``stride``).
    """

    transport = "nvshmem"
    host_free = True
    bounded_groups = True
    agrees_dispatch = True
    reserves = True

    def __init__(self, config, group=None, exchange=None) -> None:
        super().__init__(config, group)
        if exchange is None:
            device = torch.device("cuda", torch.cuda.current_device())
            exchange = exchange_for(group, self.world_size, device)  # (it builds our put kernel: seconds, once)
        self.exchange = exchange
        self.fan = self.world_size  # the most ranks one rank's rows go to or come from: the buffers hold fan T rows
        self._capacity: tuple[int, int, int] | None = None  # (T, K, row stride) the buffers of max_rows hold
        self._failed = self._failure = None  # on the device: a dispatch with max_rows failed, and its summary
        self._seen = self._seen_at = None  # the failure flag, copied to the host as the work runs
        self._local_error: Exception | None = None  # this rank's own reason, where it had one
        self._row_bytes = 0
        self._kept: list[torch.Tensor] = []  # host headers read by captured graphs
        self._replays: dict = {}  # signature -> its plan captured whole (None: seen once), oldest first
        self._uncaptured: set = set()  # signatures whose capture failed here

    def plan(self, request: Request) -> tuple[NVSHMEMHandle, PlanOutputs]:
        return self.plan_agreed(request, self.agreed_words(request))

    def plan_agreed(self, request: Request, words: tuple[int, ...]) -> tuple[NVSHMEMHandle, PlanOutputs]:
        """``plan`` of a dispatch whose agreement is made (every rank's ``dispatch_word``)."""
        if request.max_rows is not None:
            return self._plan_bounded(request, words)
        return self._plan_host(request)

    def _plan_host(self, request: Request) -> tuple[NVSHMEMHandle, PlanOutputs]:
        x, local = request.x, self.num_local_experts
        header = plan.header(x, request.topk_weights, request.topk_idx.shape[1], request.ticket)
        planned, captured = self._counts_and_send_plan(request, header, grouped_sends=False)
        summary = HostSummary.read(planned.summary, self.world_size, local)  # host sync: N, peers' headers
        headers = summary.headers
        self._raise_own_values(request, headers[self.rank])
        grads_any = checks.check_peer_headers(headers)
        checks.check_row_budgets(headers, summary.received, self.row_bytes(x), request.exact_memory_rows)
        checks.check_peer_groups(summary.groups)
        matrix = summary.matrix
        num_rows = sum(summary.per_expert)
        sizes = (max(map(sum, matrix)), max(map(sum, zip(*matrix))))  # every rank's largest S and R
        send, recv = summary.send, summary.recv
        fields = dict(send_splits=send, recv_splits=recv, **shape_fields(request, local, summary.per_expert, num_rows))
        tensors = self._plan_tensors(request, planned, captured, num_rows, None, sizes, counts=(sum(send), sum(recv)))
        return self._made_plan(request, tensors, grads_any, num_rows, sizes, summary.has_rows,
                               summary.per_expert_host(), fields)

    def _plan_bounded(self, request: Request, words: tuple[int, ...]) -> tuple[NVSHMEMHandle, PlanOutputs]:
        x, topk_idx, ticket = request.x, request.topk_idx, request.ticket
        num_tokens, topk = topk_idx.shape
        if self._capacity is None or not self._capacity[0]:  # the same on every rank (agreed): size the buffers
            # by agreement, once (again while no rank has had a token)
            self.reserve(x, topk)
        header = plan.header(x, request.topk_weights, topk, ticket)
        tokens, most_topk, stride = self._capacity
        wide = max(self.exchange.stride(b) for b in self._row_sizes(x, topk))
        error = None
        if num_tokens > tokens or topk > most_topk or wide > stride:
            error = ValueError(f"x: a dispatch with max_rows takes at most {tokens} tokens of K <= {most_topk} "
                               f"and rows like the x the buffers were sized for (TokenDispatcher.reserve), got "
                               f"T={num_tokens}, K={topk}, H={x.shape[1]} {x.dtype}")
        elif 0 <= ticket.memory_rows < ticket.max_rows:
            error = ValueError(f"max_rows: {ticket.max_rows} rows do not fit this rank's free device memory "
                               f"({ticket.memory_rows} rows of {self.row_bytes(x)} bytes, the dispatch's outputs)")
        if error is not None:  # this rank takes part with no slots; its mark fails the dispatch on every rank
            header[plan.HEADER.index("failed")] = 2
            request = dataclasses.replace(request, topk_idx=torch.full_like(topk_idx, -1), check_values=False)
            self._local_error = self._local_error or error
        world, groups = self.world_size, request.groups
        self._row_bytes = self.row_bytes(x)
        grads_any = grads_of(words)
        sizes = (0, 0) if error is not None else (self.fan * tokens, self.fan * tokens)
        bound = -(-ticket.max_rows // groups)  # by groups, each group's rows padded to B = ceil(max_rows / G)
        num_rows = groups * bound
        replay = None if error is not None else self._replay_for(request, num_rows, sizes)
        if replay is not None:
            tensors = replay.run(request, header)
        else:
            tensors = self._bounded_tensors(request, header, num_rows, sizes)
        self._watch_failure()
        shape = {}
        if groups > 1:
            shape = dict(group_experts=plan.expert_groups(self.num_local_experts, groups),
                         group_rows=tuple(g * bound for g in range(groups + 1)))
        return self._made_plan(request, tensors, grads_any, num_rows, sizes, (True,) * world, None,
                               dict(send_splits=None, recv_splits=None, **shape))

    def _bounded_tensors(self, request: Request, header: "list[int] | torch.Tensor", num_rows: int, sizes) -> dict:
        """The device work of a dispatch with max_rows (:meth:`_plan_tensors`),
        its failure recorded on the device; nothing read on the host, so that
        it can be captured whole (:class:`_Replayed`)."""
        planned, captured = self._counts_and_send_plan(request, header, bounded=True, grouped_sends=False)
        # into the failure record reserve made, before any bounded plan
        settled = bounded_plan.settle(planned.summary, self.world_size, self.num_local_experts, self.rank,
                                      self._failed, self._failure)
        return self._plan_tensors(request, planned, captured, num_rows, settled, sizes)

    def _replay_for(self, request: Request, num_rows: int, sizes) -> "_Replayed | None":
        """The captured plan of this dispatch's signature (made the second time
        it is seen), or None where it runs op by op: off CUDA, for no tokens,
        while the caller captures, without plan graphs
        (``TuningConfig.plan_graphs``), where the exchange cannot be captured,
        or where the counts are not put by our kernel (an NCCL collective)."""
        topk_idx, weights = request.topk_idx, request.topk_weights
        if (self._graphs is None or not topk_idx.is_cuda or not topk_idx.shape[0]
                or torch.cuda.is_current_stream_capturing() or not self.exchange.capturable
                or not self.exchange.can_put(topk_idx.device)):
            return None
        key = (tuple(topk_idx.shape), topk_idx.dtype, weights.dtype, topk_idx.device, request.check_values,
               request.groups, num_rows, sizes)
        if key in self._uncaptured:
            return None
        seen = key in self._replays
        replay = self._replays.pop(key, None)
        if replay is not None and replay.generation != self.exchange.generation:
            replay = None  # it puts into receive buffers since replaced (on every rank alike): captured anew
        if seen and replay is None:
            try:
                replay = _Replayed(self, request, num_rows, sizes)
            except RuntimeError:  # (out of memory, say) the capture ran nothing: op by op, as its peers may be
                self._uncaptured.add(key)
        self._replays[key] = replay
        while len(self._replays) > _REPLAYS:
            self._replays.pop(next(iter(self._replays)))
        return replay

    def _plan_tensors(self, request: Request, planned, captured, num_rows: int, settled: "bounded_plan.Settled | None",
                      sizes, counts: tuple[int, int] | None = None) -> dict:
        """The slot lists exchanged and the receive plan, from the send plan:
        the handle's tensors and the plan's outputs on the device, by name.
        ``settled``: None where the sizes were read on the host (N =
        ``num_rows``, (S, R) = ``counts``), or the settled plan of a dispatch
        with max_rows (``bounded_plan.settle``: ``num_rows`` = max_rows, or G B
        by G groups, what is past the N received is padding). ``sizes``: (send_rows, recv_rows) of
        :class:`NVSHMEMHandle` ((0, 0): this rank takes part with nothing)."""
        world, local = self.world_size, self.num_local_experts
        send_rows, recv_rows = sizes
        sp = planned.send
        keep = (lambda t: t.clone()) if captured is not None else (lambda t: t)  # noqa: E731
        if settled is None:
            summary = Summary.read(planned.summary, world, local)
            put_at, back_at = bounded_plan.starts(summary.matrix, self.rank)
            sends, receives, home_index, slot_row = (keep(t) for t in (summary.send, summary.recv, sp.home_index,
                                                                        sp.slot_row))
            send_token = keep(sp.send_token[: counts[0]])
            per_expert = keep(Summary.per_expert_of(planned.summary, world, local))
            table = plan.one_group_table(receives)

            def received(meta):
                return meta[: counts[1]].clone()
        else:  # a failed dispatch moves nothing and sums nothing, on every rank alike (new tensors: none
            # of them is a replayed plan's buffer, which the next replay rewrites)
            failed, sends, receives, put_at, back_at, per_expert, table = settled
            home_index, slot_row = torch.where(failed, -1, sp.home_index), torch.where(failed, -1, sp.slot_row)
            send_token = sp.send_token  # made new below
            held = min(num_rows, recv_rows)  # the rows past the R received are no rows (R <= N <= max_rows)

            def received(meta):
                real = torch.arange(held, device=meta.device) < receives.sum()
                return torch.where(real.unsqueeze(1), meta[:held], -1)
        meta = self.exchange.exchange(sp.meta[: send_token.shape[0]], sends, receives, send_rows, recv_rows, received,
                                      at=put_at)
        rp = plan.build_recv_plan(meta, table, num_rows, plan.weight_wire_dtype(request.topk_weights.dtype))
        presum_index = rp.presum_index
        if settled is None:
            expand_src, weights, src_rank, src_token = rp.expand_src, rp.weights, rp.expanded_rank, rp.expanded_token
        else:  # padding: the zero row, weight 0, sources -1; the rows past S are gathered too (not sent)
            padded = bounded_plan.pad(rp.expand_src, rp.weights, rp.src_rank, rp.src_token, per_expert, send_token,
                                      sends, recv_rows)
            if request.groups > 1:  # each group's rows at g B, padded to B
                padded, presum_index = bounded_plan.place_by_groups(padded, presum_index, per_expert, request.groups,
                                                                    num_rows // request.groups, recv_rows)
            expand_src, weights, src_rank, src_token, send_token = padded
        tensors = dict(send_token=send_token, home_index=home_index, slot_row=slot_row, slot_col=keep(sp.slot_col),
                       expand_src=expand_src, presum_index=presum_index, sends=sends, receives=receives,
                       put_at=put_at, back_at=back_at, weights=weights, tokens_per_expert=per_expert,
                       src_rank=src_rank, src_token=src_token)
        if captured is not None:  # the replayed buffers read: the next call's replays may come
            captured.release()
        return tensors

    def _made_plan(self, request: Request, tensors: dict, grads_any, num_rows: int, sizes, has_rows,
                   per_expert_host, fields: dict | None = None) -> tuple[NVSHMEMHandle, PlanOutputs]:
        """The handle and outputs of a plan from its tensors (:meth:`_plan_tensors`)."""
        handle = NVSHMEMHandle(
            **handle_fields(request, self, num_rows, grads_any, has_rows),
            **(fields or dict(send_splits=None, recv_splits=None)), send_rows=sizes[0], recv_rows=sizes[1],
            **{name: tensors[name] for name in _HANDLE_TENSORS})
        outputs = PlanOutputs(weights=tensors["weights"], tokens_per_expert=tensors["tokens_per_expert"],
                              tokens_per_expert_host=per_expert_host, src_rank=tensors["src_rank"],
                              src_token=tensors["src_token"])
        mark(self.phase_timer, "plan")
        return handle, outputs

    def _gather_rows(self, row: torch.Tensor, group, world: int, out: torch.Tensor | None = None,
                     arrivals=None) -> torch.Tensor:
        # put by our kernel where it runs (no wait to bound: every rank is at this dispatch, agreed over the host)
        if self.exchange.can_put(row.device):
            return self.exchange.gather(row, out)
        return comm.all_gather_rows(row, group, world, out=out, arrivals=arrivals)

    # -- the movements --------------------------------------------------------

    def to_experts(self, rows: torch.Tensor, handle: NVSHMEMHandle, codec: Codec, own: bool = False) -> PendingGroups:
        index = handle.send_token

        def consume(received):
            return codec.unpack(received, rows.dtype, rows.shape[1], handle.expand_src)

        dtype, width = codec.wire_row(rows.dtype, rows.shape[1])
        if not own:  # (the dispatch's own x: its plan checked it, and a rank whose x is too wide takes part with none)
            self.check_holds(handle, width, dtype, "rows")
        if (dtype == rows.dtype and self.exchange.can_put(rows.device)
                and handle.presum_index.shape[1] <= nvshmem_puts.MAX_WIDTH):
            # the rows as they are: got by their receivers and written straight to their expert-major places
            args = (rows.detach(), index, handle.presum_index, handle.receives, handle.back_at, handle.send_rows,
                    handle.recv_rows, handle.expand_src)
            if handle.groups > 1:  # one get a group, each row with the first group that needs it
                return pieces(*self.exchange.get_expand(*args, spans=[handle.row_range(g)
                                                                        for g in range(handle.groups)]),
                               handle, self.phase_timer)
            expanded = self.exchange.get_expand(*args)
        else:
            sent = Packed(index.shape[0], width, dtype,  # [S, wire row], packed into the send buffer
                          lambda out: codec.pack(rows, index[: out.shape[0]], out), (rows, index))
            expanded = self.exchange.exchange(sent, handle.sends, handle.receives, handle.send_rows,
                                              handle.recv_rows, consume, at=handle.put_at)
        mark(self.phase_timer, "exchange_out")
        return by_groups(Done(expanded), handle)

    def to_home(self, rows, handle: NVSHMEMHandle, weights, wire) -> Pending:
        index = handle.presum_index
        at_least = None if weights is None else weights.dtype  # fp64 weights: fp64 sums

        def home_sum(back):
            return gather_sum(back, handle.home_index, None, rows.dtype, at_least)

        if (self.exchange.can_put(rows.device) and nvshmem_puts.sums_here(rows.dtype, at_least, wire)
                and index.shape[1] <= nvshmem_puts.MAX_WIDTH):
            # each received row's pre-sum made where it is put home, and the partials summed there
            self.check_holds(handle, rows.shape[1], wire, "expert_out")
            out = self.exchange.presum_put(rows.contiguous(), None if weights is None else weights.contiguous(), index,
                                           handle.receives, handle.back_at, wire, handle.recv_rows, handle.send_rows,
                                           handle.home_index.contiguous())
        else:
            out = self.back_home(presums(rows, index, weights, wire), handle, home_sum)
        mark(self.phase_timer, "final_sum")
        return Done(out)  # [T, H]

    def group_sums(self, handle: NVSHMEMHandle, wire: str, dtype):
        out = None if dtype is None else sum_wire_dtype(wire, dtype)
        if (handle.groups == 1 or out is None or not self.exchange.can_put(handle.device)
                or not nvshmem_puts.sums_here(dtype, None, out)
                or handle.presum_index.shape[1] > nvshmem_puts.MAX_WIDTH):
            return super().group_sums(handle, wire, dtype)
        return GroupPuts(self, handle, out, WholeSums(handle, wire, dtype))

    def slots_home(self, values: torch.Tensor, handle: NVSHMEMHandle) -> Pending:
        index = handle.presum_index  # [R, J]
        padded = torch.cat([values, values.new_zeros(1)])  # last entry: padding
        grid = padded[torch.where(index >= 0, index, values.shape[0])]
        return Done(self.back_home(grid, handle, lambda back: _slots_from_rows(back, handle, values)))

    def back_home(self, rows: "torch.Tensor | Packed", handle: NVSHMEMHandle, consume) -> torch.Tensor:
        """``consume`` of rows of the received rows' order home, in the send order.
        Rows wider than the buffers a dispatch with ``max_rows`` was sized for
        are refused before any exchange (the same on every rank where the
        expert outputs are alike)."""
        if isinstance(rows, Packed):
            self.check_holds(handle, rows.width, rows.dtype, "expert_out")
        else:
            self.check_holds(handle, rows.shape[1], rows.dtype, "values")
        out = self.exchange.exchange(rows, handle.receives, handle.sends, handle.recv_rows, handle.send_rows, consume,
                                     at=handle.back_at)
        mark(self.phase_timer, "exchange_back")
        return out

    def check_holds(self, handle: NVSHMEMHandle, width: int, dtype: torch.dtype, name: str) -> None:
        """Refuse rows of ``width`` x ``dtype`` (the argument ``name``) wider than
        the rows the buffers of a dispatch with max_rows were sized for (they
        do not grow then: a growth is a collective): by the agreed capacity,
        so alike on every rank, a rank whose own dispatch failed (and has no
        rows) included, and before any exchange."""
        if handle.send_splits is None and self.exchange.stride(width * dtype.itemsize) > self._capacity[2]:
            raise ValueError(f"{name}: rows of {width} x {dtype} are wider than the rows the buffers of a dispatch "
                             "with max_rows were sized for (rows like x: TokenDispatcher.reserve with the widest "
                             "rows of the round trip)")

    def stats(self, handle: NVSHMEMHandle, dispatch_row_bytes, combine_wire, hidden):
        if handle.send_splits is None:
            return None  # with max_rows: nothing read on the host
        return super().stats(handle, dispatch_row_bytes, combine_wire, hidden)

    # -- sizes and failures ---------------------------------------------------

    def reserve(self, x: torch.Tensor, topk: int) -> None:
        stride = max(self.exchange.stride(b) for b in self._row_sizes(x, topk))
        need = plan.to_device(torch.tensor([x.shape[0], topk, stride], dtype=torch.int64), x.device)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self.group)
        tokens, most_topk, stride = need.tolist()  # host sync: the group's largest T, K, row
        if self._capacity is not None:  # room only grows (as the engine's): a later, smaller reserve keeps it
            tokens, most_topk, stride = (max(old, new) for old, new in zip(self._capacity, (tokens, most_topk, stride)))
        self._capacity = (tokens, most_topk, stride)
        rows = self.fan * tokens  # R <= fan T; S <= T min(K, fan) <= fan T
        # the counts all-gather puts a row to every rank too (``_gather_rows``): room for it, so that no bounded
        # dispatch after this grows a buffer (a host sync; in a capture, an error)
        counts = self.exchange.stride(8 * counts_row(self.world_size, self.num_local_experts).width)
        self.exchange.ensure(rows * stride, max((rows + 1) * stride, (self.world_size + 1) * counts))
        if self._failed is None:  # the failure record, before any capture
            width = Summary.width(self.world_size, self.num_local_experts)
            self._failed = torch.zeros((), dtype=torch.bool, device=x.device)
            self._failure = torch.zeros(width, dtype=torch.int64, device=x.device)

    def _row_sizes(self, x: torch.Tensor, topk: int) -> list[int]:
        """The bytes of every kind of row a round trip of x moves, expert
        outputs like x and backward included: rows to the experts, pre-sums,
        slot lists (fp64 weights), per-slot values."""
        hidden, config = x.shape[1], self.config
        width = min(topk, self.num_local_experts)
        sizes = [to_experts_codec(wire, x.dtype).row_bytes(hidden)
                 for wire in (config.dispatch_wire, config.combine_grad_wire)]
        sizes += [sum_wire_dtype(wire, x.dtype).itemsize * hidden
                  for wire in (config.combine_wire, config.dispatch_grad_wire)]
        return sizes + [4 * (width + 1 + 2 * width), 8 * width]

    def _watch_failure(self) -> None:
        """Start the failure flag's copy to the host (read by the next
        dispatch's ``dispatch_word``), unless capturing."""
        if self._failed.is_cuda and not torch.cuda.is_current_stream_capturing():
            if self._seen is None:
                self._seen = torch.zeros((), dtype=torch.bool, pin_memory=True)
                self._seen_at = torch.cuda.Event()
            self._seen.copy_(self._failed, non_blocking=True)
            self._seen_at.record()

    def seen_failed(self, bounded: bool) -> bool:
        """Its own reason, or the failure flag's copy arrived (off CUDA, the
        flag itself). Never while capturing."""
        if self._local_error is not None:
            return True
        if self._failed is None or (self._failed.is_cuda and torch.cuda.is_current_stream_capturing()):
            return False
        if not self._failed.is_cuda:
            return bool(self._failed)
        return self._seen is not None and self._seen_at.query() and bool(self._seen)

    def check(self) -> None:
        local, self._local_error = self._local_error, None
        if self._failed is None or not bool(self._failed):  # host sync: the failure flag
            if local is not None:
                raise local
            return
        summary = HostSummary.read(self._failure, self.world_size, self.num_local_experts)
        self._failed.zero_()  # raised once
        if self._seen is not None:
            self._seen.fill_(False)
        if local is not None:
            raise local
        headers = summary.headers
        checks.check_peer_headers(headers)
        checks.check_peer_groups(summary.groups)
        if summary.groups[0] > 1:
            checks.check_group_bounds(headers, summary.groups, summary.fullest)
        else:
            checks.check_row_budgets(headers, summary.received, self._row_bytes)
        raise RuntimeError("a dispatch with max_rows failed on the device")  # every check above passes: not reached

    def _header_row(self, header: list[int], device: torch.device) -> torch.Tensor:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a captured copy reads its host source at every replay: keep it for the graph's life
            host = torch.tensor(header, dtype=torch.int64).pin_memory()
            self._kept.append(host)
            return host.to(device, non_blocking=True)
        return super()._header_row(header, device)


def presums(rows: torch.Tensor, index: torch.Tensor, weights: torch.Tensor | None, wire: torch.dtype) -> Packed:
    """[R, H] the received rows' weighted pre-sums (``index``: [R, J] their
    expanded rows), summed straight into an exchange's send buffer."""
    return Packed(index.shape[0], rows.shape[1], wire,
                  lambda out: gather_sum(rows, index[: out.shape[0]], weights, wire, out=out),
                  (rows, index) if weights is None else (rows, index, weights))


class _Replayed:
    """A dispatch with max_rows planned whole in one CUDA graph, for one
    signature (:meth:`NVSHMEMTransport._replay_for`): its route, its counts put
    to every rank, send plan, device checks, slot lists put and receive plan,
    replayed on each call's routing and header in a few host calls instead of
    some hundred. What the call keeps is copied out of the graph's buffers
    (one copy per dtype). Captured without a warm-up (the signature ran op by
    op once before): a warm-up would run the puts and barriers once more on
    this rank only. Replays run the same kernels, barriers and puts as the ops,
    in the same order, so a rank that replays pairs with one that does not."""

    def __init__(self, transport: NVSHMEMTransport, request: Request, num_rows: int, sizes) -> None:
        device = request.topk_idx.device
        self.generation = transport.exchange.generation  # the receive buffer its puts go to
        self.topk_idx = request.topk_idx.clone()
        self.topk_weights = request.topk_weights.detach().clone()
        self.header = torch.zeros(len(plan.HEADER), dtype=torch.int64, device=device)
        static = dataclasses.replace(request, topk_idx=self.topk_idx, topk_weights=self.topk_weights)
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        self.exchange = transport.exchange
        try:
            with torch.cuda.stream(side):
                self.graph = torch.cuda.CUDAGraph()
                self.graph.capture_begin(capture_error_mode="thread_local")
                try:
                    tensors = transport._bounded_tensors(static, self.header, num_rows, sizes)
                    dtypes = sorted({t.dtype for t in tensors.values()}, key=str)
                    self._layout = [(dtype, [(name, t.shape) for name, t in tensors.items() if t.dtype == dtype])
                                    for dtype in dtypes]
                    self._packed = [torch.cat([tensors[name].flatten() for name, _ in names])
                                    for _, names in self._layout]
                except BaseException:
                    with contextlib.suppress(RuntimeError):  # (ending a broken capture raises too: not that)
                        self.graph.capture_end()
                    raise
                self.graph.capture_end()
        finally:
            current.wait_stream(side)

    def run(self, request: Request, header: list[int]) -> dict:
        """This call's tensors (:meth:`NVSHMEMTransport._plan_tensors`), replayed:
        its inputs copied in, the replay and the copies out in the exchanges'
        order (a call of the same signature on another stream waits for them)."""
        header = torch.tensor(header, dtype=torch.int64)

        def replay():
            self.topk_idx.copy_(request.topk_idx)
            self.topk_weights.copy_(request.topk_weights.detach())
            plan.to_device(header, self.header.device, out=self.header)
            self.graph.replay()
            return [packed.clone() for packed in self._packed]

        tensors = {}
        for (_, names), packed in zip(self._layout, self.exchange.in_order(replay)):
            parts = packed.split([math.prod(shape) for _, shape in names])
            tensors.update((name, part.view(shape)) for (name, shape), part in zip(names, parts))
        return tensors
