"""MoEExchange(split="experts"): the exchange by groups of local experts gives
the plain round trip's results, value for value, for every number of groups."""

from __future__ import annotations

import pytest
import torch

import pipeline_fns
from routing import make_routing, random_tokens

HIDDEN = 4


def _run(worlds, routing, dtype, kind, chunk_counts, x_grad=True, w_grad=True, **options):
    xs = [random_tokens(r, t, HIDDEN, dtype, 0) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, dtype, 1) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, **options)
    args = [
        (xs[r], routing.topk_idx[r], routing.topk_weights[r].to(dtype), gs[r], config, ["plain", *chunk_counts],
         kind, False, x_grad, w_grad, False, "experts")
        for r in range(routing.world_size)
    ]
    return worlds(routing.world_size).run(pipeline_fns.pipelined, args)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["random", "sparse"])
def test_groups_equal_plain_fp32(worlds, world_size, mode):
    """fp32 swiglu experts, 4 local experts: 1, 2, 3 and 4 groups give the plain
    round trip's output and every gradient bit for bit (T = 0 on a rank)."""
    routing = make_routing(world_size, 4, 3, [7, 0, 3, 12][:world_size], mode, seed=world_size)
    for rank, per_c in enumerate(_run(worlds, routing, torch.float32, "swiglu", [1, 2, 3, 4])):
        for chunks in (1, 2, 3, 4):
            pipeline_fns.assert_same(per_c[chunks], per_c["plain"], f"rank {rank} groups={chunks}")


@pytest.mark.parametrize("options", [dict(dispatch_wire="fp8", combine_grad_wire="e5m2"),
                                     dict(combine_wire="bf16", dispatch_grad_wire="bf16")])
def test_groups_with_wire_formats(worlds, options):
    """Compressed wires: rows are encoded one by one, so grouping changes no bit."""
    routing = make_routing(2, 4, 3, [9, 5], "random", seed=12)
    for rank, per_c in enumerate(_run(worlds, routing, torch.float32, "swiglu", [2, 4], **options)):
        for chunks in (2, 4):
            pipeline_fns.assert_same(per_c[chunks], per_c["plain"], f"{options} rank {rank} groups={chunks}")


def test_groups_only_some_gradients(worlds):
    """Ranks whose inputs need different gradients."""
    routing = make_routing(2, 4, 2, [6, 4], "random", seed=5)
    for x_grad, w_grad in ((True, False), (False, True)):
        for rank, per_c in enumerate(_run(worlds, routing, torch.float32, "relu", [3], x_grad, w_grad)):
            pipeline_fns.assert_same(per_c[3], per_c["plain"], f"x_grad={x_grad} w_grad={w_grad} rank {rank}")


def test_refusals_name_the_argument(worlds):
    messages = worlds(1).run(pipeline_fns.split_errors, [(4,)])[0]
    assert all(m is not None for m in messages), messages
    for message, word in zip(messages, ["split", "alltoall", "chunks", "GroupedExperts", "autocast"]):
        assert word in message, message


def test_refusals_at_the_call(worlds):
    messages = worlds(1).run(pipeline_fns.split_late_errors, [(4,)])[0]
    assert all(m is not None for m in messages), messages
    for message, word in zip(messages, ["local experts", "hook", "x must be", "x must be"]):
        assert word in message, message


def test_rank_with_only_empty_slots(worlds):
    """A rank whose tokens all have empty slots sends nothing: it still takes part
    in every chunk, and the results are those of the plain round trip."""
    routing = make_routing(2, 4, 2, [1, 2], "random", seed=0)
    routing.topk_idx[0] = torch.full_like(routing.topk_idx[0], -1)
    routing.topk_idx[1] = torch.tensor([[0, 3], [2, -1]], dtype=routing.topk_idx[1].dtype)
    for rank, per_c in enumerate(_run(worlds, routing, torch.float32, "swiglu", [2, 4])):
        for chunks in (2, 4):
            pipeline_fns.assert_same(per_c[chunks], per_c["plain"], f"rank {rank} groups={chunks}")
