"""MoEExchange: the exchange pipelined against the expert compute, forward and backward.

Notation as in ``dispatch.plan`` (W, E_local, K, T, H, N); C chunks; H' the
experts' output width.

The tokens of each rank are split into C equal home token ranges; chunk c of
every rank forms one exchange of the group, with its own plan and handle. A
token's output depends only on its own expert rows and on the home-side sum in
ascending rank order, and chunk c's rows are a sub-sequence of the one-shot
canonical order, so with experts that compute each row on its own the output
and the gradients of x and topk_weights are bitwise those of C = 1.

The pipeline uses the dispatcher's public asynchronous verbs only. Forward::

    start dispatch 0 .. C-1              (each: plan, then the rows leave)
    for c: wait dispatch c -> experts(c) -> start combine c
    wait combine 0 .. C-1

so that the rows of chunks c + 1.. travel while the experts compute chunk c, and
the way home of chunk c while they compute chunk c + 1. Backward is the mirror
image: the output gradient of every chunk is dispatched ahead along its handle
(``dispatch_rows``), then per chunk the experts' backward and the start of its
gradients' way home (``combine_rows`` for x, ``combine_slots`` for the routing
weights). On CUDA the exchanges run on the dispatcher's communication stream
(``comm_priority``), ordered against the caller's stream by events only; on CPU
they are asynchronous collectives. Each chunk's plan makes its own counts
exchange (one host synchronisation per chunk, before the experts start).

Experts' parameters: for a plain :class:`GroupedExperts` (its own ``forward``
and parameters, no module hooks, no autocast: ``_plain_grouped_experts``) the
backward of each chunk computes only the rows' gradients, and the weight
gradients are formed once, after the last chunk and while its gradients travel
home, from every chunk's rows held expert-major (``experts.ChunkedExperts``):
the same GEMM over the same rows for every C. Other experts are differentiated
chunk by chunk by autograd, their parameter gradients accumulated in place in
the parameters' dtype: bitwise those of C = 1 when these sums are exact, equal
to rounding otherwise.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from dispatch import checks
from dispatch.dispatchers.base import TokenDispatcher
from dispatch.experts import ChunkedExperts, GroupedExperts
from dispatch.kernels.gather_sum import accumulate_dtype


def chunk_bounds(num_tokens: int, chunks: int) -> tuple[int, ...]:
    """C + 1 home token bounds: chunk c is tokens ``[c T // C, (c + 1) T // C)``."""
    return tuple(c * num_tokens // chunks for c in range(chunks + 1))


class MoEExchange(nn.Module):
    """dispatch -> experts -> combine, in C chunks overlapping exchange and compute.

    Args:
        dispatcher: a :class:`TokenDispatcher` (``dispatch.create``). Its config's
            wire formats apply to every direction as in ``dispatch``/``combine``.
        experts: any callable ``(tokens [N, H], tokens_per_expert [E_local] int64
            on the device of tokens) -> [N, H']``, rows in canonical order. If it
            is an ``nn.Module`` it becomes a submodule and the gradients of its
            parameters are computed by the pipelined backward.
        chunks: C >= 1 equal home token ranges, each its own exchange (1: no
            chunking, one dispatch and one combine).
        comm_priority: CUDA priority of the dispatcher's communication stream
            during this layer's exchanges (lower is higher; clamped to the
            device's range). Default -1: the small kernels around the
            collectives are not stuck behind the GEMMs.
    """

    def __init__(self, dispatcher: TokenDispatcher, experts, chunks: int = 1, comm_priority: int = -1):
        super().__init__()
        if not isinstance(dispatcher, TokenDispatcher):
            raise TypeError(f"dispatcher must be a dispatch.TokenDispatcher, got {type(dispatcher).__name__}")
        if not callable(experts):
            raise TypeError(
                f"experts must be callable (tokens, tokens_per_expert) -> out, got {type(experts).__name__}"
            )
        if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
            raise ValueError(f"chunks must be an int >= 1, got {chunks!r}")
        if chunks > 1 and dispatcher.config.capacity_factor is not None:
            raise ValueError(f"chunks={chunks} with DispatchConfig.capacity_factor: the capacity is per dispatch, "
                             "so token chunks would drop other tokens than one dispatch; use chunks=1")
        if isinstance(comm_priority, bool) or not isinstance(comm_priority, int):
            raise TypeError(f"comm_priority must be an int, got {type(comm_priority).__name__}")
        self.dispatcher = dispatcher
        self.experts = experts
        self.chunks = chunks
        self.comm_priority = comm_priority

    def forward(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Args:
            x: [T, H] float16/bfloat16/float32/float64 tokens of this rank (T may be 0).
            topk_idx: [T, K] int32/int64 global expert ids; -1 = empty slot.
            topk_weights: [T, K] floating routing weights.
        Returns:
            [T, H'] in the experts' output dtype (on a rank whose experts got no
            rows, that of the ranks whose did): for each token, the sum over its
            slots of ``weight * experts(row)``, as ``combine(..., weights=...)``.
            Differentiable w.r.t. x, topk_weights and the experts' parameters.
        """
        d = self.dispatcher
        checks.check_dispatch_inputs(x, topk_idx, topk_weights, d.devices)
        bounds = chunk_bounds(x.shape[0], self.chunks)
        with self._priority():
            works = [
                d.dispatch(x[a:b], topk_idx[a:b], topk_weights[a:b], async_op=True)
                for a, b in zip(bounds[:-1], bounds[1:])
            ]
        grad_on = torch.is_grad_enabled()
        anchor = torch.empty(0, device=x.device, requires_grad=grad_on)
        return _PipelineFn.apply(x, topk_weights, anchor, self, works, bounds, grad_on, *self._trained_params())

    def _trained_params(self) -> tuple:
        """The experts' parameters that require grad (none for a plain callable)."""
        if not isinstance(self.experts, nn.Module):
            return ()
        return tuple(p for p in self.experts.parameters() if p.requires_grad)

    @contextlib.contextmanager
    def _priority(self):
        """The dispatcher's exchanges run at this layer's ``comm_priority`` inside."""
        d = self.dispatcher
        before, d.comm_priority = d.comm_priority, self.comm_priority
        try:
            yield
        finally:
            d.comm_priority = before


class _PipelineFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, topk_weights, anchor, layer, works, bounds, grad_on, *params):
        d, experts = layer.dispatcher, layer.experts
        chunks = len(works)
        handles = [work.handle for work in works]
        x_grad_any = handles[0].x_grad_any
        chunked = None
        if _plain_grouped_experts(experts, x.device.type):  # weight gradients once, over all chunks
            chunked = ChunkedExperts(experts, [None] * chunks, [None] * chunks, grad_on)
        weights, leaves, ys, combines = [None] * chunks, [None] * chunks, [None] * chunks, []
        with layer._priority():
            for c in range(chunks):
                out, works[c] = works[c].wait(), None
                handles[c] = out.handle  # as waited for (a pad_to_capacity dispatch places its rows then)
                weights[c] = out.weights
                if chunked is not None:
                    chunked.set_counts(c, out.tokens_per_expert, out.tokens_per_expert_host)
                    y = chunked.forward(c, out.tokens)
                else:
                    leaf = out.tokens.detach().requires_grad_(grad_on and x_grad_any)
                    with torch.set_grad_enabled(grad_on):
                        y = experts(leaf, out.tokens_per_expert)
                    _check_expert_out(y, out.tokens)
                    if grad_on:  # kept for backward; without grad, chunk c's rows die here
                        leaves[c], ys[c] = leaf, y
                combines.append(d.combine(y.detach(), out.handle, weights=out.weights, async_op=True))
                out = y = None
            homes = [work.wait() for work in combines]
        # the output's dtype is that of the first chunk where some rank has rows
        # (a chunk without rows anywhere brings zeros home, in any dtype)
        first = next((c for c in range(chunks) if any(handles[c].has_rows)), chunks - 1)
        result = torch.cat([home.to(homes[first].dtype) for home in homes])
        ctx.layer, ctx.handles, ctx.bounds, ctx.weights = layer, handles, bounds, weights
        ctx.leaves, ctx.ys, ctx.params, ctx.chunked = leaves, ys, params, chunked
        ctx.spent = False
        ctx.x_shape, ctx.x_dtype, ctx.w_dtype = x.shape, x.dtype, topk_weights.dtype
        ctx.anchor_dtype = anchor.dtype
        return result

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.spent:
            raise RuntimeError(
                "MoEExchange's backward ran a second time on one forward (retain_graph=True): each chunk's "
                "expert graph is freed as its gradients are sent; run the forward again"
            )
        ctx.spent = True
        layer, handles, bounds, chunked = ctx.layer, ctx.handles, ctx.bounds, ctx.chunked
        d, config = layer.dispatcher, layer.dispatcher.config
        grad_out = grad_out.contiguous()
        x_any, w_any = handles[0].x_grad_any, handles[0].weights_grad_any
        grad_params = [None] * len(ctx.params)
        to_x, to_w = [], []
        with layer._priority():
            brings = [
                d.dispatch_rows(grad_out[a:b], handle, wire=config.combine_grad_wire, async_op=True)
                for handle, a, b in zip(handles, bounds[:-1], bounds[1:])
            ]
            for c, handle in enumerate(handles):
                grad_rows, brings[c] = brings[c].wait(), None
                y = ctx.ys[c] if chunked is None else chunked.output(c)
                grad_y, grad_w = weighted_grads(grad_rows, ctx.weights[c], y, w_any)
                if chunked is not None:
                    grad_tokens = chunked.backward(c, grad_y, x_any) if x_any or ctx.params else None
                else:
                    grad_tokens = autograd_rows(ctx.leaves[c], y, grad_y, x_any, ctx.params, grad_params)
                    ctx.ys[c] = ctx.leaves[c] = None  # the chunk's graph is spent
                if x_any:
                    to_x.append(d.combine_rows(grad_tokens, handle, wire=config.dispatch_grad_wire, async_op=True))
                if w_any:
                    to_w.append(d.combine_slots(grad_w, handle, async_op=True))
                y = grad_rows = grad_y = grad_w = grad_tokens = None
            if chunked is not None and ctx.params:  # while the last chunk's gradients travel home
                grad_params[:] = chunked.param_grads(ctx.params)
            grad_x = torch.cat([work.wait().to(ctx.x_dtype) for work in to_x]) if x_any else None
            grad_topk = torch.cat([work.wait().to(ctx.w_dtype) for work in to_w]) if w_any else None
        ctx.chunked = None
        needs = ctx.needs_input_grad
        grad_params = [
            torch.zeros_like(p) if g is None and needs[7 + i] else g
            for i, (g, p) in enumerate(zip(grad_params, ctx.params))
        ]
        return (
            grad_x if needs[0] else None,
            grad_topk if needs[1] else None,
            grad_out.new_zeros(0, dtype=ctx.anchor_dtype),
            None,
            None,
            None,
            None,
            *grad_params,
        )


def weighted_grads(grad_rows: torch.Tensor, w: torch.Tensor, y: torch.Tensor, w_any: bool):
    """From the gradients of weighted expert rows: (gradient of the experts'
    output rows, in y's dtype; gradient of each row's weight, or None)."""
    acc = accumulate_dtype(grad_rows.dtype, w.dtype)
    grad_y = (grad_rows.to(acc) * w.to(acc).unsqueeze(1)).to(y.dtype)
    grad_w = (grad_rows.to(acc) * y.detach().to(acc)).sum(1).to(w.dtype) if w_any else None
    return grad_y, grad_w


def autograd_rows(leaf, y, grad_y, rows_grad: bool, params, grad_params: list):
    """Backward of one call of experts differentiated by autograd: the gradient
    of its rows ``leaf`` (if ``rows_grad``; zeros where autograd has none), and
    its parameters' gradients summed into ``grad_params`` in place, in the
    parameters' dtype (as autograd would sum them over calls)."""
    rows_grad = rows_grad and leaf.requires_grad
    inputs = ([leaf] if rows_grad else []) + list(params)
    grads = [None] * len(inputs)
    if inputs and y.requires_grad:
        grads = list(torch.autograd.grad(y, inputs, grad_y, allow_unused=True))
    grad_rows = grads.pop(0) if rows_grad else None
    for i, g in enumerate(grads):
        if g is not None:
            grad_params[i] = g if grad_params[i] is None else grad_params[i].add_(g)
    if rows_grad and grad_rows is None:
        grad_rows = leaf.new_zeros(leaf.shape)
    return grad_rows


def _check_expert_out(y: object, tokens: torch.Tensor) -> None:
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"experts must return a tensor, got {type(y).__name__}")
    if y.dim() != 2 or y.shape[0] != tokens.shape[0] or y.device != tokens.device:
        raise ValueError(
            f"experts must return [N, H'] rows on {tokens.device} for N={tokens.shape[0]} tokens; "
            f"got shape {tuple(y.shape)} on {y.device}"
        )


def _plain_grouped_experts(experts, device_type: str) -> bool:
    """Whether ``experts`` is a :class:`GroupedExperts` that ``ChunkedExperts``
    may compute in its place: ``forward`` not overridden, ``w_in`` and
    ``w_out`` its own parameters and its only ones (not parametrized), no
    module hooks (a hook, such as one that gathers sharded parameters, must see
    each call), and no autocast (whose dtypes the manual backward does not
    replay)."""
    if not isinstance(experts, GroupedExperts) or type(experts).forward is not GroupedExperts.forward:
        return False
    own = experts._parameters
    if set(own) != {"w_in", "w_out"} or own["w_in"] is not experts.w_in or own["w_out"] is not experts.w_out:
        return False
    if any(True for _ in experts.children()) or torch.is_autocast_enabled(device_type):
        return False
    hooks = (experts._forward_hooks, experts._forward_pre_hooks, experts._backward_hooks,
             experts._backward_pre_hooks)
    global_hooks = getattr(nn.modules.module, "_has_any_global_hook", lambda: False)()
    return not any(hooks) and not global_hooks
