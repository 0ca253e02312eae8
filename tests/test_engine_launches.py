"""The NVLink engine's launches against its kernels' signatures, on CPU.

The kernels (``csrc/``) run only on GPUs; their calling contract is held here, in
CI: every argument tuple the engine's host side (``dispatch.nvlink.Engine``)
builds has the count and the C type of each parameter of the kernel it
launches (read from the source), and every instantiation names as many template
arguments as the kernel's template takes. An argument list out of step with its
kernel would otherwise show only on a GPU, as garbage read by the kernel.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from dispatch import cuda, plan
from dispatch.codec import to_experts_codec
from dispatch.nvlink import SENDS_COL, Capacity, Engine, partial_row_bytes, scan_warps, staged_row_bytes

_KERNEL = re.compile(
    r"(?:template\s*<(?P<template>[^>]*)>\s*)?__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?"
    r"(?P<name>\w+)\s*\((?P<params>[^)]*)\)"
)
_BY_VALUE = {
    "int": np.int32,
    "unsigned": np.uint32,
    "unsigned int": np.uint32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "float": np.float32,
    "double": np.float64,
}


def _signatures() -> dict:
    """(file, kernel) -> (template parameter count, [numpy type of each parameter])."""
    out = {}
    for path in sorted(cuda.csrc_dir().glob("*.cu")):
        for m in _KERNEL.finditer(path.read_text()):
            types = []
            for param in m["params"].split(","):
                decl = " ".join(param.split())
                if "*" in decl:
                    types.append(np.uint64)  # every pointer travels as its address
                    continue
                base = " ".join(w for w in decl.split()[:-1] if w != "const")
                types.append(_BY_VALUE[base])
            template = m["template"]
            out[(path.name, m["name"])] = (0 if template is None else len(template.split(",")), types)
    return out


SIGNATURES = _signatures()


class _Checked:
    """Stands for a compiled kernel: checks each launch's arguments and records it."""

    def __init__(self, source: str, name: str, template_args: tuple, launches: list) -> None:
        assert (source, name) in SIGNATURES, f"{source} has no kernel {name}"
        count, self.types = SIGNATURES[(source, name)]
        assert len(template_args) == count, f"{name}<{', '.join(template_args)}>: the template takes {count}"
        self.name, self.launches = name, launches

    def __call__(self, blocks, args, shared=0):
        assert int(blocks) >= 1
        assert 0 <= shared <= 48 * 1024, f"{self.name}: {shared} bytes of dynamic shared memory (48 KiB without opt-in)"
        assert len(args) == len(self.types), f"{self.name}: {len(args)} arguments for {len(self.types)} parameters"
        for i, (arg, want) in enumerate(zip(args, self.types)):
            assert type(arg) is want, f"{self.name} argument {i}: {type(arg).__name__}, the kernel takes {want.__name__}"
        self.launches.append(self.name)


@pytest.fixture
def launches(monkeypatch):
    made: list = []
    monkeypatch.setattr(cuda, "kernel", lambda source, name, *t: _Checked(source, name, t, made))
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
    e._flags = torch.zeros(world, dtype=torch.int32)
    e.capacity, e._regions = capacity, capacity.regions(world)
    e._data = torch.zeros(e._regions["total"][0], dtype=torch.uint8)
    e._data_ptrs = torch.zeros(world, dtype=torch.int64)
    e._kernels, e._retired, e._captured, e._last = {}, [], False, None
    e.status = torch.zeros(4, dtype=torch.int32)
    e._seq = torch.zeros(1, dtype=torch.int32)
    e._counter = torch.zeros(1, dtype=torch.int32)
    return e


@pytest.mark.parametrize("idx_dtype, weight_dtype", [(torch.int64, torch.float32), (torch.int32, torch.float64)])
@pytest.mark.parametrize("dtype, wire", [(torch.bfloat16, "native"), (torch.bfloat16, "fp8"), (torch.float32, "bf16")])
def test_a_round_trip_launches_every_kernel_as_declared(launches, idx_dtype, weight_dtype, dtype, wire):
    world, experts, tokens, topk, hidden = 2, 8, 40, 4, 64
    codec = to_experts_codec(wire, dtype)
    combine_wire = torch.float32
    engine = _cpu_engine(world, experts, Capacity(64, topk, staged_row_bytes(codec, hidden),
                                                  partial_row_bytes(combine_wire, hidden)))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    idx = torch.rand(tokens, experts, generator=gen).topk(topk, dim=1).indices.to(idx_dtype)
    w = torch.rand(tokens, topk, generator=gen, dtype=weight_dtype)
    header = plan.header(x, w, topk, (100, 1000))
    counts = engine._exchange_counts(idx, w, header, x, codec, True, False)
    width, max_rows = min(topk, engine.experts_per_rank), 100
    presum = torch.empty(world * counts.bound, width, dtype=torch.int32)
    slot_k = torch.empty_like(presum)
    places = (torch.empty(max_rows, dtype=weight_dtype), torch.empty(max_rows, dtype=torch.int64),
              torch.empty(max_rows, dtype=torch.int64))
    engine._to_experts(x, codec, counts, presum, slot_k, max_rows, meta_out=places)  # the dispatch
    out = engine._to_experts(x, codec, counts, presum, slot_k, max_rows)  # rows along the plan
    engine._to_experts(x, codec, counts, presum, slot_k, max_rows, piece=(30, 70), out=out)  # a later group's
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
    engine._to_experts(x, codec, by_groups, presum, slot_k, 102, meta_out=places, piece=(34, 68), out=out, group=1)
    # the rows staged with the counts by the layout's launch; along a plan by stage_rows
    assert launches == ["route_layout", "exchange_counts", "pull_rows", "stage_rows", "pull_rows",
                        "pull_rows", "push_partials", "home_sum", "store_pair", "push_partials", "push_slots",
                        "home_slots", "route_layout", "exchange_counts", "pull_rows"]


def test_the_signatures_are_read():
    """The parser finds every kernel the engine launches, with parameters."""
    names = {name for _, name in SIGNATURES}
    assert {"route_layout", "exchange_counts", "stage_rows", "pull_rows", "push_partials", "home_sum",
            "push_slots", "home_slots"} <= names
    assert all(types for _, types in SIGNATURES.values())
    count, types = SIGNATURES[("layout.cu", "exchange_counts")]
    assert count == 0 and types[0] is np.uint64 and types[3] is np.int32 and types[-1] is np.uint64


def test_the_host_side_mirrors_the_kernels_tuning():
    """The constants the host sizes launches by are the kernels' (engine.cuh)."""
    text = (cuda.csrc_dir() / "engine.cuh").read_text()

    def constant(name: str) -> int:
        m = re.search(rf"static constexpr (?:int|unsigned) {name} = ([^;]+);", text)
        assert m, f"engine.cuh has no Tuning::{name}"
        return int(eval(m[1], {}))  # an integer literal or product of them

    assert (cuda.THREADS, cuda.SCAN_TILES, cuda.SCAN_SHARED) == (
        constant("kThreads"), constant("kScanTiles"), constant("kScanShared"))


def test_the_layout_scan_takes_the_warps_whose_counts_fit():
    assert scan_warps(256, 8) == cuda.THREADS // 32  # DeepSeek-V3 on 8 ranks: every warp
    limit = cuda.SCAN_SHARED // 4  # ints of counts in one block
    assert scan_warps(limit - 8, 8) == 1
    assert scan_warps(limit - 7, 8) == 0  # unusable() names num_experts
    assert scan_warps(1024, 8) == cuda.SCAN_SHARED // (4 * 1032)
