"""MoEExchange(local_first=True), with C = 1 and C > 1 chunks: the own rows
computed beside the plan and the exchange, then the others' rows chunk by chunk,
give the plain round trip's results, bitwise, forward and backward, on worlds of
1-4 ranks (gloo here, NCCL on GPUs)."""

from __future__ import annotations

import pytest
import torch

import pipeline_fns
from routing import make_routing, random_tokens
from test_pipeline import HIDDEN, _run

# local_first with C chunks ("local" is C = 1); 8 is more chunks than some ranks have tokens;
# "/A": A chunks dispatched ahead instead of all
LOCAL = ["local", "local2", "local3", "local8", "local3/1", "local8/2", "local2/3", "local1:2:1", "local3:1/1"]


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("mode", ["random", "sparse"])
def test_local_first_bitwise_fp32(worlds, world_size, mode):
    """Output and gradients of x and topk_weights bitwise those of dispatch ->
    experts -> combine; parameter gradients (two calls' sums) to rounding. A rank
    with T = 0, and sparse routing where some ranks have no own rows."""
    routing = make_routing(world_size, 2, 3, [7, 0, 3, 12][:world_size], mode, seed=20 + world_size)
    _, results = _run(worlds, routing, torch.float32, "rowwise", ["plain", *LOCAL])
    for rank, per_c in enumerate(results):
        for chunks in LOCAL:
            pipeline_fns.assert_same(per_c[chunks], per_c["plain"], f"rank {rank} {chunks}", params_exact=False)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("experts", ["rowwise", "relu"])
def test_local_first_exact_sums(worlds, world_size, experts):
    """fp64 dyadic data, where every sum is exact: the experts' parameter
    gradients too are bitwise those of one call (GroupedExperts' relu included)."""
    routing = make_routing(world_size, 2, 2, [6, 1, 0, 9][:world_size], "random", seed=27)
    xs = [(random_tokens(r, t, HIDDEN, torch.float64, 3) * 8).round() / 8 for r, t in enumerate(routing.num_tokens)]
    gs = [(random_tokens(r, t, HIDDEN, torch.float64, 4) * 8).round() / 8 for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r], gs[r], config, ["plain", "local", "local3"],
             experts) for r in range(world_size)]
    for rank, per_c in enumerate(worlds(world_size).run(pipeline_fns.pipelined, args)):
        for chunks in ("local", "local3"):
            pipeline_fns.assert_same(per_c[chunks], per_c["plain"], f"rank {rank} {chunks}")


@pytest.mark.parametrize("pow2", [False, True])
def test_local_first_wire_formats(worlds, pow2):
    """fp8 dispatch, e5m2 gradients, bf16 sums: the own rows are encoded as the
    all-to-all's self block carries them, in both directions."""
    routing = make_routing(3, 2, 2, [7, 5, 6], "random", seed=26)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) * 3 for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, torch.float32, 1) * 3 for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts, dispatch_wire="fp8", combine_wire="bf16",
                  combine_grad_wire="e5m2", dispatch_grad_wire="bf16", fp8_pow2_scales=pow2)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, ["plain", "local", "local2"],
             "rowwise") for r in range(3)]
    for rank, per_c in enumerate(worlds(3).run(pipeline_fns.pipelined, args)):
        for chunks in ("local", "local2"):
            pipeline_fns.assert_same(per_c[chunks], per_c["plain"], f"rank {rank} {chunks}", params_exact=False)


def test_local_first_gradients_only_where_asked(worlds):
    """Ranks that need different gradients: each gets those it asked for, the others none."""
    routing = make_routing(2, 2, 2, [4, 5], "random", seed=23)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, torch.float32, 1) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config, ["plain", "local", "local2"],
             "rowwise", False, r == 0, r == 1) for r in range(2)]
    results = worlds(2).run(pipeline_fns.pipelined, args)
    for rank, per_c in enumerate(results):
        for chunks in ("local", "local2"):
            pipeline_fns.assert_same(per_c[chunks], per_c["plain"], f"rank {rank} {chunks}", params_exact=False)
    for chunks in ("local", "local2"):
        assert results[0][chunks]["topk_weights"] is None and results[1][chunks]["x"] is None


@pytest.mark.parametrize("chunks", ["local", "local3"])
def test_local_first_no_grad_and_second_backward(worlds, chunks):
    """Forward without grad gives C = 1's output; a second backward says what happened."""
    routing = make_routing(2, 2, 2, [6, 3], "random", seed=22)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    got = worlds(2).run(pipeline_fns.pipelined_no_grad,
                        [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, chunks) for r in range(2)])
    want = worlds(2).run(pipeline_fns.pipelined_no_grad,
                         [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, 1) for r in range(2)])
    for (h, requires), (h1, _) in zip(got, want):
        assert torch.equal(h, h1) and not requires
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, "rowwise", chunks) for r in range(2)]
    for message in worlds(2).run(pipeline_fns.backward_twice, args):
        assert message is not None and "second time" in message


@pytest.mark.skipif(not torch.cuda.is_available(), reason="streams are a CUDA matter")
@pytest.mark.parametrize("world_size", [1, 2])
def test_local_first_late_streams(worlds, world_size):
    """CUDA: every all-to-all made late on the communication stream and the
    experts made late on the compute stream change no bit: the own rows' work,
    the plan and the exchange meet only through events."""
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs")
    routing = make_routing(world_size, 2, 2, [300, 41][:world_size], "random", seed=33)
    xs = [random_tokens(r, t, 64, torch.float32, 0) for r, t in enumerate(routing.num_tokens)]
    gs = [random_tokens(r, t, 64, torch.float32, 1) for r, t in enumerate(routing.num_tokens)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), gs[r], config,
             ["plain", "local", "local3", "local3/1"], "rowwise", False, True, True, True) for r in range(world_size)]
    for rank, per_c in enumerate(worlds(world_size).run(pipeline_fns.pipelined, args)):
        for chunks in ("local", "local3", "local3/1"):
            pipeline_fns.assert_same(per_c[chunks], per_c["plain"], f"rank {rank} {chunks}", params_exact=False)


def test_local_first_bad_arguments(worlds):
    """Refused at construction, naming the argument: a non-bool, another variant."""
    (messages,) = worlds(1).run(pipeline_fns.local_first_errors, [(2,)])
    assert "local_first must be a bool" in messages[0]
    assert "alltoall variant" in messages[1]


@pytest.mark.parametrize("chunks", ["local", "local2", "local3", 2, 3])
def test_part_without_rows(worlds, chunks):
    """Experts that answer an empty call in another dtype (fp32 under bf16
    autocast), and ranks with no rows in a chunk (rank 1 in chunk 0 of C = 2)
    or with no own rows: every rank's output is its tokens in the experts'
    dtype (the identity in bf16), as the partial sums travel in the dtype of
    the ranks that computed them (an empty part used to make its rank receive
    them as fp32, giving wrong values, or raise after the dispatch)."""
    xs = [random_tokens(0, 4, HIDDEN, torch.float32, 0), random_tokens(1, 3, HIDDEN, torch.float32, 0)]
    idx = [torch.tensor([[0], [1], [2], [3]]), torch.tensor([[0], [1], [0]])]  # E = 4: rank 1 routes nothing home
    ws = [torch.ones(4, 1), torch.ones(3, 1)]
    def args(c):
        return [(xs[r], idx[r], ws[r], 4, c) for r in range(2)]

    runs, plain = (worlds(2).run(pipeline_fns.empty_part_under_autocast, args(c)) for c in (chunks, "plain"))
    for rank in range(2):
        out, grad = runs[rank]
        assert out.dtype == torch.bfloat16, f"rank {rank}"
        assert torch.equal(out, xs[rank].to(torch.bfloat16)), f"rank {rank}"
        assert torch.equal(grad, plain[rank][1]), f"rank {rank}: gradient of x"


@pytest.mark.parametrize("chunks", ["local3", 3])
def test_chunks_without_rows_anywhere_first(worlds, chunks):
    """C = 3 where no rank has rows in chunk 0 (only empty slots there) and only
    rank 0 in chunk 1, with experts answering empty calls in fp32 under bf16
    autocast: the output is made in bf16 once some rank has rows, and the tokens
    without an expert come out as zeros."""
    xs = [random_tokens(0, 4, HIDDEN, torch.float32, 2), random_tokens(1, 3, HIDDEN, torch.float32, 2)]
    idx = [torch.tensor([[-1], [-1], [0], [2]]), torch.tensor([[-1], [1], [3]])]  # E = 4
    ws = [torch.ones(4, 1), torch.ones(3, 1)]
    runs = worlds(2).run(pipeline_fns.empty_part_under_autocast, [(xs[r], idx[r], ws[r], 4, chunks) for r in range(2)])
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


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("chunks", ["local", "local2"])
def test_local_first_plan_graphs(worlds, world_size, chunks):
    """Three steps on one layer, each with new routing of the same shape: with
    the plan's CUDA graphs (on GPUs the second step captures, the third replays,
    own rows' keys included) the results are bitwise those without."""
    routings = [make_routing(world_size, 2, 3, [11, 4, 0][:world_size], mode, seed=40 + s)
                for s, mode in enumerate(["random", "sparse", "random"])]
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 5) for r, t in enumerate(routings[0].num_tokens)]
    gs = [random_tokens(r, t, HIDDEN, torch.float32, 6) for r, t in enumerate(routings[0].num_tokens)]
    runs = []
    for graphs in (False, True):
        config = dict(num_experts=routings[0].num_experts, plan_graphs=graphs)
        args = [(xs[r], [(g.topk_idx[r], g.topk_weights[r].float()) for g in routings], gs[r], config, chunks,
                 "rowwise") for r in range(world_size)]
        runs.append(worlds(world_size).run(pipeline_fns.repeated, args))
    for rank, (eager, replayed) in enumerate(zip(*runs)):
        for step, (a, b) in enumerate(zip(eager, replayed)):
            pipeline_fns.assert_same(b, a, f"rank {rank}, step {step}")
    for rank in range(2):  # and the steps differ: each used its own routing (rank 2 has no tokens)
        assert not torch.equal(runs[0][rank][0]["out"], runs[0][rank][1]["out"])


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("chunks", [1, 2])
def test_local_first_experts_failing_on_one_rank_stop_every_rank(worlds, world_size, chunks):
    """The own rows' experts raise on one rank, before the plan's first
    collective: that rank raises its error and every peer a RuntimeError naming
    it, none hangs, and the next step of the same layer works."""
    routing = make_routing(world_size, 2, 2, [6] * world_size, "random", seed=41)
    xs = [random_tokens(r, 6, 4, torch.float32, 8) for r in range(world_size)]
    config = dict(num_experts=routing.num_experts)
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), config, 1, chunks)
            for r in range(world_size)]
    results = worlds(world_size).run(pipeline_fns.local_first_one_rank_fails, args)
    for rank, (error, second) in enumerate(results):
        if rank == 1:
            assert error == ("ValueError", "these experts fail on purpose")
        else:
            assert error is not None and error[0] == "RuntimeError" and "rank(s) [1]" in error[1], error
        assert second.shape == xs[rank].shape and torch.isfinite(second).all()


def test_combine_refuses_rows_in_different_dtypes(worlds):
    """Where some rank has no rows (so the dtype is agreed), ranks whose rows
    come in different dtypes are refused on every rank, naming them."""
    xs = [random_tokens(r, 2, HIDDEN, torch.float32, 3) for r in range(3)]
    idx = [torch.tensor([[0], [1]]), torch.tensor([[1], [1]]), torch.tensor([[0], [1]])]  # E = 3: rank 2 gets none
    ws = [torch.ones(2, 1)] * 3
    messages = worlds(3).run(pipeline_fns.combine_in_rank_dtype, [(xs[r], idx[r], ws[r], 3) for r in range(3)])
    for message in messages:
        assert message is not None and "one floating dtype" in message
        assert "rank 0: torch.float32" in message and "rank 1: torch.float64" in message


@pytest.mark.parametrize("chunks", [1, 3, "3/1", "4/2", "2/4", "1/2", "local", "local3", "local3/1", "local4/2",
                                    "local2/3"])
def test_first_chunks_started_in_the_plan_and_packed_rows_dropped(worlds, chunks):
    """With ``ahead`` = A (default C; A > C is C), the first A chunks' all-to-alls
    start within the plan and are the ones the pipeline uses; chunk c + A's
    dispatch follows chunk c's combine (C dispatches and C combines in the
    forward, not one more); the backward alike, its first A dispatches issued
    by the pipeline; every packed tensor local_first holds is dropped by the
    end of its pass."""
    routing = make_routing(3, 2, 2, [7, 0, 5], "random", seed=61)
    xs = [random_tokens(r, t, HIDDEN, torch.float32, 8) for r, t in enumerate(routing.num_tokens)]
    args = [(xs[r], routing.topk_idx[r], routing.topk_weights[r].float(), routing.num_experts, chunks)
            for r in range(3)]
    name, _, ahead = str(chunks).removeprefix("local").partition("/")
    num_chunks = int(name or 1)
    ahead = min(int(ahead or num_chunks), num_chunks)
    rest = "".join("H" + ("D" if c + ahead < num_chunks else "") for c in range(num_chunks))
    for rank, (order, backward, dropped) in enumerate(worlds(3).run(pipeline_fns.starts_and_held, args)):
        assert order == "P" * ahead + rest, f"rank {rank}: all-to-alls started {order}, want {'P' * ahead + rest}"
        assert backward == "D" * ahead + rest, f"rank {rank}: backward started {backward}"
        assert dropped == ([True, True] if str(chunks).startswith("local") else []), f"rank {rank}"

