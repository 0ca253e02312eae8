"""Rank functions of test_agreement.py: one rank's own mistake on one verb, and
calls that one rank skips.

Every function runs on every rank of a world and returns what this rank saw:
(the name of what the verb raised or None, its message, seconds the verb took,
whether a good round trip on the same dispatcher afterwards gave the dense
answer).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

import dispatch
from routing import identity_tokens, make_routing
from world import current_device

E = 12  # experts: a multiple of every W of the tests (2, 3, 4)
H = 64


def _routing(world: int, seed: int, more: int = 0):
    routing = make_routing(world, E // world, 2, [5 + r + more for r in range(world)], "random", seed=seed)
    rank = dist.get_rank()
    device = current_device()
    x = identity_tokens(rank, routing.num_tokens[rank], H, torch.float32).to(device)
    return x, routing.topk_idx[rank].to(device), routing.topk_weights[rank].float().to(device)


def _round_trip_is_right(d) -> bool:
    """A good dispatch and combine on ``d``: the combined rows are the dense answer."""
    x, idx, w = _routing(dist.get_world_size(), seed=11)
    out = d.dispatch(x, idx, w)
    home = d.combine(out.tokens, out.handle, weights=out.weights)
    live = idx >= 0 if out.dropped is None else (idx >= 0) & ~out.dropped  # slots over capacity dropped
    return torch.equal(home, x * (w * live).sum(1, keepdim=True))


def _bad(value: torch.Tensor, mistake: str):
    """``value`` spoilt by ``mistake`` (a dtype, a shape, a device)."""
    if mistake == "dtype":
        return value.to(torch.int32) if value.is_floating_point() else value.float()
    if mistake == "shape":
        return value[1:]
    if mistake == "device":
        return value.to("meta")
    if mistake == "layout":
        return value.to_sparse()
    raise AssertionError(mistake)


def _without_board(fn, *args):
    """``fn(*args)`` with the dispatchers it makes agreeing over the host channel
    (a gloo collective) instead of the board: as ranks on several hosts do."""
    from dispatch import agreement

    made, agreement.Board.for_group = agreement.Board.for_group, staticmethod(lambda group: None)
    try:
        return fn(*args)
    finally:
        agreement.Board.for_group = made


def _board_agreeing(compiled: bool, fn, *args):
    """``fn(*args)`` with every board of this process agreeing through the
    compiled agreement (``csrc/host.cpp``'s ``board_agree``: as a process with
    CUDA, or on a host other than x86-64, agrees) or the one in Python, those
    made inside too."""
    from dispatch import board, host

    module = host.built() if compiled else None
    assert module is not None or not compiled, host.why_not()
    boards = [b for b in board.Board._of_group.values() if b is not None]
    before = [b._compiled for b in boards]
    chosen, board.compiled_agreement = board.compiled_agreement, lambda: module
    for b in boards:
        b._compiled = module
    try:
        return fn(*args)
    finally:
        board.compiled_agreement = chosen
        for b, was in zip(boards, before):
            b._compiled = was


def on_board(kind: str, name: str, *args):
    """The rank function ``name`` of this module, its calls agreeing on the
    board in Python (``"board"``), on the compiled board (``"compiled board"``)
    or over the host channel (``"host channel"``)."""
    fn = globals()[name]
    if kind == "host channel":
        return _without_board(fn, *args)
    return _board_agreeing(kind == "compiled board", fn, *args)


def one_rank_mistake(config: dict, verb: str, mistake: str, bad_rank: int):
    """Every rank runs ``verb`` (after the dispatches it moves along); rank
    ``bad_rank`` makes ``mistake`` in it: a dtype, a shape, a device or a
    layout of its tensor argument (the layout also "after a dense call" of the
    same signature), rows of another dispatch than its handle's ("rows versus
    handle"), or a handle of another dispatcher ("handle")."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(world, seed=3)
    mine = rank == bad_rank
    if mistake == "layout after a dense call":  # the checks of a signature are kept: dense first, then sparse
        seen = d.dispatch(x, idx, w)
        d.combine(seen.tokens, seen.handle, weights=seen.weights)
        mistake = "layout"
    if verb == "dispatch":
        args = (_bad(x, mistake), idx, w) if mine else (x, idx, w)
        return _timed(lambda: d.dispatch(*args), d)
    groups = 2 if verb == "combine_groups" else 1
    out = d.dispatch(x, idx, w, groups=groups, async_op=True).wait()
    handle, rows, home_rows, values = out.handle, out.tokens, x, out.weights
    if mistake == "handle":  # every rank dispatches on another dispatcher; one passes that handle
        other = dispatch.create(dispatch.DispatchConfig.from_options(**config))
        foreign = other.dispatch(x, idx, w).handle
        handle = foreign if mine else handle
    elif mistake == "rows versus handle":  # every rank dispatches again, with 3 more tokens
        x2, idx2, w2 = _routing(world, seed=4, more=3)
        second = d.dispatch(x2, idx2, w2)
        if mine:
            rows, home_rows, values = second.tokens, x2, second.weights
    elif mine:
        rows, home_rows, values = _bad(rows, mistake), _bad(home_rows, mistake), _bad(values, mistake)
    call = {
        "combine": lambda: d.combine(rows, handle, weights=out.weights),
        "combine_rows": lambda: d.combine_rows(rows, handle),
        "dispatch_rows": lambda: d.dispatch_rows(home_rows, handle),
        "combine_slots": lambda: d.combine_slots(values, handle),
        "combine_groups": lambda: _combine_groups(d, handle, rows, out.handle),
    }[verb]
    return _timed(call, d)


def refused_by_hand(config: dict, verb: str, bad_rank: int):
    """Every rank dispatches; rank ``bad_rank``'s own loop fails before its next
    call (``verb`` along the handle, "GroupSums.add", or the next "dispatch") and hands the error to
    ``refuse``; the others make that call. Returns as :func:`one_rank_mistake`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(world, seed=3)
    out = d.dispatch(x, idx, w)
    handle, rows = out.handle, out.tokens
    if rank == bad_rank:
        error = RuntimeError("this rank's own loop failed")
        if verb == "GroupSums.add":
            sums = d.combine_groups(handle, dtype=None)
            return _timed(lambda: sums.refuse(error), d)
        return _timed(lambda: d.refuse(verb, None if verb == "dispatch" else handle, error), d)
    call = {
        "dispatch": lambda: d.dispatch(x, idx, w),
        "combine": lambda: d.combine(rows, handle, weights=out.weights),
        "combine_rows": lambda: d.combine_rows(rows, handle),
        "dispatch_rows": lambda: d.dispatch_rows(x, handle),
        "combine_slots": lambda: d.combine_slots(out.weights, handle),
        "combine_groups": lambda: d.combine_groups(handle, dtype=None),
        "GroupSums.add": lambda: d.combine_groups(handle, dtype=None).add(rows),
    }[verb]
    return _timed(call, d)


def moe_layer_mistake(config: dict, bad_rank: int):
    """Every rank runs a ``MoEExchange`` layer; rank ``bad_rank``'s x has a
    dtype its dispatch refuses. Returns as :func:`one_rank_mistake`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(world, seed=3)
    layer = dispatch.MoEExchange(d, lambda rows, counts: rows * 2)
    mine = x.to(torch.int32) if rank == bad_rank else x
    return _timed(lambda: layer(mine, idx, w), d)


def moe_experts_mistake(config: dict, mistake: str, groups: int, bad_rank: int):
    """Every rank runs a ``MoEExchange`` layer by ``groups`` groups; rank
    ``bad_rank``'s experts answer rows its peers' would not: one row too many
    (``"shape"``), integers (``"dtype"``), or no tensor (``"not a tensor"``).
    Returns as :func:`one_rank_mistake`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(world, seed=3)

    def experts(rows, counts):
        y = rows * 2
        if rank != bad_rank:
            return y
        return {"shape": lambda: torch.cat([y, y.new_zeros(1, y.shape[1])]), "dtype": lambda: y.to(torch.int32),
                "not a tensor": lambda: y.tolist()}[mistake]()

    layer = dispatch.MoEExchange(d, experts, groups=groups)
    return _timed(lambda: layer(x, idx, w), d)


class _RaisesInBackward(torch.autograd.Function):
    """Its rows, unchanged; its backward raises (the experts' backward failing on one rank)."""

    @staticmethod
    def forward(ctx, rows):
        return rows.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("the experts' backward failed on this rank")


def moe_experts_raise(config: dict, groups: int, bad_rank: int, bad_group: int, where: str, grads: str):
    """Every rank runs a ``MoEExchange`` layer by ``groups`` groups, forward and
    backward, its experts with a parameter; on rank ``bad_rank`` they raise a
    RuntimeError of their own at group ``bad_group``, in the forward or the
    backward (``where``), with the gradients of ``grads`` ("x", "weights",
    "both" or "none": the parameter's only) asked for. Returns as
    :func:`one_rank_mistake`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(world, seed=3)
    x.requires_grad_(grads in ("x", "both"))
    w.requires_grad_(grads in ("weights", "both"))

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((), 2.0, device=x.device))
            self.calls, self.failing = 0, True

        def forward(self, rows, counts):
            g, self.calls = self.calls % groups, self.calls + 1
            y = rows * self.scale
            if self.failing and rank == bad_rank and g == bad_group:
                if where == "forward":
                    raise RuntimeError("the experts failed on this rank")
                y = _RaisesInBackward.apply(y)
            return y

    experts = Experts()
    layer = dispatch.MoEExchange(d, experts, groups=groups)
    name, message, elapsed, usable = _timed(lambda: layer(x, idx, w).sum().backward(), d)
    # the layer again on every rank, forward and backward: the verbs it makes are in step after the refusal
    experts.failing, experts.calls = False, 0
    out = layer(x, idx, w)
    out.sum().backward()
    dense = x.detach() * 2 * (w.detach() * (idx >= 0)).sum(1, keepdim=True)
    return name, message, elapsed, usable and torch.allclose(out.detach(), dense, rtol=1e-6, atol=1e-6)


def crosswise_adds(config: dict, groups: int, crossing: int):
    """Every rank dispatches by ``groups`` groups and makes two ``combine_groups``
    along its handle, A of the dispatched rows and B of other rows; rank
    ``crossing`` adds each group's rows to B before A, its peers to A before B.
    Returns (the name of what was raised or None, its message, whether both
    sums were those of ``combine_rows``, the round trip after it was right)."""
    rank = dist.get_rank()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(dist.get_world_size(), seed=7)
    out = d.dispatch(x, idx, w, groups=groups, async_op=True).wait()
    handle, tokens = out.handle, out.tokens.detach()
    rows = {"A": tokens, "B": tokens + 100}
    sums = {name: d.combine_groups(handle, dtype=torch.float32) for name in rows}
    try:
        for g in range(groups):
            lo, hi = handle.row_range(g)
            for name in ("B", "A") if rank == crossing else ("A", "B"):
                sums[name].add(rows[name][lo:hi])
        got = {name: s.wait() for name, s in sums.items()}
    except RuntimeError as exc:  # the test inspects what each rank raised
        return type(exc).__name__, str(exc), False, _round_trip_is_right(d)
    right = all(torch.equal(got[name], d.combine_rows(rows[name], handle)) for name in rows)
    return None, "", right, _round_trip_is_right(d)


def rows_differ(config: dict, verb: str, what: str, bad_rank: int):
    """Every rank makes ``verb`` with arguments its own checks pass; rank
    ``bad_rank``'s rows have another dtype (``what="dtype"``) or width
    (``"width"``) than its peers' (``GroupSums.add``: the rows of
    ``combine_groups``' first add; ``combine_groups``: its ``dtype``),
    another ``wire`` (``"wire"``), fp64 weights where its peers' are fp32
    (``"weights"``) or none (``"no weights"``). Returns as :func:`one_rank_mistake`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(world, seed=3)
    out = d.dispatch(x, idx, w)
    mine = rank == bad_rank

    def spoilt(rows):
        return rows if not mine else rows.double() if what == "dtype" else rows[:, : rows.shape[1] // 2]

    if what in ("weights", "no weights"):  # rows alike, the weights not: fp64 on one rank, or none there
        weights = (out.weights.double() if what == "weights" else None) if mine else out.weights
        call = {
            "combine": lambda: d.combine(out.tokens, out.handle, weights=weights),
            "combine_rows": lambda: d.combine_rows(out.tokens, out.handle, weights),
        }[verb]
        return _timed(call, d)
    if what == "wire":  # rows alike, the wire they travel in not
        wire = ("bf16" if verb == "dispatch_rows" else "fp32") if mine else "native"
        call = {
            "dispatch_rows": lambda: d.dispatch_rows(x, out.handle, wire=wire),
            "combine_rows": lambda: d.combine_rows(out.tokens, out.handle, wire=wire),
            "combine_groups": lambda: d.combine_groups(out.handle, dtype=torch.float32, wire=wire),
        }[verb]
        return _timed(call, d)
    call = {
        "combine": lambda: d.combine(spoilt(out.tokens), out.handle, weights=out.weights),
        "combine_rows": lambda: d.combine_rows(spoilt(out.tokens), out.handle),
        "dispatch_rows": lambda: d.dispatch_rows(spoilt(x), out.handle),
        "combine_slots": lambda: d.combine_slots(out.weights.double() if mine else out.weights, out.handle),
        "combine_groups": lambda: d.combine_groups(
            out.handle, dtype=(torch.float64 if what == "dtype" else None) if mine else torch.float32),
        "GroupSums.add": lambda: d.combine_groups(out.handle, dtype=torch.float32).add(spoilt(out.tokens)),
    }[verb]
    return _timed(call, d)


def other_dispatchers_call(config: dict, bad_rank: int):
    """Every rank makes two dispatchers and dispatches on the first; rank
    ``bad_rank`` then combines on the second (with the first's handle), its
    peers on the first. Returns as :func:`one_rank_mistake` (the round trip
    after it on the first dispatcher: the ranks are in step again)."""
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    other = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(dist.get_world_size(), seed=6)
    out = d.dispatch(x, idx, w)
    chosen = other if dist.get_rank() == bad_rank else d
    return _timed(lambda: chosen.combine(out.tokens, out.handle, weights=out.weights), d)


def configs_differ(config: dict, bad_rank: int, field: str, value):
    """Every rank makes a dispatcher; rank ``bad_rank``'s config has ``field``
    = ``value``. Returns (the name of what ``create`` raised or None, its
    message, seconds it took, whether a dispatcher made next with the same
    config on every rank gives the dense answer)."""
    theirs = dict(config, **{field: value}) if dist.get_rank() == bad_rank else config
    start = time.monotonic()
    try:
        dispatch.create(dispatch.DispatchConfig.from_options(**theirs))
        raised = None, ""
    except Exception as exc:  # the test inspects what each rank raised
        raised = type(exc).__name__, str(exc)
    elapsed = time.monotonic() - start
    return *raised, elapsed, _round_trip_is_right(dispatch.create(dispatch.DispatchConfig.from_options(**config)))


def _combine_groups(d, handle, rows, own):
    """Both groups' rows of ``rows`` summed home along ``handle`` (``own``: the
    handle the rows' group bounds come from)."""
    sums = d.combine_groups(handle, dtype=torch.float32)
    lo, hi = own.row_range(0) if own.groups > 1 else (0, rows.shape[0])
    sums.add(rows[lo:hi])
    if own.groups > 1:
        sums.add(rows[hi:])
    return sums.wait()


def _timed(call, d):
    start = time.monotonic()
    try:
        call()
        raised = None
    except Exception as exc:  # the test inspects what each rank raised
        raised = (type(exc).__name__, str(exc))
    elapsed = time.monotonic() - start
    name, message = raised or (None, "")
    return name, message, elapsed, _round_trip_is_right(d)


def skipped_call(config: dict, skipping: int, check: bool = True):
    """Rank ``skipping`` skips the combine_rows along dispatch 1 and makes the
    one along dispatch 2; every other rank makes the one along dispatch 1 (the
    same routing, other rows: a mis-pairing completes silently with the wrong
    rows). ``check=False`` is the mutation: the calls' agreement no longer
    compares the calls. Returns (what the call raised or None, the rows
    returned are those of dispatch 1)."""
    rank = dist.get_rank()
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(dist.get_world_size(), seed=5)
    first = d.dispatch(x, idx, w)
    second = d.dispatch(x + 100, idx, w)
    handle, rows = (second.handle, second.tokens) if rank == skipping else (first.handle, first.tokens)
    if not check:
        from dispatch import agreement

        agreement.check_peer_calls, original = _only_refusals, agreement.check_peer_calls
    try:
        home = d.combine_rows(rows, handle)
    except RuntimeError as exc:
        return type(exc).__name__, str(exc)
    finally:
        if not check:
            agreement.check_peer_calls = original
    expected = d.combine_rows(first.tokens, first.handle)  # (every rank, dispatch 1's rows)
    return None, torch.equal(home, expected)


def _only_refusals(headers) -> None:
    """``agreement.check_peer_calls`` without its comparison of the calls (the mutation)."""
    from dispatch import agreement, plan

    failed = [r for r, h in enumerate(headers) if h[plan.HEADER.index("failed")]]
    if failed:
        raise agreement.PeerRefused(failed, "a call")


def fixed_rows_apart(kind: str):
    """The host channel's rows of the form it takes beside NCCL (``agreement.agree``
    with no counts row), the ranks at calls apart: ``"dispatchers"``, each
    rank at a combine of another dispatcher; ``"create"``, rank 0 agreeing on
    a config at ``create`` while rank 1 is at a dispatcher's combine. Returns
    (the name of what was raised, its message)."""
    from dispatch import agreement, comm, plan

    rank = dist.get_rank()
    place = rank if kind == "dispatchers" else 0
    combine = plan.Ticket(agreement.VERB_CODES["combine"] + agreement.DISPATCHERS * place, 1, 1)
    host = comm.host_group(None)  # the host channel (the world itself on gloo; beside NCCL a gloo group of it)
    try:
        if kind == "create" and rank == 0:
            agreement.agree_config(dispatch.DispatchConfig(num_experts=E), None)
        else:
            agreement.agree(combine, host, dist.get_world_size(), tail=(0,))
    except RuntimeError as exc:  # the test inspects what each rank raised
        return type(exc).__name__, str(exc)
    return None, ""


def grad_modes_differ(config: dict, verb: str, bad_rank: int):
    """Every rank dispatches (and combines) with grad mode on, but rank
    ``bad_rank`` makes ``verb`` with it off. Returns as :func:`one_rank_mistake`."""
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(dist.get_world_size(), seed=12)
    x.requires_grad_(True)
    off = torch.no_grad() if dist.get_rank() == bad_rank else contextlib.nullcontext()
    if verb == "dispatch":
        def call():
            with off:
                d.dispatch(x, idx, w)
        return _timed(call, d)
    out = d.dispatch(x, idx, w)

    def call():
        with off:
            d.combine(out.tokens, out.handle, weights=out.weights)
    return _timed(call, d)


def extra_call(config: dict, extra_rank: int):
    """Rank ``extra_rank`` makes a combine_rows its peers do not make, while they
    dispatch. Returns as :func:`one_rank_mistake` (the round trip after it: the
    ranks in step again)."""
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(dist.get_world_size(), seed=8)
    out = d.dispatch(x, idx, w)
    if dist.get_rank() == extra_rank:
        return _timed(lambda: d.combine_rows(out.tokens, out.handle), d)
    return _timed(lambda: d.dispatch(x, idx, w), d)


def never_calls(config: dict, absent: int):
    """Rank ``absent`` makes the combine_rows its peers make only after their
    timeout: they raise, naming it, within the timeout; it raises when it comes
    (its peers gave up that call); then every rank makes a round trip on the
    same group, which must come out right (the board is in step). Returns
    (what the call raised, its message, seconds, the round trip was right)."""
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(dist.get_world_size(), seed=9)
    out = d.dispatch(x, idx, w)
    if dist.get_rank() == absent:
        time.sleep(1.25 * config["timeout"])  # past their timeout, within the next call's
    return _timed(lambda: d.combine_rows(out.tokens, out.handle), d)


def interrupted_wait(config: dict):
    """On the compiled board: rank 0 waits at a combine_rows that rank 1 makes
    2 s late, and a signal handler raises in rank 0 after 0.3 s (as Ctrl-C
    does): its wait ends there, it withdraws, and rank 1 raises when it comes.
    Returns as :func:`one_rank_mistake`."""
    import signal

    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(dist.get_world_size(), seed=9)
    out = d.dispatch(x, idx, w)
    if dist.get_rank() == 0:
        def alarm(signum, frame):
            raise TimeoutError("interrupted by the test's alarm")

        before = signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        try:
            return _timed(lambda: d.combine_rows(out.tokens, out.handle), d)
        finally:
            signal.signal(signal.SIGALRM, before)
    time.sleep(2.0)
    return _timed(lambda: d.combine_rows(out.tokens, out.handle), d)


def extra_call_on_auto_without_board(config: dict, extra_rank: int):
    """:func:`extra_call` off the board on ``variant="auto"`` whose choice is
    alltoall, whose counts row is wider than the one auto's agreements
    all-gather: an agreement must never meet such a counts exchange (over gloo
    a collective of rows of another width aborts the process)."""
    from dispatch.transports import auto

    modelled = auto.estimate
    auto.estimate = lambda *args: {"alltoall": 0.0, "allgather": 1.0, "hierarchical": 1.0}
    try:
        return _without_board(extra_call, dict(config, variant="auto"), extra_rank)
    finally:
        auto.estimate = modelled


def calls_of_other_shapes(config: dict, bad_rank: int, kind: str):
    """Off the board: rank ``bad_rank`` dispatches on a second dispatcher with
    twice the experts (``"dispatch"``: its counts row is wider) while its peers
    make a combine_rows on the first, or creates a dispatcher (``"create"``)
    while its peers dispatch: over gloo a counts exchange meeting an agreement
    of another width aborts the process; every rank must raise CallsDiffer.
    Returns as :func:`one_rank_mistake`."""
    def mistake():
        d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
        wide = dispatch.create(dispatch.DispatchConfig.from_options(**dict(config, num_experts=2 * E)))
        x, idx, w = _routing(dist.get_world_size(), seed=10)
        out = d.dispatch(x, idx, w)
        if kind == "create":
            bad = lambda: dispatch.create(dispatch.DispatchConfig.from_options(**config))  # noqa: E731
            return _timed(bad if dist.get_rank() == bad_rank else lambda: d.dispatch(x, idx, w), d)
        bad = lambda: wide.dispatch(x, idx, w)  # noqa: E731
        return _timed(bad if dist.get_rank() == bad_rank else lambda: d.combine_rows(out.tokens, out.handle), d)

    return _without_board(mistake)


def wait_in_another_grad_mode(config: dict, bad_rank: int):
    """Every rank dispatches with grad on, async; rank ``bad_rank`` waits under
    ``no_grad``; all combine and go backward with grad on. Returns whether this
    rank's x got its gradient, the seconds it took, and whether a round trip
    after it is right."""
    d = dispatch.create(dispatch.DispatchConfig.from_options(**config))
    x, idx, w = _routing(dist.get_world_size(), seed=6)
    leaf = x.clone().requires_grad_()
    start = time.monotonic()
    work = d.dispatch(leaf, idx, w, async_op=True)
    with torch.no_grad() if dist.get_rank() == bad_rank else contextlib.nullcontext():
        out = work.wait()
    d.combine(out.tokens * 2, out.handle, weights=out.weights).sum().backward()
    return leaf.grad is not None, time.monotonic() - start, _round_trip_is_right(d)
