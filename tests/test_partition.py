"""dispatch.partition's SM partitions against a stand-in driver
(tests/fake_cuda/libcuda.c, a device of 132 SMs split in multiples of 8 as
compute capability 9.0 does): the sizes it gets, refusals that name
``sm_partition``, and no green context left behind where one fails. The
partitions' streams and their bits against shared SMs: tests/test_micro_batches.py
and tests/test_nvshmem.py on GPUs."""

from __future__ import annotations

import ctypes

import pytest
import torch

from dispatch import partition
from dispatch.partition import SMPartition


@pytest.fixture
def green(fake_driver, monkeypatch):
    """The stand-in driver's green contexts, a fresh set of partitions per test."""
    monkeypatch.setattr(partition, "_PARTITIONS", {})
    fake_driver.fake_set_green.argtypes = [ctypes.c_uint, ctypes.c_int]
    fake_driver.fake_set_green(132, -1)
    yield fake_driver
    fake_driver.fake_set_green(132, -1)


@pytest.mark.parametrize("asked, exchange", [(1, 8), (8, 8), (12, 16), (64, 64), (120, 120)])
def test_a_partition_takes_the_sms_asked_rounded_up_and_leaves_the_rest(green, asked, exchange):
    made = SMPartition.of(torch.device("cuda", 0), asked)
    assert (made.exchange_sms, made.compute_sms) == (exchange, 132 - exchange)
    assert SMPartition.of(torch.device("cuda", 0), asked) is made  # once a process
    assert green.fake_green_contexts(0) == 2 and green.fake_green_contexts(1) == 0


@pytest.mark.parametrize("asked", [129, 132, 100_000])
def test_a_partition_that_leaves_no_sms_is_refused_by_name(green, asked):
    with pytest.raises(ValueError, match=rf"sm_partition={asked} leaves no SMs to the rest of cuda:0 \(132 SMs, "
                                         r"taken in multiples of 8\)"):
        SMPartition.of(torch.device("cuda", 0), asked)
    assert green.fake_green_contexts(0) == 0


@pytest.mark.parametrize("fail_at", [0, 1])
def test_a_green_context_that_fails_leaves_none_behind(green, fail_at):
    green.fake_set_green(132, fail_at)
    with pytest.raises(RuntimeError, match=r"sm_partition=8: no SM partition of cuda:0: cuGreenCtxCreate failed"):
        SMPartition.of(torch.device("cuda", 0), 8)
    assert green.fake_green_contexts(1) == green.fake_green_contexts(0) == fail_at
    assert (0, 8) not in partition._PARTITIONS  # not cached: a later call tries again


def test_the_resource_struct_is_the_drivers():
    assert ctypes.sizeof(partition._DevResource) == 144  # CUDA 12.4 to 13's CUdevResource
    assert partition._DevResource.sm.offset == 96 and partition._SmResource.smCoscheduledAlignment.offset == 8


class _Stream:
    """A stream as dispatch.partition sees one: its handle, and the streams it was made to wait for."""

    def __init__(self, handle: int) -> None:
        self.cuda_stream, self.waited = handle, []

    def wait_stream(self, other) -> None:
        self.waited.append(other)


def test_side_streams_follow_the_callers_stream_and_are_handed_over_in_order(monkeypatch):
    class Partition:
        def __init__(self):
            self.stand_ins = {}

        def stand_in(self, plain):
            return self.stand_ins.setdefault(plain.cuda_stream, _Stream(1000 + plain.cuda_stream))

    split = Partition()
    compute, caller, plain = _Stream(5), _Stream(7), _Stream(9)
    monkeypatch.setattr(partition, "_BY_STREAM", {compute.cuda_stream: split})
    assert partition.beside(caller, plain) is plain  # no partition's stream: the side stream itself
    stand_in = partition.beside(compute, plain)
    assert stand_in is split.stand_ins[9] and partition.beside(compute, plain) is stand_in  # one stand-in a stream
    assert partition.handed_over(None, plain) is plain and plain.waited == []
    assert partition.handed_over(plain, plain) is plain and plain.waited == []  # the same stream: no wait
    assert partition.handed_over(plain, stand_in) is stand_in and stand_in.waited == [plain]
    assert partition.handed_over(stand_in, plain) is plain and plain.waited == [stand_in]


def test_a_call_on_a_partition_is_refused_in_a_capture(monkeypatch):
    """Inside a CUDA-graph capture a call with an SM partition is refused by name
    (every rank alike, before any exchange); without a partition, or outside a
    capture, nothing is."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="sm_partition: a call on an SM partition cannot be captured"):
        partition.outside_capture(8)
    partition.outside_capture(None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    partition.outside_capture(8)
