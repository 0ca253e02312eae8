"""Per-phase timing of an exchange, for benchmarks and users chasing a bottleneck.

A dispatcher whose ``phase_timer`` is set marks the end of each phase of its
work (``plan``, ``exchange_out``, ``expand``, ``presum``, ``exchange_back``,
``final_sum``). On CUDA the marks are events on the current stream, so timing
adds no host synchronisation inside the exchange; ``phases()`` synchronises once,
when the caller asks for the figures.
"""

from __future__ import annotations

import time

import torch


class PhaseTimer:
    """Collects named phase boundaries and turns them into durations.

    Usage::

        timer = PhaseTimer(device)
        dispatcher.phase_timer = timer
        timer.start()
        out = dispatcher.dispatch(...); y = ...; dispatcher.combine(...)
        timer.phases()   # {"plan": ms, "exchange_out": ms, ...}
    """

    def __init__(self, device: torch.device | str) -> None:
        self.cuda = torch.device(device).type == "cuda"
        self._marks: list[tuple[str, object]] = []

    def _now(self) -> object:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self) -> None:
        """Forget earlier marks and start a new measurement here."""
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        """End ``phase`` now (the phase began at the previous mark)."""
        if self._marks:
            self._marks.append((phase, self._now()))

    def phases(self) -> dict[str, float]:
        """Milliseconds spent in each phase since :meth:`start`; same-named phases add up."""
        if self.cuda and self._marks:
            self._marks[-1][1].synchronize()  # host sync: reading the timings, outside the exchange
        out: dict[str, float] = {}
        for (_, before), (name, after) in zip(self._marks, self._marks[1:]):
            if self.cuda:
                ms = before.elapsed_time(after)
            else:
                ms = (after - before) * 1e3
            out[name] = out.get(name, 0.0) + ms
        return out


def mark(timer: PhaseTimer | None, phase: str) -> None:
    """Mark the end of ``phase`` on ``timer`` if there is one."""
    if timer is not None:
        timer.mark(phase)
