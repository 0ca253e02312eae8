"""The NVLink engine (transport="nvlink") against the NCCL transport, bit for bit.

GPU only but for a few host-side checks on gloo: needs 2 CUDA devices and CuPy
(skipped elsewhere). Inputs are random
(not dyadic), so that a sum taken in another order or with another rounding
shows as a different bit.
"""

from __future__ import annotations

import copy

import pytest
import torch

import dispatch
import agreement_fns
import groups_fns
import pipeline_fns
import rank_fns
from dispatch import cuda
from dispatch.nvlink_layout import most_experts
from dispatch.bench.common import same_bits
from routing import make_routing
from shared_gpu import engine_ranks

WORLD = 2
needs_engine = pytest.mark.skipif(not engine_ranks(WORLD), reason="needs 2 CUDA devices (or one shared) and CuPy")
needs_two_gpus = pytest.mark.skipif(  # a GPU each: another GPU's rows, one rank's device memory filled
    not (cuda.available() and torch.cuda.device_count() >= WORLD), reason="needs 2 CUDA devices and CuPy")


def _inputs(routing, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, hidden, generator=gen).to(dtype) for t in routing.num_tokens]
    ws = [torch.rand(idx.shape, generator=gen, dtype=torch.float64) for idx in routing.topk_idx]
    return xs, ws


def _gradient_inputs(routing, per_rank, hidden, dtype):
    """Each rank's output gradient [T, H] and its experts' outputs [N, H] (seeded)."""
    gen = torch.Generator().manual_seed(11)
    grads = [torch.randn(t, hidden, generator=gen).to(dtype) for t in routing.num_tokens]
    rows = [int(sum((idx // per_rank == r).sum() for idx in routing.topk_idx)) for r in range(len(routing.num_tokens))]
    expert_out = [torch.randn(n, hidden, generator=gen).to(dtype) for n in rows]
    return grads, expert_out


def _run(worlds, fn, routing, xs, ws, config, *extra):
    args = [(xs[r], routing.topk_idx[r], ws[r].float(), dict(config), *extra) for r in range(WORLD)]
    return worlds(WORLD).run(fn, args)


def _equal(a, b, where):
    if isinstance(a, dict):
        for key in a:
            if key in ("variant", "stats"):
                continue
            _equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert same_bits(a, b), f"{where}: {(a.double() - b.double()).abs().max()}"
    else:
        assert a == b, where


CASES = [
    # mode, experts per rank, topk, tokens per rank
    ("random", 4, 4, [96, 80]),
    ("random", 16, 8, [200, 0]),
    ("one_rank", 4, 3, [64, 64]),
    ("one_expert", 8, 2, [50, 70]),
    ("sparse", 4, 4, [33, 17]),
    ("random", 160, 8, [1100, 700]),  # several blocks of tokens, 320 experts
    ("random", 512, 8, [600, 300]),  # 1024 experts: the layout's scan by fewer warps than a block has
    ("random", 2, 1, [5000, 3000]),  # K = 1: chunks of the layout's scan of 2048 tokens
]


@needs_engine
@pytest.mark.parametrize("mode, per_rank, topk, tokens", CASES)
@pytest.mark.parametrize("dtype, wire, hidden", [
    (torch.bfloat16, "native", 256), (torch.float32, "native", 136), (torch.bfloat16, "fp8", 384),
    (torch.float32, "bf16", 256), (torch.float16, "e5m2", 260), (torch.float64, "native", 64),
])
def test_round_trip_matches_nccl(worlds, mode, per_rank, topk, tokens, dtype, wire, hidden):
    routing = make_routing(WORLD, per_rank, topk, tokens, mode, seed=len(tokens) + hidden)
    xs, ws = _inputs(routing, hidden, dtype, seed=hidden)
    want_wire = "fp8" if wire == "e5m2" else wire  # e5m2 is a gradient wire
    got = {}
    for transport in ("nccl", "nvlink"):
        config = dict(num_experts=routing.num_experts, dispatch_wire=want_wire, transport=transport)
        got[transport] = _run(worlds, rank_fns.round_trip, routing, xs, ws, config, "scaled", 2)
    for rank in range(WORLD):
        _equal(got["nccl"][rank], got["nvlink"][rank], f"rank {rank}")


FOUR = 4
needs_four = pytest.mark.skipif(not engine_ranks(FOUR), reason="needs 4 CUDA devices (or one shared) and CuPy")


@needs_four
@pytest.mark.parametrize("mode, per_rank, topk, tokens", [
    ("random", 4, 4, [96, 80, 0, 57]), ("one_rank", 4, 3, [64, 64, 64, 64]), ("sparse", 8, 6, [33, 17, 90, 1]),
    ("random", 64, 8, [700, 1100, 300, 900]),
])
@pytest.mark.parametrize("dtype, wire, hidden", [
    (torch.bfloat16, "native", 256), (torch.bfloat16, "fp8", 384), (torch.float64, "native", 64),
])
def test_round_trip_on_four_ranks_matches_nccl(worlds, mode, per_rank, topk, tokens, dtype, wire, hidden):
    """A world of 4 (T = 0 on a rank, all to one rank): round trip and its
    gradients bitwise the NCCL transport's."""
    routing = make_routing(FOUR, per_rank, topk, tokens, mode, seed=len(tokens) + hidden)
    xs, ws = _inputs(routing, hidden, dtype, seed=hidden)
    grads, expert_out = _gradient_inputs(routing, per_rank, hidden, dtype)
    got = {}
    for transport in ("nccl", "nvlink"):
        config = dict(num_experts=routing.num_experts, dispatch_wire=wire, transport=transport)
        trips = worlds(FOUR).run(rank_fns.round_trip, [(xs[r], routing.topk_idx[r], ws[r].float(), dict(config),
                                                        "scaled", 2) for r in range(FOUR)])
        config.pop("dispatch_wire")
        grads_of = worlds(FOUR).run(rank_fns.gradients, [(xs[r], routing.topk_idx[r], ws[r].float(), grads[r],
                                                          expert_out[r], dict(config)) for r in range(FOUR)])
        got[transport] = list(zip(trips, grads_of))
    for rank in range(FOUR):
        for part in range(2):
            _equal(got["nccl"][rank][part], got["nvlink"][rank][part], f"rank {rank} part {part}")


@needs_four
def test_graph_replays_on_four_ranks(worlds):
    """A round trip with max_rows captured once and replayed 200 times on a world
    of 4, each replay with a new routing checked against NCCL."""
    args = [(dict(num_experts=32), 300, 512, 4, 300 * 4 * 2, 200, 5)] * FOUR
    assert worlds(FOUR).run(_graph_replays, args) == [0] * FOUR


@needs_engine
@pytest.mark.parametrize("mode, per_rank, topk, tokens", CASES[:3])
@pytest.mark.parametrize("dtype, weights_dtype, grad_wire", [
    (torch.bfloat16, torch.float32, "native"), (torch.float32, torch.float32, "e5m2"),
    (torch.float64, torch.float64, "native"),
])
def test_gradients_match_nccl(worlds, mode, per_rank, topk, tokens, dtype, weights_dtype, grad_wire):
    routing = make_routing(WORLD, per_rank, topk, tokens, mode, seed=7)
    hidden = 128
    xs, ws = _inputs(routing, hidden, dtype, seed=3)
    grads, expert_out = _gradient_inputs(routing, per_rank, hidden, dtype)
    got = {}
    for transport in ("nccl", "nvlink"):
        config = dict(num_experts=routing.num_experts, transport=transport, combine_grad_wire=grad_wire)
        args = [(xs[r], routing.topk_idx[r], ws[r].to(weights_dtype), grads[r], expert_out[r], config)
                for r in range(WORLD)]
        got[transport] = worlds(WORLD).run(rank_fns.gradients, args)
    for rank in range(WORLD):
        _equal(got["nccl"][rank], got["nvlink"][rank], f"rank {rank}")


@needs_engine
@pytest.mark.parametrize("mode, per_rank, topk, tokens, groups", [
    ("random", 8, 4, [96, 80], 3),
    ("random", 16, 8, [200, 0], 5),
    ("one_expert", 8, 2, [50, 70], 2),
    ("sparse", 4, 4, [33, 17], 4),
])
@pytest.mark.parametrize("dtype, hidden, wires", [
    (torch.bfloat16, 256, {}), (torch.float32, 136, dict(dispatch_wire="fp8", combine_wire="bf16")),
    (torch.float64, 6, {}), (torch.float16, 20, {}),
])
def test_groups_on_the_engine_give_the_bits_of_one_piece(worlds, mode, per_rank, topk, tokens, groups, dtype,
                                                         hidden, wires):
    """A dispatch by groups on the engine (a pull a group, a row that an earlier
    group brought copied locally; the pre-sums a group completes pushed as it
    is added): every verb gives the bits of the same dispatch in one span,
    the groups waited for in reverse order."""
    routing = make_routing(WORLD, per_rank, topk, tokens, mode, seed=groups + hidden)
    xs, ws = _inputs(routing, hidden, dtype, seed=hidden)
    gen = torch.Generator().manual_seed(groups)
    args = []
    for r in range(WORLD):
        rows_out = torch.randn(4 * sum(tokens) * topk + 4, hidden, generator=gen, dtype=torch.float64)
        values = torch.randn(4 * sum(tokens) * topk + 4, generator=gen, dtype=torch.float64).to(dtype)
        config = dict(num_experts=routing.num_experts, transport="nvlink", **wires)
        args.append((xs[r], routing.topk_idx[r], ws[r].to(dtype), rows_out, values, config, groups))
    for rank, (pairs, facts) in enumerate(worlds(WORLD).run(groups_fns.grouped_verbs, args)):
        assert facts["groups"] == groups
        for name, (got, want) in pairs.items():
            _equal(got, want, f"rank {rank}: {name}")


def _interleaved_sums(x, topk_idx, topk_weights, config, groups):
    """Two combines by groups along one dispatch, their groups added in turn,
    and a dispatch between two groups of the second: each gives the bits of
    the combine in one piece."""
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    work = d.dispatch(x, topk_idx, topk_weights, groups=groups, async_op=True)
    parts = [work.wait_group(g) for g in range(groups)]
    ys = [torch.cat([p.tokens for p in parts]) * s for s in (2, 3)]
    a = d.combine_groups(work.handle, dtype=x.dtype)
    b = d.combine_groups(work.handle, dtype=x.dtype)
    for g, p in enumerate(parts):
        lo, hi = p.rows
        a.add(ys[0][lo:hi], p.weights)
        if g == 1:
            d.dispatch(x, topk_idx, topk_weights)  # an operation between two groups of b
        b.add(ys[1][lo:hi], p.weights)
    full = work.wait()
    ok = [torch.equal(s.wait(), d.combine(y, full.handle, weights=full.weights)) for s, y in zip((a, b), ys)]
    # one combine's first group, then another combine whole (its pieces over the first's
    # early pushes), then the first's other groups
    a = d.combine_groups(full.handle, dtype=x.dtype)
    b = d.combine_groups(full.handle, dtype=x.dtype)
    a.add(ys[0][slice(*parts[0].rows)], parts[0].weights)
    for p in parts:
        b.add(ys[1][slice(*p.rows)], p.weights)
    for p in parts[1:]:
        a.add(ys[0][slice(*p.rows)], p.weights)
    ok += [torch.equal(s.wait(), d.combine(y, full.handle, weights=full.weights)) for s, y in zip((a, b), ys)]
    return all(ok)


def _piece_rows(x, topk_idx, topk_weights, config, groups):
    """A pull of one group's span into an output whose other rows hold marks:
    it writes its group's rows only, and copies an item that an earlier group
    brought from that group's row (marked here) instead of reading it again."""
    from dispatch.codec import to_experts_codec
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    full = d.dispatch(x, topk_idx, topk_weights, groups=groups)
    h, tokens = full.handle, full.tokens
    lo, hi = h.row_range(1)
    out = torch.cat([tokens[:lo] * 2, torch.full_like(tokens[lo:], 7.0)])
    d.transport.engine.to_experts(x, to_experts_codec("native", x.dtype), h.counts, h.presum, h.slot_k, h.num_rows,
                        span=(lo, hi), out=out)
    # presum holds bound rows per source, one an item (a token the source sends this
    # rank, in its list's order); those past the source's items are not written
    written = torch.zeros(h.presum.shape[0], dtype=torch.bool, device=device)
    for source, sends in enumerate(h.counts.host.sends):
        count = sends[d.rank]
        written[source * h.counts.bound:source * h.counts.bound + count] = True
    listed = (h.presum >= 0) & written.unsqueeze(1)
    first = torch.full((tokens.shape[0],), -1, dtype=torch.int64, device=device)
    first[h.presum[listed].long()] = h.presum[:, :1].expand_as(h.presum)[listed].long()
    earlier = (first[lo:hi] < lo).unsqueeze(1)
    want = torch.cat([tokens[:lo] * 2, torch.where(earlier, tokens[lo:hi] * 2, tokens[lo:hi]),
                      torch.full_like(tokens[hi:], 7.0)])
    return torch.equal(out, want), bool(earlier.any()), bool((~earlier).any())


@needs_engine
def test_a_piece_writes_its_group_and_copies_what_earlier_groups_brought(worlds):
    routing = make_routing(WORLD, 8, 4, [96, 80], "random", seed=5)
    xs, ws = _inputs(routing, 256, torch.bfloat16, seed=5)
    config = dict(num_experts=routing.num_experts, transport="nvlink")
    for equal, copied, pulled in _run(worlds, _piece_rows, routing, xs, ws, config, 3):
        assert equal and copied and pulled


@needs_engine
def test_combines_by_groups_interleaved(worlds):
    routing = make_routing(WORLD, 8, 4, [96, 80], "random", seed=3)
    xs, ws = _inputs(routing, 256, torch.bfloat16, seed=3)
    config = dict(num_experts=routing.num_experts, transport="nvlink")
    assert all(_run(worlds, _interleaved_sums, routing, xs, ws, config, 4))


@needs_engine
@pytest.mark.parametrize("experts, dtype, hidden, late", [
    ("rowwise", torch.float32, 64, True), ("relu", torch.float64, 16, False), ("rowwise", torch.bfloat16, 128, False),
])
def test_layer_by_groups_on_the_engine(worlds, experts, dtype, hidden, late):
    """MoEExchange by groups of experts on the engine, the experts late on their
    stream: output and gradients of x and topk_weights bitwise those of one
    span and of dispatch -> experts -> combine; parameter gradients too, where
    the sums are exact (fp64 dyadic data)."""
    routing = make_routing(WORLD, 6, 3, [70, 0], "random", seed=hidden)
    xs, _ = _inputs(routing, hidden, dtype, seed=1)
    gs, _ = _inputs(routing, hidden, dtype, seed=2)
    if dtype == torch.float64:  # dyadic: every sum exact
        xs, gs = [(x * 8).round() / 8 for x in xs], [(g * 8).round() / 8 for g in gs]
    config = dict(num_experts=routing.num_experts, transport="nvlink")
    groups = ["plain", 1, 2, 3, 6]
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].to(dtype), gs[r], config, groups, experts, False,
             True, True, late) for r in range(WORLD)]
    exact = dtype == torch.float64
    for rank, per_g in enumerate(worlds(WORLD).run(pipeline_fns.pipelined, args)):
        for g in groups[1:]:
            if not exact:  # parameter gradients are sums over rows taken group by group
                per_g[g]["params"] = per_g["plain"]["params"] = []
            pipeline_fns.assert_same(per_g[g], per_g["plain"], f"rank {rank} G={g}", params_exact=exact)


def _many_calls(x, topk_idx, topk_weights, config):
    """Several dispatches and combines of different sizes on one dispatcher, two
    micro-batches in flight: each result equals a fresh NCCL dispatcher's."""
    from world import current_device

    device = current_device()
    engine = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink"))
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    outs = []
    for d in (engine, nccl):
        first = d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
        half = x.shape[0] // 2
        second = d.dispatch(x[:half].to(device) * 2, topk_idx[:half].to(device), topk_weights[:half].to(device))
        h2 = d.combine(second.tokens * 3, second.handle, weights=second.weights)
        h1 = d.combine(first.tokens, first.handle, weights=first.weights)
        outs.append([t.cpu() for t in (first.tokens, second.tokens, h1, h2)])
    return all(torch.equal(a, b) for a, b in zip(*outs))


@needs_engine
def test_interleaved_micro_batches_and_growth(worlds):
    for tokens in ([16, 8], [300, 500], [40, 2000]):  # the buffers grow on the second and third
        routing = make_routing(WORLD, 4, 4, tokens, "random", seed=tokens[1])
        xs, ws = _inputs(routing, 512, torch.bfloat16, seed=1)
        config = dict(num_experts=routing.num_experts)
        args = [(xs[r], routing.topk_idx[r], ws[r].float(), config) for r in range(WORLD)]
        assert all(worlds(WORLD).run(_many_calls, args))


@needs_engine
def test_a_rank_that_does_not_call_raises_on_its_peer(worlds):
    """Rank 1 dispatches only after rank 0's timeout: rank 0 raises naming it, rank 1
    raises when it comes (rank 0 gave the call up); nothing hangs, and the world
    serves the tests after it."""
    assert _timeout_case(worlds) == ["RuntimeError", "late"]


def _stall(x, topk_idx, topk_weights, config):
    import time

    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=2.0))
    if torch.distributed.get_rank() == 1:
        time.sleep(2.5)  # past rank 0's timeout
    try:
        d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    except RuntimeError as exc:
        if torch.distributed.get_rank() == 1:
            assert "gave up waiting" in str(exc), str(exc)
            return "late"
        assert "rank 1" in str(exc), str(exc)
        return "RuntimeError"
    return "returned"


def _timeout_case(worlds):
    routing = make_routing(WORLD, 4, 2, [8, 8], "random", seed=0)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], ws[r].float(), config) for r in range(WORLD)]
    return worlds(WORLD).run(_stall, args)


def _picked(config):
    return "/".join(dispatch.create(dispatch.DispatchConfig.from_options(**config)).transport.key)


def _refused(config):
    try:
        dispatch.create(dispatch.DispatchConfig.from_options(**config))
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.skipif(engine_ranks(WORLD), reason="the CPU (gloo) side")
def test_auto_transport_takes_the_collectives_on_gloo(worlds):
    config = dict(num_experts=4)
    assert worlds(WORLD).run(_picked, [(config,)] * WORLD) == ["alltoall/nccl"] * WORLD
    config = dict(num_experts=4, transport="nvlink")
    for message in worlds(WORLD).run(_refused, [(config,)] * WORLD):
        assert message is not None and "transport='nvlink'" in message and "gloo" in message


def test_more_experts_than_the_layout_counts_refused_by_name(worlds):
    """E + W past what one block's shared memory counts: transport='nvlink' refused
    naming num_experts, on every rank, before any communication; 'auto' takes NCCL."""
    experts = most_experts(WORLD) + WORLD  # over the limit by one expert per rank
    config = dict(num_experts=experts, transport="nvlink")
    for message in worlds(WORLD).run(_refused, [(config,)] * WORLD):
        assert message is not None and f"num_experts={experts}" in message, message
    assert worlds(WORLD).run(_picked, [(dict(num_experts=experts),)] * WORLD) == ["alltoall/nccl"] * WORLD


def _bad_on_rank0(x, topk_idx, topk_weights, config, case):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink"))
    if torch.distributed.get_rank() == 0:
        if case == "id":
            topk_idx = topk_idx.clone()
            topk_idx[1, 0] = config["num_experts"]
        elif case == "twice":
            topk_idx = topk_idx.clone()
            topk_idx[1, 1] = topk_idx[1, 0]
        elif case == "weight":
            topk_weights = topk_weights.clone()
            topk_weights[2, 0] = float("nan")
        elif case == "hidden":
            x = x[:, :32].contiguous()
    try:
        d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return None


@needs_engine
@pytest.mark.parametrize("case, argument", [("id", "topk_idx"), ("twice", "topk_idx"), ("weight", "topk_weights"),
                                            ("hidden", "x")])
def test_bad_input_on_one_rank_stops_every_rank(worlds, case, argument):
    """Bad values on rank 0: it raises a ValueError naming the argument, rank 1 a
    RuntimeError naming rank 0, both where they read the counts; ranks that
    disagree on H are refused alike. No token moves, nothing hangs."""
    routing = make_routing(WORLD, 4, 2, [8, 8], "random", seed=5)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], ws[r].float(), config, case) for r in range(WORLD)]
    results = worlds(WORLD).run(_bad_on_rank0, args)
    if case == "hidden":
        assert all(r is not None and r[0] == "ValueError" and argument in r[1] for r in results), results
        return
    assert results[0] is not None and results[0][0] == "ValueError" and argument in results[0][1], results
    assert results[1] is not None and results[1][0] == "PeerRefused" and "[0]" in results[1][1], results


@needs_engine
@pytest.mark.parametrize("groups, bad_group, where, grads", [(1, 0, "forward", "both"), (2, 1, "forward", "both"),
                                                             (2, 0, "backward", "both"), (2, 0, "backward", "weights")])
def test_a_layers_experts_raising_on_one_rank_stop_every_rank_on_the_engine(worlds, groups, bad_group, where, grads):
    """``MoEExchange`` on the engine: rank 1's experts raise in group g (forward,
    or backward; with the weights' gradients only, after the later groups'
    pulls, which the engine issues as they are waited for) while the exchange
    of the other groups is in flight: rank 1 raises its error, rank 0
    PeerRefused naming it (not at the timeout), and a round trip and the layer
    after it are right on both (the engine's buffers and calls in step)."""
    config = dict(num_experts=agreement_fns.E, transport="nvlink", timeout=30.0)
    results = worlds(WORLD).run(agreement_fns.moe_experts_raise, [(config, groups, 1, bad_group, where, grads)] * 2)
    assert results[1][0] == "RuntimeError" and "failed on this rank" in results[1][1], results
    assert results[0][0] == "PeerRefused" and "rank(s) [1]" in results[0][1], results
    assert all(r[2] < 10 and r[3] for r in results), results


@needs_two_gpus
@pytest.mark.parametrize("verb", ["combine", "combine_rows", "combine_slots", "dispatch_rows", "dispatch",
                                  "dispatch, the other GPU current"])
def test_rows_on_another_gpu_refused_by_name(worlds, verb):
    """Rank 0 hands a verb along a handle its rows on the other GPU (a process that
    sees both), or dispatches its tokens there, or with that GPU current: it
    raises a ValueError naming the argument and both devices, rank 1
    PeerRefused naming rank 0, before any row moves; a round trip after it
    completes on both (an engine's kernel would have read the other GPU's memory
    through its address)."""
    routing = make_routing(WORLD, 4, 2, [8, 8], "random", seed=3)
    xs, ws = _inputs(routing, 64, torch.float32, seed=1)
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], ws[r].float(), config, verb) for r in range(WORLD)]
    results = worlds(WORLD).run(_rows_on_another_gpu, args)
    name = {"combine_slots": "values", "combine": "expert_out"}.get(verb, "rows")
    told = {"dispatch": ["x is on cuda:", "but the dispatcher's engine runs on cuda:"],
            "dispatch, the other GPU current": ["the current CUDA device is", "call it with its own device current"]}
    for part in told.get(verb, [f"{name} is on cuda:", "but must be on cuda:", "the device of the dispatch's x"]):
        assert results[0][0] == "ValueError" and part in results[0][1], results
    assert results[1][0] == "PeerRefused" and "[0]" in results[1][1], results
    assert all(r[2] for r in results), results


def _rows_on_another_gpu(x, topk_idx, topk_weights, config, verb):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink"))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    other, mine = torch.device("cuda", 1 - device.index), torch.distributed.get_rank() == 0
    with torch.no_grad():
        out = d.dispatch(x, topk_idx, topk_weights)
        moved = {"combine": out.tokens, "combine_rows": out.tokens, "combine_slots": out.weights}.get(verb, x)

        def call():
            if verb == "dispatch":  # rank 0's tokens on the other GPU
                d.dispatch(*(t.to(other) if mine else t for t in (x, topk_idx, topk_weights)))
            elif verb == "dispatch, the other GPU current":
                with torch.cuda.device(other if mine else device):
                    d.dispatch(x, topk_idx, topk_weights)
            else:
                getattr(d, verb)(moved.to(other) if mine else moved, out.handle)

        try:
            call()
            raised = None
        except (ValueError, RuntimeError) as exc:
            raised = (type(exc).__name__, str(exc))
        again = d.dispatch(x, topk_idx, topk_weights)
        back = d.combine(again.tokens, again.handle, weights=again.weights)
        torch.cuda.synchronize()
    expected = x * (topk_weights * (topk_idx >= 0)).sum(1, keepdim=True)  # identity experts, weighted
    return (*raised, bool(torch.allclose(back, expected, rtol=1e-5, atol=1e-5))) if raised else None


@needs_engine
def test_tokens_on_the_host_refused_by_name(worlds):
    """Rank 0 dispatches tokens left on the host to an engine dispatcher: a
    ValueError naming x and its device (not a CUDA error from the engine reading
    host memory through a device address; over gloo, where the group moves host
    tensors, the engine's own check says it), rank 1 PeerRefused naming rank 0;
    a round trip after it completes on both."""
    routing = make_routing(WORLD, 4, 2, [8, 8], "random", seed=4)
    xs, ws = _inputs(routing, 64, torch.float32, seed=2)
    results = _run(worlds, _tokens_on_the_host, routing, xs, ws, dict(num_experts=routing.num_experts))
    assert results[0][0] == "ValueError" and "x is on cpu" in results[0][1], results
    assert results[1][0] == "PeerRefused" and "[0]" in results[1][1], results
    assert all(r[2] for r in results), results


def _tokens_on_the_host(x, topk_idx, topk_weights, config):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink"))
    on_device = [t.to(device) for t in (x, topk_idx, topk_weights)]
    with torch.no_grad():
        try:
            d.dispatch(*((x, topk_idx, topk_weights) if torch.distributed.get_rank() == 0 else on_device))
            raised = None
        except (ValueError, RuntimeError) as exc:
            raised = (type(exc).__name__, str(exc))
        again = d.dispatch(*on_device)
        back = d.combine(again.tokens, again.handle, weights=again.weights)
        torch.cuda.synchronize()
    x, topk_idx, topk_weights = on_device
    expected = x * (topk_weights * (topk_idx >= 0)).sum(1, keepdim=True)  # identity experts, weighted
    return (*raised, bool(torch.allclose(back, expected, rtol=1e-5, atol=1e-5))) if raised else None


def _async_out_of_order(x, topk_idx, topk_weights, config):
    """Three micro-batches on one engine dispatcher: dispatches started together
    (on its communication stream) and waited for in reverse order, combines
    mixed synchronous and started; each result equals a fresh NCCL dispatcher's."""
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    parts = [slice(0, None), slice(0, x.shape[0] // 2), slice(x.shape[0] // 3, None)]
    engine = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink"))
    works = [engine.dispatch(x[p] * (i + 1), topk_idx[p], topk_weights[p], async_op=True) for i, p in enumerate(parts)]
    outs = [w.wait() for w in reversed(works)][::-1]
    started = engine.combine(outs[0].tokens, outs[0].handle, weights=outs[0].weights, async_op=True)
    second = engine.combine(outs[1].tokens * 3, outs[1].handle, weights=outs[1].weights)
    third = engine.combine(outs[2].tokens, outs[2].handle, async_op=True).wait()
    got = [o.tokens for o in outs] + [started.wait(), second, third]
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    ref = [nccl.dispatch(x[p] * (i + 1), topk_idx[p], topk_weights[p]) for i, p in enumerate(parts)]
    want = [o.tokens for o in ref] + [nccl.combine(ref[0].tokens, ref[0].handle, weights=ref[0].weights),
                                      nccl.combine(ref[1].tokens * 3, ref[1].handle, weights=ref[1].weights),
                                      nccl.combine(ref[2].tokens, ref[2].handle)]
    return all(torch.equal(a, b) for a, b in zip(got, want))


@needs_engine
def test_async_micro_batches_waited_out_of_order(worlds):
    routing = make_routing(WORLD, 16, 8, [3000, 2500], "random", seed=9)
    xs, ws = _inputs(routing, 1024, torch.bfloat16, seed=4)
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], ws[r].float(), config) for r in range(WORLD)]
    assert all(worlds(WORLD).run(_async_out_of_order, args))


# -- a dispatch with no host read (max_rows) ----------------------------------


def _bounded_against_host_read(x, topk_idx, topk_weights, config, pad):
    """One dispatcher reading the counts on the host, one with max_rows = N + pad
    (on an engine of its own, so that its first call sizes the buffers): the
    first N rows, the combine and both gradients bitwise equal, the rest zero."""
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    got = {}
    for name, extra in (("host", {}), ("bounded", {"sm_budget": 64})):
        d = dispatch.create(dispatch.DispatchConfig.from_options(**config, **extra, transport="nvlink"))
        xx, ww = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()
        bound = None if name == "host" else got["host"]["n"] + pad
        out = d.dispatch(xx, topk_idx, ww, max_rows=bound)
        y = out.tokens * 1.5 + out.tokens * out.tokens * 0.125
        combined = d.combine(y, out.handle, weights=out.weights)
        combined.float().square().sum().backward()
        d.check()
        got[name] = dict(n=out.tokens.shape[0], tokens=out.tokens.detach(), weights=out.weights.detach(),
                         src_rank=out.src_rank, src_token=out.src_token, per_expert=out.tokens_per_expert,
                         combined=combined.detach(), grad_x=xx.grad, grad_w=ww.grad,
                         host=out.tokens_per_expert_host, stats=out.stats)
    host, bounded, n = got["host"], got["bounded"], got["host"]["n"]
    checks = [
        bounded["n"] == n + pad, bounded["host"] is None, bounded["stats"] is None,
        torch.equal(bounded["per_expert"], host["per_expert"]),
        torch.equal(bounded["combined"], host["combined"]),
        torch.equal(bounded["grad_x"], host["grad_x"]), torch.equal(bounded["grad_w"], host["grad_w"]),
    ]
    for key, filler in (("tokens", 0), ("weights", 0), ("src_rank", -1), ("src_token", -1)):
        checks += [torch.equal(bounded[key][:n], host[key]), bool((bounded[key][n:] == filler).all())]
    return checks


@needs_engine
@pytest.mark.parametrize("mode, per_rank, topk, tokens, pad", [
    ("random", 4, 4, [96, 80], 17), ("one_rank", 4, 3, [64, 64], 0), ("random", 16, 8, [200, 0], 300),
])
@pytest.mark.parametrize("dtype, wire", [(torch.bfloat16, "native"), (torch.bfloat16, "fp8"),
                                         (torch.float32, "bf16")])
def test_max_rows_matches_the_host_read(worlds, mode, per_rank, topk, tokens, pad, dtype, wire):
    routing = make_routing(WORLD, per_rank, topk, tokens, mode, seed=pad)
    xs, ws = _inputs(routing, 256, dtype, seed=pad)
    config = dict(num_experts=routing.num_experts, dispatch_wire=wire)
    for rank, checks in enumerate(_run(worlds, _bounded_against_host_read, routing, xs, ws, config, pad)):
        assert all(checks), (rank, checks)


def _fresh_inputs(experts, tokens, hidden, topk, seed):
    """A function drawing this rank's next (x bf16, topk_idx, topk_weights, an
    output gradient) from its own seeded generator."""
    gen = torch.Generator().manual_seed(seed + torch.distributed.get_rank())

    def fresh():
        idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])
        return (torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16), idx,
                torch.rand(tokens, topk, generator=gen), torch.randn(tokens, hidden, generator=gen))

    return fresh


def _graph_replays(config, tokens, hidden, topk, max_rows, replays, seed):
    """A round trip with max_rows captured in a CUDA graph once, replayed with a
    new routing and new rows each time: each replay equals an NCCL round trip."""
    from world import current_device

    device = current_device()
    fresh = _fresh_inputs(config["num_experts"], tokens, hidden, topk, seed)
    static = [t.to(device) for t in fresh()[:3]]
    engine = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", sm_budget=48))
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    with torch.no_grad():
        out = engine.dispatch(*static, max_rows=max_rows)  # eager: sizes the buffers, compiles the kernels
        engine.combine(out.tokens * 2, out.handle, weights=out.weights)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = engine.dispatch(*static, max_rows=max_rows)
            y = engine.combine(out.tokens * 2, out.handle, weights=out.weights)
        wrong = 0
        for _ in range(replays):
            for s, t in zip(static, fresh()):
                s.copy_(t)
            graph.replay()
            ref = nccl.dispatch(*static)
            want = nccl.combine(ref.tokens * 2, ref.handle, weights=ref.weights)
            n = ref.tokens.shape[0]
            same = (torch.equal(out.tokens[:n], ref.tokens) and bool((out.tokens[n:] == 0).all())
                    and torch.equal(out.src_token[:n], ref.src_token) and torch.equal(y, want)
                    and torch.equal(out.tokens_per_expert, ref.tokens_per_expert))
            wrong += not same
        engine.check()
    return wrong


@needs_engine
def test_graph_capture_and_replay_with_max_rows(worlds):
    config = dict(num_experts=16)
    args = [(config, 300, 512, 4, 300 * 4 * 2, 1000, 3)] * WORLD  # 1,000 replays, each checked
    assert worlds(WORLD).run(_graph_replays, args) == [0, 0]


def _graph_setup(config, tokens, hidden, topk, seed):
    """(the input generator, this rank's first x and topk_weights requiring grad with
    topk_idx and an output gradient, the engine, an NCCL dispatcher) for the graph
    tests of a forward and backward."""
    from world import current_device

    device = current_device()
    fresh = _fresh_inputs(config["num_experts"], tokens, hidden, topk, seed)
    x, idx, w, grad = (t.to(device) for t in fresh())
    x.requires_grad_()
    w.requires_grad_()
    engine = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", sm_budget=40))
    nccl = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nccl"))
    return fresh, (x, idx, w, grad), engine, nccl


def _captured_replays(step, reset, inputs, fresh, replays: int, same) -> int:
    """``step()`` run twice eagerly (buffers sized, kernels compiled), then captured
    in a CUDA graph, each after ``reset()``; the graph replayed ``replays`` times,
    each with new values of ``inputs`` from ``fresh()``: how many replays' outputs
    ``same(out)`` rejects."""
    for _ in range(2):
        reset()
        step()
    torch.cuda.synchronize()
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    wrong = 0
    for _ in range(replays):
        for s, t in zip(inputs, fresh()):
            s.copy_(t)
        graph.replay()
        wrong += not same(out)
    return wrong


def _round_trip(d, idx, x, w, bound):
    """A round trip with max_rows ``bound`` around a smooth nonlinear stand-in for experts."""
    out = d.dispatch(x, idx, w, max_rows=bound)
    y = out.tokens * 1.5 + out.tokens * out.tokens * 0.125
    return d.combine(y, out.handle, weights=out.weights)


def _equals_nccl(nccl, idx, x, w, grad, h) -> bool:
    """Whether ``h`` and the gradients in x.grad, w.grad (of sum(h * grad)) equal an
    NCCL round trip's on the same values, bitwise."""
    xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = _round_trip(nccl, idx, xr, wr, None)
    (want.float() * grad).sum().backward()
    return torch.equal(h, want) and torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)


def _graph_backward(config, tokens, hidden, topk, max_rows, replays, seed):
    """Forward and backward of a round trip with max_rows captured in one CUDA
    graph, replayed with new rows, routings, weights and output gradients: the
    output and the gradients of x and topk_weights equal an NCCL round trip's."""
    fresh, (x, idx, w, grad), engine, nccl = _graph_setup(config, tokens, hidden, topk, seed)

    def step():
        h = _round_trip(engine, idx, x, w, max_rows)
        (h.float() * grad).sum().backward()
        return h.detach()

    def reset():
        x.grad = w.grad = None

    wrong = _captured_replays(step, reset, (x.detach(), idx, w.detach(), grad), fresh, replays,
                              lambda h: _equals_nccl(nccl, idx, x, w, grad, h))
    engine.check()
    return wrong


@needs_engine
def test_graph_capture_of_forward_and_backward(worlds):
    config = dict(num_experts=8)
    args = [(config, 200, 256, 2, 200 * 2 * 2, 20, 5)] * WORLD
    assert worlds(WORLD).run(_graph_backward, args) == [0, 0]


def _graphed_apart(config, tokens, hidden, topk, max_rows, replays, seed):
    """A round trip with max_rows whose forward and backward are captured as two
    graphs (``torch.cuda.make_graphed_callables``, as Megatron's local graphs do a
    layer's): the backward's capture must not wait for the forward capture's work
    (a capture may not wait for another's events). Each replay equals an NCCL
    round trip, output and gradients."""
    fresh, (x, idx, w, grad), engine, nccl = _graph_setup(config, tokens, hidden, topk, seed)
    _round_trip(engine, idx, x, w, max_rows).sum().backward()  # eager: sizes the buffers, compiles the kernels
    torch.cuda.synchronize()
    graphed = torch.cuda.make_graphed_callables(lambda x, w: _round_trip(engine, idx, x, w, max_rows), (x, w))
    wrong = 0
    for _ in range(replays):
        for s, t in zip((x.detach(), idx, w.detach(), grad), fresh()):
            s.copy_(t)
        x.grad = w.grad = None
        h = graphed(x, w)
        (h.float() * grad).sum().backward()
        wrong += not _equals_nccl(nccl, idx, x, w, grad, h)
    engine.check()
    return wrong


@needs_engine
def test_forward_and_backward_captured_apart(worlds):
    config = dict(num_experts=8)
    args = [(config, 200, 256, 2, 200 * 2 * 2, 10, 7)] * WORLD
    assert worlds(WORLD).run(_graphed_apart, args) == [0, 0]


def _layer_graph(config, tokens, hidden, topk, max_rows, replays, seed):
    """MoEExchange(max_rows=M) over the engine with GroupedExperts, forward and
    backward captured in one CUDA graph and replayed with new rows, routings,
    weights and output gradients: the output and every gradient (x, topk_weights,
    the experts' weights) equal the same layer's over NCCL, whose max_rows gives the
    experts the same M rows."""
    fresh, (x, idx, w, grad), engine, nccl = _graph_setup(config, tokens, hidden, topk, seed)
    torch.manual_seed(seed)
    experts = dispatch.experts.GroupedExperts(engine.num_local_experts, hidden, 2 * hidden, dtype=torch.bfloat16,
                                              device=x.device)
    twin = copy.deepcopy(experts)
    layer = dispatch.MoEExchange(engine, experts, max_rows=max_rows)
    reference = dispatch.MoEExchange(nccl, twin, max_rows=max_rows)
    wrong = _layer_replays(layer, reference, (x, idx, w, grad), fresh, replays)
    engine.check()
    return wrong


def _layer_replays(layer, reference, inputs, fresh, replays: int) -> int:
    """``layer``'s forward and backward (x, topk_weights requiring grad) captured
    and replayed with new ``inputs`` (``_captured_replays``): how many replays'
    output or gradients (x, topk_weights, the experts' parameters) differ from
    an eager run of ``reference`` (a layer with twin experts)."""
    x, idx, w, grad = inputs
    experts, twin = layer.experts, reference.experts

    def step(layer, x, w):
        h = layer(x, idx, w)
        (h.float() * grad).sum().backward()
        return h.detach()

    def reset():
        x.grad = w.grad = None
        experts.zero_grad(set_to_none=True)

    def same(h):
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        twin.zero_grad(set_to_none=True)
        want = step(reference, xr, wr)
        return (torch.equal(h, want) and torch.equal(x.grad, xr.grad) and torch.equal(w.grad, wr.grad)
                and all(torch.equal(a.grad, b.grad) for a, b in zip(experts.parameters(), twin.parameters())))

    return _captured_replays(lambda: step(layer, x, w), reset, (x.detach(), idx, w.detach(), grad), fresh, replays,
                             same)


@needs_engine
def test_layer_with_max_rows_in_a_cuda_graph(worlds):
    config = dict(num_experts=8)
    args = [(config, 200, 256, 2, 200 * 2 * 2, 10, 9)] * WORLD
    assert worlds(WORLD).run(_layer_graph, args) == [0, 0]


def _over_budget(x, topk_idx, topk_weights, config):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=5.0))
    bound = 1 if torch.distributed.get_rank() == 0 else 10**6
    messages = []
    out = d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device), max_rows=bound)
    d.combine(out.tokens, out.handle, weights=out.weights)  # skipped on the device, no hang
    for call in (d.check, lambda: d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device),
                                             max_rows=bound)):
        try:
            call()
            torch.cuda.synchronize()
            d.check()
        except RuntimeError as exc:
            messages.append(str(exc))
    return messages


def _group_over_bound(x, topk_idx, topk_weights, config):
    """A dispatch by 2 groups whose max_rows leaves a rank's fullest group one row
    short, though its N fits (all its rows in one group): every rank's check
    raises (its message, in a list), and the failed dispatch gives the experts
    no rows (counts zero: nothing sized by them runs past the bound)."""
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=5.0))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    bounds = d.dispatch(x, topk_idx, topk_weights, groups=2).handle.group_rows
    fullest = max(bounds[1] - bounds[0], bounds[2] - bounds[1])
    assert bounds[2] <= 2 * fullest - 2 or fullest < 2  # N within max_rows: only the group's bound is over
    bound = 2 * fullest - 2 if fullest >= 2 else 10**6
    work = d.dispatch(x, topk_idx, topk_weights, groups=2, max_rows=bound, async_op=True)
    parts = [work.wait_group(g) for g in range(2)]
    sums = d.combine_groups(work.handle, dtype=parts[0].tokens.dtype)
    for p in parts:  # skipped on the device, no hang
        sums.add(p.tokens, p.weights)
    sums.wait()
    given = [int(p.tokens_per_expert.sum()) for p in parts]
    try:
        d.check()
    except RuntimeError as exc:
        return [str(exc) if not any(given) else f"the failed dispatch gave the experts {given} rows"]
    return []


@needs_engine
@pytest.mark.parametrize("fn, mode, calls, message", [
    (_over_budget, "random", 2, "rank 0 receives more rows than its max_rows"),
    (_group_over_bound, "one_expert", 1, "receives more rows than its max_rows"),
], ids=["whole", "by groups"])
def test_a_rank_over_its_max_rows_fails_every_rank(worlds, fn, mode, calls, message):
    routing = make_routing(WORLD, 4, 2, [64, 64], mode, seed=2)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    config = dict(num_experts=routing.num_experts)
    results = _run(worlds, fn, routing, xs, ws, config)
    assert all(len(m) == calls and all(message in one for one in m) for m in results), results
    assert results[0] == results[1]  # the same failure on every rank


def _failure_raised_alike(x, topk_idx, topk_weights, config):
    """A dispatch with max_rows that fails (rank 0 over its max_rows) gives
    every rank zero rows of weight 0 and source -1, and its combine zero sums;
    the ranks go on
    dispatching, rank 1 with its GPU kept busy so that the failure reaches its
    host later than rank 0's: every rank raises at the same later dispatch
    (its number, its message), none inside an exchange its peers skip."""
    from world import current_device

    device = current_device()
    rank = torch.distributed.get_rank()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=5.0))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=1 if rank == 0 else 4096)
    home = d.combine(out.tokens + 1, out.handle, weights=out.weights)  # skipped on the device: zero sums
    torch.cuda.synchronize()
    zeroed = (bool((out.tokens == 0).all()) and bool((out.weights == 0).all()) and bool((out.src_rank == -1).all())
              and bool((out.src_token == -1).all()) and int(out.tokens_per_expert.sum()) == 0
              and bool((home == 0).all()))
    for k in range(1, 8):
        if rank == 1:
            torch.cuda._sleep(400_000_000)  # about 0.2 s of this rank's GPU before each dispatch
        try:
            d.dispatch(x, topk_idx, topk_weights, max_rows=4096)
        except RuntimeError as exc:
            return zeroed, k, str(exc)
    return zeroed, None, None


@needs_engine
def test_a_failure_is_raised_at_one_dispatch_on_every_rank(worlds):
    routing = make_routing(WORLD, 4, 2, [64, 64], "random", seed=2)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    got = _run(worlds, _failure_raised_alike, routing, xs, ws, dict(num_experts=routing.num_experts))
    assert all(zeroed for zeroed, _, _ in got), got
    assert got[0][1] is not None and got[0][1] == got[1][1], got  # the same dispatch on every rank
    assert all("rank 0 receives more rows than its max_rows" in message for _, _, message in got), got


def _padded_after_a_failure(x, topk_idx, topk_weights, config):
    """A dispatch with max_rows fails (rank 0 over its max_rows) and rank 0's
    check() raises it (rank 1 does not ask); then a pad_to_capacity dispatcher on
    the same engine: its dispatch raises on every rank, from rank 0's word in
    the agreement (rank 1 alone would go on, and wait for rank 0 until the
    timeout). Returns what each step raised (None for rank 1's check)."""
    from world import current_device

    device = current_device()
    rank = torch.distributed.get_rank()
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=5.0))
    padded = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=5.0,
                                                                  capacity_factor=1.0, pad_to_capacity=True))
    d.dispatch(x, topk_idx, topk_weights, max_rows=1 if rank == 0 else 4096)
    torch.cuda.synchronize()
    seen = []
    for step in ((d.check if rank == 0 else lambda: None), lambda: padded.dispatch(x, topk_idx, topk_weights)):
        try:
            step()
            seen.append(None)
        except RuntimeError as exc:
            seen.append(str(exc))
    return seen


@needs_engine
def test_a_padded_dispatch_after_a_failure_raises_on_every_rank(worlds):
    routing = make_routing(WORLD, 4, 2, [64, 64], "random", seed=2)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    got = _run(worlds, _padded_after_a_failure, routing, xs, ws, dict(num_experts=routing.num_experts))
    assert got[0][0] is not None and "rank 0 receives more rows than its max_rows" in got[0][0], got
    assert got[1][0] is None, got
    for _, padded in got:  # rank 0's word (or rank 1's own sight of the failure) raises on every rank
        assert padded is not None and "max_rows" in padded and "timed out" not in padded, got


def _bounded_mistakes(x, topk_idx, topk_weights, config, case):
    """One rank's mistake with max_rows on the engine, and what each rank
    raised (type, message) where, or what it got: ``mixed``, max_rows on
    rank 0 only; ``grads``, x needs its gradient on rank 0 only (no mistake:
    x's gradient there, against the host-read dispatch's); ``more``, rank 0
    with more tokens than the buffers hold, then a dispatch of every rank;
    ``capture``, the first dispatch with max_rows inside a CUDA graph capture."""
    from world import current_device

    device = current_device()
    rank = torch.distributed.get_rank()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=6.0))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    seen = []
    if case == "grads":
        grads = []
        for bound in (4096, None):
            xx = x.clone().requires_grad_(rank == 0)
            out = d.dispatch(xx, topk_idx, topk_weights, max_rows=bound)
            d.combine(out.tokens * 2, out.handle, weights=out.weights).sum().backward()
            grads.append(xx.grad)
        d.check()
        return rank != 0 or torch.equal(grads[0], grads[1])
    if case == "capture":
        d.dispatch(x, topk_idx, topk_weights)  # eager, without max_rows: the buffers grown, nothing reserved
        torch.cuda.synchronize()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        with torch.cuda.stream(stream):
            try:
                with torch.cuda.graph(graph, stream=stream):
                    d.dispatch(x, topk_idx, topk_weights, max_rows=4096)
            except RuntimeError as exc:
                seen.append(str(exc))
        return seen
    calls = [lambda: d.dispatch(x, topk_idx, topk_weights, max_rows=4096 if rank == 0 else None)]
    if case == "more":
        d.dispatch(x[:8], topk_idx[:8], topk_weights[:8], max_rows=4096)  # sizes the buffers (256 tokens)
        big = torch.cat([x] * 5)[:300], torch.cat([topk_idx] * 5)[:300], torch.cat([topk_weights] * 5)[:300]
        calls = [lambda: d.dispatch(*(big if rank == 0 else (x, topk_idx, topk_weights)), max_rows=4096),
                 lambda: d.dispatch(x, topk_idx, topk_weights, max_rows=4096)]
    for call in calls:
        try:
            call()
            torch.cuda.synchronize()
            seen.append(None)
        except (ValueError, RuntimeError) as exc:
            seen.append((type(exc).__name__, str(exc)))
    return seen


@needs_engine
@pytest.mark.parametrize("case", ["mixed", "grads", "more", "capture"])
def test_one_ranks_bounded_mistake_on_the_engine(worlds, case):
    routing = make_routing(WORLD, 4, 2, [64, 64], "random", seed=2)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    got = _run(worlds, _bounded_mistakes, routing, xs, ws, dict(num_experts=routing.num_experts), case)
    if case == "mixed":  # at the agreement, on every rank
        assert all(g[0][0] == "ValueError" and "max_rows: every rank" in g[0][1] for g in got), got
    elif case == "grads":
        assert got == [True, True], got
    elif case == "more":  # rank 0 at once; every rank at the next dispatch, where rank 0's word says so
        assert got[0][0][0] == "ValueError" and "T=300" in got[0][0][1] and got[1][0] is None, got
        assert all(g[1][0] == "RuntimeError" and "rank 0 marked its input bad" in g[1][1] for g in got), got
    else:
        assert all(len(g) == 1 and "cannot hold: run one eagerly first" in g[0] for g in got), got


def _a_route_only_its_receiver_refuses(bounded):
    """check_inputs=False: after two good round trips (their partials left in the
    buffers), rank 0 routes token 0 to rank 1's expert 3 twice, which rank 1
    alone finds as it pulls the rows. Each rank: what check() raised after the
    combine, whether the combine's output is all zeros, what the next dispatch
    raised."""
    from world import current_device

    device, rank = current_device(), torch.distributed.get_rank()
    d = dispatch.create(dispatch.DispatchConfig.from_options(num_experts=4, transport="nvlink", check_inputs=False,
                                                             timeout=20.0))
    gen = torch.Generator(device=device).manual_seed(rank)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]], device=device)
    w = torch.full((6, 2), 0.5, device=device)
    bound = 64 if bounded else None
    for _ in range(2):
        out = d.dispatch(torch.randn(6, 64, generator=gen, device=device), idx, w, max_rows=bound)
        d.combine(out.tokens, out.handle, weights=out.weights)
    d.check()
    bad = idx.clone()
    if rank == 0:
        bad[0] = torch.tensor([3, 3], device=device)
    seen = []
    try:
        out = d.dispatch(torch.randn(6, 64, generator=gen, device=device), bad, w, max_rows=bound)
        y = d.combine(out.tokens, out.handle, weights=out.weights)
        torch.cuda.synchronize()
        seen.append(bool((y == 0).all()))
        d.check()
        seen.append(None)
    except RuntimeError as exc:
        seen.append(str(exc))
    try:  # the engine is failed for good: the next dispatch itself raises, on the host
        d.dispatch(torch.randn(6, 64, generator=gen, device=device), idx, w, max_rows=bound)
        seen.append(None)
    except RuntimeError as exc:
        seen.append(str(exc))
    return seen


@needs_engine
@pytest.mark.parametrize("bounded", [True, False])
def test_a_rank_that_fails_alone_mid_exchange_fails_its_peers_combine(worlds, bounded):
    """A failure one rank alone records (a route it refuses as it pulls) after the
    counts were agreed: that rank skips its part of the combine, and its peer's
    combine must not sum what lay in the buffers from an earlier call. The peer
    gets zeros and its check() names the failed rank; every rank raises at the
    next dispatch. With or without max_rows: the host reads the counts before
    the rows move, not what the pull finds."""
    got = worlds(WORLD).run(_a_route_only_its_receiver_refuses, [(bounded,)] * WORLD)
    assert got[1][0] is True and "received a route no checked dispatch makes" in got[1][1], got
    assert "from rank 0 in the rows exchange" in got[1][1], got
    assert got[0][0] is True, got  # zeros, not the sums of stale partials
    assert "rank 1 failed" in got[0][1] and "in the combine" in got[0][1], got
    assert all(g[-1] is not None for g in got), got


def _rows_along_a_failed_dispatch(bounded):
    """check_inputs=False: rank 0 routes token 0 to rank 1's expert 3 twice,
    which rank 1 alone refuses as it pulls; then both move rows along that
    dispatch's handle (dispatch_rows), into memory that held 7s. Each rank:
    whether those rows are all zeros, and what check() raised."""
    from world import current_device

    device, rank = current_device(), torch.distributed.get_rank()
    d = dispatch.create(dispatch.DispatchConfig.from_options(num_experts=4, transport="nvlink", check_inputs=False,
                                                             timeout=20.0))
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]], device=device)
    if rank == 0:
        idx[0] = torch.tensor([3, 3], device=device)
    bound = 64 if bounded else None
    out = d.dispatch(torch.randn(6, 64, device=device), idx, torch.full((6, 2), 0.5, device=device), max_rows=bound)
    moved = torch.randn(6, 64, device=device)
    torch.cuda.synchronize()
    junk = torch.full(out.tokens.shape, 7.0, device=device)  # the block the rows' output will take
    del junk
    zeros = None
    try:
        rows = d.dispatch_rows(moved, out.handle)
        torch.cuda.synchronize()
        zeros = bool((rows == 0).all())
        d.check()
        return zeros, None
    except RuntimeError as exc:
        return zeros, str(exc)


@needs_engine
@pytest.mark.parametrize("bounded", [True, False])
def test_rows_moved_along_a_failed_dispatch_are_zeros(worlds, bounded):
    """A rank failed alone (its pull refused a route) signals its next exchange
    as failed: its peer takes nothing from it and returns zeros, not the memory
    its output was made in; the failed rank too. Both raise at check()."""
    got = worlds(WORLD).run(_rows_along_a_failed_dispatch, [(bounded,)] * WORLD)
    assert "received a route no checked dispatch makes" in got[1][1], got
    assert "rank 1 failed" in got[0][1], got
    assert got[0][0] is True and got[1][0] is True, got


def _a_failed_ranks_next_dispatch_in_a_graph():
    """check_inputs=False, a dispatch with max_rows captured in a CUDA graph (no
    host between replays): a good replay, then one where rank 0 routes token 0 to
    rank 1's expert 3 twice (rank 1 alone fails, in its pull), then a good one
    again, of new rows. Each rank: what check() raised, the seconds the last
    replay took, and whether it left the rank's data buffer (its routes, lists
    and staged rows, where its peers read them) as it was."""
    import time

    from world import current_device

    device, rank = current_device(), torch.distributed.get_rank()
    d = dispatch.create(dispatch.DispatchConfig.from_options(num_experts=4, transport="nvlink", check_inputs=False,
                                                             timeout=20.0))
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]], device=device)
    good = idx.clone()
    x, w = torch.randn(6, 64, device=device), torch.full((6, 2), 0.5, device=device)
    for _ in range(2):
        out = d.dispatch(x, idx, w, max_rows=64)
        d.combine(out.tokens, out.handle, weights=out.weights)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        d.dispatch(x, idx, w, max_rows=64)
    graph.replay()
    if rank == 0:
        idx[0] = torch.tensor([3, 3], device=device)
    graph.replay()
    idx.copy_(good)
    x.copy_(torch.randn_like(x))
    data = d.transport.engine._data
    torch.cuda.synchronize()
    before = data.clone()
    start = time.monotonic()
    graph.replay()
    torch.cuda.synchronize()
    took = time.monotonic() - start
    unchanged = torch.equal(data, before)
    try:
        d.check()
        return None, took, unchanged
    except RuntimeError as exc:
        return str(exc), took, unchanged


@needs_engine
def test_a_failed_ranks_next_counts_exchange_fails_its_peers_at_once(worlds):
    """A rank failed alone, whose host has not read it (replays of a graph): at
    its next counts exchange it still raises its flags, marked failed, so its
    peer fails there at once naming it, not after the timeout (20 s) and not on
    a stale counts row. Waiting for no peer any more, it writes none of its
    routes, lists or rows where its peers read them (a peer still reading an
    earlier epoch there would be overtaken); its peer, not failed, stages its own."""
    got = worlds(WORLD).run(_a_failed_ranks_next_dispatch_in_a_graph, [()] * WORLD)
    assert "received a route no checked dispatch makes" in got[1][0], got
    assert "rank 1 failed" in got[0][0] and "in the counts exchange" in got[0][0], got
    assert got[0][1] < 10, got
    assert got[1][2] is True and got[0][2] is False, got


class _ShortOnOneRank:
    """torch's symmetric memory, whose allocations past ``size`` bytes fail on rank 1."""

    def __init__(self, symm, size: int) -> None:
        self.symm, self.size = symm, size

    def empty(self, size, **kwargs):
        if torch.distributed.get_rank() == 1 and size > self.size:
            raise torch.OutOfMemoryError("CUDA out of memory (a test's)")
        return self.symm.empty(size, **kwargs)

    def rendezvous(self, *args):
        return self.symm.rendezvous(*args)


def test_the_words_of_a_dispatch_raise_alike_on_every_rank():
    """``Transport.dispatch_word`` and ``agreed_words`` (the engine's and
    NVSHMEM's agreement of a dispatch): what every rank's words make each rank
    raise, or the gradients some rank needs."""
    from types import SimpleNamespace

    from dispatch.transports.base import BOUNDED, FAILED, GROUPS, WEIGHTS_GRAD, X_GRAD, Transport, grads_of

    checked = []
    seen = {"failed": False}
    me = SimpleNamespace(check=lambda: checked.append(True), seen_failed=lambda bounded: seen["failed"])
    me.dispatch_word = lambda x, w, max_rows, groups=1: Transport.dispatch_word(me, x, w, max_rows, groups)
    x, w = torch.zeros(2, 4, requires_grad=True), torch.zeros(2, 2)
    assert me.dispatch_word(x, w, 8) == BOUNDED | X_GRAD
    with torch.no_grad():
        assert me.dispatch_word(x, w.requires_grad_(), None) == 0
    seen["failed"] = True
    assert me.dispatch_word(x, w, None) == X_GRAD | WEIGHTS_GRAD | FAILED
    assert me.dispatch_word(x, w, None, 3) == X_GRAD | WEIGHTS_GRAD | FAILED | 2 * GROUPS

    def agreed(*words):
        return Transport.agreed_words(me, SimpleNamespace(agreed=words, x=x, topk_weights=w, max_rows=8, groups=1))

    assert grads_of(agreed(BOUNDED | X_GRAD, BOUNDED | WEIGHTS_GRAD)) == (True, True)
    assert grads_of(agreed(BOUNDED, BOUNDED)) == (False, False) and not checked
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] found it"):
        agreed(BOUNDED, BOUNDED | FAILED)
    assert checked == [True]  # this rank's own failure first, where it has one
    with pytest.raises(ValueError, match="max_rows: every rank of the group passes one or none .rank 0: max_rows, "
                                         "rank 1: none"):
        agreed(BOUNDED | X_GRAD, X_GRAD)
    assert agreed(BOUNDED | GROUPS, BOUNDED | GROUPS | X_GRAD) == (BOUNDED | GROUPS, BOUNDED | GROUPS | X_GRAD)
    with pytest.raises(ValueError, match="groups: every rank .* same groups; got rank 0: 2, rank 1: 1, rank 2: 4"):
        agreed(X_GRAD | GROUPS, X_GRAD, 3 * GROUPS)
    assert Transport.agreed_words(me, SimpleNamespace(agreed=None, x=x, topk_weights=w, max_rows=None, groups=1)) == (
        X_GRAD | WEIGHTS_GRAD | FAILED,)


def _symmetric_allocation(short_rank, error):
    """Engine._symmetric of an engine on this world (no kernels), its
    allocation failing on ``short_rank`` (None: on none) with ``error`` (torch's
    out of memory, or the driver's as torch's symmetric memory raises it): what
    this rank raised (its type and message) and the rendezvous it made."""
    import torch.distributed as dist
    from dispatch.nvlink import Engine
    from world import current_device

    engine = object.__new__(Engine)
    engine.group, engine.world, engine.rank = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    engine.device, engine._on_nvshmem = current_device(), False
    engine._allocated = torch.zeros(engine.world + 1, dtype=torch.int32, device=engine.device)
    made = []

    class Symm:
        @staticmethod
        def empty(size, dtype, device):
            if engine.rank == short_rank:
                raise (torch.OutOfMemoryError if error == "torch" else RuntimeError)("out of memory (a test's)")
            return torch.zeros(size, dtype=dtype)

        @staticmethod
        def rendezvous(data, group):
            made.append(data.numel())

    engine._symm = Symm
    try:
        engine._symmetric(1024)
    except RuntimeError as exc:
        return (type(exc).__name__, str(exc)), made
    return None, made


@pytest.mark.parametrize("short_rank, error", [(None, None), (0, "torch"), (1, "torch"), (1, "driver")])
def test_an_allocation_is_agreed_before_its_rendezvous(worlds, short_rank, error):
    """Growing the engine's buffers is a collective (the rendezvous): a rank
    whose allocation fails tells its peers first, and every rank raises,
    naming it, instead of waiting in a rendezvous it will not make."""
    got = worlds(WORLD).run(_symmetric_allocation, [(short_rank, error)] * WORLD)
    if short_rank is None:
        assert got == [(None, [1024])] * WORLD, got
        return
    for rank, (raised, made) in enumerate(got):
        assert made == [] and raised is not None, got
        assert raised[0] == ("OutOfMemoryError" if rank == short_rank and error == "torch" else "RuntimeError"), got
        assert f"rank(s) [{short_rank}] could not allocate 1024 bytes" in raised[1], got


def _short_of_memory_on_growth(x, topk_idx, topk_weights, config):
    """The engine's buffers grow (a collective) where rank 1 cannot allocate:
    every rank raises, naming it, none waits in the rendezvous; the buffers
    stay as they were and the dispatchers go on."""
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=6.0))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    d.dispatch(x[:8], topk_idx[:8], topk_weights[:8])  # sizes the buffers: 256 tokens
    engine = d.transport.engine
    engine._symm = _ShortOnOneRank(engine._symm, engine._data.numel())
    try:
        d.dispatch(x, topk_idx, topk_weights)  # 300 tokens: the buffers grow
        raised = None
    except RuntimeError as exc:  # (torch.OutOfMemoryError is one)
        raised = type(exc).__name__, str(exc)
    engine._symm = engine._symm.symm
    out = d.dispatch(x[:200], topk_idx[:200], topk_weights[:200])
    return raised, int(out.tokens_per_expert.sum())


@needs_engine
def test_a_rank_short_of_memory_for_the_buffers_stops_every_rank(worlds):
    routing = make_routing(WORLD, 4, 2, [300, 300], "random", seed=4)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    got = _run(worlds, _short_of_memory_on_growth, routing, xs, ws, dict(num_experts=routing.num_experts))
    (one, rows_one), (two, rows_two) = got
    assert one is not None and one[0] == "RuntimeError" and "rank(s) [1] could not allocate" in one[1], got
    assert two is not None and two[0] == "OutOfMemoryError" and "rank(s) [1] could not allocate" in two[1], got
    local = routing.num_experts // WORLD  # the rows each rank's experts get of the 200 first tokens of every rank
    want = [sum(int(((idx[:200] // local == r) & (idx[:200] >= 0)).sum()) for idx in routing.topk_idx)
            for r in range(WORLD)]
    assert [rows_one, rows_two] == want, (got, want)


def _tokens_over_capacity(x, topk_idx, topk_weights, config):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=6.0))
    rank = torch.distributed.get_rank()
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    d.dispatch(x[:8], topk_idx[:8], topk_weights[:8], max_rows=4096)  # sizes the buffers (256 tokens)
    try:
        d.dispatch(x if rank == 0 else x[:8], topk_idx if rank == 0 else topk_idx[:8],
                   topk_weights if rank == 0 else topk_weights[:8], max_rows=4096)
        d.check()
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__, str(exc)
    return None


@needs_engine
def test_more_tokens_than_the_bounded_buffers_hold(worlds):
    routing = make_routing(WORLD, 4, 2, [300, 300], "random", seed=4)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    config = dict(num_experts=routing.num_experts)
    first, second = _run(worlds, _tokens_over_capacity, routing, xs, ws, config)
    assert first is not None and first[0] == "ValueError" and "T=300" in first[1], first
    assert second is not None and second[0] == "RuntimeError" and "rank 0 marked its input bad" in second[1], second


def _built_again_after_failure(x, topk_idx, topk_weights, config):
    from world import current_device

    failed = _tokens_over_capacity(x, topk_idx, topk_weights, config)  # fails the engine on every rank
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=6.0))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=4096)
    d.check()
    return failed is not None, out.tokens_per_expert.sum().item()


@needs_engine
def test_dispatchers_built_again_after_a_failure_start_afresh(worlds):
    routing = make_routing(WORLD, 4, 2, [300, 300], "random", seed=4)
    xs, ws = _inputs(routing, 64, torch.float32, seed=0)
    got = _run(worlds, _built_again_after_failure, routing, xs, ws, dict(num_experts=routing.num_experts))
    assert all(failed for failed, _ in got) and all(rows > 0 for _, rows in got), got


def _bounded_after_unbounded(x, topk_idx, topk_weights, config):
    """A dispatch without max_rows grows the buffers first (for 8 tokens); the
    first with max_rows still sizes them by agreement, from the group's
    largest T: it goes through, its rows those of the host-read dispatch."""
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=6.0))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    d.dispatch(x[:8], topk_idx[:8], topk_weights[:8])
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=4096)
    d.check()
    want = d.dispatch(x, topk_idx, topk_weights)
    n = want.tokens.shape[0]
    return torch.equal(out.tokens[:n].cpu(), want.tokens.cpu()) and bool((out.tokens[n:] == 0).all())


@needs_engine
def test_the_first_bounded_dispatch_sizes_buffers_another_grew(worlds):
    routing = make_routing(WORLD, 4, 2, [300, 280], "random", seed=6)
    xs, ws = _inputs(routing, 64, torch.float32, seed=1)
    config = dict(num_experts=routing.num_experts)
    assert _run(worlds, _bounded_after_unbounded, routing, xs, ws, config) == [True, True]


def _reserved_room(x, topk_idx, topk_weights, config):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, transport="nvlink", timeout=6.0))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    d.dispatch(x[:8], topk_idx[:8, :1], topk_weights[:8, :1], max_rows=4096)  # sizes the room: 256 tokens of K = 1
    d.reserve(x, topk_idx.shape[1])  # every rank, the same point
    out = d.dispatch(x, topk_idx, topk_weights, max_rows=4096)
    d.check()
    want = d.dispatch(x, topk_idx, topk_weights)
    n = want.tokens.shape[0]
    return (torch.equal(out.tokens[:n].cpu(), want.tokens.cpu()) and bool((out.tokens[n:] == 0).all())
            and torch.equal(out.tokens_per_expert.cpu(), want.tokens_per_expert.cpu()))


@needs_engine
def test_reserve_makes_room_that_max_rows_does_not_grow(worlds):
    """A dispatch with max_rows never grows the engine's buffers (it reads nothing on
    the host); reserve, a collective, does: more tokens of more slots then fit."""
    routing = make_routing(WORLD, 4, 3, [300, 280], "random", seed=6)
    xs, ws = _inputs(routing, 64, torch.float32, seed=1)
    assert _run(worlds, _reserved_room, routing, xs, ws, dict(num_experts=routing.num_experts)) == [True, True]


def _bounded_refused(config, bound):
    from world import current_device

    device = current_device()
    try:
        d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
        d.dispatch(torch.zeros(4, 8, device=device), torch.zeros(4, 1, dtype=torch.int64, device=device),
                   torch.ones(4, 1, device=device), max_rows=bound)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("bound, says", [(-1, "[0, 2**31)"), (2.5, "an int"), (True, "an int"),
                                         (2**31, "2**31")])
def test_max_rows_refused_by_name(worlds, bound, says):
    """max_rows not an int in range: a ValueError naming it, before any communication."""
    config = dict(num_experts=4, transport="nccl")
    for message in worlds(WORLD).run(_bounded_refused, [(config, bound)] * WORLD):
        assert message is not None and "max_rows" in message and says in message, message


def _all_to_one_rank_at_size(seed):
    """DeepSeek-V3 size (T = 4096, H = 7168, K = 8 of E = 256), every slot of every
    rank on rank 0's experts: 65,536 rows land on rank 0, none on rank 1. The
    engine's round trip equals NCCL's, with and without max_rows."""
    from world import current_device

    device = current_device()
    rank = torch.distributed.get_rank()
    gen = torch.Generator(device=device).manual_seed(seed + rank)
    tokens, hidden, experts, topk = 4096, 7168, 256, 8
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
    scores = torch.rand(tokens, experts // WORLD, generator=gen, device=device)
    idx = scores.topk(topk, dim=1).indices  # rank 0's experts only
    w = torch.rand(tokens, topk, generator=gen, device=device)
    got = {}
    for name, transport, bound in (("nccl", "nccl", None), ("engine", "nvlink", None),
                                   ("bounded", "nvlink", WORLD * tokens * topk)):
        d = dispatch.create(dispatch.DispatchConfig(num_experts=experts, transport=transport, timeout=61.0))
        out = d.dispatch(x, idx, w, max_rows=bound)
        n = int(out.tokens_per_expert.sum())
        combined = d.combine(out.tokens, out.handle, weights=out.weights)
        d.check()
        got[name] = (n, out.tokens[:n].clone(), combined)
        del out, d
    rows = got["nccl"][0]
    same = all(got[k][0] == rows and torch.equal(got[k][1], got["nccl"][1]) and torch.equal(got[k][2], got["nccl"][2])
               for k in ("engine", "bounded"))
    return rows, same


@needs_engine
def test_every_token_to_one_rank_at_deepseek_size(worlds):
    results = worlds(WORLD).run(_all_to_one_rank_at_size, [(8,)] * WORLD)
    assert results == [(WORLD * 4096 * 8, True), (0, True)], results


def _engine_rank(rank, store_file, behaviour, bounded, queue):
    """A fresh 2-GPU NCCL world on the engine (or two ranks on one shared GPU): one
    good round trip, then rank 1 dies or stops calling; rank 0 reports what its next
    dispatch (or check) raised."""
    import os
    import time

    import shared_gpu

    if shared_gpu.wanted() and torch.cuda.device_count() < WORLD:
        device = shared_gpu.init_rank(rank, WORLD, f"file://{store_file}")
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        torch.distributed.init_process_group("nccl", init_method=f"file://{store_file}", rank=rank,
                                             world_size=WORLD, device_id=device)
    d = dispatch.create(dispatch.DispatchConfig(num_experts=4, transport="nvlink", timeout=3.0))
    x = torch.randn(6, 64, device=device)
    idx = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]], device=device)
    w = torch.full((6, 2), 0.5, device=device)
    bound = 64 if bounded else None
    out = d.dispatch(x, idx, w, max_rows=bound)
    d.combine(out.tokens, out.handle)
    d.check()
    torch.cuda.synchronize()
    if rank == 1:
        if behaviour == "dies":
            os._exit(3)
        time.sleep(60)  # alive, but makes no more dispatches
        os._exit(0)
    start = time.monotonic()
    try:
        d.dispatch(x, idx, w, max_rows=bound)
        d.check()
        queue.put(("returned", "", time.monotonic() - start))
    except RuntimeError as exc:
        queue.put(("RuntimeError", str(exc), time.monotonic() - start))
    queue.close()
    queue.join_thread()
    os._exit(0)  # the group cannot be used any more: leave without tearing it down


@needs_engine
@pytest.mark.parametrize("behaviour", ["dies", "stops calling"])
@pytest.mark.parametrize("bounded", [False, True])
def test_a_peer_that_dies_or_stops_is_named_on_the_engine(behaviour, bounded):
    """Kills or stalls rank 1 of a real 2-GPU world: rank 0 raises a RuntimeError
    naming it within the timeout (at the dispatch's host read, or at check()
    after a dispatch with max_rows), and exits."""
    import multiprocessing as mp
    import os
    import tempfile

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as folder:
        store = os.path.join(folder, "store")
        procs = [ctx.Process(target=_engine_rank, args=(r, store, behaviour, bounded, queue)) for r in range(WORLD)]
        for p in procs:
            p.start()
        try:
            kind, message, elapsed = queue.get(timeout=120)
        finally:
            procs[0].join(timeout=30)
            alive = procs[0].is_alive()
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
    assert kind == "RuntimeError" and "rank 1" in message and "timed out" in message, (kind, message)
    assert elapsed < 3.0 + 10, elapsed
    assert not alive, "rank 0 did not exit"


def _short_of_memory_at_size(seed):
    """DeepSeek-V3 size, every slot on rank 0's experts (65,536 rows there), with
    rank 0's device memory filled to leave 1 GiB (the rows need ~1.9 GB): every
    rank is refused by name before any token moves (NCCL, the engine with its
    host read; with max_rows, rank 0 refuses and its peer records it); with the
    memory freed, the same dispatchers work."""
    from world import current_device

    from dispatch import free_memory

    device = current_device()
    rank = torch.distributed.get_rank()
    gen = torch.Generator(device=device).manual_seed(seed + rank)
    tokens, hidden, experts, topk = 4096, 7168, 256, 8
    x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
    idx = torch.rand(tokens, experts // WORLD, generator=gen, device=device).topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, generator=gen, device=device)
    spread = torch.rand(tokens, experts, generator=gen, device=device).topk(topk, dim=1).indices
    out = []
    for transport, bound in (("nccl", None), ("nvlink", None), ("nvlink", WORLD * tokens * topk)):
        d = dispatch.create(dispatch.DispatchConfig(num_experts=experts, transport=transport, timeout=20.0))
        warm = d.dispatch(x, spread, w, max_rows=bound)  # communicators and buffers made
        d.combine(warm.tokens, warm.handle, weights=warm.weights)
        del warm
        torch.cuda.synchronize()
        filler = None
        if rank == 0:
            torch.cuda.empty_cache()
            filler = torch.empty(free_memory.free_bytes(device) - (1 << 30), dtype=torch.uint8, device=device)
        try:
            d.dispatch(x, idx, w, max_rows=bound)
            d.check()
            refused = None
        except (ValueError, RuntimeError) as exc:
            refused = (type(exc).__name__, str(exc))
        del filler
        torch.cuda.empty_cache()
        if bound is None:  # the engine stays failed after a failure on the no-host-read path
            again = d.dispatch(x, idx, w)
            d.combine(again.tokens, again.handle, weights=again.weights)
            refused = (*refused, again.handle.num_rows) if refused else (None, None, again.handle.num_rows)
        out.append(refused)
        del d
    return out


@needs_two_gpus
def test_a_rank_short_of_memory_is_refused_at_deepseek_size(worlds):
    first, second = worlds(WORLD).run(_short_of_memory_at_size, [(3,)] * WORLD)
    rows = WORLD * 4096 * 8
    for got in (first[:2], second[:2]):  # nccl, the engine's host read: every rank names rank 0
        for kind, message, after in got:
            assert kind == "ValueError" and "free device memory" in message and "rank 0:" in message, message
            assert "rank 1" not in message, message
    assert [r[2] for r in first[:2]] == [rows, rows] and [r[2] for r in second[:2]] == [0, 0]
    assert first[2][0] == "ValueError" and "do not fit this rank's free device memory" in first[2][1], first[2]
    assert second[2][0] == "RuntimeError" and "rank 0 marked its input bad" in second[2][1], second[2]


def _padded_round_trip(x, topk_idx, topk_weights, config):
    from world import current_device

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config, capacity_factor=0.8, pad_to_capacity=True))
    xx, ww = x.to(device).requires_grad_(), topk_weights.to(device).requires_grad_()
    out = d.dispatch(xx, topk_idx.to(device), ww)
    combined = d.combine(out.tokens * 2, out.handle, weights=out.weights)
    combined.float().pow(2).sum().backward()
    return {key: value.detach().cpu() for key, value in dict(
        tokens=out.tokens, weights=out.weights, src_rank=out.src_rank, src_token=out.src_token, combined=combined,
        x_grad=xx.grad, w_grad=ww.grad).items()}


@needs_engine
def test_pad_to_capacity_matches_nccl(worlds):
    """pad_to_capacity on the engine (whose pull writes the rows' sources): the
    padded blocks, the round trip and its gradients, bitwise NCCL's."""
    routing = make_routing(WORLD, 4, 3, [90, 70], "random", seed=12)
    xs, ws = _inputs(routing, 64, torch.bfloat16, seed=3)
    got = {t: _run(worlds, _padded_round_trip, routing, xs, ws, dict(num_experts=routing.num_experts, transport=t))
           for t in ("nccl", "nvlink")}
    for r in range(WORLD):
        _equal(got["nvlink"][r], got["nccl"][r], f"rank {r}")


@needs_engine
@pytest.mark.parametrize("mode, per_rank, topk, tokens, groups, slack", [
    ("random", 8, 4, [96, 80], 3, 1.0), ("random", 8, 4, [96, 80], 3, 1.5), ("random", 6, 2, [120, 0], 2, 2.0),
    ("one_expert", 8, 2, [50, 70], 4, 1.0),
])
def test_groups_with_max_rows_on_the_engine(worlds, mode, per_rank, topk, tokens, groups, slack):
    routing = make_routing(WORLD, per_rank, topk, tokens, mode, seed=groups)
    xs, ws = _inputs(routing, 128, torch.bfloat16, seed=groups)
    config = dict(num_experts=routing.num_experts, transport="nvlink")
    for rank, ok in enumerate(_run(worlds, rank_fns.bounded_groups_verbs, routing, xs, ws, config, groups, slack)):
        assert all(ok.values()), f"rank {rank}: {ok}"


def _bounded_groups_layer(config, tokens, hidden, topk, groups, max_rows, replays, seed):
    """MoEExchange by groups with max_rows on the engine: eager, in fp64 dyadic
    data (exact sums), its output and every gradient the bits of the layer by
    groups without a bound; then, in bf16, its forward and backward captured in
    one CUDA graph and replayed with new inputs, each replay the bits of an eager
    run of a twin layer (GroupedExperts)."""
    from pipeline_fns import make_experts

    fresh, (x, idx, w, grad), engine, _ = _graph_setup(config, tokens, hidden, topk, seed)
    relu = make_experts("relu", engine.num_local_experts, hidden, torch.float64, seed)
    exact = [(t.detach().double() * 8).round() / 8 for t in (x, w, grad)]
    eager = {}
    for bound in (None, max_rows):
        experts = copy.deepcopy(relu)
        layer = dispatch.MoEExchange(engine, experts, groups=groups, max_rows=bound)
        xr, wr = exact[0].clone().requires_grad_(), exact[1].clone().requires_grad_()
        h = layer(xr, idx, wr)
        (h * exact[2]).sum().backward()
        eager[bound] = (h.detach(), xr.grad, wr.grad, *(p.grad for p in experts.parameters()))
    wrong = sum(not torch.equal(a, b) for a, b in zip(eager[None], eager[max_rows]))
    torch.manual_seed(seed)
    experts = dispatch.experts.GroupedExperts(engine.num_local_experts, hidden, 2 * hidden, dtype=torch.bfloat16,
                                              device=x.device)
    layer = dispatch.MoEExchange(engine, experts, groups=groups, max_rows=max_rows)
    reference = dispatch.MoEExchange(engine, copy.deepcopy(experts), groups=groups, max_rows=max_rows)
    wrong += _layer_replays(layer, reference, (x, idx, w, grad), fresh, replays)
    engine.check()
    return wrong


@needs_engine
def test_layer_by_groups_with_max_rows_in_a_cuda_graph(worlds):
    config = dict(num_experts=8)
    args = [(config, 200, 256, 2, 4, 200 * 2 * 2, 10, 9)] * WORLD
    assert worlds(WORLD).run(_bounded_groups_layer, args) == [0, 0]
