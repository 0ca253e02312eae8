"""Functions run on every rank of a test world for the pipeline tests (importable by name)."""

from __future__ import annotations

import contextlib

import torch
from torch import nn

import dispatch
from dispatch import comm
from dispatch.dispatchers.alltoall import AllToAllDispatcher
from dispatch.dispatchers.base import TokenDispatcher
from dispatch.experts import GroupedExperts
from world import current_device


class RowwiseExperts(nn.Module):
    """E_local elementwise experts: ``y = x * scale[e] + x * x * quad[e]``. Every
    row is computed on its own, so chunking cannot change a row's bits."""

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


class GenericChunks(AllToAllDispatcher):
    """The alltoall variant with the base class's generic chunk support (one plan
    per chunk, exchanges finished on start), for comparison with the native one."""

    _plan_chunks = TokenDispatcher._plan_chunks
    _to_experts_start = TokenDispatcher._to_experts_start
    _to_home_start = TokenDispatcher._to_home_start
    _weights_to_home_start = TokenDispatcher._weights_to_home_start


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
        def call(rows, send_splits, recv_splits, group):
            torch.cuda._sleep(LATE_CYCLES)
            return exchange(rows, send_splits, recv_splits, group)

        return call

    comm.all_to_all_rows_start, comm.all_to_all_rows = late(start), late(whole)
    try:
        yield
    finally:
        comm.all_to_all_rows_start, comm.all_to_all_rows = start, whole


def _cpu(t):
    return None if t is None else t.detach().cpu()


def make_experts(kind: str, num_local_experts: int, hidden: int, dtype: torch.dtype, seed: int):
    if kind == "rowwise":
        return RowwiseExperts(num_local_experts, hidden, dtype, seed).to(current_device())
    torch.manual_seed(seed)
    experts = GroupedExperts(num_local_experts, hidden, 2 * hidden, activation=kind, dtype=dtype)
    if kind == "relu":
        with torch.no_grad():  # dyadic weights: the relu experts stay exact in fp64
            for p in experts.parameters():
                p.copy_((p * 8).round() / 8)
    return experts.to(current_device())


def layer_options(layer) -> dict:
    """MoEExchange's chunks, local_first and ahead of a layer's name: C or
    relative sizes "s0:s1:..." (chunks=(s0, s1, ...)), "local" (C = 1) or "local"
    and either, then "/A" for ``ahead=A`` (none: every chunk ahead)."""
    name, _, ahead = str(layer).partition("/")
    local = name.startswith("local")
    sizes = (name.removeprefix("local") or "1").split(":")
    chunks = int(sizes[0]) if len(sizes) == 1 else tuple(map(int, sizes))
    return dict(chunks=chunks, local_first=local, ahead=int(ahead) if ahead else None)


def make_layer(d, experts, chunks):
    """The MoEExchange a layer's name describes (:func:`layer_options`): C or
    relative sizes "1:2:1", "local" first for ``local_first=True``, "/A" after
    for ``ahead=A`` (e.g. 3, "local3", "4/2", "local1:2:1/1")."""
    return dispatch.MoEExchange(d, experts, **layer_options(chunks))


def pipelined(x, topk_idx, topk_weights, grad_out, config: dict, chunk_counts, experts_kind: str,
              generic: bool = False, x_grad: bool = True, w_grad: bool = True, late: bool = False):
    """For each C in ``chunk_counts``: MoEExchange(C) forward and backward with
    fresh identical experts; C = "plain" runs dispatch -> experts -> combine
    instead, C = "local" MoEExchange(local_first=True).
    Returns {C: {"out", "x", "topk_weights", "params": [...]}}, all on the CPU."""
    device = current_device()
    cfg = dispatch.DispatchConfig(**config)
    d = GenericChunks(cfg) if generic else dispatch.create(cfg)
    results = {}
    for chunks in chunk_counts:
        experts = make_experts(experts_kind, d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
        if late and chunks != "plain":
            experts = LateExperts(experts)
        xs = x.to(device).requires_grad_(x_grad)
        ws = topk_weights.to(device).requires_grad_(w_grad)
        idx = topk_idx.to(device)
        with late_collectives(late and chunks != "plain"):
            if chunks == "plain":
                out = d.dispatch(xs, idx, ws)
                y = experts(out.tokens, out.tokens_per_expert)
                h = d.combine(y, out.handle, weights=out.weights)
            else:
                h = make_layer(d, experts, chunks)(xs, idx, ws)
            (h * grad_out.to(device)).sum().backward()
        results[chunks] = {
            "out": _cpu(h),
            "x": _cpu(xs.grad),
            "topk_weights": _cpu(ws.grad),
            "params": [_cpu(p.grad) for p in experts.parameters()],
        }
    return results


def pipelined_no_grad(x, topk_idx, topk_weights, config: dict, chunks, late: bool = False):
    """Forward only, under no_grad (no expert graph kept)."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(**config))
    experts = make_experts("rowwise", d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
    if late:
        experts = LateExperts(experts)
    with torch.no_grad(), late_collectives(late):
        h = make_layer(d, experts, chunks)(x.to(device), topk_idx.to(device), topk_weights.to(device))
    return _cpu(h), h.requires_grad


def chunk_plan_counts(topk_idx, bounds, num_experts: int, world_size: int):
    """plan.chunk_counts against route() of each chunk's tokens, on one process."""
    from dispatch import plan

    r = plan.route(topk_idx, num_experts, world_size)
    chunk_of = plan.token_chunks(bounds, topk_idx.device)[0]
    got = plan.chunk_counts(r, topk_idx, chunk_of, len(bounds) - 1, num_experts)
    want = torch.stack([plan.route(topk_idx[a:b], num_experts, world_size).counts for a, b in zip(bounds, bounds[1:])])
    return got, want


def peak_memory(x, topk_idx, topk_weights, config: dict, chunks: int):
    """Peak CUDA memory (bytes above the start) of one forward + backward."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(**config))
    torch.manual_seed(0)
    experts = GroupedExperts(d.num_local_experts, x.shape[1], 4 * x.shape[1], dtype=x.dtype, device=device)
    layer = make_layer(d, experts, chunks)
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


def chunk_plan_collectives(x, topk_idx, topk_weights, config: dict, chunks: int):
    """The collectives one chunked plan of the alltoall variant starts, by name."""
    import dispatch.comm as comm

    calls = []
    originals = {name: getattr(comm, name) for name in ("all_gather_rows", "all_to_all_rows")}

    def counting(name):
        def call(*a, **k):
            calls.append(name)
            return originals[name](*a, **k)

        return call

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(**config))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    bounds = tuple(c * x.shape[0] // chunks for c in range(chunks + 1))
    for name in originals:
        setattr(comm, name, counting(name))
    try:
        d._plan_chunks(x, topk_idx, topk_weights, bounds, True)
    finally:
        for name, original in originals.items():
            setattr(comm, name, original)
    return calls


def expert_calls(x, topk_idx, topk_weights, config: dict, chunks: int):
    """Calls seen by a forward pre-hook of GroupedExperts and by a subclass's own
    forward, through one MoEExchange(chunks) forward + backward each."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(**config))

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
        dispatch.MoEExchange(d, experts, chunks=chunks)(xs, topk_idx.to(device), topk_weights.to(device)).sum().backward()
    return len(seen), Counted.calls


def special_experts(x, topk_idx, topk_weights, grad_out, config: dict, kind: str, chunks_list=(1, 3)):
    """GroupedExperts the pipeline must leave to autograd: ``kind`` "parametrized"
    (w_in through a parametrization) or "autocast" (the step under CPU/CUDA
    autocast to bf16). Returns {C or "plain": (out, x grad, [parameter grads])}."""
    from torch.nn.utils import parametrize

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(**config))
    results = {}
    for chunks in ("plain", *chunks_list):
        torch.manual_seed(d.rank)
        experts = GroupedExperts(d.num_local_experts, x.shape[1], 2 * x.shape[1], dtype=x.dtype).to(device)
        if kind == "parametrized":
            parametrize.register_parametrization(experts, "w_in", _Doubled())
        xs = x.to(device).requires_grad_()
        idx, ws = topk_idx.to(device), topk_weights.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=kind == "autocast"):
            if chunks == "plain":
                out = d.dispatch(xs, idx, ws)
                h = d.combine(experts(out.tokens, out.tokens_per_expert), out.handle, weights=out.weights)
            else:
                h = make_layer(d, experts, chunks)(xs, idx, ws)
        (h.float() * grad_out.to(device)).sum().backward()
        results[chunks] = (_cpu(h), _cpu(xs.grad), [_cpu(p.grad) for p in experts.parameters()])
    return results


class _Doubled(nn.Module):
    def forward(self, w):
        return 2 * w


def backward_twice(x, topk_idx, topk_weights, config: dict, experts_kind: str, chunks=2):
    """The error of a second backward through one MoEExchange forward."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(**config))
    experts = make_experts(experts_kind, d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
    xs = x.to(device).requires_grad_()
    out = make_layer(d, experts, chunks)(xs, topk_idx.to(device), topk_weights.to(device)).sum()
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
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        if params_exact:
            assert torch.equal(a, b), f"{what}: gradient of parameter {i} differs"
        else:
            torch.testing.assert_close(a, b, msg=f"{what}: gradient of parameter {i}")


def local_first_errors(num_experts: int) -> list[str | None]:
    """Messages of MoEExchange(local_first=...) refusals, on a world of one."""
    alltoall = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts))
    allgather = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts, variant="allgather"))
    messages = []
    for attempt in (lambda: dispatch.MoEExchange(alltoall, lambda t, n: t, local_first=1),
                    lambda: dispatch.MoEExchange(allgather, lambda t, n: t, local_first=True)):
        try:
            attempt()
            messages.append(None)
        except (TypeError, ValueError) as exc:
            messages.append(str(exc))
    return messages


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


def empty_part_under_autocast(x, topk_idx, topk_weights, num_experts: int, chunks, variant: str = "alltoall"):
    """Output of a layer whose experts answer empty calls in another dtype, under
    bf16 autocast; ``chunks`` "plain" runs dispatch -> experts -> combine."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts, variant=variant))
    experts = _EmptyInOwnDtype(x.shape[1]).to(device)
    xs, idx, ws = x.to(device).requires_grad_(), topk_idx.to(device), topk_weights.to(device)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        if chunks == "plain":
            out = d.dispatch(xs, idx, ws)
            h = d.combine(experts(out.tokens, out.tokens_per_expert), out.handle, weights=out.weights)
        else:
            h = make_layer(d, experts, chunks)(xs, idx, ws)
    h.float().sum().backward()
    return _cpu(h), _cpu(xs.grad)


def starts_and_held(x, topk_idx, topk_weights, num_experts: int, chunks):
    """One forward and backward of a layer: (the token all-to-alls the forward
    started, in order: "P" a dispatch started within the plan, "D" one started
    by the pipeline, "H" a combine; those the backward started; whether each
    tensor local_first held was dropped by the end)."""
    from unittest import mock

    from dispatch import pipeline_local

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts))
    held, order, kind = [], [], ["P"]  # a start outside _rows_start is the plan's

    class Tracked(pipeline_local.Held):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            held.append(self)

    start, rows_start = d.transport.start, d._rows_start

    def counted(*args, **kwargs):
        order.append(kind[0])
        return start(*args, **kwargs)

    def rows_start_of_kind(rows, handle, back):
        kind[0] = "H" if back else "D"
        try:
            return rows_start(rows, handle, back)
        finally:
            kind[0] = "P"

    d.transport.start, d._rows_start = counted, rows_start_of_kind
    experts = make_experts("rowwise", d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
    xs = x.to(device).requires_grad_()
    with mock.patch.object(pipeline_local, "Held", Tracked):
        out = make_layer(d, experts, chunks)(xs, topk_idx.to(device), topk_weights.to(device))
        forward_order = "".join(order)
        out.sum().backward()
    return forward_order, "".join(order)[len(forward_order):], [h.tensor is None for h in held]


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


def repeated(x, steps, grad_out, config: dict, chunks, experts_kind: str):
    """One dispatcher and one layer, a forward and backward per (topk_idx,
    topk_weights) in ``steps`` (same shapes: on CUDA the second step captures
    the plan's graphs, later ones replay them on new routing). Returns per step
    {"out", "x", "topk_weights", "params"} on the CPU."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(**config))
    experts = make_experts(experts_kind, d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
    layer = make_layer(d, experts, chunks)
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


class _RaisesOnce(nn.Module):
    """Experts whose first call raises (on the ranks that build them so)."""

    def __init__(self, experts, raises: bool) -> None:
        super().__init__()
        self.experts, self.raises = experts, raises

    def forward(self, tokens, tokens_per_expert):
        if self.raises:
            self.raises = False
            raise ValueError("these experts fail on purpose")
        return self.experts(tokens, tokens_per_expert)


def local_first_one_rank_fails(x, topk_idx, topk_weights, config: dict, failing_rank: int, chunks: int = 1):
    """MoEExchange(chunks=C, local_first=True) whose experts raise on ``failing_rank``'s own
    rows: (exception type and message, or None) of that step, then the output of
    a second step on the same layer (which must work)."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(**config))
    experts = _RaisesOnce(make_experts("rowwise", d.num_local_experts, x.shape[1], x.dtype, seed=d.rank),
                          d.rank == failing_rank)
    layer = dispatch.MoEExchange(d, experts, chunks=chunks, local_first=True)
    args = (x.to(device), topk_idx.to(device), topk_weights.to(device))
    try:
        layer(*args)
        error = None
    except Exception as exc:  # the test inspects what each rank raised
        error = (type(exc).__name__, str(exc))
    return error, _cpu(layer(*args).detach())
