"""A thin layer over torch.distributed: the collectives the dispatchers use.

Rows travel as raw bytes (a ``[rows, row_bytes]`` uint8 view), so one code path
serves every dtype and wire format on every backend: gloo has no bf16 or fp8
all-to-all, NCCL moves bytes at the same speed as any other type.
"""

from __future__ import annotations

import math
import socket
import time

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor (a FutureWarning) for its new name, all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

_BACKEND_DEVICES = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu", "ucc": "cuda", "xccl": "xpu"}


def device_types(group: dist.ProcessGroup | None) -> frozenset[str]:
    """Device types whose tensors the group's backend can move.

    A backend string such as ``"cpu:gloo,cuda:nccl"`` maps devices explicitly;
    a plain name maps to its usual device.
    """
    backend = str(dist.get_backend(group))
    if ":" in backend:
        return frozenset(part.split(":")[0] for part in backend.split(","))
    return frozenset({_BACKEND_DEVICES.get(backend, "cpu")})


def all_gather_rows(
    row: torch.Tensor,
    group: dist.ProcessGroup | None,
    world_size: int,
    out: torch.Tensor | None = None,
    arrivals: "Arrivals | None" = None,
) -> torch.Tensor:
    """All-gather of one fixed-size row per rank.

    Args:
        row: [L] this rank's row.
        out: optional [W, L] buffer to gather into.
        arrivals: bound the wait (:class:`Arrivals`): the host waits until the
            rows are there, at most ``arrivals.timeout`` seconds, then raises a
            RuntimeError naming the ranks that did not arrive.
    Returns:
        [W, L]; ``out[s]`` is rank s's ``row`` (in a world of one without
        ``out``: ``row`` itself as [1, L], a view where its strides allow).
    """
    if world_size == 1 and out is None:  # alone: the row is every rank's
        return row.reshape(1, -1)
    if out is None:
        out = torch.empty(world_size, row.numel(), dtype=row.dtype, device=row.device)
    if world_size == 1:
        out.copy_(row.unsqueeze(0))
    elif arrivals is None:
        _all_gather_single(out.view(-1), row.contiguous(), group=group)
    else:
        arrivals.wait(lambda: _all_gather_single(out.view(-1), row.contiguous(), group=group, async_op=True))
    return out


def host_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup | None:
    """A group of the same ranks whose collectives run on the host (gloo): the
    group itself where its backend moves CPU tensors, else a gloo group made
    beside it once (a collective of the group's ranks, at the first call:
    every rank makes its dispatchers in the same order)."""
    if "cpu" in device_types(group):
        return group
    name = (group if group is not None else dist.group.WORLD).group_name
    if name not in _HOST_GROUPS:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        _HOST_GROUPS[name] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return _HOST_GROUPS[name]


_HOST_GROUPS: dict[str, dist.ProcessGroup] = {}


def group_hosts(group: dist.ProcessGroup | None) -> tuple[str, ...] | None:
    """The host (its name) of each rank of a group of two ranks or more, in
    group order: a collective of its host channel (:func:`host_group`) at the
    group's first call (every rank makes its dispatchers in the same order),
    kept for that group after. None for a one-rank group."""
    if dist.get_world_size(group) == 1:
        return None
    group = group if group is not None else dist.group.WORLD
    kept = _HOSTS.get(group.group_name)
    if kept is None or kept[0] is not group:  # (a name is given again to a group made after a world ends)
        hosts: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(hosts, socket.gethostname(), group=host_group(group))  # host sync: where each runs
        kept = _HOSTS[group.group_name] = (group, tuple(hosts))
    return kept[1]


_HOSTS: dict[str, tuple] = {}  # group name -> (the group, its ranks' hosts)


class Arrivals:
    """Bounded waits at one dispatcher's collectives that open a call (its counts
    exchanges, its calls' agreements over the host channel), naming the ranks
    that did not arrive (a rank that died, stalled, or stopped calling);
    ``role="config"``: those of ``dispatch.create``'s agreement on the config.

    ``wait(issue)`` issues the collective and polls it (no host thread is
    parked in the backend); a rank still waiting after a moment writes the number of the
    exchange it waits in under its name in the group's store, and one waiting
    past ``timeout`` seconds reads every rank's entry and raises a RuntimeError
    naming the ranks that are not at this exchange (``role="expert-tp"``: the
    Megatron adapter's counts exchanges over an expert-TP group). Nothing is written to the
    store while exchanges complete in time. Every rank of the group makes its
    dispatchers in the same order (their names in the store follow it).

    The collective left behind cannot complete; the process group is not usable
    after the error (``dist.destroy_process_group()`` and exit).
    """

    _made: dict[str, int] = {}  # dispatchers made per group

    def __init__(self, group: dist.ProcessGroup | None, timeout: float, role: str = "") -> None:
        self.group, self.timeout = group, timeout
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        name = (group if group is not None else dist.group.WORLD).group_name
        self._key = key = f"{name}/{role}" if role else name  # other roles are numbered apart from dispatchers
        made = Arrivals._made.get(key, 0)
        Arrivals._made[key] = made + 1
        self.index = made  # the dispatcher's place among the group's, in the order every rank makes them
        self.prefix = f"moe-dispatch/{key}/{made}"
        self.what = _ROLES[role]
        self.exchange = 0

    def withdraw(self) -> None:
        """Give this one's number back (the last made of its role): the ranks
        did not count what it waited for (``agreement.CallsDiffer``)."""
        if Arrivals._made.get(self._key) == self.index + 1:
            Arrivals._made[self._key] = self.index

    def wait(self, issue) -> None:
        """Issue the collective (``issue()`` returns its work) and wait for it, bounded."""
        self.exchange += 1
        published = False
        start = time.monotonic()
        pause = 2e-5
        try:
            work = issue()
            while not work.is_completed():
                waited = time.monotonic() - start
                if not published and waited > self._publish_after:
                    self._publish()  # I am here, still waiting
                    published = True
                if waited > self.timeout:
                    raise RuntimeError(self._late_message())
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
            work.wait()  # raises the backend's error, if it had one
        except RuntimeError as exc:
            if str(exc).startswith(_LATE):
                raise
            # the backend gave up (a peer's connection closed): name who is missing
            raise RuntimeError(self._late_message(grace=2 * self._publish_after)) from exc

    @property
    def _publish_after(self) -> float:
        return min(0.5, self.timeout / 4)

    def _publish(self) -> None:
        try:
            _store().set(f"{self.prefix}/{self.rank}", str(self.exchange))
        except Exception:  # the store went with a dead rank: nothing to tell
            pass

    def _late_message(self, grace: float = 0.0) -> str:
        self._publish()
        time.sleep(grace)  # peers that are waiting too have written where they are
        late = []
        store = _store()
        for rank in range(self.world):
            if rank == self.rank:
                continue
            key = f"{self.prefix}/{rank}"
            try:
                at = int(store.get(key)) if store.check([key]) else 0
            except Exception:  # the store itself is gone with a dead rank
                at = 0
            if at < self.exchange:
                late.append(rank)
        who = f"rank(s) {late}" if late else "some rank"
        return (f"{_LATE}{who} of the group did not reach {self.what.format(self.exchange)} within "
                f"{self.timeout:g} s (DispatchConfig.timeout): a peer died, stalled or stopped calling; "
                "this process group cannot be used any more")


_LATE = "peer missing: "
_ROLES = {  # what an Arrivals' waits are for, as its message names them ({}: the exchange's number)
    "": "exchange {} of this dispatcher (a counts exchange, or a call's agreement)",
    "config": "the agreement on the dispatcher's config at dispatch.create",
    "expert-tp": "expert-TP counts exchange {} of this Megatron layer's dispatcher",
}


def _store():
    return dist.distributed_c10d._get_default_store()


def all_to_all_rows(
    rows: torch.Tensor,
    send_splits: tuple[int, ...],
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Variable-split all-to-all of rows of any dtype.

    Args:
        rows: [S, ...] rows in destination-rank order; ``send_splits[r]`` go to rank r.
        send_splits, recv_splits: host row counts per peer (recv_splits[s] rows
            arrive from rank s).
    Returns:
        [sum(recv_splits), ...] rows in source-rank order, same dtype as ``rows``.
    """
    if len(send_splits) == 1:
        return rows
    rows = rows.contiguous()
    tail = rows.shape[1:]
    as_bytes = rows.view(rows.shape[0], math.prod(tail)).view(torch.uint8)
    num_recv = sum(recv_splits)
    out = torch.empty(num_recv, as_bytes.shape[1], dtype=torch.uint8, device=rows.device)
    dist.all_to_all_single(out, as_bytes, list(recv_splits), list(send_splits), group=group)
    return out.view(rows.dtype).view(num_recv, *tail)


def all_to_all_rows_start(
    rows: torch.Tensor,
    send_splits: tuple[int, ...],
    recv_splits: tuple[int, ...],
    group: dist.ProcessGroup | None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, "dist.Work | None"]:
    """:func:`all_to_all_rows` issued with ``async_op=True``.

    Args:
        out: None, or a contiguous [sum(recv_splits), ...] tensor like ``rows``
            to receive into (a range of a larger buffer).
    Returns:
        (out, work): ``out`` is the [sum(recv_splits), ...] result buffer, valid
        once ``work.wait()`` returned (on NCCL: once the current stream reaches
        the point where ``wait`` was called). ``work`` is None when nothing
        travels (a group of one), and ``out`` is then ``rows`` itself (copied
        into the given ``out``).
    """
    if len(send_splits) == 1:
        return (rows, None) if out is None else (out.copy_(rows), None)
    rows = rows.contiguous()
    tail = rows.shape[1:]
    as_bytes = rows.view(rows.shape[0], math.prod(tail)).view(torch.uint8)
    num_recv = sum(recv_splits)
    if out is None:
        out = torch.empty(num_recv, *tail, dtype=rows.dtype, device=rows.device)
    received = out.view(num_recv, math.prod(tail)).view(torch.uint8)
    work = dist.all_to_all_single(
        received, as_bytes, list(recv_splits), list(send_splits), group=group, async_op=True
    )
    return out, work

