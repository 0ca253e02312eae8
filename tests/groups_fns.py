"""Functions run on every rank of a test world for test_groups.py (importable by name)."""

from __future__ import annotations

import torch

import dispatch
from world import current_device


def _cpu(t):
    return None if t is None else t.detach().cpu()


def grouped_verbs(x, topk_idx, topk_weights, rows_out, values, config: dict, groups: int):
    """A dispatch by ``groups`` groups of local experts against the same
    dispatch in one piece: every verb, group by group and whole. Returns
    {name: (grouped, one piece)} on the CPU, and facts about the groups."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    rows_out, values = rows_out.to(device), values.to(device)
    ref = d.dispatch(x, topk_idx, topk_weights)
    n = ref.tokens.shape[0]
    y, v = rows_out[:n].to(x.dtype), values[:n]
    work = d.dispatch(x, topk_idx, topk_weights, groups=groups, async_op=True)
    handle = work.handle
    parts = [work.wait_group(g) for g in reversed(range(groups))][::-1]  # any order
    facts = dict(groups=handle.groups, by_pieces=getattr(handle, "by_group", None) is not None,
                 rows=[p.rows for p in parts], experts=[p.experts for p in parts],
                 per_expert=[_cpu(p.tokens_per_expert) for p in parts],
                 per_expert_host=[_cpu(p.tokens_per_expert_host) for p in parts])
    sums = d.combine_groups(handle, dtype=y.dtype, wire=config.get("combine_wire", "native"))
    for p in parts:
        sums.add(y[p.rows[0] : p.rows[1]], p.weights)
    plain = d.combine_groups(handle, dtype=y.dtype, wire="bf16")
    for p in parts:
        plain.add(y[p.rows[0] : p.rows[1]])
    cast = d.combine_groups(handle, dtype=y.dtype, wire=config.get("combine_wire", "native"))
    for p in parts:  # rows in another dtype are cast to the one given (exactly, here)
        cast.add(y[p.rows[0] : p.rows[1]].double(), p.weights)
    rows_work = d.dispatch_rows(x, handle, wire="fp8", async_op=True)
    rows_parts = [rows_work.wait_group(g) for g in range(groups)] if groups > 1 else [rows_work.wait()]
    full = work.wait()
    pairs = {
        "tokens": (torch.cat([p.tokens for p in parts]), ref.tokens),
        "weights": (torch.cat([p.weights for p in parts]), ref.weights),
        "tokens_per_expert": (sum(p.tokens_per_expert for p in parts), ref.tokens_per_expert),
        "combine_groups": (sums.wait(), d.combine(y, ref.handle, weights=ref.weights)),
        "combine_groups_plain": (plain.wait(), d.combine_rows(y, ref.handle, wire="bf16")),
        "combine_groups_cast": (cast.wait(), d.combine(y, ref.handle, weights=ref.weights)),
        "dispatch_rows_groups": (torch.cat(rows_parts), d.dispatch_rows(x, ref.handle, wire="fp8")),
        "wait_tokens": (full.tokens, ref.tokens),
        "src": (torch.stack([full.src_rank, full.src_token]), torch.stack([ref.src_rank, ref.src_token])),
        "combine": (d.combine(y, full.handle, weights=full.weights), d.combine(y, ref.handle, weights=ref.weights)),
        "combine_rows": (d.combine_rows(y, full.handle), d.combine_rows(y, ref.handle)),
        "combine_slots": (d.combine_slots(v, full.handle), d.combine_slots(v, ref.handle)),
        "dispatch_rows": (d.dispatch_rows(x, full.handle), d.dispatch_rows(x, ref.handle)),
    }
    # the differentiable verbs along a dispatch by groups: the same gradients
    grads = []
    for g in (groups, 1):
        xg, wg = x.detach().requires_grad_(), topk_weights.detach().requires_grad_()
        out = d.dispatch(xg, topk_idx, wg, groups=g)
        home = d.combine(out.tokens * 2, out.handle, weights=out.weights)
        (home * rows_out[: home.shape[0], : home.shape[1]].to(home.dtype)).sum().backward()
        grads.append((_cpu(home), _cpu(xg.grad), _cpu(wg.grad)))
    pairs["autograd"] = (torch.cat([t.flatten().double() for t in grads[0]]),
                         torch.cat([t.flatten().double() for t in grads[1]]))
    return {k: (_cpu(a), _cpu(b)) for k, (a, b) in pairs.items()}, facts


def grouped_errors(x, topk_idx, topk_weights, config: dict, groups_of_rank: list[int]):
    """Refusals of dispatches by groups; returns the messages."""
    from dispatch import DispatchConfig

    device = current_device()
    d = dispatch.create(DispatchConfig.from_options(**config))
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    rank = torch.distributed.get_rank()
    errors = {}
    for name, call in {
        "zero": lambda: d.dispatch(x, topk_idx, topk_weights, groups=0),
        "too many": lambda: d.dispatch(x, topk_idx, topk_weights, groups=d.num_local_experts + 1),
        "max_rows": lambda: d.dispatch(x, topk_idx, topk_weights, groups=2, max_rows=100),
        "disagree": lambda: d.dispatch(x, topk_idx, topk_weights, groups=groups_of_rank[rank]),
    }.items():
        try:
            call()
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    work = d.dispatch(x, topk_idx, topk_weights, groups=2, async_op=True)
    first = work.wait_group(0)
    sums = d.combine_groups(work.handle, dtype=x.dtype)
    for name, call in {
        "wait before all added": sums.wait,
        "wrong rows": lambda: sums.add(torch.cat([first.tokens, x[:1]])),  # one row too many
        "bad group": lambda: work.wait_group(2),
        "rows' bad group": lambda: d.dispatch_rows(x, work.handle, async_op=True).wait_group(-1),  # (no all-to-all
    }.items():  # waited for: the last group's rows read before they land)
        try:
            call()
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    sums.add(first.tokens)
    sums.add(work.wait_group(1).tokens)
    sums.wait()
    if rank == 0:  # one rank's extra add: refused here alone, no peer joins it
        try:
            sums.add(first.tokens)
        except ValueError as e:
            errors["added twice"] = str(e)
    errors["next call"] = torch.equal(d.dispatch(x, topk_idx, topk_weights).tokens.cpu(),
                                      work.wait().tokens.cpu())  # every rank still pairs its next call
    return errors


def experts_in_another_dtype(x, topk_idx, topk_weights, num_experts: int, groups: int, variant: str = "alltoall"):
    """MoEExchange whose experts answer rows in fp64 (x fp32) where they have rows:
    (output, its gradient of x) on the CPU."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts, transport="nccl", variant=variant))
    xs = x.to(device).requires_grad_()
    out = dispatch.MoEExchange(d, lambda t, n: t.double() * 2 if t.shape[0] else t, groups=groups)(
        xs, topk_idx.to(device), topk_weights.to(device))
    out.double().sum().backward()
    return _cpu(out), _cpu(xs.grad)


def grouped_errors_without_board(*args):
    """:func:`grouped_errors` with the calls agreed over the host channel (as off one host)."""
    from agreement_fns import _without_board

    return _without_board(grouped_errors, *args)


def one_group_bounded(x, topk_idx, topk_weights, num_experts: int, bound: int):
    """A dispatch with ``max_rows=bound`` in one group, async: its ``wait_group(0)``
    and its ``wait()``, on the CPU (tokens, weights, rows of each)."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig(num_experts=num_experts, transport="nccl"))
    work = d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device), max_rows=bound, async_op=True)
    part = work.wait_group(0)
    whole = work.wait()
    return (_cpu(part.tokens), _cpu(part.weights), part.rows), (_cpu(whole.tokens), _cpu(whole.weights))
