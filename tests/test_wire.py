"""The routing properties with every wire format, on worlds of 2-4 ranks: routing
stays exact, values are the codec's (within its bound), and gradients with
compressed backward directions stay within the bound of the uncompressed ones."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rank_fns
from dispatch.codec import sum_wire_dtype, to_experts_codec
from dispatch.kernels import quantize
from reference import reference_combine, reference_dispatch
from routing import make_routing, random_tokens, routings
from test_codec import fp8_error_bound

HIDDEN = 131  # one whole 128-channel block and a short one
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _codec_rounded(x: torch.Tensor, wire: str, pow2: bool) -> torch.Tensor:
    codec = to_experts_codec(wire, x.dtype, pow2)
    return codec.unpack(codec.pack(x), x.dtype, x.shape[1])


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize(
    "dispatch_wire, combine_wire, pow2",
    [("fp8", "native", False), ("fp8", "bf16", True), ("fp8", "fp32", False), ("bf16", "bf16", False),
     ("fp32", "native", False), ("native", "bf16", False)],
)
@SETTINGS
@given(data=st.data())
def test_round_trip_with_wire(worlds, world_size, dispatch_wire, combine_wire, pow2, data):
    routing = data.draw(routings(world_size, max_tokens=8))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    seed = data.draw(st.integers(0, 10**6))
    xs = [random_tokens(r, t, HIDDEN, dtype, seed) * 10.0 ** (r - 1) for r, t in enumerate(routing.num_tokens)]
    weights = [w.float() for w in routing.topk_weights]
    config = dict(num_experts=routing.num_experts, dispatch_wire=dispatch_wire, combine_wire=combine_wire,
                  fp8_pow2_scales=pow2)
    args = [(xs[r], routing.topk_idx[r], weights[r], config, "scaled") for r in range(world_size)]
    results = worlds(world_size).run(rank_fns.round_trip, args)

    # Routing is exact and every row is the codec's rounding of its token, bit for
    # bit: the packed layout decodes to the same values on every rank.
    rounded = [_codec_rounded(x, dispatch_wire, pow2) for x in xs]
    ref = reference_dispatch(rounded, routing.topk_idx, weights, routing.num_experts)
    exact_ref = reference_dispatch(xs, routing.topk_idx, weights, routing.num_experts)
    for rank, (got, want) in enumerate(zip(results, ref)):
        assert torch.equal(got["src_rank"], want.src_rank) and torch.equal(got["src_token"], want.src_token)
        assert torch.equal(got["tokens_per_expert"], want.tokens_per_expert)
        assert torch.equal(got["weights"], want.weights)
        assert got["tokens"].dtype == dtype
        assert torch.equal(got["tokens"], want.tokens), f"rank {rank}: rows differ from the codec's rounding"
        # ... and that rounding is within the codec's bound of the true rows
        truth = exact_ref[rank].tokens
        err = (got["tokens"].double() - truth.double()).abs()
        if dispatch_wire == "fp8":
            packed = to_experts_codec("fp8", dtype, pow2).pack(truth)
            bound = fp8_error_bound(truth.float().double(), quantize.split_packed(packed, HIDDEN)[1], quantize.E4M3, dtype)
        elif dispatch_wire == "bf16":
            bound = truth.double().abs() * 2.0**-8
        else:
            bound = torch.zeros_like(err)
        assert not (err > bound).any(), f"rank {rank}: a row is outside the codec's error bound"

    scaled = [d.tokens * rank_fns.expert_scale(d.tokens_per_expert, dtype, "cpu") for d in ref]
    wire_dtype = sum_wire_dtype(combine_wire, dtype)
    expected = reference_combine(scaled, ref, routing.num_tokens, weights=[d.weights for d in ref], wire_dtype=wire_dtype)
    on_gpu = worlds(world_size).on_gpu
    if on_gpu:  # sum of |contributions|: the scale of one partial's rounding
        magnitude = reference_combine([t.abs() for t in scaled], ref, routing.num_tokens,
                                      weights=[d.weights.abs() for d in ref], wire_dtype=torch.float64)
    for rank, got in enumerate(results):
        assert got["combined"].dtype == dtype
        if on_gpu:
            # Fused multiply-adds on the GPU: a few units in the last place of the
            # fp32 pre-sum, and where the wire is narrower, that unit may tip a
            # partial's rounding to the wire: one unit of the wire at its scale.
            eps = torch.finfo(dtype).eps
            wire_unit = torch.finfo(wire_dtype).eps if wire_dtype.itemsize < dtype.itemsize else 0.0
            bound = 4 * eps * (1 + expected[rank].double().abs()) + wire_unit * magnitude[rank].double()
            excess = (got["combined"].double() - expected[rank].double()).abs() - bound
            assert not (excess > 0).any(), f"rank {rank}: combine beyond rounding by {excess.max()}"
        else:
            assert torch.equal(got["combined"], expected[rank])


def _gradient_case(world_size, seed):
    routing = make_routing(world_size, 2, 3, [7] * world_size, "random", seed=seed)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, seed) for r, t in enumerate(routing.num_tokens)]
    grad_out = [random_tokens(r, t, HIDDEN, torch.float32, seed + 1) for r, t in enumerate(routing.num_tokens)]
    ref = reference_dispatch(xs, routing.topk_idx, routing.topk_weights, routing.num_experts)
    expert_out = [random_tokens(r, d.tokens.shape[0], HIDDEN, torch.float32, seed + 2) for r, d in enumerate(ref)]
    weights = [w.float() for w in routing.topk_weights]
    return routing, xs, grad_out, expert_out, weights


def _gradients(worlds, routing, xs, weights, grad_out, expert_out, **wires):
    config = dict(num_experts=routing.num_experts, **wires)
    args = [(xs[r], routing.topk_idx[r], weights[r], grad_out[r], expert_out[r], config)
            for r in range(routing.world_size)]
    return worlds(routing.world_size).run(rank_fns.gradients, args)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("wire", ["fp8", "e5m2", "bf16"])
def test_compressed_combine_backward(worlds, world_size, wire):
    """combine_grad_wire compresses the gradient of the combined output on its way to
    the experts: the gradients are exactly those of the uncompressed run fed the
    codec-rounded gradient, and within the codec's bound of the uncompressed ones."""
    routing, xs, grad_out, expert_out, weights = _gradient_case(world_size, seed=world_size)
    got = _gradients(worlds, routing, xs, weights, grad_out, expert_out, combine_grad_wire=wire)
    rounded = [_codec_rounded(g, wire, False) for g in grad_out]
    same = _gradients(worlds, routing, xs, weights, rounded, expert_out)
    plain = _gradients(worlds, routing, xs, weights, grad_out, expert_out)
    ref = reference_dispatch(grad_out, routing.topk_idx, weights, routing.num_experts)
    for rank in range(world_size):
        for key in ("x", "topk_weights", "expert_out", "weights"):
            assert torch.equal(got[rank][key], same[rank][key]), f"rank {rank}: grad of {key}"
        # grad of expert_out = w * g: the codec's bound on g, times |w|
        g = ref[rank].tokens
        if wire == "bf16":
            bound_g = g.double().abs() * 2.0**-8
        else:
            fmt = quantize.E4M3 if wire == "fp8" else quantize.E5M2
            packed = to_experts_codec(wire, torch.float32).pack(g)
            bound_g = fp8_error_bound(g.double(), quantize.split_packed(packed, HIDDEN)[1], fmt, torch.float32)
        w = plain[rank]["routed_weights"].double().abs().unsqueeze(1)
        err = (got[rank]["expert_out"].double() - plain[rank]["expert_out"].double()).abs()
        assert not (err > w * bound_g * (1 + 1e-6) + 1e-30).any(), f"rank {rank}: grad of expert_out"
        err_w = (got[rank]["weights"].double() - plain[rank]["weights"].double()).abs()
        bound_w = (bound_g * expert_out[rank].double().abs()).sum(1) * (1 + 1e-4) + 1e-5
        assert not (err_w > bound_w).any(), f"rank {rank}: grad of the routed weights"


@pytest.mark.parametrize("world_size", [2, 3])
def test_compressed_dispatch_backward(worlds, world_size):
    """dispatch_grad_wire="bf16": the partial sums of the gradient of x travel in bf16;
    each partial is rounded once, so the error is at most 2^-8 of the sum of the
    magnitudes of the per-slot gradients; the other gradients do not change."""
    routing, xs, grad_out, expert_out, weights = _gradient_case(world_size, seed=10 + world_size)
    got = _gradients(worlds, routing, xs, weights, grad_out, expert_out, dispatch_grad_wire="bf16")
    plain = _gradients(worlds, routing, xs, weights, grad_out, expert_out)
    per_rank = routing.num_experts // world_size
    for rank in range(world_size):
        for key in ("topk_weights", "expert_out", "weights"):
            assert torch.equal(got[rank][key], plain[rank][key]), key
        # per-slot gradient of x: w * g * d(expert)/dt, expert(t) = (1 + e) t + t^2 / 8
        idx, w = routing.topk_idx[rank], weights[rank].double()
        local = torch.where(idx >= 0, idx % per_rank, 0).double()
        slope = (1 + local).unsqueeze(2) + 0.25 * xs[rank].double().unsqueeze(1)  # [T, K, H]
        per_slot = (w * (idx >= 0)).unsqueeze(2) * grad_out[rank].double().unsqueeze(1) * slope
        bound = per_slot.abs().sum(1) * (2.0**-8 + 2.0**-20) + 1e-6
        err = (got[rank]["x"].double() - plain[rank]["x"].double()).abs()
        assert not (err > bound).any(), f"rank {rank}: grad of x outside the bf16 bound"
        assert (err > 0).any() or not (idx >= 0).any(), "bf16 partials should round something"
