"""DeepEP's intranode kernels beside ours in ``dispatch-bench dispatch``, where
``deep_ep`` imports (it is not a dependency: build it on the GPU machine from its
public source, ``bench/build_deepep.sh``).

What its row includes, against ours: DeepEP's dispatch hands each rank every
token that has an expert there once, rank-major, with its top-k ids and weights
(no expansion to the expert-major rows that ours and Megatron's experts get);
its combine sums the rows home unweighted. So that the row computes what ours
does, its experts here multiply each received row by the sum of its local
slots' weights, each times its expert's own factor (``common.expert_factor``:
the benchmark's check sees a row at the wrong expert), in one elementwise
kernel (fp32 math, rounded once to bf16) before the combine: a cost ours does
not pay (it weighs inside its combine), which a real layer would fold into its
experts. Two rows, each beside one of ours: eager (its layout kernel, and its dispatch reads
the received count on the host once, as ours does without ``max_rows``),
beside our eager round trip; and its kernels alone along a cached layout (its
handle reused: no layout, no host read), beside our round trip captured in a
CUDA graph.
Its SM budget is DeepEP's usual 24 (``Buffer.set_num_sms``; ours takes every SM
unless ``Tuning.sm_budget``), its configs its defaults for the group size.
"""

from __future__ import annotations

import functools

import torch

from dispatch.bench.common import expert_factor
from dispatch.timing import mark

NUM_SMS = 24
NVL_BYTES = int(2e9)  # DeepEP's own intranode test's buffer


@functools.lru_cache(maxsize=1)
def deepep_available() -> bool:
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False
    return True


def build_buffer(group=None):
    """A DeepEP ``Buffer`` over ``group`` (None: the world; a collective: every rank builds it)."""
    import deep_ep
    import torch.distributed as dist

    deep_ep.Buffer.set_num_sms(NUM_SMS)
    return deep_ep.Buffer(group if group is not None else dist.group.WORLD, NVL_BYTES)


def deepep_round_trip(buffer, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                      num_experts: int, timer=None):
    """Layout, dispatch, weighted identity experts, combine: DeepEP eager.
    Returns (``[T, H]`` bf16, the layout ``deepep_cached_round_trip`` reuses).

    Phases marked on ``timer``: plan (the layout), exchange_out (dispatch, its
    host read of the received count included), presum (the experts'
    weighting), exchange_back (combine)."""
    import deep_ep

    idx = topk_idx.to(getattr(deep_ep, "topk_idx_t", torch.int64))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    mark(timer, "plan")
    recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        topk_idx=idx, topk_weights=topk_weights.float())
    mark(timer, "exchange_out")
    scale = _scale(buffer, recv_idx, recv_w, num_experts)
    y = recv_x.mul_(scale)  # one kernel: fp32 math, rounded once (recv_x is this call's own)
    mark(timer, "presum")
    out, _, _ = buffer.combine(y, handle)
    mark(timer, "exchange_back")
    return out, (handle, scale)


def _scale(buffer, recv_idx: torch.Tensor, recv_w: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[N, 1] fp32: per received token, its local slots' weights, each times its
    expert's factor (``recv_idx``: local expert ids on this rank, -1 elsewhere)."""
    first = buffer.rank * (num_experts // buffer.group_size)
    factor = torch.where(recv_idx >= 0, expert_factor(recv_idx.clamp(min=0) + first, num_experts), 0.0)
    return (recv_w.float() * factor).sum(1, keepdim=True)


def deepep_cached_round_trip(buffer, x: torch.Tensor, layout, timer=None) -> torch.Tensor:
    """DeepEP's kernels alone: dispatch and combine along the layout of an
    earlier round trip on the same routing (its handle reused: no layout
    kernel and no host read, as its own tests time it, with its default tuned
    configs), the same weighting; ``[T, H]`` bf16. Phases as
    ``deepep_round_trip``'s, without plan."""
    handle, scale = layout
    recv_x = buffer.dispatch(x, handle=handle)[0]
    mark(timer, "exchange_out")
    y = recv_x.mul_(scale)
    mark(timer, "presum")
    out, _, _ = buffer.combine(y, handle)
    mark(timer, "exchange_back")
    return out
