"""The symmetric exchange under the NVSHMEM transport (``transport="nvshmem"``):
variable-split all-to-alls of rows whose split sizes are on the device, over
symmetric buffers of NVSHMEM's backend; by our put kernel
(``dispatch.kernels.nvshmem_puts``) where it runs, else by torch's
``all_to_all_vdev``; and whether NVSHMEM can serve a group here
(:func:`unusable`, :func:`take_backend`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from dispatch import cuda, free_memory, partition
from dispatch.kernels import nvshmem_puts
from dispatch.kernels.gather_sum import gather_sum


def unusable(group: dist.ProcessGroup | None) -> str | None:
    """Why NVSHMEM cannot serve ``group`` here (None if it may), answered at
    once from this process alone (no collective), changing nothing: it needs
    an NCCL group of two ranks or more on CUDA devices, the whole world
    (NVSHMEM's allocations are collective over every process), and a torch
    built with NVSHMEM. It also needs this process's symmetric memory on the
    NVSHMEM backend: :func:`take_backend` asks for it once every rank agrees."""
    backend = dist.get_backend(group)
    if backend != "nccl":
        return f"needs an NCCL process group on CUDA devices, got backend {backend!r}"
    if dist.get_world_size(group) == 1:
        return "needs peers: the group has one rank (torch's NVSHMEM rendezvous takes two or more)"
    if dist.get_world_size(group) != dist.get_world_size():
        return (f"needs the whole world as its group ({dist.get_world_size(group)} of {dist.get_world_size()} "
                "ranks here): NVSHMEM allocates symmetric memory on every process of the job at once, alike, "
                "which dispatchers of different groups would not do")
    symm_mem = _symmetric_memory()
    if symm_mem is None:
        return "needs torch.distributed._symmetric_memory"
    if not symm_mem.is_nvshmem_available():
        return "needs a torch built with NVSHMEM (torch.distributed._symmetric_memory.is_nvshmem_available())"
    return None


def blocks_differ(group: dist.ProcessGroup | None) -> str | None:
    """Why the ranks of ``group`` cannot share NVSHMEM's buffers, the same on
    every rank (a collective; None: they can): a row's stride there follows
    ``TORCH_SYMMMEM_NBLOCKS`` (:class:`SymmetricExchange`), which each process
    reads from its own environment, so it must be alike on every rank."""
    told: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(told, os.environ.get("TORCH_SYMMMEM_NBLOCKS"), group=group)  # host sync
    if len(set(told)) == 1:
        return None
    return ("needs TORCH_SYMMMEM_NBLOCKS alike on every rank (it lays out the rows in NVSHMEM's buffers), got "
            + ", ".join(f"rank {r}: {'unset' if b is None else repr(b)}" for r, b in enumerate(told)))


def take_backend() -> str | None:
    """This process's symmetric memory put on the NVSHMEM backend (None), or why
    it cannot be: torch fixes the backend at a process's first symmetric
    allocation (the NVLink engine's buffers make it ``CUDA``), and then NVSHMEM
    cannot serve the process. Torch cannot put it back: once taken, the
    process's later engines allocate on NVSHMEM's backend (which serves them:
    ``transports.nvlink.unusable`` refuses a group whose ranks' backends differ)."""
    symm_mem = _symmetric_memory()
    backend = symm_mem.get_backend(torch.device("cuda", torch.cuda.current_device()))
    if backend == "NVSHMEM":
        return None
    try:
        symm_mem.set_backend("NVSHMEM")
    except RuntimeError:
        return (f"this process's symmetric memory is on the {backend} backend already (torch fixes it at the "
                "first symmetric allocation, e.g. the NVLink engine's: NVSHMEM cannot serve it; make the NVSHMEM "
                "dispatcher first, and the engine runs on its backend's buffers)")
    return None


def _symmetric_memory():
    try:
        from torch.distributed import _symmetric_memory as symm_mem
    except ImportError:
        return None
    return symm_mem


class SymmetricExchange:
    """A variable-split all-to-all of rows whose split sizes are on the device:
    torch's NVSHMEM ``all_to_all_vdev``, over symmetric buffers it owns; one
    per (group, device), shared by every dispatcher there (``exchange_for``).

    ``exchange(rows, sends, receives, send_rows, recv_rows, consume)`` sends
    ``rows`` (destination-major, ``sends[r]`` to rank r; at most ``send_rows``,
    the rows every rank's send buffer holds) and returns ``consume(received)``:
    the [recv_rows + 1, width] rows received (source-major, the first
    ``receives.sum()`` real, then unset, then one zero row), read by
    ``consume`` before the next exchange reuses them. Where ``can_put`` says it
    runs, rows given ``at`` (this rank's first row at each receiver, [W] on the
    device) are put by this rank straight into the receivers' buffers instead
    (``dispatch.kernels.nvshmem_puts``, between two NVSHMEM barriers): no send
    buffer, no split exchange; ``gather`` all-gathers one row per rank (the
    counts); ``get_expand`` and ``presum_put`` move the rows to the experts and
    their pre-sums home with the experts' layout in the same pass.

    Every exchange runs on the exchange's own stream, in the order issued
    (the caller's stream waits for it), and opens with a barrier of the group
    (torch's all-to-all with no rows: its split exchange ends in one): torch's
    kernel reads the peers' send buffers with one-sided gets and tells nobody
    when it is done, and torch 2.11's NVSHMEM symmetric memory has no barrier
    of its own, so a rank rewrites its send buffer only once every peer is past
    its previous exchange, whatever ran before (a CUDA graph replayed back to
    back included). Rows are padded to a stride that the kernel's blocks per
    peer divide evenly (it asserts that); the send buffer holds at least 8 MiB,
    so that its block count is its largest whatever the rows. Symmetric memory
    is allocated alike on every process of the job at the same point: the
    sizes come from values every rank holds (the all-gathered counts, or
    ``reserve``), and buffers are never freed (a free is collective too).
    """

    MIN_SEND_BYTES = 8 << 20
    capturable = True  # its exchanges read nothing on the host: a CUDA graph may hold them

    def __init__(self, group: dist.ProcessGroup | None, world_size: int, device: torch.device) -> None:
        self.group_name = (group if group is not None else dist.group.WORLD).group_name
        self.world, self.device = world_size, device
        # torch's kernel gives each peer blocks // W blocks: at most 64 (16 off one host), or
        # TORCH_SYMMMEM_NBLOCKS where the user set it (alike on every rank: blocks_differ)
        told = os.environ.get("TORCH_SYMMMEM_NBLOCKS", "")
        blocks = (int(told),) if told.isdigit() and int(told) > 0 else (64, 16)
        self.unit = math.lcm(16, *(max(b // world_size, 1) for b in blocks))
        self._splits = (self._empty((world_size,), torch.int64), self._empty((2, world_size), torch.int64))
        self._sync = (self._empty((1, 16), torch.uint8), self._empty((1, 16), torch.uint8),
                      self._empty((world_size,), torch.int64).zero_(), self._empty((2, world_size), torch.int64))
        self._send: torch.Tensor | None = None
        self._recv: torch.Tensor | None = None
        self.generation = 0  # receive buffers made so far (``ensure``)
        self.operations = 0  # exchanges issued so far (a combine by groups sees whether one came between its groups)
        # its buffers NVSHMEM's (where torch's symmetric memory runs on NVSHMEM): our put kernel may write them
        from torch.distributed import _symmetric_memory as symm_mem

        get_backend = getattr(symm_mem, "get_backend", None)
        self._on_nvshmem = device.type == "cuda" and get_backend is not None and get_backend(device) == "NVSHMEM"
        self._spent: list[torch.Tensor] = []
        # a row to every rank, at row `rank` of each (``gather``): its index, sends and places
        rank = dist.get_rank(group)
        self._to_everyone = tuple(torch.full((world_size,), value, dtype=torch.int64, device=device)
                                  for value in (0, 1, rank))
        # its kernels' stream: its own, or beside an SM partition's stream the partition's (:meth:`_beside`)
        self._own = self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # whether our put kernel runs, agreed by every rank (a rank whose build failed would otherwise pair
        # torch's all-to-all, or NCCL's, with its peers' puts)
        self._puts = False
        if self._on_nvshmem and world_size <= nvshmem_puts.MAX_WORLD:
            built = torch.tensor([int(nvshmem_puts.built(device))], device=device)
            dist.all_reduce(built, op=dist.ReduceOp.MIN, group=group)
            self._puts = bool(built.item())  # host sync: once, at the exchange's making

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A symmetric tensor, rendezvoused with the group (a collective)."""
        from torch.distributed import _symmetric_memory as symm_mem

        if self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            # host sync: NVSHMEM's allocation is a collective with a barrier of its own (on its stream); an
            # exchange's barrier still queued on this rank's streams would pair with a peer's allocation
            # barrier crosswise, and both ranks wait for ever. So none is queued when it starts
            cuda.synchronize(self.device.index)
        tensor = symm_mem.empty(*shape, dtype=dtype, device=self.device)
        symm_mem.rendezvous(tensor, self.group_name)  # host sync: a collective through the store
        free_memory.FREE_MEMORY.forget()  # device memory taken outside torch's caching allocator
        return tensor

    def stride(self, row_bytes: int) -> int:
        """Bytes a row of ``row_bytes`` takes in the buffers."""
        return -(-row_bytes // self.unit) * self.unit

    def ensure(self, send_bytes: int, recv_bytes: int) -> None:
        """Buffers of at least these bytes (a collective where they grow: every
        rank calls it at the same point with the same sizes). ``generation``
        counts the receive buffers made: a CUDA graph that put into an earlier
        one is stale."""
        if self._recv is None or self._recv.numel() < recv_bytes:
            self.generation += 1
        if self._send is None or self._send.numel() < send_bytes:
            size = max(send_bytes, self.MIN_SEND_BYTES, 0 if self._send is None else 2 * self._send.numel())
            self._spent += [] if self._send is None else [self._send]
            self._send = self._empty((size,), torch.uint8)
        if self._recv is None or self._recv.numel() < recv_bytes:
            size = max(recv_bytes, 0 if self._recv is None else 2 * self._recv.numel())
            self._spent += [] if self._recv is None else [self._recv]
            self._recv = self._empty((size,), torch.uint8)

    def exchange(self, rows: "torch.Tensor | Packed", sends: torch.Tensor, receives: torch.Tensor, send_rows: int,
                 recv_rows: int, consume, at: torch.Tensor | None = None):
        if not isinstance(rows, Packed):
            rows = Packed.of(rows)
        count, width, dtype = min(rows.count, send_rows), rows.width, rows.dtype
        if at is not None and self.can_put(self.device):
            return self._put(lambda: rows.tensor(count, self.device), None, sends, at, count, recv_rows,
                             width * dtype.itemsize, dtype, consume, (*rows.reads, sends, at))
        row_bytes = width * dtype.itemsize
        stride = self.stride(row_bytes)
        self._room(send_rows, recv_rows, stride)

        def move():
            all_to_all_vdev(*self._sync, self.group_name)  # a barrier: every peer is past its last exchange
            send = _rows_of(self._send, stride)  # the whole buffer: its size sets the kernel's blocks
            place = send[:count, :row_bytes]
            if stride == row_bytes:  # written in place: no copy
                rows.write(place.view(-1).view(dtype).view(count, width))
            else:
                place.copy_(rows.tensor(count, self.device).view(torch.uint8))
            in_splits, out_splits = self._splits
            in_splits.copy_(sends)
            all_to_all_vdev(send, _rows_of(self._recv, stride), in_splits, out_splits, self.group_name)
            return self._received(stride, recv_rows, row_bytes, dtype, consume)

        return self._in_turn(move, (*rows.reads, sends, receives))

    def can_put(self, device: torch.device) -> bool:
        """Whether rows on ``device`` are put here (NVSHMEM's put kernel, on
        buffers of NVSHMEM's backend, on CUDA, built on every rank)."""
        return self._puts and nvshmem_puts.enabled and device == self.device

    def in_order(self, run):
        """``run()`` on the caller's stream in the exchanges' order: after the
        exchanges issued before, before those issued after (a CUDA graph
        replayed there that holds exchanges of its own)."""
        self.operations += 1
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._beside(current))
        result = run()
        self._stream.wait_stream(current)
        return result

    def get_expand(self, x: torch.Tensor, send_token: torch.Tensor, places: torch.Tensor, receives: torch.Tensor,
                   back_at: torch.Tensor, send_rows: int, recv_rows: int, expand_src: torch.Tensor,
                   spans: list[tuple[int, int]] | None = None):
        """The rows to the experts as they are (``x`` [T, H]), expanded where they
        land, each (token, rank) row over the link once: [N, H] (N =
        ``expand_src``'s length), row i the received row ``expand_src[i]``
        (``recv_rows``: zeros). Every rank stages its send rows (``x[send_token]``,
        at most ``send_rows``, the most any rank sends) in its send buffer, then
        each receiver gets row r (received from rank s, source-major by
        ``receives``) from row ``back_at[s] + r - first[s]`` of rank s's, and writes
        it to its places ``places[r]`` ([R, J], -1 padded): ``nvshmem_puts.get_expand``.
        The buffers' sizes come from ``send_rows`` and ``recv_rows``, the same on every rank.

        By groups (``spans``: each group's places, in order), one get a group,
        each row with the first group that has a place of it (written to all
        its places), returning ``(out, ends)``: ``ends[g]`` an event after
        group g's rows (None off CUDA), for which the stream that reads group
        g waits (the caller's stream does not wait for the whole move)."""
        row_bytes = x.shape[1] * x.element_size()
        stride = self.stride(row_bytes)
        self._room(send_rows, recv_rows, stride)
        count = min(send_token.shape[0], send_rows)
        ends: list = []

        def move():
            stage = _rows_of(self._send, stride)[:count, :row_bytes].view(x.dtype)
            if stride == row_bytes:  # straight into the stage: one pass
                torch.index_select(x, 0, send_token[:count], out=stage)
            else:
                stage.copy_(x.index_select(0, send_token[:count]))
            out = torch.empty(expand_src.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
            for span in spans or (nvshmem_puts.EVERY,):
                nvshmem_puts.get_expand(out, self._send, self._recv, stride, row_bytes, places, receives, back_at,
                                        recv_rows, expand_src, recv_rows, self._stream, span)
                if spans is not None:
                    ends.append(None if self._stream is None else torch.cuda.Event())
                    if ends[-1] is not None:
                        ends[-1].record(self._stream)
            return out

        out = self._in_turn(move, (x, send_token, places, receives, back_at, expand_src), joined=spans is None)
        return out if spans is None else (out, ends)

    def presum_put(self, y: torch.Tensor, weights: torch.Tensor | None, places: torch.Tensor, receives: torch.Tensor,
                   back_at: torch.Tensor, wire: torch.dtype, send_rows: int, recv_rows: int,
                   home_index: torch.Tensor) -> torch.Tensor:
        """Combine's pre-sums made where they are put home, and summed there:
        row r (received from rank s in the dispatch, as in :meth:`get_expand`)
        sums rows ``places[r]`` of ``y`` ([N, H], contiguous; each times
        ``weights`` of its row where given) in fp32 onto ``wire``, as
        ``gather_sum`` does, and goes to row ``back_at[s] + r - first[s]`` of rank
        s's receive rows (``nvshmem_puts.presum_put``); then each token's
        partials (``home_index`` [T, W], ascending rank, -1 padded) summed in
        fp32 into a [T, H] of y's dtype (``gather_sum``). ``send_rows``:
        the most rows any rank sends home; ``recv_rows``: the most it gets."""
        row_bytes = y.shape[1] * wire.itemsize
        stride = self.stride(row_bytes)
        self._room(send_rows, recv_rows, stride)

        def home_sum(back):
            return gather_sum(back, home_index, None, y.dtype)

        def move():
            nvshmem_puts.presum_put(self._recv, self._send, stride, y, weights, places, receives, back_at, wire,
                                    send_rows, self._stream)
            return self._received(stride, recv_rows, row_bytes, wire, home_sum)

        reads = (y, places, receives, back_at, home_index) + (() if weights is None else (weights,))
        return self._in_turn(move, reads)

    def group_table(self, bounds: tuple[int, ...]) -> torch.Tensor:
        """What :meth:`presum_put_group` keeps of a combine by groups whose
        groups' places start at ``bounds`` (G + 1): ``nvshmem_puts.group_table``."""
        return nvshmem_puts.group_table(bounds, self.device)

    def presum_put_group(self, table: torch.Tensor, new: list[tuple[int, torch.Tensor, torch.Tensor | None]],
                         span: tuple[int, int], places: torch.Tensor, receives: torch.Tensor, back_at: torch.Tensor,
                         wire: torch.dtype, send_rows: int, recv_rows: int,
                         home_index: torch.Tensor | None) -> torch.Tensor | None:
        """Groups of a combine by groups (:meth:`presum_put` in pieces): the
        groups ``new`` ((g, rows, weights): rows contiguous, like every
        group's) stored in ``table``, then the pre-sums of the received rows
        whose last place is in ``span`` (from every group's rows stored so far)
        put home. With ``home_index`` (the last group), the home sums as
        :meth:`presum_put` returns them; else None."""
        rows = new[-1][1]
        row_bytes = rows.shape[1] * wire.itemsize
        stride = self.stride(row_bytes)
        self._room(send_rows, recv_rows, stride)

        def move():
            for g, group_rows, group_weights in new:
                nvshmem_puts.store_group(table, g, group_rows, group_weights)
            nvshmem_puts.presum_put(self._recv, self._send, stride, rows, new[-1][2], places, receives, back_at, wire,
                                    send_rows, self._stream, table, span)
            if home_index is None:
                return None
            return self._received(stride, recv_rows, row_bytes, wire,
                                  lambda back: gather_sum(back, home_index, None, rows.dtype))

        reads = [table, places, receives, back_at] + [t for _, r, w in new for t in (r, w) if t is not None]
        return self._in_turn(move, tuple(reads) + (() if home_index is None else (home_index,)))

    def gather(self, row: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """All-gather of one row per rank ([L] on the device, alike on every
        rank) by the put kernel (where ``can_put``): [W, L] (``out`` where
        given), row s rank s's."""
        if out is None:
            out = torch.empty(self.world, row.numel(), dtype=row.dtype, device=row.device)
        source = row.reshape(1, -1).contiguous()
        index, sends, at = self._to_everyone
        row_bytes = source.shape[1] * source.element_size()
        return self._put(lambda: source, index, sends, at, self.world, self.world, row_bytes, row.dtype,
                         lambda got: out.copy_(got[: self.world]), (source, out))

    def _put(self, source, send_token, sends, at, most: int, recv_rows: int, row_bytes: int, dtype, consume,
             reads: tuple):
        """Rows of ``source()`` (by ``send_token``, or in order) put to the
        receivers, then ``consume`` of the rows received."""
        stride = self.stride(row_bytes)
        self._room(0, recv_rows, stride)

        def move():
            nvshmem_puts.put_rows(self._recv, stride, source(), send_token, sends, at, most, self._stream)
            return self._received(stride, recv_rows, row_bytes, dtype, consume)

        return self._in_turn(move, reads)

    def _beside(self, current: "torch.cuda.Stream") -> "torch.cuda.Stream":
        """The stream the exchange's kernels take beside ``current`` (its own, or an
        SM partition's stand-in for it beside one of that partition's), after the
        one they took last: every move stays in the order issued."""
        self._stream = partition.handed_over(self._stream, partition.beside(current, self._own))
        return self._stream

    def _room(self, send_rows: int, recv_rows: int, stride: int) -> None:
        """Buffers for ``send_rows`` rows to send and ``recv_rows`` received (and the
        zero row after them), ``stride`` bytes each; none where this rank moves no
        row either way: a rank that failed its own bounded dispatch takes part
        with no rows, and its own rows' width (wider than its peers', say) must
        not grow a buffer alone (a growth is a collective). The first buffers are
        made whatever the rows (every rank makes them at the same call)."""
        if send_rows or recv_rows or self._send is None or self._recv is None:
            self.ensure(send_rows * stride, (recv_rows + 1) * stride)

    def _received(self, stride: int, recv_rows: int, row_bytes: int, dtype: torch.dtype, consume):
        """``consume`` of the rows received, [recv_rows + 1, row], the last zeros
        (with none received, that zero row made here: see :meth:`_room`)."""
        if not recv_rows:
            return consume(torch.zeros(1, row_bytes, dtype=torch.uint8, device=self.device).view(dtype))
        out = _rows_of(self._recv, stride)[: recv_rows + 1, :row_bytes]
        out[recv_rows].zero_()
        return consume(out.view(dtype))

    def _in_turn(self, move, reads: tuple, joined: bool = True):
        """``move()`` on the exchange's own stream, after the caller's work and
        (``joined``; else the caller waits for events of the move's own) before
        the caller's next (``reads``: the caller's tensors it reads)."""
        self.operations += 1
        current = None if self._stream is None else torch.cuda.current_stream(self.device)
        if current is None:
            return move()
        self._beside(current).wait_stream(current)
        with torch.cuda.stream(self._stream):
            result = move()
        if joined:
            current.wait_stream(self._stream)
        if not torch.cuda.is_current_stream_capturing():  # made and read on two streams
            for tensor in reads:
                tensor.record_stream(self._stream)
            for tensor in result if isinstance(result, tuple) else (result,):  # (what consume made: a tuple too)
                if tensor is not None:
                    tensor.record_stream(current)
        return result


@dataclass(frozen=True)
class Packed:
    """Rows to send, made where they go: ``write(out)`` writes the first n of
    them into ``out``, [n, width] of ``dtype``, contiguous (an exchange's send
    buffer: no copy of them in between), reading only ``reads``."""

    count: int
    width: int
    dtype: torch.dtype
    write: Callable[[torch.Tensor], object]
    reads: tuple
    made: torch.Tensor | None = None  # the rows themselves, where they were made already

    @staticmethod
    def of(rows: torch.Tensor) -> Packed:
        """Rows made already (a 2-D tensor): written by a copy."""
        return Packed(rows.shape[0], rows.shape[1], rows.dtype, lambda out: out.copy_(rows[: out.shape[0]]), (rows,),
                      rows)

    def tensor(self, count: int, device: torch.device) -> torch.Tensor:
        """The first ``count`` rows, contiguous (in a tensor of their own where they were not made yet)."""
        if self.made is not None:
            return self.made[:count].contiguous()
        out = torch.empty(count, self.width, dtype=self.dtype, device=device)
        self.write(out)
        return out


_EXCHANGES: dict = {}


def exchange_for(group: dist.ProcessGroup | None, world_size: int, device: torch.device) -> SymmetricExchange:
    """The :class:`SymmetricExchange` of (group, device), made on first use (a
    collective: every rank makes its dispatchers in the same order)."""
    key = ((group if group is not None else dist.group.WORLD).group_name, device)
    if key not in _EXCHANGES:
        _EXCHANGES[key] = SymmetricExchange(group, world_size, device)
    return _EXCHANGES[key]


def all_to_all_vdev(send, recv, in_splits, out_splits_offsets, group_name: str) -> None:
    """torch's NVSHMEM all-to-all (``torch.ops.symm_mem.all_to_all_vdev``):
    rows of ``send`` [rows, stride] to each rank by ``in_splits`` [W], into
    ``recv`` by source rank; writes the rows received from each rank and
    their offsets into ``out_splits_offsets`` [2, W]. Every argument symmetric."""
    torch.ops.symm_mem.all_to_all_vdev(send, recv, in_splits, out_splits_offsets, group_name)


def _rows_of(buffer: torch.Tensor, stride: int) -> torch.Tensor:
    """A byte buffer as [rows, stride] from its start (where its rendezvous is)."""
    rows = buffer.numel() // stride
    return buffer[: rows * stride].view(rows, stride)
