"""Routing properties of the dispatchers, on worlds of 1-4 ranks, against the dense reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rank_fns
from reference import reference_combine, reference_dispatch
from routing import MODES, identity_tokens, make_routing, random_tokens, routings

WORLD_SIZES = [1, 2, 3, 4]
VARIANTS = ["alltoall", "allgather", "hierarchical", "auto"]
# ranks per node of the hierarchical variant by world size (4: 2 x 2, 4 x 1, 1 x 4; 6: 3 x 2, 2 x 3)
LAYOUTS = {1: [1], 2: [1, 2], 3: [1, 3], 4: [2, 1, 4], 6: [2, 3]}
HIDDEN = 5
SETTINGS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
# the other variants run every property too, on fewer examples each (the suite shares 2 cores)
VARIANT_SETTINGS = settings(
    max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def variant_cases(world_sizes, variants=VARIANTS):
    """pytest params (world_size, variant, local_world_size): hierarchical over its
    layouts, auto with two nodes where the world splits, the others as one node."""
    cases = []
    for world_size in world_sizes:
        for variant in variants:
            if variant == "hierarchical":
                locals_ = LAYOUTS[world_size]
            elif variant == "auto" and world_size % 2 == 0 and world_size > 2:
                locals_ = [world_size // 2]
            else:
                locals_ = [None]
            for local in locals_:
                layout = "" if local is None else f"-{world_size // local}x{local}"
                cases.append(pytest.param(world_size, variant, local, id=f"w{world_size}-{variant}{layout}"))
    return cases


def variant_config(num_experts, variant, local):
    config = dict(num_experts=num_experts, variant=variant)
    if local is not None:
        config["local_world_size"] = local
    return config


def _same(a, b) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def assert_sums_close(got, want, magnitude, dtypes, what):
    """``got`` equals the reference ``want`` up to a different summation order:
    |got - want| <= 8 eps * magnitude, eps of the coarsest of ``dtypes`` and
    ``magnitude`` the reference computed on absolute values."""
    eps = max(torch.finfo(d).eps for d in dtypes)
    err = (got.double() - want.double()).abs()
    bound = 8 * eps * magnitude.double() + torch.finfo(got.dtype).tiny
    assert bool((err <= bound).all()), f"{what}: off by {float((err - bound).max()):.3g} beyond the rounding bound"


def _run_round_trip(world, routing, xs, weights, config, experts="identity"):
    args = [
        (xs[r], routing.topk_idx[r], weights[r], config, experts) for r in range(routing.world_size)
    ]
    return world.run(rank_fns.round_trip, args)


def _check_dispatch(results, routing, xs, weights):
    """Property 1 (each expert gets exactly its tokens, canonical order) and 2 (counts)."""
    ref = reference_dispatch(xs, routing.topk_idx, weights, routing.num_experts)
    per_rank = routing.num_experts // routing.world_size
    for rank, (got, want) in enumerate(zip(results, ref)):
        assert torch.equal(got["src_rank"], want.src_rank), f"rank {rank}: wrong source ranks"
        assert torch.equal(got["src_token"], want.src_token), f"rank {rank}: wrong source tokens"
        assert torch.equal(got["tokens"], want.tokens), f"rank {rank}: wrong token values"
        assert torch.equal(got["weights"], want.weights), f"rank {rank}: wrong weights"
        assert torch.equal(got["tokens_per_expert"], want.tokens_per_expert)
        assert torch.equal(got["tokens_per_expert_host"], want.tokens_per_expert)
        assert got["tokens_per_expert_host"].device.type == "cpu"
    all_idx = torch.cat([t.flatten() for t in routing.topk_idx])
    routed = all_idx[all_idx >= 0]
    per_expert = torch.cat([got["tokens_per_expert"] for got in results])
    assert int(per_expert.sum()) == routed.numel()
    assert torch.equal(per_expert, torch.bincount(routed, minlength=routing.num_experts))
    assert sum(got["tokens"].shape[0] for got in results) == routed.numel()
    assert per_expert.numel() == per_rank * routing.world_size
    return ref


@pytest.mark.parametrize("world_size, variant, local", variant_cases(WORLD_SIZES, ["alltoall"]))
@SETTINGS
@given(data=st.data())
def test_identity_round_trip(worlds, world_size, variant, local, data):
    """Properties 1-3: exact routing, counts, and combine(dispatch(x)) == x * sum(weights)."""
    _identity_round_trip(worlds, world_size, variant, local, data)


@pytest.mark.parametrize("world_size, variant, local", variant_cases(WORLD_SIZES + [6], VARIANTS[1:]))
@VARIANT_SETTINGS
@given(data=st.data())
def test_identity_round_trip_variants(worlds, world_size, variant, local, data):
    _identity_round_trip(worlds, world_size, variant, local, data)


def _identity_round_trip(worlds, world_size, variant, local, data):
    routing = data.draw(routings(world_size))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    weight_dtype = data.draw(st.sampled_from([dtype, torch.bfloat16, torch.float16]))  # k/8: exact in all
    idx_dtype = data.draw(st.sampled_from([torch.int64, torch.int32]))
    xs = [identity_tokens(r, t, HIDDEN, dtype) for r, t in enumerate(routing.num_tokens)]
    weights = [w.to(weight_dtype) for w in routing.topk_weights]
    config = variant_config(routing.num_experts, variant, local)
    args = [
        (xs[r], routing.topk_idx[r].to(idx_dtype), weights[r], config) for r in range(world_size)
    ]
    results = worlds(world_size).run(rank_fns.round_trip, args)
    _check_dispatch(results, routing, xs, weights)
    for rank, got in enumerate(results):
        live = (routing.topk_idx[rank] >= 0).to(dtype)
        expected = xs[rank] * (weights[rank].to(dtype) * live).sum(1, keepdim=True)
        assert torch.equal(got["combined"], expected), f"rank {rank}: combine(dispatch(x)) != x * sum(w)"


@pytest.mark.parametrize("world_size, variant, local", variant_cases([2, 4], ["alltoall"]))
@SETTINGS
@given(data=st.data())
def test_combine_matches_reference_bitwise(worlds, world_size, variant, local, data):
    """Arbitrary values, per-expert experts: the sums happen in the reference's order, bit for bit
    on CPU."""
    _combine_matches_reference(worlds, world_size, variant, local, data)


@pytest.mark.parametrize("world_size, variant, local", variant_cases([2, 4, 6], VARIANTS[1:]))
@VARIANT_SETTINGS
@given(data=st.data())
def test_combine_matches_reference_variants(worlds, world_size, variant, local, data):
    """As the bitwise test; where a variant sums in another order (allgather's fp32
    reduce-scatter, hierarchical's per-node sums) within the rounding of that order.
    hierarchical with one node or one rank per node is bitwise."""
    _combine_matches_reference(worlds, world_size, variant, local, data)


def _bitwise(variant, local, world_size, wire_dtype, fp64=False):
    """Whether the variant's combine is the reference's bits: the allgather's
    reduce-scatter sums in fp32 on an fp32 wire, but not where fp64 data or
    weights (``fp64``) make its sums fp64, in rank order as the all-to-all's."""
    if variant == "hierarchical":
        return local in (1, world_size)
    if variant == "allgather":
        return wire_dtype != torch.float32 or fp64
    return variant == "alltoall"


def _combine_matches_reference(worlds, world_size, variant, local, data):
    routing = data.draw(routings(world_size))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
    weight_dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    seed = data.draw(st.integers(0, 10**6))
    xs = [random_tokens(r, t, HIDDEN, dtype, seed) for r, t in enumerate(routing.num_tokens)]
    weights = [
        torch.rand(w.shape, generator=torch.Generator().manual_seed(seed + r)).to(weight_dtype)
        for r, w in enumerate(routing.topk_weights)
    ]
    config = variant_config(routing.num_experts, variant, local)
    results = _run_round_trip(worlds(world_size), routing, xs, weights, config, experts="scaled")
    ref = _check_dispatch(results, routing, xs, weights)
    scaled = [
        d.tokens * rank_fns.expert_scale(d.tokens_per_expert, dtype, "cpu") for d in ref
    ]
    expected = reference_combine(scaled, ref, routing.num_tokens, weights=[d.weights for d in ref])
    on_gpu = worlds(world_size).on_gpu
    chosen = {got["variant"] for got in results}
    assert len(chosen) == 1, f"ranks chose different variants: {chosen}"
    if not _bitwise(chosen.pop(), local, world_size, dtype, torch.float64 in (dtype, weight_dtype)):
        magnitude = reference_combine(
            [s.abs().double() for s in scaled], ref, routing.num_tokens, weights=[d.weights.abs().double() for d in ref]
        )
        for rank, got in enumerate(results):
            assert got["combined"].dtype == dtype
            assert_sums_close(got["combined"], expected[rank], magnitude[rank], (dtype,), f"rank {rank}")
        return
    for rank, got in enumerate(results):
        assert got["combined"].dtype == dtype
        if on_gpu:
            # The GPU kernel may fuse a slot's multiply into its add (one rounding
            # fewer per slot); same order, so within a few units in the last place.
            eps = torch.finfo(dtype).eps
            torch.testing.assert_close(got["combined"], expected[rank], rtol=4 * eps, atol=4 * eps)
        else:
            assert torch.equal(got["combined"], expected[rank]), f"rank {rank}: combine differs from reference"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size, variant, local", variant_cases(WORLD_SIZES) + variant_cases([6], VARIANTS[1:]))
def test_adversarial_routings(worlds, world_size, variant, local, mode):
    """Each adversarial shape explicitly, with T = 0 on rank 0 and K = 1 / K = E covered."""
    for topk, tokens in [(1, [0] + [6] * (world_size - 1)), (3, [7] * world_size)]:
        routing = make_routing(world_size, 2, topk, tokens, mode, seed=world_size * 10 + topk)
        xs = [identity_tokens(r, t, HIDDEN, torch.float64) for r, t in enumerate(routing.num_tokens)]
        config = variant_config(routing.num_experts, variant, local)
        results = _run_round_trip(worlds(world_size), routing, xs, routing.topk_weights, config)
        _check_dispatch(results, routing, xs, routing.topk_weights)
        for rank, got in enumerate(results):
            live = (routing.topk_idx[rank] >= 0).double()
            expected = xs[rank] * (routing.topk_weights[rank] * live).sum(1, keepdim=True)
            assert torch.equal(got["combined"], expected)


@pytest.mark.parametrize("world_size, variant, local", variant_cases([2, 3]))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_two_runs_bitwise_identical(worlds, world_size, variant, local, data):
    """Property 5: determinism (no atomics, fixed summation order)."""
    routing = data.draw(routings(world_size))
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 7) for r, t in enumerate(routing.num_tokens)]
    weights = [w.float() * 1.37 for w in routing.topk_weights]
    config = variant_config(routing.num_experts, variant, local)
    first = _run_round_trip(worlds(world_size), routing, xs, weights, config, experts="scaled")
    second = _run_round_trip(worlds(world_size), routing, xs, weights, config, experts="scaled")
    for a, b in zip(first, second):
        for key in a:
            assert _same(a[key], b[key]), key


@pytest.mark.parametrize("wire", ["bf16", "fp32"])
@pytest.mark.parametrize("world_size, variant, local", variant_cases([2, 3]) + variant_cases([4], VARIANTS[1:]))
def test_cast_wires(worlds, world_size, variant, local, wire):
    """bf16/fp32 wires: routing stays exact, values are the wire-rounded ones, output dtype is kept."""
    wire_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[wire]
    routing = make_routing(world_size, 3, 4, [9] * world_size, "random", seed=3)
    xs = [random_tokens(r, t, HIDDEN, torch.float64, 5) for r, t in enumerate(routing.num_tokens)]
    config = variant_config(routing.num_experts, variant, local)
    config.update(dispatch_wire=wire, combine_wire=wire)
    results = _run_round_trip(worlds(world_size), routing, xs, routing.topk_weights, config)
    rounded = [x.to(wire_dtype).double() for x in xs]
    ref = reference_dispatch(rounded, routing.topk_idx, routing.topk_weights, routing.num_experts)
    expected = reference_combine(
        [d.tokens for d in ref], ref, routing.num_tokens, weights=[d.weights for d in ref], wire_dtype=wire_dtype
    )
    bitwise = _bitwise(results[0]["variant"], local, world_size, wire_dtype, fp64=True)  # x in fp64
    magnitude = reference_combine(
        [d.tokens.abs() for d in ref], ref, routing.num_tokens, weights=[d.weights.abs() for d in ref]
    )
    for rank, got in enumerate(results):
        assert got["tokens"].dtype == torch.float64
        assert torch.equal(got["tokens"], ref[rank].tokens)
        if bitwise:
            assert torch.equal(got["combined"], expected[rank])
        else:
            assert_sums_close(got["combined"], expected[rank], magnitude[rank], (wire_dtype,), f"rank {rank}")


@pytest.mark.parametrize("world_size, variant, local", variant_cases([2, 4]) + variant_cases([1], ["alltoall"]))
def test_two_dispatches_in_flight(worlds, world_size, variant, local):
    """Handles are independent: combine the second micro-batch, then the first
    (one rank: on one GPU, the all-to-all's plan replayed as CUDA graphs)."""
    first = make_routing(world_size, 2, 3, [8] * world_size, "random", seed=21)
    second = make_routing(world_size, 2, 3, [8] * world_size, "one_rank", seed=22)
    xs = [identity_tokens(r, 8, HIDDEN, torch.float32) for r in range(world_size)]
    weights = [w.float() for w in first.topk_weights]
    args = [
        (xs[r], first.topk_idx[r], second.topk_idx[r], weights[r], variant_config(first.num_experts, variant, local))
        for r in range(world_size)
    ]
    results = worlds(world_size).run(rank_fns.two_in_flight, args)
    for rank, (out_first, out_second) in enumerate(results):
        for routing, got in ((first, out_first), (second, out_second)):
            live = (routing.topk_idx[rank] >= 0).float()
            assert torch.equal(got, xs[rank] * (weights[rank] * live).sum(1, keepdim=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the plan is captured only there)")
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_plan_graphs_match_eager_plan(worlds, world_size):
    """The CUDA-graph replay of the plan (used on GPUs) gives the eager plan's results."""
    routing = make_routing(world_size, 3, 4, [9, 0, 5][:world_size], "sparse", seed=5)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 3) for r, t in enumerate(routing.num_tokens)]
    weights = [w.float() for w in routing.topk_weights]
    runs = []
    for graphs in (False, True):
        config = dict(num_experts=routing.num_experts, plan_graphs=graphs)
        # three runs on one dispatcher: on CUDA the second captures, the third replays
        args = [(xs[r], routing.topk_idx[r], weights[r], config, "scaled", 3) for r in range(world_size)]
        runs.append(worlds(world_size).run(rank_fns.round_trip, args))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            for key in a:
                assert _same(a[key], b[key]), key
