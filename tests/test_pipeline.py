"""MoEExchange by groups of local experts: results for every number of groups
G are bitwise those of G = 1 and of the round trip in one piece, forward and
backward, on worlds of 1-4 ranks (gloo here, NCCL on GPUs); experts that answer
empty calls in another dtype; the plan's CUDA graphs."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import dispatch
import pipeline_fns
from dispatch.pipeline import module_parameters
from reference import reference_combine, reference_dispatch
from routing import make_routing, random_tokens

LOCAL = 6  # local experts of the routings that try every G
GROUPS = list(range(1, LOCAL + 1))  # a group of one expert each at G = 6: groups without rows
HIDDEN = 4


def _run(worlds, routing, dtype, experts, group_counts, generic=False, x_grad=True, w_grad=True, seed=0,
         **options):
    world_size = routing.world_size
    xs = [random_tokens(r, t, HIDDEN, dtype, seed) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, dtype, seed + 1) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, **options)
    args = [
        (xs[r], routing.topk_idx[r], routing.topk_weights[r].to(dtype), gs[r], config, group_counts, experts,
         generic, x_grad, w_grad)
        for r in range(world_size)
    ]
    return xs, worlds(world_size).run(pipeline_fns.pipelined, args)


WEIGHING_GROUPS = (1, 2, 3, LOCAL)


def _weighing(worlds, world_size: int, dtype, tokens: list, seed: int, apart: bool = False):
    """(routing, every rank's pipeline_fns.weighing_experts results), every G checked
    bitwise against dispatch -> experts(tokens, counts, weights) -> combine(weights=None):
    forward, the rows', routing weights' and parameters' gradients."""
    routing = make_routing(world_size, LOCAL, 3, tokens[:world_size], "random", seed=seed)
    xs = [random_tokens(r, t, HIDDEN, dtype, 3) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, dtype, 4) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], gs[r], config, WEIGHING_GROUPS, apart)
            for r in range(world_size)]
    results = worlds(world_size).run(pipeline_fns.weighing_experts, args)
    for rank, result in enumerate(results):
        want = result["plain"]
        for g in WEIGHING_GROUPS:
            got = result[g]
            for key in ("out", "x", "topk_weights"):
                assert torch.equal(got[key], want[key]), f"rank {rank} G={g} {key}"
            for mine, theirs in zip(got["params"], want["params"]):
                assert torch.equal(mine, theirs), f"rank {rank} G={g} params"
    return routing, results


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_that_weigh_their_rows(worlds, world_size, dtype):
    """weighted_experts=True (Megatron's experts apply the routing weights): every G
    bitwise the unpipelined round trip; each group's call counts only that group's
    experts."""
    routing, results = _weighing(worlds, world_size, dtype, [7, 0, 5], seed=11)
    for rank, result in enumerate(results):
        for g in WEIGHING_GROUPS:
            calls = result[g]["calls"]
            bounds = dispatch.plan.expert_groups(LOCAL, g)
            assert len(calls) == g
            for counts, lo, hi in zip(calls, bounds, bounds[1:]):
                assert all(n == 0 for e, n in enumerate(counts) if not lo <= e < hi), (rank, g, counts)
        if routing.num_tokens[rank]:  # the weights' gradients came through the experts
            assert result["plain"]["topk_weights"].abs().sum() > 0


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_each_groups_backward_reaches_its_experts_weights_only(worlds, world_size):
    """Experts that hold each expert's weights apart and run every expert, empty or
    not (Megatron-Core's SequentialMLP), naming each group's (``group_parameters``):
    every G bitwise the unpipelined round trip, and each expert's weights get one
    gradient a backward, not one a group (zeros from the groups that gave it no rows)."""
    _, results = _weighing(worlds, world_size, torch.float32, [9, 0, 6], seed=5, apart=True)
    for rank, result in enumerate(results):
        assert result["plain"]["gradients"] == [2] * LOCAL  # w_in and w_out of each expert, once
        for g in WEIGHING_GROUPS:
            # each of an expert's two weights: its gradient made once by its group's
            # backward, then accumulated once into .grad (the hook sees both)
            assert result[g]["gradients"] == [4] * LOCAL, f"rank {rank} G={g}: {result[g]['gradients']}"


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["random", "sparse"])
def test_groups_bitwise_fp32(worlds, world_size, mode):
    """fp32 random data, row-wise experts: output and gradients of x and topk_weights
    are bitwise those of the round trip in one piece for every G; parameter
    gradients (sums over rows, accumulated per group) agree to rounding."""
    tokens = [7, 0, 3, 12][:world_size]  # T = 0 on a rank
    routing = make_routing(world_size, LOCAL, 3, tokens, mode, seed=world_size)
    _, results = _run(worlds, routing, torch.float32, "rowwise", ["plain", *GROUPS])
    for rank, per_g in enumerate(results):
        for groups in GROUPS:
            pipeline_fns.assert_same(per_g[groups], per_g["plain"], f"rank {rank} G={groups}", params_exact=False)


@pytest.mark.parametrize(
    "options",
    [dict(variant="allgather"), dict(variant="hierarchical", local_world_size=2),
     dict(variant="auto", local_world_size=2), dict(variant="alltoall", dispatch_wire="fp8")],
)
def test_groups_with_every_variant_and_wire(worlds, options):
    """Every variant (allgather and hierarchical through the base class's start
    hooks, which finish the exchange at once) and a compressed wire: by groups
    results are those of G = 1."""
    routing = make_routing(4, 5, 3, [9, 0, 4, 6], "random", seed=11)
    _, results = _run(worlds, routing, torch.float32, "rowwise", ["plain", 1, 3, 5], **options)
    for rank, per_g in enumerate(results):
        for groups in (1, 3, 5):
            pipeline_fns.assert_same(per_g[groups], per_g["plain"], f"{options} rank {rank} G={groups}", params_exact=False)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("experts", ["rowwise", "relu", "aliased"])
def test_groups_bitwise_exact_sums(worlds, world_size, experts):
    """fp64 dyadic data, where every sum is exact: all gradients, the experts'
    parameters' included, are bitwise those of G = 1 (GroupedExperts' relu
    included, and experts whose parameters autograd hands one gradient tensor)."""
    routing = make_routing(world_size, 4, 2, [6, 1, 0, 9][:world_size], "random", seed=7)
    xs = [(random_tokens(r, t, HIDDEN, torch.float64, 3) * 8).round() / 8 for r, t in enumerate(routing.num_tokens)]
    gs = [(random_tokens(r, t, HIDDEN, torch.float64, 4) * 8).round() / 8 for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [
        (xs[r], routing.topk_idx[r], routing.topk_weights[r], gs[r], config, ["plain", 1, 2, 3, 4], experts)
        for r in range(world_size)
    ]
    results = worlds(world_size).run(pipeline_fns.pipelined, args)
    for rank, per_g in enumerate(results):
        for groups in (1, 2, 3, 4):
            pipeline_fns.assert_same(per_g[groups], per_g["plain"], f"rank {rank} G={groups}")


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("options", [{}, {"variant": "allgather"}, {"dispatch_wire": "fp8"}])
def test_max_rows_layer(worlds, world_size, options):
    """MoEExchange(max_rows=M): the dispatch reads nothing on the host on the engine
    (here gloo stands in, with its host read, as its max_rows gives the same shapes);
    GroupedExperts take the M rows with device counts. Bitwise the round trip
    written out with max_rows, and in fp64 dyadic data (exact sums) the layer
    without a bound, parameter gradients included."""
    routing = make_routing(world_size, 4, 2, [6, 1, 0][:world_size], "random", seed=13)
    xs = [(random_tokens(r, t, HIDDEN, torch.float64, 5) * 8).round() / 8 for r, t in enumerate(routing.num_tokens)]
    gs = [(random_tokens(r, t, HIDDEN, torch.float64, 6) * 8).round() / 8 for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, **options)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], gs[r], config,
             ["plain", "plain bounded", 1, "bounded"], "relu") for r in range(world_size)]
    for rank, per_g in enumerate(worlds(world_size).run(pipeline_fns.pipelined, args)):
        assert per_g["bounded"]["rows_seen"] == per_g["plain bounded"]["rows_seen"] == [pipeline_fns.BOUND], per_g
        pipeline_fns.assert_same(per_g["bounded"], per_g["plain bounded"], f"{options} rank {rank} bounded")
        if not options.get("dispatch_wire"):  # fp8 rows are not exact: the bound may change a GEMM's rounding
            pipeline_fns.assert_same(per_g["bounded"], per_g[1], f"{options} rank {rank} bounded vs G=1")


def test_grouped_experts_with_hooks_or_own_forward_are_called(worlds):
    """GroupedExperts with a module hook, or a subclass with its own forward, are
    called once per group (the pipeline does not compute them in their place)."""
    routing = make_routing(2, 3, 2, [6, 5], "random", seed=2)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, 3) for r in range(2)]
    for hooked, counted in worlds(2).run(pipeline_fns.expert_calls, args):
        assert (hooked, counted) == (3, 3)


@pytest.mark.parametrize("kind", ["parametrized", "autocast"])
def test_parametrized_or_autocast_grouped_experts(worlds, kind):
    """A parametrized GroupedExperts, or one under autocast, goes through
    autograd group by group: its results and every gradient agree with the
    round trip in one piece (none is silently zero, nothing fails on dtypes)."""
    routing = make_routing(2, 3, 2, [7, 5], "random", seed=8)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, torch.float32, 1) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, kind) for r in range(2)]
    tol = dict(rtol=2e-2, atol=2e-2) if kind == "autocast" else {}
    for rank, per_g in enumerate(worlds(2).run(pipeline_fns.special_experts, args)):
        want_out, want_x, want_params = per_g["plain"]
        assert all(g is not None and g.abs().sum() > 0 for g in want_params)
        for groups in (1, 3):
            out, gx, params = per_g[groups]
            torch.testing.assert_close(out, want_out, **tol, msg=f"rank {rank} G={groups}: output")
            torch.testing.assert_close(gx, want_x, **tol, msg=f"rank {rank} G={groups}: x grad")
            for i, (a, b) in enumerate(zip(params, want_params)):
                torch.testing.assert_close(a, b, **tol, msg=f"rank {rank} G={groups}: parameter {i}")


@pytest.mark.parametrize("experts", ["rowwise", "swiglu"])
def test_second_backward_is_refused_clearly(worlds, experts):
    """A second backward through one forward (retain_graph) says what happened."""
    routing = make_routing(2, 2, 2, [5, 4], "random", seed=3)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, experts) for r in range(2)]
    for message in worlds(2).run(pipeline_fns.backward_twice, args):
        assert message is not None and "second time" in message


@pytest.mark.parametrize("world_size", [2, 3])
def test_output_matches_dense_reference(worlds, world_size):
    """G = 3 against the dense single-process reference (identity-like row-wise experts)."""
    routing = make_routing(world_size, 3, 2, [5, 2, 8][:world_size], "random", seed=11)
    xs, results = _run(worlds, routing, torch.float64, "rowwise", [3])
    ref = reference_dispatch(xs, routing.topk_idx, routing.topk_weights, routing.num_experts)
    ys = []
    for rank, d in enumerate(ref):
        experts = pipeline_fns.RowwiseExperts(routing.num_experts // world_size, HIDDEN, torch.float64, seed=rank)
        ys.append(experts(d.tokens, d.tokens_per_expert).detach())
    want = reference_combine(ys, ref, routing.num_tokens, weights=[d.weights for d in ref])
    for rank in range(world_size):
        torch.testing.assert_close(results[rank][3]["out"], want[rank], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pow2", [False, True])
def test_wire_formats_match_plain(worlds, pow2):
    """fp8 dispatch and e5m2 gradients with and without power-of-two scales: the
    pipeline encodes every direction exactly as dispatch/combine do (rows are
    quantized one by one, so groups change no bit)."""
    routing = make_routing(2, 3, 2, [7, 5], "random", seed=6)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) * 3 for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, torch.float32, 1) * 3 for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, dispatch_wire="fp8", combine_wire="bf16",
                  combine_grad_wire="e5m2", dispatch_grad_wire="bf16", fp8_pow2_scales=pow2)
    args = [
        (xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, ["plain", 1, 3], "rowwise")
        for r in range(2)
    ]
    for rank, per_g in enumerate(worlds(2).run(pipeline_fns.pipelined, args)):
        for groups in (1, 3):
            pipeline_fns.assert_same(per_g[groups], per_g["plain"], f"rank {rank} G={groups}", params_exact=False)


@pytest.mark.parametrize("world_size", [2, 3])
def test_exchanges_finished_on_start_match_in_flight(worlds, world_size):
    """The base class's start hooks (each exchange finished when started) give
    the bits of the alltoall variant's, whose collectives stay in flight."""
    routing = make_routing(world_size, 4, 2, [9, 4, 0][:world_size], "sparse", seed=5)
    _, native = _run(worlds, routing, torch.float32, "rowwise", [1, 4])
    _, generic = _run(worlds, routing, torch.float32, "rowwise", [1, 4], generic=True)
    for rank in range(world_size):
        for groups in (1, 4):
            pipeline_fns.assert_same(generic[rank][groups], native[rank][groups], f"rank {rank} G={groups}")


def test_gradients_only_where_asked(worlds):
    """Ranks that need different gradients (peer exchanges still run everywhere)."""
    routing = make_routing(2, 3, 2, [4, 5], "random", seed=3)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, torch.float32, 1) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [
        (xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, ["plain", 3], "rowwise",
         False, r == 0, r == 1)
        for r in range(2)
    ]
    results = worlds(2).run(pipeline_fns.pipelined, args)
    for rank, per_g in enumerate(results):
        pipeline_fns.assert_same(per_g[3], per_g["plain"], f"rank {rank}", params_exact=False)
    assert results[0][3]["topk_weights"] is None and results[1][3]["x"] is None


def test_no_grad_forward(worlds):
    routing = make_routing(2, 4, 2, [6, 3], "random", seed=2)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, 4) for r in range(2)]
    got = worlds(2).run(pipeline_fns.pipelined_no_grad, args)
    args1 = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, 1) for r in range(2)]
    want = worlds(2).run(pipeline_fns.pipelined_no_grad, args1)
    for (h, requires), (h1, _) in zip(got, want):
        assert torch.equal(h, h1) and not requires


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams are a CUDA matter")
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_late_streams_change_nothing(worlds, world_size):
    """CUDA: with every pipelined all-to-all made late on the communication stream
    and the experts made late (and churning the allocator) on the compute stream,
    forward and backward still give the plain round trip's bits, and so does a
    forward without grad: every cross-stream use waits on an event, and no buffer
    is handed out again while the other stream still reads it."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    routing = make_routing(world_size, 4, 2, [300, 0, 41, 257][:world_size], "random", seed=13)
    xs = [random_tokens(r, t, 64, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, 64, torch.float32, 1) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, ["plain", 1, 3, 4],
             "rowwise", False, True, True, True) for r in range(world_size)]
    for rank, per_g in enumerate(worlds(world_size).run(pipeline_fns.pipelined, args)):
        for groups in (1, 3, 4):
            pipeline_fns.assert_same(per_g[groups], per_g["plain"], f"rank {rank} G={groups}", params_exact=False)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, 4, True) for r in range(world_size)]
    late = worlds(world_size).run(pipeline_fns.pipelined_no_grad, args)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, 1) for r in range(world_size)]
    for (h, _), (h1, _) in zip(late, worlds(world_size).run(pipeline_fns.pipelined_no_grad, args)):
        assert torch.equal(h, h1)


def test_bad_arguments_raise():
    with pytest.raises(TypeError, match="dispatcher"):
        dispatch.MoEExchange(object(), lambda t, n: t)
    for groups in [0, 5, (1, 2), [1], None, True, "2", 2.0]:  # 5: more groups than the 4 local experts
        with pytest.raises(ValueError, match="groups"):
            dispatch.MoEExchange(_OneRank(), lambda t, n: t, groups=groups)
    for gone in ("ahead", "local_first"):
        with pytest.raises(TypeError, match=gone):
            dispatch.MoEExchange(_OneRank(), lambda t, n: t, **{gone: 1})
    with pytest.raises(TypeError, match="comm_priority"):
        dispatch.MoEExchange(_OneRank(), lambda t, n: t, comm_priority=1.5)
    with pytest.raises(TypeError, match="experts"):
        dispatch.MoEExchange(_OneRank(), 3)
    for bad in ("bf16", torch.int32):
        with pytest.raises(TypeError, match="out_dtype"):
            dispatch.MoEExchange(_OneRank(), lambda t, n: t, out_dtype=bad)
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="sm_carveout"):
            dispatch.MoEExchange(_OneRank(), lambda t, n: t, sm_carveout=bad)
    for bad in (-1, 1.5, True, "8", 2**31):
        with pytest.raises(ValueError, match="max_rows"):
            dispatch.MoEExchange(_OneRank(), lambda t, n: t, max_rows=bad)
    with pytest.raises(ValueError, match="max_rows=64 with groups=2"):
        dispatch.MoEExchange(_OneRank(), lambda t, n: t, groups=2, max_rows=64)


class _OneRank(dispatch.TokenDispatcher):
    """A dispatcher object that needs no process group, for argument checks only."""

    transport = types.SimpleNamespace(key=("alltoall", "nccl"), bounded_groups=False)

    def __init__(self) -> None:
        self.num_local_experts = 4


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_peak_memory_not_above_one_piece(worlds):
    """Peak memory of forward + backward with G = 4 (every group dispatched
    ahead) is no larger than with G = 1."""
    routing = make_routing(2, 4, 2, [2048, 2048], "random", seed=1)
    xs = [random_tokens(r, 2048, 512, torch.bfloat16, 0) for r in range(2)]
    config = dict(num_experts=routing.num_experts)
    peaks = {}
    for groups in (1, 4):
        args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, groups) for r in range(2)]
        peaks[groups] = worlds(2).run(pipeline_fns.peak_memory, args)
    for rank in range(2):
        assert peaks[4][rank] <= peaks[1][rank], f"rank {rank}: {peaks}"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_grouped_experts_bf16_on_gpus(worlds):
    """GroupedExperts (torch._grouped_mm on sm90) in bf16 over NCCL: G = 4 equals G = 1
    to bf16 rounding. Bitwise equality is not asserted: a grouped GEMM's tiling may
    depend on the group sizes, so a row's reduction order may change with the group."""
    routing = make_routing(2, 4, 2, [256, 192], "random", seed=4)
    xs = [random_tokens(r, t, 64, torch.bfloat16, 0) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, 64, torch.bfloat16, 1) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].to(torch.bfloat16), gs[r], config, [1, 4], "swiglu")
            for r in range(2)]
    for rank, per_g in enumerate(worlds(2).run(pipeline_fns.pipelined, args)):
        for name in ("out", "x", "topk_weights"):
            torch.testing.assert_close(per_g[4][name], per_g[1][name], rtol=2e-2, atol=2e-2)
        for a, b in zip(per_g[4]["params"], per_g[1]["params"]):
            # one GEMM over all groups' rows (ExpertsByGroups), but the rows'
            # activations and gradients come from group-sized bf16 GEMMs: an
            # element whose terms cancel can differ by a few bf16 steps of the
            # gradient's scale, not of its own
            a, b = a.float(), b.float()
            bound = 2**-6 * b.abs().max() + 2e-2 * b.abs()
            assert ((a - b).abs() <= bound).all(), f"rank {rank}: parameter gradient beyond bf16 rounding"


@pytest.mark.parametrize("groups", [1, 2])
def test_part_without_rows(worlds, groups):
    """Experts that answer an empty call in another dtype (fp32 under bf16
    autocast), and ranks with no rows in a group (rank 1 in both groups of
    G = 2): every rank's output is its tokens in the experts' dtype (the
    identity in bf16), as the partial sums travel in the dtype of the ranks that
    computed them (G = 1: agreed; G > 1: autocast's)."""
    xs = [random_tokens(0, 4, HIDDEN, torch.float32, 0), random_tokens(1, 3, HIDDEN, torch.float32, 0)]
    idx = [torch.tensor([[0], [1], [2], [3]]), torch.tensor([[0], [1], [0]])]  # E = 4: rank 1 routes nothing home
    ws = [torch.ones(4, 1), torch.ones(3, 1)]

    def args(g):
        return [(xs[r], idx[r], ws[r], 4, g) for r in range(2)]

    runs, plain = (worlds(2).run(pipeline_fns.empty_part_under_autocast, args(g)) for g in (groups, "plain"))
    for rank in range(2):
        out, grad = runs[rank]
        assert out.dtype == torch.bfloat16, f"rank {rank}"
        assert torch.equal(out, xs[rank].to(torch.bfloat16)), f"rank {rank}"
        assert torch.equal(grad, plain[rank][1]), f"rank {rank}: gradient of x"


def test_groups_without_rows_anywhere_first(worlds):
    """G = 4 groups of one expert where no rank has rows in group 0 and only
    rank 0 in group 1, with experts answering empty calls in fp32 under bf16
    autocast: the output is in bf16, and the tokens without an expert come out
    as zeros."""
    xs = [random_tokens(0, 4, HIDDEN, torch.float32, 2), random_tokens(1, 3, HIDDEN, torch.float32, 2)]
    idx = [torch.tensor([[-1], [1], [2], [7]]), torch.tensor([[-1], [6], [3]])]  # E = 8: experts 0 and 4 unused
    ws = [torch.ones(4, 1), torch.ones(3, 1)]
    runs = worlds(2).run(pipeline_fns.empty_part_under_autocast, [(xs[r], idx[r], ws[r], 8, 4) for r in range(2)])
    for rank in range(2):
        out, grad = runs[rank]
        routed = idx[rank] >= 0
        assert out.dtype == torch.bfloat16, f"rank {rank}"
        assert torch.equal(out, xs[rank].to(torch.bfloat16) * routed), f"rank {rank}"
        assert torch.equal(grad, torch.ones_like(grad) * routed), f"rank {rank}: gradient of x"


@pytest.mark.parametrize("variant", ["alltoall", "allgather", "hierarchical"])
def test_combine_on_rank_without_rows(worlds, variant):
    """dispatch -> experts -> combine where rank 1's experts get no row at all
    and answer the empty call in fp32 under bf16 autocast: rank 1's partial
    sums come home in the dtype its peers computed them in (bf16), not its own."""
    xs = [random_tokens(0, 3, HIDDEN, torch.float32, 1), random_tokens(1, 2, HIDDEN, torch.float32, 1)]
    idx = [torch.tensor([[0], [1], [0]]), torch.tensor([[1], [0]])]  # E = 4: experts 0, 1 on rank 0 only
    ws = [torch.ones(3, 1), torch.ones(2, 1)]
    runs = worlds(2).run(pipeline_fns.empty_part_under_autocast,
                         [(xs[r], idx[r], ws[r], 4, "plain", variant) for r in range(2)])
    for rank in range(2):
        out, grad = runs[rank]
        assert out.dtype == torch.bfloat16, f"rank {rank}"
        assert torch.equal(out, xs[rank].to(torch.bfloat16)), f"rank {rank}"
        assert torch.equal(grad, torch.ones_like(grad)), f"rank {rank}: gradient of x"


def test_combine_refuses_rows_in_different_dtypes(worlds):
    """Ranks whose rows come in different dtypes are refused on every rank,
    naming them (here where some rank has no rows, whose dtype is not theirs
    to agree with)."""
    xs = [random_tokens(r, 2, HIDDEN, torch.float32, 3) for r in range(3)]
    idx = [torch.tensor([[0], [1]]), torch.tensor([[1], [1]]), torch.tensor([[0], [1]])]  # E = 3: rank 2 gets none
    ws = [torch.ones(2, 1)] * 3
    messages = worlds(3).run(pipeline_fns.combine_in_rank_dtype, [(xs[r], idx[r], ws[r], 3) for r in range(3)])
    for message in messages:
        assert message is not None and "one floating dtype" in message
        assert "rank 0: float32" in message and "rank 1: float64" in message and "rank 2" not in message


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("groups", [1, 2])
def test_plan_graphs_in_the_pipeline(worlds, world_size, groups):
    """Three steps on one layer, each with new routing of the same shape: with
    the plan's CUDA graphs (on GPUs the second step captures, the third
    replays) the results are bitwise those without."""
    routings = [make_routing(world_size, 2, 3, [11, 4, 0][:world_size], mode, seed=40 + s)
                for s, mode in enumerate(["random", "sparse", "random"])]
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 5) for r, t in enumerate(routings[0].num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, torch.float32, 6) for r, t in enumerate(routings[0].num_tokens)]
    runs = []
    for graphs in (False, True):
        config = dict(num_experts=routings[0].num_experts, plan_graphs=graphs)
        args = [(xs[r], [(g.topk_idx[r], g.topk_weights[r].float()) for g in routings], gs[r], config, groups,
                 "rowwise") for r in range(world_size)]
        runs.append(worlds(world_size).run(pipeline_fns.repeated, args))
    for rank, (eager, replayed) in enumerate(zip(*runs)):
        for step, (a, b) in enumerate(zip(eager, replayed)):
            pipeline_fns.assert_same(b, a, f"rank {rank}, step {step}")
    for rank in range(2):  # and the steps differ: each used its own routing (rank 2 has no tokens)
        assert not torch.equal(runs[0][rank][0]["out"], runs[0][rank][1]["out"])


def test_module_parameters_is_parameters_in_order():
    """The layer's walk of its experts' parameters gives what ``parameters()`` gives,
    in its order: shared parameters and modules once, None entries skipped."""
    shared = nn.Linear(3, 3)
    model = nn.Sequential(nn.Linear(2, 3), shared, nn.ReLU(), nn.Sequential(shared, nn.Linear(3, 1, bias=False)))
    model.extra = nn.Parameter(torch.zeros(1))
    model[0].register_parameter("gone", None)
    model[3][1].weight = model[0].weight  # a parameter shared by two modules
    assert [id(p) for p in module_parameters(model)] == [id(p) for p in model.parameters()]
    assert module_parameters(nn.ReLU()) == []

    class Flat(nn.Module):  # a module that names its parameters its own way
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(2, 2)

        def parameters(self, recurse=True):
            return iter([self.inner.weight])

    flat = Flat()
    assert [id(p) for p in module_parameters(flat)] == [id(flat.inner.weight)]  # its walk: no bias

    class Hidden(nn.Sequential):  # a submodule that hides its children from the walk
        def named_modules(self, memo=None, prefix="", remove_duplicate=True):
            if memo is not None and self in memo:
                return
            if memo is not None:
                memo.add(self)
            yield prefix, self

    outer = nn.Sequential(nn.Linear(2, 2), Hidden(nn.Linear(2, 1)))
    assert [id(p) for p in module_parameters(outer)] == [id(p) for p in outer.parameters()]
    assert len(module_parameters(outer)) == 2  # the hidden Linear's are not walked


@pytest.mark.parametrize("reached", [0, 1], ids=["first reached", "last reached"])
@pytest.mark.parametrize("layer_kind", ["plain", "micro-batches", "groups 1", "groups 2"])
def test_a_parameter_no_row_reached_gets_a_zero_gradient_in_the_layers(worlds, layer_kind, reached):
    """Experts that skip an expert without rows: the layers give its parameters
    a zero gradient (as experts that run every expert give through the plain
    verbs: Megatron's SequentialMLP), the plain verbs leave their ``.grad`` None;
    the first expert's parameters unreached as the last's."""
    used, unused = [True, True], ([None, None] if layer_kind == "plain" else [False, False])
    for grads in worlds(2).run(pipeline_fns.unused_expert_grads, [(layer_kind, reached)] * 2):
        assert grads == (used + unused if reached == 0 else unused + used), grads


@pytest.mark.parametrize("w_grad", [True, False])
def test_experts_trained_where_no_x_needs_its_gradient(worlds, w_grad):
    """No rank's x needs its gradient, the experts' parameters do (GroupedExperts,
    whose weight gradients the layer forms itself), the routing weights' maybe:
    every G bitwise the plain verbs' (fp64 dyadic), every parameter's gradient there."""
    routing = make_routing(2, 4, 2, [6, 9], "random", seed=7)
    xs = [(random_tokens(r, t, HIDDEN, torch.float64, 3) * 8).round() / 8 for r, t in enumerate(routing.num_tokens)]
    gs = [(random_tokens(r, t, HIDDEN, torch.float64, 4) * 8).round() / 8 for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], gs[r], config, ["plain", 1, 2], "relu", False,
             False, w_grad) for r in range(2)]
    for rank, per_g in enumerate(worlds(2).run(pipeline_fns.pipelined, args)):
        assert per_g["plain"]["x"] is None and all(p is not None for p in per_g["plain"]["params"]), rank
        for groups in (1, 2):
            pipeline_fns.assert_same(per_g[groups], per_g["plain"], f"rank {rank} G={groups}")


@pytest.mark.parametrize("x_grad, w_grad", [(False, True), (True, False)])
def test_experts_that_weigh_their_rows_with_one_gradient_asked(worlds, x_grad, w_grad):
    """weighted_experts=True where only the routing weights' gradient is asked,
    or only x's: every G the plain round trip's bits."""
    routing = make_routing(2, LOCAL, 3, [7, 5], "random", seed=11)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 3) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, torch.float32, 4) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], gs[r], config, (1, 2), False, x_grad, w_grad)
            for r in range(2)]
    for rank, result in enumerate(worlds(2).run(pipeline_fns.weighing_experts, args)):
        want = result["plain"]
        assert (want["x"] is None) != x_grad and (want["topk_weights"] is None) != w_grad
        for g in (1, 2):
            pipeline_fns.assert_same(result[g], want, f"rank {rank} G={g}")
