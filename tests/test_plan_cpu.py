"""The compiled CPU plan and sums (``csrc/plan_cpu.cpp``) held to their torch
references, bitwise; and a round trip on gloo with it equal to one without."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch import counts, plan, plan_graph
from dispatch.kernels import gather_sum as gs
from dispatch.kernels import plan_cpu
from dispatch.transports import hierarchical
from test_kernels import GATHER_CASES, ROUTE_CASES, SEND_CASES, _bad_values, _case, _recv_case, _slots
from bench_scripts import load

compiled = plan_cpu.module()
pytestmark = pytest.mark.skipif(compiled is None, reason="the compiled CPU plan does not build here (no C++ "
                                                         "compiler or ninja)")


@contextlib.contextmanager
def torch_ops():
    """The references: the package's torch operations, the compiled calls off."""
    plan_cpu.enabled = False
    try:
        yield
    finally:
        plan_cpu.enabled = True


@settings(max_examples=80, deadline=None)
@given(**{**ROUTE_CASES, "weight_dtype": st.sampled_from([torch.bfloat16, torch.float16, torch.float32,
                                                          torch.float64])})
def test_route_row_is_the_references(world, local, tokens, topk, idx_dtype, weight_dtype, bad, check_values, seed):
    """The route and the counts row of one group, bad values included (dropped
    from the route; with the checks, the failed entry raised): bitwise
    ``plan_graph.route_phase_reference``."""
    experts = world * local
    gen = torch.Generator().manual_seed(seed)
    idx, weights = _bad_values(_slots(tokens, topk, experts, gen),
                               torch.rand(tokens, topk, generator=gen, dtype=torch.float64), bad, gen, experts)
    idx, weights = idx.to(idx_dtype), weights.to(weight_dtype)
    header = torch.arange(len(plan.HEADER), dtype=torch.int64) + 7
    header[plan.HEADER.index("failed")] = 0
    with torch_ops():
        want, _, want_row = plan_graph.route_phase_reference(idx, weights, header, experts, world, check_values)
    dest, hit, row = compiled.route_row(idx, weights, header, experts, world, check_values,
                                        plan.HEADER.index("failed"))
    assert torch.equal(dest, want.dest) and torch.equal(hit, want.hit) and torch.equal(row, want_row)


@settings(max_examples=80, deadline=None)
@given(**ROUTE_CASES)
def test_route_is_the_references(world, local, tokens, topk, idx_dtype, weight_dtype, bad, check_values, seed):
    """The route of any ids, bad ones included (empty slots there): bitwise
    ``plan.route_reference``."""
    experts = world * local
    gen = torch.Generator().manual_seed(seed)
    idx, _ = _bad_values(_slots(tokens, topk, experts, gen), torch.rand(tokens, topk, generator=gen), bad, gen,
                         experts)
    idx = idx.to(idx_dtype)
    want, got = plan.route_reference(idx, experts, world), plan.route(idx, experts, world)
    assert torch.equal(got.dest, want.dest) and torch.equal(got.hit, want.hit)
    assert torch.equal(got.counts, want.counts)


@settings(max_examples=80, deadline=None)
@given(**ROUTE_CASES, nodes=st.integers(1, 3))
def test_counts_row_is_the_references(world, local, tokens, topk, idx_dtype, weight_dtype, bad, check_values, seed,
                                      nodes):
    """The counts exchange's route, node hits, row (``counts.route_and_row``:
    the counts, the header, T, the tokens with an expert on each node, G) and
    routing rows (``counts.ROUTING``), bad values included (dropped from the
    route; with the checks, the failed entry raised): bitwise its torch
    operations'."""
    world *= nodes
    experts = world * local
    gen = torch.Generator().manual_seed(seed)
    idx, weights = _bad_values(_slots(tokens, topk, experts, gen),
                               torch.rand(tokens, topk, generator=gen, dtype=torch.float64), bad, gen, experts)
    idx, weights = idx.to(idx_dtype), weights.to(weight_dtype)
    head = [7 + i for i in range(len(plan.HEADER))] + [tokens, 1 + seed % 3]
    head[plan.HEADER.index("failed")] = seed % 2  # (a refused rank's: kept)
    rank = seed % world
    for with_routing in (False, True):
        args = (idx, weights, head, experts, world, world // nodes, check_values, torch.device("cpu"), rank,
                with_routing)
        with torch_ops():
            want = counts.route_and_row(*args)
        got = counts.route_and_row(*args)
        assert (got[3] is None) == (want[3] is None) == (not with_routing)
        for one, other in zip((*got[0].__dict__.values(), *got[1:3]), (*want[0].__dict__.values(), *want[1:3])):
            assert one.dtype == other.dtype and torch.equal(one, other)
    assert got[3].dtype == want[3].dtype and torch.equal(got[3], want[3])
    assert got[3].shape == (tokens, 2 + 2 * topk)
    assert torch.equal(got[3][:, 2 + topk:], weights.double().view(torch.int64))  # (bits: NaN too)


@settings(max_examples=80, deadline=None)
@given(items=st.integers(0, 40), dests=st.integers(1, 9), seed=st.integers(0, 10**6))
def test_send_order_is_the_references(items, dests, seed):
    """Items going out destination-major (``counts.send_order``): the item of
    each send row and each item's rows, bitwise ``plan.send_positions``,
    ``plan.items_by_row`` and ``plan.rows_by_item``."""
    gen = torch.Generator().manual_seed(seed)
    hit = torch.rand(items, dests, generator=gen) < torch.rand(1, generator=gen)
    sizes = tuple(hit.sum(0).tolist())
    with torch_ops():
        want = counts.send_order(hit, sizes)
    got = counts.send_order(hit, sizes)
    for one, other in zip(got, want):
        assert one.dtype == other.dtype and torch.equal(one, other)


@settings(max_examples=80, deadline=None)
@given(world=st.integers(1, 6), local=st.integers(1, 4), items=st.integers(0, 50), topk=st.integers(1, 6),
       rank=st.integers(0, 5), bad=st.sampled_from(["none", "id", "repeat", "empty"]), spread=st.integers(1, 3),
       seed=st.integers(0, 10**6))
def test_expand_is_the_references(world, local, items, topk, rank, bad, spread, seed):
    """The expansion of the routing rows that reached this rank to canonical
    order (``counts.expand``: the slots, the items with a slot here and each
    one's expanded rows, each row's item, weight, source rank and token),
    items in any order of their keys, ids the route drops included, items
    with no slot here holding any source: bitwise its torch operations'."""
    rank = rank % world
    experts = world * local
    gen = torch.Generator().manual_seed(seed)
    ids, weights = _bad_values(_slots(items, topk, experts, gen), torch.rand(items, topk, generator=gen), bad, gen,
                               experts)
    block = max(items * spread // world + 1, 1)
    key = torch.randperm(world * block, generator=gen)[:items]  # unique (source rank, token)
    route = plan.route_reference(ids, experts, world)
    here = (route.dest == rank).any(1)
    source = torch.stack([key // block, key % block], 1)
    source[~here] = torch.randint(-1, 3, (int((~here).sum()), 2), generator=gen)  # (not keyed: any)
    routing = torch.cat([source, ids.long(), weights.double().view(torch.int64)], 1)
    num_rows = int(route.counts[rank, 1:].sum())
    args = (routing, topk, block, experts, world, rank, num_rows, min(topk, local), int(here.sum()))
    with torch_ops():
        want = counts.expand(*args)
    got = counts.expand(*args)
    for name, value in want.__dict__.items():
        assert value.dtype == getattr(got, name).dtype and torch.equal(getattr(got, name), value), name
    assert torch.equal(got.weights.view(torch.int64), weights.double().flatten()[got.slots].view(torch.int64))
    assert torch.equal(got.src_rank * block + got.src_token, (source[:, 0] * block + source[:, 1])[got.expand_src])
    with pytest.raises(RuntimeError, match="slots here disagree with the counts"):
        compiled.expand(*args[:6], num_rows + 1, *args[7:])
    with pytest.raises(RuntimeError, match="items here disagree with the counts"):
        compiled.expand(*args[:8], int(here.sum()) + 1)


@settings(max_examples=60, deadline=None)
@given(nodes=st.integers(1, 3), ranks_per_node=st.integers(1, 3), local=st.integers(1, 3), topk=st.integers(1, 4),
       rank=st.integers(0, 8), bad=st.sampled_from(["none", "id", "repeat", "empty"]), seed=st.integers(0, 10**6))
def test_the_hierarchical_host_plan_is_the_references(nodes, ranks_per_node, local, topk, rank, bad, seed):
    """The hierarchical variant's host plan from the counts exchange
    (``hierarchical.tier_plan``: each tier's rows each way, this rank's slots per
    expert, stage 1's send order and rows, its offsets) and its second stage's send
    order and rows (``hierarchical.forward_order``), any layout of nodes, ranks with
    no tokens, ids the route drops: bitwise their torch operations'."""
    world = nodes * ranks_per_node
    rank, experts = rank % world, world * local
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 7, (world,), generator=gen)
    ids = [_bad_values(_slots(int(t), topk, experts, gen), torch.rand(int(t), topk, generator=gen), bad, gen,
                       experts)[0] for t in tokens]
    routes = [plan.route_reference(one, experts, world) for one in ids]
    node_hit = [r.hit.view(-1, nodes, ranks_per_node).any(2) for r in routes]
    mine = ids[rank]
    routing = torch.cat([torch.full((mine.shape[0], 1), rank), torch.arange(mine.shape[0]).unsqueeze(1), mine.long(),
                         torch.rand(mine.shape, generator=gen, dtype=torch.float64).view(torch.int64)], 1)
    gc = types.SimpleNamespace(counts=torch.stack([r.counts for r in routes]), tokens=tokens, routing=routing,
                               node_hits=torch.stack([h.sum(0) for h in node_hit]), node_hit=node_hit[rank])
    with torch_ops():
        want = hierarchical.tier_plan(gc, rank, ranks_per_node)
    got = hierarchical.tier_plan(gc, rank, ranks_per_node)
    for one, other in zip(got, want):
        if isinstance(other, torch.Tensor):
            assert one.dtype == other.dtype and torch.equal(one, other)
        else:
            assert list(one) == list(other)
    node = rank // ranks_per_node
    first, held = node * ranks_per_node, got[7]  # this node's first rank; as if stage 1's rows came back here
    sizes = tuple(plan.route_reference(held[:, 2 : 2 + topk], experts, world).hit[:, first : first + ranks_per_node]
                  .sum(0).tolist())
    args = (held, topk, experts, world, first, sizes)
    with torch_ops():
        want = hierarchical.forward_order(*args)
    got = hierarchical.forward_order(*args)
    for one, other in zip(got, want):
        assert one.dtype == other.dtype and torch.equal(one, other)
    assert torch.equal(got[2], held[got[0]])


@settings(max_examples=80, deadline=None)
@given(**SEND_CASES, own_groups=st.integers(1, 4))
def test_send_plan_is_the_references(world, local, tokens, topk, rank, weight_dtype, seed, own_groups):
    """The send plan, summary and receive table of one group, any rank of any
    world (the peers' rows made up around this rank's own): bitwise
    ``plan_graph.send_phase`` in torch operations on every row the exchange
    reads (``send_token`` and ``meta`` up to the S rows sent; the C rows past
    them are -1 here, unset or a dump there). This rank's G (``own_groups``,
    sent in one order whatever G) sets the summary's fullest groups."""
    rank = rank % world
    experts = world * local
    gen = torch.Generator().manual_seed(seed)
    idx = _slots(tokens, topk, experts, gen)
    weights = (torch.rand(tokens, topk, generator=gen, dtype=torch.float64) * 3 - 1).to(weight_dtype)
    header = torch.zeros(len(plan.HEADER), dtype=torch.int64)
    route, _, row = plan_graph.route_phase_reference(idx, weights, header, experts, world, False)
    gathered = torch.randint(0, 50, (world, row.numel()), generator=gen)
    gathered[rank] = row
    own_groups = min(own_groups, local)  # (a G in [1, E_local], as dispatch takes it)
    gathered[rank, -1] = own_groups  # (the row's last entry: G)
    with torch_ops():
        want = plan_graph.send_phase(route, None, gathered, rank, idx, weights, own_groups)
    *send, summary, table = compiled.send_plan(route.dest, route.hit, gathered, rank, idx, weights,
                                               len(plan.HEADER))
    got = plan.SendPlan(*send)
    sent = int(route.counts[:, 0].sum())
    assert got.send_token.shape == want.send.send_token.shape and got.meta.shape == want.send.meta.shape
    assert torch.equal(got.send_token[:sent], want.send.send_token[:sent])
    assert torch.equal(got.meta[:sent], want.send.meta[:sent])
    assert (got.send_token[sent:] == -1).all() and (got.meta[sent:] == -1).all()
    for name in ("home_index", "slot_row", "slot_col"):
        assert torch.equal(getattr(got, name), getattr(want.send, name)), name
    assert torch.equal(summary, want.summary) and torch.equal(table, want.table)


@settings(max_examples=60, deadline=None)
@given(world=st.integers(1, 8), groups=st.integers(1, 5), width=st.integers(1, 4), words=st.sampled_from([1, 2]),
       seed=st.integers(0, 10**6))
def test_recv_plan_is_the_references(world, groups, width, words, seed):
    """The expansion of the received rows, by any number of groups: bitwise
    ``plan.build_recv_plan_reference``."""
    meta, recv_rows, num_rows, weight_dtype, _ = _recv_case(world, groups, width, words, seed)
    table = torch.tensor(plan.recv_table(recv_rows), dtype=torch.int64)
    want = plan.build_recv_plan_reference(meta, table, num_rows, weight_dtype)
    got = plan.RecvPlan(*compiled.recv_plan(meta, table, num_rows, words))
    for name in plan.RecvPlan.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(want, name)), name


@settings(max_examples=80, deadline=None)
@given(**GATHER_CASES, out_dtype=st.sampled_from(["same", torch.float32, torch.bfloat16, torch.float64]),
       weight_dtype=st.sampled_from([None, torch.float32, torch.bfloat16, torch.float64]),
       at_least=st.sampled_from([None, torch.float64]))
def test_gather_sum_is_the_references(rows, width, src_rows, hidden, dtype, out_dtype, weight_dtype, at_least,
                                      seed):
    """Weighted gathered sums in fp32 or fp64, every dtype in and out: bitwise
    ``gather_sum_reference`` (the same terms in the same order, each product
    and sum rounded once), and so what ``gather_sum`` gives on CPU."""
    src, index, weight = (None if t is None else t.cpu()  # (the case is made on the GPU where there is one)
                          for t in _case(rows, width, src_rows, hidden, dtype, seed, weight_dtype is not None))
    weight = None if weight is None else (weight * 3 - 1).to(weight_dtype)
    src = src * 1e3  # sums that round
    out_dtype = dtype if out_dtype == "same" else out_dtype
    want = gs.gather_sum_reference(src, index, weight, out_dtype, at_least)
    got = gs.gather_sum(src, index, weight, out_dtype, at_least)
    assert got.dtype == want.dtype == out_dtype
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))  # the bits, signed zeros included


def test_gather_sum_takes_strided_rows():
    """Rows that are a view (a column slice) sum as their contiguous copy."""
    src = torch.randn(6, 10)[:, 2:8]
    index = torch.tensor([[0, 5, -1], [3, -1, -1]])
    weight = torch.rand(6)
    want = gs.gather_sum_reference(src.contiguous(), index, weight, torch.bfloat16)
    assert torch.equal(compiled.gather_sum(src, index, weight, torch.bfloat16, False), want)
    # fp64 anywhere accumulates in fp64
    for args in ((src.double(), weight, torch.float32, False), (src, weight.double(), torch.float32, False),
                 (src, weight, torch.float64, False), (src, weight, torch.float32, True)):
        want = gs.gather_sum_reference(args[0].contiguous(), index, args[1], args[2],
                                       torch.float64 if args[3] else None)
        assert torch.equal(compiled.gather_sum(args[0], index, *args[1:]), want)


def test_send_plan_takes_no_tokens_with_any_strides():
    """T = 0 with weights whose strides are 0 (an expanded empty tensor, as a
    rank with no tokens may pass): an empty plan, as the reference's."""
    idx = torch.empty(0, 3, dtype=torch.int64)
    weights = torch.empty(0, 1, dtype=torch.float64).expand(0, 3)
    route, _, row = plan_graph.route_phase_reference(idx, weights, torch.zeros(len(plan.HEADER), dtype=torch.int64),
                                                     4, 2, False)
    gathered = torch.stack([row, row])
    *send, summary, table = compiled.send_plan(route.dest, route.hit, gathered, 0, idx, weights, len(plan.HEADER))
    assert [t.numel() for t in send] == [0, 7, 0, 0, 0] and table.tolist() == [[0, 0], [0, 0], [0, 1]]


def test_arguments_of_other_shapes_are_refused_not_read_past():
    """The compiled calls check what they index with (a RuntimeError, no read past a tensor)."""
    with pytest.raises(RuntimeError, match="an index past the rows"):
        compiled.gather_sum(torch.randn(3, 4), torch.tensor([[0, 3]]), None, torch.float32, False)
    with pytest.raises(RuntimeError, match="other forms"):
        compiled.gather_sum(torch.randn(3, 4), torch.tensor([[0, 1]]), torch.rand(2), torch.float32, False)
    idx = torch.tensor([[0, 1], [2, 3]])
    header = torch.zeros(len(plan.HEADER), dtype=torch.int64)
    with pytest.raises(RuntimeError, match="other shapes"):
        compiled.route_row(idx, torch.rand(2, 3), header, 4, 2, True, plan.HEADER.index("failed"))
    route, _, row = plan_graph.route_phase_reference(idx, torch.rand(2, 2), header, 4, 2, False)
    with pytest.raises(RuntimeError, match="other shapes"):
        compiled.send_plan(route.dest, route.hit, torch.stack([row, row]), 0, idx, torch.rand(2, 1), len(plan.HEADER))


def test_the_host_plan_probe_holds_its_two_expansions_equal(tmp_path):
    """``bench/host_plan_probe.py`` (where the GPU's expansion should run) on CPU: its
    two ways, the torch operations and the compiled plan with its copies, give the
    same bits on every row."""
    out = tmp_path / "probe.md"
    assert load("host_plan_probe").main(["--device", "cpu", "--tokens", "7,33", "--worlds", "1,3",
                                         "--experts", "12", "--topk", "3", "--iters", "1", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 4 and all(row.endswith("| yes |") for row in rows), rows
