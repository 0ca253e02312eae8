"""``MegatronDispatcher``: Megatron-Core's ``MoETokenDispatcher`` interface over
the dispatch engine (the contract is in ``dispatch.integrations.megatron``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import weakref
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

import dispatch
from dispatch import comm
from dispatch.config import DispatchConfig, Tuning
from dispatch.integrations import megatron_settings as settings
from dispatch.integrations import megatron_tp as expert_tp
from dispatch.integrations.megatron_moe import ExpertsByGroup, idle, pad_routing_map, routing_to_topk, users_stage

# DispatchConfig fields a user may set; num_experts comes from Megatron's config.
# token dropping is Megatron's router's (moe_expert_capacity_factor), not the engine's here
ENGINE_OPTIONS = tuple(f.name for f in (*dataclasses.fields(DispatchConfig), *dataclasses.fields(Tuning))
                       if f.name not in ("num_experts", "capacity_factor", "drop_policy", "pad_to_capacity", "tuning"))


STAGES = (
    "dispatch_preprocess",
    "token_dispatch",
    "dispatch_postprocess",
    "combine_preprocess",
    "token_combine",
    "combine_postprocess",
)


@dataclass(frozen=True)
class _InFlight:
    """One round trip between the stages (Megatron's stages take no handle), from
    ``token_dispatch`` on (``dispatch_preprocess`` leaves its routing on the object).

    Attributes:
        next_stage: index in ``STAGES`` of the stage that may run next.
        hidden_shape: shape of the layer's ``hidden_states``, restored at the end.
        dispatched: the engine's dispatch results, one per group of local experts
            (``MegatronDispatcher.expert_groups``; one where a single dispatch
            moves every slot), in expert order.
        counts: ``[E_local]`` int64 on the CPU, rows per local expert (from the
            engine's host read, or fixed by the capacity when graphs hold every stage).
        tp_rows: the rows of the expert-TP group, once ``dispatch_postprocess`` ran
            (expert tensor parallelism only).
        routing: by groups of local experts (``install(overlap=...)``): ``(topk_idx,
            too_many)`` of ``dispatch_preprocess``, for ``experts_by_groups``, which
            moves the rows (``dispatched`` and ``counts`` are then empty).
    """

    next_stage: int
    hidden_shape: torch.Size
    dispatched: tuple[dispatch.Dispatched, ...]
    counts: torch.Tensor | None
    tp_rows: "expert_tp.TensorParallelRows | None" = None
    routing: tuple | None = None


def group_size(group) -> int:
    """Ranks in ``group``; None counts as no group (one rank)."""
    return 1 if group is None else dist.get_world_size(group)


class MegatronDispatcher:
    """Megatron-Core's ``MoETokenDispatcher`` interface over the dispatch engine.

    Args:
        num_local_experts: ``E_local``; must be ``E // W``.
        local_expert_indices: this rank's global expert ids, which must be
            ``[r*E_local, (r+1)*E_local)`` for EP rank ``r`` (the engine's placement,
            and Megatron's).
        config: Megatron's ``TransformerConfig`` (read: ``num_moe_experts``,
            ``moe_router_topk`` and the settings listed as refused in the module
            docstring; any object with these attributes will do).
        pg_collection: Megatron's ``ProcessGroupCollection``; ``ep`` is the EP group
            (None: the default world), ``expt_tp`` the expert tensor parallel group
            (None: none; see the module's "Expert tensor parallelism").
        options: the engine's options (``ENGINE_OPTIONS``: fields of
            :class:`dispatch.DispatchConfig` and :class:`dispatch.Tuning`, but
            ``num_experts`` and token dropping: ``variant``, ``dispatch_wire``, ...).
    Raises:
        ValueError / TypeError naming the setting, before any communication (but what
        depends on the engine, known once it is made: on every rank alike), for what
        is not supported or does not fit the group.

    One round trip is in flight at a time, as with Megatron's own dispatchers: the
    stages carry their state on the object.
    """

    def __init__(
        self,
        num_local_experts: int,
        local_expert_indices: list[int],
        config,
        pg_collection=None,
        *,
        options: Mapping | None = None,
    ) -> None:
        options = dict(options or {})
        unknown = sorted(set(options) - set(ENGINE_OPTIONS))
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; the options are {', '.join(ENGINE_OPTIONS)}"
                + (" (num_experts comes from config.num_moe_experts)" if "num_experts" in unknown else "")
            )
        num_experts = getattr(config, "num_moe_experts", None)
        topk = getattr(config, "moe_router_topk", None)
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"config.num_moe_experts must be a positive int, got {num_experts!r}")
        if not isinstance(topk, int) or not 1 <= topk <= num_experts:
            raise ValueError(f"config.moe_router_topk must be an int in [1, {num_experts}], got {topk!r}")
        problems = settings.refusals(config)
        expt_tp = getattr(pg_collection, "expt_tp", None)
        if problems:
            raise ValueError("MegatronDispatcher does not support: " + "; ".join(problems))
        capture = settings.capture(config)

        self.config = config
        self.ep_group = getattr(pg_collection, "ep", None)
        self.tp_group = expt_tp
        self.tp_ep_group = getattr(pg_collection, "tp_ep", None)
        self.ep_size = dist.get_world_size(self.ep_group)  # None: the default world
        self.ep_rank = dist.get_rank(self.ep_group)
        self.tp_size = group_size(expt_tp)
        self.tp_rank = 0 if expt_tp is None else dist.get_rank(expt_tp)
        if num_experts % self.ep_size:
            raise ValueError(f"config.num_moe_experts={num_experts} is not a multiple of the EP group size {self.ep_size}")
        per_rank = num_experts // self.ep_size
        expected = list(range(self.ep_rank * per_rank, (self.ep_rank + 1) * per_rank))
        if num_local_experts != per_rank:
            raise ValueError(f"num_local_experts={num_local_experts}, expected E // W = {per_rank}")
        if list(local_expert_indices) != expected:
            raise ValueError(
                f"local_expert_indices must be {expected[0]}..{expected[-1]} on EP rank {self.ep_rank}, "
                f"got {list(local_expert_indices)}"
            )
        self.num_experts = num_experts
        self.num_local_experts = num_local_experts
        self.pad_to_capacity = bool(getattr(config, "moe_pad_expert_input_to_capacity", False))
        self.quantization_multiple = settings.quantization_multiple(config)
        # Megatron's EP-communication overlap (combined 1F1B) runs the stages as separate
        # autograd graphs and frees each node's inputs after its forward
        self.split_nodes = bool(getattr(config, "overlap_moe_expert_parallel_comm", False))
        self.local_expert_indices = expected
        self.topk = topk
        self.engine = dispatch.create(DispatchConfig.from_options(num_experts=num_experts, **options), self.ep_group)
        problems = settings.engine_refusals(config, self.engine)
        if problems:  # the same on every rank: all refuse alike
            raise ValueError("MegatronDispatcher does not support: " + "; ".join(problems))
        # Every stage inside CUDA graphs: fixed rows per expert, nothing read on the host.
        self.fixed_rows = capture == "all"
        # Padded, a token may name every expert, and the engine moves at most max_topk slots a
        # token: past that, one dispatch per group of local experts (max_topk // W of each rank's,
        # so a group's slots fit), their rows one after another in expert order.
        limit = self.engine.max_topk
        self.expert_groups = None
        if (self.pad_to_capacity or self.quantization_multiple) and limit is not None and num_experts > limit:
            size = limit // self.ep_size  # >= 1: engine_refusals refuses an EP group wider than the limit
            self.expert_groups = tuple((lo, min(lo + size, per_rank)) for lo in range(0, per_rank, size))
        # Megatron's local moe_preprocess graphs capture the layer's postprocess alone
        self.postprocess_alone = capture == "preprocess" and getattr(config, "cuda_graph_impl", None) == "local"
        self.capacity_factor = getattr(config, "moe_expert_capacity_factor", None)
        self._reserved = False  # whether the engine was made room for this dispatcher's rows
        self._fixed_tp_rows: dict = {}  # fixed counts -> the expert-TP group's rows (laid out once)
        # the expert-TP group's gathers of its counts (eager, with a host read) wait within the engine's timeout,
        # naming a rank that never comes (a peer whose EP group's dispatch raised)
        self._tp_arrivals = (comm.Arrivals(self.tp_group, self.engine.config.timeout, role="expert-tp")
                             if self.tp_size > 1 else None)
        # Attributes Megatron's MoELayer and TransformerLayer read on any dispatcher. With
        # dispatch_preprocess inside a graph (moe_preprocess), Megatron returns the tensors
        # named in cudagraph_attrs from the graph and sets them again after each replay.
        self.shared_experts = None
        self.cudagraph_attrs: list[str] = ["topk_idx"]
        self.valid_cudagraph_attrs = None
        self.topk_idx: torch.Tensor | None = None  # dispatch_preprocess -> token_dispatch
        # (topk_idx, whether a row of it named more than top-k): set where checked (eagerly)
        self._too_many: tuple[torch.Tensor, torch.Tensor] | None = None
        self.hidden_shape: torch.Size | None = None
        self._in_flight: _InFlight | None = None
        # install(overlap=...): the layer's exchange and experts by groups of local experts
        self.exchange: "dispatch.MoEExchange | None" = None

    # -- what Megatron reads besides the stages --------------------------------

    def set_shared_experts(self, shared_experts) -> None:
        """Run Megatron's shared experts (a ``SharedExpertMLP``) beside the exchange
        (``moe_shared_expert_overlap``; see the module's "Shared experts beside the
        exchange")."""
        self.shared_experts = shared_experts
        # dispatch_preprocess sets these on them (pre_forward_comm), inside moe_preprocess graphs
        if getattr(shared_experts, "use_shared_expert_gate", False):
            self.cudagraph_attrs.append("shared_experts.gate_score")
        self.cudagraph_attrs.append("shared_experts.cached_fc1_input")

    def get_expert_zero_copy_buffers(self):
        """No zero-copy buffers: the experts allocate their outputs."""
        return None, None

    # -- the six stages ------------------------------------------------------

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """Routing to top-k form; no communication, but with padding (to capacity or
        for quantization): there the EP group agrees on the slots per token (an
        all-reduce and its host read, waited for within the engine's timeout).

        Args:
            hidden_states: ``[S, B, H]`` (or any ``[..., H]``, T = product of the
                leading dims) activations.
            routing_map: ``[T, E]`` bool, at most K Trues per row (Megatron's router
                gives exactly K).
            probs: ``[T, E]`` floating, routing weights where ``routing_map`` is True.
        Returns:
            ``(x [T, H], topk_weights [T, K] dtype of probs)``, for ``token_dispatch``.
        """
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() < 2:
            raise ValueError(f"hidden_states must be a tensor [..., H], got {_describe(hidden_states)}")
        hidden = hidden_states.shape[-1]
        num_tokens = hidden_states.numel() // hidden if hidden else 0
        if (
            not isinstance(routing_map, torch.Tensor)
            or routing_map.dtype != torch.bool
            or tuple(routing_map.shape) != (num_tokens, self.num_experts)
        ):
            raise ValueError(
                f"routing_map must be a [T={num_tokens}, E={self.num_experts}] bool tensor, got {_describe(routing_map)}"
            )
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() or probs.shape != routing_map.shape:
            raise ValueError(f"probs must be a floating [T={num_tokens}, E={self.num_experts}] tensor, got {_describe(probs)}")
        if routing_map.device != hidden_states.device or probs.device != hidden_states.device:
            raise ValueError(
                f"hidden_states ({hidden_states.device}), routing_map ({routing_map.device}) and probs "
                f"({probs.device}) must be on one device"
            )
        topk, too_many = self.topk, None
        if self.quantization_multiple:  # as Megatron's alltoall dispatcher pads, before it counts
            routing_map = pad_routing_map(routing_map, self.quantization_multiple)
        if self.fixed_rows:  # every expert may take a token padded to capacity: K' fixed, no host read
            topk = self.num_experts
        elif self.pad_to_capacity or self.quantization_multiple:  # up to every expert per token
            topk = self._padded_topk(routing_map)
        elif self.engine.config.tuning.check_inputs and num_tokens and not settings.capturing():
            too_many = routing_map.sum(dim=1) > self.topk  # on the device: read only where the dispatch fails
        topk_idx, topk_weights = routing_to_topk(routing_map, probs, topk)
        if too_many is not None:
            # a row of more than top-k experts gets, in its last slot, an id no expert has: the
            # dispatch's value check refuses it on every rank (with no host read of its own here)
            topk_idx[:, -1] = torch.where(too_many, self.num_experts, topk_idx[:, -1])
            too_many = (topk_idx, too_many.any())
        self._too_many = too_many
        if self.shared_experts is not None:
            idle(self.shared_experts)  # (a round trip that raised half way left them mid-forward)
            self.shared_experts.pre_forward_comm(hidden_states)
        # A new round trip may always start (one that raised half way is dropped). The
        # routing waits on the object for token_dispatch: under a moe_preprocess graph,
        # Megatron sets it there again after each replay (cudagraph_attrs).
        self._in_flight = None
        self.topk_idx, self.hidden_shape = topk_idx, hidden_states.shape
        rows = hidden_states.reshape(num_tokens, hidden)
        if self.split_nodes:  # the dispatch node frees its input, which the router saved: hand over a copy
            rows = rows.clone()
        return rows, topk_weights

    def _padded_topk(self, routing_map: torch.Tensor) -> int:
        """K' with padding (to capacity, or for quantization): the most experts a
        token of the EP group names (at least 1; the ranks must agree on K)."""
        per_token = routing_map.sum(dim=1)
        most = (per_token.amax() if per_token.numel() else per_token.new_zeros(())).reshape(1).to(torch.int64)
        if self.ep_size > 1:  # waited for within the engine's timeout, naming a rank that never comes
            self.engine.transport.arrivals.wait(
                lambda: dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.ep_group, async_op=True))
        return max(int(most), 1)  # host sync: K' of the group

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """The engine's dispatch (collective over the EP group); one per group of local
        experts where the padded slots per token exceed what the engine moves at once.

        Args:
            hidden_states: ``[T, H]`` from ``dispatch_preprocess``.
            probs: ``[T, K]`` topk weights from ``dispatch_preprocess``.
        Returns:
            ``(tokens [N, H] dtype of hidden_states, permuted_probs [N] dtype of probs)``.
        """
        topk_idx = self.topk_idx
        if topk_idx is None:
            raise self._out_of_order("token_dispatch")
        self.topk_idx = None
        if self.exchange is not None:  # by groups: the rows move with the experts' groups (experts_by_groups)
            too_many, self._too_many = self._too_many, None
            self._in_flight = _InFlight(next_stage=2, hidden_shape=self.hidden_shape, dispatched=(), counts=None,
                                        routing=(topk_idx, too_many))
            return hidden_states, probs
        groups = self._groups_for(topk_idx.shape[1])
        per_expert = None
        if self.fixed_rows:  # each expert gets its capacity of every rank's tokens, exactly
            per_expert = settings.capacity(topk_idx.shape[0] * self.topk, self.num_experts, self.capacity_factor)
            per_expert += -per_expert % max(self.quantization_multiple, 1)  # the router padding's round-up
            if not settings.capturing():  # each eager step, every rank: room for the slots (nothing when it fits)
                self.engine.reserve(hidden_states, max(self._group_width(topk_idx, g) for g in groups))
                self._reserved = True
            elif not self._reserved:
                raise RuntimeError("MegatronDispatcher: with every stage inside CUDA graphs, run one eager step "
                                   "before capturing (it makes the engine's room for K' = num_moe_experts slots)")
        shared = self.shared_experts
        if shared is not None:
            shared.wait_current_stream()
        outs = []
        too_many, self._too_many = self._too_many, None
        if too_many is not None and too_many[0] is not topk_idx:  # of another routing (a graph's replay)
            too_many = None
        try:
            for group in groups:
                idx, weights = (topk_idx, probs) if len(groups) == 1 else self._group_slots(topk_idx, probs, group)
                max_rows = None if per_expert is None else per_expert * self.ep_size * (group[1] - group[0])
                with self._too_many_named(too_many):
                    outs.append(self.engine.dispatch(hidden_states, idx, weights, max_rows=max_rows))
        except Exception as error:  # its expert-TP peers wait in this round trip's counts exchange: told there
            try:
                self._refuse_tp(per_expert is not None, hidden_states.device)
            except Exception as other:  # (a peer never came: named, this rank's error beneath)
                raise other from error
            raise
        try:  # (where this raises, the combine ahead is refused, as ``guard`` does)
            tokens = outs[0].tokens if len(outs) == 1 else torch.cat([o.tokens for o in outs])
            permuted_probs = outs[0].weights if len(outs) == 1 else torch.cat([o.weights for o in outs])
            if per_expert is None:
                counts = sum(o.tokens_per_expert_host for o in outs[1:]) + outs[0].tokens_per_expert_host
            else:
                counts = torch.full((self.num_local_experts,), per_expert * self.ep_size, dtype=torch.int64)
                if not settings.capturing():  # (a collective: before anything that may raise on one rank)
                    got = sum(o.tokens_per_expert for o in outs[1:]) + outs[0].tokens_per_expert
                    self._check_fixed_counts(got, counts, per_expert, topk_idx.shape[0])
            if shared is not None:  # beside the exchange's kernels
                shared.linear_fc1_forward_and_act(tokens)
        except Exception as error:
            self.engine.refuse("combine", outs[0].handle, error)  # (raises error)
        self._in_flight = _InFlight(next_stage=2, hidden_shape=self.hidden_shape, dispatched=tuple(outs),
                                    counts=counts)
        return tokens, permuted_probs

    def _groups_for(self, slots: int) -> tuple[tuple[int, int], ...]:
        """The groups of local experts ``[lo, hi)`` a dispatch of ``slots`` slots per
        token moves by: all in one where the engine takes them (``expert_groups``)."""
        if self.expert_groups is None or slots <= self.engine.max_topk:
            return ((0, self.num_local_experts),)
        return self.expert_groups

    def _group_width(self, topk_idx: torch.Tensor, group: tuple[int, int]) -> int:
        """Slots per token of ``group``'s dispatch: at most its experts on every rank."""
        return min(topk_idx.shape[1], self.ep_size * (group[1] - group[0]))

    def _group_slots(self, topk_idx: torch.Tensor, weights: torch.Tensor, group: tuple[int, int]):
        """The slots of ``topk_idx`` whose expert is one of local experts ``[lo, hi)`` of
        its rank, first and in their order, in ``_group_width`` columns (-1 / weight 0
        after them); on the device, differentiable w.r.t. ``weights`` (a gather)."""
        lo, hi = group
        local = topk_idx.remainder(self.num_local_experts)
        inside = (topk_idx >= 0) & (local >= lo) & (local < hi)
        width = self._group_width(topk_idx, group)
        order = torch.sort((~inside).to(torch.int8), dim=1, stable=True).indices[:, :width]
        kept = inside.gather(1, order)
        return torch.where(kept, topk_idx.gather(1, order), -1), torch.where(kept, weights.gather(1, order), 0)

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """Hands the rows to Megatron's experts; with expert tensor parallelism,
        first gathers those of the expert-TP group (a collective over it).

        Returns:
            ``(tokens [N, H], tokens_per_expert [E_local] int64 on the CPU, permuted_probs [N])``;
            with expert-TP size P, N and the counts are those of the P ranks together.
        """
        state = self._advance("dispatch_postprocess")
        counts = state.counts
        if self.tp_size == 1:
            # the expert node frees its input, which the experts' GEMMs save: hand over a copy
            return (hidden_states.clone() if self.split_nodes else hidden_states), counts, probs
        if self.fixed_rows:  # every expert-TP rank's counts are the same fixed ones: nothing to gather
            rows = self._fixed_tp_rows.get(tuple(counts.tolist()))
            if rows is None:
                if settings.capturing():
                    raise RuntimeError("MegatronDispatcher: the expert-TP rows of a shape are laid out in an eager "
                                       "step before a CUDA graph captures them (run one eager step first)")
                table = (tuple(counts.tolist()),) * self.tp_size
                rows = expert_tp.TensorParallelRows.of(table, self.tp_group, hidden_states.device)
                self._fixed_tp_rows[table[0]] = rows
        else:
            rows = expert_tp.TensorParallelRows.gather_counts(counts, self.tp_group, self.tp_size, hidden_states.device,
                                                              self._tp_arrivals)
        self._in_flight = dataclasses.replace(self._in_flight, tp_rows=rows)
        tokens = rows.by_expert(expert_tp.GatherRows.apply(hidden_states, rows))
        permuted_probs = rows.by_expert(expert_tp.GatherRows.apply(probs, rows))
        return tokens, rows.per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Nothing to do without expert tensor parallelism (the expert outputs
        ``[N, H]`` are in dispatch order); with it, the sum of each of this rank's
        rows over the expert-TP group (a collective over it)."""
        state = self._advance("combine_preprocess")
        if self.tp_size == 1:
            return hidden_states
        rows = state.tp_rows
        return expert_tp.SumRows.apply(rows.by_rank(hidden_states), rows)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The engine's combine, unweighted (the experts applied the probs). Where the
        dispatch went by groups of local experts, one combine per group (each sums
        its rows in fp32 and rounds once, as a combine does), the groups' sums then
        added in fp32 (fp64 for fp64), in group order, and rounded.

        Args:
            hidden_states: ``[N, H]`` expert outputs (already weighted by ``permuted_probs``).
        Returns:
            ``[T, H]`` in the dtype of ``hidden_states`` (on a rank whose experts got
            no rows, that of the ranks whose did): per token, the sum of its rows.
        """
        state = self._advance("token_combine")
        if state.routing is not None:  # by groups: experts_by_groups summed the rows home
            return hidden_states
        shared = self.shared_experts
        if shared is not None:
            shared.wait_current_stream()
        handles = [d.handle for d in state.dispatched]
        if self.split_nodes:
            # each node's backward runs on its own graph, on every rank, in one order: tied to the
            # dispatch's node through the handle's link, the combine node's backward would also run
            # the dispatch's (an exchange more, with zero gradients)
            handles = [dataclasses.replace(h, link=torch.empty(0, device=hidden_states.device,
                                                               requires_grad=torch.is_grad_enabled()))
                       for h in handles]
        if len(handles) == 1:
            out = self.engine.combine(hidden_states, handles[0], weights=None)
        else:
            pieces = hidden_states.split([d.tokens.shape[0] for d in state.dispatched])
            total = dtype = None
            for piece, handle in zip(pieces, handles):
                part = self.engine.combine(piece, handle, weights=None)
                dtype = part.dtype  # the dtype the combine agreed between the ranks
                part = part.to(torch.promote_types(dtype, torch.float32))
                total = part if total is None else total + part
            out = total.to(dtype)
        if shared is not None:  # beside the exchange's kernels
            shared.linear_fc2_forward(out)
            shared.post_forward_comm()
        return out

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[T, H]`` back to the shape of the layer's input (``[S, B, H]``), plus the
        shared experts' output where they run here."""
        if self._in_flight is None and self.postprocess_alone and self.hidden_shape is not None:
            # Megatron's partial graphs capture this stage alone (its graph of the layer's
            # postprocess), after an eager round trip: the shape is the graph's, fixed
            shape = self.hidden_shape
        else:
            shape = self._advance("combine_postprocess").hidden_shape
        out = hidden_states.view(*shape[:-1], hidden_states.shape[-1])
        return out if self.shared_experts is None else out + self.shared_experts.get_output()

    def _refuse_tp(self, fixed: bool, device: torch.device) -> None:
        """This rank's dispatch raised: its expert-TP peers are told at this round trip's
        counts exchange (``expert_tp.refuse``). Inside a CUDA graph capture, nothing."""
        if self.tp_size > 1 and not settings.capturing():
            expert_tp.refuse(fixed, self.num_local_experts, self.tp_group, self.tp_size, device, self._tp_arrivals)

    def _check_fixed_counts(self, got: torch.Tensor, fixed: torch.Tensor, per_expert: int, num_tokens: int) -> None:
        """Eager steps with fixed rows: every rank raises where some rank's experts did
        not get the fixed counts (a host sync, and an all-reduce over the EP group, then
        a gather over the expert-TP group, whose rows a peer whose dispatch raised marks,
        ``expert_tp.refuse``: so that no rank waits for one that raised)."""
        mine = got.cpu()  # host sync
        wrong = torch.tensor([int(not torch.equal(mine, fixed))], dtype=torch.int32, device=got.device)
        dist.all_reduce(wrong, op=dist.ReduceOp.MAX, group=self.ep_group)
        if self.tp_size > 1:
            wrong = comm.all_gather_rows(wrong, self.tp_group, self.tp_size, arrivals=self._tp_arrivals)
        told = wrong.view(-1).tolist()  # host sync
        refused = [p for p, v in enumerate(told) if v == expert_tp.REFUSED]
        if refused:
            raise expert_tp.refused_by(refused)
        if max(told):
            whose = (f"this rank's experts got {mine.tolist()}" if not torch.equal(mine, fixed)
                     else "another rank's experts got other counts")
            raise ValueError(
                f"routing_map: padded to capacity, each expert must get {per_expert} of each rank's {num_tokens} "
                f"tokens (moe_expert_capacity_factor={self.capacity_factor}), {fixed[0].item()} from the "
                f"{self.ep_size} ranks together; {whose}")

    @contextlib.contextmanager
    def _too_many_named(self, too_many):
        """A dispatch that refused a routing row of more than top-k experts (marked by
        ``dispatch_preprocess``) raises saying so."""
        try:
            yield
        except ValueError as exc:
            if too_many is not None and bool(too_many[1]):  # host sync, on the way out only
                raise ValueError(
                    f"routing_map has a row with more than moe_router_topk={self.topk} experts; only padding "
                    "(moe_pad_expert_input_to_capacity, moe_router_padding_for_quantization) names more"
                ) from exc
            raise

    def guard(self, moe_layer) -> None:
        """Make ``moe_layer``'s experts stage (``MoELayer.routed_experts_compute``,
        between this rank's dispatch and its combine) refuse the round trip's
        combine where it raises (``install``; by groups, ``MoEExchange`` does
        so itself): the rank takes part in that combine's agreement marked
        refused, so that every peer raises :class:`dispatch.PeerRefused` in its
        combine at once, naming it, instead of waiting for it until the timeout;
        then it raises its own error. The round trip is dropped. (The layer is
        held weakly: no reference cycle keeps it alive. A stage the user set on
        the layer itself is the one guarded, an earlier install's guard is
        replaced. Shared experts run beside the exchange refuse it likewise, in
        ``token_dispatch``. Not covered: a ``MoELayer`` without the stage, from an
        older Megatron-Core.)"""
        own = users_stage(moe_layer)
        vars(moe_layer).pop("routed_experts_compute", None)  # an earlier install's, or the user's (kept as own)
        compute = getattr(type(moe_layer), "routed_experts_compute", None)
        if own is None and compute is None:
            return
        layer = weakref.ref(moe_layer)

        def routed_experts_compute(hidden_states, probs):
            try:
                return own(hidden_states, probs) if own is not None else compute(layer(), hidden_states, probs)
            except Exception as error:
                state, self._in_flight = self._in_flight, None
                if state is None or not state.dispatched:  # no combine of this rank's dispatch ahead
                    raise
                self.engine.refuse("combine", state.dispatched[0].handle, error)  # (raises error)

        routed_experts_compute.guarded = own  # what it runs, for an install after this one
        moe_layer.routed_experts_compute = routed_experts_compute

    def pipeline(self, moe_layer, groups: int) -> None:
        """Run ``moe_layer``'s experts by ``groups`` groups of local experts as their
        rows land (``install(overlap=...)``, which checks the layer first; see the
        module's "Overlap by groups of local experts"): its ``routed_experts_compute``
        becomes :meth:`experts_by_groups`."""
        self.exchange = dispatch.MoEExchange(self.engine, ExpertsByGroup(moe_layer.experts), groups=groups,
                                             weighted_experts=True)
        moe_layer.routed_experts_compute = self.experts_by_groups

    def experts_by_groups(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        """In place of ``MoELayer.routed_experts_compute`` (``install(overlap=...)``):
        the dispatch by groups of local experts, the layer's experts on each group's
        rows as they land, each group's outputs summed into the pre-sums going home.

        Args:
            hidden_states: ``[T, H]`` as ``token_dispatch`` handed them on.
            probs: ``[T, K]`` topk weights, likewise.
        Returns:
            ``([T, H] the home sums, None)`` (no bias), for ``token_combine``.
        """
        state = self._advance("dispatch_postprocess")
        if state.routing is None:
            raise self._out_of_order("experts_by_groups")
        topk_idx, too_many = state.routing
        if too_many is not None and too_many[0] is not topk_idx:  # of another routing
            too_many = None
        with self._too_many_named(too_many):
            out = self.exchange(hidden_states, topk_idx, probs)
        self._advance("combine_preprocess")
        return out, None

    def check(self) -> None:
        """Raises what the engine's kernels recorded (a peer that timed out, a rank over
        its rows): with every stage inside CUDA graphs nothing is read on the host, so
        call it now and then (``dispatch.TokenDispatcher.check``)."""
        self.engine.check()

    def _advance(self, name: str) -> _InFlight:
        """The round trip's state, checked to be at stage ``name``; moves it on (the
        last stage ends the round trip)."""
        state = self._in_flight
        if state is None or STAGES[state.next_stage] != name:
            raise self._out_of_order(name)
        last = state.next_stage == len(STAGES) - 1
        self._in_flight = None if last else dataclasses.replace(state, next_stage=state.next_stage + 1)
        return state

    @staticmethod
    def _out_of_order(name: str) -> RuntimeError:
        return RuntimeError(
            f"MegatronDispatcher.{name} called out of order: the stages run as MoELayer.forward calls "
            f"them ({', '.join(STAGES)}), one round trip at a time"
        )


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__
