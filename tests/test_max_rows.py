"""A dispatch with max_rows over a host read (NCCL / gloo, every variant): the
same rows, combine and gradients as without it, padded to max_rows rows (zero
tokens and weights, sources -1), along the handle too; a rank over its bound
makes every rank raise before any token moves. (The engine's no-host-read path
is tested in test_nvlink.py.)"""

from __future__ import annotations

import pytest
import torch

import dispatch
import rank_fns
from dispatch.bench.common import same_bits
from routing import make_routing


def _padded_against_plain(x, topk_idx, topk_weights, grad_out, config, pad):
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights, grad_out = (t.to(device) for t in (x, topk_idx, topk_weights, grad_out))
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    got = {}
    for name in ("plain", "padded"):
        bound = None if name == "plain" else got["plain"]["n"] + pad
        got[name] = rank_fns.every_verb(d, x, topk_idx, topk_weights, grad_out, bound)
    plain, padded, n = got["plain"], got["padded"], got["plain"]["n"]
    checks = [padded["n"] == n + pad, torch.equal(padded["per_expert"], plain["per_expert"])]
    for key in ("combined", "grad_x", "grad_w", "home", "slots"):
        checks.append(same_bits(padded[key], plain[key]))
    for key, filler in (("tokens", 0), ("weights", 0), ("src_rank", -1), ("src_token", -1), ("rows", 0)):
        checks += [torch.equal(padded[key][:n], plain[key]), bool((padded[key][n:] == filler).all())]
    return checks


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical", "auto"])
@pytest.mark.parametrize("pad", [0, 7])
def test_padded_round_trip_equals_the_plain_one(worlds, variant, pad):
    world = 2
    routing = make_routing(world, 3, 2, [30, 0], "random", seed=pad + 1)
    gen = torch.Generator().manual_seed(pad)
    xs = [torch.randn(t, 16, generator=gen, dtype=torch.float64) for t in routing.num_tokens]
    ws = [torch.rand(i.shape, generator=gen, dtype=torch.float64) for i in routing.topk_idx]
    gs = [torch.randn(t, 16, generator=gen, dtype=torch.float64) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, variant=variant, transport="nccl")
    if variant == "hierarchical":
        config["local_world_size"] = 1
    args = [(xs[r], routing.topk_idx[r], ws[r], gs[r], config, pad) for r in range(world)]
    for rank, checks in enumerate(worlds(world).run(_padded_against_plain, args)):
        assert all(checks), (rank, checks)


def _over_bound(x, topk_idx, topk_weights, config, bounds):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    moved = []
    original = d.transport.to_experts
    d.transport.to_experts = lambda *a: moved.append(1) or original(*a)
    try:
        d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device),
                   max_rows=bounds[torch.distributed.get_rank()])
    except ValueError as exc:
        return str(exc), len(moved)
    return None, len(moved)


def test_a_rank_over_its_bound_stops_every_rank_before_tokens_move(worlds):
    routing = make_routing(3, 2, 2, [20, 20, 20], "random", seed=4)
    xs = [torch.randn(t, 8) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, transport="nccl")
    bounds = [10**6, 1, 10**6]  # rank 1 receives more than one row
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config, bounds) for r in range(3)]
    for message, moved in worlds(3).run(_over_bound, args):
        assert message is not None and "max_rows" in message and "rank 1:" in message, message
        assert "rank 0" not in message and "rank 2" not in message, message
        assert moved == 0


def _short_of_memory(x, topk_idx, topk_weights, config, short_rank, max_rows, exact_short=True):
    """Dispatch with rank ``short_rank``'s free device memory holding 3 rows (by
    the cheap lower bound; by the exact budget too where ``exact_short``, else
    the exact budget holds any), then with its memory back (the same dispatcher)."""
    from world import current_device

    from dispatch import free_memory

    device = current_device()
    rank = torch.distributed.get_rank()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    moved = []
    original_start = d.transport.to_experts
    original_free, original_lower = free_memory.free_bytes, free_memory.device_free_bytes
    d.transport.to_experts = lambda *a: moved.append(1) or original_start(*a)
    short = 3 * d.transport.row_bytes(x) + 1
    free_memory.device_free_bytes = lambda dev: short if rank == short_rank else None
    free_memory.free_bytes = lambda dev: short if rank == short_rank and exact_short else None
    try:
        d.dispatch(x, topk_idx, topk_weights, max_rows=max_rows)
        message = None
    except (ValueError, dispatch.PeerRefused) as exc:
        message = f"{type(exc).__name__}: {exc}"
    finally:
        free_memory.free_bytes, free_memory.device_free_bytes = original_free, original_lower
    refused_moves = len(moved)
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=max_rows)
    return message, refused_moves, out.handle.num_rows


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical"])
@pytest.mark.parametrize("max_rows", [None, 10**4])
def test_a_rank_short_of_memory_stops_every_rank_before_tokens_move(worlds, variant, max_rows):
    """The budget of device memory: a rank whose free memory does not hold its
    received rows (or its max_rows rows, which its outputs have) is named by
    every rank, before any token moves; the dispatcher works afterwards."""
    routing = make_routing(3, 2, 2, [20, 20, 20], "random", seed=4)
    xs = [torch.randn(t, 8) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, transport="nccl", variant=variant)
    if variant == "hierarchical":
        config["local_world_size"] = 1
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config, 2, max_rows) for r in range(3)]
    for message, moved, rows in worlds(3).run(_short_of_memory, args):
        assert message is not None and "free device memory" in message and "rank 2:" in message, message
        assert "holds 3" in message and "rank 0" not in message and "rank 1" not in message, message
        assert moved == 0
        assert rows > 3


@pytest.mark.parametrize("variant", ["alltoall", "hierarchical"])
@pytest.mark.parametrize("short_rank", [0, 1])
def test_a_rank_short_of_memory_for_its_padded_rows_stops_every_rank(worlds, variant, short_rank):
    """pad_to_capacity: a rank whose free memory does not hold its padded rows
    (E_local * the sum of the ranks' capacities, beside the rows it receives)
    refuses, whether it receives rows (rank 0: every token's experts) or none
    (rank 1); every other rank raises PeerRefused naming it, before any token
    moves; the dispatcher works afterwards."""
    topk_idx = torch.tensor([[0, 1]] * 16)
    config = dict(num_experts=4, transport="nccl", variant=variant, capacity_factor=1.0, pad_to_capacity=True)
    if variant == "hierarchical":
        config["local_world_size"] = 1
    args = [(torch.randn(16, 8), topk_idx, torch.rand(16, 2), config, short_rank, None) for _ in range(2)]
    for rank, (message, moved, rows) in enumerate(worlds(2).run(_short_of_memory, args)):
        if rank == short_rank:
            assert message.startswith("ValueError: x: the padded rows of a pad_to_capacity dispatch (32) do not fit "
                                      "in this rank's free device memory (3 rows)"), message
        else:
            assert message.startswith("PeerRefused: rank(s) [%d]" % short_rank), message
        assert moved == 0 and rows == (32 if rank == 0 else 0)


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical"])
@pytest.mark.parametrize("max_rows", [None, 10**4])
def test_a_rank_short_only_by_the_cheap_bound_of_its_memory_dispatches(worlds, variant, max_rows):
    """The header carries the device's free memory alone (a lower bound); where
    a rank falls short of it but its exact budget (the allocator's unused pool
    counted) holds its rows, every rank reads the exact budgets in one more
    agreement and the dispatch goes on, on every rank alike."""
    routing = make_routing(3, 2, 2, [20, 20, 20], "random", seed=4)
    xs = [torch.randn(t, 8) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, transport="nccl", variant=variant)
    if variant == "hierarchical":
        config["local_world_size"] = 1
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config, 2, max_rows, False) for r in range(3)]
    for message, moved, rows in worlds(3).run(_short_of_memory, args):
        assert message is None
        assert moved == 1  # its rows moved
        assert rows > 3


def test_a_bounded_dispatch_reads_its_exact_memory_alone_where_the_cheap_bound_falls_short(monkeypatch):
    """With max_rows a rank's outputs have G * ceil(max_rows / G) rows whatever it
    receives: it reads its exact budget (``free_memory.free_bytes``) only where the cheap
    lower bound (``free_memory.device_free_bytes``) holds fewer than max_rows + G rows,
    alone (no agreement); without max_rows the header carries the bound."""
    from dispatch import free_memory

    row_bytes = 100
    x = torch.zeros(4, 8)
    exact_reads = []
    monkeypatch.setattr(free_memory, "free_bytes", lambda device: exact_reads.append(1) or 10**6 * row_bytes)
    for lower, max_rows, groups, want, reads in [(1000, None, 1, (-1, 1000), 0),  # no bound: the cheap one
                                                 (1000, 990, 4, (990, 1000), 0),  # 990 + 4 rows fit it
                                                 (1000, 998, 4, (998, 10**6), 1),  # 998 + 4 may not: exact
                                                 (10, 500, 1, (500, 10**6), 1)]:
        monkeypatch.setattr(free_memory, "device_free_bytes", lambda device, lower=lower: lower * row_bytes)
        exact_reads.clear()
        assert free_memory.row_budgets(x, lambda x: row_bytes, max_rows, groups) == want
        assert len(exact_reads) == reads


def _reserves(x, bad_topk, reserves: bool):
    """``reserve`` with rank 0's ``topk`` ``bad_topk``, then every rank's good one,
    on a transport that makes room (its ``reserve`` stood in for, recorded) or
    one that does nothing. Returns (what the first raised, the room made)."""
    d = dispatch.create(dispatch.DispatchConfig(num_experts=4, transport="nccl"))
    made = []
    d.transport.reserves = reserves
    d.transport.reserve = lambda x, topk: made.append((x.shape[0], topk))
    rank = torch.distributed.get_rank()
    try:
        d.reserve(x, bad_topk if rank == 0 else 2)
        raised = None
    except (ValueError, TypeError, dispatch.PeerRefused) as exc:
        raised = f"{type(exc).__name__}: {exc}"
    d.reserve(x, 2)
    return raised, made


@pytest.mark.parametrize("reserves", [True, False], ids=["makes room", "nothing to do"])
@pytest.mark.parametrize("bad_topk", [0, -1, 2.0, "2", True])
def test_reserve_refuses_a_bad_argument_on_every_rank(worlds, reserves, bad_topk):
    """A bad ``topk`` on one rank: where the transport makes room (a collective),
    it raises there naming the argument and its peer PeerRefused, before any
    room is made on either; where it has nothing to do, it raises there alone.
    The next reserve of every rank makes its room."""
    for rank, (raised, made) in enumerate(worlds(2).run(_reserves, [(torch.zeros(6, 8), bad_topk, reserves)] * 2)):
        if rank == 0:
            assert raised is not None and raised.startswith("ValueError: topk must be an int in [1, "), raised
        elif reserves:
            assert raised is not None and raised.startswith("PeerRefused: rank(s) [0]") and "reserve #1" in raised, raised
        else:
            assert raised is None, raised
        assert made == ([(6, 2)] if reserves else []), made
