"""The NVLink engine's launches against its kernels' signatures, on CPU.

The kernels (``csrc/``) run only on GPUs; their calling contract is held here, in
CI: every launch the engine's host side (``dispatch.nvlink.Engine``) makes names
each parameter of the kernel it launches (its signature read from the source,
``cuda.signature``), by name, with a value its C type holds (a pointer: a tensor,
an address or None), and the values this test knows (the rank, the world, K,
H, T ...) where the kernel names them; every instantiation names as many
template arguments as the kernel's template takes. An argument out of step with
its kernel would otherwise show only on a GPU, as garbage read by the kernel.
"""

from __future__ import annotations

import ctypes
import re
import struct

import pytest
import torch

from dispatch import checks, cuda, host, nvlink, nvlink_layout, plan
from dispatch.codec import to_experts_codec
from dispatch.nvlink import SENDS_COL, Capacity, Engine, partial_row_bytes, scan_warps, staged_row_bytes
from dispatch.nvlink_layout import counts_shared, most_experts

SIGNATURES = cuda.signatures()


class _Checked:
    """Stands for a compiled kernel: checks each launch's arguments and records it.

    ``known``: {parameter name: value} that every launch naming it must pass
    (the engine's rank and world, the dispatch's T, K, H ...)."""

    def __init__(self, source: str, name: str, template_args: tuple, launches: list, known: dict) -> None:
        self.signature = cuda.signature(source, name)
        count = self.signature.template
        assert len(template_args) == count, f"{name}<{', '.join(template_args)}>: the template takes {count}"
        self.name, self.launches, self.known = name, launches, known

    def __call__(self, blocks, shared=0, **args):
        assert int(blocks) >= 1
        assert 0 <= shared <= 48 * 1024, f"{self.name}: {shared} bytes of dynamic shared memory (48 KiB without opt-in)"
        sig = self.signature
        for i, (name, code) in enumerate(zip(sig.names, sig.codes)):
            value = args.get(name)
            if i in sig.pointers:
                assert value is None or isinstance(value, (int, torch.Tensor)), f"{self.name}.{name}: {value!r}"
            elif code in "fd":
                assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{self.name}.{name}"
            else:
                assert isinstance(value, int) and not isinstance(value, bool), f"{self.name}.{name}: {value!r}"
            if name in self.known:
                assert value == self.known[name], f"{self.name}.{name} = {value}, the launch's is {self.known[name]}"
        layout, _ = cuda.parameter_block(sig.codes)
        layout.pack(*cuda.arguments(sig, args))  # every name given once, every value fits its C type
        self.launches.append(self.name)
        ARGS[self.name] = args

    def bind(self, **bound):
        """A launch with ``bound`` given once, checked with the free arguments at each launch."""
        unknown = set(bound) - set(self.signature.names)
        assert not unknown, f"{self.name}: binds {sorted(unknown)}"

        def launch(blocks, shared=0, **free):
            assert not set(free) & set(bound), f"{self.name}: {sorted(set(free) & set(bound))} bound and given"
            self(blocks, shared, **bound, **free)
        return launch


@pytest.fixture(autouse=True)
def python_launches(monkeypatch):
    """Launches issued from Python, whose blocks these tests see (on a GPU the
    compiled path would issue them; tests/test_host.py holds it to these)."""
    monkeypatch.setattr(host, "enabled", False)


KNOWN: dict = {}  # the values the launches of the running test must pass (``launches``)
ARGS: dict = {}  # kernel name -> the arguments of its latest launch


@pytest.fixture
def launches(monkeypatch):
    made: list = []
    KNOWN.clear()
    ARGS.clear()
    KNOWN.update(me=0, world=2)  # the engine of rank 0 of 2 (``_cpu_engine``)
    monkeypatch.setattr(cuda, "kernel", lambda source, name, *t: _Checked(source, name, t, made, KNOWN))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # a CPU build has no streams
    monkeypatch.setattr(cuda, "capturing", lambda: False)
    return made


def _cpu_engine(world: int, experts: int, capacity: Capacity) -> Engine:
    """An Engine of rank 0 whose buffers are CPU tensors (no peers, no kernels run)."""
    e = object.__new__(Engine)
    e.group, e.world, e.rank = None, world, 0
    e.num_experts, e.experts_per_rank = experts, experts // world
    e._scan_warps = scan_warps(experts, world)
    e.device, e.sms, e.blocks, e.timeout_ns = torch.device("cpu"), 2, 8, 10**9
    e.counts_col = SENDS_COL + world
    e.row_len = e.counts_col + experts
    e.rows_offset, e._matrix_stride = 256, 4096
    e._meta_ptrs = torch.zeros(world, dtype=torch.int64)
    e._flags = torch.zeros(cuda.FLAG_WORDS * world, dtype=torch.int32)
    e.capacity, e._regions = capacity, capacity.regions(world)
    e._data = torch.zeros(e._regions["total"][0], dtype=torch.uint8)
    e._data_ptrs = torch.zeros(world, dtype=torch.int64)
    e._kernels, e._launches, e._retired, e._captured, e._last, e._eager_event = {}, {}, [], False, None, None
    e._eager_raw, e._last_captured = 0, None
    e._on_nvshmem = False
    e.operations = 0
    e.status = torch.zeros(4, dtype=torch.int32)
    e._seq = torch.zeros(1, dtype=torch.int32)
    e._counter = torch.zeros(1, dtype=torch.int32)
    e._scratch = torch.zeros(0, dtype=torch.int32)
    e._host, e._host_words = None, None  # launches from Python
    e._agree_allocated = lambda size, error: None  # no peers to agree with on an allocation
    return e


@pytest.mark.parametrize("idx_dtype, weight_dtype", [(torch.int64, torch.float32), (torch.int32, torch.float64)])
@pytest.mark.parametrize("dtype, wire", [(torch.bfloat16, "native"), (torch.bfloat16, "fp8"), (torch.float32, "bf16")])
def test_a_round_trip_launches_every_kernel_as_declared(launches, idx_dtype, weight_dtype, dtype, wire):
    world, experts, tokens, topk, hidden = 2, 8, 40, 4, 64
    KNOWN.update(topk=topk, hidden=hidden, experts=experts, experts_per_rank=experts // world,
                 tokens=tokens)
    codec = to_experts_codec(wire, dtype)
    combine_wire = torch.float32
    engine = _cpu_engine(world, experts, Capacity(64, topk, staged_row_bytes(codec, hidden),
                                                  partial_row_bytes(combine_wire, hidden)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.to(idx_dtype)
    w = torch.rand(tokens, topk, generator=gen, dtype=weight_dtype)
    header = plan.header(x, w, topk, plan.Ticket(max_rows=100, memory_rows=1000))
    counts = engine._exchange_counts(idx, w, header, x, codec, True, False)
    width, max_rows = min(topk, engine.experts_per_rank), 100
    presum = torch.empty(world * counts.bound, width, dtype=torch.int32)
    slot_k = torch.empty_like(presum)
    places = (torch.empty(max_rows, dtype=weight_dtype), torch.empty(max_rows, dtype=torch.int64),
              torch.empty(max_rows, dtype=torch.int64))
    engine._to_experts(x, codec, counts, presum, slot_k, max_rows, meta_out=places)  # the dispatch
    out = engine._to_experts(x, codec, counts, presum, slot_k, max_rows)  # rows along the plan
    engine._to_experts(x, codec, counts, presum, slot_k, max_rows, span=(30, 70), out=out)  # a later group's
    y = torch.randn(max_rows, hidden, generator=gen).to(dtype)
    engine._push(y, places[0], combine_wire, counts, presum)  # the combine
    engine._home_sum(counts, combine_wire, y.dtype, hidden, None)
    table = torch.zeros(6, dtype=torch.int64)
    bounds = torch.tensor([0, 30, 70, max_rows])
    engine._store_group(table, 1, y[30:70], places[0][30:70])  # group 1 of 3 of a combine by groups
    engine._push(y[30:70], places[0][30:70], combine_wire, counts, presum,
                 (table[:3], table[3:], bounds, 2, (30, 70), False), hidden)
    engine._slots_home(torch.randn(max_rows, generator=gen), counts, presum, slot_k)  # routing-weight gradients
    by_groups = engine._exchange_counts(idx, w, header, x, codec, True, False, groups=3)  # padded by 3 groups
    assert by_groups.group_end is not None and by_groups.group_end.shape == (3,)
    engine._to_experts(x, codec, by_groups, presum, slot_k, 102, meta_out=places, span=(34, 68), out=out, group=1)
    # the rows staged with the counts by the layout's launch; along a plan by stage_rows
    assert launches == ["route_layout", "exchange_counts", "pull_rows", "stage_rows", "pull_rows",
                        "pull_rows", "push_partials", "home_sum", "store_pair", "push_partials", "push_slots",
                        "home_slots", "route_layout", "exchange_counts", "pull_rows"]


def test_the_layouts_zeroed_words_are_the_engines_own_from_one_dispatch_to_the_next(launches, monkeypatch):
    """route_layout's zeroed words (its row, the scan's ticket and chunk states) are
    a buffer of the engine's, which exchange_counts zeroes again after reading: no
    allocation or memset a dispatch; it grows outside a CUDA graph capture (the
    outgrown one kept for work still queued), and a capture that needs more takes a
    zeroed tensor of its own, leaving the engine's as it is."""
    world, experts, hidden, topk = 2, 8, 64, 4
    codec = to_experts_codec("native", torch.bfloat16)
    engine = _cpu_engine(world, experts, Capacity(4096, topk, staged_row_bytes(codec, hidden),
                                                  partial_row_bytes(torch.float32, hidden)))
    made: list = []
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **k: made.append(a) or real_zeros(*a, **k))
    gen = torch.Generator().manual_seed(0)

    def dispatch(tokens):
        x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
        idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
        w = torch.rand(tokens, topk, generator=gen)
        header = plan.header(x, w, topk, plan.Ticket(max_rows=100, memory_rows=10**6))
        engine._exchange_counts(idx, w, header, x, codec, True, False)

    per_chunk = engine._scan_warps * cuda.SCAN_TILES * (32 // topk)  # tokens a scan block places
    dispatch(10)
    first = engine._scratch
    assert first.numel() == engine.row_len + 1 + 1 and len(made) == 1
    dispatch(10)
    dispatch(per_chunk)  # one chunk still: the same words, nothing allocated
    assert engine._scratch is first and len(made) == 1
    dispatch(4 * per_chunk)  # 4 chunks: grown to twice the words at least, the old one kept
    assert engine._scratch.numel() >= 2 * first.numel() and engine._scratch.numel() >= engine.row_len + 1 + 4
    assert engine._retired[-1] is first and len(made) == 2
    grown = engine._scratch
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(cuda, "capturing", lambda: True)
    dispatch(64 * per_chunk)  # inside a capture: a zeroed tensor of its own
    assert engine._scratch is grown and len(made) == 3
    dispatch(per_chunk)
    assert engine._scratch is grown and len(made) == 3
    counts_launches = [name for name in launches if name == "exchange_counts"]
    assert len(counts_launches) == 6


@pytest.mark.parametrize("topk, rows_together", [(2, "1"), (4, str(cuda.SUM_ROWS))])
def test_a_pre_sum_loads_several_rows_together_where_items_hold_more_than_two(monkeypatch, topk, rows_together):
    """push_partials' last template argument: the rows a lane loads together, 1
    where an item holds at most 2 rows on this rank (J <= 2), else SUM_ROWS."""
    made: list = []
    monkeypatch.setattr(cuda, "kernel",
                        lambda source, name, *t: made.append((name, t)) or _Checked(source, name, t, [], {"me": 0, "world": 2}))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(cuda, "capturing", lambda: False)
    world, experts, tokens, hidden = 2, 8, 40, 64
    codec = to_experts_codec("native", torch.bfloat16)
    engine = _cpu_engine(world, experts, Capacity(64, topk, staged_row_bytes(codec, hidden),
                                                  partial_row_bytes(torch.float32, hidden)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, generator=gen)
    header = plan.header(x, w, topk, plan.Ticket(max_rows=100, memory_rows=1000))
    counts = engine._exchange_counts(idx, w, header, x, codec, True, False)
    presum = torch.empty(world * counts.bound, min(topk, engine.experts_per_rank), dtype=torch.int32)
    engine._push(torch.randn(100, hidden, generator=gen).to(torch.bfloat16), torch.rand(100), torch.float32, counts,
                 presum)
    (args,) = [t for name, t in made if name == "push_partials"]
    assert args[-1] == rows_together


def test_a_parameter_block_lays_each_argument_at_its_c_alignment():
    """The block a launch hands the driver: a 4-byte int then a pointer puts the
    pointer at 8 (C pads to its alignment), ints pack tight, nothing after the last."""
    layout, offsets = cuda.parameter_block("iQiiqfI")
    assert offsets == (0, 8, 16, 20, 24, 32, 36)
    assert layout.size == 40
    args = (-3, 0, 7, 2**31 - 1, -(2**40), 0.5, 2**32 - 1)
    block = layout.pack(*args)
    assert struct.unpack_from("<i", block, 0)[0] == -3 and struct.unpack_from("<Q", block, 8)[0] == 0
    assert struct.unpack_from("<q", block, 24)[0] == -(2**40) and struct.unpack_from("<f", block, 32)[0] == 0.5
    assert struct.unpack_from("<I", block, 36)[0] == 2**32 - 1
    with pytest.raises(struct.error):  # a value its C type cannot hold is refused, not truncated
        layout.pack(*args[:3], 2**31, *args[4:])
    with pytest.raises(struct.error):
        layout.pack(*args[:6], -1)  # nor wrapped


def test_a_launch_hands_the_driver_each_parameter_at_its_address(monkeypatch):
    """What ``Kernel`` passes ``cuLaunchKernelEx``: a configuration (grid, block,
    shared memory, stream, and programmatic dependent launch allowed where the
    device has it) and kernelParams, an array of addresses, each holding its
    argument with its C type, refilled for each launch of the format."""
    calls = []

    def launch(config, handle, params, extra):
        c = cuda.LaunchConfig.from_address(config)
        attrs = [(c.attrs[i].id, c.attrs[i].value[0]) for i in range(c.numAttrs)]
        calls.append((handle, c.gridDimX, c.gridDimY, c.gridDimZ, c.blockDimX, c.blockDimY, c.blockDimZ,
                      c.sharedMemBytes, c.hStream, attrs, params, extra))
        return 0

    monkeypatch.setattr(cuda, "_launch", lambda: launch)
    monkeypatch.setattr(cuda, "raw_stream", lambda device: 77)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    dependent = [True]
    monkeypatch.setattr(cuda, "_dependent_launch", lambda device: dependent[0])
    signature = cuda.Signature(0, ("a", "p", "b", "c", "d"), "iQqIf", (1,))
    kernel = cuda.Kernel(None, cuda.THREADS, signature)
    kernel._handles[0] = 1234  # the CUfunction on device 0, as _load would find it

    def values(params: int, codes: str) -> list:
        at = (ctypes.c_void_p * len(codes)).from_address(params)
        return [struct.unpack(c, ctypes.string_at(at[i], struct.calcsize(c)))[0] for i, c in enumerate(codes)]

    for i, last in enumerate((1.5, -2.0)):
        kernel(3 - i, d=last, c=2**32 - 1, b=-(2**33) - i, p=None, a=5 + i, shared=16 * i)  # by name, any order
        handle, gx, gy, gz, bx, by, bz, shared, stream, attrs, params, extra = calls[-1]
        assert (handle, gx, gy, gz, bx, by, bz, shared, stream, extra) == (1234, 3 - i, 1, 1, cuda.THREADS, 1, 1,
                                                                           16 * i, 77, None)
        assert attrs == [(cuda.PROGRAMMATIC_STREAM_SERIALIZATION, 1)]
        assert values(params, "iQqIf") == [5 + i, 0, -(2**33) - i, 2**32 - 1, last]
    dependent[0] = False  # a device before compute capability 9.0: a plain launch
    pointer = torch.zeros(2)
    kernel(0, a=1, p=pointer, b=0, c=0, d=0.0)  # an empty grid still launches one block
    assert calls[-1][1] == 1 and calls[-1][9] == [] and values(calls[-1][10], "iQ") == [1, pointer.data_ptr()]
    with pytest.raises(TypeError, match=r"missing \['d'\], unknown \['e'\]"):
        kernel(1, a=1, p=None, b=0, c=0, e=0.0)
    with pytest.raises(TypeError, match=r"missing \[\], unknown \['e'\]"):
        kernel(1, a=1, p=None, b=0, c=0, d=0.0, e=0)


def test_a_failed_launch_raises_the_drivers_error(monkeypatch):
    monkeypatch.setattr(cuda, "_launch", lambda: lambda *args: 1)  # CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(cuda, "raw_stream", lambda device: 0)
    monkeypatch.setattr(cuda, "_dependent_launch", lambda device: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)

    class Driver:  # what the driver names error 1
        @staticmethod
        def cuGetErrorName(code, out):
            out._obj.value = b"CUDA_ERROR_INVALID_VALUE"
            return 0

        @staticmethod
        def cuGetErrorString(code, out):
            out._obj.value = b"invalid argument"
            return 0

    monkeypatch.setattr(cuda, "_driver", lambda: Driver)
    kernel = cuda.Kernel(None, cuda.THREADS, cuda.Signature(0, ("a",), "i", ()))
    kernel._handles[0] = 1
    with pytest.raises(RuntimeError, match=r"cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE \(1\): invalid"):
        kernel(1, a=0)


def test_the_signatures_are_read():
    """The parser finds every kernel the engine launches, with parameters."""
    names = {name for _, name in SIGNATURES}
    assert {"route_layout", "exchange_counts", "stage_rows", "pull_rows", "push_partials", "home_sum",
            "push_slots", "home_slots"} <= names
    assert all(sig.names and len(sig.names) == len(sig.codes) for sig in SIGNATURES.values())
    sig = SIGNATURES[("layout.cu", "exchange_counts")]
    assert sig.template == 0 and sig.codes[0] == "Q" and sig.codes[3] == "i" and sig.codes[-1] == "Q"
    assert sig.names[:5] == ("meta_ptrs", "rows_offset", "matrix_bytes", "me", "world") and 0 in sig.pointers
    assert SIGNATURES[("layout.cu", "route_layout")].template == 2


def test_the_counts_exchange_takes_the_header_by_its_names():
    """exchange_counts' header parameters are ``plan.HEADER``'s columns, by name and
    in order (the launch passes the header by those names)."""
    names = SIGNATURES[("layout.cu", "exchange_counts")].names
    start = names.index(plan.HEADER[0])
    assert names[start : start + len(plan.HEADER)] == plan.HEADER


def test_a_swapped_pair_of_arguments_fails_the_check(launches):
    """The check above holds each value the test knows by its parameter's name: a
    launch that swaps the rank and the world size (both ints) is caught."""
    sig = SIGNATURES[("intranode_dispatch.cu", "stage_rows")]
    kernel = cuda.kernel("intranode_dispatch.cu", "stage_rows")
    args = {name: (0 if i in sig.pointers else 1) for i, name in enumerate(sig.names)}
    kernel(1, **{**args, "me": 0, "world": 2})
    with pytest.raises(AssertionError, match=r"stage_rows\.(me = 2|world = 0)"):
        kernel(1, **{**args, "me": 2, "world": 0})


def test_the_host_side_reads_the_kernels_tuning():
    """The constants the host sizes launches by are the kernels' (engine.cuh), read
    from there (``cuda.tuning``), not copied."""
    text = (cuda.csrc_dir() / "engine.cuh").read_text()

    def constant(name: str) -> int:
        m = re.search(rf"static constexpr (?:int|unsigned) {name} = ([^;]+);", text)
        assert m, f"engine.cuh has no Tuning::{name}"
        return int(eval(m[1], {}))  # an integer literal or product of them

    assert (cuda.THREADS, cuda.SCAN_TILES, cuda.SCAN_SHARED, cuda.SUM_ROWS, cuda.FLAG_WORDS) == (
        constant("kThreads"), constant("kScanTiles"), constant("kScanShared"), constant("kSumRows"),
        constant("kFlagWords"))


def test_every_status_code_the_kernels_record_has_its_message():
    """engine.cuh's ``Code`` enumerators, in order, are the host's messages
    (``nvlink_layout._STATUS``): a code added on the device is said on the host."""
    text = (cuda.csrc_dir() / "engine.cuh").read_text()
    body = text[text.index("enum Code : int {"):]
    codes = [int(v) for v in re.findall(r"^\s*k\w+ = (\d+),", body[: body.index("};")], flags=re.M)]
    assert codes == list(range(len(nvlink_layout._STATUS)))
    assert "rank 1 failed" in nvlink_layout.failure_message(7, 1, 2, 0, 10**9)


def test_the_counts_rows_columns_are_the_headers():
    """engine.cuh's ``Row`` names the columns of ``plan.HEADER`` (and those after it)
    where the host puts them: the device compares the columns the host does (checks.AGREED)."""
    text = (cuda.csrc_dir() / "engine.cuh").read_text()
    row = dict(re.findall(r"static constexpr int (k\w+) = (\d+);", text[text.index("struct Row"):]))
    header = plan.HEADER
    assert int(row["kAgreed"]) == checks.AGREED
    assert header[:header.index("failed")] == ("verb", "call", "along", "topk", "hidden", "x_dtype", "weights_dtype",
                                                "x_grad", "weights_grad")
    assert (int(row["kFailed"]), int(row["kBudget"]), int(row["kMemory"])) == tuple(
        header.index(c) for c in ("failed", "max_rows", "memory_rows"))
    assert (int(row["kTokens"]), int(row["kStaged"]), int(row["kGroups"]), int(row["kSends"])) == (
        nvlink.TOKENS_COL, nvlink.STAGED_COL, nvlink.GROUPS_COL, nvlink.SENDS_COL)


def test_the_layout_scan_takes_the_warps_whose_counts_fit():
    assert scan_warps(256, 8) == cuda.THREADS // 32  # DeepSeek-V3 on 8 ranks: every warp
    limit = cuda.SCAN_SHARED // 4  # ints of counts in one block
    assert scan_warps(limit - 8, 8) == 1
    assert scan_warps(limit - 7, 8) == 0  # unusable() names num_experts
    assert scan_warps(1024, 8) == cuda.SCAN_SHARED // (4 * 1032)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8, 32])
def test_the_layout_kernels_shared_memory_fits_a_block_up_to_the_experts_the_engine_takes(world):
    """A block takes 48 KiB of shared memory without opting in to more (the
    engine does not): its layout kernels' dynamic bytes (``cuda.SCAN_SHARED`` at
    most) leave room for their own words, and every E the engine takes fits
    both (the counts exchange's grows with E + E / W, past the scan's at W = 2)."""
    assert cuda.SCAN_SHARED <= 48 * 1024 - 1024
    most = most_experts(world)
    assert most % world == 0
    assert scan_warps(most, world) >= 1 and counts_shared(most, world) <= cuda.SCAN_SHARED
    bigger = most + world  # the next E the ranks can split
    assert scan_warps(bigger, world) == 0 or counts_shared(bigger, world) > cuda.SCAN_SHARED


def test_each_kernels_packer_lays_its_arguments_as_the_signature_does():
    """The function a launch packs its arguments with (``cuda._packer``, made per
    signature and free names) writes the bytes the signature's layout packs from
    ``arguments``, for every kernel of csrc/, whether every argument is named at
    the launch or some were bound before (as they travel, by place); a free name
    missing or unknown raises KeyError (the launch then names them)."""
    pointer = torch.zeros(3)
    for (source, name), sig in SIGNATURES.items():
        layout, _ = cuda.parameter_block(sig.codes)
        args = {}
        for i, (param, code) in enumerate(zip(sig.names, sig.codes)):
            args[param] = ((pointer, None, 4096)[i % 3] if i in sig.pointers
                           else 0.25 * i if code in "fd" else i + 1)
        want = layout.pack(*cuda.arguments(sig, args))
        travelled = cuda.arguments(sig, args)
        for free in (sig.names, sig.names[::2]):
            bound = tuple(None if n in free else v for n, v in zip(sig.names, travelled))
            given = {n: args[n] for n in free}
            block = ctypes.create_string_buffer(max(layout.size, 1))
            cuda._packer(sig, free)(layout.pack_into, block, given, bound)
            assert block.raw[: layout.size] == want, f"{source}:{name}"
            for wrong in ({**given, "unknown": 1}, {k: v for k, v in given.items() if k != free[-1]}):
                with pytest.raises(KeyError):
                    cuda._packer(sig, free)(layout.pack_into, block, wrong, bound)


def test_a_launch_with_bound_arguments_hands_the_driver_the_same_block(monkeypatch):
    """``Kernel.bind``: the bound values packed once, the free ones named at each
    launch, the block the driver gets the one an unbound launch of the same
    values gives; a free name missing, unknown or bound again is named."""
    blocks = []

    def launch(config, handle, params, extra):
        at = (ctypes.c_void_p * 5).from_address(params)
        blocks.append([struct.unpack(c, ctypes.string_at(at[i], struct.calcsize(c)))[0]
                       for i, c in enumerate("iQqIf")])
        return 0

    monkeypatch.setattr(cuda, "_launch", lambda: launch)
    monkeypatch.setattr(cuda, "raw_stream", lambda device: 0)
    monkeypatch.setattr(cuda, "_dependent_launch", lambda device: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    kernel = cuda.Kernel(None, cuda.THREADS, cuda.Signature(0, ("a", "p", "b", "c", "d"), "iQqIf", (1,)))
    kernel._handles[0] = 1
    pointer = torch.zeros(2)
    bound = kernel.bind(p=pointer, c=7)
    for i in range(2):
        bound(1, a=i, b=-i, d=0.5 * i)
        kernel(1, a=i, p=pointer, b=-i, c=7, d=0.5 * i)
        assert blocks[-1] == blocks[-2] == [i, pointer.data_ptr(), -i, 7, 0.5 * i]
    with pytest.raises(TypeError, match=r"missing \['d'\], unknown \['c'\]"):
        bound(1, a=0, b=0, c=7)
    with pytest.raises(TypeError, match=r"unknown \['e'\]"):
        kernel.bind(e=1)


@pytest.mark.parametrize("on_nvshmem", [False, True])
def test_launches_made_per_shape_take_the_grown_buffers(launches, monkeypatch, on_nvshmem):
    """A shape's launches bind the engine's buffers (their addresses, regions and
    sizes): buffers grown by ``ensure`` make every launch of that shape anew, with
    the new buffers' values, not the outgrown ones'. On NVSHMEM's symmetric
    memory no buffer is ever freed (its free is a collective of every process)."""
    from dispatch import nvlink

    world, experts, tokens, topk, hidden = 2, 8, 40, 4, 64
    codec = to_experts_codec("native", torch.bfloat16)
    engine = _cpu_engine(world, experts, Capacity(64, topk, staged_row_bytes(codec, hidden),
                                                  partial_row_bytes(torch.float32, hidden)))
    engine._on_nvshmem = on_nvshmem
    kept: list = []
    monkeypatch.setattr(nvlink, "_NVSHMEM_KEPT", kept)

    class Handle:  # what the symmetric rendezvous gives: every rank's address of the buffer
        def __init__(self, data):
            self.buffer_ptrs = [data.data_ptr()] * world

    class Symm:
        @staticmethod
        def empty(size, dtype, device):
            return torch.zeros(size, dtype=dtype)

        @staticmethod
        def rendezvous(data, group):
            return Handle(data)

    class Stream:
        def synchronize(self):
            pass

    engine._symm = Symm
    monkeypatch.setattr(cuda, "current_stream", lambda index: Stream())
    synced: list = []  # the device's work waited for before each allocation, on NVSHMEM's backend
    monkeypatch.setattr(cuda, "synchronize", lambda index: synced.append(len(kept)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices
    w = torch.rand(tokens, topk, generator=gen)
    header = plan.header(x, w, topk, plan.Ticket(max_rows=100, memory_rows=10**6))

    def round_trip():
        counts = engine._exchange_counts(idx, w, header, x, codec, True, False)
        presum = torch.empty(world * counts.bound, min(topk, engine.experts_per_rank), dtype=torch.int32)
        places = (torch.empty(100, dtype=w.dtype), torch.empty(100, dtype=torch.int64),
                  torch.empty(100, dtype=torch.int64))
        engine._to_experts(x, codec, counts, presum, torch.empty_like(presum), 100, meta_out=places)
        y = torch.randn(100, hidden, generator=gen).to(torch.bfloat16)
        engine._push(y, places[0], torch.float32, counts, presum)
        engine._home_sum(counts, torch.float32, y.dtype, hidden, None)

    round_trip()
    old_data, old_ptrs = engine._data, engine._data_ptrs
    assert ARGS["pull_rows"]["list_stride"] == 64 and ARGS["pull_rows"]["data_ptrs"] is old_ptrs
    engine.ensure(Capacity(1000, topk, 0, 0))  # the buffers grow (T_max to 1024)
    assert engine._data is not old_data and engine.capacity.tokens == 1024
    round_trip()  # the same shape: its launches made again on the grown buffers
    regions = engine._regions
    layout, counts, pull = ARGS["route_layout"], ARGS["exchange_counts"], ARGS["pull_rows"]
    push, home = ARGS["push_partials"], ARGS["home_sum"]
    assert layout["list_stride"] == pull["list_stride"] == push["tcap"] == home["tcap"] == 1024
    assert layout["shared_route"] == engine._data.data_ptr() + regions["route"][0]
    assert layout["copy_bytes"] == regions["route"][1] and layout["stage_copy"] == regions["stage"][1]
    assert pull["data_ptrs"] is engine._data_ptrs and push["data_ptrs"] is engine._data_ptrs
    assert (pull["route_off"], pull["route_copy"], pull["stage_off"]) == (*regions["route"], regions["stage"][0])
    assert (push["part_off"], push["part_copy"]) == regions["partials"]
    assert home["partials"] == engine._data.data_ptr() + regions["partials"][0]
    assert counts["staged"] == 1
    grown = engine._data
    engine.ensure(Capacity(3000, topk, 0, 0))  # and again: the first grown buffer is outgrown
    assert [t.data_ptr() for t in kept] == ([grown.data_ptr(), engine._data.data_ptr()] if on_nvshmem else [])
    assert synced == ([0, 1] if on_nvshmem else [])  # one wait before each allocation, none after


def test_a_kernels_signature_is_read_past_its_attributes():
    """Any ``__attribute__(...)`` between ``void`` and the name (launch bounds,
    cluster dims) is passed over; template arguments are counted; pointers
    travel as addresses and the rest as their C type."""
    source = """
    extern "C" __global__ void __launch_bounds__(256) __cluster_dims__(2, 1, 1) moved(
        char* out, const long long* places, int width, unsigned long long most) {}
    template <int A, typename T> __global__ void plain(const float* x, long long n) {}
    """
    found = cuda.signatures_in(source)
    assert found["moved"] == cuda.Signature(0, ("out", "places", "width", "most"), "QQiQ", (0, 1))
    assert found["plain"].template == 2 and found["plain"].names == ("x", "n")

