"""The host-free half of the routing plan, replayed as CUDA graphs.

Before its host synchronisation, the plan in torch operations is some 140 small
kernels on ``[T, K]`` and ``[T, W]`` tensors. Each is microseconds of GPU work
but costs a kernel launch and the framework's per-op overhead on the host. For
one group on CUDA, the route and the counts row are one Triton kernel
(``dispatch.kernels.route_row``) and the send plan two
(``dispatch.kernels.send_plan``): about 35 kernels in all. Their shapes depend
only on (T, K, dtypes), so once a shape has been seen twice they are captured
as two CUDA graphs and replayed:

    graph 1: value checks (folded into the row) + the route + the row to all-gather
    (host)   all-gather the rows                           (eager: a collective)
    graph 2: the send plan + the summary the host needs

A shape seen once runs eagerly, so batches whose T keeps changing never pay for
a capture. Replays overwrite the graphs' buffers, so whatever outlives the call
(what a handle keeps, ``Kept``) is copied out by the caller, and a call's
replays wait for the reads of the call before (``CapturedPlan.release``),
whatever stream each ran on.
"""

from __future__ import annotations

import array
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dispatch import checks, plan
from dispatch.kernels import plan_cpu, route_row, send_plan

_FAILED, _HEADER_LEN = plan.HEADER.index("failed"), len(plan.HEADER)


@dataclass(frozen=True)
class PlanKey:
    num_tokens: int
    topk: int
    idx_dtype: torch.dtype
    weight_dtype: torch.dtype
    device: torch.device
    check_values: bool
    groups: int


@dataclass(frozen=True)
class Planned:
    """What the host-free half of the plan produces (eager or replayed)."""

    send: plan.SendPlan
    summary: torch.Tensor  # see ``plan_summary``
    table: torch.Tensor  # ``plan.recv_table`` of one group, [len(RECV_TABLE), W] (``plan.one_group_table``)


def route_phase(topk_idx, topk_weights, header_row, num_experts, world_size, check_values, groups=1):
    """Route, GroupRoute (None for one group), and the row to all-gather: the
    counts and header, then ``group_tail``. With ``check_values``, a bad value
    raises the header's failed entry in that row (``checks.fold_flags``, on the
    device: in graph 1 where it is replayed). For one group on CUDA, one Triton
    kernel (``dispatch.kernels.route_row``), on CPU one compiled call
    (``dispatch.kernels.plan_cpu``); else :func:`route_phase_reference`."""
    local = num_experts // world_size
    if groups == 1 and topk_idx.is_cuda and route_row.triton is not None:
        layout = counts_row(world_size, local)
        dest, hit, row = route_row.route_row_triton(topk_idx, topk_weights, header_row, num_experts, world_size,
                                                    check_values, layout.width, layout.header_at,
                                                    layout.header_at + plan.HEADER.index("failed"))
    elif groups == 1 and (compiled := plan_cpu.on_cpu(topk_idx)) is not None:
        dest, hit, row = compiled.route_row(topk_idx, topk_weights, header_row, num_experts, world_size, check_values,
                                            _FAILED)
    else:
        return route_phase_reference(topk_idx, topk_weights, header_row, num_experts, world_size, check_values, groups)
    return plan.Route(dest=dest, hit=hit, counts=row[: world_size * (1 + local)].view(world_size, 1 + local)), None, row


def route_phase_reference(topk_idx, topk_weights, header_row, num_experts, world_size, check_values, groups=1):
    """:func:`route_phase` in torch operations (any device, any G)."""
    if check_values:
        header_row = checks.fold_flags(header_row, checks.value_flags(topk_idx, topk_weights, num_experts))
    route = plan.route(topk_idx, num_experts, world_size)
    grouped = plan.group_route(route, topk_idx, groups) if groups > 1 else None
    world, local = route.hit.shape[1], route.counts.shape[1] - 1
    return route, grouped, counts_row(world, local).row(route.counts, header_row, group_tail(route, grouped, groups))


def counts_row(world: int, local: int) -> plan.CountsRow:
    """The row the alltoall transport all-gathers: counts, header, ``group_tail``."""
    return plan.CountsRow(world, local, world * 2 * local + 1)


def group_tail(route: plan.Route, grouped: "plan.GroupRoute | None", groups: int) -> torch.Tensor:
    """[W * 2 * E_local + 1] int64: the rows to each rank by first and last
    group (``GroupRoute.counts``; zeros for one group), then G. Its width does
    not depend on G, so that ranks that disagree on G are told so by the
    counts exchange itself."""
    world, local = route.hit.shape[1], route.counts.shape[1] - 1
    counts = route.counts.new_zeros(world * 2 * local) if grouped is None else grouped.counts.flatten()
    return torch.cat([counts, route.counts.new_full((1,), groups)])


def send_phase(route, grouped, gathered, rank, topk_idx, topk_weights, groups: int = 1) -> Planned:
    """The send plan, the summary the host reads and the receive table of one
    group, from the all-gathered rows: for one group on CUDA two Triton kernels
    (``dispatch.kernels.send_plan``) and torch operations, on CPU one compiled
    call (``dispatch.kernels.plan_cpu``); else torch operations. ``groups``:
    this rank's G (the last entry of its row; sent in one order, ``grouped``
    is None whatever G)."""
    if grouped is None and (compiled := plan_cpu.on_cpu(gathered)) is not None:
        *send, summary, table = compiled.send_plan(route.dest, route.hit, gathered, rank, topk_idx, topk_weights,
                                                   _HEADER_LEN)
        return Planned(plan.SendPlan(*send), summary, table)
    all_counts, headers, tails = counts_row(gathered.shape[0], route.counts.shape[1] - 1).split(gathered)
    hit, dest = route.hit, route.dest
    if (grouped is None and hit.is_cuda and send_plan.triton is not None  # one group on CUDA: two kernels
            and send_plan.fits(hit.shape[0], dest.shape[1], all_counts.shape[0] * (all_counts.shape[2] - 1))):
        send = plan.SendPlan(*send_plan.send_plan_triton(route.hit, route.dest, route.counts[:, 0], all_counts, rank,
                                                         topk_idx, topk_weights))
    else:
        send = plan.build_send_plan(route, all_counts, rank, topk_idx, topk_weights, grouped)
    return Planned(send, plan_summary(route.counts, all_counts, headers, rank, tails, groups),
                   plan.one_group_table(all_counts[:, rank, 0]))


def plan_summary(counts: torch.Tensor, all_counts: torch.Tensor, headers: torch.Tensor, rank: int,
                 tails: torch.Tensor, groups: int = 1) -> torch.Tensor:
    """[2 W + E_local + W * len(HEADER) + W W + W + 4 W E_local + W + W] int64:
    rows sent to each rank, rows received from each rank, expanded rows per
    local expert; every rank's header; the rows every rank sends to every rank
    ([W_src, W_dst], whose columns say which ranks get rows); every rank's N;
    from the group tails (``group_tail``), this rank's rows to each rank by
    first and last group, every rank's rows to this one so, and every rank's G;
    every rank's rows in its fullest group of local experts by this rank's G
    (``groups``, the last entry of its tail; ``plan.expert_groups``; N for one
    group). The one tensor the host needs."""
    world, local = all_counts.shape[0], all_counts.shape[2] - 1
    recv_counts = all_counts[:, rank]  # [W_src, 1 + E_local]
    mine = torch.cat([counts[:, 0], recv_counts[:, 0], recv_counts[:, 1:].sum(0)])
    by_group = tails[:, :-1].view(world, world, -1)  # [W_src, W_dst, 2 E_local]
    per_expert = all_counts[:, :, 1:].sum(0)  # [W_dst, E_local]
    received = per_expert.sum(1)
    fullest = received
    if groups > 1:
        group_of = ((torch.arange(local, device=per_expert.device) + 1) * groups - 1) // local
        fullest = per_expert.new_zeros(world, groups).index_add_(1, group_of, per_expert).amax(1)
    return torch.cat([mine, headers.flatten(), all_counts[:, :, 0].flatten(), received,
                      by_group[rank].flatten(), by_group[:, rank].flatten(), tails[:, -1], fullest])


@dataclass(frozen=True)
class Summary:
    """A :func:`plan_summary` read on the host, by part (the one place that knows
    its layout).

    Attributes:
        send, recv: [W] rows this rank sends to / receives from each rank.
        per_expert: [E_local] expanded rows per local expert.
        headers: [W, len(HEADER)] every rank's header.
        matrix: [W_src, W_dst] the rows every rank sends every rank.
        received: [W] every rank's N.
        by_group: [2, W, 2, E_local] this rank's rows to each rank, then every
            rank's rows to this one, by first and last group.
        groups: [W] every rank's G.
        fullest: [W] every rank's rows in its fullest group (by this rank's G).
    """

    send: torch.Tensor
    recv: torch.Tensor
    per_expert: torch.Tensor
    headers: torch.Tensor
    matrix: torch.Tensor
    received: torch.Tensor
    by_group: torch.Tensor
    groups: torch.Tensor
    fullest: torch.Tensor

    @staticmethod
    def per_expert_of(summary: torch.Tensor, world: int, local: int) -> torch.Tensor:
        """The ``per_expert`` part of a summary (on its device)."""
        return summary[2 * world : 2 * world + local]

    @staticmethod
    def sizes(world: int, local: int) -> tuple[int, ...]:
        """The entries of each part, in order."""
        return (world, world, local, world * len(plan.HEADER), world * world, world, 4 * world * local, world, world)

    @classmethod
    def width(cls, world: int, local: int) -> int:
        """The entries of a summary."""
        return sum(cls.sizes(world, local))

    @classmethod
    def read(cls, summary: torch.Tensor, world: int, local: int) -> "Summary":
        sizes = cls.sizes(world, local)
        send, recv, per_expert, headers, matrix, received, by_group, groups, fullest = summary.split(sizes)
        return cls(send, recv, per_expert, headers.view(world, -1), matrix.view(world, world), received,
                   by_group.view(2, world, 2, local), groups, fullest)


@dataclass(frozen=True)
class HostSummary:
    """A :func:`plan_summary` read on the host in one read, as Python ints by part
    (the parts of :class:`Summary`; ``by_group`` flat, [2 W 2 E_local] in order):
    what a plan's host path reads, with no tensor operation per part.

    Attributes:
        send, recv: [W] each; per_expert: [E_local]; headers: [W][len(HEADER)];
        matrix: [W_src][W_dst]; received: [W]; by_group: flat; groups: [W];
        fullest: [W].
    """

    send: tuple[int, ...]
    recv: tuple[int, ...]
    per_expert: list[int]
    headers: list[list[int]]
    matrix: list[list[int]]
    received: list[int]
    by_group: list[int]
    groups: list[int]
    fullest: list[int]

    @classmethod
    def read(cls, summary: torch.Tensor, world: int, local: int) -> "HostSummary":
        """Read ``summary`` (on its device: the host read of a plan) into its parts."""
        flat, width = summary.tolist(), len(plan.HEADER)
        at = 2 * world + local  # the parts' starts, in the order of Summary.sizes
        headers, matrix = at, at + world * width
        received = matrix + world * world
        by_group = received + world
        groups = by_group + 4 * world * local
        fullest = groups + world
        cut = flat.__getitem__  # (the W rows of a part, each its slice: by map, no call per row)
        return cls(tuple(flat[:world]), tuple(flat[world : 2 * world]), flat[2 * world : at],
                   list(map(cut, map(slice, range(headers, matrix, width), range(headers + width, matrix + 1, width)))),
                   list(map(cut, map(slice, range(matrix, received, world), range(matrix + world, received + 1, world)))),
                   flat[received:by_group], flat[by_group:groups], flat[groups:fullest], flat[fullest:])

    @property
    def has_rows(self) -> tuple[bool, ...]:
        """Whether each rank receives rows (a column of ``matrix`` not all zero)."""
        return tuple(map(any, zip(*self.matrix)))

    def per_expert_host(self) -> torch.Tensor:
        """``per_expert`` as a host int64 tensor (``tokens_per_expert_host``)."""
        return torch.frombuffer(array.array("q", self.per_expert), dtype=torch.int64)

    def by_group_tensor(self, world: int, local: int) -> torch.Tensor:
        """``by_group`` as [2, W, 2, E_local] on the host."""
        return torch.tensor(self.by_group, dtype=torch.int64).view(2, world, 2, local)


class Kept(NamedTuple):
    """What an exchange's handle keeps of its plan (``SendPlan``'s send_token,
    home_index, slot_row and slot_col; the rows per local expert): int64
    tensors, all of them."""

    send_token: torch.Tensor
    home_index: torch.Tensor
    slot_row: torch.Tensor
    slot_col: torch.Tensor
    per_expert: torch.Tensor

    @classmethod
    def of(cls, planned: Planned, world: int, local: int) -> "Kept":
        """The parts themselves, of a plan that was not replayed (nothing overwrites them)."""
        send = planned.send
        return cls(send.send_token, send.home_index, send.slot_row, send.slot_col,
                   planned.summary[2 * world : 2 * world + local])  # (Summary.per_expert_of)


class CapturedPlan:
    """Graphs 1 and 2 for one :class:`PlanKey`, with their static buffers."""

    def __init__(self, key: PlanKey, num_experts: int, world_size: int, rank: int) -> None:
        self.key, self.rank = key, rank
        device = key.device
        self.topk_idx = torch.zeros(key.num_tokens, key.topk, dtype=key.idx_dtype, device=device)
        self.topk_weights = torch.zeros(key.num_tokens, key.topk, dtype=key.weight_dtype, device=device)
        self.header_row = torch.zeros(len(plan.HEADER), dtype=torch.int64, device=device)
        local = num_experts // world_size
        self.gathered = torch.zeros(world_size, counts_row(world_size, local).width, dtype=torch.int64, device=device)

        def first():
            return route_phase(
                self.topk_idx, self.topk_weights, self.header_row, num_experts, world_size, key.check_values,
                key.groups,
            )

        def second(route, grouped):
            return send_phase(route, grouped, self.gathered, rank, self.topk_idx, self.topk_weights, key.groups)

        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            second(*first()[:2])  # warm-up outside capture (allocator, library handles)
            # capture_begin/end directly: torch.cuda.graph() would also synchronise
            # the device and empty the allocator's cache on every capture.
            self.graph1, self.graph2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            self.graph1.capture_begin(capture_error_mode="thread_local")
            try:
                route, grouped, self.row = first()
            finally:
                self.graph1.capture_end()
            self.graph2.capture_begin(pool=self.graph1.pool(), capture_error_mode="thread_local")
            try:
                self.planned = second(route, grouped)
                # what outlives a replay, in one buffer: one copy of it per call (``kept``)
                self._kept = torch.cat([part.flatten() for part in Kept.of(self.planned, world_size, local)])
            finally:
                self.graph2.capture_end()
        current.wait_stream(side)
        self._released: torch.cuda.Event | None = None  # recorded after a call's last read of the buffers
        self._kept_shapes = tuple(part.shape for part in Kept.of(self.planned, world_size, local))
        self._kept_sizes = [math.prod(shape) for shape in self._kept_shapes]

    def run_route(self, topk_idx, topk_weights, header: torch.Tensor):
        """Replay graph 1 on new inputs (``header``: this rank's ``plan.header``
        on the host): the row to all-gather. It waits for the reads of the
        call before (:meth:`release`), on whatever stream they were queued."""
        if self._released is not None:
            torch.cuda.current_stream(self.key.device).wait_event(self._released)
        self.topk_idx.copy_(topk_idx)
        self.topk_weights.copy_(topk_weights)
        plan.to_device(header, self.header_row.device, out=self.header_row)
        self.graph1.replay()
        return self.row

    def run_send(self) -> Planned:
        """Replay graph 2 once ``self.gathered`` holds the all-gathered rows."""
        self.graph2.replay()
        return self.planned

    def release(self) -> None:
        """Mark that the call's reads of the buffers are queued, on the current
        stream: the next call's replays come after them."""
        if self._released is None:
            self._released = torch.cuda.Event()
        self._released.record(torch.cuda.current_stream(self.key.device))

    def kept(self) -> "Kept":
        """A copy of what the caller keeps of this call's replays (:class:`Kept`),
        which the next replay overwrites: one copy, its parts views of it."""
        parts = self._kept.clone().split(self._kept_sizes)
        return Kept(*(part.view(shape) for part, shape in zip(parts, self._kept_shapes)))


class PlanGraphCache:
    """Captured plans of the ``capacity`` most recent shapes seen at least twice."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[PlanKey, CapturedPlan | None] = OrderedDict()

    def get(self, key: PlanKey, num_experts: int, world_size: int, rank: int) -> CapturedPlan | None:
        """The captured plan for ``key``; None the first time a shape is seen."""
        seen = key in self._plans
        captured = self._plans.pop(key, None)
        if seen and captured is None:
            captured = CapturedPlan(key, num_experts, world_size, rank)
        self._plans[key] = captured
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return captured
