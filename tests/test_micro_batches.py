"""MoEMicroBatches: M micro-batches at once on an explicit schedule, bitwise
the layer run micro-batch by micro-batch (MoEExchange, one group), forward and
backward, with and without max_rows, on worlds of 1-3 ranks (gloo here, NCCL
on GPUs); one rank's experts raising stop every rank at once; bad arguments
named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dispatch
import pipeline_fns
from routing import make_routing, random_tokens
from shared_gpu import engine_ranks
from world import current_device

HIDDEN = 8


def _cpu(t):
    return None if t is None else t.detach().cpu()


def micro_batches_against_one_by_one(xs, idx, ws, grads, num_experts: int, max_rows, kind: str = "relu",
                                     params_tol: float | None = None, options: dict | None = None,
                                     x_grad: bool = True, w_grad: bool = True):
    """The M micro-batches through MoEMicroBatches and through MoEExchange one
    after the other (twin experts, fp64 dyadic: exact whatever the order of the
    parameters' sums): the outputs and every gradient. Returns the indices that
    differ (outputs, x's and the routing weights' gradients, then the
    parameters'); ``params_tol``: the parameters' gradients within it (relative
    to the largest), not bitwise; ``options``: the dispatcher's (wires); ``x_grad``,
    ``w_grad``: which of x and the routing weights need their gradients."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(num_experts=num_experts, **(options or {})))
    xs, idx, ws, grads = ([t.to(device) for t in ts] for ts in (xs, idx, ws, grads))
    got = {}
    for name in ("together", "one by one"):
        experts = pipeline_fns.make_experts(kind, d.num_local_experts, HIDDEN, xs[0].dtype, seed=3)
        leaves = [x.clone().requires_grad_(x_grad) for x in xs]
        weights = [w.clone().requires_grad_(w_grad) for w in ws]
        if name == "together":
            outs = dispatch.MoEMicroBatches(d, experts, max_rows=max_rows)(leaves, idx, weights)
        else:
            layer = dispatch.MoEExchange(d, experts, max_rows=max_rows)
            outs = [layer(x, i, w) for x, i, w in zip(leaves, idx, weights)]
        sum((out * g).sum() for out, g in zip(outs, grads)).backward()
        got[name] = [_cpu(o) for o in outs] + [_cpu(t.grad) for t in leaves + weights] + [
            _cpu(p.grad) for p in experts.parameters()]
    rows = 3 * len(xs)  # outputs, x's gradients, the routing weights' gradients: bitwise
    return [k for k, (a, b) in enumerate(zip(got["together"], got["one by one"]))
            if (a is None) != (b is None) or a is not None and not (torch.equal(a, b) if params_tol is None or k < rows
                    else torch.allclose(a.float(), b.float(), rtol=0, atol=params_tol * b.float().abs().max()))]


def _dyadic_args(routings, world_size: int, *rest) -> list:
    """Every rank's arguments of :func:`micro_batches_against_one_by_one` for the
    micro-batches ``routings``: fp64 dyadic tokens, output gradients and routing
    weights (exact whatever the order of the sums), then ``rest``."""
    args = []
    for r in range(world_size):
        xs = [(random_tokens(r, rt.num_tokens[r], HIDDEN, torch.float64, m) * 8).round() / 8
              for m, rt in enumerate(routings)]
        grads = [(random_tokens(r, rt.num_tokens[r], HIDDEN, torch.float64, 10 + m) * 8).round() / 8
                 for m, rt in enumerate(routings)]
        ws = [(rt.topk_weights[r].double() * 8).round() / 8 for rt in routings]
        args.append((xs, [rt.topk_idx[r] for rt in routings], ws, grads, routings[0].num_experts, *rest))
    return args


@pytest.mark.parametrize("world_size, tokens, bounded", [
    (1, [[5], [3]], False), (2, [[9, 4], [0, 7]], False), (2, [[9, 4], [6, 7], [3, 0]], True),
    (3, [[5, 0, 8], [7, 6, 2]], False),
])
def test_micro_batches_are_bitwise_the_layer_one_by_one(worlds, world_size, tokens, bounded):
    routings = [make_routing(world_size, 4, 2, t, "random", seed=s) for s, t in enumerate(tokens)]
    args = _dyadic_args(routings, world_size, 256 if bounded else None)
    assert worlds(world_size).run(micro_batches_against_one_by_one, args) == [[]] * world_size


@pytest.mark.parametrize("case", ["x's gradient alone", "the weights' alone", "the parameters' alone",
                                  "fp8 and bf16 wires"])
def test_micro_batches_with_some_gradients_or_wires_are_bitwise_the_layer(worlds, case):
    """As above where only some gradients are asked (the experts' parameters'
    always), and with wires that are not native (each backward exchange on its
    own gradient wire)."""
    routings = [make_routing(2, 4, 2, t, "random", seed=s) for s, t in enumerate([[9, 4], [0, 7]])]
    x_grad, w_grad = {"x's gradient alone": (True, False), "the weights' alone": (False, True),
                      "the parameters' alone": (False, False)}.get(case, (True, True))
    options = dict(dispatch_wire="fp8", combine_wire="bf16") if case == "fp8 and bf16 wires" else None
    args = _dyadic_args(routings, 2, None, "relu", None, options, x_grad, w_grad)
    assert worlds(2).run(micro_batches_against_one_by_one, args) == [[]] * 2


def test_parameters_autograd_hands_one_gradient_are_summed_apart(worlds):
    """Experts whose parameters autograd hands one gradient tensor (and a
    broadcast view): each parameter's gradient over the micro-batches is its
    own sum, bitwise the layer one micro-batch at a time's (fp64 dyadic)."""
    routings = [make_routing(2, 4, 2, t, "random", seed=20 + s) for s, t in enumerate([[6, 5], [4, 7], [3, 2]])]
    args = _dyadic_args(routings, 2, None, "aliased")
    assert worlds(2).run(micro_batches_against_one_by_one, args) == [[], []]


def an_output_the_loss_does_not_use(xs, idx, ws, grads, num_experts: int):
    """The micro-batches' backward where the loss uses the first output only, and
    where it uses the others times zero: whether every gradient (x's, the
    routing weights', the parameters') is bitwise the same."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts))
    xs, idx, ws, grads = ([t.to(device) for t in ts] for ts in (xs, idx, ws, grads))
    got = []
    for zeros in (False, True):
        experts = pipeline_fns.make_experts("relu", d.num_local_experts, HIDDEN, xs[0].dtype, seed=3)
        leaves = [x.clone().requires_grad_() for x in xs]
        weights = [w.clone().requires_grad_() for w in ws]
        outs = dispatch.MoEMicroBatches(d, experts)(leaves, idx, weights)
        loss = (outs[0] * grads[0]).sum() + (sum((out * 0).sum() for out in outs[1:]) if zeros else 0)
        loss.backward()
        got.append([_cpu(t.grad) for t in leaves + weights] + [_cpu(p.grad) for p in experts.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*got))


def test_an_output_the_loss_does_not_use_has_zero_gradients(worlds):
    """Micro-batches whose outputs the loss does not use: autograd hands their
    backward zeros, as if the loss used them times zero."""
    routings = [make_routing(2, 4, 2, t, "random", seed=30 + s) for s, t in enumerate([[6, 5], [4, 7], [3, 2]])]
    args = [a[:5] for a in _dyadic_args(routings, 2)]
    assert worlds(2).run(an_output_the_loss_does_not_use, args) == [True, True]


@pytest.mark.parametrize("first_empty", [False, True])
@pytest.mark.parametrize("layer_kind", ["micro-batches", "groups 1", "groups 2"])
def test_experts_reaching_parameters_they_do_not_register_are_refused(worlds, layer_kind, first_empty):
    """A plain callable closing over a module's parameters (whose gradients the
    layer's backward would not give them): refused by name on every rank, also
    where the layer's first call had no tokens (its experts' output no graph to
    check); the module itself runs, every parameter with its gradient."""
    routing = make_routing(2, 4, 2, [7, 5], "random", seed=9)
    args = [(random_tokens(r, routing.num_tokens[r], HIDDEN, torch.float32, 1), routing.topk_idx[r],
             routing.topk_weights[r].float(), layer_kind, first_empty) for r in range(2)]
    for rank, (raised, grads) in enumerate(worlds(2).run(pipeline_fns.closure_experts_refused, args)):
        assert raised is not None and raised.startswith("ValueError: experts: their output depends on a tensor "
                                                        "that requires grad"), (rank, raised)
        assert grads == [True, True], (rank, grads)


@pytest.mark.parametrize("bounded", [False, True])
def test_two_micro_batches_in_bf16_are_bitwise_the_layer_one_by_one(worlds, bounded):
    """Rounded data, GroupedExperts as MoEExchange computes them (by hand, or by
    autograd with max_rows): the outputs and the inputs' gradients are the same
    bits; the weights' gradients, one GEMM over both micro-batches' rows against
    two summed in bf16, within bf16's rounding (the fp64 case above holds them
    bitwise)."""
    routings = [make_routing(2, 4, 2, t, "random", seed=7 + s) for s, t in enumerate([[9, 6], [5, 8]])]
    args = [([random_tokens(r, rt.num_tokens[r], HIDDEN, torch.bfloat16, m) for m, rt in enumerate(routings)],
             [rt.topk_idx[r] for rt in routings], [rt.topk_weights[r].float() for rt in routings],
             [random_tokens(r, rt.num_tokens[r], HIDDEN, torch.bfloat16, 5 + m) for m, rt in enumerate(routings)],
             routings[0].num_experts, 64 if bounded else None, "gelu", 2 ** -7) for r in range(2)]
    assert worlds(2).run(micro_batches_against_one_by_one, args) == [[], []]


class _RaisingExperts(nn.Module):
    """Experts that raise on ``rank`` at micro-batch ``at`` (forward), or in its
    backward (``backward``)."""

    def __init__(self, experts, rank: int, at: int, backward: bool) -> None:
        super().__init__()
        self.experts, self.rank, self.at, self.backward_raises, self.calls = experts, rank, at, backward, 0

    def forward(self, tokens, tokens_per_expert):
        import torch.distributed as dist

        call, self.calls = self.calls, self.calls + 1
        mine = dist.get_rank() == self.rank and call == self.at
        if mine and not self.backward_raises:
            raise RuntimeError("experts failed here")
        y = self.experts(tokens, tokens_per_expert)
        return _FailBackward.apply(y) if mine else y


class _FailBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("experts' backward failed here")


def one_rank_raises(xs, idx, ws, num_experts: int, backward: bool, at: int = 1):
    """Rank 1's experts raise at micro-batch ``at`` (forward, or its backward):
    what each rank raised, and whether a round trip after it runs in step."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts))
    xs, idx, ws = ([t.to(device) for t in ts] for ts in (xs, idx, ws))
    experts = _RaisingExperts(pipeline_fns.make_experts("relu", d.num_local_experts, HIDDEN, torch.float64, 1),
                              rank=1, at=at, backward=backward)
    leaves = [x.clone().requires_grad_() for x in xs]
    try:
        outs = dispatch.MoEMicroBatches(d, experts)(leaves, idx, ws)
        sum(o.sum() for o in outs).backward()
        raised = None
    except dispatch.PeerRefused:
        raised = "PeerRefused"
    except RuntimeError as error:
        raised = str(error)
    out = d.dispatch(xs[0], idx[0], ws[0])
    home = d.combine(out.tokens, out.handle, weights=out.weights)
    return raised, home.shape == xs[0].shape


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("at", [0, 1])
def test_one_ranks_experts_raising_stop_every_rank_at_once(worlds, backward, at):
    """At micro-batch 0 (forward: before this rank has issued the other
    dispatches, which it then issues as its peers did) or 1."""
    routings = [make_routing(2, 4, 2, [6, 5], "random", seed=s) for s in range(3)]
    args = [([random_tokens(r, rt.num_tokens[r], HIDDEN, torch.float64, m) for m, rt in enumerate(routings)],
             [rt.topk_idx[r] for rt in routings], [rt.topk_weights[r].double() for rt in routings],
             routings[0].num_experts, backward, at) for r in range(2)]
    (raised0, ok0), (raised1, ok1) = worlds(2).run(one_rank_raises, args)
    assert raised0 == "PeerRefused" and "failed here" in raised1, (raised0, raised1)
    assert ok0 and ok1


def one_rank_refused(xs, idx, ws, num_experts: int, what: str):
    """Rank 1's call fails its own checks (``what``: its SM partition cannot be
    made here, or its lists of micro-batches differ in length): what each rank
    raised, in how many seconds, and whether a round trip after it runs in step."""
    import time

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts, timeout=20.0))
    xs, idx, ws = ([t.to(device) for t in ts] for ts in (xs, idx, ws))
    mine = dist.get_rank() == 1
    layer = dispatch.MoEMicroBatches(d, lambda t, n: t, sm_partition=100_000 if mine and what == "partition" else None)
    if mine and what == "lists":
        idx = idx[:1]
    start = time.monotonic()
    try:
        layer(xs, idx, ws)
        raised = None
    except dispatch.PeerRefused as error:
        raised = f"PeerRefused: {error}"
    except (TypeError, ValueError) as error:
        raised = f"{type(error).__name__}: {error}"
    took = time.monotonic() - start
    out = d.dispatch(xs[0], idx[0], ws[0])
    home = d.combine(out.tokens, out.handle, weights=out.weights)
    return raised, took, home.shape == xs[0].shape


@pytest.mark.parametrize("what", ["partition", "lists"])
def test_one_rank_failing_its_own_checks_stops_every_rank_at_once(worlds, what):
    """A rank whose SM partition cannot be made, or whose arguments fail the
    layer's own checks, refuses its first dispatch: it raises its own error
    and its peers PeerRefused there, not at the timeout; the next round trip
    runs in step."""
    routings = [make_routing(2, 4, 2, [6, 5], "random", seed=s) for s in range(2)]
    args = [([random_tokens(r, rt.num_tokens[r], HIDDEN, torch.float64, m) for m, rt in enumerate(routings)],
             [rt.topk_idx[r] for rt in routings], [rt.topk_weights[r].double() for rt in routings],
             routings[0].num_experts, what) for r in range(2)]
    (raised0, took0, ok0), (raised1, took1, ok1) = worlds(2).run(one_rank_refused, args)
    assert raised0.startswith("PeerRefused: rank(s) [1] of the group refused dispatch"), raised0
    want = "ValueError: sm_partition" if what == "partition" else "ValueError: xs, topk_idx and topk_weights"
    assert raised1.startswith(want), raised1
    assert took0 < 10 and took1 < 10, (took0, took1)
    assert ok0 and ok1


def weight_gradient_gemms(xs, idx, ws, num_experts: int, max_rows):
    """Plain GroupedExperts over the micro-batches: how many ExpertsByGroups the
    layer made and how many times it formed weight gradients (one of each:
    one GEMM a weight over every micro-batch's rows), and whether every
    parameter got a gradient."""
    from dispatch import micro_batches

    made, formed = [], []

    class Counted(micro_batches.ExpertsByGroups):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

        def weight_grads(self):
            formed.append(self)
            return super().weight_grads()

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts))
    experts = pipeline_fns.make_experts("relu", d.num_local_experts, HIDDEN, torch.float64, 2)
    real, micro_batches.ExpertsByGroups = micro_batches.ExpertsByGroups, Counted
    try:
        leaves = [x.to(device).requires_grad_() for x in xs]
        outs = dispatch.MoEMicroBatches(d, experts, max_rows=max_rows)(leaves, [i.to(device) for i in idx],
                                                                       [w.to(device) for w in ws])
        sum(o.sum() for o in outs).backward()
    finally:
        micro_batches.ExpertsByGroups = real
    return len(made), len(formed), all(p.grad is not None for p in experts.parameters())


@pytest.mark.parametrize("bounded", [False, True])
def test_plain_experts_form_their_weight_gradients_once(worlds, bounded):
    routings = [make_routing(2, 4, 2, t, "random", seed=3 + s) for s, t in enumerate([[7, 5], [4, 6], [5, 5]])]
    args = [([random_tokens(r, rt.num_tokens[r], HIDDEN, torch.float64, m) for m, rt in enumerate(routings)],
             [rt.topk_idx[r] for rt in routings], [rt.topk_weights[r].double() for rt in routings],
             routings[0].num_experts, 64 if bounded else None) for r in range(2)]
    assert worlds(2).run(weight_gradient_gemms, args) == [(1, 1, True)] * 2


def bad_arguments():
    """What each bad argument raises (type and message), on one rank."""
    d = dispatch.create(dispatch.DispatchConfig(num_experts=2))
    device = current_device()
    x, idx, w = (torch.randn(3, HIDDEN, device=device), torch.zeros(3, 1, dtype=torch.long, device=device),
                 torch.ones(3, 1, device=device))
    layer = dispatch.MoEMicroBatches(d, lambda t, n: t)
    seen = []
    for call in (lambda: dispatch.MoEMicroBatches(object(), lambda t, n: t),
                 lambda: dispatch.MoEMicroBatches(d, 3),
                 lambda: dispatch.MoEMicroBatches(d, lambda t, n: t, sm_carveout=-1),
                 lambda: dispatch.MoEMicroBatches(d, lambda t, n: t, max_rows=True),
                 lambda: dispatch.MoEMicroBatches(d, lambda t, n: t, sm_partition=0),
                 lambda: dispatch.MoEMicroBatches(d, lambda t, n: t, sm_partition=True),
                 lambda: layer(x, [idx], [w]),
                 lambda: layer([x, x], [idx], [w, w]),
                 lambda: layer([], [], [])):
        try:
            call()
            seen.append(None)
        except (TypeError, ValueError) as error:
            seen.append(f"{type(error).__name__}: {error}")
    seen.append([o.shape for o in layer([x, x[:1]], [idx, idx[:1]], [w, w[:1]])])
    if device.type == "cpu":  # an SM partition splits a GPU's SMs: refused before any exchange
        try:
            dispatch.MoEMicroBatches(d, lambda t, n: t, sm_partition=8)([x], [idx], [w])
            seen.append(None)
        except ValueError as error:
            seen.append(f"ValueError: {error}")
    return seen


def test_bad_arguments_are_named(worlds):
    (seen,) = worlds(1).run(bad_arguments)
    assert seen[0].startswith("TypeError: dispatcher") and seen[1].startswith("TypeError: experts"), seen
    assert seen[2].startswith("ValueError: sm_carveout") and seen[3].startswith("ValueError: max_rows"), seen
    assert seen[4].startswith("ValueError: sm_partition") and seen[5].startswith("ValueError: sm_partition"), seen
    assert seen[6].startswith("TypeError: xs") and seen[7].startswith("ValueError: xs, topk_idx"), seen
    assert seen[8].startswith("ValueError: xs, topk_idx"), seen
    assert seen[9] == [torch.Size([3, HIDDEN]), torch.Size([1, HIDDEN])], seen
    if len(seen) > 10:
        assert seen[10].startswith("ValueError: sm_partition splits a GPU's SMs: it needs the layer's tensors on "
                                   "CUDA"), seen


@pytest.mark.skipif(not engine_ranks(2), reason="needs 2 CUDA devices (or one shared) and CuPy")
def test_on_the_engine_the_layer_with_max_rows_is_captured(worlds):
    """Forward and backward of MoEMicroBatches with max_rows on the NVLink
    engine, captured in one CUDA graph: every replay on new values the bits of
    the layer run eagerly on them."""
    args = pipeline_fns.captured_args("nvlink", seed=23)
    for rank, differ in enumerate(worlds(2).run(pipeline_fns.micro_batches_captured, args)):
        assert differ == [], (rank, differ)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("transport, bounded", [("nccl", False), ("nvlink", False), ("nvlink", True)])
def test_on_cuda_an_sm_partition_keeps_the_bits(worlds, transport, bounded):
    """The exchange on 8 SMs split off, the experts on the rest: the bits of the
    layer on shared SMs, forward and backward, taken in turn with it both ways."""
    args = pipeline_fns.partition_args(transport, bounded, seed=21)
    for differ, wrong_streams, refused in worlds(2).run(pipeline_fns.partition_against_shared, args):
        assert differ == [] and wrong_streams == [], (differ, wrong_streams)
        assert refused.startswith("sm_partition=100000 leaves no SMs to the rest of cuda:"), refused
