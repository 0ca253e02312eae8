"""Functions run on every rank of a test world for test_async.py (importable by name)."""

from __future__ import annotations

import torch

import dispatch
from pipeline_fns import make_experts
from world import current_device


def _cpu(t):
    return None if t is None else t.detach().cpu()


def _grads(tensors):
    return [_cpu(t.grad) for t in tensors]


def two_micro_batches(batches, grad_outs, config: dict, overlapped: bool):
    """Two micro-batches through dispatch -> experts -> combine, forward and
    backward. ``overlapped``: by hand with the async verbs (start dispatch 0,
    start dispatch 1, wait 0, experts 0, start combine 0, wait 1, experts 1,
    start combine 1, wait both; one backward over both); else one after the
    other with the plain verbs. Returns outputs and gradients on the CPU."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    hidden, dtype = batches[0][0].shape[1], batches[0][0].dtype
    experts = make_experts("rowwise", d.num_local_experts, hidden, dtype, seed=d.rank)
    xs = [x.to(device).requires_grad_() for x, _, _ in batches]
    ws = [w.to(device).requires_grad_() for _, _, w in batches]
    idx = [i.to(device) for _, i, _ in batches]
    if overlapped:
        started = [d.dispatch(xs[m], idx[m], ws[m], async_op=True) for m in range(2)]
        combines = []
        for work in started:
            out = work.wait()
            y = experts(out.tokens, out.tokens_per_expert)
            combines.append(d.combine(y, out.handle, weights=out.weights, async_op=True))
        hs = [work.wait() for work in combines]
    else:
        hs = []
        for m in range(2):
            out = d.dispatch(xs[m], idx[m], ws[m])
            hs.append(d.combine(experts(out.tokens, out.tokens_per_expert), out.handle, weights=out.weights))
    loss = sum((h * g.to(device)).sum() for h, g in zip(hs, grad_outs))
    loss.backward()
    return {"out": [_cpu(h) for h in hs], "x": _grads(xs), "topk_weights": _grads(ws),
            "params": _grads(experts.parameters())}


def verbs(x, topk_idx, topk_weights, rows_out, values, config: dict):
    """Every verb run plainly and with ``async_op=True`` on one dispatch; and the
    moves along the handle against what dispatch/combine and their backwards
    give. Returns {name: (plain, async)} and {name: (move, reference)}, on the CPU."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    rows_out, values = rows_out.to(device), values.to(device)
    out = d.dispatch(x, topk_idx, topk_weights)
    work = d.dispatch(x, topk_idx, topk_weights, async_op=True)
    assert isinstance(work, dispatch.DispatchWork) and work.handle.num_rows == out.handle.num_rows
    late = work.wait()
    assert work.wait() is late  # once
    n = out.tokens.shape[0]
    y = rows_out[:n]
    pairs = {
        "tokens": (out.tokens, late.tokens),
        "weights": (out.weights, late.weights),
        "combine": (d.combine(y, out.handle, weights=out.weights),
                    d.combine(y, late.handle, weights=late.weights, async_op=True).wait()),
        "dispatch_rows": (d.dispatch_rows(x, out.handle), d.dispatch_rows(x, out.handle, async_op=True).wait()),
        "combine_rows": (d.combine_rows(y, out.handle, out.weights),
                         d.combine_rows(y, out.handle, out.weights, async_op=True).wait()),
        "combine_slots": (d.combine_slots(values[:n], out.handle),
                          d.combine_slots(values[:n], out.handle, async_op=True).wait()),
        "dispatch_rows_fp8": (d.dispatch_rows(x, out.handle, wire="fp8"),
                              d.dispatch_rows(x, out.handle, wire="fp8", async_op=True).wait()),
        "combine_rows_bf16": (d.combine_rows(y, out.handle, wire="bf16"),
                              d.combine_rows(y, out.handle, wire="bf16", async_op=True).wait()),
    }
    # the moves along the handle are what dispatch / combine and their backwards move
    xg = x.detach().requires_grad_()
    wg = topk_weights.detach().requires_grad_()
    again = d.dispatch(xg, topk_idx, wg)
    ((again.tokens * y).sum() + (again.weights * values[:n]).sum()).backward()
    same = {
        "dispatch_rows = tokens": (d.dispatch_rows(x, out.handle), out.tokens),
        "combine_rows = combine": (d.combine_rows(y, out.handle, out.weights), pairs["combine"][0]),
        "combine_rows = grad of x": (d.combine_rows(y, out.handle), xg.grad),
        "combine_slots = grad of topk_weights": (d.combine_slots(values[:n], out.handle), wg.grad),
    }
    cpu = lambda p: tuple(_cpu(t) for t in p)  # noqa: E731
    return {k: cpu(v) for k, v in pairs.items()}, {k: cpu(v) for k, v in same.items()}


def async_gradients(x, topk_idx, topk_weights, grad_out, config: dict, async_op: bool):
    """dispatch -> experts -> combine -> backward with the verbs plain or async:
    output and gradients of x, topk_weights and the experts' parameters."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    experts = make_experts("rowwise", d.num_local_experts, x.shape[1], x.dtype, seed=d.rank)
    xs = x.to(device).requires_grad_()
    ws = topk_weights.to(device).requires_grad_()
    out = d.dispatch(xs, topk_idx.to(device), ws, async_op=async_op)
    out = out.wait() if async_op else out
    h = d.combine(experts(out.tokens, out.tokens_per_expert), out.handle, weights=out.weights, async_op=async_op)
    h = h.wait() if async_op else h
    (h * grad_out.to(device)).sum().backward()
    return {"out": _cpu(h), "x": _cpu(xs.grad), "topk_weights": _cpu(ws.grad),
            "params": _grads(experts.parameters())}


def verb_errors(x, topk_idx, topk_weights, config: dict):
    """(exception type, message) of bad calls of the moves along a handle."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    other = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    out = d.dispatch(x, topk_idx, topk_weights)
    n = out.tokens.shape[0]
    attempts = {
        "foreign handle": lambda: other.dispatch_rows(x, out.handle),
        "not a handle": lambda: d.combine_slots(out.weights, object()),
        "rows of T + 1": lambda: d.dispatch_rows(torch.cat([x, x[:1]]), out.handle),
        "integer rows": lambda: d.combine_rows(out.tokens.long(), out.handle),
        "N + 1 rows": lambda: d.combine_rows(torch.cat([out.tokens, out.tokens[:1]]), out.handle),
        "weights of N + 1": lambda: d.combine_rows(out.tokens, out.handle, torch.ones(n + 1, device=device)),
        "values 2-D": lambda: d.combine_slots(out.weights[:, None], out.handle),
        "dispatch wire": lambda: d.dispatch_rows(x, out.handle, wire="fp4"),
        "combine wire": lambda: d.combine_rows(out.tokens, out.handle, wire="fp8"),
    }
    errors = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            errors[name] = None
        except (TypeError, ValueError) as exc:
            errors[name] = (type(exc).__name__, str(exc))
    return errors


def two_groups(batches, config: dict):
    """Two dispatchers on two process groups (the same ranks) with their exchanges
    interleaved: micro-batch 0 on the first, 1 on the second, started together,
    waited for and combined in the other order; against one dispatcher on the
    default group, one micro-batch after the other. Returns (interleaved, plain)
    outputs on the CPU."""
    import torch.distributed as dist

    device = current_device()
    ranks = list(range(dist.get_world_size()))
    groups = [dist.new_group(ranks), dist.new_group(ranks)]
    ds = [dispatch.create(dispatch.DispatchConfig.from_options(**config), group=g) for g in groups]
    inputs = [(x.to(device), i.to(device), w.to(device)) for x, i, w in batches]
    started = [d.dispatch(*inputs[m], async_op=True) for m, d in enumerate(ds)]
    outs = [started[1].wait(), started[0].wait()][::-1]
    combines = [ds[m].combine(outs[m].tokens * (m + 2), outs[m].handle, weights=outs[m].weights, async_op=True)
                for m in (1, 0)][::-1]
    interleaved = [_cpu(c.wait()) for c in combines]
    plain_d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    plain = []
    for m in range(2):
        out = plain_d.dispatch(*inputs[m])
        plain.append(_cpu(plain_d.combine(out.tokens * (m + 2), out.handle, weights=out.weights)))
    return interleaved, plain
