"""``variant="auto"`` among the NCCL transports: alltoall, allgather or hierarchical.

Where every rank shares a host and the NVLink engine can run, the registry
(``dispatch.transports.build``) gives ``auto`` the engine itself: it is faster
than every collective variant at every shape measured (``bench/results``).
Elsewhere this transport chooses among the collective variants with the cost
model of ``dispatch.cost_model``: at the first dispatch, and again every
:data:`RECHOOSE` dispatches (the call numbers are agreed by every rank, so
every rank re-chooses at the same call), one all-gather of the routing
statistics (``dispatch.counts``) gives every rank the same figures, which the
``Tuning.link_model`` bandwidths and latencies turn into a modelled
time per variant; the cheapest wins (ties: alltoall, then allgather, then
hierarchical). The calls between pay nothing for the choice.

The choice is ``Dispatched.handle.transport`` (its ``variant``), ``last_choice``
and ``last_costs`` (modelled seconds per variant), and is logged at debug level
on this module's logger. hierarchical is a candidate only where there are
several nodes of several ranks (otherwise it moves what alltoall moves).
"""

from __future__ import annotations

import dataclasses
import logging

from dispatch import counts
from dispatch.agreement import CALL_WRAP
from dispatch.codec import sum_wire_dtype, to_experts_codec
from dispatch.cost_model import LinkModel, estimate
from dispatch.transports.allgather import AllGatherTransport
from dispatch.transports.alltoall import AllToAllTransport
from dispatch.transports.base import Request, Transport
from dispatch.transports.hierarchical import HierarchicalTransport

log = logging.getLogger(__name__)

RECHOOSE = 64  # dispatches between two choices


class AutoTransport(Transport):
    """Cost-model choice among the collective variants (see the module doc).

    Attributes:
        candidates: {variant: transport}, built over the same group.
        link_model: the :class:`dispatch.cost_model.LinkModel` in use.
        last_choice: the variant of the latest choice (None before any).
        last_costs: {variant: modelled seconds} of the latest choice.
    """

    variant = "auto"

    def __init__(self, config, group=None) -> None:
        super().__init__(config, group)
        self.link_model = config.tuning.link_model or LinkModel()
        inner = config  # (the values are checked by the choice's exchange, or by the plan between choices)
        classes = {"alltoall": AllToAllTransport, "allgather": AllGatherTransport}
        if 1 < self.local_world_size < self.world_size:
            classes["hierarchical"] = HierarchicalTransport
        self.candidates: dict[str, Transport] = {
            name: cls(dataclasses.replace(inner, variant=name), group) for name, cls in classes.items()}
        self.last_choice: str | None = None
        self.last_costs: dict[str, float] = {}
        self._chosen_at = -RECHOOSE

    def members(self) -> tuple[Transport, ...]:
        return tuple(self.candidates.values())

    def plan(self, request: Request):
        call = request.ticket.call
        if self.last_choice is None or (call - self._chosen_at) % CALL_WRAP >= RECHOOSE:  # the same call on every rank
            self._choose(request)
            self._chosen_at = call
            request = dataclasses.replace(request, check_values=False)  # checked by the choice's exchange
        return self.candidates[self.last_choice].plan(request)

    def _choose(self, request: Request) -> None:
        """The variant for this and the next dispatches (a collective: every
        rank chooses at the same call, from the same all-gathered figures)."""
        x = request.x
        gc = counts.exchange(x, request.topk_idx, request.topk_weights, self.config.num_experts,
                             self.local_world_size, self.group, self.world_size, self.rank, request.check_values,
                             self.arrivals, request.ticket, exact_memory_rows=request.exact_memory_rows,
                             groups=request.groups)
        hidden = x.shape[1]
        costs = estimate(gc.routing_stats(), self.local_world_size,
                         to_experts_codec(self.config.dispatch_wire, x.dtype).row_bytes(hidden),
                         sum_wire_dtype(self.config.combine_wire, x.dtype), hidden, self.link_model)
        costs = {name: costs[name] for name in self.candidates}
        self.last_choice = min(costs, key=costs.get)  # first of equals: dict order
        self.last_costs = costs
        log.debug("auto: %s (modelled ms: %s)", self.last_choice, {k: round(v * 1e3, 4) for k, v in costs.items()})
