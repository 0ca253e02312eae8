"""The engine's compiled host path (``csrc/host.cpp``, ``dispatch.host``) on CPU.

What a compiled launch hands the driver is held to the Python packer, byte for
byte, for every kernel of csrc/; and on a stand-in driver
(``tests/fake_cuda/libcuda.c``), an engine's counts exchange, pull and combine
issued from C++ are held to the same issued from Python: every launch's
configuration and arguments, and what the host reads back. Where the module
cannot be built here (no compiler, ninja or ``cuda.h``) these skip. On a GPU
the results of both are held bitwise to NCCL's (``bench/engine_one_gpu.py
--check``, and the GPU suite: every engine test runs the compiled path).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import struct

import pytest
import torch

from dispatch import cuda, host, plan
from dispatch.codec import to_experts_codec
from dispatch.nvlink import HostCounts, SENDS_COL, Capacity, Engine

SIGNATURES = cuda.signatures()


class _Kernel:
    """A kernel of csrc/ without CuPy: its signature, a block size, and for a
    function handle its signature's id (``_KERNELS``)."""

    def __init__(self, source: str, name: str) -> None:
        self.signature, self.threads, self.name = cuda.signature(source, name), 128, name

    def handle(self, device: int) -> int:
        return id(self.signature)

    def bind(self, **bound) -> cuda.Launch:
        return cuda.Launch(self, bound)

    def __call__(self, blocks: int, shared: int = 0, **args) -> None:
        self.bind()(blocks, shared, **args)


_KERNELS = {id(sig): (name, sig) for (_, name), sig in SIGNATURES.items()}  # function handle -> kernel


@pytest.fixture
def no_gpu(compiled, monkeypatch):
    """The compiled path made on CPU: the module built here, launches never issued."""
    monkeypatch.setattr(host, "module", lambda: compiled)
    monkeypatch.setattr(cuda, "_dependent_launch", lambda device: False)
    monkeypatch.setattr(cuda, "kernel", lambda source, name, *types: _Kernel(source, name))


def _values(sig: cuda.Signature) -> dict:
    pointer = torch.zeros(3)
    return {param: ((pointer, None, 4096)[i % 3] if i in sig.pointers else 0.25 * i if code in "fd" else i + 1)
            for i, (param, code) in enumerate(zip(sig.names, sig.codes))}


def test_a_compiled_launch_hands_the_driver_the_python_block(no_gpu):
    """For every kernel of csrc/, bound or free, in the signature's order or any
    other: the bytes a compiled launch patches and hands the driver are those the
    signature's layout packs from the same arguments."""
    for (source, name), sig in SIGNATURES.items():
        args = _values(sig)
        want = cuda.parameter_block(sig.codes)[0].pack(*cuda.arguments(sig, args))
        for free in (sig.names, sig.names[1::2], ()):
            launch = _Kernel(source, name).bind(**{n: v for n, v in args.items() if n not in free})
            for order in (None, tuple(reversed(free))):
                names = launch.free if order is None else order
                launcher = launch.compiled(0, order)
                given = cuda._gatherer(sig, names)({n: args[n] for n in names})
                assert launcher.block_of(given) == want, f"{source}:{name} free {names}"


def test_a_compiled_launch_takes_its_free_names_and_no_others(no_gpu):
    launch = _Kernel("layout.cu", "exchange_counts").bind(me=0, world=2)
    with pytest.raises(TypeError, match="free parameters"):
        launch.compiled(0, ("me", *launch.free[1:]))
    with pytest.raises(TypeError, match="free parameters"):
        launch.compiled(0, launch.free[1:])
    launcher = launch.compiled(0)
    with pytest.raises(ValueError, match="one value a free parameter"):
        launcher.block_of((0,) * (len(launch.free) - 1))


def _cpu_engine(world: int, experts: int, capacity: Capacity, compiled=None) -> Engine:
    """An Engine of rank 0 whose buffers are CPU tensors (no peers, no kernels run),
    its host work issued from ``compiled`` (None: from Python)."""
    from test_engine_launches import _cpu_engine as made

    engine = made(world, experts, capacity)
    engine.sms = 7  # of a budget of 8 blocks: a row grid meets its floor, or its cap (the rows of a case decide)
    if compiled is not None:
        engine._host = compiled
        engine._host_words = torch.empty(4 + engine.world * engine.row_len, dtype=torch.int32)
    return engine


@pytest.mark.parametrize("tokens", [0, 37])
def test_the_compiled_counts_exchange_binds_what_the_engine_binds(no_gpu, tokens):
    """The counts exchange's compiled launches take, in the order csrc/host.cpp
    passes them, exactly the free names of the engine's own launches of that
    shape (the layout's none where T = 0), and its shape the engine's columns."""
    engine = _cpu_engine(4, 32, Capacity(64, 4, 1024, 512), host.built())
    codec = to_experts_codec("native", torch.bfloat16)
    fits, layout, counts, words, sizes, compiled, _ = engine._counts_launches(
        tokens, 4, torch.int64, torch.float32, codec, 512, 1)
    shape, layout_c, counts_c = compiled
    assert (layout is None) == (layout_c is None) == (tokens == 0)
    assert sorted(host.COUNTS_FREE) == sorted(counts.launch.free)
    if tokens:
        assert sorted(host.LAYOUT_FREE) == sorted(layout.launch.free)
    assert (shape.world, shape.rank, shape.row_len, shape.counts_col, shape.experts_per_rank) == (
        4, 0, engine.row_len, engine.counts_col, 8)
    assert shape.sizes == list(sizes)


def test_the_host_counts_sum_every_ranks_row():
    """``HostCounts.read``: every rank's header and sends as read, the rows
    each rank receives (its experts' columns summed over the sources), and this
    rank's rows of each of its experts."""
    world, experts, rank = 3, 6, 1
    engine = _cpu_engine(world, experts, Capacity())
    engine.rank = rank
    local = experts // world
    gen = torch.Generator().manual_seed(0)
    matrix = torch.randint(0, 9, (world, engine.row_len), generator=gen).tolist()
    got = HostCounts.read(matrix, rank, local)
    assert isinstance(got, HostCounts)
    assert got.headers == tuple(r[: len(plan.HEADER)] for r in matrix)
    assert got.sends == tuple(tuple(r[SENDS_COL : SENDS_COL + world]) for r in matrix)
    counts = torch.tensor([r[engine.counts_col :] for r in matrix])  # [source, expert]
    assert list(got.rows) == counts.view(world, world, local).sum((0, 2)).tolist()
    assert torch.equal(got.per_expert, counts[:, rank * local : (rank + 1) * local].sum(0))


@pytest.mark.parametrize("seed", range(60))
def test_the_compiled_usual_case_is_where_the_checks_pass_and_say_nothing(no_gpu, seed):
    """``usual`` (csrc/host.cpp), by which the compiled counts exchange skips the
    host's checks of every rank's header and budgets, holds exactly where those
    checks (``checks.check_peer_headers``, ``checks.check_row_budgets``) pass
    without a word: headers agreeing, none failed, every rank within budget."""
    from dispatch import checks

    world = 3
    engine = _cpu_engine(world, 6, Capacity(64, 4, 1024, 512), host.built())
    codec = to_experts_codec("native", torch.bfloat16)
    shape = engine._counts_launches(8, 4, torch.int64, torch.float32, codec, 512, 1)[5][0]
    gen = torch.Generator().manual_seed(seed)
    pick = lambda *choices: choices[int(torch.randint(len(choices), (1,), generator=gen))]  # noqa: E731
    header = [1, 3, 0, 4, 512, 1, 2, 1, 0, 0, -1, 10**6]
    rows, rows_of = [], []
    for r in range(world):
        h = list(header)
        column = pick(None, None, None, *plan.HEADER)
        if column is not None:
            h[plan.HEADER.index(column)] = pick(0, 1, 2, 30, 2000)
        rows.append(h + [0] * (engine.row_len - len(h)))
        rows_of.append(pick(0, 5, 40, 3000))
    quiet = True
    try:
        checks.check_peer_headers(rows)
        checks.check_row_budgets([r[: len(plan.HEADER)] for r in rows], rows_of, 1024)
    except (ValueError, RuntimeError):
        quiet = False
    failed = any(r[plan.HEADER.index("failed")] for r in rows)
    usual = host.built().usual(shape, [w for r in rows for w in r], rows_of)
    assert usual == (quiet and not failed)


def test_a_compiled_launch_refuses_a_value_its_c_type_does_not_hold(no_gpu):
    """As struct.pack refuses it for a Python launch: an int past 32 bits, a
    negative unsigned, a float for an integer."""
    sig = cuda.signature("layout.cu", "exchange_counts")
    launch = _Kernel("layout.cu", "exchange_counts").bind()
    launcher = launch.compiled(0)
    good = cuda._gatherer(sig, launch.free)(_values(sig))
    launcher.block_of(good)
    me = launch.free.index("me")  # an int
    meta = launch.free.index("meta_ptrs")  # a pointer
    layout = cuda.parameter_block(sig.codes)[0]
    for place, value in ((me, 2**31), (me, -2**31 - 1), (meta, -1), (me, 1.5)):
        wrong = tuple(value if i == place else v for i, v in enumerate(good))
        with pytest.raises((ValueError, TypeError, OverflowError)):
            launcher.block_of(wrong)
        with pytest.raises(struct.error):  # as the Python launch refuses it
            layout.pack(*wrong)
    widest = tuple(2**64 - 1 if i == meta else -2**31 if i == me else v for i, v in enumerate(good))
    launcher.block_of(widest)  # the widest values each type holds


def test_the_compiled_pull_push_and_home_sum_bind_what_the_engine_binds(no_gpu):
    """``pull`` and ``to_home`` (csrc/host.cpp) pass, in their order, exactly the
    free names of the engine's own launches of the pull, the push and the home sum."""
    engine = _cpu_engine(4, 32, Capacity(64, 4, 1024, 512))
    codec = to_experts_codec("native", torch.bfloat16)
    pull = engine._pull_launch(codec, torch.bfloat16, 512, 4, 4, torch.float32)
    push = engine._push_launch(torch.bfloat16, torch.float32, torch.float32, 512, 4)
    home = engine._home_launch(torch.float32, torch.bfloat16, torch.float32, 512)
    for launch, order in ((pull, host.PULL_FREE), (push, host.PUSH_FREE), (home, host.HOME_FREE)):
        assert sorted(order) == sorted(launch.free)
        assert launch.compiled(0, order) is not None


def test_a_host_path_that_does_not_build_is_said_once(monkeypatch):
    """Where the compiled path cannot be built on a GPU machine, the engine runs
    its host side in Python and says why, once."""
    import warnings

    monkeypatch.setattr(host, "_build", lambda: (None, "RuntimeError: ninja is required"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    host._here.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not build .RuntimeError: ninja is required"):
            assert host.module() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert host.module() is None
    finally:
        host._here.cache_clear()


_HOOK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))


class _Recorder:
    """Each launch the stand-in driver is handed: kernel, grid, shared memory,
    stream, attributes and every argument by name, addresses as (buffer, offset)
    of the buffers named in ``regions``. The counts exchange's launch gets the
    counts matrix ``words`` written into its ``out`` (as the kernel would)."""

    def __init__(self, words: torch.Tensor) -> None:
        self.words, self.launches, self.regions = words, [], {}
        self.records = []  # (launches before it, event, stream) of each event record
        self.hook = _HOOK(self._launched)

    def _launched(self, config, function, params) -> int:
        if not config:  # an event recorded (the stand-in driver's cuEventRecord)
            self.records.append((len(self.launches), function, params[0]))
            return 0
        name, sig = _KERNELS[function]
        values = {}
        for i, (param, code) in enumerate(zip(sig.names, sig.codes)):
            values[param] = struct.unpack(code, ctypes.string_at(params[i], struct.calcsize(code)))[0]
        if name == "exchange_counts":
            ctypes.memmove(values["out"], self.words.data_ptr(), self.words.numel() * 4)
        c = cuda.LaunchConfig.from_address(config)
        self.launches.append((name, c.gridDimX, c.blockDimX, c.sharedMemBytes, c.hStream, c.numAttrs, values,
                              {p for i, (p, code) in enumerate(zip(sig.names, sig.codes))
                               if i in sig.pointers or code == "Q"}))  # (an address, by value)
        return 0

    def seen(self) -> list:
        """The launches, each address named by the region it falls in."""
        spans = [(name, t.data_ptr(), t.numel() * t.element_size()) for name, t in self.regions.items()]

        def named(address: int):
            for name, start, size in spans:
                if start <= address < start + max(size, 1):
                    return name, address - start
            return "?" if address else 0

        return [(*launch[:6], {p: named(v) if p in launch[7] else v for p, v in launch[6].items()})
                for launch in self.launches]


def _counts_words(world: int, rank: int, engine: Engine, topk: int, hidden: int, tokens: int, agree: bool,
                  staged: bool, gen: torch.Generator, memory_rows: int = 10**6) -> torch.Tensor:
    """The status and counts matrix a counts exchange reads back: every rank's
    header (rank ``rank``'s own as given, a peer's with another H where not
    ``agree``; its memory budget ``memory_rows`` rows), T, staged, G, sends,
    counts to every expert."""
    experts = engine.num_experts
    rows = []
    for r in range(world):
        header = [0, 1, 0, topk, hidden if agree or r == rank else hidden + 8, 1, 2, 1, r % 2, 0, -1, memory_rows]
        t = tokens if r == rank else int(torch.randint(1, 60, (1,), generator=gen))
        sends = torch.randint(0, t + 1, (world,), generator=gen).tolist()
        counts = torch.randint(0, 9, (experts,), generator=gen).tolist()
        rows.append(header + [t, int(staged or r == rank), 1] + sends + counts)
    return torch.tensor([0, 0, 0, 0] + [w for r in rows for w in r], dtype=torch.int32)


@pytest.mark.parametrize("world, rank, tokens, agree, staged, idx_dtype, weight_dtype", [
    (1, 0, 37, True, True, torch.int64, torch.float32),
    (2, 1, 37, True, True, torch.int32, torch.float64),
    (4, 2, 37, True, False, torch.int64, torch.float32),
    (4, 3, 0, True, True, torch.int64, torch.float32),
    (2, 0, 37, False, True, torch.int64, torch.float32),
])
@pytest.mark.parametrize("pull", [False, True])
def test_the_compiled_host_path_launches_and_reads_as_the_python_one(
        fake_driver, compiled, monkeypatch, world, rank, tokens, agree, staged, idx_dtype, weight_dtype, pull):
    """On the stand-in driver: a dispatch's counts exchange, its pull and a
    combine's push and home sum, issued from C++ and from Python, launch the
    same kernels with the same configuration and arguments (addresses by the
    buffer they fall in), and read back the same counts; in the usual case
    (every header agreeing, every budget kept) the compiled exchange also gives
    what the host's checks would and the handle's tensors, shaped as the
    Python path makes them, and with ``pull`` (where every rank staged) the
    pull too, within the same call."""
    from dispatch import checks
    from dispatch.nvlink_layout import Planned

    experts, topk, hidden = 8 * world, 4, 64
    monkeypatch.setattr(cuda, "kernel", lambda source, name, *types: _Kernel(source, name))
    monkeypatch.setattr(cuda, "_dependent_launch", lambda device: True)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "raw_stream", lambda device: 7)
    monkeypatch.setattr(cuda, "capturing", lambda: False)
    codec = to_experts_codec("native", torch.bfloat16)
    gen = torch.Generator().manual_seed(world * 10 + rank)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.to(idx_dtype)
    w = torch.rand(tokens, topk, generator=gen, dtype=weight_dtype)
    seen = {}
    for path in ("python", "compiled"):
        monkeypatch.setattr(host, "module", lambda path=path: compiled if path == "compiled" else None)
        engine = _cpu_engine(world, experts, Capacity(64, topk, 256, 512), compiled if path == "compiled" else None)
        engine.rank = rank
        engine._ordered = lambda writes=True: contextlib.nullcontext()
        words = _counts_words(world, rank, engine, topk, hidden, tokens, agree, staged,
                              torch.Generator().manual_seed(1))
        recorder = _Recorder(words)
        fake_driver.fake_set_hook(recorder.hook)
        header = plan.header(x, w, topk, plan.Ticket(memory_rows=10**6))
        width = min(topk, engine.experts_per_rank)
        counts = engine._exchange_counts(idx, w, header, x, codec, True, True, 1, (width, weight_dtype),
                                         pull and path == "compiled")
        num_rows = counts.host.rows[rank]
        planned = counts.planned
        for part in ("matrix", "hit", "src_start", "num_rows"):  # the addresses launches take are the views'
            assert counts.address(part) == getattr(counts, part).data_ptr(), part
        if planned is None:
            presum, slot_k = torch.empty(2, world * counts.bound, width, dtype=torch.int32).unbind()
            places = (torch.empty(num_rows, dtype=weight_dtype), *torch.empty(2, num_rows, dtype=torch.int64))
        else:
            presum, slot_k, places = planned.presum, planned.slot_k, planned[4:7]
        if planned is not None and planned.tokens is not None:  # pulled within the counts exchange
            tokens_out = planned.tokens
        else:
            tokens_out = engine._to_experts(x, codec, counts, presum, slot_k, num_rows, meta_out=places)
        y = torch.randn(num_rows, hidden, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        home = engine.to_home(y, places[0], torch.float32, counts, presum, None)
        recorder.regions = dict(
            idx=idx, w=w, x=x, y=y, scratch=engine._scratch, data=engine._data, seq=engine._seq,
            status=engine.status, counter=engine._counter, flags=engine._flags, meta_ptrs=engine._meta_ptrs,
            data_ptrs=engine._data_ptrs, per_expert=counts.tokens_per_expert, tokens_at=counts.tokens_at,
            presum=presum, slot_k=slot_k, weights=places[0], src_rank=places[1], src_token=places[2],
            tokens=tokens_out, home=home,
            words=torch.empty(0).set_(counts.route.untyped_storage()))  # the dispatch's int32 words, whole
        seen[path] = (recorder.seen(), counts, planned, tuple(t.shape for t in (presum, slot_k, *places)),
                      (tokens_out.shape, home.shape, home.dtype))
    (launched, counts, _, shapes, outs), (launched_c, counts_c, planned, shapes_c, outs_c) = seen["python"], \
        seen["compiled"]
    assert launched_c == launched
    assert [name for name, *_ in launched] == ["route_layout"] * bool(tokens) + ["exchange_counts"] + \
        ["stage_rows"] * (not staged) * (1 + 2 * bool(tokens)) + ["pull_rows", "push_partials", "home_sum"]
    assert counts_c.host[:3] == counts.host[:3] and torch.equal(counts_c.host.per_expert, counts.host.per_expert)
    assert (counts_c.received, counts_c.bound, counts_c.staged) == (counts.received, counts.bound, counts.staged)
    assert torch.equal(counts_c.matrix, counts.matrix) and counts_c.tokens_at.shape == counts.tokens_at.shape
    assert shapes_c == shapes and outs_c == outs
    assert counts.planned is None  # the Python path leaves the checks to the host
    headers = counts.host.headers
    try:
        grads = checks.check_peer_headers(headers)
        checks.check_row_budgets(headers, counts.host.rows, 1024)
    except (ValueError, RuntimeError):
        grads = None
    assert (planned is None) == (grads is None) == (not agree)
    if planned is not None:
        assert isinstance(planned, Planned) and (planned.x_grad, planned.weights_grad) == grads
        assert planned.weights.dtype == weight_dtype
        # the weights (which combine's backward keeps) share no storage, nor so a version, with another output
        storages = {t.untyped_storage().data_ptr() for t in (planned.presum, planned.src_rank, planned.src_token)}
        assert planned.weights.numel() == 0 or planned.weights.untyped_storage().data_ptr() not in storages
        assert (planned.tokens is not None) == (pull and staged)


@pytest.mark.parametrize("stream", [0, 7])
def test_the_usual_eager_operations_are_ordered_by_their_compiled_call(fake_driver, compiled, monkeypatch, stream):
    """After an eager operation on the same stream (``nvlink_order.eager_stream``;
    the default stream's handle is 0) the compiled counts exchange (with its pull)
    and combine record the engine's eager event themselves, on that stream, after
    every launch they make, and the engine notes the operation as ``Ordered``
    would (its last operation, the operations counted), without entering it;
    after one on another stream, the same once this stream waited for it. In a
    capture, or before the eager event is made, they are issued in ``Ordered``
    and record nothing."""
    world, rank, tokens, topk, hidden, experts = 2, 0, 37, 4, 64, 16
    monkeypatch.setattr(cuda, "kernel", lambda source, name, *types: _Kernel(source, name))
    monkeypatch.setattr(cuda, "_dependent_launch", lambda device: True)
    monkeypatch.setattr(cuda, "current_device", lambda: None)  # the CPU engine's device index
    monkeypatch.setattr(cuda, "raw_stream", lambda device: stream)
    capturing = {"now": False}
    monkeypatch.setattr(cuda, "capturing", lambda: capturing["now"])
    codec = to_experts_codec("native", torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, generator=gen)
    monkeypatch.setattr(host, "module", lambda: compiled)
    engine = _cpu_engine(world, experts, Capacity(64, topk, 256, 512), compiled)
    entered = []
    engine._ordered = lambda writes=True: entered.append(writes) or contextlib.nullcontext()
    words = _counts_words(world, rank, engine, topk, hidden, tokens, True, True, torch.Generator().manual_seed(1))
    recorder = _Recorder(words)
    fake_driver.fake_set_hook(recorder.hook)
    width = min(topk, engine.experts_per_rank)

    def round_trip():
        header = plan.header(x, w, topk, plan.Ticket(memory_rows=10**6))
        counts = engine.exchange_counts(idx, w, header, x, codec, True, True, 1, (width, torch.float32), True)
        planned = counts.planned
        y = torch.randn(planned.tokens.shape, generator=gen).to(torch.bfloat16)
        engine.to_home(y, planned.weights, torch.float32, counts, planned.presum, None)

    engine._eager_raw, engine._eager_event = 0xE0, "the eager event"
    round_trip()
    names = [launch[0] for launch in recorder.launches]
    assert names == ["route_layout", "exchange_counts", "pull_rows", "push_partials", "home_sum"]
    assert [(n, event, at or 0) for n, event, at in recorder.records] == [(3, 0xE0, stream), (5, 0xE0, stream)]
    assert engine._last == ("the eager event", stream) and engine.operations == 3 and entered == []
    for case in ("another stream", "captured", "no event yet"):
        recorder.launches, recorder.records, entered[:], waits = [], [], [], []
        monkeypatch.setattr(cuda, "current_stream", lambda device: _Waits(waits))
        engine._last = ("the eager event", 8 if case == "another stream" else stream)
        capturing["now"] = case == "captured"
        engine._eager_raw = 0 if case == "no event yet" else 0xE0
        round_trip()
        if case == "another stream":  # this stream waits for it once, then as after an operation on it
            assert waits == ["the eager event"] and entered == [], case
            assert [(n, event, at or 0) for n, event, at in recorder.records] == [(3, 0xE0, stream), (5, 0xE0, stream)]
        else:
            assert recorder.records == [] and entered == [True, True] and waits == [], case
        assert [launch[0] for launch in recorder.launches] == names, case
    capturing["now"] = False


class _Waits:
    """A stream that notes the events it is made to wait for."""

    def __init__(self, waits: list) -> None:
        self.wait_event = waits.append


def test_operations_follow_their_kind_across_streams_and_captures(monkeypatch):
    """``Ordered``: an eager operation waits for the engine's latest eager one where
    that ran on another stream, whatever was captured in between; a captured one
    waits only for the latest of its own capture on another stream; none waits for
    an operation on its own stream. (An eager operation on stream 2, then one
    captured on stream 1, then an eager one on stream 1: the last waited for
    nothing, though stream 2's operation may still run.)"""
    import types

    from dispatch.nvlink_order import Ordered

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.cuda_event, self.at = 100 + Event.made, None

        def record(self, stream):
            self.at = stream.cuda_stream

    class Stream:
        def __init__(self, raw):
            self.cuda_stream, self.waited = raw, []

        def wait_event(self, event):
            self.waited.append((event.cuda_event, event.at))

    streams, now = {1: Stream(1), 2: Stream(2)}, {"stream": 1, "capture": None}
    monkeypatch.setattr(cuda, "current_stream", lambda device: streams[now["stream"]])
    monkeypatch.setattr(cuda, "capture_id", lambda device: now["capture"])
    monkeypatch.setattr(torch.cuda, "Event", Event)
    engine = types.SimpleNamespace(device=torch.device("cpu"), _last=None, _last_captured=None, _eager_event=None,
                                   _eager_raw=0, _captured=False, operations=0)

    def operation(stream, capture=None):
        now.update(stream=stream, capture=capture)
        streams[stream].waited.clear()
        with Ordered(engine, True):
            pass
        return streams[stream].waited

    assert operation(2) == []  # the first: the eager event made (its handle 101)
    assert engine._eager_raw == 101 and engine._last == (engine._eager_event, 2)
    assert operation(1, capture=7) == []  # a capture waits for no eager operation
    assert operation(1) == [(101, 2)]  # eager after eager on another stream, a capture between
    assert operation(1) == []  # the same stream
    assert operation(2, capture=7) == [(102, 1)]  # the capture's own latest, on another stream
    assert operation(1, capture=8) == []  # another capture's: not waited for
    assert engine.operations == 6 and engine._captured


@pytest.mark.parametrize("mode", [0, 1, 2])
def test_the_compiled_host_read_is_said_as_torch_says_a_sync(monkeypatch, mode):
    """The compiled host read synchronises through the driver; under
    ``torch.cuda.set_sync_debug_mode`` it warns or raises as torch's own
    synchronising operations do."""
    import warnings

    monkeypatch.setattr(cuda, "sync_debug_mode", lambda: mode)
    if mode == 2:
        with pytest.raises(RuntimeError, match="synchronizing CUDA operation"):
            host.said_sync()
    elif mode == 1:
        with pytest.warns(UserWarning, match="synchronizing CUDA operation"):
            host.said_sync()
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            host.said_sync()


def test_the_free_memory_budget_reads_the_driver_once_an_age(fake_driver, compiled, monkeypatch):
    """A dispatch's memory budget (``free_memory.device_free_bytes``, and the compiled
    usual dispatch) reads the driver's free memory through ``free_bytes``
    (csrc/host.cpp, on the stand-in driver): once per age a device, and in
    between takes off what torch's caching allocator reserved since (or adds
    what it gave back); again at once after ``forget_free_bytes``; every time
    where the allocator cannot say (-1); -2 for a device that is not the
    current one. ``free_memory.FreeMemory`` reads through it, else through torch."""
    from dispatch import free_memory

    fake_driver.fake_set_free.argtypes = [ctypes.c_size_t]
    fake_driver.fake_set_free(10_000)
    compiled.forget_free_bytes()
    start, age = fake_driver.fake_free_reads(), 3600.0

    def reads() -> int:
        return fake_driver.fake_free_reads() - start

    assert compiled.free_bytes(0, age, -1) == 10_000 and compiled.free_bytes(0, age, -1) == 10_000 and reads() == 2
    assert compiled.free_bytes(0, age, 8_000) == 10_000 and reads() == 3
    fake_driver.fake_set_free(7_000)  # torch reserves 3,000 more: the device has that much less
    assert compiled.free_bytes(0, age, 11_000) == 7_000 and reads() == 3
    fake_driver.fake_set_free(12_000)  # torch gives 5,000 back (empty_cache)
    assert compiled.free_bytes(0, age, 6_000) == 12_000 and reads() == 3
    fake_driver.fake_set_free(11_500)  # taken outside torch: seen once the reading is older than the age
    assert compiled.free_bytes(0, age, 6_000) == 12_000 and reads() == 3
    assert compiled.free_bytes(0, 0.0, 6_000) == 11_500 and reads() == 4
    fake_driver.fake_set_free(11_400)
    compiled.forget_free_bytes()
    assert compiled.free_bytes(0, age, 6_000) == 11_400 and reads() == 5
    assert compiled.free_bytes(1, age, 6_000) == -2 and reads() == 5  # not the current device
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (5 + index, 99))
    memory = free_memory.FreeMemory()
    assert memory(0) == 5  # without the compiled path: torch's reading
    memory.compiled = compiled
    assert memory(0) == 11_400 and memory(1) == 6 and reads() == 6  # (its allocator cannot say here: read again)


def test_the_compiled_path_gives_the_budget_its_reader_of_the_allocator(compiled, monkeypatch):
    """The engine's compiled module (``host.module()``) reads ``free_memory.FREE_MEMORY``
    with torch's caching allocator's reserved bytes where torch's own allocator serves
    (not with caching off, nor another backend, nor without CUDA: there its
    reader says -1, cannot say)."""
    from dispatch import free_memory

    host.module()
    native = torch.cuda.is_available() and torch.cuda.get_allocator_backend() == "native"
    assert (free_memory.FREE_MEMORY.compiled is compiled) == (
        native and os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") in ("", "0"))
    monkeypatch.setenv("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
    assert not host._caching_allocator()
    if not torch.cuda.is_available():
        assert compiled.reserved_bytes(0) == -1
        monkeypatch.delenv("PYTORCH_NO_CUDA_MEMORY_CACHING")
        assert not host._caching_allocator()
