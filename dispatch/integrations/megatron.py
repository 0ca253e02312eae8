"""The dispatch engine as a drop-in Megatron-Core token dispatcher.

``MegatronDispatcher`` has the interface of Megatron-Core's ``MoETokenDispatcher``
(0.19): the constructor ``(num_local_experts, local_expert_indices, config,
pg_collection)`` and the six stages ``MoELayer.forward`` calls in this order::

    dispatch_preprocess(hidden_states, routing_map, probs) -> (x, topk_weights)   routing to top-k (padded: K' agreed)
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
``flex`` over HybridEP or NCCL-EP with fp8/fp4 and no router padding (Megatron's
experts then leave the quantization padding of their rows to that dispatcher),
``flex`` with ``moe_expert_rank_capacity_factor`` (a per-rank budget it does not
apply), and the CUDA graphs below that it cannot hold. Attention tensor parallelism needs
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
  replays, and every call with ``check_inputs=False``, are not checked (their
  rows keep the top-k lowest experts). Its routing
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
recompute. ``install(moe_layer)`` again puts the layer's own stage back (guarded:
``MegatronDispatcher.guard``).

The engine's own options (``variant``, ``dispatch_wire``, ``combine_wire``, the
gradient wires, ``check_inputs``, ...) are the fields of
:class:`dispatch.DispatchConfig` other than ``num_experts`` and token dropping
(``capacity_factor``, ``drop_policy``, ``pad_to_capacity``: Megatron's router
drops) and of :class:`dispatch.Tuning`, passed as ``options``
(``DispatchConfig.from_options``); the config validates them.
"""
from __future__ import annotations

import torch

from dispatch.integrations import megatron_settings as settings
from dispatch.integrations.megatron_dispatcher import ENGINE_OPTIONS, STAGES, MegatronDispatcher, group_size
from dispatch.integrations.megatron_moe import pad_routing_map, routing_to_topk, users_stage

__all__ = ["ENGINE_OPTIONS", "OVERLAP_GROUPS", "STAGES", "MegatronDispatcher", "install", "install_all",
           "pad_routing_map", "routing_to_topk"]

_INSTALL_HINT = 'pip install megatron-core (or pip install "moe-dispatch[megatron]")'


def _import_moe_layer():
    """Megatron-Core's ``MoELayer`` class, or an ImportError saying what to install."""
    try:
        from megatron.core.transformer.moe.moe_layer import MoELayer
    except ImportError as exc:
        raise ImportError(f"dispatch.integrations.megatron.install needs megatron-core: {_INSTALL_HINT}") from exc
    return MoELayer

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
            on 2 GPUs; bench/results/README.md, findings): measure yours before
            turning it on.
        **options: the engine's options (``ENGINE_OPTIONS``: fields of
            :class:`dispatch.DispatchConfig` and :class:`dispatch.Tuning`, but
            ``num_experts`` and token dropping), e.g. ``dispatch_wire="bf16"``.
    Where the layer's experts (or shared experts run beside the exchange) raise
    on one rank between its dispatch and its combine, that rank raises their
    error and its peers ``dispatch.PeerRefused`` in their combine, at once
    (``MegatronDispatcher.guard``; by groups, ``MoEExchange``). With expert
    tensor parallelism, a rank whose EP group's dispatch raised (every rank of
    it, as the engine's checks before any row moves make it) takes part in
    its expert-TP peers' counts exchange of that round trip, marked: they raise
    ``PeerRefused`` there at once, naming it, and the next round trip starts in
    step (a rank that never comes is named there within the engine's
    ``timeout``). Where experts raise after that exchange, their expert-TP peers
    wait in its sums (``combine_preprocess``) for the backend's timeout
    (joining them with zeros would let them go on with wrong sums); until those
    have raised, the rank must not start another round trip: its collectives
    would pair with theirs of the round trip before.

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
    groups = _overlap_groups(moe_layer, overlap, group_size(expt_tp), shared)  # before any communication
    dispatcher = MegatronDispatcher(
        moe_layer.num_local_experts, moe_layer.local_expert_indices, moe_layer.config,
        ProcessGroupCollection(ep=moe_layer.ep_group, expt_tp=expt_tp), options=options
    )
    if shared is not None:  # MoELayer handed them to its dispatcher (moe_shared_expert_overlap)
        dispatcher.set_shared_experts(shared)
    if groups:
        dispatcher.pipeline(moe_layer, groups)
    else:  # the layer's own experts stage, guarded (in place of an earlier install's)
        dispatcher.guard(moe_layer)
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
    if users_stage(moe_layer) is not None:
        problems.append("a routed_experts_compute set on the layer itself (the experts by groups would replace it)")
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
