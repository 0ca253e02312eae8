"""The hierarchical variant over NVSHMEM (``variant="hierarchical"``,
``transport="nvshmem"``): every verb bitwise the NCCL hierarchical variant's,
with and without ``max_rows`` (then nothing read on the host), every wire,
dtypes, gradients, groups and the async verbs; nodes of one rank, of every
rank, and between; failures raised on every rank alike.

On CPU its rows move through ``splits_exchange.HostSplitsExchange`` (the
contract of torch's NVSHMEM all-to-all over gloo), the ranks taken as nodes of
``local_world_size``; on two GPUs with a torch built with NVSHMEM, the same
comparison on the real thing, the two ranks as two nodes and as one.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import rank_fns
from dispatch.bench.common import same_bits
from routing import make_routing, routings
from test_nvshmem import against_nccl, captured_round_trip


def _layouts(world: int) -> list[int]:
    return [n for n in range(1, world + 1) if world % n == 0]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_verb_is_bitwise_the_nccl_hierarchical_variants(worlds, data):
    world = data.draw(st.sampled_from([2, 4]))
    local = data.draw(st.sampled_from(_layouts(world)))
    routing = data.draw(routings(world, max_tokens=12))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    wire = data.draw(st.sampled_from(["native", "bf16", "fp8"]))
    pad = data.draw(st.sampled_from([None, 0, 5]))
    # (with max_rows the buffers hold the widest row of the wires: dispatch_rows' native rows need one as wide)
    combine = data.draw(st.sampled_from(["native", "bf16"])) if pad is None or dtype == torch.bfloat16 else "native"
    per_rank = routing.num_experts // world
    groups = data.draw(st.sampled_from([1, 2])) if pad is None and per_rank >= 2 else 1
    async_op = data.draw(st.booleans())
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    xs = [torch.randn(t, 16, generator=gen).to(dtype) for t in routing.num_tokens]
    gs = [torch.randn(t, 16, generator=gen).to(dtype) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, variant="hierarchical", local_world_size=local,
                  dispatch_wire=wire, combine_grad_wire=wire, combine_wire=combine, dispatch_grad_wire=combine)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].to(dtype), gs[r], config, pad, groups, async_op,
             True) for r in range(world)]
    for rank, (differ, read_host) in enumerate(worlds(world).run(against_nccl, args)):
        assert differ == [], (rank, local, differ)
        assert read_host == (pad is None), rank


@pytest.mark.parametrize("tokens", [[30, 0, 17, 9], [0, 0, 0, 0]])
def test_two_nodes_of_two_with_a_row_bound_and_by_groups(worlds, tokens):
    """2 nodes x 2, a bound with room and one tight (pad 0), and by 2 groups
    without one (async); tokens on some ranks only, or on none."""
    routing = make_routing(4, 4, 4, tokens, "random", seed=3)
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(t, 24, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    gs = [torch.randn(t, 24, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, variant="hierarchical", local_world_size=2, dispatch_wire="fp8")
    for pad, groups in ((None, 1), (0, 1), (7, 1), (None, 2)):
        args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, pad, groups, groups > 1,
                 True) for r in range(4)]
        for rank, (differ, read_host) in enumerate(worlds(4).run(against_nccl, args)):
            assert differ == [] and read_host == (pad is None), (pad, rank, differ)


def bad_values_everywhere(x, topk_idx, topk_weights, config, bounded):
    """A dispatch whose topk_idx on rank 1 names an expert past E: (what this
    rank raised, and whether a later good dispatch then runs)."""
    d = rank_fns.dispatcher(dict(config, transport="nvshmem"), True)
    bad = topk_idx.clone()
    if torch.distributed.get_rank() == 1:
        bad[0, 0] = config["num_experts"] + 3
    told = None
    try:
        d.dispatch(x, bad, topk_weights, max_rows=64 if bounded else None)
        if bounded:
            d.check()
    except (ValueError, RuntimeError) as error:
        told = f"{type(error).__name__}: {error}"
    if bounded and told is None:  # raised at the next dispatch's agreement, on every rank
        try:
            d.dispatch(x, topk_idx, topk_weights, max_rows=64)
        except (ValueError, RuntimeError) as error:
            told = f"{type(error).__name__}: {error}"
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=64 if bounded else None)
    d.check()
    return told, int(out.tokens_per_expert.sum())


@pytest.mark.parametrize("bounded", [False, True])
def test_a_bad_expert_id_on_one_rank_fails_every_rank(worlds, bounded):
    routing = make_routing(4, 2, 2, [6, 5, 4, 3], "random", seed=5)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(t, 8, generator=gen) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, variant="hierarchical", local_world_size=2)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config, bounded) for r in range(4)]
    results = worlds(4).run(bad_values_everywhere, args)
    for rank, (told, rows) in enumerate(results):
        assert told is not None, rank
        if rank == 1 and not bounded:  # its own values named
            assert "topk_idx holds an expert id outside [-1, 8) (num_experts=8): row 0 is [11," in told, told
    assert sum(rows for _, rows in results) == sum(int((t >= 0).sum()) for t in routing.topk_idx)


# -- on the real NVSHMEM: two GPUs, a torch built with it --------------------------------------------


@pytest.mark.parametrize("local", [1, 2])  # two nodes of one rank; one node of two
@pytest.mark.parametrize("wire", ["native", "fp8"])
@pytest.mark.parametrize("pad", [None, 0, 9])
def test_on_nvshmem_every_verb_is_bitwise_the_nccl_hierarchical_variants(nvshmem_world, local, wire, pad):
    routing = make_routing(2, 4, 4, [40, 33], "random", seed=7)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    gs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, variant="hierarchical", local_world_size=local,
                  dispatch_wire=wire, combine_wire="bf16")
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, pad, 1, False, False)
            for r in range(2)]
    for rank, (differ, read_host) in enumerate(nvshmem_world.run(against_nccl, args)):
        assert differ == [], (rank, differ)
        assert read_host == (pad is None), rank


def test_on_nvshmem_a_bounded_hierarchical_round_trip_is_captured(nvshmem_world):
    routing = make_routing(2, 4, 4, [64, 64], "random", seed=2)
    gen = torch.Generator().manual_seed(5)
    config = dict(num_experts=8, variant="hierarchical", local_world_size=1)
    args = [(torch.randn(64, 128, generator=gen), routing.topk_idx[r], routing.topk_weights[r].float(), 512, config)
            for r in range(2)]
    for rank, same in enumerate(nvshmem_world.run(captured_round_trip, args)):
        assert all(same), (rank, same)


@pytest.mark.parametrize("capacity", [dict(capacity_factor=0.75), dict(capacity_factor=1.0, pad_to_capacity=True)])
def test_capacity_drops_and_padding_are_the_nccl_variants(worlds, capacity):
    """Megatron's token dropping, and with pad_to_capacity fixed blocks of rows:
    the front end's work around the transport, the same bits over both."""
    routing = make_routing(4, 2, 2, [20, 13, 0, 9], "random", seed=9)
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(t, 16, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    gs = [torch.randn(t, 16, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, variant="hierarchical", local_world_size=2, **capacity)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, None, 1, False, True)
            for r in range(4)]
    for rank, (differ, read_host) in enumerate(worlds(4).run(against_nccl, args)):
        assert differ == [] and read_host, (rank, differ)


def slots_differ(bounded):
    """Rank 1 with K = 4 slots a token, rank 0 with 2 (a bounded dispatch:
    the buffers sized for 2), through the real ``SymmetricExchange`` (every
    symmetric allocation checked alike on gloo): what each rank raised, and
    whether a dispatch after it goes through. Stage 1 carries the routing as
    rows 2K wide: the ranks agree on K before any of them moves (with
    max_rows, rank 1 takes part with nothing; every rank raises at check)."""
    import torch.distributed as dist
    from splits_exchange import FakeSymmetricMemory

    import dispatch
    from dispatch.dispatcher import TokenDispatcher
    from dispatch.transports import REGISTRY
    from dispatch.transports.symmetric import SymmetricExchange

    rank = dist.get_rank()
    gen = torch.Generator().manual_seed(rank)
    topk = 4 if rank == 1 else 2
    idx = torch.stack([torch.randperm(8, generator=gen)[:topk] for _ in range(6)])
    weights, x = torch.rand(6, topk, generator=gen), torch.randn(6, 8, generator=gen)
    with FakeSymmetricMemory(True):
        cfg = dispatch.DispatchConfig.from_options(num_experts=8, transport="nvshmem", variant="hierarchical",
                                                   local_world_size=1)
        exchange = SymmetricExchange(None, dist.get_world_size(), torch.device("cpu"))
        exchange._puts, exchange.MIN_SEND_BYTES = True, 0  # our kernels' contracts, faked; buffers as small as asked
        d = TokenDispatcher(cfg, None, REGISTRY["hierarchical", "nvshmem"](cfg, None, exchange=exchange))
        if bounded:
            d.reserve(x, 2)
        told = None
        try:
            d.dispatch(x, idx, weights, max_rows=64 if bounded else None)
            d.check()
        except (ValueError, RuntimeError) as error:
            told = str(error).split(":")[0]
        good = idx[:, :2].contiguous(), weights[:, :2].contiguous()
        out = d.dispatch(x, *good, max_rows=64 if bounded else None)
        d.check()
    return told, out.tokens.shape[0] > 0


@pytest.mark.parametrize("bounded", [False, True])
def test_ranks_with_different_slots_a_token_raise_together(worlds, bounded):
    if worlds(2).backend != "gloo":
        pytest.skip("torch's NVSHMEM pieces are faked on gloo ranks")
    got = worlds(2).run(slots_differ, [(bounded,)] * 2)
    if bounded:  # rank 1 over the buffers' K: it takes part with nothing, and raises its own reason
        assert got[1] == ("x", True) and got[0][0].startswith("rank(s) [1] of the group refused"), got
    else:
        assert got == [("topk_idx", True)] * 2, got


def traffic_of_both(x, topk_idx, topk_weights, config):
    """``Dispatched.stats`` of one dispatch without max_rows over NCCL and over
    NVSHMEM (emulated), and over NVSHMEM with max_rows (None: not accounted)."""
    nccl = rank_fns.dispatcher(dict(config, transport="nccl"))
    d = rank_fns.dispatcher(dict(config, transport="nvshmem"), True)
    want, got = (one.dispatch(x, topk_idx, topk_weights).stats for one in (nccl, d))
    bounded = d.dispatch(x, topk_idx, topk_weights, max_rows=64).stats
    d.check()
    return want == got, bounded is None, got.dispatch_inter_rows + got.dispatch_intra_rows


def test_its_traffic_is_the_nccl_variants(worlds):
    """The rows and bytes each tier carries, from the host sizes of its plans:
    those of the NCCL hierarchical variant (one per (token, node) across nodes,
    then inside the node)."""
    routing = make_routing(4, 4, 4, [20, 13, 7, 9], "random", seed=4)
    gen = torch.Generator().manual_seed(4)
    config = dict(num_experts=routing.num_experts, variant="hierarchical", local_world_size=2)
    args = [(torch.randn(t, 16, generator=gen), routing.topk_idx[r], routing.topk_weights[r], config)
            for r, t in enumerate(routing.num_tokens)]
    got = worlds(4).run(traffic_of_both, args)
    assert all(same and unaccounted for same, unaccounted, _ in got), got
    assert sum(rows for *_, rows in got) > 0, got


def layers_over_both(x, topk_idx, topk_weights, grad_out, config):
    """MoEExchange (one piece, by 2 groups, with max_rows) and MoEMicroBatches
    (2 micro-batches, with and without max_rows) over NCCL and over NVSHMEM
    (emulated), fresh identical experts each: the names whose outputs, input
    gradients or parameter gradients differ."""
    import pipeline_fns

    import dispatch

    differ = []
    runs = (("groups 1", 1, None), ("groups 2", 2, None), ("bounded", 1, 64), ("micro", None, None),
            ("micro bounded", None, 32))
    for name, groups, bound in runs:
        got = []
        for transport in ("nccl", "nvshmem"):
            d = rank_fns.dispatcher(dict(config, transport=transport), transport == "nvshmem")
            experts = pipeline_fns.make_experts("swiglu", d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
            xs, ws = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()
            if groups is None:  # two micro-batches: the tokens' halves
                half = x.shape[0] // 2
                layer = dispatch.MoEMicroBatches(d, experts, max_rows=bound)
                if bound is not None:
                    d.reserve(xs, topk_idx.shape[1])
                outs = layer([xs[:half], xs[half:]], [topk_idx[:half], topk_idx[half:]], [ws[:half], ws[half:]])
                out = torch.cat(outs)
            else:
                out = dispatch.MoEExchange(d, experts, groups=groups, max_rows=bound)(xs, topk_idx, ws)
            (out * grad_out).sum().backward()
            d.check()
            got.append([out.detach(), xs.grad, ws.grad, *[p.grad for p in experts.parameters()]])
        if any(not same_bits(a, b) for a, b in zip(*got)):
            differ.append(name)
    return differ


def test_the_layers_over_it_are_the_nccl_variants(worlds):
    """MoEExchange and MoEMicroBatches over the hierarchical variant on NVSHMEM
    (2 nodes of 2): every output and gradient the bits of the same layers over
    its NCCL rows."""
    routing = make_routing(4, 4, 3, [16, 12, 10, 14], "random", seed=6)
    gen = torch.Generator().manual_seed(6)
    args = [(torch.randn(t, 16, generator=gen).to(torch.bfloat16), routing.topk_idx[r],
             routing.topk_weights[r].float(), torch.randn(t, 16, generator=gen).to(torch.bfloat16),
             dict(num_experts=routing.num_experts, variant="hierarchical", local_world_size=2))
            for r, t in enumerate(routing.num_tokens)]
    assert worlds(4).run(layers_over_both, args) == [[]] * 4
