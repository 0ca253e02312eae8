"""Functions that run on every rank of a test world (importable by name)."""

from __future__ import annotations

import torch

import dispatch
from world import current_device


def _cpu(t):
    return None if t is None else t.detach().cpu()


def expert_scale(tokens_per_expert_host: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """[N, 1] factor 1 + local expert id for each dispatched row: a per-expert 'model'."""
    experts = torch.repeat_interleave(torch.arange(len(tokens_per_expert_host)), tokens_per_expert_host)
    return (1 + experts).to(dtype=dtype, device=device).unsqueeze(1)


def round_trip(x, topk_idx, topk_weights, config: dict, experts: str = "identity", repeats: int = 1):
    """dispatch -> experts -> combine(weights=out.weights); everything back on the CPU.
    With ``repeats`` > 1 the same dispatcher runs that many times and the last run
    is returned (on CUDA, the second run of a shape replays the captured plan)."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    for _ in range(repeats - 1):
        d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    out = d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    y = out.tokens
    if experts == "scaled":
        y = y * expert_scale(out.tokens_per_expert_host, y.dtype, device)
    combined = d.combine(y, out.handle, weights=out.weights)
    return {
        "tokens": _cpu(out.tokens),
        "tokens_per_expert": _cpu(out.tokens_per_expert),
        "tokens_per_expert_host": out.tokens_per_expert_host,
        "weights": _cpu(out.weights),
        "src_rank": _cpu(out.src_rank),
        "src_token": _cpu(out.src_token),
        "combined": _cpu(combined),
        "stats": None if out.stats is None else out.stats.as_dict(),
        "variant": out.handle.transport.variant,
    }


def gradients(x, topk_idx, topk_weights, grad_out, expert_out, config: dict):
    """Gradients of sum(grad_out * combine(f(dispatch(x)))) for x and topk_weights,
    and of sum(grad_out * combine(expert_out, weights)) for expert_out and weights."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x = x.to(device).requires_grad_()
    w = topk_weights.to(device).requires_grad_()
    g = grad_out.to(device)
    out = d.dispatch(x, topk_idx.to(device), w)
    scale = expert_scale(out.tokens_per_expert_host, out.tokens.dtype, device)
    y = out.tokens * scale + out.tokens * out.tokens * 0.125
    (d.combine(y, out.handle, weights=out.weights) * g).sum().backward()

    y_leaf = expert_out.to(device).requires_grad_()
    w_leaf = out.weights.detach().clone().requires_grad_()
    (d.combine(y_leaf, out.handle, weights=w_leaf) * g).sum().backward()
    return {
        "x": _cpu(x.grad),
        "topk_weights": _cpu(w.grad),
        "expert_out": _cpu(y_leaf.grad),
        "weights": _cpu(w_leaf.grad),
        "routed_weights": _cpu(out.weights),
    }


def error_of(fn_name: str, *args):
    """Run one of the call_* functions below; return (exception type, message,
    collectives the dispatcher started: not those of ``dispatch.create``), or
    None if nothing was raised."""
    calls = []
    names = ("all_gather_rows", "all_to_all_rows", "all_to_all_rows_start")
    originals = {name: getattr(dispatch.comm, name) for name in names}
    create, creating = dispatch.create, []

    def counting(name):
        def call(*a, **k):
            if not creating:
                calls.append(name)
            return originals[name](*a, **k)

        return call

    def uncounted_create(*a, **k):
        creating.append(True)
        try:
            return create(*a, **k)
        finally:
            creating.pop()

    for name in originals:
        setattr(dispatch.comm, name, counting(name))
    dispatch.create = uncounted_create
    try:
        globals()[fn_name](*args)
    except Exception as exc:  # the test inspects what was raised
        return type(exc).__name__, str(exc), calls
    finally:
        for name, original in originals.items():
            setattr(dispatch.comm, name, original)
        dispatch.create = create
    return None


class OnMeta:
    """A tensor to be put on the 'meta' device on the rank (meta tensors don't pickle)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _move(value, device):
    if isinstance(value, OnMeta):
        return value.tensor.to("meta")
    return value.to(device) if isinstance(value, torch.Tensor) else value


def call_dispatch(config: dict, x, topk_idx, topk_weights):
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    d.dispatch(_move(x, device), _move(topk_idx, device), _move(topk_weights, device))


def call_dispatch_after_good(config: dict, good: tuple, x, topk_idx, topk_weights):
    """call_dispatch on a dispatcher that made a good round trip of ``good`` (x,
    topk_idx, topk_weights) first: its checks of that signature passed and are kept."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    out = d.dispatch(*(t.to(device) for t in good))
    d.combine(out.tokens, out.handle, weights=out.weights)
    d.dispatch(_move(x, device), _move(topk_idx, device), _move(topk_weights, device))


def call_dispatch_twice(config: dict, x, topk_idx, topk_weights, first: dict, second: dict):
    """Two dispatches of the same tensors on one dispatcher, with the keyword
    arguments ``first`` (which pass), then ``second``."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    args = (_move(x, device), _move(topk_idx, device), _move(topk_weights, device))
    d.dispatch(*args, **first)
    d.dispatch(*args, **second)


def call_combine_after_good(config: dict, x, topk_idx, topk_weights, expert_out, weights):
    """call_combine on a dispatcher whose first round trip of the same inputs
    combined their own rows (its combine checks of that signature passed and
    are kept)."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    args = (x.to(device), topk_idx.to(device), topk_weights.to(device))
    out = d.dispatch(*args)
    d.combine(out.tokens, out.handle, weights=out.weights)
    out = d.dispatch(*args)
    if expert_out == "same":
        expert_out = out.tokens
    d.combine(_move(expert_out, device), out.handle, weights=_move(weights, device))


def call_combine(config: dict, x, topk_idx, topk_weights, expert_out, weights):
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    out = d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    if expert_out == "same":
        expert_out = out.tokens
    d.combine(_move(expert_out, device), out.handle, weights=_move(weights, device))


def call_dispatch_as(config: dict, per_rank: list):
    """call_dispatch with this rank's own (x, topk_idx, topk_weights) from ``per_rank``."""
    import torch.distributed as dist

    call_dispatch(config, *per_rank[dist.get_rank()])


def call_dispatch_later_as(config: dict, per_rank: list, good: tuple):
    """A dispatch of the ``good`` inputs on every rank, then one of this rank's own
    from ``per_rank`` on the same dispatcher (``variant="auto"`` checks its
    inputs itself only at the calls where it chooses: the first, every 64th)."""
    import torch.distributed as dist

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    d.dispatch(*(_move(t, device) for t in good))
    d.dispatch(*(_move(t, device) for t in per_rank[dist.get_rank()]))


def call_layer_as(config: dict, options: dict, per_rank: list):
    """MoEExchange(**options) with identity experts on this rank's own
    (x, topk_idx, topk_weights) from ``per_rank``."""
    import torch.distributed as dist

    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, topk_idx, topk_weights = (_move(t, device) for t in per_rank[dist.get_rank()])
    dispatch.MoEExchange(d, lambda tokens, per_expert: tokens, **options)(x, topk_idx, topk_weights)


def call_create(config: dict):
    dispatch.create(dispatch.DispatchConfig.from_options(**config))


def call_foreign_handle(config: dict, x, topk_idx, topk_weights):
    device = current_device()
    first = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    second = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    out = first.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    second.combine(out.tokens, out.handle, weights=out.weights)


def bench_wrong_rows(corrupt):
    """The benchmark's #wrong count over the world (E = 4 experts, slots of
    token 2 on experts 1 and 3, others on 0 and 2, one empty), with one element
    planted wrong on this rank, or (``"swapped"``) the weights of token 1's two
    slots swapped, or (``"identity"``) the experts' factors left out."""
    from dispatch.bench.common import expert_factor
    from dispatch.bench.common import wrong_rows as _wrong_rows

    device = current_device()
    x = torch.arange(12, dtype=torch.float32, device=device).view(4, 3)
    idx = torch.tensor([[0, 2], [0, 2], [1, 3], [2, -1]], device=device)
    w = torch.tensor([[0.5, 0.5], [0.25, 0.75], [0.5, 0.5], [1.0, 0.0]], device=device)
    used = w.clone()
    if corrupt == "swapped":
        used[1] = used[1].flip(0)
    factor = torch.where(idx >= 0, expert_factor(idx.clamp(min=0), 4), 0.0)
    if corrupt == "identity":
        factor = (idx >= 0).float()
    out = x * (used * factor).sum(1, keepdim=True)
    if isinstance(corrupt, tuple):
        out[corrupt] += 0.25
    return _wrong_rows(out, x, idx, w, 4)


def two_in_flight(x, first_idx, second_idx, topk_weights, config: dict):
    """Two dispatches of one shape on one dispatcher before either combine (on CUDA
    both plans come from the same captured graphs: their handles must not alias)."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, w = x.to(device), topk_weights.to(device)
    d.dispatch(x, second_idx.to(device), w)  # first sighting of the shape: eager plan
    first = d.dispatch(x, first_idx.to(device), w)  # CUDA: captured ...
    # ... and replayed by the next one, over the same static buffers
    second = d.dispatch(x, second_idx.to(device), w)
    out_second = d.combine(second.tokens, second.handle, weights=second.weights)
    out_first = d.combine(first.tokens, first.handle, weights=first.weights)
    return _cpu(out_first), _cpu(out_second)


def mixed_gradients(x, topk_idx, topk_weights, grad_out, x_grad: bool, w_grad: bool, fresh: bool, config: dict):
    """Ranks that need different gradients, experts applying the weights themselves;
    with ``fresh`` this rank's experts return a new tensor unconnected to the tokens."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x = x.to(device).requires_grad_(x_grad)
    w = topk_weights.to(device).requires_grad_(w_grad)
    out = d.dispatch(x, topk_idx.to(device), w)
    if fresh:
        y = torch.zeros_like(out.tokens)
    else:
        y = out.tokens * out.weights.unsqueeze(1).to(out.tokens.dtype)
    h = d.combine(y, out.handle)
    loss = (h * grad_out.to(device)).sum()
    if loss.requires_grad:
        loss.backward()
    return _cpu(x.grad), _cpu(w.grad)


def bench_traffic(idx, config: dict, hidden: int):
    """The dispatch benchmark's byte accounting for one dispatch of fp32 rows."""
    from dispatch.bench.roundtrip import _traffic

    device = current_device()
    topk_idx = torch.tensor(idx, dtype=torch.int64, device=device)
    weights = torch.full(topk_idx.shape, 0.5, device=device)
    x = torch.zeros(topk_idx.shape[0], hidden, device=device)
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    out = d.dispatch(x, topk_idx, weights)
    return _traffic(out, topk_idx, hidden * 4, device)


def round_trip_in_ep_groups(x, topk_idx, topk_weights, config: dict, ep_size: int):
    """The world split into EP groups of ``ep_size`` consecutive ranks (as beside
    data parallelism), each running its own dispatcher: ``round_trip``'s results."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(s, s + ep_size))) for s in range(0, world, ep_size)]
    group = groups[rank // ep_size]
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config), group)
    out = d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    combined = d.combine(out.tokens, out.handle, weights=out.weights)
    return {"tokens": _cpu(out.tokens), "src_rank": _cpu(out.src_rank), "src_token": _cpu(out.src_token),
            "combined": _cpu(combined)}


def call_create_in_group(config: dict, members):
    """dispatch.create on a group of ``members`` made by every rank (or, with
    members None, on something that is not a group)."""
    group = torch.distributed.new_group(members) if members is not None else "world"
    dispatch.create(dispatch.DispatchConfig.from_options(**config), group)


def auto_choices(x, topk_idx, topk_weights, config: dict, calls: int):
    """The calls at which ``variant="auto"`` chose (its cost model's counts
    exchange), over ``calls`` round trips; and the variant it runs."""
    device = current_device()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    transport, chosen = d.transport, []
    choose = transport._choose
    transport._choose = lambda request: chosen.append(request.ticket.call) or choose(request)
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    for _ in range(calls):
        out = d.dispatch(x, topk_idx, topk_weights)
        d.combine(out.tokens, out.handle, weights=out.weights)
    return chosen, out.handle.transport.variant


def tiers_on_hosts(x, topk_idx, topk_weights, config: dict, hosts: tuple):
    """The ranks per node a dispatcher's transport takes where its group's ranks
    are told to run on ``hosts`` (``comm.group_hosts``), and the stats of one
    dispatch by its tiers."""
    from dispatch import comm

    asked, comm.group_hosts = comm.group_hosts, lambda group: hosts
    try:
        d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    finally:
        comm.group_hosts = asked
    out = d.dispatch(x, topk_idx, topk_weights)
    return d.transport.local_world_size, out.stats


def tiers_beside_local_world_size(x, topk_idx, topk_weights, config: dict, env: str):
    """The ranks per node a dispatcher's transport takes, and its dispatch's
    rows, where this process's ``LOCAL_WORLD_SIZE`` is ``env`` (torchrun's, on
    nodes of different sizes), the group's ranks all on this host."""
    import os

    saved = os.environ.get("LOCAL_WORLD_SIZE")
    os.environ["LOCAL_WORLD_SIZE"] = env
    device = current_device()
    try:
        d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
        out = d.dispatch(x.to(device), topk_idx.to(device), topk_weights.to(device))
    finally:
        if saved is None:
            del os.environ["LOCAL_WORLD_SIZE"]
        else:
            os.environ["LOCAL_WORLD_SIZE"] = saved
    return d.transport.local_world_size, out.tokens.shape[0]


def hosts_asked(host: str):
    """``comm.group_hosts`` of the world, asked twice, where this rank runs on
    ``host``: (its answers, the all-gathers it made); then of a one-rank group;
    then its answer as it is (every rank on this host)."""
    import socket

    import torch.distributed as dist

    from dispatch import comm

    gathers, kept = [], dict(comm._HOSTS)
    comm._HOSTS.clear()  # (the world's hosts, where a dispatcher asked them before)
    saved = socket.gethostname, dist.all_gather_object
    socket.gethostname = lambda: host
    dist.all_gather_object = lambda *args, **kw: gathers.append(1) or saved[1](*args, **kw)
    try:
        answers = [comm.group_hosts(None), comm.group_hosts(dist.group.WORLD)]
        alone = comm.group_hosts(dist.new_group([dist.get_rank()], use_local_synchronization=True))
    finally:  # (the hosts told here are not kept for the tests after it in this process)
        socket.gethostname, dist.all_gather_object = saved
        comm._HOSTS.clear()
        comm._HOSTS.update(kept)
    return answers, len(gathers), alone, comm.group_hosts(None)


def every_verb(d, x, topk_idx, topk_weights, grad_out, max_rows=None, groups=1, async_op=False) -> dict:
    """One round trip through every verb along one handle: dispatch (with
    ``max_rows``, ``groups``, ``async_op``), a combine of a nonlinear expert
    and its backward, then dispatch_rows, combine_rows and combine_slots.
    Returns each result by name (``n``: the rows dispatched; ``per_expert``:
    ``tokens_per_expert_host``)."""
    xx, ww = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()
    out = d.dispatch(xx, topk_idx, ww, max_rows=max_rows, groups=groups, async_op=async_op)
    if async_op:
        out = out.wait()
    y = out.tokens * 1.5 + out.tokens * out.tokens * 0.25
    combined = d.combine(y, out.handle, weights=out.weights)
    (combined * grad_out).sum().backward()
    rows = d.dispatch_rows(x * 3, out.handle)
    home = d.combine_rows(out.tokens.detach() * 2, out.handle, out.weights.detach())
    values = out.weights.detach() * 5
    values[::3] = -0.0  # signed zeros come home as they went
    slots = d.combine_slots(values, out.handle)
    return dict(n=out.tokens.shape[0], tokens=out.tokens.detach(), weights=out.weights.detach(), src_rank=out.src_rank,
                src_token=out.src_token, tokens_per_expert=out.tokens_per_expert, combined=combined.detach(),
                grad_x=xx.grad, grad_w=ww.grad, rows=rows, home=home, slots=slots,
                per_expert=out.tokens_per_expert_host)


def every_verb_by_config(configs: dict, x, topk_idx, topk_weights, grad_out) -> dict:
    """``every_verb`` on this rank's device through a dispatcher of each of
    ``configs`` (name -> options): the results by name, on the CPU."""
    from world import current_device

    device = current_device()
    x, topk_idx, topk_weights, grad_out = (t.to(device) for t in (x, topk_idx, topk_weights, grad_out))
    got = {}
    for name, config in configs.items():
        d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
        one = every_verb(d, x, topk_idx, topk_weights, grad_out)
        got[name] = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in one.items()}
    return got


def with_and_without_compiled_plan(x, topk_idx, topk_weights, grad_out, expert_out, config: dict):
    """``round_trip`` and ``gradients`` with the compiled CPU plan
    (``dispatch.kernels.plan_cpu``) and with the torch operations: (both, built)."""
    from dispatch.kernels import plan_cpu

    got = []
    for enabled in (True, False):
        plan_cpu.enabled = enabled
        try:
            got.append((round_trip(x, topk_idx, topk_weights, config),
                        gradients(x, topk_idx, topk_weights, grad_out, expert_out, config)))
        finally:
            plan_cpu.enabled = True
    return got, plan_cpu.module() is not None


def dispatcher(config: dict, emulated: bool = False):
    """``dispatch.create`` of ``config``; ``emulated``: the NVSHMEM transport's
    dispatcher with its rows over gloo (``splits_exchange.HostSplitsExchange``)."""
    cfg = dispatch.DispatchConfig.from_options(**config)
    if not emulated:
        return dispatch.create(cfg)
    from splits_exchange import HostSplitsExchange

    from dispatch.dispatcher import TokenDispatcher
    from dispatch.transports import REGISTRY

    return TokenDispatcher(cfg, None, REGISTRY[cfg.variant, "nvshmem"](cfg, None, exchange=HostSplitsExchange()))


def padded_groups(rows, bounds, bound, fill):
    """Rows of a dispatch by groups [N, ...] placed as a dispatch by groups with a
    row bound places them: group g's at [g B, g B + its rows), ``fill`` after."""
    groups = len(bounds) - 1
    out = torch.full((groups * bound, *rows.shape[1:]), fill, dtype=rows.dtype, device=rows.device)
    for g in range(groups):
        lo, hi = bounds[g], bounds[g + 1]
        out[g * bound : g * bound + hi - lo] = rows[lo:hi]
    return out


def bounded_groups_verbs(x, topk_idx, topk_weights, config, groups, slack, emulated=False):
    """A dispatch by groups with max_rows (``slack`` times this rank's fullest
    group, by G; 1: a tight fit) against the same by groups without: each
    group's rows in its padded block (zeros after, weight 0, sources -1), and
    every verb along the handle the same bits, whatever the padding rows of the
    expert outputs hold; dispatch, combine and their backward too.
    ``emulated``: over the NVSHMEM transport on gloo (:func:`dispatcher`)."""
    from world import current_device

    device = current_device()
    d = dispatcher(config, emulated)
    x, topk_idx, topk_weights = x.to(device), topk_idx.to(device), topk_weights.to(device)
    ref = d.dispatch(x, topk_idx, topk_weights, groups=groups)
    bounds = ref.handle.group_rows
    fullest = max(hi - lo for lo, hi in zip(bounds[:-1], bounds[1:]))
    max_rows = groups * int(slack * fullest)
    work = d.dispatch(x, topk_idx, topk_weights, groups=groups, max_rows=max_rows, async_op=True)
    bound = -(-max_rows // groups)
    parts = [work.wait_group(g) for g in reversed(range(groups))][::-1]
    tokens = torch.cat([p.tokens for p in parts])
    weights = torch.cat([p.weights for p in parts])
    ok = {
        "rows": [p.rows for p in parts] == [(g * bound, (g + 1) * bound) for g in range(groups)],
        "tokens": torch.equal(tokens, padded_groups(ref.tokens, bounds, bound, 0)),
        "weights": torch.equal(weights, padded_groups(ref.weights, bounds, bound, 0)),
        "per_expert": torch.equal(sum(p.tokens_per_expert for p in parts), ref.tokens_per_expert),
    }
    gen = torch.Generator(device=device).manual_seed(1)
    y = torch.randn(ref.tokens.shape, generator=gen, device=device).to(x.dtype)
    junk = torch.full((), float("nan"), dtype=x.dtype)  # the padding rows of the outputs are never read
    y_padded = padded_groups(y, bounds, bound, junk.item())
    sums = d.combine_groups(work.handle, dtype=x.dtype)
    for p in parts:
        sums.add(y_padded[slice(*p.rows)], p.weights)
    ok["combine_groups"] = torch.equal(sums.wait(), d.combine(y, ref.handle, weights=ref.weights))
    moved = d.dispatch_rows(x * 3, work.handle, async_op=True)
    moved = torch.cat([moved.wait_group(g) for g in range(groups)])
    ok["dispatch_rows"] = torch.equal(moved, padded_groups(d.dispatch_rows(x * 3, ref.handle), bounds, bound, 0))
    full = work.wait()
    ok["src"] = torch.equal(full.src_token, padded_groups(ref.src_token, bounds, bound, -1))
    values = torch.randn(ref.tokens.shape[0], generator=gen, device=device)
    ok["combine_slots"] = torch.equal(d.combine_slots(padded_groups(values, bounds, bound, float("nan")),
                                                      work.handle), d.combine_slots(values, ref.handle))
    grads = []  # the differentiable verbs along the padded handle: combine's backward moves by groups too
    for bound_rows in (max_rows, None):
        xg, wg = x.detach().requires_grad_(), topk_weights.detach().requires_grad_()
        out = d.dispatch(xg, topk_idx, wg, groups=groups, max_rows=bound_rows)
        home = d.combine(out.tokens * 2, out.handle, weights=out.weights)
        (home.float() * 3).sum().backward()
        grads.append((home, xg.grad, wg.grad))
    ok["autograd"] = all(torch.equal(a, b) for a, b in zip(*grads))
    d.check()
    return ok


def higher_order_and_async_grad_mode(x, topk_idx, topk_weights, config: dict) -> dict:
    """A round trip's gradients taken with create_graph (a second backward
    through them: what it raised), and an async combine started with grad
    mode on, waited for under no_grad (whether its result has a graph, and x's
    gradient through it against the synchronous combine's)."""
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    got = {}
    xx, ww = x.clone().requires_grad_(), topk_weights.clone().requires_grad_()
    out = d.dispatch(xx, topk_idx, ww)
    y = d.combine(out.tokens * out.tokens, out.handle, weights=out.weights)
    gx, = torch.autograd.grad(y.sum(), xx, create_graph=True)
    try:
        gx.sum().backward()
        got["double backward"] = None
    except RuntimeError as error:
        got["double backward"] = str(error)
    grads = []
    for started in (False, True):
        xx = x.clone().requires_grad_()
        out = d.dispatch(xx, topk_idx, topk_weights)
        work = d.combine(out.tokens * 3, out.handle, weights=out.weights, async_op=started)
        if started:
            with torch.no_grad():
                work = work.wait()
        got["graph" if started else "graph, sync"] = work.requires_grad
        work.sum().backward()
        grads.append(xx.grad)
    got["same gradient"] = torch.equal(*grads)
    return got
