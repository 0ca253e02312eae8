"""The transport protocol: what moves a dispatch's rows, behind the front end.

Notation as in ``dispatch.handle`` (W, E_local, T, K, H, N).

A transport is one way of moving rows over one kind of link (the alltoall
variant over NCCL, over the NVLink engine, the allgather and hierarchical
variants, ``auto``'s choice among them). The front end
(``dispatch.dispatcher.TokenDispatcher``) checks the verbs' arguments, agrees
on each call with the peers and runs the autograd and the streams; it talks to
its transport through these methods only, each in one form:

* ``plan(request)``: the routing plan of one dispatch and its counts exchange
  (a :class:`Request`); returns the handle and the per-row facts;
* ``to_experts(rows, handle, codec, own)``: [T, H] home rows -> [N, H] rows
  for the experts, one piece per group of local experts (``PendingGroups``; a
  ``Pending`` for one group);
* ``to_home(rows, handle, weights, wire)``: [N, H] rows -> [T, H] sums home
  (``Pending``);
* ``slots_home(values, handle)``: [N] per-row values -> [T, K] per slot;
* ``group_sums(handle, wire, dtype)``: the sums home of a combine by groups;
* ``stats(...)``: the traffic of a round trip, from host-side sizes.

Each movement returns work in flight; ``finish()`` gives its result. The
transports are registered by (variant, transport) in ``dispatch.transports``.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dispatch import checks, comm, plan
from dispatch.codec import Codec, sum_wire_dtype, to_experts_codec
from dispatch.handle import CombineHandle, PlanOutputs, received
from dispatch.stats import DispatchStats, resolve_local_world_size
from dispatch.streams import Pending, PendingGroups

_FAILED = plan.HEADER.index("failed")
# the bits of a rank's word in a dispatch's agreement (``Transport.dispatch_word``), then G - 1 in GROUPS units
BOUNDED, X_GRAD, WEIGHTS_GRAD, FAILED = 1, 2, 4, 8
GROUPS = 2 * FAILED
WORD_SPAN = GROUPS << 31  # a word is below it (G < 2**31)


def grads_of(words: tuple[int, ...]) -> tuple[bool, bool]:
    """Which gradients some rank needs (x, topk_weights), from every rank's word."""
    return any(w & X_GRAD for w in words), any(w & WEIGHTS_GRAD for w in words)


@dataclass(frozen=True)
class Request:
    """One dispatch, checked by the front end, for a transport's ``plan``.

    Attributes:
        owner: the dispatcher it is for (the handle's ``owner``).
        x: [T, H] tokens; topk_idx: [T, K] expert ids (-1 empty); topk_weights: [T, K].
        ticket: the call (``plan.Ticket``): its number, whether this rank
            refused it, its row budgets (``max_rows``, ``memory_rows``; -1: none).
        check_values: check the values of the routing (``checks.value_flags``).
        groups: G, the groups of local experts the rows move by.
        agreed: where the transport agrees on its dispatches over the host
            (``Transport.agrees_dispatch``), every rank's ``dispatch_word``;
            else None.
        exact_memory_rows: where the ticket's ``memory_rows`` is a lower bound,
            a collective giving every rank's exact budget of device memory in
            rows, which every rank makes where some rank falls short of its
            bound (``checks.check_row_budgets``); else None.
        at_once: the dispatch's own rows move right after its plan, on the
            caller's stream, in one group, untimed (no ``async_op``, no groups,
            no phase timer): the transport may move them within its plan, and
            its ``to_experts`` of them then hands those out.
    """

    owner: object
    x: torch.Tensor
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor
    ticket: plan.Ticket
    check_values: bool
    groups: int = 1
    agreed: tuple[int, ...] | None = None
    exact_memory_rows: Callable[[], list[int]] | None = None
    at_once: bool = False

    @property
    def max_rows(self) -> int | None:
        """The dispatch's bound on the rows this rank receives (None: none)."""
        return None if self.ticket.max_rows < 0 else self.ticket.max_rows


class Transport(abc.ABC):
    """Moves rows for one dispatcher (see the module doc).

    Attributes:
        variant, transport: (class) its key in the registry.
        host_free: (class) whether a dispatch with ``max_rows`` and the round
            trip after it read nothing on the host (CUDA-graph capturable).
        max_topk: (class) the most slots per token it moves (None: any).
        bounded_groups: (class) whether it moves a dispatch by groups with
            ``max_rows`` (each group padded to its bound, nothing read on the host).
        device_bound: (class) whether its kernels run on one device: the front
            end then asks its ``check_current(x=None)`` before each call's
            agreement, which refuses a call they cannot make as it is called
            (another CUDA device current; a dispatch's ``x`` elsewhere) on this
            rank alone, so that its peers are refused with it.
        agrees_dispatch: whether every dispatch is agreed on the host (on the
            board, else over the host channel) before any exchange, with a word of its own
            (``dispatch_word``): a transport that learns of failures on the
            device (with ``max_rows``), so that every rank raises them at one
            dispatch, or whose exchanges cannot time out (a peer that raised
            alone would leave the others waiting).
        config, group, world_size (W), rank, num_local_experts (E_local),
        local_world_size (ranks per node), arrivals (``comm.Arrivals``: the
        bounded wait of its counts exchange), phase_timer (or None).
    """

    variant = ""
    transport = "nccl"
    host_free = False
    max_topk: int | None = None
    bounded_groups = False
    device_bound = False
    agrees_dispatch = False
    reserves = False  # whether reserve() makes room (a collective), or does nothing

    def __init__(self, config, group: dist.ProcessGroup | None) -> None:
        self.config, self.group = config, group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local_experts = config.num_experts // self.world_size
        configured = config.tuning.local_world_size
        self.local_world_size = resolve_local_world_size(
            configured, self.world_size, None if configured is not None else comm.group_hosts(group))
        self.arrivals = comm.Arrivals(group, config.timeout)
        self.phase_timer = None
        self._row_bytes_of: dict[tuple, int] = {}

    @property
    def key(self) -> tuple[str, str]:
        return self.variant, self.transport

    @abc.abstractmethod
    def plan(self, request: Request) -> tuple[CombineHandle, PlanOutputs]:
        """The routing plan and its exchanges; no token data moves yet. With
        ``check_values``, a rank with bad values raises right after the counts
        exchange, in which it marks itself failed so that its peers raise there
        too; ranks that disagree on the call, K, H or dtypes are refused
        (``checks.check_peer_headers``), and so is a rank over one of its row
        budgets (``checks.check_row_budgets``), before any token moves. With
        ``max_rows`` a transport that reads its counts on the host pads the
        rows to it (``CombineHandle.max_rows``); by groups, it plans all at once
        unless it moves by groups (``shape_fields``)."""

    # The movements along a handle: the front end calls them on ``handle.transport``,
    # the transport that planned it (a transport that only chooses, as ``auto``,
    # plans through another and has none of its own).

    def to_experts(self, rows: torch.Tensor, handle: CombineHandle, codec: Codec,
                   own: bool = False) -> "PendingGroups | Pending":
        """[T, H] home rows -> [N, H] expanded rows (dtype of ``rows``), packed
        by ``codec`` (gather + encode), exchanged, unpacked (decode + expand);
        piece g is group g's rows. ``own``: the dispatch's own x (the NVLink
        engine writes the rows' places as it moves them)."""
        raise NotImplementedError(f"{type(self).__name__} moves no rows of its own")

    def to_home(self, rows: torch.Tensor, handle: CombineHandle, weights: torch.Tensor | None,
                wire: torch.dtype) -> Pending:
        """[N, H] expanded rows -> [T, H] (dtype of ``rows``): weighted pre-sum
        per (token, rank), exchange back via ``wire``, sum in ascending rank order."""
        raise NotImplementedError(f"{type(self).__name__} moves no rows of its own")

    def slots_home(self, values: torch.Tensor, handle: CombineHandle) -> Pending:
        """[N] per-row values -> [T, K] per-slot values (0 for empty slots)."""
        raise NotImplementedError(f"{type(self).__name__} moves no rows of its own")

    def group_sums(self, handle: CombineHandle, wire: str, dtype: torch.dtype | None) -> "GroupSumsIssuer":
        """What issues a ``GroupSums``' work; ``wire``: the pre-sums' wire
        format's name; ``dtype``: the rows' (None: agreed, one group only).
        Here: every group's rows kept, then summed home at once."""
        return WholeSums(handle, wire, dtype)

    def stats(self, handle: CombineHandle, dispatch_row_bytes: int, combine_wire: torch.dtype,
              hidden: int) -> DispatchStats | None:
        """Traffic of the round trip behind ``handle`` (``dispatch.stats``), from
        host-side sizes only; None where it is not accounted."""
        return None

    def members(self) -> tuple["Transport", ...]:
        """The transports whose handles the front end takes (``auto``: its candidates)."""
        return (self,)

    def row_bytes(self, x: torch.Tensor) -> int:
        """Bytes a dispatch of x allocates per row it receives: the row on the
        wire, the output row, its weight and sources (the free-memory budget)."""
        hidden = x.shape[1]
        got = self._row_bytes_of.get((x.dtype, hidden))
        if got is None:  # (once per dtype and width: every dispatch's host path)
            wire = to_experts_codec(self.config.dispatch_wire, x.dtype).row_bytes(hidden)
            got = self._row_bytes_of[x.dtype, hidden] = wire + hidden * x.element_size() + 24
        return got

    def _raise_own_values(self, request: Request, header: list[int]) -> None:
        """``checks.raise_own_values`` for ``request`` (where ``header`` is marked failed)."""
        if header[_FAILED]:
            checks.raise_own_values(header, request.ticket, request.topk_idx, request.topk_weights,
                                    self.config.num_experts)

    def dispatch_word(self, x: torch.Tensor, topk_weights: torch.Tensor, max_rows: int | None,
                      groups: int = 1) -> int:
        """What this rank adds to a dispatch's agreement (``agrees_dispatch``):
        whether it passes ``max_rows``, which gradients it needs, and whether
        it has seen a dispatch fail (``seen_failed``): the bits BOUNDED, X_GRAD,
        WEIGHTS_GRAD and FAILED; then its groups G, as (G - 1) GROUPS (0 for
        one group, the compiled usual dispatch's word)."""
        grad = torch.is_grad_enabled()
        return ((BOUNDED if max_rows is not None else 0) | (X_GRAD if grad and x.requires_grad else 0)
                | (WEIGHTS_GRAD if grad and topk_weights.requires_grad else 0)
                | (FAILED if self.seen_failed(max_rows is not None) else 0)) + (groups - 1) * GROUPS

    def seen_failed(self, bounded: bool) -> bool:
        """Whether this rank knows on the host, without waiting, that an earlier
        dispatch failed (``agrees_dispatch``; ``bounded``: this one passes ``max_rows``)."""
        return False

    def agreed_words(self, request: Request) -> tuple[int, ...]:
        """Every rank's ``dispatch_word`` of ``request`` (this rank's alone where
        none was agreed); raises alike on every rank, before any exchange, where
        some rank has seen a failure (this rank's own failure first, where
        ``check`` has it), the ranks mix ``max_rows`` with none, or their groups differ."""
        words = request.agreed
        if words is None:
            return (self.dispatch_word(request.x, request.topk_weights, request.max_rows, request.groups),)
        seen = [r for r, w in enumerate(words) if w & FAILED]
        if seen:
            self.check()
            raise RuntimeError(f"an earlier dispatch failed: rank(s) {seen} found it (raised there); no token of "
                               "this dispatch moved (build the dispatchers again on every rank)")
        bounded = [bool(w & BOUNDED) for w in words]
        if any(b != bounded[0] for b in bounded):
            told = ", ".join(f"rank {r}: {'max_rows' if b else 'none'}" for r, b in enumerate(bounded))
            raise ValueError(f"max_rows: every rank of the group passes one or none ({told})")
        checks.check_peer_groups([w // GROUPS + 1 for w in words])
        return words

    def reserve(self, x: torch.Tensor, topk: int) -> None:
        """``TokenDispatcher.reserve``: nothing where ``max_rows`` reads the host anyway."""

    def check(self) -> None:
        """``TokenDispatcher.check``: nothing is pending where every failure is raised at once."""


def handle_fields(request: Request, transport: Transport, num_rows: int, grads_any: tuple[bool, bool],
                  has_rows: tuple[bool, ...]) -> dict:
    """The fields every transport's handle of ``request`` has (``CombineHandle``'s)."""
    num_tokens, topk = request.topk_idx.shape
    return dict(owner=request.owner, transport=transport, device=request.x.device, call=request.ticket.call,
                num_tokens=num_tokens, num_rows=num_rows, topk=topk, x_grad_any=grads_any[0],
                weights_grad_any=grads_any[1], has_rows=has_rows)


def shape_fields(request: Request, num_local: int, per_expert: list[int], num_rows: int) -> dict:
    """The handle's fields that a plan read on the host gives the front end:
    its groups' bounds (``group_experts``, ``group_rows``) for a dispatch by
    groups, and ``max_rows`` where the rows are padded to a bound."""
    fields = {}
    if request.groups > 1:
        bounds = plan.expert_groups(num_local, request.groups)
        fields.update(group_experts=bounds, group_rows=tuple(sum(per_expert[:b]) for b in bounds))
    bound = request.ticket.max_rows  # (Request.max_rows, -1: none)
    if bound >= 0 and bound != num_rows:
        fields["max_rows"] = bound
    return fields


def by_groups(whole: Pending, handle: CombineHandle) -> "PendingGroups | Pending":
    """A movement made at once, handed out by group: piece g is group g's rows
    (one group: the movement itself)."""
    if handle.group_rows is None:  # (one group)
        return whole
    return PendingGroups([None] * handle.groups,
                         [lambda g=g: whole.finish()[slice(*handle.row_range(g))] for g in range(handle.groups)])


class GroupSumsIssuer:
    """A transport's side of a ``GroupSums``: ``add(g, rows, weights)`` issues
    group g's work, ``finish()`` returns a :class:`Pending` of the home sums."""

    def add(self, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
        raise NotImplementedError

    def finish(self) -> Pending:
        raise NotImplementedError


class WholeSums(GroupSumsIssuer):
    """Every group's rows kept until the last is in, then summed home at once
    (as ``combine_rows``; for rows of one group of no given dtype, in the
    dtype the ranks agree on, as ``combine``)."""

    def __init__(self, handle: CombineHandle, wire: str, dtype) -> None:
        self._handle, self._wire, self._dtype = handle, wire, dtype
        self._parts: list[tuple] = []
        self._pending: Pending | None = None

    def add(self, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
        self._parts.append((rows, weights))
        if g + 1 == self._handle.groups:
            parts, self._parts = self._parts, []
            handle = self._handle
            rows = received(torch.cat([r for r, _ in parts]) if len(parts) > 1 else parts[0][0], handle)
            if self._dtype is None:  # the dtype agreed, as combine
                transport = handle.transport
                rows = checks.home_rows(rows, handle.has_rows, transport.group, transport.world_size)
            rows = rows.contiguous()
            w = None if weights is None else received(torch.cat([w for _, w in parts]), handle)
            self._pending = handle.transport.to_home(rows, handle, w, sum_wire_dtype(self._wire, rows.dtype))

    def finish(self) -> Pending:
        return self._pending
