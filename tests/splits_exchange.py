"""The contract of ``dispatch.transports.symmetric.SymmetricExchange`` over the
process group's own all-to-all (split sizes read on the host), so that the
NVSHMEM transport's plan and movements run on gloo ranks in CI. The rows past
the real ones are garbage (NaN, or huge ints), so a plan that reads them fails
the comparisons, and every call is checked against the contract: the receiver's
counts are what the senders send, and nothing overflows the stated bounds."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from dispatch import comm


class HostSplitsExchange:
    capturable = False  # it reads the split sizes on the host

    def __init__(self, group=None) -> None:
        self.group = group
        self.operations = 0  # exchanges issued (as SymmetricExchange counts them)
        self.generation = 0  # (its buffers never grow)

    def stride(self, row_bytes: int) -> int:
        return row_bytes

    def ensure(self, send_bytes: int, recv_bytes: int) -> None:
        pass

    def exchange(self, rows, sends, receives, send_rows, recv_rows, consume, at=None):
        from dispatch.transports.symmetric import Packed

        self.operations += 1
        if at is not None:  # rows that would be put: their places at the receivers
            self._check_places(sends, at)
        if isinstance(rows, Packed):  # made where they go: here, a tensor of their own
            rows = rows.tensor(min(rows.count, send_rows), sends.device)
        send, recv = sends.tolist(), receives.tolist()
        world = len(send)
        truth = torch.empty_like(sends)
        dist.all_to_all_single(truth, sends.contiguous(), group=self.group)  # what the senders send this rank
        assert truth.tolist() == recv, (truth.tolist(), recv)
        assert sum(send) <= min(rows.shape[0], send_rows), (send, rows.shape, send_rows)
        assert sum(recv) <= recv_rows, (recv, recv_rows)
        got = comm.all_to_all_rows(rows[: sum(send)], tuple(send), tuple(recv), self.group) if world > 1 else rows[:sum(send)]
        filler = float("nan") if rows.dtype.is_floating_point else (2**30 if rows.dtype != torch.uint8 else 0x7F)
        out = torch.full((recv_rows + 1, *rows.shape[1:]), filler, dtype=rows.dtype, device=rows.device)
        out[: sum(recv)] = got
        out[recv_rows] = 0
        return consume(out)

    def can_put(self, device):
        return True

    def get_expand(self, x, send_token, places, receives, back_at, send_rows, recv_rows, expand_src, spans=None):
        """As the kernel: every rank stages x[send_token] (its send order); row r,
        the (r - first[s])-th received from rank s, is row back_at[s] + r - first[s]
        of rank s's stage, written to its places; padding rows zeros, the rest
        garbage. By groups (``spans``, each group's places), the rows whose first
        place is in some span and the padding rows in one, and (out, no events):
        rows and padding outside every span stay garbage."""
        self.operations += 1
        for t in (send_token, places, receives, back_at, expand_src):
            assert t.dtype == torch.int64 and t.is_contiguous(), (t.dtype, t.stride())  # as the kernel reads them
        assert places.shape[1] <= 32 and bool(((places >= 0).int().diff(dim=1) <= 0).all()), places  # packed left
        self._check_places(receives, back_at)
        world = receives.numel()
        counts = receives.tolist()
        got = sum(counts)
        assert got <= recv_rows and got <= places.shape[0], (counts, recv_rows, places.shape)
        count = min(send_token.shape[0], send_rows)
        sizes = [torch.empty(1, dtype=torch.int64, device=x.device) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([send_rows], device=x.device), group=self.group)
        staged = torch.zeros(max(int(n) for n in sizes), *x.shape[1:], dtype=x.dtype, device=x.device)
        staged[:count] = x[send_token[:count]]
        stages = [torch.empty_like(staged) for _ in range(world)]
        dist.all_gather(stages, staged, group=self.group)  # every rank's stage
        garbage = float("nan") if x.dtype.is_floating_point else 123  # (bytes of packed rows: any value)
        out = torch.full((expand_src.shape[0], x.shape[1]), garbage, dtype=x.dtype, device=x.device)
        covered = [(0, 2**62)] if spans is None else spans
        assert all(lo <= hi for lo, hi in covered) and all(a[1] <= b[0] for a, b in zip(covered, covered[1:])), spans
        first = 0
        for s in range(world):
            for j in range(counts[s]):
                row = int(back_at[s]) + j
                assert row < int(sizes[s]), (s, j, row, int(sizes[s]))  # within what rank s staged
                mine = [p for p in places[first + j].tolist() if p >= 0]
                earliest = min(mine) if mine else None
                if any(earliest is None and lo == 0 or earliest is not None and lo <= earliest < hi
                       for lo, hi in covered):
                    for place in mine:
                        out[place] = stages[s][row]
            first += counts[s]
        position = torch.arange(expand_src.shape[0], device=x.device)
        inside = torch.zeros_like(position, dtype=torch.bool)
        for lo, hi in covered:
            inside |= (position >= lo) & (position < hi)
        out[(expand_src == recv_rows) & inside] = 0
        return out if spans is None else (out, [None] * len(spans))

    def presum_put(self, y, weights, places, receives, back_at, wire, send_rows, recv_rows, home_index):
        """As the kernels: each received row's sum (gather_sum's), put home, and
        the partials of each token summed there (the kernels' sums are gather_sum's, bitwise)."""
        from dispatch.kernels.gather_sum import gather_sum  # the sums of the NCCL transport on this device

        self.operations += 1
        assert y.is_contiguous() and (weights is None or weights.dtype == torch.float32), (y.stride(), weights)
        assert home_index.dtype == torch.int64 and home_index.is_contiguous(), home_index.stride()
        got = int(receives.sum())
        partial = gather_sum(y, places[:got], weights, wire)
        back = torch.empty_like(receives)
        dist.all_to_all_single(back, receives.contiguous(), group=self.group)  # what comes home from each rank
        return self.exchange(partial, receives, back, send_rows, recv_rows,
                             lambda rows: gather_sum(rows, home_index, None, y.dtype), at=back_at)

    def group_table(self, bounds):
        """A combine by groups' state: its groups' places and the rows stored."""
        return {"bounds": tuple(bounds), "rows": {}, "partial": None}

    def presum_put_group(self, table, new, span, places, receives, back_at, wire, send_rows, recv_rows, home_index):
        """As the kernels by groups: the groups ``new`` stored; the received rows
        whose last place is in ``span`` summed (gather_sum's) from the groups
        stored so far (the others NaN: a pre-sum that reads a group not yet
        in comes home NaN) and kept as put (lost where another exchange came
        between two groups, as its rows overwrite them); with ``home_index``
        (the last group), every received row must have been put once since:
        they go home and are summed there."""
        from dispatch.kernels.gather_sum import gather_sum

        if table.get("after") not in (None, self.operations):  # another exchange came: its rows overwrote the puts
            table["partial"] = None
        self.operations += 1
        table["after"] = self.operations
        for g, rows, weights in new:
            assert rows.is_contiguous() and (weights is None or weights.dtype == torch.float32), rows.stride()
            table["rows"][g] = (rows, weights)
        bounds = table["bounds"]
        total = bounds[-1]
        y = torch.full((total, rows.shape[1]), float("nan"), dtype=rows.dtype, device=rows.device)
        w = None if weights is None else torch.full((total,), float("nan"), dtype=weights.dtype, device=rows.device)
        for k, (held, held_weights) in table["rows"].items():
            assert held.shape[0] == bounds[k + 1] - bounds[k], (k, held.shape, bounds)
            y[bounds[k] : bounds[k + 1]] = held
            if w is not None:
                w[bounds[k] : bounds[k + 1]] = held_weights
        got = int(receives.sum())
        mine = places[:got]
        latest = mine.max(1).values if mine.shape[1] else torch.full((got,), -1, dtype=torch.int64)
        lo, hi = span
        chosen = torch.where(latest < 0, lo == 0, (latest >= lo) & (latest < hi))
        partial = table["partial"]
        if partial is None:
            partial = table["partial"] = torch.full((got, rows.shape[1]), float("nan"), dtype=wire, device=rows.device)
            table["put"] = torch.zeros(got, dtype=torch.int64, device=rows.device)
        sums = gather_sum(y, mine, w, wire) if got else partial
        partial[chosen] = sums[chosen]
        table["put"] += chosen.long()
        if home_index is None:
            return None
        assert bool((table["put"] == 1).all()), table["put"]  # every pre-sum put once since the buffer was last used
        back = torch.empty_like(receives)
        dist.all_to_all_single(back, receives.contiguous(), group=self.group)
        return self.exchange(partial, receives, back, send_rows, recv_rows,
                             lambda got_rows: gather_sum(got_rows, home_index, None, rows.dtype), at=back_at)

    def gather(self, row, out=None):
        self.operations += 1
        assert row.dim() == 1, row.shape  # one row per rank
        return comm.all_gather_rows(row, self.group, dist.get_world_size(self.group), out=out)

    def _check_places(self, sends, at):
        """The put kernel's contract: this rank's rows to rank d start at row
        ``at[d]`` of its receive rows, after the rows of every lower rank.
        Returns every rank's ``sends``; the kernel reads both as contiguous int64."""
        assert all(t.dtype == torch.int64 and t.is_contiguous() for t in (sends, at)), (sends.stride(), at.stride())
        world = sends.numel()
        everyone = [torch.empty_like(sends) for _ in range(world)]
        dist.all_gather(everyone, sends.contiguous(), group=self.group)
        rank = dist.get_rank(self.group)
        want = [sum(int(everyone[s][d]) for s in range(rank)) for d in range(world)]
        assert at.tolist() == want, (at.tolist(), want)
        return everyone


class FakeSymmetricMemory:
    """torch's NVSHMEM pieces that ``SymmetricExchange`` calls, on gloo: its
    buffers plain tensors, allocated alike on every rank (as NVSHMEM's
    collective allocation needs: checked), its all-to-all the process group's
    with the same layout (rows from each rank at the exclusive prefix of the
    splits) and the same check torch's kernel asserts (each peer's bytes divide
    evenly among its blocks per peer). With ``kernels``, also our NVSHMEM
    kernels (``dispatch.kernels.nvshmem_puts``: put_rows, get_expand,
    presum_put) as their contracts say, each peer's symmetric buffer reached by
    the process group. ``with FakeSymmetricMemory(): ...``."""

    def __init__(self, kernels: bool = False) -> None:
        self.kernels = kernels

    def __enter__(self):
        from torch.distributed import _symmetric_memory as symm_mem

        from dispatch.kernels import nvshmem_puts
        from dispatch.transports import symmetric

        self._saved = [(symm_mem, "empty", symm_mem.empty), (symm_mem, "rendezvous", symm_mem.rendezvous),
                       (symmetric, "all_to_all_vdev", symmetric.all_to_all_vdev)]
        symm_mem.empty = _fake_empty
        symm_mem.rendezvous = lambda tensor, group: None
        symmetric.all_to_all_vdev = _fake_vdev
        if self.kernels:
            global _SAVED_STORE
            _SAVED_STORE = nvshmem_puts.store_group
            for name, fake in (("put_rows", _fake_put_rows), ("get_expand", _fake_get_expand),
                               ("presum_put", _fake_presum_put), ("store_group", _fake_store_group)):
                self._saved.append((nvshmem_puts, name, getattr(nvshmem_puts, name)))
                setattr(nvshmem_puts, name, fake)
        return self

    def __exit__(self, *exc):
        for module, name, value in self._saved:
            setattr(module, name, value)


def _fake_empty(*shape, dtype, device):
    sizes = [None] * dist.get_world_size()
    dist.all_gather_object(sizes, (tuple(shape), str(dtype)))
    assert len(set(sizes)) == 1, f"a symmetric allocation differs between ranks: {sizes}"  # a collective
    tensor = torch.empty(*shape, dtype=dtype, device=device)
    return tensor.fill_(0x55) if dtype == torch.uint8 else tensor.zero_()  # byte buffers: garbage rows


def _rows(buffer: torch.Tensor, stride: int) -> torch.Tensor:
    """A symmetric byte buffer as [rows, stride] (as ``symmetric._rows_of``)."""
    return buffer[: buffer.numel() // stride * stride].view(-1, stride)


def _everyone(tensor: torch.Tensor) -> list:
    """Every rank's ``tensor`` (its shape may differ between ranks)."""
    told = [None] * dist.get_world_size()
    dist.all_gather_object(told, tensor.cpu())
    return told


def _fake_put_rows(recv, recv_stride, x, send_token, sends, at, most, stream=None):
    """put_rows's contract: this rank's rows (x[send_token[i]], or x[i]) for each
    send row i < min(sum(sends), most), sends[d] to rank d in order, land at
    row at[d] onwards of rank d's recv."""
    total = min(int(sends.sum()), most)
    rows = x[:total] if send_token is None else x[send_token[:total]]
    raw = rows.contiguous().view(torch.uint8).reshape(total, rows.shape[1] * rows.element_size())
    me = dist.get_rank()
    for s, (their_raw, their_sends, their_at) in enumerate(zip(_everyone(raw), _everyone(sends), _everyone(at))):
        first, count = int(their_sends[:me].sum()), int(their_sends[me])
        if not count:  # (a rank that takes part with nothing may stage rows of another width: none is put)
            continue
        assert their_raw.shape[1] <= recv_stride, (s, their_raw.shape, recv_stride)  # a row within its place
        place = int(their_at[me])
        _rows(recv, recv_stride)[place : place + count, : their_raw.shape[1]] = their_raw[first : first + count]


def _in_span(places: torch.Tensor, span, last: bool) -> torch.Tensor:
    """[R] whether each row (its places, -1 padded) goes with ``span``: its first
    (``last``: its last) place in [lo, hi), a row of no place with the span from 0."""
    from dispatch.kernels import nvshmem_puts

    lo, hi = nvshmem_puts.EVERY if span is None else span
    real = places >= 0
    key = torch.where(real, places, -1).amax(1) if last else torch.where(real, places, 2**62).amin(1)
    return torch.where(real.any(1), (key >= lo) & (key < hi), lo == 0)


def _fake_get_expand(out, stage, recv, stride, row_bytes, places, receives, back_at, most, expand_src, zero_at,
                     stream=None, span=None):
    """get_expand's contract: row r received (the (r - first[s])-th from rank s)
    is row back_at[s] + r - first[s] of rank s's stage, written to its places;
    padding rows zeros. By groups (``span``): only the rows whose first place is
    in it, and the padding rows in it."""
    from dispatch.kernels import nvshmem_puts

    lo, hi = nvshmem_puts.EVERY if span is None else span
    stages = _everyone(stage)
    assert len({t.numel() for t in stages}) == 1, "the stages differ between ranks"
    flat = out.view(torch.uint8).reshape(out.shape[0], math.prod(out.shape[1:]) * out.element_size())  # (0 rows too)
    total, r = min(int(receives.sum()), most), 0
    chosen = _in_span(places[:total], span, last=False).tolist()
    for s, count in enumerate(receives.tolist()):
        for j in range(count):
            if r >= total:
                break
            row = _rows(stages[s], stride)[int(back_at[s]) + j, :row_bytes]
            for place in places[r].tolist() if chosen[r] else ():
                if place >= 0:
                    flat[place] = row
            r += 1
    position = torch.arange(out.shape[0], device=out.device)
    flat[(expand_src == zero_at) & (position >= lo) & (position < hi)] = 0


_SAVED_STORE = None  # the real store_group, while faked
_GROUPS: dict = {}  # a combine by groups' table (its address) -> {g: (rows, weights)} stored in it


def _fake_store_group(table, g, rows, weights):
    """store_group's contract, the rows kept by the table's address for the fake kernel to read."""
    _SAVED_STORE(table, g, rows, weights)
    if g == 0:
        _GROUPS[table.data_ptr()] = {}
    _GROUPS[table.data_ptr()][g] = (rows, weights)


def _fake_presum_put(recv, send, stride, y, weights, places, receives, back_at, wire, most, stream=None, table=None,
                     span=None):
    """presum_put's contract: each received row's sum (gather_sum's) goes to its
    home s at row back_at[s] + r - first[s] of s's recv. By groups (``table``):
    the rows of each group as stored in it (a place in a group not stored yet
    reads NaN), whether weighted as its own entry says, and only the rows whose
    last place is in ``span``."""
    from dispatch.kernels.gather_sum import gather_sum

    total = min(int(receives.sum()), most)
    if table is not None:
        groups = (table.numel() - 2) // 3
        bounds = table[2 * groups : 3 * groups + 1].tolist()
        stored = _GROUPS[table.data_ptr()]
        y = torch.full((bounds[-1], y.shape[1]), float("nan"), dtype=y.dtype, device=y.device)
        weighted = bool(table[3 * groups + 1])
        weights = torch.full((bounds[-1],), float("nan"), device=y.device) if weighted else None
        for g, (rows, group_weights) in stored.items():
            assert int(table[g]) == rows.data_ptr(), (g, "the table holds another group's rows")
            y[bounds[g] : bounds[g + 1]] = rows
            if weighted:
                weights[bounds[g] : bounds[g + 1]] = group_weights
    chosen = _in_span(places[:total], span, last=True)
    raw = gather_sum(y, places[:total], weights, wire).view(torch.uint8).reshape(total, y.shape[1] * wire.itemsize)
    me = dist.get_rank()
    for s, (their_raw, their_receives, their_back, their_chosen) in enumerate(
            zip(_everyone(raw), _everyone(receives), _everyone(back_at), _everyone(chosen))):
        first, count = int(their_receives[:me].sum()), int(their_receives[me])
        place = int(their_back[me])
        for j in range(count):
            if their_chosen[first + j]:
                _rows(recv, stride)[place + j, : their_raw.shape[1]] = their_raw[first + j]


def _fake_vdev(send, recv, in_splits, out_splits_offsets, group_name):
    world = in_splits.numel()
    out_splits = torch.empty_like(in_splits)
    dist.all_to_all_single(out_splits, in_splits)
    send_list, recv_list = in_splits.tolist(), out_splits.tolist()
    stride = send.stride(0) * send.element_size()
    blocks = -(-send.numel() * send.element_size() // 65536)  # torch's kernel: 64 KiB a block, a multiple of W,
    blocks = min(-(-blocks // world) * world, 64)  # at most 64
    per_peer = max(blocks // world, 1)
    assert all(n * stride % per_peer == 0 for n in recv_list), (recv_list, stride, per_peer)
    assert sum(recv_list) <= recv.shape[0]
    got = comm.all_to_all_rows(send[: sum(send_list)], tuple(send_list), tuple(recv_list), None)
    recv[: sum(recv_list)] = got
    out_splits_offsets[0] = out_splits
    out_splits_offsets[1] = torch.cumsum(out_splits, 0) - out_splits
