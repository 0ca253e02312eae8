"""Triton kernels held against their PyTorch references (interpreter on CPU, real on GPU)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dispatch.kernels import gather_sum as gs

pytestmark = pytest.mark.skipif(gs.triton is None, reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(rows, width, src_rows, hidden, dtype, seed, weighted):
    gen = torch.Generator().manual_seed(seed)
    src = torch.randn(src_rows, hidden, generator=gen, dtype=torch.float64).to(dtype)
    counts = torch.randint(0, width + 1, (rows,), generator=gen) if src_rows else torch.zeros(rows, dtype=torch.int64)
    index = torch.full((rows, width), -1, dtype=torch.int64)
    for r in range(rows):
        index[r, : counts[r]] = torch.randint(0, max(src_rows, 1), (int(counts[r]),), generator=gen)
    weight = torch.rand(src_rows, generator=gen) if weighted else None
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return move(src), move(index), move(weight)


# the gathered sums' cases (``_case``) the implementations are held to the reference on (tests/test_plan_cpu.py too)
GATHER_CASES = dict(
    rows=st.integers(0, 9),
    width=st.integers(1, 5),
    src_rows=st.integers(0, 12),
    hidden=st.sampled_from([1, 7, 128, 1030]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]),
    seed=st.integers(0, 10**6),
)


@settings(max_examples=60, deadline=None)
@given(**GATHER_CASES, out_dtype=st.sampled_from(["same", torch.float32, torch.bfloat16]), weighted=st.booleans())
def test_gather_sum_matches_reference(rows, width, src_rows, hidden, dtype, out_dtype, weighted, seed):
    src, index, weight = _case(rows, width, src_rows, hidden, dtype, seed, weighted)
    out_dtype = dtype if out_dtype == "same" else out_dtype
    want = gs.gather_sum_reference(src, index, weight, out_dtype)
    got = gs.gather_sum_triton(src, index, weight, out_dtype)
    assert got.dtype == want.dtype == out_dtype
    # Same accumulation dtype and order. The GPU may fuse each multiply into its
    # add (one rounding fewer per slot) and Triton's interpreter truncates to
    # bf16 where torch rounds: allow one rounding of the accumulator per slot
    # (relative to the sum of magnitudes) plus one unit of the output dtype.
    acc_eps = torch.finfo(gs.accumulate_dtype(src.dtype, out_dtype)).eps
    magnitude = gs.gather_sum_reference(
        src.abs(), index, None if weight is None else weight.abs(), torch.float64
    )
    bound = (width + 1) * acc_eps * magnitude + torch.finfo(out_dtype).eps * want.double().abs()
    excess = (got.double() - want.double()).abs() - bound
    assert not (excess > 0).any(), f"kernel differs from reference by more than rounding: {excess.max()}"
    # written into a buffer's rows (an exchange's send buffer, rows wider than H): the same bits, nothing else
    buffer = torch.full((rows, hidden + 3), 5.0, dtype=out_dtype, device=src.device)
    assert torch.equal(gs.gather_sum(src, index, weight, out_dtype, out=buffer[:, :hidden]),
                       gs.gather_sum(src, index, weight, out_dtype))
    assert torch.equal(buffer[:, hidden:], torch.full((rows, 3), 5.0, dtype=out_dtype, device=src.device))
    with pytest.raises(ValueError, match="out must be"):
        gs.gather_sum(src, index, weight, out_dtype, out=buffer)


def _groups_case(held, width, hidden, groups, seed, dtype, weighted):
    """A received-rows layout: N expanded rows, each owned by one of ``held``
    received rows (at most ``width`` each, ascending), ``groups`` ranges of them."""
    gen = torch.Generator().manual_seed(seed)
    # every received row has one to ``width`` slots (-1 padded)
    sizes = torch.randint(1, width + 1, (held,), generator=gen)
    owner = torch.repeat_interleave(torch.arange(held), sizes)
    owner = owner[torch.randperm(owner.numel(), generator=gen)]
    index = torch.full((held, width), -1, dtype=torch.int64)
    counts = [0] * held
    expand_all, expand_col = [], []
    for n, j in enumerate(owner.tolist()):
        index[j, counts[j]] = n
        expand_all.append(j)
        expand_col.append(counts[j])
        counts[j] += 1
    rows = len(expand_all)
    bounds = sorted([0, rows, *torch.randint(0, rows + 1, (groups - 1,), generator=gen).tolist()])
    src = torch.randn(rows, hidden, generator=gen, dtype=torch.float64).to(dtype)
    weight = torch.rand(rows, generator=gen).to(dtype) if weighted else None
    place = torch.randperm(held, generator=gen)
    return index, torch.tensor(expand_all), torch.tensor(expand_col), bounds, src, weight, place


@settings(max_examples=40, deadline=None)
@given(
    held=st.integers(1, 7),
    width=st.integers(1, 4),
    hidden=st.sampled_from([1, 9, 130]),
    groups=st.integers(1, 5),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]),
    wire=st.sampled_from(["same", torch.bfloat16, torch.float32]),
    weighted=st.booleans(),
    seed=st.integers(0, 10**6),
)
def test_accumulate_group_gives_one_pass_bits(held, width, hidden, groups, dtype, wire, weighted, seed):
    """Adding the groups' rows one range after another into running sums, each
    pre-sum written out (at its place) when its last group is in: bitwise the
    one-pass gather_sum, Triton against Triton and reference against reference,
    whatever the ranges (empty ones included)."""
    index, expand_all, expand_col, bounds, src, weight, place = _groups_case(held, width, hidden, groups, seed,
                                                                            dtype, weighted)
    out_dtype = dtype if wire == "same" else wire
    acc_dtype = gs.accumulate_dtype(dtype, out_dtype, *(() if weight is None else (weight.dtype,)))
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    index, expand_all, expand_col, src, weight, place = map(move, (index, expand_all, expand_col, src, weight, place))
    for grouped, one_pass in ((gs.accumulate_group_triton, gs.gather_sum_triton),
                              (gs.accumulate_group_reference, gs.gather_sum_reference)):
        acc = torch.zeros(held, hidden, dtype=acc_dtype, device=DEVICE)
        if grouped is gs.accumulate_group_triton:
            acc.fill_(float("nan"))  # the kernel reads only what an earlier group wrote
        out = torch.full((held, hidden), float("nan"), dtype=out_dtype, device=DEVICE)
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            extra = (expand_all, expand_col) if grouped is gs.accumulate_group_triton else ()
            grouped(acc, out, src[lo:hi], index, None if weight is None else weight[lo:hi], lo, hi, place, *extra)
        want = one_pass(src, index, weight, out_dtype)
        assert torch.equal(out[place], want), grouped.__name__


def test_gather_sum_padding_and_exact_sums():
    src = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]], device=DEVICE)
    index = torch.tensor([[2, 0, -1], [-1, -1, -1], [1, 1, 1]], device=DEVICE)
    weight = torch.tensor([0.5, 2.0, 0.25], device=DEVICE)
    expected = torch.tensor([[25.5, 51.0], [0.0, 0.0], [60.0, 120.0]])
    for fn in (gs.gather_sum_reference, gs.gather_sum_triton):
        assert torch.equal(fn(src, index, weight, torch.float32).cpu(), expected)


def _recv_case(world, groups, width, words, seed):
    """Received metadata of a consistent plan by ``groups`` groups: the expanded
    positions are a permutation of all rows, split among the received rows
    (ascending, -1 padded); returns (metadata in arrival order, [G][W] rows,
    N, weight dtype, the metadata as held)."""
    gen = torch.Generator().manual_seed(seed)
    recv_rows = torch.randint(0, 5, (groups, world), generator=gen).tolist()
    weight_dtype = torch.float32 if words == 1 else torch.float64
    num_recv = sum(map(sum, recv_rows))
    slots = torch.randint(0, width + 1, (num_recv,), generator=gen)
    order = torch.randperm(int(slots.sum()), generator=gen)
    held = torch.full((num_recv, width + 1 + width * words), -1, dtype=torch.int32)  # group-major, then source
    at = 0
    for j, k in enumerate(slots.tolist()):
        held[j, :k] = order[at : at + k].sort().values.to(torch.int32)
        at += k
    held[:, width] = torch.randint(0, 1000, (num_recv,), generator=gen, dtype=torch.int32)
    weights = torch.rand(num_recv, width, generator=gen, dtype=torch.float64).to(weight_dtype)
    held[:, width + 1 :] = weights.contiguous().view(torch.int32).view(num_recv, width * words)
    starts = [sum(map(sum, recv_rows[:g])) for g in range(groups)]
    arrived = []  # arrival order: source rank, then group
    for s in range(world):
        for g in range(groups):
            first = starts[g] + sum(recv_rows[g][:s])
            arrived.append(held[first : first + recv_rows[g][s]])
    return torch.cat(arrived), recv_rows, int(slots.sum()), weight_dtype, held


@settings(max_examples=40, deadline=None)
@given(
    world=st.integers(1, 8),
    groups=st.integers(1, 5),
    width=st.integers(1, 4),
    words=st.sampled_from([1, 2]),
    seed=st.integers(0, 10**6),
)
def test_recv_plan_kernel_matches_reference(world, groups, width, words, seed):
    from dispatch import plan
    from dispatch.kernels import recv_plan

    meta, recv_rows, num_rows, weight_dtype, held = _recv_case(world, groups, width, words, seed)
    table = torch.tensor(plan.recv_table(recv_rows), dtype=torch.int64, device=DEVICE)
    meta = meta.to(DEVICE)
    want = plan.build_recv_plan_reference(meta, table, num_rows, weight_dtype)
    got = plan.RecvPlan(*recv_plan.recv_plan_triton(meta, table, num_rows, weight_dtype))
    for name in plan.RecvPlan.__dataclass_fields__:
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    # every row lands where it is held: its slot list, and every expanded row points back at it
    assert torch.equal(want.presum_index.cpu(), held[:, :width].long())
    assert torch.equal(want.src_token.cpu(), held[:, width].long())
    assert torch.equal(want.expanded_token, want.src_token[want.expand_src])
    assert torch.equal(want.expanded_rank, want.src_rank[want.expand_src])
    for n, j in enumerate(want.expand_src.tolist()):
        assert n in want.presum_index[j].tolist(), (n, j)
    # the kernel's int64 outputs share allocations, each still starting 16-byte aligned
    assert all(t.data_ptr() % 16 == 0 for t in (got.expand_src, got.expanded_token, got.expanded_rank,
                                                 got.src_token, got.src_rank))


@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(0, 9),
    extra=st.integers(0, 4),
    width=st.sampled_from([1, 5, 128, 2100]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64, torch.int64]),
    seed=st.integers(0, 10**6),
)
def test_scatter_rows_matches_reference(rows, extra, width, dtype, seed):
    from dispatch.kernels import scatter_rows as sr

    gen = torch.Generator().manual_seed(seed)
    src = (torch.randn(rows, width, generator=gen, dtype=torch.float64) * 100).to(dtype).to(DEVICE)
    place = torch.randperm(rows + extra, generator=gen)[:rows].to(DEVICE)
    fill = torch.full((rows + extra, width), 7, dtype=dtype, device=DEVICE)
    want = sr.scatter_rows_reference(fill.clone(), place, src)
    got = sr.scatter_rows_triton(fill.clone(), place, src)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows, width", [(0, 64), (5, 1), (7, 300), (3, 2100)])
@pytest.mark.parametrize("dtype, weight_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                                 (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("want_weights", [True, False])
def test_weighted_row_grads_kernel_matches_reference(rows, width, dtype, weight_dtype, want_weights):
    """The experts' output gradient bitwise the reference's; the weights' to fp32
    rounding of the row's dot product (its own summation order)."""
    from dispatch.kernels import row_grads

    gen = torch.Generator().manual_seed(rows * width)
    g = torch.randn(rows, width, generator=gen).to(dtype).to(DEVICE)
    y = torch.randn(rows, width, generator=gen).to(dtype).to(DEVICE)
    w = torch.rand(rows, generator=gen).to(weight_dtype).to(DEVICE)
    got = row_grads.weighted_row_grads_triton(g, w, y, want_weights)
    want = row_grads.weighted_row_grads_reference(g, w, y, want_weights)
    assert got[0].dtype == want[0].dtype == dtype
    if DEVICE == "cpu" and dtype == torch.bfloat16:  # the interpreter truncates to bf16 where torch rounds
        step = torch.finfo(dtype).eps * want[0].double().abs()
        assert ((got[0].double() - want[0].double()).abs() <= step).all()
    else:
        assert torch.equal(got[0], want[0])
    if not want_weights:
        assert got[1] is None and want[1] is None
        return
    assert got[1].dtype == want[1].dtype == weight_dtype
    exact = (g.double() * y.double()).sum(1)
    bound = width * torch.finfo(torch.float32).eps * (g.double() * y.double()).abs().sum(1)
    step = torch.finfo(weight_dtype).eps * exact.abs()  # the final cast's rounding
    assert ((got[1].double() - exact).abs() <= bound + step).all()
    assert ((got[1].double() - want[1].double()).abs() <= 2 * (bound + step)).all()


def test_weighted_row_grads_fp64_takes_the_reference():
    from dispatch.kernels import row_grads

    g = torch.randn(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="fp64"):
        row_grads.weighted_row_grads_triton(g, torch.rand(4, dtype=torch.float64), g, True)
    got = row_grads.weighted_row_grads(g, torch.rand(4, dtype=torch.float64), g, True)
    assert got[0].dtype == torch.float64 and got[1].dtype == torch.float64


def _slots(tokens: int, topk: int, experts: int, gen: torch.Generator) -> torch.Tensor:
    """[T, K] int64 distinct expert ids per token, some slots empty (-1; all
    past E where K > E)."""
    idx = torch.rand(tokens, experts, generator=gen).argsort(dim=1)[:, : min(topk, experts)]
    idx = torch.cat([idx, torch.full((tokens, topk - idx.shape[1]), -1)], 1)
    return torch.where(torch.rand(tokens, topk, generator=gen) < 0.2, -1, idx)


def _bad_values(idx, weights, bad, gen, experts):
    """``idx`` and ``weights`` with one bad value of kind ``bad`` ("none": as they are): an id
    out of range, a repeat, a NaN or infinite weight, or a token with every slot empty."""
    tokens, topk = idx.shape
    if tokens and bad != "none":
        t, k = int(torch.randint(tokens, (1,), generator=gen)), int(torch.randint(topk, (1,), generator=gen))
        if bad == "id":
            idx[t, k] = experts + int(torch.randint(3, (1,), generator=gen)) if k % 2 else -2
        elif bad == "repeat" and topk > 1:
            idx[t, k], idx[t, (k + 1) % topk] = 0, 0
        elif bad == "nan":
            weights[t, k] = float("nan")
        elif bad == "inf":
            weights[t, k] = float("-inf") if k % 2 else float("inf")
        elif bad == "empty":
            idx[t] = -1
    return idx, weights


# the routings the route's implementations are held to their reference on (tests/test_plan_cpu.py too)
ROUTE_CASES = dict(
    world=st.integers(1, 9),
    local=st.integers(1, 4),
    tokens=st.integers(0, 70),
    topk=st.integers(1, 6),
    idx_dtype=st.sampled_from([torch.int32, torch.int64]),
    weight_dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]),
    bad=st.sampled_from(["none", "id", "repeat", "nan", "inf", "empty"]),
    check_values=st.booleans(),
    seed=st.integers(0, 10**6),
)
# and the send plan's
SEND_CASES = dict(
    world=st.integers(1, 9),
    local=st.integers(1, 4),
    tokens=st.integers(0, 40),
    topk=st.integers(1, 6),
    rank=st.integers(0, 8),
    weight_dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]),
    seed=st.integers(0, 10**6),
)


@settings(max_examples=60, deadline=None)
@given(**ROUTE_CASES)
def test_route_row_kernel_matches_reference(world, local, tokens, topk, idx_dtype, weight_dtype, bad, check_values,
                                            seed):
    """The route and counts row of one group in one kernel: bitwise the torch
    operations' (``plan_graph.route_phase_reference``), bad values included
    (ids out of range, repeats, non-finite weights: dropped from the route, and
    the failed entry raised with the checks)."""
    from dispatch import plan, plan_graph
    from dispatch.kernels import route_row

    experts = world * local
    gen = torch.Generator().manual_seed(seed)
    idx, weights = _bad_values(_slots(tokens, topk, experts, gen),
                               torch.rand(tokens, topk, generator=gen, dtype=torch.float64), bad, gen, experts)
    idx, weights = idx.to(idx_dtype).to(DEVICE), weights.to(weight_dtype).to(DEVICE)
    header = torch.arange(len(plan.HEADER), dtype=torch.int64, device=DEVICE) + 7
    header[plan.HEADER.index("failed")] = 0
    want_route, _, want_row = plan_graph.route_phase_reference(idx, weights, header, experts, world, check_values)
    layout = plan_graph.counts_row(world, local)
    dest, hit, row = route_row.route_row_triton(idx, weights, header, experts, world, check_values, layout.width,
                                                layout.header_at, layout.header_at + plan.HEADER.index("failed"))
    assert torch.equal(dest, want_route.dest)
    assert torch.equal(hit, want_route.hit)
    assert torch.equal(row, want_row)


@settings(max_examples=60, deadline=None)
@given(**SEND_CASES)
def test_send_plan_kernel_matches_reference(world, local, tokens, topk, rank, weight_dtype, seed):
    """The send plan of one group in two kernels: bitwise the torch operations'
    (``plan.build_send_plan``) on every row the exchange reads (``send_token``
    and ``meta`` up to the S rows sent), any rank of any world (the peers'
    counts made up around this rank's own)."""
    from dispatch import plan
    from dispatch.kernels import send_plan

    rank = rank % world
    experts = world * local
    gen = torch.Generator().manual_seed(seed)
    idx = _slots(tokens, topk, experts, gen).to(DEVICE)
    weights = (torch.rand(tokens, topk, generator=gen, dtype=torch.float64) * 3 - 1).to(weight_dtype).to(DEVICE)
    route = plan.route(idx, experts, world)
    all_counts = torch.randint(0, 50, (world, world, 1 + local), generator=gen).to(DEVICE)
    all_counts[rank] = route.counts
    want = plan.build_send_plan(route, all_counts, rank, idx, weights)
    got = plan.SendPlan(*send_plan.send_plan_triton(route.hit, route.dest, route.counts[:, 0], all_counts, rank, idx,
                                                    weights))
    sent = int(route.counts[:, 0].sum())
    assert torch.equal(got.send_token[:sent], want.send_token[:sent])
    assert got.send_token.shape == want.send_token.shape and got.meta.shape == want.meta.shape
    assert torch.equal(got.meta[:sent], want.meta[:sent])
    for name in ("home_index", "slot_row", "slot_col"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_send_plan_kernel_only_where_its_counts_stay_small():
    """The blocks' counts per expert grow as T x E: past ``MAX_COUNTS`` entries
    the plan runs the torch operations (``plan_graph.send_phase``)."""
    from dispatch.kernels import send_plan

    assert send_plan.fits(4096, 8, 256) and send_plan.fits(0, 8, 10**9)
    assert not send_plan.fits(65536, 8, 512)
    tokens = send_plan._block_tokens(8)  # a block's tokens at K = 8
    blocks = send_plan.MAX_COUNTS // 256
    assert send_plan.fits(blocks * tokens, 8, 256) and not send_plan.fits(blocks * tokens + 1, 8, 256)


def _summary_case(world, local, spoil, gen):
    """A plan summary (``plan_graph.plan_summary``'s layout) of ranks that agree,
    spoiled by one way ``checks.peers_fail`` names (or none)."""
    from dispatch import checks, plan
    from dispatch.plan_graph import Summary

    sizes = Summary.sizes(world, local)
    summary = torch.randint(0, 40, (sum(sizes),), generator=gen)
    send, recv, per_expert, headers, matrix, received, by_group, groups, fullest = summary.split(sizes)
    headers = headers.view(world, len(plan.HEADER))
    headers[:, : checks.AGREED] = headers[0, : checks.AGREED].clone()
    failed, bound, memory = (plan.HEADER.index(name) for name in ("failed", "max_rows", "memory_rows"))
    headers[:, failed] = 0
    received.add_(1)  # (a rank over its bound or its memory has rows)
    headers[:, bound] = torch.where(torch.rand(world, generator=gen) < 0.5, -1, received + 5)
    headers[:, memory] = torch.where(torch.rand(world, generator=gen) < 0.5, -1, received + 50)
    # G = 3 for some (the bound of each group then), one group where a rank is over its N's bound
    split = 3 if spoil.startswith("group ") or (spoil != "over" and bool(torch.rand(1, generator=gen) < 0.3)) else 1
    groups.fill_(split)
    fullest.copy_(-(-received // split))  # (each rank's rows spread evenly over its groups)
    peer = int(torch.randint(0, world, (1,), generator=gen))
    if spoil == "agreed":
        headers[peer, int(torch.randint(0, checks.AGREED, (1,), generator=gen))] += 1
    elif spoil == "failed":
        headers[peer, failed] = 2
    elif spoil == "over":
        headers[peer, bound] = received[peer] - 1
    elif spoil == "short":
        headers[peer, memory] = received[peer] - 1
    elif spoil == "at bound":  # (not over it)
        headers[peer, bound] = received[peer]
    elif spoil == "short of bound":  # memory for its rows, not for its bound
        headers[peer, bound], headers[peer, memory] = received[peer] + 10, received[peer] + 5
    elif spoil == "zero bound":
        headers[peer, bound] = 0
    elif spoil == "groups":  # (its rows spread over its own G: a one-rank world has nothing to disagree with)
        groups[peer] += 1
        fullest[peer] = -(-received[peer] // groups[peer])
    elif spoil in ("group over", "group at bound"):  # by groups: the fullest group against B = ceil(bound / G)
        headers[peer, bound] = received[peer] + 5
        fullest[peer] = -(-(received[peer] + 5) // split) + (spoil == "group over")
    return summary


@settings(max_examples=60, deadline=None)
@given(world=st.sampled_from([1, 2, 3, 5, 8, 300]), local=st.sampled_from([1, 3, 16, 128]), rank=st.integers(0, 299),
       spoil=st.sampled_from(["none", "agreed", "failed", "over", "short", "at bound", "short of bound", "zero bound",
                              "groups", "group over", "group at bound"]), seen=st.booleans(),
       seed=st.integers(0, 10**6))
def test_settle_kernel_matches_reference(world, local, rank, spoil, seen, seed):
    """A bounded NVSHMEM plan settled in one kernel (``bounded_plan.settle``):
    its failure, the record of the first one (in place), the masked W-vectors,
    the rows per local expert and the receive table, bitwise the torch
    operations', every way a dispatch fails and none."""
    from dispatch.kernels import bounded_plan

    gen = torch.Generator().manual_seed(seed)
    summary = _summary_case(world, local, spoil, gen).to(DEVICE)
    rank %= world
    records = [(torch.tensor(seen, device=DEVICE), torch.randint(0, 9, summary.shape, generator=gen).to(DEVICE))
               for _ in range(2)]
    records[1][1].copy_(records[0][1])
    want = bounded_plan.settle_reference(summary, world, local, rank, *records[0])
    got = bounded_plan.settle_triton(summary, world, local, rank, *records[1])
    one_rank_fails = ("failed", "over", "short", "short of bound", "zero bound", "group over")
    assert bool(want.failed) == (spoil in one_rank_fails or (world > 1 and spoil in ("agreed", "groups")))
    for name, one, other in zip(bounded_plan.Settled._fields, got, want):
        assert one.dtype == other.dtype and torch.equal(one, other), name
    assert torch.equal(records[0][0], records[1][0]) and torch.equal(records[0][1], records[1][1])
    assert all(t.data_ptr() % 16 == 0 for t in got[1:])  # one allocation, each part aligned as its own would be


@settings(max_examples=40, deadline=None)
@given(num_rows=st.integers(0, 700), held=st.integers(0, 40), sent_rows=st.integers(0, 600), local=st.integers(1, 9),
       world=st.integers(1, 8), wide=st.booleans(), seed=st.integers(0, 10**6))
def test_pad_kernel_matches_reference(num_rows, held, sent_rows, local, world, wide, seed):
    """A bounded NVSHMEM plan's padding in one kernel (``bounded_plan.pad``):
    the expanded rows past N and the send rows past S, bitwise the torch
    operations' (N and S anywhere from none to every row)."""
    from dispatch.kernels import bounded_plan

    gen = torch.Generator().manual_seed(seed)
    real = int(torch.randint(0, num_rows + 1, (1,), generator=gen)) if held else 0
    per_expert = torch.zeros(local, dtype=torch.int64)
    per_expert.index_add_(0, torch.randint(0, local, (real,), generator=gen), torch.ones(real, dtype=torch.int64))
    sent = int(torch.randint(0, sent_rows + 1, (1,), generator=gen))
    sends = torch.zeros(world, dtype=torch.int64)
    sends.index_add_(0, torch.randint(0, world, (sent,), generator=gen), torch.ones(sent, dtype=torch.int64))
    args = (torch.randint(0, max(held, 1), (num_rows,), generator=gen),
            torch.randn(num_rows, generator=gen, dtype=torch.float64 if wide else torch.float32),
            torch.randint(0, 8, (held,), generator=gen), torch.randint(0, 5000, (held,), generator=gen), per_expert,
            torch.randint(0, 5000, (sent_rows,), generator=gen), sends)
    args = tuple(t.to(DEVICE) for t in args)
    want = bounded_plan.pad_reference(*args, held + 3)
    got = bounded_plan.pad_triton(*args, held + 3)
    for name, one, other in zip(bounded_plan.Padded._fields, got, want):
        assert one.dtype == other.dtype and torch.equal(one, other), name
    assert all(t.data_ptr() % 16 == 0 for t in got)
