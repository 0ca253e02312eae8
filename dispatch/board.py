"""The board: where the ranks of a group on one host agree on each call, in
shared memory, in microseconds, with nothing queued on the GPU in the way.

One file per group in ``/dev/shm`` (made by the group's first rank, opened by
the others through a name in the group's store, unlinked once every rank has
it mapped) holds two copies (by parity) of one slot per rank: ``[k, row]``. A
rank at its k-th agreement writes its row into copy k % 2, then k into the
slot's first word, and waits until every rank's first word in that copy reads
k; then it confirms (k in its second word), waits for every rank's
confirmation, and reads their rows. A rank gets to agreement k + 2 (the same copy)
only once every rank has arrived at k + 1, that is, once each has read copy k:
no row is overwritten before it is read. The row must be seen before k: the
compiled agreement (``csrc/host.cpp``'s ``board_agree``, the same words)
orders its stores and loads so on any architecture, the one in Python only
where stores keep their program order (x86-64). The compiled one serves where
this process has the compiled host path (``dispatch.host``: a CUDA device), and
wherever stores may be reordered; where neither can, or the ranks do not share
a host, :meth:`Board.for_group` gives None and the agreement runs over a gloo
group (``comm.host_group``).

Every agreement of every dispatcher of the group goes through its one board,
in the order the ranks make them (as every collective of a group). A rank that
does not arrive (it died, stalled, or is elsewhere in the program) leaves its
word behind: the others raise within the dispatcher's timeout, naming it, and
withdraw from that agreement; where the missing rank makes that call late, it
finds them withdrawn and raises too, and the board is in step again.
"""

from __future__ import annotations

import array
import ctypes
import mmap
import os
import platform
import tempfile
import time
import uuid
from typing import Callable

import torch
import torch.distributed as dist

ROW = 16  # int64 words of a row, at most (the call's header and its tail)
_SLOT = 2 + ROW  # arrived, confirmed, the row
_SPIN = 2e-3  # seconds a wait polls with a yield only, before it sleeps


_X86 = platform.machine() in ("x86_64", "AMD64")


def compiled_agreement():
    """The compiled host module whose ``board_agree`` agrees here: on a host
    with CUDA (where the engine builds it too: ``dispatch.host``, once per
    machine) or one that needs it (not x86-64), with the compiled host path on
    (``host.enabled``); else None (the agreement in Python, x86-64 only)."""
    from dispatch import host

    if (_X86 and not torch.cuda.is_available()) or not host.enabled:
        return None
    return host.built()


class Board:
    """The shared page of one group's ranks (:meth:`for_group`)."""

    _of_group: dict[tuple[str, int], "Board | None"] = {}

    def __init__(self, mapped: mmap.mmap, world: int, rank: int, compiled=None) -> None:
        self._words, self._world, self._rank, self._keep = memoryview(mapped).cast("q"), world, rank, mapped
        self._count = array.array("q", [0])  # agreements made (the compiled agreement counts them here too)
        self._heads = [range(copy * world * _SLOT, (copy + 1) * world * _SLOT, _SLOT) for copy in (0, 1)]
        self._compiled = compiled  # the module of board_agree, or None (in Python)
        self._at = (ctypes.addressof(ctypes.c_char.from_buffer(mapped)), self._count.buffer_info()[0])

    @property
    def words_at(self) -> int:
        """The address of the mapped page (for ``board_agree``)."""
        return self._at[0]

    @property
    def count_at(self) -> int:
        """The address of this rank's int64 count of agreements (for ``board_agree``)."""
        return self._at[1]

    slot = _SLOT  # int64 words of a rank's slot

    @classmethod
    def for_group(cls, group: dist.ProcessGroup | None) -> "Board | None":
        """The group's board, made at the first call (a collective of the group's
        ranks, through its store: every rank makes its dispatchers in the same
        order); None where some rank cannot map it (another host, no shared
        memory, not x86-64 without the compiled agreement)."""
        real = group if group is not None else dist.group.WORLD
        key = (real.group_name, id(real))
        if key not in cls._of_group:
            made = sum(name == real.group_name for name, _ in cls._of_group)  # boards of this name made so far
            cls._of_group[key] = cls._make(real, f"{real.group_name}/{made}")
        return cls._of_group[key]

    @classmethod
    def _make(cls, group: dist.ProcessGroup, name: str) -> "Board | None":
        store = dist.distributed_c10d._get_default_store()
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        key = f"moe-dispatch/board/{name}"
        size = 2 * world * _SLOT * 8
        compiled = compiled_agreement()
        if rank == 0:
            path = ""
            if _X86 or compiled is not None:
                folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
                path = os.path.join(folder, f"moe-dispatch-{uuid.uuid4().hex}")
                try:
                    with open(path, "wb") as f:
                        f.truncate(size)
                except OSError:  # no room or no right to write there: no board
                    path = ""
            store.set(f"{key}/path", path)
        path = store.get(f"{key}/path").decode()
        mapped = None
        try:
            if path and (_X86 or compiled is not None):
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
        return cls(mapped, world, rank, compiled)

    def agree(self, row: list[int], timeout: float, what: Callable[[], str],
              width: int | None = None) -> list[list[int]]:
        """Write this rank's ``row`` (at most ``ROW`` ints), wait for every rank's
        row of the same agreement, return them ([W][len(row)], or their first
        ``width`` entries).

        Two steps: every rank arrives (its row, then k in its first word),
        then every rank confirms it saw all arrive (k in its second word); a
        rank returns once all confirmed. A rank that times out withdraws (-k
        in its first word): a rank that sees that raises too (a late one as
        well, when it comes), and none can have returned (a rank withdrawn
        before it confirmed never confirms; one that finds every rank
        confirmed after all returns with them), so no rank leaves an agreement
        that another gave up, but for a peer that read the withdrawal in the
        instant before the last confirmation landed; every rank has then spent
        agreement k, and the next is in step.

        Raises:
            RuntimeError naming the ranks that did not arrive within ``timeout``
            seconds (``what()``: the call, for the message), or that gave up
            waiting for it.
        """
        width = len(row) if width is None else width
        if self._compiled is not None:
            rows = self._compiled.board_agree(self._at[0], self._world, self._rank, _SLOT, self._at[1], row, timeout,
                                              width)
            if isinstance(rows, tuple):  # this rank gave up waiting, and withdrew
                raise RuntimeError(self.message(*rows, what(), timeout))
            return rows
        self._count[0] += 1
        k, words = self._count[0], self._words
        heads = self._heads[k % 2]
        mine = heads[self._rank]
        words[mine + 2 : mine + 2 + len(row)] = array.array("q", row)
        words[mine] = k  # after the row: a peer that reads k reads the row
        start = None
        for h in heads:  # every rank there already (the usual case at the second word): no wait
            if words[h] != k:
                start = self._wait(heads, 0, k, None, timeout, what)
                break
        words[mine + 1] = k  # saw every rank arrive
        for h in heads:
            if words[h + 1] != k:
                self._wait(heads, 1, k, start, timeout, what)
                break
        rows = map(slice, range(heads.start + 2, heads.stop + 2, _SLOT),
                   range(heads.start + 2 + width, heads.stop + 2 + width, _SLOT))  # each rank's row
        return list(map(list, map(words.__getitem__, rows)))  # (by map: no call per rank)

    def _wait(self, heads, word: int, k: int, start: float | None, timeout: float,
              what: Callable[[], str]) -> float | None:
        """Until word ``word`` of every slot reads k; withdraw and raise where a
        rank withdrew, or past ``timeout`` from ``start`` (None: from the first
        poll that does not find every rank there, the clock read only then).
        Returns the start it timed from."""
        words = self._words
        pause = 2e-5
        while True:
            there = True
            for h in heads:  # a loop, not a generator: every call's host path
                if words[h + word] != k:
                    there = False
                    break
            if there:
                return start
            if start is None:
                start = time.monotonic()
            withdrawn = [r for r, h in enumerate(heads) if words[h] == -k]
            waited = time.monotonic() - start
            if withdrawn or waited > timeout:
                words[heads[self._rank]] = -k  # withdrawn: the others stop too, a late rank raises
                if word == 1 and all(words[h + 1] == k for h in heads):  # every rank confirmed meanwhile
                    words[heads[self._rank]] = k
                    return
                missing = [r for r, h in enumerate(heads) if words[h + word] != k and words[h] != -k]
                raise RuntimeError(self.message(missing, withdrawn, what(), timeout))
            if waited < _SPIN:
                os.sched_yield()
            else:
                time.sleep(pause)
                pause = min(2 * pause, 1e-3)

    @staticmethod
    def message(missing: list[int], withdrawn: list[int], what: str, timeout: float) -> str:
        """What a rank that gave up waiting for ``what`` raises."""
        if missing:
            names = ", ".join(f"rank {r}" for r in missing)
            return (f"peer missing: rank(s) {missing} of the group ({names}) did not reach {what}: timed out after "
                    f"{timeout:g} s (DispatchConfig.timeout); a peer died, stalled or stopped calling (one that "
                    "is alive raises at this call when it comes, and the group's next calls pair again)")
        return (f"peer missing: rank(s) {withdrawn} of the group gave up waiting for {what} (DispatchConfig.timeout: "
                f"{timeout:g} s) before every rank arrived; every rank raises at this call, and the group's next "
                "calls pair again")
