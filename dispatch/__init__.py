"""moe-dispatch: expert-parallel token dispatch and combine for MoE training.

Public API::

    cfg = dispatch.DispatchConfig(num_experts=E)
    d = dispatch.create(cfg, group)               # a TokenDispatcher
    out = d.dispatch(x, topk_idx, topk_weights)   # Dispatched
    y = experts(out.tokens, out.tokens_per_expert)
    h = d.combine(y, out.handle, weights=out.weights)

    work = d.dispatch(x, topk_idx, topk_weights, async_op=True)   # DispatchWork
    out = work.wait()                                             # Dispatched
    work = d.combine(y, out.handle, weights=out.weights, async_op=True)   # ExchangeWork
    h = work.wait()
    # moves along a handle, not differentiable (hand-written backwards):
    # d.dispatch_rows(rows, handle), d.combine_rows(rows, handle), d.combine_slots(values, handle)

    layer = dispatch.MoEExchange(d, experts, groups=4)   # the same, by groups of local experts
    h = layer(x, topk_idx, topk_weights)
    pair = dispatch.MoEMicroBatches(d, experts)   # micro-batches at once, each one's exchange under another's experts
    h0, h1 = pair([x0, x1], [topk_idx0, topk_idx1], [topk_weights0, topk_weights1])
"""

from __future__ import annotations

import torch.distributed as dist

from dispatch.agreement import CallsDiffer, PeerRefused, agree_config as _agree_config
from dispatch.config import DispatchConfig, Tuning
from dispatch.cost_model import LinkModel
from dispatch.dispatcher import TokenDispatcher
from dispatch.handle import CombineHandle, Dispatched, DispatchedGroup
from dispatch.transports import build as _build_transport
from dispatch.work import DispatchWork, ExchangeWork, GroupSums
from dispatch import experts  # noqa: F401  (dispatch.experts.GroupedExperts)
from dispatch.pipeline import MoEExchange
from dispatch.micro_batches import MoEMicroBatches
from dispatch.stats import DispatchStats
from dispatch.timing import PhaseTimer

__all__ = [
    "CallsDiffer",
    "CombineHandle",
    "DispatchConfig",
    "DispatchStats",
    "DispatchWork",
    "Dispatched",
    "DispatchedGroup",
    "ExchangeWork",
    "GroupSums",
    "LinkModel",
    "MoEExchange",
    "MoEMicroBatches",
    "PeerRefused",
    "PhaseTimer",
    "TokenDispatcher",
    "Tuning",
    "create",
]
__version__ = "0.1.0"


def create(config: DispatchConfig, group: dist.ProcessGroup | None = None) -> TokenDispatcher:
    """Build the dispatcher ``config`` describes over the EP process ``group``.

    Args:
        config: a :class:`DispatchConfig`.
        group: the expert-parallel process group (default: the whole world).
            ``torch.distributed`` must be initialised.

    The transport comes from the registry (``dispatch.transports``), keyed by
    (variant, transport). On an NCCL group the alltoall and auto variants with
    ``transport`` ``"auto"``, ``"nvlink"`` or ``"nvshmem"``, and the
    hierarchical one with ``"nvshmem"``, make this a collective (the ranks
    agree whether the engine or NVSHMEM can run, and their buffers are
    allocated); so does the first ``create`` over a group of two ranks or
    more that leaves ``Tuning.local_world_size`` unset (its ranks' hosts are
    gathered once, ``comm.group_hosts``). Every rank of the group calls ``create`` with
    the same config, in the same order: the ranks first agree on it (over the
    host channel, waiting at most ``config.timeout`` for a rank that does not
    come), and where their configs differ every rank raises a ValueError naming
    the fields.
    Raises:
        TypeError / ValueError, naming the argument, when ``group`` is not a
        process group this rank belongs to, or the config does not fit the group (``num_experts`` not a multiple of the group size,
        ``local_world_size`` not dividing it, ``transport="nvlink"`` where the
        engine cannot run: not CUDA/NCCL, ranks on several hosts, no CuPy;
        ``transport="nvshmem"`` where NVSHMEM cannot: not CUDA/NCCL, one rank,
        a torch without NVSHMEM, the engine already in the process);
        RuntimeError where torch.distributed is not initialised.
    """
    if not isinstance(config, DispatchConfig):
        raise TypeError(f"config must be a dispatch.DispatchConfig, got {type(config).__name__}")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before dispatch.create")
    member = group is not dist.GroupMember.NON_GROUP_MEMBER  # what new_group gives the ranks outside it
    if member and group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed.ProcessGroup or None, got {type(group).__name__}")
    if not member or dist.get_rank(group) < 0:
        raise ValueError(f"group: rank {dist.get_rank()} of the world is not a member of the group it was given "
                         "(create the dispatcher on the ranks of its group only)")
    _agree_config(config, group)  # first: a config that differs is named on every rank, not refused on one
    world = dist.get_world_size(group)
    if config.num_experts % world != 0:
        raise ValueError(
            f"num_experts={config.num_experts} is not a multiple of the group size {world}; "
            "every rank must hold the same number of experts"
        )
    if config.tuning.local_world_size is not None and world % config.tuning.local_world_size != 0:
        raise ValueError(
            f"local_world_size={config.tuning.local_world_size} does not divide the group size {world}"
        )
    return TokenDispatcher(config, group, _build_transport(config, group))
