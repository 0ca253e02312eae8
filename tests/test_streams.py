"""Exchanges run on the communication stream (``dispatch.streams``): a result
asked for again, from another stream, is ready on that stream too (the work
objects' later waits, ``ExchangeWork.wait`` here, ask their exchange again)."""

from __future__ import annotations

import pytest
import torch

from dispatch.streams import CommStreams, Done, PendingGroups
from dispatch.work import ExchangeWork

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _slow_piece(src: torch.Tensor, scale: float):
    """Issued on the communication stream: the piece reads -1 until a long sleep
    there ends, then ``src * scale``."""
    out = torch.full_like(src, -1.0)
    torch.cuda._sleep(200_000_000)
    return out.copy_(src * scale)


@needs_cuda
@pytest.mark.parametrize("groups", [1, 2])
def test_a_result_waited_for_again_on_another_stream_is_ready_there(groups):
    src = torch.arange(1 << 18, dtype=torch.float32, device="cuda")
    streams = CommStreams()
    if groups == 1:
        started = streams.start(lambda: Done(_slow_piece(src, 2.0)), (src,), True, 0)
    else:
        started = streams.start_groups(
            lambda: PendingGroups([None] * groups, [lambda g=g: _slow_piece(src, g + 2.0) for g in range(groups)]),
            (src,), True, 0)
    want = torch.cat([src * (g + 2.0) for g in range(groups)])
    work = ExchangeWork(started, groups=groups)
    first = work.wait()  # the current stream waits
    other = torch.cuda.Stream()
    with torch.cuda.stream(other):  # a fresh stream, which only the second wait can hold back
        again = work.wait()
        seen = again.clone()
        piece = (started.result() if groups == 1 else started.result(groups - 1)).clone()
    torch.cuda.synchronize()
    assert again is first
    assert torch.equal(seen, want)
    assert torch.equal(piece, src * (groups + 1.0))
