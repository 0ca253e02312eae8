"""The ``alltoall`` variant on the NVLink engine (``transport="nvlink"``): every
rank of the group on one host, the plan and the exchanges run by the engine's
kernels (``dispatch.nvlink``, ``csrc/``) with one host read per dispatch.

Notation as in ``dispatch.nvlink`` (W, E_local, T, K, J, H, N).

The contract is the alltoall variant's, bit for bit: the same canonical
receive order, a token read by a rank once whatever its experts there, the
expert side pre-summing each (token, rank) in fp32 (fp64 for fp64) in ascending
local expert with one fused multiply-add per weighted term, the home rank
summing the partials in ascending rank order and casting once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatch import checks, cuda, plan
from dispatch.codec import Codec, sum_wire_dtype, to_experts_codec
from dispatch.handle import CombineHandle, PlanOutputs, made
from dispatch.streams import Done, Pending, PendingGroups
from dispatch.transports.base import GroupSumsIssuer, Request, Transport, grads_of, handle_fields, shape_fields
from dispatch.nvlink import Capacity, Counts, aligned_rows, engine_for, partial_row_bytes, staged_row_bytes
from dispatch.nvlink_layout import most_experts
from dispatch.stats import make_stats, tier_split
from dispatch.timing import mark

MAX_WORLD = 32  # a token's ranks are one 32-bit mask
MAX_TOPK = 32  # a token's slots are one warp's lanes


@dataclass(frozen=True, kw_only=True)
class NVLinkHandle(CombineHandle):
    """Plan of one exchange on the engine.

    Attributes:
        counts: the counts exchange (``dispatch.nvlink.Counts``): matrix, routes, masks.
        presum: [W * counts.bound, J] int32, this rank's expanded rows of each
            (source rank, token) in ascending local expert, -1 padded.
        slot_k: [W * counts.bound, J] int32, the source slot of each of them.
        split_matrix: host rows (tokens) of every rank to every rank (None
            for a dispatch with max_rows).
        places: [N] routing weight (wire dtype), source rank and source token
            (int64) of each expanded row, written by the dispatch's own pull
            (``to_experts`` with ``own``), which reads the sources' routes.
        group_bound: B, the rows of each group of a dispatch by groups with
            ``max_rows`` (group g's rows at [g B, g B + its rows), then zero rows);
            None otherwise.
    """

    counts: Counts
    presum: torch.Tensor
    slot_k: torch.Tensor
    split_matrix: tuple[tuple[int, ...], ...] | None
    places: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    group_bound: int | None = None


class NVLinkTransport(Transport):
    """Deduplicated all-to-all over NVLink with the engine's kernels
    (``variant="alltoall"``, ``transport="nvlink"`` or ``"auto"``; chosen by
    the registry once :func:`unusable` found nothing against it)."""

    variant, transport = "alltoall", "nvlink"
    host_free = True
    max_topk = MAX_TOPK
    bounded_groups = True
    device_bound = True
    agrees_dispatch = True  # on the group's board (one host), else over the host channel: one all-gather a dispatch
    reserves = True

    def __init__(self, config, group=None) -> None:
        super().__init__(config, group)
        self.engine = engine_for(group, config.num_experts, config.tuning.sm_budget, config.timeout)

    def check_current(self, x: torch.Tensor | None = None) -> None:
        device = self.engine.device
        if x is not None and (x.device.type != device.type or (x.device.type == "cuda" and x.device != device)):
            raise ValueError(f"x is on {x.device}, but the dispatcher's engine runs on {device}: dispatch tokens "
                             "on its device")
        self.engine.check_current()

    def plan(self, request: Request) -> tuple[NVLinkHandle, PlanOutputs]:
        words = self.agreed_words(request)
        if request.max_rows is not None:
            return self._plan_bounded(request, words)
        x, topk_idx, topk_weights, ticket = request.x, request.topk_idx, request.topk_weights, request.ticket
        num_tokens, topk = _check_topk(topk_idx)
        weights, wire, codec = self._wire_inputs(x, topk_weights)
        engine = self.engine
        # the values are checked by the layout kernel, which marks this rank failed in
        # the counts every rank reads: no host synchronisation of its own
        counts = engine.exchange_counts(topk_idx.contiguous(), weights, plan.header(x, topk_weights, topk, ticket),
                                        x.detach().contiguous(), codec, request.check_values,
                                        planned=(min(topk, self.num_local_experts), wire), pull=request.at_once)
        return self.planned(request, counts)

    def planned(self, request: Request, counts: Counts) -> tuple[NVLinkHandle, PlanOutputs]:
        """The plan of ``request`` (no ``max_rows``) from its counts exchange, read
        on the host: the checks of every rank's header and budgets where the
        compiled exchange did not find the usual case, then the handle."""
        read = counts.host  # what the host read: every rank's header, sends and rows
        headers, rows_of = read.headers, read.rows
        if counts.planned is None:  # not the usual case (or no compiled path): the checks say what it is
            self._raise_own_values(request, headers[self.rank])
            grads_any = checks.check_peer_headers(headers)
            checks.check_row_budgets(headers, rows_of, self.row_bytes(request.x), request.exact_memory_rows)
        else:  # the checks would pass: the compiled exchange found every header agreeing, every budget kept
            grads_any = (counts.planned.x_grad, counts.planned.weights_grad)
        has_rows = tuple([n > 0 for n in rows_of])
        num_rows = rows_of[self.rank]
        per_expert = read.per_expert.tolist() if request.groups > 1 else ()  # (the groups' bounds sum them)
        wire = plan.weight_wire_dtype(request.topk_weights.dtype)
        handle, outputs = self._handle(request, counts, num_rows, grads_any, has_rows, read.sends, wire,
                                       read.per_expert,
                                       shape_fields(request, self.num_local_experts, per_expert, num_rows))
        mark(self.phase_timer, "plan")
        return handle, outputs

    def _plan_bounded(self, request: Request, words: tuple[int, ...]) -> tuple[NVLinkHandle, PlanOutputs]:
        # nothing read on the host: the counts exchange kernel checks what plan checks
        # there, for every rank alike, and a failure surfaces at a later dispatch's
        # agreement (seen_failed) or host read; by groups, each group's rows padded to
        # B = ceil(max_rows / G)
        x, topk_idx, topk_weights, ticket = request.x, request.topk_idx, request.topk_weights, request.ticket
        groups = request.groups
        num_tokens, topk = _check_topk(topk_idx)
        weights, wire, codec = self._wire_inputs(x, topk_weights)
        engine = self.engine
        stage_row = staged_row_bytes(codec, x.shape[1])
        if not engine.reserved:  # the same on every rank: size the buffers by agreement, once some rank has a
            if cuda.capturing():  # token (whatever grew them before)
                raise RuntimeError("max_rows: the first dispatch with max_rows on the engine sizes its buffers by a "
                                   "collective, which a CUDA graph capture cannot hold: run one eagerly first (or "
                                   "d.reserve(x, K))")
            self.reserve(x, topk)
        header = plan.header(x, topk_weights, topk, ticket)
        max_rows, memory_rows = ticket.max_rows, ticket.memory_rows
        bound = -(-max_rows // groups)
        out_rows = groups * bound  # the outputs have these rows, whatever N
        over = not engine.capacity.covers(Capacity(num_tokens, topk, stage_row, 0))
        short = 0 <= memory_rows < out_rows
        if over or short:  # this rank raises; its mark makes every peer record the failure
            header[plan.HEADER.index("failed")] = 2
            topk_idx, weights = topk_idx[:0], weights[:0]
        rows = x.detach().contiguous()[: len(topk_idx)]
        counts = engine.exchange_counts(topk_idx.contiguous(), weights, header, rows, codec, request.check_values,
                                        host_read=False, groups=groups)
        if over or short:  # its peers raise at their next dispatch, where this rank's word says it saw the failure
            engine.failure_seen = True
        if short:
            raise ValueError(
                f"max_rows: {out_rows} rows do not fit this rank's free device memory ({memory_rows} rows of "
                f"{self.row_bytes(x)} bytes, the dispatch's outputs); the engine is failed")
        if over:
            capacity = engine.capacity
            raise ValueError(
                f"x: a dispatch with max_rows takes at most {capacity.tokens} tokens of K <= {capacity.topk} "
                f"(the buffers the first such dispatch sized from the group's largest T), got T={num_tokens}, "
                f"K={topk}: give the first dispatch with max_rows the largest T on some rank; the engine is failed")
        shape = {}
        if groups > 1:
            shape = dict(group_experts=plan.expert_groups(self.num_local_experts, groups),
                         group_rows=tuple(g * bound for g in range(groups + 1)), group_bound=bound)
        handle, outputs = self._handle(request, counts, out_rows, grads_of(words),
                                       (True,) * self.world_size, None, wire, None, shape)
        mark(self.phase_timer, "plan")
        return handle, outputs

    def reserve(self, x: torch.Tensor, topk: int) -> None:
        need = plan.to_device(torch.tensor([x.shape[0], topk, *self._round_trip_rows(x)], dtype=torch.int64),
                              x.device)
        dist.all_reduce(need, op=dist.ReduceOp.MAX, group=self.group)
        need = Capacity(*need.tolist())  # host sync: the group's largest T, K, rows
        self.engine.ensure(need)
        self.engine.reserved = self.engine.reserved or need.tokens > 0

    def _round_trip_rows(self, x) -> tuple[int, int]:
        """(staged, partial) row bytes of a round trip of x with expert outputs
        like x, backward included, so that sizing the buffers once covers it."""
        hidden, config = x.shape[1], self.config
        staged = max(staged_row_bytes(to_experts_codec(wire, x.dtype), hidden)
                     for wire in (config.dispatch_wire, config.combine_grad_wire))
        partial = max(partial_row_bytes(sum_wire_dtype(wire, x.dtype), hidden)
                      for wire in (config.combine_wire, config.dispatch_grad_wire))
        return staged, partial

    def _wire_inputs(self, x, topk_weights):
        """(routing weights in their wire dtype, contiguous; that dtype; the codec of x)."""
        wire = plan.weight_wire_dtype(topk_weights.dtype)
        codec = to_experts_codec(self.config.dispatch_wire, x.dtype, self.config.tuning.fp8_pow2_scales)
        return topk_weights.detach().to(wire).contiguous(), wire, codec

    def _handle(self, request: Request, counts: Counts, num_rows, grads_any, has_rows, split, wire, per_expert_host,
                shape: dict):
        if counts.planned is not None:  # made with the counts exchange
            planned = counts.planned
            presum, slot_k, places = planned.presum, planned.slot_k, (planned.weights, planned.src_rank,
                                                                      planned.src_token)
        else:
            device = request.x.device
            width = min(request.topk_idx.shape[1], self.num_local_experts)
            presum, slot_k = torch.empty(2, self.world_size * counts.bound, width, dtype=torch.int32,
                                         device=device).unbind()
            places = (torch.empty(num_rows, dtype=wire, device=device),
                      *torch.empty(2, num_rows, dtype=torch.int64, device=device).unbind())
        handle = made(  # (NVLinkHandle's __init__, faster)
            NVLinkHandle,
            **handle_fields(request, self, num_rows, grads_any, has_rows),
            counts=counts,
            presum=presum,
            slot_k=slot_k,
            split_matrix=split,
            places=places,
            **shape,
        )
        routed, src_rank, src_token = handle.places
        outputs = made(
            PlanOutputs,
            weights=routed,
            tokens_per_expert=counts.tokens_per_expert,
            tokens_per_expert_host=per_expert_host,
            src_rank=src_rank,
            src_token=src_token,
        )
        return handle, outputs

    def check(self) -> None:
        self.engine.check()

    def seen_failed(self, bounded: bool) -> bool:
        return self.engine.seen_failed(poll=bounded)

    def to_experts(self, rows: torch.Tensor, handle: NVLinkHandle, codec: Codec,
                   own: bool = False) -> PendingGroups:
        if handle.groups > 1:
            # one pull a group, in order, into one output: a row that an earlier group of this
            # rank brought is copied from there, so a token still crosses to a rank once
            pulls = _GroupPulls(self, rows.contiguous(), handle, codec, own)
            return PendingGroups([None] * handle.groups, [lambda g=g: pulls.upto(g) for g in range(handle.groups)])
        # the dispatch's own x: the rows to their places, with each place's weight and
        # source; where every rank staged its rows with the counts, nothing more is exchanged
        planned = handle.counts.planned
        if own and planned is not None and planned.tokens is not None:  # pulled with the counts (Request.at_once)
            return Done(planned.tokens)
        tokens = self.engine.to_experts(rows.contiguous(), codec, handle.counts, handle.presum, handle.slot_k,
                                        handle.num_rows, meta_out=handle.places if own else None)
        mark(self.phase_timer, "exchange_out")
        return Done(tokens)

    def to_home(self, rows, handle: NVLinkHandle, weights, wire) -> Pending:
        at_least = None if weights is None else weights.dtype  # fp64 weights: fp64 sums
        out = self.engine.to_home(rows.contiguous(), None if weights is None else weights.contiguous(), wire,
                                  handle.counts, handle.presum, at_least)
        mark(self.phase_timer, "exchange_back")
        return Done(out)

    def group_sums(self, handle: NVLinkHandle, wire: str, dtype):
        if handle.groups == 1:
            return super().group_sums(handle, wire, dtype)
        return _GroupPushes(self, handle, wire)

    def slots_home(self, values, handle: NVLinkHandle) -> Pending:
        return Done(self.engine.slots_home(values, handle.counts, handle.presum, handle.slot_k))

    def stats(self, handle: NVLinkHandle, dispatch_row_bytes, combine_wire, hidden):
        if handle.split_matrix is None:  # a dispatch with max_rows: the sizes are not on the host
            return None
        local = self.local_world_size
        sent = handle.split_matrix[self.rank]
        received = tuple(row[self.rank] for row in handle.split_matrix)
        return make_stats(local, tier_split(sent, self.rank, local), dispatch_row_bytes,
                          tier_split(received, self.rank, local), hidden * combine_wire.itemsize)


class _GroupPulls:
    """The pulls of a move by groups, issued in group order whatever order the
    groups are asked for in (a span copies rows that earlier pulls brought)."""

    def __init__(self, dispatcher: NVLinkTransport, rows, handle: NVLinkHandle, codec: Codec, own: bool) -> None:
        self._d, self._rows, self._handle, self._codec, self._own = dispatcher, rows, handle, codec, own
        self._out, self._issued = None, 0

    def upto(self, g: int) -> torch.Tensor:
        """Group g's rows [N_g, H], the pulls of groups up to g issued."""
        handle = self._handle
        while self._issued <= g:
            self._out = self._d.engine.to_experts(
                self._rows, self._codec, handle.counts, handle.presum, handle.slot_k, handle.num_rows,
                meta_out=handle.places if self._own else None, span=handle.row_range(self._issued), out=self._out,
                group=None if handle.group_bound is None else self._issued)
            self._issued += 1
        if self._issued == handle.groups:
            mark(self._d.phase_timer, "exchange_out")
        return self._out[slice(*handle.row_range(g))]

    @property
    def out(self) -> torch.Tensor | None:
        """Every group's rows, once every span is issued."""
        return self._out


class _GroupPushes(GroupSumsIssuer):
    """The expert side of a combine by groups on the engine: as group g's rows
    come, the pre-sums it completes (those of the (token, source rank) rows whose
    last expert here is in group g) are summed whole from every group's rows
    and pushed home; the home rank sums them as soon as the last group is
    pushed. The bits of one combine, for every G. The groups' row pointers are
    written on the device, so that a dispatch by groups with ``max_rows`` can
    be captured in a CUDA graph with its combine.

    The pushes of groups before the last write the partials of the next
    operation of the engine without raising it. Where another operation of the
    engine comes between two groups (a second combine by groups, a dispatch),
    the partials pushed so far may be another operation's: the groups after
    push nothing, and the last pushes every pre-sum (the same bits, nothing
    hidden). A CUDA graph of the engine's operations replayed between two
    groups is not seen so (its replay counts nothing on the host): replay none
    there (``GroupSums.add``)."""

    def __init__(self, dispatcher: NVLinkTransport, handle: NVLinkHandle, wire: str) -> None:
        self._d, self._handle, self._wire_name = dispatcher, handle, wire
        self._rows: list = []  # every group's rows and weights, alive until the last push
        self._weights: list = []
        self._table = self._bounds = self._wire = self._after = self._out = None
        self._whole = False  # push every pre-sum with the last group

    def _setup(self, rows: torch.Tensor) -> None:
        handle, device = self._handle, self._d.engine.device
        self._wire = sum_wire_dtype(self._wire_name, rows.dtype)
        self._table = torch.zeros(2 * handle.groups, dtype=torch.int64, device=device)
        if handle.group_bound is not None:  # rows padded by groups: the bounds on the device
            self._bounds = torch.arange(handle.groups + 1, dtype=torch.int64, device=device) * handle.group_bound
        else:  # a dispatch that read its counts on the host (never inside a capture)
            bounds = torch.tensor(handle.group_rows, dtype=torch.int64)
            self._bounds = bounds.pin_memory().to(device, non_blocking=True)

    def add(self, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
        handle, engine = self._handle, self._d.engine
        if self._table is None:
            self._setup(rows)
        rows = aligned_rows(rows)
        self._rows.append(rows)
        self._weights.append(weights)
        engine.store_group(self._table, g, rows, weights)
        self._whole |= self._after is not None and engine.operations != self._after
        last = g + 1 == handle.groups
        if self._whole and not last:
            return
        span = (0, handle.rows) if self._whole else handle.row_range(g)
        engine.push_group(rows, weights, self._table, self._bounds, g + 1, span, last, self._wire, handle.counts,
                          handle.presum)
        self._after = engine.operations
        if last:  # the home sums right behind the pushes, before any other operation
            at_least = None if weights is None else weights.dtype  # fp64 weights: fp64 sums
            self._out = engine.home_sum(handle.counts, self._wire, rows.dtype, rows.shape[1], at_least)
            self._rows, self._weights = [], []
            mark(self._d.phase_timer, "exchange_back")

    def finish(self) -> Pending:
        return Done(self._out)


def _check_topk(topk_idx: torch.Tensor) -> tuple[int, int]:
    num_tokens, topk = topk_idx.shape
    if topk > MAX_TOPK:
        raise ValueError(f"topk_idx: transport='nvlink' takes at most {MAX_TOPK} slots per token, got K={topk}")
    return num_tokens, topk


def unusable(group, num_experts: int) -> str | None:
    """Why the engine cannot serve ``group`` and ``num_experts`` here (None if it
    can): it needs an NCCL group of at most 32 ranks, all on one host with peer
    access between their GPUs, PyTorch's symmetric memory and CuPy, and E + W
    counts within one block's shared memory. On an NCCL group this is a
    collective (every rank must call it, and all get the same answer); on any
    other it answers at once."""
    world = dist.get_world_size(group)
    if num_experts > most_experts(world):  # the same on every rank: no collective needed
        return (f"takes at most {most_experts(world)} experts on {world} ranks (its routing layout counts them in "
                f"one block's shared memory), got num_experts={num_experts}")
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"needs an NCCL process group on CUDA devices, got backend {backend!r}"
    if world == 1:  # and no symmetric-memory rendezvous that its peers outside it would not make
        return "needs peers: the group has one rank"
    import socket

    device = torch.cuda.current_device()
    visible = {str(torch.cuda.get_device_properties(i).uuid): i for i in range(torch.cuda.device_count())}
    mine = (socket.gethostname(), str(torch.cuda.get_device_properties(device).uuid), cuda.available(),
            *_symmetric_memory(world == dist.get_world_size()))
    everyone: list = [None] * world
    dist.all_gather_object(everyone, mine, group=group)  # host sync: where every rank runs, what it has
    problem = None
    backends = [backend for *_, backend in everyone]
    if world > MAX_WORLD:
        problem = f"takes at most {MAX_WORLD} ranks, the group has {world}"
    elif not all(ok for _, _, ok, _, _ in everyone):
        problem = "needs CuPy on every rank (pip install 'moe-dispatch[cuda13]' or [cuda12])"
    elif not all(ok for _, _, _, ok, _ in everyone):
        problem = ("needs torch.distributed._symmetric_memory on every rank, and on NVSHMEM's backend (which a "
                   "transport='nvshmem' dispatcher sets for the process) the whole world as its group: NVSHMEM "
                   "allocates on every process of the job at once")
    elif len(set(backends)) > 1:
        problem = ("needs every rank's symmetric memory on one backend (torch fixes it per process), got "
                   + ", ".join(f"rank {r}: {b}" for r, b in enumerate(backends)))
    elif len({host for host, *_ in everyone}) > 1:
        problem = "every rank of the group must be on one host"
    elif len({uuid for _, uuid, *_ in everyone}) < world:
        problem = "every rank of the group must have a GPU of its own"
    # every rank sees every peer's GPU and can reach it (by UUID: device indices differ
    # between processes that see different devices)
    peers = [visible.get(uuid) for _, uuid, *_ in everyone]
    reachable = problem is None and all(
        d is not None and (d == device or torch.cuda.can_device_access_peer(device, d)) for d in peers)
    agreed = plan.to_device(torch.tensor([int(reachable)], dtype=torch.int32), torch.device("cuda", device))
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if problem is None and not agreed.item():  # host sync: every rank takes the same answer
        problem = "some GPUs of the group cannot reach each other (peer access, or not visible to every rank)"
    return problem


def _symmetric_memory(whole_world: bool) -> tuple[bool, str | None]:
    """(Whether symmetric memory is there for the engine, its backend in this
    process): on CUDA's backend, or on NVSHMEM's (torch fixes one per process at
    its first allocation: a ``transport="nvshmem"`` dispatcher's makes it
    NVSHMEM's) for a group of the whole world, whose every process allocates
    alike. Ranks on different backends could not open each other's buffers."""
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return False, None
    get_backend = getattr(symm_mem, "get_backend", None)
    backend = None if get_backend is None else get_backend(torch.device("cuda", torch.cuda.current_device()))
    return whole_world or backend != "NVSHMEM", backend
