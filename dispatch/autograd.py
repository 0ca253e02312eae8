"""The autograd of dispatch and combine: each is the other's adjoint.

The backward of dispatch is the sum of the rows' gradients home (unweighted),
the backward of combine a dispatch of the gradient, so both directions keep the
contract (deduplicated wire, fp32 sums in a fixed order). Every rank joins
both backwards' exchanges, whatever it needs itself (``CombineHandle.x_grad_any``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd.function import once_differentiable

from dispatch.codec import sum_wire_dtype, to_experts_codec
from dispatch.handle import padded, received
from dispatch.kernels.row_grads import weighted_row_grads


class DispatchFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, anchor, routed_weights, call):
        # ``call``: (dispatcher, handle, the exchange of x to the experts started by the verb),
        # one argument (autograd looks at each argument of a call)
        dispatcher, handle, started = call
        ctx.dispatcher, ctx.handle = dispatcher, handle
        return *DispatchFn.outputs(topk_weights, routed_weights, handle, started), x.new_empty(0)

    @staticmethod
    def outputs(topk_weights, routed_weights, handle, started):
        """(tokens, weights) of a dispatch, as its node hands them out (with grad mode off: without one)."""
        tokens = started.result()
        # in topk_weights' dtype: a new tensor where that is another, else the routed weights
        # themselves (a new tensor object on their memory, which nothing reads after the dispatch)
        dtype = topk_weights.dtype
        weights = routed_weights.detach() if routed_weights.dtype == dtype else routed_weights.to(dtype)
        if handle.max_rows is None:  # the N rows as moved (the usual case: no padding)
            return tokens, weights
        return padded(tokens, handle, 0), padded(weights, handle, 0)

    @staticmethod
    @once_differentiable  # (its exchanges are not differentiable: a double backward raises)
    def backward(ctx, grad_tokens, grad_weights, _grad_link):
        # Exchanges follow what the group needs (handle), not this rank alone, so
        # that every rank makes the same collective calls.
        dispatcher, handle = ctx.dispatcher, ctx.handle
        dispatcher._calls.agree(dispatcher._along("the backward of dispatch", handle, lambda: None))
        grad_x = grad_topk = None
        if handle.x_grad_any:
            grad_tokens = received(grad_tokens, handle).contiguous()
            wire = sum_wire_dtype(dispatcher.config.dispatch_grad_wire, grad_tokens.dtype)
            grad_x = handle.transport.to_home(grad_tokens, handle, None, wire).finish()
        if handle.weights_grad_any:
            grad_topk = handle.transport.slots_home(received(grad_weights, handle).contiguous(), handle).finish()
        needs = ctx.needs_input_grad
        return (grad_x if needs[0] else None), (grad_topk if needs[1] else None), None, None, None


class CombineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, expert_out, weights, link, call):
        # ``call``: (dispatcher, handle, the exchange of expert_out home started by the verb)
        dispatcher, handle, started = call
        ctx.dispatcher, ctx.handle = dispatcher, handle
        ctx.out_dtype, ctx.link_dtype = expert_out.dtype, link.dtype
        ctx.weights_dtype = None if weights is None else weights.dtype
        ctx.save_for_backward(
            expert_out if weights is not None and weights.requires_grad else None, weights
        )
        return started.result()

    @staticmethod
    @once_differentiable  # (its exchanges are not differentiable: a double backward raises)
    def backward(ctx, grad_out):
        expert_out, weights = ctx.saved_tensors
        ctx.dispatcher._calls.agree(ctx.dispatcher._along("the backward of combine", ctx.handle, lambda: None))
        grad_out = grad_out.contiguous()
        config = ctx.dispatcher.config
        codec = to_experts_codec(config.combine_grad_wire, grad_out.dtype, config.tuning.fp8_pow2_scales)
        grad_rows = padded(ctx.handle.transport.to_experts(grad_out, ctx.handle, codec).whole(), ctx.handle, 0)
        grad_expert = grad_weights = None
        needs = ctx.needs_input_grad
        if weights is None:
            if needs[0]:
                grad_expert = grad_rows.to(ctx.out_dtype)
        elif needs[0] or needs[1]:
            # expert_out is saved where the weights need a gradient; else rows of its dtype stand in
            y = expert_out if needs[1] else grad_rows.new_empty(0, 0, dtype=ctx.out_dtype)
            grad_expert, grad_weights = weighted_row_grads(grad_rows, weights, y, needs[1])
            grad_expert = grad_expert if needs[0] else None
        return grad_expert, grad_weights, grad_out.new_zeros(0, dtype=ctx.link_dtype), None


def _node(fn: type) -> "Callable":
    """``fn.apply`` without ``torch.autograd.Function``'s Python wrapper where no
    functorch transform is active: the wrapper then only unwraps functorch's dead
    wrappers (tensors that outlived a finished ``torch.func`` transform: not the
    verbs' inputs) and calls the same C-level apply, a few microseconds of every
    dispatch and combine. Its full ``apply`` where a transform is active, or where
    this torch has no such C-level apply. (``torch.compile`` breaks its graph at
    the verbs either way: they read the host and call collectives.)"""
    base = getattr(torch._C, "_FunctionBase", None)
    raw = None if base is None else base.__dict__.get("apply")
    if raw is None:
        return fn.apply
    bound, active = raw.__get__(None, fn), torch._C._are_functorch_transforms_active

    def apply(*args):
        return fn.apply(*args) if active() else bound(*args)

    return apply


def with_grad(node: "Callable", *args):
    """``node(*args)`` with grad mode on: a node made at an async verb's wait,
    in the grad mode of the call (on), not the wait's."""
    with torch.enable_grad():
        return node(*args)


dispatch_node = _node(DispatchFn)  # DispatchFn.apply
combine_node = _node(CombineFn)  # CombineFn.apply
