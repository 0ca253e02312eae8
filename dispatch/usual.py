"""The usual dispatch and combine on the NVLink engine, compiled whole.

Most dispatches of a training run are alike: the signature of the call before
(tensors of one shape, dtype and device), no ``max_rows``, one group, no
``async_op``, rows that travel as they are, eager, on the stream of the
engine's last operation. For those, ``csrc/host.cpp``'s ``UsualDispatch``
makes in one call what the front end, the transport and the engine make in
Python: the call's number (``agreement.Calls``), its agreement on the board
(``dispatch.board``), its header with its memory budget (``free_memory.row_budgets``),
the routing weights in their wire dtype, and the counts exchange with the
dispatch's own pull (``Engine.exchange_counts``). A combine along such a
dispatch's handle (every rank with rows, rows of a signature met before,
contiguous, no ``async_op``) is one call too, ``UsualCombine``: its number,
agreement and ``Engine.to_home``. The same kernels with the same arguments, so
the same bits; only the host time differs.

:class:`UsualDispatches` keeps one compiled call per signature (made after a
call of that signature took the usual path in Python, so its checks have
passed once), dropped when the engine's launches are made again (its buffers
grew). Where a compiled call stops short (the ranks' calls or rows differ, a
peer refused or timed out), the front end raises as its agreement would; where
the compiled exchange finds the case not usual (a budget short), the
transport's plan goes on from the counts it read. Its memory budget reads
the free memory as ``free_memory.FREE_MEMORY`` does, from the same compiled
reading (``free_bytes``), not through ``free_memory.device_free_bytes``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from dispatch import agreement, checks, cuda, free_memory, host, plan
from dispatch.autograd import DispatchFn, combine_node, dispatch_node
from dispatch.codec import CastCodec, sum_wire_dtype, to_experts_codec
from dispatch.handle import Dispatched, made, with_link
from dispatch.nvlink_layout import Counts, HostCounts, Planned, WordsAt
from dispatch.nvlink_order import eager_stream, ordered_eager
from dispatch.streams import Done
from dispatch.transports.base import WEIGHTS_GRAD, WORD_SPAN, X_GRAD, Request
from dispatch.transports.nvlink import NVLinkHandle

if TYPE_CHECKING:
    from dispatch.dispatcher import TokenDispatcher

_SIGNATURES = 8  # compiled dispatches (and combines) a dispatcher keeps, one per signature of its arguments
_DISPATCH, _COMBINE = agreement.VERB_CODES["dispatch"], agreement.VERB_CODES["combine"]
# a peer's word with any of these set stops the compiled dispatch at its agreement (the transport raises from the
# words: a failure seen, max_rows, a dispatch by groups); the gradients' bits it takes
RAISE_BITS = (WORD_SPAN - 1) & ~(X_GRAD | WEIGHTS_GRAD)


class UsualDispatches:
    """The compiled usual dispatches of one dispatcher on the engine (module doc)."""

    def __init__(self, dispatcher: "TokenDispatcher") -> None:
        self._d = dispatcher
        self._engine = dispatcher.transport.engine
        self._calls: list = []  # _Learnt, newest first
        self._combines: list = []  # UsualCombine of each signature of rows and weights learnt
        self._launches = None  # the engine's launches they were made from
        self._learnt: set = set()  # the signatures of both (a call the compiled ones did not take is not one)

    def dispatch(self, x, topk_idx, topk_weights):
        """:meth:`TokenDispatcher.dispatch`'s result (no ``max_rows``, one group,
        no ``async_op``) made by a compiled call, or None (nothing done: the
        front end takes the call)."""
        engine = self._engine
        if engine.launches is not self._launches or not engine.quiet:
            return None
        stream = eager_stream(engine)
        if stream is None or self._d.transport.phase_timer is not None:
            return None
        host.said_sync()  # (its host read, as torch's sync debug mode asks)
        for learnt in self._calls:
            try:
                got = learnt.compiled.dispatch(x, topk_idx, topk_weights, stream)
            except BaseException:  # (an allocation or launch that failed: its event recorded as the call unwound; or
                ordered_eager(engine, stream)  # an interrupt in the agreement, before any: one more operation
                raise  # counted, which at most makes a combine by groups push its pre-sums whole, the same bits)
            if got is not None:
                return self._result(got, x, topk_idx, topk_weights, learnt, stream)
        return None

    def _result(self, got: tuple, x, topk_idx, topk_weights, learnt: "_Learnt", stream: int):
        d, engine = self._d, self._engine
        what, number, out = got[:3]
        if what != "planned":  # stopped at the agreement: raise as it would
            off = 0 if torch.is_grad_enabled() else agreement.GRAD_OFF
            ticket = plan.Ticket(_DISPATCH + off + agreement.DISPATCHERS * d._calls.place, number)
            d._calls.settle(ticket, out)
            words = tuple(row[-1] for row in out)
            d.transport.agreed_words(Request(d, x, topk_idx, topk_weights, ticket, False, agreed=words))
            raise RuntimeError(f"dispatch #{number}: the ranks' agreement stopped the compiled call, and its "
                               f"checks found nothing: {out}")
        ordered_eager(engine, stream)  # recorded by the call
        if len(out) == 3:  # the status words: a failure the kernels recorded
            engine.raise_failure(*out)
        words, per_expert, tokens_at, headers, sends, rows_of, mine, bound, received, staged, planned = out
        if planned is not None:
            planned = Planned(*planned)
            if planned.tokens is not None:
                engine.operations += 1  # the pull's, with the counts exchange's
        counts = made(Counts, words=words, at=learnt.at, host=HostCounts(headers, sends, rows_of, mine),
                      received=received, bound=bound, tokens_per_expert=per_expert, tokens_at=tokens_at,
                      staged=staged, planned=planned, core=got[3])
        if planned is None or planned.tokens is None:  # not the usual case: the transport's plan goes on
            header = headers[d.rank]
            ticket = plan.Ticket(header[0], number, 0, False, -1, header[plan.HEADER.index("memory_rows")])
            request = made(Request, owner=d, x=x, topk_idx=topk_idx, topk_weights=topk_weights, ticket=ticket,
                           check_values=d.config.tuning.check_inputs, at_once=True,
                           exact_memory_rows=lambda: d._exact_memory_rows(x, ticket))
            handle, plan_out = d.transport.planned(request, counts)
            return d._dispatched(x, topk_weights, handle, plan_out, learnt.codec, None)
        # the usual case, planned and pulled: the handle and result the transport's plan and the front end
        # would make (NVLinkTransport._handle, work.dispatched), from the learnt call's handle
        handle = object.__new__(NVLinkHandle)
        handle.__dict__.update(learnt.handle, call=number, num_rows=rows_of[d.rank], x_grad_any=planned.x_grad,
                               weights_grad_any=planned.weights_grad, has_rows=tuple([n > 0 for n in rows_of]),
                               counts=counts, presum=planned.presum, slot_k=planned.slot_k, split_matrix=sends,
                               places=(planned.weights, planned.src_rank, planned.src_token))
        if torch.is_grad_enabled():
            tokens, weights, link = dispatch_node(x, topk_weights, d.anchor(x.device), planned.weights,
                                                  (d, handle, Done(planned.tokens)))
            handle = with_link(handle, link)
        else:
            tokens, weights = DispatchFn.outputs(topk_weights, planned.weights, handle, Done(planned.tokens))
        row_bytes, sum_wire, hidden = learnt.traffic
        return made(Dispatched, tokens=tokens, tokens_per_expert=per_expert, tokens_per_expert_host=mine,
                    weights=weights, src_rank=planned.src_rank, src_token=planned.src_token, handle=handle,
                    _traffic=lambda: handle.transport.stats(handle, row_bytes, sum_wire, hidden))

    def combine(self, expert_out, handle, weights):
        """:meth:`TokenDispatcher.combine`'s result (no ``async_op``) along the
        handle of a usual dispatch compiled, made by a compiled call, or None
        (nothing done: the front end takes the call)."""
        core = getattr(getattr(handle, "counts", None), "core", None)
        engine = self._engine
        if core is None or handle.owner is not self._d or engine.launches is not self._launches:
            return None
        stream = eager_stream(engine)
        if stream is None or self._d.transport.phase_timer is not None:
            return None
        linked = handle.link is not None
        for compiled in self._combines:
            try:
                got = compiled.combine(expert_out, weights, core, linked, stream)
            except BaseException:  # (as the dispatch's)
                ordered_eager(engine, stream)
                raise
            if got is not None:
                break
        else:
            return None
        what, number, out = got
        d = self._d
        if what != "done":  # stopped at the agreement: raise as it would (every rank has rows: its dtype's code)
            off = 0 if torch.is_grad_enabled() else agreement.GRAD_OFF
            d._calls.settle(plan.Ticket(_COMBINE + off + agreement.DISPATCHERS * d._calls.place, number, core.call),
                            out)
            checks.check_peer_rows([row[: len(plan.HEADER)] for row in out], "expert_out")
            raise RuntimeError(f"combine #{number}: the ranks' agreement stopped the compiled call, and its checks "
                               f"found nothing: {out}")
        ordered_eager(engine, stream)  # recorded by the call
        if linked and torch.is_grad_enabled():
            return combine_node(expert_out, weights, handle.link, (d, handle, Done(out)))
        return out

    def learn_combine(self, expert_out, handle, weights) -> None:
        """Compile the usual combine of this signature of rows and weights, whose
        call (no ``async_op``) along the handle of a usual dispatch compiled has
        just taken the usual path in Python (the checks passed)."""
        engine, d = self._engine, self._d
        core = getattr(getattr(handle, "counts", None), "core", None)
        parts = engine.compiled_parts()
        if (core is None or parts is None or handle.owner is not d or engine.launches is not self._launches
                or len(self._combines) >= _SIGNATURES):
            return
        dtype, hidden = expert_out.dtype, expert_out.shape[1]
        weight_dtype = None if weights is None else weights.dtype
        signature = ("combine", dtype, hidden, weight_dtype, handle.presum.shape[1])
        if signature in self._learnt:
            return
        self._learnt.add(signature)
        wire = sum_wire_dtype(d.config.combine_wire, dtype)
        push, home = engine.home_launches(dtype, weight_dtype, wire, hidden, handle.presum.shape[1], weight_dtype)
        if push is None:
            return
        board = d._calls.board
        code = -1 if weights is None else checks.FLOAT_CODES[weights.dtype]
        self._combines.append(parts[0].UsualCombine(
            push=push, home=home, hidden=hidden, device=expert_out.device, dtype=dtype, weighted=weights is not None,
            weights_dtype=weight_dtype or torch.float32, width=handle.presum.shape[1],
            verb=_COMBINE + agreement.DISPATCHERS * d._calls.place,
            grad_off=agreement.GRAD_OFF, call_wrap=agreement.CALL_WRAP, verb_col=plan.HEADER.index("verb"),
            call_col=plan.HEADER.index("call"), along_col=plan.HEADER.index("along"),
            call_row=[*plan.call_header(plan.Ticket(), checks.dtype_code(expert_out, True), hidden, code), 0],
            made_at=d._calls.counter("combine"), board_words=board.words_at, board_count=board.count_at,
            board_slot=board.slot, timeout=d.config.timeout, world=d.world_size, rank=d.rank,
            capacity_tokens=engine.capacity.tokens, capacity_topk=engine.capacity.topk, blocks=engine.blocks,
            sms=engine.sms, rows_per_block=cuda.THREADS // 32, record=parts[3]))

    def learn(self, x, topk_idx, topk_weights, handle, codec) -> None:
        """Compile the usual dispatch of this signature of arguments, whose call
        (no ``max_rows``, one group, no ``async_op``) has just taken the usual
        path in Python: every rank's checks passed, the engine's compiled counts
        exchange made ``handle``'s tensors and pulled its rows."""
        engine, d = self._engine, self._d
        planned = getattr(getattr(handle, "counts", None), "planned", None)
        if (planned is None or planned.tokens is None or handle.transport is not d.transport
                or engine.compiled_parts() is None or not isinstance(codec, CastCodec) or codec.wire != x.dtype
                or handle.__dict__.keys() != _PER_CALL | _SHARED):  # (a field neither names: not made in _result)
            return
        if engine.launches is not self._launches:
            self._calls, self._combines, self._launches, self._learnt = [], [], engine.launches, set()
        signature = ("dispatch", x.shape, x.dtype, x.device, topk_idx.shape, topk_idx.dtype, topk_weights.dtype)
        if signature in self._learnt:
            return
        self._learnt.add(signature)
        tokens, topk = topk_idx.shape
        wire = plan.weight_wire_dtype(topk_weights.dtype)
        fits, layout, counts, words, sizes, compiled, at = engine.counts_launches(tokens, topk, topk_idx.dtype, wire,
                                                                                  codec, x.shape[1])
        width = min(topk, d.num_local_experts)
        pull = engine.own_pull(codec, x, topk, (width, wire)) if compiled is not None else None
        if pull is None:
            return
        module, row_at, host_words, record = engine.compiled_parts(words)
        board = d._calls.board
        shape, layout_c, counts_c = compiled
        header = plan.header(x, topk_weights, topk, plan.Ticket())
        usual = module.UsualDispatch(
            shape=shape, layout=layout_c, counts=counts_c, pull=pull[0], pull_cap=pull[1], pull_min=pull[2],
            rows_per_block=pull[3], hidden=x.shape[1], device=x.device, x_dtype=x.dtype,
            idx_dtype=topk_idx.dtype, weights_dtype=topk_weights.dtype, wire_dtype=wire,
            verb=_DISPATCH + agreement.DISPATCHERS * d._calls.place,
            grad_off=agreement.GRAD_OFF, call_wrap=agreement.CALL_WRAP, verb_col=plan.HEADER.index("verb"),
            call_col=plan.HEADER.index("call"),
            call_row=[*plan.call_header(plan.Ticket()), 0], header=header, x_grad_bit=X_GRAD,
            weights_grad_bit=WEIGHTS_GRAD, raise_bits=RAISE_BITS, made_at=d._calls.counter("dispatch"),
            board_words=board.words_at, board_count=board.count_at, board_slot=board.slot, timeout=d.config.timeout,
            row_bytes=d.transport.row_bytes(x), allocator=free_memory.FREE_MEMORY.compiled is not None,
            age=free_memory.FREE_MEMORY_AGE, row_at=row_at, host_words=host_words,
            check_values=d.config.tuning.check_inputs, width=width, stage=bool(fits and tokens), record=record)
        if len(self._calls) == _SIGNATURES:
            self._learnt.discard(self._calls[-1].signature)
        fields = {name: value for name, value in handle.__dict__.items() if name in _SHARED}
        traffic = (to_experts_codec(d.config.dispatch_wire, x.dtype).row_bytes(x.shape[1]),
                   sum_wire_dtype(d.config.combine_wire, x.dtype), x.shape[1])
        learnt = _Learnt(usual, codec, at, signature, dict(fields, link=None), traffic)
        self._calls = [learnt, *self._calls[: _SIGNATURES - 1]]


class _Learnt(NamedTuple):
    """A compiled usual dispatch (``UsualDispatch``) and what its results take
    from the call it was learnt from: the wire codec of x, where its words hold
    what (``WordsAt``), its signature, the fields of that call's handle that
    every call of the signature shares (not those of ``_PER_CALL``; no link),
    and what ``Dispatched.stats`` counts rows by (the dispatch's row bytes on
    the wire, the combine's sum dtype, H)."""

    compiled: object
    codec: object
    at: WordsAt
    signature: tuple
    handle: dict
    traffic: tuple


# the handle's fields that differ from call to call of one signature (set by _result), and those that every
# call of a signature shares (taken from the learnt call's handle: its dispatcher and transport, the signature's
# device, T and K, and what the usual case leaves None)
_PER_CALL = frozenset(("call", "num_rows", "x_grad_any", "weights_grad_any", "has_rows", "counts", "presum", "slot_k",
                       "split_matrix", "places", "link"))
_SHARED = frozenset(("owner", "transport", "device", "num_tokens", "topk", "max_rows", "pad_blocks", "pad_index",
                     "group_experts", "group_rows", "group_bound"))


def usable(dispatcher: "TokenDispatcher") -> bool:
    """Whether ``dispatcher`` can have compiled usual dispatches: on the engine
    with its compiled host path, agreeing on the group's board, without
    capacity dropping or padding."""
    engine = getattr(dispatcher.transport, "engine", None)
    config = dispatcher.config
    return (engine is not None and getattr(engine, "_host", None) is not None and dispatcher._calls.board is not None
            and dispatcher.transport.agrees_dispatch and config.capacity_factor is None
            and not config.pad_to_capacity and cuda.available() and host.enabled)
