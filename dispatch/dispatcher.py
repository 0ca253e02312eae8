"""The front end: the verbs users call, their checks, and the call agreement.

Notation as in ``dispatch.handle`` (W, E, E_local, T, K, H, N; canonical order).

:class:`TokenDispatcher` turns one transport (``dispatch.transports``: the
protocol of ``transports.base.Transport``) into the public verbs:

* ``dispatch`` / ``combine``: differentiable (``dispatch.autograd``), or work in
  flight with ``async_op=True`` (``dispatch.work``);
* ``dispatch_rows`` / ``combine_rows`` / ``combine_slots`` / ``combine_groups``:
  the same movements along an existing handle, not differentiable (what a
  hand-written backward or a pipeline needs).

Every verb checks its arguments on this rank, then agrees on the call with
every peer (``agreement.Calls``) before any token moves: a rank's refusal, or
ranks at different calls, raise on every rank alike. On the NVLink engine a
dispatch of a signature met before, and a combine along it, is one compiled
call each, the same steps and bits (``dispatch.usual``).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from dispatch import agreement, capacity, checks, comm, free_memory, plan, usual
from dispatch.autograd import combine_node, with_grad
from dispatch.codec import Codec, sum_wire_dtype, to_experts_codec
from dispatch.config import GRAD_TO_EXPERTS_WIRES, SUM_WIRES, DispatchConfig
from dispatch.handle import CombineHandle, Dispatched, padded, received
from dispatch.streams import CommStreams, Started
from dispatch.timing import PhaseTimer
from dispatch.transports.base import Request, Transport
from dispatch.work import DispatchWork, ExchangeWork, GroupSums, dispatched


class TokenDispatcher:
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
        transport: what moves its rows (``dispatch.transports``), chosen by
            ``create`` from the registry by (variant, transport).
        host_free: whether ``dispatch(..., max_rows=M)`` and the round trip
            after it read nothing on the host, so that they can be captured in
            a CUDA graph (the NVLink engine, NVSHMEM); elsewhere ``max_rows`` gives the
            same shapes with a host read.
        max_topk: the most slots per token it moves (None: any).

    Every verb takes ``async_op``: False (default) returns the result; True
    returns a work object (:class:`DispatchWork` / :class:`ExchangeWork`) whose
    ``wait()`` returns it. Started work runs on the dispatcher's
    communication stream on CUDA (the caller's stream waits for it at
    ``wait()`` by an event, the host does not block), and as asynchronous
    collectives on CPU (``wait()`` finishes them). Every rank of the group must
    start the same exchanges in the same order (each call is agreed by every
    rank before any token moves: ``checks``, ``dispatch.board``); several may be in flight at
    once (each has its own handle), and may be waited for in any order (with
    gradients, the same order on every rank: a work's autograd node is made at
    its wait, and the backwards' exchanges run in the nodes' order); a CUDA
    graph's replay is ordered by its stream only: wait for them before it.
    """

    def __init__(self, config: DispatchConfig, group: dist.ProcessGroup | None, transport: Transport) -> None:
        self.config, self.group, self.transport = config, group, transport
        self.world_size, self.rank = transport.world_size, transport.rank
        self.num_local_experts = transport.num_local_experts
        self.devices = comm.device_types(group)
        self.comm_priority = -1
        self._streams = CommStreams()
        self._signatures: dict[tuple, object] = {}  # signatures of the verbs' arguments checked (_signature)
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._members = transport.members()  # the transports whose handles it moves along
        self._calls = agreement.Calls(group, self.world_size, transport.arrivals, config.timeout)  # numbered, agreed
        self._usual = usual.UsualDispatches(self) if usual.usable(self) else None  # the usual dispatch compiled

    @property
    def host_free(self) -> bool:
        return self.transport.host_free

    @property
    def max_topk(self) -> int | None:
        return self.transport.max_topk

    @property
    def phase_timer(self) -> PhaseTimer | None:
        return self.transport.phase_timer

    @phase_timer.setter
    def phase_timer(self, timer: PhaseTimer | None) -> None:
        for transport in {self.transport, *self._members}:
            transport.phase_timer = timer

    def anchor(self, device: torch.device) -> torch.Tensor:
        """An empty leaf that requires grad, on ``device``, made once: the input by
        which every rank's dispatch is a node of the graph, whatever its own
        inputs need (its gradient is always None: nothing accumulates in it)."""
        anchor = self._anchors.get(device)
        if anchor is None:
            anchor = self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return anchor

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
            max_rows: None, or a bound on the rows this rank receives. Its outputs then have ``max_rows`` rows
                (those past the N received: zero tokens and weights, sources -1; experts size by
                ``tokens_per_expert``), and so do the expert outputs and row arguments the verbs take along its
                handle. On the NVLink engine and over NVSHMEM the dispatch reads nothing on the host (it can be
                captured in a CUDA graph): ``tokens_per_expert_host`` and ``stats`` are None, and failures (a rank
                over its bound, bad values, ranks that disagree) are raised on every rank at a later dispatch (the
                first after some rank saw one), or by :meth:`check`. Elsewhere the plan reads N on the host as
                always, and a rank over its bound makes every rank raise a ValueError before any token moves (the
                bounds travel in the counts exchange). Every rank passes one or none; none with ``pad_to_capacity``,
                which fixes the rows itself.
            groups: G >= 1 groups of local experts (``plan.expert_groups``, G <= E_local) to move the rows by: with
                ``async_op``, ``DispatchWork.wait_group(g)`` hands out group g's rows while later groups' still
                move, and ``combine_groups`` brings the experts' outputs home group by group. The alltoall variant
                on the NCCL transport (and on gloo; ``auto`` where it picks alltoall) moves each group as its own
                all-to-all, the NVLink engine and NVSHMEM get each group's rows in turn (either way a token still
                crosses to a rank once: with the first group there that needs it); the other variants move all
                groups at once and hand them out by group. Every rank passes the same G (where they differ, every
                rank raises before any row moves); not with ``pad_to_capacity``. With ``max_rows`` (the alltoall
                variant on the NVLink engine and NVSHMEM), each group's rows are padded to B = ceil(max_rows / G):
                group g's rows at [g B, g B + its rows), then zero rows, the outputs G B rows, nothing read on the
                host; a rank with more than B rows in a group fails every rank alike (raised at a later dispatch, or
                by :meth:`check`). The rows are then not expert-contiguous from row 0: hand each group's to the
                experts (``wait_group``, with its ``tokens_per_expert``).
            async_op: return a :class:`DispatchWork` instead of the result.
        Returns:
            :class:`Dispatched` (through ``DispatchWork.wait()`` with ``async_op``).
            Gradients flow to ``x`` (through ``tokens``) and to ``topk_weights``
            (through ``weights``).
        """
        fast = self._usual
        if fast is not None and max_rows is None and groups == 1 and not async_op:
            result = fast.dispatch(x, topk_idx, topk_weights)
            if result is not None:
                return result
        ticket = self._calls.ticket("dispatch")
        try:
            at_once = not async_op and groups == 1 and self.transport.phase_timer is None  # Request.at_once
            codec, handle, plan_out, dropped = self._plan_dispatch(ticket, x, topk_idx, topk_weights, max_rows, groups,
                                                                   at_once)
        except agreement.CallsDiffer:  # its first message met another call (the counts exchange, off the board)
            self._calls.withdraw(ticket)
            raise
        result = self._dispatched(x, topk_weights, handle, plan_out, codec, dropped, async_op)
        if fast is not None and at_once and max_rows is None:
            fast.learn(x, topk_idx, topk_weights, handle, codec)
        return result

    def _dispatched(self, x, topk_weights, handle, plan_out, codec: Codec, dropped,
                    async_op: bool = False) -> "Dispatched | DispatchWork":
        """A planned dispatch's result: its rows moved on the caller's stream (its
        result once the collectives are done: ``streams.Pending``), or started
        on the communication stream (``async_op``)."""
        rows, dtype, hidden = x.detach(), x.dtype, x.shape[1]
        wires = self.config.dispatch_wire, self.config.combine_wire

        def traffic():  # ``Dispatched.stats``, at its first read
            return handle.transport.stats(handle, to_experts_codec(wires[0], dtype).row_bytes(hidden),
                                          sum_wire_dtype(wires[1], dtype), hidden)

        if async_op:
            started = self._streams.start_groups(lambda: handle.transport.to_experts(rows, handle, codec, True),
                                                 (rows,), True, self.comm_priority)
            return DispatchWork(self, x, topk_weights, handle, plan_out, started, traffic, dropped)
        started = handle.transport.to_experts(rows, handle, codec, True)
        return dispatched(self, x, topk_weights, handle, plan_out, started, traffic, dropped)

    def _plan_dispatch(self, ticket: plan.Ticket, x, topk_idx, topk_weights, max_rows, groups, at_once=False):
        """``dispatch`` up to its rows' move: its checks, its agreement and its
        plan (``at_once``: the rows move right after it, ``Request.at_once``).
        Returns (its wire codec, handle, plan outputs, dropped slots)."""
        try:
            codec = self._check_dispatch(x, topk_idx, topk_weights, max_rows, groups)
            if self.transport.device_bound:  # (not kept with the signature: the current device may change)
                self.transport.check_current(x)
        except (TypeError, ValueError) as error:  # still take part in the first message: the peers raise there
            agreement.refuse(error, lambda: self._take_part_refused(ticket))
        agreed = word = None
        if self.transport.agrees_dispatch:  # its word, every rank's (with pad_to_capacity: in capacity.agreed_blocks)
            word = self.transport.dispatch_word(x, topk_weights, max_rows, groups)
        if word is not None and not self.config.pad_to_capacity:
            agreed = tuple(row[-1] for row in self._calls.agree(ticket, tail=(word,)))
        elif self._calls.dispatch_agrees and not self.config.pad_to_capacity:
            self._calls.agree(ticket)  # the call agreed on the host; the counts exchange checks it again
        dropped = None
        if self.config.capacity_factor is not None:  # Megatron's token dropping, on this rank's routing
            topk_idx, dropped = capacity.drop_over_capacity(topk_idx, topk_weights, self.config.num_experts,
                                                            self.config.capacity_factor, self.config.drop_policy,
                                                            self.config.tuning.check_inputs)
        check = self.config.tuning.check_inputs
        if self.config.pad_to_capacity:  # the blocks every rank pads to, before any row moves
            blocks, agreed = capacity.agreed_blocks(self._calls, self.config, topk_idx, ticket, word)
            padded_rows = self.num_local_experts * sum(blocks)  # (the same on every rank)
            # the N received beside their padded copy: a rank whose memory cannot hold the copy refuses
            memory_rows = free_memory.memory_rows(x, self.transport.row_bytes, free_memory.free_bytes)
            short = 0 <= memory_rows < padded_rows
            budget = -1 if memory_rows < 0 else max(memory_rows - padded_rows, 0)  # for the N received
            ticket = dataclasses.replace(ticket.with_budgets((-1, budget)), refused=short)
            try:
                handle, plan_out = self.transport.plan(
                    Request(self, x, topk_idx, topk_weights, ticket, check, groups, agreed))
            except agreement.PeerRefused:
                if short:
                    raise ValueError(f"x: the padded rows of a pad_to_capacity dispatch ({padded_rows}) do not fit in "
                                     f"this rank's free device memory ({memory_rows} rows); no token moved") from None
                raise
            handle = dataclasses.replace(handle, max_rows=padded_rows, pad_blocks=blocks)
        else:
            budgets = free_memory.row_budgets(x, self.transport.row_bytes, max_rows, groups)
            handle, plan_out = self.transport.plan(
                Request(self, x, topk_idx, topk_weights, ticket.with_budgets(budgets), check, groups, agreed,
                        lambda: self._exact_memory_rows(x, ticket), at_once))
        return codec, handle, plan_out, dropped

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
            theirs (``checks.home_rows``). Differentiable w.r.t. ``expert_out`` and
            ``weights`` (the backward is a dispatch of the gradient).
        """
        fast = self._usual
        if fast is not None and not async_op:
            out = fast.combine(expert_out, handle, weights)
            if out is not None:
                return out
        ticket = self._along("combine", handle, self._check_combine, expert_out, handle, weights)
        rows = expert_out.detach() if handle.max_rows is None else received(expert_out.detach(), handle)
        headers = self._calls.agree(ticket, checks.dtype_code(rows), hidden=rows.shape[1],
                                    weights_code=-1 if weights is None else checks.FLOAT_CODES[weights.dtype])
        checks.check_peer_rows(headers, "expert_out")
        rows = checks.home_rows(rows, handle.has_rows, self.group, self.world_size, headers).contiguous()
        wire = sum_wire_dtype(self.config.combine_wire, rows.dtype)
        w = None
        if weights is not None:
            w = weights.detach() if handle.max_rows is None else received(weights.detach(), handle)
        node = torch.is_grad_enabled() and handle.link is not None  # else no backward: no node
        if async_op:
            started = self._start(lambda: handle.transport.to_home(rows, handle, w, wire), _present(rows, w), True)
            return ExchangeWork(started, lambda: with_grad(combine_node, expert_out, weights, handle.link,
                                                            (self, handle, started)) if node else started.result())
        started = handle.transport.to_home(rows, handle, w, wire)  # on the caller's stream, as dispatch's
        out = combine_node(expert_out, weights, handle.link, (self, handle, started)) if node else started.result()
        if fast is not None:
            fast.learn_combine(expert_out, handle, weights)
        return out

    def _check_combine(self, expert_out, handle: CombineHandle, weights) -> None:
        """``combine``'s own checks of its arguments (this rank alone)."""
        self._check_handle(handle)
        rows = handle.rows
        try:
            key = ("combine", expert_out.__class__, expert_out.shape, expert_out.dtype, expert_out.device,
                   expert_out.layout, weights.__class__, rows, handle.device,
                   None if weights is None else (weights.shape, weights.dtype, weights.device, weights.layout))
        except AttributeError:
            key = None
        try:
            self._signatures[key]  # a signature met before (None is never kept)
        except (KeyError, TypeError):
            self._signature(key, lambda: checks.check_combine_inputs(expert_out, weights, rows, self.devices,
                                                                     device=handle.device) or True)
        differentiable = expert_out.requires_grad or (weights is not None and weights.requires_grad)
        if torch.is_grad_enabled() and differentiable and handle.link is None:
            raise ValueError(
                "expert_out (or weights) requires grad but the dispatch behind handle ran with grad mode off (run "
                "it with grad mode on so every rank joins the backward), or handle is a DispatchWork's taken before "
                "its wait() (take wait().handle)")

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
            checks.check_rows("rows", rows, handle.num_tokens, "the dispatch behind handle had T =", self.devices,
                              handle.device)
            _check_wire("wire", wire, GRAD_TO_EXPERTS_WIRES)
            to_experts_codec(wire, rows.dtype, self.config.tuning.fp8_pow2_scales)

        headers = self._calls.agree(self._along("dispatch_rows", handle, check), checks.dtype_code(rows, always=True),
                                    hidden=rows.shape[1], tail=(GRAD_TO_EXPERTS_WIRES.index(wire),))
        checks.check_peer_rows(headers, "rows")
        checks.check_peer_choice(headers, "wire", GRAD_TO_EXPERTS_WIRES)
        codec = to_experts_codec(wire, rows.dtype, self.config.tuning.fp8_pow2_scales)
        rows = rows.detach().contiguous()
        started = self._streams.start_groups(lambda: handle.transport.to_experts(rows, handle, codec),
                                             (rows,), async_op, self.comm_priority)
        if handle.groups > 1:
            work = ExchangeWork(started, groups=handle.groups)
        else:
            work = ExchangeWork(started, lambda: padded(started.result(), handle, 0))
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
            rows: [N, H'] floating, in the dispatched order; one H' on every
                rank, and one dtype on every rank that has rows (a rank without
                takes theirs, as ``combine``).
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
            checks.check_combine_inputs(rows, weights, handle.rows, self.devices, "rows", handle.device)
            _check_wire("wire", wire, SUM_WIRES)

        ticket = self._along("combine_rows", handle, check)
        rows = received(rows.detach(), handle)
        headers = self._calls.agree(ticket, checks.dtype_code(rows), hidden=rows.shape[1],
                                    tail=(SUM_WIRES.index(wire),),
                                    weights_code=-1 if weights is None else checks.FLOAT_CODES[weights.dtype])
        checks.check_peer_rows(headers, "rows")
        checks.check_peer_choice(headers, "wire", SUM_WIRES)
        rows = checks.home_rows(rows, handle.has_rows, self.group, self.world_size, headers).contiguous()
        w = None if weights is None else received(weights.detach(), handle)
        wire_dtype = sum_wire_dtype(wire, rows.dtype)
        started = self._start(lambda: handle.transport.to_home(rows, handle, w, wire_dtype), _present(rows, w),
                              async_op)
        work = ExchangeWork(started)
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
            [T, K] in the dtype of ``values`` (one on every rank that has rows;
            a rank without takes theirs): the value of the row of each (token,
            slot), 0 for empty slots.
        """
        def check():
            self._check_handle(handle)
            checks.check_values("values", values, handle.rows, self.devices, handle.device)

        ticket = self._along("combine_slots", handle, check)
        values = received(values.detach(), handle)
        headers = self._calls.agree(ticket, checks.dtype_code(values))
        checks.check_peer_rows(headers, "values")
        values = checks.home_rows(values, handle.has_rows, self.group, self.world_size, headers).contiguous()
        started = self._start(lambda: handle.transport.slots_home(values, handle), (values,), async_op)
        work = ExchangeWork(started)
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

        ticket = self._along("combine_groups", handle, check)
        code = checks.NO_DTYPE if dtype is None else checks.FLOAT_DTYPES.index(dtype)
        headers = self._calls.agree(ticket, code, tail=(SUM_WIRES.index(wire),))
        checks.check_peer_rows(headers, "dtype")
        checks.check_peer_choice(headers, "wire", SUM_WIRES)
        return GroupSums(self, handle, dtype, wire, ticket)

    def reserve(self, x: torch.Tensor, topk: int) -> None:
        """Make room for dispatches with ``max_rows`` of up to ``x``'s T tokens of ``topk``
        slots, rows like ``x`` (round trip and backward included), so that they read nothing
        on the host. A collective over the group: every rank calls it at the same point,
        each with its own ``x`` (one host synchronisation); room only grows. Without it the
        first dispatch with ``max_rows`` sizes it once, and a later one that does not fit
        raises. Nothing to do where ``max_rows`` reads the host anyway (the arguments checked
        alone); elsewhere a bad argument is refused on every rank (the peers ``PeerRefused``)."""
        if not self.transport.reserves:
            return checks.check_reserve(self, x, topk)
        self._calls.agree(self._along("reserve", None, checks.check_reserve, self, x, topk))
        self.transport.reserve(x, int(topk))

    def refuse(self, verb: str, handle: CombineHandle | None, error: BaseException) -> None:
        """Raise ``error`` (its experts raised, a layer's argument failed here), this rank's reason not to make
        its next ``verb`` call (dispatch, ``handle`` None; combine, combine_rows, dispatch_rows, combine_slots,
        combine_groups along ``handle``), once it took part in that call's first message marked refused: every
        peer raises ``agreement.PeerRefused`` there, naming it, not waiting until ``DispatchConfig.timeout``.
        ``GroupSums.refuse`` for an add. In the call's grad mode; a bad verb or handle raises here alone."""
        if verb == "dispatch" and handle is None:
            ticket = self._calls.ticket("dispatch")
            try:
                agreement.refuse(error, lambda: self._take_part_refused(ticket))  # (it raises)
            except agreement.CallsDiffer:  # as in dispatch: a call the ranks differ on is counted by none
                self._calls.withdraw(ticket)
                raise
        self._check_handle(handle)
        if verb not in ("combine", "combine_rows", "dispatch_rows", "combine_slots", "combine_groups"):
            raise ValueError(f"verb must be dispatch (handle None) or name a call along a handle (combine, "
                             f"combine_rows, dispatch_rows, combine_slots, combine_groups), got {verb!r}")
        self._calls.refuse(verb, handle.call, error)

    def check(self) -> None:
        """Raise a failure that an exchange with no host read (``max_rows``)
        recorded on the device: a rank over its ``max_rows``, bad values, ranks that
        disagree (every rank records these alike), a peer that did not arrive (this
        rank's own: its peers raise it at their next dispatch). A host read: it waits
        for the work queued so far. Without such exchanges nothing is pending."""
        self.transport.check()

    # -- shared by the verbs --------------------------------------------------

    def _check_dispatch(self, x, topk_idx, topk_weights, max_rows, groups) -> Codec:
        """``dispatch``'s own checks of its arguments (this rank alone); its wire codec.
        They read the arguments' types, shapes, dtypes, devices and layouts only (the values are
        checked with the plan): once passed for a signature, its codec is kept (``_signature``)."""
        try:
            key = ("dispatch", x.__class__, x.shape, x.dtype, x.device, x.layout, topk_idx.__class__, topk_idx.shape,
                   topk_idx.dtype, topk_idx.device, topk_idx.layout, topk_weights.__class__, topk_weights.shape,
                   topk_weights.dtype, topk_weights.device, topk_weights.layout, max_rows.__class__, max_rows,
                   groups.__class__, groups)
        except AttributeError:  # not tensors: the checks name the argument
            key = None
        try:
            return self._signatures[key]  # a signature met before (None is never kept)
        except (KeyError, TypeError):
            return self._signature(key, lambda: checks.check_dispatch_signature(self, x, topk_idx, topk_weights,
                                                                                  max_rows, groups))

    def _signature(self, key: tuple | None, check):
        """``check()``'s result (not None), kept for ``key`` (the signature of a verb's arguments: their types,
        shapes, dtypes, devices, where ``check`` reads nothing else), which the verbs look up first: a call of a
        signature met before pays one subscript (``_SIGNATURES`` kept at most; None or an unhashable key: none)."""
        result = check()
        if len(self._signatures) >= _SIGNATURES:
            self._signatures.clear()
        if key is not None:
            try:
                self._signatures[key] = result
            except TypeError:  # unhashable (an argument of a type the checks refuse)
                pass
        return result

    def _take_part_refused(self, ticket: plan.Ticket) -> None:
        """This rank's share of a dispatch it refuses: the first message (the
        call's agreement on the board, or the counts exchange marked refused,
        with no tokens), as its peers make it."""
        ticket = dataclasses.replace(ticket, refused=True)
        if self._calls.dispatch_agrees or self.config.pad_to_capacity or self.transport.agrees_dispatch:
            self._calls.agree(ticket, tail=(0,))
            return
        device = torch.device("cuda", torch.cuda.current_device()) if "cuda" in self.devices else torch.device("cpu")
        self.transport.plan(Request(self, torch.zeros(0, 1, device=device),
                                    torch.zeros(0, 1, dtype=torch.int64, device=device),
                                    torch.zeros(0, 1, device=device), ticket, False))

    def _along(self, verb: str, handle, check, *args) -> plan.Ticket:
        """Start a verb that moves rows along ``handle`` (None: ``reserve``, along
        none): run its own checks (``check(*args)``); if they fail, agree on the call
        refused and raise (the peers raise :class:`agreement.PeerRefused`). Returns
        the call's ticket, which the verb then agrees on (``agreement.Calls.agree``)."""
        ticket = self._calls.ticket(verb, handle.call if isinstance(handle, CombineHandle) else 0)
        try:
            check(*args)
            if handle is not None and handle.transport.device_bound:
                handle.transport.check_current()
        except (TypeError, ValueError) as error:
            agreement.refuse(error, lambda: self._calls.agree(dataclasses.replace(ticket, refused=True)))
        return ticket

    def _start(self, issue, reads: tuple, async_op: bool) -> Started:
        return self._streams.start(issue, reads, async_op, self.comm_priority)

    def _check_handle(self, handle: object) -> None:
        if not isinstance(handle, CombineHandle) or handle.owner is not self:
            raise ValueError("handle must be the Dispatched.handle of a dispatch made by this dispatcher")
        if handle.pad_blocks is not None and handle.pad_index is None:
            raise ValueError("handle: a pad_to_capacity dispatch places its rows when it is waited for; move rows "
                             "along the handle of its result (DispatchWork.wait().handle)")

    def _exact_memory_rows(self, x: torch.Tensor, ticket: plan.Ticket) -> list[int]:
        """Every rank's exact memory budget in rows (``free_memory.free_bytes``), agreed
        (``Request.exact_memory_rows``)."""
        rows = free_memory.memory_rows(x, self.transport.row_bytes, free_memory.free_bytes)
        return [row[-1] for row in self._calls.agree(ticket, tail=(rows,))]


_SIGNATURES = 64  # argument signatures (of every verb) a dispatcher keeps as checked


def _present(*tensors) -> tuple:
    return tuple(t for t in tensors if t is not None)


def _check_wire(name: str, wire: object, choices: tuple[str, ...]) -> None:
    if wire not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {wire!r}")

