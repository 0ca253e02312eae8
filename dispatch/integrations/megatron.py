"""The dispatch engine as a drop-in Megatron-Core token dispatcher.

``MegatronDispatcher`` has the interface of Megatron-Core's ``MoETokenDispatcher``
(0.19): the constructor ``(num_local_experts, local_expert_indices, config,
pg_collection)`` and the six stages ``MoELayer.forward`` calls in this order::

    dispatch_preprocess(hidden_states, routing_map, probs) -> (x, topk_weights)   local: routing to top-k
    token_dispatch(x, topk_weights)                        -> (tokens, weights)   the engine's dispatch
    dispatch_postprocess(tokens, weights)                  -> (tokens, tokens_per_expert, permuted_probs)
    experts(tokens, tokens_per_expert, permuted_probs)     -> y                   Megatron's experts
    combine_preprocess(y) -> token_combine(y) -> combine_postprocess(h)           the engine's combine

``install(moe_layer, **options)`` swaps it into a built ``MoELayer``;
``install_all(model, **options)`` into every ``MoELayer`` of a model; with
``overlap=True`` the layer's experts run by groups beside the exchange (below).

Notation:

    W        ranks in the expert-parallel (EP) group
    T        tokens on this rank (S*B for hidden states [S, B, H])
    H        hidden size
    E        experts in total (config.num_moe_experts); E_local = E // W per rank,
             expert e on EP rank e // E_local
    K        experts per token (config.moe_router_topk)
    N        rows this rank's experts receive, one per (token, local expert) pair

What Megatron's experts expect, and what they get
-------------------------------------------------
* ``tokens [N, H]`` grouped by local expert, inside an expert by (source rank,
  source token): the same order as Megatron's ``alltoall`` dispatcher produces.
* ``tokens_per_expert [E_local]`` int64 **on the CPU**, where Megatron's
  ``alltoall`` (and ``allgather``) dispatchers put it: ``SequentialMLP`` and
  ``TEGroupedMLP`` call ``.tolist()`` on it. The engine's plan has these counts on
  the host already, so handing them over costs no synchronisation.
* ``permuted_probs [N]`` in the dtype of ``probs``, differentiable w.r.t. ``probs``.
  Megatron's experts multiply their activations by these; combine therefore runs
  with ``weights=None`` and does not weight a second time.

Combine sums the rows of a token in fp32 (as the engine always does, see the contract in README.md)
where Megatron's ``alltoall`` dispatcher sums them in the activation dtype: for bf16
activations the results agree within bf16 rounding, not bit for bit.

What is refused
---------------
The constructor refuses, with a ValueError naming the setting, what this adapter
does not implement: ``overlap_moe_expert_parallel_comm`` with another
``moe_token_dispatcher_type`` than ``alltoall``, the inference-optimized layer,
and the CUDA graphs below that it cannot hold. Attention tensor parallelism needs
nothing: as in Megatron's ``alltoall`` dispatcher with expert tensor parallel
size 1, each rank dispatches the tokens it holds (with sequence parallelism, its
sequence shard).

CUDA graphs
-----------
* Graphs of attention and of the router alone end before ``dispatch_preprocess``.
* ``moe_preprocess`` graphs (with ``moe_router``; without padding to capacity or
  router padding, as Megatron requires there) hold ``dispatch_preprocess``, which
  reads nothing on the host. Rows of more than top-k experts are refused by the
  dispatch's value check where ``dispatch_preprocess`` ran eagerly; a graph's
  replays are not checked (their rows keep the top-k lowest experts). Its routing
  (``topk_idx``) waits on the object for ``token_dispatch``. Named in ``cudagraph_attrs``, it is a graph output that
  Megatron sets again after each replay; ``token_dispatch`` takes it once. Megatron's
  local graphs also capture the layer's postprocess alone, after an eager round
  trip: ``combine_postprocess`` then runs without the stages before it.
* Graphs of every stage (``moe``, whole layers, the whole iteration) need a round
  trip that reads nothing on the host. That takes padding to capacity, which
  Megatron's own dispatcher needs there too, and the NVLink engine (its
  ``max_rows`` path; over NCCL the split sizes are read on the host). Each expert
  then gets exactly its capacity of every rank's tokens (Megatron's
  ``get_capacity``, rounded up to the router padding's multiple), so K' = E,
  ``max_rows`` and the host ``tokens_per_expert`` are fixed,
  and with expert tensor parallelism so are the expert-TP group's counts (every
  rank of it has the same; they are laid out once, in an eager step). Each eager
  ``token_dispatch`` makes the engine's room for them (``reserve``, a collective;
  nothing when it fits) and checks the device's counts against the fixed ones, on
  every rank (an all-reduce of what each found).
  Replays read nothing on the host: ``check()`` raises what the engine's kernels
  recorded.

Padding to capacity
-------------------
With ``moe_pad_expert_input_to_capacity`` (and a capacity factor) Megatron's
router hands over its capacity mask: every expert takes exactly its capacity of
each rank's tokens, the padding being tokens with probability 0, so a token may
name more than ``moe_router_topk`` experts. The dispatcher then moves rows of up
to K' experts, K' the most any token of the EP group names (one small all-reduce
and host read per dispatch): each expert gets its capacity of rows from every
rank, in the order of Megatron's ``alltoall`` dispatcher (source rank, then
token), the padding rows with probability 0. Where K' passes the slots the engine
moves per token (32 on NVLink; NCCL moves any number), the round trip goes by
groups of local experts, 32 // W of each rank's a group (a group's slots fit): one
dispatch per group, their rows one after another in expert order (the experts see
one dispatch's rows), and one combine per group, whose sums (each rounded to the
activations' dtype) are added in fp32, in group order, and rounded again: for a
token of three rows or more spread over groups, a half-precision result may differ
from one combine's by a rounding. An EP group of more ranks than those 32 slots is
refused with padding.

Megatron's EP-communication overlap
-----------------------------------
With ``overlap_moe_expert_parallel_comm`` (``alltoall`` only) Megatron's combined
1F1B schedule runs a layer as four nodes on two streams (attention, router and
``dispatch_preprocess``; ``token_dispatch``; ``dispatch_postprocess``, experts and
``combine_preprocess``; ``token_combine`` and ``combine_postprocess``), each on
detached copies of its inputs with a backward of its own, and frees the
dispatch, expert and combine nodes' inputs once their forward has run. So
``dispatch_preprocess`` hands over a copy of the rows (the router saved the
tensor they view), ``dispatch_postprocess`` a copy of the tokens without expert
tensor parallelism (the experts' GEMMs save them), and ``token_combine`` unties
the combine from the dispatch (the handle's ``link``): every rank runs every
node's backward itself, and a tied combine node's backward would also run the
dispatch's, an exchange more.

Shared experts beside the exchange
----------------------------------
With ``moe_shared_expert_overlap=True``, ``MoELayer`` hands its shared experts to
the dispatcher (``set_shared_experts``; ``install`` carries them over), which runs
them as Megatron's ``alltoall`` dispatcher does, on their own stream: their input
communication at ``dispatch_preprocess``, fc1 once the dispatch is issued, fc2 and
their output communication once the combine is issued, their output added at
``combine_postprocess``. On the NVLink engine the kernels of the exchange are then
in flight beside them.

Expert tensor parallelism
-------------------------
With ``expert_tensor_parallel_size`` P > 1 (``pg_collection.expt_tp``), as in
Megatron's ``alltoall`` dispatcher: each rank dispatches its tokens over its EP
group (the ranks of its expert-TP index); ``dispatch_postprocess`` gathers the
rows of the P ranks of its expert-TP group (which hold the same experts, sharded)
and orders them by local expert, then by expert-TP rank, then as dispatched
(source EP rank, source token); ``tokens_per_expert`` counts them all.
``combine_preprocess`` puts the experts' partial outputs back in expert-TP rank
order and sums each rank's rows over the group (in fp32, ascending rank, cast
once; Megatron's reduce-scatter): the experts leave that reduction to the
dispatcher, as with Megatron's. Backward: the gather's gradient is that sum, the
sum's is the gather.

Overlap by groups of local experts
----------------------------------
``install(moe_layer, overlap=True)`` (or ``overlap=G``) runs the layer's own
experts group by group of its local experts as their rows land, while the next
group's rows move (``dispatch.MoEExchange`` with ``weighted_experts``: Megatron's
experts apply ``permuted_probs`` themselves, so the sums go home unweighted). The
layer's ``routed_experts_compute`` is replaced by the dispatcher's
``experts_by_groups``: ``token_dispatch`` hands the rows on untouched,
``experts_by_groups`` dispatches by groups, runs the layer's experts on each
group's rows (a plain ``SequentialMLP``: the MLPs of the group's experts that have
rows, as its own forward runs each on its rows; other experts are called whole
with ``tokens_per_expert`` zero outside the group, a grouped MLP running empty
GEMMs for the others) and adds each group's outputs to the pre-sums going home, and ``token_combine``
hands the home sums on. Each expert's weights are read once per pass; backward is
the mirror image. The results are bitwise those of the adapter without overlap
(one dispatch, the experts called once, one combine): each expert sees the same
rows in the same order, and the sums go home in the same order. Not taken (a
ValueError naming them): expert tensor parallelism, shared experts overlapped
with the exchange, padding to capacity or for quantization, CUDA graphs of the MoE
stages, Megatron's own EP overlap, delayed weight gradients and MoE layer
recompute. ``install(moe_layer)`` again puts the layer's own stage back.

The engine's own options (``variant``, ``dispatch_wire``, ``combine_wire``, the
gradient wires, ``check_inputs``, ...) are the fields of
:class:`dispatch.DispatchConfig` other than ``num_experts`` and of
:class:`dispatch.Tuning`, passed as ``options``
(``DispatchConfig.from_options``); the config validates them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

import dispatch
from dispatch.config import DispatchConfig, Tuning
from dispatch.integrations import megatron_settings as settings
from dispatch.integrations import megatron_tp as expert_tp
from dispatch.pipeline import hooked, module_parameters

__all__ = ["ENGINE_OPTIONS", "STAGES", "MegatronDispatcher", "install", "install_all", "routing_to_topk"]

# DispatchConfig fields a user may set; num_experts comes from Megatron's config.
# token dropping is Megatron's router's (moe_expert_capacity_factor), not the engine's here
ENGINE_OPTIONS = tuple(f.name for f in (*dataclasses.fields(DispatchConfig), *dataclasses.fields(Tuning))
                       if f.name not in ("num_experts", "capacity_factor", "drop_policy", "pad_to_capacity", "tuning"))

_INSTALL_HINT = 'pip install megatron-core (or pip install "moe-dispatch[megatron]")'


def _import_moe_layer():
    """Megatron-Core's ``MoELayer`` class, or an ImportError saying what to install."""
    try:
        from megatron.core.transformer.moe.moe_layer import MoELayer
    except ImportError as exc:
        raise ImportError(f"dispatch.integrations.megatron.install needs megatron-core: {_INSTALL_HINT}") from exc
    return MoELayer


# ----------------------------------------------------------------------------- routing format


def routing_to_topk(routing_map: torch.Tensor, probs: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's dense routing as the engine's top-k lists, on the device, no host sync.

    Args:
        routing_map: ``[T, E]`` bool, True where token t goes to expert e (at most
            ``topk`` Trues per row; extra Trues beyond the ``topk`` lowest expert ids
            are not represented, see ``MegatronDispatcher`` for the check).
        probs: ``[T, E]`` floating, the routing weight where ``routing_map`` is True.
        topk: ``K``.
    Returns:
        ``(topk_idx [T, K] int64, topk_weights [T, K] dtype of probs)``: the experts of
        each row in ascending order, then ``-1`` slots (weight 0) if the row has fewer
        than ``K``. ``topk_weights`` is differentiable w.r.t. ``probs`` (a gather).
    """
    num_experts = routing_map.shape[1]
    k = min(topk, num_experts)
    # Trues score E - e (largest for the lowest expert id), Falses 0.
    rank_score = torch.arange(num_experts, 0, -1, device=routing_map.device, dtype=torch.int32)
    score = routing_map.to(torch.int32) * rank_score
    top_score, top_expert = score.topk(k, dim=1)
    routed = top_score > 0
    topk_idx = torch.where(routed, top_expert, -1).to(torch.int64)
    topk_weights = torch.where(routed, probs.gather(1, top_expert), 0).to(probs.dtype)
    if k < topk:  # K > E cannot be routed; keep the [T, K] shape with empty slots
        pad = topk - k
        topk_idx = torch.cat([topk_idx, topk_idx.new_full((topk_idx.shape[0], pad), -1)], 1)
        topk_weights = torch.cat([topk_weights, topk_weights.new_zeros(topk_weights.shape[0], pad)], 1)
    return topk_idx, topk_weights


def pad_routing_map(routing_map: torch.Tensor, multiple: int) -> torch.Tensor:
    """Megatron's router padding for quantization: for each expert, the first
    tokens (ascending) not routed to it are routed to it, as many as bring its
    count on this rank to a multiple of ``multiple`` (their probability stays 0);
    on the device, no host sync.

    Args:
        routing_map: ``[T, E]`` bool.
        multiple: the alignment (``get_align_size_for_quantization``), >= 1.
    Returns:
        ``[T, E]`` bool, a new tensor.
    """
    free = ~routing_map
    short = (-routing_map.sum(0)) % multiple  # [E] tokens each expert lacks
    order = torch.cumsum(free.to(torch.int64), 0)  # [T, E]: the free token's place in its expert's column
    return routing_map | (free & (order <= short))


# ----------------------------------------------------------------------------- the dispatcher


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


def _group_size(group) -> int:
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
        options: the engine's options, fields of :class:`dispatch.DispatchConfig`
            other than ``num_experts`` (``variant``, ``dispatch_wire``, ...).
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
        self.tp_size = _group_size(expt_tp)
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
        """Routing to top-k form; no communication.

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
        if self.ep_size > 1:
            dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.ep_group)
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
        for group in groups:
            idx, weights = (topk_idx, probs) if len(groups) == 1 else self._group_slots(topk_idx, probs, group)
            max_rows = None if per_expert is None else per_expert * self.ep_size * (group[1] - group[0])
            with self._too_many_named(too_many):
                outs.append(self.engine.dispatch(hidden_states, idx, weights, max_rows=max_rows))
        tokens = outs[0].tokens if len(outs) == 1 else torch.cat([o.tokens for o in outs])
        permuted_probs = outs[0].weights if len(outs) == 1 else torch.cat([o.weights for o in outs])
        if shared is not None:  # beside the exchange's kernels
            shared.linear_fc1_forward_and_act(tokens)
        if per_expert is None:
            counts = sum(o.tokens_per_expert_host for o in outs[1:]) + outs[0].tokens_per_expert_host
        else:
            counts = torch.full((self.num_local_experts,), per_expert * self.ep_size, dtype=torch.int64)
            if not settings.capturing():
                got = sum(o.tokens_per_expert for o in outs[1:]) + outs[0].tokens_per_expert
                self._check_fixed_counts(got, counts, per_expert, topk_idx.shape[0])
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
            rows = expert_tp.TensorParallelRows.gather_counts(counts, self.tp_group, self.tp_size, hidden_states.device)
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

    def _check_fixed_counts(self, got: torch.Tensor, fixed: torch.Tensor, per_expert: int, num_tokens: int) -> None:
        """Eager steps with fixed rows: every rank raises where some rank's experts did
        not get the fixed counts (a host sync, and an all-reduce over the EP group, then
        the expert-TP group, so that no rank waits for one that raised)."""
        mine = got.cpu()  # host sync
        wrong = torch.tensor([int(not torch.equal(mine, fixed))], dtype=torch.int32, device=got.device)
        dist.all_reduce(wrong, op=dist.ReduceOp.MAX, group=self.ep_group)
        if self.tp_size > 1:
            dist.all_reduce(wrong, op=dist.ReduceOp.MAX, group=self.tp_group)
        if wrong.item():
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

    def pipeline(self, moe_layer, groups: int) -> None:
        """Run ``moe_layer``'s experts by ``groups`` groups of local experts as their
        rows land (``install(overlap=...)``, which checks the layer first; see the
        module's "Overlap by groups of local experts"): its ``routed_experts_compute``
        becomes :meth:`experts_by_groups`."""
        self.exchange = dispatch.MoEExchange(self.engine, _GroupExperts(moe_layer.experts), groups=groups,
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


class _GroupExperts(torch.nn.Module):
    """Megatron's experts called for one group of local experts at a time
    (``install(overlap=...)``): ``(tokens [N_g, H], tokens_per_expert [E_local]
    int64 on the CPU, zero outside the group, permuted_probs [N_g]) -> [N_g, H]``, as
    ``MoELayer`` calls them. A plain ``SequentialMLP`` (``_runs_alone``) runs the MLPs
    of the experts with rows only, as its own forward runs each on its rows (the
    others' calls on no rows would cost the host as much as a full one, once per
    group); other experts are called whole (a grouped MLP: empty GEMMs for the other
    groups' experts). Not a submodule of the layer (its parameters are the experts'
    own, counted once)."""

    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts
        # SequentialMLP: an MLP a local expert, each run on its rows (none for the other
        # groups' experts), its parameters its MLPs' and nothing else
        mlps = getattr(experts, "local_experts", None)
        apart = isinstance(mlps, torch.nn.ModuleList) and len(mlps) > 0 and (
            {id(p) for p in experts.parameters()} == {id(p) for mlp in mlps for p in mlp.parameters()})
        self._mlps = tuple(mlps) if apart else None
        self._alone = apart and _runs_alone(experts)

    def group_parameters(self, first: int, end: int) -> list:
        """The parameters that a call with rows of local experts [first, end) only can
        reach (``MoEExchange``): those experts' MLPs' where each expert has its own
        (SequentialMLP), else all (a grouped MLP's weights hold every expert)."""
        if self._mlps is None:
            return module_parameters(self.experts)
        return [p for mlp in self._mlps[first:end] for p in module_parameters(mlp)]

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        if self._alone and not hooked(self.experts):
            # SequentialMLP.forward's loop over the experts with rows (each MLP's bias,
            # if any, is in its output; SequentialMLP returns none); a group without
            # rows gets its empty output from one MLP
            counts = tokens_per_expert.tolist()  # on the CPU where the dispatch read its counts
            rows, weights = tokens.split(counts), probs.split(counts)
            outs = [mlp(r, w)[0] for mlp, r, w, n in zip(self._mlps, rows, weights, counts) if n]
            if not outs:
                return self._mlps[0](tokens, probs)[0]
            return outs[0] if len(outs) == 1 else torch.cat(outs)
        out, bias = self.experts(tokens, tokens_per_expert, probs)
        if bias is not None:
            raise ValueError(f"install(overlap=...): the experts ({type(self.experts).__name__}) returned a bias; "
                             "MoELayer takes none from its dispatchers' experts either")
        return out


def _runs_alone(experts: torch.nn.Module) -> bool:
    """Whether ``experts`` is a ``SequentialMLP`` whose forward is, for more than one
    local expert, each MLP on its rows and probs (split by the counts) and the outputs
    concatenated: its own forward, no input scaling by the probs, no padding for
    fp8/fp4 quantization."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    config = getattr(experts, "config", None)
    return (type(experts).forward is SequentialMLP.forward and isinstance(experts, SequentialMLP)
            and len(experts.local_experts) > 1 and config is not None
            and not getattr(config, "moe_apply_probs_on_input", False)
            and not getattr(config, "fp8", None) and not getattr(config, "fp4", None))


# ----------------------------------------------------------------------------- expert tensor parallelism


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype} {tuple(value.shape)}"
    return type(value).__name__


# ----------------------------------------------------------------------------- installing


OVERLAP_GROUPS = 2  # install(overlap=True): the fewest groups that overlap anything


def install(moe_layer, overlap: bool | int = False, **options) -> MegatronDispatcher:
    """Replace the token dispatcher of a built Megatron-Core ``MoELayer`` by the engine.

    Collective over the layer's EP group (the engine is created there).

    Args:
        moe_layer: a ``megatron.core.transformer.moe.moe_layer.MoELayer``.
        overlap: run the layer's experts group by group of local experts as their
            rows land, beside the next group's exchange (see the module's "Overlap
            by groups of local experts"): True for ``OVERLAP_GROUPS`` groups (or
            E_local where fewer), an int G for G groups; False (default): one
            exchange, the experts called once, as ``MoELayer`` does. Measured
            slower than False on an eager, host-bound layer (16 and 256 experts
            on 2 x H100, bench/results/README.md): measure yours before turning
            it on.
        **options: the engine's options (fields of :class:`dispatch.DispatchConfig`
            other than ``num_experts``), e.g. ``dispatch_wire="bf16"``.
    Returns:
        The new dispatcher, also set as ``moe_layer.token_dispatcher``.
    Raises:
        ImportError (saying what to install) when megatron-core is missing;
        TypeError when ``moe_layer`` is not a ``MoELayer``; ValueError for settings
        the adapter does not support, and for an ``overlap`` the layer cannot take.
    """
    moe_layer_cls = _import_moe_layer()
    if not isinstance(moe_layer, moe_layer_cls):
        raise TypeError(f"moe_layer must be a megatron.core MoELayer, got {type(moe_layer).__name__}")
    from megatron.core.process_groups_config import ProcessGroupCollection

    old = moe_layer.token_dispatcher
    expt_tp = getattr(old, "tp_group", None)
    shared = getattr(old, "shared_experts", None)
    groups = _overlap_groups(moe_layer, overlap, _group_size(expt_tp), shared)  # before any communication
    dispatcher = MegatronDispatcher(
        moe_layer.num_local_experts, moe_layer.local_expert_indices, moe_layer.config,
        ProcessGroupCollection(ep=moe_layer.ep_group, expt_tp=expt_tp), options=options
    )
    if shared is not None:  # MoELayer handed them to its dispatcher (moe_shared_expert_overlap)
        dispatcher.set_shared_experts(shared)
    if groups:
        dispatcher.pipeline(moe_layer, groups)
    else:  # the layer's own experts stage again, where an earlier install(overlap=...) replaced it
        vars(moe_layer).pop("routed_experts_compute", None)
    moe_layer.token_dispatcher = dispatcher
    return dispatcher


def _overlap_groups(moe_layer, overlap, tp_size: int, shared) -> int:
    """The groups of local experts ``install(overlap=...)`` runs ``moe_layer``'s
    experts by (0: none), or a ValueError naming what the layer or its config
    does not allow with it."""
    local = moe_layer.num_local_experts
    if overlap is False:
        return 0
    if overlap is True:
        groups = min(OVERLAP_GROUPS, local)
    elif isinstance(overlap, int) and 1 <= overlap <= local:
        groups = overlap
    else:
        raise ValueError(f"overlap must be a bool or an int in [1, {local}] (groups of the layer's {local} local "
                         f"experts), got {overlap!r}")
    problems = settings.overlap_refusals(moe_layer.config)
    if tp_size > 1:
        problems.append(f"expert_tensor_parallel_size={tp_size} (the experts' rows are gathered over the "
                        "expert-TP group whole)")
    if shared is not None:
        problems.append("moe_shared_expert_overlap=True (the shared experts run beside a whole exchange)")
    if not isinstance(getattr(moe_layer, "experts", None), torch.nn.Module):
        problems.append(f"experts of type {type(getattr(moe_layer, 'experts', None)).__name__} (an nn.Module "
                        "called as MoELayer calls it)")
    if problems:
        raise ValueError("install(overlap=...) does not support: " + "; ".join(problems))
    return groups


def install_all(model: torch.nn.Module, overlap: bool | int = False, **options) -> list[MegatronDispatcher]:
    """``install`` into every ``MoELayer`` of ``model`` (e.g. a ``GPTModel``), in module order.

    Collective over each layer's EP group. Returns the dispatchers; raises as ``install``,
    and ValueError when ``model`` holds no ``MoELayer``.
    """
    moe_layer_cls = _import_moe_layer()
    layers = [m for m in model.modules() if isinstance(m, moe_layer_cls)]
    if not layers:
        raise ValueError(f"model ({type(model).__name__}) holds no MoELayer")
    return [install(layer, overlap=overlap, **options) for layer in layers]
