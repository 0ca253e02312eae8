"""The usual dispatch on the NVLink engine, compiled whole.

Most dispatches of a training run are alike: the signature of the call before
(tensors of one shape, dtype and device), no ``max_rows``, one group, no
``async_op``, rows that travel as they are, eager, on the stream of the
engine's last operation. For those, ``csrc/host.cpp``'s ``UsualDispatch``
makes in one call what the front end, the transport and the engine make in
Python: the call's number (``agreement.Calls``), its agreement on the board
(``dispatch.board``), its header with its memory budget (``checks.row_budgets``),
the routing weights in their wire dtype, and the counts exchange with the
dispatch's own pull (``Engine.exchange_counts``). The same kernels with the
same arguments, so the same bits; only the host time differs.

:class:`UsualDispatches` keeps one compiled call per signature (made after a
dispatch of that signature took the usual path in Python, so its checks have
passed once), dropped when the engine's launches are made again (its buffers
grew). Where the compiled call stops short (the ranks' calls differ, a peer
refused or timed out), the front end raises as its agreement would; where the
compiled exchange finds the case not usual (a budget short), the transport's
plan goes on from the counts it read.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dispatch import agreement, checks, cuda, host, plan
from dispatch.codec import CastCodec
from dispatch.nvlink_layout import Counts, HostCounts, Planned
from dispatch.nvlink_order import eager_stream, ordered_eager
from dispatch.transports.base import BOUNDED, FAILED, WEIGHTS_GRAD, X_GRAD, Request

if TYPE_CHECKING:
    from dispatch.dispatcher import TokenDispatcher

_SIGNATURES = 8  # compiled dispatches a dispatcher keeps (one per signature of its arguments)


class UsualDispatches:
    """The compiled usual dispatches of one dispatcher on the engine (module doc)."""

    def __init__(self, dispatcher: "TokenDispatcher") -> None:
        self._d = dispatcher
        self._engine = dispatcher.transport.engine
        self._calls: list = []  # [UsualDispatch, (codec, WordsAt)] newest first
        self._launches = None  # the engine's launches they were made from

    def dispatch(self, x, topk_idx, topk_weights):
        """:meth:`TokenDispatcher.dispatch`'s result (no ``max_rows``, one group,
        no ``async_op``) made by a compiled call, or None (nothing done: the
        front end takes the call)."""
        engine = self._engine
        if engine._launches is not self._launches or engine.failure_seen or engine._polled_event is not None:
            return None
        stream = eager_stream(engine)
        if stream is None or self._d.transport.phase_timer is not None:
            return None
        for compiled, codec, at in self._calls:
            got = compiled.dispatch(x, topk_idx, topk_weights, stream)
            if got is not None:
                return self._result(got, x, topk_idx, topk_weights, codec, at, stream)
        return None

    def _result(self, got: tuple, x, topk_idx, topk_weights, codec, at, stream: int):
        d, engine = self._d, self._engine
        what, number, out = got
        ticket = plan.Ticket(agreement.VERB_CODES["dispatch"], number)  # (its verb as the rows carry it)
        if what != "planned":  # stopped at the agreement: raise as it would
            off = 0 if torch.is_grad_enabled() else agreement.GRAD_OFF
            d._calls.settle(plan.Ticket(ticket.verb + off + agreement.DISPATCHERS * d._calls.place, number), out)
            words = tuple(row[-1] for row in out)
            d.transport.agreed_words(Request(d, x, topk_idx, topk_weights, ticket, False, agreed=words))
            raise RuntimeError(f"dispatch #{number}: the ranks' agreement stopped the compiled call, and its "
                               f"checks found nothing: {out}")
        ordered_eager(engine, stream)  # recorded by the call
        words, per_expert, tokens_at, headers, sends, rows_of, mine, bound, received, staged, planned = out
        counts = Counts(words, at, HostCounts(headers, sends, rows_of, mine), received, bound, per_expert,
                        tokens_at, staged, None, None if planned is None else Planned(*planned))
        if planned is not None and planned[-1] is not None:
            engine.operations += 1  # the pull's, with the counts exchange's
        header = headers[d.rank]
        ticket = plan.Ticket(header[0], number, 0, False, -1, header[plan.HEADER.index("memory_rows")])
        request = Request(d, x, topk_idx, topk_weights, ticket, d.config.tuning.check_inputs, 1, None,
                          lambda: d._exact_memory_rows(x, ticket), True)
        handle, plan_out = d.transport.planned(request, counts)
        return d._dispatched(x, topk_weights, handle, plan_out, codec, None)

    def learn(self, x, topk_idx, topk_weights, handle, codec) -> None:
        """Compile the usual dispatch of this signature of arguments, whose call
        (no ``max_rows``, one group, no ``async_op``) has just taken the usual
        path in Python: every rank's checks passed, the engine's compiled counts
        exchange made ``handle``'s tensors and pulled its rows."""
        engine, d = self._engine, self._d
        planned = getattr(getattr(handle, "counts", None), "planned", None)
        if (planned is None or planned.tokens is None or handle.transport is not d.transport or not engine._eager_raw
                or not isinstance(codec, CastCodec) or codec.wire != x.dtype):
            return
        if engine._launches is not self._launches:
            self._calls, self._launches = [], engine._launches
        tokens, topk = topk_idx.shape
        wire = plan.weight_wire_dtype(topk_weights.dtype)
        key = ("counts", tokens, topk, topk_idx.dtype, wire, codec, x.shape[1], 1)
        fits, layout, counts, words, sizes, compiled, at = engine._cached(key, engine._counts_launches)
        width = min(topk, d.num_local_experts)
        pull = engine._own_pull(codec, x, topk, (width, wire)) if compiled is not None else None
        if pull is None:
            return
        board = d._calls.board
        shape, layout_c, counts_c = compiled
        header = plan.header(x, topk_weights, topk, plan.Ticket())
        usual = engine._host.UsualDispatch(
            shape=shape, layout=layout_c, counts=counts_c, pull=pull[0], pull_cap=pull[1], pull_min=pull[2],
            rows_per_block=pull[3], hidden=x.shape[1], device=x.device, x_dtype=x.dtype,
            idx_dtype=topk_idx.dtype, weights_dtype=topk_weights.dtype, wire_dtype=wire,
            verb=agreement.VERB_CODES["dispatch"] + agreement.DISPATCHERS * d._calls.place,
            grad_off=agreement.GRAD_OFF, verb_col=plan.HEADER.index("verb"), call_col=plan.HEADER.index("call"),
            call_row=[*plan.call_header(plan.Ticket()), 0], header=header, x_grad_bit=X_GRAD,
            weights_grad_bit=WEIGHTS_GRAD, raise_bits=FAILED | BOUNDED, made_at=d._calls.counter("dispatch"),
            board_words=board.words_at, board_count=board.count_at, board_slot=board.slot, timeout=d.config.timeout,
            row_bytes=d.transport.row_bytes(x), allocator=checks.FREE_MEMORY.compiled is not None,
            age=checks.FREE_MEMORY_AGE, row_at=engine._zeroed(words).data_ptr(), host_words=engine._host_words,
            check_values=d.config.tuning.check_inputs, width=width, stage=bool(fits and tokens), record=engine._eager_raw)
        self._calls = [(usual, codec, at), *self._calls[: _SIGNATURES - 1]]


def usable(dispatcher: "TokenDispatcher") -> bool:
    """Whether ``dispatcher`` can have compiled usual dispatches: on the engine
    with its compiled host path, agreeing on the group's board, without
    capacity dropping or padding."""
    engine = getattr(dispatcher.transport, "engine", None)
    config = dispatcher.config
    return (engine is not None and getattr(engine, "_host", None) is not None and dispatcher._calls.board is not None
            and dispatcher.transport.agrees_dispatch and config.capacity_factor is None
            and not config.pad_to_capacity and cuda.available() and host.enabled)
