"""The NVLink engine's data movements: rows pulled to the experts, partial sums
pushed home and summed, per-slot values home (the kernels of
``csrc/intranode_dispatch.cu`` and ``csrc/intranode_combine.cu``). A part of
:class:`dispatch.nvlink.Engine`, whose buffers, epochs and order they use.

Notation as in ``dispatch.nvlink``.
"""

from __future__ import annotations

import torch

from dispatch import cuda, host
from dispatch.kernels import quantize
from dispatch.nvlink_layout import (SENDS_COL, Capacity, Counts, _wire_of, aligned_rows, partial_row_bytes,
                                    staged_row_bytes)
from dispatch.nvlink_order import eager_stream, ordered_eager


class EngineMoves:
    """The movements of an :class:`dispatch.nvlink.Engine` (a part of it)."""

    # -- what a compiled usual call is made of (dispatch.usual) ----------------

    @property
    def launches(self) -> dict:
        """The launches made while the buffers last: a new dict each time they
        grow, so that a compiled call made of them holds while it is this one."""
        return self._launches

    @property
    def quiet(self) -> bool:
        """No failure seen on the host and no poll of the status words in flight."""
        return not self.failure_seen and self._polled_event is None

    def compiled_parts(self, words: int = 0) -> tuple | None:
        """(the compiled host module, the address of the layout's ``words`` zeroed
        words, the pinned host words of the counts matrix, the eager event's
        handle) that a compiled usual call issues with; None without the compiled
        host path, or before an eager operation recorded the event."""
        if self._host is None or not self._eager_raw:
            return None
        return self._host, self._zeroed(words).data_ptr(), self._host_words, self._eager_raw

    # -- rows to the experts ---------------------------------------------------

    def to_experts(self, rows, codec, counts: Counts, presum, slot_k, num_rows: int, meta_out=None,
                   span: tuple[int, int] | None = None, out: torch.Tensor | None = None,
                   group: int | None = None) -> torch.Tensor:
        with self._ordered():
            return self._to_experts(rows, codec, counts, presum, slot_k, num_rows, meta_out, span, out, group)

    def _to_experts(self, rows, codec, counts: Counts, presum, slot_k, num_rows: int, meta_out=None,
                    span: tuple[int, int] | None = None, out: torch.Tensor | None = None,
                    group: int | None = None) -> torch.Tensor:
        """Move rows [T, H] to this rank's expert-major places ([num_rows, H],
        dtype of rows; rows past the N received zeroed).

        With ``meta_out`` = (weights, src_rank, src_token) [num_rows] the places
        come from the routes (a dispatch; ``presum``/``slot_k`` are written),
        and where ``counts.staged`` the rows were staged with the counts;
        otherwise from ``presum`` (a move along a plan), in an exchange of its own.

        ``span`` = (lo, hi): one group's places of a move by groups, the spans
        issued in order, the first with ``out`` None (it stages and makes the
        output), the later ones with the output it returned; a row that an
        earlier span brought is copied from there instead of crossing again.
        ``group``: the span's group where each group's rows are padded to a
        bound (``Counts.group_end``): the span zeroes its group's padding."""
        tokens, hidden = rows.shape
        wire, fp8 = _wire_of(codec, rows.dtype)
        stage_row = staged_row_bytes(codec, hidden)
        topk = counts.topk
        from_route = meta_out is not None
        if out is None and not (from_route and counts.staged):  # stage (and route) in an exchange of their own
            self.ensure(Capacity(counts.bound, topk, stage_row, 0))
            if from_route and tokens:
                self._stage(counts.route.view(tokens, -1), topk * 16, "route", topk * 16, signal=False)
                self._stage(counts.lists, tokens * 4, "lists", self.capacity.tokens * 4, signal=False)
            self._stage_rows(rows, codec, stage_row, signal=True)
        weights, src_rank, src_token = meta_out if from_route else (None, None, None)
        launch = self._pull_of(codec, rows.dtype, hidden, topk, presum.shape[1],
                               None if weights is None else weights.dtype)
        if out is None and span is None and group is None and from_route:  # a dispatch's own pull: compiled
            compiled = launch.compiled(self.device.index, host.PULL_FREE) if self._host else None
            if compiled is not None:
                return self._host.pull(
                    compiled, self._row_grid(max(counts.items, num_rows)), rows, num_rows, counts.address("matrix"),
                    counts.tokens_at.data_ptr(), presum.data_ptr(), counts.bound, counts.address("src_start"),
                    counts.address("num_rows"), slot_k.data_ptr(), weights.data_ptr(), src_rank.data_ptr(),
                    src_token.data_ptr(), cuda.raw_stream(self.device.index))
        if out is None:
            out = torch.empty(num_rows, hidden, dtype=rows.dtype, device=rows.device)
        lo, hi = (0, num_rows) if span is None else span
        # the rows zeroed: [N, num_rows), or a padded group's [its end, its bound)
        tail_from, tail_to = (counts.num_rows, num_rows) if group is None else (counts.group_end[group:], hi)
        launch(
            self._row_grid(max(counts.items, num_rows)),
            **self._item_tables(counts, presum),
            src_start=counts.src_start,
            num_rows=tail_from,
            out=out,
            max_rows=num_rows,
            slot_k=slot_k,
            out_weights=weights,
            out_src_rank=src_rank,
            out_src_token=src_token,
            row_lo=lo,
            row_hi=hi,
            tail_to=tail_to,
        )
        return out

    def own_pull(self, codec, rows, topk: int, planned: tuple) -> tuple | None:
        """What the compiled counts exchange needs to issue a dispatch's own pull
        (``Engine.exchange_counts(pull=True)``): the compiled launcher of the pull
        of ``rows`` [T, H] under ``codec``, K = ``topk``, ``planned`` = (J, the
        places' weights' dtype), and its grid's terms (``_row_grid``: cap, floor,
        rows a block); None where launches issue from Python."""
        width, weight_dtype = planned
        compiled = self._pull_of(codec, rows.dtype, rows.shape[1], topk, width, weight_dtype).compiled(
            self.device.index, host.PULL_FREE)
        return None if compiled is None else (compiled, self.blocks, self.sms, cuda.THREADS // 32)

    def _pull_of(self, codec, dtype: torch.dtype, hidden: int, topk: int, width: int,
                 weight_dtype: torch.dtype | None) -> "cuda.Launch":
        """The pull of this shape (``_pull_launch``), made once while the buffers last."""
        return self._cached(("pull", codec, dtype, hidden, topk, width, weight_dtype), self._pull_launch)

    def _pull_launch(self, codec, dtype: torch.dtype, hidden: int, topk: int, width: int,
                     weight_dtype: torch.dtype | None) -> "cuda.Launch":
        """``pull_rows`` for rows of ``dtype`` [., H] under ``codec``, routes of K slots
        and J = ``width`` rows a (source rank, token) here at most, the places'
        weights in ``weight_dtype`` (None: a move along a plan); what holds for
        every such pull bound (``_launches``)."""
        wire, fp8 = _wire_of(codec, dtype)
        acc = torch.float64 if torch.float64 in (dtype, wire) and not fp8 else torch.float32
        from_route = weight_dtype is not None
        route_start, route_copy = self._region("route")
        stage_start, stage_copy = self._region("stage")
        lists_start, lists_copy = self._region("lists")
        return self._kernel(
            "intranode_dispatch.cu", "pull_rows", torch.uint8 if fp8 else wire, str(fp8), dtype, acc,
            "true" if from_route else "false", weight_dtype if from_route else torch.float32,
        ).bind(
            data_ptrs=self._data_ptrs,
            route_off=route_start,
            route_copy=route_copy,
            stage_off=stage_start,
            stage_copy=stage_copy,
            stage_row=staged_row_bytes(codec, hidden),
            scales_at=quantize.codes_bytes(hidden),
            lists_off=lists_start,
            lists_copy=lists_copy,
            list_stride=self.capacity.tokens,
            **self._walk(width),
            experts_per_rank=self.experts_per_rank,
            topk=topk,
            hidden=hidden,
            out_max=quantize._out_max(dtype) if fp8 else 0.0,
            **self._waits(),
        )

    def _row_grid(self, rows: int) -> int:
        """Blocks of a kernel that moves ``rows`` rows, a warp a row or a segment of one
        (``split_rows``): a warp a row, but at least a block per SM (few rows, as in a
        decode step, are cut into more segments so that every SM keeps loads in
        flight), at most the budget (``counts_plan`` in csrc/host.cpp sizes the pull
        it issues so, from ``own_pull``'s terms)."""
        return min(self.blocks, max(self.sms, -(-rows // (cuda.THREADS // 32))))

    def _items(self, counts: Counts, presum) -> dict:
        """The arguments by which a kernel walks this rank's items (source rank s, j)
        and their rows: the counts matrix (this rank's column of sends), each item's
        token and its rows here (``presum`` [W * bound, J]), this rank and W."""
        return {**self._item_tables(counts, presum), **self._walk(presum.shape[1])}

    def _item_tables(self, counts: Counts, presum) -> dict:
        """The part of ``_items`` that is a dispatch's own: its counts matrix, its
        items' tokens and rows here, its T_max."""
        return dict(matrix=counts.matrix, tokens_at=counts.tokens_at, presum=presum, tstride=counts.bound)

    def _walk(self, width: int) -> dict:
        """The part of ``_items`` that holds for every dispatch of J = ``width``."""
        return dict(row_len=self.row_len, sends_col=SENDS_COL, width=width, me=self.rank, world=self.world)

    def _waits(self) -> dict:
        """The arguments by which a kernel waits for its peers (their flags, this
        operation's sequence number, the timeout) and records a failure (status)."""
        return dict(flags=self._flags, seq=self._seq, timeout_ns=self.timeout_ns, status=self.status)

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

    def to_home(self, rows, weights, wire: torch.dtype, counts: Counts, presum,
                at_least: torch.dtype | None) -> torch.Tensor:
        """[N, H] expert-side rows -> [T, H] (dtype of rows): weighted pre-sum per
        (token, rank) pushed home in ``wire``, summed in ascending rank order."""
        stream = eager_stream(self) if self._host is not None else None
        if stream is not None:  # the usual eager case: ordered by the compiled call (else in Python, below)
            out = self._to_home_compiled(rows, weights, wire, counts, presum, at_least, stream)
            if out is not None:
                return out
        with self._ordered():
            rows = aligned_rows(rows)
            if self._host is not None:  # compiled: both launches and the output in one call
                out = self._to_home_compiled(rows, weights, wire, counts, presum, at_least)
                if out is not None:
                    return out
            self._push(rows, weights, wire, counts, presum)
            return self._home_sum(counts, wire, rows.dtype, rows.shape[1], at_least)

    def _to_home_compiled(self, rows, weights, wire: torch.dtype, counts: Counts, presum,
                          at_least: torch.dtype | None, stream: int | None = None) -> torch.Tensor | None:
        """``to_home`` in one compiled call (both launches and the output), None where
        its launches issue from Python; given the ``stream`` of
        ``nvlink_order.eager_stream``, ordered by the call (else in ``Ordered``)."""
        rows = aligned_rows(rows)
        hidden = rows.shape[1]
        self._ensure_partials(counts, wire, hidden)
        push, home = self.home_launches(rows.dtype, None if weights is None else weights.dtype, wire, hidden,
                                        presum.shape[1], at_least)
        if push is None:
            return None
        tokens = counts.tokens
        try:
            return self._host.to_home(
                push, self._row_grid(counts.items), home, self._row_grid(tokens), rows,
                0 if weights is None else weights.data_ptr(), counts.address("matrix"), counts.tokens_at.data_ptr(),
                presum.data_ptr(), counts.bound, counts.address("hit"), tokens,
                cuda.raw_stream(self.device.index) if stream is None else stream,
                0 if stream is None else self._eager_raw)
        finally:
            if stream is not None:  # recorded by the call, as it returned or raised
                ordered_eager(self, stream)

    def home_launches(self, dtype: torch.dtype, weight_dtype: torch.dtype | None, wire: torch.dtype, hidden: int,
                      width: int, at_least: torch.dtype | None) -> tuple:
        """``_home_compiled`` of this shape, made once while the buffers last."""
        return self._cached(("to_home", dtype, weight_dtype, wire, hidden, width, at_least), self._home_compiled)

    def _home_compiled(self, dtype: torch.dtype, weight_dtype: torch.dtype | None, wire: torch.dtype, hidden: int,
                       width: int, at_least: torch.dtype | None) -> tuple:
        """The compiled launchers of a combine's push and home sum of this shape (``to_home``;
        the buffers already hold its partials), made once while the buffers last; (None,
        None) where either issues from Python."""
        device = self.device.index
        push = self._push_launch_of(dtype, weight_dtype, wire, hidden, width)
        home = self._home_of(wire, dtype, hidden, at_least)
        push, home = push.compiled(device, host.PUSH_FREE), home.compiled(device, host.HOME_FREE)
        return (None, None) if push is None or home is None else (push, home)

    def store_group(self, table: torch.Tensor, g: int, rows: torch.Tensor, weights: torch.Tensor | None) -> None:
        """Write group g's row and weight pointers into ``table`` ([2 G] int64 on the
        device: the rows' pointers, then the weights'; 0 for no weights), on the
        device, so that a CUDA graph replays them. ``rows`` 16-byte aligned, kept
        alive by the caller until the combine's last group is pushed."""
        with self._ordered(writes=False):
            self._store_group(table, g, rows, weights)

    def _store_group(self, table, g: int, rows, weights) -> None:
        self._kernel("intranode_combine.cu", "store_pair")(
            1,
            table=table,
            at=g,
            stride=table.shape[0] // 2,
            a=rows.data_ptr(),
            b=0 if weights is None else weights.data_ptr(),
        )

    def push_group(self, rows: torch.Tensor, weights: torch.Tensor | None, table: torch.Tensor,
                   bounds: torch.Tensor, parts: int, span: tuple[int, int], last: bool, wire: torch.dtype,
                   counts: Counts, presum) -> None:
        """One group of a combine by groups: push the pre-sums that group
        completes (those whose last row lies in ``span``), each summed whole
        from the rows of its groups.

        Args:
            rows, weights: a group's rows [N_g, H] and weights (their dtypes and H
                are every group's).
            table: the groups' row and weight pointers (:meth:`store_group`), those
                of groups 0 .. parts - 1 written.
            bounds: [G + 1] int64 on the device, the groups' first rows.
            span: (lo, hi), the rows of the group pushed (every group's, for all
                the pre-sums).
            last: the last group (its push raises the operation's flags).
        """
        with self._ordered():
            groups = table.shape[0] // 2
            self._push(rows, weights, wire, counts, presum,
                       (table[:groups], table[groups:], bounds, parts, span, last), rows.shape[1])

    def home_sum(self, counts: Counts, wire: torch.dtype, dtype: torch.dtype, hidden: int,
                 at_least: torch.dtype | None) -> torch.Tensor:
        """[T, H] in ``dtype``: the partials pushed home, summed in ascending rank order."""
        with self._ordered(writes=False):
            return self._home_sum(counts, wire, dtype, hidden, at_least)

    def _push(self, rows, weights, wire: torch.dtype, counts: Counts, presum, by_group=None,
              hidden: int | None = None) -> None:
        """The expert side of a combine (``push_partials``): every pre-sum, or
        with ``by_group`` = (row pointers [G'], weight pointers [G'], bounds, G',
        (lo, hi), signal) those one group completes."""
        hidden = rows.shape[1] if hidden is None else hidden
        if by_group is None:
            y_parts, w_parts, bounds, parts, (lo, hi), signal = None, None, None, 0, (0, 2**62), True
        else:
            y_parts, w_parts, bounds, parts, (lo, hi), signal = by_group
        self._push_of(rows, weights, wire, counts, presum, hidden)(
            self._row_grid(counts.items),
            y=rows,
            weights=weights,
            y_parts=y_parts,
            w_parts=w_parts,
            bounds=bounds,
            parts=parts,
            row_lo=lo,
            row_hi=hi,
            **self._item_tables(counts, presum),
            signal=int(signal),
        )

    def _push_of(self, rows, weights, wire: torch.dtype, counts: Counts, presum, hidden: int) -> "cuda.Launch":
        """The push of these rows, weights and pre-sums, the buffers grown to hold its partials first."""
        self._ensure_partials(counts, wire, hidden)
        return self._push_launch_of(rows.dtype, None if weights is None else weights.dtype, wire, hidden,
                                    presum.shape[1])

    def _ensure_partials(self, counts: Counts, wire: torch.dtype, hidden: int) -> None:
        """The buffers grown (``ensure``) where they do not hold a combine's partials of
        ``counts`` in ``wire`` [., H]; the usual case, that they do, read in ints."""
        capacity, part_row = self.capacity, partial_row_bytes(wire, hidden)
        if self._data is None or counts.bound > capacity.tokens or counts.topk > capacity.topk or \
                part_row > capacity.part_row:
            self.ensure(Capacity(counts.bound, counts.topk, 0, part_row))

    def _push_launch_of(self, dtype: torch.dtype, weight_dtype: torch.dtype | None, wire: torch.dtype, hidden: int,
                        width: int) -> "cuda.Launch":
        """The push of this shape (``_push_launch``), made once while the buffers last."""
        return self._cached(("push", dtype, weight_dtype, wire, hidden, width), self._push_launch)

    def _push_launch(self, dtype: torch.dtype, weight_dtype: torch.dtype | None, wire: torch.dtype, hidden: int,
                     width: int) -> "cuda.Launch":
        """``push_partials`` for rows of ``dtype`` [., H], weights of ``weight_dtype``
        (None: none), pre-sums in ``wire``, J = ``width``; what holds for every such
        push bound (``_launches``)."""
        weighted = weight_dtype is not None
        weight_dtype = weight_dtype or torch.float32
        acc = torch.float64 if torch.float64 in (dtype, wire, weight_dtype) else torch.float32
        part_start, part_copy = self._region("partials")
        return self._kernel(
            "intranode_combine.cu", "push_partials", dtype, weight_dtype, "true" if weighted else "false",
            wire, acc, str(cuda.SUM_ROWS if width > 2 else 1),  # rows a lane loads together
        ).bind(
            **self._walk(width),
            hidden=hidden,
            data_ptrs=self._data_ptrs,
            part_off=part_start,
            part_copy=part_copy,
            part_row=partial_row_bytes(wire, hidden),
            tcap=self.capacity.tokens,
            flag_ptrs=self._meta_ptrs,
            seq=self._seq,
            counter=self._counter,
            status=self.status,
        )

    def _home_sum(self, counts: Counts, wire: torch.dtype, dtype: torch.dtype, hidden: int,
                  at_least: torch.dtype | None) -> torch.Tensor:
        tokens = counts.tokens
        out = torch.empty(tokens, hidden, dtype=dtype, device=self.device)
        self._home_of(wire, dtype, hidden, at_least)(self._row_grid(tokens), hit=counts.hit, tokens=tokens, out=out)
        return out

    def _home_of(self, wire: torch.dtype, dtype: torch.dtype, hidden: int, at_least: torch.dtype | None):
        """The home sum of partials in ``wire`` into rows of ``dtype``, summed in fp64 where
        any of them (or ``at_least``) is fp64, else fp32."""
        home_acc = torch.float64 if torch.float64 in (wire, dtype, at_least) else torch.float32
        return self._cached(("home", wire, dtype, home_acc, hidden), self._home_launch)

    def _home_launch(self, wire: torch.dtype, dtype: torch.dtype, acc: torch.dtype, hidden: int) -> "cuda.Launch":
        """``home_sum`` of pre-sums in ``wire`` into rows of ``dtype`` [T, H], summed in
        ``acc``; what holds for every such sum bound (``_launches``)."""
        part_start, part_copy = self._region("partials")
        return self._kernel("intranode_combine.cu", "home_sum", wire, dtype, acc).bind(
            hidden=hidden,
            partials=self._data.data_ptr() + part_start,
            part_copy=part_copy,
            part_row=partial_row_bytes(wire, hidden),
            tcap=self.capacity.tokens,
            world=self.world,
            **self._waits(),
        )

    def slots_home(self, values, counts: Counts, presum, slot_k) -> torch.Tensor:
        with self._ordered():
            return self._slots_home(values, counts, presum, slot_k)

    def _slots_home(self, values, counts: Counts, presum, slot_k) -> torch.Tensor:
        """[N] per-row values -> [T, K] per-slot values at home (0 for empty slots)."""
        tokens, topk = counts.tokens, counts.topk
        self.ensure(Capacity(counts.bound, topk, 0, 0))
        value_type = torch.float64 if values.dtype == torch.float64 else torch.float32
        wide = values.to(value_type).contiguous()
        items = counts.items * presum.shape[1]
        slots_start, slots_copy = self._region("slots")
        self._kernel("intranode_combine.cu", "push_slots", value_type)(
            min(self.blocks, max(1, -(-items // cuda.THREADS))),
            values=wide,
            **self._items(counts, presum),
            slot_k=slot_k,
            topk=topk,
            data_ptrs=self._data_ptrs,
            slots_off=slots_start,
            slots_copy=slots_copy,
            flag_ptrs=self._meta_ptrs,
            seq=self._seq,
            counter=self._counter,
            status=self.status,
        )
        out = torch.empty(tokens, topk, dtype=value_type, device=self.device)
        self._kernel("intranode_combine.cu", "home_slots", value_type)(
            min(self.blocks, max(1, -(-tokens * topk // cuda.THREADS))),
            route=counts.route,
            slots=tokens * topk,
            pushed=self._data.data_ptr() + slots_start,
            pushed_copy=slots_copy,
            out=out,
            world=self.world,
            **self._waits(),
        )
        return out.to(values.dtype)
