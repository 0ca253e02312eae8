"""Token dropping by expert capacity (DispatchConfig.capacity_factor): which
slots each policy drops, against a plain-Python reference and against
Megatron-Core's router where megatron-core is importable; every variant
dispatching the kept slots exactly, gradients of dropped weights zero."""

from __future__ import annotations

import fractions
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import dispatch
from dispatch.capacity import drop_over_capacity
from reference import reference_combine, reference_dispatch
from routing import make_routing


def _reference_dropped(topk_idx, weights, num_experts, factor, policy):
    """Per expert, its slots in token order; keep the first C by the policy."""
    tokens, topk = topk_idx.shape
    cap = math.ceil(tokens * topk / num_experts * factor)
    dropped = torch.zeros(tokens, topk, dtype=torch.bool)
    for expert in range(num_experts):
        slots = [(t, k) for t in range(tokens) for k in range(topk) if int(topk_idx[t, k]) == expert]
        if policy == "probs":
            slots.sort(key=lambda s: (-float(weights[s]), s[0]))
        for t, k in slots[cap:]:
            dropped[t, k] = True
    return dropped


def test_a_row_naming_an_expert_twice_loses_no_slot():
    """Dropping one of a repeated id would hide the repeat from the value checks,
    which refuse the dispatch: every slot of such a row stays, the others drop."""
    idx = torch.tensor([[0, 1], [0, 0], [0, 2], [0, 3]])  # C = ceil(4 * 2 / 4 * 0.5) = 1: expert 0 keeps token 0
    new_idx, dropped = drop_over_capacity(idx, torch.ones(4, 2), 4, 0.5, "position")
    assert dropped.tolist() == [[False, False], [False, False], [True, False], [True, False]]
    assert new_idx[1].tolist() == [0, 0]
    # without the value checks (check_inputs=False) nothing refuses the row: it drops as any other, within C
    _, unchecked = drop_over_capacity(idx, torch.ones(4, 2), 4, 0.5, "position", checked=False)
    assert unchecked.tolist() == [[False, False], [True, True], [True, False], [True, False]]


@st.composite
def _routings(draw):
    experts = draw(st.integers(1, 8))
    topk = draw(st.integers(1, experts))
    tokens = draw(st.integers(0, 30))
    idx = torch.stack([torch.randperm(experts, generator=torch.Generator().manual_seed(draw(st.integers(0, 10**6))))
                       [:topk] for _ in range(tokens)]) if tokens else torch.zeros(0, topk, dtype=torch.int64)
    if tokens and draw(st.booleans()):  # some empty slots
        idx[torch.rand(idx.shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99)))) < 0.2] = -1
    levels = draw(st.integers(1, 4))  # few weight values: ties
    weights = torch.randint(0, levels, idx.shape, generator=torch.Generator().manual_seed(draw(st.integers(0, 99))))
    factor = draw(st.sampled_from([0.1, 0.4, 0.75, 1.0, 1.5, 4.0]))
    return idx, weights.float() / levels, experts, factor


@settings(max_examples=150, deadline=None)
@given(_routings(), st.sampled_from(["probs", "position"]))
def test_dropped_slots_are_the_policys(case, policy):
    idx, weights, experts, factor = case
    if idx.shape[0] % 2:  # int32 ids too
        idx = idx.int()
    new_idx, dropped = drop_over_capacity(idx, weights, experts, factor, policy)
    assert new_idx.dtype == idx.dtype
    want = _reference_dropped(idx, weights, experts, factor, policy)
    assert torch.equal(dropped, want)
    assert torch.equal(new_idx, torch.where(want, -1, idx))
    cap = math.ceil(idx.shape[0] * idx.shape[1] / experts * factor)
    kept = new_idx[new_idx >= 0]
    assert int(torch.bincount(kept, minlength=experts).max()) <= cap  # no expert over its capacity


def test_rows_the_checks_refuse_are_left_to_them_as_given():
    """A row with an id out of range or a non-finite weight keeps every slot and
    takes no capacity (the value checks' error then names it as given); without
    the checks only the ids out of range stay, the rest drops as any other."""
    idx = torch.tensor([[0, 9], [0, -3], [0, 1], [0, 1], [1, 2]])
    weights = torch.ones(5, 2)
    weights[4, 1] = float("nan")
    new_idx, dropped = drop_over_capacity(idx, weights, 4, 0.4, "position")  # C = 1
    assert torch.equal(new_idx, torch.tensor([[0, 9], [0, -3], [0, 1], [-1, -1], [1, 2]]))
    assert dropped.sum() == 2
    new_idx, dropped = drop_over_capacity(idx, weights, 4, 0.4, "position", checked=False)
    assert torch.equal(new_idx, torch.tensor([[0, 9], [-1, -3], [-1, 1], [-1, -1], [-1, 2]]))
    assert dropped.sum() == 5


def test_probs_policy_keeps_what_megatrons_router_keeps():
    """Megatron-Core's own token dropping (its router's), on distinct weights."""
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    gen = torch.Generator().manual_seed(0)
    for trial in range(60):
        tokens, experts = 1 + trial * 3, 2 + trial % 12
        topk = 1 + trial % min(experts, 6)
        factor = (0.25, 0.5, 1.0, 1.3, 2.0)[trial % 5]
        weights, idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1)
        probs = torch.zeros(tokens, experts).scatter(1, idx, weights)
        routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, idx, True)
        _, kept_map = moe_utils.apply_router_token_dropping(probs, routing_map, topk, factor, "probs", False)
        new_idx, _ = drop_over_capacity(idx, weights, experts, factor, "probs")
        ours = torch.zeros(tokens, experts, dtype=torch.bool)
        rows = torch.arange(tokens).unsqueeze(1).expand(tokens, topk)
        ours[rows[new_idx >= 0], new_idx[new_idx >= 0]] = True
        assert torch.equal(ours, kept_map), trial


def _dropping_round_trip(x, topk_idx, topk_weights, grad_out, config):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    w = topk_weights.to(device).requires_grad_()
    out = d.dispatch(x.to(device), topk_idx.to(device), w)
    combined = d.combine(out.tokens * 2, out.handle, weights=out.weights)
    (combined.float() * grad_out.to(device)).sum().backward()
    return {"tokens": out.tokens.cpu(), "src_token": out.src_token.cpu(), "combined": combined.detach().cpu(),
            "dropped": out.dropped.cpu(), "grad_w": w.grad.cpu()}


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical"])
@pytest.mark.parametrize("policy, factor", [("probs", 0.5), ("position", 0.8), ("probs", 10.0)])
def test_every_variant_dispatches_the_kept_slots(worlds, variant, policy, factor):
    world = 2
    routing = make_routing(world, 4, 3, [40, 25], "random", seed=3)
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(t, 16, generator=gen) for t in routing.num_tokens]
    ws = [torch.rand(idx.shape, generator=gen) for idx in routing.topk_idx]
    grads = [torch.randn(t, 16, generator=gen) for t in routing.num_tokens]
    config = dict(num_experts=routing.num_experts, variant=variant, capacity_factor=factor, drop_policy=policy,
                  transport="nccl")
    if variant == "hierarchical":
        config["local_world_size"] = 1
    args = [(xs[r], routing.topk_idx[r], ws[r], grads[r], config) for r in range(world)]
    got = worlds(world).run(_dropping_round_trip, args)
    kept = [drop_over_capacity(routing.topk_idx[r], ws[r], routing.num_experts, factor, policy)
            for r in range(world)]
    ref = reference_dispatch(xs, [k[0] for k in kept], ws, routing.num_experts)
    combined = reference_combine([d.tokens * 2 for d in ref], ref, routing.num_tokens,
                                 weights=[d.weights for d in ref])
    on_gpu = worlds(world).on_gpu
    for r in range(world):
        assert torch.equal(got[r]["dropped"], kept[r][1])
        assert torch.equal(got[r]["tokens"], ref[r].tokens) and torch.equal(got[r]["src_token"], ref[r].src_token)
        if on_gpu:  # the GPU kernels fuse a slot's multiply into its add: same order, one rounding fewer
            eps = torch.finfo(torch.float32).eps
            torch.testing.assert_close(got[r]["combined"], combined[r], rtol=4 * eps, atol=4 * eps)
        else:
            assert torch.equal(got[r]["combined"], combined[r])
        assert bool((got[r]["grad_w"][kept[r][1]] == 0).all())  # a dropped slot's weight: no gradient
        if factor < 1:
            assert bool(kept[r][1].any())  # this case drops something


def test_a_factor_large_enough_to_overflow_takes_every_slot():
    """C is at most a rank's T K slots: a factor whose share overflows (1e308)
    keeps them all rather than failing on one rank alone."""
    from dispatch import capacity

    assert capacity.capacity(26, 2, 4, 1e308) == 52 and capacity.capacity(0, 2, 4, 1e308) == 0
    assert capacity.capacity(10, 2, 4, 1.0) == 5 and capacity.capacity(10, 2, 4, 1.1) == 6
    idx = torch.tensor([[0, 1], [1, 2], [0, 3]])
    kept, dropped = capacity.drop_over_capacity(idx, torch.rand(3, 2), 4, 1e308, "probs")
    assert torch.equal(kept, idx) and not dropped.any()


def test_capacity_refused_by_name():
    for bad in (0, -1.0, float("inf"), float("nan"), True, "1", 10**400):  # (the last: past float's range)
        with pytest.raises(ValueError, match="capacity_factor"):
            dispatch.DispatchConfig(num_experts=4, capacity_factor=bad)
    for real in (fractions.Fraction(3, 2), torch.tensor(2.5).item(), 3):  # any real number (numpy's), kept as a float
        factor = dispatch.DispatchConfig(num_experts=4, capacity_factor=real).capacity_factor
        assert type(factor) is float and factor == float(real)
    with pytest.raises(ValueError, match="drop_policy"):
        dispatch.DispatchConfig(num_experts=4, capacity_factor=1.0, drop_policy="random")


def _groups_with_capacity(x, topk_idx, topk_weights, config):
    """MoEExchange by 1 and 2 groups of experts on a dispatcher with a capacity
    (outputs and gradients of x), and the refusal of groups with pad_to_capacity."""
    from dispatch.experts import GroupedExperts
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    got = []
    for groups in (1, 2):
        torch.manual_seed(0)
        experts = GroupedExperts(config["num_experts"] // torch.distributed.get_world_size(), 8, 16).to(device)
        xx = x.clone().requires_grad_()
        out = dispatch.MoEExchange(d, experts, groups=groups)(xx, topk_idx, topk_weights)
        out.sum().backward()
        got.append((out.detach().cpu(), xx.grad.cpu()))
    padded = dispatch.create(dispatch.DispatchConfig.from_options(**config, pad_to_capacity=True))
    try:
        dispatch.MoEExchange(padded, experts, groups=2)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return got, refused


def test_groups_keep_the_drops_of_one_dispatch(worlds):
    """The capacity is per dispatch, and a layer by groups makes one dispatch:
    its outputs and gradients are those of one group (the same slots dropped);
    groups with pad_to_capacity (blocks placed when the whole dispatch is in)
    are refused."""
    routing = make_routing(2, 2, 2, [10, 7], "random", seed=1)
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(t, 8, generator=gen) for t in routing.num_tokens]
    config = dict(num_experts=4, capacity_factor=0.7, transport="nccl")
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], config) for r in range(2)]
    for got, refused in worlds(2).run(_groups_with_capacity, args):
        (a, ga), (b, gb) = got
        assert torch.equal(a, b) and torch.equal(ga, gb)
        assert refused is not None and "pad_to_capacity" in refused and "groups=2" in refused, refused


def _padded_against_plain(x, topk_idx, topk_weights, grad_out, config):
    """The same round trip with pad_to_capacity and without (the same drops)."""
    from world import current_device

    device = current_device()
    x, topk_idx, grad_out = x.to(device), topk_idx.to(device), grad_out.to(device)
    got = {}
    for pad in (False, True):
        d = dispatch.create(dispatch.DispatchConfig.from_options(**config, pad_to_capacity=pad))
        xx, ww = x.clone().requires_grad_(), topk_weights.to(device).requires_grad_()
        out = d.dispatch(xx, topk_idx, ww)
        y = out.tokens * 1.5 + out.tokens * out.tokens * 0.25
        combined = d.combine(y, out.handle, weights=out.weights)
        (combined * grad_out).sum().backward()
        rows = d.dispatch_rows(x * 3, out.handle)
        got[pad] = {key: value.detach().cpu() for key, value in dict(
            tokens=out.tokens, weights=out.weights, src_rank=out.src_rank, src_token=out.src_token,
            tokens_per_expert=out.tokens_per_expert, combined=combined, x_grad=xx.grad, w_grad=ww.grad, rows=rows,
            summed=d.combine_rows(rows, out.handle)).items()}
        got[pad]["tokens_per_expert_host"] = out.tokens_per_expert_host
    return got


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical"])
@pytest.mark.parametrize("policy, factor", [("probs", 0.5), ("position", 1.0), ("probs", 10.0)])
def test_pad_to_capacity_places_the_kept_rows_in_fixed_blocks(worlds, variant, policy, factor):
    """pad_to_capacity: every local expert gets min(C_s, T_s) rows from each source
    rank s (its kept rows in order, then zero rows of weight 0 and source -1), and
    the round trip, its gradients and the moves along the handle are those of the
    same dispatch without padding."""
    world, experts, topk = 2, 4, 2
    routing = make_routing(world, experts // world, topk, [12, 7], "random", seed=6)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(t, 8, generator=gen) for t in routing.num_tokens]
    ws = [torch.rand(idx.shape, generator=gen) for idx in routing.topk_idx]
    grads = [torch.randn(t, 8, generator=gen) for t in routing.num_tokens]
    config = dict(num_experts=experts, variant=variant, capacity_factor=factor, drop_policy=policy, transport="nccl")
    if variant == "hierarchical":
        config["local_world_size"] = 1
    got = worlds(world).run(_padded_against_plain, [(xs[r], routing.topk_idx[r], ws[r], grads[r], config)
                                                    for r in range(world)])
    blocks = [min(math.ceil(t * topk / experts * factor), t) for t in routing.num_tokens]
    local = experts // world
    for r in range(world):
        plain, padded = got[r][False], got[r][True]
        assert padded["tokens"].shape[0] == local * sum(blocks)
        assert torch.equal(padded["tokens_per_expert"], torch.full((local,), sum(blocks)))
        assert torch.equal(padded["tokens_per_expert_host"], torch.full((local,), sum(blocks)))
        at = 0  # the plain rows, block by block
        for e in range(local):
            for s in range(world):
                start = (e * sum(blocks) + sum(blocks[:s]))
                mine = (plain["src_rank"] == s) & (torch.repeat_interleave(
                    torch.arange(local), plain["tokens_per_expert"]) == e)
                n = int(mine.sum())
                assert n <= blocks[s]
                for key, fill in (("tokens", 0), ("weights", 0), ("src_rank", -1), ("src_token", -1), ("rows", 0)):
                    assert torch.equal(padded[key][start : start + n], plain[key][at : at + n]), (r, key, e, s)
                    assert bool((padded[key][start + n : start + blocks[s]] == fill).all()), (r, key, e, s)
                at += n
        assert at == plain["tokens"].shape[0]
        for key in ("combined", "x_grad", "w_grad", "summed"):
            assert torch.equal(padded[key], plain[key]), (r, key)


def test_pad_to_capacity_refused_by_name():
    with pytest.raises(ValueError, match="pad_to_capacity"):
        dispatch.DispatchConfig(num_experts=4, pad_to_capacity=True)
    with pytest.raises(TypeError, match="pad_to_capacity"):
        dispatch.DispatchConfig(num_experts=4, capacity_factor=1.0, pad_to_capacity=1)


def _padded_with_max_rows(config):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    try:
        d.dispatch(torch.zeros(4, 8, device=device), torch.zeros(4, 1, dtype=torch.int64, device=device),
                   torch.ones(4, 1, device=device), max_rows=64)
    except ValueError as exc:
        return str(exc)
    return None


def test_pad_to_capacity_takes_no_max_rows(worlds):
    config = dict(num_experts=4, capacity_factor=1.0, pad_to_capacity=True, transport="nccl")
    for message in worlds(2).run(_padded_with_max_rows, [(config,)] * 2):
        assert message is not None and message.startswith("max_rows:") and "pad_to_capacity" in message, message


def _layer_padded_against_plain(x, topk_idx, topk_weights):
    """MoEExchange with GroupedExperts, with pad_to_capacity and without: outputs and
    gradients; then a move along a pad_to_capacity dispatch's handle before its wait."""
    from dispatch.experts import GroupedExperts
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    got = []
    for pad in (True, False):
        d = dispatch.create(dispatch.DispatchConfig(num_experts=4, capacity_factor=0.7, pad_to_capacity=pad,
                                                    transport="nccl"))
        torch.manual_seed(0)
        experts = GroupedExperts(2, 8, 16).to(device)
        xx = x.clone().requires_grad_()
        out = dispatch.MoEExchange(d, experts, groups=1)(xx, topk_idx, topk_weights)
        out.sum().backward()
        got.append((out.detach(), xx.grad, [p.grad.clone() for p in experts.parameters()]))
    d_pad = dispatch.create(dispatch.DispatchConfig(num_experts=4, capacity_factor=0.7, pad_to_capacity=True,
                                                           transport="nccl"))
    work = d_pad.dispatch(x, topk_idx, topk_weights, async_op=True)
    try:
        d_pad.dispatch_rows(x, work.handle)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    work.wait()
    (a, ga, pa), (b, gb, pb) = got
    return torch.equal(a, b) and torch.equal(ga, gb) and all(torch.equal(u, v) for u, v in zip(pa, pb)), refused


def test_pad_to_capacity_in_the_layer(worlds):
    """MoEExchange on a pad_to_capacity dispatcher: the experts see the padded blocks,
    the layer's output and every gradient are those without padding; moving rows
    along the handle of a dispatch not yet waited for is refused (its rows are placed
    at the wait)."""
    routing = make_routing(2, 2, 2, [10, 7], "random", seed=1)
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(t, 8, generator=gen) for t in routing.num_tokens]
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r]) for r in range(2)]
    for same, refused in worlds(2).run(_layer_padded_against_plain, args):
        assert same
        assert refused is not None and refused.startswith("handle:") and "wait" in refused, refused
