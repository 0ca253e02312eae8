"""Dispatches by groups of local experts (``dispatch(groups=G)``, ``wait_group``,
``combine_groups``): group by group, every verb gives the bits of the same
dispatch in one piece, for every G, variant, wire and routing (gloo here, NCCL
on GPUs)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import groups_fns
from routing import make_routing, random_tokens

HIDDEN = 6


def _run(worlds, world_size, local, topk, tokens, mode, dtype, groups, config, seed):
    g = make_routing(world_size, local, topk, tokens, mode, seed=seed)
    args = []
    for r in range(world_size):
        x = random_tokens(r, g.num_tokens[r], HIDDEN, dtype, seed)
        rows_out = random_tokens(r, 4 * sum(tokens) * topk + 4, HIDDEN, torch.float64, seed + 1)
        values = random_tokens(r, 4 * sum(tokens) * topk + 4, 1, torch.float64, seed + 2)[:, 0].to(dtype)
        args.append((x, g.topk_idx[r], g.topk_weights[r].to(dtype), rows_out, values,
                     dict(num_experts=g.num_experts, **config), groups))
    return worlds(world_size).run(groups_fns.grouped_verbs, args)


def _check(results, groups, local):
    bounds = [g * local // groups for g in range(groups + 1)]
    for rank, (pairs, facts) in enumerate(results):
        for name, (got, want) in pairs.items():
            assert got.dtype == want.dtype and got.shape == want.shape, f"rank {rank}: {name} {got.shape} {want.shape}"
            assert torch.equal(got, want), f"rank {rank}: {name} differs"
        assert facts["experts"] == list(zip(bounds[:-1], bounds[1:]))
        for g, (lo, hi) in enumerate(facts["rows"]):
            counts = facts["per_expert"][g]
            assert torch.equal(counts, facts["per_expert_host"][g])
            first, end = facts["experts"][g]
            assert int(counts.sum()) == hi - lo and not counts[:first].any() and not counts[end:].any()


@settings(max_examples=25, deadline=None)
@given(
    world_size=st.sampled_from([2, 3, 4]),
    local=st.integers(1, 5),
    topk=st.integers(1, 6),
    mode=st.sampled_from(["random", "sparse", "one_rank", "one_expert"]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]),
    groups=st.integers(1, 5),
    seed=st.integers(0, 10**6),
)
def test_groups_give_the_bits_of_one_piece(worlds, world_size, local, topk, mode, dtype, groups, seed):
    groups = min(groups, local)
    tokens = [(seed + 3 * r) % 9 for r in range(world_size)]
    results = _run(worlds, world_size, local, topk, tokens, mode, dtype, groups,
                   dict(variant="alltoall", transport="nccl"), seed)
    _check(results, groups, local)
    assert all(facts["by_pieces"] == (groups > 1) for _, facts in results)  # moved group by group


@pytest.mark.parametrize("config", [dict(variant="alltoall", transport="nccl", dispatch_wire="fp8",
                                         combine_wire="bf16"),
                                    dict(variant="alltoall"),  # on GPUs with CuPy: the NVLink engine
                                    dict(variant="allgather"), dict(variant="hierarchical", local_world_size=2),
                                    dict(variant="auto", local_world_size=2)],
                         ids=["alltoall-fp8", "alltoall-auto", "allgather", "hierarchical", "auto"])
def test_groups_every_variant(worlds, config):
    results = _run(worlds, 4, 4, 3, [7, 0, 5, 9], "random", torch.float32, 3, config, seed=5)
    _check(results, 3, 4)


@pytest.mark.parametrize("board", [True, False], ids=["board", "host channel"])
@pytest.mark.parametrize("config", [dict(variant="alltoall"), dict(variant="allgather"),
                                    dict(variant="hierarchical", local_world_size=1), dict(variant="auto")],
                         ids=["alltoall", "allgather", "hierarchical", "auto"])
def test_group_refusals(worlds, config, board):
    """Refusals of dispatches by groups, on every variant, the calls agreed on
    the board or over the host channel: ranks that pass different G all raise
    naming groups and each rank's G (the counts exchange carries it), before
    any row moves."""
    g = make_routing(2, 4, 2, [5, 4], "random", seed=3)
    args = [(random_tokens(r, g.num_tokens[r], HIDDEN, torch.float32, 1), g.topk_idx[r], g.topk_weights[r].float(),
             dict(num_experts=g.num_experts, transport="nccl", **config), [2, 3]) for r in range(2)]
    fn = groups_fns.grouped_errors if board else groups_fns.grouped_errors_without_board
    for rank, errors in enumerate(worlds(2).run(fn, args)):
        assert "groups must be an int in [1, 4]" in errors["zero"]
        assert "groups must be an int in [1, 4]" in errors["too many"]
        assert "max_rows" in errors["max_rows"]
        assert "rank 0: 2, rank 1: 3" in errors["disagree"]
        assert "add every group" in errors["wait before all added"]
        assert "rows has" in errors["wrong rows"] and "group 0 has" in errors["wrong rows"], errors["wrong rows"]
        assert "g must be a group index in [0, 2)" in errors["bad group"]
        assert "g must be a group index in [0, 2), got -1" in errors["rows' bad group"]
        assert "added already" in errors["added twice"] if rank == 0 else "added twice" not in errors
        assert errors["next call"]


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical"])
def test_experts_in_another_dtype_on_some_ranks(worlds, variant):
    """With G > 1 the pre-sums leave before every rank has computed a row, so
    experts' rows in another dtype than the layer's are cast to it, on the ranks
    that have rows as on those that have none: every rank finishes (none waits
    for a peer that refused), in x's dtype, with the one-group result's values."""
    x = [torch.arange(12.0).view(4, 3) / 8, torch.arange(9.0).view(3, 3) / 4]
    idx = [torch.tensor([[0, 1], [1, -1], [0, 1], [1, 0]]), torch.tensor([[0, -1], [1, 0], [0, 1]])]  # rank 0's
    ws = [torch.full((4, 2), 0.5), torch.full((3, 2), 0.25)]
    runs = {c: worlds(2).run(groups_fns.experts_in_another_dtype, [(x[r], idx[r], ws[r], 4, c, variant)
                                                                  for r in range(2)])
            for c in (1, 2)}
    for rank in range(2):
        (one, g1), (two, g2) = runs[1][rank], runs[2][rank]
        assert one.dtype == torch.float64 and two.dtype == torch.float32, (one.dtype, two.dtype)
        assert torch.equal(two, one.float()) and torch.equal(g2, g1)  # dyadic values: every sum exact


def test_a_bounded_dispatch_of_one_group_hands_out_its_padded_rows_by_group(worlds):
    """``wait_group(0)`` of a dispatch with ``max_rows`` in one group gives the
    rows ``wait()`` gives: max_rows of them, padded, beside their weights."""
    g = make_routing(2, 2, 2, [5, 3], "random", seed=2)
    args = [(random_tokens(r, g.num_tokens[r], HIDDEN, torch.float32, 4), g.topk_idx[r], g.topk_weights[r].float(),
             g.num_experts, 16) for r in range(2)]
    for (tokens, weights, rows), (whole_tokens, whole_weights) in worlds(2).run(groups_fns.one_group_bounded, args):
        assert tokens.shape == (16, HIDDEN) and rows == (0, 16), (tokens.shape, rows)
        assert torch.equal(tokens, whole_tokens) and torch.equal(weights, whole_weights)
