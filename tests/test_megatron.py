"""The Megatron-Core adapter's six stages on gloo worlds of 1, 2 and 4, without megatron-core:
Megatron-shaped inputs ([S, B, H] hidden states, routing_map [T, E] bool, probs [T, E]),
called in MoELayer.forward's order, checked against the dense reference."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import megatron_rank_fns
from dispatch.integrations.megatron import routing_to_topk
from reference import reference_dispatch
from routing import identity_tokens, make_routing, routings

SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
HIDDEN = 4


def megatron_routing(topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int):
    """[T, K] top-k (with -1 slots) as Megatron's routing_map [T, E] bool and probs [T, E]."""
    routing_map = torch.zeros(topk_idx.shape[0], num_experts, dtype=torch.bool)
    probs = torch.zeros(topk_idx.shape[0], num_experts, dtype=topk_weights.dtype)
    for t, k in (topk_idx >= 0).nonzero().tolist():
        routing_map[t, topk_idx[t, k]] = True
        probs[t, topk_idx[t, k]] = topk_weights[t, k]
    return routing_map, probs


def rank_inputs(routing, rank: int, num_experts: int, dtype=torch.float64):
    """Rank ``rank``'s Megatron-shaped inputs: x [S, B, H] (identity tokens), routing_map,
    probs, and an output gradient like x."""
    count = routing.num_tokens[rank]
    x = identity_tokens(rank, count, HIDDEN, dtype).view(*seq_batch(count), HIDDEN)
    routing_map, probs = megatron_routing(routing.topk_idx[rank], routing.topk_weights[rank], num_experts)
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(rank), dtype=torch.float64).to(dtype)
    return x, routing_map, probs, grad


def seq_batch(count: int) -> tuple[int, int]:
    return (count // 2, 2) if count % 2 == 0 and count else (count, 1)


def dense_layer(x, routing_map, probs, per_rank: int):
    """What the layer computes: out[t] = x[t] * sum_e map[t, e] * probs[t, e] * (1 + e % E_local)."""
    scale = 1 + torch.arange(routing_map.shape[1]) % per_rank
    factor = (routing_map * probs * scale).sum(1)
    return x * factor.view(*x.shape[:-1], 1)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@SETTINGS
@given(data=st.data())
def test_stages_match_the_reference(worlds, world_size, data):
    routing = data.draw(routings(world_size, max_tokens=8))
    topk = routing.topk_idx[0].shape[1]
    num_experts, per_rank = routing.num_experts, routing.num_experts // world_size
    inputs = [rank_inputs(routing, r, num_experts) for r in range(world_size)]
    args = [(*inp, num_experts, topk, {}) for inp in inputs]
    results = worlds(world_size).run(megatron_rank_fns.stage_round_trip, args)

    flat = [x.view(-1, HIDDEN) for x, *_ in inputs]
    ref = reference_dispatch(flat, routing.topk_idx, routing.topk_weights, num_experts)
    for rank, (got, want, (x, routing_map, probs, grad)) in enumerate(zip(results, ref, inputs)):
        assert torch.equal(got["tokens"], want.tokens), f"rank {rank}: wrong rows or order"
        assert torch.equal(got["permuted_probs"], want.weights), f"rank {rank}: wrong permuted_probs"
        assert got["tokens_per_expert"].device.type == "cpu"
        assert got["tokens_per_expert"].dtype == torch.int64
        assert torch.equal(got["tokens_per_expert"], want.tokens_per_expert)
        xl = x.clone().requires_grad_()
        pl = probs.clone().requires_grad_()
        expected = dense_layer(xl, routing_map, pl, per_rank)
        (expected * grad).sum().backward()
        assert got["out"].shape == x.shape
        torch.testing.assert_close(got["out"], expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["x_grad"], xl.grad, rtol=1e-12, atol=1e-12)
        # only the routed entries of probs carry gradient, as in Megatron's dispatchers
        torch.testing.assert_close(got["probs_grad"], pl.grad * routing_map, rtol=1e-12, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(0, 9), experts=st.integers(1, 6), multiple=st.sampled_from([1, 2, 3, 4, 16]),
       seed=st.integers(0, 10**6))
def test_pad_routing_map_is_megatrons_rule(tokens, experts, multiple, seed):
    """For each expert, the first tokens not routed to it are, until its count is a
    multiple (or no token is left): Megatron's pad_routing_map, written out."""
    from dispatch.integrations.megatron import pad_routing_map

    routing_map = torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed)) < 0.4
    want = routing_map.clone()
    for e in range(experts):
        need = (-int(routing_map[:, e].sum())) % multiple
        for t in range(tokens):
            if need and not want[t, e]:
                want[t, e], need = True, need - 1
    assert torch.equal(pad_routing_map(routing_map, multiple), want)
    assert torch.equal(routing_map, torch.rand(tokens, experts, generator=torch.Generator().manual_seed(seed)) < 0.4)


def test_router_padding_for_quantization_stages(worlds):
    """moe_router_padding_for_quantization (alignment 4 here): every rank's count
    per expert is padded to a multiple of 4 with tokens of probability 0, the rows
    are those of the padded routing, and the round trip is the dense layer's."""
    from dispatch.integrations.megatron import pad_routing_map, routing_to_topk

    routing = make_routing(2, 2, 2, [7, 5], "random", seed=4)
    inputs = [rank_inputs(routing, r, 4) for r in range(2)]
    padded = [pad_routing_map(routing_map, 4) for _, routing_map, _, _ in inputs]
    most = max(int(m.sum(1).max()) for m in padded)
    topk = [routing_to_topk(m, probs, most) for m, (_, _, probs, _) in zip(padded, inputs)]
    flat = [x.view(-1, HIDDEN) for x, *_ in inputs]
    ref = reference_dispatch(flat, [i for i, _ in topk], [w for _, w in topk], 4)
    args = [(*inp, 4, 2, {}, None, None, 4) for inp in inputs]
    for rank, (got, want, m, (x, routing_map, probs, grad)) in enumerate(
            zip(worlds(2).run(megatron_rank_fns.stage_round_trip, args), ref, padded, inputs)):
        counts = m.sum(0)  # a multiple of 4, or every token where too few are left to pad with
        assert bool(((counts % 4 == 0) | (counts == m.shape[0])).all()) and not torch.equal(m, routing_map)
        assert torch.equal(got["tokens"], want.tokens) and torch.equal(got["tokens_per_expert"], want.tokens_per_expert)
        assert torch.equal(got["permuted_probs"], want.weights)
        xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
        expected = dense_layer(xl, m, pl, 2)  # the padding's probabilities are 0: the same output
        (expected * grad).sum().backward()
        torch.testing.assert_close(expected.detach(), dense_layer(x, routing_map, probs, 2), rtol=0, atol=0)
        torch.testing.assert_close(got["out"], expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["x_grad"], xl.grad, rtol=1e-12, atol=1e-12)
        # the padded entries are routed: their probabilities get gradients, as in Megatron's dispatcher
        torch.testing.assert_close(got["probs_grad"], pl.grad * m, rtol=1e-12, atol=1e-12)


def test_padding_to_capacity_moves_rows_of_more_than_k_experts(worlds):
    """moe_pad_expert_input_to_capacity: the router's capacity mask names up to every
    expert per token (here 3 and 2 on the two ranks, with moe_router_topk=1); the
    ranks agree on K' = 3 and the round trip is the dense layer's."""
    routing = make_routing(2, 2, 3, [6, 5], "random", seed=9)
    routing.topk_idx[1][:, 2] = -1  # rank 1: at most 2 experts per token
    inputs = [rank_inputs(routing, r, 4) for r in range(2)]
    args = [(*inp, 4, 1, {}, None, {"moe_pad_expert_input_to_capacity": True}) for inp in inputs]
    flat = [x.view(-1, HIDDEN) for x, *_ in inputs]
    ref = reference_dispatch(flat, routing.topk_idx, routing.topk_weights, 4)
    for rank, (got, want, (x, routing_map, probs, grad)) in enumerate(
            zip(worlds(2).run(megatron_rank_fns.stage_round_trip, args), ref, inputs)):
        assert torch.equal(got["tokens"], want.tokens) and torch.equal(got["tokens_per_expert"], want.tokens_per_expert)
        xl, pl = x.clone().requires_grad_(), probs.clone().requires_grad_()
        expected = dense_layer(xl, routing_map, pl, 2)
        (expected * grad).sum().backward()
        torch.testing.assert_close(got["out"], expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["x_grad"], xl.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["probs_grad"], pl.grad * routing_map, rtol=1e-12, atol=1e-12)


def capacity_routing(num_tokens: int, num_experts: int, capacity: int, seed: int):
    """A router's capacity mask, padded (moe_pad_expert_input_to_capacity): each expert
    takes exactly ``capacity`` distinct tokens, a third of them padding (probability 0)."""
    gen = torch.Generator().manual_seed(seed)
    routing_map = torch.zeros(num_tokens, num_experts, dtype=torch.bool)
    for e in range(num_experts):
        routing_map[torch.randperm(num_tokens, generator=gen)[:capacity], e] = True
    probs = torch.rand(num_tokens, num_experts, generator=gen, dtype=torch.float64)
    probs = probs * routing_map * (torch.rand(num_tokens, num_experts, generator=gen) > 0.33)
    return routing_map, probs


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_fixed_rows_when_graphs_hold_every_stage(worlds, world_size):
    """With every stage inside CUDA graphs (padded to capacity), K' = E on every rank,
    max_rows and the counts are fixed by the capacity (on the NVLink engine nothing is
    then read on the host; here gloo stands in, with its host read). The round trip is
    bitwise the one that agrees K' and reads the counts."""
    num_experts, topk, tokens, factor = 2 * world_size, 2, 6, 1.0
    capacity = -(-tokens * topk // num_experts)  # Megatron's get_capacity at factor 1
    args, eager = [], []
    for r in range(world_size):
        routing_map, probs = capacity_routing(tokens, num_experts, capacity, seed=r)
        x = identity_tokens(r, tokens, HIDDEN, torch.float64).view(3, 2, HIDDEN)
        grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        args.append((x, routing_map, probs, grad, num_experts, topk, factor))
        eager.append((x, routing_map, probs, grad, num_experts, topk, {}, None,
                      {"moe_pad_expert_input_to_capacity": True}))
    want = worlds(world_size).run(megatron_rank_fns.stage_round_trip, eager)
    got = worlds(world_size).run(megatron_rank_fns.fixed_rows_round_trip, args)
    for rank, (g, w) in enumerate(zip(got, want)):
        assert not isinstance(g, str), g
        assert g["fixed_rows"] and not w["fixed_rows"], rank
        assert torch.equal(g["tokens_per_expert"], torch.full((2,), capacity * world_size)), rank
        for key in ("tokens", "tokens_per_expert", "permuted_probs", "out", "x_grad", "probs_grad"):
            assert torch.equal(g[key], w[key]), (rank, key)


@pytest.mark.parametrize("world_size, tp", [(2, 2), (4, 2)])
def test_fixed_rows_with_expert_tensor_parallelism(worlds, world_size, tp):
    """Fixed rows with expert TP: every rank of an expert-TP group has the same fixed
    counts, so the group's rows are laid out without gathering them; the round trip is
    bitwise the one that gathers the counts."""
    num_experts, topk, tokens, factor = 4, 2, 6, 1.0
    capacity = -(-tokens * topk // num_experts)
    fixed, gathered = [], []
    for r in range(world_size):
        routing_map, probs = capacity_routing(tokens, num_experts, capacity, seed=10 + r)
        x = identity_tokens(r, tokens, HIDDEN, torch.float64).view(3, 2, HIDDEN)
        grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        fixed.append((x, routing_map, probs, grad, num_experts, topk, factor, tp))
        gathered.append((x, routing_map, probs, grad, num_experts, topk, tp, {"moe_pad_expert_input_to_capacity": True}))
    want = worlds(world_size).run(megatron_rank_fns.stage_round_trip_expert_tp, gathered)
    got = worlds(world_size).run(megatron_rank_fns.fixed_rows_round_trip, fixed)
    ep = world_size // tp
    for rank, (g, w) in enumerate(zip(got, want)):
        assert not isinstance(g, str), g
        assert g["fixed_rows"] and not w["fixed_rows"], rank
        assert torch.equal(g["tokens_per_expert"], torch.full((num_experts // ep,), capacity * world_size)), rank
        for key in ("tokens", "tokens_per_expert", "permuted_probs", "out", "x_grad", "probs_grad"):
            assert torch.equal(g[key], w[key]), (rank, key)


def _padded_round_trips(world_size: int, seed: int):
    """Per rank, a map padded to capacity (E = 4 per rank, top-2 of 6 tokens, capacity
    factor 1) as arguments of fixed_rows_round_trip, and of stage_round_trip eagerly."""
    num_experts, topk, tokens, factor = 4 * world_size, 2, 6, 1.0
    capacity = -(-tokens * topk // num_experts)
    fixed, eager = [], []
    for r in range(world_size):
        routing_map, probs = capacity_routing(tokens, num_experts, capacity, seed=seed + r)
        x = identity_tokens(r, tokens, HIDDEN, torch.float64).view(3, 2, HIDDEN)
        grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        fixed.append((x, routing_map, probs, grad, num_experts, topk, factor))
        eager.append((x, routing_map, probs, grad, num_experts, topk, {}, None,
                      {"moe_pad_expert_input_to_capacity": True}))
    return fixed, eager


@pytest.mark.parametrize(
    "world_size, limit, graphs, slots",
    [
        # one local expert a group (limit // W = 1): four dispatches of W slots
        (1, 1, True, [1] * 4), (2, 2, True, [2] * 4), (3, 3, True, [3] * 4),
        (1, 1, False, [1] * 4), (2, 2, False, [2] * 4), (3, 3, False, [3] * 4),
        # groups of several experts and a shorter last one: local experts (0, 3), (3, 4)
        (1, 3, True, [3, 1]),
        # 5 // W = 2 local experts a group, (0, 2) and (2, 4): 4 of the K' = E = 8 slots each
        (2, 5, True, [4, 4]),
    ],
)
def test_padded_slots_past_the_engine_limit_move_by_expert_groups(worlds, world_size, limit, graphs, slots):
    """Padded, a token may name more experts than the engine moves per token (32 on
    NVLink; `limit` here): the adapter then dispatches by groups of local experts,
    limit // W of each rank's (every stage in CUDA graphs: always, K' = E; eagerly:
    where K' passes the limit). The experts get the rows of one dispatch, bitwise; the
    sums per token (output, input gradient) add the groups' up, equal to rounding."""
    fixed, eager = _padded_round_trips(world_size, seed=40)
    name, args = ("fixed_rows_round_trip", fixed) if graphs else ("stage_round_trip", eager)
    want = worlds(world_size).run(getattr(megatron_rank_fns, name), args)
    got = worlds(world_size).run(megatron_rank_fns.with_slot_limit, [(limit, name, *a) for a in args])
    for rank, (g, w) in enumerate(zip(got, want)):
        assert not isinstance(g, str), g
        assert len(w["dispatch_slots"]) == 1 and w["dispatch_slots"][0] > limit, (rank, w["dispatch_slots"])
        assert g["dispatch_slots"] == slots, (rank, g["dispatch_slots"])
        for key in ("tokens", "tokens_per_expert", "permuted_probs", "probs_grad"):
            assert torch.equal(g[key], w[key]), (rank, key)
        for key in ("out", "x_grad"):
            torch.testing.assert_close(g[key], w[key], rtol=1e-12, atol=1e-12)


def test_padding_over_more_ranks_than_the_engine_limit_is_refused(worlds):
    """A padded token may go to an expert of every rank: an EP group wider than the
    engine's slots per token cannot be split into groups, and is refused on every rank."""
    fixed, _ = _padded_round_trips(2, seed=50)
    for error in worlds(2).run(megatron_rank_fns.with_slot_limit, [(1, "fixed_rows_round_trip", *a) for a in fixed]):
        assert isinstance(error, str), error
        assert "padding (to capacity or for quantization) over an EP group of 2 ranks" in error


def test_padding_waits_for_an_absent_rank_within_the_timeout():
    """With padding, the EP group agrees on the slots per token before the
    dispatch: a rank that never comes is named there within the engine's
    timeout, not after the process group's own (a world of its own: the group
    is not usable after)."""
    from dispatch.kernels import plan_cpu
    from world import World

    plan_cpu.module()  # (built here, not by the ranks inside the timed round trip)
    with World(2, timeout=60) as world:
        results = world.run(megatron_rank_fns.padded_with_a_rank_absent, [(1, 3.0)] * 2)
    elapsed, kind, message = results[0]
    assert kind == "RuntimeError" and "rank(s) [1]" in message and "did not reach" in message, (kind, message)
    assert elapsed < 15, elapsed


@pytest.mark.parametrize("fixed", [False, True])
def test_expert_tp_peers_of_a_failed_ep_group_raise_at_once_and_stay_in_step(fixed):
    """With expert tensor parallelism, a dispatch that fails in one EP group (a
    non-finite weight on rank 0: rank 0 and its EP peer raise at once) leaves
    the other EP group's ranks in the expert-TP counts exchange with them: the
    failed ranks take part there, marked, so that those raise ``PeerRefused`` at
    once, naming them. The next round trip, every rank at once, pairs no
    exchange with one of the round trip before: each rank's output is that of
    the layer (here the tokens themselves: weights 1 on both slots, identity
    experts, two expert-TP copies summed); also with fixed rows, whose counts'
    check is the exchange (a world of its own)."""
    from dispatch.kernels import plan_cpu
    from world import World

    plan_cpu.module()  # (built here, not by the ranks inside the timed round trip)
    with World(4, timeout=60) as world:
        results = world.run(megatron_rank_fns.expert_tp_with_one_ep_group_failing, [(30.0, fixed)] * 4)
    assert results[0][0][1] == "ValueError" and results[2][0][1] == "PeerRefused", results
    for rank in (1, 3):  # (the failed rank of each expert-TP group is its rank 0 there)
        elapsed, kind, message, _ = results[rank][0]
        assert kind == "PeerRefused" and "rank(s) [0]" in message, (rank, kind, message)
        assert elapsed < 10, (rank, elapsed, message)
    for rank, (step0, step1) in enumerate(results):
        elapsed, kind, message, out = step1
        assert kind is None, (rank, kind, message)
        want = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(10 * (rank // 2) + 1)) * 4
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_fixed_rows_refuse_a_map_not_padded_to_capacity(worlds):
    """An expert short of its capacity would leave the fixed counts wrong: refused
    in an eager step (a captured one cannot read the host) on every rank, the rank
    whose experts got other counts and the ranks whose did not (none waits for it)."""
    args = []
    for r in range(2):
        routing_map, probs = capacity_routing(6, 4, 3, seed=5 + r)
        if r == 0:
            routing_map[:, 2] = False  # expert 2 lives on rank 1: only rank 1's experts miss rows
        x = identity_tokens(r, 6, HIDDEN, torch.float64).view(3, 2, HIDDEN)
        args.append((x, routing_map, probs * routing_map, torch.ones_like(x), 4, 2, 1.0))
    first, second = worlds(2).run(megatron_rank_fns.fixed_rows_round_trip, args)
    for error in (first, second):
        assert isinstance(error, str) and "routing_map: padded to capacity, each expert must get 3 of each" in error
    assert "another rank's experts got other counts" in first, first
    assert "this rank's experts got [3, 6]" in second, second


@pytest.mark.parametrize("world_size", [1, 2])
def test_preprocess_inside_a_graph_replays(worlds, world_size):
    """moe_preprocess graphs: after a replay Megatron sets the dispatcher's
    cudagraph_attrs from the graph's outputs, and the stages after it run on them as
    on a fresh dispatch_preprocess; a routing is used once (no stale one is reused)."""
    num_experts, topk = 2 * world_size, 2
    routing = [make_routing(world_size, 2, topk, [6] * world_size, kind, seed=s)
               for kind, s in (("random", 1), ("random", 2))]
    args, fresh = [], []
    for r in range(world_size):
        first, second = (rank_inputs(rt, r, num_experts) for rt in routing)
        args.append((first, second, num_experts, topk))
        fresh.append((*second, num_experts, topk, {}))
    want = worlds(world_size).run(megatron_rank_fns.stage_round_trip, fresh)
    for rank, ((got, stale), w) in enumerate(zip(worlds(world_size).run(megatron_rank_fns.replayed_preprocess, args),
                                                 want)):
        assert stale is not None and "token_dispatch called out of order" in stale, stale
        for key in ("tokens", "tokens_per_expert", "permuted_probs", "out", "x_grad", "probs_grad"):
            assert torch.equal(got[key], w[key]), (rank, key)


def test_shared_experts_run_beside_the_exchange(worlds):
    """moe_shared_expert_overlap: the shared experts' calls come at the points of
    Megatron's alltoall dispatcher, and their output is added to the routed one
    (forward and backward)."""
    routing = make_routing(2, 2, 2, [6, 4], "random", seed=8)
    inputs = [rank_inputs(routing, r, 4) for r in range(2)]
    args = [(*inp, 4, 2, {}, 11) for inp in inputs]
    w1, w2 = megatron_rank_fns.shared_mlp_weights(HIDDEN, 11)
    for got, (x, routing_map, probs, grad) in zip(worlds(2).run(megatron_rank_fns.stage_round_trip, args), inputs):
        assert got["log"] == ["dispatch_preprocess", "pre", "token_dispatch", "wait", "fc1", "dispatch_postprocess",
                              "combine_preprocess", "token_combine", "wait", "fc2", "post", "combine_postprocess",
                              "output"], got["log"]
        xl = x.clone().requires_grad_()
        expected = dense_layer(xl, routing_map, probs, 2) + torch.tanh(xl @ w1) @ w2
        (expected * grad).sum().backward()
        torch.testing.assert_close(got["out"], expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["x_grad"], xl.grad, rtol=1e-12, atol=1e-12)


def test_shared_experts_raising_on_one_rank_stop_every_rank_at_once(worlds):
    """Shared experts beside the exchange that raise on rank 1 after its dispatch:
    rank 1 raises their error, rank 0 ``PeerRefused`` naming it in its combine
    (not the timeout); the next round trip runs in step, as on a fresh dispatcher."""
    routing = [make_routing(2, 2, 2, [6, 4], "random", seed=s) for s in (8, 9)]
    inputs = [[rank_inputs(rt, r, 4) for rt in routing] for r in range(2)]
    got = worlds(2).run(megatron_rank_fns.shared_experts_raise, [(1, *inp, 4, 2) for inp in inputs])
    want = worlds(2).run(megatron_rank_fns.stage_round_trip, [(*inp[1], 4, 2, {}, 11) for inp in inputs])
    (kind0, told0), (kind1, told1) = got[0][0], got[1][0]
    assert kind1 == "RuntimeError" and "rank 1's shared experts broke" in told1, got[1][0]
    assert kind0 == "PeerRefused" and "rank(s) [1]" in told0 and "refused combine" in told0, got[0][0]
    for (_, out), w in zip(got, want):
        assert torch.equal(out, w["out"])


def test_shared_experts_raising_with_fixed_rows_stop_every_rank_at_once(worlds):
    """The same where every expert gets fixed rows (every stage inside CUDA graphs;
    eager here): the fixed counts' check, a collective, comes before the shared
    experts, so the peers are not left waiting in it."""
    fixed = [_padded_round_trips(2, seed)[0] for seed in (3, 5)]
    config = {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe"],
              "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    args = [(1, fixed[0][r][:4], fixed[1][r][:4], fixed[0][r][4], fixed[0][r][5], config) for r in range(2)]
    got = worlds(2).run(megatron_rank_fns.shared_experts_raise, args)
    (kind0, told0), (kind1, told1) = got[0][0], got[1][0]
    assert kind1 == "RuntimeError" and "rank 1's shared experts broke" in told1, got[1][0]
    assert kind0 == "PeerRefused" and "rank(s) [1]" in told0 and "refused combine" in told0, got[0][0]
    assert all(bool(torch.isfinite(out).all()) for _, out in got)


@pytest.mark.parametrize("world_size, tp", [(2, 2), (4, 2)])
def test_expert_tensor_parallel_stages(worlds, world_size, tp):
    """Expert tensor parallelism (EP = world / tp): each expert's rows reach every
    rank of its expert-TP group, ordered by local expert, then expert-TP rank, then
    source EP rank and token (Megatron's order), counted over the group; the
    partial outputs are summed back; outputs and gradients are the dense layer's."""
    ep = world_size // tp
    # E = 4 experts; EP rank e holds [e * E / ep, (e + 1) * E / ep), on each of its tp ranks
    routing_ep = make_routing(world_size, 4 // world_size, 3, [7, 0, 5, 6][:world_size], "random", seed=5)
    num_experts = routing_ep.num_experts
    per_rank = num_experts // ep
    inputs = [rank_inputs(routing_ep, r, num_experts) for r in range(world_size)]
    args = [(*inp, num_experts, 3, tp) for inp in inputs]
    results = worlds(world_size).run(megatron_rank_fns.stage_round_trip_expert_tp, args)
    flat = [x.view(-1, HIDDEN) for x, *_ in inputs]
    for rank, (got, (x, routing_map, probs, grad)) in enumerate(zip(results, inputs)):
        ep_rank, members = rank // tp, [rank // tp * tp + p for p in range(tp)]
        experts = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        # Megatron's order: local expert, expert-TP rank, then (source EP rank, token) as the EP dispatch gives
        want_rows, want_probs, want_counts = [], [], []
        for e in experts:
            count = 0
            for p in range(tp):
                for src in [s * tp + p for s in range(ep)]:
                    for t in range(flat[src].shape[0]):
                        slots = (routing_ep.topk_idx[src][t] == e).nonzero().flatten().tolist()
                        if slots:
                            want_rows.append(flat[src][t])
                            want_probs.append(routing_ep.topk_weights[src][t, slots[0]])
                            count += 1
            want_counts.append(count)
        assert torch.equal(got["tokens_per_expert"], torch.tensor(want_counts)), (rank, members)
        assert torch.equal(got["tokens"], torch.stack(want_rows) if want_rows else got["tokens"][:0]), rank
        assert torch.equal(got["permuted_probs"], torch.stack(want_probs) if want_probs
                           else got["permuted_probs"][:0]), rank
        xl = x.clone().requires_grad_()
        pl = probs.clone().requires_grad_()
        expected = dense_layer(xl, routing_map, pl, per_rank)
        (expected * grad).sum().backward()
        torch.testing.assert_close(got["out"], expected.detach(), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["x_grad"], xl.grad, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got["probs_grad"], pl.grad * routing_map, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("config_extra", [
    {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["attn", "moe_router"]},
    {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router"]},
    {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn"]},
    {"cuda_graph_impl": "none"},
    # dispatch_preprocess inside the graph (dropless): nothing of it reads the host
    {"cuda_graph_impl": "local", "cuda_graph_modules": ["attn", "moe_router"]},
    {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router", "moe_preprocess"]},
    {"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router", "moe_preprocess"],
     "moe_expert_capacity_factor": 1.0},
])
def test_graphs_that_leave_the_exchange_outside_are_accepted(worlds, config_extra):
    (error,) = worlds(1).run(megatron_rank_fns.stage_error, [("none", 4, 2, config_extra, {})])
    assert error is None, error


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_overlap_moe_expert_parallel_comm_nodes(worlds, world_size):
    """Megatron's EP-communication overlap runs the stages as four nodes, each its
    own autograd graph, freeing the dispatch, expert and combine nodes' inputs after
    their forward: the adapter hands over copies where a freed input is saved for
    backward, and unties combine from dispatch (each node's backward is run on
    every rank), so the gradients are those of one graph and the dispatch's
    backward runs once, in its own node."""
    args = [(torch.randn(2 + r, 3, 4, generator=torch.Generator().manual_seed(r), dtype=torch.float64), 11, 6, 2)
            for r in range(world_size)]
    for rank, (one, nodes, one_graph, split) in enumerate(worlds(world_size).run(
            megatron_rank_fns.split_node_round_trip, args)):
        for name, a, b in zip(("x", "router", "experts"), nodes, one):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"rank {rank}: gradient of {name}")
        assert len(one_graph) == 1 and len(split) == 1 and split[0] > 0, (one_graph, split)


def test_bf16_activations_with_fp32_probs(worlds):
    """Megatron's usual dtypes: bf16 hidden states, fp32 probs (router in fp32)."""
    routing = make_routing(2, 2, 2, [6, 4], "random", seed=3)
    args = []
    for r in range(2):
        x = identity_tokens(r, routing.num_tokens[r], HIDDEN, torch.bfloat16).view(-1, 2, HIDDEN)
        routing_map, probs = megatron_routing(routing.topk_idx[r], routing.topk_weights[r].float(), 4)
        args.append((x, routing_map, probs, torch.ones(x.shape, dtype=torch.bfloat16), 4, 2, {"combine_wire": "fp32"}))
    for (x, routing_map, probs, *_), got in zip(args, worlds(2).run(megatron_rank_fns.stage_round_trip, args)):
        assert got["out"].dtype == torch.bfloat16 and got["permuted_probs"].dtype == torch.float32
        expected = dense_layer(x.double(), routing_map, probs.double(), 2)
        torch.testing.assert_close(got["out"].double(), expected, rtol=2e-2, atol=1e-2)


def test_routing_to_topk_lowest_experts_first_and_empty_slots():
    routing_map = torch.tensor([[False, True, False, True], [False, False, False, False], [True, False, False, False]])
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75], [0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]], requires_grad=True)
    idx, w = routing_to_topk(routing_map, probs, 2)
    assert torch.equal(idx, torch.tensor([[1, 3], [-1, -1], [0, -1]]))
    assert torch.equal(w.detach(), torch.tensor([[0.25, 0.75], [0.0, 0.0], [1.0, 0.0]]))
    w.sum().backward()
    assert torch.equal(probs.grad, routing_map.float())
    empty_idx, empty_w = routing_to_topk(routing_map[:0], probs[:0], 2)
    assert empty_idx.shape == (0, 2) and empty_w.shape == (0, 2)


DROP_PAD = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}


@pytest.mark.parametrize(
    "config_extra, options, needle",
    [
        ({}, {"capacity_factor": 1.0}, "unknown engine option(s) capacity_factor"),
        ({"moe_router_padding_for_quantization": True}, {}, "moe_router_padding_for_quantization=True"),
        ({"cuda_graph_impl": "local"}, {}, "capturing whole layers without moe_pad_expert_input_to_capacity"),
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe"]}, {},
         "capturing moe without moe_pad_expert_input_to_capacity"),
        ({"cuda_graph_impl": "full_iteration"}, {}, "capturing the whole iteration without"),
        # padded to capacity, every stage inside graphs: only the NVLink engine or NVSHMEM reads nothing on the host
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe"], **DROP_PAD}, {},
         "capturing moe without a transport that reads nothing on the host (variant='alltoall', transport='auto' "
         "here reads split"),
        ({"cuda_graph_impl": "local", **DROP_PAD}, {"transport": "nccl"},
         "capturing whole layers without a transport that reads nothing on the host (variant='alltoall', "
         "transport='nccl'"),
        ({"cuda_graph_impl": "local", "cuda_graph_modules": ["moe_router"], **DROP_PAD}, {},
         "(moe_preprocess) with padding to capacity"),
        ({"cuda_graph_impl": "transformer_engine", "cuda_graph_modules": ["moe_router", "moe_preprocess"],
          "moe_router_padding_for_quantization": True}, {}, "(moe_preprocess) with padding to capacity or router"),
        ({"overlap_moe_expert_parallel_comm": True, "moe_token_dispatcher_type": "flex"}, {},
         "overlap_moe_expert_parallel_comm=True with moe_token_dispatcher_type='flex'"),
        ({"transformer_impl": "inference_optimized"}, {}, "inference_optimized"),
        ({"moe_token_dispatcher_type": "flex", "moe_flex_dispatcher_backend": "hybridep", "fp8": "hybrid"}, {},
         "moe_flex_dispatcher_backend='hybridep' and fp8/fp4"),
        ({"moe_token_dispatcher_type": "flex", "moe_expert_rank_capacity_factor": 1.5}, {},
         "moe_expert_rank_capacity_factor=1.5"),
        ({}, {"groups": 2}, "unknown engine option(s) groups"),
        ({}, {"num_experts": 8}, "num_experts comes from config.num_moe_experts"),
        ({}, {"dispatch_wire": "fp4"}, "dispatch_wire"),
    ],
)
def test_construction_refuses(worlds, config_extra, options, needle):
    (error,) = worlds(1).run(megatron_rank_fns.stage_error, [("none", 4, 2, config_extra, options)])
    assert error is not None and error[0] in ("ValueError", "TypeError")
    assert needle in error[1]


@pytest.mark.parametrize(
    "call, kind, needle",
    [
        ("too_many", "ValueError", "more than moe_router_topk=2"),
        ("map_dtype", "ValueError", "routing_map must be a [T=6, E=4] bool"),
        ("map_shape", "ValueError", "routing_map must be a [T=6, E=4] bool"),
        ("probs_dtype", "ValueError", "probs must be a floating"),
        ("order", "RuntimeError", "token_dispatch called out of order"),
        ("combine_twice", "RuntimeError", "token_combine called out of order"),
        ("postprocess_alone", "RuntimeError", "combine_postprocess called out of order"),
    ],
)
def test_misuse_is_refused(worlds, call, kind, needle):
    results = worlds(2).run(megatron_rank_fns.stage_error, [(call, 4, 2, {}, {})] * 2)
    for error in results:
        assert error is not None and error[0] == kind and needle in error[1], error


def test_a_row_of_more_than_topk_experts_is_refused_on_every_rank(worlds):
    """Only rank 0's routing_map names more than top-k experts in a row: its dispatch
    raises that, and rank 1's raises that rank 0's input is bad, instead of waiting."""
    first, second = worlds(2).run(megatron_rank_fns.stage_error, [("too_many_on_rank_0", 4, 2, {}, {})] * 2)
    assert first is not None and first[0] == "ValueError" and "more than moe_router_topk=2" in first[1], first
    # "rank(s) [0] of the group failed before the exchange" (or, without a host read: "rank 0 marked its input bad")
    assert second is not None and re.search(r"rank(\(s\))? \[?0\]? ", second[1]), second


def test_the_group_must_fit():
    from types import SimpleNamespace

    from dispatch.integrations.megatron import MegatronDispatcher

    config = SimpleNamespace(num_moe_experts=4, moe_router_topk=5)
    with pytest.raises(ValueError, match="moe_router_topk must be an int in"):
        MegatronDispatcher(4, [0, 1, 2, 3], config, None)


def test_import_does_not_need_megatron():
    code = (
        "import sys; sys.modules['megatron'] = None\n"
        "import dispatch.integrations.megatron as m\n"
        "try:\n    m.install(object())\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install megatron-core" in out and 'moe-dispatch[megatron]' in out


@pytest.mark.parametrize(
    "argv, needle",
    [(["--parts", "nope"], "--parts"), (["--steps", "0"], "--steps"), (["--graph-steps", "0"], "--graph-steps"),
     (["--option", "dispatch_wire"], "KEY=VALUE"),
     (["--option", "local_world_size=0"], "local_world_size"), (["--option", "dispatch_wire=fp4"], "dispatch_wire"),
     (["--overlap-groups", "0"], "--overlap-groups"), (["--overlap-groups", "2", "0"], "--overlap-groups")],
)
def test_layer_script_bad_flags(argv, needle, capsys):
    from bench_scripts import load

    megatron_layer = load("megatron_layer")
    with pytest.raises(SystemExit) as exc:
        megatron_layer.main(argv)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_layer_script_traces_busy_time_as_the_union_of_spans():
    from bench_scripts import load

    covered = load("megatron_layer").covered
    assert covered([]) == 0
    assert covered([(5, 9), (0, 2), (1, 3), (8, 12), (20, 21)]) == 3 + 7 + 1  # [0, 3), [5, 12), [20, 21)
    assert covered([(0, 10), (2, 3)]) == 10  # one inside another


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_layer_script_needs_cuda(capsys):
    from bench_scripts import load

    assert load("megatron_layer").main(["--parts", "layer"]) == 2
    assert "needs CUDA" in capsys.readouterr().err


def test_scenarios_script_shapes_and_refusals(tmp_path, capsys):
    """bench/megatron_scenarios.py: the shapes a world of 2 holds, and a clear exit 2
    without Megatron-LM's test sources or outside torchrun (it runs on GPUs)."""
    from bench_scripts import load

    scenarios = load("megatron_scenarios")
    assert scenarios.shapes(2) == [(1, 2, 1), (2, 1, 2), (2, 1, 1), (1, 1, 2), (1, 1, 1)]
    assert scenarios.shapes(1) == [(1, 1, 1)]
    assert scenarios.main(["--megatron-lm", str(tmp_path)]) == 2
    assert "no Megatron-LM tests" in capsys.readouterr().err
