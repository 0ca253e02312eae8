"""Megatron-Core's token dispatchers as a benchmark baseline.

This module drives Megatron-Core 0.19.2's ``MoEAlltoAllTokenDispatcher`` and
``MoEAllGatherTokenDispatcher`` through one full dispatch + combine round trip, in the
same six stages and with the same arguments as ``MoELayer.forward`` calls them, with
identity experts in the middle. It is a baseline to time our engine against; it holds
no Megatron code, only calls into Megatron's public classes.

Notation (as in the rest of the project):

    W        ranks in the expert-parallel (EP) group
    T        tokens on this rank
    H        hidden size
    E        experts in total; E_local = E // W live on each rank,
             expert e on EP rank e // E_local
    K        experts per token (top-k)
    N        rows this rank's experts receive (one per (token, local expert) pair)

Megatron describes a routing with dense tensors, not with top-k lists:

    routing_map  [T, E] bool     True where token t goes to expert e (K Trues per row)
    probs        [T, E] float32  routing weight where routing_map is True, 0 elsewhere

``routing_to_megatron`` converts our ``(topk_idx, topk_weights)`` into these.

What comes out of the round trip
--------------------------------
Neither dispatcher applies the routing weights in combine: in Megatron the *experts*
multiply their activations by ``permuted_probs`` (and cast back to the activation
dtype), and combine only scatters and sums. So, with identity experts,

* ``weight_by_probs=False`` (the default, "no experts"):
  ``out[t] = sum over the K experts of t of x[t] = K * x[t]``;
* ``weight_by_probs=True`` (identity experts that weight as Megatron's experts do,
  ``(rows * permuted_probs[:, None]).to(rows.dtype)``):
  ``out[t] = sum_k bf16(x[t] * w[t, k])``, i.e. about ``x[t] * sum_k w[t, k]``, which is
  what our engine's ``combine`` returns for identity experts.

Both dispatchers return ``out`` in the dtype and shape of ``hidden_states``. Where the
sums happen differs, which matters when comparing values bit for bit:

* alltoall: the K rows of a token are summed on the token's home rank by one
  ``scatter_add_`` in the activation dtype (bf16 adds for bf16 input);
* allgather: the rows of a token that live on one rank are summed there in bf16, then the
  per-rank partials are reduce-scattered in float32 (the dtype of ``probs``) and cast back.

Bytes on the wire: alltoall sends every (token, expert) pair as its own row (no
deduplication per destination rank), plus the ``[T*K]`` float32 probs; allgather gathers
``[W*T, H]`` rows, ``[W*T, E]`` probs and the ``[W*T, E]`` map, and reduce-scatters
``[W*T, H]`` in float32.

Side effects
------------
``build_megatron_dispatcher`` is collective over the whole default world: the first call
in a process runs ``megatron.core.parallel_state.initialize_model_parallel`` (tensor
parallel 1, pipeline 1, expert tensor parallel 1), because the allgather dispatcher takes
its gather buffer from Megatron's global memory buffer, which only that function sets up.
The dispatchers themselves communicate over the ``group`` they are given, passed to them
in a ``ProcessGroupCollection``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from dispatch.bench.common import by_expert
from dispatch.timing import mark

__all__ = [
    "megatron_available",
    "build_megatron_dispatcher",
    "megatron_round_trip",
    "routing_to_megatron",
]

# kind -> the Megatron-Core class that implements it (megatron/core/transformer/moe/token_dispatcher.py)
_DISPATCHER_CLASSES = {
    "alltoall": "MoEAlltoAllTokenDispatcher",
    "allgather": "MoEAllGatherTokenDispatcher",
}

_available: bool | None = None


def megatron_available() -> bool:
    """True iff ``megatron.core`` (and its MoE token dispatchers) can be imported.

    The answer is computed once per process. Megatron warns at import time that Transformer
    Engine and Apex are missing; those warnings are silenced here.
    """
    global _available
    if _available is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                import megatron.core  # noqa: F401
                from megatron.core.transformer.moe import token_dispatcher  # noqa: F401
        except Exception:  # ImportError, or a version clash raised while importing
            _available = False
        else:
            _available = True
    return _available


def _require_megatron() -> None:
    if not megatron_available():
        raise RuntimeError(
            "megatron-core is not importable; install megatron-core 0.19.2 or put it on PYTHONPATH"
        )


def _check_positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


# ----------------------------------------------------------------------------- construction


def _ensure_parallel_state(ep_size: int) -> None:
    """Initialise Megatron's global parallel state once (collective over the default world).

    Megatron's dispatchers take their process groups from the ``ProcessGroupCollection``
    we pass, but the allgather dispatcher gathers into ``parallel_state``'s global memory
    buffer, and the expert-tensor-parallel group of size 1 comes from there too. If some
    other code initialised the state already, it is reused after checking that tensor
    parallelism and expert tensor parallelism are both 1.
    """
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        tp = parallel_state.get_tensor_model_parallel_world_size()
        etp = parallel_state.get_expert_tensor_parallel_world_size()
        if tp != 1 or etp != 1:
            raise RuntimeError(
                "megatron parallel_state is already initialised with tensor parallel size "
                f"{tp} and expert tensor parallel size {etp}; this baseline needs both to be 1"
            )
        return
    world = dist.get_world_size()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        # Megatron's own EP groups are contiguous blocks of ranks; we pass our own group
        # to the dispatcher anyway, so this only has to be a valid size.
        expert_model_parallel_size=ep_size if world % ep_size == 0 else 1,
        expert_tensor_parallel_size=1,
        create_gloo_process_groups=False,
    )


def _process_groups(group: dist.ProcessGroup):
    """The ``ProcessGroupCollection`` the dispatchers read: ``ep``, ``tp_ep`` and ``expt_tp``.

    With tensor parallel 1 the "tensor and expert parallel" group is the EP group itself,
    and the expert tensor parallel group is this rank alone.
    """
    from megatron.core import parallel_state
    from megatron.core.process_groups_config import ProcessGroupCollection

    return ProcessGroupCollection(
        ep=group,
        tp_ep=group,
        expt_tp=parallel_state.get_expert_tensor_parallel_group(),
        tp=parallel_state.get_tensor_model_parallel_group(),
    )


def _transformer_config(kind: str, num_experts: int, topk: int, hidden: int, ep_size: int):
    """A ``TransformerConfig`` holding only what the two dispatchers read, bf16, dropless.

    Fields the dispatchers read (token_dispatcher.py, 0.19.2): ``num_moe_experts``,
    ``moe_router_topk``, ``moe_expert_capacity_factor`` (None: no dropping, output size
    ``T*K`` known without a host sync), ``moe_pad_expert_input_to_capacity`` (False),
    ``moe_permute_fusion`` (False: plain torch permute, no Transformer Engine),
    ``moe_router_padding_for_quantization`` (False), ``moe_shared_expert_overlap``
    (False), ``cuda_graph_impl`` ("none"), ``add_bias_linear`` (False). The rest only has
    to pass ``__post_init__``: one layer, one attention head, no TP/SP/PP.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        # model shape (only hidden_size matters here)
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=1,
        ffn_hidden_size=hidden,
        moe_ffn_hidden_size=hidden,
        add_bias_linear=False,
        transformer_impl="local",  # no Transformer Engine on the benchmark machine
        # parallelism
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=1,
        sequence_parallel=False,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1,
        # precision
        bf16=True,
        params_dtype=torch.bfloat16,
        moe_router_dtype="fp32",  # probs arrive as float32, as from a router in fp32
        # MoE routing and dispatch
        num_moe_experts=num_experts,
        moe_router_topk=topk,
        # The router is never built; pre-softmax only keeps __post_init__ from rejecting K=1.
        moe_router_pre_softmax=True,
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=kind,
        moe_expert_capacity_factor=None,
        moe_pad_expert_input_to_capacity=False,
        moe_permute_fusion=False,
        moe_router_padding_for_quantization=False,
        moe_shared_expert_intermediate_size=None,
        moe_shared_expert_overlap=False,
        cuda_graph_impl="none",
    )


def build_megatron_dispatcher(
    kind: str, num_experts: int, topk: int, hidden: int, group: dist.ProcessGroup | None = None
):
    """Construct one of Megatron-Core's token dispatchers over ``group``.

    Collective: every rank of the default world must call it (the first call initialises
    Megatron's ``parallel_state``, see the module docstring). ``torch.distributed`` must
    be initialised and, for NCCL, ``torch.cuda.set_device`` called already: the alltoall
    dispatcher creates its device-to-host CUDA stream on the current device.

    Args:
        kind: ``"alltoall"`` (``MoEAlltoAllTokenDispatcher``) or ``"allgather"``
            (``MoEAllGatherTokenDispatcher``).
        num_experts: ``E``, a multiple of the group size ``W``.
        topk: ``K``, experts per token, ``1 <= K <= E``.
        hidden: ``H``.
        group: the EP group; ``None`` means the default (WORLD) group. Expert-parallel
            size is its size; tensor parallel and expert tensor parallel are 1.

    Returns:
        The dispatcher, holding rank ``r``'s experts ``[r*E_local, (r+1)*E_local)``
        (``r`` this rank's index in ``group``), configured bf16, dropless
        (capacity factor None), ``moe_permute_fusion=False``. Feed it to
        ``megatron_round_trip``.
    """
    _require_megatron()
    if kind not in _DISPATCHER_CLASSES:
        raise ValueError(f"kind must be one of {sorted(_DISPATCHER_CLASSES)}, got {kind!r}")
    _check_positive_int("num_experts", num_experts)
    _check_positive_int("topk", topk)
    _check_positive_int("hidden", hidden)
    if topk > num_experts:
        raise ValueError(f"topk ({topk}) must be <= num_experts ({num_experts})")
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before building the dispatcher")
    group = dist.group.WORLD if group is None else group
    ep_size = dist.get_world_size(group)
    ep_rank = dist.get_rank(group)
    if num_experts % ep_size != 0:
        raise ValueError(f"num_experts ({num_experts}) must be a multiple of the group size ({ep_size})")
    num_local = num_experts // ep_size

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TE/Apex-missing notices, moe_* defaults notices
        from megatron.core.transformer.moe import token_dispatcher

        _ensure_parallel_state(ep_size)
        config = _transformer_config(kind, num_experts, topk, hidden, ep_size)
    cls = getattr(token_dispatcher, _DISPATCHER_CLASSES[kind])
    local_expert_indices = list(range(ep_rank * num_local, (ep_rank + 1) * num_local))
    return cls(num_local, local_expert_indices, config=config, pg_collection=_process_groups(group))


# ----------------------------------------------------------------------------- the round trip


def _identity_experts(
    rows: torch.Tensor, tokens_per_expert: torch.Tensor, permuted_probs: torch.Tensor, weight_by_probs: bool,
    first_expert: int | None = None, num_experts: int = 0,
) -> torch.Tensor:
    """Experts that compute nothing: ``rows``, or ``rows`` weighted as Megatron's experts do.

    Megatron's experts multiply their activations by ``permuted_probs`` and cast back to
    the activation dtype (experts.py, ``bias_act_func``); the weighted branch does the same
    to the input rows. With ``first_expert`` (this rank's first global expert), each
    expert also scales its rows by a factor of its own (``common.by_expert``, the
    benchmark's checked experts), in the same multiply.
    """
    if first_expert is not None:
        return by_expert(rows, tokens_per_expert, first_expert, num_experts,
                         permuted_probs if weight_by_probs else None)
    if not weight_by_probs:
        return rows
    return (rows * permuted_probs.unsqueeze(-1)).to(rows.dtype)


def megatron_round_trip(
    dispatcher,
    hidden_states: torch.Tensor,
    routing_map: torch.Tensor,
    probs: torch.Tensor,
    *,
    weight_by_probs: bool = False,
    first_expert: int | None = None,
    timer=None,
) -> torch.Tensor:
    """Dispatch then combine through ``dispatcher``, with identity experts between.

    The stages and their arguments are those of ``MoELayer.forward`` in 0.19.2
    (``preprocess`` -> ``dispatch`` -> ``routed_experts_compute`` -> ``combine`` ->
    ``postprocess``):

        dispatch_preprocess(x, routing_map, probs) -> (rows, p)        local permute
        token_dispatch(rows, p)                    -> (rows, p)        all-to-all / all-gather
        dispatch_postprocess(rows, p)              -> (rows [N, H], tokens_per_expert [E_local], p [N])
        experts(rows, tokens_per_expert, p)        -> y [N, H]         identity here
        combine_preprocess(y) -> token_combine(.) -> combine_postprocess(.) -> out

    Collective over the dispatcher's group. Not re-entrant: Megatron keeps the state of
    one round trip on the dispatcher object between the stages. The alltoall dispatcher
    syncs with the host once (split sizes for NCCL); the allgather one once as well
    (tokens per local expert). Wrap the call in ``torch.no_grad()`` to time forward only;
    every stage is differentiable if the inputs require grad.

    Args:
        dispatcher: from ``build_megatron_dispatcher``.
        hidden_states: ``[T, H]`` (or ``[S, B, H]``, ``T = S*B``) bf16, contiguous.
            For ``allgather``, ``T`` must be the same on every rank.
        routing_map: ``[T, E]`` bool, exactly ``K`` Trues per row (the alltoall dispatcher
            sizes its buffers as ``T*K`` rows).
        probs: ``[T, E]`` float32, the weights where ``routing_map`` is True.
        weight_by_probs: False: identity experts, ``out = K * x``. True: the experts
            multiply their rows by the routing weight (as Megatron's experts do), so
            ``out[t] ~= x[t] * sum_k w[t, k]``. See the module docstring for where the
            sums happen and in which dtype.
        first_expert: this rank's first global expert: each expert also scales its
            rows by its own factor (``common.by_expert``), ``out[t] ~= x[t] *
            sum_k w[t, k] (1 + e_k / E)`` weighted; None: not.

    Returns:
        ``out``, same shape and dtype as ``hidden_states``.
    """
    if hidden_states.dim() not in (2, 3):
        raise ValueError(f"hidden_states must be [T, H] or [S, B, H], got shape {tuple(hidden_states.shape)}")
    num_tokens = hidden_states.numel() // hidden_states.shape[-1]
    if routing_map.dtype != torch.bool or routing_map.dim() != 2 or routing_map.shape[0] != num_tokens:
        raise ValueError(
            f"routing_map must be a [T={num_tokens}, E] bool tensor, got {routing_map.dtype} "
            f"{tuple(routing_map.shape)}"
        )
    if probs.shape != routing_map.shape:
        raise ValueError(f"probs must have routing_map's shape {tuple(routing_map.shape)}, got {tuple(probs.shape)}")
    if not hidden_states.is_contiguous():
        raise ValueError("hidden_states must be contiguous (Megatron reshapes it with .view)")

    rows, p = dispatcher.dispatch_preprocess(hidden_states, routing_map, probs)
    mark(timer, "plan")
    rows, p = dispatcher.token_dispatch(rows, p)
    mark(timer, "exchange_out")
    rows, tokens_per_expert, p = dispatcher.dispatch_postprocess(rows, p)
    mark(timer, "expand")
    y = _identity_experts(rows, tokens_per_expert, p, weight_by_probs, first_expert, routing_map.shape[1])
    y = dispatcher.combine_preprocess(y)
    mark(timer, "presum")
    y = dispatcher.token_combine(y)
    mark(timer, "exchange_back")
    out = dispatcher.combine_postprocess(y)
    mark(timer, "final_sum")
    return out


# ----------------------------------------------------------------------------- routing format


def routing_to_megatron(
    topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, *, check: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our top-k routing as Megatron's dense routing map and probs.

    Args:
        topk_idx: ``[T, K]`` int64, global expert ids in ``[0, E)``, no ``-1`` (empty)
            slots and no expert twice in one row: Megatron's alltoall dispatcher counts on
            exactly ``K`` experts per token.
        topk_weights: ``[T, K]`` float32, the routing weight of each slot.
        num_experts: ``E``.
        check: verify the ids (range, no duplicates in a row); costs one host sync.

    Returns:
        ``(routing_map [T, E] bool, probs [T, E] float32)`` on ``topk_idx``'s device:
        ``routing_map[t, topk_idx[t, k]] = True`` and
        ``probs[t, topk_idx[t, k]] = topk_weights[t, k]``, False / 0 elsewhere.
    """
    _check_positive_int("num_experts", num_experts)
    if topk_idx.dim() != 2 or topk_idx.dtype != torch.int64:
        raise ValueError(f"topk_idx must be a [T, K] int64 tensor, got {topk_idx.dtype} {tuple(topk_idx.shape)}")
    if topk_weights.shape != topk_idx.shape:
        raise ValueError(
            f"topk_weights must have topk_idx's shape {tuple(topk_idx.shape)}, got {tuple(topk_weights.shape)}"
        )
    if not topk_weights.is_floating_point():
        raise TypeError(f"topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_weights.device != topk_idx.device:
        raise ValueError(f"topk_weights is on {topk_weights.device}, topk_idx on {topk_idx.device}")
    num_tokens, topk = topk_idx.shape
    if topk > num_experts:
        raise ValueError(f"K ({topk}) must be <= num_experts ({num_experts})")
    if check and topk_idx.numel() > 0:
        out_of_range = ((topk_idx < 0) | (topk_idx >= num_experts)).any()
        ids = topk_idx.sort(dim=1).values
        repeated = (ids[:, 1:] == ids[:, :-1]).any()
        if bool(out_of_range | repeated):  # host sync: validate the ids
            raise ValueError(
                f"topk_idx must hold distinct expert ids in [0, {num_experts}) in every row "
                "(no -1 slots, no expert twice in a row)"
            )

    device = topk_idx.device
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool, device=device)
    routing_map.scatter_(1, topk_idx, True)
    probs = torch.zeros(num_tokens, num_experts, dtype=torch.float32, device=device)
    probs.scatter_(1, topk_idx, topk_weights.to(torch.float32))
    return routing_map, probs
