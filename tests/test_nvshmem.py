"""The NVSHMEM transport (``transport="nvshmem"``): bitwise the NCCL transport,
with and without ``max_rows``, every wire, dtypes, gradients, groups and the
async verbs; with ``max_rows`` nothing read on the host and failures recorded
on the device, raised at a later host read on every rank alike; refused by name
where NVSHMEM cannot run; ``auto``'s rule.

On CPU its rows move through ``splits_exchange.HostSplitsExchange`` (the
contract of torch's NVSHMEM all-to-all over gloo): everything but the NVSHMEM
call itself runs here, on several ranks. On two GPUs or more with a torch built
with NVSHMEM the same comparisons run on the real thing, in a world of its own
(torch fixes one symmetric-memory backend per process, and the NVLink engine's
tests take the shared worlds to CUDA's); there the engine runs too, on
NVSHMEM's buffers.
"""

from __future__ import annotations

import ctypes
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import dispatch
from dispatch import cuda
import pipeline_fns
import rank_fns
from dispatch.dispatcher import TokenDispatcher
from dispatch.transports import REGISTRY, HierarchicalNVSHMEMTransport, NVSHMEMTransport, choose, registry_key
from dispatch.bench.common import same_bits
from routing import routings

VERBS = ("tokens", "weights", "src_rank", "src_token", "tokens_per_expert", "combined", "grad_x", "grad_w", "rows",
         "home", "slots")


def _dispatcher(config: dict, emulated: bool):
    """The NVSHMEM transport's dispatcher (its rows over gloo where ``emulated``)."""
    return rank_fns.dispatcher(dict(config, transport="nvshmem"), emulated)


def _round_trip(d, x, topk_idx, topk_weights, grad_out, max_rows, groups, async_op):
    got = rank_fns.every_verb(d, x, topk_idx, topk_weights, grad_out, max_rows, groups, async_op)
    return {k: got[k].cpu() for k in VERBS}, got["per_expert"]


def against_nccl(x, topk_idx, topk_weights, grad_out, config, pad, groups, async_op, emulated):
    """Every verb of one round trip over NVSHMEM and over NCCL on the same
    inputs; with ``pad`` not None, both with max_rows = N + pad. Returns the
    verbs that differ, and whether the bounded one read its counts on the host."""
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights, grad_out = (t.to(device) for t in (x, topk_idx, topk_weights, grad_out))
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    bound = None
    if pad is not None:
        bound = nccl.dispatch(x, topk_idx, topk_weights).tokens.shape[0] + pad
    want, _ = _round_trip(nccl, x, topk_idx, topk_weights, grad_out, bound, groups, False)
    d = _dispatcher(config, emulated)
    got, host_counts = _round_trip(d, x, topk_idx, topk_weights, grad_out, bound, groups, async_op)
    if groups > 1:  # the sums home group by group too
        want["by_groups"], got["by_groups"] = (_by_groups(one, x, topk_idx, topk_weights, groups) for one in (nccl, d))
    d.check()
    differ = [k for k in want if not same_bits(got[k], want[k])]
    return differ, host_counts is not None


def _by_groups(d, x, topk_idx, topk_weights, groups):
    """combine_groups of a dispatch by groups: each group's rows doubled, home group by group."""
    work = d.dispatch(x, topk_idx, topk_weights, groups=groups, async_op=True)
    sums = d.combine_groups(work.handle, dtype=x.dtype)
    for g in range(groups):
        piece = work.wait_group(g)
        sums.add(piece.tokens * 2, piece.weights)
    work.wait()
    return sums.wait().cpu()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_every_verb_is_bitwise_the_nccl_transports(worlds, data):
    world = data.draw(st.sampled_from([2, 3]))
    routing = data.draw(routings(world, max_tokens=12))
    dtype = data.draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
    wire = data.draw(st.sampled_from(["native", "bf16", "fp8"]))
    pad = data.draw(st.sampled_from([None, 0, 5]))
    local = routing.num_experts // world
    groups = data.draw(st.sampled_from([1, 2])) if pad is None and local >= 2 else 1
    async_op = data.draw(st.booleans())
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 1000)))
    xs = [torch.randn(t, 16, generator=gen).to(dtype) for t in routing.num_tokens]
    gs = [torch.randn(t, 16, generator=gen).to(dtype) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, dispatch_wire=wire, combine_grad_wire=wire)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].to(dtype), gs[r], config, pad, groups, async_op,
             True) for r in range(world)]
    for rank, (differ, read_host) in enumerate(worlds(world).run(against_nccl, args)):
        assert differ == [], (rank, differ)
        assert read_host == (pad is None), rank


@pytest.mark.parametrize("mode, per_rank, topk, tokens, groups, slack", [
    ("random", 8, 4, [40, 31], 3, 1.0), ("random", 8, 4, [40, 31], 3, 1.5), ("random", 6, 2, [50, 0], 2, 2.0),
    ("one_expert", 8, 2, [20, 30], 4, 1.0),
])
def test_groups_with_max_rows(worlds, mode, per_rank, topk, tokens, groups, slack):
    """A dispatch by groups with max_rows moves group by group, each group's
    rows padded to B = ceil(max_rows / G): every verb the bits of the same
    dispatch by groups without a bound (the emulated transport)."""
    from routing import make_routing

    routing = make_routing(2, per_rank, topk, tokens, mode, seed=groups)
    gen = torch.Generator().manual_seed(groups)
    xs = [torch.randn(t, 16, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, transport="nvshmem")
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, groups, slack, True)
            for r in range(2)]
    for rank, ok in enumerate(worlds(2).run(rank_fns.bounded_groups_verbs, args)):
        assert all(ok.values()), f"rank {rank}: {ok}"


def group_over_its_bound(x, topk_idx, topk_weights):
    """Every token to local expert 0 of rank 1, by 2 groups with max_rows that
    holds all its rows but not in one group (B = ceil(max_rows / 2)): no rank
    raises at the dispatch, its outputs are padding, ``check()`` raises on
    every rank, naming the group's bound."""
    from world import current_device

    x, topk_idx, topk_weights = (t.to(current_device()) for t in (x, topk_idx, topk_weights))
    d = _dispatcher(dict(num_experts=4), True)
    out = d.dispatch(x, topk_idx, topk_weights, groups=2, max_rows=2 * x.shape[0])
    seen = dict(padding=bool((out.tokens == 0).all()) and bool((out.src_rank == -1).all()),
                rows=out.tokens.shape[0], per_expert=int(out.tokens_per_expert.sum()))
    try:
        d.check()
        seen["check"] = None
    except ValueError as exc:
        seen["check"] = str(exc)
    return seen


def test_a_group_over_its_bound_fails_the_dispatch_on_every_rank(worlds):
    tokens = 5
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(tokens, 8, generator=gen) for _ in range(2)]
    idx = torch.full((tokens, 1), 2)  # 2 local experts a rank: rank 1's expert 0, its first group
    args = [(xs[r], idx, torch.ones(tokens, 1)) for r in range(2)]
    for rank, seen in enumerate(worlds(2).run(group_over_its_bound, args)):
        assert seen["padding"] and seen["rows"] == 2 * tokens and seen["per_expert"] == 0, (rank, seen)
        assert "rank 1: 10 rows in a group, over B=5" in seen["check"], (rank, seen)


def interleaved_group_sums(x, topk_idx, topk_weights, emulated=True, num_experts=4):
    """A combine by groups with another exchange between its groups (a second
    dispatch): the pre-sums put before it are put again with the last group.
    Returns whether its sums are the bits of the NCCL transport's."""
    from world import current_device

    x, topk_idx, topk_weights = (t.to(current_device()) for t in (x, topk_idx, topk_weights))
    sums = []
    for d in (dispatch.create(dispatch.DispatchConfig.from_options(num_experts=num_experts, transport="nccl")),
              _dispatcher(dict(num_experts=num_experts), emulated)):
        work = d.dispatch(x, topk_idx, topk_weights, groups=2, async_op=True)
        adding = d.combine_groups(work.handle, dtype=x.dtype)
        piece = work.wait_group(0)
        adding.add(piece.tokens * 3, piece.weights)
        d.dispatch(x * 2, topk_idx, topk_weights)  # between the two groups
        piece = work.wait_group(1)
        adding.add(piece.tokens * 3, piece.weights)
        sums.append(adding.wait())
    return torch.equal(*sums)


def test_a_combine_by_groups_with_an_exchange_between_its_groups(worlds):
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(t, 8, generator=gen) for t in (7, 9)]
    idx = [torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(t)]) for t in (7, 9)]
    args = [(xs[r], idx[r], torch.rand(idx[r].shape, generator=gen)) for r in range(2)]
    assert worlds(2).run(interleaved_group_sums, args) == [True, True]


def bounded_failures(x, topk_idx, topk_weights, bounds, bad_rank):
    """A dispatch with max_rows over some rank's bound (or with a bad value on
    ``bad_rank``): no rank raises at the dispatch, its outputs are padding,
    ``check()`` raises on every rank, once; then a failure found by the next
    dispatch instead. Returns what each step saw."""
    import torch.distributed as dist
    from world import current_device

    rank = dist.get_rank()
    x, topk_idx, topk_weights = (t.to(current_device()) for t in (x, topk_idx, topk_weights))
    if rank == bad_rank:
        topk_idx = topk_idx.clone()
        topk_idx[0, 0] = 10_000
    d = _dispatcher(dict(num_experts=4), True)
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=bounds[rank])
    seen = dict(padding=bool((out.tokens == 0).all()) and bool((out.src_rank == -1).all()),
                per_expert=int(out.tokens_per_expert.sum()))
    for step in ("check", "again"):
        try:
            d.check()
            seen[step] = None
        except (RuntimeError, ValueError) as exc:
            seen[step] = type(exc).__name__ + ": " + str(exc)
    d.dispatch(x, topk_idx, topk_weights, max_rows=bounds[rank])
    if x.is_cuda:
        torch.cuda.synchronize()  # the failure's flag has reached the host
    try:
        d.dispatch(x, topk_idx, topk_weights, max_rows=bounds[rank])
        seen["next"] = None
    except (RuntimeError, ValueError) as exc:
        seen["next"] = type(exc).__name__
    return seen


@pytest.mark.parametrize("case", ["over_bound", "bad_value"])
def test_a_bounded_failure_moves_nothing_and_raises_at_the_next_host_read(worlds, case):
    tokens = 6
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(tokens, 8, generator=gen) for _ in range(2)]
    idx = [torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(tokens)]) for _ in range(2)]
    ws = [torch.rand(tokens, 2, generator=gen) for _ in range(2)]
    bounds, bad = ([100, 1], -1) if case == "over_bound" else ([100, 100], 0)
    results = worlds(2).run(bounded_failures, [(xs[r], idx[r], ws[r], bounds, bad) for r in range(2)])
    for rank, seen in enumerate(results):
        assert seen["padding"] and seen["per_expert"] == 0, (rank, seen)
        assert seen["check"] is not None and seen["again"] is None, (rank, seen)
        assert seen["next"] is not None, (rank, seen)
        if case == "over_bound":
            assert "max_rows" in seen["check"] and "rank 1" in seen["check"], (rank, seen)
    assert len({seen["check"] for seen in results}) == 1  # every rank alike


def padded_after_a_failure(x, topk_idx, topk_weights, seen_rank):
    """A pad_to_capacity dispatch where ``seen_rank`` alone has seen an earlier
    dispatch fail (``Transport.seen_failed``; on the engine a failure of another
    dispatcher's): what each rank raised, or None. Every rank's word travels in
    the agreement that carries its T, so every rank raises there alike."""
    import torch.distributed as dist
    from world import current_device

    d = _dispatcher(dict(num_experts=4, capacity_factor=1.0, pad_to_capacity=True), True)
    if dist.get_rank() == seen_rank:
        d.transport.seen_failed = lambda bounded: True
    try:
        d.dispatch(*(t.to(current_device()) for t in (x, topk_idx, topk_weights)))
    except RuntimeError as exc:
        return str(exc)
    return None


def test_a_padded_dispatch_raises_on_every_rank_where_one_has_seen_a_failure(worlds):
    gen = torch.Generator().manual_seed(5)
    args = [(torch.randn(6, 8, generator=gen), torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(6)]),
             torch.rand(6, 2, generator=gen), 1) for _ in range(2)]
    raised = worlds(2).run(padded_after_a_failure, args)
    assert all(r is not None and "rank(s) [1] found it" in r for r in raised), raised


def through_the_plan_kernels(fn, *args):
    """``fn(*args)`` with the bounded plan settled and padded by its Triton
    kernels (``bounded_plan.settle_triton``, ``pad_triton``; Triton's
    interpreter on CPU) where off CUDA their torch references run."""
    from dispatch.kernels import bounded_plan

    saved = bounded_plan.settle, bounded_plan.pad
    bounded_plan.settle, bounded_plan.pad = bounded_plan.settle_triton, bounded_plan.pad_triton
    try:
        return fn(*args)
    finally:
        bounded_plan.settle, bounded_plan.pad = saved


@pytest.mark.parametrize("case", ["round_trip", "over_bound", "bad_value"])
def test_the_bounded_plan_through_its_kernels_on_gloo(worlds, case):
    """The transport's bounded path with the kernels it runs on GPUs, on gloo
    ranks: a round trip bitwise the NCCL transport's (rows to spare and none),
    and a failed dispatch moving nothing and raising alike on every rank, as
    with the torch references."""
    from dispatch.kernels import bounded_plan

    if bounded_plan.triton is None or worlds(2).backend != "gloo":
        pytest.skip("the kernels under Triton's interpreter, on gloo ranks (on GPUs the transport runs them)")
    gen = torch.Generator().manual_seed(5)
    tokens = [7, 6]
    xs = [torch.randn(t, 8, generator=gen) for t in tokens]
    idx = [torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(t)]) for t in tokens]
    ws = [torch.rand(t, 2, generator=gen) for t in tokens]
    if case == "round_trip":
        config = dict(num_experts=4)
        for pad in (0, 5):
            args = [(against_nccl, xs[r], idx[r], ws[r], xs[r], config, pad, 1, False, True) for r in range(2)]
            for rank, (differ, read_host) in enumerate(worlds(2).run(through_the_plan_kernels, args)):
                assert differ == [] and not read_host, (rank, pad, differ)
        return
    bounds, bad = ([100, 1], -1) if case == "over_bound" else ([100, 100], 0)
    args = [(xs[r][:6], idx[r][:6], ws[r][:6], bounds, bad) for r in range(2)]
    want = worlds(2).run(bounded_failures, args)
    got = worlds(2).run(through_the_plan_kernels, [(bounded_failures, *a) for a in args])

    def same(seen):  # (a later dispatcher of the process is named by its number in the errors)
        return {k: re.sub(r" of dispatcher #\d+", "", v) if isinstance(v, str) else v for k, v in seen.items()}

    assert [same(s) for s in got] == [same(s) for s in want], (got, want)
    assert want[0]["check"] is not None and want[0]["padding"] and want[0]["per_expert"] == 0


def local_failures(x, topk_idx, topk_weights, case):
    """A rank whose own dispatch is over the buffers' bounds (``over``), ranks
    that mix max_rows with none (``mixed``), a rank that refuses its own
    argument (``refused``): no rank is left waiting in an exchange; what each
    raises, and where."""
    import torch.distributed as dist
    from world import current_device

    rank = dist.get_rank()
    x, topk_idx, topk_weights = (t.to(current_device()) for t in (x, topk_idx, topk_weights))
    d = _dispatcher(dict(num_experts=4), True)
    d.dispatch(x, topk_idx, topk_weights, max_rows=64)  # sizes the buffers for T = 6
    seen = {}
    try:
        if case == "over":
            more = torch.cat([x, x]) if rank == 1 else x
            more_idx = torch.cat([topk_idx, topk_idx]) if rank == 1 else topk_idx
            more_w = torch.cat([topk_weights, topk_weights]) if rank == 1 else topk_weights
            out = d.dispatch(more, more_idx, more_w, max_rows=64)
            home = d.combine(out.tokens, out.handle, weights=out.weights)
            seen["padding"] = bool((out.tokens == 0).all()) and home.shape[0] == more.shape[0]
            seen["home_zero"] = bool((home == 0).all())
            d.dispatch(x, topk_idx, topk_weights, max_rows=64)
        elif case == "mixed":
            d.dispatch(x, topk_idx, topk_weights, max_rows=64 if rank == 0 else None)
        else:
            d.dispatch(x, topk_idx, topk_weights[:, :1] if rank == 1 else topk_weights, max_rows=64)
        seen["raised"] = None
    except (RuntimeError, ValueError) as exc:
        seen["raised"] = f"{type(exc).__name__}: {exc}"
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=64)  # the group goes on
    seen["after"] = bool(torch.isfinite(d.combine(out.tokens, out.handle, weights=out.weights)).all())
    return seen


def two_ranks_routed(seed: int, tokens: int = 6, hidden: int = 8, experts: int = 4, topk: int = 2) -> list[tuple]:
    """Each of 2 ranks' (x [T, H], topk_idx [T, K] of ``experts`` experts, topk_weights)."""
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(tokens, hidden, generator=gen) for _ in range(2)]
    idx = [torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)]) for _ in range(2)]
    ws = [torch.rand(tokens, topk, generator=gen) for _ in range(2)]
    return [(xs[r], idx[r], ws[r]) for r in range(2)]


def wide_rows_after_a_local_failure(x, topk_idx, topk_weights, verb, variant="alltoall"):
    """A bounded dispatch that rank 1 fails on its own (more tokens than the
    buffers were sized for: it takes part with no rows), then rows wider than
    the buffers along its handle (``verb``: the experts' outputs home, or rows
    out by ``dispatch_rows``), through the real ``SymmetricExchange`` (every
    symmetric allocation checked alike). ``verb`` "k": rank 1's K past the
    reserved one instead. What each rank raised. ``variant``: over NVSHMEM
    (hierarchical: each rank a node)."""
    import torch.distributed as dist
    from splits_exchange import FakeSymmetricMemory

    from dispatch.transports.symmetric import SymmetricExchange

    rank = dist.get_rank()
    with FakeSymmetricMemory(True):
        cfg = dispatch.DispatchConfig.from_options(num_experts=4, transport="nvshmem", variant=variant,
                                                   local_world_size=1)
        exchange = SymmetricExchange(None, dist.get_world_size(), torch.device("cpu"))
        exchange._puts = True  # our kernels' contracts, faked
        d = TokenDispatcher(cfg, None, REGISTRY[variant, "nvshmem"](cfg, None, exchange=exchange))
        d.dispatch(x, topk_idx, topk_weights, max_rows=64)  # sizes the buffers for T = 6, H = 8
        more, more_idx, more_w = ((torch.cat([t, t]) if rank == 1 else t) for t in (x, topk_idx, topk_weights))
        if verb.startswith("x"):  # rank 1's own x wider than the buffers instead (ranks whose H differ: found
            # on the device); "x64": a row of it wider than the whole receive buffer
            wider = 64 if verb == "x64" else 4
            more, more_idx, more_w = (torch.cat([x] * wider, 1) if rank == 1 else x), topk_idx, topk_weights
        if verb == "k":  # every expert a slot of each of rank 1's tokens (K = 4, the buffers sized for 2)
            more, more_idx, more_w = x, topk_idx, topk_weights
            if rank == 1:
                more_idx = torch.arange(4).repeat(x.shape[0], 1)
                more_w = torch.full((x.shape[0], 4), 0.25)
        out = d.dispatch(more, more_idx, more_w, max_rows=64)
        try:
            if verb.startswith("x") or verb == "k":
                d.combine(out.tokens, out.handle, weights=out.weights)
                d.check()
            elif verb == "combine":
                d.combine(torch.cat([out.tokens] * 4, 1), out.handle, weights=out.weights)
            else:
                d.dispatch_rows(torch.cat([more] * 4, 1), out.handle)
            raised = None
        except (ValueError, RuntimeError) as exc:
            raised = str(exc).split(":")[0]
        try:
            d.check()
        except ValueError:
            pass  # rank 1's own reason
        except RuntimeError:
            pass
        d.dispatch(x[:0], topk_idx[:0], topk_weights[:0], max_rows=64)  # the group goes on
    return raised


@pytest.mark.parametrize("variant", ["alltoall", "hierarchical"])
@pytest.mark.parametrize("verb", ["combine", "dispatch_rows", "x", "x64", "k"])
def test_rows_wider_than_the_buffers_are_refused_on_every_rank(worlds, verb, variant):
    """Along a bounded handle, rows wider than the buffers were sized for are
    refused by name on every rank before any exchange, also on a rank whose
    own dispatch failed (it has no rows, its peers do): no rank goes on into
    an exchange or a symmetric allocation that its peers do not make. A rank
    whose own x is too wide takes part in its dispatch with nothing (its
    peers go on with theirs: no rank raises alone), also where one of its
    rows is wider than the whole receive buffer (it grows no buffer alone),
    and so does a rank with more slots a token than the buffers were sized
    for. Also for the hierarchical variant over NVSHMEM (each rank a node)."""
    if worlds(2).backend != "gloo":
        pytest.skip("torch's NVSHMEM pieces are faked on gloo ranks")
    got = worlds(2).run(wide_rows_after_a_local_failure, [(*args, verb, variant) for args in two_ranks_routed(8)])
    # (with x too wide on rank 1, the dispatch goes through on both, and their outputs' widths differ)
    if verb == "k":  # the round trip went through on both; then rank 1 raises its own reason, its peer that it refused
        assert got[1] == "x" and got[0].startswith("rank(s) [1] of the group refused dispatch #2"), got
        return
    name = {"combine": "expert_out", "dispatch_rows": "rows", "x": "expert_out", "x64": "expert_out"}[verb]
    assert got == [name, name], got


def bounded_after_no_tokens(x, topk_idx, topk_weights):
    """A first bounded dispatch with no tokens on any rank, then one with
    tokens: whether each went through."""
    from world import current_device

    x, topk_idx, topk_weights = (t.to(current_device()) for t in (x, topk_idx, topk_weights))
    d = _dispatcher(dict(num_experts=4), True)
    d.dispatch(x[:0], topk_idx[:0], topk_weights[:0], max_rows=64)
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=64)
    d.check()
    return int(out.tokens_per_expert.sum())


def test_a_first_bounded_dispatch_of_no_tokens_sizes_nothing_for_good(worlds):
    """The buffers of a bounded dispatch are sized by the group's first
    dispatch with a token, not fixed at none by an empty one."""
    got = worlds(2).run(bounded_after_no_tokens, two_ranks_routed(9))
    assert sum(got) == 2 * 6 * 2, got  # every slot arrived somewhere


def bounded_after_a_smaller_reserve(x, topk_idx, topk_weights):
    """Room made for x, then for a third of it (another layer's reserve, say),
    then a bounded dispatch of x: how many slots arrived (the room only grows)."""
    from world import current_device

    x, topk_idx, topk_weights = (t.to(current_device()) for t in (x, topk_idx, topk_weights))
    d = _dispatcher(dict(num_experts=4), True)
    d.reserve(x, topk_idx.shape[1])
    d.reserve(x[: x.shape[0] // 3], 1)
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=64)
    d.check()
    return int(out.tokens_per_expert.sum())


def allocations_after_reserve(x, topk_idx, topk_weights, max_rows, groups, variant="alltoall"):
    """``reserve``, then a bounded round trip through every verb, through the real
    ``SymmetricExchange`` and our kernels' contracts (faked): the symmetric
    allocations made after the reserve (each a host sync; in a capture, an
    error). ``variant``: over NVSHMEM (hierarchical: each rank a node)."""
    import torch.distributed as dist
    from splits_exchange import FakeSymmetricMemory

    from dispatch.transports.symmetric import SymmetricExchange

    with FakeSymmetricMemory(True):
        cfg = dispatch.DispatchConfig.from_options(num_experts=8, transport="nvshmem", variant=variant,
                                                   local_world_size=1)
        exchange = SymmetricExchange(None, dist.get_world_size(), torch.device("cpu"))
        exchange._puts, exchange.MIN_SEND_BYTES = True, 0
        d = TokenDispatcher(cfg, None, REGISTRY[variant, "nvshmem"](cfg, None, exchange=exchange))
        d.reserve(x, topk_idx.shape[1])
        made, allocate = [], exchange._empty
        exchange._empty = lambda shape, dtype: made.append(shape) or allocate(shape, dtype)
        rank_fns.every_verb(d, x, topk_idx, topk_weights, torch.ones_like(x), max_rows, groups)
        d.check()
    return made


@pytest.mark.parametrize("tokens, hidden, groups, variant, topk", [
    (6, 16, 1, "alltoall", 2), (1, 4, 1, "alltoall", 2), (5, 8, 2, "alltoall", 2), (6, 16, 1, "hierarchical", 2),
    (1, 4, 1, "hierarchical", 2), (6, 4, 1, "hierarchical", 8),  # (K large against H: its routing rows the widest)
])
def test_after_reserve_a_bounded_round_trip_allocates_nothing(worlds, tokens, hidden, groups, variant, topk):
    """``reserve`` makes room for everything a bounded round trip moves, the
    counts' all-gather included (rows narrower than a counts row, say); the
    hierarchical variant's routing rows too."""
    if worlds(2).backend != "gloo":
        pytest.skip("torch's NVSHMEM pieces are faked on gloo ranks")
    routed = two_ranks_routed(tokens, tokens, hidden, experts=8, topk=topk)
    got = worlds(2).run(allocations_after_reserve, [(*args, 64, groups, variant) for args in routed])
    assert got == [[], []], got


def test_a_smaller_reserve_keeps_the_room_an_earlier_one_made(worlds):
    got = worlds(2).run(bounded_after_a_smaller_reserve, two_ranks_routed(10))
    assert sum(got) == 2 * 6 * 2, got  # every slot arrived somewhere


@pytest.mark.parametrize("case", ["over", "mixed", "refused"])
def test_no_rank_is_left_waiting_by_a_peer_that_raises(worlds, case):
    results = worlds(2).run(local_failures, [(*args, case) for args in two_ranks_routed(8)])
    for rank, seen in enumerate(results):
        assert seen["raised"] is not None and seen["after"], (rank, seen)
    if case == "over":
        assert all(seen["padding"] and seen["home_zero"] for seen in results), results
        assert "takes at most 6 tokens" in results[1]["raised"], results
        assert "rank(s) [1]" in results[0]["raised"] and "dispatch #2" in results[0]["raised"], results
    if case == "mixed":
        assert all("passes one or none" in seen["raised"] for seen in results), results
    if case == "refused":
        assert "topk_weights" in results[1]["raised"] and "PeerRefused" in results[0]["raised"], results


def gradients_where_one_rank_needs_none(x, topk_idx, topk_weights, needs):
    """Backward of a bounded round trip where only some ranks' x need a
    gradient: every rank joins the backward's exchanges; x's gradient bitwise
    NCCL's."""
    from world import current_device

    x, topk_idx, topk_weights = (t.to(current_device()) for t in (x, topk_idx, topk_weights))
    grads = []
    for d in (dispatch.create(dispatch.DispatchConfig(num_experts=4, transport="nccl")),
              _dispatcher(dict(num_experts=4), True)):
        xx = x.clone().requires_grad_(needs)
        out = d.dispatch(xx, topk_idx, topk_weights, max_rows=64)
        (d.combine(out.tokens * out.tokens, out.handle, weights=out.weights) * 3).sum().backward()
        grads.append(None if xx.grad is None else xx.grad.cpu())
    return grads[0] is None and grads[1] is None or torch.equal(grads[0], grads[1])


def test_gradients_when_one_rank_needs_none(worlds):
    gen = torch.Generator().manual_seed(9)
    xs = [torch.randn(5, 8, generator=gen) for _ in range(2)]
    idx = [torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)]) for _ in range(2)]
    ws = [torch.rand(5, 2, generator=gen) for _ in range(2)]
    assert all(worlds(2).run(gradients_where_one_rank_needs_none,
                             [(xs[r], idx[r], ws[r], r == 0) for r in range(2)]))


def refused_on_cpu():
    try:
        dispatch.create(dispatch.DispatchConfig(num_experts=4, transport="nvshmem"))
    except ValueError as exc:
        return str(exc)
    return None


def test_refused_by_name_where_nvshmem_cannot_run(worlds):
    from world import World

    world = worlds(2) if worlds(2).backend == "gloo" else World(2, backend="gloo")  # not a GPU world's backend
    try:
        told_by_rank = world.run(refused_on_cpu, [()] * 2)
    finally:
        if world is not worlds(2):
            world.close()
    for told in told_by_rank:
        assert told is not None and told.startswith("transport='nvshmem': needs an NCCL process group"), told
    with pytest.raises(ValueError, match="transport='nvshmem' needs variant='alltoall'"):
        dispatch.DispatchConfig(num_experts=4, variant="allgather", transport="nvshmem")


def _never():
    raise AssertionError("asked what the rule does not need")


@pytest.mark.parametrize("variant, transport, engine, spans, nvshmem, want", [
    ("alltoall", "auto", None, _never, _never, "nvlink"),  # the engine can run: nothing else asked
    ("auto", "auto", None, _never, _never, "nvlink"),
    ("alltoall", "auto", "ranks on 2 hosts", True, None, "nvshmem"),  # across hosts: NVSHMEM
    ("alltoall", "auto", "no CuPy", False, _never, "nccl"),  # one host, no engine: NCCL
    ("alltoall", "auto", "ranks on 2 hosts", True, "no NVSHMEM", "nccl"),
    ("auto", "auto", "ranks on 2 hosts", _never, _never, "nccl"),  # the cost model over the collectives
    ("allgather", "auto", _never, _never, _never, "nccl"),
    ("alltoall", "nccl", _never, _never, _never, "nccl"),
    ("alltoall", "nvshmem", _never, _never, None, "nvshmem"),
    ("alltoall", "nvshmem", _never, _never, "gloo", ValueError),
    ("alltoall", "nvlink", "gloo", _never, _never, ValueError),
    ("hierarchical", "auto", _never, _never, _never, "nccl"),  # over NVSHMEM only where asked
    ("hierarchical", "nvshmem", _never, _never, None, "nvshmem"),
    ("hierarchical", "nvshmem", _never, _never, "gloo", ValueError),
])
def test_the_transport_rule(variant, transport, engine, spans, nvshmem, want):
    answers = [(lambda a=a: a()) if callable(a) else (lambda a=a: a) for a in (engine, spans, nvshmem)]
    if want is ValueError:
        with pytest.raises(ValueError, match=f"transport='{transport}': "):
            choose(variant, transport, *answers)
        return
    assert choose(variant, transport, *answers) == want
    cls = REGISTRY[registry_key(variant, want)]  # the class build makes of it
    assert (cls.variant, cls.transport) == ((variant if want == "nccl" or variant != "auto" else "alltoall"), want)
    assert want != "nvshmem" or cls in (NVSHMEMTransport, HierarchicalNVSHMEMTransport)


@pytest.mark.parametrize("peer", ["runs and takes it", "cannot run NVSHMEM", "cannot take its backend",
                                  "has other NBLOCKS"])
def test_nvshmem_backend_is_taken_only_where_every_rank_may_run_it(monkeypatch, peer):
    """Each rank asks for NVSHMEM's symmetric-memory backend only once every
    rank may run NVSHMEM (a peer that cannot leaves this rank's backend as it
    was, for its engine), and whether each got it is agreed too. The
    collectives are stood in for, as this rank sees them: its own answer, or
    the peer's where it has one."""
    from types import SimpleNamespace

    from dispatch import transports
    from dispatch.transports import symmetric

    backend = {"now": "CUDA"}
    fake = SimpleNamespace(get_backend=lambda device: backend["now"],
                           set_backend=lambda name: backend.update(now=name))
    monkeypatch.setattr(symmetric, "_symmetric_memory", lambda: fake)
    monkeypatch.setattr(symmetric, "unusable", lambda group: None)
    blocks = "needs TORCH_SYMMMEM_NBLOCKS alike on every rank" if peer == "has other NBLOCKS" else None
    monkeypatch.setattr(symmetric, "blocks_differ", lambda group: blocks)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    says = {"cannot run NVSHMEM": ["needs a torch built with NVSHMEM", None],
            "cannot take its backend": [None, "on the CUDA backend already"]}.get(peer, [None, None])
    asked = []

    def agreed(group, problem):
        told = says[len(asked)]
        asked.append(problem)
        return problem or (told and f"rank 1: {told}")

    monkeypatch.setattr(transports, "_agreed", agreed)
    problem = transports._nvshmem_problem(None)
    if peer == "has other NBLOCKS":
        assert problem == blocks and asked == [None] and backend["now"] == "CUDA"
    elif peer == "cannot run NVSHMEM":
        assert problem == "rank 1: needs a torch built with NVSHMEM" and asked == [None]
        assert backend["now"] == "CUDA"  # not taken
    elif peer == "cannot take its backend":
        assert problem == "rank 1: on the CUDA backend already" and asked == [None, None]
        assert backend["now"] == "NVSHMEM"  # taken, kept: torch cannot set it back (the engine checks)
    else:
        assert problem is None and asked == [None, None] and backend["now"] == "NVSHMEM"


@pytest.mark.parametrize("told, differ", [(["8", "8"], False), ([None, None], False), (["8", None], True),
                                          (["8", "16"], True)])
def test_ranks_with_other_nvshmem_blocks_are_refused_by_name(monkeypatch, told, differ):
    """A row's stride in NVSHMEM's buffers follows each process's own
    TORCH_SYMMMEM_NBLOCKS: ranks where it differs are refused, every rank's
    named (the all-gather stood in for: the ranks' values)."""
    from dispatch.transports import symmetric

    monkeypatch.setattr(symmetric.dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(symmetric.dist, "all_gather_object", lambda out, mine, group=None: out.__setitem__(
        slice(None), told))
    problem = symmetric.blocks_differ(None)
    if not differ:
        assert problem is None
    else:
        assert problem.startswith("needs TORCH_SYMMMEM_NBLOCKS alike on every rank"), problem
        assert f"rank 0: {told[0]!r}" in problem and ("rank 1: unset" if told[1] is None else "rank 1: '16'") in problem


# -- on the real NVSHMEM: two GPUs or more, a torch built with it ------------------------------------


@pytest.mark.parametrize("wire", ["native", "fp8"])
@pytest.mark.parametrize("pad", [None, 0, 9])
def test_on_nvshmem_every_verb_is_bitwise_the_nccl_transports(nvshmem_world, wire, pad):
    from routing import make_routing

    routing = make_routing(2, 4, 4, [40, 33], "random", seed=7)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    gs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, dispatch_wire=wire)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, pad, 1, False, False)
            for r in range(2)]
    for rank, (differ, read_host) in enumerate(nvshmem_world.run(against_nccl, args)):
        assert differ == [], (rank, differ)
        assert read_host == (pad is None), rank


@pytest.mark.parametrize("pad", [None, 3])
def test_on_nvshmem_groups_move_group_by_group(nvshmem_world, pad):
    """By groups (with max_rows: each group padded to its bound), one get and
    one put a group: every verb the bits of the NCCL transport's (without a
    bound), and of the same dispatch without one (with a bound); a combine by
    groups with another exchange between its groups too."""
    from routing import make_routing

    routing = make_routing(2, 8, 4, [300, 251], "random", seed=11)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    gs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts)
    if pad is None:
        args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, None, 4, True, False)
                for r in range(2)]
        for rank, (differ, read_host) in enumerate(nvshmem_world.run(against_nccl, args)):
            assert differ == [] and read_host, (rank, differ)
        args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), False, routing.num_experts)
                for r in range(2)]
        assert nvshmem_world.run(interleaved_group_sums, args) == [True, True]
        return
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), dict(config, transport="nvshmem"), 4,
             1.0 + pad / 10, False) for r in range(2)]
    for rank, ok in enumerate(nvshmem_world.run(rank_fns.bounded_groups_verbs, args)):
        assert all(ok.values()), f"rank {rank}: {ok}"


def test_on_nvshmem_micro_batches_with_max_rows_are_captured(nvshmem_world):
    """Forward and backward of MoEMicroBatches with max_rows over NVSHMEM,
    captured in one CUDA graph: every replay on new values the bits of the
    layer run eagerly on them."""
    args = pipeline_fns.captured_args("nvshmem", seed=33)
    for rank, differ in enumerate(nvshmem_world.run(pipeline_fns.micro_batches_captured, args)):
        assert differ == [], (rank, differ)


@pytest.mark.parametrize("bounded", [False, True])
def test_on_nvshmem_an_sm_partition_keeps_the_bits(nvshmem_world, bounded):
    """MoEMicroBatches with its exchange (plans, puts and gets) on 8 SMs split
    off, the experts on the rest: the bits of the layer on shared SMs, forward
    and backward, taken in turn with it both ways."""
    args = pipeline_fns.partition_args("nvshmem", bounded, seed=31)
    for differ, wrong_streams, refused in nvshmem_world.run(pipeline_fns.partition_against_shared, args):
        assert differ == [] and wrong_streams == [], (differ, wrong_streams)
        assert refused.startswith("sm_partition=100000 leaves no SMs to the rest of cuda:"), refused


def _first_group_empty(emulated: bool) -> list:
    gen = torch.Generator().manual_seed(8)
    picks = torch.tensor([2, 3, 6, 7])  # 8 experts, 4 a rank, G = 2: the groups {0, 1} and {2, 3} of each rank
    idx = [picks[torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(t)])] for t in (30, 21)]
    xs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in (30, 21)]
    gs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in (30, 21)]
    return [(xs[r], idx[r], torch.rand(idx[r].shape, generator=gen), gs[r], dict(num_experts=8), None, 2, True,
             emulated) for r in range(2)]


@pytest.mark.parametrize("where", ["emulated", "on_nvshmem"])
def test_a_combine_by_groups_whose_first_group_is_empty_is_weighted(worlds, where, request):
    """Every token to the second group of each rank's experts: the first group's
    rows (and weights) are empty tensors (on CUDA, of address 0), and the sums
    home are still weighted, the bits of the NCCL transport's."""
    world = worlds(2) if where == "emulated" else request.getfixturevalue("nvshmem_world")
    for rank, (differ, _) in enumerate(world.run(against_nccl, _first_group_empty(where == "emulated"))):
        assert differ == [], (rank, differ)


def layer_by_groups_captured(x, topk_idx, topk_weights, grad, groups, max_rows, replays):
    """MoEExchange by groups with max_rows over NVSHMEM: its forward and
    backward captured in one CUDA graph, replayed on new values of x and the
    routing weights; each replay's output and gradients (x, topk_weights, the
    experts') against an eager run of a twin layer. How many replays differ."""
    import copy

    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights, grad = (t.to(device) for t in (x, topk_idx, topk_weights, grad))
    d = _dispatcher(dict(num_experts=8), False)
    torch.manual_seed(5)
    experts = dispatch.experts.GroupedExperts(4, x.shape[1], 2 * x.shape[1], dtype=x.dtype, device=device)
    layer = dispatch.MoEExchange(d, experts, groups=groups, max_rows=max_rows)
    twin = dispatch.MoEExchange(d, copy.deepcopy(experts), groups=groups, max_rows=max_rows)
    xs, ws = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()

    def step(module, xx, ww):
        h = module(xx, topk_idx, ww)
        (h.float() * grad).sum().backward()
        return h.detach()

    def reset():
        xs.grad = ws.grad = None
        experts.zero_grad(set_to_none=True)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # buffers sized, kernels built, the plan's graph made
            reset()
            step(layer, xs, ws)
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            out = step(layer, xs, ws)
    torch.cuda.current_stream().wait_stream(side)
    wrong = 0
    for k in range(replays):
        with torch.no_grad():
            xs.copy_(x * (k + 2))
            ws.copy_(topk_weights.flip(1) if k % 2 else topk_weights * 0.5)
        graph.replay()
        xr, wr = xs.detach().clone().requires_grad_(), ws.detach().clone().requires_grad_()
        twin.experts.zero_grad(set_to_none=True)
        want = step(twin, xr, wr)
        same = (torch.equal(out, want) and torch.equal(xs.grad, xr.grad) and torch.equal(ws.grad, wr.grad)
                and all(torch.equal(a.grad, b.grad) for a, b in zip(experts.parameters(), twin.experts.parameters())))
        wrong += not same
    torch.cuda.synchronize()
    d.check()
    return wrong


def test_on_nvshmem_a_layer_by_groups_with_max_rows_is_captured(nvshmem_world):
    from routing import make_routing

    routing = make_routing(2, 4, 2, [200, 200], "random", seed=6)
    gen = torch.Generator().manual_seed(6)
    args = [(torch.randn(200, 256, generator=gen).to(torch.bfloat16), routing.topk_idx[r],
             routing.topk_weights[r].float(), torch.randn(200, 256, generator=gen), 4, 4 * 200, 4)
            for r in range(2)]
    assert nvshmem_world.run(layer_by_groups_captured, args) == [0, 0]


def captured_round_trip(x, topk_idx, topk_weights, max_rows, config=None):
    """A round trip with max_rows captured in a CUDA graph and replayed on new
    values: the replay's outputs equal an eager round trip's on those values."""
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights = (t.to(device) for t in (x, topk_idx, topk_weights))
    d = _dispatcher(config or dict(num_experts=8), False)
    d.reserve(x, topk_idx.shape[1])

    def trip(xx, ii, ww):
        out = d.dispatch(xx, ii, ww, max_rows=max_rows)
        return out.tokens, d.combine(out.tokens * 2, out.handle, weights=out.weights)

    static = [t.clone() for t in (x, topk_idx, topk_weights)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        trip(*static)  # warm-up
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            captured = trip(*static)
    torch.cuda.current_stream().wait_stream(side)
    static[0].copy_(x * 3)
    static[2].copy_(topk_weights.flip(1))
    graph.replay()
    eager = trip(x * 3, topk_idx, topk_weights.flip(1))
    torch.cuda.synchronize()
    d.check()
    return [torch.equal(a, b) for a, b in zip(captured, eager)]


def test_on_nvshmem_a_bounded_round_trip_is_captured(nvshmem_world):
    from routing import make_routing

    routing = make_routing(2, 4, 4, [64, 64], "random", seed=2)
    gen = torch.Generator().manual_seed(5)
    args = [(torch.randn(64, 128, generator=gen), routing.topk_idx[r], routing.topk_weights[r].float(), 512)
            for r in range(2)]
    for rank, same in enumerate(nvshmem_world.run(captured_round_trip, args)):
        assert all(same), (rank, same)


def replayed_plans(x, topk_idx, topk_weights, pad):
    """Dispatches with max_rows of one signature on new values each call (the
    tokens rolled: the same rows per rank), all held, then combined: the plan
    runs op by op, then is captured whole, then replayed; every dispatch's rows
    and every combine equal the NCCL transport's, also after the receive
    buffer grew. Also whether it replayed, and the buffer grew."""
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights = (t.to(device) for t in (x, topk_idx, topk_weights))
    config = dict(num_experts=8)
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    d = _dispatcher(config, False)
    bound = nccl.dispatch(x, topk_idx, topk_weights).tokens.shape[0] + pad
    calls = [tuple(t.roll(i, 0) for t in (x, topk_idx, topk_weights)) for i in range(5)]
    held = [d.dispatch(*call, max_rows=bound) for call in calls]  # handles outlive the later replays
    same = []
    for out, call in zip(held, calls):
        want = nccl.dispatch(*call)
        rows = want.tokens.shape[0]
        same.append(torch.equal(out.tokens[:rows], want.tokens) and not out.tokens[rows:].any()
                    and torch.equal(out.tokens_per_expert, want.tokens_per_expert))
        same.append(torch.equal(d.combine(out.tokens * 3, out.handle, weights=out.weights),
                                nccl.combine(want.tokens * 3, want.handle, weights=want.weights)))
    replayed = any(r is not None for r in d.transport._replays.values())
    # a receive buffer made anew (on every rank alike): the captured plans put into the old one, so they are
    # captured anew. A dispatch without max_rows of wider rows may grow it; the exchange is the process's, which
    # earlier calls may have grown already, so it is then grown for certain
    exchange = d.transport.exchange
    made = exchange.generation
    out = d.dispatch(torch.cat([x] * 8, 1), topk_idx, topk_weights)
    d.combine(out.tokens, out.handle)
    exchange.ensure(0, exchange._recv.numel() + 1)
    grew = exchange.generation > made
    for call in calls[:3]:
        out, want = d.dispatch(*call, max_rows=bound), nccl.dispatch(*call)
        same.append(torch.equal(d.combine(out.tokens, out.handle, weights=out.weights),
                                nccl.combine(want.tokens, want.handle, weights=want.weights)))
    d.check()
    return same, replayed and grew


@pytest.mark.parametrize("pad", [0, 7])
def test_on_nvshmem_a_plan_with_max_rows_is_replayed_whole(nvshmem_world, pad):
    from routing import make_routing

    routing = make_routing(2, 4, 4, [40, 33], "random", seed=13)
    gen = torch.Generator().manual_seed(3)
    args = [(torch.randn(t, 256, generator=gen).to(torch.bfloat16), routing.topk_idx[r],
             routing.topk_weights[r].float(), pad) for r, t in enumerate(routing.num_tokens)]
    for rank, (same, replayed) in enumerate(nvshmem_world.run(replayed_plans, args)):
        assert all(same) and replayed, (rank, same, replayed)


def replays_beside_ops(x, topk_idx, topk_weights, vary):
    """Dispatches with max_rows where this rank repeats one signature (its plan
    replayed from the third call) or, with ``vary``, changes it every call (op
    by op): the two kinds pair puts and barriers alike. Every combine against
    the NCCL transport's, and whether this rank replayed."""
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights = (t.to(device) for t in (x, topk_idx, topk_weights))
    config = dict(num_experts=8)
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    d = _dispatcher(config, False)
    bound = nccl.dispatch(x, topk_idx, topk_weights).tokens.shape[0] + 3
    same = []
    for i in range(5):
        call = tuple(t[: x.shape[0] - (i if vary else 0)] for t in (x, topk_idx, topk_weights))
        out, want = d.dispatch(*call, max_rows=bound), nccl.dispatch(*call)
        same.append(torch.equal(d.combine(out.tokens, out.handle, weights=out.weights),
                                nccl.combine(want.tokens, want.handle, weights=want.weights)))
    d.check()
    return same, any(r is not None for r in d.transport._replays.values())


def test_on_nvshmem_a_rank_that_replays_pairs_with_one_that_does_not(nvshmem_world):
    from routing import make_routing

    routing = make_routing(2, 4, 4, [40, 33], "random", seed=17)
    gen = torch.Generator().manual_seed(4)
    args = [(torch.randn(t, 256, generator=gen).to(torch.bfloat16), routing.topk_idx[r],
             routing.topk_weights[r].float(), r == 0) for r, t in enumerate(routing.num_tokens)]
    for rank, (same, replayed) in enumerate(nvshmem_world.run(replays_beside_ops, args)):
        assert all(same) and replayed == (rank == 1), (rank, same, replayed)


def engine_beside_nvshmem(x, topk_idx, topk_weights, grad_out, pad):
    """The NVLink engine in a process whose symmetric memory NVSHMEM's backend
    took (an NVSHMEM dispatcher made first): its buffers NVSHMEM's. Returns the
    verbs of its round trip (and of the NVSHMEM dispatcher's after it) that
    differ from the NCCL transport's, the backend and the engine's key."""
    from torch.distributed import _symmetric_memory as symm_mem
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights, grad_out = (t.to(device) for t in (x, topk_idx, topk_weights, grad_out))
    config = dict(num_experts=8)
    first = _dispatcher(config, False)  # the process's symmetric memory on NVSHMEM's backend
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    bound = None if pad is None else nccl.dispatch(x, topk_idx, topk_weights).tokens.shape[0] + pad
    want, _ = _round_trip(nccl, x, topk_idx, topk_weights, grad_out, bound, 1, False)
    engine = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink"))
    got, _ = _round_trip(engine, x, topk_idx, topk_weights, grad_out, bound, 1, False)
    engine.check()
    differ = [k for k in want if not same_bits(got[k], want[k])]
    beside, _ = _round_trip(first, x, topk_idx, topk_weights, grad_out, bound, 1, False)  # both in use
    first.check()
    differ += [f"nvshmem {k}" for k in want if not same_bits(beside[k], want[k])]
    return differ, symm_mem.get_backend(device), engine.transport.key


@pytest.mark.parametrize("pad", [None, 5])
def test_on_nvshmem_the_engine_runs_in_the_same_process(nvshmem_world, pad):
    from routing import make_routing

    routing = make_routing(2, 4, 4, [40, 33], "random", seed=11)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    gs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], pad) for r in range(2)]
    for rank, (differ, backend, key) in enumerate(nvshmem_world.run(engine_beside_nvshmem, args)):
        assert (differ, backend, key) == ([], "NVSHMEM", ("alltoall", "nvlink")), rank


def engine_on_backends_that_differ():
    """Rank 0's symmetric memory put on NVSHMEM's backend, rank 1's left on CUDA's:
    what transport='nvlink' raises, and what 'auto' takes."""
    from torch.distributed import _symmetric_memory as symm_mem

    if torch.distributed.get_rank() == 0:
        symm_mem.set_backend("NVSHMEM")
    try:
        dispatch.create(dispatch.DispatchConfig(num_experts=8, transport="nvlink"))
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return refused, "/".join(dispatch.create(dispatch.DispatchConfig(num_experts=8)).transport.key)


def test_the_engine_refuses_ranks_on_different_symmetric_memory_backends():
    """Ranks whose processes' symmetric memory differ in backend (torch fixes it
    per process; one rank's NVSHMEM dispatcher could not be made) could not open
    each other's buffers: the engine refuses them by name, on every rank, and
    'auto' takes NCCL."""
    from conftest import _nvshmem_ready
    from world import World

    if not _nvshmem_ready() or not cuda.available():
        pytest.skip("needs 2 CUDA devices, CuPy and a torch built with NVSHMEM")
    world = World(2, backend="nccl")  # a world of its own: the backend stays fixed in its processes
    try:
        got = world.run(engine_on_backends_that_differ, [()] * 2)
    finally:
        world.close()
    for refused, taken in got:
        assert refused is not None and "rank 0: NVSHMEM, rank 1: CUDA" in refused, refused
        assert taken == "alltoall/nccl"


def put_kernel_why_not():
    """Why NVSHMEM's put kernel cannot run here (None where it moves the rows
    sent as they are), once an NVSHMEM dispatcher has started NVSHMEM."""
    from world import current_device

    from dispatch.kernels import nvshmem_puts

    _dispatcher(dict(num_experts=8), False)
    return nvshmem_puts.why_not(current_device())


def test_on_nvshmem_rows_sent_as_they_are_move_by_our_put_kernel(nvshmem_world):
    """The GPU machines build it (nvcc, nvlink and the nvidia-nvshmem wheel's
    device library): the bitwise tests above then ran it for every native wire."""
    assert nvshmem_world.run(put_kernel_why_not, [()] * 2) == [None, None]


def exchanges_by_torch(puts: bool, *args):
    """``against_nccl(*args)`` with our put kernel on or off; also how many of
    torch's all-to-alls the NVSHMEM round trip called."""
    from dispatch.kernels import nvshmem_puts
    from dispatch.transports import symmetric

    calls, saved = [], (symmetric.all_to_all_vdev, nvshmem_puts.enabled)

    def counted(*a):
        calls.append(1)
        return saved[0](*a)

    symmetric.all_to_all_vdev, nvshmem_puts.enabled = counted, puts
    try:
        differ, _ = against_nccl(*args)
    finally:
        symmetric.all_to_all_vdev, nvshmem_puts.enabled = saved
    return differ, len(calls)


@pytest.mark.parametrize("wire", ["native", "fp8"])
def test_on_nvshmem_every_exchange_is_put_by_our_kernel_and_torchs_is_the_same(nvshmem_world, wire):
    """With the put kernel, a round trip (plain and with max_rows, gradients
    included) calls none of torch's all-to-alls; without it, torch's move the
    same rows: both bitwise the NCCL transport."""
    from routing import make_routing

    routing = make_routing(2, 4, 4, [40, 33], "random", seed=8)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    gs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, dispatch_wire=wire, combine_wire="fp32")
    for puts in (True, False):
        for pad in (None, 9):
            args = [(puts, xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, pad, 1, False,
                     False) for r in range(2)]
            for rank, (differ, by_torch) in enumerate(nvshmem_world.run(exchanges_by_torch, args)):
                assert differ == [], (rank, puts, pad, differ)
                assert (by_torch == 0) == puts, (rank, puts, pad, by_torch)


def got_and_put_as_across_hosts(*args):
    """``against_nccl(*args)`` with every peer's rows got and put by NVSHMEM (as
    across hosts), not read and written where NVSHMEM maps them."""
    from dispatch.kernels import nvshmem_puts

    nvshmem_puts.mapped = False
    try:
        return against_nccl(*args)[0]
    finally:
        nvshmem_puts.mapped = True


@pytest.mark.parametrize("pad", [None, 6])
def test_on_nvshmem_rows_got_and_put_as_across_hosts_are_the_same_bits(nvshmem_world, pad):
    """The way across hosts (each peer's rows got into the receive buffer, then
    expanded; each pre-sum made in the send buffer, then put home), run on one
    host: every verb bitwise the NCCL transport, plain and with max_rows."""
    from routing import make_routing

    routing = make_routing(2, 4, 4, [40, 33], "random", seed=21)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    gs = [torch.randn(t, 256, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, pad, 1, False, False)
            for r in range(2)]
    for rank, differ in enumerate(nvshmem_world.run(got_and_put_as_across_hosts, args)):
        assert differ == [], (rank, differ)


def test_the_put_kernel_stands_aside_where_it_cannot_run():
    """Off CUDA the NVSHMEM kernels move nothing (torch's all-to-all does); where the
    nvidia-nvshmem wheel is missing, ``why_not`` names it, before any build; each
    launch packs every parameter by name where C lays it out, in the C type the
    source declares; the tables and places they read are checked by name."""
    import struct
    from importlib.util import find_spec

    from dispatch.kernels import nvshmem_puts

    assert not nvshmem_puts.built(torch.device("cpu"))
    from dispatch.cuda import parameter_block, signatures

    for kernel in nvshmem_puts._KERNELS:
        signature = signatures()[("nvshmem_puts.cu", kernel)]
        names, packer, block, params = nvshmem_puts._parameters(kernel)
        assert names == signature.names and len(params) == len(names)
        values = {name: 1000 + i for i, name in enumerate(names)}  # each its own value
        packer.pack_into(block, 0, *[values[name] for name in names])
        _, offsets = parameter_block(signature.codes)
        for name, code, offset, address in zip(names, signature.codes, offsets, params):
            assert address == ctypes.addressof(block) + offset, name
            assert struct.unpack_from("@" + code, block, offset)[0] == values[name], (kernel, name)
    if find_spec("nvidia") is None or find_spec("nvidia.nvshmem") is None:
        assert "nvidia-nvshmem" in nvshmem_puts.why_not(torch.device("cuda", 0))
    # it reads its tables as contiguous int64: a strided one is refused by name, before any launch
    rows, places = torch.zeros(4, 8), torch.zeros(2, 2, dtype=torch.int64)
    with pytest.raises(ValueError, match="^at: "):
        nvshmem_puts.put_rows(rows, 32, rows, None, torch.zeros(2, dtype=torch.int64), places[:, 0], 4)
    with pytest.raises(ValueError, match="^sends: "):
        nvshmem_puts.put_rows(rows, 32, rows, None, torch.zeros(2, dtype=torch.int32), places[0], 4)
    wide = torch.zeros(2, nvshmem_puts.MAX_WIDTH + 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="^places: "):
        nvshmem_puts.presum_put(rows, rows, 32, rows, None, wide, places[0], places[0], torch.float32, 2)
    with pytest.raises(ValueError, match="^presum_put sums"):
        nvshmem_puts.presum_put(rows, rows, 32, rows.double(), None, places, places[0], places[0], torch.float32, 2)


def through_symmetric_exchange(x, topk_idx, topk_weights, config, max_rows, kernels=False, groups=1,
                               bounded_groups=False):
    """A round trip through ``SymmetricExchange`` (its buffers, strides, turns
    and padding row) on gloo, torch's NVSHMEM pieces faked by
    ``splits_exchange.FakeSymmetricMemory``, against the NCCL transport. With
    ``kernels``, through our kernels' contracts (faked likewise) from a send
    buffer that starts empty, so that it grows (alike on every rank, checked).
    By ``groups`` (``bounded_groups``: with a bound of its own, against the same
    dispatch without, ``rank_fns.bounded_groups_verbs``)."""
    from splits_exchange import FakeSymmetricMemory
    from world import current_device

    from dispatch.transports.symmetric import SymmetricExchange

    device = current_device()
    x, topk_idx, topk_weights = (t.to(device) for t in (x, topk_idx, topk_weights))
    with FakeSymmetricMemory(kernels):
        cfg = dispatch.DispatchConfig.from_options(**config, transport="nvshmem")
        exchange = SymmetricExchange(None, torch.distributed.get_world_size(), device)
        if kernels:  # our kernels' contracts, faked: every exchange by them, from a send buffer that grows
            exchange._puts, exchange.MIN_SEND_BYTES = True, 0
        d = TokenDispatcher(cfg, None, NVSHMEMTransport(cfg, None, exchange=exchange))
        if bounded_groups:  # by groups with a bound, against the same without
            real, rank_fns.dispatcher = rank_fns.dispatcher, lambda config, emulated=False: d
            try:
                ok = rank_fns.bounded_groups_verbs(x, topk_idx, topk_weights, config, groups, 1.5)
            finally:
                rank_fns.dispatcher = real
            return [k for k, v in ok.items() if not v]
        got, _ = _round_trip(d, x, topk_idx, topk_weights, x, max_rows, groups, False)
        if groups > 1:
            got["by_groups"] = _by_groups(d, x, topk_idx, topk_weights, groups)
        d.check()
        # a receive buffer made anew is a new generation (what captured puts check); one that holds is not
        made = exchange.generation
        exchange.ensure(0, exchange._recv.numel())
        held = exchange.generation == made
        exchange.ensure(0, exchange._recv.numel() + 1)
        grown = exchange.generation == made + 1
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    want, _ = _round_trip(nccl, x, topk_idx, topk_weights, x, max_rows, groups, False)
    if groups > 1:
        want["by_groups"] = _by_groups(nccl, x, topk_idx, topk_weights, groups)
    differ = [k for k in want if k in got and not same_bits(got[k], want[k])]
    return differ + ([] if made >= 1 and held and grown else ["generation"])


@pytest.mark.parametrize("kernels", [False, True])
@pytest.mark.parametrize("world, hidden, wire", [(2, 16, "native"), (3, 7, "bf16"), (2, 128, "fp8")])
def test_the_symmetric_exchange_moves_rows_as_nccl(worlds, world, hidden, wire, kernels):
    """Through torch's all-to-all, or through our kernels' contracts (ranks of
    different T: the buffers they grow are alike, and every row lands where
    the kernels put it), every verb bitwise the NCCL transport's."""
    from routing import make_routing

    if worlds(world).backend != "gloo":
        pytest.skip("torch's NVSHMEM pieces are faked on gloo ranks")
    routing = make_routing(world, 2, 3, [9, 0, 14][:world], "random", seed=world)
    gen = torch.Generator().manual_seed(hidden)
    xs = [torch.randn(t, hidden, generator=gen) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, dispatch_wire=wire, combine_grad_wire=wire)
    for max_rows in (None, 40):
        args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, max_rows, kernels)
                for r in range(world)]
        for rank, differ in enumerate(worlds(world).run(through_symmetric_exchange, args)):
            assert differ == [], (rank, max_rows, differ)


@pytest.mark.parametrize("bounded", [False, True])
def test_the_symmetric_exchange_moves_groups_as_nccl(worlds, bounded):
    """By groups through ``SymmetricExchange`` and our kernels' contracts (a get
    and a put a group, the groups' rows read through their table): every verb
    and the sums by groups bitwise the NCCL transport's; with a bound (each
    group padded), the same dispatch without one's."""
    from routing import make_routing

    if worlds(2).backend != "gloo":
        pytest.skip("torch's NVSHMEM pieces are faked on gloo ranks")
    routing = make_routing(2, 4, 3, [11, 7], "random", seed=4)
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(t, 16, generator=gen).to(torch.bfloat16) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, None, True, 3, bounded)
            for r in range(2)]
    for rank, differ in enumerate(worlds(2).run(through_symmetric_exchange, args)):
        assert differ == [], (rank, bounded, differ)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("wire", ["native", "fp8"])
def test_on_one_gpu_its_plan_and_kernels_are_bitwise_the_nccl_transports(wire):
    """W = 1 over NCCL (no NVSHMEM: torch's rendezvous takes two ranks), rows
    moved by the all-to-all's contract: the Triton receive plan, codecs and sums
    on CUDA, the bounded path's masked rows included."""
    from routing import make_routing
    from world import World

    routing = make_routing(1, 16, 8, [300], "random", seed=11)
    gen = torch.Generator().manual_seed(2)
    x, g = (torch.randn(300, 256, generator=gen).to(torch.bfloat16) for _ in range(2))
    config = dict(num_experts=routing.num_experts, dispatch_wire=wire)
    with World(1, backend="nccl") as world:
        for pad in (None, 0, 7):
            args = [(x, routing.topk_idx[0], routing.topk_weights[0].to(torch.bfloat16), g, config, pad, 1,
                     pad is None, True)]
            ((differ, read_host),) = world.run(against_nccl, args)
            assert differ == [] and read_host == (pad is None), (pad, differ)
        # SymmetricExchange itself (its own stream, fenced both ways), torch's NVSHMEM pieces faked
        for max_rows in (None, 4000):
            args = [(x, routing.topk_idx[0], routing.topk_weights[0].to(torch.bfloat16), config, max_rows)]
            assert world.run(through_symmetric_exchange, args) == [[]], max_rows
