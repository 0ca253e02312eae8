"""The NVLink engine's host side: symmetric buffers, epochs, and the launches of
its kernels (``csrc/``) for one dispatcher's group, every rank on one host.

Notation: W ranks, E experts (E_local per rank), T tokens of a rank (T_max the largest
of the group), K slots per token, J = min(K, E_local), H hidden size, N rows to its experts.

Two symmetric allocations per engine (``torch.distributed._symmetric_memory``):

* ``meta`` (fixed): flags [W] u32 (word s raised by rank s to the epoch it
  reached), rank s's failure mark and failed epoch ([W] u32 each: a failed
  rank's flags say so, ``csrc/engine.cuh``'s ``wait_peers``), then the counts
  matrix [W, L] int32, row s written by rank s: its header (``plan.HEADER``, its
  row budgets included), its T, whether it staged its rows with the counts, the
  groups of experts its dispatch moves by, its tokens per destination rank [W],
  its tokens per global expert [E] (the columns of ``engine.cuh``'s ``Row``).
* ``data`` (grown collectively): two copies (by epoch parity) each of the routes
  [T_max, K] (16-byte ``Slot``), the lists [W, T_max] int32 (the tokens each
  destination rank gets, ascending: a receiver walks only its own), the slots
  [T_max, K] (8 bytes), the staged rows [T_max, B] (B: wire bytes of a row,
  16-aligned) and the partial sums [W, T_max, P] (P: wire bytes of a partial row).

Every operation (a counts exchange with the rows staged beside it, a rows
exchange, a combine, a slots exchange) takes the next epoch; a combine by groups
of experts is one operation in G pushes, those before the last writing the
epoch's partials without raising it (:meth:`Engine.push_group`). The epoch lives
on the device (``seq``, one word), so that a CUDA graph of operations replays
with fresh epochs: the kernel that raises an operation's flags takes seq + 1
and stores it, the kernels before it write the epoch's copy of the regions,
the kernels after it wait for every rank's flag to reach it and read. On the
device a rank runs its operations in order, whatever streams the caller issues
them on: each waits for an event the previous one of its kind recorded (eager
work, or a capture's; a graph's replay is ordered by its stream: ``_ordered``). A
region written in epoch i (the counts matrix, routes, staged rows, partial
sums, slots: two copies each, by parity) is rewritten in epoch i + 2 at the
earliest, and a writer only gets there past epoch i + 1's wait, which its peers
raise after their reads of epoch i: no reader is overtaken (a failed rank, which
waits no more, writes nothing its peers read but its flags, marked failed). Waits
are bounded (``timeout``): a peer that never arrives, or arrives failed, leaves a
status word naming it, which the next host read turns into a RuntimeError (the
next dispatch's, or :meth:`Engine.check`); the engine then stays failed (every
rank must build its dispatchers again).

A dispatch with a row budget (``max_rows``) reads nothing on the host: its
output has ``max_rows`` rows (those past the N received zeroed), and the
checks a host read makes elsewhere (headers agreed, no rank's input marked bad,
every rank's N within its budget) run in the counts exchange kernel, which
records the first failure, in rank order, on every rank alike; the error is
raised on every rank at a later dispatch's agreement, the first at which some
rank has seen it reach the host (:meth:`Engine.seen_failed`), or by
:meth:`Engine.check`.

One engine serves every dispatcher of a (group, device, E, SM budget, timeout)
(:func:`engine_for`), so that a model's MoE layers share its buffers.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from dispatch import cuda, free_memory, host, plan
from dispatch.nvlink_layout import (_ALIGN, GROUPS_COL, SENDS_COL, STAGED_COL, TOKENS_COL, Capacity, Counts,
                                    HostCounts, WordsAt, _up, aligned_rows, counts_shared, failure_message,
                                    partial_row_bytes, scan_warps, staged_row_bytes)
from dispatch.nvlink_moves import EngineMoves
from dispatch.nvlink_order import Ordered, eager_stream, ordered_eager

__all__ = ["GROUPS_COL", "SENDS_COL", "STAGED_COL", "TOKENS_COL", "Capacity", "Counts", "Engine", "aligned_rows",
           "engine_for", "partial_row_bytes", "scan_warps", "staged_row_bytes"]

BLOCKS_PER_SM = 4  # blocks of the data kernels per SM without an SM budget (measured: bench/engine_tuning.py)


class Engine(EngineMoves):
    """Buffers and launches of the NVLink transport for the dispatchers of one
    group (:func:`engine_for`).

    Args:
        group: the EP process group (NCCL, every rank on this host).
        num_experts: E.
        sm_budget: blocks the data kernels may use (None: ``BLOCKS_PER_SM`` per SM).
        timeout: seconds a kernel waits for a peer before it gives up.

    Its operations are issued by one thread at a time (they share its epochs,
    its order and its host words).
    """

    def __init__(self, group, num_experts: int, sm_budget: int | None, timeout: float) -> None:
        from torch.distributed import _symmetric_memory as symm_mem

        # the compiled host path, built here (the first time on this machine) before the
        # rendezvous below, so that the ranks line up after it, not in their first dispatch
        self._host = host.module()
        self._symm = symm_mem
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.num_experts = num_experts
        self.experts_per_rank = num_experts // self.world
        self._scan_warps = scan_warps(num_experts, self.world)  # >= 1: transports.nvlink.unusable checked it
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.sms = cuda.num_sms(self.device)
        self.blocks = sm_budget or self.sms * BLOCKS_PER_SM
        self.timeout_ns = int(timeout * 1e9)
        self.counts_col = SENDS_COL + self.world
        self.row_len = self.counts_col + num_experts
        self.rows_offset = _up(4 * cuda.FLAG_WORDS * self.world)  # the flags region, then the matrix
        matrix_bytes = 4 * self.world * self.row_len
        self._matrix_stride = _up(matrix_bytes)  # two copies, by epoch parity
        # on NVSHMEM's backend (where a transport="nvshmem" dispatcher set it first) its buffers are
        # NVSHMEM's, reached through their peer pointers as CUDA's
        self._on_nvshmem = getattr(symm_mem, "get_backend", lambda device: "CUDA")(self.device) == "NVSHMEM"
        self._allocated = torch.zeros(self.world + 1, dtype=torch.int32, device=self.device)  # (_agree_allocated)
        meta, self._meta_handle = self._symmetric(self.rows_offset + 2 * self._matrix_stride)
        meta.zero_()
        self._meta = meta
        self._meta_ptrs = _pointers(self._meta_handle, self.device)
        self._flags = meta[: 4 * cuda.FLAG_WORDS * self.world].view(torch.int32)
        # every rank's flags are zero before any is raised (NVSHMEM's handle has no barrier: the host's)
        if self._on_nvshmem:
            torch.cuda.current_stream(self.device).synchronize()
            dist.barrier(group=self.group, device_ids=[self.device.index])
        else:
            self._meta_handle.barrier(channel=0)
        self._data = self._data_handle = self._data_ptrs = None
        self._retired: list = []  # buffers outgrown that queued work or captured graphs may still use
        self._captured = False  # some operation was captured in a CUDA graph
        self.capacity = Capacity()
        self.reserved = False  # a dispatch with max_rows sized the buffers by agreement (transports.nvlink.reserve)
        self._regions = Capacity().regions(self.world)
        self._kernels: dict = {}
        self._launches: dict = {}  # launches made per shape, bound while the buffers last (growth empties it)
        self.status = torch.zeros(4, dtype=torch.int32, device=self.device)
        self._seq = torch.zeros(1, dtype=torch.int32, device=self.device)  # the epoch reached (u32)
        self._counter = torch.zeros(1, dtype=torch.int32, device=self.device)
        self._scratch = torch.zeros(0, dtype=torch.int32, device=self.device)  # the layout's zeroed words
        # the latest eager operation's (event, raw stream handle), and the latest captured one's
        # (event, the id of its capture, raw stream handle): dispatch.nvlink_order
        self._last: tuple | None = None
        self._last_captured: tuple | None = None
        self._eager_event: torch.cuda.Event | None = None  # the event eager operations record (Ordered)
        self._eager_raw = 0  # its handle, once recorded (dispatch.nvlink_order.eager_stream)
        self._polled = torch.zeros(4, dtype=torch.int32).pin_memory()  # a copy of status (seen_failed)
        self._polled_event: torch.cuda.Event | None = None
        self._poll_stream: torch.cuda.Stream | None = None  # where that copy runs (made at the first poll)
        self.failure_seen = False  # a failure recorded on the device has reached the host (seen_failed)
        self._host_words = None  # the counts matrix as the compiled counts exchange reads it (pinned)
        if self._host is not None:
            self._host_words = torch.empty(4 + self.world * self.row_len, dtype=torch.int32).pin_memory()
        # operations issued so far that may write the peers' buffers or raise an epoch (a
        # combine by groups sees whether another came between two of its groups)
        self.operations = 0

    # -- order and failures ----------------------------------------------------

    def _ordered(self, writes: bool = True) -> Ordered:
        """A context for one operation: on the current stream, after the previous
        operation of its kind (eager, or of its CUDA graph capture; whatever stream
        it ran on: ``dispatch.nvlink_order``), and recorded for the next;
        ``writes``: it may write the peers' buffers or raise an epoch (counted in
        ``operations``)."""
        self.check_current()
        return Ordered(self, writes)

    def check_current(self) -> None:
        """Raise a ValueError where another CUDA device than the engine's is current."""
        if (current := cuda.current_device()) != self.device.index:
            raise ValueError(f"the current CUDA device is {current}, the dispatcher's is {self.device.index}: call "
                             "it with its own device current")

    def raise_failure(self, code: int, peer: int, where: int) -> None:  # (the status words, read on the host)
        self.failure_seen = True  # seen for good (seen_failed): the next dispatch's word says so
        raise RuntimeError(failure_message(code, peer, where, self.rank, self.timeout_ns))

    def check(self) -> None:
        """Raise the failure the kernels recorded, if any (a host read: it waits
        for the work queued on the current stream)."""
        if self._last is not None:
            self._last[0].synchronize()  # host sync: the latest eager operation, on whatever stream
        code, peer, where, _ = self.status.tolist()  # host sync: the status words
        if code:
            self.raise_failure(code, peer, where)

    def seen_failed(self, poll: bool) -> bool:
        """Whether a failure the kernels recorded has reached the host, without
        waiting (seen once, for good: the engine stays failed): reads the copy of
        the status words that an earlier call queued, if it has landed; with
        ``poll``, queues a new one where none is in flight. Never inside a CUDA
        graph capture."""
        if self.failure_seen or cuda.capturing():
            return self.failure_seen
        event = self._polled_event
        if event is not None:
            if not event.query():
                return False
            self._polled_event = None
            if self._polled[0]:  # landed: no wait
                self.failure_seen = True
                return True
        if poll:  # the copy comes after the latest operation and the caller's work so far, on a stream of its
            # own: it orders nothing after it (the caller's stream does not wait for the engine's latest operation)
            if self._poll_stream is None:
                self._poll_stream = torch.cuda.Stream(self.device)
            side = self._poll_stream
            side.wait_stream(cuda.current_stream(self.device.index))
            if self._last is not None:  # (the latest eager operation: never inside a capture)
                side.wait_event(self._last[0])
            with torch.cuda.stream(side):
                self._polled.copy_(self.status, non_blocking=True)
                self._polled_event = torch.cuda.Event()
                self._polled_event.record(side)
        return False

    # -- buffers -------------------------------------------------------------

    def ensure(self, need: Capacity) -> None:
        """Grow the data buffer to hold ``need``; every rank must call this with
        the same ``need`` at the same point (it is a collective when it grows).
        Once an operation was captured in a CUDA graph, an outgrown buffer is
        kept (the graph replays on it), not freed."""
        if self.capacity.covers(need) and self._data is not None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the NVLink engine's buffers must grow and cannot inside a CUDA graph capture: "
                               "run one eager round trip (dispatch, combine, backward) of the largest shapes first")
        capacity = self.capacity.union(need)
        regions = capacity.regions(self.world)
        # host sync: this rank's earlier reads of its peers' buffers are done before the rendezvous,
        # which every rank reaches only after the same sync: no rank still reads a buffer dropped
        cuda.current_stream(self.device.index).synchronize()
        if self._last is not None:
            self._last[0].synchronize()
        data, handle = self._symmetric(max(regions["total"][0], _ALIGN))
        if self._captured and self._data is not None:  # a captured graph may still replay on these
            self._retired.append((self._data, self._data_handle, self._data_ptrs))
        self._data, self._data_handle = data, handle
        self._data_ptrs = _pointers(self._data_handle, self.device)
        self.capacity, self._regions = capacity, regions
        self._launches = {}  # their bound addresses and sizes were the outgrown buffer's (a new dict: dispatch.usual)
        self.operations += 1  # (a combine by groups in flight pushes its pre-sums again, whole: not to the outgrown)

    def _symmetric(self, size: int):
        """(a symmetric byte buffer of ``size``, its handle): a collective of the
        group. On NVSHMEM's backend it is never freed (NVSHMEM's free is a
        collective of every process, which the ranks' dropping it at different
        times would not make)."""
        if self._on_nvshmem and not torch.cuda.is_current_stream_capturing():  # host sync: NVSHMEM's allocation
            cuda.synchronize(self.device.index)  # has a barrier of its own, which one queued here would pair crosswise
        try:
            data, error = self._symm.empty(size, dtype=torch.uint8, device=self.device), None
        except RuntimeError as exc:  # (out of memory: torch's, or the driver's) this rank alone, maybe: its
            data, error = None, exc  # peers would wait in the rendezvous
        if not self._on_nvshmem:  # (NVSHMEM's allocation is a collective of its own, on a heap of one size)
            self._agree_allocated(size, error)
        handle = self._symm.rendezvous(data, self.group)  # host sync: a collective through the store
        free_memory.FREE_MEMORY.forget()  # device memory taken outside torch's caching allocator
        if self._on_nvshmem:
            _NVSHMEM_KEPT.append(data)
        return data, handle

    def _agree_allocated(self, size: int, error: Exception | None) -> None:
        """Every rank learns whether each allocated its part of a symmetric
        buffer of ``size`` bytes (``error``: this rank's failure), before the
        rendezvous: where some rank could not, every rank raises, naming it,
        and keeps the buffers it had."""
        words = self._allocated
        words[self.world].fill_(int(error is None))
        dist.all_gather_into_tensor(words[: self.world], words[self.world:], group=self.group)
        short = [r for r, ok in enumerate(words[: self.world].tolist()) if not ok]  # host sync: every rank's
        if short:
            message = (f"NVLink transport: rank(s) {short} could not allocate {size} bytes of device memory for the "
                       "engine's symmetric buffers; no rank grew them (free device memory, or dispatch fewer tokens)")
            raise (torch.OutOfMemoryError if isinstance(error, torch.OutOfMemoryError) else RuntimeError)(
                message) from error

    def _region(self, name: str) -> tuple[int, int]:
        """(offset of copy 0, bytes between the copies) of a region of the data buffer."""
        return self._regions[name]

    def _fits(self, tokens: int, topk: int, stage_row: int) -> bool:
        """This rank's routes and rows fit the data buffer as it is."""
        return self._data is not None and self.capacity.covers(Capacity(tokens, topk, stage_row, 0))

    def _stage(self, src: torch.Tensor, row_bytes: int, region: str, dst_stride: int, signal: bool) -> None:
        """Copy rows [T, row_bytes] (bytes of ``src``, rows 16-aligned where they
        can be) into this rank's copy of ``region`` of the next epoch; with
        ``signal``, raise that epoch's flags once they are visible."""
        tokens = src.shape[0]
        start, copy = self._region(region)
        stride = src.stride(0) * src.element_size() if tokens else row_bytes
        self._kernel("intranode_dispatch.cu", "stage_rows")(
            self._copy_grid(tokens),
            src=src,
            src_stride=stride,
            row_bytes=row_bytes,
            rows=tokens,
            dst=self._data.data_ptr() + start,
            copy_bytes=copy,
            dst_stride=dst_stride,
            seq=self._seq,
            signal=int(signal),
            flag_ptrs=self._meta_ptrs,
            world=self.world,
            me=self.rank,
            counter=self._counter,
            status=self.status,
        )

    def _copy_grid(self, rows: int) -> int:
        """Blocks that copy ``rows`` rows, a warp a row, within the budget."""
        return min(self.blocks, max(1, -(-rows // (cuda.THREADS // 32))))

    def _stage_rows(self, rows: torch.Tensor, codec, stage_row: int, signal: bool) -> None:
        """Encode rows [T, H] for the wire and stage them (``_stage``)."""
        wire = codec.pack(rows) if rows.shape[0] else rows
        self._stage(wire, codec.row_bytes(rows.shape[1]), "stage", stage_row, signal)

    # -- the counts exchange (dispatch) ------------------------------------

    def exchange_counts(self, topk_idx: torch.Tensor, weights: torch.Tensor, header: list[int],
                        rows: torch.Tensor | None = None, codec=None, check_values: bool = False,
                        host_read: bool = True, groups: int = 1, planned: tuple | None = None,
                        pull: bool = False) -> Counts:
        """Counts, routes and the counts exchange of one dispatch.

        Args:
            topk_idx: [T, K] int32/int64 expert ids (-1 empty).
            weights: [T, K] float32/float64 routing weights (their wire dtype).
            header: this rank's ``plan.HEADER`` entries (failure mark and row
                budgets included: where some rank has a max_rows, the kernel
                checks every rank's N against it).
            rows, codec: [T, H] rows to stage with the routes (by blocks of the
                layout's launch, beside it), before the flag is raised, so that
                the pull needs no second exchange (where every rank's routes and
                rows fit the buffers; ``Counts.staged``).
            check_values: the layout kernel raises the header's ``failed`` entry
                where a row holds an id outside [-1, E), an expert twice or a
                non-finite weight (``checks.value_flags``), so that every rank
                sees it in the counts it reads.
            host_read: one host read (the counts matrix, the status); else
                nothing is read on the host (a dispatch with max_rows: the caller
                made sure the routes and rows fit the buffers).
            groups: G, the groups of local experts the dispatch moves by (the
                same on every rank); with a row budget and G > 1 each group's
                rows are padded to B = ceil(max_rows / G) (``Counts.group_end``).
            planned: (J, the dtype of the places' weights): with a host read on
                the compiled path, check the usual case and make the handle's
                tensors there (``Counts.planned``).
            pull: with ``planned``, in the usual case where every rank staged its
                rows, also pull this rank's rows to its experts (the dispatch's
                own ``to_experts``, in the same call: ``Planned.tokens``).
        """
        stream = eager_stream(self) if host_read and rows is not None and self._host is not None else None
        if stream is not None:  # the usual eager case: ordered by the compiled call (else in Python, below)
            got = self._exchange_counts(topk_idx, weights, header, rows, codec, check_values, host_read, groups,
                                        planned, pull, stream)
            if got is not None:
                return got
        with self._ordered():
            return self._exchange_counts(topk_idx, weights, header, rows, codec, check_values, host_read, groups,
                                         planned, pull)

    def _exchange_counts(self, topk_idx, weights, header, rows, codec, check_values, host_read,
                         groups: int = 1, planned: tuple | None = None, pull: bool = False,
                         stream: int | None = None) -> Counts | None:
        """``exchange_counts`` in ``Ordered``; or, given the ``stream`` of
        ``nvlink_order.eager_stream``, ordered by its compiled call, None (nothing
        issued) where that does not take it."""
        tokens, topk = topk_idx.shape
        hidden = 0 if rows is None else rows.shape[1]
        fits, layout, counts, words, sizes, compiled, words_at = self.counts_launches(
            tokens, topk, topk_idx.dtype, weights.dtype, codec if rows is not None else None, hidden, groups)
        budgeted = header[plan.HEADER.index("max_rows")] >= 0
        if compiled is not None and host_read and rows is not None and not (groups > 1 and budgeted):
            puller = self.own_pull(codec, rows, topk, planned) if pull and planned else None
            try:
                got = host.exchange_counts(
                    self._host, compiled, words_at, topk_idx, weights, header, rows,
                    codec.pack(rows) if fits and tokens else None, self._zeroed(words).data_ptr(), check_values,
                    cuda.raw_stream(self.device.index) if stream is None else stream, self._host_words,
                    planned or (0, torch.float32), puller, 0 if stream is None else self._eager_raw)
            finally:
                if stream is not None:  # recorded by the call, as it returned or raised
                    ordered_eager(self, stream)
            if isinstance(got, tuple):  # the status words: a failure the kernels recorded
                self.raise_failure(*got)
            if got.planned is not None and got.planned.tokens is not None:
                self.operations += 1  # the pull's, with the counts exchange's (its order's)
            return got
        if stream is not None:
            return None
        device = self.device
        # sends, counts, the bad-values mark; then the scan's ticket and its chunks' states (the
        # kernels get addresses into it: int32 words at these offsets), zeroed again by
        # exchange_counts once read
        row_at = self._zeroed(words).data_ptr()
        # the dispatch's int32 words in one allocation: routes, lists, hits, the exchange's output,
        # the scan's sums
        every = torch.empty(sum(sizes), dtype=torch.int32, device=device)
        route, lists, hit, out, scan_sums = every.split(sizes)
        route, lists = route.view(tokens, topk, 4), lists.view(self.world, tokens)
        if tokens:
            # the rows staged beside the layout, by blocks of the same launch, where they fit
            wire = codec.pack(rows) if fits and rows is not None else None
            layout.launch(
                layout.blocks,
                topk_idx=topk_idx,
                weights=weights,
                route=route,
                counts=row_at + 4 * self.counts_col,
                sends=row_at + 4 * SENDS_COL,
                lists=lists,
                scan_state=row_at + 4 * self.row_len,
                scan_sums=scan_sums,
                hit=hit,
                bad=row_at + 4 * plan.HEADER.index("failed") if check_values else 0,
                stage_src=wire,
                src_stride=0 if wire is None else wire.stride(0) * wire.element_size(),
                shared=layout.shared,
            )
        world, length, local = self.world, self.row_len, self.experts_per_rank
        per_expert = torch.empty(local, dtype=torch.int64, device=device)
        places = 4 + world * length  # src_start, then num_rows, then group_end
        at = out.data_ptr()
        counts.launch(
            1,
            row=row_at,
            **dict(zip(plan.HEADER, header)),
            out=at,
            tokens_per_expert=per_expert,
            src_start=at + 4 * places,
            num_rows=at + 4 * (places + world * local),
            group_end=at + 4 * (places + world * local + 1),
            shared=counts.shared,
        )
        group_end = out[places + world * local + 1 :] if groups > 1 and budgeted else None
        if not host_read:
            bound = self.capacity.tokens
            return Counts(every, words_at, None, None, bound, per_expert, self._tokens_at(bound),
                          fits and rows is not None, group_end)
        # host sync: row counts (to size the output), headers, status
        words_read = out[: 4 + world * length].tolist()
        code, peer, where = words_read[:3]
        if code:
            self.raise_failure(code, peer, where)
        matrix_host = [words_read[4 + s * length : 4 + (s + 1) * length] for s in range(world)]
        staged, bound, received = rows is not None, 1, 0
        for r in matrix_host:  # a loop, not three generators: this is every dispatch's host path
            staged = staged and bool(r[STAGED_COL])
            bound = r[TOKENS_COL] if r[TOKENS_COL] > bound else bound
            received += r[SENDS_COL + self.rank]
        host_counts = HostCounts.read(matrix_host, self.rank, self.experts_per_rank)
        return Counts(every, words_at, host_counts, received, bound, per_expert, self._tokens_at(bound), staged,
                      group_end)

    def counts_launches(self, tokens: int, topk: int, idx_dtype: torch.dtype, weight_dtype: torch.dtype, codec,
                        hidden: int, groups: int = 1) -> tuple:
        """``_counts_launches`` of a dispatch of this shape, made once while the
        buffers last (``launches``)."""
        return self._cached(("counts", tokens, topk, idx_dtype, weight_dtype, codec, hidden, groups),
                            self._counts_launches)

    def _counts_launches(self, tokens: int, topk: int, idx_dtype: torch.dtype, weight_dtype: torch.dtype, codec,
                         hidden: int, groups: int) -> tuple:
        """(whether the routes and rows fit the buffers, the routing layout's launch,
        the counts exchange's launch, the scratch words the layout zeroes, the
        int32 words of the dispatch's routes, lists, hits, exchange output and
        scan sums, the compiled path's launchers (or None), where those words
        hold what: ``WordsAt``) of a dispatch of this shape (``codec``: the rows'
        staged with the counts, None for none), the arguments that hold for every
        such dispatch bound (made once per shape: ``_cached``)."""
        stage_row = 0 if codec is None else staged_row_bytes(codec, hidden)
        fits = self._fits(tokens, topk, stage_row)
        lanes = 1 << (topk - 1).bit_length() if topk else 1  # a token's lanes in the layout's blocks
        chunks = -(-tokens // (self._scan_warps * cuda.SCAN_TILES * (32 // lanes)))  # the scan's blocks
        words = self.row_len + 1 + chunks
        layout = None
        if tokens:
            stage = fits and codec is not None
            stage_blocks = self._copy_grid(tokens) if stage else 0
            route_start, route_copy = self._region("route") if fits else (0, 0)
            lists_start, lists_copy = self._region("lists") if fits else (0, 0)
            stage_start, stage_copy = self._region("stage") if stage else (0, 0)
            data = self._data.data_ptr() if fits else 0
            launch = self._kernel("layout.cu", "route_layout", idx_dtype, weight_dtype).bind(
                tokens=tokens,
                topk=topk,
                experts=self.num_experts,
                experts_per_rank=self.experts_per_rank,
                shared_route=data + route_start if fits else 0,
                copy_bytes=route_copy,
                seq=self._seq,
                shared_lists=data + lists_start if fits else 0,
                lists_copy=lists_copy,
                list_stride=self.capacity.tokens,
                chunks=chunks,
                scan_warps=self._scan_warps,
                row_bytes=codec.row_bytes(hidden) if stage else 0,
                stage_dst=data + stage_start if stage else 0,
                stage_copy=stage_copy,
                dst_stride=stage_row,
                stage_blocks=stage_blocks,
                status=self.status,
            )
            layout = _Bound(launch, chunks + -(-tokens // (cuda.THREADS // lanes)) + stage_blocks,
                            4 * self._scan_warps * (self.num_experts + self.world))
        world, local = self.world, self.experts_per_rank
        launch = self._kernel("layout.cu", "exchange_counts").bind(
            meta_ptrs=self._meta_ptrs,
            rows_offset=self.rows_offset,
            matrix_bytes=self._matrix_stride,
            me=self.rank,
            world=world,
            row_len=self.row_len,
            count_start=self.counts_col,
            experts_per_rank=local,
            scratch_words=words,
            tokens=tokens,
            staged=int(fits),
            groups=groups,
            seq=self._seq,
            timeout_ns=self.timeout_ns,
            status=self.status,
        )
        counts = _Bound(launch, 1, counts_shared(self.num_experts, world))
        # int32 words of the routes, the lists, the hits, the exchange's output, the scan's sums
        sizes = (tokens * topk * 4, world * tokens, tokens, 4 + world * self.row_len + world * local + 1 + groups,
                 2 * chunks * (self.num_experts + world) if tokens else 0)
        compiled = None if self._host is None else host.counts_launchers(self._host, self, tokens, topk, layout,
                                                                         counts, sizes)
        return fits, layout, counts, words, sizes, compiled, WordsAt.of(tokens, topk, world, self.row_len, local, sizes)

    def _cached(self, key: tuple, make):
        """``make(*key[1:])`` (launches of one shape, ``key[0]`` naming which), made
        once while the buffers last and kept in ``_launches``: at most 256 shapes,
        emptied when full (shapes that change at every call, such as T in
        serving, cost the making of their launches again, not memory)."""
        made = self._launches.get(key)
        if made is None:
            if len(self._launches) >= 256:
                self._launches.clear()
            made = self._launches[key] = make(*key[1:])
        return made

    def _zeroed(self, words: int) -> torch.Tensor:
        """At least ``words`` zero int32 words for the routing layout (its row, the
        scan's ticket and chunk states), which exchange_counts zeroes again once it
        has read them: the engine's own, kept from one operation to the next (no
        memset a dispatch), grown to twice the need where short; inside a CUDA
        graph capture a short one gives a zeroed tensor of the call's own."""
        if self._scratch.numel() >= words:
            return self._scratch
        zeroed = torch.zeros(max(words, 2 * self._scratch.numel()), dtype=torch.int32, device=self.device)
        if not cuda.capturing():
            # an operation queued on another stream may still use the outgrown one, and a compiled usual
            # dispatch keeps its address (dispatch.usual; each exchange zeroes its words again): kept
            self._retired.append(self._scratch)
            self._scratch = zeroed
        return zeroed

    def _tokens_at(self, bound: int) -> torch.Tensor:
        """``Counts.tokens_at`` of a dispatch whose sources have at most ``bound`` tokens."""
        return torch.empty(self.world * bound, dtype=torch.int32, device=self.device)


class _Bound(NamedTuple):
    """A launch made once per shape (``cuda.Launch``, its shape's arguments bound),
    with its grid and dynamic shared memory."""

    launch: "cuda.Launch"
    blocks: int
    shared: int


def _pointers(handle, device: torch.device) -> torch.Tensor:
    """[W] int64 on ``device``: every rank's base pointer of a symmetric allocation."""
    return plan.to_device(torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64), device)


_ENGINES: dict = {}
_NVSHMEM_KEPT: list = []  # the engines' buffers on NVSHMEM's backend (Engine._symmetric)


def engine_for(group, num_experts: int, sm_budget: int | None, timeout: float) -> Engine:
    """The engine of a (group, current device, E, SM budget, timeout), made on first use,
    and made again where it failed on some rank (dispatchers built again after a failure
    start afresh); a collective: every rank of the group makes its dispatchers in the same
    order."""
    group = group if group is not None else dist.group.WORLD
    key = (id(group), torch.cuda.current_device(), num_experts, sm_budget, timeout)
    engine = _ENGINES.get(key)
    if engine is not None and engine.group is group:
        failed = (engine.status[:1] != 0).to(torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)  # the ranks agree: all keep it or none
        if not failed.item():  # host sync: whether some rank's engine failed
            return engine
    engine = _ENGINES[key] = Engine(group, num_experts, sm_budget, timeout)
    return engine
