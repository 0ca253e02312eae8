"""The engine's compiled host path (``csrc/host.cpp``, ``dispatch.host``) on CPU.

What a compiled launch hands the driver is held to the Python packer, byte for
byte, for every kernel of csrc/, and the counts exchange's compiled launches to
the names the engine binds; where the module cannot be built here (no compiler,
ninja or ``cuda.h``) these skip. The compiled path's results are held bitwise
to the Python path's on a GPU (``bench/engine_one_gpu.py --check``, and the
GPU suite: every engine test runs it).
"""

from __future__ import annotations

import pytest
import torch

from dispatch import cuda, host, plan
from dispatch.codec import to_experts_codec
from dispatch.nvlink import HostCounts, SENDS_COL, Capacity, Engine

SIGNATURES = cuda.signatures()


@pytest.fixture(scope="module")
def compiled():
    module = host.built()
    if module is None:
        pytest.skip("the compiled host path does not build here (no C++ compiler, ninja or cuda.h)")
    return module


class _Kernel:
    """A kernel of csrc/ without CuPy: its signature, a block size, no function."""

    def __init__(self, source: str, name: str) -> None:
        self.signature, self.threads = cuda.signature(source, name), 128

    def handle(self, device: int) -> int:
        return 0

    def bind(self, **bound) -> cuda.Launch:
        return cuda.Launch(self, bound)


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


def _cpu_engine(world: int, experts: int, capacity: Capacity) -> Engine:
    """An Engine of rank 0 whose buffers are CPU tensors (no peers, no kernels run)."""
    from test_engine_launches import _cpu_engine as made

    return made(world, experts, capacity)


@pytest.mark.parametrize("tokens", [0, 37])
def test_the_compiled_counts_exchange_binds_what_the_engine_binds(no_gpu, tokens):
    """The counts exchange's compiled launches take, in the order csrc/host.cpp
    passes them, exactly the free names of the engine's own launches of that
    shape (the layout's none where T = 0), and its shape the engine's columns."""
    engine = _cpu_engine(4, 32, Capacity(64, 4, 1024, 512))
    engine._host_words = torch.empty(0, dtype=torch.int32)  # (pinned on a GPU machine)
    codec = to_experts_codec("native", torch.bfloat16)
    fits, layout, counts, words, sizes, compiled = engine._counts_launches(
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
    """``Engine._host_counts``: every rank's header and sends as read, the rows
    each rank receives (its experts' columns summed over the sources), and this
    rank's rows of each of its experts."""
    world, experts, rank = 3, 6, 1
    engine = _cpu_engine(world, experts, Capacity())
    engine.rank = rank
    local = experts // world
    gen = torch.Generator().manual_seed(0)
    matrix = torch.randint(0, 9, (world, engine.row_len), generator=gen).tolist()
    got = engine._host_counts(matrix)
    assert isinstance(got, HostCounts)
    assert got.headers == tuple(r[: len(plan.HEADER)] for r in matrix)
    assert got.sends == tuple(tuple(r[SENDS_COL : SENDS_COL + world]) for r in matrix)
    counts = torch.tensor([r[engine.counts_col :] for r in matrix])  # [source, expert]
    assert list(got.rows) == counts.view(world, world, local).sum((0, 2)).tolist()
    assert torch.equal(got.per_expert, counts[:, rank * local : (rank + 1) * local].sum(0))


@pytest.mark.parametrize("seed", range(40))
def test_the_compiled_usual_case_is_where_the_checks_pass_and_say_nothing(no_gpu, seed):
    """``usual`` (csrc/host.cpp), by which the compiled counts exchange skips the
    host's checks of every rank's header and budgets, holds exactly where those
    checks (``checks.check_peer_headers``, ``checks.check_row_budgets``) pass
    without a word: headers agreeing, none failed, every rank within budget."""
    from dispatch import checks

    world = 3
    engine = _cpu_engine(world, 6, Capacity(64, 4, 1024, 512))
    engine._host_words = torch.empty(0, dtype=torch.int32)
    codec = to_experts_codec("native", torch.bfloat16)
    shape = engine._counts_launches(8, 4, torch.int64, torch.float32, codec, 512, 1)[-1][0]
    gen = torch.Generator().manual_seed(seed)
    pick = lambda *choices: choices[int(torch.randint(len(choices), (1,), generator=gen))]  # noqa: E731
    header = [1, 3, 0, 4, 512, 1, 2, 1, 0, 0, -1, 10**6]
    rows, rows_of = [], []
    for r in range(world):
        h = list(header)
        column = pick(None, None, "call", "hidden", "x_dtype", "failed", "max_rows", "memory_rows", "x_grad")
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
    for place, value in ((me, 2**31), (me, -2**31 - 1), (meta, -1), (me, 1.5)):
        wrong = tuple(value if i == place else v for i, v in enumerate(good))
        with pytest.raises((ValueError, TypeError, OverflowError)):
            launcher.block_of(wrong)
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
