"""The asynchronous verbs (``async_op=True``) and the moves along a handle
(``dispatch_rows``, ``combine_rows``, ``combine_slots``): the same bits as the
plain verbs, forward and backward, and two micro-batches overlapped by hand give
the bits of running them one after the other (gloo here, NCCL on GPUs)."""

from __future__ import annotations

import pytest
import torch

import async_fns
from routing import make_routing, random_tokens

HIDDEN = 4
VARIANTS = [dict(variant="alltoall"), dict(variant="allgather"),
            dict(variant="hierarchical", local_world_size=2), dict(variant="auto", local_world_size=2)]


def _assert_equal(got, want, what):
    assert (got is None) == (want is None), f"{what}: present in one run only"
    if got is not None:
        assert got.dtype == want.dtype and torch.equal(got, want), f"{what} differs"


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_micro_batches_overlapped_by_hand(worlds, world_size, dtype):
    """Dispatch of micro-batch 1 starts before micro-batch 0 is waited for, and
    its experts run while micro-batch 0's combine travels: outputs and every
    gradient are bitwise those of the two run one after the other."""
    routings = [make_routing(world_size, 2, 3, [7, 0, 5, 9][:world_size], mode, seed=world_size + m)
                for m, mode in enumerate(["random", "sparse"])]
    args = []
    for r in range(world_size):
        batches = [(random_tokens(r, g.num_tokens[r], HIDDEN, dtype, m), g.topk_idx[r], g.topk_weights[r].to(dtype))
                   for m, g in enumerate(routings)]
        grads = [random_tokens(r, g.num_tokens[r], HIDDEN, dtype, 10 + m) for m, g in enumerate(routings)]
        args.append((batches, grads, dict(num_experts=routings[0].num_experts)))
    plain = worlds(world_size).run(async_fns.two_micro_batches, [(*a, False) for a in args])
    overlapped = worlds(world_size).run(async_fns.two_micro_batches, [(*a, True) for a in args])
    for rank, (got, want) in enumerate(zip(overlapped, plain)):
        for name in ("out", "x", "topk_weights", "params"):
            for i, (a, b) in enumerate(zip(got[name], want[name])):
                _assert_equal(a, b, f"rank {rank}: {name}[{i}]")


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: o["variant"])
def test_two_micro_batches_every_variant(worlds, options):
    routings = [make_routing(4, 2, 3, [6, 3, 0, 8], "random", seed=20 + m) for m in range(2)]
    args = []
    for r in range(4):
        batches = [(random_tokens(r, g.num_tokens[r], HIDDEN, torch.float32, m), g.topk_idx[r],
                    g.topk_weights[r].float()) for m, g in enumerate(routings)]
        grads = [random_tokens(r, g.num_tokens[r], HIDDEN, torch.float32, 10 + m) for m, g in enumerate(routings)]
        args.append((batches, grads, dict(num_experts=routings[0].num_experts, **options)))
    plain = worlds(4).run(async_fns.two_micro_batches, [(*a, False) for a in args])
    overlapped = worlds(4).run(async_fns.two_micro_batches, [(*a, True) for a in args])
    for rank, (got, want) in enumerate(zip(overlapped, plain)):
        for name in ("out", "x", "topk_weights", "params"):
            for i, (a, b) in enumerate(zip(got[name], want[name])):
                _assert_equal(a, b, f"{options} rank {rank}: {name}[{i}]")


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: o["variant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_every_verb_async_equals_plain(worlds, options, dtype):
    """Each verb with ``async_op=True`` gives the plain call's bits; the moves
    along a handle move what dispatch, combine and their backwards move."""
    routing = make_routing(4, 2, 3, [5, 8, 0, 3], "random", seed=4)
    config = dict(num_experts=routing.num_experts, **options)
    args = []
    for r in range(4):
        x = random_tokens(r, routing.num_tokens[r], HIDDEN, dtype, 0) * 8
        rows_out = random_tokens(r, 64, HIDDEN, dtype, 1)  # enough rows for any N here
        values = random_tokens(r, 64, 1, dtype, 2).flatten()
        args.append((x, routing.topk_idx[r], routing.topk_weights[r].to(dtype), rows_out, values, config))
    for rank, (pairs, same) in enumerate(worlds(4).run(async_fns.verbs, args)):
        for name, (plain, started) in pairs.items():
            _assert_equal(started, plain, f"{options} rank {rank}: {name}")
        for name, (move, reference) in same.items():
            _assert_equal(move, reference, f"{options} rank {rank}: {name}")


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_async_round_trip_gradients(worlds, world_size):
    """dispatch and combine started with ``async_op=True`` and waited for at once
    are differentiable: every gradient is bitwise that of the plain verbs."""
    routing = make_routing(world_size, 2, 2, [6, 0, 4][:world_size], "random", seed=9)
    args = [(random_tokens(r, t, HIDDEN, torch.float32, 0), routing.topk_idx[r], routing.topk_weights[r].float(),
             random_tokens(r, t, HIDDEN, torch.float32, 1), dict(num_experts=routing.num_experts))
            for r, t in enumerate(routing.num_tokens)]
    plain = worlds(world_size).run(async_fns.async_gradients, [(*a, False) for a in args])
    started = worlds(world_size).run(async_fns.async_gradients, [(*a, True) for a in args])
    for rank, (got, want) in enumerate(zip(started, plain)):
        for name in ("out", "x", "topk_weights"):
            _assert_equal(got[name], want[name], f"rank {rank}: {name}")
        for i, (a, b) in enumerate(zip(got["params"], want["params"])):
            _assert_equal(a, b, f"rank {rank}: parameter {i}")


def test_moves_along_a_handle_refuse_bad_arguments(worlds):
    routing = make_routing(2, 2, 2, [4, 3], "random", seed=1)
    args = [(random_tokens(r, t, HIDDEN, torch.float32, 0), routing.topk_idx[r], routing.topk_weights[r].float(),
             dict(num_experts=routing.num_experts)) for r, t in enumerate(routing.num_tokens)]
    want = {
        "foreign handle": ("ValueError", "handle"),
        "not a handle": ("ValueError", "handle"),
        "rows of T + 1": ("ValueError", "rows"),
        "integer rows": ("TypeError", "rows"),
        "N + 1 rows": ("ValueError", "rows"),
        "weights of N + 1": ("ValueError", "weights"),
        "values 2-D": ("ValueError", "values"),
        "dispatch wire": ("ValueError", "wire"),
        "combine wire": ("ValueError", "wire"),
    }
    for rank, errors in enumerate(worlds(2).run(async_fns.verb_errors, args)):
        for name, (kind, argument) in want.items():
            assert errors[name] is not None, f"rank {rank}: {name} was accepted"
            assert errors[name][0] == kind and argument in errors[name][1], (rank, name, errors[name])


@pytest.mark.parametrize("options", VARIANTS, ids=lambda o: o["variant"])
def test_two_dispatchers_on_two_groups_interleaved(worlds, options):
    """Exchanges of two dispatchers on two groups, started together and finished
    in the other order, give what one dispatcher gives one after the other."""
    world_size = 4
    routings = [make_routing(world_size, 2, 3, [6, 3, 0, 8], "random", seed=40 + m) for m in range(2)]
    args = []
    for r in range(world_size):
        batches = [(random_tokens(r, g.num_tokens[r], HIDDEN, torch.float32, m), g.topk_idx[r],
                    g.topk_weights[r].float()) for m, g in enumerate(routings)]
        args.append((batches, dict(num_experts=routings[0].num_experts, **options)))
    for rank, (interleaved, plain) in enumerate(worlds(world_size).run(async_fns.two_groups, args)):
        for m in range(2):
            _assert_equal(interleaved[m], plain[m], f"rank {rank}: micro-batch {m}")
