"""The NVLink engine's host side: symmetric buffers, epochs, and the launches of
its kernels (``csrc/``) for one dispatcher's group, every rank on one host.

Notation: W ranks, E experts (E_local per rank), T tokens of a rank (T_max the
largest of the group), K slots per token, J = min(K, E_local), H hidden size,
N rows handed to this rank's experts.

Two symmetric allocations per engine (``torch.distributed._symmetric_memory``):

* ``meta`` (fixed): flags [W] u32 (word s raised by rank s to the epoch it
  reached), then the counts matrix [W, L] int32, row s written by rank s: its
  header (``plan.HEADER``), its T, whether it staged its rows with the counts,
  its tokens per destination rank [W], its tokens per global expert [E].
* ``data`` (grown collectively): two copies (by epoch parity) each of the routes
  [T_max, K] (16-byte ``Slot``), the slots [T_max, K] (8 bytes), the staged
  rows [T_max, B] (B: wire bytes of a row, 16-aligned) and the partial sums
  [W, T_max, P] (P: wire bytes of a partial row).

Every operation (a counts exchange, a rows exchange, a combine, a slots
exchange) takes the next epoch: each rank writes what its peers will read,
raises its flag on every rank, and reads once every rank's flag has reached
the epoch. On the device a rank runs its operations in epoch order, whatever
streams the caller issues them on: each waits for an event the previous one
recorded (``_ordered``). A region written by operation i (the counts matrix,
routes, staged rows, partial sums, slots: two copies each, by parity) is
rewritten by operation i + 2 at the earliest, and a writer only gets there past
operation i + 1's wait, which its peers raise after their reads of operation
i: no reader is overtaken. Waits are bounded (``timeout``): a peer that never
arrives leaves a status word naming it, which the next dispatch's host read
turns into a RuntimeError; the engine then stays failed (every rank must build
its dispatchers again).

One engine serves every dispatcher of a (group, device, E, SM budget, timeout)
(:func:`engine_for`), so that a model's MoE layers share its buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from dispatch import cuda, plan
from dispatch.cuda import f32, i32, i64, ptr, u32, u64
from dispatch.kernels import quantize

_ALIGN = 256
_STATUS = ("ok", "timed out waiting for", "received more rows than the dispatch counted from",
           "received a route no checked dispatch makes (an expert id twice in a row, check_inputs=False) from")
_WHERE = ("the counts exchange", "the rows exchange", "the combine", "the routing-weight gradients")


def _up(n: int, to: int = _ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class Capacity:
    """Sizes the data buffer holds (per parity copy)."""

    tokens: int = 0  # T_max
    topk: int = 0  # K
    stage_row: int = 0  # bytes of a staged row
    part_row: int = 0  # bytes of a partial row

    def covers(self, other: "Capacity") -> bool:
        return all(getattr(self, f) >= getattr(other, f) for f in ("tokens", "topk", "stage_row", "part_row"))

    def union(self, other: "Capacity") -> "Capacity":
        tokens = max(self.tokens, other.tokens)
        return Capacity(max(256, 1 << max(tokens - 1, 0).bit_length()) if tokens > self.tokens else tokens,
                        max(self.topk, other.topk), max(self.stage_row, other.stage_row),
                        max(self.part_row, other.part_row))

    def regions(self, world: int) -> dict[str, tuple[int, int]]:
        """name -> (offset of copy 0, bytes of one copy)."""
        sizes = {
            "route": self.tokens * self.topk * 16,
            "slots": self.tokens * self.topk * 8,
            "stage": self.tokens * self.stage_row,
            "partials": world * self.tokens * self.part_row,
        }
        out, at = {}, 0
        for name, size in sizes.items():
            size = _up(size)
            out[name] = (at, size)
            at += 2 * size
        out["total"] = (at, 0)
        return out


@dataclass(frozen=True)
class Counts:
    """What the counts exchange of one dispatch gave.

    Attributes:
        matrix: [W, L] int32 on the device (the counts matrix).
        rows: the same on the host, W lists of L ints.
        tokens_of: T of every rank (host).
        tokens_per_expert: [E_local] int64 on the device.
        src_start: [W, E_local] int32 on the device: first row of (source, local expert).
        route: [T, K] ``Slot`` (int32 [T, K, 4]) of this rank's tokens, on the device.
        hit: [T] int32 mask of the ranks each token goes to.
        staged: the epoch in which every rank staged its routes and rows with
            the counts (None if some rank could not: they move in an exchange
            of their own).
    """

    matrix: torch.Tensor
    rows: list
    tokens_of: tuple
    tokens_per_expert: torch.Tensor
    src_start: torch.Tensor
    route: torch.Tensor
    hit: torch.Tensor
    staged: int | None = None

    @property
    def tmax(self) -> int:
        """The largest T of the group."""
        return max(self.tokens_of)

    @property
    def items(self) -> int:
        """(source rank, token) pairs of the group: the tokens of every rank."""
        return sum(self.tokens_of)


class Engine:
    """Buffers and launches of the NVLink transport for the dispatchers of one
    group (:func:`engine_for`).

    Args:
        group: the EP process group (NCCL, every rank on this host).
        num_experts: E.
        sm_budget: blocks the data kernels may use (None: one per SM).
        timeout: seconds a kernel waits for a peer before it gives up.
    """

    def __init__(self, group, num_experts: int, sm_budget: int | None, timeout: float) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        self._symm = symm_mem
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.world
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.blocks = sm_budget or cuda.num_sms(self.device)
        self.timeout_ns = int(timeout * 1e9)
        self.tokens_col = len(plan.HEADER)
        self.staged_col = self.tokens_col + 1
        self.sends_col = self.staged_col + 1
        self.counts_col = self.sends_col + self.world
        self.row_len = self.counts_col + num_experts
        self.rows_offset = _up(4 * self.world)
        matrix_bytes = 4 * self.world * self.row_len
        self._matrix_stride = _up(matrix_bytes)  # two copies, by epoch parity
        meta = symm_mem.empty(self.rows_offset + 2 * self._matrix_stride, dtype=torch.uint8, device=self.device)
        meta.zero_()
        self._meta = meta
        self._meta_handle = symm_mem.rendezvous(meta, self.group)  # host sync: a collective through the store
        self._meta_ptrs = _pointers(self._meta_handle, self.device)
        self._flags = meta[: 4 * self.world].view(torch.int32)
        self._meta_handle.barrier(channel=0)  # every rank's flags are zero before any is raised
        self._data = self._data_handle = self._data_ptrs = None
        self.capacity = Capacity()
        self._regions = Capacity().regions(self.world)
        self.epoch = 0
        self._kernels: dict = {}
        self.status = torch.zeros(4, dtype=torch.int32, device=self.device)
        self._counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._last: torch.cuda.Event | None = None  # recorded after the latest operation

    # -- order ---------------------------------------------------------------

    def _ordered(self) -> "_Ordered":
        """A context for one operation: on the current stream, after the previous
        operation (whatever stream it ran on), and recorded for the next."""
        if torch.cuda.current_device() != self.device.index:
            raise ValueError(f"the current CUDA device is {torch.cuda.current_device()}, the dispatcher's is "
                             f"{self.device.index}: call it with its own device current")
        return _Ordered(self)

    # -- buffers -------------------------------------------------------------

    def ensure(self, need: Capacity) -> None:
        """Grow the data buffer to hold ``need``; every rank must call this with
        the same ``need`` at the same point (it is a collective when it grows)."""
        if self.capacity.covers(need) and self._data is not None:
            return
        capacity = self.capacity.union(need)
        regions = capacity.regions(self.world)
        # host sync: this rank's earlier reads of its peers' buffers are done before the
        # rendezvous, which every rank reaches only after the same sync, so no rank still
        # reads a buffer when it is dropped.
        torch.cuda.current_stream(self.device).synchronize()
        if self._last is not None:
            self._last.synchronize()
        data = self._symm.empty(max(regions["total"][0], _ALIGN), dtype=torch.uint8, device=self.device)
        handle = self._symm.rendezvous(data, self.group)  # host sync: a collective through the store
        self._data, self._data_handle = data, handle
        self._data_ptrs = _pointers(handle, self.device)
        self.capacity, self._regions = capacity, regions

    def _offset(self, region: str, epoch: int) -> int:
        start, size = self._regions[region]
        return start + (epoch & 1) * size

    def _view(self, region: str, epoch: int, nbytes: int) -> torch.Tensor:
        at = self._offset(region, epoch)
        return self._data[at : at + nbytes]

    def _next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def _raise(self, code: int, peer: int, where: int) -> None:
        raise RuntimeError(
            f"NVLink transport: rank {self.rank} {_STATUS[code]} rank {peer} in {_WHERE[where]} "
            f"(timeout {self.timeout_ns / 1e9:g} s); the exchange's results are invalid"
        )

    # -- the counts exchange (dispatch) ------------------------------------

    def _fits(self, tokens: int, topk: int, stage_row: int) -> bool:
        """This rank's routes and rows fit the data buffer as it is."""
        return self._data is not None and self.capacity.covers(Capacity(tokens, topk, stage_row, 0))

    def _stage(self, rows: torch.Tensor, codec, epoch: int, stage_row: int) -> None:
        """Encode rows [T, H] into this rank's staging copy of ``epoch``."""
        tokens, hidden = rows.shape
        wire, fp8 = _wire_of(codec, rows.dtype)
        stage = self._view("stage", epoch, self.capacity.tokens * stage_row).view(-1, stage_row)[:tokens]
        if fp8:
            quantize.pack(rows, None, codec.fmt, codec.pow2_scales, out=stage[:, : codec.row_bytes(hidden)])
        else:
            stage[:, : hidden * wire.itemsize].view(wire).copy_(rows)

    def exchange_counts(self, topk_idx: torch.Tensor, weights: torch.Tensor, header: list[int],
                        rows: torch.Tensor | None = None, codec=None, check_values: bool = False) -> Counts:
        """Counts, routes and the counts exchange of one dispatch; one host read.

        Args:
            topk_idx: [T, K] int32/int64 expert ids (-1 empty).
            weights: [T, K] float32/float64 routing weights (their wire dtype).
            header: this rank's ``plan.HEADER`` entries (failure mark included).
            rows, codec: [T, H] rows to stage with the routes, before the flag
                is raised, so that the pull needs no second exchange (where
                every rank's routes and rows fit the buffers; ``Counts.staged``).
            check_values: the layout kernel raises the header's ``failed`` entry
                where a row holds an id outside [-1, E), an expert twice or a
                non-finite weight (``checks.value_flags``), so that every rank
                sees it in the counts it reads.
        """
        with self._ordered():
            return self._exchange_counts(topk_idx, weights, header, rows, codec, check_values)

    def _exchange_counts(self, topk_idx, weights, header, rows, codec, check_values) -> Counts:
        tokens, topk = topk_idx.shape
        device = self.device
        epoch = self._next_epoch()
        stage_row = 0 if rows is None else _up(codec.row_bytes(rows.shape[1]), 16)
        fits = self._fits(tokens, topk, stage_row)
        row = torch.empty(self.row_len, dtype=torch.int32, device=device)
        row[: self.counts_col] = plan.to_device(
            torch.tensor([*header, tokens, int(fits)] + [0] * self.world, dtype=torch.int32), device)
        if fits:  # the routes go straight into the buffer the peers read
            route = self._view("route", epoch, tokens * topk * 16).view(torch.int32).view(tokens, topk, 4)
        else:
            route = torch.empty(tokens, topk, 4, dtype=torch.int32, device=device)
        hit = torch.empty(tokens, dtype=torch.int32, device=device)
        counts, sends = row[self.counts_col :], row[self.sends_col : self.counts_col]
        if tokens:
            self._kernel("layout.cu", "route_layout", topk_idx.dtype, weights.dtype)(
                self.num_experts + -(-tokens // cuda.THREADS),
                (ptr(topk_idx), ptr(weights), i32(tokens), i32(topk), i32(self.num_experts),
                 i32(self.experts_per_rank), ptr(route), ptr(counts), ptr(sends), ptr(hit),
                 ptr(row[plan.HEADER.index("failed") :]) if check_values else ptr(None)),
            )
        else:
            counts.zero_()
        if fits:
            route = route.clone()  # the handle's own copy: the buffer's is rewritten two exchanges later
            if rows is not None and tokens:
                self._stage(rows, codec, epoch, stage_row)
        out = torch.empty(4 + self.world * self.row_len + self.world * self.experts_per_rank, dtype=torch.int32,
                          device=device)
        per_expert = torch.empty(self.experts_per_rank, dtype=torch.int64, device=device)
        self._kernel("layout.cu", "exchange_counts")(
            1,
            (ptr(self._meta_ptrs), i64(self.rows_offset + (epoch & 1) * self._matrix_stride), i32(self.rank),
             i32(self.world), i32(self.row_len),
             i32(self.counts_col), i32(self.experts_per_rank), ptr(row), u32(epoch), u64(self.timeout_ns),
             ptr(self.status), ptr(out), ptr(per_expert), ptr(out[4 + self.world * self.row_len :])),
            shared=4 * self.experts_per_rank,
        )
        # host sync: row counts (to size the output), headers, status
        host = out[: 4 + self.world * self.row_len].tolist()
        code, peer, where = host[:3]
        if code:
            self._raise(code, peer, where)
        length = self.row_len
        matrix = [host[4 + s * length : 4 + (s + 1) * length] for s in range(self.world)]
        staged = rows is not None and all(r[self.staged_col] for r in matrix)
        return Counts(out[4 : 4 + self.world * length], matrix, tuple(r[self.tokens_col] for r in matrix),
                      per_expert, out[4 + self.world * length :], route, hit, epoch if staged else None)

    # -- rows to the experts ---------------------------------------------------

    def to_experts(self, rows, codec, counts: Counts, presum, slot_k, num_rows: int, tstride: int,
                   meta_out=None) -> torch.Tensor:
        with self._ordered():
            return self._to_experts(rows, codec, counts, presum, slot_k, num_rows, tstride, meta_out)

    def _to_experts(self, rows, codec, counts: Counts, presum, slot_k, num_rows: int, tstride: int,
                    meta_out=None) -> torch.Tensor:
        """Move rows [T, H] to this rank's expert-major places ([N, H], dtype of rows).

        With ``meta_out`` = (weights [N], src_rank [N], src_token [N]) the places
        come from the routes (a dispatch; ``presum``/``slot_k`` are written),
        and where ``counts.staged`` the rows were staged with the counts;
        otherwise from ``presum`` (a move along a plan), in an exchange of its own."""
        tokens, hidden = rows.shape
        wire, fp8 = _wire_of(codec, rows.dtype)
        stage_row = _up(codec.row_bytes(hidden), 16)
        topk = counts.route.shape[1]
        from_route = meta_out is not None
        epoch = counts.staged if from_route else None
        if epoch is None:  # stage (and route) in an exchange of their own
            self.ensure(Capacity(counts.tmax, topk, stage_row, 0))
            epoch = self._next_epoch()
            if stage_row and tokens:
                self._stage(rows, codec, epoch, stage_row)
            if from_route and tokens:
                self._view("route", epoch, counts.route.numel() * 4).view(torch.int32).copy_(counts.route.flatten())
            self._kernel("layout.cu", "raise_flags")(
                1, (ptr(self._meta_ptrs), i32(self.world), i32(self.rank), u32(epoch)))
        out = torch.empty(num_rows, hidden, dtype=rows.dtype, device=rows.device)
        weights, src_rank, src_token = meta_out if from_route else (None, None, None)
        acc = torch.float64 if torch.float64 in (rows.dtype, wire) and not fp8 else torch.float32
        width = presum.shape[1]
        items = counts.items
        self._kernel(
            "intranode_dispatch.cu", "pull_rows", torch.uint8 if fp8 else wire, str(fp8), rows.dtype, acc,
            "true" if from_route else "false", weights.dtype if from_route else torch.float32,
        )(
            min(self.blocks, -(-items // (cuda.THREADS // 32))),
            (ptr(self._data_ptrs), i64(self._offset("route", epoch)), i64(self._offset("stage", epoch)),
             i64(stage_row), i64(quantize.codes_bytes(hidden)), ptr(counts.matrix), i32(self.row_len),
             i32(self.tokens_col), ptr(counts.src_start), i32(self.rank), i32(self.world),
             i32(self.experts_per_rank), i32(topk), i32(width), i32(hidden), i64(tstride), ptr(out),
             i64(num_rows), ptr(presum), ptr(slot_k), ptr(weights), ptr(src_rank), ptr(src_token),
             f32(quantize._out_max(rows.dtype)) if fp8 else f32(0.0), ptr(self._flags), u32(epoch),
             u64(self.timeout_ns), ptr(self.status)),
        )
        return out

    def _kernel(self, source: str, name: str, *types) -> "cuda.Kernel":
        """The kernel ``name`` of ``source`` for these template arguments (dtypes
        or C spellings), resolved once per engine."""
        key = (name, *types)
        kernel = self._kernels.get(key)
        if kernel is None:
            spelled = [cuda.c_type(t) if isinstance(t, torch.dtype) else t for t in types]
            kernel = self._kernels[key] = cuda.kernel(source, name, *spelled)
        return kernel

    # -- partial sums home -------------------------------------------------------

    def to_home(self, rows, weights, wire: torch.dtype, counts: Counts, presum, tstride: int,
                at_least: torch.dtype | None) -> torch.Tensor:
        with self._ordered():
            return self._to_home(_aligned(rows), weights, wire, counts, presum, tstride, at_least)

    def _to_home(self, rows, weights, wire: torch.dtype, counts: Counts, presum, tstride: int,
                 at_least: torch.dtype | None) -> torch.Tensor:
        """[N, H] expert-side rows -> [T, H] (dtype of rows): weighted pre-sum per
        (token, rank) pushed home in ``wire``, summed in ascending rank order."""
        hidden = rows.shape[1]
        tokens = counts.route.shape[0]
        part_row = _up(hidden * wire.itemsize, 16)
        tmax = counts.tmax
        self.ensure(Capacity(tmax, counts.route.shape[1], 0, part_row))
        epoch = self._next_epoch()
        weight_dtype = torch.float32 if weights is None else weights.dtype
        acc = torch.float64 if torch.float64 in (rows.dtype, wire, weight_dtype) else torch.float32
        items = counts.items
        self._kernel(
            "intranode_combine.cu", "push_partials", rows.dtype, weight_dtype, "false" if weights is None else "true",
            wire, acc,
        )(
            min(self.blocks, max(1, -(-items // (cuda.THREADS // 32)))),
            (ptr(rows), ptr(weights), ptr(presum), i32(presum.shape[1]), i64(tstride), ptr(counts.matrix),
             i32(self.row_len), i32(self.tokens_col), i32(hidden), ptr(self._data_ptrs),
             i64(self._offset("partials", epoch)), i64(part_row), i64(self.capacity.tokens), i32(self.rank),
             i32(self.world), ptr(self._meta_ptrs), u32(epoch), ptr(self._counter), ptr(self.status)),
        )
        out = torch.empty(tokens, hidden, dtype=rows.dtype, device=rows.device)
        home_acc = torch.float64 if torch.float64 in (wire, rows.dtype, at_least) else torch.float32
        partials = self._offset("partials", epoch)
        self._kernel("intranode_combine.cu", "home_sum", wire, rows.dtype, home_acc)(
            min(self.blocks, max(1, -(-tokens // (cuda.THREADS // 32)))),
            (ptr(counts.hit), i32(tokens), i32(hidden), u64(self._data.data_ptr() + partials), i64(part_row),
             i64(self.capacity.tokens), i32(self.world), ptr(out), ptr(self._flags), u32(epoch),
             u64(self.timeout_ns), ptr(self.status)),
        )
        return out

    def slots_home(self, values, counts: Counts, presum, slot_k, tstride: int) -> torch.Tensor:
        with self._ordered():
            return self._slots_home(values, counts, presum, slot_k, tstride)

    def _slots_home(self, values, counts: Counts, presum, slot_k, tstride: int) -> torch.Tensor:
        """[N] per-row values -> [T, K] per-slot values at home (0 for empty slots)."""
        tokens, topk = counts.route.shape[:2]
        self.ensure(Capacity(counts.tmax, topk, 0, 0))
        epoch = self._next_epoch()
        value_type = torch.float64 if values.dtype == torch.float64 else torch.float32
        wide = values.to(value_type).contiguous()
        items = counts.items * presum.shape[1]
        self._kernel("intranode_combine.cu", "push_slots", value_type)(
            min(self.blocks, max(1, -(-items // cuda.THREADS))),
            (ptr(wide), ptr(presum), ptr(slot_k), i32(presum.shape[1]), i64(tstride), ptr(counts.matrix),
             i32(self.row_len), i32(self.tokens_col), i32(topk), ptr(self._data_ptrs),
             i64(self._offset("slots", epoch)), i32(self.rank), i32(self.world), ptr(self._meta_ptrs),
             u32(epoch), ptr(self._counter), ptr(self.status)),
        )
        out = torch.empty(tokens, topk, dtype=value_type, device=self.device)
        self._kernel("intranode_combine.cu", "home_slots", value_type)(
            min(self.blocks, max(1, -(-tokens * topk // cuda.THREADS))),
            (ptr(counts.route), i64(tokens * topk), u64(self._data.data_ptr() + self._offset("slots", epoch)),
             ptr(out), i32(self.world), ptr(self._flags), u32(epoch), u64(self.timeout_ns), ptr(self.status)),
        )
        return out.to(values.dtype)


def _wire_of(codec, dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """(wire dtype, fp8 kind: 0 none, 1 e4m3, 2 e5m2) of a codec for rows of ``dtype``."""
    fmt = getattr(codec, "fmt", None)
    if fmt is None:
        return codec.wire, 0
    return torch.uint8, 1 if fmt is quantize.E4M3 else 2


class _Ordered:
    """See :meth:`Engine._ordered`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def __enter__(self) -> None:
        if self.engine._last is not None:
            torch.cuda.current_stream(self.engine.device).wait_event(self.engine._last)

    def __exit__(self, *exc) -> bool:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.engine.device))
        self.engine._last = event
        return False


def _pointers(handle, device: torch.device) -> torch.Tensor:
    """[W] int64 on ``device``: every rank's base pointer of a symmetric allocation."""
    return plan.to_device(torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64), device)


def _aligned(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` contiguous at a 16-byte-aligned address (the kernels load 16 bytes at a time)."""
    rows = rows.contiguous()
    return rows if rows.data_ptr() % 16 == 0 else rows.clone()


_ENGINES: dict = {}


def engine_for(group, num_experts: int, sm_budget: int | None, timeout: float) -> Engine:
    """The engine of a (group, current device, E, SM budget, timeout), made on first use
    (a collective: every rank of the group makes its dispatchers in the same order)."""
    group = group if group is not None else dist.group.WORLD
    key = (id(group), torch.cuda.current_device(), num_experts, sm_budget, timeout)
    engine = _ENGINES.get(key)
    if engine is None or engine.group is not group:
        engine = _ENGINES[key] = Engine(group, num_experts, sm_budget, timeout)
    return engine
