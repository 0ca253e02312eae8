"""The usual dispatch compiled whole (``dispatch.usual``, ``csrc/host.cpp``'s
``UsualDispatch``), on CPU: the front end over an engine whose buffers are CPU
tensors, its host work issued from C++ on the stand-in driver
(``tests/fake_cuda/libcuda.c``), on a one-rank gloo world. The compiled call
launches what the Python path launches (every kernel, configuration and
argument), hands out the same result, and leaves the call numbers where the
Python path leaves them; it takes a call only of a signature it has seen pass
the checks; where the ranks' agreement differs, a peer refused or never came,
every rank raises as the agreement in Python raises. On a GPU every engine test
runs it (the GPU suite).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import types

import pytest
import torch
import torch.distributed as dist

from dispatch import agreement, cuda, host, plan, usual
from dispatch.board import Board
from dispatch.codec import to_experts_codec
from dispatch.config import DispatchConfig
from dispatch.dispatcher import TokenDispatcher
from dispatch.nvlink import Capacity
from dispatch.pipeline import MoEExchange
from dispatch.transports.base import FAILED, GROUPS, Request, Transport
from dispatch.transports.nvlink import NVLinkTransport
from test_host import _cpu_engine, _counts_words, _Kernel, _Recorder, _Waits

EXPERTS, TOPK, HIDDEN = 8, 4, 64


@pytest.fixture
def one_rank():
    """A one-rank gloo world in this process (its board a page of its own)."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def on_the_stand_in(fake_driver, compiled, monkeypatch):
    """The engine's launches made on CPU and issued from C++ to the stand-in driver."""
    monkeypatch.setattr(host, "module", lambda: compiled)
    monkeypatch.setattr(cuda, "kernel", lambda source, name, *types: _Kernel(source, name))
    monkeypatch.setattr(cuda, "_dependent_launch", lambda device: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "raw_stream", lambda device: 7)
    monkeypatch.setattr(cuda, "capturing", lambda: False)
    monkeypatch.setattr(usual, "usable", lambda d: True)  # (CuPy: not needed by the host path)
    return fake_driver


def _dispatcher(compiled, world: int = 1) -> TokenDispatcher:
    """A dispatcher of the engine on CPU buffers, rank 0 of ``world``, its
    operations eager on stream 7 after an eager one (``nvlink_order``)."""
    config = DispatchConfig(num_experts=EXPERTS, transport="nvlink")
    engine = _cpu_engine(world, EXPERTS, Capacity(64, TOPK, 1024, 512), compiled)
    engine._ordered = lambda writes=True: contextlib.nullcontext()
    engine._eager_raw, engine._last = 0x5EED, (None, 7)  # the eager event, last recorded on stream 7
    engine.device = torch.device("cpu", 0)  # (the current device, as cuda.current_device says here)
    engine.failure_seen, engine._polled_event, engine.reserved = False, None, False
    transport = object.__new__(NVLinkTransport)
    Transport.__init__(transport, config, None)
    transport.engine = engine
    return TokenDispatcher(config, None, transport)


def _inputs(tokens: int, seed: int = 0, topk: int = TOPK):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, EXPERTS, generator=gen).topk(topk, dim=1).indices
    return x, idx, torch.rand(tokens, topk, generator=gen)


def _launched(d: TokenDispatcher, driver, fn, tokens: int, topk: int = TOPK, memory_rows: int = 10**6,
              handle=None) -> tuple[list, object]:
    """(the launches ``fn()`` makes, addresses by the engine's buffer (or, along
    ``handle``, its tables') they fall in, the call's number and its
    dispatcher's place left out; its result), the counts exchange reading every
    rank's memory budget as ``memory_rows``."""
    engine = d.transport.engine
    recorder = _Recorder(_counts_words(1, 0, engine, topk, HIDDEN, tokens, True, True,
                                       torch.Generator().manual_seed(1), memory_rows))
    driver.fake_set_hook(recorder.hook)
    out = fn()
    driver.fake_set_hook(None)  # (the hook is gone once this returns)
    recorder.regions = dict(scratch=engine._scratch, data=engine._data, seq=engine._seq, status=engine.status,
                            counter=engine._counter, meta_ptrs=engine._meta_ptrs, data_ptrs=engine._data_ptrs)
    if handle is not None:  # (its presum first: it lies inside the tables of a compiled dispatch)
        counts = handle.counts
        recorder.regions = dict(presum=handle.presum, tokens_at=counts.tokens_at, words=counts.words,
                                weights=handle.places[0], **recorder.regions)
    seen = []
    for *config, args in recorder.seen():
        args = {p: v % agreement.DISPATCHERS if p == "verb" else v for p, v in args.items() if p != "call"}
        seen.append((*config, args))
    return seen, out


def _same_handles(got, want) -> None:
    """Handles alike field by field: their type and every field (tensors by shape
    and dtype, the counts by their host read), the owner and transport the same
    objects."""
    assert type(got) is type(want) and got.__dict__.keys() == want.__dict__.keys()
    for name, a in got.__dict__.items():
        b = want.__dict__[name]
        if name in ("owner", "transport"):
            assert type(a) is type(b), name
        elif name == "counts":
            assert (a.host[:3], a.bound, a.received, a.staged) == (b.host[:3], b.bound, b.received, b.staged)
        elif name in ("link", "places"):
            assert [(t.shape, t.dtype) for t in ((a,) if name == "link" else a) if t is not None] == \
                [(t.shape, t.dtype) for t in ((b,) if name == "link" else b) if t is not None], name
        elif isinstance(a, torch.Tensor):
            assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        else:
            assert a == b, name


@pytest.mark.parametrize("learnt", [False, True])
def test_a_failure_read_with_the_counts_is_remembered(one_rank, on_the_stand_in, compiled, learnt):
    """A failure the kernels recorded, read with a dispatch's counts (by the
    compiled call where one is ``learnt``, else in Python): raised, and seen for
    good, so that the rank's next dispatch says so in its word (its peers raise
    at that dispatch's agreement, not at the timeout of an exchange it does not
    make) and raises its own failure again."""
    d = _dispatcher(compiled)
    x, idx, w = _inputs(37)
    words = _counts_words(1, 0, d.transport.engine, TOPK, HIDDEN, 37, True, True, torch.Generator().manual_seed(1))
    recorder = _Recorder(words)
    on_the_stand_in.fake_set_hook(recorder.hook)  # (held here: the driver calls it)
    with torch.no_grad():
        if learnt:
            d.dispatch(x, idx, w)
            assert _compiled_calls(d) == 1
        words[:3] = torch.tensor([1, 0, 0])  # rank 0 timed out waiting for rank 0, in the counts exchange
        with pytest.raises(RuntimeError, match="timed out waiting for rank 0 in the counts exchange"):
            d.dispatch(x, idx, w)
        assert d.transport.engine.failure_seen and d.transport.dispatch_word(x, w, None) & FAILED
        engine = d.transport.engine
        engine.status[0], engine._last = 1, None  # (as the kernels left it; no event to wait for on the stand-in)
        with pytest.raises(RuntimeError, match="timed out waiting"):
            d.dispatch(x, idx, w)


@pytest.mark.parametrize("verb", ["dispatch", "combine"])
def test_another_current_device_is_refused_before_the_calls_agreement(one_rank, on_the_stand_in, compiled, verb):
    """With another CUDA device current than its dispatcher's, a rank refuses a
    dispatch or a combine on its own, where a compiled call of its signature is
    learnt too: it takes part in the call's agreement marked refused (its peers
    raise PeerRefused there) and launches nothing; with its device current
    again, the calls go on."""
    d = _dispatcher(compiled)
    x, idx, w = _inputs(37)
    recorder = _Recorder(_counts_words(1, 0, d.transport.engine, TOPK, HIDDEN, 37, True, True,
                                       torch.Generator().manual_seed(1)))
    on_the_stand_in.fake_set_hook(recorder.hook)  # (held here: the driver calls it)
    with torch.no_grad():
        out = d.dispatch(x, idx, w)
        d.combine(out.tokens, out.handle, out.weights)
        out = d.dispatch(x, idx, w)  # (the compiled calls learnt)
        agreed, agree = [], d._calls.agree
        d._calls.agree = lambda ticket, *args, **kwargs: agreed.append(ticket.refused) or agree(ticket, *args, **kwargs)
        recorder.launches.clear()
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(cuda, "current_device", lambda: 1)
            with pytest.raises(ValueError, match="the current CUDA device is 1, the dispatcher's is 0"):
                d.dispatch(x, idx, w) if verb == "dispatch" else d.combine(out.tokens, out.handle, out.weights)
        assert agreed == [True] and recorder.launches == []
        if verb == "dispatch":
            out = d.dispatch(x, idx, w)
        back = d.combine(out.tokens, out.handle, out.weights)
    assert back.shape == (37, HIDDEN) and recorder.launches


def _compiled_calls(d: TokenDispatcher) -> int:
    return len(d._usual._calls)


@pytest.mark.parametrize("weighted", [True, False])
@pytest.mark.parametrize("grad", [True, False])
def test_the_compiled_round_trip_launches_and_hands_out_what_the_python_path_does(
        one_rank, on_the_stand_in, compiled, grad, weighted):
    """A dispatch of a signature seen once takes the compiled call, and so does a
    combine along its handle once one of its signature passed: the same launches
    as the Python path's (the header with its grad mode, budgets and flags),
    the same results and handle, the autograd nodes where grad mode asks, the
    next calls numbered as the Python path numbers them (from 1 again past
    ``agreement.CALL_WRAP``: the kernels take an int32)."""
    tokens = 37
    x, idx, w = _inputs(tokens)
    x.requires_grad_(grad)
    d, reference = _dispatcher(compiled), _dispatcher(compiled)
    reference._usual = None  # the Python path, every call
    for one in (d, reference):  # the calls numbered up to agreement.CALL_WRAP, then from 1 again
        one._calls._made[agreement.VERB_CODES["dispatch"]] = agreement.CALL_WRAP - 2
        one._calls._made[agreement.VERB_CODES["combine"]] = agreement.CALL_WRAP - 1
    taken, result, combine, planned = [], d._usual._result, d._usual.combine, d.transport.planned
    d.transport.planned = lambda *args: taken.append("planned") or planned(*args)
    d._usual._result = lambda *args: taken.append("dispatch") or result(*args)
    d._usual.combine = lambda *args: (lambda out: out is not None and taken.append("combine") or out)(combine(*args))
    with torch.set_grad_enabled(grad):
        for call in (1, 2, 3):
            seen = {}
            for name, one in (("compiled", d), ("python", reference)):
                seen[name] = _launched(one, on_the_stand_in, lambda one=one: one.dispatch(x, idx, w), tokens)
            assert len(d._usual._calls) == 1  # learnt at the first call, taken at the next
            assert seen["compiled"][0] == seen["python"][0], f"call {call}"
            got, want = seen["compiled"][1], seen["python"][1]
            for field in ("tokens", "tokens_per_expert", "weights", "src_rank", "src_token"):
                a, b = getattr(got, field), getattr(want, field)
                assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad), field
            assert torch.equal(got.tokens_per_expert_host, want.tokens_per_expert_host)
            _same_handles(got.handle, want.handle)
            assert (got.handle.link is None) == (want.handle.link is None) == (not grad)
            assert got.stats == want.stats and got.dropped is want.dropped is None
            assert got.__dict__.keys() == want.__dict__.keys()
            y = torch.randn(got.handle.num_rows, HIDDEN).to(torch.bfloat16).requires_grad_(grad)
            back = [_launched(one, on_the_stand_in, lambda one=one, r=r: one.combine(
                y, r.handle, r.weights if weighted else None), tokens, handle=r.handle)
                for one, r in ((d, got), (reference, want))]
            assert back[0][0] == back[1][0], f"call {call}"
            a, b = back[0][1], back[1][1]
            assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad)
        # the dispatch compiled from the second call; the combine along its handle from the third (the first
        # along a compiled dispatch's handle passed in Python)
        # (the transport's plan only in the first: the compiled calls make their handle and result themselves)
        assert taken == ["planned", "dispatch", "dispatch", "combine"]
        assert d._calls._made.tolist() == reference._calls._made.tolist()
        assert d._calls._made[agreement.VERB_CODES["dispatch"]] == 1 and d._calls._made[agreement.VERB_CODES["combine"]] == 2


def test_a_compiled_combine_moves_only_along_handles_it_was_made_for(one_rank, on_the_stand_in, compiled):
    """A compiled dispatch whose counts exchange finds a rank short of its memory
    budget leaves the rest to the front end (its exact budget, then its tables):
    a combine along its handle runs in Python. A combine compiled along handles
    of one J (the pre-sum table's width: K = 4 here) does not move along those
    of another (K = 2): the front end does, and learns it. Each launch as the
    Python path's."""
    d, reference = _dispatcher(compiled), _dispatcher(compiled)
    reference._usual = None
    taken, combine = [], d._usual.combine
    d._usual.combine = lambda *args: (lambda out: out is not None and taken.append(1) or out)(combine(*args))
    # (K, the memory budget the counts exchange reads, whether the handle has a core, combines compiled taken so far)
    steps = ((4, 10**6, False, 0), (4, 10**6, True, 0), (4, 10**6, True, 1), (4, 1, False, 1),
             (2, 10**6, False, 1), (2, 10**6, True, 1), (2, 10**6, True, 2))
    for topk, memory_rows, core, combined in steps:
        x, idx, w = _inputs(37, topk=topk)
        got = {}
        for name, one in (("compiled", d), ("python", reference)):
            got[name] = _launched(one, on_the_stand_in, lambda one=one: one.dispatch(x, idx, w), 37, topk, memory_rows)
        assert got["compiled"][0] == got["python"][0]
        out = got["compiled"][1]
        assert (out.handle.counts.core is not None) == core
        y = torch.randn(out.handle.num_rows, HIDDEN).to(torch.bfloat16)
        back = [_launched(one, on_the_stand_in, lambda one=one, r=r: one.combine(y, r.handle, r.weights), 37, topk,
                          handle=r.handle)[0] for one, r in ((d, out), (reference, got["python"][1]))]
        assert back[0] == back[1] and len(taken) == combined, (topk, memory_rows)
    assert len(d._usual._combines) == 2  # one a J, each learnt once


@pytest.mark.parametrize("grad", [True, False])
def test_a_layer_of_one_group_takes_the_compiled_calls(one_rank, on_the_stand_in, compiled, grad):
    """``MoEExchange`` with one group (nothing to overlap) dispatches and combines
    through the plain verbs, so that its calls take the compiled ones as a
    user's own ``dispatch`` and ``combine`` do: the same launches as the layer
    over the Python path, call by call."""
    tokens = 37
    x, idx, w = _inputs(tokens)
    d, reference = _dispatcher(compiled), _dispatcher(compiled)
    reference._usual = None
    taken, result, combine, planned = [], d._usual._result, d._usual.combine, d.transport.planned
    d.transport.planned = lambda *args: taken.append("planned") or planned(*args)
    d._usual._result = lambda *args: taken.append("dispatch") or result(*args)
    d._usual.combine = lambda *args: (lambda out: out is not None and taken.append("combine") or out)(combine(*args))
    layers = {one: MoEExchange(one, lambda rows, counts: rows) for one in (d, reference)}
    with torch.set_grad_enabled(grad):
        for call in (1, 2, 3):
            seen = [_launched(one, on_the_stand_in, lambda one=one: layers[one](
                x.detach().requires_grad_(grad), idx, w.detach().requires_grad_(grad)), tokens)
                for one in (d, reference)]
            assert seen[0][0] == seen[1][0], f"call {call}"
            a, b = seen[0][1], seen[1][1]
            assert (a.shape, a.dtype, a.requires_grad) == (b.shape, b.dtype, b.requires_grad) == \
                ((tokens, HIDDEN), torch.bfloat16, grad)
    assert taken == ["planned", "dispatch", "dispatch", "combine"]
    assert d._calls._made.tolist() == reference._calls._made.tolist()


def test_the_compiled_dispatch_takes_only_a_signature_it_has_seen(one_rank, on_the_stand_in, compiled):
    """Another T or dtype, a tensor subclass, a non-contiguous x: the compiled
    call does nothing (not even its number), the front end takes the call and
    learns the new signature once it passed (a signature learnt once, not again
    where a call of it took the front end for another reason); on another stream
    than the engine's latest operation, it takes the call after that stream
    waits for it; a dispatch by groups never reaches it."""
    d = _dispatcher(compiled)
    x, idx, w = _inputs(37)
    recorder = _Recorder(_counts_words(1, 0, d.transport.engine, TOPK, HIDDEN, 37, True, True,
                                       torch.Generator().manual_seed(1)))
    on_the_stand_in.fake_set_hook(recorder.hook)  # (held here: the driver calls it)
    d.dispatch(x, idx, w)
    fast = d._usual._calls[0][0]
    made = d._calls._made.tolist()
    for args in ((x[:20], idx[:20], w[:20]), (x.float(), idx, w), (x, idx.int(), w), (x, idx, w.double()),
                 (x.as_subclass(_Sub), idx, w), (x.t().contiguous().t(), idx, w)):
        assert fast.dispatch(*args, 7) is None
    assert d._calls._made.tolist() == made
    d.dispatch(x[:20], idx[:20], w[:20])  # passed in Python: learnt
    assert _compiled_calls(d) == 2
    engine, waits = d.transport.engine, []
    last = engine._last
    taken, result = [], d._usual._result
    d._usual._result = lambda *args: taken.append(1) or result(*args)
    with pytest.MonkeyPatch.context() as patch:  # on another stream than the engine's last operation (a layer's
        patch.setattr(cuda, "raw_stream", lambda device: 8)  # backward on its communication stream): that stream
        patch.setattr(cuda, "current_stream", lambda device: _Waits(waits))  # waits for it, the compiled call takes
        d.dispatch(x, idx, w)  # it there (its own stand-in order: the Python path's is not kept here)
    assert waits == [last[0]] and engine._last[1] == 8 and taken == [1]
    assert _compiled_calls(d) == 2
    d._usual._result, engine._last = result, last  # (back on the stand-in's stream 7)
    made = d._calls._made[agreement.VERB_CODES["dispatch"]]
    d._usual._calls = [(None, None, None, None)]  # (any call that reached it would raise)
    d.dispatch(x, idx, w, groups=2)
    assert d._calls._made[agreement.VERB_CODES["dispatch"]] == made + 1


class _Sub(torch.Tensor):
    """A tensor subclass (its own torch functions): the front end's to take."""


def _peer(words: mmap.mmap, row: list[int] | None, got: list, board: Board | None = None) -> threading.Thread:
    """Rank 1 of a two-rank board on ``words`` (or its ``board``), agreeing on ``row`` in Python (None: never there)."""
    board = board or Board(words, 2, 1)

    def run():
        try:
            got.append(board.agree(row, 5.0, lambda: "the call", len(row)))
        except RuntimeError as error:
            got.append(error)

    thread = threading.Thread(target=run)
    if row is not None:
        thread.start()
    return thread


def _two_ranks(compiled, timeout: float):
    """Rank 0 of two: (its engine on CPU buffers, its call counts, the board's
    page, its board, its compiled dispatch of ``_inputs(37)``'s signature)."""
    engine = _cpu_engine(2, EXPERTS, Capacity(64, TOPK, 1024, 512), compiled)
    counter = torch.zeros(len(agreement.VERBS), dtype=torch.int64)
    words = mmap.mmap(-1, 2 * 2 * Board.slot * 8)
    board = Board(words, 2, 0)
    x, idx, w = _inputs(37)
    codec = to_experts_codec("native", x.dtype)
    fits, _, _, words_n, _, launchers, _ = engine.counts_launches(37, TOPK, idx.dtype, torch.float32, codec, HIDDEN)
    shape, layout, counts = launchers
    pull = engine.own_pull(codec, x, TOPK, (TOPK, torch.float32))
    fast = compiled.UsualDispatch(
        shape=shape, layout=layout, counts=counts, pull=pull[0], pull_cap=pull[1], pull_min=pull[2],
        rows_per_block=pull[3], hidden=HIDDEN, device=x.device, x_dtype=x.dtype, idx_dtype=idx.dtype,
        weights_dtype=w.dtype, wire_dtype=torch.float32, verb=agreement.VERB_CODES["dispatch"],
        grad_off=agreement.GRAD_OFF, call_wrap=agreement.CALL_WRAP, verb_col=0, call_col=1,
        call_row=[*plan.call_header(plan.Ticket()), 0],
        header=plan.header(x, w, TOPK), x_grad_bit=2, weights_grad_bit=4, raise_bits=usual.RAISE_BITS,
        made_at=counter.data_ptr() + 8 * agreement.VERB_CODES["dispatch"], board_words=board.words_at,
        board_count=board.count_at, board_slot=Board.slot, timeout=timeout, row_bytes=256,
        allocator=False, age=0.1, row_at=engine._zeroed(words_n).data_ptr(), host_words=engine._host_words,
        check_values=True, width=TOPK, stage=fits, record=0)
    return engine, counter, words, board, fast


@pytest.mark.parametrize("peer", ["same call", "same call, x's gradient", "another call", "a dispatch that failed",
                                  "by two groups", "refused", "missing"])
def test_the_compiled_agreement_stops_where_the_ranks_differ(on_the_stand_in, compiled, peer):
    """Rank 0's compiled dispatch beside rank 1 agreeing on the board in Python:
    at the same call (its gradients its own) it plans; where rank 1 is at
    another call, saw a dispatch fail, dispatches by groups or refused, it stops
    at the agreement with every rank's row, from which the agreement's checks
    (or the transport's, of the words) raise as in Python; a peer that never
    comes: it gives up within the timeout, naming it."""
    engine, counter, words, board, fast = _two_ranks(compiled, 0.3 if peer == "missing" else 5.0)
    x, idx, w = _inputs(37)
    ticket = plan.Ticket(agreement.VERB_CODES["dispatch"] + agreement.GRAD_OFF, 1)  # (made with grad mode off)
    row = [*plan.call_header(ticket), 0]
    if peer == "same call, x's gradient":
        row[-1] = 2
    elif peer == "another call":
        row[1] = 2
    elif peer == "a dispatch that failed":
        row[-1] = FAILED
    elif peer == "by two groups":
        row[-1] = GROUPS
    elif peer == "refused":
        row[plan.HEADER.index("failed")] = 1
    got: list = []
    thread = _peer(words, None if peer == "missing" else row, got)
    recorder = _Recorder(_counts_words(2, 0, engine, TOPK, HIDDEN, 37, True, True, torch.Generator().manual_seed(1)))
    on_the_stand_in.fake_set_hook(recorder.hook)
    with torch.no_grad():
        what, number, out = fast.dispatch(x, idx, w, 7)[:3]
    if thread.is_alive() or thread.ident is not None:
        thread.join()
    assert number == 1 and counter[agreement.VERB_CODES["dispatch"]] == 1
    launched = [name for name, *_ in recorder.launches]
    if peer.startswith("same call"):
        assert what == "planned" and launched == ["route_layout", "exchange_counts", "pull_rows"]
        assert got[0][0] == [*row[:-1], 0]  # rank 0's row as rank 1 read it
        return
    assert launched == []  # nothing moved
    if peer == "missing":
        assert what == "gave up" and out == ([1], [])
        with pytest.raises(RuntimeError, match=r"peer missing: rank\(s\) \[1\]"):
            raise RuntimeError(Board.message(*out, "dispatch #1", 0.3))
        return
    assert what == "differ" and out[1] == row and got[0][1] == row
    error = {"another call": agreement.CallsDiffer, "a dispatch that failed": None, "by two groups": None,
             "refused": agreement.PeerRefused}[peer]
    if error is None:  # the agreement's rows agree; the words ask the transport to raise (transports.base)
        agreement.check_peer_calls([r[: len(plan.HEADER)] for r in out])
        rank_0 = types.SimpleNamespace(check=lambda: None)  # (a transport that has seen no failure of its own)
        request = Request(None, x, idx, w, ticket, False, agreed=tuple(r[-1] for r in out))
        with pytest.raises((RuntimeError, ValueError), match="failed: rank" if out[1][-1] & FAILED else
                           r"groups: every rank .* same groups; got rank 0: 1, rank 1: 2"):
            Transport.agreed_words(rank_0, request)
    else:
        with pytest.raises(error):
            agreement.check_peer_calls([r[: len(plan.HEADER)] for r in out])


@pytest.mark.parametrize("peer", ["the same rows", "rows of another dtype", "no weights"])
def test_the_compiled_combine_agrees_as_the_combine_in_python(on_the_stand_in, compiled, peer):
    """Rank 0's compiled combine along its compiled dispatch's handle beside rank 1
    agreeing in Python: with the same rows' dtype, width and weights it pushes
    and sums home; where rank 1's differ, it stops at the agreement, and the
    checks of the rows raise as in Python, naming them. Rows not of its
    signature (dtype, weights or none, a misaligned address, a gradient its
    handle cannot give) it leaves to the front end, unnumbered."""
    from dispatch import checks
    from dispatch.nvlink_moves import partial_row_bytes

    engine, counter, words, board, fast = _two_ranks(compiled, 5.0)
    x, idx, w = _inputs(37)
    peer_board, got = Board(words, 2, 1), []
    dispatch_row = [*plan.call_header(plan.Ticket(agreement.VERB_CODES["dispatch"] + agreement.GRAD_OFF, 1)), 0]
    recorder = _Recorder(_counts_words(2, 0, engine, TOPK, HIDDEN, 37, True, True, torch.Generator().manual_seed(1)))
    on_the_stand_in.fake_set_hook(recorder.hook)  # (held here: the driver calls it)
    thread = _peer(words, dispatch_row, got, peer_board)
    with torch.no_grad():
        what, _, _, core = fast.dispatch(x, idx, w, 7)
    thread.join()
    assert what == "planned" and core.call == 1 and core.every_rank_rows and core.rows > 0
    engine.ensure(Capacity(64, TOPK, 0, partial_row_bytes(torch.float32, HIDDEN)))
    push, home = engine.home_launches(torch.bfloat16, torch.float32, torch.float32, HIDDEN, TOPK, torch.float32)
    combine = agreement.VERB_CODES["combine"]
    mine = [*plan.call_header(plan.Ticket(), 1, HIDDEN, checks.FLOAT_CODES[torch.float32]), 0]
    fields = dict(
        push=push, home=home, hidden=HIDDEN, device=x.device, dtype=torch.bfloat16, weighted=True,
        weights_dtype=torch.float32, width=TOPK, verb=combine, grad_off=agreement.GRAD_OFF,
        call_wrap=agreement.CALL_WRAP, verb_col=0, call_col=1, along_col=2,
        call_row=mine, made_at=counter.data_ptr() + 8 * combine, board_words=board.words_at,
        board_count=board.count_at, board_slot=Board.slot, timeout=5.0, world=2, rank=0, capacity_tokens=64,
        capacity_topk=TOPK, blocks=8, sms=2, rows_per_block=4, record=0)
    usual_combine = compiled.UsualCombine(**fields)
    no_width = {k: v for k, v in fields.items() if k != "width"}
    for wrong, told in ((dict(fields, smz=2), "unknown fields"), (no_width, "no width")):
        with pytest.raises(ValueError, match=told):  # (every field by its name, once: as CountsShape's)
            compiled.UsualCombine(**wrong)
    y, weights = torch.randn(core.rows, HIDDEN).to(torch.bfloat16), torch.rand(core.rows)
    theirs = list(mine)
    theirs[:3] = [combine + agreement.GRAD_OFF, 1, 1]
    if peer == "rows of another dtype":
        theirs[plan.HEADER.index("x_dtype")] = 2
    elif peer == "no weights":
        theirs[plan.HEADER.index("weights_dtype")] = -1
    assert usual_combine.combine(y.float(), weights, core, False, 7) is None  # not its signature
    assert usual_combine.combine(y, None, core, False, 7) is None
    misaligned = torch.empty(core.rows * HIDDEN + 1, dtype=torch.bfloat16)[1:].view(core.rows, HIDDEN)
    assert usual_combine.combine(misaligned, weights, core, False, 7) is None  # (the kernels load 16 bytes at once)
    with torch.enable_grad():  # a gradient that a dispatch with grad mode off does not give: the front end raises
        assert usual_combine.combine(y.clone().requires_grad_(), weights, core, False, 7) is None
    recorder = _Recorder(torch.zeros(1, dtype=torch.int32))
    on_the_stand_in.fake_set_hook(recorder.hook)
    thread = _peer(words, theirs, got, peer_board)
    with torch.no_grad():
        what, number, out = usual_combine.combine(y, weights, core, False, 7)
    thread.join()
    assert number == 1 and counter[combine] == 1
    if peer == "the same rows":
        assert what == "done" and (out.shape, out.dtype) == ((37, HIDDEN), torch.bfloat16)
        assert [name for name, *_ in recorder.launches] == ["push_partials", "home_sum"]
        return
    assert what == "differ" and recorder.launches == []
    agreement.check_peer_calls([r[: len(plan.HEADER)] for r in out])  # the same call
    with pytest.raises(ValueError, match="expert_out" if peer == "rows of another dtype" else "weights"):
        checks.check_peer_rows([r[: len(plan.HEADER)] for r in out], "expert_out")
