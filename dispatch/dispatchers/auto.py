"""The ``auto`` variant: picks alltoall, allgather or hierarchical for each call.

Per call, one all-gather of the routing statistics (the counts exchange of
``dispatch.counts``, with the value checks before it and the peers' header
check after it) gives every rank the same global figures; the cost model of
``dispatch.cost_model`` turns them into a modelled time per variant with the
``DispatchConfig.link_model`` bandwidths and latencies, and the cheapest wins
(ties: alltoall, then allgather, then hierarchical). Every rank computes the
same figures from the same data, so all ranks make the same choice and the same
collectives. The choice costs one small all-gather and one host sync per call
on top of the chosen variant's own plan (whose value checks are then skipped:
they were made here).

The choice is ``Dispatched.handle.owner.config.variant``, ``last_choice`` and
``last_costs`` (modelled seconds per variant, for the latest call), and is logged
at debug level on the ``dispatch.dispatchers.auto`` logger. hierarchical is a
candidate only when there are several nodes of several ranks (otherwise it moves
what alltoall moves).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from dispatch import counts, plan
from dispatch.codec import sum_wire_dtype, to_experts_codec
from dispatch.cost_model import LinkModel, estimate
from dispatch.dispatchers.allgather import AllGatherDispatcher
from dispatch.dispatchers.alltoall import AllToAllDispatcher
from dispatch.dispatchers.base import CombineHandle, TokenDispatcher
from dispatch.dispatchers.hierarchical import HierarchicalDispatcher
from dispatch.stats import resolve_local_world_size

log = logging.getLogger(__name__)


class AutoDispatcher(TokenDispatcher):
    """Cost-model choice among the variants (``variant="auto"``).

    Attributes:
        variants: {name: dispatcher} the candidates, built over the same group.
        link_model: the :class:`dispatch.cost_model.LinkModel` in use.
        last_choice: name of the variant the latest dispatch used (None before any).
        last_costs: {name: modelled seconds} of the latest dispatch.
    """

    def __init__(self, config, group=None) -> None:
        self.variants: dict[str, TokenDispatcher] = {}
        super().__init__(config, group)
        self.local_world_size = resolve_local_world_size(config.local_world_size, self.world_size)
        self.link_model = config.link_model or LinkModel()
        inner = dataclasses.replace(config, check_inputs=False)  # checked here, before the choice
        classes = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}
        if 1 < self.local_world_size < self.world_size:
            classes["hierarchical"] = HierarchicalDispatcher
        for name, cls in classes.items():
            self.variants[name] = cls(dataclasses.replace(inner, variant=name), group)
            self.variants[name].phase_timer = self.phase_timer
        self.last_choice: str | None = None
        self.last_costs: dict[str, float] = {}

    @property
    def phase_timer(self):
        return self._phase_timer

    @phase_timer.setter
    def phase_timer(self, timer) -> None:
        self._phase_timer = timer
        for variant in self.variants.values():
            variant.phase_timer = timer

    def choose(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
               ticket: plan.Ticket = plan.Ticket()) -> TokenDispatcher:
        """The variant for this call (a collective: every rank must call it alike).

        Args: as :meth:`dispatch` (already checked for shapes, dtypes and devices);
            ``ticket``: the call (``plan.Ticket``), carried in the counts exchange.
        """
        gc = counts.exchange(
            x,
            topk_idx,
            topk_weights,
            self.config.num_experts,
            self.local_world_size,
            self.group,
            self.world_size,
            self.config.check_inputs,
            self._arrivals,
            ticket,
        )
        hidden = x.shape[1]
        costs = estimate(
            gc.routing_stats(),
            self.local_world_size,
            to_experts_codec(self.config.dispatch_wire, x.dtype).row_bytes(hidden),
            sum_wire_dtype(self.config.combine_wire, x.dtype),
            hidden,
            self.link_model,
        )
        costs = {name: costs[name] for name in self.variants}
        choice = min(costs, key=costs.get)  # first of equals: dict order
        self.last_choice, self.last_costs = choice, costs
        log.debug("auto: %s (modelled ms: %s)", choice, {k: round(v * 1e3, 4) for k, v in costs.items()})
        return self.variants[choice]

    def _counts_row_width(self) -> int:
        return counts.row_width(self.world_size, self.num_local_experts, self.local_world_size)

    def _made(self, handle: CombineHandle) -> bool:
        return any(handle.owner is v for v in self.variants.values())

    # The plan chooses; the data movements go to the variant that made the handle.
    def _plan(self, x, topk_idx, topk_weights, check_values, ticket):
        return self.choose(x, topk_idx, topk_weights, ticket)._plan(x, topk_idx, topk_weights, False, ticket)

    def _to_experts(self, rows, handle, codec):
        return handle.owner._to_experts(rows, handle, codec)

    def _to_home(self, rows, handle, weights, wire):
        return handle.owner._to_home(rows, handle, weights, wire)

    def _weights_to_home(self, values, handle):
        return handle.owner._weights_to_home(values, handle)

    def _to_experts_start(self, rows, handle, codec):
        return handle.owner._to_experts_start(rows, handle, codec)

    def _to_home_start(self, rows, handle, weights, wire):
        return handle.owner._to_home_start(rows, handle, weights, wire)

    def _weights_to_home_start(self, values, handle):
        return handle.owner._weights_to_home_start(values, handle)

    def _plan_groups(self, x, topk_idx, topk_weights, check_values, ticket, groups):
        chosen = self.choose(x, topk_idx, topk_weights, ticket)
        return chosen._plan_groups(x, topk_idx, topk_weights, False, ticket, groups)

    def _to_experts_groups_start(self, rows, handle, codec, own):
        return handle.owner._to_experts_groups_start(rows, handle, codec, own)

    def _group_sums(self, handle, wire, dtype):
        return handle.owner._group_sums(handle, wire, dtype)

    def _stats(self, handle, dispatch_row_bytes, combine_wire, hidden):
        return handle.owner._stats(handle, dispatch_row_bytes, combine_wire, hidden)
