"""What is particular to the allgather, hierarchical and auto variants: bytes per
tier (DispatchStats), the cost model and auto's choice. Their routing and sums
are checked with every other variant's in test_properties.py and test_autograd.py."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dispatch
import rank_fns
from dispatch.cost_model import LinkModel, RoutingStats, estimate
from dispatch.bench.common import same_bits
from reference import reference_combine, reference_dispatch
from dispatch.stats import resolve_local_world_size
from routing import identity_tokens, make_routing, routings

HIDDEN = 4


def _expected_inter_rows(routing, local):
    """Per rank (alltoall, hierarchical) dispatch rows that cross nodes, counted
    from topk_idx; and per rank the combine rows that cross nodes on their way
    home (alltoall: the pre-sums of the rows it received from other nodes;
    hierarchical: as holder (node n, index i), one per token of (m, i), m != n,
    with an expert on node n)."""
    world = routing.world_size
    per_rank = routing.num_experts // world
    flat, hier, has_pair = [], [], False
    flat_back, hier_back = [0] * world, [0] * world
    for rank, idx in enumerate(routing.topk_idx):
        node = rank // local
        ranks_hit = [{int(e) // per_rank for e in row if e >= 0} for row in idx]
        remote = [{d for d in hit if d // local != node} for hit in ranks_hit]
        flat.append(sum(len(r) for r in remote))
        hier.append(sum(len({d // local for d in r}) for r in remote))
        has_pair |= any(len(r) > len({d // local for d in r}) for r in remote)
        for r in remote:
            for d in r:
                flat_back[d] += 1
            for n in {d // local for d in r}:
                hier_back[n * local + rank % local] += 1
    return flat, hier, has_pair, flat_back, hier_back


@pytest.mark.parametrize("world_size, local", [(4, 2), (6, 2), (6, 3)])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_hierarchical_never_sends_more_across_nodes(worlds, world_size, local, data):
    """Inter-node bytes of hierarchical <= flat alltoall's (per rank on the way out, in
    total both ways), strictly fewer exactly when some token has two experts on
    different ranks of one remote node; and both match a count from the routing."""
    routing = data.draw(routings(world_size))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16]))
    xs = [identity_tokens(r, t, HIDDEN, dtype) for r, t in enumerate(routing.num_tokens)]
    stats = {}
    for variant in ("alltoall", "hierarchical"):
        config = dict(num_experts=routing.num_experts, variant=variant, local_world_size=local)
        args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config) for r in range(world_size)]
        stats[variant] = [got["stats"] for got in worlds(world_size).run(rank_fns.round_trip, args)]
    flat_rows, hier_rows, has_pair, flat_back, hier_back = _expected_inter_rows(routing, local)
    row_bytes = HIDDEN * dtype.itemsize
    totals = {}
    for variant, want, back in (("alltoall", flat_rows, flat_back), ("hierarchical", hier_rows, hier_back)):
        got = stats[variant]
        assert [s["dispatch_inter_rows"] for s in got] == want, variant
        assert [s["combine_inter_rows"] for s in got] == back, variant  # each rank's own, not a total
        assert all(s["dispatch_inter_bytes"] == s["dispatch_inter_rows"] * row_bytes for s in got)
        assert all(s["combine_inter_bytes"] == s["combine_inter_rows"] * row_bytes for s in got)
        assert sum(s["combine_inter_rows"] for s in got) == sum(want)  # one row back per row out
        assert all(s["local_world_size"] == local for s in got)
        totals[variant] = sum(s["dispatch_inter_bytes"] + s["combine_inter_bytes"] for s in got)
    for flat, hier in zip(stats["alltoall"], stats["hierarchical"]):
        assert hier["dispatch_inter_bytes"] <= flat["dispatch_inter_bytes"]
    if has_pair:
        assert totals["hierarchical"] < totals["alltoall"]
    else:
        assert totals["hierarchical"] == totals["alltoall"]


def test_allgather_stats_count_padded_blocks(worlds):
    """allgather sends its whole (padded) block to every peer; the combine sends
    reduce-scatter blocks for an fp32 wire, one partial per (token, rank) otherwise."""
    routing = make_routing(4, 2, 2, [3, 5, 0, 2], "random", seed=4)
    for dtype, wire_rows in ((torch.float32, "block"), (torch.bfloat16, "partials")):
        xs = [identity_tokens(r, t, HIDDEN, dtype) for r, t in enumerate(routing.num_tokens)]
        config = dict(num_experts=routing.num_experts, variant="allgather", local_world_size=2)
        args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config) for r in range(4)]
        results = worlds(4).run(rank_fns.round_trip, args)
        flat = dict(config, variant="alltoall")
        flat_stats = [g["stats"] for g in worlds(4).run(rank_fns.round_trip, [(*a[:3], flat) for a in args])]
        for rank, got in enumerate(results):
            s = got["stats"]
            assert (s["dispatch_intra_rows"], s["dispatch_inter_rows"]) == (5, 10)  # T_max = 5
            assert s["dispatch_intra_bytes"] == 5 * HIDDEN * dtype.itemsize
            if wire_rows == "block":
                assert (s["combine_intra_rows"], s["combine_inter_rows"]) == (5, 10)
                assert s["combine_inter_bytes"] == 10 * HIDDEN * 4
            else:
                want = flat_stats[rank]
                assert (s["combine_intra_rows"], s["combine_inter_rows"]) == (
                    want["combine_intra_rows"],
                    want["combine_inter_rows"],
                )


def _stats_of(tokens, rank_hits, local):
    world = len(tokens)
    hits = torch.tensor(rank_hits, dtype=torch.int64)
    node_hits = torch.zeros(world, world // local, dtype=torch.int64)
    for n in range(world // local):  # an upper-bound-free stand-in: no token has two ranks in a node
        node_hits[:, n] = hits[:, n * local : (n + 1) * local].sum(1)
    return RoutingStats(torch.tensor(tokens), hits, node_hits)


def test_cost_model_allgather_costs_what_alltoall_does_when_tokens_reach_every_rank():
    """When every token reaches every rank, allgather moves alltoall's bytes in as
    many stages (the model then keeps alltoall, the first of equals); when tokens
    reach few ranks, allgather moves more."""
    world, tokens = 4, 16
    stats = _stats_of([tokens] * world, [[tokens] * world] * world, world)
    costs = estimate(stats, world, 2 * 1024, torch.bfloat16, 1024, LinkModel())
    assert costs["allgather"] == pytest.approx(costs["alltoall"])  # same bytes, same stages
    sparse = _stats_of([tokens] * world, [[tokens // 4] * world] * world, world)
    costs = estimate(sparse, world, 2 * 1024, torch.bfloat16, 1024, LinkModel())
    assert costs["alltoall"] < costs["allgather"]


def test_cost_model_prefers_hierarchical_on_a_slow_network():
    world, local, tokens = 4, 2, 4096
    hits = [[tokens] * world] * world  # every token on every rank: 2 ranks of each node
    stats = RoutingStats(
        torch.tensor([tokens] * world), torch.tensor(hits), torch.full((world, 2), tokens, dtype=torch.int64)
    )
    slow = LinkModel(intra_bandwidth=300e9, inter_bandwidth=10e9)
    costs = estimate(stats, local, 2 * 4096, torch.bfloat16, 4096, slow)
    assert costs["hierarchical"] < costs["alltoall"]
    fast = LinkModel(intra_bandwidth=300e9, inter_bandwidth=300e9, inter_latency=25e-6)
    costs = estimate(stats, local, 2 * 4096, torch.bfloat16, 4096, fast)
    assert costs["alltoall"] < costs["hierarchical"]  # one stage fewer, same bandwidth


@pytest.mark.parametrize(
    "link, tokens, want",
    [
        (LinkModel(intra_bandwidth=300e9, inter_bandwidth=1e6), 24, "hierarchical"),
        (LinkModel(intra_bandwidth=300e9, inter_bandwidth=300e9, inter_latency=25e-6), 24, "alltoall"),
    ],
)
def test_auto_choice_is_the_same_on_every_rank_and_exposed(worlds, link, tokens, want):
    """With all experts of every token (each token reaches both ranks of the other
    node), the network speed decides among the collectives' variants (on one
    host ``transport="auto"`` would take the NVLink engine); every rank reports
    the same choice, and the results are the reference's."""
    routing = make_routing(4, 2, 8, [tokens] * 4, "all_experts", seed=2)
    xs = [identity_tokens(r, t, 64, torch.float32) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, variant="auto", transport="nccl", local_world_size=2,
                  link_model=link)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config) for r in range(4)]
    results = worlds(4).run(rank_fns.round_trip, args)
    assert [got["variant"] for got in results] == [want] * 4
    ref = reference_dispatch(xs, routing.topk_idx, [w.float() for w in routing.topk_weights], routing.num_experts)
    expected = reference_combine([d.tokens for d in ref], ref, routing.num_tokens, weights=[d.weights for d in ref])
    for rank, got in enumerate(results):
        assert torch.equal(got["tokens"], ref[rank].tokens)
        torch.testing.assert_close(got["combined"], expected[rank], rtol=1e-6, atol=1e-5)


def test_auto_chooses_at_the_first_dispatch_and_every_64th(worlds):
    """The cost model's choice (its own counts exchange) runs at dispatches 1, 65, ...
    on every rank alike; the calls between run the chosen variant alone."""
    from dispatch.transports.auto import RECHOOSE

    routing = make_routing(2, 2, 2, [6, 5], "random", seed=3)
    xs = [identity_tokens(r, t, 16, torch.float32) for r, t in enumerate(routing.num_tokens)]
    # over the collectives: where the NVLink engine can run, transport="auto" takes it and no cost model chooses
    config = dict(num_experts=routing.num_experts, variant="auto", transport="nccl")
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, RECHOOSE + 2) for r in range(2)]
    for chosen, variant in worlds(2).run(rank_fns.auto_choices, args):
        assert chosen == [1, RECHOOSE + 1] and variant == "alltoall", (chosen, variant)


def test_local_world_size_resolution(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # (a process's own: not read)
    assert resolve_local_world_size(None, 1) == 1
    assert resolve_local_world_size(2, 8) == 2
    with pytest.raises(ValueError, match="local_world_size"):
        resolve_local_world_size(3, 8)


def test_local_world_size_follows_the_hosts_of_the_group(monkeypatch):
    """The ranks per node of a group are counted from the host of each of its
    ranks, not from the processes a node runs: an EP group
    strided across two nodes of 8 GPUs (tensor parallelism of 2 inside them) has
    4 ranks a node where ``LOCAL_WORLD_SIZE`` says 8. Where a host's ranks are not
    one block of consecutive ranks, or the blocks differ in size, every rank is
    a node of its own. A size given in the config still wins."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    strided = ("a",) * 4 + ("b",) * 4
    assert resolve_local_world_size(None, 8, strided) == 4
    assert resolve_local_world_size(2, 8, strided) == 2
    assert resolve_local_world_size(None, 8, ("a",) * 8) == 8
    assert resolve_local_world_size(None, 4, ("a", "b", "a", "b")) == 1  # interleaved
    assert resolve_local_world_size(None, 6, ("a",) * 4 + ("b",) * 2) == 1  # uneven
    assert resolve_local_world_size(None, 6, ("a", "a", "b", "b", "c", "c")) == 2


def test_the_hosts_of_a_group_are_asked_once(worlds):
    """``comm.group_hosts``: every rank's host in group order, gathered at the
    first ask only, whatever the backend; nothing asked of a one-rank group."""
    results = worlds(4).run(rank_fns.hosts_asked, [("a",), ("a",), ("b",), ("b",)])
    for answers, gathers, alone, plain in results:
        assert answers == [("a", "a", "b", "b")] * 2 and gathers == 1, (answers, gathers)
        assert alone is None and len(plain) == 4 and len(set(plain)) == 1, plain


@pytest.mark.parametrize("variant", ["hierarchical", "allgather", "auto"])
def test_ranks_agree_on_their_tiers_whatever_their_local_world_size(worlds, variant):
    """Processes whose ``LOCAL_WORLD_SIZE`` differs (torchrun's, on nodes of 3
    and 1 GPUs) take the tiers of their ranks' hosts alike (one host here): a
    dispatch runs (ranks that took different tiers made counts rows of
    different widths, which aborted the gloo processes)."""
    routing = make_routing(4, 2, 2, [5, 6, 4, 7], "random", seed=5)
    config = dict(num_experts=routing.num_experts, variant=variant)
    args = [(identity_tokens(r, t, 8, torch.float32), routing.topk_idx[r], routing.topk_weights[r], config, env)
            for r, (t, env) in enumerate(zip(routing.num_tokens, ("3", "3", "3", "1")))]
    assert [local for local, _ in worlds(4).run(rank_fns.tiers_beside_local_world_size, args)] == [4] * 4


@pytest.mark.parametrize("variant", ["hierarchical", "alltoall"])
def test_transports_take_their_tiers_from_the_hosts(worlds, variant):
    """A dispatcher over a group whose ranks run on two hosts, two ranks each,
    takes 2 ranks a node (the tiers of the hierarchical variant and of the
    stats); on hosts interleaved, 1; a size in the config wins."""
    routing = make_routing(4, 2, 2, [5, 6, 4, 7], "random", seed=5)
    xs = [identity_tokens(r, t, 8, torch.float32) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, variant=variant, transport="nccl")
    for hosts, local in ((("a", "a", "b", "b"), 2), (("a", "b", "a", "b"), 1)):
        args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config, hosts) for r in range(4)]
        results = worlds(4).run(rank_fns.tiers_on_hosts, args)
        want = _expected_inter_rows(routing, local)[0 if variant == "alltoall" else 1]
        assert [got for got, _ in results] == [local] * 4, hosts
        assert [stats.dispatch_inter_rows for _, stats in results] == want, hosts
        told = worlds(4).run(rank_fns.tiers_on_hosts, [(*a[:3], dict(config, local_world_size=4), a[4]) for a in args])
        assert [got for got, _ in told] == [4] * 4


@pytest.mark.parametrize(
    "kwargs, error, argument",
    [
        (dict(link_model={"intra_bandwidth": 1}), TypeError, "link_model"),
    ],
)
def test_new_config_fields_validate(kwargs, error, argument):
    with pytest.raises(error, match=argument):
        dispatch.DispatchConfig(num_experts=4, **kwargs)


@pytest.mark.parametrize("field", ["intra_bandwidth", "inter_bandwidth", "intra_latency", "inter_latency"])
def test_link_model_validates(field):
    with pytest.raises(ValueError, match=field):
        LinkModel(**{field: -1.0})


@pytest.mark.parametrize("variant", ["hierarchical", "auto"])
def test_tier_groups_of_several_ep_groups(worlds, variant):
    """A world of 4 as two EP groups of 2 (beside data parallelism), each
    hierarchical as 2 nodes of 1: each group's tier groups are made by its own
    ranks only, and each group's results are those of the dense reference."""
    per_group = [make_routing(2, 2, 2, [5, 3], "random", seed=s) for s in (1, 2)]
    args, xs = [], []
    for g, routing in enumerate(per_group):
        for r in range(2):
            x = identity_tokens(r, routing.num_tokens[r], 4, torch.float64)
            xs.append(x)
            config = dict(num_experts=routing.num_experts, variant=variant, local_world_size=1)
            args.append((x, routing.topk_idx[r], routing.topk_weights[r].double(), config, 2))
    results = worlds(4).run(rank_fns.round_trip_in_ep_groups, args)
    for g, routing in enumerate(per_group):
        group_xs = xs[2 * g : 2 * g + 2]
        weights = [w.double() for w in routing.topk_weights]
        ref = reference_dispatch(group_xs, routing.topk_idx, weights, routing.num_experts)
        for r in range(2):
            got = results[2 * g + r]
            assert torch.equal(got["tokens"], ref[r].tokens), f"group {g} rank {r}: tokens"
            assert torch.equal(got["src_token"], ref[r].src_token), f"group {g} rank {r}: order"
            live = (routing.topk_idx[r] >= 0).double()
            expected = group_xs[r] * (weights[r] * live).sum(1, keepdim=True)
            assert torch.equal(got["combined"], expected), f"group {g} rank {r}: combine"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_variant_moves_the_all_to_alls_bits(worlds, dtype):
    """What no variant sums (the rows, their order and sources, the counts, the
    values brought home to their slots, signed zeros among them, and so the
    routing weights' gradients) are the all-to-all's bits in every variant."""
    world, local = 4, 2
    routing = make_routing(world, 4, 3, [9, 0, 13, 6], "random", seed=5)
    gen = torch.Generator().manual_seed(3)
    xs, gs = ([torch.randn(t, HIDDEN, generator=gen).to(dtype) for t in routing.num_tokens] for _ in range(2))
    configs = {variant: dict(num_experts=routing.num_experts, variant=variant, local_world_size=local)
               for variant in ("alltoall", "allgather", "hierarchical", "auto")}
    args = [(configs, xs[r], routing.topk_idx[r], routing.topk_weights[r].to(dtype), gs[r]) for r in range(world)]
    results = worlds(world).run(rank_fns.every_verb_by_config, args)
    assert any(bool(torch.signbit(got["alltoall"]["slots"]).any()) for got in results), "no signed zero went home"
    for rank, got in enumerate(results):
        for variant in ("allgather", "hierarchical", "auto"):
            for key in ("tokens", "weights", "src_rank", "src_token", "tokens_per_expert", "rows", "slots", "grad_w"):
                assert same_bits(got[variant][key], got["alltoall"][key]), (rank, variant, key)


@pytest.mark.parametrize("variant", ["alltoall", "hierarchical"])
def test_stats_count_each_direction_in_its_own_wire(worlds, variant):
    """``Dispatched.stats`` counts the rows to the experts in the dispatch wire's
    bytes (fp8: codes and scales) and the rows home in the combine wire's
    (bf16), inside the node as across nodes."""
    from dispatch.codec import to_experts_codec

    routing = make_routing(4, 2, 3, [9, 4, 7, 5], "random", seed=3)
    xs = [identity_tokens(r, t, 256, torch.float32) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, variant=variant, local_world_size=2, dispatch_wire="fp8",
                  combine_wire="bf16")
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config) for r in range(4)]
    out_bytes, back_bytes = to_experts_codec("fp8", torch.float32).row_bytes(256), 256 * 2
    assert out_bytes not in (back_bytes, 256 * 4)
    stats = [got["stats"] for got in worlds(4).run(rank_fns.round_trip, args)]
    assert any(s["dispatch_intra_rows"] for s in stats) and any(s["combine_inter_rows"] for s in stats)
    for s in stats:
        for tier in ("intra", "inter"):
            assert s[f"dispatch_{tier}_bytes"] == s[f"dispatch_{tier}_rows"] * out_bytes, s
            assert s[f"combine_{tier}_bytes"] == s[f"combine_{tier}_rows"] * back_bytes, s


def test_cost_model_charges_each_direction_to_its_sender():
    """Rows out are charged to the rank that sends them, rows home to the rank
    that held them (the hits transposed), a rank's rows to itself to no link:
    on three nodes of one rank, unit bandwidths and no latency, rank 0 sends
    200 rows of 1 byte out, ranks 1 and 2 each 110 rows of 2 bytes home."""
    link = LinkModel(intra_bandwidth=1.0, inter_bandwidth=1.0, intra_latency=0.0, inter_latency=0.0)
    hits = torch.tensor([[500, 100, 100], [10, 500, 10], [10, 10, 500]])
    stats = RoutingStats(torch.tensor([600, 520, 520]), hits, hits.clone())  # one rank a node: its hits its node's
    costs = estimate(stats, 1, 1, torch.bfloat16, 1, link)
    assert costs["alltoall"] == 200 + 110 * 2
    assert costs["hierarchical"] == 200 + 110 * 2  # one rank a node: nothing moves inside a node
