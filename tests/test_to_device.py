"""The small host-to-device copies (``plan.to_device``): queued behind the
stream's work without waiting for it, each delivers the values it was given,
however many copies are made meanwhile and whatever becomes of the host
tensors."""

from __future__ import annotations

import pytest
import torch

from dispatch import plan

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
def test_copies_queued_behind_the_stream_keep_their_values():
    device = torch.device("cuda", torch.cuda.current_device())
    copies = 100
    torch.cuda._sleep(50_000_000)  # the stream busy: none of the copies below has run yet
    sent = [torch.arange(i, i + 16, dtype=torch.int64) for i in range(copies)]
    got = [plan.to_device(host, device) for host in sent]
    for host in sent:
        host.fill_(-1)  # the host tensors change: the copies read what they held at the call
    torch.cuda.synchronize()
    for i, out in enumerate(got):
        assert torch.equal(out.cpu(), torch.arange(i, i + 16, dtype=torch.int64))


@needs_cuda
@pytest.mark.parametrize("host", [torch.tensor(True), torch.zeros(0, 3, dtype=torch.int32),
                                  torch.arange(12, dtype=torch.float64).view(3, 4).t(),
                                  torch.arange(4096, dtype=torch.int64)])
def test_dtypes_shapes_and_sizes(host):
    # a scalar, no elements, a transposed view, and a larger tensor
    out = plan.to_device(host, torch.device("cuda"))
    assert out.is_cuda and out.dtype == host.dtype and out.shape == host.shape
    assert torch.equal(out.cpu(), host)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
def test_a_copy_into_a_given_tensor(device):
    """``out=``: the values land in that tensor, which is returned (a replayed
    graph's input buffer takes the host header so)."""
    out = torch.full((4,), -1, dtype=torch.int64, device=device)
    got = plan.to_device(torch.arange(4), torch.device(device), out=out)
    if device == "cuda":
        torch.cuda.synchronize()
    assert got is out and torch.equal(out.cpu(), torch.arange(4))
