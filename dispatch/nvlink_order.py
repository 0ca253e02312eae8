"""The order of the NVLink engine's operations (``dispatch.nvlink``): on the device a
rank runs them in the order issued, whatever streams the caller issues them on.

Each operation runs on the caller's current stream, after the engine's previous
operation: where that ran on another stream, this one waits for the event it
recorded; each records the event for the next. Eager operations follow eager
ones (``Engine._last``: the eager event and the raw handle of the stream it was
last recorded on), and an operation in a CUDA graph capture follows those of its
capture (``Engine._last_captured``: its event, the capture's id, its stream's
handle): a capture may not wait for another's events, and graphs (a layer's
forward and backward captured apart) are ordered by the stream they are
replayed on. :class:`Ordered` does this around an operation issued from Python.

The usual eager operation (a dispatch's counts exchange, a combine's push and
home sum on the compiled host path) follows the engine's latest eager operation
on its stream (:func:`eager_stream` makes it wait where that ran on another).
There the compiled call records the engine's eager event itself, when it
returns or raises (``csrc/host.cpp``), and the host keeps nothing else of the
order: :func:`eager_stream` says where this holds, :func:`ordered_eager` notes
the operation, as :class:`Ordered`'s exit would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dispatch import cuda

if TYPE_CHECKING:
    from dispatch.nvlink import Engine


class Ordered:
    """See :meth:`Engine._ordered` and the module doc. An operation on the stream
    of the one it follows needs no wait (the stream orders them); eager
    operations record one event of the engine's again and again (a wait takes
    the record it follows when it is queued), a captured one an event of its own
    (its graph records it at each replay)."""

    def __init__(self, engine: "Engine", writes: bool) -> None:
        self.engine, self.writes = engine, writes

    def __enter__(self) -> None:
        device = self.engine.device
        self.stream, self.capture = cuda.current_stream(device.index), cuda.capture_id(device)
        self.raw = self.stream.cuda_stream
        if self.capture is None:
            last = self.engine._last
            if last is not None and last[1] != self.raw:
                self.stream.wait_event(last[0])
        else:
            last = self.engine._last_captured
            if last is not None and last[1] == self.capture and last[2] != self.raw:
                self.stream.wait_event(last[0])

    def __exit__(self, *exc) -> bool:
        engine = self.engine
        if self.capture is None:
            event = engine._eager_event
            if event is None:
                event = engine._eager_event = torch.cuda.Event()
        else:
            event = torch.cuda.Event()
            engine._captured = True
        event.record(self.stream)  # the operation's stream and capture: an operation stays on its stream
        if self.capture is None:
            engine._eager_raw = engine._eager_raw or event.cuda_event  # (made by its first record)
            engine._last = (event, self.raw)
        else:
            engine._last_captured = (event, self.capture, self.raw)
        engine.operations += int(self.writes)
        return False


def eager_stream(engine: "Engine") -> int | None:
    """The raw handle of the current stream (0 for the default stream) where
    ``engine``'s next operation may be issued by a compiled call, which records
    its eager event: not in a CUDA graph capture, the engine's device current,
    the eager event made; else None (the operation is issued in
    :class:`Ordered`, which also refuses another current device by name).
    Where the engine's latest eager operation ran on another stream (a layer's
    backward on its communication stream, say), the current stream waits for
    it here, as :class:`Ordered` would make it."""
    if not engine._eager_raw or cuda.capturing() or cuda.current_device() != engine.device.index:
        return None
    raw = cuda.raw_stream(engine.device.index)
    last = engine._last
    if last is not None and last[1] != raw:
        cuda.current_stream(engine.device.index).wait_event(last[0])
    return raw


def ordered_eager(engine: "Engine", raw: int) -> None:
    """Note an operation on stream ``raw`` (:func:`eager_stream`) whose compiled
    call recorded the eager event there, as :class:`Ordered`'s exit does (every
    such operation writes: it is counted in ``operations``)."""
    engine._last = (engine._eager_event, raw)
    engine.operations += 1
