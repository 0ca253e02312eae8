"""The NVSHMEM transport's moves by groups of local experts
(``dispatch.transports.nvshmem``): the rows to the experts got group by group,
each row with the first group that has a place of it (:func:`pieces` hands them
out), and the pre-sums put home group by group, each with the last group it
needs (:class:`GroupPuts`), through ``SymmetricExchange.get_expand`` with
spans and ``SymmetricExchange.presum_put_group``. The bits of one piece, for every G.
"""

from __future__ import annotations

import torch

from dispatch.kernels import nvshmem_puts
from dispatch.streams import Done, Pending, PendingGroups
from dispatch.timing import mark
from dispatch.transports.base import GroupSumsIssuer, WholeSums


def pieces(out: torch.Tensor, ends: list, handle, timer) -> PendingGroups:
    """A move by groups whose rows land in ``out`` group after group: piece g is
    group g's rows, the stream that takes it waiting for ``ends[g]`` alone."""
    mark(timer, "exchange_out")

    def piece(g: int) -> torch.Tensor:
        if ends[g] is not None:
            torch.cuda.current_stream(out.device).wait_event(ends[g])
        return out[slice(*handle.row_range(g))]

    return PendingGroups([None] * handle.groups, [lambda g=g: piece(g) for g in range(handle.groups)])


class GroupPuts(GroupSumsIssuer):
    """The expert side of a combine by groups over NVSHMEM: as group g's rows
    come, the pre-sums it completes (those of the received rows whose last
    place is in group g) are summed from every group's rows so far and put
    home (``SymmetricExchange.presum_put_group``); the home rank sums them
    after the last group. The bits of one combine, for every G.

    The puts of groups before the last land in the receive buffer that the
    next exchange also uses. Where another exchange comes between two groups
    (a second combine by groups, a dispatch, a plan replayed: on every rank
    alike), or the buffers grew, the pre-sums put so far may be overwritten:
    the groups after put nothing, and the last puts every pre-sum (the same
    bits, nothing hidden). Every group's rows and
    weights are held until the last is put (a later group's pre-sums read them).
    Weights other than fp32 (fp64: fp64 sums; of one dtype on every rank, as
    the adds agree) are summed home at once, after the last group (``at_once``)."""

    def __init__(self, transport, handle, wire: torch.dtype,
                 at_once: WholeSums) -> None:
        self._t, self._handle, self._wire, self._at_once = transport, handle, wire, at_once
        self._table = transport.exchange.group_table(handle.group_rows)
        self._held: list = []
        self._after = None  # (exchanges issued, buffers made) after the last group's put
        self._stored = 0  # the groups in the table
        self._whole = self._grouped = False
        self._out = None

    def add(self, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
        handle, exchange = self._handle, self._t.exchange
        if g == 0:  # (every group is weighed alike)
            self._grouped = weights is None or weights.dtype == torch.float32
        if not self._grouped:
            self._at_once.add(g, rows, weights)
            return
        self._held.append((rows, weights))
        self._whole |= self._after is not None and (exchange.operations, exchange.generation) != self._after
        last = g + 1 == handle.groups
        if self._whole and not last:
            return
        if g == 0:
            self._t.check_holds(handle, rows.shape[1], self._wire, "expert_out")
        span = nvshmem_puts.EVERY if self._whole else handle.row_range(g)
        new = [(k, *self._held[k]) for k in range(self._stored, g + 1)]  # the groups not in the table yet
        out = exchange.presum_put_group(self._table, new, span, handle.presum_index, handle.receives,
                                        handle.back_at, self._wire, handle.recv_rows, handle.send_rows,
                                        handle.home_index.contiguous() if last else None)
        self._after, self._stored = (exchange.operations, exchange.generation), g + 1
        if last:
            self._out, self._held = out, []
            mark(self._t.phase_timer, "final_sum")

    def finish(self) -> Pending:
        return Done(self._out) if self._grouped else self._at_once.finish()
