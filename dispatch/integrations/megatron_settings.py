"""What the Megatron-Core adapter reads of Megatron's ``TransformerConfig``: the
settings it refuses (whatever the engine, and on the engine it was given), what
Megatron's CUDA graphs capture of the dispatcher, the router padding's alignment
and the experts' capacity (see :mod:`dispatch.integrations.megatron`)."""

from __future__ import annotations

import math

import torch


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (no host reads then)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def refusals(config) -> list[str]:
    """Settings of Megatron's TransformerConfig this adapter does not implement,
    whatever the engine (``engine_refusals``: what depends on it)."""
    def get(name, default=None):
        return getattr(config, name, default)

    problems = []
    if capture(config) == "all" and (get("moe_expert_capacity_factor") is None
                                     or not get("moe_pad_expert_input_to_capacity", False)):
        problems.append(f"{graph_text(config)} without moe_pad_expert_input_to_capacity and a "
                        "moe_expert_capacity_factor (a graph holds the dispatcher only where every expert gets fixed "
                        "rows; Megatron's own alltoall dispatcher needs the same)")
    if capture(config) == "preprocess" and (
        get("moe_pad_expert_input_to_capacity", False) or get("moe_router_padding_for_quantization", False)
        or get("moe_router_padding_for_fp8", False)
    ):
        problems.append(f"cuda_graph_modules={module_names(config)} (moe_preprocess) with padding to capacity or "
                        "router padding for quantization (dispatch_preprocess agrees the slots per token with the "
                        "other ranks and reads them on the host, which a graph cannot hold; Megatron's alltoall "
                        "dispatcher refuses these too)")
    if get("overlap_moe_expert_parallel_comm", False) and get("moe_token_dispatcher_type", "alltoall") != "alltoall":
        problems.append(f"overlap_moe_expert_parallel_comm=True with moe_token_dispatcher_type="
                        f"{get('moe_token_dispatcher_type')!r} (this adapter stands in for 'alltoall')")
    if get("transformer_impl") == "inference_optimized":
        problems.append("transformer_impl='inference_optimized' (inference dispatchers)")
    backend = get("moe_flex_dispatcher_backend")
    flex = get("moe_token_dispatcher_type") == "flex"
    if (flex and backend in ("hybridep", "ncclep") and (get("fp8") or get("fp4"))
            and not get("moe_router_padding_for_quantization", False) and not get("moe_router_padding_for_fp8", False)):
        problems.append(f"moe_token_dispatcher_type='flex' with moe_flex_dispatcher_backend={backend!r} and fp8/fp4 "
                        "(Megatron's experts then leave the quantization padding of their rows to that dispatcher, "
                        "which this adapter does not make; moe_router_padding_for_quantization=True pads them)")
    if flex and get("moe_expert_rank_capacity_factor") is not None:
        problems.append(f"moe_expert_rank_capacity_factor={get('moe_expert_rank_capacity_factor')!r} (a token budget "
                        "per rank of Megatron's HybridEP and NCCL-EP dispatchers; this adapter drops by "
                        "moe_expert_capacity_factor only)")
    return problems


def overlap_refusals(config) -> list[str]:
    """Settings of Megatron's TransformerConfig that ``install(overlap=...)`` (the
    experts by groups of local experts) does not take, besides those ``refusals`` names."""
    def get(name, default=None):
        return getattr(config, name, default)

    problems = []
    if capture(config) is not None:
        problems.append(f"cuda_graph_impl={get('cuda_graph_impl')!r} capturing MoE stages (the pipeline reads its "
                        "counts on the host)")
    if get("moe_pad_expert_input_to_capacity", False) or get("moe_router_padding_for_quantization", False) \
            or get("moe_router_padding_for_fp8", False):
        problems.append("padding to capacity or for quantization (padded rows are placed with the whole dispatch)")
    if get("overlap_moe_expert_parallel_comm", False):
        problems.append("overlap_moe_expert_parallel_comm=True (Megatron's own overlap runs the stages as nodes "
                        "of their own)")
    for name in ("overlap_dispatch_backward_with_experts_wgrad", "delay_wgrad_compute"):
        if get(name, False):
            problems.append(f"{name}=True (the experts' weight gradients come with each group's backward)")
    if get("moe_layer_recompute", False):
        problems.append("moe_layer_recompute=True (the pipeline would move every group again in the recompute)")
    return problems


def engine_refusals(config, engine) -> list[str]:
    """What ``engine`` cannot do of ``config``: padding over more ranks than the
    slots it moves per token, and CUDA graphs that capture every stage (``capture``
    is ``"all"``) without its ``max_rows`` path (the round trip must read nothing on
    the host; padding to capacity, ``refusals``)."""
    problems = []
    padded = any(getattr(config, name, False) for name in (
        "moe_pad_expert_input_to_capacity", "moe_router_padding_for_quantization", "moe_router_padding_for_fp8"))
    if padded and engine.max_topk is not None and engine.world_size > engine.max_topk:
        problems.append(f"padding (to capacity or for quantization) over an EP group of {engine.world_size} ranks "
                        f"(a padded token may go to an expert of every rank; the NVLink engine moves at most "
                        f"{engine.max_topk} per token: transport='nccl' moves any number)")
    if capture(config) != "all":
        return problems
    what = graph_text(config)
    if not getattr(engine, "host_free", False):
        chosen = engine.config
        problems.append(f"{what} without a transport that reads nothing on the host (variant={chosen.variant!r}, "
                        f"transport={chosen.transport!r} here reads split sizes on the host; variant 'alltoall' with "
                        "transport 'nvlink' (or 'auto' on one host with peer access) or 'nvshmem', and variant "
                        "'hierarchical' with transport 'nvshmem', read nothing with max_rows)")
    return problems


def quantization_multiple(config) -> int:
    """The alignment of Megatron's router padding for quantization (0: none), by
    Megatron's own rule (``get_align_size_for_quantization``: 16 for fp8, 32 for
    MXFP8 and fp4, 256 with Transformer Engine's op fuser)."""
    if not (getattr(config, "moe_router_padding_for_quantization", False)
            or getattr(config, "moe_router_padding_for_fp8", False)):
        return 0
    try:
        from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization
    except ImportError as exc:
        raise ValueError("moe_router_padding_for_quantization=True needs megatron-core importable (its alignment "
                         "rule, get_align_size_for_quantization)") from exc
    try:
        multiple = get_align_size_for_quantization(config)
    except (AttributeError, TypeError) as exc:  # a config that is not a TransformerConfig
        raise ValueError(f"moe_router_padding_for_quantization=True: Megatron's alignment rule could not read the "
                         f"config ({exc})") from exc
    if isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 0:
        raise ValueError(f"moe_router_padding_for_quantization: Megatron's alignment is {multiple!r}, not an int >= 0")
    return multiple


def module_names(config) -> list[str]:
    """``cuda_graph_modules`` as names (Megatron normalises them to enum members)."""
    modules = getattr(config, "cuda_graph_modules", ())
    modules = [modules] if isinstance(modules, str) else list(modules or ())
    return [str(getattr(m, "name", m)) for m in modules]


def capture(config) -> str | None:
    """What of the dispatcher Megatron's CUDA graphs capture: None (nothing: the
    graphs of attention and of the router end before ``dispatch_preprocess``),
    ``"preprocess"`` (``dispatch_preprocess`` with the router: ``moe_preprocess``)
    or ``"all"`` (every stage: ``moe``, whole layers, the whole iteration)."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl in (None, "none"):
        return None
    if impl not in ("local", "transformer_engine"):
        return "all"
    names = set(module_names(config))
    if not names or names == {"full"} or "moe" in names:
        return "all"
    if "moe_preprocess" in names or (impl == "local" and "moe_router" in names):  # local graphs take both
        return "preprocess"
    return None


def graph_text(config) -> str:
    """How the error messages name graphs of every stage."""
    impl = getattr(config, "cuda_graph_impl", "none")
    if impl not in ("local", "transformer_engine"):
        captured = "the whole iteration"
    else:
        captured = "moe" if "moe" in module_names(config) else "whole layers"
    return f"cuda_graph_impl={impl!r} capturing {captured}"


def capacity(num_tokens: int, num_experts: int, factor: float) -> int:
    """Megatron's expert capacity (``get_capacity``): ceil(tokens / experts * factor)."""
    return math.ceil((num_tokens / num_experts) * factor)
