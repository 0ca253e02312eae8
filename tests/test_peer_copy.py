"""The peer-copy transport (``dispatch.peer_copy``): its block arithmetic against a
dense all-to-all, and whole exchanges, dispatchers and pipelines bitwise equal to
the collective transport on worlds of 2-4 ranks (shared-memory files on gloo,
symmetric memory and copy engines on NCCL)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dispatch
import peer_copy_fns
import pipeline_fns
import rank_fns
from dispatch.peer_copy import pull_blocks, transposed
from routing import make_routing, random_tokens, routings

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_pull_blocks_assemble_the_all_to_all(data):
    """Each rank's blocks, pulled out of its peers' send rows, are exactly the rows
    sent to it, in source order, each once."""
    world = data.draw(st.integers(1, 6))
    matrix = tuple(tuple(data.draw(st.integers(0, 4)) for _ in range(world)) for _ in range(world))
    sent = []
    for s in range(world):  # a send row names its source, destination and index
        sent.append([(s, d, i) for d in range(world) for i in range(matrix[s][d])])
    for me in range(world):
        want = [(s, me, i) for s in range(world) for i in range(matrix[s][me])]
        got = [None] * sum(matrix[s][me] for s in range(world))
        for b in pull_blocks(matrix, me):
            assert b.rows == matrix[b.source][me] > 0
            got[b.dst_row : b.dst_row + b.rows] = sent[b.source][b.src_row : b.src_row + b.rows]
        assert got == want
        assert len({b.source for b in pull_blocks(matrix, me)}) == len(pull_blocks(matrix, me))


def test_every_rank_starts_with_another_source():
    for world in (2, 3, 4, 8):
        full = tuple((1,) * world for _ in range(world))
        firsts = [pull_blocks(full, me)[0].source for me in range(world)]
        assert sorted(firsts) == list(range(world)) and all(f != me for me, f in enumerate(firsts))
    assert transposed(((1, 2), (3, 4))) == ((1, 3), (2, 4))


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype, width", [(torch.float32, 5), (torch.bfloat16, 700), (torch.int64, 1)])
def test_exchanges_match_the_definition(worlds, world_size, dtype, width):
    """Sequences of exchanges (zeros, growth of the buffers past their first
    size, both directions, two in flight at once) give the rows of the
    definition of an all-to-all."""
    sizes = [3, 0, 40, 7, 900, 2, 1, 300]  # rows per pair: 900 rows of 1400 bytes outgrow 1 MiB
    matrices = peer_copy_fns.draw_matrices(world_size, sizes, seed=world_size)
    for in_flight in (0, 1):
        args = [(matrices, width, dtype, in_flight, 10 * in_flight)] * world_size
        for rank, same in enumerate(worlds(world_size).run(peer_copy_fns.exchanges, args)):
            assert same == [True] * len(sizes), f"rank {rank}, {in_flight} in flight: {same}"


@pytest.mark.parametrize("world_size, group_size", [(2, 2), (3, 3), (4, 2)])
def test_new_groups_start_with_empty_exchanges(worlds, world_size, group_size):
    """Fresh buffers of new groups (two pairs where W = 4), an exchange with
    nothing to move first, then growth: the rows of the definition."""
    sizes = [0, 0, 5, 700]  # draw_matrices leaves all-zero matrices at size 0
    matrices = peer_copy_fns.draw_matrices(world_size, sizes, seed=7)
    args = [(matrices, 800, torch.float32, 1, 3, group_size)] * world_size
    for rank, same in enumerate(worlds(world_size).run(peer_copy_fns.exchanges, args)):
        assert same == [True] * len(sizes), f"rank {rank}: {same}"


@pytest.mark.parametrize("world_size", [2, 3, 4])
@SETTINGS
@given(data=st.data())
def test_dispatch_and_gradients_match_the_collective(worlds, world_size, data):
    """dispatch, combine and every gradient are bitwise those of the collective
    transport, whatever the routing."""
    routing = data.draw(routings(world_size))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    xs = [random_tokens(r, t, 6, dtype, 3) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, 6, dtype, 4) for r, t in enumerate(routing.num_tokens)]
    results = {}
    for transport in ("collective", "peer_copy"):
        config = dict(num_experts=routing.num_experts, transport=transport)
        trips = worlds(world_size).run(rank_fns.round_trip, [
            (xs[r], routing.topk_idx[r], routing.topk_weights[r].to(dtype), config) for r in range(world_size)])
        grads = worlds(world_size).run(rank_fns.gradients, [
            (xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], trips[r]["tokens"] * 0.5, config)
            for r in range(world_size)])
        results[transport] = list(zip(trips, grads))
    for rank, ((trip, grad), (want_trip, want_grad)) in enumerate(zip(results["peer_copy"], results["collective"])):
        for name in ("tokens", "weights", "src_rank", "src_token", "combined", "tokens_per_expert"):
            assert torch.equal(trip[name], want_trip[name]), f"rank {rank}: {name}"
        for name, value in grad.items():
            assert torch.equal(value, want_grad[name]), f"rank {rank}: gradient {name}"


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("experts", ["rowwise", "swiglu"])
def test_pipelines_match_the_collective(worlds, world_size, experts):
    """MoEExchange with C = 1, 3 and local_first, forward and backward: bitwise the
    collective transport's results."""
    routing = make_routing(world_size, 2, 3, [9, 0, 5, 12][:world_size], "random", seed=31)
    xs = [random_tokens(r, t, 8, torch.float32, 5) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, 8, torch.float32, 6) for r, t in enumerate(routing.num_tokens)]
    chunks = [1, 3, "local"]
    results = {}
    for transport in ("collective", "peer_copy"):
        config = dict(num_experts=routing.num_experts, transport=transport)
        results[transport] = worlds(world_size).run(pipeline_fns.pipelined, [
            (xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, chunks, experts)
            for r in range(world_size)])
    for rank, (got, want) in enumerate(zip(results["peer_copy"], results["collective"])):
        for c in chunks:
            pipeline_fns.assert_same(got[c], want[c], f"rank {rank} C={c}")


def test_two_dispatches_in_flight(worlds):
    first = make_routing(3, 2, 3, [8] * 3, "random", seed=21)
    second = make_routing(3, 2, 3, [8] * 3, "one_rank", seed=22)
    xs = [random_tokens(r, 8, 4, torch.float32, 7) for r in range(3)]
    weights = [w.float() for w in first.topk_weights]
    results = {}
    for transport in ("collective", "peer_copy"):
        config = dict(num_experts=first.num_experts, transport=transport)
        results[transport] = worlds(3).run(rank_fns.two_in_flight, [
            (xs[r], first.topk_idx[r], second.topk_idx[r], weights[r], config) for r in range(3)])
    for got, want in zip(results["peer_copy"], results["collective"]):
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_config_is_checked():
    with pytest.raises(ValueError, match="transport"):
        dispatch.DispatchConfig(num_experts=4, transport="nvlink")
    for variant in ("allgather", "hierarchical", "auto"):
        with pytest.raises(ValueError, match="transport='peer_copy' needs variant='alltoall'"):
            dispatch.DispatchConfig(num_experts=4, variant=variant, transport="peer_copy")
