"""The host cost of the usual call, where CI sees it: a round trip on a one-rank
gloo world in Python calls; and the compiled CPU plan that keeps it low, bitwise
the torch operations' round trip and gradients."""

from __future__ import annotations

import os

import pytest
import torch

import rank_fns
from reference import reference_dispatch
from bench_scripts import load
from routing import make_routing, random_tokens

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Python calls (cProfile, each function's calls counted by code object: bench/host_calls.py) of a
# round trip on a one-rank gloo world, at most: 150, every variant's. (pstats' total, which keeps
# one of the dataclasses' generated __init__, all "<string>", 2, __init__, counted 9-11 fewer, by
# whether the package was loaded from bytecode.)
MAX_CALLS = {"alltoall": 150, "auto": 150, "allgather": 150, "hierarchical": 150}


@pytest.mark.parametrize("variant", list(MAX_CALLS))
def test_a_round_trip_makes_few_python_calls(variant):
    """dispatch + combine, as a user calls them, on one gloo rank: at most
    ``MAX_CALLS`` Python calls, builtins included (the routing plan and the sums
    compiled, the front end one pass through its checks, agreement and exchange).
    Measured as ``bench/host_calls.py`` measures it, in a process of its own."""
    got = load("host_calls").measure(REPO, variant, trips=1)
    calls, compiled = got["calls"], got["compiled"]
    if not compiled:
        pytest.skip("the compiled CPU plan does not build here (no C++ compiler or ninja)")
    most = MAX_CALLS[variant]
    assert calls <= most, f"a round trip made {calls} Python calls (at most {most})"


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical", "auto"])
def test_the_compiled_plan_gives_the_same_bits(worlds, variant):
    """Round trip and gradients on 4 gloo ranks (2 nodes of 2) with the compiled
    CPU plan and with the torch operations: the same bits, every output (a rank
    without tokens, an empty slot)."""
    world = 4
    routing = make_routing(world, 2, 3, [5, 0, 9, 3], "random", seed=11)
    routing.topk_idx[2][1, 1] = -1  # an empty slot
    xs = [random_tokens(r, t, 6, torch.bfloat16, 5) for r, t in enumerate(routing.num_tokens)]
    ref = reference_dispatch([x.double() for x in xs], routing.topk_idx, routing.topk_weights, routing.num_experts)
    config = {"num_experts": routing.num_experts, "variant": variant, "local_world_size": 2}
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(),
             random_tokens(r, routing.num_tokens[r], 6, torch.bfloat16, 6),
             random_tokens(r, ref[r].tokens.shape[0], 6, torch.float32, 7), config) for r in range(world)]
    for (compiled, torch_ops), built in worlds(world).run(rank_fns.with_and_without_compiled_plan, args):
        if not built:
            pytest.skip("the compiled CPU plan does not build here (no C++ compiler or ninja)")
        for one, other in zip(compiled, torch_ops):
            assert one.keys() == other.keys()
            for name, value in one.items():
                if isinstance(value, torch.Tensor):  # the bits (signed zeros too)
                    assert value.dtype == other[name].dtype, name
                    assert torch.equal(value.view(torch.uint8), other[name].view(torch.uint8)), name
                else:
                    assert value == other[name], name
