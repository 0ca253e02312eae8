"""The board: where the ranks of a group on one host agree on each call, in
shared memory, in microseconds, with nothing queued on the GPU in the way.

One file per group in ``/dev/shm`` (made by the group's first rank, opened by
the others through a name in the group's store, unlinked once every rank has
it mapped) holds two copies (by parity) of one slot per rank: ``[k, row]``. A
rank at its k-th agreement writes its row into copy k % 2, then k into the
slot's first word, and waits until every rank's first word in that copy reads
k; then it reads their rows. A rank gets to agreement k + 2 (the same copy)
only once every rank has arrived at k + 1, that is, once each has read copy k:
no row is overwritten before it is read. Stores and loads keep their program
order on x86-64, where the board is used (elsewhere, and where the ranks do
not share a host, :meth:`Board.for_group` gives None and the agreement runs
over a gloo group, ``comm.host_group``).

Every agreement of every dispatcher of the group goes through its one board,
in the order the ranks make them (as every collective of a group). A rank that
does not arrive (it died, stalled, or is elsewhere in the program) leaves its
word behind: the others raise within the dispatcher's timeout, naming it; the
board is then out of step and the group not usable any more.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
import uuid

import torch.distributed as dist

ROW = 16  # int64 words of a row (the call's header, its tail and the dispatcher's index)
_SLOT = 1 + ROW
_SPIN = 2e-3  # seconds a wait polls with a yield only, before it sleeps


class Board:
    """The shared page of one group's ranks (:meth:`for_group`)."""

    _of_group: dict[str, "Board | None"] = {}

    def __init__(self, words: memoryview, world: int, rank: int, keep) -> None:
        self._words, self._world, self._rank, self._keep = words, world, rank, keep
        self._count = 0  # agreements made

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None) -> "Board | None":
        """The group's board, made at the first call (a collective of the group's
        ranks, through its store: every rank makes its dispatchers in the same
        order); None where some rank cannot map it (not x86-64, another host,
        no shared memory)."""
        real = group if group is not None else dist.group.WORLD
        name = real.group_name
        if name not in cls._of_group:
            cls._of_group[name] = cls._make(real, name)
        return cls._of_group[name]

    @classmethod
    def _make(cls, group: dist.ProcessGroup, name: str) -> "Board | None":
        store = dist.distributed_c10d._get_default_store()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        key = f"moe-dispatch/board/{name}"
        size = 2 * world * _SLOT * 8
        if rank == 0:
            path = ""
            if platform.machine() in ("x86_64", "AMD64"):
                folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
                path = os.path.join(folder, f"moe-dispatch-{uuid.uuid4().hex}")
                with open(path, "wb") as f:
                    f.truncate(size)
            store.set(f"{key}/path", path)
        path = store.get(f"{key}/path").decode()
        mapped = None
        try:
            if path:
                with open(path, "r+b") as f:
                    mapped = mmap.mmap(f.fileno(), size)
        except OSError:  # another host: no such file here
            mapped = None
        store.set(f"{key}/ok/{rank}", "1" if mapped is not None else "0")
        oks = [store.get(f"{key}/ok/{r}") == b"1" for r in range(world)]
        if rank == 0 and path:
            os.unlink(path)  # every rank has mapped it, or failed to
        if not all(oks):
            return None
        return cls(memoryview(mapped).cast("q"), world, rank, mapped)

    def agree(self, row: list[int], timeout: float, what: str) -> list[list[int]]:
        """Write this rank's ``row`` (at most ``ROW`` ints), wait for every rank's
        row of the same agreement, return them ([W][len(row)]).

        Raises:
            RuntimeError naming the ranks that did not arrive within ``timeout``
            seconds (``what``: the call, for the message).
        """
        self._count += 1
        k, words, world = self._count, self._words, self._world
        base = (k % 2) * world * _SLOT
        mine = base + self._rank * _SLOT
        for i, value in enumerate(row):
            words[mine + 1 + i] = value
        words[mine] = k  # after the row: a peer that reads k reads the row
        heads = range(base, base + world * _SLOT, _SLOT)
        start = time.monotonic()
        pause = 2e-5
        while any(words[h] != k for h in heads):
            waited = time.monotonic() - start
            if waited > timeout:
                missing = [r for r, h in enumerate(heads) if words[h] != k]
                raise RuntimeError(
                    f"peer missing: rank(s) {missing} of the group did not reach {what} within {timeout:g} s "
                    "(DispatchConfig.timeout): a peer died, stalled or stopped calling; this process group cannot "
                    "be used any more")
            if waited < _SPIN:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)
        return [list(words[h + 1 : h + 1 + len(row)]) for h in heads]
