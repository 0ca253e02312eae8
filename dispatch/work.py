"""Work in flight: a dispatch started with ``async_op=True`` (:class:`DispatchWork`),
a combine or a move along a handle (:class:`ExchangeWork`), and the sums of a
combine by groups (:class:`GroupSums`).

Notation as in ``dispatch.handle``.
"""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING

import torch

from dispatch import checks
from dispatch.autograd import DispatchFn, dispatch_node
from dispatch.handle import CombineHandle, Dispatched, DispatchedGroup, only, pad_to_blocks, padded, with_link
from dispatch.streams import Done, StartedGroups

if TYPE_CHECKING:
    from dispatch.dispatcher import TokenDispatcher
    from dispatch.plan import Ticket


class GroupSums:
    """Expert rows summed home group by group (``TokenDispatcher.combine_groups``;
    ``call``: the ticket of that call, which each add names in its agreement)."""

    def __init__(self, dispatcher: "TokenDispatcher", handle: CombineHandle, dtype, wire: str,
                 call: "Ticket") -> None:
        self._dispatcher, self._handle, self.dtype, self._call = dispatcher, handle, dtype, call
        self._issuer = handle.transport.group_sums(handle, wire, dtype)
        self._added, self._last, self._result = 0, None, None
        self._weights_dtype = False  # not known before the first add

    def add(self, rows: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """The next group's rows ([N_g, H'], canonical order; cast to ``dtype``
        if given in another) and their routing weights ([N_g] floating, e.g.
        ``DispatchedGroup.weights``), or None (in every group alike). The
        pre-sums' way home starts behind the caller's current stream's work so
        far. A rank that refuses its rows here (shape, weights) makes its
        peers raise too, naming it (each group's add agrees on the call, as
        ``combine`` does). Each add names its ``combine_groups`` there too:
        the adds of two along one handle, made in another order on some rank,
        raise ``CallsDiffer`` on every rank instead of pairing crosswise. Leave
        the rows and weights unchanged until :meth:`wait`: a later group's
        pre-sums may read them (the NVLink engine sums each pre-sum whole when
        its last group comes). An add past the last group raises a ValueError
        on this rank alone, agreeing on nothing: its peers make no such add.
        On the NVLink engine, replay no CUDA graph of the dispatcher's
        operations between two adds: the earlier groups' pushes would not be
        redone."""
        handle, g = self._handle, self._added
        if g == handle.groups:  # here alone: no peer makes this add, so it agrees on nothing
            raise ValueError(f"add: all {handle.groups} groups were added already")
        given = weights.dtype if isinstance(weights, torch.Tensor) else None

        def check():
            lo, hi = handle.row_range(g)
            devices = self._dispatcher.devices
            checks.check_rows("rows", rows, hi - lo, f"group {g} has", devices, handle.device)
            if self._last is not None and rows.shape[1] != self._last.shape[1]:
                raise ValueError(f"rows of group {g} have {rows.shape[1]} columns, earlier groups "
                                 f"{self._last.shape[1]}")
            if weights is not None:
                checks.check_values("weights", weights, hi - lo, devices, handle.device)
            if self._weights_dtype is not False and given != self._weights_dtype:
                raise ValueError(f"weights of group {g}: {given}, earlier groups' {self._weights_dtype}; weigh "
                                 "every group alike (or none)")

        ticket = self._dispatcher._along("GroupSums.add", handle, check)
        code = checks.dtype_code(rows) if self.dtype is None else -1  # with a dtype, rows are cast to it
        weights_code = -1 if given is None else checks.FLOAT_CODES[given]  # (one dtype on every rank, or none)
        checks.check_peer_rows(self._dispatcher._calls.agree_part(ticket, self._call, code, rows.shape[1],
                                                                  weights_code), "rows")
        if self.dtype is not None and rows.dtype != self.dtype:
            # cast, not refused: a rank without rows in this group could not
            # refuse alike, and would send its pieces to peers that wait
            rows = rows.to(self.dtype)
        if weights is not None:
            weights = weights.detach().contiguous()
        rows = rows.detach().contiguous()
        reads = (rows,) if weights is None else (rows, weights)
        self._dispatcher._start(lambda: Done(self._issuer.add(g, rows, weights)), reads, True)
        self._added, self._last, self._weights_dtype = g + 1, rows, given

    def refuse(self, error: BaseException) -> None:
        """Raise ``error``, this rank's reason not to add its next group (its
        experts raised, say), once it took part in that add's agreement marked
        refused: every peer raises ``agreement.PeerRefused`` there, naming it,
        instead of waiting for it (``TokenDispatcher.refuse``). Once every
        group is added its peers wait at no add: a ValueError, here alone."""
        if self._added == self._handle.groups:
            raise ValueError(f"refuse: all {self._handle.groups} groups were added; refuse the call the peers make "
                             "next instead (TokenDispatcher.refuse)") from error
        self._dispatcher._calls.refuse("GroupSums.add", self._handle.call, error, self._call)

    def wait(self) -> torch.Tensor:
        """[T, H'] in ``dtype``: per token, the (weighted) sum of its rows, as
        ``combine_rows``; the caller's current stream waits for it. Once every
        group is added. Later calls return it again, and their current stream
        waits too."""
        if self._result is None:
            if self._added != self._handle.groups:
                raise ValueError(f"wait: {self._added} of {self._handle.groups} groups were added; add every group")
            self._started = self._dispatcher._start(self._issuer.finish, (self._last,), True)
            self._result, self._issuer, self._last = self._started.result(), None, None
        else:
            self._started.follow()
        return self._result


class DispatchWork:
    """A dispatch in flight (``TokenDispatcher.dispatch(..., async_op=True)``).

    Its routing plan is made (``handle`` is known); the token exchange may
    still be moving. It holds the inputs and the buffers until waited for.

    Attributes:
        handle: the :class:`CombineHandle` of this dispatch (also
            ``wait().handle``; with ``pad_to_capacity``, only ``wait().handle``
            moves rows: the rows are placed in their blocks at the wait).
    """

    def __init__(self, dispatcher, x, topk_weights, handle, plan_out, started: StartedGroups, traffic,
                 dropped) -> None:
        self._args = (x, topk_weights, traffic, dropped)
        self.handle = handle
        self._result: Dispatched | None = None
        self._dispatcher, self._started, self._plan_out = dispatcher, started, plan_out
        self._grad_on = torch.is_grad_enabled()  # the grad mode the call was agreed in

    def wait_group(self, g: int) -> DispatchedGroup:
        """Group g's rows (:class:`DispatchedGroup`), not differentiable; the
        caller's current stream waits for that group's piece only (the later
        groups' rows may still be moving). A dispatch without ``groups`` is
        one group. Leave the rows unchanged until every group is waited for:
        on the NVLink engine a later group copies rows that an earlier group
        brought."""
        handle = self.handle
        g = group_index(g, handle.groups)
        if self._result is not None:
            raise ValueError("wait_group: the dispatch was waited for (wait()); take its rows from that result")
        if handle.pad_blocks is not None:
            raise ValueError("wait_group: a pad_to_capacity dispatch places its rows at wait(); use wait()")
        lo, hi = handle.row_range(g)
        bounds = handle.group_experts or (0, self._dispatcher.num_local_experts)
        first, end = bounds[g], bounds[g + 1]
        tokens = self._started.result(g)  # once waited for, again at wait()
        if handle.groups == 1:
            tokens = padded(tokens, handle, 0)
        per_expert_host = self._plan_out.tokens_per_expert_host
        if per_expert_host is not None:
            per_expert_host = only(per_expert_host, first, end)
        per_expert = only(self._plan_out.tokens_per_expert, first, end)  # on the device: no host copy
        weights = padded(self._plan_out.weights, handle, 0)[lo:hi].to(self._args[1].dtype)
        return DispatchedGroup(tokens.detach(), per_expert, per_expert_host, weights, (lo, hi), (first, end))

    def wait(self) -> Dispatched:
        """The :class:`Dispatched` result; the caller's current stream waits for
        the exchange (the host does not, on CUDA). The autograd node of the
        dispatch is made here, in the grad mode the dispatch started in (its
        peers' at that call), whatever the mode of the wait. Later calls
        return it again, and their current stream waits too."""
        if self._result is None:
            with torch.set_grad_enabled(self._grad_on):
                self._result = dispatched(self._dispatcher, *self._args[:2], self.handle, self._plan_out,
                                          self._started, *self._args[2:])
            self.handle = self._result.handle
            self._args = self._plan_out = None
        else:
            self._started.follow()
        return self._result


def dispatched(dispatcher: "TokenDispatcher", x, topk_weights, handle: CombineHandle, plan_out,
               started: StartedGroups, traffic, dropped) -> Dispatched:
    """The :class:`Dispatched` result of a dispatch from its plan and its rows'
    move (``DispatchWork.wait``; a dispatch without ``async_op`` makes it at once):
    the dispatch's autograd node (with grad mode on, on every rank, whatever it
    needs itself: ``CombineHandle.link``), its outputs padded where its handle
    says so."""
    if handle.pad_blocks is not None:  # the rows' places among the blocks, from their sources
        started.result()  # the caller's stream follows the exchange (the engine writes the sources)
        handle, plan_out = pad_to_blocks(handle, plan_out, dispatcher.num_local_experts)
    if torch.is_grad_enabled():
        tokens, weights, link = dispatch_node(
            x, topk_weights, dispatcher.anchor(x.device), plan_out.weights, (dispatcher, handle, started))
        handle = with_link(handle, link)
    else:
        tokens, weights = DispatchFn.outputs(topk_weights, plan_out.weights, handle, started)
    src_rank, src_token = plan_out.src_rank, plan_out.src_token
    if handle.max_rows is not None:  # (else the N rows as moved)
        src_rank, src_token = padded(src_rank, handle, -1), padded(src_token, handle, -1)
    return Dispatched(tokens=tokens, tokens_per_expert=plan_out.tokens_per_expert,
                      tokens_per_expert_host=plan_out.tokens_per_expert_host, weights=weights, src_rank=src_rank,
                      src_token=src_token, handle=handle, _traffic=traffic, dropped=dropped)


def group_index(g: object, groups: int) -> int:
    """``wait_group``'s ``g``, an index in [0, groups)."""
    if isinstance(g, bool) or not isinstance(g, numbers.Integral) or not 0 <= g < groups:
        raise ValueError(f"g must be a group index in [0, {groups}), got {g!r}")
    return int(g)


class ExchangeWork:
    """A combine or a move along a handle in flight (the verbs' ``async_op=True``;
    ``started``: its exchange, ``finish``: the result from it, by default its
    result; ``groups``: a ``dispatch_rows`` by that many groups). It holds the
    buffers of the exchange until waited for."""

    def __init__(self, started, finish=None, groups: int = 1) -> None:
        self._started, self._finish, self._result, self._groups = started, finish or started.result, None, groups

    def wait_group(self, g: int) -> torch.Tensor:
        """Group g's rows of a ``dispatch_rows`` along the handle of a dispatch
        by groups; the caller's current stream waits for that group's piece."""
        if self._groups == 1:
            raise ValueError("wait_group: only a dispatch_rows along the handle of a dispatch by groups "
                             "(dispatch(groups=G), G > 1) moves by groups")
        return self._started.result(group_index(g, self._groups))

    def wait(self) -> torch.Tensor:
        """The verb's result tensor; the caller's current stream waits for the
        exchange (the host does not, on CUDA). Later calls return it again, and
        their current stream waits too."""
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        else:
            self._started.follow()
        return self._result

