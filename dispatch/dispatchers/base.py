"""The TokenDispatcher interface and its autograd: dispatch and combine are adjoint.

Notation: W ranks, E experts (E_local per rank), T tokens on this rank, K slots
per token, H hidden size, N expanded rows on this rank (one per (source token,
local expert)), in canonical order: local expert ascending, then (source rank,
source token) ascending.

A variant implements four data movements and a planner; this module turns them
into the public verbs, with validation, gradients and ``async_op``:

* ``dispatch`` / ``combine``: differentiable (:class:`DispatchWork` /
  :class:`ExchangeWork` when started with ``async_op=True``);
* ``dispatch_rows`` / ``combine_rows`` / ``combine_slots``: the same movements
  along an existing handle, not differentiable (what a hand-written backward
  or a pipeline needs).

What a variant provides:

* ``_plan``: routing plan + one counts exchange (+ the slot lists); returns the handle.
* ``_to_experts``: [T, H] home rows -> [N, H] expanded rows (dispatch direction).
* ``_to_home``: [N, H] expanded rows -> [T, H] (pre-sum, exchange back, final sum).
* ``_weights_to_home``: [N] per-row values -> [T, K] per-slot values.

The backward of dispatch is ``_to_home`` of the gradients (unweighted), the
backward of combine is ``_to_experts`` of the gradient, so both directions keep
the contract (deduplicated wire, fp32 sums in a fixed order).
"""

from __future__ import annotations

import abc
import dataclasses
import numbers
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatch import capacity, checks, comm, plan
from dispatch.codec import Codec, sum_wire_dtype, to_experts_codec
from dispatch.config import GRAD_TO_EXPERTS_WIRES, SUM_WIRES, DispatchConfig
from dispatch.dispatchers.streams import CommStreams, Pending, PendingGroups, Started
from dispatch.kernels.row_grads import weighted_row_grads
from dispatch.stats import DispatchStats
from dispatch.timing import PhaseTimer


@dataclass(frozen=True, kw_only=True)
class CombineHandle:
    """What combine (and both backwards) need from one dispatch; frozen, so that
    several micro-batches can be in flight on one dispatcher.

    Attributes:
        owner: the dispatcher that made it (checked by combine).
        num_tokens: T of the dispatch.
        num_rows: N, rows handed to the experts.
        topk: K of the dispatch.
        x_grad_any, weights_grad_any: whether some rank of the group needs the
            gradient of x / topk_weights (learnt in the counts all-gather): the
            backward exchanges run on every rank alike, whatever this rank needs.
        link: [0] tensor output by the dispatch's autograd node and fed into the
            combine's, so that with grad mode on, both nodes exist on every rank
            (a rank whose experts return a fresh tensor still joins the backward
            exchanges of its peers). None until dispatch sets it.
        has_rows: per rank of the group, whether its experts get rows in this
            exchange (host, from the counts exchange; the same on every rank).
            Where some rank has rows and another none, the partial sums' dtype
            is agreed (``TokenDispatcher._home_rows``).
        max_rows: a dispatch with ``max_rows`` whose variant read N on the host,
            or with ``pad_to_capacity``: the rows the verbs hand out and take
            (the N received, padded); the variant moves N. None otherwise (a
            variant that bounds its outputs on the device counts them in
            ``num_rows``).
        pad_blocks: with ``pad_to_capacity``, the rows each source rank has in
            every local expert's block (min(C_s, T_s)); None otherwise.
        pad_index: with ``pad_to_capacity``, [N] int64 on the device: where each
            received row sits among the ``max_rows`` (set when the dispatch is
            waited for); None otherwise (the N rows come first).
        group_experts: for a dispatch by G groups of local experts
            (``dispatch(groups=G)``), the G + 1 bounds of the groups'
            local experts (``plan.expert_groups``); None for one group.
        group_rows: the G + 1 bounds of the groups' rows among the N
            (host); None for one group.
        call: the number of its dispatch among the dispatcher's (``plan.Ticket``;
            the variant's plan sets it): the verbs along it carry it, so that
            ranks moving along the handles of different dispatches raise.
    """

    owner: "TokenDispatcher"
    num_tokens: int
    num_rows: int
    topk: int
    x_grad_any: bool
    weights_grad_any: bool
    has_rows: tuple[bool, ...]
    link: torch.Tensor | None = None
    max_rows: int | None = None
    pad_blocks: tuple[int, ...] | None = None
    pad_index: torch.Tensor | None = None
    group_experts: tuple[int, ...] | None = None
    group_rows: tuple[int, ...] | None = None
    call: int = 0

    @property
    def rows(self) -> int:
        """Rows of the dispatched tensors the verbs hand out and take."""
        return self.num_rows if self.max_rows is None else self.max_rows

    @property
    def groups(self) -> int:
        """G, the groups of local experts the exchange moves by (1: one piece)."""
        return 1 if self.group_rows is None else len(self.group_rows) - 1

    def row_range(self, g: int) -> tuple[int, int]:
        """Group g's rows among the N: [lo, hi)."""
        return (0, self.rows) if self.group_rows is None else self.group_rows[g : g + 2]


@dataclass(frozen=True)
class Dispatched:
    """The result of ``TokenDispatcher.dispatch``.

    Attributes:
        tokens: [N, H] rows for the local experts, canonical order, dtype of x
            (with ``max_rows`` or ``pad_to_capacity``, padded: see ``dispatch``
            and ``DispatchConfig``).
        tokens_per_expert: [E_local] int64 on the device of x.
        tokens_per_expert_host: [E_local] int64 on the CPU (the plan already had it:
            no extra synchronisation), for grouped GEMMs that size on the host;
            None for a dispatch with ``max_rows`` (nothing read on the host).
        weights: [N] routing weight of each row (dtype of topk_weights);
            differentiable w.r.t. topk_weights.
        src_rank: [N] int64, home rank of each row's token.
        src_token: [N] int64, index of each row's token on its home rank.
        handle: pass to ``combine``.
        stats: :class:`dispatch.stats.DispatchStats`, rows and bytes this rank
            sends per tier (intra-/inter-node) in this round trip, from the plan's
            host-side split sizes (None for a variant that does not account them).
        dropped: [T, K] bool, the slots of this rank dropped by expert capacity
            (``DispatchConfig.capacity_factor``; None without it).
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    tokens_per_expert_host: torch.Tensor | None
    weights: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor
    handle: CombineHandle
    stats: DispatchStats | None = None
    dropped: torch.Tensor | None = None


@dataclass(frozen=True)
class DispatchedGroup:
    """One group's rows of a dispatch by groups (``DispatchWork.wait_group``);
    not differentiable (a pipeline makes its own backward along the handle).

    Attributes:
        tokens: [N_g, H] the group's rows (canonical order), dtype of x.
        tokens_per_expert: [E_local] int64 on the device: rows per local
            expert, zero outside the group (so ``experts(tokens, tokens_per_expert)``
            computes the group's experts only).
        tokens_per_expert_host: the same on the CPU.
        weights: [N_g] routing weight of each row (dtype of topk_weights).
        rows: (lo, hi), the group's rows among the dispatch's N.
        experts: (first, end), the group's local experts.
    """

    tokens: torch.Tensor
    tokens_per_expert: torch.Tensor
    tokens_per_expert_host: torch.Tensor
    weights: torch.Tensor
    rows: tuple[int, int]
    experts: tuple[int, int]


class TokenDispatcher(abc.ABC):
    """Moves tokens to the ranks that hold their experts and back.

    Construct through ``dispatch.create(config, group)``.

    Attributes:
        config: the :class:`DispatchConfig`.
        group, world_size (W), rank, num_local_experts (E_local).
        comm_priority: CUDA priority of the communication stream that the
            verbs' ``async_op=True`` work runs on (lower is higher, clamped to
            the device's range; default -1, high: the exchange's small
            kernels do not queue behind the experts' GEMMs).
        phase_timer: optionally a :class:`dispatch.timing.PhaseTimer` timing
            the phases of the work.
        host_free: (class) whether ``dispatch(..., max_rows=M)`` and the round
            trip after it read nothing on the host, so that they can be captured
            in a CUDA graph (the NVLink engine); elsewhere ``max_rows`` gives the
            same shapes with a host read.
        max_topk: (class) the most slots per token it moves (None: any).

    Every verb takes ``async_op``: False (default) returns the result; True
    returns a work object (:class:`DispatchWork` / :class:`ExchangeWork`) whose
    ``wait()`` returns it. Started work runs on the dispatcher's
    communication stream on CUDA (the caller's stream waits for it at
    ``wait()`` by an event, the host does not block), and as asynchronous
    collectives on CPU (``wait()`` finishes them). Every rank of the group must
    start the same exchanges in the same order (each call is agreed by every
    rank before any token moves: ``checks``, ``dispatch.board``); several may be in flight at
    once (each has its own handle), and may be waited for in any order.
    """

    host_free = False
    max_topk: int | None = None

    def __init__(self, config: DispatchConfig, group: dist.ProcessGroup | None = None) -> None:
        self.config = config
        self.group = group
        self._arrivals = comm.Arrivals(group, config.timeout)  # bounds the wait at each counts exchange
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.num_local_experts = config.num_experts // self.world_size
        self.devices = comm.device_types(group)
        self.phase_timer: PhaseTimer | None = None
        self.comm_priority = -1
        self._streams = CommStreams()
        # the calls, numbered and agreed with the peers
        self._calls = checks.Calls(group, self.world_size, self._arrivals, config.timeout, self._counts_row)

    # -- public verbs -------------------------------------------------------

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        *,
        max_rows: int | None = None,
        groups: int = 1,
        async_op: bool = False,
    ) -> "Dispatched | DispatchWork":
        """Send each token to the ranks holding its experts, expanded per local expert.

        The routing plan (with its counts exchange and one host synchronisation
        for the split sizes) is made at once; with ``async_op`` the token
        exchange is left in flight.

        Args:
            x: [T, H] float16/bfloat16/float32/float64 tokens of this rank (T may be 0).
            topk_idx: [T, K] int32/int64 global expert ids; -1 = empty slot.
            topk_weights: [T, K] floating routing weights.
            max_rows: None, or a bound on the rows this rank receives. Its
                outputs then have ``max_rows`` rows (those past the N received:
                zero tokens and weights, sources -1; experts size by
                ``tokens_per_expert``), and so do the expert outputs and row
                arguments the verbs take along its handle. On the NVLink engine
                the dispatch reads nothing on the host (it can be captured in a
                CUDA graph): ``tokens_per_expert_host`` and ``stats`` are None,
                and failures (a rank over its bound, bad values, ranks that
                disagree) are raised at a later host read (the next such
                dispatch, or :meth:`check`). Elsewhere the plan reads N on the
                host as always, and a rank over its bound makes every rank
                raise a ValueError before any token moves (the bounds travel
                in the counts exchange). Every rank passes one or none; none
                with ``pad_to_capacity``, which fixes the rows itself.
            groups: G >= 1 groups of local experts (``plan.expert_groups``,
                G <= E_local) to move the rows by: with ``async_op``,
                ``DispatchWork.wait_group(g)`` hands out group g's rows while
                later groups' still move, and ``combine_groups`` brings the
                experts' outputs home group by group. The alltoall variant
                on the NCCL transport (and on gloo; ``auto`` where it picks
                alltoall) moves each group as its own all-to-all, the NVLink
                engine pulls each group's rows in turn (either way a token
                still crosses to a rank once: with the first group there that
                needs it); the other variants move all groups at once and
                hand them out by group. Every rank passes
                the same G (checked where the pieces must match); not with
                ``pad_to_capacity``. With ``max_rows`` (the NVLink engine
                only), each group's rows are padded to B = ceil(max_rows / G):
                group g's rows at [g B, g B + its rows), then zero rows, the
                outputs G B rows, nothing read on the host; a rank with more
                than B rows in a group fails every rank alike (raised at a
                later host read). The rows are then not expert-contiguous
                from row 0: hand each group's to the experts (``wait_group``,
                with its ``tokens_per_expert``).
            async_op: return a :class:`DispatchWork` instead of the result.
        Returns:
            :class:`Dispatched` (through ``DispatchWork.wait()`` with ``async_op``).
            Gradients flow to ``x`` (through ``tokens``) and to ``topk_weights``
            (through ``weights``).
        """
        ticket = self._calls.ticket("dispatch")
        try:
            codec = self._check_dispatch(x, topk_idx, topk_weights, max_rows, groups)
        except (TypeError, ValueError) as error:  # still take part in the first message: the peers raise there
            checks.refuse(error, lambda: self._take_part_refused(ticket))
        if self._calls.on_board and not self.config.pad_to_capacity:  # (with it: in _capacity_blocks)
            self._calls.agree(ticket)  # the call agreed on the host; the counts exchange checks it again
        dropped = None
        if self.config.capacity_factor is not None:  # Megatron's token dropping, on this rank's routing
            topk_idx, dropped = capacity.drop_over_capacity(topk_idx, topk_weights, self.config.num_experts,
                                                            self.config.capacity_factor, self.config.drop_policy)
        check = self.config.check_inputs
        if self.config.pad_to_capacity:  # the blocks every rank pads to, before any row moves
            blocks = self._capacity_blocks(x, topk_idx, ticket)
            padded_rows = self.num_local_experts * sum(blocks)
            memory_rows = self._row_budgets(x, None)[1]  # the N received and their padded copy, at once
            budgets = (-1, memory_rows if memory_rows < 0 else max(memory_rows - padded_rows, 0))
            handle, plan_out = self._plan(x, topk_idx, topk_weights, check, ticket.with_budgets(budgets))
            handle = dataclasses.replace(handle, max_rows=padded_rows, pad_blocks=blocks)
        elif groups > 1 and max_rows is not None:  # each group's rows padded to ceil(max_rows / G)
            handle, plan_out = self._plan_bounded_groups(x, topk_idx, topk_weights, check,
                                                         ticket.with_budgets(self._row_budgets(x, max_rows)), groups)
        elif groups > 1:
            handle, plan_out = self._plan_groups(x, topk_idx, topk_weights, check,
                                                 ticket.with_budgets(self._row_budgets(x, None)), groups)
            bounds = plan.expert_groups(self.num_local_experts, groups)
            per_expert = plan_out.tokens_per_expert_host.tolist()
            handle = dataclasses.replace(handle, group_experts=bounds,
                                         group_rows=tuple(sum(per_expert[:b]) for b in bounds))
        elif max_rows is None:
            handle, plan_out = self._plan(x, topk_idx, topk_weights, check,
                                          ticket.with_budgets(self._row_budgets(x, None)))
        else:
            handle, plan_out = self._plan_bounded(x, topk_idx, topk_weights, check,
                                                  ticket.with_budgets(self._row_budgets(x, max_rows)))
            if handle.num_rows != max_rows:  # the variant read N on the host: the verbs pad
                handle = dataclasses.replace(handle, max_rows=max_rows)
        rows = x.detach()
        if handle.groups > 1:
            started = self._streams.start_groups(lambda: self._to_experts_groups_start(rows, handle, codec, True),
                                                 (rows,), async_op, self.comm_priority)
        else:
            started = self._start(lambda: self._dispatch_start(rows, handle, codec), (rows,), async_op)
        hidden = x.shape[1]
        dispatch_row_bytes = to_experts_codec(self.config.dispatch_wire, x.dtype).row_bytes(hidden)
        stats = self._stats(handle, dispatch_row_bytes, sum_wire_dtype(self.config.combine_wire, x.dtype), hidden)
        work = DispatchWork(self, x, topk_weights, handle, plan_out, started, stats, dropped)
        return work if async_op else work.wait()

    def combine(
        self,
        expert_out: torch.Tensor,
        handle: CombineHandle,
        weights: torch.Tensor | None = None,
        *,
        async_op: bool = False,
    ) -> "torch.Tensor | ExchangeWork":
        """Bring expert outputs home and sum them per token.

        Args:
            expert_out: [N, H'] expert outputs in the dispatched (canonical) order.
            handle: ``Dispatched.handle`` of the matching dispatch.
            weights: [N] routing weights to apply (usually ``Dispatched.weights``),
                or None if the experts already weighted their outputs.
            async_op: return an :class:`ExchangeWork` instead of the result.
        Returns:
            [T, H'] in the dtype of ``expert_out``: for each token, the sum over its
            slots of ``weight * expert_out``, accumulated in fp32 (fp64 for fp64).
            On a rank whose experts got no rows while others' did, in the dtype of
            theirs (``_home_rows``). Differentiable w.r.t. ``expert_out`` and
            ``weights`` (the backward is a dispatch of the gradient).
        """
        ticket = self._along("combine", handle, lambda: self._check_combine(expert_out, handle, weights))
        rows = _received(expert_out.detach(), handle)
        headers = self._calls.agree(ticket, _dtype_code(rows))
        rows = self._home_rows(rows, handle, headers).contiguous()
        wire = sum_wire_dtype(self.config.combine_wire, rows.dtype)
        w = None if weights is None else _received(weights.detach(), handle)
        started = self._start(lambda: self._to_home_start(rows, handle, w, wire), _present(rows, w), async_op)
        work = ExchangeWork(lambda: _CombineFn.apply(expert_out, weights, handle.link, self, handle, started))
        return work if async_op else work.wait()

    def _check_combine(self, expert_out, handle: CombineHandle, weights) -> None:
        """``combine``'s own checks of its arguments (this rank alone)."""
        self._check_handle(handle)
        checks.check_combine_inputs(expert_out, weights, handle.rows, self.devices)
        differentiable = expert_out.requires_grad or (weights is not None and weights.requires_grad)
        if torch.is_grad_enabled() and differentiable and not handle.link.requires_grad:
            raise ValueError(
                "expert_out (or weights) requires grad but the dispatch behind handle ran with "
                "grad mode off: run dispatch with grad mode on so every rank joins the backward"
            )

    def dispatch_rows(
        self, rows: torch.Tensor, handle: CombineHandle, *, wire: str = "native", async_op: bool = False
    ) -> "torch.Tensor | ExchangeWork":
        """Move per-token rows to the experts along an existing handle, as its
        dispatch moved x (the backward of ``combine``); not differentiable.

        Args:
            rows: [T, H'] floating, one row per token of the dispatch behind ``handle``.
            handle: ``Dispatched.handle``.
            wire: how the rows travel: "native" (their dtype, lossless), "bf16",
                "fp32", "fp8" or "e5m2" (block-scaled as ``DispatchConfig.dispatch_wire``,
                with its ``fp8_pow2_scales``).
            async_op: return an :class:`ExchangeWork` instead of the result;
                along the handle of a dispatch by groups, its ``wait_group(g)``
                gives group g's rows while later groups' still move.
        Returns:
            [N, H'] in the dtype of ``rows``: row i is the row of the token behind
            dispatched row i (``Dispatched.src_rank/src_token``), canonical order.
        """
        def check():
            self._check_handle(handle)
            checks.check_rows("rows", rows, handle.num_tokens, "the dispatch behind handle had T =", self.devices)
            _check_wire("wire", wire, GRAD_TO_EXPERTS_WIRES)
            to_experts_codec(wire, rows.dtype, self.config.fp8_pow2_scales)

        self._calls.agree(self._along("dispatch_rows", handle, check))
        codec = to_experts_codec(wire, rows.dtype, self.config.fp8_pow2_scales)
        rows = rows.detach().contiguous()
        if handle.groups > 1:
            started = self._streams.start_groups(lambda: self._to_experts_groups_start(rows, handle, codec, False),
                                                 (rows,), async_op, self.comm_priority)
            work = ExchangeWork(started.result, started.result)
        else:
            started = self._start(lambda: self._to_experts_start(rows, handle, codec), (rows,), async_op)
            work = ExchangeWork(lambda: _padded(started.result(), handle, 0))
        return work if async_op else work.wait()

    def combine_rows(
        self,
        rows: torch.Tensor,
        handle: CombineHandle,
        weights: torch.Tensor | None = None,
        *,
        wire: str = "native",
        async_op: bool = False,
    ) -> "torch.Tensor | ExchangeWork":
        """Sum dispatched rows home along an existing handle, as ``combine`` does
        (the backward of ``dispatch`` with ``weights=None``); not differentiable.

        Args:
            rows: [N, H'] floating, in the dispatched order; the same dtype on
                every rank that has rows (no dtype is agreed, unlike ``combine``).
            handle: ``Dispatched.handle``.
            weights: None or [N] floating, applied to the rows before the sums.
            wire: how the expert-side partial sums travel: "native" (their
                accumulation's input dtype), "bf16" or "fp32".
            async_op: return an :class:`ExchangeWork` instead of the result.
        Returns:
            [T, H'] in the dtype of ``rows``: per token, the sum of its rows
            (weighted), in fp32 (fp64 for fp64 rows or weights), ascending rank order.
        """
        def check():
            self._check_handle(handle)
            checks.check_combine_inputs(rows, weights, handle.rows, self.devices, name="rows")
            _check_wire("wire", wire, SUM_WIRES)

        self._calls.agree(self._along("combine_rows", handle, check))
        rows = _received(rows.detach(), handle).contiguous()
        w = None if weights is None else _received(weights.detach(), handle)
        wire_dtype = sum_wire_dtype(wire, rows.dtype)
        started = self._start(lambda: self._to_home_start(rows, handle, w, wire_dtype), _present(rows, w), async_op)
        work = ExchangeWork(started.result)
        return work if async_op else work.wait()

    def combine_slots(
        self, values: torch.Tensor, handle: CombineHandle, *, async_op: bool = False
    ) -> "torch.Tensor | ExchangeWork":
        """Bring one value per dispatched row home to its (token, slot), along an
        existing handle (the gradient of the routing weights goes home so);
        not differentiable.

        Args:
            values: [N] floating, one per dispatched row (canonical order).
            handle: ``Dispatched.handle``.
            async_op: return an :class:`ExchangeWork` instead of the result.
        Returns:
            [T, K] in the dtype of ``values``: the value of the row of each
            (token, slot), 0 for empty slots.
        """
        def check():
            self._check_handle(handle)
            checks.check_values("values", values, handle.rows, self.devices)

        self._calls.agree(self._along("combine_slots", handle, check))
        values = _received(values.detach().contiguous(), handle)
        started = self._start(lambda: self._weights_to_home_start(values, handle), (values,), async_op)
        work = ExchangeWork(started.result)
        return work if async_op else work.wait()

    def combine_groups(
        self, handle: CombineHandle, *, dtype: torch.dtype | None, wire: str = "native"
    ) -> "GroupSums":
        """Sum dispatched rows home group by group, along the handle of a dispatch
        by groups (``dispatch(groups=G)``): ``combine_rows`` in pieces, for a
        pipeline that computes one group of experts at a time. Not differentiable.

        Each :meth:`GroupSums.add` takes the next group's rows (and their
        routing weights, or None) and adds them to the running pre-sums of
        their (token, source rank) rows, in fp32 (fp64 as ``combine_rows``); a
        pre-sum whose last group is in starts home at once (on the
        communication stream). :meth:`GroupSums.wait` gives the home sums:
        bitwise ``combine_rows`` of all groups' rows at once, for every G.

        Args:
            handle: the handle of a dispatch by groups (or of any dispatch: one group).
            dtype: the dtype the rows are summed from and the sums come home
                in, the same on every rank (the pre-sums travel before some
                ranks have computed any row); rows added in another dtype are
                cast to it first. None for one group only: the rows' own dtype,
                agreed between the ranks as ``combine`` does.
            wire: how the pre-sums travel: "native", "bf16" or "fp32".
        """
        def check():
            self._check_handle(handle)
            _check_wire("wire", wire, SUM_WIRES)
            if dtype is None and handle.groups > 1:
                raise TypeError(f"dtype: a dispatch by {handle.groups} groups sums rows of a dtype given up front, "
                                "got None")
            if dtype is not None and (not isinstance(dtype, torch.dtype) or dtype not in checks.FLOAT_DTYPES):
                raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")

        self._calls.agree(self._along("combine_groups", handle, check))
        return GroupSums(self, handle, dtype, wire)

    def reserve(self, x: torch.Tensor, topk: int) -> None:
        """Make room for dispatches with ``max_rows`` of up to ``x``'s T tokens of
        ``topk`` slots, rows like ``x`` (round trip and backward included), so that
        they read nothing on the host. A collective over the group: every rank calls
        it at the same point, each with its own ``x`` (one host synchronisation).
        Without it the first dispatch with ``max_rows`` sizes the room once, and a
        later one that does not fit raises. Nothing to do where ``max_rows`` reads
        the host anyway."""

    def check(self) -> None:
        """Raise a failure that an exchange with no host read (``max_rows``)
        recorded on the device: a rank over its ``max_rows``, bad values, ranks
        that disagree, a peer that did not arrive. A host read: it waits for the
        work queued so far. Without such exchanges nothing is pending (failures
        are raised by the call that meets them)."""

    # -- shared by the verbs --------------------------------------------------

    def _check_dispatch(self, x, topk_idx, topk_weights, max_rows, groups) -> Codec:
        """``dispatch``'s own checks of its arguments (this rank alone); its wire codec."""
        checks.check_dispatch_inputs(x, topk_idx, topk_weights, self.devices)
        checks.check_groups(groups, self.num_local_experts)
        if self.max_topk is not None and topk_idx.shape[1] > self.max_topk:
            raise ValueError(f"topk_idx: {type(self).__name__} takes at most {self.max_topk} slots per token, "
                             f"got K={topk_idx.shape[1]}")
        if groups > 1 and self.config.pad_to_capacity:
            raise ValueError(f"groups={groups} with DispatchConfig.pad_to_capacity: a dispatch by groups of experts "
                             "places its rows group by group; use groups=1")
        if groups > 1 and max_rows is not None and not self.host_free:
            raise ValueError(f"groups={groups} with max_rows: a dispatch by groups with a row bound needs a "
                             f"dispatcher that reads nothing on the host (the NVLink engine), {type(self).__name__} "
                             "sizes its rows on the host; use groups=1 or no max_rows")
        if self.config.pad_to_capacity and max_rows is not None:
            raise ValueError("max_rows: a dispatcher with pad_to_capacity fixes its rows itself (E_local * the sum "
                             "of the ranks' capacities); dispatch without max_rows")
        if max_rows is not None:
            checks.check_max_rows(max_rows)
        return to_experts_codec(self.config.dispatch_wire, x.dtype, self.config.fp8_pow2_scales)

    def _take_part_refused(self, ticket: plan.Ticket) -> None:
        """This rank's share of a dispatch it refuses: the first message (the
        call's agreement on the board, or the counts exchange marked refused,
        with no tokens), as its peers make it."""
        ticket = dataclasses.replace(ticket, refused=True)
        if self._calls.on_board or self.config.pad_to_capacity:
            self._calls.agree(ticket, tail=(0,))
            return
        device = torch.device("cuda", torch.cuda.current_device()) if "cuda" in self.devices else torch.device("cpu")
        self._plan(torch.zeros(0, 1, device=device), torch.zeros(0, 1, dtype=torch.int64, device=device),
                   torch.zeros(0, 1, device=device), False, ticket)

    def _counts_row_width(self) -> int:
        """Length of the row this variant's counts exchange all-gathers: counts,
        header, a tail of at least one entry. The agreement over the host
        channel (``checks.agree``) all-gathers rows of this length, so that on
        gloo, where it shares the group with the counts exchange, the two pair
        and see the different calls."""
        return self.world_size * (1 + self.num_local_experts) + len(plan.HEADER) + 1

    def _counts_row(self) -> tuple[int, int]:
        """(length of the counts row, offset of its header): ``checks.Calls``."""
        return self._counts_row_width(), self.world_size * (1 + self.num_local_experts)

    def _along(self, verb: str, handle, check) -> plan.Ticket:
        """Start a verb that moves rows along ``handle``: run its own checks
        (``check()``); if they fail, agree on the call refused and raise (the
        peers raise :class:`checks.PeerRefused`). Returns the call's ticket,
        which the verb then agrees on (``checks.Calls.agree``)."""
        ticket = self._calls.ticket(verb, handle.call if isinstance(handle, CombineHandle) else 0)
        try:
            check()
        except (TypeError, ValueError) as error:
            checks.refuse(error, lambda: self._calls.agree(dataclasses.replace(ticket, refused=True)))
        return ticket

    def _start(self, issue, reads: tuple, async_op: bool) -> Started:
        return self._streams.start(issue, reads, async_op, self.comm_priority)

    def _made(self, handle: CombineHandle) -> bool:
        """Whether this dispatcher made ``handle`` (and moves along it)."""
        return handle.owner is self

    def _check_handle(self, handle: object) -> None:
        if not isinstance(handle, CombineHandle) or not self._made(handle):
            raise ValueError("handle must be the Dispatched.handle of a dispatch made by this dispatcher")
        if handle.pad_blocks is not None and handle.pad_index is None:
            raise ValueError("handle: a pad_to_capacity dispatch places its rows when it is waited for; move rows "
                             "along the handle of its result (DispatchWork.wait().handle)")

    def _home_rows(self, rows: torch.Tensor, handle: CombineHandle,
                   headers: list[list[int]] | None = None) -> torch.Tensor:
        """``rows``, expert outputs about to go home, in the dtype in which the
        group's partial sums travel.

        A rank whose experts got no rows answered an empty call, and experts may
        answer one in another dtype than their outputs (autocast, an early
        return). That rank still receives its tokens' partial sums, in the dtype
        of the ranks that computed them. So where ``handle.has_rows`` shows ranks
        without rows beside ranks with rows, every rank learns the dtype of the
        others' rows and a rank without rows takes it; ranks with rows in
        different dtypes are then refused, on every rank alike. Where every rank
        has rows nothing is checked: their dtypes must agree (the wire carries
        no dtype; a mismatch fails in the collective, or worse). ``headers``:
        the call's agreement (``Calls.agree`` with ``_dtype_code``), which carries
        every rank's code; without it (``GroupSums`` of one group) the codes
        are all-gathered here, where needed (a host read).
        """
        has = handle.has_rows
        if all(has) or not any(has):
            return rows
        dtypes = checks.FLOAT_DTYPES
        if headers is not None:
            codes = [h[plan.HEADER.index("x_dtype")] for h in headers]
        else:
            row = plan.to_device(torch.tensor([_dtype_code(rows)], dtype=torch.int64), rows.device)
            codes = comm.all_gather_rows(row, self.group, self.world_size).flatten().tolist()  # host sync: dtype
        known = sorted({c for c in codes if c >= 0})
        if len(known) != 1 or known[0] == len(dtypes):
            names = ", ".join(f"rank {r}: {dtypes[c] if c < len(dtypes) else 'not floating'}"
                              for r, c in enumerate(codes) if c >= 0)
            raise ValueError(f"expert outputs must have one floating dtype on every rank that has rows; got {names}")
        return rows if rows.shape[0] else rows.to(dtypes[known[0]])

    # -- what a variant provides ------------------------------------------

    def _capacity_blocks(self, x: torch.Tensor, topk_idx: torch.Tensor, ticket: plan.Ticket) -> tuple[int, ...]:
        """min(C_s, T_s) of every rank s of the group (``pad_to_capacity``): every
        rank's T travels in the call's agreement (``checks.Calls.agree``)."""
        config = self.config
        tokens = [row[-1] for row in self._calls.agree(ticket, tail=(topk_idx.shape[0],))]
        topk = topk_idx.shape[1]
        return tuple(min(capacity.capacity(t, topk, config.num_experts, config.capacity_factor), t) for t in tokens)

    def row_bytes(self, x: torch.Tensor) -> int:
        """Bytes a dispatch of x allocates per row it receives: the row on the
        wire, the output row, its weight and sources (the free-memory budget)."""
        hidden = x.shape[1]
        wire = to_experts_codec(self.config.dispatch_wire, x.dtype).row_bytes(hidden)
        return wire + hidden * x.element_size() + 24

    def _row_budgets(self, x: torch.Tensor, max_rows: int | None) -> tuple[int, int]:
        """This rank's (max_rows, rows its free device memory holds), -1 for none:
        the budgets its header carries (``plan.header``), checked on every rank
        before any token moves (``checks.check_row_budgets``)."""
        free = checks.free_bytes(x.device)
        memory_rows = -1 if free is None else min(free // self.row_bytes(x), 2**31 - 1)
        return -1 if max_rows is None else max_rows, memory_rows

    @abc.abstractmethod
    def _plan(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, check_values: bool,
        budgets: tuple[int, int],
    ) -> tuple[CombineHandle, "PlanOutputs"]:
        """Routing plan and its exchanges; no token data moves yet. With
        ``check_values``, the values of the routing are checked (``checks.value_flags``)
        and a rank with bad values raises right after the counts all-gather, in
        which it marks itself failed so that its peers raise there too; ranks
        that disagree on K, H or dtypes are refused
        (``checks.check_peer_headers``), and so is a rank over one of its row
        ``budgets`` (``_row_budgets``, in the header: ``checks.check_row_budgets``),
        before any token moves."""

    def _plan_bounded(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, check_values: bool,
        budgets: tuple[int, int],
    ) -> tuple[CombineHandle, "PlanOutputs"]:
        """``_plan`` for a dispatch with ``max_rows`` (``budgets[0]``). Here: the
        plan reads N on the host and refuses a rank over its bound like any
        budget; the verbs then pad to ``max_rows`` rows. A variant that moves
        the rows on the device overrides it (no host read, outputs of
        ``max_rows`` rows)."""
        return self._plan(x, topk_idx, topk_weights, check_values, budgets)

    @abc.abstractmethod
    def _to_experts(self, rows: torch.Tensor, handle: CombineHandle, codec: Codec) -> torch.Tensor:
        """[T, H] home rows -> [N, H] expanded rows (dtype of ``rows``): packed by
        ``codec.pack`` (gather + encode), exchanged, ``codec.unpack`` (decode + expand)."""

    @abc.abstractmethod
    def _to_home(
        self,
        rows: torch.Tensor,
        handle: CombineHandle,
        weights: torch.Tensor | None,
        wire: torch.dtype,
    ) -> torch.Tensor:
        """[N, H] expanded rows -> [T, H] (dtype of ``rows``): weighted pre-sum per
        (token, rank), exchange back via ``wire``, sum in ascending rank order."""

    @abc.abstractmethod
    def _weights_to_home(self, values: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
        """[N] per-row values -> [T, K] per-slot values (0 for empty slots)."""

    def _stats(
        self, handle: CombineHandle, dispatch_row_bytes: int, combine_wire: torch.dtype, hidden: int
    ) -> DispatchStats | None:
        """Traffic of the round trip behind ``handle`` (see :mod:`dispatch.stats`), from
        host-side sizes only; ``combine_wire`` is the partial sums' dtype for expert
        outputs like x ([N, ``hidden``]). None where a variant does not account it."""
        return None

    # The verbs start each movement through these hooks, which return a
    # :class:`Pending` whose ``finish()`` gives the result. The defaults run
    # the movement to its end (correct for every variant, overlapping
    # nothing on CPU); a variant overrides them to leave its collectives in
    # flight (``async_op=True``) and finish the rest in ``finish()``.

    def _to_experts_start(self, rows: torch.Tensor, handle: CombineHandle, codec: Codec) -> Pending:
        """``_to_experts`` left in flight."""
        return Pending.done(self._to_experts(rows, handle, codec))

    def _dispatch_start(self, rows: torch.Tensor, handle: CombineHandle, codec: Codec) -> Pending:
        """The dispatch's own movement of x (the first along its plan): ``_to_experts_start``,
        unless a variant moves x with the rows' places (the NVLink engine)."""
        return self._to_experts_start(rows, handle, codec)

    def _to_home_start(
        self, rows: torch.Tensor, handle: CombineHandle, weights: torch.Tensor | None, wire: torch.dtype
    ) -> Pending:
        """``_to_home`` left in flight."""
        return Pending.done(self._to_home(rows, handle, weights, wire))

    def _weights_to_home_start(self, values: torch.Tensor, handle: CombineHandle) -> Pending:
        """``_weights_to_home`` left in flight."""
        return Pending.done(self._weights_to_home(values, handle))

    # Dispatches by groups of local experts. A variant that plans and moves by
    # groups overrides these three; the defaults plan and move all groups at
    # once, hand the rows out by group, and bring the sums home after the last.

    def _plan_groups(self, x, topk_idx, topk_weights, check_values, budgets, groups: int):
        """``_plan`` for a dispatch by ``groups`` groups of local experts."""
        return self._plan(x, topk_idx, topk_weights, check_values, budgets)

    def _plan_bounded_groups(self, x, topk_idx, topk_weights, check_values, budgets, groups: int):
        """``_plan_bounded`` by ``groups`` groups of local experts, each group's rows
        padded to B = ceil(max_rows / G) (group g's at [g B, g B + its rows)):
        only a variant that reads nothing on the host (``host_free``)."""
        raise NotImplementedError(f"{type(self).__name__} does not dispatch by groups with max_rows")

    def _to_experts_groups_start(self, rows: torch.Tensor, handle: CombineHandle, codec: Codec,
                                 own: bool) -> PendingGroups:
        """``_to_experts_start`` (``_dispatch_start`` for the dispatch's ``own``
        rows) in one piece per group: piece g's result is group g's rows."""
        whole = (self._dispatch_start if own else self._to_experts_start)(rows, handle, codec)
        thens = [lambda g=g: whole.finish()[slice(*handle.row_range(g))] for g in range(handle.groups)]
        return PendingGroups([None] * handle.groups, thens)

    def _group_sums(self, handle: CombineHandle, wire: str, dtype: torch.dtype | None) -> "GroupSumsIssuer":
        """What issues a :class:`GroupSums`' work (on the communication stream);
        ``wire``: the pre-sums' wire format's name; ``dtype``: the rows'
        (None: agreed between the ranks, one group only)."""
        return _WholeSums(self, handle, wire, dtype)


class GroupSums:
    """Expert rows summed home group by group (``TokenDispatcher.combine_groups``)."""

    def __init__(self, dispatcher: "TokenDispatcher", handle: CombineHandle, dtype, wire: str) -> None:
        self._dispatcher, self._handle, self.dtype = dispatcher, handle, dtype
        self._issuer = dispatcher._group_sums(handle, wire, dtype)
        self._added, self._last, self._result = 0, None, None
        self._weights_dtype = False  # not known before the first add

    def add(self, rows: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """The next group's rows ([N_g, H'], canonical order; cast to ``dtype``
        if given in another) and their routing weights ([N_g] floating, e.g.
        ``DispatchedGroup.weights``), or None (in every group alike). The
        pre-sums' way home starts behind the caller's current stream's work so
        far. A rank that refuses its rows here (shape, weights) makes its
        peers raise too, naming it (each group's add agrees on the call, as
        ``combine`` does). Leave the rows and weights unchanged until
        :meth:`wait`: a later group's pre-sums may read them (the NVLink engine
        sums each pre-sum whole when its last group comes)."""
        handle, g = self._handle, self._added
        given = weights.dtype if isinstance(weights, torch.Tensor) else None

        def check():
            if g == handle.groups:
                raise ValueError(f"add: all {handle.groups} groups were added already")
            lo, hi = handle.row_range(g)
            devices = self._dispatcher.devices
            checks.check_rows("rows", rows, hi - lo, f"group {g} has", devices)
            if self._last is not None and rows.shape[1] != self._last.shape[1]:
                raise ValueError(f"rows of group {g} have {rows.shape[1]} columns, earlier groups "
                                 f"{self._last.shape[1]}")
            if weights is not None:
                checks.check_values("weights", weights, hi - lo, devices)
            if self._weights_dtype is not False and given != self._weights_dtype:
                raise ValueError(f"weights of group {g}: {given}, earlier groups' {self._weights_dtype}; weigh "
                                 "every group alike (or none)")

        self._dispatcher._calls.agree(self._dispatcher._along("GroupSums.add", handle, check))
        if self.dtype is not None and rows.dtype != self.dtype:
            # cast, not refused: a rank without rows in this group could not
            # refuse alike, and would send its pieces to peers that wait
            rows = rows.to(self.dtype)
        if weights is not None:
            weights = weights.detach().contiguous()
        rows = rows.detach().contiguous()
        reads = (rows,) if weights is None else (rows, weights)
        self._dispatcher._start(lambda: Pending.done(self._issuer.add(g, rows, weights)), reads, True)
        self._added, self._last, self._weights_dtype = g + 1, rows, given

    def wait(self) -> torch.Tensor:
        """[T, H'] in ``dtype``: per token, the (weighted) sum of its rows, as
        ``combine_rows``; the caller's current stream waits for it. Once every
        group is added."""
        if self._result is None:
            if self._added != self._handle.groups:
                raise ValueError(f"wait: {self._added} of {self._handle.groups} groups were added; add every group")
            started = self._dispatcher._start(self._issuer.finish, (self._last,), True)
            self._result, self._issuer, self._last = started.result(), None, None
        return self._result


class GroupSumsIssuer:
    """The variant's side of a :class:`GroupSums`: ``add(g, rows, weights)``
    issues group g's work, ``finish()`` returns a :class:`Pending` of the home sums."""

    def add(self, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
        raise NotImplementedError

    def finish(self) -> Pending:
        raise NotImplementedError


class _WholeSums(GroupSumsIssuer):
    """Every group's rows kept until the last is in, then summed home at once
    (as ``combine_rows``; for rows of one group of no given dtype, in the
    dtype the ranks agree on, as ``combine``)."""

    def __init__(self, dispatcher: "TokenDispatcher", handle: CombineHandle, wire: str, dtype) -> None:
        self._dispatcher, self._handle, self._wire, self._dtype = dispatcher, handle, wire, dtype
        self._parts: list[tuple] = []
        self._pending: Pending | None = None

    def add(self, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
        self._parts.append((rows, weights))
        if g + 1 == self._handle.groups:
            parts, self._parts = self._parts, []
            d, handle = self._dispatcher, self._handle
            rows = _received(torch.cat([r for r, _ in parts]) if len(parts) > 1 else parts[0][0], handle)
            if self._dtype is None:  # the dtype agreed, as combine
                rows = d._home_rows(rows, handle)
            rows = rows.contiguous()
            w = None if weights is None else _received(torch.cat([w for _, w in parts]), handle)
            self._pending = d._to_home_start(rows, handle, w, sum_wire_dtype(self._wire, rows.dtype))

    def finish(self) -> Pending:
        return self._pending


class DispatchWork:
    """A dispatch in flight (``TokenDispatcher.dispatch(..., async_op=True)``).

    Its routing plan is made (``handle`` is known); the token exchange may
    still be moving. It holds the inputs and the buffers until waited for.

    Attributes:
        handle: the :class:`CombineHandle` of this dispatch (also
            ``wait().handle``; with ``pad_to_capacity``, only ``wait().handle``
            moves rows: the rows are placed in their blocks at the wait).
    """

    def __init__(self, dispatcher, x, topk_weights, handle, plan_out, started: Started, stats, dropped) -> None:
        self._args = (x, topk_weights, stats, dropped)
        self.handle = handle
        self._result: Dispatched | None = None
        self._dispatcher, self._started, self._plan_out = dispatcher, started, plan_out

    def wait_group(self, g: int) -> DispatchedGroup:
        """Group g's rows (:class:`DispatchedGroup`), not differentiable; the
        caller's current stream waits for that group's piece only (the later
        groups' rows may still be moving). A dispatch without ``groups`` is
        one group. Leave the rows unchanged until every group is waited for:
        on the NVLink engine a later group copies rows that an earlier group
        brought."""
        handle = self.handle
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or not 0 <= g < handle.groups:
            raise ValueError(f"g must be a group index in [0, {handle.groups}), got {g!r}")
        if self._started is None:
            raise ValueError("wait_group: the dispatch was waited for (wait()); take its rows from that result")
        if handle.pad_blocks is not None:
            raise ValueError("wait_group: a pad_to_capacity dispatch places its rows at wait(); use wait()")
        g = int(g)
        lo, hi = handle.row_range(g)
        bounds = handle.group_experts or (0, self._dispatcher.num_local_experts)
        first, end = bounds[g], bounds[g + 1]
        if handle.groups > 1:
            tokens = self._started.result(g)
        else:  # the whole result, once: wait() takes it from here
            moved = self._started.result()
            self._started = Started(Pending.done(moved))
            tokens = _padded(moved, handle, 0)
        per_expert_host = self._plan_out.tokens_per_expert_host
        if per_expert_host is not None:
            per_expert_host = _only(per_expert_host, first, end)
        per_expert = _only(self._plan_out.tokens_per_expert, first, end)  # on the device: no host copy
        weights = _padded(self._plan_out.weights, handle, 0)[lo:hi].to(self._args[1].dtype)
        return DispatchedGroup(tokens.detach(), per_expert, per_expert_host, weights, (lo, hi), (first, end))

    def wait(self) -> Dispatched:
        """The :class:`Dispatched` result; the caller's current stream waits for
        the exchange (the host does not, on CUDA). Call it in the grad mode the
        dispatch started in; the autograd node of the dispatch is made here."""
        if self._result is None:
            x, topk_weights, stats, dropped = self._args
            dispatcher, plan_out, started = self._dispatcher, self._plan_out, self._started
            if self.handle.pad_blocks is not None:  # the rows' places among the blocks, from their sources
                moved = started.result()  # the caller's stream follows the exchange (the engine writes the sources)
                started = Started(Pending.done(moved))
                self.handle, plan_out = _pad_to_blocks(self.handle, plan_out, dispatcher.num_local_experts)
            anchor = torch.empty(0, device=x.device, requires_grad=torch.is_grad_enabled())
            tokens, weights, link = _DispatchFn.apply(
                x, topk_weights, anchor, plan_out.weights, dispatcher, self.handle, started
            )
            self.handle = dataclasses.replace(self.handle, link=link)
            self._result = Dispatched(
                tokens=tokens,
                tokens_per_expert=plan_out.tokens_per_expert,
                tokens_per_expert_host=plan_out.tokens_per_expert_host,
                weights=weights,
                src_rank=_padded(plan_out.src_rank, self.handle, -1),
                src_token=_padded(plan_out.src_token, self.handle, -1),
                handle=self.handle,
                stats=stats,
                dropped=dropped,
            )
            self._args = self._started = self._plan_out = None
        return self._result


class ExchangeWork:
    """A combine or a move along a handle in flight (the verbs' ``async_op=True``).
    It holds the buffers of the exchange until waited for."""

    def __init__(self, finish, group=None) -> None:
        self._finish, self._result, self._group = finish, None, group

    def wait_group(self, g: int) -> torch.Tensor:
        """Group g's rows of a ``dispatch_rows`` along the handle of a dispatch
        by groups; the caller's current stream waits for that group's piece."""
        if self._group is None:
            raise ValueError("wait_group: only a dispatch_rows along the handle of a dispatch by groups "
                             "(dispatch(groups=G), G > 1) moves by groups")
        return self._group(g)

    def wait(self) -> torch.Tensor:
        """The verb's result tensor; the caller's current stream waits for the
        exchange (the host does not, on CUDA). Once: later calls return it again."""
        if self._finish is not None:
            self._result, self._finish = self._finish(), None
        return self._result


def _padded(rows: torch.Tensor, handle: CombineHandle, fill) -> torch.Tensor:
    """The N rows a variant moved, padded with ``fill`` to the ``max_rows`` of a
    handle that has one (a dispatch with ``max_rows`` over a host read: after
    them; with ``pad_to_capacity``: in their blocks, ``pad_index``)."""
    if handle.pad_index is not None:
        out = rows.new_full((handle.max_rows, *rows.shape[1:]), fill)
        return out.index_copy_(0, handle.pad_index, rows)
    if handle.max_rows is None or rows.shape[0] == handle.max_rows:
        return rows
    pad = rows.new_full((handle.max_rows - rows.shape[0], *rows.shape[1:]), fill)
    return torch.cat([rows, pad])


def _received(rows: torch.Tensor, handle: CombineHandle) -> torch.Tensor:
    """The N of a handle's ``max_rows`` rows that the variant moves."""
    if handle.pad_index is not None:
        return rows.index_select(0, handle.pad_index)
    return rows if handle.max_rows is None else rows[: handle.num_rows]


def _pad_to_blocks(handle: CombineHandle, plan_out: "PlanOutputs", local: int):
    """(handle with ``pad_index``, plan outputs counting the blocks) of a
    ``pad_to_capacity`` dispatch: received row i of local expert e from source
    s goes to e * sum(B) + B_0 + .. + B_{s-1} + (its place among (e, s)'s rows),
    from the rows' sources and counts on the device (no host read)."""
    blocks = torch.tensor(handle.pad_blocks, dtype=torch.int64)
    width, starts = int(blocks.sum()), torch.cumsum(blocks, 0) - blocks
    device = plan_out.src_rank.device
    rows, world = handle.num_rows, len(handle.pad_blocks)
    expert = torch.repeat_interleave(torch.arange(local, device=device), plan_out.tokens_per_expert,
                                     output_size=rows)
    key = expert * world + plan_out.src_rank  # canonical order: ascending key
    sizes = torch.zeros(local * world, dtype=torch.int64, device=device).scatter_add_(0, key, torch.ones_like(key))
    first = torch.cumsum(sizes, 0) - sizes
    place = torch.arange(rows, device=device) - first[key]
    index = expert * width + starts.to(device)[plan_out.src_rank] + place
    per_expert = torch.full((local,), width, dtype=torch.int64)
    plan_out = dataclasses.replace(plan_out, tokens_per_expert=per_expert.to(device), tokens_per_expert_host=per_expert)
    return dataclasses.replace(handle, pad_index=index), plan_out


def _only(counts: torch.Tensor, first: int, end: int) -> torch.Tensor:
    """``counts`` with every entry outside [first, end) zeroed (a new tensor)."""
    out = torch.zeros_like(counts)
    out[first:end] = counts[first:end]
    return out


def _dtype_code(rows: torch.Tensor) -> int:
    """The code of expert rows' dtype that ranks agree on (``_home_rows``): its
    index in ``checks.FLOAT_DTYPES``, one past them for any other, -1 for no rows."""
    dtypes = checks.FLOAT_DTYPES
    return (dtypes.index(rows.dtype) if rows.dtype in dtypes else len(dtypes)) if rows.shape[0] else -1


def _present(*tensors) -> tuple:
    return tuple(t for t in tensors if t is not None)


def _check_wire(name: str, wire: object, choices: tuple[str, ...]) -> None:
    if wire not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {wire!r}")


@dataclass(frozen=True)
class PlanOutputs:
    """Per-row facts the plan learned, handed to :class:`Dispatched` (weights in
    the dtype they travelled in; the dispatch converts them to topk_weights' dtype)."""

    weights: torch.Tensor
    tokens_per_expert: torch.Tensor
    tokens_per_expert_host: torch.Tensor
    src_rank: torch.Tensor
    src_token: torch.Tensor


class _DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, anchor, routed_weights, dispatcher, handle, started):
        # ``started``: the exchange of x to the experts, started by the verb
        ctx.dispatcher, ctx.handle = dispatcher, handle
        tokens = _padded(started.result(), handle, 0)
        weights = _padded(routed_weights.to(topk_weights.dtype, copy=True), handle, 0)
        return tokens, weights, x.new_empty(0)

    @staticmethod
    def backward(ctx, grad_tokens, grad_weights, _grad_link):
        # Exchanges follow what the group needs (handle), not this rank alone, so
        # that every rank makes the same collective calls.
        dispatcher, handle = ctx.dispatcher, ctx.handle
        dispatcher._calls.agree(dispatcher._along("the backward of dispatch", handle, lambda: None))
        grad_x = grad_topk = None
        if handle.x_grad_any:
            grad_tokens = _received(grad_tokens, handle).contiguous()
            wire = sum_wire_dtype(dispatcher.config.dispatch_grad_wire, grad_tokens.dtype)
            grad_x = dispatcher._to_home(grad_tokens, handle, None, wire)
        if handle.weights_grad_any:
            grad_topk = dispatcher._weights_to_home(_received(grad_weights, handle).contiguous(), handle)
        needs = ctx.needs_input_grad
        return (grad_x if needs[0] else None), (grad_topk if needs[1] else None), None, None, None, None, None


class _CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, link, dispatcher, handle, started):
        # ``started``: the exchange of expert_out home, started by the verb
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.out_dtype, ctx.link_dtype = expert_out.dtype, link.dtype
        ctx.weights_dtype = None if weights is None else weights.dtype
        ctx.save_for_backward(
            expert_out if weights is not None and weights.requires_grad else None, weights
        )
        return started.result()

    @staticmethod
    def backward(ctx, grad_out):
        expert_out, weights = ctx.saved_tensors
        ctx.dispatcher._calls.agree(ctx.dispatcher._along("the backward of combine", ctx.handle, lambda: None))
        grad_out = grad_out.contiguous()
        config = ctx.dispatcher.config
        codec = to_experts_codec(config.combine_grad_wire, grad_out.dtype, config.fp8_pow2_scales)
        grad_rows = _padded(ctx.dispatcher._to_experts(grad_out, ctx.handle, codec), ctx.handle, 0)
        grad_expert = grad_weights = None
        needs = ctx.needs_input_grad
        if weights is None:
            if needs[0]:
                grad_expert = grad_rows.to(ctx.out_dtype)
        elif needs[0] or needs[1]:
            # expert_out is saved where the weights need a gradient; else rows of its dtype stand in
            y = expert_out if needs[1] else grad_rows.new_empty(0, 0, dtype=ctx.out_dtype)
            grad_expert, grad_weights = weighted_row_grads(grad_rows, weights, y, needs[1])
            grad_expert = grad_expert if needs[0] else None
        return grad_expert, grad_weights, grad_out.new_zeros(0, dtype=ctx.link_dtype), None, None, None
