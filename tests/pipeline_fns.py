"""Functions run on every rank of a test world for the pipeline tests (importable by name)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import dispatch
from dispatch import comm
from dispatch.transports.alltoall import AllToAllTransport
from dispatch.streams import Done, PendingGroups
from dispatch.experts import GroupedExperts
from world import current_device


class RowwiseExperts(nn.Module):
    """E_local elementwise experts: ``y = x * scale[e] + x * x * quad[e]``. Every
    row is computed on its own, so groups cannot change a row's bits."""

    def __init__(self, num_local_experts: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        # dyadic values: products and sums stay exact in fp64
        self.scale = nn.Parameter((torch.randint(-8, 9, (num_local_experts, hidden), generator=gen) / 8).to(dtype))
        self.quad = nn.Parameter((torch.randint(-8, 9, (num_local_experts, hidden), generator=gen) / 16).to(dtype))

    def forward(self, tokens, tokens_per_expert):
        expert = torch.repeat_interleave(
            torch.arange(len(tokens_per_expert), device=tokens.device),
            tokens_per_expert.to(tokens.device),
            output_size=tokens.shape[0],
        )
        return tokens * self.scale[expert] + tokens * tokens * self.quad[expert]


class AliasedExperts(RowwiseExperts):
    """Row-wise experts whose parameters' gradients autograd hands out shared:
    ``y = x * (scale + shift)[e] + x * x * quad[e] + x * tilt.sum()``: scale and
    shift get one tensor, tilt a broadcast view (summing into either in place
    corrupts the other, or fails)."""

    def __init__(self, num_local_experts: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__(num_local_experts, hidden, dtype, seed)
        gen = torch.Generator().manual_seed(seed + 1)
        self.shift = nn.Parameter((torch.randint(-8, 9, (num_local_experts, hidden), generator=gen) / 8).to(dtype))
        self.tilt = nn.Parameter((torch.randint(-8, 9, (hidden,), generator=gen) / 64).to(dtype))

    def forward(self, tokens, tokens_per_expert):
        expert = torch.repeat_interleave(
            torch.arange(len(tokens_per_expert), device=tokens.device),
            tokens_per_expert.to(tokens.device),
            output_size=tokens.shape[0],
        )
        return (tokens * (self.scale + self.shift)[expert] + tokens * tokens * self.quad[expert]
                + tokens * self.tilt.sum())


class FinishedOnStart(AllToAllTransport):
    """The alltoall transport with every exchange finished when it is started,
    for comparison with the ones left in flight."""

    def to_experts(self, rows, handle, codec, own=False):
        pieces = super().to_experts(rows, handle, codec, own)
        done = [pieces.finish(g) for g in range(pieces.groups)]
        return PendingGroups([None] * len(done), [lambda out=out: out for out in done])

    def to_home(self, rows, handle, weights, wire):
        return Done(super().to_home(rows, handle, weights, wire).finish())

    def slots_home(self, values, handle):
        return Done(super().slots_home(values, handle).finish())


LATE_CYCLES = 2_000_000  # about a millisecond of GPU clock


class LateExperts(nn.Module):
    """On CUDA: the experts start late on their stream and first churn the caching
    allocator with NaN-filled blocks, so that rows still read by the other stream
    and freed too early would be overwritten. Elsewhere: the experts as they are."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens, tokens_per_expert):
        if tokens.is_cuda:
            torch.cuda._sleep(LATE_CYCLES)
            for _ in range(4):
                torch.full((1 << 16,), float("nan"), device=tokens.device)
        return self.inner(tokens, tokens_per_expert)


@contextlib.contextmanager
def late_collectives(on: bool = True):
    """On CUDA: every pipelined all-to-all, and the plan's metadata all-to-all,
    starts late on the stream it is issued from (MoEExchange's communication
    stream), so that a missing event wait shows as wrong values. Elsewhere:
    nothing changes."""
    if not on or current_device().type != "cuda":
        yield
        return
    start, whole = comm.all_to_all_rows_start, comm.all_to_all_rows

    def late(exchange):
        def call(rows, send_splits, recv_splits, group, **options):
            torch.cuda._sleep(LATE_CYCLES)
            return exchange(rows, send_splits, recv_splits, group, **options)

        return call

    comm.all_to_all_rows_start, comm.all_to_all_rows = late(start), late(whole)
    try:
        yield
    finally:
        comm.all_to_all_rows_start, comm.all_to_all_rows = start, whole


def _cpu(t):
    return None if t is None else t.detach().cpu()


def make_experts(kind: str, num_local_experts: int, hidden: int, dtype: torch.dtype, seed: int):
    if kind in ("rowwise", "aliased"):
        experts = (RowwiseExperts if kind == "rowwise" else AliasedExperts)(num_local_experts, hidden, dtype, seed)
        return experts.to(current_device())
    torch.manual_seed(seed)
    experts = GroupedExperts(num_local_experts, hidden, 2 * hidden, activation=kind, dtype=dtype)
    if kind == "relu":
        with torch.no_grad():  # dyadic weights: the relu experts stay exact in fp64
            for p in experts.parameters():
                p.copy_((p * 8).round() / 8)
    return experts.to(current_device())


BOUND = 512  # max_rows of the "bounded" runs: more than any test's rank receives


def make_layer(d, experts, groups):
    """MoEExchange with ``groups`` groups; "bounded": one group, max_rows=BOUND."""
    if groups == "bounded":
        return dispatch.MoEExchange(d, experts, max_rows=BOUND)
    return dispatch.MoEExchange(d, experts, groups=groups)


def pipelined(x, topk_idx, topk_weights, grad_out, config: dict, group_counts, experts_kind: str,
              generic: bool = False, x_grad: bool = True, w_grad: bool = True, late: bool = False):
    """For each G in ``group_counts``: MoEExchange(G) forward and backward with
    fresh identical experts; G = "plain" runs dispatch -> experts -> combine
    instead, "plain bounded" the same with max_rows=BOUND, "bounded"
    MoEExchange(max_rows=BOUND).
    Returns {G: {"out", "x", "topk_weights", "params": [...]}}, all on the CPU."""
    device = current_device()
    cfg = dispatch.DispatchConfig.from_options(**config)
    d = dispatch.TokenDispatcher(cfg, None, FinishedOnStart(cfg)) if generic else dispatch.create(cfg)
    results = {}
    for groups in group_counts:
        experts = make_experts(experts_kind, d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
        if late and not str(groups).startswith("plain"):
            experts = LateExperts(experts)
        seen = []  # the rows the experts were called with, in the bounded runs (a hook: the generic path)
        if "bounded" in str(groups):
            experts.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[0]))
        xs = x.to(device).requires_grad_(x_grad)
        ws = topk_weights.to(device).requires_grad_(w_grad)
        idx = topk_idx.to(device)
        with late_collectives(late and not str(groups).startswith("plain")):
            if groups in ("plain", "plain bounded"):
                out = d.dispatch(xs, idx, ws, max_rows=BOUND if groups == "plain bounded" else None)
                y = experts(out.tokens, out.tokens_per_expert)
                h = d.combine(y, out.handle, weights=out.weights)
            else:
                h = make_layer(d, experts, groups)(xs, idx, ws)
            (h * grad_out.to(device)).sum().backward()
        results[groups] = {
            "out": _cpu(h),
            "x": _cpu(xs.grad),
            "topk_weights": _cpu(ws.grad),
            "params": [_cpu(p.grad) for p in experts.parameters()],
            "rows_seen": seen,
        }
    return results


class WeighingExperts(nn.Module):
    """E_local MLPs that weigh their rows themselves, as Megatron-Core's do:
    ``y = (relu(x @ w_in[e]) * weight) @ w_out[e]``, called ``(tokens,
    tokens_per_expert on the host, weights)``, one GEMM pair per expert over its rows."""

    def __init__(self, num_local_experts: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w_in = nn.Parameter(torch.randn(num_local_experts, hidden, 2 * hidden, generator=gen).to(dtype))
        self.w_out = nn.Parameter(torch.randn(num_local_experts, 2 * hidden, hidden, generator=gen).to(dtype))
        self.calls: list = []  # the counts of each call

    def forward(self, tokens, tokens_per_expert, weights):
        assert tokens_per_expert.device.type == "cpu", "the counts come on the host, as Megatron's experts take them"
        counts = tokens_per_expert.tolist()
        self.calls.append(counts)
        out = []
        for e, (rows, w) in enumerate(zip(tokens.split(counts), weights.split(counts))):
            if counts[e]:
                out.append(((rows @ self.w_in[e]).relu() * w.unsqueeze(1).to(rows.dtype)) @ self.w_out[e])
        return torch.cat(out) if out else tokens.new_zeros(0, self.w_out.shape[2])


class ExpertsApart(nn.Module):
    """E_local MLPs with weights of their own, each run on its rows, empty or not (as
    Megatron-Core's SequentialMLP), weighing them; names each group's parameters
    (``group_parameters``) and counts the gradients computed for each expert's."""

    def __init__(self, num_local_experts: int, hidden: int, dtype: torch.dtype, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.w_in = nn.ParameterList(
            torch.randn(hidden, 2 * hidden, generator=gen).to(dtype) for _ in range(num_local_experts))
        self.w_out = nn.ParameterList(
            torch.randn(2 * hidden, hidden, generator=gen).to(dtype) for _ in range(num_local_experts))
        self.gradients = [0] * num_local_experts  # of each expert's weights, over a backward
        for e in range(num_local_experts):
            for p in (self.w_in[e], self.w_out[e]):
                p.register_hook(lambda grad, e=e: self._count(e))

    def _count(self, e: int) -> None:
        self.gradients[e] += 1

    def forward(self, tokens, tokens_per_expert, weights):
        counts = tokens_per_expert.tolist()
        return torch.cat([((rows @ self.w_in[e]).relu() * w.unsqueeze(1).to(rows.dtype)) @ self.w_out[e]
                          for e, (rows, w) in enumerate(zip(tokens.split(counts), weights.split(counts)))])

    def group_parameters(self, first: int, end: int) -> list:
        return [p for e in range(first, end) for p in (self.w_in[e], self.w_out[e])]


def weighing_experts(x, topk_idx, topk_weights, grad_out, config: dict, group_counts, apart: bool = False,
                     x_grad: bool = True, w_grad: bool = True):
    """MoEExchange(weighted_experts=True) for each G in ``group_counts`` against
    dispatch -> experts(tokens, counts, weights) -> combine(weights=None) ("plain"),
    forward and backward; {G: {"out", "x", "topk_weights", "params", "calls"}} on the CPU."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    results = {}
    for groups in ("plain", *group_counts):
        kind = ExpertsApart if apart else WeighingExperts
        experts = kind(d.num_local_experts, x.shape[1], x.dtype, seed=d.rank).to(device)
        xs = x.to(device).requires_grad_(x_grad)
        ws = topk_weights.to(device).requires_grad_(w_grad)
        idx = topk_idx.to(device)
        if groups == "plain":
            out = d.dispatch(xs, idx, ws)
            h = d.combine(experts(out.tokens, out.tokens_per_expert_host, out.weights), out.handle, weights=None)
        else:
            h = dispatch.MoEExchange(d, experts, groups=groups, weighted_experts=True)(xs, idx, ws)
        (h * grad_out.to(device)).sum().backward()
        results[groups] = {"out": _cpu(h), "x": _cpu(xs.grad), "topk_weights": _cpu(ws.grad),
                           "params": [_cpu(p.grad) for p in experts.parameters()],
                           "calls": getattr(experts, "calls", None), "gradients": getattr(experts, "gradients", None)}
    return results


def pipelined_no_grad(x, topk_idx, topk_weights, config: dict, groups, late: bool = False):
    """Forward only, under no_grad (no expert graph kept)."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    experts = make_experts("rowwise", d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
    if late:
        experts = LateExperts(experts)
    with torch.no_grad(), late_collectives(late):
        h = make_layer(d, experts, groups)(x.to(device), topk_idx.to(device), topk_weights.to(device))
    return _cpu(h), h.requires_grad


def peak_memory(x, topk_idx, topk_weights, config: dict, groups: int):
    """Peak CUDA memory (bytes above the start) of one forward + backward."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    torch.manual_seed(0)
    experts = GroupedExperts(d.num_local_experts, x.shape[1], 4 * x.shape[1], dtype=x.dtype, device=device)
    layer = make_layer(d, experts, groups)
    xs = x.to(device).requires_grad_()
    ws = topk_weights.to(device).requires_grad_()
    idx = topk_idx.to(device)
    layer(xs, idx, ws).sum().backward()  # warm-up: streams, allocator, kernels
    xs.grad = ws.grad = None
    experts.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    layer(xs, idx, ws).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


def expert_calls(x, topk_idx, topk_weights, config: dict, groups: int):
    """Calls seen by a forward pre-hook of GroupedExperts and by a subclass's own
    forward, through one MoEExchange(groups) forward + backward each."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))

    class Counted(GroupedExperts):
        calls = 0

        def forward(self, tokens, tokens_per_expert):
            Counted.calls += 1
            return super().forward(tokens, tokens_per_expert)

    hooked = GroupedExperts(d.num_local_experts, x.shape[1], 2 * x.shape[1], dtype=x.dtype).to(device)
    seen = []
    hooked.register_forward_pre_hook(lambda module, args: seen.append(args[0].shape[0]))
    counted = Counted(d.num_local_experts, x.shape[1], 2 * x.shape[1], dtype=x.dtype).to(device)
    for experts in (hooked, counted):
        xs = x.to(device).requires_grad_()
        dispatch.MoEExchange(d, experts, groups=groups)(xs, topk_idx.to(device), topk_weights.to(device)).sum().backward()
    return len(seen), Counted.calls


def special_experts(x, topk_idx, topk_weights, grad_out, config: dict, kind: str, groups_list=(1, 3)):
    """GroupedExperts the pipeline must leave to autograd: ``kind`` "parametrized"
    (w_in through a parametrization) or "autocast" (the step under CPU/CUDA
    autocast to bf16). Returns {G or "plain": (out, x grad, [parameter grads])}."""
    from torch.nn.utils import parametrize

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    results = {}
    for groups in ("plain", *groups_list):
        torch.manual_seed(d.rank)
        experts = GroupedExperts(d.num_local_experts, x.shape[1], 2 * x.shape[1], dtype=x.dtype).to(device)
        if kind == "parametrized":
            parametrize.register_parametrization(experts, "w_in", _Doubled())
        xs = x.to(device).requires_grad_()
        idx, ws = topk_idx.to(device), topk_weights.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=kind == "autocast"):
            if groups == "plain":
                out = d.dispatch(xs, idx, ws)
                h = d.combine(experts(out.tokens, out.tokens_per_expert), out.handle, weights=out.weights)
            else:
                h = make_layer(d, experts, groups)(xs, idx, ws)
        (h.float() * grad_out.to(device)).sum().backward()
        results[groups] = (_cpu(h), _cpu(xs.grad), [_cpu(p.grad) for p in experts.parameters()])
    return results


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def backward_twice(x, topk_idx, topk_weights, config: dict, experts_kind: str, groups=2):
    """The error of a second backward through one MoEExchange forward."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    experts = make_experts(experts_kind, d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
    xs = x.to(device).requires_grad_()
    out = make_layer(d, experts, groups)(xs, topk_idx.to(device), topk_weights.to(device)).sum()
    out.backward(retain_graph=True)
    try:
        out.backward()
    except RuntimeError as exc:
        return str(exc)
    return None


def assert_same(got, want, what, params_exact=True):
    """Two results of :func:`pipelined`: output and gradients of x and topk_weights
    bitwise equal; parameter gradients bitwise (``params_exact``) or to rounding."""
    for name in ("out", "x", "topk_weights"):
        a, b = got[name], want[name]
        assert (a is None) == (b is None), f"{what}: {name} present in one run only"
        if a is not None:
            assert torch.equal(a, b), f"{what}: {name} differs (max {(a - b).abs().max()})"
    assert len(got["params"]) == len(want["params"]), f"{what}: parameters"
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        assert (a is None) == (b is None), f"{what}: gradient of parameter {i} present in one run only"
        if a is None:
            continue
        if params_exact:
            assert torch.equal(a, b), f"{what}: gradient of parameter {i} differs"
        else:
            torch.testing.assert_close(a, b, msg=f"{what}: gradient of parameter {i}")


class _EmptyInOwnDtype(nn.Module):
    """Experts that answer an empty call without computing: under autocast their
    empty output keeps the rows' dtype, their others are bf16."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(hidden))

    def forward(self, tokens, tokens_per_expert):
        if tokens.shape[0] == 0:
            return tokens.new_zeros(0, self.w.shape[1])
        return tokens @ self.w


def empty_part_under_autocast(x, topk_idx, topk_weights, num_experts: int, groups, variant: str = "alltoall"):
    """Output of a layer whose experts answer empty calls in another dtype, under
    bf16 autocast; ``groups`` "plain" runs dispatch -> experts -> combine."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts, variant=variant))
    experts = _EmptyInOwnDtype(x.shape[1]).to(device)
    xs, idx, ws = x.to(device).requires_grad_(), topk_idx.to(device), topk_weights.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        if groups == "plain":
            out = d.dispatch(xs, idx, ws)
            h = d.combine(experts(out.tokens, out.tokens_per_expert), out.handle, weights=out.weights)
        else:
            h = make_layer(d, experts, groups)(xs, idx, ws)
    h.float().sum().backward()
    return _cpu(h), _cpu(xs.grad)


def combine_in_rank_dtype(x, topk_idx, topk_weights, num_experts: int):
    """dispatch -> experts -> combine with experts whose output is fp32 on rank 0
    and fp64 elsewhere; the ValueError's message, or None if combine ran."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts))
    out = d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    try:
        d.combine(out.tokens.to(torch.float32 if d.rank == 0 else torch.float64), out.handle, weights=out.weights)
    except ValueError as exc:
        return str(exc)
    return None


def repeated(x, steps, grad_out, config: dict, groups, experts_kind: str):
    """One dispatcher and one layer, a forward and backward per (topk_idx,
    topk_weights) in ``steps`` (same shapes: on CUDA the second step captures
    the plan's graphs, later ones replay them on new routing). Returns per step
    {"out", "x", "topk_weights", "params"} on the CPU."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    experts = make_experts(experts_kind, d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
    layer = make_layer(d, experts, groups)
    results = []
    for topk_idx, topk_weights in steps:
        experts.zero_grad(set_to_none=True)
        xs = x.to(device).requires_grad_()
        ws = topk_weights.to(device).requires_grad_()
        h = layer(xs, topk_idx.to(device), ws)
        (h * grad_out.to(device)).sum().backward()
        results.append({"out": _cpu(h), "x": _cpu(xs.grad), "topk_weights": _cpu(ws.grad),
                        "params": [_cpu(p.grad) for p in experts.parameters()]})
    return results


def partition_against_shared(xs, topk_idx, topk_weights, grads, config: dict, max_rows, sm_partition: int):
    """MoEMicroBatches with plain GroupedExperts (bf16) on shared SMs, then on
    an SM partition of ``sm_partition`` SMs, then shared and on it again, queued
    one after the other with no host sync between (each side stream handed over
    to the next): the outputs and every gradient of the last three against the
    first's. Returns the runs and indices that differ, then any run whose side
    streams (the dispatcher's communication streams, the NVSHMEM exchange's)
    were not the partition's where it ran on one, and plain elsewhere, then
    what a partition of more SMs than the device has raised."""
    from dispatch import partition

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    xs, topk_idx, topk_weights, grads = ([t.to(device) for t in ts] for ts in (xs, topk_idx, topk_weights, grads))
    torch.manual_seed(5)
    experts = GroupedExperts(d.num_local_experts, xs[0].shape[1], 64, dtype=torch.bfloat16, device=device)
    if max_rows is not None:  # the bounded buffers sized for the largest micro-batch, not the first
        d.reserve(max(xs, key=len), topk_idx[0].shape[1])
    runs, wrong_streams = [], []
    exchange = getattr(d.transport, "exchange", None)
    for run, split in enumerate((None, sm_partition, None, sm_partition)):
        layer = dispatch.MoEMicroBatches(d, experts, max_rows=max_rows, sm_partition=split)
        leaves = [x.clone().requires_grad_() for x in xs]
        weights = [w.clone().requires_grad_() for w in topk_weights]
        outs = layer(leaves, topk_idx, weights)
        sum((out.float() * g.float()).sum() for out, g in zip(outs, grads)).backward()
        runs.append([t.detach().clone() for t in outs] + [t.grad for t in leaves + weights]
                    + [p.grad for p in experts.parameters()])
        experts.zero_grad(set_to_none=True)
        taken = list(d._streams._last.values()) + ([exchange._stream] if exchange is not None else [])
        if not taken or any((t.cuda_stream in partition._BY_STREAM) != (split is not None) for t in taken):
            wrong_streams.append(run)
    differ = [(run, k) for run in (1, 2, 3) for k, (a, b) in enumerate(zip(runs[run], runs[0]))
              if not torch.equal(_cpu(a), _cpu(b))]
    try:
        dispatch.MoEMicroBatches(d, experts, sm_partition=100_000)(xs, topk_idx, topk_weights)
        refused = None
    except ValueError as error:
        refused = str(error)
    return differ, wrong_streams, refused


def partition_args(transport: str, bounded: bool, seed: int) -> list:
    """Each of 2 ranks' arguments of :func:`partition_against_shared`: two
    micro-batches of bf16 rows (H = 256) routed at random to 16 experts, K = 2."""
    from routing import make_routing, random_tokens

    routings = [make_routing(2, 8, 2, t, "random", seed=seed + s) for s, t in enumerate([[40, 33], [25, 47]])]
    return [([random_tokens(r, rt.num_tokens[r], 256, torch.bfloat16, m) for m, rt in enumerate(routings)],
             [rt.topk_idx[r] for rt in routings], [rt.topk_weights[r].float() for rt in routings],
             [random_tokens(r, rt.num_tokens[r], 256, torch.bfloat16, 5 + m) for m, rt in enumerate(routings)],
             dict(num_experts=routings[0].num_experts, transport=transport), 400 if bounded else None, 8)
            for r in range(2)]


def micro_batches_captured(xs, topk_idx, topk_weights, grads, config: dict, max_rows: int, replays: int):
    """MoEMicroBatches with max_rows and plain GroupedExperts (bf16): its
    forward and backward captured in one CUDA graph, replayed on new values of
    the micro-batches' rows, routing weights and output gradients; each
    replay's outputs and gradients (every x, every topk_weights, the experts')
    against an eager run of the same layer on those values. Returns the
    replays and indices that differ."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    xs, topk_idx, topk_weights, grads = ([t.to(device) for t in ts] for ts in (xs, topk_idx, topk_weights, grads))
    torch.manual_seed(5)
    experts = GroupedExperts(d.num_local_experts, xs[0].shape[1], 64, dtype=torch.bfloat16, device=device)
    d.reserve(max(xs, key=len), topk_idx[0].shape[1])
    layer = dispatch.MoEMicroBatches(d, experts, max_rows=max_rows)
    leaves = [x.clone().requires_grad_() for x in xs]
    weights = [w.clone().requires_grad_() for w in topk_weights]
    out_grads = [g.clone() for g in grads]

    def step(xx, ww, gg):
        outs = layer(xx, topk_idx, ww)
        torch.autograd.backward(outs, gg)
        return ([o.detach() for o in outs] + [t.grad for t in (*xx, *ww)]
                + [p.grad for p in experts.parameters()])

    def reset(tensors):
        for t in (*tensors, *experts.parameters()):
            t.grad = None

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # buffers sized, kernels built, plans' graphs made
            reset(leaves + weights)
            step(leaves, weights, out_grads)
        reset(leaves + weights)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            captured = step(leaves, weights, out_grads)
    torch.cuda.current_stream().wait_stream(side)
    differ = []
    for k in range(replays):
        with torch.no_grad():
            for static, x in zip(leaves, xs):
                static.copy_(x * (k + 2))
            for static, w in zip(weights, topk_weights):
                static.copy_(w.flip(1) if k % 2 else w * 0.5)
            for static, g in zip(out_grads, grads):
                static.copy_(g * (k + 1))
        graph.replay()
        got = [t.clone() for t in captured]
        fresh = [t.detach().clone().requires_grad_() for t in leaves + weights]
        reset(())
        want = step(fresh[: len(xs)], fresh[len(xs):], out_grads)
        differ += [(k, i) for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)]
    torch.cuda.synchronize()
    d.check()
    return differ


def captured_args(transport: str, seed: int) -> list:
    """Each of 2 ranks' arguments of :func:`micro_batches_captured`: those of
    :func:`partition_args` with a bound, and 3 replays."""
    return [(*args[:6], 3) for args in partition_args(transport, True, seed)]


def closure_experts_refused(x, topk_idx, topk_weights, layer_kind: str, first_empty: bool = False):
    """Experts given as a plain callable that closes over a module's parameters
    (``lambda rows, counts: module(rows, counts)``; an empty call answered with
    zeros, no graph): what the layer (``layer_kind``: "micro-batches", or "groups
    N" for MoEExchange) raised on this rank (``first_empty``: at its second call,
    its first with no tokens on any rank), then whether the same layer over the
    module itself still runs."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=8))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    module = make_experts("rowwise", d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)

    def run(experts):
        if layer_kind == "micro-batches":
            layer = dispatch.MoEMicroBatches(d, experts)
        else:
            layer = dispatch.MoEExchange(d, experts, groups=int(layer_kind.split()[1]))
        for tokens in ((0, None) if first_empty else (None,)):
            leaf = x[:tokens].clone().requires_grad_()
            idx, w = topk_idx[:tokens], topk_weights[:tokens]
            if layer_kind == "micro-batches":
                outs = layer([leaf, leaf * 2], [idx] * 2, [w] * 2)
            else:
                outs = [layer(leaf, idx, w)]
            sum(o.sum() for o in outs).backward()
        return [p.grad is not None for p in module.parameters()]

    try:
        run(lambda rows, counts: rows.new_zeros(rows.shape) if rows.shape[0] == 0 else module(rows, counts))
        raised = None
    except (ValueError, dispatch.PeerRefused) as error:
        raised = f"{type(error).__name__}: {error}"
    return raised, run(module)


class SkipsEmpty(nn.Module):
    """One linear map per local expert; an expert without rows is not run (its
    parameters get no gradient through autograd)."""

    def __init__(self, local: int, hidden: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(hidden, hidden, dtype=torch.float64) for _ in range(local))

    def forward(self, rows, counts):
        parts = [self.experts[e](r) for e, r in enumerate(rows.split(counts.tolist())) if r.shape[0]]
        return torch.cat(parts) if parts else rows.new_zeros(rows.shape)


def unused_expert_grads(layer_kind: str, reached: int = 0) -> list:
    """The gradients of :class:`SkipsEmpty` experts' parameters (None: none, else
    whether any entry is nonzero) after a
    step on 2 ranks that routes every token to local expert ``reached`` of each, through
    the plain verbs or a layer (``layer_kind``: "plain", "micro-batches", "groups N")."""
    d = dispatch.create(dispatch.DispatchConfig(num_experts=4))
    torch.manual_seed(0)
    experts = SkipsEmpty(d.num_local_experts, 4).to(current_device())
    x = torch.randn(6, 4, dtype=torch.float64, device=current_device(), requires_grad=True)
    idx = torch.tensor([[reached, 2 + reached]] * 6, device=current_device())
    w = torch.rand(6, 2, dtype=torch.float64, device=current_device())
    if layer_kind == "plain":
        out = d.dispatch(x, idx, w)
        h = d.combine(experts(out.tokens, out.tokens_per_expert_host), out.handle, weights=out.weights)
    elif layer_kind == "micro-batches":
        h = dispatch.MoEMicroBatches(d, experts)([x], [idx], [w])[0]
    else:
        h = dispatch.MoEExchange(d, experts, groups=int(layer_kind.split()[1]))(x, idx, w)
    h.sum().backward()
    return [None if p.grad is None else bool(p.grad.any()) for p in experts.parameters()]
