"""The agreement of every call across the ranks: before any token moves, every
verb that communicates (and each backward) agrees on the call with its peers,
whatever its own checks (``dispatch.checks``) found.

Only one rank may see its own mistake, so no rank raises alone. The agreement
runs on the group's board in shared memory where the ranks share a host
(``dispatch.board``), else over the host channel (:func:`agree`; beside
NCCL a dispatch then rides on its counts all-gather). The call's header (``plan.HEADER``)
names it (its verb, dispatcher and grad mode, its number on the dispatcher,
the dispatch whose handle it moves along) and marks a rank that refused its
input; after the agreement every rank raises alike, before any token moves:
the rank that refused its own error, its peers a :class:`PeerRefused` naming
it, and every rank a :class:`CallsDiffer` naming both calls where the ranks
are at different calls, so that no call completes by pairing with another.
A refusal agreed so leaves the dispatcher usable; calls that differ are
counted by no rank. ``dispatch.create`` agrees on the config the same way
(:func:`agree_config`).
"""

from __future__ import annotations

import array
import dataclasses
import hashlib

import torch
import torch.distributed as dist

from dispatch import comm, plan
from dispatch.board import Board
from dispatch.plan import HEADER

_FAILED, _HEADER_LEN = HEADER.index("failed"), len(HEADER)


def header_rows(headers) -> list[list[int]]:
    """Headers as lists of ints (from a host tensor, or as given)."""
    return headers.tolist() if isinstance(headers, torch.Tensor) else headers


# what ``plan.Ticket.verb`` names: every verb (and backward) that communicates, by its index here, plus
# GRAD_OFF for a dispatch or combine made with grad mode off, plus DISPATCHERS times the dispatcher's place in
# its group (``Calls.ticket``), so that every header of a call (on the board, over the host channel, in a counts
# exchange) tells apart calls of two dispatchers, and a differentiable call that some rank makes without autograd
VERBS = ("none", "dispatch", "combine", "dispatch_rows", "combine_rows", "combine_slots", "combine_groups",
         "GroupSums.add", "the backward of dispatch", "the backward of combine", "dispatch.create", "reserve")
VERB_CODES = {verb: code for code, verb in enumerate(VERBS)}
GRAD_OFF, DISPATCHERS = 16, 32
assert len(VERBS) <= GRAD_OFF
CALL_WRAP = 2**31 - 1  # the most calls of a verb numbered before 1 again: the engine's kernels take an int32


def agree_config(config, group) -> None:
    """Every rank of ``group`` makes its next dispatcher with the same ``config``
    (``dispatch.create``'s first collective, before any whose shape the config
    decides): a digest of it all-gathered over the host channel, waited for at
    most ``config.timeout``; where the ranks' differ, every rank raises a
    ValueError naming the fields and the ranks' values (one more all-gather)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    flat = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.name != "tuning"}
    flat.update({f.name: getattr(config.tuning, f.name) for f in dataclasses.fields(config.tuning)})
    digest = hashlib.blake2b(repr(sorted(flat.items())).encode(), digest_size=8).digest()
    host = comm.host_group(group)
    arrivals = comm.Arrivals(group, config.timeout, role="config")
    ticket = plan.Ticket(VERB_CODES["dispatch.create"], arrivals.index + 1)  # the group's n-th create
    # a call's agreement as the host channel makes it (the ranks at another call raise CallsDiffer), its tail the digest
    try:
        rows = agree(ticket, host, world, arrivals, tail=(int.from_bytes(digest, "little", signed=True),))
    except CallsDiffer:
        arrivals.withdraw()  # not counted, as a call's: the next create is numbered as this one
        raise
    if all(row[-1] == rows[0][-1] for row in rows):
        return
    everyone: list = [None] * world
    dist.all_gather_object(everyone, flat, group=host)  # every rank is here: the digests came from all
    told = "; ".join(f"{name} ({', '.join(f'rank {r}: {theirs[name]!r}' for r, theirs in enumerate(everyone))})"
                     for name in flat if any(theirs.get(name) != flat[name] for theirs in everyone))
    if not told:  # equal values written apart (30 and 30.0): the same config
        return
    raise ValueError(f"config: the ranks of the group made this dispatcher with different configs: {told}; every "
                     "rank calls dispatch.create with the same config, in the same order")


class CallsDiffer(RuntimeError):
    """The ranks are at different calls (another verb, number, handle's dispatch
    or dispatcher): every rank raises it alike, and none counts the call as made
    (:meth:`Calls.agree`), so that where one rank's mistake was an extra call
    the ranks are in step again at the next."""


class PeerRefused(RuntimeError):
    """Some rank refused its own arguments of this call (its error says why).

    Attributes:
        ranks: the ranks that refused.
    """

    def __init__(self, ranks: list[int], call: str) -> None:
        super().__init__(f"rank(s) {ranks} of the group refused {call} (see their errors); every rank stops "
                         "here, before any row of this call moves, and the dispatcher stays usable")
        self.ranks = ranks


def call_name(verb: int, call: int, along: int = 0) -> str:
    """``"combine #3 along dispatch #2"``: a call as the messages name it (its
    dispatcher's place too where it is not the group's first)."""
    dispatcher, verb = divmod(verb, DISPATCHERS)
    off, verb = divmod(verb, GRAD_OFF)
    name = f"{VERBS[verb] if 0 <= verb < len(VERBS) else f'verb {verb}'} #{call}"
    name = f"{name} along dispatch #{along}" if along else name
    name = f"{name} with grad mode off" if off else name
    return f"{name} of dispatcher #{dispatcher + 1}" if dispatcher else name


def check_peer_calls(headers) -> None:
    """Every rank is at the same call (of the same dispatcher), and none refused it.

    Args:
        headers: [W, len(HEADER)] every rank's header (host int64 tensor, or
            lists); its verb tells the dispatcher too (``DISPATCHERS``).
    Raises:
        :class:`CallsDiffer` naming the ranks and their calls where they differ
        (the handle's dispatch compared between the ranks that did not refuse:
        a refused handle may be none);
        :class:`PeerRefused` naming the ranks that refused (on every rank alike).
    """
    headers = header_rows(headers)
    columns = [HEADER.index(c) for c in ("verb", "call", "along")]
    calls = [tuple(h[c] for c in columns) for h in headers]
    failed = [r for r, h in enumerate(headers) if h[_FAILED]]
    dispatchers = [c[0] // DISPATCHERS for c in calls]
    if any(d != dispatchers[0] for d in dispatchers):
        told = ", ".join(f"rank {r}: dispatcher #{d + 1} at {call_name(c[0] % DISPATCHERS, *c[1:])}"
                         for r, (d, c) in enumerate(zip(dispatchers, calls)))
        raise CallsDiffer(f"the ranks of the group are at calls of different dispatchers ({told}): every rank "
                          "must make the same calls of each dispatcher in the same order; every rank stops here, "
                          "before any token moves")
    alongs = {c[2] for r, c in enumerate(calls) if r not in failed}
    if any(c[:2] != calls[0][:2] for c in calls) or len(alongs) > 1:
        at: dict[tuple[int, ...], list[int]] = {}
        for rank, c in enumerate(calls):
            at.setdefault(c, []).append(rank)
        told = "; ".join(f"rank(s) {ranks} at {call_name(*c)}" for c, ranks in at.items())
        raise CallsDiffer(f"the ranks of the group are at different calls of the dispatcher ({told}): a rank "
                          "skipped a call or made another; no call completes by pairing with another, and "
                          "every rank stops here, before any token moves")
    if failed:
        raise PeerRefused(failed, call_name(calls[0][0], calls[0][1], min(alongs, default=0)))


def agree(ticket: plan.Ticket, group, world_size: int, arrivals: comm.Arrivals | None = None, dtype_code: int = -1,
          tail: tuple[int, ...] = (), hidden: int = 0, weights_code: int = -1) -> list[list[int]]:
    """The first message of a call over the host channel: every rank's header
    of the call, all-gathered on the host and checked (:func:`check_peer_calls`).

    It runs over the group's host channel (``comm.host_group``: the group
    itself on gloo, a gloo group of the same ranks beside NCCL), so that it
    waits for the peers to reach the call and for nothing queued on the GPU.
    Its row is the header and one tail entry, the same for every call of
    every dispatcher of the group and for ``dispatch.create``'s agreement on
    the config: where ranks are at different calls, of dispatchers of other
    shapes too, the rows pair, and the calls differ. It never meets a counts
    exchange (whose rows have other widths: on gloo a collective of rows of
    two widths aborts the process): on gloo a dispatch agrees here before its
    counts exchange (``Calls.dispatch_agrees``); beside NCCL the counts
    exchanges run on NCCL.

    Args:
        ticket: this call (``refused``: this rank takes part, then raises).
        group: the host channel's group.
        dtype_code: the ``x_dtype`` column: the code of the rows' dtype where
            the verb agrees on one (``combine``), -1 for none.
        tail: entries after the header (at most one).
        hidden: the ``hidden`` column: the width of the rows the call moves (0: none).
        weights_code: the ``weights_dtype`` column: the code of the weights' dtype where the
            call takes weights (``checks.FLOAT_CODES``), -1 for none.
    Returns:
        [W][len(HEADER) + len(tail)] every rank's header and tail.
    """
    row = torch.zeros(len(HEADER) + 1, dtype=torch.int64)
    end = len(HEADER) + len(tail)
    row[:end] = torch.tensor(plan.call_header(ticket, dtype_code, hidden, weights_code) + list(tail), dtype=torch.int64)
    rows = comm.all_gather_rows(row, group, world_size, arrivals=arrivals)[:, :end].tolist()
    check_peer_calls(rows)
    return rows


class Calls:
    """One dispatcher's calls: numbered per verb, and agreed with the peers
    before any token moves, on the group's board where the ranks share a host
    (``dispatch.board``), else over the host channel (:func:`agree`).

    Args:
        group, world_size: the dispatcher's group.
        arrivals: its bounded waits (its ``index`` is the dispatcher's place in
            the group, which the board's rows carry).
        timeout: ``DispatchConfig.timeout``.

    Attributes:
        dispatch_agrees: a dispatch agrees on its call before its counts
            exchange: on the board, and over gloo, whose host channel is the
            group itself (an agreement meets only another); beside NCCL off
            the board it rides on its counts exchange, which checks the call.
    """

    def __init__(self, group, world_size: int, arrivals: comm.Arrivals, timeout: float) -> None:
        self._made = array.array("q", [0] * len(VERBS))  # calls made of each verb (read by dispatch.usual too)
        self._board = Board.for_group(group)
        self.dispatch_agrees = self._board is not None or "cpu" in comm.device_types(group)
        self._host = comm.host_group(group) if self._board is None else None
        self._group, self._world, self._arrivals, self._timeout = group, world_size, arrivals, timeout

    def ticket(self, verb: str, along: int = 0) -> plan.Ticket:
        """The next call of ``verb`` (numbered from 1, and from 1 again after
        ``CALL_WRAP``), along the handle of
        dispatch ``along`` (0: none); a dispatch or combine made with grad
        mode off says so (its backward is every rank's or none's)."""
        code = VERB_CODES[verb]
        number = self._made[code] % CALL_WRAP + 1
        self._made[code] = number
        off = GRAD_OFF if verb in ("dispatch", "combine") and not torch.is_grad_enabled() else 0
        return plan.Ticket(code + off + DISPATCHERS * self._arrivals.index, number, along)  # (self.place)

    @property
    def place(self) -> int:
        """The dispatcher's place among the group's (its calls' verbs carry it: ``DISPATCHERS``)."""
        return self._arrivals.index

    @property
    def board(self) -> Board | None:
        """The group's board, where its ranks agree (None: over the host channel)."""
        return self._board

    def counter(self, verb: str) -> int:
        """The address of the int64 count of ``verb``'s calls made, which :meth:`ticket`
        numbers them from (a compiled call numbers its own there: ``dispatch.usual``)."""
        return self._made.buffer_info()[0] + 8 * VERB_CODES[verb]

    def agree(self, ticket: plan.Ticket, dtype_code: int = -1, tail: tuple[int, ...] = (),
              hidden: int = 0, weights_code: int = -1) -> list[list[int]]:
        """Agree on the call of ``ticket`` with the peers: [W][len(HEADER) +
        len(tail)] every rank's header of the call and what followed it
        (``tail``: at most one entry; ``dtype_code``, ``hidden``: the dtype and
        width of its rows, :func:`check_peer_rows`; ``weights_code``: its
        weights' dtype, ``checks.check_peer_rows``). Raises as
        :func:`check_peer_calls`; where the ranks' calls differ, none is
        counted as made (this rank's number is given again)."""
        try:
            if self._board is None:
                return agree(ticket, self._host, self._world, self._arrivals, dtype_code, tail,
                             hidden, weights_code)
            row = [*plan.call_header(ticket, dtype_code, hidden, weights_code), *(tail or (0,))]  # one length for all
            end = _HEADER_LEN + (1 if tail else 0)  # what the caller reads back (no tail: the same 0 on every rank)
            rows = self._board.agree(row, self._timeout, lambda: call_name(ticket.verb, ticket.call, ticket.along),
                                     end)
        except CallsDiffer:
            self.withdraw(ticket)
            raise
        same, mine = not ticket.refused, row[:end]
        for r in rows:
            same = same and r == mine
        if not same:  # else every rank made this very call, unrefused
            self.settle(ticket, rows)
        return rows

    def settle(self, ticket: plan.Ticket, rows) -> None:
        """Raise as :meth:`agree` does where ``rows``, the call's agreement on the
        board, are not every rank at this very call unrefused (nothing where
        they are); ``rows`` may be (missing, withdrawn): this rank gave up
        waiting (``csrc/host.cpp``'s ``board_agree``)."""
        if isinstance(rows, tuple):
            what = call_name(ticket.verb, ticket.call, ticket.along)
            raise RuntimeError(self._board.message(*rows, what, self._timeout))
        try:
            check_peer_calls([r[:_HEADER_LEN] for r in rows])
        except CallsDiffer:
            self.withdraw(ticket)
            raise

    def agree_part(self, ticket: plan.Ticket, whole: plan.Ticket, dtype_code: int = -1,
                   hidden: int = 0, weights_code: int = -1) -> list[list[int]]:
        """:meth:`agree` for a call that is a part of the call ``whole`` (a
        ``GroupSums.add`` of its ``combine_groups``): the whole's number travels
        in the tail, so that parts of two calls along one handle, made in
        another order on some rank, do not pair crosswise: every rank raises
        :class:`CallsDiffer` naming the ranks and both calls, and none counts
        the part."""
        rows = self.agree(ticket, dtype_code, (whole.call,), hidden, weights_code)
        wholes = [row[-1] for row in rows]
        for number in wholes:  # the usual case, at a glance: every rank at a part of this very call
            if number != whole.call:
                break
        else:
            return rows
        self.withdraw(ticket)
        at: dict[int, list[int]] = {}
        for rank, number in enumerate(wholes):
            at.setdefault(number, []).append(rank)
        told = "; ".join(f"rank(s) {ranks} at {call_name(ticket.verb % DISPATCHERS, ticket.call)} of "
                         f"{call_name(whole.verb, number, whole.along)}" for number, ranks in at.items())
        raise CallsDiffer(f"the ranks of the group are at parts of different calls ({told}): every rank makes "
                          "the parts of its calls in the same order; no part completes by pairing with another "
                          "call's, and every rank stops here, before any row moves")

    def refuse(self, verb: str, along: int, error: BaseException, whole: plan.Ticket | None = None) -> None:
        """Raise ``error``: this rank's reason not to make its next call of
        ``verb`` along dispatch ``along`` (its experts raised, say), once it
        took part in that call's agreement marked refused, as a refusal of its
        arguments does (:func:`refuse`): every peer raises :class:`PeerRefused`
        there, naming it, instead of waiting for it until the timeout.
        ``whole``: the call it is a part of (:meth:`agree_part`)."""
        ticket = dataclasses.replace(self.ticket(verb, along), refused=True)
        refuse(error, (lambda: self.agree(ticket)) if whole is None else (lambda: self.agree_part(ticket, whole)))

    def withdraw(self, ticket: plan.Ticket) -> None:
        """Give ``ticket``'s number back (where it is still its verb's last):
        the ranks' calls differed (:class:`CallsDiffer`), and none counts it."""
        code = ticket.verb % GRAD_OFF
        if self._made[code] == ticket.call:
            self._made[code] = ticket.call - 1


def refuse(error: Exception, take_part) -> None:
    """Raise ``error``, this rank's refusal of its arguments, once it took part
    in the call's first message marked refused (``take_part()``, which raises
    :class:`PeerRefused` on every rank): its peers raise there too, naming it,
    instead of pairing their exchanges with its next call."""
    try:
        take_part()
    except PeerRefused:
        pass  # (raised below, outside this handler: error keeps its own cause, without this one)
    except Exception as other:  # the ranks are at different calls, or a peer is missing
        raise other from error
    raise error  # (a refused first message raises PeerRefused on every rank: take_part does not return)
