"""The host-free half of the routing plan, replayed as CUDA graphs.

Before its one host synchronisation, the plan is some sixty small kernels on
``[T, K]`` and ``[T, W]`` tensors. Each is microseconds of GPU work but costs
a kernel launch and the framework's per-op overhead on the host, which is what
the plan's time was made of (about 2.5 ms for the DeepSeek-V3 shape on H200).
Their shapes depend only on (T, K, dtypes), so they are captured once per shape
as two CUDA graphs and replayed:

    graph 1: value checks' flags + ``plan.route``        (input: topk_idx, topk_weights)
    (host)   raise on bad values; all-gather the counts   (eager: a collective)
    graph 2: ``plan.build_send_plan`` + the split summary (input: the gathered counts)

Replays overwrite the graphs' buffers, so whatever outlives the call (what a
handle keeps) is copied out by the caller.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from dispatch import checks, plan


@dataclass(frozen=True)
class PlanKey:
    num_tokens: int
    topk: int
    idx_dtype: torch.dtype
    weight_dtype: torch.dtype
    device: torch.device
    check_values: bool


class CapturedPlan:
    """Graphs 1 and 2 for one :class:`PlanKey`, with their static buffers."""

    def __init__(self, key: PlanKey, num_experts: int, world_size: int, rank: int) -> None:
        self.key = key
        self.num_experts, self.world_size, self.rank = num_experts, world_size, rank
        device = key.device
        self.topk_idx = torch.zeros(key.num_tokens, key.topk, dtype=key.idx_dtype, device=device)
        self.topk_weights = torch.zeros(key.num_tokens, key.topk, dtype=key.weight_dtype, device=device)
        per_rank = num_experts // world_size
        self.all_counts = torch.zeros(world_size, world_size, 1 + per_rank, dtype=torch.int64, device=device)

        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside capture (allocator, library handles)
            flags, route = self._first()
            self._second(route)
        torch.cuda.current_stream(device).wait_stream(side)

        self.graph1, self.graph2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph1):
            self.flags, self.route = self._first()
        with torch.cuda.graph(self.graph2, pool=self.graph1.pool()):
            self.send, self.summary = self._second(self.route)

    def _first(self):
        flags = None
        if self.key.check_values:
            flags = checks.value_flags(self.topk_idx, self.topk_weights, self.num_experts)
        return flags, plan.route(self.topk_idx, self.num_experts, self.world_size)

    def _second(self, route: plan.Route):
        send = plan.build_send_plan(route, self.all_counts, self.rank, self.topk_idx, self.topk_weights)
        return send, plan_summary(route, self.all_counts, self.rank)

    def route_phase(self, topk_idx: torch.Tensor, topk_weights: torch.Tensor):
        """Replay graph 1 on new inputs; returns (flags or None, Route) in static buffers."""
        self.topk_idx.copy_(topk_idx)
        self.topk_weights.copy_(topk_weights)
        self.graph1.replay()
        return self.flags, self.route

    def send_phase(self) -> tuple[plan.SendPlan, torch.Tensor]:
        """Replay graph 2 once ``all_counts`` holds the gathered counts."""
        self.graph2.replay()
        return self.send, self.summary


def plan_summary(route: plan.Route, all_counts: torch.Tensor, rank: int) -> torch.Tensor:
    """[2 W + E_local] int64: rows sent to each rank, rows received from each rank,
    expanded rows per local expert. The one tensor the host needs."""
    recv_counts = all_counts[:, rank]
    return torch.cat([route.counts[:, 0], recv_counts[:, 0], recv_counts[:, 1:].sum(0)])


class PlanGraphCache:
    """Least-recently-used :class:`CapturedPlan` per shape (``capacity`` shapes kept)."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._plans: OrderedDict[PlanKey, CapturedPlan] = OrderedDict()

    def get(self, key: PlanKey, num_experts: int, world_size: int, rank: int) -> CapturedPlan:
        captured = self._plans.pop(key, None)
        if captured is None:
            captured = CapturedPlan(key, num_experts, world_size, rank)
            if len(self._plans) >= self.capacity:
                self._plans.popitem(last=False)
        self._plans[key] = captured
        return captured
