"""Where a dispatcher's exchanges run: the one place that knows about streams.

A variant's ``_*_start`` hooks issue an exchange and return a :class:`Pending`
(collectives issued with ``async_op=True``, plus what remains to be done once
they are done: decode, expand, final sum). :class:`CommStreams` runs it:

* on CUDA, with ``async_op``, the whole exchange (pack, collectives, unpack) is
  queued on the dispatcher's communication stream (one per device and
  priority), after the work queued on the caller's stream so far; the inputs
  are marked as used by that stream (``record_stream``), and an event marks
  its end. :meth:`Started.result` makes the caller's current stream wait for
  that event (the host never blocks) and marks the result as used there;
* on CPU (gloo), or without ``async_op``, the hook runs on the caller's stream
  and the collectives are left in flight; :meth:`Started.result` waits for them
  and finishes the rest.
"""

from __future__ import annotations

from typing import Callable

import torch


class Pending:
    """An exchange in flight: ``finish()`` waits for its collective (``work``) and
    runs what remains (``then()``) on the current stream, once. It holds the
    buffers the collective writes until it is finished."""

    def __init__(self, work, then: Callable[[], torch.Tensor]) -> None:
        self._work, self._then = work, then
        self._result = None

    @classmethod
    def done(cls, result: torch.Tensor) -> "Pending":
        pending = cls(None, None)
        pending._result = result
        return pending

    def finish(self) -> torch.Tensor:
        if self._then is not None:
            if self._work is not None:
                self._work.wait()
            self._result, self._work, self._then = self._then(), None, None
        return self._result


class Started:
    """An exchange started by :meth:`CommStreams.start`; :meth:`result` once.
    Until then it holds ``keep`` (what the communication stream reads: the
    start hook with its handle and inputs), so that none of it is freed and
    handed out to the caller's stream while that stream may still read it."""

    def __init__(self, pending: Pending, event: "torch.cuda.Event | None" = None, device=None, keep=None) -> None:
        self._pending, self._event, self._device, self._keep = pending, event, device, keep

    def result(self) -> torch.Tensor:
        """The exchange's result, ready for the caller's current stream."""
        out = self._pending.finish()
        if self._event is not None:
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(self._event)
            # made in the communication stream's pool, used on the caller's stream:
            # its memory is not handed out again before that use
            out.record_stream(stream)
            self._event = self._keep = None
        return out


class CommStreams:
    """A dispatcher's communication streams, one per (CUDA device, priority)."""

    def __init__(self) -> None:
        self._streams: dict[tuple[int, int], torch.cuda.Stream] = {}

    def start(self, issue: Callable[[], Pending], reads: tuple[torch.Tensor, ...], async_op: bool,
              priority: int) -> Started:
        """Run ``issue()`` (a variant's start hook reading ``reads``) for an
        exchange; see the module doc."""
        device = reads[0].device
        if not async_op or device.type != "cuda":
            return Started(issue())
        caller = torch.cuda.current_stream(device)
        stream = self.stream(device, priority)
        stream.wait_stream(caller)  # an event: the inputs are made by now
        with torch.cuda.stream(stream):
            pending = Pending.done(issue().finish())
            event = torch.cuda.Event()
            event.record(stream)
        for tensor in reads:  # the caller may drop them: their memory waits for this stream
            tensor.record_stream(stream)
        return Started(pending, event, device, keep=(issue, reads))

    def stream(self, device: torch.device, priority: int) -> "torch.cuda.Stream":
        """The communication stream of ``device`` at ``priority`` (made on first use)."""
        index = torch.cuda.current_device() if device.index is None else device.index
        key = (index, priority)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device=index, priority=priority)
        return self._streams[key]
