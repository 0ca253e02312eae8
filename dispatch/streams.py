"""Where a dispatcher's exchanges run: the one place that knows about streams.

A transport's movements (``dispatch.transports.base.Transport``) issue an
exchange and return a :class:`Pending` (collectives issued with
``async_op=True``, plus what remains to be done once they are done: decode,
expand, final sum), or a :class:`PendingGroups` of one per group of local
experts. :class:`CommStreams` runs it:

* on CUDA, with ``async_op``, the whole exchange (pack, collectives, unpack) is
  queued on the dispatcher's communication stream (one per device and
  priority), after the work queued on the caller's stream so far; the inputs
  are marked as used by that stream (``record_stream``), and an event marks
  its end. :meth:`Started.result` makes the caller's current stream wait for
  that event (the host never blocks) and marks the result as used there, at
  each call (a work waited for again, on another stream, is ready there too);
* on CPU (gloo), or without ``async_op``, the hook runs on the caller's stream
  and the collectives are left in flight; :meth:`Started.result` waits for them
  and finishes the rest.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from dispatch import partition
from dispatch.cuda import current_stream as _current_stream


def _caller_stream(device: torch.device) -> "torch.cuda.Stream":
    """The current stream of CUDA ``device`` (its index, or the current device's)."""
    return _current_stream(torch.cuda.current_device() if device.index is None else device.index)


@contextlib.contextmanager
def _on(stream: "torch.cuda.Stream"):
    """``torch.cuda.stream(stream)`` for a stream of the current device, without the
    device guards and lookups that context takes each time (several per exchange)."""
    if stream.device_index != torch.cuda.current_device():
        with torch.cuda.stream(stream):
            yield
        return
    before = _current_stream(stream.device_index)
    torch.cuda.set_stream(stream)
    try:
        yield
    finally:
        torch.cuda.set_stream(before)


class Pending:
    """An exchange in flight: ``finish()`` waits for its collective (``work``) and
    runs what remains (``then()``) on the current stream, once. It holds the
    buffers the collective writes until it is finished. It is an exchange in
    one piece too (``PendingGroups``' and, run at once, ``Started``'s and
    ``StartedGroups``' methods: ``groups``, ``finish(0)``, ``whole()``, ``result()``)."""

    groups = 1

    def __init__(self, work, then: Callable[[], torch.Tensor]) -> None:
        self._work, self._then = work, then
        self._result = None

    def finish(self, g: int = 0) -> torch.Tensor:
        if self._then is not None:
            if self._work is not None:
                self._work.wait()
            self._result, self._work, self._then = self._then(), None, None
        return self._result

    whole = result = follow = finish


class Done(Pending):
    """An exchange already made: ``finish()`` returns ``result``."""

    def __init__(self, result: torch.Tensor) -> None:
        self._work = self._then = None
        self._result = result


class PendingGroups:
    """An exchange in flight in G pieces, one per group of local experts:
    ``finish(g)`` waits for the collectives of pieces up to g (``works``, in
    order) and runs what remains of piece g (``thens[g]``), once each."""

    def __init__(self, works: list, thens: list[Callable[[], torch.Tensor]]) -> None:
        self._works, self._thens = list(works), list(thens)
        self._results: list = [None] * len(thens)

    @property
    def groups(self) -> int:
        return len(self._thens)

    def whole(self) -> torch.Tensor:
        """Every piece finished; their results concatenated (one piece: its own)."""
        parts = [self.finish(g) for g in range(self.groups)]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def result(self, g: int | None = None) -> torch.Tensor:
        """``StartedGroups.result`` of pieces run at once (``CommStreams.start_groups``)."""
        return self.whole() if g is None else self.finish(g)

    def follow(self) -> None:
        """Every piece finished (``StartedGroups.follow``)."""
        for g in range(self.groups):
            self.finish(g)

    def finish(self, g: int) -> torch.Tensor:
        if self._thens[g] is not None:
            for earlier in range(g + 1):
                if self._works[earlier] is not None:
                    self._works[earlier].wait()
                    self._works[earlier] = None
            self._results[g], self._thens[g] = self._thens[g](), None
        return self._results[g]


class StartedGroups:
    """An exchange in pieces started by :meth:`CommStreams.start_groups`;
    :meth:`result` of each group, in any order, as often as asked."""

    def __init__(self, pending: PendingGroups, events=None, device=None, keep=None) -> None:
        self._pending, self._events, self._device, self._keep = pending, events, device, keep
        self._unread = set(range(pending.groups))  # groups never asked for: until none, it holds ``keep``

    @property
    def groups(self) -> int:
        return self._pending.groups

    def result(self, g: int | None = None) -> torch.Tensor:
        """Group g's result, ready for the caller's current stream (which waits
        for that piece alone); every group's, concatenated, for None."""
        if g is None:
            parts = [self.result(g) for g in range(self.groups)]
            return parts[0] if len(parts) == 1 else torch.cat(parts)
        out = self._pending.finish(g)
        if self._events is not None:
            _follow(self._events[g], out, self._device)
            self._unread.discard(g)
            if not self._unread:
                self._keep = None
        return out

    def follow(self) -> None:
        """The caller's current stream waits for every piece (again)."""
        for g in range(self.groups):
            self.result(g)


class Started:
    """An exchange started by :meth:`CommStreams.start`. Until its first
    :meth:`result` it holds ``keep`` (what the communication stream reads: the
    start hook with its handle and inputs), so that none of it is freed and
    handed out to the caller's stream while that stream may still read it."""

    def __init__(self, pending: Pending, event: "torch.cuda.Event | None" = None, device=None, keep=None) -> None:
        self._pending, self._event, self._device, self._keep = pending, event, device, keep

    def result(self) -> torch.Tensor:
        """The exchange's result, ready for the caller's current stream (at
        each call: a later one may come from another stream)."""
        out = self._pending.finish()
        if self._event is not None:
            _follow(self._event, out, self._device)
            self._keep = None
        return out

    follow = result


def _follow(event: "torch.cuda.Event", out: torch.Tensor, device: torch.device) -> None:
    """The caller's current stream waits for ``event`` and uses ``out``: made in
    the communication stream's pool, its memory is not handed out again before
    that use (``record_stream``)."""
    stream = _caller_stream(device)
    stream.wait_event(event)
    out.record_stream(stream)


class CommStreams:
    """A dispatcher's communication streams, one per (CUDA device, priority);
    where the caller's stream is an SM partition's, the partition's stand-in for
    one instead (``dispatch.partition``), taken in turn with it."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}
        self._last: dict[tuple[int, int], torch.cuda.Stream] = {}  # the stream each took last

    def start(self, issue: Callable[[], Pending], reads: tuple[torch.Tensor, ...], async_op: bool,
              priority: int) -> "Started | Pending":
        """Run ``issue()`` (a variant's start hook reading ``reads``) for an
        exchange; see the module doc."""
        device = reads[0].device
        if not async_op or device.type != "cuda":
            return issue()  # a Pending: the result where the collectives are done
        caller = _caller_stream(device)
        stream = self.stream(device, priority)
        stream.wait_stream(caller)  # an event: the inputs are made by now
        with _on(stream):
            pending = Done(issue().finish())
            event = torch.cuda.Event()
            event.record(stream)
        for tensor in reads:  # the caller may drop them: their memory waits for this stream
            tensor.record_stream(stream)
        return Started(pending, event, device, keep=(issue, reads))

    def start_groups(self, issue: Callable[[], "PendingGroups | Pending"], reads: tuple[torch.Tensor, ...],
                     async_op: bool, priority: int) -> "StartedGroups | PendingGroups | Pending":
        """:meth:`start` for an exchange in pieces: on CUDA with ``async_op``,
        each piece's end is its own event, so that the caller's stream waits
        for group g's rows alone."""
        device = reads[0].device
        if not async_op or device.type != "cuda":
            return issue()  # a Pending or PendingGroups: each group's result where its collectives are done
        caller = _caller_stream(device)
        stream = self.stream(device, priority)
        stream.wait_stream(caller)
        events = []
        with _on(stream):
            pending = issue()
            for g in range(pending.groups):
                pending.finish(g)
                events.append(torch.cuda.Event())
                events[-1].record(stream)
        for tensor in reads:
            tensor.record_stream(stream)
        return StartedGroups(pending, events, device, keep=(issue, reads))

    def stream(self, device: torch.device, priority: int) -> "torch.cuda.Stream":
        """The communication stream of ``device`` at ``priority`` (made on first
        use), or beside an SM partition's stream its stand-in there; after the one
        taken last at that priority, where they differ."""
        index = torch.cuda.current_device() if device.index is None else device.index
        key = (index, priority)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=index, priority=priority)
        taken = partition.beside(_current_stream(index), self._streams[key])
        self._last[key] = partition.handed_over(self._last.get(key), taken)
        return taken
