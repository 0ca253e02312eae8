"""Property 4: gradients of the round trip, against the dense reference (fp64)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dispatch
import rank_fns
from reference import reference_combine, reference_dispatch
from routing import make_routing, random_tokens, routings
from test_properties import VARIANTS, variant_cases, variant_config
from world import World

HIDDEN = 3


def _backward(loss):
    if loss.requires_grad:  # not when no token was routed anywhere
        loss.backward()


def _grad(leaf):
    return leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)


def _reference_gradients(routing, xs, grad_out, expert_out):
    xs = [x.clone().requires_grad_() for x in xs]
    ws = [w.clone().requires_grad_() for w in routing.topk_weights]
    ref = reference_dispatch(xs, routing.topk_idx, ws, routing.num_experts)
    ys = [
        d.tokens * rank_fns.expert_scale(d.tokens_per_expert, torch.float64, "cpu") + d.tokens * d.tokens * 0.125
        for d in ref
    ]
    out = reference_combine(ys, ref, routing.num_tokens, weights=[d.weights for d in ref])
    _backward(sum((o * g).sum() for o, g in zip(out, grad_out)))

    ys_leaf = [y.clone().requires_grad_() for y in expert_out]
    ws_leaf = [d.weights.detach().clone().requires_grad_() for d in ref]
    out = reference_combine(ys_leaf, ref, routing.num_tokens, weights=ws_leaf)
    _backward(sum((o * g).sum() for o, g in zip(out, grad_out)))
    return [
        {
            "x": _grad(xs[r]),
            "topk_weights": _grad(ws[r]),
            "expert_out": _grad(ys_leaf[r]),
            "weights": _grad(ws_leaf[r]),
        }
        for r in range(routing.world_size)
    ]


def _compare(worlds, routing, seed, variant="alltoall", local=None):
    world_size = routing.world_size
    xs = [random_tokens(r, t, HIDDEN, torch.float64, seed) for r, t in enumerate(routing.num_tokens)]
    grad_out = [random_tokens(r, t, HIDDEN, torch.float64, seed + 1) for r, t in enumerate(routing.num_tokens)]
    ref = reference_dispatch(xs, routing.topk_idx, routing.topk_weights, routing.num_experts)
    expert_out = [random_tokens(r, d.tokens.shape[0], HIDDEN, torch.float64, seed + 2) for r, d in enumerate(ref)]
    config = variant_config(routing.num_experts, variant, local)
    args = [
        (xs[r], routing.topk_idx[r], routing.topk_weights[r], grad_out[r], expert_out[r], config)
        for r in range(world_size)
    ]
    got = worlds(world_size).run(rank_fns.gradients, args)
    want = _reference_gradients(routing, xs, grad_out, expert_out)
    for rank in range(world_size):
        for key in ("x", "topk_weights", "expert_out", "weights"):
            torch.testing.assert_close(
                got[rank][key], want[rank][key], rtol=1e-12, atol=1e-12, msg=f"rank {rank}: grad of {key}"
            )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gradients_match_reference(worlds, world_size, data):
    routing = data.draw(routings(world_size, max_tokens=6))
    _compare(worlds, routing, data.draw(st.integers(0, 10**6)))


@pytest.mark.parametrize("world_size, variant, local", variant_cases([2, 4, 6], VARIANTS[1:]))
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_gradients_match_reference_variants(worlds, world_size, variant, local, data):
    routing = data.draw(routings(world_size, max_tokens=6))
    _compare(worlds, routing, data.draw(st.integers(0, 10**6)), variant, local)


def test_reference_passes_gradcheck():
    """The reference's gradients are those of finite differences, so matching it is gradcheck."""
    routing = make_routing(3, 2, 3, [3, 0, 2], "sparse", seed=11)
    xs = [random_tokens(r, t, 2, torch.float64, 1).requires_grad_() for r, t in enumerate(routing.num_tokens)]
    ws = [w.clone().requires_grad_() for w in routing.topk_weights]

    def round_trip(*tensors):
        x, w = list(tensors[:3]), list(tensors[3:])
        ref = reference_dispatch(x, routing.topk_idx, w, routing.num_experts)
        ys = [d.tokens * d.tokens for d in ref]
        return tuple(reference_combine(ys, ref, routing.num_tokens, weights=[d.weights for d in ref]))

    assert torch.autograd.gradcheck(round_trip, (*xs, *ws))


def _gradcheck_single_rank(seed, variant="alltoall"):
    """gradcheck of the real dispatcher in a world of one (no peer to keep in step)."""
    routing = make_routing(1, 4, 3, [4], "sparse", seed=seed)
    d = dispatch.create(dispatch.DispatchConfig(num_experts=routing.num_experts, variant=variant))
    x = random_tokens(0, 4, 2, torch.float64, seed).requires_grad_()
    w = routing.topk_weights[0].clone().requires_grad_()
    idx = routing.topk_idx[0]

    def round_trip(x, w):
        out = d.dispatch(x, idx, w)
        return d.combine(out.tokens * out.tokens, out.handle, weights=out.weights)

    return torch.autograd.gradcheck(round_trip, (x, w))


def test_gradcheck_world_of_one():
    with World(1, backend="gloo") as world:
        for variant in VARIANTS:
            assert world.run(_gradcheck_single_rank, [(5, variant)]) == [True], variant


def _graph_freed_without_gc(variant):
    """A round trip's autograd graph (and what its nodes keep: here a tensor saved
    by the op that made x) is freed with its outputs by reference counting alone:
    no reference cycle through the handle keeps it (nor, with it, its leaves'
    gradient accumulators and the streams they were made on, which a CUDA graph
    captured after an eager warm-up would then reuse)."""
    import gc
    import weakref

    routing = make_routing(1, 4, 3, [4], "sparse", seed=3)
    d = dispatch.create(dispatch.DispatchConfig(num_experts=routing.num_experts, variant=variant))
    leaf = random_tokens(0, 4, 2, torch.float64, 3).requires_grad_()
    w = routing.topk_weights[0].clone().requires_grad_()
    scale = torch.full((4, 2), 2.0, dtype=torch.float64)
    saved = weakref.ref(scale)
    gc.disable()
    try:
        x = leaf * scale  # its node keeps scale (the gradient of leaf)
        del scale
        out = d.dispatch(x, routing.topk_idx[0], w)
        h = d.combine(out.tokens * 2.0, out.handle, weights=out.weights)
        del x, out, h
        return saved() is None
    finally:
        gc.enable()


def test_round_trip_graph_freed_without_gc():
    with World(1, backend="gloo") as world:
        for variant in VARIANTS:
            assert world.run(_graph_freed_without_gc, [(variant,)]) == [True], variant


@pytest.mark.parametrize(
    "x_grad, w_grad, fresh",
    [
        ((True, False), (False, False), (False, False)),  # only rank 0 needs grad of x
        ((True, False), (False, True), (False, False)),  # rank 0: x, rank 1: weights
        ((True, True), (True, True), (False, True)),  # rank 1's experts return a fresh tensor
    ],
)
@pytest.mark.parametrize("variant", VARIANTS)
def test_ranks_needing_different_gradients(worlds, x_grad, w_grad, fresh, variant):
    """Backward exchanges follow what the group needs: no rank hangs, every
    gradient asked for is the reference's."""
    routing = make_routing(2, 2, 2, [5, 4], "random", seed=9)
    xs = [random_tokens(r, t, HIDDEN, torch.float64, 1) for r, t in enumerate(routing.num_tokens)]
    grad_out = [random_tokens(r, t, HIDDEN, torch.float64, 2) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, variant=variant, local_world_size=1)
    args = [
        (xs[r], routing.topk_idx[r], routing.topk_weights[r], grad_out[r], x_grad[r], w_grad[r], fresh[r], config)
        for r in range(2)
    ]
    got = worlds(2).run(rank_fns.mixed_gradients, args)

    leaves_x = [x.clone().requires_grad_() for x in xs]
    leaves_w = [w.clone().requires_grad_() for w in routing.topk_weights]
    ref = reference_dispatch(leaves_x, routing.topk_idx, leaves_w, routing.num_experts)
    ys = [
        torch.zeros_like(d.tokens) if fresh[r] else d.tokens * d.weights.unsqueeze(1) for r, d in enumerate(ref)
    ]
    out = reference_combine(ys, ref, routing.num_tokens)
    _backward(sum((o * g).sum() for o, g in zip(out, grad_out)))
    for rank in range(2):
        grad_x, grad_w = got[rank]
        assert (grad_x is not None) == x_grad[rank] and (grad_w is not None) == w_grad[rank]
        if x_grad[rank]:
            torch.testing.assert_close(grad_x, _grad(leaves_x[rank]), rtol=1e-12, atol=1e-12)
        if w_grad[rank]:
            torch.testing.assert_close(grad_w, _grad(leaves_w[rank]), rtol=1e-12, atol=1e-12)


def test_a_second_backward_raises_and_an_async_combine_keeps_its_calls_grad_mode(worlds):
    """Gradients taken with create_graph carry no graph through the exchanges,
    so a backward through them raises (they were silently detached); an async
    combine started with grad mode on and waited for under no_grad keeps its
    graph, as the synchronous combine (its graph was cut)."""
    routing = make_routing(2, 4, 2, [6, 5], "random", seed=2)
    args = [(random_tokens(r, routing.num_tokens[r], HIDDEN, torch.float64, 1), routing.topk_idx[r],
             routing.topk_weights[r].double(), dict(num_experts=routing.num_experts)) for r in range(2)]
    for got in worlds(2).run(rank_fns.higher_order_and_async_grad_mode, args):
        assert got["double backward"] is not None and "once_differentiable" in got["double backward"], got
        assert got["graph"] and got["graph, sync"] and got["same gradient"], got
